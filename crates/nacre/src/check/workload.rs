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

use std::collections::BTreeMap;
use std::fmt;
use std::future::Future;
use std::io::{self, Write as _};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use bytes::Bytes;
use nacre_client::{CallError, Caller, DirEntryPlus, Fh, FileSystem, FsError, FsResult, OpenFlags};
use nacre_meta::{Attr, FileType, MetaError, ROOT_INO, SetAttr};
use nacre_types::{Ino, crc32c};
use serde::Serialize;
use tokio::sync::watch;

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
        }
    }
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
}

impl Finding {
    /// The volume path the finding is about.
    pub fn path(&self) -> &str {
        match self {
            Self::Missing { path, .. }
            | Self::Wrong { path, .. }
            | Self::Unexpected { path, .. }
            | Self::Unreadable { path, .. } => path,
            Self::RenameNotAtomic { from, .. } => from,
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

// ---------------------------------------------------------------------------------------------
// Content: what a file holds, as pseudo-random segments.

const GOLDEN: u64 = 0x9e37_79b9_7f4a_7c15;

/// The splitmix64 finalizer.
fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// splitmix64: tiny, deterministic, good enough to pick operations.
#[derive(Clone, Debug)]
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(GOLDEN);
        mix(self.0)
    }

    fn below(&mut self, n: u64) -> u64 {
        if n == 0 { 0 } else { self.next() % n }
    }

    /// In `lo..=hi` (`lo` if empty).
    fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.below(hi.saturating_sub(lo) + 1)
    }
}

/// Bytes `from..` of the stream `seed` into `out`: random access, so a segment cut anywhere
/// still names its bytes.
fn fill(seed: u64, from: u64, out: &mut [u8]) {
    let (mut i, mut k) = (from, 0);
    while k < out.len() {
        let word = mix(seed ^ (i >> 3).wrapping_mul(GOLDEN)).to_le_bytes();
        let start = (i & 7) as usize;
        let n = (8 - start).min(out.len() - k);
        out[k..k + n].copy_from_slice(&word[start..start + n]);
        k += n;
        i += n as u64;
    }
}

fn stream(seed: u64, len: u64) -> Bytes {
    let mut v = vec![0u8; len as usize];
    fill(seed, 0, &mut v);
    Bytes::from(v)
}

/// File bytes `off..off + len` are bytes `from..` of the stream `seed`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Seg {
    off: u64,
    len: u64,
    seed: u64,
    from: u64,
}

/// A file's content: `len` bytes, the segments over zeros (holes, extensions).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct Content {
    len: u64,
    /// Sorted, not overlapping, inside `len`.
    segs: Vec<Seg>,
}

impl Content {
    /// After writing `len` bytes of stream `seed` at `off` (past the end: a hole of zeros).
    fn written(&self, off: u64, len: u64, seed: u64) -> Self {
        let mut c = self.cut(off, off + len);
        c.segs.push(Seg {
            off,
            len,
            seed,
            from: 0,
        });
        c.segs.sort_by_key(|s| s.off);
        c.len = c.len.max(off + len);
        c
    }

    /// After a truncate (or an extension with zeros).
    fn resized(&self, size: u64) -> Self {
        let mut c = self.cut(size, u64::MAX);
        c.len = size;
        c
    }

    /// Without the segments' bytes in `from..to`.
    fn cut(&self, from: u64, to: u64) -> Self {
        let mut segs = Vec::with_capacity(self.segs.len() + 1);
        for s in &self.segs {
            let end = s.off + s.len;
            if end <= from || s.off >= to {
                segs.push(*s);
                continue;
            }
            if s.off < from {
                segs.push(Seg {
                    len: from - s.off,
                    ..*s
                });
            }
            if end > to {
                segs.push(Seg {
                    off: to,
                    len: end - to,
                    seed: s.seed,
                    from: s.from + (to - s.off),
                });
            }
        }
        Self {
            len: self.len,
            segs,
        }
    }

    fn bytes(&self) -> Vec<u8> {
        let mut out = vec![0u8; self.len as usize];
        for s in &self.segs {
            fill(
                s.seed,
                s.from,
                &mut out[s.off as usize..(s.off + s.len) as usize],
            );
        }
        out
    }
}

// ---------------------------------------------------------------------------------------------
// The model.

#[derive(Clone, Debug, Default)]
struct FileModel {
    content: Content,
    /// Acknowledged operations on this file (what losing it takes back).
    ops: u64,
}

/// What a world allows at one path: content `a`, or with `b` (the outcome of a failed operation)
/// a length between theirs and each byte `a`'s or `b`'s.
#[derive(Clone, Debug)]
struct Expect {
    a: Content,
    b: Option<Content>,
    ops: u64,
}

impl Expect {
    fn exact(f: &FileModel) -> Self {
        Self {
            a: f.content.clone(),
            b: None,
            ops: f.ops,
        }
    }

    fn max_len(&self) -> u64 {
        self.a.len.max(self.b.as_ref().map_or(0, |b| b.len))
    }

    /// Where `data` (of a file whose size says `size`) leaves what this allows: the first bad
    /// offset and how many bytes are bad; `None` if allowed.
    fn mismatch(&self, size: u64, data: &[u8]) -> Option<(u64, u64)> {
        let a = self.a.bytes();
        let b = self.b.as_ref().map(Content::bytes);
        let b_len = b.as_ref().map_or(a.len(), Vec::len) as u64;
        let lo = (a.len() as u64).min(b_len);
        let mut first: Option<u64> = None;
        let mut bad = 0u64;
        // Block by block: equal blocks (the common case) cost a memcmp.
        const BLOCK: usize = 4096;
        let same = |x: &[u8], at: usize, blk: &[u8]| x.get(at..at + blk.len()) == Some(blk);
        for (k, blk) in data.chunks(BLOCK).enumerate() {
            let at = k * BLOCK;
            if same(&a, at, blk) || b.as_ref().is_some_and(|b| same(b, at, blk)) {
                continue;
            }
            for (i, c) in (at..).zip(blk) {
                if a.get(i) != Some(c) && b.as_ref().and_then(|b| b.get(i)) != Some(c) {
                    first.get_or_insert(i as u64);
                    bad += 1;
                }
            }
        }
        let n = data.len() as u64;
        let mut flag = |at: u64, count: u64| {
            first = Some(first.map_or(at, |f| f.min(at)));
            bad += count;
        };
        if n < lo {
            flag(n, lo - n);
        }
        // A size the bytes read do not bear out (a short read, or a size past what was read).
        if size != n {
            flag(size.min(n), size.abs_diff(n));
        }
        first.map(|f| (f, bad))
    }
}

