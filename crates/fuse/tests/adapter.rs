//! The adapter through the kernel, over a toy in-memory `FileSystem` (no cluster): paging and
//! stable offsets of listings, the xattr size probe, rename flags, errno values, unmount with
//! files open. Skipped (with a message) without root or /dev/fuse.
#![allow(clippy::unwrap_used)]

use std::collections::{BTreeMap, HashMap};
use std::fs;
use std::io::Write as _;
use std::os::unix::fs::MetadataExt as _;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use nacre_api::meta::{Attr, DirEntry, FileType, MetaError, SetAttr, XattrMode, without_suidgid};
use nacre_client::{
    Caller, DirEntryPlus, Entry, Fh, FileSystem, FsError, FsResult, OpenFlags, StatFs,
};
use nacre_fuse::{MountOptions, Mounted, mount};
use nacre_types::Ino;

/// Every readdir page is at most this long, whatever the caller asks: the adapter must go on
/// after short pages.
const SHORT_PAGE: usize = 7;

#[derive(Default)]
struct State {
    attrs: HashMap<Ino, Attr>,
    data: HashMap<Ino, Vec<u8>>,
    dirs: HashMap<Ino, BTreeMap<Vec<u8>, Ino>>,
    links: HashMap<Ino, Vec<u8>>,
    xattrs: HashMap<Ino, BTreeMap<Vec<u8>, Vec<u8>>>,
    handles: HashMap<u64, (Ino, OpenFlags)>,
    next: u64,
}

/// A minimal POSIX-ish file system in memory; counts reads of `security.capability`.
struct Toy(Mutex<State>, std::sync::atomic::AtomicU64);

fn not_found() -> FsError {
    MetaError::NotFound.into()
}

impl Toy {
    fn new() -> Self {
        let mut s = State {
            next: 2,
            ..State::default()
        };
        s.attrs.insert(Ino(1), attr(Ino(1), FileType::Dir, 0o755));
        s.dirs.insert(Ino(1), BTreeMap::new());
        Self(Mutex::new(s), std::sync::atomic::AtomicU64::new(0))
    }

    fn new_inode(&self, parent: Ino, name: &[u8], kind: FileType, mode: u32) -> FsResult<Attr> {
        let mut s = self.0.lock().unwrap();
        let dir = s.dirs.get(&parent).ok_or_else(not_found)?;
        if dir.contains_key(name) {
            return Err(MetaError::Exists.into());
        }
        let ino = Ino(s.next);
        s.next += 1;
        let a = attr(ino, kind, mode);
        s.attrs.insert(ino, a.clone());
        match kind {
            FileType::Dir => {
                s.dirs.insert(ino, BTreeMap::new());
            }
            _ => {
                s.data.insert(ino, Vec::new());
            }
        }
        s.dirs.get_mut(&parent).unwrap().insert(name.to_vec(), ino);
        Ok(a)
    }

    fn open_ino(&self, ino: Ino, flags: OpenFlags) -> Fh {
        let mut s = self.0.lock().unwrap();
        let fh = s.next;
        s.next += 1;
        s.handles.insert(fh, (ino, flags));
        Fh(fh)
    }

    fn handle(&self, fh: Fh) -> FsResult<(Ino, OpenFlags)> {
        self.0
            .lock()
            .unwrap()
            .handles
            .get(&fh.0)
            .copied()
            .ok_or(FsError::BadHandle(fh.0))
    }
}

fn attr(ino: Ino, kind: FileType, mode: u32) -> Attr {
    Attr {
        ino,
        kind,
        mode: mode & 0o7777,
        uid: 0,
        gid: 0,
        size: 0,
        nlink: if kind == FileType::Dir { 2 } else { 1 },
        rdev: 0,
        atime: 1,
        mtime: 1,
        ctime: 1,
        generation: 0,
    }
}

impl FileSystem for Toy {
    async fn lookup(&self, parent: Ino, name: &[u8]) -> FsResult<Attr> {
        let s = self.0.lock().unwrap();
        let ino = s
            .dirs
            .get(&parent)
            .ok_or(FsError::Meta(MetaError::NotDir))?
            .get(name)
            .ok_or_else(not_found)?;
        s.attrs.get(ino).cloned().ok_or_else(not_found)
    }

    async fn getattr(&self, ino: Ino) -> FsResult<Attr> {
        self.0
            .lock()
            .unwrap()
            .attrs
            .get(&ino)
            .cloned()
            .ok_or_else(not_found)
    }

