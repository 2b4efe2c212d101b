//! [`NetFs`]: the [`FileSystem`] of one volume over the network — the CFS metadata workflows
//! ([`MetaFs`]) and the data path ([`NetVolume`]'s data calls, [`SeqWriter`]).
//!
//! **Open files.** All handles of one inode in this client share one [`OpenFile`]: its size as
//! this client sees it, its extent keys (fetched on open, refetched after a change), a *run* of
//! sequential writes not yet committed to the meta node, and a read-ahead window.
//!
//! **Writes.** A write at the end of the run (or, with no run, at or past the end of the file)
//! extends the run. The run's bytes stay in memory until it reaches one packet (128 KiB); then a
//! [`SeqWriter`] streams them as pipelined primary-backup appends. On flush (`close`, `fsync`), a
//! run that never reached a packet goes to a tiny extent in one request (small files share tiny
//! extents); otherwise the stream is drained. Either way the new extent keys are committed to the
//! meta node (`AppendExtents`), which makes the bytes visible and sets the size. A write inside
//! the committed file goes **in place through Raft** (`Overwrite`) where a normal extent holds
//! the range; tiny-extent ranges are rewritten copy-on-write (new data, a new key that replaces
//! the old range); a write wholly into a hole stays in memory as a *piece* until the next commit
//! (`pieces` module). A write into bytes of the run that are still in memory patches them.
//!
//! **Reads** flush an overlapping run first (so a reader sees its own writes), then read every
//! extent piece of the range in parallel, holes as zeros, with the pieces over them. Sequential
//! reads fetch ahead.
//!
//! **Unlinking an open file.** POSIX lets a process keep using a file after its last name is gone
//! (SQLite and many tools rely on it). When this client has the file open, `unlink` renames it to
//! a hidden name in the same directory (`.nacre-hidden.INO`, not listed by `readdir`) and the last
//! `release` removes it — what libfuse does with `.fuse_hidden` files; a file that `rename` replaces
//! is hidden the same way. A hidden file reports one link less. Other clients that have it
//! open are not protected (no cross-client open state), and a directory holding a hidden file is
//! not empty until it is closed.
//!
//! **Consistency** is CFS's: per-file sequential consistency for this client, the extent keys and
//! size refreshed on open; no leases, no guarantee for concurrent writers of one range.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use nacre_api::data::{MAX_PACKET, Written};
use nacre_api::meta::{Attr, ExtentKey, FileType, MetaError, SetAttr, XattrMode, without_suidgid};
use nacre_types::sync::lock;
use nacre_types::{Ino, PartitionId};
use tokio::task::JoinSet;

use crate::data::{DataCallError, SeqWriter};
use crate::fs::{Caller, DirEntryPlus, Fh, FileSystem, OpenFlags, StatFs};
use crate::meta::{CallError, Entry, FsError, FsResult, MetaFs, NewInode};
use crate::net::NetVolume;

mod alloc;
mod behind;
mod commit;
mod files;
mod frames;
mod pieces;

/// Tuning of the network file system.
#[derive(Clone, Debug)]
pub struct NetFsConfig {
    /// A run flushed below this size goes to a tiny extent (at most one packet).
    pub tiny_max: usize,
    /// Appends in flight per open file.
    pub inflight: usize,
    /// Bytes fetched ahead on sequential reads.
    pub read_ahead: u32,
    /// Largest piece read from a data node in one request.
    pub read_piece: u32,
    /// Create and remove names in the directories this client makes ahead of the meta
    /// partitions (`MetaFs::with_write_behind`); fsync waits for them. Off by default: a
    /// long-lived client (a mount) turns it on and settles before it goes.
    pub write_behind: bool,
    /// With `write_behind`: a closed file whose bytes fit a tiny extent is written behind
    /// (`behind` module), sent at the latest this long after its close unless a packet's worth
    /// is waiting sooner. `None`: every close commits its file before it returns.
    pub flush_delay: Option<Duration>,
    /// Most bytes written behind and not yet sent; a close that finds more waits.
    pub dirty_max: u64,
    /// A run's bytes streamed to a normal extent are committed at the latest this long after
    /// its first packet was sent, by a task of the client if no call commits them first
    /// (`commit` module): an open file does not keep uncommitted keys for long.
    pub commit_every: Duration,
    /// A commit of such keys later than this after the run's first packet fails instead
    /// (`FsError::WriteFailed`): the data nodes' garbage collector may have deleted the extent
    /// (docs/ARCHITECTURE.md, "Garbage collection"). `KEY_COMMIT_WITHIN`; lower it only in tests.
    pub commit_within: Duration,
}

