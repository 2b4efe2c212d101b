//! The FUSE front end (docs/design.md §8): [`FuseFs`] adapts any [`FileSystem`] (the network client, or
//! a stack of layers over it) to the kernel through `fuser`, and [`mount`] mounts it.
//!
//! **Threads.** `fuser` reads requests on its own threads ([`MountOptions::threads`]); each
//! callback moves its reply object into a task on the tokio runtime given to [`mount`], which
//! awaits the file system and replies. So a slow network call never holds up the kernel queue, and
//! the kernel's own limits (one outstanding request per blocked application thread, `max_background`
//! for read-ahead) bound the work in flight.
//!
//! **Errors.** POSIX errno values exist only here ([`errno()`]).
//!
//! **Directories.** `opendir` starts a listing that `readdir` fills page by page (by name cursor)
//! and keeps until `releasedir`, so the offsets the kernel hands back stay valid however the
//! directory changes meanwhile; `rewinddir` (offset 0) starts a fresh listing.

mod errno;
mod mount;
mod state;

use std::ffi::OsStr;
use std::future::Future;
use std::os::unix::ffi::OsStrExt as _;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use fuser::{
    AccessFlags, Errno, FileHandle, FopenFlags, Generation, INodeNo, InitFlags, IoctlFlags,
    KernelConfig, LockOwner, PollEvents, PollFlags, PollNotifier, RenameFlags, ReplyAttr,
    ReplyBmap, ReplyCreate, ReplyData, ReplyDirectory, ReplyDirectoryPlus, ReplyEmpty, ReplyEntry,
    ReplyIoctl, ReplyOpen, ReplyPoll, ReplyStatfs, ReplyWrite, ReplyXattr, Request, TimeOrNow,
    WriteFlags,
};
use nacre_api::meta::{Attr, FileType, MetaError, SetAttr, XattrMode};
use nacre_client::{Caller, Falloc, Fh, FileSystem, FsError, OpenFlags};
use nacre_types::Ino;
use nacre_types::OncePerSecond;
use nacre_types::sync::lock;
use tokio::runtime::Handle;

pub use crate::errno::errno;
pub use crate::mount::{MountError, MountOptions, Mounted, mount};
use crate::state::{CAPS, Inner, Listing};

/// `st_blksize` reported for every inode: the data path's packet size.
pub const BLKSIZE: u32 = 128 << 10;

/// Entries fetched from the file system per `readdir` call.
const DIR_PAGE: u32 = 1024;

/// The kernel attributes of `a`: times are signed ns since the Unix epoch, `blocks` counts
/// 512-byte units (`ceil(size / 512)`: files are not sparse as far as `du` can tell).
pub fn file_attr(a: &Attr) -> fuser::FileAttr {
    fuser::FileAttr {
        ino: INodeNo(a.ino.0),
        size: a.size,
        blocks: a.size.div_ceil(512),
        atime: time(a.atime),
        mtime: time(a.mtime),
        ctime: time(a.ctime),
        crtime: time(a.ctime),
        kind: file_type(a.kind),
        perm: (a.mode & 0o7777) as u16,
        nlink: a.nlink,
        uid: a.uid,
        gid: a.gid,
        rdev: a.rdev,
        blksize: BLKSIZE,
        flags: 0,
    }
}

fn file_type(k: FileType) -> fuser::FileType {
    match k {
        FileType::File => fuser::FileType::RegularFile,
        FileType::Dir => fuser::FileType::Directory,
        FileType::Symlink => fuser::FileType::Symlink,
        FileType::Fifo => fuser::FileType::NamedPipe,
        FileType::Socket => fuser::FileType::Socket,
        FileType::CharDev => fuser::FileType::CharDevice,
        FileType::BlockDev => fuser::FileType::BlockDevice,
    }
}

/// The `SystemTime` of a file time (signed ns since the Unix epoch).
fn time(ns: i64) -> SystemTime {
    let d = Duration::from_nanos(ns.unsigned_abs());
    if ns >= 0 {
        UNIX_EPOCH + d
    } else {
        // Every i64 of ns is a `SystemTime` on Linux; the fallback is never taken there.
        UNIX_EPOCH.checked_sub(d).unwrap_or(UNIX_EPOCH)
    }
}

/// Signed nanoseconds since the Unix epoch of `t`, saturated to the `i64` range (1677 to 2262).
fn nanos(t: SystemTime) -> i64 {
    match t.duration_since(UNIX_EPOCH) {
        Ok(d) => i64::try_from(d.as_nanos()).unwrap_or(i64::MAX),
        Err(e) => i64::try_from(e.duration().as_nanos()).map_or(i64::MIN, |n| -n),
    }
}