/// One allowed outcome of an operation: the state of each of its paths (`None`: absent).
#[derive(Clone, Debug)]
struct World {
    paths: Vec<(String, Option<Expect>)>,
    /// Allowed, but worth reporting when it is what happened.
    note: Option<Finding>,
}

impl World {
    fn at(path: &str, e: Option<Expect>) -> Self {
        Self {
            paths: vec![(path.to_string(), e)],
            note: None,
        }
    }

    fn two(p: &str, e: Option<Expect>, q: &str, f: Option<Expect>) -> Self {
        Self {
            paths: vec![(p.to_string(), e), (q.to_string(), f)],
            note: None,
        }
    }

    fn expect(&self, path: &str) -> Option<&Expect> {
        self.paths
            .iter()
            .find(|(p, _)| p == path)
            .and_then(|(_, e)| e.as_ref())
    }
}

/// One client's knowledge. Paths are relative to the client's directory (`a/f12`).
#[derive(Clone, Debug, Default)]
struct ClientModel {
    /// Files whose state is certain.
    files: BTreeMap<String, FileModel>,
    /// For each failed operation, its worlds; their paths are in no other entry.
    uncertain: Vec<Vec<World>>,
    next_name: u64,
}

#[derive(Debug)]
struct AckLog {
    out: io::BufWriter<std::fs::File>,
    lines: u64,
    /// The first write error (the log stops there; `flush_log` reports it).
    error: Option<io::Error>,
}

#[derive(Serialize)]
struct AckLine<'a> {
    t_ms: u64,
    client: usize,
    op: &'a str,
    path: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    from: Option<&'a str>,
    offset: Option<u64>,
    len: Option<u64>,
    size: Option<u64>,
    crc32c: Option<u32>,
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

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

fn unknown(why: &str) -> FsError {
    FsError::Unavailable(CallError::Unknown(why.into()))
}

fn not_found(e: &FsError) -> bool {
    matches!(e, FsError::Meta(MetaError::NotFound))
}

async fn timed<T>(fut: impl Future<Output = FsResult<T>>) -> FsResult<T> {
    tokio::time::timeout(CALL_TIMEOUT, fut)
        .await
        .unwrap_or_else(|_| Err(unknown("timed out")))
}

/// Resolves when `stop` turns true (never if its sender is gone without saying so).
async fn until_stopped(stop: &mut watch::Receiver<bool>) {
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

// ---------------------------------------------------------------------------------------------
// A client.

struct Client<'w, F> {
    w: &'w Workload,
    id: usize,
    fs: &'w F,
    stop: watch::Receiver<bool>,
    rng: Rng,
    /// The inodes of `a` and `b`.
    dirs: [Ino; 2],
    /// The current step failed somewhere: back off before the next.
    failed: bool,
    base: String,
}