    async fn setattr(&self, ino: Ino, set: SetAttr) -> FsResult<Attr> {
        let mut s = self.0.lock().unwrap();
        let s = &mut *s;
        let a = s.attrs.get_mut(&ino).ok_or_else(not_found)?;
        if let Some(m) = set.mode {
            a.mode = m;
        }
        a.uid = set.uid.unwrap_or(a.uid);
        a.gid = set.gid.unwrap_or(a.gid);
        if set.kill_suidgid && a.kind != FileType::Dir {
            a.mode = without_suidgid(a.mode);
        }
        if let Some(size) = set.size {
            a.size = size;
            if let Some(d) = s.data.get_mut(&ino) {
                d.resize(size as usize, 0);
            }
        }
        if let Some(t) = set.mtime {
            a.mtime = t;
        }
        if let Some(t) = set.atime {
            a.atime = t;
        }
        Ok(a.clone())
    }

    async fn create(
        &self,
        parent: Ino,
        name: &[u8],
        mode: u32,
        _caller: Caller,
        flags: OpenFlags,
    ) -> FsResult<(Entry, Fh)> {
        let attr = self.new_inode(parent, name, FileType::File, mode)?;
        let fh = self.open_ino(attr.ino, flags);
        Ok((Entry::bare(attr), fh))
    }

    async fn mkdir(&self, parent: Ino, name: &[u8], mode: u32, _caller: Caller) -> FsResult<Entry> {
        let attr = self.new_inode(parent, name, FileType::Dir, mode)?;
        Ok(Entry::bare(attr))
    }

    async fn symlink(
        &self,
        parent: Ino,
        name: &[u8],
        target: &[u8],
        _caller: Caller,
    ) -> FsResult<Entry> {
        let mut a = self.new_inode(parent, name, FileType::Symlink, 0o777)?;
        let mut s = self.0.lock().unwrap();
        s.links.insert(a.ino, target.to_vec());
        a.size = target.len() as u64;
        s.attrs.insert(a.ino, a.clone());
        Ok(Entry::bare(a))
    }

    async fn mknod(
        &self,
        parent: Ino,
        name: &[u8],
        kind: FileType,
        mode: u32,
        rdev: u32,
        _caller: Caller,
    ) -> FsResult<Entry> {
        let mut a = self.new_inode(parent, name, kind, mode)?;
        a.rdev = rdev;
        self.0.lock().unwrap().attrs.insert(a.ino, a.clone());
        Ok(Entry::bare(a))
    }

    async fn link(&self, ino: Ino, new_parent: Ino, new_name: &[u8]) -> FsResult<Entry> {
        let mut s = self.0.lock().unwrap();
        let dir = s.dirs.get_mut(&new_parent).ok_or_else(not_found)?;
        if dir.contains_key(new_name) {
            return Err(MetaError::Exists.into());
        }
        dir.insert(new_name.to_vec(), ino);
        let a = s.attrs.get_mut(&ino).ok_or_else(not_found)?;
        a.nlink += 1;
        Ok(Entry::bare(a.clone()))
    }

    async fn unlink(&self, parent: Ino, name: &[u8]) -> FsResult<Vec<Attr>> {
        let mut s = self.0.lock().unwrap();
        let ino = *s
            .dirs
            .get(&parent)
            .and_then(|d| d.get(name))
            .ok_or_else(not_found)?;
        if s.dirs.contains_key(&ino) {
            return Err(MetaError::IsDir.into());
        }
        s.dirs.get_mut(&parent).unwrap().remove(name);
        if let Some(a) = s.attrs.get_mut(&ino) {
            a.nlink -= 1;
        }
        Ok(Vec::new())
    }

    async fn rmdir(&self, parent: Ino, name: &[u8]) -> FsResult<Vec<Attr>> {
        let mut s = self.0.lock().unwrap();
        let ino = *s
            .dirs
            .get(&parent)
            .and_then(|d| d.get(name))
            .ok_or_else(not_found)?;
        match s.dirs.get(&ino) {
            None => return Err(MetaError::NotDir.into()),
            Some(d) if !d.is_empty() => return Err(MetaError::NotEmpty.into()),
            Some(_) => {}
        }
        s.dirs.remove(&ino);
        s.dirs.get_mut(&parent).unwrap().remove(name);
        Ok(Vec::new())
    }

