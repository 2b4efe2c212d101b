//! `nacre bench msgr`: echo RPC round trips through the messenger on loopback, beside a raw baseline
//! (the same echo over plain blocking TCP sockets: no framing, no runtime, no checksums).
//!
//! Both sides of both implementations run in this process. The nacre load runs on the client
//! messenger's worker, next to its connection, as a role's own code would; the server has its own
//! worker. The raw baseline uses one client thread doing write-then-read for one request in flight, and
//! a writer thread plus a reader thread pipelining over one connection for more; its server is one
//! thread echoing bytes back as they come.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use bytes::Bytes;
use nacre_msgr::{Messenger, MsgrConfig, Payload, Router, TcpTransport};
use nacre_proto::msg::sys::{Echo, EchoRequest, EchoResponse};

use super::report::{MsgrRow, percentiles_us};

/// What to measure.
#[derive(Clone, Debug)]
pub struct Params {
    pub sizes: Vec<usize>,
    pub inflight: Vec<usize>,
    pub duration: Duration,
    pub warmup: Duration,
    /// Alternating raw/nacre rounds the measured time is split into.
    pub rounds: usize,
    pub baseline: bool,
    pub server_workers: usize,
    pub client_workers: usize,
    pub conns: usize,
}

/// Runs every (size, inflight) cell, alternating raw and nacre rounds so that each ratio compares
/// measurements interleaved in time on the same machine.
pub fn run(p: &Params, mut on_row: impl FnMut(&MsgrRow)) -> anyhow::Result<Vec<MsgrRow>> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let server_cfg = MsgrConfig {
        workers: p.server_workers,
        ..MsgrConfig::default()
    };
    let client_cfg = MsgrConfig {
        workers: p.client_workers,
        conns_per_peer: p.conns,
        ..MsgrConfig::default()
    };
    let server = Messenger::new("bench-srv", server_cfg, Arc::new(TcpTransport))?;
    let client_msgr = Messenger::new("bench-cli", client_cfg, Arc::new(TcpTransport))?;
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let addr = rt.block_on(async {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let listener = TcpTransport::listener(l);
        let addr = listener.local_addr()?;
        let router = Router::new()
            .route::<Echo, _, _>(|_req, inc| async move { Ok((EchoResponse {}, inc.data)) });
        rt.spawn(server.serve(listener, Arc::new(router), async {
            let _ = stop_rx.await;
        }));
        anyhow::Ok(addr)
    })?;
    let raw = if p.baseline {
        Some(RawServer::start()?)
    } else {
        None
    };

    let mut rows = Vec::new();
    for &size in &p.sizes {
        for &inflight in &p.inflight {
            let cell = format!("size {size}, inflight {inflight}");
            let payload = echo_payload(size);
            let client = client_msgr.client();
            // Warm up both (connect, grow buffers), then alternate short rounds so that a change in
            // the machine's load affects both implementations alike.
            let round = p.duration.div_f64(p.rounds as f64);
            let nacre = |d| {
                rt.block_on(run_load(
                    &client_msgr,
                    &client,
                    &addr,
                    &payload,
                    inflight,
                    d,
                ))
                .with_context(|| format!("nacre, {cell}"))
            };
            let baseline = |raw: &RawServer, d| {
                raw_measure(raw.addr, size, inflight, d)
                    .with_context(|| format!("raw baseline, {cell}"))
            };
            let mut raw_total: Option<Sample> = raw.as_ref().map(|_| Sample::default());
            let mut nacre_total = Sample::default();
            if let Some(raw) = &raw {
                baseline(raw, p.warmup)?;
            }
            nacre(p.warmup)?;
            for _ in 0..p.rounds {
                if let (Some(raw), Some(total)) = (&raw, raw_total.as_mut()) {
                    total.add(baseline(raw, round)?);
                }
                nacre_total.add(nacre(round)?);
            }
            let base = raw_total.map(|mut t| {
                let r = row("raw-tcp", size, inflight, t.secs, &mut t.lat);
                on_row(&r);
                let ops = r.ops_per_s;
                rows.push(r);
                ops
            });
            let mut r = row(
                "nacre",
                size,
                inflight,
                nacre_total.secs,
                &mut nacre_total.lat,
            );
            r.vs_baseline = base.map(|b| r.ops_per_s / b);
            on_row(&r);
            rows.push(r);
        }
    }
    let _ = stop_tx.send(());
    drop(rt);
    client_msgr.shutdown();
    server.shutdown();
    Ok(rows)
}

/// The echo payload. Its CRC is computed once, as the data path does with the block CRCs it keeps;
/// every receiver still verifies every byte.
fn echo_payload(size: usize) -> Payload {
    let p = Payload::new(Bytes::from(vec![0xa5u8; size]));
    let crc = p.crc();
    Payload::with_crc(p.bytes, crc)
}

/// Elapsed seconds and per-operation latencies (ns) of one or more measurement rounds.
#[derive(Debug, Default)]
struct Sample {
    secs: f64,
    lat: Vec<u64>,
}

impl Sample {
    fn add(&mut self, (secs, lat): (f64, Vec<u64>)) {
        self.secs += secs;
        self.lat.extend(lat);
    }
}