/// The file time of a time the kernel sent in `SETATTR`. fuser 0.18 (pinned) decodes the
/// kernel's `timespec {sec, nsec}` with `sec < 0` as `UNIX_EPOCH - (-sec s + nsec ns)`, not as
/// `-sec s` before the epoch plus `nsec`; this undoes that (the mapping is one to one), so
/// 1969-12-31T23:59:59.25 stays that, not 23:59:58.75.
fn kernel_nanos(t: SystemTime) -> i64 {
    match t.duration_since(UNIX_EPOCH) {
        Ok(_) => nanos(t),
        Err(e) => {
            let d = e.duration();
            let ns = -i128::from(d.as_secs()) * 1_000_000_000 + i128::from(d.subsec_nanos());
            i64::try_from(ns).unwrap_or(i64::MIN)
        }
    }
}

fn time_or_now(t: TimeOrNow) -> i64 {
    match t {
        TimeOrNow::SpecificTime(t) => kernel_nanos(t),
        TimeOrNow::Now => nanos(SystemTime::now()),
    }
}

fn err(e: &FsError) -> Errno {
    let n = errno(e);
    if n == libc::EIO {
        // The application sees only the errno; the cause goes to the log, one line a second at
        // most (during a fault every call may fail the same way).
        if let Some(suppressed) = EIO_LOG.admit_now() {
            tracing::warn!(error = %e, suppressed, "a call failed with EIO");
        }
    }
    Errno::from_i32(n)
}

static EIO_LOG: OncePerSecond = OncePerSecond::new();

/// How the adapter talks to the kernel.
#[derive(Clone, Debug)]
pub struct FuseConfig {
    /// How long the kernel may cache a name → inode mapping.
    pub entry_ttl: Duration,
    /// How long the kernel may cache attributes.
    pub attr_ttl: Duration,
    /// FUSE_WRITEBACK_CACHE: the kernel buffers writes in its page cache and sends them later,
    /// possibly through any writable handle of the file, with offsets it computed itself (it
    /// handles `O_APPEND`), and reads pages around partial writes. So with it on, handles are
    /// opened for reading too and without `append`.
    pub writeback: bool,
    /// Largest write the kernel sends in one request.
    pub max_write: u32,
}

impl Default for FuseConfig {
    fn default() -> Self {
        Self {
            entry_ttl: Duration::from_secs(1),
            attr_ttl: Duration::from_secs(1),
            writeback: false,
            max_write: 1 << 20,
        }
    }
}

/// A [`FileSystem`] as a `fuser` file system.
pub struct FuseFs<F: FileSystem> {
    inner: Arc<Inner<F>>,
}

impl<F: FileSystem> std::fmt::Debug for FuseFs<F> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FuseFs")
            .field("cfg", &self.inner.cfg)
            .finish_non_exhaustive()
    }
}

impl<F: FileSystem> FuseFs<F> {
    /// Calls into `fs` run as tasks on `rt`.
    pub fn new(fs: Arc<F>, rt: Handle, cfg: FuseConfig) -> Self {
        Self {
            inner: Arc::new(Inner {
                fs,
                rt,
                cfg,
                dirs: Mutex::default(),
                next_dir: AtomicU64::new(1),
                parents: Mutex::default(),
                no_caps: Mutex::default(),
                killpriv: AtomicBool::new(false),
                privileged: Mutex::default(),
            }),
        }
    }

    /// Runs `f`: first on this `fuser` thread, as far as it gets without waiting (a call the
    /// client answers from its caches replies right here, and one that sends a request sends it
    /// from here), then as a task on the runtime once what it waits for wakes it
    /// ([`nacre_client::task::run_detached`]). If the runtime is gone, the task (and the reply it
    /// owns) is dropped, and `fuser` answers `EIO` for a dropped reply.
    fn spawn<Fut>(&self, f: impl FnOnce(Arc<Inner<F>>) -> Fut)
    where
        Fut: Future<Output = ()> + Send + 'static,
    {
        nacre_client::task::run_detached(&self.inner.rt, f(self.inner.clone()));
    }
}

fn caller(req: &Request) -> Caller {
    Caller {
        uid: req.uid(),
        gid: req.gid(),
    }
}

fn name_of(name: &OsStr) -> Vec<u8> {
    name.as_bytes().to_vec()
}

