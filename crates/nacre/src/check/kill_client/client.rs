//! The client the `kill-client` schedule kills: `nacre check client`, a process of its own with
//! the client a mount runs (`MetaCache` over `NetFs`, configured by the mount's flags: names and
//! small files' data written behind), driving a seeded single-threaded workload of small files
//! in a directory it makes, and journaling every call ([`journal`](super::journal)).

use std::io::{Read as _, Write as _};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use bytes::Bytes;
use clap::Args;
use nacre_api::meta::MetaError;
use nacre_client::{Caller, FileSystem, FsError, FsResult, MetaCache, OpenFlags};
use nacre_msgr::{Messenger, MsgrConfig, TcpTransport};
use nacre_types::Ino;

use super::content::{self, VersionId};
use super::journal::{Op, Record, Writer};
use crate::check::workload::resolve;
use crate::mount::{MountFlags, connect_netfs};

/// Files alive at once: the checker reads at most this many per incarnation.
const MAX_LIVE: usize = 48;
/// What the client writes with: `write(2)` sizes of `cp` and of the kernel's FUSE requests.
const CHUNKS: [u64; 3] = [4 << 10, 32 << 10, 128 << 10];

#[derive(Debug, Args)]
pub struct ClientArgs {
    /// Master addresses (`host:port`, comma-separated).
    #[arg(long, value_delimiter = ',', required = true)]
    master: Vec<String>,
    #[arg(long, default_value = super::super::VOLUME)]
    volume: String,
    /// The volume path of the directory to make and work in (its parent must exist).
    #[arg(long)]
    path: String,
    /// The incarnation's number, in every record of the content it writes.
    #[arg(long)]
    incarnation: u32,
    /// The journal (a local file, created).
    #[arg(long)]
    journal: PathBuf,
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Stop after this many calls (default: until killed).
    #[arg(long)]
    ops: Option<u64>,
    /// The mount's flags; those that configure its client apply (`--sync-meta`,
    /// `--flush-delay-ms`, `--dirty-max`, `--attr-ttl`, `--entry-ttl`).
    #[command(flatten)]
    mount: MountFlags,
}

/// Why the workload stopped.
#[derive(Debug, thiserror::Error)]
pub enum StepError {
    /// A call failed (journaled as `fail`).
    #[error("{op}: {error}")]
    Call { op: String, error: FsError },
    #[error("journal: {0}")]
    Journal(#[from] std::io::Error),
    #[error(transparent)]
    Content(#[from] content::TooLarge),
}

/// `nacre check client`: prints `ready` once its directory exists, then runs until killed, a
/// call fails (exit 1), `--ops` calls are done, or its standard input closes (the harness is
/// gone).
pub fn run(a: ClientArgs) -> anyhow::Result<()> {
    std::thread::spawn(|| {
        let mut b = [0u8; 64];
        while matches!(std::io::stdin().read(&mut b), Ok(n) if n > 0) {}
        std::process::exit(2);
    });
    crate::runtime()?.block_on(async move {
        let msgr = Messenger::new(
            "check-client",
            MsgrConfig {
                workers: 1,
                ..MsgrConfig::default()
            },
            Arc::new(TcpTransport),
        )?;
        let netfs = connect_netfs(&msgr, a.master.clone(), &a.volume, &a.mount).await?;
        let fs = MetaCache::with_config(netfs, a.mount.cache_config()?);
        let names: Vec<String> = a
            .path
            .split('/')
            .filter(|c| !c.is_empty())
            .map(String::from)
            .collect();
        let (name, parent) = names.split_last().context("--path names no directory")?;
        let parent = resolve(&fs, parent).await?.ino;
        let dir = fs
            .mkdir(parent, name.as_bytes(), 0o755, Caller::default())
            .await
            .with_context(|| format!("cannot make {}", a.path))?
            .attr
            .ino;
        let mut journal = Writer::create(&a.journal)
            .with_context(|| format!("cannot create {}", a.journal.display()))?;
        journal.put(&Record::Header { inc: a.incarnation })?;
        let mut out = std::io::stdout();
        writeln!(out, "ready")?;
        out.flush()?;
        let mut w = Runner::new(&fs, dir, a.incarnation, a.seed, journal);
        w.run(a.ops.unwrap_or(u64::MAX)).await?;
        Ok(())
    })
}

/// A file alive in the directory.
#[derive(Clone, Copy, Debug)]
struct Live {
    file: u32,
    ino: Ino,
    version: u32,
}

/// The workload: one call at a time, each journaled before and after.
#[derive(Debug)]
pub struct Runner<'f, F> {
    fs: &'f F,
    dir: Ino,
    inc: u32,
    rng: fastrand::Rng,
    journal: Writer,
    live: Vec<Live>,
    next_file: u32,
}

impl<'f, F: FileSystem + Sync> Runner<'f, F> {
    pub fn new(fs: &'f F, dir: Ino, inc: u32, seed: u64, journal: Writer) -> Self {
        Self {
            fs,
            dir,
            inc,
            rng: fastrand::Rng::with_seed(seed),
            journal,
            live: Vec::new(),
            next_file: 0,
        }
    }

    /// Runs `ops` steps, or until a call fails (journaled as `fail`, returned).
    pub async fn run(&mut self, ops: u64) -> Result<(), StepError> {
        for _ in 0..ops {
            self.step().await?;
        }
        Ok(())
    }