impl Default for NetFsConfig {
    fn default() -> Self {
        Self {
            tiny_max: MAX_PACKET,
            inflight: 8,
            read_ahead: 4 << 20,
            read_piece: 1 << 20,
            write_behind: false,
            flush_delay: None,
            dirty_max: 64 << 20,
            commit_every: Duration::from_secs(30),
            commit_within: nacre_api::data::KEY_COMMIT_WITHIN,
        }
    }
}

/// The network client of one volume.
///
/// **Cancel safety.** Every call that changes this client's open-file state or takes more than
/// one step on the meta nodes (writes, flushes, opens, creates, renames, …) runs to completion on
/// its own task: dropping its future (a caller's timeout, a `select!`) detaches the call rather
/// than cutting it between two awaits. A write cut half way would leave the run's byte count and
/// the stream's offset apart, and the next flush would commit bytes at the wrong offsets.
///
/// **Order.** The data calls on one file (read, write, flush, fsync, release, through any of its
/// handles) run in the order they were issued, that is first polled: each takes a turn before
/// its task is spawned, and its task waits for that turn. Tasks alone would not keep it: a write
/// detached by a cut and the `release` issued next are two tasks the runtime may start in either
/// order, and a release that ran first would close the file before the write.
#[derive(Debug, Clone)]
pub struct NetFs {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    /// This client itself, for the tasks it starts.
    me: Weak<Inner>,
    /// Small files' data written behind, when on.
    behind: Option<behind::DataBehind>,
    /// The volume's compression, when it has one.
    framer: Option<frames::Framer>,
    vol: Arc<NetVolume>,
    meta: MetaFs<Arc<NetVolume>>,
    cfg: NetFsConfig,
    next_fh: AtomicU64,
    handles: Mutex<HashMap<Fh, Handle>>,
    files: Mutex<HashMap<Ino, Arc<OpenFile>>>,
    hide_hook: HideHookSlot,
    /// The task that commits streamed runs in time runs (`commit` module).
    committer: AtomicBool,
}

/// Where an unlink or rename that hides an open file is between its meta requests; a test hook
/// ([`NetFs::set_hide_hook`]) can stop it there to let another call land in between.
#[doc(hidden)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HideStep {
    /// The name was looked up; whether the file is open is not checked yet.
    LookedUp,
    /// The name was renamed to the hidden one; the open file does not know it yet.
    Renamed,
}

/// Called at each [`HideStep`]; the step waits for the returned future.
#[doc(hidden)]
pub type HideHook =
    Arc<dyn Fn(HideStep) -> std::pin::Pin<Box<dyn Future<Output = ()> + Send>> + Send + Sync>;

#[derive(Default)]
struct HideHookSlot(Mutex<Option<HideHook>>);

impl std::fmt::Debug for HideHookSlot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("HideHookSlot")
    }
}

#[derive(Debug, Clone)]
struct Handle {
    file: Arc<OpenFile>,
    flags: OpenFlags,
}

#[derive(Debug)]
struct OpenFile {
    ino: Ino,
    /// Handles open on it (the entry leaves `files` when the last one is released).
    opens: AtomicU64,
    /// Unlinked while open: the hidden name (parent, name) to remove on the last release.
    hidden: Mutex<Option<(Ino, Vec<u8>)>>,
    /// On the dirty list of the data written behind (kept in `files` while it is).
    dirty: AtomicBool,
    /// This file's bytes counted as dirty.
    behind_bytes: AtomicU64,
    state: tokio::sync::Mutex<FileState>,
    /// Turns of the data calls, in issue order (see "Order" on [`NetFs`]): the next one to hand
    /// out, and the one whose call may run.
    next_turn: AtomicU64,
    serving: tokio::sync::watch::Sender<u64>,
}

/// A data call's place in its file's order; the next call's turn comes when this is dropped.
#[derive(Debug)]
struct Turn {
    file: Arc<OpenFile>,
    ticket: u64,
}

impl Turn {
    fn take(file: Arc<OpenFile>) -> Self {
        let ticket = file.next_turn.fetch_add(1, Ordering::Relaxed);
        Self { file, ticket }
    }