impl<F: FileSystem + Sync> Client<'_, F> {
    fn stopped(&self) -> bool {
        *self.stop.borrow()
    }

    /// `fut` with a timeout, abandoned when the workload stops.
    async fn call<T>(&self, fut: impl Future<Output = FsResult<T>>) -> FsResult<T> {
        let mut stop = self.stop.clone();
        tokio::select! {
            biased;
            r = timed(fut) => r,
            () = until_stopped(&mut stop) => Err(unknown("stopped")),
        }
    }

    async fn pause(&self, d: Duration) {
        let mut stop = self.stop.clone();
        tokio::select! {
            () = tokio::time::sleep(d) => {}
            () = until_stopped(&mut stop) => {}
        }
    }

    async fn setup(&mut self) -> anyhow::Result<()> {
        let mut dir = ROOT_INO;
        let mut names = self.w.root_names();
        names.push(format!("c{}", self.id));
        for n in &names {
            dir = self.ensure_dir(dir, n).await?;
        }
        for (i, sub) in SUBDIRS.iter().enumerate() {
            self.dirs[i] = self.ensure_dir(dir, sub).await?;
        }
        Ok(())
    }

    /// The directory `parent/name`, made if missing; retried (a directory whose mkdir had an
    /// unknown outcome is found by the next lookup).
    async fn ensure_dir(&mut self, parent: Ino, name: &str) -> anyhow::Result<Ino> {
        let mut last = String::from("stopped");
        for i in 0..SETUP_TRIES {
            if self.stopped() {
                break;
            }
            if i > 0 {
                self.pause(SETUP_GAP).await;
            }
            let r = match self.call(self.fs.lookup(parent, name.as_bytes())).await {
                Err(e) if not_found(&e) => {
                    let caller = Caller::default();
                    self.call(self.fs.mkdir(parent, name.as_bytes(), 0o755, caller))
                        .await
                        .map(|e| e.attr)
                }
                r => r,
            };
            match r {
                Ok(a) if a.kind == FileType::Dir => return Ok(a.ino),
                Ok(_) => anyhow::bail!("{name} is not a directory"),
                Err(FsError::Meta(MetaError::Exists)) => {}
                Err(e) => {
                    self.count_failure();
                    last = e.to_string();
                }
            }
        }
        anyhow::bail!("client {}: cannot make directory {name}: {last}", self.id)
    }

    async fn run(&mut self) {
        let limit = self.w.cfg.ops_limit.unwrap_or(u64::MAX);
        for _ in 0..limit {
            if self.stopped() {
                break;
            }
            self.failed = false;
            self.step().await;
            if self.failed {
                // Rate limiting while the cluster is sick, not synchronization.
                let ms = self.rng.range(50, 200);
                self.pause(Duration::from_millis(ms)).await;
            }
            // A fast file system must not starve the other tasks of the runtime.
            tokio::task::yield_now().await;
        }
    }

    async fn step(&mut self) {
        let (count, full) = {
            let m = self.model();
            (
                m.files.len(),
                m.files.len() >= self.w.cfg.max_files_per_client,
            )
        };
        let roll = self.rng.below(100);
        if count == 0 || (roll < 24 && !full) {
            return self.create(roll % 24 >= 20).await;
        }
        let Some((rel, f)) = self.pick() else { return };
        match roll {
            0..24 | 76..84 => self.unlink(rel, f).await,
            24..42 => self.overwrite(rel, f, false).await,
            42..56 => self.overwrite(rel, f, true).await,
            56..64 => self.truncate(rel, f).await,
            64..76 => self.rename(rel, f).await,
            _ => self.read_back(rel, f).await,
        }
    }

    // Model bookkeeping (never across an await: the guard is not `Send`).

    fn model(&self) -> MutexGuard<'_, ClientModel> {
        lock(&self.w.models[self.id])
    }

    fn full(&self, rel: &str) -> String {
        format!("{}/{rel}", self.base)
    }

    fn fresh(&mut self) -> String {
        let dir = SUBDIRS[self.rng.below(2) as usize];
        let mut m = self.model();
        m.next_name += 1;
        format!("{dir}/f{}", m.next_name)
    }

    fn pick(&mut self) -> Option<(String, FileModel)> {
        let len = self.model().files.len() as u64;
        let i = self.rng.below(len) as usize;
        let m = self.model();
        m.files.iter().nth(i).map(|(p, f)| (p.clone(), f.clone()))
    }

    fn loc<'r>(&self, rel: &'r str) -> (Ino, &'r [u8]) {
        let (dir, name) = rel.split_once('/').unwrap_or(("a", rel));
        (self.dirs[usize::from(dir == "b")], name.as_bytes())
    }

    fn settle(&self, rel: &str, f: &FileModel) {
        self.model().files.insert(rel.to_string(), f.clone());
    }

    fn count_failure(&mut self) {
        self.w.stats.failed.fetch_add(1, Relaxed);
        self.failed = true;
    }

    fn fail(&mut self, op: &str, rel: &str, e: &FsError) {
        self.count_failure();
        let path = self.full(rel);
        tracing::warn!(client = self.id, op, path, error = %e, "operation failed");
    }

    /// The operation's paths now have the outcomes `worlds`; the client forgets them.
    fn uncertain(&self, worlds: Vec<World>) {
        let mut m = self.model();
        for w in &worlds {
            for (p, _) in &w.paths {
                m.files.remove(p);
            }
        }
        m.uncertain.push(worlds);
        self.w.stats.uncertain.fetch_add(1, Relaxed);
    }

    /// Counts an acknowledged operation and logs it (`after`: the file's content now; its crc is
    /// computed before taking the log's lock).
    fn ack(
        &self,
        op: &str,
        rel: &str,
        range: Option<(u64, u64)>,
        after: Option<&Content>,
        from: Option<&str>,
    ) {
        let s = &self.w.stats;
        s.acked.fetch_add(1, Relaxed);
        s.acked_bytes.fetch_add(range.map_or(0, |r| r.1), Relaxed);
        let Some(log) = &self.w.log else { return };
        let path = self.full(rel);
        let from = from.map(|f| self.full(f));
        let line = AckLine {
            t_ms: self.w.started.elapsed().as_millis() as u64,
            client: self.id,
            op,
            path: &path,
            from: from.as_deref(),
            offset: range.map(|r| r.0),
            len: range.map(|r| r.1),
            size: after.map(|c| c.len),
            crc32c: after.map(|c| crc32c(&c.bytes())),
        };
        let mut log = lock(log);
        if log.error.is_some() {
            return;
        }
        let r = serde_json::to_writer(&mut log.out, &line)
            .map_err(io::Error::from)
            .and_then(|()| log.out.write_all(b"\n"));
        log.lines += 1;
        let r = r.and_then(|()| {
            if log.lines.is_multiple_of(LOG_FLUSH_LINES) {
                log.out.flush()
            } else {
                Ok(())
            }
        });
        if let Err(e) = r {
            log.error = Some(e);
        }
    }

    // File system helpers.

    async fn write_all(&self, fh: Fh, mut off: u64, mut data: Bytes) -> FsResult<()> {
        while !data.is_empty() {
            let n = self.call(self.fs.write(fh, off, data.clone())).await? as usize;
            if n == 0 {
                return Err(unknown("the file system took no bytes"));
            }
            off += n as u64;
            data = data.slice(n.min(data.len())..);
        }
        Ok(())
    }

    /// Best effort, after a failure or after the acknowledgement: nothing is left to flush.
    async fn release_quietly(&self, fh: Fh) -> bool {
        matches!(
            tokio::time::timeout(CLEANUP_TIMEOUT, self.fs.release(fh)).await,
            Ok(Ok(()))
        )
    }

    /// Opens `rel`: no effect on the file if it fails.
    async fn open(&self, rel: &str, flags: OpenFlags) -> FsResult<Fh> {
        let (dir, name) = self.loc(rel);
        let attr = self.call(self.fs.lookup(dir, name)).await?;
        self.call(self.fs.open(attr.ino, flags)).await
    }

    /// Writes `n` new bytes at `off` of `rel` (open as `fh`; with `append`, at offset 0 on purpose:
    /// the flag must decide), then commits them: fsync, or with `close` (a small file, written in
    /// one to three pieces) flush and release. Acknowledged then; on a failure the file becomes
    /// uncertain between `f` and the attempted content, and `None` is returned.
    #[allow(clippy::too_many_arguments)]
    async fn put(
        &mut self,
        op: &str,
        rel: &str,
        fh: Fh,
        f: FileModel,
        (off, n): (u64, u64),
        close: bool,
        append: bool,
    ) -> Option<FileModel> {
        let seed = self.rng.next();
        let b = f.content.written(off, n, seed);
        let pieces = if close { self.rng.range(1, 3) } else { 1 };
        let data = stream(seed, n);
        let r = async {
            let mut at = 0;
            for i in 1..=pieces {
                let end = n * i / pieces;
                let piece = data.slice(at as usize..end as usize);
                let to = if append { 0 } else { off + at };
                self.write_all(fh, to, piece).await?;
                at = end;
            }
            if !close {
                return self.call(self.fs.fsync(fh)).await;
            }
            self.call(self.fs.flush(fh)).await?;
            self.call(self.fs.release(fh)).await
        }
        .await;
        if let Err(e) = r {
            self.release_quietly(fh).await;
            self.fail(op, rel, &e);
            let e = Expect {
                a: f.content,
                b: Some(b),
                ops: f.ops,
            };
            self.uncertain(vec![World::at(rel, Some(e))]);
            return None;
        }
        let f = FileModel {
            content: b,
            ops: f.ops + 1,
        };
        self.settle(rel, &f);
        self.ack(op, rel, Some((off, n)), Some(&f.content), None);
        Some(f)
    }

    /// A small file (NetFs puts files closed under 128 KiB in tiny extents), or a big one: appends
    /// of 128 KiB – 1 MiB, each acknowledged by its fsync.
    async fn create(&mut self, big: bool) {
        let rel = self.fresh();
        let (dir, name) = self.loc(&rel);
        let caller = Caller::default();
        let created = self.call(self.fs.create(dir, name, 0o644, caller, OpenFlags::WRITE));
        let fh = match created.await {
            Ok((_, fh)) => fh,
            Err(e) => {
                self.fail("create", &rel, &e);
                // No file, or an empty one.
                let empty = Expect::exact(&FileModel::default());
                return self.uncertain(vec![World::at(&rel, None), World::at(&rel, Some(empty))]);
            }
        };
        if !big {
            // Answered: from here on the file is there, empty or (partly) written.
            let n = self.rng.range(1, 64 * KIB);
            self.put(
                "create",
                &rel,
                fh,
                FileModel::default(),
                (0, n),
                true,
                false,
            )
            .await;
            return;
        }
        let max = self.w.cfg.max_file_bytes;
        let target = self.rng.range((128 * KIB).min(max), max);
        let mut f = FileModel {
            content: Content::default(),
            ops: 1,
        };
        self.settle(&rel, &f);
        self.ack("create", &rel, None, Some(&f.content), None);
        while f.content.len < target && !self.stopped() {
            let off = f.content.len;
            let n = self.rng.range(128 * KIB, MIB).min(target - off);
            match self
                .put("append", &rel, fh, f, (off, n), false, false)
                .await
            {
                Some(next) => f = next,
                None => return,
            }
        }
        if !self.release_quietly(fh).await {
            self.count_failure();
        }
    }

    /// Overwrites a range (sometimes past the end, leaving a hole) or, with `append`, appends
    /// through an `O_APPEND` handle.
    async fn overwrite(&mut self, rel: String, f: FileModel, append: bool) {
        let len = f.content.len;
        let cap = self.w.cfg.max_file_bytes.max(len);
        let off = if append {
            len
        } else if len < cap && self.rng.below(8) == 0 {
            len + self.rng.below((cap - len).min(64 * KIB))
        } else {
            self.rng.below(len + 1).min(cap - 1)
        };
        if off >= cap {
            return self.truncate(rel, f).await;
        }
        let n = self.rng.range(1, 256 * KIB).min(cap - off);
        let op = if append { "append" } else { "overwrite" };
        let fh = match self
            .open(
                &rel,
                OpenFlags {
                    append,
                    ..OpenFlags::WRITE
                },
            )
            .await
        {
            Ok(fh) => fh,
            Err(e) => return self.fail(op, &rel, &e),
        };
        let put = self.put(op, &rel, fh, f, (off, n), false, append).await;
        if put.is_some() && !self.release_quietly(fh).await {
            self.count_failure();
        }
    }

    /// Shorter or longer (zeros) through setattr; acknowledged when it returns.
    async fn truncate(&mut self, rel: String, f: FileModel) {
        let len = f.content.len;
        let max = self.w.cfg.max_file_bytes;
        let size = if len > 0 && (len >= max || self.rng.below(2) == 0) {
            self.rng.below(len)
        } else {
            (len + self.rng.range(1, 128 * KIB)).min(max)
        };
        let b = f.content.resized(size);
        let (dir, name) = self.loc(&rel);
        let ino = match self.call(self.fs.lookup(dir, name)).await {
            Ok(a) => a.ino,
            Err(e) => return self.fail("truncate", &rel, &e),
        };
        let set = SetAttr {
            size: Some(size),
            ..SetAttr::default()
        };
        if let Err(e) = self.call(self.fs.setattr(ino, set)).await {
            self.fail("truncate", &rel, &e);
            let e = Expect {
                a: f.content,
                b: Some(b),
                ops: f.ops,
            };
            return self.uncertain(vec![World::at(&rel, Some(e))]);
        }
        let f = FileModel {
            content: b,
            ops: f.ops + 1,
        };
        self.settle(&rel, &f);
        self.ack("truncate", &rel, Some((size, 0)), Some(&f.content), None);
    }

    /// To a fresh name or over another file of this client, in the same or the other directory.
    async fn rename(&mut self, rel: String, f: FileModel) {
        let target = if self.rng.below(3) == 0 {
            self.pick().filter(|(p, _)| *p != rel)
        } else {
            None
        };
        let to = match &target {
            Some((p, _)) => p.clone(),
            None => self.fresh(),
        };
        let ((d0, n0), (d1, n1)) = (self.loc(&rel), self.loc(&to));
        if let Err(e) = self.call(self.fs.rename(d0, n0, d1, n1)).await {
            self.fail("rename", &rel, &e);
            let x = Some(Expect::exact(&f));
            let t = target.map(|(_, t)| Expect::exact(&t));
            let mut worlds = vec![
                World::two(&rel, x.clone(), &to, t.clone()),
                World::two(&rel, None, &to, x.clone()),
            ];
            if t.is_some() {
                worlds.push(World::two(&rel, x.clone(), &to, None));
            }
            let mut both = World::two(&rel, x.clone(), &to, x);
            both.note = Some(Finding::RenameNotAtomic {
                from: self.full(&rel),
                to: self.full(&to),
            });
            worlds.push(both);
            return self.uncertain(worlds);
        }
        let f = FileModel {
            content: f.content,
            ops: f.ops + 1,
        };
        {
            let mut m = self.model();
            m.files.remove(&rel);
            m.files.insert(to.clone(), f.clone());
        }
        self.ack("rename", &to, None, Some(&f.content), Some(&rel));
    }

    async fn unlink(&mut self, rel: String, f: FileModel) {
        let (dir, name) = self.loc(&rel);
        if let Err(e) = self.call(self.fs.unlink(dir, name)).await {
            self.fail("unlink", &rel, &e);
            let a = Some(Expect::exact(&f));
            return self.uncertain(vec![World::at(&rel, a), World::at(&rel, None)]);
        }
        self.model().files.remove(&rel);
        self.ack("unlink", &rel, None, None, None);
    }

    /// Reads a certain file back; a mismatch is a finding (a failed read changes nothing).
    async fn read_back(&mut self, rel: String, f: FileModel) {
        let (dir, name) = self.loc(&rel);
        let r = async {
            let attr = self.call(self.fs.lookup(dir, name)).await?;
            let data = self
                .call(read_file(self.fs, attr.ino, f.content.len + 1))
                .await?;
            Ok::<_, FsError>((attr.size, data))
        }
        .await;
        let (size, data) = match r {
            Ok(x) => x,
            Err(e) => return self.fail("read", &rel, &e),
        };
        let path = self.full(&rel);
        match judge(&path, Some(&Expect::exact(&f)), &Seen::File { size, data }) {
            Some(finding) => {
                tracing::warn!(%finding, "read back during the run");
                lock(&self.w.run_findings).push((finding, f.ops));
            }
            None => {
                self.w.stats.reads_verified.fetch_add(1, Relaxed);
            }
        }
    }
}

