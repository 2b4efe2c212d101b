//! The connection balancer: every interval it measures each worker's load and moves live
//! connections from the busiest worker to the least busy one when the spread is too wide.
//!
//! The decision is a pure function ([`plan`]) of per-worker and per-connection load over the last
//! interval; the [`Balancer`] thread samples the counters, asks [`plan`], and sends each chosen
//! connection a migrate message. The connection's driver moves itself at its next poll (see
//! `conn.rs`), so a migration loses, duplicates and reorders nothing.
//!
//! Spread is the standard deviation of the workers' loads; the balancer acts when it exceeds
//! `threshold` × the busiest worker's load (Song et al.'s heuristic), and stops moving once it does
//! not. A connection is worth moving when its load is below the gap between the busiest and least
//! busy worker (otherwise the move only swaps their roles); of those, it takes the one that brings
//! the two closest together.

use std::collections::HashMap;
use std::fmt;
use std::str::FromStr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::thread;
use std::time::Duration;

use nacre_types::sync::lock;
use tokio::sync::mpsc::WeakUnboundedSender;

use crate::Shared;
use crate::conn::Outgoing;

/// What the balancer measures as load.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum BalanceKind {
    /// Connections stay on the worker they were assigned (Ceph's behaviour).
    #[default]
    Off,
    /// Time spent running: a worker's busy time, a connection's time in its driver.
    Busy,
    /// Bytes read and written.
    Bytes,
    /// Frames read and written.
    Frames,
}

impl FromStr for BalanceKind {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "off" => Ok(Self::Off),
            "busy" => Ok(Self::Busy),
            "bytes" => Ok(Self::Bytes),
            "frames" => Ok(Self::Frames),
            other => Err(format!(
                "unknown balancer policy {other:?} (expected off, busy, bytes or frames)"
            )),
        }
    }
}

impl fmt::Display for BalanceKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Off => "off",
            Self::Busy => "busy",
            Self::Bytes => "bytes",
            Self::Frames => "frames",
        })
    }
}

/// Balancer settings.
#[derive(Clone, Debug, PartialEq)]
pub struct BalanceConfig {
    pub policy: BalanceKind,
    /// How often load is sampled and connections may move.
    pub interval: Duration,
    /// Act when the standard deviation of worker loads exceeds this fraction of the busiest
    /// worker's load.
    pub threshold: f64,
    /// Connections moved per interval at most.
    pub max_moves: usize,
    /// Intervals a moved connection stays where it was put.
    pub cooldown: u32,
    /// Do nothing while the busiest worker was busy for less than this fraction of the interval:
    /// an idle messenger's spread is noise.
    pub min_busy: f64,
}

impl Default for BalanceConfig {
    fn default() -> Self {
        Self {
            policy: BalanceKind::Off,
            interval: Duration::from_millis(200),
            threshold: 0.2,
            max_moves: 2,
            cooldown: 5,
            min_busy: 0.1,
        }
    }
}

/// A connection's load over the last interval, as [`plan`] sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ConnLoad {
    pub id: u64,
    pub worker: usize,
    pub load: u64,
}

/// One migration [`plan`] chose.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Move {
    pub id: u64,
    pub from: usize,
    pub to: usize,
}

/// Standard deviation of `loads` (population).
pub fn spread(loads: &[u64]) -> f64 {
    if loads.is_empty() {
        return 0.0;
    }
    let n = loads.len() as f64;
    let mean = loads.iter().map(|&l| l as f64).sum::<f64>() / n;
    let var = loads
        .iter()
        .map(|&l| (l as f64 - mean).powi(2))
        .sum::<f64>()
        / n;
    var.sqrt()
}

