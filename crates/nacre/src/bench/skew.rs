//! `nacre bench msgr --skew`: the connection balancer's experiment (Song et al.). A server messenger
//! with two workers serves eight client connections:
//!
//! - **skewed**: two heavy connections (64 requests in flight each) and six light ones (one in
//!   flight), the heavy ones both on server worker 0 at the start;
//! - **uniform**: eight connections with 16 in flight each, spread evenly.
//!
//! Each request carries `size` bytes and is answered with an empty reply, as a replicated write
//! is. Every (size, load) cell runs each messenger mode in turn on fresh messengers: `static`
//! (connections never move, Ceph's behaviour), `balanced` (the balancer on), `balanced+dual`
//! (balancer and dual workers), `bundles` (static server; each client's calls over a bundle of
//! two connections). Reported: ops/s, p50/p99 over all calls, p99 of the light
//! connections, the standard deviation of the server workers' busy fraction sampled every 100 ms
//! (the seed's figure), migrations and their pauses.
//!
//! The client side is the load generator, not the system under test: its connections are spread
//! over its workers and never move, and each connection's callers run on that connection's worker.

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use nacre_msgr::{
    BalanceConfig, BalanceKind, CallOptions, Client, Messenger, MsgrConfig, Payload, Reply,
    Request, TcpTransport,
};
use nacre_proto::Op;
use nacre_proto::msg::RemoteError;
use serde::Serialize;

use super::report::percentiles_us;

/// The op the load sends: any number the server answers.
const WRITE: Op = Op(0x0f01);

/// What to measure.
#[derive(Clone, Debug)]
pub struct Params {
    pub sizes: Vec<usize>,
    pub modes: Vec<Mode>,
    pub loads: Vec<Load>,
    pub duration: Duration,
    pub warmup: Duration,
    pub interval: Duration,
    pub threshold: f64,
    /// Rounds the measured time of a cell is split into, the modes alternating within each, so
    /// that a drift in the machine's speed affects every mode alike.
    pub rounds: usize,
}

/// How the server's messenger runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    Static,
    Balanced,
    BalancedDual,
    /// Static server; each client sends its calls over a bundle of two connections.
    Bundles,
}

impl Mode {
    pub fn name(self) -> &'static str {
        match self {
            Self::Static => "static",
            Self::Balanced => "balanced",
            Self::BalancedDual => "balanced+dual",
            Self::Bundles => "bundles",
        }
    }

    pub fn parse(s: &str) -> Result<Self, String> {
        match s {
            "static" => Ok(Self::Static),
            "balanced" => Ok(Self::Balanced),
            "balanced+dual" => Ok(Self::BalancedDual),
            "bundles" => Ok(Self::Bundles),
            o => Err(format!(
                "unknown mode {o:?} (expected static, balanced, balanced+dual or bundles)"
            )),
        }
    }
}

/// The shape of the offered load.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Load {
    Skewed,
    Uniform,
}

impl Load {
    pub fn name(self) -> &'static str {
        match self {
            Self::Skewed => "skewed",
            Self::Uniform => "uniform",
        }
    }

    pub fn parse(s: &str) -> Result<Self, String> {
        match s {
            "skewed" => Ok(Self::Skewed),
            "uniform" => Ok(Self::Uniform),
            o => Err(format!("unknown load {o:?} (expected skewed or uniform)")),
        }
    }

    /// Requests in flight per connection, and the server worker each starts on.
    fn conns(self) -> Vec<(usize, usize)> {
        match self {
            Self::Skewed => {
                let mut c = vec![(64, 0), (64, 0)];
                c.extend((0..6).map(|i| (1, i % 2)));
                c
            }
            Self::Uniform => (0..8).map(|i| (16, i % 2)).collect(),
        }
    }
}

/// One measured (size, load, mode).
#[derive(Clone, Debug, Serialize)]
pub struct SkewRow {
    pub bench: &'static str,
    #[serde(rename = "impl")]
    pub implementation: &'static str,
    pub load: &'static str,
    pub size: usize,
    pub conns: usize,
    pub ops: u64,
    pub secs: f64,
    pub ops_per_s: f64,
    pub mib_per_s: f64,
    pub p50_us: f64,
    pub p99_us: f64,
    /// p99 of the depth-1 connections (skewed load only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub light_p99_us: Option<f64>,
    /// Mean over 100 ms samples of the standard deviation of the server workers' busy fraction,
    /// in percentage points.
    pub worker_spread_pct: f64,
    /// The samples behind `worker_spread_pct`, in time order (round after round): the spread of
    /// worker load over time.
    pub worker_spread_samples_pct: Vec<f64>,
    /// Server connections moved during the measured time (and the warm-up before it).
    pub migrations: u64,
    /// p99 of the time a moving connection was not served.
    pub migration_pause_p99_us: f64,
    /// ops/s relative to `static` on the same (size, load) in this run.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub vs_static: Option<f64>,
}