/// File `ino` (at most `cap` bytes): open, read until a short read, release.
async fn read_file<F: FileSystem>(fs: &F, ino: Ino, cap: u64) -> FsResult<Vec<u8>> {
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

// ---------------------------------------------------------------------------------------------
// The checker.

/// What the checker found at a path.
#[derive(Debug)]
enum Seen {
    Absent,
    File { size: u64, data: Vec<u8> },
}

/// Why `seen` is not what `want` allows (`None`: absent); `None` if it is.
fn judge(path: &str, want: Option<&Expect>, seen: &Seen) -> Option<Finding> {
    let path = path.to_string();
    match (want, seen) {
        (None, Seen::Absent) => None,
        (None, Seen::File { size, .. }) => Some(Finding::Unexpected { path, size: *size }),
        (Some(w), Seen::Absent) => Some(Finding::Missing {
            path,
            acked_size: w.a.len,
        }),
        (Some(w), Seen::File { size, data }) => {
            w.mismatch(*size, data)
                .map(|(offset, differing_bytes)| Finding::Wrong {
                    path,
                    offset,
                    differing_bytes,
                    expected_size: w.a.len,
                    actual_size: *size,
                })
        }
    }
}

/// Retries transient errors; "not found" is an answer.
async fn retry<T, Fut: Future<Output = FsResult<T>>>(mut f: impl FnMut() -> Fut) -> FsResult<T> {
    let mut last = unknown("not tried");
    for i in 0..VERIFY_TRIES {
        if i > 0 {
            tokio::time::sleep(VERIFY_GAP).await;
        }
        match f().await {
            Ok(v) => return Ok(v),
            Err(e) if not_found(&e) => return Err(e),
            Err(e) => last = e,
        }
    }
    Err(last)
}

async fn resolve<F: FileSystem>(fs: &F, names: &[String]) -> FsResult<Attr> {
    let mut cur = timed(fs.getattr(ROOT_INO)).await?;
    for n in names {
        cur = timed(fs.lookup(cur.ino, n.as_bytes())).await?;
    }
    Ok(cur)
}

async fn list_all<F: FileSystem>(fs: &F, dir: Ino) -> FsResult<Vec<DirEntryPlus>> {
    let mut all: Vec<DirEntryPlus> = Vec::new();
    loop {
        let after = all.last().map(|e| e.entry.name.clone());
        let page = timed(fs.readdir(dir, after, PAGE)).await?;
        let done = page.len() < PAGE as usize;
        all.extend(page);
        if done {
            return Ok(all);
        }
    }
}

struct Check<'f, F> {
    fs: &'f F,
    report: Report,
    /// Full path → ops lost with it.
    lost: BTreeMap<String, u64>,
}