/// The moves that even out `workers` (load per worker over the last interval) by moving some of
/// `conns` (only those free to move), at most `max_moves`, while the spread exceeds
/// `threshold` × the busiest worker's load.
pub fn plan(workers: &[u64], conns: &[ConnLoad], threshold: f64, max_moves: usize) -> Vec<Move> {
    let mut loads = workers.to_vec();
    let mut free: Vec<ConnLoad> = conns
        .iter()
        .filter(|c| c.worker < loads.len() && c.load > 0)
        .copied()
        .collect();
    let mut moves = Vec::new();
    while moves.len() < max_moves {
        let Some((busiest, &max)) = loads
            .iter()
            .enumerate()
            .max_by_key(|(i, l)| (**l, usize::MAX - i))
        else {
            break;
        };
        let Some((idlest, &min)) = loads.iter().enumerate().min_by_key(|(i, l)| (**l, *i)) else {
            break;
        };
        if max == 0 || busiest == idlest || spread(&loads) <= threshold * max as f64 {
            break;
        }
        let gap = max - min;
        // Moving load c changes the pair's difference from gap to |gap - 2c|: an improvement for
        // 0 < c < gap, best at c = gap / 2.
        let best = free
            .iter()
            .enumerate()
            .filter(|(_, c)| c.worker == busiest && c.load < gap)
            .min_by_key(|(_, c)| ((gap as i128 - 2 * c.load as i128).abs(), c.id))
            .map(|(i, _)| i);
        let Some(i) = best else { break };
        let c = free.swap_remove(i);
        loads[busiest] -= c.load;
        loads[idlest] += c.load;
        moves.push(Move {
            id: c.id,
            from: busiest,
            to: idlest,
        });
    }
    moves
}

/// What the messenger knows of one live connection: where it runs, what it costs, and how to reach
/// its driver. Shared by the driver (which counts) and the balancer (which reads and moves).
#[derive(Debug)]
pub(crate) struct ConnInfo {
    pub(crate) id: u64,
    pub(crate) side: &'static str,
    pub(crate) peer: Arc<str>,
    pub(crate) worker: AtomicUsize,
    /// Nanoseconds spent in the driver's poll.
    pub(crate) busy_ns: AtomicU64,
    pub(crate) bytes: AtomicU64,
    pub(crate) frames: AtomicU64,
    pub(crate) migrations: AtomicU64,
    /// Not a strong sender: a client connection closes when its last caller's handle is gone.
    tx: WeakUnboundedSender<Outgoing>,
}

impl ConnInfo {
    pub(crate) fn new(
        id: u64,
        side: &'static str,
        peer: Arc<str>,
        worker: usize,
        tx: WeakUnboundedSender<Outgoing>,
    ) -> Arc<Self> {
        Arc::new(Self {
            id,
            side,
            peer,
            worker: AtomicUsize::new(worker),
            busy_ns: AtomicU64::new(0),
            bytes: AtomicU64::new(0),
            frames: AtomicU64::new(0),
            migrations: AtomicU64::new(0),
            tx,
        })
    }

    pub(crate) fn count_bytes(&self, n: u64) {
        self.bytes.fetch_add(n, Ordering::Relaxed);
    }

    pub(crate) fn count_frame(&self) {
        self.frames.fetch_add(1, Ordering::Relaxed);
    }

    fn load(&self, kind: BalanceKind) -> u64 {
        match kind {
            BalanceKind::Off | BalanceKind::Busy => self.busy_ns.load(Ordering::Relaxed),
            BalanceKind::Bytes => self.bytes.load(Ordering::Relaxed),
            BalanceKind::Frames => self.frames.load(Ordering::Relaxed),
        }
    }

    pub(crate) fn stat(&self) -> ConnStat {
        ConnStat {
            id: self.id,
            side: self.side,
            peer: self.peer.to_string(),
            worker: self.worker.load(Ordering::Relaxed),
            busy: Duration::from_nanos(self.busy_ns.load(Ordering::Relaxed)),
            bytes: self.bytes.load(Ordering::Relaxed),
            frames: self.frames.load(Ordering::Relaxed),
            migrations: self.migrations.load(Ordering::Relaxed),
        }
    }
}

/// A snapshot of one live connection ([`crate::Messenger::connections`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConnStat {
    pub id: u64,
    /// `client` (opened by this messenger) or `server` (accepted).
    pub side: &'static str,
    pub peer: String,
    pub worker: usize,
    /// Time its driver has run.
    pub busy: Duration,
    pub bytes: u64,
    pub frames: u64,
    /// Times it moved between workers.
    pub migrations: u64,
}