/// Runs `inflight` closed loops on the client's first worker for `dur`; returns elapsed seconds and
/// per-call latencies in nanoseconds.
async fn run_load(
    msgr: &Messenger,
    client: &nacre_msgr::Client,
    addr: &str,
    data: &Payload,
    inflight: usize,
    dur: Duration,
) -> anyhow::Result<(f64, Vec<u64>)> {
    let (client, addr, data) = (client.clone(), addr.to_string(), data.clone());
    let size = data.len();
    let load = msgr.workers().get(0).spawn(async move {
        let start = Instant::now();
        let end = start + dur;
        let mut loops = tokio::task::JoinSet::new();
        for _ in 0..inflight {
            let (client, addr, data) = (client.clone(), addr.clone(), data.clone());
            loops.spawn(async move {
                let mut lat = Vec::with_capacity(4096);
                loop {
                    let t = Instant::now();
                    if t >= end {
                        break;
                    }
                    let (_, got) = client
                        .call::<Echo>(&addr, &EchoRequest {}, data.clone())
                        .await?;
                    anyhow::ensure!(got.len() == size, "echo returned {} bytes", got.len());
                    lat.push(t.elapsed().as_nanos() as u64);
                }
                anyhow::Ok(lat)
            });
        }
        let mut all = Vec::new();
        while let Some(r) = loops.join_next().await {
            all.extend(r??);
        }
        anyhow::Ok((start.elapsed().as_secs_f64(), all))
    });
    load.await?
}

fn row(implementation: &str, size: usize, inflight: usize, secs: f64, lat: &mut [u64]) -> MsgrRow {
    let ops = lat.len() as u64;
    let ops_per_s = ops as f64 / secs;
    let pct = percentiles_us(lat, &[50.0, 99.0]);
    MsgrRow {
        bench: "msgr",
        implementation: implementation.to_string(),
        size,
        inflight,
        ops,
        secs,
        ops_per_s,
        // Payload bytes moved per second in each direction.
        mib_per_s: ops_per_s * size as f64 / (1 << 20) as f64,
        p50_us: pct[0],
        p99_us: pct[1],
        vs_baseline: None,
    }
}

/// A blocking echo server: one thread per connection writing back whatever it reads.
struct RawServer {
    addr: std::net::SocketAddr,
}

impl RawServer {
    fn start() -> anyhow::Result<Self> {
        let l = TcpListener::bind("127.0.0.1:0")?;
        let addr = l.local_addr()?;
        thread::Builder::new()
            .name("raw-accept".into())
            .spawn(move || {
                for s in l.incoming() {
                    let Ok(mut s) = s else { continue };
                    let _ = thread::Builder::new()
                        .name("raw-echo".into())
                        .spawn(move || {
                            let _ = s.set_nodelay(true);
                            let mut buf = vec![0u8; 1 << 20];
                            loop {
                                match s.read(&mut buf) {
                                    Ok(0) | Err(_) => return,
                                    Ok(n) => {
                                        if s.write_all(&buf[..n]).is_err() {
                                            return;
                                        }
                                    }
                                }
                            }
                        });
                }
            })?;
        // The accept thread lives until the process exits; each connection thread ends when the
        // client closes its socket.
        Ok(Self { addr })
    }
}

fn raw_measure(
    addr: std::net::SocketAddr,
    size: usize,
    inflight: usize,
    dur: Duration,
) -> anyhow::Result<(f64, Vec<u64>)> {
    if inflight <= 1 {
        raw_ping_pong(addr, size, dur)
    } else {
        raw_pipelined(addr, size, inflight, dur)
    }
}

fn raw_ping_pong(
    addr: std::net::SocketAddr,
    size: usize,
    dur: Duration,
) -> anyhow::Result<(f64, Vec<u64>)> {
    let mut s = TcpStream::connect(addr)?;
    s.set_nodelay(true)?;
    let out = vec![0xa5u8; size];
    let mut back = vec![0u8; size];
    let mut lat = Vec::new();
    let start = Instant::now();
    loop {
        let t = Instant::now();
        if t >= start + dur {
            break;
        }
        s.write_all(&out)?;
        s.read_exact(&mut back)?;
        lat.push(t.elapsed().as_nanos() as u64);
    }
    Ok((start.elapsed().as_secs_f64(), lat))
}

fn raw_pipelined(
    addr: std::net::SocketAddr,
    size: usize,
    inflight: usize,
    dur: Duration,
) -> anyhow::Result<(f64, Vec<u64>)> {
    let s = TcpStream::connect(addr)?;
    s.set_nodelay(true)?;
    let mut rd = s.try_clone()?;
    let mut wr = s;
    // `tokens` bounds the messages in flight; `sent` carries send times to the reader in order.
    let (token_tx, token_rx) = mpsc::sync_channel::<()>(inflight);
    for _ in 0..inflight {
        token_tx.send(())?;
    }
    let (sent_tx, sent_rx) = mpsc::channel::<Option<Instant>>();
    let start = Instant::now();
    let end = start + dur;
    let writer = thread::spawn(move || -> std::io::Result<()> {
        let out = vec![0xa5u8; size];
        while token_rx.recv().is_ok() {
            let t = Instant::now();
            if t >= end {
                break;
            }
            wr.write_all(&out)?;
            if sent_tx.send(Some(t)).is_err() {
                break;
            }
        }
        let _ = sent_tx.send(None);
        Ok(())
    });
    let mut back = vec![0u8; size];
    let mut lat = Vec::new();
    while let Ok(Some(t)) = sent_rx.recv() {
        rd.read_exact(&mut back)?;
        lat.push(t.elapsed().as_nanos() as u64);
        let _ = token_tx.try_send(());
    }
    let secs = start.elapsed().as_secs_f64();
    drop(token_tx);
    writer
        .join()
        .map_err(|_| anyhow::anyhow!("raw writer thread panicked"))??;
    Ok((secs, lat))
}