    /// Until every call issued before this one has finished.
    async fn wait(&self) {
        let mut rx = self.file.serving.subscribe();
        // The sender lives in `self.file`: the channel cannot close while we wait.
        let _ = rx.wait_for(|s| *s >= self.ticket).await;
    }
}

impl Drop for Turn {
    fn drop(&mut self) {
        let t = self.ticket;
        self.file.serving.send_if_modified(|s| {
            let mine = *s == t;
            if mine {
                *s += 1;
            }
            mine
        });
    }
}

/// Names of files unlinked while open start with this (see the module docs).
pub const HIDDEN_PREFIX: &[u8] = b".nacre-hidden.";

/// Sequential writes not yet committed to the meta node: `[start, start + sent + buf.len())`.
#[derive(Debug)]
struct Run {
    start: u64,
    /// Bytes handed to `stream` (`start..start + sent`).
    sent: u64,
    /// The unsent tail.
    buf: BytesMut,
    stream: Option<SeqWriter>,
    /// When the run's first packet went to `stream`: its keys must be committed within
    /// `commit_within` of it (`commit` module).
    first_sent: Option<std::time::Instant>,
}

impl Run {
    fn end(&self) -> u64 {
        self.start + self.sent + self.buf.len() as u64
    }
}

#[derive(Debug)]
struct FileState {
    /// The size as this client sees it (committed size, grown by the run).
    size: u64,
    /// The committed extent keys (`None`: fetch before use).
    extents: Option<Vec<ExtentKey>>,
    run: Option<Run>,
    /// A stream whose keys were committed, kept to continue appending to the same extent.
    idle_stream: Option<(u64, SeqWriter)>,
    /// Read-ahead window: bytes at an offset.
    ahead: Option<(u64, Bytes)>,
    /// Where the last read ended (to recognize sequential reads).
    last_read_end: u64,
    /// A failed commit of written bytes, reported by the next `flush`/`fsync`/`release` (the
    /// call that hit it may have been a read that had to commit first).
    error: Option<String>,
    /// Times set explicitly while the run was uncommitted: applied again after its keys, whose
    /// commit stamps the time of the commit.
    times: Option<SetAttr>,
    /// Since when the run's write behind has been failing.
    failing: Option<std::time::Instant>,
    /// Bytes were overwritten in place since keys were last committed: the next flush moves the
    /// file's mtime and ctime (an `AppendExtents` without keys), unless a time is set first.
    times_stale: bool,
    /// Writes into holes not committed yet, by file offset (`pieces` module), and their bytes.
    pieces: std::collections::BTreeMap<u64, BytesMut>,
    pieces_bytes: usize,
}

fn fs_err(e: DataCallError) -> FsError {
    FsError::Data(e)
}

impl NetFs {
    pub fn new(vol: Arc<NetVolume>) -> Self {
        Self::with_config(vol, NetFsConfig::default())
    }

    pub fn with_config(vol: Arc<NetVolume>, cfg: NetFsConfig) -> Self {
        Self {
            inner: Arc::new_cyclic(|me| Inner {
                me: me.clone(),
                behind: cfg
                    .flush_delay
                    .filter(|_| cfg.write_behind)
                    .map(|d| behind::DataBehind::new(d, cfg.dirty_max)),
                framer: frames::Framer::of(&vol),
                meta: if cfg.write_behind {
                    MetaFs::with_write_behind(vol.clone())
                } else {
                    MetaFs::new(vol.clone())
                },
                vol,
                cfg,
                next_fh: AtomicU64::new(1),
                handles: Mutex::default(),
                files: Mutex::default(),
                hide_hook: HideHookSlot::default(),
                committer: AtomicBool::new(false),
            }),
        }
    }

    /// The metadata workflows underneath.
    pub fn meta(&self) -> &MetaFs<Arc<NetVolume>> {
        &self.inner.meta
    }

    pub fn volume(&self) -> &Arc<NetVolume> {
        &self.inner.vol
    }

    /// Installs (or with `None` removes) a hook that runs between the steps of hiding an open
    /// file, for tests that make a release land there.
    #[doc(hidden)]
    pub fn set_hide_hook(&self, hook: Option<HideHook>) {
        *lock(&self.inner.hide_hook.0) = hook;
    }