/// Every live connection of a messenger, by id.
#[derive(Debug, Default)]
pub(crate) struct ConnTable {
    next_id: AtomicU64,
    conns: Mutex<HashMap<u64, Arc<ConnInfo>>>,
}

impl ConnTable {
    pub(crate) fn next_id(&self) -> u64 {
        self.next_id.fetch_add(1, Ordering::Relaxed) + 1
    }

    pub(crate) fn insert(&self, info: &Arc<ConnInfo>) {
        lock(&self.conns).insert(info.id, Arc::clone(info));
    }

    pub(crate) fn remove(&self, id: u64) {
        lock(&self.conns).remove(&id);
    }

    pub(crate) fn all(&self) -> Vec<Arc<ConnInfo>> {
        lock(&self.conns).values().cloned().collect()
    }

    /// Asks connection `id` to move to worker `to`; `false` when it is gone.
    pub(crate) fn migrate(&self, id: u64, to: usize) -> bool {
        let Some(info) = lock(&self.conns).get(&id).cloned() else {
            return false;
        };
        match info.tx.upgrade() {
            Some(tx) => tx.send(Outgoing::Migrate(to)).is_ok(),
            None => false,
        }
    }
}

/// The balancer thread of one messenger. Stops when dropped (or when its messenger is gone).
#[derive(Debug)]
pub(crate) struct Balancer {
    stop: Option<std::sync::mpsc::Sender<()>>,
    thread: Option<thread::JoinHandle<()>>,
}

impl Balancer {
    pub(crate) fn start(
        name: &str,
        shared: Weak<Shared>,
        cfg: BalanceConfig,
    ) -> std::io::Result<Self> {
        let (stop, stopped) = std::sync::mpsc::channel::<()>();
        let thread = thread::Builder::new()
            .name(format!("{name}-bal"))
            .spawn(move || run(&shared, &cfg, &stopped))?;
        Ok(Self {
            stop: Some(stop),
            thread: Some(thread),
        })
    }