/// A synthetic attribute for `.` and `..` in readdir-plus replies (the kernel ignores it).
fn dot_attr(ino: Ino) -> fuser::FileAttr {
    file_attr(&Attr {
        ino,
        kind: FileType::Dir,
        mode: 0o755,
        uid: 0,
        gid: 0,
        size: 0,
        nlink: 2,
        rdev: 0,
        atime: 0,
        mtime: 0,
        ctime: 0,
        generation: 0,
    })
}

impl<F: FileSystem> fuser::Filesystem for FuseFs<F> {
    fn init(&mut self, _req: &Request, config: &mut KernelConfig) -> std::io::Result<()> {
        let caps = config.capabilities();
        let mut want = InitFlags::FUSE_ASYNC_READ
            | InitFlags::FUSE_BIG_WRITES
            | InitFlags::FUSE_MAX_PAGES
            // open(O_TRUNC) truncates in the open call (no setattr after it).
            | InitFlags::FUSE_ATOMIC_O_TRUNC
            | InitFlags::FUSE_DO_READDIRPLUS
            | InitFlags::FUSE_READDIRPLUS_AUTO
            | InitFlags::FUSE_PARALLEL_DIROPS
            | InitFlags::FUSE_ASYNC_DIO
            | InitFlags::FUSE_CACHE_SYMLINKS
            // Cached pages are dropped when a refreshed mtime or size shows another client
            // changed the file.
            | InitFlags::FUSE_AUTO_INVAL_DATA
            // Set-user-ID and set-group-ID bits are cleared here (write, truncate, chown), so the
            // kernel does not ask for `security.capability` before every write: a round trip
            // less per write.
            | InitFlags::FUSE_HANDLE_KILLPRIV_V2;
        if self.inner.cfg.writeback {
            want |= InitFlags::FUSE_WRITEBACK_CACHE;
        }
        // Only what this kernel offers; the rest is simply not used.
        let _ = config.add_capabilities(want & caps);
        let killpriv = caps.contains(InitFlags::FUSE_HANDLE_KILLPRIV_V2);
        self.inner.killpriv.store(killpriv, Ordering::Relaxed);
        if let Err(max) = config.set_max_write(self.inner.cfg.max_write) {
            let _ = config.set_max_write(max);
        }
        let _ = config.set_max_background(64);
        tracing::info!(
            kernel_abi = %config.kernel_abi(),
            writeback = self.inner.cfg.writeback && caps.contains(InitFlags::FUSE_WRITEBACK_CACHE),
            killpriv,
            "FUSE session initialized"
        );
        Ok(())
    }

    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        let name = name_of(name);
        self.spawn(|i| async move {
            match i.fs.lookup(Ino(parent.0), &name).await {
                Ok(a) => {
                    i.learn_parent(&a, Ino(parent.0));
                    i.entry(reply, &a);
                }
                Err(e) => reply.error(err(&e)),
            }
        });
    }

    /// The kernel dropped the inode: what it learns of it next comes through a new reply.
    fn forget(&self, _req: &Request, ino: INodeNo, _nlookup: u64) {
        lock(&self.inner.privileged).remove(&ino.0);
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        self.spawn(|i| async move {
            match i.fs.getattr(Ino(ino.0)).await {
                Ok(a) => reply.attr(&i.cfg.attr_ttl, &i.out_attr(&a)),
                Err(e) => reply.error(err(&e)),
            }
        });
    }

    fn setattr(
        &self,
        req: &Request,
        ino: INodeNo,
        mode: Option<u32>,
        uid: Option<u32>,
        gid: Option<u32>,
        size: Option<u64>,
        atime: Option<TimeOrNow>,
        mtime: Option<TimeOrNow>,
        _ctime: Option<SystemTime>,
        _fh: Option<FileHandle>,
        _crtime: Option<SystemTime>,
        _chgtime: Option<SystemTime>,
        _bkuptime: Option<SystemTime>,
        _flags: Option<fuser::BsdFileFlags>,
        reply: ReplyAttr,
    ) {
        // With killpriv the kernel leaves it to us: chown always clears the bits of a
        // non-directory (the meta node skips directories), a truncate when the caller lacks
        // `CAP_FSETID`. fuser does not pass the kernel's FATTR_KILL_SUIDGID, so a caller other
        // than root stands for one without `CAP_FSETID`.
        let killpriv = self.inner.killpriv.load(Ordering::Relaxed);
        let set = SetAttr {
            mode: mode.map(|m| m & 0o7777),
            uid,
            gid,
            size,
            atime: atime.map(time_or_now),
            mtime: mtime.map(time_or_now),
            kill_suidgid: killpriv
                && (uid.is_some() || gid.is_some() || (size.is_some() && req.uid() != 0)),
        };
        self.spawn(|i| async move {
            let ino = Ino(ino.0);
            // Nothing we store changes (a ctime-only update): answer with the attributes.
            let r = if set == SetAttr::default() {
                i.fs.getattr(ino).await
            } else {
                i.fs.setattr(ino, set).await
            };
            match r {
                Ok(a) => reply.attr(&i.cfg.attr_ttl, &i.out_attr(&a)),
                Err(e) => reply.error(err(&e)),
            }
        });
    }

    fn readlink(&self, _req: &Request, ino: INodeNo, reply: ReplyData) {
        self.spawn(|i| async move {
            match i.fs.readlink(Ino(ino.0)).await {
                Ok(t) => reply.data(&t),
                Err(e) => reply.error(err(&e)),
            }
        });
    }

    /// Regular files only (create, then release); the file system has no special files.
    fn mknod(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        umask: u32,
        rdev: u32,
        reply: ReplyEntry,
    ) {
        // The kernel checks CAP_MKNOD for devices before it asks.
        let special = match mode & libc::S_IFMT {
            libc::S_IFREG => None,
            libc::S_IFIFO => Some(FileType::Fifo),
            libc::S_IFSOCK => Some(FileType::Socket),
            libc::S_IFCHR => Some(FileType::CharDev),
            libc::S_IFBLK => Some(FileType::BlockDev),
            _ => {
                reply.error(Errno::EINVAL);
                return;
            }
        };
        let (name, caller) = (name_of(name), caller(req));
        let perm = mode & !umask & 0o7777;
        if let Some(kind) = special {
            self.spawn(|i| async move {
                match i
                    .fs
                    .mknod(Ino(parent.0), &name, kind, perm, rdev, caller)
                    .await
                {
                    Ok(e) => i.entry(reply, &e.attr),
                    Err(e) => reply.error(err(&e)),
                }
            });
            return;
        }
        self.spawn(|i| async move {
            let r =
                i.fs.create(Ino(parent.0), &name, perm, caller, OpenFlags::READ)
                    .await;
            match r {
                Ok((e, fh)) => {
                    let released = i.fs.release(fh).await;
                    match released {
                        Ok(()) => i.entry(reply, &e.attr),
                        Err(e) => reply.error(err(&e)),
                    }
                }
                Err(e) => reply.error(err(&e)),
            }
        });
    }

    fn mkdir(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        umask: u32,
        reply: ReplyEntry,
    ) {
        let (name, caller) = (name_of(name), caller(req));
        let perm = mode & !umask & 0o7777;
        self.spawn(|i| async move {
            match i.fs.mkdir(Ino(parent.0), &name, perm, caller).await {
                Ok(e) => {
                    i.learn_parent(&e.attr, Ino(parent.0));
                    i.entry(reply, &e.attr);
                }
                Err(e) => reply.error(err(&e)),
            }
        });
    }

    fn unlink(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        let name = name_of(name);
        self.spawn(|i| async move {
            match i.fs.unlink(Ino(parent.0), &name).await {
                Ok(_) => reply.ok(),
                Err(e) => reply.error(err(&e)),
            }
        });
    }

    fn rmdir(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        let name = name_of(name);
        self.spawn(|i| async move {
            match i.fs.rmdir(Ino(parent.0), &name).await {
                Ok(_) => reply.ok(),
                Err(e) => reply.error(err(&e)),
            }
        });
    }

    fn symlink(
        &self,
        req: &Request,
        parent: INodeNo,
        link_name: &OsStr,
        target: &Path,
        reply: ReplyEntry,
    ) {
        let (name, caller) = (name_of(link_name), caller(req));
        let target = target.as_os_str().as_bytes().to_vec();
        self.spawn(|i| async move {
            match i.fs.symlink(Ino(parent.0), &name, &target, caller).await {
                Ok(e) => i.entry(reply, &e.attr),
                Err(e) => reply.error(err(&e)),
            }
        });
    }

    /// `RENAME_NOREPLACE` checks that the target is absent first (not atomic with the rename:
    /// a concurrent creator of the target may still be replaced); `RENAME_EXCHANGE` and
    /// `RENAME_WHITEOUT` are not supported (`EINVAL`).
    fn rename(
        &self,
        _req: &Request,
        parent: INodeNo,
        name: &OsStr,
        newparent: INodeNo,
        newname: &OsStr,
        flags: RenameFlags,
        reply: ReplyEmpty,
    ) {
        if flags.intersects(RenameFlags::RENAME_EXCHANGE | RenameFlags::RENAME_WHITEOUT)
            || !(flags - RenameFlags::RENAME_NOREPLACE).is_empty()
        {
            reply.error(Errno::EINVAL);
            return;
        }
        let noreplace = flags.contains(RenameFlags::RENAME_NOREPLACE);
        let (name, newname) = (name_of(name), name_of(newname));
        self.spawn(|i| async move {
            let (p, np) = (Ino(parent.0), Ino(newparent.0));
            if noreplace {
                match i.fs.lookup(np, &newname).await {
                    Ok(_) => return reply.error(Errno::EEXIST),
                    Err(FsError::Meta(MetaError::NotFound)) => {}
                    Err(e) => return reply.error(err(&e)),
                }
            }
            match i.fs.rename(p, &name, np, &newname).await {
                Ok(_) => reply.ok(),
                Err(e) => reply.error(err(&e)),
            }
        });
    }

    fn link(
        &self,
        _req: &Request,
        ino: INodeNo,
        newparent: INodeNo,
        newname: &OsStr,
        reply: ReplyEntry,
    ) {
        let newname = name_of(newname);
        self.spawn(|i| async move {
            match i.fs.link(Ino(ino.0), Ino(newparent.0), &newname).await {
                Ok(e) => i.entry(reply, &e.attr),
                Err(e) => reply.error(err(&e)),
            }
        });
    }

    fn open(&self, req: &Request, ino: INodeNo, flags: fuser::OpenFlags, reply: ReplyOpen) {
        // An open(O_TRUNC) truncates here (FUSE_ATOMIC_O_TRUNC); see `setattr` for the uid.
        let kill = self.inner.killpriv.load(Ordering::Relaxed) && req.uid() != 0;
        self.spawn(|i| async move {
            let mut flags = i.open_flags(flags.0);
            flags.kill_suidgid = kill;
            match i.fs.open(Ino(ino.0), flags).await {
                Ok(fh) => reply.opened(FileHandle(fh.0), FopenFlags::empty()),
                Err(e) => reply.error(err(&e)),
            }
        });
    }

    fn read(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        size: u32,
        _flags: fuser::OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyData,
    ) {
        self.spawn(|i| async move {
            match i.fs.read(Fh(fh.0), offset, size).await {
                Ok(b) => reply.data(&b),
                Err(e) => reply.error(err(&e)),
            }
        });
    }

    fn write(
        &self,
        _req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        data: &[u8],
        write_flags: WriteFlags,
        _flags: fuser::OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyWrite,
    ) {
        let kill = write_flags.contains(WriteFlags::FUSE_WRITE_KILL_SUIDGID)
            && self.inner.is_privileged(ino.0);
        // The request buffer is reused for the next request: the data is copied once, here.
        let data = Bytes::copy_from_slice(data);
        self.spawn(|i| async move {
            if kill && let Err(e) = i.kill_suidgid(Ino(ino.0)).await {
                return reply.error(err(&e));
            }
            match i.fs.write(Fh(fh.0), offset, data).await {
                Ok(n) => reply.written(n),
                Err(e) => reply.error(err(&e)),
            }
        });
    }

    fn flush(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        _lock_owner: LockOwner,
        reply: ReplyEmpty,
    ) {
        self.spawn(|i| async move {
            match i.fs.flush(Fh(fh.0)).await {
                Ok(()) => reply.ok(),
                Err(e) => reply.error(err(&e)),
            }
        });
    }

    fn release(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        _flags: fuser::OpenFlags,
        _lock_owner: Option<LockOwner>,
        _flush: bool,
        reply: ReplyEmpty,
    ) {
        self.spawn(|i| async move {
            match i.fs.release(Fh(fh.0)).await {
                Ok(()) => reply.ok(),
                Err(e) => {
                    // close(2) has returned already; nobody but the log sees this.
                    tracing::warn!(fh = fh.0, error = %e, "release failed");
                    reply.error(err(&e));
                }
            }
        });
    }

    fn fsync(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        _datasync: bool,
        reply: ReplyEmpty,
    ) {
        self.spawn(|i| async move {
            match i.fs.fsync(Fh(fh.0)).await {
                Ok(()) => reply.ok(),
                Err(e) => reply.error(err(&e)),
            }
        });
    }

    fn opendir(&self, _req: &Request, ino: INodeNo, _flags: fuser::OpenFlags, reply: ReplyOpen) {
        let i = &self.inner;
        let dir = Ino(ino.0);
        let listing = Listing {
            dir,
            parent: i.parent_of(dir),
            entries: Vec::new(),
            complete: false,
        };
        let id = i.next_dir.fetch_add(1, Ordering::Relaxed);
        lock(&i.dirs).insert(id, Arc::new(tokio::sync::Mutex::new(listing)));
        reply.opened(FileHandle(id), FopenFlags::empty());
    }

    fn readdir(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        mut reply: ReplyDirectory,
    ) {
        let Some(listing) = self.inner.listing(fh) else {
            reply.error(Errno::EBADF);
            return;
        };
        self.spawn(|i| async move {
            let mut l = listing.lock().await;
            if offset == 0 {
                l.entries.clear();
                l.complete = false;
            }
            let mut at = usize::try_from(offset).unwrap_or(usize::MAX);
            loop {
                let entry = match at {
                    0 => Some((l.dir, fuser::FileType::Directory, &b"."[..])),
                    1 => Some((l.parent, fuser::FileType::Directory, &b".."[..])),
                    _ => {
                        if let Err(e) = l.fill(&*i.fs, at - 1).await {
                            return reply.error(err(&e));
                        }
                        l.entries
                            .get(at - 2)
                            .map(|e| (e.entry.ino, file_type(e.entry.kind), &e.entry.name[..]))
                    }
                };
                let Some((ino, kind, name)) = entry else {
                    break;
                };
                if reply.add(INodeNo(ino.0), at as u64 + 1, kind, OsStr::from_bytes(name)) {
                    break;
                }
                at += 1;
            }
            reply.ok();
        });
    }

    fn readdirplus(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        mut reply: ReplyDirectoryPlus,
    ) {
        let Some(listing) = self.inner.listing(fh) else {
            reply.error(Errno::EBADF);
            return;
        };
        self.spawn(|i| async move {
            let mut l = listing.lock().await;
            if offset == 0 {
                l.entries.clear();
                l.complete = false;
            }
            let ttl = i.cfg.entry_ttl.min(i.cfg.attr_ttl);
            let mut at = usize::try_from(offset).unwrap_or(usize::MAX);
            loop {
                let full = match at {
                    0 => reply.add(
                        INodeNo(l.dir.0),
                        1,
                        ".",
                        &ttl,
                        &dot_attr(l.dir),
                        Generation(0),
                    ),
                    1 => reply.add(
                        INodeNo(l.parent.0),
                        2,
                        "..",
                        &ttl,
                        &dot_attr(l.parent),
                        Generation(0),
                    ),
                    _ => {
                        if let Err(e) = l.fill(&*i.fs, at - 1).await {
                            return reply.error(err(&e));
                        }
                        let Some(e) = l.entries.get(at - 2) else {
                            break;
                        };
                        let Some(a) = &e.attr else {
                            break; // not kept by `fill`
                        };
                        i.learn_parent(a, l.dir);
                        reply.add(
                            INodeNo(a.ino.0),
                            at as u64 + 1,
                            OsStr::from_bytes(&e.entry.name),
                            &ttl,
                            &i.out_attr(a),
                            Generation(u64::from(a.generation)),
                        )
                    }
                };
                if full {
                    break;
                }
                at += 1;
            }
            reply.ok();
        });
    }

    fn releasedir(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        _flags: fuser::OpenFlags,
        reply: ReplyEmpty,
    ) {
        lock(&self.inner.dirs).remove(&fh.0);
        reply.ok();
    }

    /// Names created or removed ahead of the meta partitions (write-behind) become durable.
    fn fsyncdir(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        _datasync: bool,
        reply: ReplyEmpty,
    ) {
        self.spawn(|i| async move {
            match i.fs.sync_dir(Ino(ino.0)).await {
                Ok(()) => reply.ok(),
                Err(e) => reply.error(err(&e)),
            }
        });
    }

    fn statfs(&self, _req: &Request, _ino: INodeNo, reply: ReplyStatfs) {
        self.spawn(|i| async move {
            match i.fs.statfs().await {
                Ok(s) => {
                    let bsize = if s.block_size == 0 {
                        4096
                    } else {
                        s.block_size
                    };
                    let blocks = s.total_bytes / u64::from(bsize);
                    let free = s.free_bytes / u64::from(bsize);
                    reply.statfs(
                        blocks,
                        free,
                        free,
                        s.files.saturating_add(s.free_files),
                        s.free_files,
                        bsize,
                        s.max_name,
                        bsize,
                    );
                }
                Err(e) => reply.error(err(&e)),
            }
        });
    }

    fn setxattr(
        &self,
        _req: &Request,
        ino: INodeNo,
        name: &OsStr,
        value: &[u8],
        flags: i32,
        _position: u32,
        reply: ReplyEmpty,
    ) {
        let mode = match flags & (libc::XATTR_CREATE | libc::XATTR_REPLACE) {
            0 => XattrMode::Upsert,
            libc::XATTR_CREATE => XattrMode::Create,
            libc::XATTR_REPLACE => XattrMode::Replace,
            _ => return reply.error(Errno::EINVAL),
        };
        let (name, value) = (name_of(name), value.to_vec());
        self.spawn(|i| async move {
            if name == CAPS {
                i.set_caps_absent(ino.0, false);
            }
            match i.fs.setxattr(Ino(ino.0), &name, &value, mode).await {
                Ok(()) => reply.ok(),
                Err(e) => reply.error(err(&e)),
            }
        });
    }

    /// `size` 0 asks for the value's length only; a value longer than `size` is `ERANGE`.
    fn getxattr(&self, _req: &Request, ino: INodeNo, name: &OsStr, size: u32, reply: ReplyXattr) {
        let name = name_of(name);
        let caps = name == CAPS;
        if caps && self.inner.caps_known_absent(ino.0) {
            return reply.error(Errno::from_i32(libc::ENODATA));
        }
        self.spawn(|i| async move {
            match i.fs.getxattr(Ino(ino.0), &name).await {
                Ok(v) => reply_xattr(reply, &v, size),
                Err(e) => {
                    if caps && matches!(e, FsError::Meta(MetaError::NoXattr)) {
                        i.set_caps_absent(ino.0, true);
                    }
                    reply.error(err(&e))
                }
            }
        });
    }

    fn listxattr(&self, _req: &Request, ino: INodeNo, size: u32, reply: ReplyXattr) {
        self.spawn(|i| async move {
            match i.fs.listxattr(Ino(ino.0)).await {
                Ok(names) => {
                    let mut buf = Vec::new();
                    for n in names {
                        buf.extend_from_slice(&n);
                        buf.push(0);
                    }
                    reply_xattr(reply, &buf, size);
                }
                Err(e) => reply.error(err(&e)),
            }
        });
    }

    fn removexattr(&self, _req: &Request, ino: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        let name = name_of(name);
        self.spawn(|i| async move {
            match i.fs.removexattr(Ino(ino.0), &name).await {
                Ok(()) => reply.ok(),
                Err(e) => reply.error(err(&e)),
            }
        });
    }

    /// Permissions are checked by the kernel (the mount uses `default_permissions`).
    fn access(&self, _req: &Request, _ino: INodeNo, _mask: AccessFlags, reply: ReplyEmpty) {
        reply.ok();
    }

    /// The modes [`falloc_mode`] accepts; the kernel clears its cached pages of a punched range
    /// and takes the new size itself.
    /// No ioctl is known here: `ENOTTY`, as a local file system answers an ioctl it does not
    /// know (Python and others ask every file they open whether it is a terminal).
    fn ioctl(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _flags: IoctlFlags,
        _cmd: u32,
        _in_data: &[u8],
        _out_size: u32,
        reply: ReplyIoctl,
    ) {
        reply.error(Errno::from_i32(libc::ENOTTY));
    }

    /// `ENOSYS`: the kernel then answers `poll` itself (a regular file is always ready) and
    /// stops asking.
    fn poll(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _ph: PollNotifier,
        _events: PollEvents,
        _flags: PollFlags,
        reply: ReplyPoll,
    ) {
        reply.error(Errno::ENOSYS);
    }

    /// No block device underneath: `ENOSYS` (`FIBMAP` fails as on a network file system).
    fn bmap(&self, _req: &Request, _ino: INodeNo, _blocksize: u32, _idx: u64, reply: ReplyBmap) {
        reply.error(Errno::ENOSYS);
    }

    fn fallocate(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        length: u64,
        mode: i32,
        reply: ReplyEmpty,
    ) {
        let mode = match falloc_mode(mode, offset, length) {
            Ok(m) => m,
            Err(e) => return reply.error(e),
        };
        self.spawn(|i| async move {
            match i.fs.fallocate(Fh(fh.0), mode, offset, length).await {
                Ok(()) => reply.ok(),
                Err(e) => reply.error(err(&e)),
            }
        });
    }

    // Not offered by the file system. ENOSYS makes the kernel stop asking and fall back: to its
    // generic SEEK_DATA/SEEK_HOLE, and to a read/write copy for copy_file_range. (fuser's
    // defaults answer the same but log a warning.)
    fn lseek(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _offset: i64,
        _whence: i32,
        reply: fuser::ReplyLseek,
    ) {
        reply.error(Errno::ENOSYS);
    }

    fn copy_file_range(
        &self,
        _req: &Request,
        _ino_in: INodeNo,
        _fh_in: FileHandle,
        _offset_in: u64,
        _ino_out: INodeNo,
        _fh_out: FileHandle,
        _offset_out: u64,
        _len: u64,
        _flags: fuser::CopyFileRangeFlags,
        reply: ReplyWrite,
    ) {
        reply.error(Errno::ENOSYS);
    }

    fn create(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        umask: u32,
        flags: i32,
        reply: ReplyCreate,
    ) {
        let (name, caller) = (name_of(name), caller(req));
        let perm = mode & !umask & 0o7777;
        let exclusive = flags & libc::O_EXCL != 0;
        self.spawn(|i| async move {
            let flags = i.open_flags(flags);
            match i.fs.create(Ino(parent.0), &name, perm, caller, flags).await {
                Ok((e, fh)) => reply.created(
                    &i.cfg.attr_ttl.min(i.cfg.entry_ttl),
                    &i.out_attr(&e.attr),
                    Generation(u64::from(e.attr.generation)),
                    FileHandle(fh.0),
                    FopenFlags::empty(),
                ),
                // The kernel's lookup found no such name, but another client made it since (or
                // a cache's answer was that old). Without O_EXCL, open(2) must open the file that
                // is there: ESTALE makes the kernel look the name up again and retry once.
                Err(FsError::Meta(MetaError::Exists)) if !exclusive => {
                    reply.error(Errno::ESTALE);
                }
                Err(e) => reply.error(err(&e)),
            }
        });
    }
}