    /// Runs `op` to its end whatever happens to the caller and waits for it: on the caller's
    /// thread until it first waits, then as a task of its own ([`crate::task::run_detached`]);
    /// dropping the returned future detaches it (see the cancel safety note on [`NetFs`]).
    async fn detached<T, Fut>(&self, op: impl FnOnce(Arc<Inner>) -> Fut) -> FsResult<T>
    where
        T: Send + 'static,
        Fut: Future<Output = FsResult<T>> + Send + 'static,
    {
        let call = op(self.inner.clone());
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return call.await;
        };
        let (tx, rx) = tokio::sync::oneshot::channel();
        crate::task::run_detached(&rt, async move {
            let _ = tx.send(call.await);
        });
        rx.await.map_err(|_| {
            FsError::Unavailable(CallError::Unknown(
                "a file system task ended without an answer (it panicked)".into(),
            ))
        })?
    }

    /// [`NetFs::detached`] for a data call on `fh`, run in its file's issue order.
    async fn in_turn<T, Fut>(&self, fh: Fh, op: impl FnOnce(Arc<Inner>) -> Fut) -> FsResult<T>
    where
        T: Send + 'static,
        Fut: Future<Output = FsResult<T>> + Send + 'static,
    {
        // Taken here, before any await: the call's place is fixed when it is first polled.
        let turn = Turn::take(self.inner.handle(fh)?.file);
        let call = op(self.inner.clone()); // does nothing until polled
        self.detached(move |_| async move {
            turn.wait().await;
            let r = call.await;
            drop(turn);
            r
        })
        .await
    }
}

impl Inner {
    async fn lookup(&self, parent: Ino, name: &[u8]) -> FsResult<Attr> {
        Ok(self.overlay(self.meta.lookup(parent, name).await?).await)
    }

    async fn getattr(&self, ino: Ino) -> FsResult<Attr> {
        Ok(self.overlay(self.meta.getattr(ino).await?).await)
    }

    async fn setattr(&self, ino: Ino, set: SetAttr) -> FsResult<Attr> {
        if set.mtime.is_some()
            && let Some(f) = self.open_file(ino)
        {
            // An explicit mtime wins over the stamp of earlier in-place writes.
            f.state.lock().await.times_stale = false;
        }
        let Some(size) = set.size else {
            if (set.atime.is_some() || set.mtime.is_some())
                && let Some(f) = self.open_file(ino)
            {
                let mut st = f.state.lock().await;
                if st.run.is_some() {
                    let t = st.times.get_or_insert_with(SetAttr::default);
                    t.atime = set.atime.or(t.atime);
                    t.mtime = set.mtime.or(t.mtime);
                }
            }
            return Ok(self.overlay(self.meta.setattr(ino, set).await?).await);
        };
        let Some(f) = self.open_file(ino) else {
            return self.meta.setattr(ino, set).await;
        };
        let mut st = f.state.lock().await;
        self.flush_file(&f, &mut st).await?;
        let attr = self.meta.setattr(ino, set).await?;
        st.size = size;
        // The truncate drops the keys past `size`, and those an idle stream would continue
        // after; to 0 there are none left.
        st.extents = (size == 0).then(Vec::new);
        st.ahead = None;
        st.idle_stream = None;
        Ok(attr)
    }

    async fn create(
        &self,
        parent: Ino,
        name: &[u8],
        mode: u32,
        caller: Caller,
        flags: OpenFlags,
    ) -> FsResult<(Entry, Fh)> {
        let e = self
            .meta
            .create(parent, name, &NewInode::file(mode, caller.uid, caller.gid))
            .await?;
        let fh = self.open_attr(&e.attr, flags, None).await?;
        // A new inode has no extent keys: its first write need not ask for them.
        if let Some(f) = self.open_file(e.attr.ino) {
            let mut st = f.state.lock().await;
            if st.run.is_none() && st.size == 0 {
                st.extents.get_or_insert_with(Vec::new);
            }
        }
        Ok((e, fh))
    }

    async fn mkdir(&self, parent: Ino, name: &[u8], mode: u32, caller: Caller) -> FsResult<Entry> {
        self.meta
            .create(parent, name, &NewInode::dir(mode, caller.uid, caller.gid))
            .await
    }