impl<F: FileSystem + Sync> Check<'_, F> {
    fn push(&mut self, f: Finding, ops: u64) {
        if let Finding::Missing { path, .. } | Finding::Wrong { path, .. } = &f {
            self.lost.insert(path.clone(), 1 + ops);
        }
        self.report.findings.push(f);
    }

    async fn client(&mut self, base: &str, dir: &[String], model: ClientModel) {
        let fs = self.fs;
        // What is there: relative path → (inode, size).
        let mut present: BTreeMap<String, (Ino, u64)> = BTreeMap::new();
        let mut blind: Vec<String> = Vec::new();
        for sub in SUBDIRS {
            let mut names = dir.to_vec();
            names.push(sub.to_string());
            let names = &names;
            let listed = retry(move || async move {
                let d = resolve(fs, names).await?;
                list_all(fs, d.ino).await
            });
            match listed.await {
                Ok(entries) => {
                    for e in entries {
                        let name = String::from_utf8_lossy(&e.entry.name);
                        let size = e.attr.map_or(0, |a| a.size);
                        present.insert(format!("{sub}/{name}"), (e.entry.ino, size));
                    }
                }
                // Never made (the client gave up): nothing is there.
                Err(e) if not_found(&e) => {}
                Err(e) => {
                    blind.push(format!("{sub}/"));
                    let path = format!("{base}/{sub}");
                    self.push(
                        Finding::Unreadable {
                            path,
                            error: e.to_string(),
                        },
                        0,
                    );
                }
            }
        }
        let mut groups: Vec<Vec<World>> = model
            .files
            .iter()
            .map(|(p, f)| vec![World::at(p, Some(Expect::exact(f)))])
            .collect();
        groups.extend(model.uncertain);
        'groups: for worlds in groups {
            let mut paths: Vec<String> = worlds
                .iter()
                .flat_map(|w| w.paths.iter().map(|(p, _)| p.clone()))
                .collect();
            paths.sort();
            paths.dedup();
            // Taken out of `present` first: what is left at the end is unexpected.
            let found: Vec<_> = paths.into_iter().map(|p| (present.remove(&p), p)).collect();
            if found
                .iter()
                .any(|(_, p)| blind.iter().any(|b| p.starts_with(b)))
            {
                continue;
            }
            let mut seen = BTreeMap::new();
            for (there, p) in found {
                let Some((ino, _)) = there else {
                    seen.insert(p, Seen::Absent);
                    continue;
                };
                let cap = worlds
                    .iter()
                    .filter_map(|w| w.expect(&p))
                    .map(Expect::max_len)
                    .max()
                    .unwrap_or(0)
                    + 1;
                let read = retry(move || async move {
                    let attr = timed(fs.getattr(ino)).await?;
                    Ok((attr.size, read_file(fs, ino, cap).await?))
                });
                match read.await {
                    Ok((size, data)) => {
                        self.report.files_checked += 1;
                        self.report.bytes_checked += data.len() as u64;
                        seen.insert(p, Seen::File { size, data });
                    }
                    Err(e) => {
                        let path = format!("{base}/{p}");
                        self.push(
                            Finding::Unreadable {
                                path,
                                error: e.to_string(),
                            },
                            0,
                        );
                        continue 'groups;
                    }
                }
            }
            self.judge_group(base, &worlds, &seen);
        }
        for (p, (_, size)) in present {
            let path = format!("{base}/{p}");
            self.push(Finding::Unexpected { path, size }, 0);
        }
    }

    /// Accepts `seen` if some world allows it; else reports the world it is closest to.
    fn judge_group(&mut self, base: &str, worlds: &[World], seen: &BTreeMap<String, Seen>) {
        let mut best: Option<Vec<(Finding, u64)>> = None;
        for w in worlds {
            let misses: Vec<(Finding, u64)> = seen
                .iter()
                .filter_map(|(p, s)| {
                    let e = w.expect(p);
                    judge(&format!("{base}/{p}"), e, s).map(|f| (f, e.map_or(0, |e| e.ops)))
                })
                .collect();
            if misses.is_empty() {
                if let Some(n) = &w.note {
                    self.push(n.clone(), 0);
                }
                return;
            }
            if best.as_ref().is_none_or(|b| misses.len() < b.len()) {
                best = Some(misses);
            }
        }
        for (f, ops) in best.unwrap_or_default() {
            self.push(f, ops);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::AtomicU32;

    use nacre_client::{Entry, StatFs};
    use nacre_meta::{DirEntry, XattrMode};

    use super::*;

    #[derive(Debug)]
    enum Node {
        Dir(BTreeMap<Vec<u8>, u64>),
        File(Vec<u8>),
    }

    #[derive(Debug)]
    struct Mem {
        nodes: BTreeMap<u64, Node>,
        handles: BTreeMap<u64, (u64, OpenFlags)>,
        next: u64,
        rng: Rng,
    }

    /// A small, correct in-memory file system (writes apply at once). With `fault_permille` set,
    /// that share of calls fail: half before applying, half after (a write then applies a
    /// random prefix), and a tenth of those never answer (the caller's timeout or stop ends them).
    #[derive(Debug)]
    struct MemFs {
        m: Mutex<Mem>,
        fault_permille: AtomicU32,
    }

    fn enoent() -> FsError {
        MetaError::NotFound.into()
    }

    fn injected() -> FsError {
        unknown("injected")
    }

    impl Mem {
        fn attr(&self, ino: u64) -> FsResult<Attr> {
            let (kind, size) = match self.nodes.get(&ino).ok_or_else(enoent)? {
                Node::Dir(_) => (FileType::Dir, 0),
                Node::File(d) => (FileType::File, d.len() as u64),
            };
            Ok(Attr {
                ino: Ino(ino),
                kind,
                mode: 0o644,
                uid: 0,
                gid: 0,
                size,
                nlink: 1,
                rdev: 0,
                atime: 0,
                mtime: 0,
                ctime: 0,
                generation: 0,
            })
        }

        fn dir(&mut self, ino: Ino) -> FsResult<&mut BTreeMap<Vec<u8>, u64>> {
            match self.nodes.get_mut(&ino.0) {
                Some(Node::Dir(d)) => Ok(d),
                Some(_) => Err(MetaError::NotDir.into()),
                None => Err(enoent()),
            }
        }

        fn child(&mut self, parent: Ino, name: &[u8]) -> FsResult<u64> {
            self.dir(parent)?.get(name).copied().ok_or_else(enoent)
        }

        fn add(&mut self, parent: Ino, name: &[u8], node: Node) -> FsResult<Attr> {
            if self.dir(parent)?.contains_key(name) {
                return Err(MetaError::Exists.into());
            }
            self.next += 1;
            let ino = self.next;
            self.nodes.insert(ino, node);
            self.dir(parent)?.insert(name.to_vec(), ino);
            self.attr(ino)
        }

        fn open(&mut self, ino: u64, flags: OpenFlags) -> Fh {
            self.next += 1;
            self.handles.insert(self.next, (ino, flags));
            Fh(self.next)
        }

        fn file(&mut self, fh: Fh) -> FsResult<(&mut Vec<u8>, OpenFlags)> {
            let (ino, flags) = *self.handles.get(&fh.0).ok_or(FsError::BadHandle(fh.0))?;
            match self.nodes.get_mut(&ino) {
                Some(Node::File(d)) => Ok((d, flags)),
                _ => Err(MetaError::IsDir.into()),
            }
        }

        /// The directory and name of a volume path, and the inode there.
        fn at(&mut self, path: &str) -> (Ino, Vec<u8>, Option<u64>) {
            let names: Vec<&str> = path.split('/').filter(|c| !c.is_empty()).collect();
            let (last, dirs) = names.split_last().unwrap();
            let mut dir = ROOT_INO;
            for d in dirs {
                dir = Ino(self.child(dir, d.as_bytes()).unwrap());
            }
            let ino = self.child(dir, last.as_bytes()).ok();
            (dir, last.as_bytes().to_vec(), ino)
        }

        fn data(&mut self, path: &str) -> &mut Vec<u8> {
            let ino = self.at(path).2.unwrap();
            match self.nodes.get_mut(&ino) {
                Some(Node::File(d)) => d,
                _ => panic!("{path} is not a file"),
            }
        }
    }

    impl MemFs {
        fn new(seed: u64) -> Arc<Self> {
            let root = (ROOT_INO.0, Node::Dir(BTreeMap::new()));
            Arc::new(Self {
                m: Mutex::new(Mem {
                    nodes: BTreeMap::from([root]),
                    handles: BTreeMap::new(),
                    next: ROOT_INO.0,
                    rng: Rng(seed),
                }),
                fault_permille: AtomicU32::new(0),
            })
        }

        /// Applies `f` (told whether the call is going to fail anyway) under the fault plan.
        async fn op<T>(&self, f: impl FnOnce(&mut Mem, bool) -> FsResult<T>) -> FsResult<T> {
            let p = u64::from(self.fault_permille.load(Relaxed));
            let (r, hang) = {
                let mut m = lock(&self.m);
                match m.rng.below(1000) {
                    x if x >= p => (f(&mut m, false), false),
                    x if x % 2 == 0 => (Err(injected()), false),
                    x => (f(&mut m, true).and(Err(injected())), x < p / 5),
                }
            };
            if hang {
                std::future::pending::<()>().await;
            }
            r
        }
    }

    /// Trait methods the workload never calls.
    macro_rules! unsupported {
        ($($name:ident($($arg:ty),*) -> $t:ty;)*) => {$(
            async fn $name(&self, $(_: $arg),*) -> FsResult<$t> {
                Err(MetaError::Invalid("unsupported".into()).into())
            }
        )*};
    }

    impl FileSystem for MemFs {
        async fn lookup(&self, parent: Ino, name: &[u8]) -> FsResult<Attr> {
            self.op(|m, _| m.child(parent, name).and_then(|i| m.attr(i)))
                .await
        }

        async fn getattr(&self, ino: Ino) -> FsResult<Attr> {
            self.op(|m, _| m.attr(ino.0)).await
        }

        async fn setattr(&self, ino: Ino, set: SetAttr) -> FsResult<Attr> {
            self.op(|m, _| {
                if let (Some(size), Some(Node::File(d))) = (set.size, m.nodes.get_mut(&ino.0)) {
                    d.resize(size as usize, 0);
                }
                m.attr(ino.0)
            })
            .await
        }

        async fn create(
            &self,
            parent: Ino,
            name: &[u8],
            _: u32,
            _: Caller,
            flags: OpenFlags,
        ) -> FsResult<(Entry, Fh)> {
            self.op(|m, _| {
                let attr = m.add(parent, name, Node::File(Vec::new()))?;
                let fh = m.open(attr.ino.0, flags);
                Ok((Entry::bare(attr), fh))
            })
            .await
        }

        async fn mkdir(&self, parent: Ino, name: &[u8], _: u32, _: Caller) -> FsResult<Entry> {
            self.op(|m, _| {
                let attr = m.add(parent, name, Node::Dir(BTreeMap::new()))?;
                Ok(Entry::bare(attr))
            })
            .await
        }

        async fn unlink(&self, parent: Ino, name: &[u8]) -> FsResult<Vec<Attr>> {
            self.op(|m, _| {
                m.child(parent, name)?;
                m.dir(parent)?.remove(name);
                Ok(Vec::new())
            })
            .await
        }

        async fn rename(
            &self,
            p: Ino,
            name: &[u8],
            np: Ino,
            new_name: &[u8],
        ) -> FsResult<Vec<Attr>> {
            self.op(|m, _| {
                let ino = m.child(p, name)?;
                m.dir(np)?;
                m.dir(p)?.remove(name);
                m.dir(np)?.insert(new_name.to_vec(), ino);
                Ok(Vec::new())
            })
            .await
        }

        async fn readdir(
            &self,
            dir: Ino,
            after: Option<Vec<u8>>,
            limit: u32,
        ) -> FsResult<Vec<DirEntryPlus>> {
            self.op(|m, _| {
                let limit = if limit == 0 {
                    usize::MAX
                } else {
                    limit as usize
                };
                let after = after.unwrap_or_default();
                let entries: Vec<(Vec<u8>, u64)> = m
                    .dir(dir)?
                    .iter()
                    .filter(|(n, _)| after.is_empty() || **n > after)
                    .take(limit)
                    .map(|(n, i)| (n.clone(), *i))
                    .collect();
                let plus = entries.into_iter().map(|(name, ino)| {
                    let attr = m.attr(ino).ok();
                    let kind = attr.as_ref().map_or(FileType::File, |a| a.kind);
                    let entry = DirEntry {
                        name,
                        ino: Ino(ino),
                        kind,
                    };
                    DirEntryPlus { entry, attr }
                });
                Ok(plus.collect())
            })
            .await
        }

        async fn open(&self, ino: Ino, flags: OpenFlags) -> FsResult<Fh> {
            self.op(|m, _| m.attr(ino.0).map(|_| m.open(ino.0, flags)))
                .await
        }

        async fn read(&self, fh: Fh, offset: u64, len: u32) -> FsResult<Bytes> {
            self.op(|m, _| {
                let (d, _) = m.file(fh)?;
                let from = (offset as usize).min(d.len());
                let to = (from + len as usize).min(d.len());
                Ok(Bytes::copy_from_slice(&d[from..to]))
            })
            .await
        }

        async fn write(&self, fh: Fh, offset: u64, data: Bytes) -> FsResult<u32> {
            self.op(|m, failing| {
                let n = if failing {
                    m.rng.below(data.len() as u64 + 1) as usize
                } else {
                    data.len()
                };
                let (d, flags) = m.file(fh)?;
                let at = if flags.append {
                    d.len()
                } else {
                    offset as usize
                };
                if d.len() < at + n {
                    d.resize(at + n, 0);
                }
                d[at..at + n].copy_from_slice(&data[..n]);
                Ok(n as u32)
            })
            .await
        }

        async fn flush(&self, fh: Fh) -> FsResult<()> {
            self.op(|m, _| m.file(fh).map(|_| ())).await
        }

        async fn fsync(&self, fh: Fh) -> FsResult<()> {
            self.flush(fh).await
        }

        async fn release(&self, fh: Fh) -> FsResult<()> {
            self.op(|m, _| {
                let h = m.handles.remove(&fh.0);
                h.map(|_| ()).ok_or(FsError::BadHandle(fh.0))
            })
            .await
        }

        unsupported! {
            symlink(Ino, &[u8], &[u8], Caller) -> Entry;
            link(Ino, Ino, &[u8]) -> Entry;
            rmdir(Ino, &[u8]) -> Vec<Attr>;
            readlink(Ino) -> Vec<u8>;
            statfs() -> StatFs;
            getxattr(Ino, &[u8]) -> Vec<u8>;
            setxattr(Ino, &[u8], &[u8], XattrMode) -> ();
            listxattr(Ino) -> Vec<Vec<u8>>;
            removexattr(Ino, &[u8]) -> ();
        }
    }

    fn config(clients: usize, seed: u64, ops: Option<u64>) -> WorkloadConfig {
        WorkloadConfig {
            clients,
            seed,
            root: "check".into(),
            max_file_bytes: 384 * KIB,
            max_files_per_client: 12,
            ops_limit: ops,
        }
    }

    /// Runs every client of `w` on `fs` as tasks; `stop_after` acknowledged ops, stops them.
    async fn run(w: &Arc<Workload>, fs: &Arc<MemFs>, stop_after: Option<u64>) {
        let (tx, rx) = watch::channel(false);
        let mut set = tokio::task::JoinSet::new();
        for id in 0..w.cfg.clients {
            let (w, fs, rx) = (w.clone(), fs.clone(), rx.clone());
            set.spawn(async move { w.run_client(id, &*fs, rx).await });
        }
        if let Some(n) = stop_after {
            // Sleeping, not yielding: paused time moves only when every task waits, and the
            // clients' hung calls need it to move.
            while w.stats().snapshot().acked < n {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            tx.send(true).unwrap();
        }
        while let Some(r) = set.join_next().await {
            r.unwrap();
        }
        assert_eq!(w.stats().snapshot().gave_up, 0);
    }

    #[tokio::test(start_paused = true)]
    async fn a_run_without_faults_checks_clean() {
        let fs = MemFs::new(1);
        let log = tempfile::NamedTempFile::new().unwrap();
        let cfg = config(3, 7, Some(300));
        let w = Arc::new(Workload::new(cfg, Some(log.path().to_path_buf())).unwrap());
        run(&w, &fs, None).await;
        let r = w.verify(&*fs).await;
        assert!(r.findings.is_empty(), "{r}");
        let s = w.stats().snapshot();
        assert_eq!((s.failed, s.uncertain), (0, 0));
        assert!(s.reads_verified > 10 && s.acked_bytes > 0, "{s:?}");
        assert_eq!(r.acked_ops, s.acked);
        assert!(r.acked_ops > 300 && r.files_checked > 10, "{r}");
        // One JSON line per acknowledged op.
        let text = std::fs::read_to_string(log.path()).unwrap();
        assert_eq!(text.lines().count() as u64, s.acked);
        let first: serde_json::Value = serde_json::from_str(text.lines().next().unwrap()).unwrap();
        assert!(
            first["crc32c"].is_u64() && first["path"].is_string(),
            "{first}"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn injected_failures_leave_only_allowed_outcomes() {
        for seed in 1..=2 {
            let fs = MemFs::new(seed);
            fs.fault_permille.store(150, Relaxed);
            let w = Arc::new(Workload::new(config(3, seed, Some(300)), None).unwrap());
            run(&w, &fs, None).await;
            fs.fault_permille.store(0, Relaxed);
            let r = w.verify(&*fs).await;
            assert!(r.findings.is_empty(), "seed {seed}: {r}");
            let s = w.stats().snapshot();
            assert!(s.failed > 50 && s.uncertain > 20 && s.acked > 100, "{s:?}");

            // A byte that is neither the acknowledged nor the attempted one is found, in an
            // uncertain file too (a zero is not acceptable just because writes failed).
            let (path, at) = {
                let m = lock(&w.models[0]);
                let (rel, e, at) = m
                    .uncertain
                    .iter()
                    .filter(|ws| ws.len() == 1)
                    .filter_map(|ws| ws[0].paths[0].1.as_ref().map(|e| (&ws[0].paths[0].0, e)))
                    .find_map(|(rel, e)| {
                        let len = e.a.len.min(e.b.as_ref().map_or(0, |b| b.len));
                        (len > 0).then_some((rel.clone(), e.clone(), len / 2))
                    })
                    .expect("an uncertain write");
                let (a, b) = (e.a.bytes(), e.b.as_ref().unwrap().bytes());
                let v = (0..=255u8).find(|v| *v != a[at as usize] && *v != b[at as usize]);
                (format!("/check/c0/{rel}"), (at, v.unwrap()))
            };
            {
                let mut m = lock(&fs.m);
                let d = m.data(&path);
                d[at.0 as usize] = at.1;
            }
            let r = w.verify(&*fs).await;
            assert!(
                matches!(&r.findings[..], [Finding::Wrong { path: p, offset, .. }]
                    if *p == path && *offset == at.0),
                "{r}"
            );
        }
    }

    #[tokio::test(start_paused = true)]
    async fn stopping_abandons_ops_without_losing_any() {
        let fs = MemFs::new(9);
        fs.fault_permille.store(100, Relaxed);
        let w = Arc::new(Workload::new(config(4, 9, None), None).unwrap());
        run(&w, &fs, Some(400)).await;
        fs.fault_permille.store(0, Relaxed);
        let r = w.verify(&*fs).await;
        assert!(r.findings.is_empty(), "{r}");
        assert!(r.acked_ops >= 400, "{r}");
    }

    #[tokio::test(start_paused = true)]
    async fn real_losses_are_found() {
        let fs = MemFs::new(5);
        let w = Arc::new(Workload::new(config(1, 5, Some(300)), None).unwrap());
        run(&w, &fs, None).await;
        let files: Vec<(String, FileModel)> = lock(&w.models[0])
            .files
            .iter()
            .filter(|(_, f)| f.content.len >= 2)
            .map(|(p, f)| (format!("/check/c0/{p}"), f.clone()))
            .take(3)
            .collect();
        let [(flip, f1), (gone, f2), (short, f3)] = &files[..] else {
            panic!("too few files: {files:?}");
        };
        let (l1, l2, l3) = (f1.content.len, f2.content.len, f3.content.len);
        {
            let mut m = lock(&fs.m);
            m.data(flip)[l1 as usize / 2] ^= 0x5a;
            m.data(short).truncate(l3 as usize - 1);
            let (dir, name, _) = m.at(gone);
            m.dir(dir).unwrap().remove(&name);
            let a = m.at("/check/c0/a").2.unwrap();
            let stray = m.add(Ino(a), b"stray", Node::File(vec![7; 10])).unwrap();
            assert_eq!(stray.size, 10);
        }
        let r = w.verify(&*fs).await;
        let want = [
            Finding::Wrong {
                path: flip.clone(),
                offset: l1 / 2,
                differing_bytes: 1,
                expected_size: l1,
                actual_size: l1,
            },
            Finding::Missing {
                path: gone.clone(),
                acked_size: l2,
            },
            Finding::Wrong {
                path: short.clone(),
                offset: l3 - 1,
                differing_bytes: 1,
                expected_size: l3,
                actual_size: l3 - 1,
            },
            Finding::Unexpected {
                path: "/check/c0/a/stray".into(),
                size: 10,
            },
        ];
        for f in &want {
            assert!(r.findings.contains(f), "{f} not in\n{r}");
        }
        assert_eq!(r.findings.len(), want.len(), "{r}");
        assert_eq!(r.lost_ops, 3 + f1.ops + f2.ops + f3.ops);
        let shown = r.to_string();
        assert!(
            shown.contains("missing: ") && shown.contains("unexpected: "),
            "{shown}"
        );
    }

    #[test]
    fn a_failed_write_allows_old_or_new_bytes_only() {
        let a = Content::default().written(0, 100, 1);
        let b = a.written(50, 100, 2);
        let e = Expect {
            a: a.clone(),
            b: Some(b.clone()),
            ops: 1,
        };
        let (ab, bb) = (a.bytes(), b.bytes());
        // Every byte from either, any length in between.
        let mut mixed = bb.clone();
        mixed[60..70].copy_from_slice(&ab[60..70]);
        assert_eq!(e.mismatch(150, &mixed), None);
        assert_eq!(e.mismatch(120, &bb[..120]), None);
        assert_eq!(e.mismatch(100, &ab), None);
        // Too short, too long, a zero neither wrote, a size the bytes do not bear out.
        assert_eq!(e.mismatch(99, &ab[..99]), Some((99, 1)));
        let mut long = bb.clone();
        long.push(0);
        assert_eq!(e.mismatch(151, &long), Some((150, 1)));
        let mut zero = mixed.clone();
        let i = (70..150).find(|&i| bb[i] != 0).unwrap();
        zero[i] = 0;
        assert_eq!(e.mismatch(150, &zero), Some((i as u64, 1)));
        assert_eq!(e.mismatch(150, &bb[..140]), Some((140, 10)));
        // Segments cut anywhere keep naming the same bytes.
        let t = b.resized(120).written(10, 5, 3).resized(200);
        let mut want = bb[..120].to_vec();
        want[10..15].copy_from_slice(&stream(3, 5));
        want.resize(200, 0);
        assert_eq!(t.bytes(), want);
    }
}
