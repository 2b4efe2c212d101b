//! One workload client: draws operations (create small or big files, overwrite, append,
//! truncate, rename, unlink, read back) on files only it uses, and updates its model from each
//! outcome: an acknowledged one is certain (and logged), a failed one leaves the worlds it allows
//! and the client never touches those paths again.

use std::future::Future;
use std::io::{self, Write as _};
use std::sync::MutexGuard;
use std::sync::atomic::Ordering::Relaxed;
use std::time::Duration;

use bytes::Bytes;
use nacre_api::meta::{FileType, MetaError, ROOT_INO, SetAttr};
use nacre_client::{Caller, Fh, FileSystem, FsError, FsResult, OpenFlags};
use nacre_types::{Ino, crc32c};
use tokio::sync::watch;

use super::content::{Content, Rng, stream};
use super::model::{AckLine, ClientModel, Expect, FileModel, World};
use super::verify::{Seen, judge};
use super::{
    CLEANUP_TIMEOUT, Finding, KIB, LOG_FLUSH_LINES, MIB, SETUP_GAP, SETUP_TRIES, SUBDIRS, Workload,
    lock, not_found, read_file, timed, unknown, until_stopped,
};

pub(super) struct Client<'w, F> {
    pub(super) w: &'w Workload,
    pub(super) id: usize,
    pub(super) fs: &'w F,
    pub(super) stop: watch::Receiver<bool>,
    pub(super) rng: Rng,
    /// The inodes of `a` and `b`.
    pub(super) dirs: [Ino; 2],
    /// The current step failed somewhere: back off before the next.
    pub(super) failed: bool,
    pub(super) base: String,
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

    pub(super) async fn setup(&mut self) -> anyhow::Result<()> {
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

    pub(super) async fn run(&mut self) {
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

    /// Counts a failed operation; what to report if it turns out applied (nothing for a call
    /// abandoned because the workload stops: no application saw that failure).
    fn fail(&mut self, op: &str, rel: &str, e: &FsError) -> Option<Finding> {
        self.count_failure();
        let path = self.full(rel);
        if self.stopped() {
            tracing::debug!(client = self.id, op, path, error = %e, "operation abandoned");
            return None;
        }
        let errno = self.w.stats.error(e);
        tracing::warn!(client = self.id, op, path, errno, error = %e, "operation failed");
        Some(Finding::FailedButApplied {
            op: op.to_string(),
            path,
            error: format!("{errno} ({e})"),
        })
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
                let failure = self.fail("create", &rel, &e);
                // No file, or an empty one.
                let empty = Expect::exact(&FileModel::default());
                let made = World::at(&rel, Some(empty)).applied(&failure);
                return self.uncertain(vec![World::at(&rel, None), made]);
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
            Err(e) => {
                self.fail(op, &rel, &e);
                return;
            }
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
            Err(e) => {
                self.fail("truncate", &rel, &e);
                return;
            }
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
            let failure = self.fail("rename", &rel, &e);
            let x = Some(Expect::exact(&f));
            let t = target.map(|(_, t)| Expect::exact(&t));
            let mut worlds = vec![
                World::two(&rel, x.clone(), &to, t.clone()),
                World::two(&rel, None, &to, x.clone()).applied(&failure),
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
            let failure = self.fail("unlink", &rel, &e);
            let a = Some(Expect::exact(&f));
            let gone = World::at(&rel, None).applied(&failure);
            return self.uncertain(vec![World::at(&rel, a), gone]);
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
            Err(e) => {
                self.fail("read", &rel, &e);
                return;
            }
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
