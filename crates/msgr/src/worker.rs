//! Worker event loops: one OS thread with a `current_thread` tokio runtime each.
//!
//! A connection lives on exactly one worker, so its reads, decoding, inline dispatch and writes happen on
//! one core without handoffs (a cross-core handoff costs about ten times a same-core one on these
//! machines). Work reaches a worker through its runtime handle.

use std::future::Future;
use std::io;
use std::sync::Mutex;
use std::thread;

use nacre_types::sync::lock;
use tokio::runtime::Handle;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

use crate::metrics::{MsgrMetrics, WorkerCounters};
use crate::policy::{AssignPolicy, WorkerLoad};

/// One worker event loop.
#[derive(Debug)]
pub struct Worker {
    index: usize,
    handle: Handle,
    pub(crate) counters: WorkerCounters,
}

impl Worker {
    /// Position of this worker in the pool.
    pub fn index(&self) -> usize {
        self.index
    }

    /// Runs a future on this worker's thread.
    pub fn spawn<F>(&self, fut: F) -> JoinHandle<F::Output>
    where
        F: Future + Send + 'static,
        F::Output: Send + 'static,
    {
        self.handle.spawn(fut)
    }

    /// Time this worker's thread has spent running tasks since it started.
    pub fn busy(&self) -> std::time::Duration {
        self.handle.metrics().worker_total_busy_duration(0)
    }

    /// This worker's connections, traffic and busy time.
    pub fn stat(&self) -> WorkerStat {
        let l = self.load();
        WorkerStat {
            index: self.index,
            connections: l.connections,
            bytes: l.bytes,
            frames: l.frames,
            busy: self.busy(),
        }
    }

    /// This worker's load as seen by assignment policies.
    pub fn load(&self) -> WorkerLoad {
        let c = &self.counters;
        WorkerLoad {
            connections: u64::try_from(c.connections.get()).unwrap_or(0),
            bytes: c.bytes_in.get() + c.bytes_out.get(),
            frames: c.frames_in.get() + c.frames_out.get(),
        }
    }
}

/// A snapshot of one worker ([`crate::Messenger::worker_stats`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WorkerStat {
    pub index: usize,
    pub connections: u64,
    /// Bytes read and written since it started.
    pub bytes: u64,
    /// Frames read and written since it started.
    pub frames: u64,
    /// Time spent running tasks since it started.
    pub busy: std::time::Duration,
}

/// The pool of workers of one messenger.
#[derive(Debug)]
pub struct Workers {
    workers: Vec<Worker>,
    policy: Box<dyn AssignPolicy>,
    stop: Mutex<Vec<oneshot::Sender<()>>>,
    threads: Mutex<Vec<thread::JoinHandle<()>>>,
}

impl Workers {
    /// Starts `n` worker threads named `{name}-w{i}`.
    pub fn start(
        name: &str,
        n: usize,
        policy: Box<dyn AssignPolicy>,
        metrics: &MsgrMetrics,
    ) -> io::Result<Self> {
        let mut workers = Vec::with_capacity(n);
        let mut stop = Vec::with_capacity(n);
        let mut threads = Vec::with_capacity(n);
        for index in 0..n {
            let (handle_tx, handle_rx) = std::sync::mpsc::channel();
            let (stop_tx, stop_rx) = oneshot::channel::<()>();
            let thread = thread::Builder::new()
                .name(format!("{name}-w{index}"))
                .spawn(move || {
                    let rt = match tokio::runtime::Builder::new_current_thread()
                        .enable_all()
                        .build()
                    {
                        Ok(rt) => rt,
                        Err(e) => {
                            let _ = handle_tx.send(Err(e));
                            return;
                        }
                    };
                    let _ = handle_tx.send(Ok(rt.handle().clone()));
                    // Runs every task spawned on this worker until the pool stops; dropping the
                    // runtime then cancels whatever is left.
                    let _ = rt.block_on(stop_rx);
                })?;
            let handle = handle_rx
                .recv()
                .map_err(|_| io::Error::other("worker thread died during start"))??;
            workers.push(Worker {
                index,
                handle,
                counters: metrics.worker(index),
            });
            stop.push(stop_tx);
            threads.push(thread);
        }
        Ok(Self {
            workers,
            policy,
            stop: Mutex::new(stop),
            threads: Mutex::new(threads),
        })
    }

    /// Number of workers.
    pub fn len(&self) -> usize {
        self.workers.len()
    }

    /// Whether the pool has no workers (never true for a started pool).
    pub fn is_empty(&self) -> bool {
        self.workers.is_empty()
    }

    /// Worker `i` (modulo the pool size).
    pub fn get(&self, i: usize) -> &Worker {
        &self.workers[i % self.workers.len()]
    }

    /// Current load of every worker.
    pub fn loads(&self) -> Vec<WorkerLoad> {
        self.workers.iter().map(Worker::load).collect()
    }

    /// Every worker's busy time since it started.
    pub fn busy(&self) -> Vec<std::time::Duration> {
        self.workers.iter().map(Worker::busy).collect()
    }

    /// A snapshot of every worker.
    pub fn stats(&self) -> Vec<WorkerStat> {
        self.workers.iter().map(Worker::stat).collect()
    }

    /// The worker the policy picks for a new connection.
    pub fn assign(&self) -> &Worker {
        let i = self.policy.assign(&self.loads());
        self.get(i)
    }

    /// Stops every worker and waits for its thread. Tasks still running are cancelled. Must not be
    /// called from a worker thread.
    pub fn shutdown(&self) {
        self.signal_stop();
        let threads = std::mem::take(&mut *lock(&self.threads));
        for t in threads {
            let _ = t.join();
        }
    }

    fn signal_stop(&self) {
        for tx in std::mem::take(&mut *lock(&self.stop)) {
            let _ = tx.send(());
        }
    }
}

impl Drop for Workers {
    fn drop(&mut self) {
        // Not joined here: a drop may happen inside an async context where blocking is not allowed.
        self.signal_stop();
    }
}