    async fn mknod(
        &self,
        parent: Ino,
        name: &[u8],
        kind: FileType,
        mode: u32,
        rdev: u32,
        caller: Caller,
    ) -> FsResult<Entry> {
        if !matches!(
            kind,
            FileType::Fifo | FileType::Socket | FileType::CharDev | FileType::BlockDev
        ) {
            return Err(FsError::Meta(MetaError::Invalid(format!(
                "mknod makes FIFOs, sockets and devices, not {kind:?}"
            ))));
        }
        // Only device numbers mean anything on devices.
        let rdev = if matches!(kind, FileType::CharDev | FileType::BlockDev) {
            rdev
        } else {
            0
        };
        let new = NewInode {
            kind,
            mode: mode & 0o7777,
            uid: caller.uid,
            gid: caller.gid,
            rdev,
            target: Vec::new(),
        };
        self.meta.create(parent, name, &new).await
    }

    async fn symlink(
        &self,
        parent: Ino,
        name: &[u8],
        target: &[u8],
        caller: Caller,
    ) -> FsResult<Entry> {
        if target.is_empty() {
            return Err(FsError::Meta(MetaError::InvalidName));
        }
        self.meta
            .create(
                parent,
                name,
                &NewInode::symlink(target, caller.uid, caller.gid),
            )
            .await
    }

    async fn unlink(&self, parent: Ino, name: &[u8]) -> FsResult<Vec<Attr>> {
        // A file this client has open is hidden, not unlinked. When it is not open (or its last
        // handle was released meanwhile: FUSE sends RELEASE after close(2) returns), the name is
        // removed; returning without removing it would leave, say, a "deleted" SQLite journal in
        // place, which the next transaction takes for a hot journal and rolls back.
        if let Some(dirs) = self.hide_if_open(parent, name, None).await? {
            return Ok(dirs);
        }
        if let Some(f) = self.closed_file(parent, name).await? {
            // Closed with bytes written behind: removed under the file's lock, so the flusher
            // cannot queue its key after the removal; bytes of a deleted file are not written.
            let mut st = f.state.lock().await;
            let (dirs, gone) = self.meta.unlink_reporting(parent, name).await?;
            if gone == Some(f.ino) {
                self.discard(&f, &mut st);
            }
            return Ok(dirs);
        }
        self.meta.unlink(parent, name).await
    }

    async fn rename(
        &self,
        parent: Ino,
        name: &[u8],
        new_parent: Ino,
        new_name: &[u8],
    ) -> FsResult<Vec<Attr>> {
        // A replaced file this client has open stays usable (hidden, not unlinked). The two steps
        // are not atomic: another client may briefly find neither name.
        if (parent, name) != (new_parent, new_name) && !lock(&self.files).is_empty() {
            // Not when both names are links of one file (then rename changes nothing).
            let src = self.meta.lookup_dentry(parent, name).await?;
            self.hide_if_open(new_parent, new_name, Some(src.ino))
                .await?;
        }
        self.meta.rename(parent, name, new_parent, new_name).await
    }

    async fn readdir(
        &self,
        dir: Ino,
        after: Option<Vec<u8>>,
        limit: u32,
    ) -> FsResult<Vec<DirEntryPlus>> {
        let entries = self.meta.readdir_plus(dir, after.as_deref(), limit).await?;
        let mut out = Vec::with_capacity(entries.len());
        for (entry, attr) in entries {
            if entry.name.starts_with(HIDDEN_PREFIX) {
                continue;
            }
            let attr = match attr {
                Some(a) => Some(self.overlay(a).await),
                None => None,
            };
            out.push(DirEntryPlus { entry, attr });
        }
        Ok(out)
    }

    async fn open(&self, ino: Ino, flags: OpenFlags) -> FsResult<Fh> {
        // An open for reading takes the keys with the attributes: the first read needs them.
        let (mut attr, keys) = if flags.read && !flags.write {
            self.meta.open_read(ino).await?
        } else {
            (self.meta.getattr(ino).await?, None)
        };
        match attr.kind {
            FileType::Dir if flags.write => return Err(FsError::Meta(MetaError::IsDir)),
            _ => {}
        }
        let truncating = flags.truncate && flags.write;
        // Also when only this client's unflushed bytes make the file non-empty.
        let resize = truncating && (attr.size > 0 || self.open_file(ino).is_some());
        let kill = truncating
            && flags.kill_suidgid
            && attr.kind != FileType::Dir
            && without_suidgid(attr.mode) != attr.mode;
        if resize || kill {
            let set = SetAttr {
                size: resize.then_some(0),
                kill_suidgid: kill,
                ..SetAttr::default()
            };
            // A truncate commits what this client holds of the file first and leaves its state
            // empty (`setattr`): the file may still be on the write-behind list, and `open_attr`
            // keeps the state of such a file as it is, so a size or keys from before the
            // truncate would send the next write in place into freed extents.
            attr = self.setattr(ino, set).await?;
        }
        self.open_attr(&attr, flags, keys).await
    }

