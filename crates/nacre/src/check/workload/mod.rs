//! The verifying workload and its checker (issue 8). Clients write files — small files, big files
//! appended and fsynced piece by piece, overwrites, appends, truncates, renames, unlinks — under
//! `/{root}/c{id}/{a,b}` while faults happen elsewhere, and remember every *acknowledged*
//! outcome. Afterwards [`Workload::verify`] reads everything back and reports acknowledged bytes
//! that are missing or wrong, and content that was never written.
//!
//! **Exact claims.** Clients never share files, so each client's model is exact while its calls
//! succeed. A call that fails (an error, a timeout, a stop) leaves the outcome of its operation
//! unknown: the files it touched become *uncertain*. The model then keeps the set of outcomes the
//! operation allows (its *worlds*) and the client never touches those paths again; names are never
//! reused at all (every new file gets a fresh one), so no later operation can blur a world. The
//! checker accepts an uncertain file only in one of its worlds; after a failed write each byte may
//! be the old or the new one — never a zero that neither had.
//!
//! **Compact model.** Content is kept as segments of seeded pseudo-random streams ([`Content`]),
//! not bytes: a client's model stays small whatever the file sizes; bytes are made when writing
//! and when checking.
//!
//! Files: this one holds the configuration, the counters, the findings and the report, and the
//! [`Workload`] that runs clients and verifies; `content.rs` is the compact representation of a
//! file's bytes, `model.rs` what a client knows (certain files, the worlds of uncertain ones, the
//! acknowledgement log), `client.rs` one client's operations and how each acknowledged or failed
//! outcome updates its model, `verify.rs` the checker that reads everything back and judges it
//! against the model.
//!
//! [`Content`]: content::Content

mod client;
mod content;
mod model;
#[cfg(test)]
pub(in crate::check) mod tests;
mod verify;

pub(in crate::check) use verify::{list_all, resolve, retry};

use std::collections::BTreeMap;
use std::fmt;
use std::future::Future;
use std::io::{self, Write as _};
use std::path::PathBuf;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use nacre_types::sync::lock;
use std::time::{Duration, Instant};

use nacre_api::meta::{MetaError, ROOT_INO};
use nacre_client::{CallError, FileSystem, FsError, FsResult, OpenFlags};
use nacre_types::Ino;
use serde::Serialize;
use tokio::sync::watch;

use self::client::Client;
use self::content::Rng;
use self::model::{AckLog, ClientModel};
use self::verify::Check;

const KIB: u64 = 1024;
const MIB: u64 = 1 << 20;
/// Every file system call gets this long; a hung call is a failed one.
const CALL_TIMEOUT: Duration = Duration::from_secs(20);
/// Releasing a handle after a failure: best effort, and not worth a long wait.
const CLEANUP_TIMEOUT: Duration = Duration::from_secs(5);
const SETUP_TRIES: u32 = 50;
const SETUP_GAP: Duration = Duration::from_millis(100);
const VERIFY_TRIES: u32 = 40;
const VERIFY_GAP: Duration = Duration::from_millis(250);
/// Bytes per read call.
const CHUNK: u64 = MIB;
/// Entries per readdir call.
const PAGE: u32 = 1024;
const LOG_FLUSH_LINES: u64 = 100;
/// Findings a report prints (all are serialized).
const SHOWN_FINDINGS: usize = 20;
/// The two directories of a client: renames move files between them.
const SUBDIRS: [&str; 2] = ["a", "b"];

#[derive(Clone, Debug, Serialize)]
pub struct WorkloadConfig {
    pub clients: usize,
    /// Client `id` draws from `seed ^ id`: a run is reproducible up to the faults' timing.
    pub seed: u64,
    /// The workload's directory (`check`: clients work under `/check/c{id}`). It must be fresh:
    /// the checker reports anything it finds there that the model does not have.
    pub root: String,
    pub max_file_bytes: u64,
    pub max_files_per_client: usize,
    /// Each client stops by itself after this many operations (tests); `None`: until stopped.
    pub ops_limit: Option<u64>,
}