    async fn rename(
        &self,
        parent: Ino,
        name: &[u8],
        new_parent: Ino,
        new_name: &[u8],
    ) -> FsResult<Vec<Attr>> {
        let mut s = self.0.lock().unwrap();
        let ino = s
            .dirs
            .get_mut(&parent)
            .and_then(|d| d.remove(name))
            .ok_or_else(not_found)?;
        s.dirs
            .get_mut(&new_parent)
            .ok_or_else(not_found)?
            .insert(new_name.to_vec(), ino);
        Ok(Vec::new())
    }

    async fn readlink(&self, ino: Ino) -> FsResult<Vec<u8>> {
        self.0
            .lock()
            .unwrap()
            .links
            .get(&ino)
            .cloned()
            .ok_or(FsError::Meta(MetaError::Invalid("not a symlink".into())))
    }

    async fn readdir(
        &self,
        dir: Ino,
        after: Option<Vec<u8>>,
        limit: u32,
    ) -> FsResult<Vec<DirEntryPlus>> {
        let s = self.0.lock().unwrap();
        let d = s.dirs.get(&dir).ok_or(FsError::Meta(MetaError::NotDir))?;
        let limit = if limit == 0 {
            usize::MAX
        } else {
            limit as usize
        };
        Ok(d.iter()
            .filter(|(n, _)| after.as_ref().is_none_or(|a| *n > a))
            .take(limit.min(SHORT_PAGE))
            .map(|(n, ino)| {
                let attr = s.attrs.get(ino).cloned();
                DirEntryPlus {
                    entry: DirEntry {
                        name: n.clone(),
                        ino: *ino,
                        kind: attr.as_ref().map_or(FileType::File, |a| a.kind),
                    },
                    attr,
                }
            })
            .collect())
    }

    async fn open(&self, ino: Ino, flags: OpenFlags) -> FsResult<Fh> {
        if flags.truncate {
            self.setattr(
                ino,
                SetAttr {
                    size: Some(0),
                    kill_suidgid: flags.kill_suidgid,
                    ..SetAttr::default()
                },
            )
            .await?;
        }
        Ok(self.open_ino(ino, flags))
    }

    async fn read(&self, fh: Fh, offset: u64, len: u32) -> FsResult<Bytes> {
        let (ino, _) = self.handle(fh)?;
        let s = self.0.lock().unwrap();
        let d = s.data.get(&ino).ok_or_else(not_found)?;
        let from = (offset as usize).min(d.len());
        let to = (from + len as usize).min(d.len());
        Ok(Bytes::copy_from_slice(&d[from..to]))
    }

    async fn write(&self, fh: Fh, offset: u64, data: Bytes) -> FsResult<u32> {
        let (ino, flags) = self.handle(fh)?;
        if !flags.write {
            return Err(FsError::NotOpenFor("writing"));
        }
        let mut s = self.0.lock().unwrap();
        let d = s.data.get_mut(&ino).ok_or_else(not_found)?;
        let at = if flags.append {
            d.len()
        } else {
            offset as usize
        };
        if d.len() < at + data.len() {
            d.resize(at + data.len(), 0);
        }
        d[at..at + data.len()].copy_from_slice(&data);
        let size = d.len() as u64;
        s.attrs.get_mut(&ino).unwrap().size = size;
        Ok(data.len() as u32)
    }

    async fn flush(&self, fh: Fh) -> FsResult<()> {
        self.handle(fh).map(|_| ())
    }

    async fn fsync(&self, fh: Fh) -> FsResult<()> {
        self.handle(fh).map(|_| ())
    }

    async fn release(&self, fh: Fh) -> FsResult<()> {
        self.0
            .lock()
            .unwrap()
            .handles
            .remove(&fh.0)
            .map(|_| ())
            .ok_or(FsError::BadHandle(fh.0))
    }

    async fn statfs(&self) -> FsResult<StatFs> {
        Ok(StatFs {
            total_bytes: 1 << 30,
            free_bytes: 1 << 29,
            files: 10,
            free_files: 1000,
            block_size: 4096,
            max_name: 255,
        })
    }