    async fn read(&self, fh: Fh, offset: u64, len: u32) -> FsResult<Bytes> {
        let h = self.handle(fh)?;
        let f = h.file;
        let mut st = f.state.lock().await;
        let want_end = offset.saturating_add(u64::from(len));
        if st
            .run
            .as_ref()
            .is_some_and(|r| r.start < want_end && offset < r.end())
        {
            self.flush_file(&f, &mut st).await?;
        }
        self.extents(&f, &mut st).await?;
        let end = want_end.min(st.size);
        if offset >= end {
            return Ok(Bytes::new());
        }
        if let Some((at, bytes)) = &st.ahead
            && *at <= offset
            && end <= at + bytes.len() as u64
        {
            let out = bytes.slice((offset - at) as usize..(end - at) as usize);
            st.last_read_end = end;
            return Ok(out);
        }
        let sequential = offset == st.last_read_end && offset > 0;
        let mut fetch_end = end;
        if sequential {
            fetch_end = (offset + u64::from(self.cfg.read_ahead)).min(st.size);
            // Never ahead into the run: its bytes are not committed yet.
            if let Some(run) = st.run.as_ref().filter(|r| r.start >= end) {
                fetch_end = fetch_end.min(run.start);
            }
            fetch_end = fetch_end.max(end);
        }
        let mut bytes = self
            .read_committed(&f, &mut st, offset, fetch_end - offset)
            .await?;
        if pieces::overlap(&st, offset, fetch_end) {
            bytes = pieces::over(&st, offset, bytes);
        }
        let out = bytes.slice(0..(end - offset) as usize);
        if fetch_end > end {
            st.ahead = Some((offset, bytes));
        }
        st.last_read_end = end;
        Ok(out)
    }

    async fn write(&self, fh: Fh, offset: u64, data: Bytes) -> FsResult<u32> {
        let h = self.handle(fh)?;
        if !h.flags.write {
            return Err(FsError::NotOpenFor("writing"));
        }
        let n = data.len() as u32;
        if data.is_empty() {
            return Ok(0);
        }
        let f = h.file;
        let mut st = f.state.lock().await;
        st.ahead = None;
        let mut off = offset;
        if h.flags.append {
            if st.run.is_none() {
                self.extents(&f, &mut st).await?;
            }
            off = st.size;
        }
        let end = off + data.len() as u64;
        // Into the in-memory tail of the run: patch it.
        if let Some(run) = &mut st.run {
            let tail = run.start + run.sent;
            if off >= tail && end <= run.end() {
                let at = (off - tail) as usize;
                run.buf[at..at + data.len()].copy_from_slice(&data);
                return Ok(n);
            }
        }
        // Anywhere but the end of the run: a piece if into a hole past it, else the run is
        // committed first.
        if st.run.as_ref().is_some_and(|r| r.end() != off) {
            if end <= st.size && self.buffer_hole(&mut st, off, &data) {
                if st.pieces_bytes > pieces::PIECES_MAX {
                    self.flush_file(&f, &mut st).await?;
                }
                return Ok(n);
            }
            self.flush_file(&f, &mut st).await?;
        }
        if st.run.is_none() {
            if st.extents.is_none() {
                self.extents(&f, &mut st).await?;
            }
            if off < st.size {
                // Where the committed bytes end, inside the size (a file `fallocate`d or
                // `ftruncate`d ahead of its writes): a run, streamed like appends, so sequential
                // writes there land in normal extents.
                let keys_end = st
                    .extents
                    .as_deref()
                    .and_then(<[ExtentKey]>::last)
                    .map_or(0, ExtentKey::end);
                if off == keys_end {
                    return self.extend_run(&f, &mut st, off, data).await.map(|()| n);
                }
                // Into a hole: kept in memory until the next commit.
                if end <= st.size && self.buffer_hole(&mut st, off, &data) {
                    if st.pieces_bytes > pieces::PIECES_MAX {
                        self.flush_file(&f, &mut st).await?;
                    }
                    return Ok(n);
                }
                if pieces::overlap(&st, off, end) {
                    self.flush_file(&f, &mut st).await?;
                }
                // Inside the committed file: in place up to the end, then a run for the rest.
                let inside = (st.size - off).min(data.len() as u64) as usize;
                self.write_committed(&f, &mut st, off, data.slice(..inside))
                    .await?;
                if inside == data.len() {
                    return Ok(n);
                }
                return self
                    .extend_run(&f, &mut st, off + inside as u64, data.slice(inside..))
                    .await
                    .map(|()| n);
            }
        }
        self.extend_run(&f, &mut st, off, data).await.map(|()| n)
    }