    /// Stops the thread and waits for it.
    pub(crate) fn stop(&mut self) {
        self.stop.take();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for Balancer {
    fn drop(&mut self) {
        // Not joined: a drop may happen on a worker thread.
        self.stop.take();
    }
}

/// Cumulative load counters of the workers and connections at one sample.
struct Sample {
    busy: Vec<u64>,
    workers: Vec<u64>,
    conns: HashMap<u64, u64>,
}

fn sample(shared: &Shared, kind: BalanceKind) -> (Sample, Vec<(u64, usize)>) {
    let busy: Vec<u64> = shared
        .workers
        .busy()
        .iter()
        .map(|d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
        .collect();
    let workers = match kind {
        BalanceKind::Off | BalanceKind::Busy => busy.clone(),
        BalanceKind::Bytes => shared.workers.loads().iter().map(|l| l.bytes).collect(),
        BalanceKind::Frames => shared.workers.loads().iter().map(|l| l.frames).collect(),
    };
    let infos = shared.conns.all();
    let conns = infos.iter().map(|c| (c.id, c.load(kind))).collect();
    let placed = infos
        .iter()
        .map(|c| (c.id, c.worker.load(Ordering::Relaxed)))
        .collect();
    (
        Sample {
            busy,
            workers,
            conns,
        },
        placed,
    )
}

fn run(shared: &Weak<Shared>, cfg: &BalanceConfig, stopped: &std::sync::mpsc::Receiver<()>) {
    let mut prev: Option<Sample> = None;
    let mut frozen: HashMap<u64, u64> = HashMap::new();
    let interval_ns = u64::try_from(cfg.interval.as_nanos()).unwrap_or(u64::MAX);
    for tick in 0u64.. {
        match stopped.recv_timeout(cfg.interval) {
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {}
            _ => return,
        }
        let Some(shared) = shared.upgrade() else {
            return;
        };
        let (now, placed) = sample(&shared, cfg.policy);
        let Some(before) = prev.replace(Sample {
            busy: now.busy.clone(),
            workers: now.workers.clone(),
            conns: now.conns.clone(),
        }) else {
            continue;
        };
        let delta = |a: &[u64], b: &[u64]| -> Vec<u64> {
            a.iter().zip(b).map(|(a, b)| a.saturating_sub(*b)).collect()
        };
        let busy = delta(&now.busy, &before.busy);
        let workers = delta(&now.workers, &before.workers);
        let max = workers.iter().copied().max().unwrap_or(0);
        shared.metrics.set_spread(if max == 0 {
            0.0
        } else {
            spread(&workers) / max as f64
        });
        frozen.retain(|_, until| *until > tick);
        let busiest = busy.iter().copied().max().unwrap_or(0);
        if (busiest as f64) < cfg.min_busy * interval_ns as f64 {
            continue;
        }
        let conns: Vec<ConnLoad> = placed
            .iter()
            .filter(|(id, _)| !frozen.contains_key(id))
            .map(|&(id, worker)| ConnLoad {
                id,
                worker,
                load: now
                    .conns
                    .get(&id)
                    .copied()
                    .unwrap_or(0)
                    .saturating_sub(before.conns.get(&id).copied().unwrap_or(0)),
            })
            .collect();
        for m in plan(&workers, &conns, cfg.threshold, cfg.max_moves) {
            if shared.conns.migrate(m.id, m.to) {
                tracing::debug!(
                    conn = m.id,
                    from = m.from,
                    to = m.to,
                    "balancer moves a connection"
                );
                frozen.insert(m.id, tick + u64::from(cfg.cooldown));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn c(id: u64, worker: usize, load: u64) -> ConnLoad {
        ConnLoad { id, worker, load }
    }

    #[test]
    fn two_heavy_connections_on_one_worker_are_split() {
        // Two heavy and six light connections; the heavy ones start on worker 0.
        let conns = [
            c(1, 0, 100),
            c(2, 0, 100),
            c(3, 0, 2),
            c(4, 1, 2),
            c(5, 0, 2),
            c(6, 1, 2),
            c(7, 0, 2),
            c(8, 1, 2),
        ];
        let moves = plan(&[208, 6], &conns, 0.2, 4);
        assert_eq!(
            moves,
            [Move {
                id: 1,
                from: 0,
                to: 1
            }]
        );
    }

    #[test]
    fn an_even_spread_is_left_alone() {
        let conns = [c(1, 0, 50), c(2, 1, 48)];
        assert!(plan(&[50, 48], &conns, 0.2, 4).is_empty());
        assert!(plan(&[0, 0], &[], 0.2, 4).is_empty());
    }

    #[test]
    fn a_connection_larger_than_the_gap_does_not_move() {
        // One connection carries all of worker 0's load: moving it only swaps the workers.
        let conns = [c(1, 0, 100)];
        assert!(plan(&[100, 0], &conns, 0.2, 4).is_empty());
    }

    #[test]
    fn several_moves_fill_the_idlest_workers_in_turn() {
        let conns: Vec<ConnLoad> = (0..8).map(|i| c(i, 0, 10)).collect();
        let moves = plan(&[80, 0, 0, 0], &conns, 0.1, 8);
        let mut per = [8u64, 0, 0, 0];
        for m in &moves {
            per[m.from] -= 1;
            per[m.to] += 1;
        }
        assert_eq!(per, [2, 2, 2, 2], "{moves:?}");
    }

    #[test]
    fn unmovable_load_is_not_chased() {
        // Worker 0 is busy with something that is no connection: nothing on it can move.
        assert!(plan(&[100, 0], &[c(1, 1, 0)], 0.2, 4).is_empty());
    }

    #[test]
    fn spread_is_the_population_standard_deviation() {
        assert_eq!(spread(&[]), 0.0);
        assert_eq!(spread(&[3, 3]), 0.0);
        assert!((spread(&[0, 10]) - 5.0).abs() < 1e-9);
    }

    #[test]
    fn policy_names_parse_and_print() {
        for k in [
            BalanceKind::Off,
            BalanceKind::Busy,
            BalanceKind::Bytes,
            BalanceKind::Frames,
        ] {
            assert_eq!(k.to_string().parse::<BalanceKind>(), Ok(k));
        }
        assert!("fastest".parse::<BalanceKind>().is_err());
    }
}
