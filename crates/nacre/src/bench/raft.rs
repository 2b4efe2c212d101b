//! `nacre bench raft`: three raft stores in this process (each with its own messenger on loopback
//! TCP and its own raft-engine log in a temporary directory), hosting 1 or many groups.
//!
//! It measures proposals per second and commit latency (propose on the leader until applied there)
//! with closed-loop clients spread over the groups, and the cost of idle groups: process CPU while
//! every group hibernates, and resident memory per group replica.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use nacre_msgr::{Messenger, MsgrConfig, TcpTransport};
use nacre_raft::store::start;
use nacre_raft::{
    EngineLogStore, GroupId, LogStore, RaftError, RaftHandle, RestoreError, StateMachine,
    StoreConfig,
};
use serde::Serialize;

use super::report::percentiles_us;

/// Applies nothing: the benchmark measures replication, not a state machine.
#[derive(Debug, Default)]
struct Null {
    applied: u64,
}

impl StateMachine for Null {
    fn apply(&mut self, index: u64, _command: &[u8]) -> Vec<u8> {
        self.applied = index;
        Vec::new()
    }

    fn snapshot(&self) -> Vec<u8> {
        self.applied.to_le_bytes().to_vec()
    }

    fn restore(&mut self, snapshot: &[u8]) -> Result<(), RestoreError> {
        let raw: [u8; 8] = snapshot
            .try_into()
            .map_err(|_| RestoreError::Decode("bad snapshot".into()))?;
        self.applied = u64::from_le_bytes(raw);
        Ok(())
    }
}

#[derive(Clone, Debug)]
pub struct Params {
    pub groups: Vec<usize>,
    pub sizes: Vec<usize>,
    pub inflight: usize,
    pub duration: Duration,
    pub idle: Duration,
}

#[derive(Clone, Debug, Serialize)]
pub struct RaftRow {
    pub bench: &'static str,
    #[serde(rename = "impl")]
    pub implementation: &'static str,
    pub groups: usize,
    pub replicas: usize,
    pub size: usize,
    pub inflight: usize,
    pub ops_per_s: f64,
    pub p50_us: f64,
    pub p99_us: f64,
    /// Process CPU while every group hibernates, in percent of one core.
    pub idle_cpu_pct: f64,
    /// Resident memory added per group replica once the groups exist.
    pub bytes_per_group_replica: f64,
}

struct Cluster {
    handles: BTreeMap<u64, RaftHandle<Null>>,
    msgrs: Vec<Messenger>,
    stops: Vec<tokio::sync::oneshot::Sender<()>>,
    _dir: tempfile::TempDir,
}

async fn cluster(config: &StoreConfig) -> anyhow::Result<Cluster> {
    let dir = tempfile::tempdir()?;
    let mut listeners = BTreeMap::new();
    let mut msgrs = BTreeMap::new();
    for id in 1..=3u64 {
        let cfg = MsgrConfig {
            workers: 1,
            ..MsgrConfig::default()
        };
        let m = Messenger::new(&format!("raft{id}"), cfg, Arc::new(TcpTransport))?;
        let l = TcpTransport::listener(tokio::net::TcpListener::bind("127.0.0.1:0").await?);
        listeners.insert(id, l);
        msgrs.insert(id, m);
    }
    let addrs: BTreeMap<u64, String> = listeners
        .iter()
        .map(|(id, l)| Ok((*id, l.local_addr()?)))
        .collect::<std::io::Result<_>>()?;
    let mut c = Cluster {
        handles: BTreeMap::new(),
        msgrs: Vec::new(),
        stops: Vec::new(),
        _dir: dir,
    };
    for (id, l) in listeners {
        let m = msgrs.remove(&id).context("messenger")?;
        let peers = addrs
            .iter()
            .filter(|(p, _)| **p != id)
            .map(|(p, a)| (*p, a.clone()))
            .collect();
        let log: Arc<dyn LogStore> = Arc::new(EngineLogStore::open(
            &c._dir.path().join(format!("node{id}")),
        )?);
        let handle = start::<Null>(id, config.clone(), log, peers, m.client())?;
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        tokio::spawn(m.serve(l, Arc::new(handle.router()), async {
            let _ = stopped.await;
        }));
        c.handles.insert(id, handle);
        c.msgrs.push(m);
        c.stops.push(stop);
    }
    Ok(c)
}

impl Cluster {
    async fn stop(self) {
        for s in self.stops {
            let _ = s.send(());
        }
        drop(self.handles);
        for m in self.msgrs {
            let _ = tokio::task::spawn_blocking(move || m.shutdown()).await;
        }
    }
}