    /// `close(2)`: commits the file's bytes, or leaves them to the flusher (`behind`).
    async fn flush(&self, fh: Fh) -> FsResult<()> {
        let h = self.handle(fh)?;
        self.close_file(&h.file).await
    }

    /// `fsync(2)`: commits the file's bytes now.
    async fn sync_file(&self, fh: Fh) -> FsResult<()> {
        let h = self.handle(fh)?;
        let mut st = h.file.state.lock().await;
        self.flush_reporting(&h.file, &mut st).await
    }

    async fn close_file(&self, f: &Arc<OpenFile>) -> FsResult<()> {
        {
            let mut st = f.state.lock().await;
            if !self.defer(f, &st) {
                return self.flush_reporting(f, &mut st).await;
            }
            if let Some(e) = st.error.take() {
                return Err(FsError::WriteFailed(e));
            }
        }
        self.wait_room().await;
        Ok(())
    }

    async fn release(&self, fh: Fh) -> FsResult<()> {
        let h = self.handle(fh)?;
        let r = self.close_file(&h.file).await;
        if h.file.opens.load(Ordering::SeqCst) <= 1 {
            h.file.state.lock().await.idle_stream = None;
        }
        lock(&self.handles).remove(&fh);
        let last = h.file.opens.fetch_sub(1, Ordering::SeqCst) == 1;
        if last {
            self.forget_if_closed(&h.file);
            let hidden = lock(&h.file.hidden).take();
            if let Some((parent, name)) = hidden {
                self.meta.unlink(parent, &name).await?;
            }
        }
        r
    }

    async fn statfs(&self) -> FsResult<StatFs> {
        let (inodes, _) = self.meta.statfs().await?;
        let (total, used) = self.vol.space().await.unwrap_or((0, 0));
        Ok(StatFs {
            total_bytes: total,
            free_bytes: total.saturating_sub(used),
            files: inodes,
            free_files: u64::from(u32::MAX).saturating_sub(inodes),
            block_size: MAX_PACKET as u32,
            max_name: nacre_api::meta::MAX_NAME as u32,
        })
    }
}

/// Calls that only read, or that are one meta node request, run on the caller's task; the rest
/// are [`NetFs::detached`].
impl FileSystem for NetFs {
    async fn lookup(&self, parent: Ino, name: &[u8]) -> FsResult<Attr> {
        self.inner.lookup(parent, name).await
    }

    async fn getattr(&self, ino: Ino) -> FsResult<Attr> {
        self.inner.getattr(ino).await
    }

    async fn setattr(&self, ino: Ino, set: SetAttr) -> FsResult<Attr> {
        self.detached(move |i| async move { i.setattr(ino, set).await })
            .await
    }

    async fn create(
        &self,
        parent: Ino,
        name: &[u8],
        mode: u32,
        caller: Caller,
        flags: OpenFlags,
    ) -> FsResult<(Entry, Fh)> {
        let name = name.to_vec();
        self.detached(move |i| async move { i.create(parent, &name, mode, caller, flags).await })
            .await
    }

    async fn mkdir(&self, parent: Ino, name: &[u8], mode: u32, caller: Caller) -> FsResult<Entry> {
        let name = name.to_vec();
        self.detached(move |i| async move { i.mkdir(parent, &name, mode, caller).await })
            .await
    }

    async fn mknod(
        &self,
        parent: Ino,
        name: &[u8],
        kind: FileType,
        mode: u32,
        rdev: u32,
        caller: Caller,
    ) -> FsResult<Entry> {
        let name = name.to_vec();
        self.detached(
            move |i| async move { i.mknod(parent, &name, kind, mode, rdev, caller).await },
        )
        .await
    }

    async fn symlink(
        &self,
        parent: Ino,
        name: &[u8],
        target: &[u8],
        caller: Caller,
    ) -> FsResult<Entry> {
        let (name, target) = (name.to_vec(), target.to_vec());
        self.detached(move |i| async move { i.symlink(parent, &name, &target, caller).await })
            .await
    }