impl Default for WorkloadConfig {
    fn default() -> Self {
        Self {
            clients: 4,
            seed: 1,
            root: "check".into(),
            max_file_bytes: 4 * MIB,
            max_files_per_client: 64,
            ops_limit: None,
        }
    }
}

/// Counters of a running workload, readable while it runs.
#[derive(Debug, Default)]
pub struct Stats {
    acked: AtomicU64,
    failed: AtomicU64,
    acked_bytes: AtomicU64,
    reads_verified: AtomicU64,
    uncertain: AtomicU64,
    gave_up: AtomicU64,
    /// Failed calls by the errno an application would have seen (through FUSE).
    errors: Mutex<BTreeMap<String, u64>>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct StatsSnapshot {
    /// Acknowledged operations.
    pub acked: u64,
    /// Failed operations (and failed setup or cleanup calls); each is followed by a back-off.
    pub failed: u64,
    /// Data bytes written by acknowledged operations.
    pub acked_bytes: u64,
    /// Files read back and found right during the run.
    pub reads_verified: u64,
    /// Failed operations that left files with several allowed outcomes.
    pub uncertain: u64,
    /// Clients that could not make their directories and did nothing.
    pub gave_up: u64,
    /// Failed calls by the errno an application would have seen (through FUSE).
    pub errors: BTreeMap<String, u64>,
}

impl Stats {
    pub fn snapshot(&self) -> StatsSnapshot {
        StatsSnapshot {
            acked: self.acked.load(Relaxed),
            failed: self.failed.load(Relaxed),
            acked_bytes: self.acked_bytes.load(Relaxed),
            reads_verified: self.reads_verified.load(Relaxed),
            uncertain: self.uncertain.load(Relaxed),
            gave_up: self.gave_up.load(Relaxed),
            errors: lock(&self.errors).clone(),
        }
    }

    /// Counts a failed call under its errno; the errno's name.
    pub(super) fn error(&self, e: &FsError) -> String {
        let name = errno_name(nacre_fuse::errno(e));
        *lock(&self.errors).entry(name.clone()).or_default() += 1;
        name
    }
}

/// `EIO` for 5, and so on; `errno N` for the rare ones.
fn errno_name(n: i32) -> String {
    let names = [
        (libc::EIO, "EIO"),
        (libc::ENOSPC, "ENOSPC"),
        (libc::ENOENT, "ENOENT"),
        (libc::EEXIST, "EEXIST"),
        (libc::EINVAL, "EINVAL"),
        (libc::EAGAIN, "EAGAIN"),
        (libc::EBADF, "EBADF"),
        (libc::ENOTDIR, "ENOTDIR"),
        (libc::EISDIR, "EISDIR"),
        (libc::ENOTEMPTY, "ENOTEMPTY"),
        (libc::EOPNOTSUPP, "EOPNOTSUPP"),
    ];
    names
        .iter()
        .find(|(e, _)| *e == n)
        .map_or_else(|| format!("errno {n}"), |(_, name)| (*name).to_string())
}

/// Something the checker found wrong. Paths are volume paths.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Finding {
    /// An acknowledged file is not there.
    Missing { path: String, acked_size: u64 },
    /// The content differs from every allowed one. `offset` is the first byte that is neither the
    /// acknowledged nor (for an uncertain file) the attempted one; `differing_bytes` counts such
    /// bytes plus the length difference (approximate when lengths differ).
    Wrong {
        path: String,
        offset: u64,
        differing_bytes: u64,
        expected_size: u64,
        actual_size: u64,
    },
    /// A file the model never had there: content never written.
    Unexpected { path: String, size: u64 },
    /// Could not be read (after retries): nothing can be said about it.
    Unreadable { path: String, error: String },
    /// A rename that failed left the file under both names (nothing is lost, but rename is not
    /// atomic under failure).
    RenameNotAtomic { from: String, to: String },
    /// After a kill of the client process (`kill-client`), a file holds none of the states its
    /// journal allows.
    Crash(crate::check::kill_client::judge::Violation),
    /// A call failed (with `error`, the errno an application would have seen), yet its operation
    /// was applied: an application was told of a failure that did not happen.
    FailedButApplied {
        op: String,
        path: String,
        error: String,
    },
}