/// Runs every cell; `on_row` sees each row as it is measured.
pub fn run(p: &Params, mut on_row: impl FnMut(&SkewRow)) -> anyhow::Result<Vec<SkewRow>> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let mut rows = Vec::new();
    let round = p.duration.div_f64(p.rounds.max(1) as f64);
    for &size in &p.sizes {
        for &load in &p.loads {
            let mut totals: Vec<Sample> = p.modes.iter().map(|_| Sample::default()).collect();
            for _ in 0..p.rounds.max(1) {
                for (&mode, total) in p.modes.iter().zip(&mut totals) {
                    total.add(rt.block_on(cell(p, round, size, load, mode))?);
                }
            }
            let mut base = None;
            for (&mode, total) in p.modes.iter().zip(totals) {
                let mut r = total.row(mode, load, size);
                if mode == Mode::Static {
                    base = Some(r.ops_per_s);
                } else if let Some(b) = base {
                    r.vs_static = Some(r.ops_per_s / b);
                }
                on_row(&r);
                rows.push(r);
            }
        }
    }
    Ok(rows)
}

/// What one or more rounds of a mode measured.
#[derive(Debug, Default)]
struct Sample {
    secs: f64,
    conns: usize,
    /// Call latencies (ns): all, and those of the light connections.
    lat: Vec<u64>,
    light: Vec<u64>,
    /// Standard deviations of the server workers' busy fraction (percentage points).
    spreads: Vec<f64>,
    migrations: u64,
    /// Migration pauses (ns).
    pauses: Vec<u64>,
}

impl Sample {
    fn add(&mut self, o: Sample) {
        self.secs += o.secs;
        self.conns = o.conns;
        self.lat.extend(o.lat);
        self.light.extend(o.light);
        self.spreads.extend(o.spreads);
        self.migrations += o.migrations;
        self.pauses.extend(o.pauses);
    }

    fn row(mut self, mode: Mode, load: Load, size: usize) -> SkewRow {
        let ops = self.lat.len() as u64;
        let ops_per_s = ops as f64 / self.secs.max(1e-9);
        let pct = percentiles_us(&mut self.lat, &[50.0, 99.0]);
        SkewRow {
            bench: "msgr-skew",
            implementation: mode.name(),
            load: load.name(),
            size,
            conns: self.conns,
            ops,
            secs: self.secs,
            ops_per_s,
            mib_per_s: ops_per_s * size as f64 / (1 << 20) as f64,
            p50_us: pct[0],
            p99_us: pct[1],
            light_p99_us: (!self.light.is_empty())
                .then(|| percentiles_us(&mut self.light, &[99.0])[0]),
            worker_spread_pct: if self.spreads.is_empty() {
                0.0
            } else {
                self.spreads.iter().sum::<f64>() / self.spreads.len() as f64
            },
            worker_spread_samples_pct: self
                .spreads
                .iter()
                .map(|v| (v * 10.0).round() / 10.0)
                .collect(),
            migrations: self.migrations,
            migration_pause_p99_us: percentiles_us(&mut self.pauses, &[99.0])[0],
            vs_static: None,
        }
    }
}

fn server_config(p: &Params, mode: Mode) -> MsgrConfig {
    let balance = match mode {
        Mode::Static | Mode::Bundles => BalanceConfig::default(),
        Mode::Balanced | Mode::BalancedDual => BalanceConfig {
            policy: BalanceKind::Busy,
            interval: p.interval,
            threshold: p.threshold,
            ..BalanceConfig::default()
        },
    };
    MsgrConfig {
        workers: 2,
        balance,
        dual: mode == Mode::BalancedDual,
        ..MsgrConfig::default()
    }
}

fn sink(req: Request) -> nacre_msgr::BoxFuture<'static, Result<Reply, RemoteError>> {
    // The data's CRC was checked on receipt; the write is acknowledged with an empty reply.
    drop(req);
    Box::pin(async { Ok(Reply::default()) })
}

async fn cell(
    p: &Params,
    duration: Duration,
    size: usize,
    load: Load,
    mode: Mode,
) -> anyhow::Result<Sample> {
    let server = Messenger::new("skew-srv", server_config(p, mode), Arc::new(TcpTransport))?;
    let client_msgr = Messenger::new(
        "skew-cli",
        MsgrConfig {
            workers: 2,
            bundle_conns: if mode == Mode::Bundles { 2 } else { 1 },
            ..MsgrConfig::default()
        },
        Arc::new(TcpTransport),
    )?;
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let listener = TcpTransport::listener(l);
    let addr = listener.local_addr()?;
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let serving = tokio::spawn(server.serve(listener, Arc::new(sink), async {
        let _ = stop_rx.await;
    }));
    let opts = CallOptions {
        bundled: mode == Mode::Bundles,
        ..CallOptions::default()
    };
    let result = measure(
        (p.warmup, duration),
        size,
        load,
        opts,
        &server,
        &client_msgr,
        &addr,
    )
    .await;
    let _ = stop_tx.send(());
    let _ = serving.await;
    tokio::task::spawn_blocking(move || {
        client_msgr.shutdown();
        server.shutdown();
    })
    .await?;
    result
}