    async fn step(&mut self) -> Result<(), StepError> {
        let roll = self.rng.u32(..100);
        let full = self.live.len() >= MAX_LIVE;
        if self.live.is_empty() || (roll < 40 && !full) {
            self.next_file += 1;
            let file = self.next_file;
            return self.write(file, None, roll.is_multiple_of(8)).await;
        }
        let k = self.rng.usize(..self.live.len());
        let l = self.live[k];
        match roll {
            // A full directory shrinks.
            0..40 | 65..80 => self.unlink(k).await,
            40..65 => self.write(l.file, Some(k), roll.is_multiple_of(8)).await,
            80..94 => self.fsync(l).await,
            _ => self.sync().await,
        }
    }

    /// A size: mostly small, a few up to 256 KiB.
    fn size(&mut self) -> u64 {
        match self.rng.u32(..100) {
            0..35 => self.rng.u64(1..=512),
            35..65 => self.rng.u64(513..=8 << 10),
            65..85 => self.rng.u64((8 << 10) + 1..=64 << 10),
            _ => self.rng.u64((64 << 10) + 1..=256 << 10),
        }
    }

    fn put(&mut self, r: Record) -> Result<(), StepError> {
        Ok(self.journal.put(&r)?)
    }

    /// Journals a failed call; the error ends the workload.
    fn failed<T>(&mut self, op: Op, r: FsResult<T>) -> Result<T, StepError> {
        r.or_else(|error| {
            self.put(Record::Fail(format!("{op}: {error}")))?;
            Err(StepError::Call {
                op: op.to_string(),
                error,
            })
        })
    }

    /// Writes the next version of `file` (a new file when `at` is `None`, else the live file
    /// `at`, opened with `O_TRUNC`), in `write(2)`-sized pieces; with `fsync`, fsyncs it before
    /// the close.
    async fn write(&mut self, file: u32, at: Option<usize>, fsync: bool) -> Result<(), StepError> {
        let version = at.map_or(1, |k| self.live[k].version + 1);
        let len = self.size();
        let id = VersionId {
            inc: self.inc,
            file,
            version,
        };
        id.fits(len)?;
        let op = Op::Write { file, version, len };
        self.put(Record::Start(op))?;
        let (fs, dir) = (self.fs, self.dir);
        let name = format!("f{file}");
        let opened = match at {
            None => fs
                .create(
                    dir,
                    name.as_bytes(),
                    0o644,
                    Caller::default(),
                    OpenFlags::WRITE,
                )
                .await
                .map(|(e, fh)| (e.attr.ino, fh)),
            Some(k) => {
                let ino = self.live[k].ino;
                let flags = OpenFlags {
                    truncate: true,
                    ..OpenFlags::WRITE
                };
                fs.open(ino, flags).await.map(|fh| (ino, fh))
            }
        };
        let (ino, fh) = self.failed(op, opened)?;
        let data = Bytes::from(content::bytes(id, 0, len));
        let chunk = CHUNKS[self.rng.usize(..CHUNKS.len())];
        let mut off = 0u64;
        while off < len {
            let end = (off + chunk).min(len);
            let piece = data.slice(off as usize..end as usize);
            let n = self.failed(op, fs.write(fh, off, piece).await)?;
            if n == 0 {
                let r = Err(FsError::Meta(MetaError::Invalid(
                    "a write took no bytes".into(),
                )));
                return self.failed(op, r);
            }
            off += u64::from(n);
        }
        if fsync {
            let sync = Op::Fsync { file };
            self.put(Record::Start(sync))?;
            self.failed(sync, fs.fsync(fh).await)?;
            self.put(Record::Done(sync))?;
        }
        // close(2): flush, then release.
        self.failed(op, fs.flush(fh).await)?;
        self.failed(op, fs.release(fh).await)?;
        self.put(Record::Done(op))?;
        let l = Live { file, ino, version };
        match at {
            Some(k) => self.live[k] = l,
            None => self.live.push(l),
        }
        Ok(())
    }

    async fn unlink(&mut self, k: usize) -> Result<(), StepError> {
        let l = self.live.swap_remove(k);
        let op = Op::Unlink { file: l.file };
        self.put(Record::Start(op))?;
        let name = format!("f{}", l.file);
        let r = self.fs.unlink(self.dir, name.as_bytes()).await;
        self.failed(op, r)?;
        self.put(Record::Done(op))
    }

    /// Opens the file read-only, fsyncs and closes it.
    async fn fsync(&mut self, l: Live) -> Result<(), StepError> {
        let op = Op::Fsync { file: l.file };
        self.put(Record::Start(op))?;
        let fs = self.fs;
        let fh = self.failed(op, fs.open(l.ino, OpenFlags::READ).await)?;
        self.failed(op, fs.fsync(fh).await)?;
        self.put(Record::Done(op))?;
        self.failed(op, fs.flush(fh).await)?;
        self.failed(op, fs.release(fh).await)
    }

    /// `fsync` of the directory: everything before it.
    async fn sync(&mut self) -> Result<(), StepError> {
        self.put(Record::Start(Op::Sync))?;
        let r = self.fs.sync_dir(self.dir).await;
        self.failed(Op::Sync, r)?;
        self.put(Record::Done(Op::Sync))
    }
}

/// How long the harness waits for a started client to say `ready`.
pub const READY_WITHIN: Duration = Duration::from_secs(60);