impl Finding {
    /// The volume path the finding is about.
    pub fn path(&self) -> &str {
        match self {
            Self::Missing { path, .. }
            | Self::Wrong { path, .. }
            | Self::Unexpected { path, .. }
            | Self::Unreadable { path, .. }
            | Self::FailedButApplied { path, .. } => path,
            Self::RenameNotAtomic { from, .. } => from,
            Self::Crash(v) => &v.path,
        }
    }
}

impl fmt::Display for Finding {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Missing { path, acked_size } => {
                write!(f, "missing: {path} (acknowledged size {acked_size})")
            }
            Self::Wrong {
                path,
                offset,
                differing_bytes,
                expected_size,
                actual_size,
            } => write!(
                f,
                "wrong: {path}: {differing_bytes} bytes differ from offset {offset} \
                 (size {actual_size}, acknowledged {expected_size})"
            ),
            Self::Unexpected { path, size } => {
                write!(
                    f,
                    "unexpected: {path} ({size} bytes) was never written there"
                )
            }
            Self::Unreadable { path, error } => write!(f, "unreadable: {path}: {error}"),
            Self::RenameNotAtomic { from, to } => {
                write!(
                    f,
                    "rename not atomic: both {from} and {to} exist after a failed rename"
                )
            }
            Self::Crash(v) => write!(f, "{v}"),
            Self::FailedButApplied { op, path, error } => {
                write!(f, "failed but applied: {op} {path} returned {error}")
            }
        }
    }
}

#[derive(Clone, Debug, Default, Serialize)]
pub struct Report {
    /// Files read back by the checker.
    pub files_checked: u64,
    pub bytes_checked: u64,
    pub acked_ops: u64,
    /// For each file with a `Missing` or `Wrong` finding: 1 + the acknowledged operations on it
    /// (its create, appends, overwrites, truncates, renames) — what the finding takes back.
    pub lost_ops: u64,
    pub uncertain_files: u64,
    pub findings: Vec<Finding>,
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "checked {} files ({} bytes): {} acknowledged ops, {} uncertain files, {} findings, \
             {} ops lost",
            self.files_checked,
            self.bytes_checked,
            self.acked_ops,
            self.uncertain_files,
            self.findings.len(),
            self.lost_ops
        )?;
        for x in self.findings.iter().take(SHOWN_FINDINGS) {
            writeln!(f, "  {x}")?;
        }
        if self.findings.len() > SHOWN_FINDINGS {
            writeln!(f, "  … and {} more", self.findings.len() - SHOWN_FINDINGS)?;
        }
        Ok(())
    }
}

/// The workload: its clients' models, counters and acknowledgement log.
#[derive(Debug)]
pub struct Workload {
    cfg: WorkloadConfig,
    stats: Stats,
    models: Vec<Mutex<ClientModel>>,
    /// Mismatches found by reads during the run, with the acknowledged ops of the file.
    run_findings: Mutex<Vec<(Finding, u64)>>,
    log: Option<Mutex<AckLog>>,
    started: Instant,
}

fn unknown(why: &str) -> FsError {
    FsError::Unavailable(CallError::Unknown(why.into()))
}

pub(in crate::check) fn not_found(e: &FsError) -> bool {
    matches!(e, FsError::Meta(MetaError::NotFound))
}

pub(in crate::check) async fn timed<T>(fut: impl Future<Output = FsResult<T>>) -> FsResult<T> {
    tokio::time::timeout(CALL_TIMEOUT, fut)
        .await
        .unwrap_or_else(|_| Err(unknown("timed out")))
}

/// Resolves when `stop` turns true (never if its sender is gone without saying so).
pub(in crate::check) async fn until_stopped(stop: &mut watch::Receiver<bool>) {
    if stop.wait_for(|s| *s).await.is_err() {
        std::future::pending::<()>().await;
    }
}