    async fn link(&self, ino: Ino, new_parent: Ino, new_name: &[u8]) -> FsResult<Entry> {
        let new_name = new_name.to_vec();
        self.detached(move |i| async move { i.meta.link(ino, new_parent, &new_name).await })
            .await
    }

    async fn unlink(&self, parent: Ino, name: &[u8]) -> FsResult<Vec<Attr>> {
        let name = name.to_vec();
        self.detached(move |i| async move { i.unlink(parent, &name).await })
            .await
    }

    async fn rmdir(&self, parent: Ino, name: &[u8]) -> FsResult<Vec<Attr>> {
        let name = name.to_vec();
        self.detached(move |i| async move { i.meta.rmdir(parent, &name).await })
            .await
    }

    async fn rename(
        &self,
        parent: Ino,
        name: &[u8],
        new_parent: Ino,
        new_name: &[u8],
    ) -> FsResult<Vec<Attr>> {
        let (name, new_name) = (name.to_vec(), new_name.to_vec());
        self.detached(move |i| async move { i.rename(parent, &name, new_parent, &new_name).await })
            .await
    }

    async fn readlink(&self, ino: Ino) -> FsResult<Vec<u8>> {
        self.inner.meta.readlink(ino).await
    }

    async fn readdir(
        &self,
        dir: Ino,
        after: Option<Vec<u8>>,
        limit: u32,
    ) -> FsResult<Vec<DirEntryPlus>> {
        self.inner.readdir(dir, after, limit).await
    }

    async fn open(&self, ino: Ino, flags: OpenFlags) -> FsResult<Fh> {
        self.detached(move |i| async move { i.open(ino, flags).await })
            .await
    }

    async fn read(&self, fh: Fh, offset: u64, len: u32) -> FsResult<Bytes> {
        // Detached too: a read may commit the run it overlaps and fills the read-ahead window.
        self.in_turn(fh, move |i| async move { i.read(fh, offset, len).await })
            .await
    }

    async fn write(&self, fh: Fh, offset: u64, data: Bytes) -> FsResult<u32> {
        self.in_turn(fh, move |i| async move { i.write(fh, offset, data).await })
            .await
    }

    async fn fallocate(&self, fh: Fh, mode: crate::Falloc, offset: u64, len: u64) -> FsResult<()> {
        self.in_turn(fh, move |i| async move {
            i.fallocate(fh, mode, offset, len).await
        })
        .await
    }

    async fn flush(&self, fh: Fh) -> FsResult<()> {
        // Nothing written and no call of this file under way (close of a new empty file, or of
        // one only read): nothing to commit, so no task.
        if let Ok(h) = self.inner.handle(fh)
            && h.file.next_turn.load(Ordering::Relaxed) == *h.file.serving.borrow()
            && let Ok(st) = h.file.state.try_lock()
            && st.run.is_none()
            && st.pieces.is_empty()
            && st.error.is_none()
            && !st.times_stale
        {
            return Ok(());
        }
        self.in_turn(fh, move |i| async move { i.flush(fh).await })
            .await
    }

    async fn fsync(&self, fh: Fh) -> FsResult<()> {
        self.in_turn(fh, move |i| async move {
            i.sync_file(fh).await?;
            i.meta.settle().await
        })
        .await
    }

    /// Every file's bytes written behind, and every metadata change, before the call.
    async fn sync_dir(&self, _dir: Ino) -> FsResult<()> {
        let data = self.inner.sync_data().await;
        self.inner.meta.settle().await?;
        data
    }

    async fn release(&self, fh: Fh) -> FsResult<()> {
        self.in_turn(fh, move |i| async move { i.release(fh).await })
            .await
    }

    async fn statfs(&self) -> FsResult<StatFs> {
        self.inner.statfs().await
    }

    async fn getxattr(&self, ino: Ino, name: &[u8]) -> FsResult<Vec<u8>> {
        self.inner.meta.get_xattr(ino, name).await
    }

    async fn setxattr(&self, ino: Ino, name: &[u8], value: &[u8], mode: XattrMode) -> FsResult<()> {
        self.inner.meta.set_xattr(ino, name, value, mode).await
    }

    async fn listxattr(&self, ino: Ino) -> FsResult<Vec<Vec<u8>>> {
        self.inner.meta.list_xattr(ino).await
    }

    async fn removexattr(&self, ino: Ino, name: &[u8]) -> FsResult<()> {
        self.inner.meta.remove_xattr(ino, name).await
    }
}