/// The [`Falloc`] of `fallocate(2)`'s `mode` bits, with the checks `vfs_fallocate` makes in
/// the order it makes them: a length of 0 or an offset past `i64::MAX` is `EINVAL`; any mode
/// but the ones nacre offers is `EOPNOTSUPP` (`COLLAPSE_RANGE`, `INSERT_RANGE`,
/// `UNSHARE_RANGE`, `NO_HIDE_STALE`, unknown bits, `PUNCH_HOLE` without `KEEP_SIZE`, and
/// `PUNCH_HOLE` with `ZERO_RANGE`, which kernels before 6.13 refuse with `EINVAL` instead);
/// an end past `i64::MAX` is `EFBIG`.
pub fn falloc_mode(mode: i32, offset: u64, len: u64) -> Result<Falloc, Errno> {
    const KEEP: i32 = libc::FALLOC_FL_KEEP_SIZE;
    const PUNCH: i32 = libc::FALLOC_FL_PUNCH_HOLE;
    const ZERO: i32 = libc::FALLOC_FL_ZERO_RANGE;
    if len == 0 || i64::try_from(offset).is_err() || i64::try_from(len).is_err() {
        return Err(Errno::EINVAL);
    }
    let falloc = match mode {
        0 => Falloc::Allocate,
        KEEP => Falloc::KeepSize,
        m if m == PUNCH | KEEP => Falloc::PunchHole,
        ZERO => Falloc::ZeroRange { keep_size: false },
        m if m == ZERO | KEEP => Falloc::ZeroRange { keep_size: true },
        _ => return Err(Errno::EOPNOTSUPP),
    };
    if offset
        .checked_add(len)
        .is_none_or(|end| i64::try_from(end).is_err())
    {
        return Err(Errno::EFBIG);
    }
    Ok(falloc)
}

/// The size probe protocol of getxattr/listxattr.
fn reply_xattr(reply: ReplyXattr, value: &[u8], size: u32) {
    let len = u32::try_from(value.len()).unwrap_or(u32::MAX);
    if size == 0 {
        reply.size(len);
    } else if len > size {
        reply.error(Errno::ERANGE);
    } else {
        reply.data(value);
    }
}

#[cfg(test)]
mod tests;