/// A connection of the load: its client, where it runs, and how many calls it keeps in flight.
struct Conn {
    client: Client,
    client_worker: usize,
    depth: usize,
}

/// `(warmup, duration)`: the time before measuring and the measured time.
async fn measure(
    (warmup, duration): (Duration, Duration),
    size: usize,
    load: Load,
    opts: CallOptions,
    server: &Messenger,
    client_msgr: &Messenger,
    addr: &str,
) -> anyhow::Result<Sample> {
    let payload = {
        let pl = Payload::new(Bytes::from(vec![0xa5u8; size]));
        let crc = pl.crc();
        Payload::with_crc(pl.bytes, crc)
    };
    // Opens the connections one at a time, and puts each server side on its starting worker.
    let mut conns = Vec::new();
    for (i, (depth, worker)) in load.conns().into_iter().enumerate() {
        let client = client_msgr.client();
        let before: Vec<u64> = server.connections().iter().map(|c| c.id).collect();
        client
            .call_raw(addr, WRITE, Bytes::new(), Payload::none(), opts)
            .await?;
        let fresh = server
            .connections()
            .into_iter()
            .find(|c| !before.contains(&c.id))
            .ok_or_else(|| anyhow::anyhow!("the server has no record of connection {i}"))?;
        if fresh.worker != worker {
            anyhow::ensure!(
                server.migrate(fresh.id, worker),
                "cannot place connection {i}"
            );
        }
        let mine = client_msgr
            .connections()
            .into_iter()
            .max_by_key(|c| c.id)
            .ok_or_else(|| anyhow::anyhow!("the client has no connection {i}"))?;
        // Heavy client connections on different client workers: the load generator must not be
        // the skew under test.
        let client_worker = i % 2;
        if mine.worker != client_worker {
            client_msgr.migrate(mine.id, client_worker);
        }
        conns.push(Conn {
            client,
            client_worker,
            depth,
        });
    }
    let migrations_before = server.migrations();
    let placements = server.recent_migration_pauses().len();
    let warm_end = Instant::now() + warmup;
    let end = warm_end + duration;
    let mut loops = Vec::new();
    for (i, c) in conns.iter().enumerate() {
        for _ in 0..c.depth {
            let (client, addr, data) = (c.client.clone(), addr.to_string(), payload.clone());
            let light = load == Load::Skewed && c.depth == 1;
            loops.push((
                i,
                light,
                client_msgr
                    .workers()
                    .get(c.client_worker)
                    .spawn(async move {
                        let mut lat = Vec::with_capacity(1 << 14);
                        loop {
                            let t = Instant::now();
                            if t >= end {
                                break;
                            }
                            client
                                .call_raw(&addr, WRITE, Bytes::new(), data.clone(), opts)
                                .await?;
                            if t >= warm_end {
                                lat.push(t.elapsed().as_nanos() as u64);
                            }
                        }
                        anyhow::Ok(lat)
                    }),
            ));
        }
    }
    // Samples the server workers' busy time every 100 ms of the measured period.
    tokio::time::sleep_until(warm_end.into()).await;
    let mut spreads = Vec::new();
    let mut prev = (Instant::now(), server.workers().busy());
    while Instant::now() + Duration::from_millis(100) <= end {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let now = (Instant::now(), server.workers().busy());
        let secs = now.0.duration_since(prev.0).as_secs_f64();
        let fractions: Vec<u64> = now
            .1
            .iter()
            .zip(&prev.1)
            .map(|(a, b)| (a.saturating_sub(*b).as_secs_f64() / secs * 1e4) as u64)
            .collect();
        spreads.push(nacre_msgr::spread(&fractions) / 100.0);
        prev = now;
    }
    let mut all = Vec::new();
    let mut light = Vec::new();
    for (_, is_light, h) in loops {
        let lat = h.await??;
        if is_light {
            light.extend_from_slice(&lat);
        }
        all.extend(lat);
    }
    Ok(Sample {
        secs: duration.as_secs_f64(),
        conns: conns.len(),
        lat: all,
        light,
        spreads,
        migrations: server.migrations() - migrations_before,
        pauses: server
            .recent_migration_pauses()
            .iter()
            .skip(placements)
            .map(|d| d.as_nanos() as u64)
            .collect(),
    })
}
