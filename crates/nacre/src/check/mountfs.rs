//! [`MountFs`]: the workload's file system calls made with POSIX calls on a mounted volume, so
//! that FUSE, the kernel's caches and the mount's write-behind are in the path, and an error
//! the workload sees is the errno an application would see.
//!
//! Inodes are the mount's `st_ino` (the volume's inode numbers); each is remembered with the path
//! it was last found at, which is how later calls reach it. Handles are open files. Every call
//! runs on a blocking thread: a call into the mount may wait out a fault for seconds.
//!
//! Only what the workload uses is supported: lookups, attributes, size changes, files and
//! directories made, opened, read, written, synced and closed, renames, unlinks and listings.
//! The rest answers `Unsupported`.

use std::collections::HashMap;
use std::ffi::OsStr;
use std::fs::{File, Metadata, OpenOptions};
use std::io;
use std::os::fd::{IntoRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{DirBuilderExt, FileExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use nacre_api::meta::{Attr, DirEntry, FileType, MetaError, ROOT_INO, SetAttr, XattrMode};
use nacre_client::{
    CallError, Caller, DirEntryPlus, Entry, Fh, FileSystem, FsError, FsResult, OpenFlags, StatFs,
};
use nacre_types::Ino;
use nacre_types::sync::lock;

#[derive(Debug)]
pub(super) struct MountFs {
    st: Arc<Mutex<State>>,
    /// The root's `st_ino` (1 on a nacre mount), answered as `ROOT_INO`.
    root: u64,
}

#[derive(Debug)]
struct State {
    /// Inode → where it was last found.
    paths: HashMap<u64, PathBuf>,
    files: HashMap<u64, Arc<File>>,
    next_fh: u64,
}

impl MountFs {
    /// The volume mounted at `root`.
    pub(super) fn new(root: PathBuf) -> Self {
        let root_ino = std::fs::metadata(&root).map_or(ROOT_INO.0, |m| m.ino());
        let paths = HashMap::from([(ROOT_INO.0, root)]);
        Self {
            st: Arc::new(Mutex::new(State {
                paths,
                files: HashMap::new(),
                next_fh: 1,
            })),
            root: root_ino,
        }
    }

    /// `a` with the root's inode as `ROOT_INO`.
    fn rooted(&self, mut a: Attr) -> Attr {
        if a.ino.0 == self.root {
            a.ino = ROOT_INO;
        }
        a
    }

    fn path(&self, ino: Ino) -> FsResult<PathBuf> {
        lock(&self.st)
            .paths
            .get(&ino.0)
            .cloned()
            .ok_or(FsError::BadHandle(ino.0))
    }

    fn child(&self, parent: Ino, name: &[u8]) -> FsResult<PathBuf> {
        Ok(self.path(parent)?.join(OsStr::from_bytes(name)))
    }

    fn file(&self, fh: Fh) -> FsResult<Arc<File>> {
        lock(&self.st)
            .files
            .get(&fh.0)
            .cloned()
            .ok_or(FsError::BadHandle(fh.0))
    }

    /// Remembers where `attr`'s inode is.
    fn found(&self, path: PathBuf, attr: &Attr) {
        if attr.ino != ROOT_INO {
            lock(&self.st).paths.insert(attr.ino.0, path);
        }
    }

    fn opened(&self, file: File) -> Fh {
        let mut st = lock(&self.st);
        let fh = st.next_fh;
        st.next_fh += 1;
        st.files.insert(fh, Arc::new(file));
        Fh(fh)
    }
}

/// `f` on a blocking thread.
async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> io::Result<T> + Send + 'static,
) -> FsResult<T> {
    match tokio::task::spawn_blocking(f).await {
        Ok(r) => r.map_err(fs_error),
        Err(e) => Err(FsError::Unavailable(CallError::Unknown(format!(
            "a call into the mount did not finish: {e}"
        )))),
    }
}

/// The typed error for an errno from the mount, chosen so that `nacre_fuse::errno` gives the
/// errno back for the common ones; any other is `Unavailable` (EIO), its errno in the message.
fn fs_error(e: io::Error) -> FsError {
    let meta = |m: MetaError| FsError::Meta(m);
    match e.raw_os_error() {
        Some(libc::ENOENT) => meta(MetaError::NotFound),
        Some(libc::EEXIST) => meta(MetaError::Exists),
        Some(libc::ENOTDIR) => meta(MetaError::NotDir),
        Some(libc::EISDIR) => meta(MetaError::IsDir),
        Some(libc::ENOTEMPTY) => meta(MetaError::NotEmpty),
        Some(libc::ENAMETOOLONG) => meta(MetaError::NameTooLong),
        Some(libc::EINVAL) => meta(MetaError::Invalid(e.to_string())),
        Some(libc::ENOSPC) => FsError::NoSpace { wanted: 0, free: 0 },
        _ => FsError::Unavailable(CallError::Unknown(format!("from the mount: {e}"))),
    }
}

fn kind(m: &Metadata) -> FileType {
    let t = m.file_type();
    if t.is_dir() {
        FileType::Dir
    } else if t.is_symlink() {
        FileType::Symlink
    } else {
        FileType::File
    }
}

fn attr(m: &Metadata) -> Attr {
    let ns = |s: i64, n: i64| s.saturating_mul(1_000_000_000).saturating_add(n);
    Attr {
        ino: Ino(m.ino()),
        kind: kind(m),
        mode: m.mode() & 0o7777,
        uid: m.uid(),
        gid: m.gid(),
        size: m.size(),
        nlink: u32::try_from(m.nlink()).unwrap_or(u32::MAX),
        rdev: u32::try_from(m.rdev()).unwrap_or(0),
        atime: ns(m.atime(), m.atime_nsec()),
        mtime: ns(m.mtime(), m.mtime_nsec()),
        ctime: ns(m.ctime(), m.ctime_nsec()),
        generation: 0,
    }
}

fn stat(p: &Path) -> io::Result<Attr> {
    Ok(attr(&std::fs::symlink_metadata(p)?))
}

fn entry(attr: Attr) -> Entry {
    Entry {
        attr,
        parent: None,
        parent_was: None,
    }
}

/// Closes `fd` and reports the error `close(2)` returns: for a file on a FUSE mount, that is
/// the error of the flush the close makes (dropping a `File` throws it away).
#[allow(unsafe_code)]
fn close_checked(fd: OwnedFd) -> io::Result<()> {
    let raw = fd.into_raw_fd();
    // SAFETY: `raw` was owned by `fd`, which gave it up: nothing else closes or uses it.
    if unsafe { libc::close(raw) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

async fn unsupported<T>(what: &'static str) -> FsResult<T> {
    Err(FsError::Unsupported(what))
}

impl FileSystem for MountFs {
    async fn lookup(&self, parent: Ino, name: &[u8]) -> FsResult<Attr> {
        let p = self.child(parent, name)?;
        let q = p.clone();
        let a = self.rooted(blocking(move || stat(&q)).await?);
        self.found(p, &a);
        Ok(a)
    }

    async fn getattr(&self, ino: Ino) -> FsResult<Attr> {
        let p = self.path(ino)?;
        Ok(self.rooted(blocking(move || stat(&p)).await?))
    }

    async fn setattr(&self, ino: Ino, set: SetAttr) -> FsResult<Attr> {
        let SetAttr {
            size: Some(size), ..
        } = set
        else {
            return Err(FsError::Unsupported("setattr other than the size"));
        };
        if set.mode.is_some()
            || set.uid.is_some()
            || set.gid.is_some()
            || set.atime.is_some()
            || set.mtime.is_some()
        {
            return Err(FsError::Unsupported("setattr other than the size"));
        }
        let p = self.path(ino)?;
        blocking(move || {
            let f = OpenOptions::new().write(true).open(&p)?;
            f.set_len(size)?;
            close_checked(f.into())?;
            stat(&p)
        })
        .await
    }

    async fn create(
        &self,
        parent: Ino,
        name: &[u8],
        mode: u32,
        _caller: Caller,
        flags: OpenFlags,
    ) -> FsResult<(Entry, Fh)> {
        let p = self.child(parent, name)?;
        let q = p.clone();
        let (file, a) = blocking(move || {
            let f = OpenOptions::new()
                .read(flags.read)
                .write(true)
                .append(flags.append)
                .create_new(true)
                .mode(mode)
                .open(&q)?;
            let a = attr(&f.metadata()?);
            Ok((f, a))
        })
        .await?;
        self.found(p, &a);
        Ok((entry(a), self.opened(file)))
    }

    async fn mkdir(&self, parent: Ino, name: &[u8], mode: u32, _caller: Caller) -> FsResult<Entry> {
        let p = self.child(parent, name)?;
        let q = p.clone();
        let a = blocking(move || {
            std::fs::DirBuilder::new().mode(mode).create(&q)?;
            stat(&q)
        })
        .await?;
        self.found(p, &a);
        Ok(entry(a))
    }

    fn symlink(
        &self,
        _parent: Ino,
        _name: &[u8],
        _target: &[u8],
        _caller: Caller,
    ) -> impl Future<Output = FsResult<Entry>> + Send {
        unsupported("symlink")
    }

    fn mknod(
        &self,
        _parent: Ino,
        _name: &[u8],
        _kind: FileType,
        _mode: u32,
        _rdev: u32,
        _caller: Caller,
    ) -> impl Future<Output = FsResult<Entry>> + Send {
        unsupported("mknod")
    }

    fn link(
        &self,
        _ino: Ino,
        _new_parent: Ino,
        _new_name: &[u8],
    ) -> impl Future<Output = FsResult<Entry>> + Send {
        unsupported("link")
    }

    async fn unlink(&self, parent: Ino, name: &[u8]) -> FsResult<Vec<Attr>> {
        let p = self.child(parent, name)?;
        blocking(move || std::fs::remove_file(&p)).await?;
        Ok(Vec::new())
    }

    async fn rmdir(&self, parent: Ino, name: &[u8]) -> FsResult<Vec<Attr>> {
        let p = self.child(parent, name)?;
        blocking(move || std::fs::remove_dir(&p)).await?;
        Ok(Vec::new())
    }

    async fn rename(
        &self,
        parent: Ino,
        name: &[u8],
        new_parent: Ino,
        new_name: &[u8],
    ) -> FsResult<Vec<Attr>> {
        let (from, to) = (self.child(parent, name)?, self.child(new_parent, new_name)?);
        let q = to.clone();
        let a = blocking(move || {
            std::fs::rename(&from, &q)?;
            stat(&q)
        })
        .await?;
        self.found(to, &a);
        Ok(Vec::new())
    }

    fn readlink(&self, _ino: Ino) -> impl Future<Output = FsResult<Vec<u8>>> + Send {
        unsupported("readlink")
    }

    async fn readdir(
        &self,
        dir: Ino,
        after: Option<Vec<u8>>,
        limit: u32,
    ) -> FsResult<Vec<DirEntryPlus>> {
        let p = self.path(dir)?;
        let listed = blocking(move || {
            let mut out = Vec::new();
            for e in std::fs::read_dir(&p)? {
                let e = e?;
                let name = e.file_name().as_bytes().to_vec();
                if after.as_ref().is_some_and(|a| name <= *a) {
                    continue;
                }
                let path = e.path();
                let a = stat(&path)?;
                out.push((path, a, name));
            }
            out.sort_by(|x, y| x.2.cmp(&y.2));
            if limit > 0 {
                out.truncate(limit as usize);
            }
            Ok(out)
        })
        .await?;
        let mut entries = Vec::with_capacity(listed.len());
        for (path, a, name) in listed {
            self.found(path, &a);
            entries.push(DirEntryPlus {
                entry: DirEntry {
                    name,
                    ino: a.ino,
                    kind: a.kind,
                },
                attr: Some(a),
            });
        }
        Ok(entries)
    }

    async fn open(&self, ino: Ino, flags: OpenFlags) -> FsResult<Fh> {
        let p = self.path(ino)?;
        let file = blocking(move || {
            OpenOptions::new()
                .read(flags.read || !flags.write)
                .write(flags.write && !flags.append)
                .append(flags.append)
                .truncate(flags.truncate && flags.write)
                .open(&p)
        })
        .await?;
        Ok(self.opened(file))
    }

    async fn read(&self, fh: Fh, offset: u64, len: u32) -> FsResult<Bytes> {
        let f = self.file(fh)?;
        blocking(move || {
            let mut buf = vec![0u8; len as usize];
            let mut got = 0;
            while got < buf.len() {
                match f.read_at(&mut buf[got..], offset + got as u64)? {
                    0 => break,
                    n => got += n,
                }
            }
            buf.truncate(got);
            Ok(Bytes::from(buf))
        })
        .await
    }

    async fn write(&self, fh: Fh, offset: u64, data: Bytes) -> FsResult<u32> {
        let f = self.file(fh)?;
        let n = u32::try_from(data.len()).unwrap_or(u32::MAX);
        blocking(move || f.write_all_at(&data, offset)).await?;
        Ok(n)
    }

    async fn flush(&self, fh: Fh) -> FsResult<()> {
        let f = self.file(fh)?;
        // A close of a duplicate makes the kernel flush the file and returns the flush's error.
        blocking(move || close_checked(f.try_clone()?.into())).await
    }

    async fn fsync(&self, fh: Fh) -> FsResult<()> {
        let f = self.file(fh)?;
        blocking(move || f.sync_all()).await
    }

    async fn sync_dir(&self, dir: Ino) -> FsResult<()> {
        let p = self.path(dir)?;
        blocking(move || File::open(&p)?.sync_all()).await
    }

    async fn release(&self, fh: Fh) -> FsResult<()> {
        let f = lock(&self.st)
            .files
            .remove(&fh.0)
            .ok_or(FsError::BadHandle(fh.0))?;
        // Another call on the handle still running keeps the file open; it closes after it.
        match Arc::try_unwrap(f) {
            Ok(f) => blocking(move || close_checked(f.into())).await,
            Err(_) => Ok(()),
        }
    }

    fn statfs(&self) -> impl Future<Output = FsResult<StatFs>> + Send {
        unsupported("statfs")
    }

    fn getxattr(&self, _ino: Ino, _name: &[u8]) -> impl Future<Output = FsResult<Vec<u8>>> + Send {
        unsupported("getxattr")
    }

    fn setxattr(
        &self,
        _ino: Ino,
        _name: &[u8],
        _value: &[u8],
        _mode: XattrMode,
    ) -> impl Future<Output = FsResult<()>> + Send {
        unsupported("setxattr")
    }

    fn listxattr(&self, _ino: Ino) -> impl Future<Output = FsResult<Vec<Vec<u8>>>> + Send {
        unsupported("listxattr")
    }

    fn removexattr(&self, _ino: Ino, _name: &[u8]) -> impl Future<Output = FsResult<()>> + Send {
        unsupported("removexattr")
    }
}

/// A `nacre mount` process of the volume, as users run it (default flags: write-behind on).
#[derive(Debug)]
pub(super) struct Mount {
    child: tokio::process::Child,
    dir: PathBuf,
}

/// How long a mount may take to appear.
const MOUNT_WAIT: std::time::Duration = std::time::Duration::from_secs(30);
/// How long a mount may take to write out what it holds and exit.
const MOUNT_STOP: std::time::Duration = std::time::Duration::from_secs(60);

impl Mount {
    /// Mounts `volume` at `dir` (made if missing) with a `nacre mount` process of `exe`, whose
    /// log goes to `log`; returns once the kernel lists the mount.
    pub(super) async fn start(
        exe: &Path,
        volume: &str,
        masters: &[String],
        dir: &Path,
        log: &Path,
        node_log: &str,
    ) -> anyhow::Result<Self> {
        use anyhow::Context as _;
        std::fs::create_dir_all(dir)?;
        let out = std::fs::File::create(log)?;
        let child = tokio::process::Command::new(exe)
            .args(["mount", volume])
            .arg(dir)
            .args(["--master", &masters.join(",")])
            .env("NACRE_LOG", node_log)
            .stdin(std::process::Stdio::null())
            .stdout(out.try_clone()?)
            .stderr(out)
            .kill_on_drop(true)
            .spawn()
            .context("cannot start nacre mount")?;
        let mut m = Self {
            child,
            dir: dir.to_path_buf(),
        };
        let deadline = tokio::time::Instant::now() + MOUNT_WAIT;
        while !mounted(dir) {
            if let Ok(Some(status)) = m.child.try_wait() {
                anyhow::bail!("nacre mount exited with {status} (see {})", log.display());
            }
            if tokio::time::Instant::now() >= deadline {
                anyhow::bail!("{} not mounted after {MOUNT_WAIT:?}", dir.display());
            }
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
        Ok(m)
    }

    /// Stops the mount as a user's Ctrl-C does (SIGTERM: it unmounts, writes out what it holds
    /// behind and exits) and waits for the process, which must exit cleanly. A plain `umount`
    /// would not end it here: node processes restarted after the mount run in mount namespaces
    /// of their own (`ip netns exec`) that hold copies of it, so the FUSE session goes on.
    pub(super) async fn stop(mut self) -> anyhow::Result<()> {
        use rustix::process::{Pid, Signal, kill_process};
        let pid = self
            .child
            .id()
            .and_then(|id| i32::try_from(id).ok())
            .and_then(Pid::from_raw)
            .ok_or_else(|| anyhow::anyhow!("nacre mount exited before the end"))?;
        kill_process(pid, Signal::TERM)?;
        match tokio::time::timeout(MOUNT_STOP, self.child.wait()).await {
            Ok(status) => {
                let status = status?;
                anyhow::ensure!(status.success(), "nacre mount exited with {status}");
                Ok(())
            }
            Err(_) => anyhow::bail!("nacre mount still running {MOUNT_STOP:?} after SIGTERM"),
        }
    }
}

impl Drop for Mount {
    fn drop(&mut self) {
        if mounted(&self.dir) {
            let _ = std::process::Command::new("umount")
                .arg("-l")
                .arg(&self.dir)
                .status();
        }
    }
}

/// Whether the kernel lists a mount at `dir`.
fn mounted(dir: &Path) -> bool {
    let Ok(dir) = dir.canonicalize() else {
        return false;
    };
    std::fs::read_to_string("/proc/self/mountinfo").is_ok_and(|t| {
        t.lines()
            .filter_map(|l| l.split(' ').nth(4))
            .any(|p| Path::new(p) == dir)
    })
}