    async fn getxattr(&self, ino: Ino, name: &[u8]) -> FsResult<Vec<u8>> {
        if name == b"security.capability" {
            self.1.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        let s = self.0.lock().unwrap();
        s.xattrs
            .get(&ino)
            .and_then(|x| x.get(name))
            .cloned()
            .ok_or(FsError::Meta(MetaError::NoXattr))
    }

    async fn setxattr(&self, ino: Ino, name: &[u8], value: &[u8], mode: XattrMode) -> FsResult<()> {
        let mut s = self.0.lock().unwrap();
        let x = s.xattrs.entry(ino).or_default();
        match (mode, x.contains_key(name)) {
            (XattrMode::Create, true) => return Err(MetaError::Exists.into()),
            (XattrMode::Replace, false) => return Err(MetaError::NoXattr.into()),
            _ => {}
        }
        x.insert(name.to_vec(), value.to_vec());
        Ok(())
    }

    async fn listxattr(&self, ino: Ino) -> FsResult<Vec<Vec<u8>>> {
        let s = self.0.lock().unwrap();
        Ok(s.xattrs
            .get(&ino)
            .map(|x| x.keys().cloned().collect())
            .unwrap_or_default())
    }

    async fn removexattr(&self, ino: Ino, name: &[u8]) -> FsResult<()> {
        let mut s = self.0.lock().unwrap();
        s.xattrs
            .get_mut(&ino)
            .and_then(|x| x.remove(name))
            .map(|_| ())
            .ok_or(FsError::Meta(MetaError::NoXattr))
    }
}

fn no_fuse() -> Option<String> {
    if !rustix::process::geteuid().is_root() {
        return Some("not root".into());
    }
    fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/fuse")
        .err()
        .map(|e| format!("cannot open /dev/fuse: {e}"))
}

fn errno_of<T>(r: std::io::Result<T>) -> i32 {
    r.err().and_then(|e| e.raw_os_error()).unwrap_or(0)
}

fn python(script: &str, arg: &Path) -> Option<String> {
    let out = Command::new("python3")
        .args(["-c", script])
        .arg(arg)
        .output()
        .ok()?;
    assert!(
        out.status.success(),
        "python3: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Some(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// A fresh `Toy` mounted in a temporary directory; fields drop in order (unmount first).
struct ToyMount {
    mounted: Mounted,
    mnt: PathBuf,
    toy: Arc<Toy>,
    _tmp: tempfile::TempDir,
    _rt: tokio::runtime::Runtime,
}

/// `None` (with a message) where FUSE cannot run.
fn toy_mount() -> Option<ToyMount> {
    if let Some(why) = no_fuse() {
        eprintln!("skipped: {why}");
        return None;
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .build()
        .unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let mnt = tmp.path().join("mnt");
    fs::create_dir(&mnt).unwrap();
    let opts = MountOptions {
        volume: "toy".into(),
        ..MountOptions::default()
    };
    let toy = Arc::new(Toy::new());
    let mounted = mount(toy.clone(), rt.handle().clone(), &mnt, &opts).unwrap();
    Some(ToyMount {
        mounted,
        mnt,
        toy,
        _tmp: tmp,
        _rt: rt,
    })
}

#[test]
fn through_the_kernel() {
    let Some(t) = toy_mount() else {
        return;
    };
    let (mnt, toy) = (&t.mnt, &t.toy);
    let mounts = fs::read_to_string("/proc/self/mounts").unwrap();
    assert!(
        mounts
            .lines()
            .any(|l| l.starts_with("nacre:toy ") && l.contains(" fuse.nacre ")),
        "{mounts}"
    );

    // Files, appends, truncation, errno values.
    let f = mnt.join("f");
    fs::write(&f, b"abc").unwrap();
    fs::OpenOptions::new()
        .append(true)
        .open(&f)
        .unwrap()
        .write_all(b"def")
        .unwrap();
    assert_eq!(fs::read(&f).unwrap(), b"abcdef");
    // The kernel asks for security.capability before every write; the adapter remembers its
    // absence for the attribute TTL instead of asking the file system each time.
    let before = toy.1.load(std::sync::atomic::Ordering::Relaxed);
    let mut w = fs::File::create(mnt.join("caps")).unwrap();
    for _ in 0..50 {
        w.write_all(b"x").unwrap();
    }
    drop(w);
    let asked = toy.1.load(std::sync::atomic::Ordering::Relaxed) - before;
    assert!(
        asked < 10,
        "security.capability asked {asked} times for 50 writes"
    );
    fs::remove_file(mnt.join("caps")).unwrap();
    fs::OpenOptions::new()
        .write(true)
        .open(&f)
        .unwrap()
        .set_len(2)
        .unwrap();
    assert_eq!(fs::read(&f).unwrap(), b"ab");
    assert_eq!(fs::metadata(&f).unwrap().blocks(), 1);
    assert_eq!(fs::metadata(&f).unwrap().blksize(), 128 * 1024);
    assert_eq!(errno_of(fs::read(mnt.join("nope"))), libc::ENOENT);
    assert_eq!(errno_of(fs::create_dir(&f)), libc::EEXIST);
    fs::create_dir(mnt.join("d")).unwrap();
    fs::write(mnt.join("d/x"), b"").unwrap();
    assert_eq!(errno_of(fs::remove_dir(mnt.join("d"))), libc::ENOTEMPTY);
    // mknod of a FIFO (the file system's mknod), and of a regular file (create + release).
    let st = Command::new("mknod")
        .arg(mnt.join("node"))
        .arg("p")
        .status()
        .unwrap();
    assert!(st.success());
    assert!(std::os::unix::fs::FileTypeExt::is_fifo(
        &fs::symlink_metadata(mnt.join("node")).unwrap().file_type()
    ));
    let script = "import os, stat, sys; os.mknod(sys.argv[1], stat.S_IFREG | 0o600); \
                  print(oct(os.stat(sys.argv[1]).st_mode))";
    if let Some(out) = python(script, &mnt.join("regular")) {
        assert_eq!(out.trim(), "0o100600");
    }
    std::os::unix::fs::symlink("f", mnt.join("s")).unwrap();
    assert_eq!(fs::read_link(mnt.join("s")).unwrap(), Path::new("f"));
    fs::hard_link(&f, mnt.join("h")).unwrap();
    assert_eq!(fs::metadata(mnt.join("h")).unwrap().nlink(), 2);

    // A listing longer than many short pages, including `.` and `..`, with stable offsets:
    // entries removed while the directory is open do not make the listing skip others.
    let big = mnt.join("big");
    fs::create_dir(&big).unwrap();
    let names: Vec<String> = (0..500).map(|i| format!("n{i:04}")).collect();
    for n in &names {
        fs::write(big.join(n), b"").unwrap();
    }
    let mut got: Vec<String> = fs::read_dir(&big)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    got.sort();
    assert_eq!(got, names);
    let ls = Command::new("ls").arg("-a").arg(&big).output().unwrap();
    let ls = String::from_utf8(ls.stdout).unwrap();
    assert_eq!(ls.lines().count(), 502);
    let script = r#"
import os, sys
d = sys.argv[1]
it = os.scandir(d)
first = [next(it).name for _ in range(100)]
for n in sorted(os.listdir(d))[:50]:
    os.unlink(os.path.join(d, n))   # behind the cursor
rest = [e.name for e in it]
print(len(first) + len(rest), len(set(first) | set(rest)))
"#;
    if let Some(out) = python(script, &big) {
        assert_eq!(out.trim(), "500 500");
    }

    // Extended attributes: the size probe, ERANGE, create/replace flags, listing.
    let script = r#"
import errno, os, sys
p = sys.argv[1]
os.setxattr(p, "user.k", b"v" * 100)
os.setxattr(p, "user.j", b"")
assert os.getxattr(p, "user.k") == b"v" * 100
assert os.getxattr(p, "user.j") == b""
assert sorted(os.listxattr(p)) == ["user.j", "user.k"]
for mode, name, err in [(os.XATTR_CREATE, "user.k", errno.EEXIST), (os.XATTR_REPLACE, "user.z", errno.ENODATA)]:
    try:
        os.setxattr(p, name, b"x", mode); sys.exit("flag ignored")
    except OSError as e:
        assert e.errno == err, e
os.removexattr(p, "user.k")
try:
    os.getxattr(p, "user.k"); sys.exit("still there")
except OSError as e:
    assert e.errno == errno.ENODATA
print("ok")
"#;
    if let Some(out) = python(script, &f) {
        assert_eq!(out.trim(), "ok");
    }

    // Rename flags: RENAME_EXCHANGE is refused; RENAME_NOREPLACE refuses an existing target.
    // (Not `h`: a rename between two links of one inode succeeds in the VFS without a call.)
    let e = rustix::fs::renameat_with(
        rustix::fs::CWD,
        &f,
        rustix::fs::CWD,
        mnt.join("d/x"),
        rustix::fs::RenameFlags::EXCHANGE,
    );
    assert_eq!(e, Err(rustix::io::Errno::INVAL));
    let e = rustix::fs::renameat_with(
        rustix::fs::CWD,
        &f,
        rustix::fs::CWD,
        mnt.join("d/x"),
        rustix::fs::RenameFlags::NOREPLACE,
    );
    assert_eq!(e, Err(rustix::io::Errno::EXIST));
    rustix::fs::renameat_with(
        rustix::fs::CWD,
        &f,
        rustix::fs::CWD,
        mnt.join("g"),
        rustix::fs::RenameFlags::NOREPLACE,
    )
    .unwrap();
    assert_eq!(fs::read(mnt.join("g")).unwrap(), b"ab");

    // An ioctl the file system does not know (a terminal check): ENOTTY, as on a local disk.
    let file = fs::File::open(mnt.join("g")).unwrap();
    assert!(!rustix::termios::isatty(&file));
    assert_eq!(
        rustix::termios::tcgetattr(&file).err(),
        Some(rustix::io::Errno::NOTTY)
    );
    drop(file);

    // statfs.
    let st = rustix::fs::statvfs(mnt).unwrap();
    assert_eq!(
        (st.f_bsize, st.f_blocks, st.f_bfree),
        (4096, 1 << 18, 1 << 17)
    );
    assert_eq!((st.f_files, st.f_ffree, st.f_namemax), (1010, 1000, 255));

    // Unmount with a file open: detached lazily; the mount point is free at once.
    let open = fs::File::open(mnt.join("g")).unwrap();
    t.mounted.unmount().unwrap();
    let mounts = fs::read_to_string("/proc/self/mounts").unwrap();
    assert!(!mounts.contains("nacre:toy "), "{mounts}");
    drop(open);
}

/// With `FUSE_HANDLE_KILLPRIV_V2` the kernel leaves clearing set-user-ID and set-group-ID bits
/// to the file system: a write or truncate by a caller without `CAP_FSETID` (here: not root)
/// clears them, one by root keeps them, chown clears them on anything but a directory.
#[test]
fn set_id_bits_are_cleared_as_the_kernel_would() {
    use std::os::unix::fs::PermissionsExt as _;
    use std::os::unix::process::CommandExt as _;
    let Some(t) = toy_mount() else {
        return;
    };
    let (mnt, toy) = (&t.mnt, &t.toy);
    // The mode the file system holds (the kernel's copy may be a TTL old).
    let mode = |name: &str| {
        let s = toy.0.lock().unwrap();
        let ino = s.dirs[&Ino(1)][name.as_bytes()];
        s.attrs[&ino].mode
    };
    let file = |name: &str, mode: u32| {
        let p = mnt.join(name);
        fs::write(&p, b"abc").unwrap();
        fs::set_permissions(&p, fs::Permissions::from_mode(mode)).unwrap();
        p
    };
    let nobody = |script: &str| {
        let out = Command::new("sh")
            .args(["-c", script])
            .current_dir(mnt)
            .uid(65534)
            .gid(65534)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{script}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    };

    file("w", 0o6777);
    nobody("printf x >> w");
    assert_eq!(mode("w"), 0o777, "a write by nobody");
    let seen = fs::metadata(mnt.join("w")).unwrap().mode();
    assert_eq!(seen & 0o7777, 0o777, "the kernel's view after the write");
    // Set-group-ID without group execute marks mandatory locking, not a privilege.
    file("lock", 0o2767);
    nobody("printf x >> lock");
    assert_eq!(mode("lock"), 0o2767);
    file("root", 0o6777);
    fs::OpenOptions::new()
        .append(true)
        .open(mnt.join("root"))
        .unwrap()
        .write_all(b"x")
        .unwrap();
    assert_eq!(mode("root"), 0o6777, "root has CAP_FSETID");
    file("t", 0o4777);
    nobody("truncate -s 1 t");
    assert_eq!(mode("t"), 0o777, "a truncate by nobody");
    file("o", 0o4777);
    nobody(": > o");
    assert_eq!(mode("o"), 0o777, "open(O_TRUNC) by nobody");
    let o = fs::read(mnt.join("o")).unwrap();
    assert!(o.is_empty(), "{o:?}");
    let c = file("c", 0o6755);
    std::os::unix::fs::chown(&c, Some(1), Some(1)).unwrap();
    assert_eq!(mode("c"), 0o755, "chown, even by root");
    let d = mnt.join("d");
    fs::create_dir(&d).unwrap();
    fs::set_permissions(&d, fs::Permissions::from_mode(0o2775)).unwrap();
    std::os::unix::fs::chown(&d, Some(1), Some(1)).unwrap();
    assert_eq!(mode("d"), 0o2775, "a directory keeps its set-group-ID");
}