impl Workload {
    pub fn new(mut cfg: WorkloadConfig, ack_log: Option<PathBuf>) -> io::Result<Self> {
        cfg.max_file_bytes = cfg.max_file_bytes.max(1);
        cfg.max_files_per_client = cfg.max_files_per_client.max(1);
        let log = match ack_log {
            Some(p) => Some(Mutex::new(AckLog {
                out: io::BufWriter::new(std::fs::File::create(p)?),
                lines: 0,
                error: None,
            })),
            None => None,
        };
        Ok(Self {
            models: (0..cfg.clients).map(|_| Mutex::default()).collect(),
            cfg,
            stats: Stats::default(),
            run_findings: Mutex::default(),
            log,
            started: Instant::now(),
        })
    }

    pub fn stats(&self) -> &Stats {
        &self.stats
    }

    /// Writes out the buffered acknowledgement log; reports the first error writing it.
    pub fn flush_log(&self) -> io::Result<()> {
        let Some(log) = &self.log else { return Ok(()) };
        let mut log = lock(log);
        if let Some(e) = log.error.take() {
            return Err(e);
        }
        log.out.flush()
    }

    fn root_names(&self) -> Vec<String> {
        self.cfg
            .root
            .split('/')
            .filter(|c| !c.is_empty())
            .map(String::from)
            .collect()
    }

    fn base(&self, id: usize) -> String {
        format!("/{}/c{id}", self.root_names().join("/"))
    }

    /// Client `id` runs on `fs` until `stop` turns true (or its `ops_limit` is reached). An
    /// operation in progress then is abandoned and counts as failed (its files uncertain). A
    /// client that cannot make its directories gives up (counted in [`StatsSnapshot::gave_up`]).
    pub async fn run_client<F: FileSystem + Sync>(
        &self,
        id: usize,
        fs: &F,
        stop: watch::Receiver<bool>,
    ) {
        if id >= self.models.len() {
            tracing::warn!(id, clients = self.models.len(), "no such workload client");
            self.stats.gave_up.fetch_add(1, Relaxed);
            return;
        }
        let mut c = Client {
            w: self,
            id,
            fs,
            stop,
            rng: Rng(self.cfg.seed ^ id as u64),
            dirs: [ROOT_INO; 2],
            failed: false,
            base: self.base(id),
        };
        if let Err(e) = c.setup().await {
            tracing::warn!(id, error = %e, "workload client gave up");
            self.stats.gave_up.fetch_add(1, Relaxed);
            return;
        }
        c.run().await;
    }

    /// After the run: reads every client's directories back through `fs` and compares them with
    /// the model. Call it once every client has returned.
    pub async fn verify<F: FileSystem + Sync>(&self, fs: &F) -> Report {
        if let Err(e) = self.flush_log() {
            tracing::warn!(error = %e, "writing the acknowledgement log failed");
        }
        let s = self.stats.snapshot();
        let mut check = Check {
            fs,
            report: Report {
                acked_ops: s.acked,
                uncertain_files: s.uncertain,
                ..Report::default()
            },
            lost: BTreeMap::new(),
        };
        let early = lock(&self.run_findings).clone();
        for (f, ops) in early {
            check.push(f, ops);
        }
        for id in 0..self.models.len() {
            let model = lock(&self.models[id]).clone();
            let mut dir = self.root_names();
            dir.push(format!("c{id}"));
            check.client(&self.base(id), &dir, model).await;
        }
        check.report.lost_ops = check.lost.values().sum();
        check.report
    }
}

impl Drop for Workload {
    fn drop(&mut self) {
        let _ = self.flush_log();
    }
}

/// File `ino` (at most `cap` bytes): open, read until a short read, release.
pub(in crate::check) async fn read_file<F: FileSystem>(
    fs: &F,
    ino: Ino,
    cap: u64,
) -> FsResult<Vec<u8>> {
    let fh = timed(fs.open(ino, OpenFlags::READ)).await?;
    let mut out = Vec::new();
    let r = async {
        loop {
            let want = (cap - out.len() as u64).min(CHUNK);
            if want == 0 {
                return Ok(());
            }
            let got = timed(fs.read(fh, out.len() as u64, want as u32)).await?;
            out.extend_from_slice(&got);
            if (got.len() as u64) < want {
                return Ok(());
            }
        }
    }
    .await;
    let _ = tokio::time::timeout(CLEANUP_TIMEOUT, fs.release(fh)).await;
    r.map(|()| out)
}