/// Proposes on the leader of `group`, following hints; `leaders` caches them.
async fn propose(
    c: &Cluster,
    leaders: &mut BTreeMap<GroupId, u64>,
    group: GroupId,
    cmd: Vec<u8>,
    deadline: Instant,
) -> anyhow::Result<()> {
    let mut target = leaders.get(&group).copied().unwrap_or(1);
    loop {
        match c.handles[&target].propose(group, cmd.clone()).await {
            Ok(_) => {
                leaders.insert(group, target);
                return Ok(());
            }
            Err(e @ (RaftError::NotLeader { .. } | RaftError::Dropped(_)))
                if Instant::now() < deadline =>
            {
                let leader = match e {
                    RaftError::NotLeader { leader, .. } => leader,
                    _ => 0,
                };
                target = if leader_known(c, leader) {
                    leader
                } else {
                    target % 3 + 1
                };
                // No leader yet: give the election a tick.
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            Err(e) => return Err(e).context(format!("proposal to group {group}")),
        }
    }
}

fn leader_known(c: &Cluster, leader: u64) -> bool {
    leader != 0 && c.handles.contains_key(&leader)
}

fn cpu_seconds() -> f64 {
    // utime + stime of this process, in clock ticks (fields 14 and 15 of /proc/self/stat).
    let Ok(stat) = std::fs::read_to_string("/proc/self/stat") else {
        return 0.0;
    };
    let after = stat.rsplit(')').next().unwrap_or("");
    let f: Vec<&str> = after.split_whitespace().collect();
    let ticks = |i: usize| f.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
    (ticks(11) + ticks(12)) / 100.0
}

fn rss_bytes() -> f64 {
    let Ok(statm) = std::fs::read_to_string("/proc/self/statm") else {
        return 0.0;
    };
    let pages: f64 = statm
        .split_whitespace()
        .nth(1)
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0);
    pages * 4096.0
}

pub async fn run(p: &Params, mut on_row: impl FnMut(&RaftRow)) -> anyhow::Result<Vec<RaftRow>> {
    let mut rows = Vec::new();
    for &groups in &p.groups {
        let config = StoreConfig::default();
        let c = cluster(&config).await?;
        let rss_before = rss_bytes();
        let ids: Vec<GroupId> = (1..=groups as u64).collect();
        for h in c.handles.values() {
            for &g in &ids {
                h.add_group(g, &[1, 2, 3], Null::default()).await?;
            }
        }
        // Elect every group (one proposal each), then let them fall asleep.
        let mut leaders = BTreeMap::new();
        let deadline = Instant::now() + Duration::from_secs(120);
        for &g in &ids {
            propose(&c, &mut leaders, g, vec![0], deadline).await?;
        }
        let bytes_per_group = (rss_bytes() - rss_before) / (3.0 * groups as f64);
        let asleep_by = Instant::now() + Duration::from_secs(60);
        loop {
            let mut all = true;
            for h in c.handles.values() {
                all &= h.status().await?.hibernating == groups;
            }
            if all || Instant::now() > asleep_by {
                break;
            }
            tokio::time::sleep(config.tick_interval).await;
        }
        let (cpu0, t0) = (cpu_seconds(), Instant::now());
        tokio::time::sleep(p.idle).await;
        let idle_cpu_pct = (cpu_seconds() - cpu0) / t0.elapsed().as_secs_f64() * 100.0;

        for &size in &p.sizes {
            let payload = vec![0x42u8; size];
            let end = Instant::now() + p.duration;
            let mut tasks = tokio::task::JoinSet::new();
            let shared = Arc::new(c.handles.clone());
            for w in 0..p.inflight {
                let handles = Arc::clone(&shared);
                let payload = payload.clone();
                let mut mine: BTreeMap<GroupId, u64> = leaders.clone();
                let ids = ids.clone();
                tasks.spawn(async move {
                    let mut lat = Vec::new();
                    let mut i = w;
                    while Instant::now() < end {
                        let g = ids[i % ids.len()];
                        i += 1;
                        let mut target = mine.get(&g).copied().unwrap_or(1);
                        let t = Instant::now();
                        loop {
                            match handles[&target].propose(g, payload.clone()).await {
                                Ok(_) => break,
                                Err(RaftError::NotLeader { leader, .. })
                                    if leader != 0 && handles.contains_key(&leader) =>
                                {
                                    target = leader;
                                }
                                Err(e) => return Err(anyhow::anyhow!("group {g}: {e}")),
                            }
                        }
                        mine.insert(g, target);
                        lat.push(t.elapsed().as_nanos() as u64);
                    }
                    anyhow::Ok(lat)
                });
            }
            let start = Instant::now();
            let mut lat = Vec::new();
            while let Some(r) = tasks.join_next().await {
                lat.extend(r??);
            }
            let secs = start.elapsed().as_secs_f64();
            let ops = lat.len() as f64;
            let pct = percentiles_us(&mut lat, &[50.0, 99.0]);
            let row = RaftRow {
                bench: "raft",
                implementation: "nacre",
                groups,
                replicas: 3,
                size,
                inflight: p.inflight,
                ops_per_s: ops / secs,
                p50_us: pct[0],
                p99_us: pct[1],
                idle_cpu_pct,
                bytes_per_group_replica: bytes_per_group,
            };
            on_row(&row);
            rows.push(row);
        }
        c.stop().await;
    }
    Ok(rows)
}

pub fn print_table(rows: &[RaftRow]) {
    use comfy_table::{Cell, CellAlignment, Table, presets::UTF8_FULL_CONDENSED};
    let mut t = Table::new();
    t.load_preset(UTF8_FULL_CONDENSED);
    t.set_header([
        "groups",
        "size",
        "inflight",
        "ops/s",
        "p50 µs",
        "p99 µs",
        "idle CPU %",
        "B/group replica",
    ]);
    for r in rows {
        let right = |s: String| Cell::new(s).set_alignment(CellAlignment::Right);
        t.add_row(vec![
            right(r.groups.to_string()),
            right(super::report::human_size(r.size)),
            right(r.inflight.to_string()),
            right(format!("{:.0}", r.ops_per_s)),
            right(format!("{:.0}", r.p50_us)),
            right(format!("{:.0}", r.p99_us)),
            right(format!("{:.2}", r.idle_cpu_pct)),
            right(format!("{:.0}", r.bytes_per_group_replica)),
        ]);
    }
    println!("{t}");
}
