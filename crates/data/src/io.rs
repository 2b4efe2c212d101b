//! Synchronous file IO behind a small trait, so the extent store runs on real files ([`FileDisk`]), in
//! memory with a crash image ([`MemDisk`]) and with injected failures ([`FaultyDisk`]).
//!
//! A [`Disk`] is one flat directory: files are addressed by name (no `/`). The contract is POSIX-like
//! and deliberately weak, because that is what the store may assume of a real file system:
//! - a write is durable only after [`DiskFile::sync_data`] of that file returns;
//! - a created, removed or renamed name is durable only after [`Disk::sync_dir`] returns;
//! - unsynced writes may be lost, reordered or torn (any prefix or subset of sectors may land);
//! - an open handle keeps working after its name is removed (the inode lives on);
//! - a file is closed when the last `Arc` of its handle drops; closing loses nothing (unsynced writes
//!   stay in the page cache), and `sync_data` through a handle opened later makes them durable too.

use std::collections::BTreeMap;
use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, PoisonError, RwLock};

use rustix::fs::FallocateFlags;

/// A directory of files.
pub trait Disk: Send + Sync + std::fmt::Debug + 'static {
    /// Opens (creating if missing) a file by flat name (no `/`). The file closes when the last `Arc`
    /// of the handle drops.
    fn open(&self, name: &str) -> io::Result<Arc<dyn DiskFile>>;
    /// Opens a file that must exist (`NotFound` otherwise): for reopening a file closed earlier.
    fn open_existing(&self, name: &str) -> io::Result<Arc<dyn DiskFile>>;
    /// Names of the files present now (durable or not), in no particular order.
    fn list(&self) -> io::Result<Vec<String>>;
    /// Removes a name; a missing file is not an error.
    fn remove(&self, name: &str) -> io::Result<()>;
    /// Renames a file, replacing `to` if it exists.
    fn rename(&self, from: &str, to: &str) -> io::Result<()>;
    /// The directory this disk's files are in, where it has one on a real file system (so files
    /// can move here from another disk's: [`Disk::adopt`]).
    fn location(&self) -> Option<&Path> {
        None
    }
    /// Moves file `name` of the directory `from` (another disk's [`Disk::location`]) here as
    /// `to`, replacing `to` if it exists: a rename across directories of one file system
    /// (`EXDEV` across file systems). Durable for this directory with its next `sync_dir`.
    fn adopt(&self, from: &Path, name: &str, to: &str) -> io::Result<()> {
        let _ = (from, name, to);
        Err(io::Error::new(
            io::ErrorKind::Unsupported,
            "this disk cannot take files from another directory",
        ))
    }
    /// Makes every create, remove and rename before this call durable.
    fn sync_dir(&self) -> io::Result<()>;
    /// Makes every write and length change of every file on this disk's file system durable at
    /// once (`syncfs`), for a commit round with many files: the file system writes them all back
    /// together and commits its journal once, where one `fdatasync` per file waits for the device
    /// and a journal commit each. `false`: this disk cannot, sync the files one by one.
    fn sync_fs(&self) -> io::Result<bool> {
        Ok(false)
    }
    /// Bytes used on the device by this disk's files (allocated blocks; holes do not count where the
    /// implementation can tell).
    fn used(&self) -> io::Result<u64>;
}

/// One open file. All methods take `&self` and may be called from many threads at once.
#[expect(
    clippy::len_without_is_empty,
    reason = "a file's emptiness is never asked; len() is its size"
)]
pub trait DiskFile: Send + Sync + std::fmt::Debug {
    /// Reads into `buf` at `off`; returns fewer bytes than asked only at the end of the file.
    fn read_at(&self, buf: &mut [u8], off: u64) -> io::Result<usize>;
    /// Writes the whole of `data` at `off`, extending the file if needed (a gap reads as zeros).
    fn write_at(&self, data: &[u8], off: u64) -> io::Result<()>;
    /// Writes like [`DiskFile::write_at`] (same durability: none before `sync_data`), for a large
    /// append the OS's page cache would only hold until the sync that follows drops it: where the
    /// file, `off` and the length allow, the bytes go to the device without passing through the
    /// cache (`O_DIRECT`), which spares the copy into it, its write-back and its dropping.
    /// Returns whether they did (`false`: they went through the cache like `write_at`'s).
    fn write_direct_at(&self, data: &[u8], off: u64) -> io::Result<bool> {
        self.write_at(data, off).map(|()| false)
    }
    /// Current length (not necessarily durable).
    fn len(&self) -> io::Result<u64>;
    /// Truncates or extends (with zeros) the file.
    fn set_len(&self, len: u64) -> io::Result<()>;
    /// Makes every write and length change of this file before the call durable.
    fn sync_data(&self) -> io::Result<()>;
    /// Deallocates `[off, off + len)`: it reads back as zeros and the file size does not change.
    fn punch_hole(&self, off: u64, len: u64) -> io::Result<()>;
    /// Asks the OS to drop the file's clean cached pages, so that later reads come from the device.
    /// After a failed fsync, pages whose writeback failed may stay cached, marked clean, with bytes
    /// the device never got; the store's reopen drops them before recovery reads the file. Best
    /// effort (dirty pages stay); a no-op where there is no such cache.
    fn drop_cache(&self) -> io::Result<()> {
        Ok(())
    }
    /// Asks the OS to drop the cached pages of `[off, off + len)` that are clean; pages only partly
    /// inside stay. The store calls it on what a group commit has just made durable, so that
    /// appended data does not pile up in the page cache (see `docs/data-store.md`, "Page cache").
    /// Best effort; a no-op where there is no such cache.
    fn drop_range(&self, off: u64, len: u64) -> io::Result<()> {
        let _ = (off, len);
        Ok(())
    }
    /// Asks the OS to start reading `[off, off + len)` into its cache without waiting for it.
    /// Best effort; a no-op where there is no such cache.
    fn will_need(&self, off: u64, len: u64) -> io::Result<()> {
        let _ = (off, len);
        Ok(())
    }
    /// Asks the OS to start writing the dirty pages of `[off, off + len)` to the device without
    /// waiting for them, so that the next `sync_data` finds them written or on their way. Makes
    /// nothing durable, and hides no error from a later `sync_data` (that one still reports
    /// write-back errors). Best effort; a no-op where there is no such cache.
    fn start_writeback(&self, off: u64, len: u64) -> io::Result<()> {
        let _ = (off, len);
        Ok(())
    }
}

/// Rejects names that are not a single path component.
fn check_name(name: &str) -> io::Result<()> {
    if name.is_empty() || name == "." || name == ".." || name.contains(['/', '\0']) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("bad file name {name:?}"),
        ));
    }
    Ok(())
}

/// Locks a mutex, ignoring poisoning: every critical section here leaves its data consistent.
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

// ---------------------------------------------------------------------------------------------------
// FileDisk

/// Real files in one directory: `pread`/`pwrite`, `fdatasync`, `fallocate(PUNCH_HOLE | KEEP_SIZE)`.
#[derive(Debug)]
pub struct FileDisk {
    dir: PathBuf,
}

impl FileDisk {
    /// Uses `dir`, creating it (and its parents) if missing.
    pub fn new(dir: impl AsRef<Path>) -> io::Result<Self> {
        let dir = dir.as_ref().to_path_buf();
        std::fs::create_dir_all(&dir)?;
        Ok(Self { dir })
    }

    /// The directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    fn path(&self, name: &str) -> io::Result<PathBuf> {
        check_name(name)?;
        Ok(self.dir.join(name))
    }
}

impl FileDisk {
    fn open_file(&self, name: &str, create: bool) -> io::Result<Arc<dyn DiskFile>> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(create)
            .truncate(false)
            .open(self.path(name)?)?;
        Ok(Arc::new(RealFile {
            file,
            direct: OnceLock::new(),
        }))
    }
}

impl Disk for FileDisk {
    fn open(&self, name: &str) -> io::Result<Arc<dyn DiskFile>> {
        self.open_file(name, true)
    }

    fn open_existing(&self, name: &str) -> io::Result<Arc<dyn DiskFile>> {
        self.open_file(name, false)
    }

    fn list(&self) -> io::Result<Vec<String>> {
        let mut names = Vec::new();
        for entry in std::fs::read_dir(&self.dir)? {
            let entry = entry?;
            if entry.file_type()?.is_file()
                && let Ok(name) = entry.file_name().into_string()
            {
                names.push(name);
            }
        }
        Ok(names)
    }

    fn remove(&self, name: &str) -> io::Result<()> {
        match std::fs::remove_file(self.path(name)?) {
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
            r => r,
        }
    }

    fn rename(&self, from: &str, to: &str) -> io::Result<()> {
        std::fs::rename(self.path(from)?, self.path(to)?)
    }

    fn location(&self) -> Option<&Path> {
        Some(&self.dir)
    }

    fn adopt(&self, from: &Path, name: &str, to: &str) -> io::Result<()> {
        check_name(name)?;
        std::fs::rename(from.join(name), self.path(to)?)
    }

    fn sync_dir(&self) -> io::Result<()> {
        File::open(&self.dir)?.sync_all()
    }

    fn sync_fs(&self) -> io::Result<bool> {
        rustix::fs::syncfs(File::open(&self.dir)?)?;
        Ok(true)
    }

    fn used(&self) -> io::Result<u64> {
        let mut used = 0u64;
        for entry in std::fs::read_dir(&self.dir)? {
            let meta = match entry?.metadata() {
                Ok(m) => m,
                // Removed since read_dir listed it.
                Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
                Err(e) => return Err(e),
            };
            if meta.is_file() {
                // st_blocks counts 512-byte units whatever the file system's block size.
                used = used.saturating_add(meta.blocks().saturating_mul(512));
            }
        }
        Ok(used)
    }
}

#[derive(Debug)]
struct RealFile {
    file: File,
    /// A second descriptor of the same file opened with `O_DIRECT`, for
    /// [`DiskFile::write_direct_at`]; opened at the first such write, `None` where the file
    /// system refuses it.
    direct: OnceLock<Option<File>>,
}

/// What `O_DIRECT` needs aligned: the file offset, the length and the buffer's address. 4 KiB
/// covers every device's logical block and the file system's block (a write of whole blocks is
/// one ext4 may run beside others).
const DIRECT_ALIGN: usize = 4096;

/// Largest copy [`with_aligned_copy`] keeps its buffer for (packets are at most 128 KiB).
const KEEP_ALIGNED: usize = 1 << 20;

thread_local! {
    /// This thread's buffer for [`with_aligned_copy`], kept between writes: a new one each time
    /// costs an allocation of fresh pages and their faults, more than the copy itself.
    static ALIGNED: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Runs `f` on a copy of `data` that starts at an address aligned for `O_DIRECT`.
fn with_aligned_copy<T>(data: &[u8], f: impl FnOnce(&[u8]) -> T) -> T {
    let copy = |v: &mut Vec<u8>| {
        if v.len() < data.len() + DIRECT_ALIGN {
            v.resize(data.len() + DIRECT_ALIGN, 0);
        }
        let at = v.as_ptr().align_offset(DIRECT_ALIGN);
        v[at..at + data.len()].copy_from_slice(data);
        at
    };
    if data.len() > KEEP_ALIGNED {
        let mut v = Vec::new();
        let at = copy(&mut v);
        return f(&v[at..at + data.len()]);
    }
    ALIGNED.with_borrow_mut(|v| {
        let at = copy(v);
        f(&v[at..at + data.len()])
    })
}

impl RealFile {
    /// The `O_DIRECT` descriptor, opened through `/proc/self/fd` so that it is the same inode
    /// whatever the file's name is now.
    #[cfg(target_os = "linux")]
    fn direct(&self) -> Option<&File> {
        use std::os::fd::AsRawFd;
        use std::os::unix::fs::OpenOptionsExt;
        self.direct
            .get_or_init(|| {
                OpenOptions::new()
                    .read(true)
                    .write(true)
                    .custom_flags(libc::O_DIRECT)
                    .open(format!("/proc/self/fd/{}", self.file.as_raw_fd()))
                    .ok()
            })
            .as_ref()
    }

    #[cfg(not(target_os = "linux"))]
    fn direct(&self) -> Option<&File> {
        None
    }
    /// `posix_fadvise` over `[off, off + len)`; nothing for an empty range (a length of 0 would
    /// mean "to the end of the file").
    fn advise(&self, off: u64, len: u64, advice: rustix::fs::Advice) -> io::Result<()> {
        match std::num::NonZeroU64::new(len) {
            Some(len) => Ok(rustix::fs::fadvise(&self.file, off, Some(len), advice)?),
            None => Ok(()),
        }
    }
}

impl DiskFile for RealFile {
    fn read_at(&self, buf: &mut [u8], off: u64) -> io::Result<usize> {
        let mut done = 0;
        while done < buf.len() {
            match self.file.read_at(&mut buf[done..], off + done as u64) {
                Ok(0) => break,
                Ok(n) => done += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(done)
    }

    fn write_at(&self, data: &[u8], off: u64) -> io::Result<()> {
        self.file.write_all_at(data, off)
    }

    fn write_direct_at(&self, data: &[u8], off: u64) -> io::Result<bool> {
        let aligned = |n: usize| n.is_multiple_of(DIRECT_ALIGN);
        let cached = || self.write_at(data, off).map(|()| false);
        let Some(direct) = self.direct() else {
            return cached();
        };
        if data.is_empty() || !aligned(data.len()) || !off.is_multiple_of(DIRECT_ALIGN as u64) {
            return cached();
        }
        let written = if aligned(data.as_ptr() as usize) {
            direct.write_all_at(data, off)
        } else {
            with_aligned_copy(data, |buf| direct.write_all_at(buf, off))
        };
        match written {
            Ok(()) => Ok(true),
            // The file system takes no direct IO here after all: the cache's way.
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => cached(),
            Err(e) => Err(e),
        }
    }

    fn len(&self) -> io::Result<u64> {
        Ok(self.file.metadata()?.len())
    }

    fn set_len(&self, len: u64) -> io::Result<()> {
        self.file.set_len(len)
    }

    fn sync_data(&self) -> io::Result<()> {
        Ok(rustix::fs::fdatasync(&self.file)?)
    }

    fn punch_hole(&self, off: u64, len: u64) -> io::Result<()> {
        if len == 0 {
            return Ok(());
        }
        Ok(rustix::fs::fallocate(
            &self.file,
            FallocateFlags::PUNCH_HOLE | FallocateFlags::KEEP_SIZE,
            off,
            len,
        )?)
    }

    fn drop_cache(&self) -> io::Result<()> {
        Ok(rustix::fs::fadvise(
            &self.file,
            0,
            None,
            rustix::fs::Advice::DontNeed,
        )?)
    }

    fn drop_range(&self, off: u64, len: u64) -> io::Result<()> {
        self.advise(off, len, rustix::fs::Advice::DontNeed)
    }

    fn will_need(&self, off: u64, len: u64) -> io::Result<()> {
        self.advise(off, len, rustix::fs::Advice::WillNeed)
    }

    #[cfg(target_os = "linux")]
    #[allow(unsafe_code)]
    fn start_writeback(&self, off: u64, len: u64) -> io::Result<()> {
        use std::os::fd::AsRawFd;
        if len == 0 {
            return Ok(());
        }
        let (Ok(off), Ok(len)) = (i64::try_from(off), i64::try_from(len)) else {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "range past i64::MAX",
            ));
        };
        // SAFETY: `sync_file_range` takes a descriptor and plain integers and touches no memory of
        // ours; the descriptor is open for as long as `self.file` lives, which outlasts the call.
        // rustix has no wrapper for it.
        let r = unsafe {
            libc::sync_file_range(self.file.as_raw_fd(), off, len, libc::SYNC_FILE_RANGE_WRITE)
        };
        if r == 0 {
            Ok(())
        } else {
            Err(io::Error::last_os_error())
        }
    }
}

// ---------------------------------------------------------------------------------------------------
// MemDisk

/// An in-memory disk that also keeps its **crash image**: for every file the content as of its last
/// `sync_data` plus the writes since (so a crash can keep any subset of them), and the names as of the
/// last `sync_dir`. Clones share the same files, so a test can keep a handle to inspect, corrupt or
/// crash the disk a store is using. It also counts its open handles ([`MemDisk::open_files`]), so a
/// test can check a bound on open files.
#[derive(Clone, Debug, Default)]
pub struct MemDisk {
    dir: Arc<Mutex<MemDir>>,
    handles: Arc<Handles>,
}

/// Open [`MemFile`]s of a [`MemDisk`] (and of its clones).
#[derive(Debug, Default)]
struct Handles {
    now: AtomicUsize,
    peak: AtomicUsize,
}

impl Handles {
    fn opened(&self) {
        let now = self.now.fetch_add(1, Ordering::SeqCst) + 1;
        self.peak.fetch_max(now, Ordering::SeqCst);
    }
}

#[derive(Debug, Default)]
struct MemDir {
    /// Names now.
    live: BTreeMap<String, Arc<MemInode>>,
    /// Names as of the last `sync_dir`.
    durable: BTreeMap<String, Arc<MemInode>>,
}

#[derive(Debug, Default)]
struct MemInode {
    state: RwLock<InodeState>,
}

#[derive(Clone, Debug, Default)]
struct InodeState {
    data: Vec<u8>,
    /// Content as of the last `sync_data`.
    synced: Vec<u8>,
    /// Changes since `synced`, in order.
    pending: Vec<Change>,
}

#[derive(Clone, Debug)]
enum Change {
    Write { off: u64, data: Vec<u8> },
    SetLen(u64),
    Punch { off: u64, len: u64 },
}

impl InodeState {
    /// The content a crash (or a failed writeback) may leave: the synced content, plus (given a
    /// generator) each later change dropped, applied or torn.
    fn survivor(&self, rng: Option<&mut Rng>) -> Vec<u8> {
        let mut data = self.synced.clone();
        let Some(rng) = rng else {
            return data;
        };
        for change in &self.pending {
            match rng.below(4) {
                0 => {}
                1 | 2 => change.apply(&mut data),
                _ => match change {
                    Change::Write { off, data: bytes } if bytes.len() > SECTOR => {
                        for (i, sector) in bytes.chunks(SECTOR).enumerate() {
                            if rng.below(2) == 0 {
                                write_into(&mut data, off + (i * SECTOR) as u64, sector);
                            }
                        }
                    }
                    Change::Write { off, data: bytes } => {
                        let keep = to_usize(rng.below(bytes.len() as u64 + 1));
                        write_into(&mut data, *off, &bytes[..keep]);
                    }
                    // Length changes and punches are metadata: all or nothing.
                    other => other.apply(&mut data),
                },
            }
        }
        data
    }
}

/// Sector size used to tear large unsynced writes in a crash image.
const SECTOR: usize = 512;

impl Change {
    fn apply(&self, data: &mut Vec<u8>) {
        match self {
            Change::Write { off, data: bytes } => write_into(data, *off, bytes),
            Change::SetLen(len) => data.resize(to_usize(*len), 0),
            Change::Punch { off, len } => {
                let start = to_usize(*off).min(data.len());
                let end = to_usize(off.saturating_add(*len)).min(data.len());
                data[start..end].fill(0);
            }
        }
    }
}

fn to_usize(v: u64) -> usize {
    usize::try_from(v).unwrap_or(usize::MAX)
}

fn write_into(data: &mut Vec<u8>, off: u64, bytes: &[u8]) {
    let off = to_usize(off);
    let end = off.saturating_add(bytes.len());
    if data.len() < end {
        data.resize(end, 0);
    }
    data[off..end].copy_from_slice(bytes);
}

/// splitmix64: a tiny deterministic generator for crash images.
#[derive(Debug)]
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: u64) -> u64 {
        if n == 0 { 0 } else { self.next() % n }
    }
}

impl MemDisk {
    pub fn new() -> Self {
        Self::default()
    }

    /// The disk after a power failure now, keeping only what was synced: the names as of the last
    /// `sync_dir`, each file as of its last `sync_data`.
    pub fn crash(&self) -> MemDisk {
        self.crash_image(None)
    }

    /// Like [`MemDisk::crash`], but each unsynced change of a surviving file may also have landed, in
    /// whole or torn (a prefix of a small write, any subset of the 512-byte sectors of a large one),
    /// chosen deterministically from `seed`. Changes may land out of order.
    pub fn crash_torn(&self, seed: u64) -> MemDisk {
        self.crash_image(Some(Rng(seed)))
    }

    fn crash_image(&self, mut rng: Option<Rng>) -> MemDisk {
        let dir = lock(&self.dir);
        let mut files = BTreeMap::new();
        for (name, inode) in &dir.durable {
            let st = inode.state.read().unwrap_or_else(PoisonError::into_inner);
            let data = st.survivor(rng.as_mut());
            let inode = Arc::new(MemInode {
                state: RwLock::new(InodeState {
                    synced: data.clone(),
                    data,
                    pending: Vec::new(),
                }),
            });
            files.insert(name.clone(), inode);
        }
        MemDisk {
            dir: Arc::new(Mutex::new(MemDir {
                live: files.clone(),
                durable: files,
            })),
            handles: Arc::default(),
        }
    }

    /// What a failed writeback may leave behind, in place: every file (by its current names)
    /// becomes its content as of its last `sync_data` plus a subset of the changes since, each
    /// whole or torn, chosen from `seed` as in [`MemDisk::crash_torn`]; that is now its synced
    /// content. Names and open handles stay. Models the kernel dropping dirty pages whose writeback
    /// failed (or having written part of them) without a crash, so that a store can be reopened on
    /// the same disk.
    pub fn lose_unsynced(&self, seed: u64) {
        let mut rng = Rng(seed);
        let dir = lock(&self.dir);
        let mut seen = std::collections::BTreeSet::new();
        for inode in dir.live.values() {
            // A file renamed over another may show under one name only, but never twice.
            if !seen.insert(Arc::as_ptr(inode)) {
                continue;
            }
            let mut st = inode.state.write().unwrap_or_else(PoisonError::into_inner);
            let data = st.survivor(Some(&mut rng));
            st.synced = data.clone();
            st.data = data;
            st.pending.clear();
        }
    }

    /// Handles opened through this disk (or its clones) and not dropped yet.
    pub fn open_files(&self) -> usize {
        self.handles.now.load(Ordering::SeqCst)
    }

    /// The most handles that were open at once.
    pub fn peak_open_files(&self) -> usize {
        self.handles.peak.load(Ordering::SeqCst)
    }

    /// A file's current content, if the name exists.
    pub fn read_file(&self, name: &str) -> Option<Vec<u8>> {
        let dir = lock(&self.dir);
        let inode = dir.live.get(name)?;
        let st = inode.state.read().unwrap_or_else(PoisonError::into_inner);
        Some(st.data.clone())
    }

    /// Creates or replaces a file with `data`, already durable (name and content).
    pub fn put_file(&self, name: &str, data: &[u8]) -> io::Result<()> {
        check_name(name)?;
        let inode = Arc::new(MemInode {
            state: RwLock::new(InodeState {
                data: data.to_vec(),
                synced: data.to_vec(),
                pending: Vec::new(),
            }),
        });
        let mut dir = lock(&self.dir);
        dir.live.insert(name.to_owned(), inode.clone());
        dir.durable.insert(name.to_owned(), inode);
        Ok(())
    }

    /// Flips the lowest bit of the byte at `offset`, in the current and the synced content (bit rot on
    /// the medium).
    pub fn corrupt(&self, name: &str, offset: u64) -> io::Result<()> {
        let dir = lock(&self.dir);
        let inode = dir
            .live
            .get(name)
            .ok_or_else(|| io::Error::new(io::ErrorKind::NotFound, name.to_owned()))?;
        let mut st = inode.state.write().unwrap_or_else(PoisonError::into_inner);
        let off = to_usize(offset);
        if off >= st.data.len() {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("{name}: offset {offset} is past the end"),
            ));
        }
        st.data[off] ^= 1;
        if let Some(b) = st.synced.get_mut(off) {
            *b ^= 1;
        }
        Ok(())
    }
}

impl MemDisk {
    fn handle(&self, inode: Arc<MemInode>) -> Arc<dyn DiskFile> {
        self.handles.opened();
        Arc::new(MemFile {
            inode,
            handles: self.handles.clone(),
        })
    }
}

impl Disk for MemDisk {
    fn open(&self, name: &str) -> io::Result<Arc<dyn DiskFile>> {
        check_name(name)?;
        let inode = lock(&self.dir)
            .live
            .entry(name.to_owned())
            .or_default()
            .clone();
        Ok(self.handle(inode))
    }

    fn open_existing(&self, name: &str) -> io::Result<Arc<dyn DiskFile>> {
        check_name(name)?;
        let inode = lock(&self.dir)
            .live
            .get(name)
            .cloned()
            .ok_or_else(|| io::Error::new(io::ErrorKind::NotFound, name.to_owned()))?;
        Ok(self.handle(inode))
    }

    fn list(&self) -> io::Result<Vec<String>> {
        Ok(lock(&self.dir).live.keys().cloned().collect())
    }

    fn remove(&self, name: &str) -> io::Result<()> {
        check_name(name)?;
        lock(&self.dir).live.remove(name);
        Ok(())
    }

    fn rename(&self, from: &str, to: &str) -> io::Result<()> {
        check_name(from)?;
        check_name(to)?;
        let mut dir = lock(&self.dir);
        let inode = dir
            .live
            .remove(from)
            .ok_or_else(|| io::Error::new(io::ErrorKind::NotFound, from.to_owned()))?;
        dir.live.insert(to.to_owned(), inode);
        Ok(())
    }

    fn sync_dir(&self) -> io::Result<()> {
        let mut dir = lock(&self.dir);
        dir.durable = dir.live.clone();
        Ok(())
    }

    /// Every file's writes and the names become durable, as `syncfs` makes them.
    fn sync_fs(&self) -> io::Result<bool> {
        let mut dir = lock(&self.dir);
        for inode in dir.live.values() {
            let mut st = inode.state.write().unwrap_or_else(PoisonError::into_inner);
            st.synced = st.data.clone();
            st.pending.clear();
        }
        dir.durable = dir.live.clone();
        Ok(true)
    }

    /// Sum of the file lengths (a hole counts: this disk does not track allocation).
    fn used(&self) -> io::Result<u64> {
        let dir = lock(&self.dir);
        Ok(dir
            .live
            .values()
            .map(|i| {
                i.state
                    .read()
                    .unwrap_or_else(PoisonError::into_inner)
                    .data
                    .len() as u64
            })
            .sum())
    }
}

#[derive(Debug)]
struct MemFile {
    inode: Arc<MemInode>,
    handles: Arc<Handles>,
}

impl Drop for MemFile {
    fn drop(&mut self) {
        self.handles.now.fetch_sub(1, Ordering::SeqCst);
    }
}

impl MemFile {
    fn change(&self, change: Change) {
        let mut st = self
            .inode
            .state
            .write()
            .unwrap_or_else(PoisonError::into_inner);
        change.apply(&mut st.data);
        st.pending.push(change);
    }
}

impl DiskFile for MemFile {
    fn read_at(&self, buf: &mut [u8], off: u64) -> io::Result<usize> {
        let st = self
            .inode
            .state
            .read()
            .unwrap_or_else(PoisonError::into_inner);
        let start = to_usize(off).min(st.data.len());
        let n = buf.len().min(st.data.len() - start);
        buf[..n].copy_from_slice(&st.data[start..start + n]);
        Ok(n)
    }

    fn write_at(&self, data: &[u8], off: u64) -> io::Result<()> {
        off.checked_add(data.len() as u64)
            .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "write past u64::MAX"))?;
        self.change(Change::Write {
            off,
            data: data.to_vec(),
        });
        Ok(())
    }

    fn len(&self) -> io::Result<u64> {
        let st = self
            .inode
            .state
            .read()
            .unwrap_or_else(PoisonError::into_inner);
        Ok(st.data.len() as u64)
    }

    fn set_len(&self, len: u64) -> io::Result<()> {
        self.change(Change::SetLen(len));
        Ok(())
    }

    fn sync_data(&self) -> io::Result<()> {
        let mut st = self
            .inode
            .state
            .write()
            .unwrap_or_else(PoisonError::into_inner);
        st.synced = st.data.clone();
        st.pending.clear();
        Ok(())
    }

    fn punch_hole(&self, off: u64, len: u64) -> io::Result<()> {
        self.change(Change::Punch { off, len });
        Ok(())
    }
}

// ---------------------------------------------------------------------------------------------------
// FaultyDisk

/// When a [`FaultyDisk`] starts failing.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FaultPlan {
    /// Operations (on the disk and on its files, reads included) that succeed before every later one
    /// fails; `None` never fails.
    pub fail_after: Option<u64>,
    /// The first failing operation, if it is a write, first writes a prefix (half) of its buffer.
    pub tear: bool,
}

impl FaultPlan {
    /// Fails every operation after `n` successful ones.
    pub fn fail_after(n: u64) -> Self {
        Self {
            fail_after: Some(n),
            tear: false,
        }
    }

    /// Also tears the first failing write.
    pub fn tearing(self) -> Self {
        Self { tear: true, ..self }
    }
}

/// Wraps a disk and fails every operation after N successful ones (fail-stop: once failing, it keeps
/// failing). Operations are counted across the disk and all files opened through it.
#[derive(Clone, Debug)]
pub struct FaultyDisk {
    inner: Arc<dyn Disk>,
    faults: Arc<Faults>,
}

#[derive(Debug)]
struct Faults {
    /// Writes fail with `StorageFull` after writing half their bytes (see [`FaultyDisk::set_full`]).
    full: AtomicBool,
    /// Opening files fails with `EMFILE` (see [`FaultyDisk::set_out_of_fds`]).
    no_fds: AtomicBool,
    /// Every fsync fails (see [`FaultyDisk::set_fail_sync`]).
    fail_sync: AtomicBool,
    ops: AtomicU64,
    /// `u64::MAX` = never.
    fail_after: AtomicU64,
    tear: bool,
}

enum Verdict {
    Ok,
    /// The first failing operation.
    First,
    Fail,
}

impl Faults {
    fn next(&self) -> Verdict {
        let n = self.ops.fetch_add(1, Ordering::SeqCst);
        let limit = self.fail_after.load(Ordering::SeqCst);
        if n < limit {
            Verdict::Ok
        } else if n == limit {
            Verdict::First
        } else {
            Verdict::Fail
        }
    }

    fn check_sync(&self) -> io::Result<()> {
        if self.fail_sync.load(Ordering::SeqCst) {
            Err(injected())
        } else {
            Ok(())
        }
    }

    fn check(&self) -> io::Result<()> {
        match self.next() {
            Verdict::Ok => Ok(()),
            Verdict::First | Verdict::Fail => Err(injected()),
        }
    }
}

fn injected() -> io::Error {
    io::Error::other("injected fault")
}

/// `EMFILE`, as `open(2)` returns it when the process has no descriptor left.
fn out_of_fds() -> io::Error {
    io::Error::from_raw_os_error(rustix::io::Errno::MFILE.raw_os_error())
}

impl FaultyDisk {
    pub fn new(inner: Arc<dyn Disk>, plan: FaultPlan) -> Self {
        Self {
            inner,
            faults: Arc::new(Faults {
                full: AtomicBool::new(false),
                no_fds: AtomicBool::new(false),
                fail_sync: AtomicBool::new(false),
                ops: AtomicU64::new(0),
                fail_after: AtomicU64::new(plan.fail_after.unwrap_or(u64::MAX)),
                tear: plan.tear,
            }),
        }
    }

    /// Operations attempted so far (successful or not).
    pub fn ops(&self) -> u64 {
        self.faults.ops.load(Ordering::SeqCst)
    }

    /// A full disk: while on, every write stores half its bytes and fails with `StorageFull`
    /// (ENOSPC); everything else works.
    pub fn set_full(&self, full: bool) {
        self.faults.full.store(full, Ordering::SeqCst);
    }

    /// No descriptors left: while on, every operation that opens a file or a directory (`open`,
    /// `open_existing`, `list`, `sync_dir`, `used`, as on [`FileDisk`]) fails with `EMFILE` and does
    /// nothing; handles already open keep working.
    pub fn set_out_of_fds(&self, on: bool) {
        self.faults.no_fds.store(on, Ordering::SeqCst);
    }

    /// Failing fsyncs: while on, every `sync_data` and `sync_dir` fails (an injected error, as
    /// `EIO` from a failed writeback) and syncs nothing; everything else works. What the kernel
    /// does with the unsynced pages meanwhile is up to the test ([`MemDisk::lose_unsynced`]).
    pub fn set_fail_sync(&self, on: bool) {
        self.faults.fail_sync.store(on, Ordering::SeqCst);
    }

    fn check_fds(&self) -> io::Result<()> {
        if self.faults.no_fds.load(Ordering::SeqCst) {
            Err(out_of_fds())
        } else {
            Ok(())
        }
    }

    fn wrap(&self, inner: Arc<dyn DiskFile>) -> Arc<dyn DiskFile> {
        Arc::new(FaultyFile {
            inner,
            faults: self.faults.clone(),
        })
    }

    /// Changes the budget: fail after `n` more successful operations from now (`None`: never).
    pub fn fail_after_more(&self, n: Option<u64>) {
        let limit = n.map_or(u64::MAX, |n| self.ops().saturating_add(n));
        self.faults.fail_after.store(limit, Ordering::SeqCst);
    }
}

impl Disk for FaultyDisk {
    fn open(&self, name: &str) -> io::Result<Arc<dyn DiskFile>> {
        self.check_fds()?;
        self.faults.check()?;
        Ok(self.wrap(self.inner.open(name)?))
    }

    fn open_existing(&self, name: &str) -> io::Result<Arc<dyn DiskFile>> {
        self.check_fds()?;
        self.faults.check()?;
        Ok(self.wrap(self.inner.open_existing(name)?))
    }

    fn list(&self) -> io::Result<Vec<String>> {
        self.check_fds()?;
        self.faults.check()?;
        self.inner.list()
    }

    fn remove(&self, name: &str) -> io::Result<()> {
        self.faults.check()?;
        self.inner.remove(name)
    }

    fn rename(&self, from: &str, to: &str) -> io::Result<()> {
        self.faults.check()?;
        self.inner.rename(from, to)
    }

    fn location(&self) -> Option<&Path> {
        self.inner.location()
    }

    fn adopt(&self, from: &Path, name: &str, to: &str) -> io::Result<()> {
        self.faults.check()?;
        self.inner.adopt(from, name, to)
    }

    fn sync_dir(&self) -> io::Result<()> {
        self.check_fds()?;
        self.faults.check_sync()?;
        self.faults.check()?;
        self.inner.sync_dir()
    }

    fn sync_fs(&self) -> io::Result<bool> {
        self.check_fds()?;
        self.faults.check_sync()?;
        self.faults.check()?;
        self.inner.sync_fs()
    }

    fn used(&self) -> io::Result<u64> {
        self.check_fds()?;
        self.faults.check()?;
        self.inner.used()
    }
}

#[derive(Debug)]
struct FaultyFile {
    inner: Arc<dyn DiskFile>,
    faults: Arc<Faults>,
}

impl FaultyFile {
    /// A write through `write`, failed or torn as the faults say: a full disk takes half of it,
    /// a tearing fault half of it then fails.
    fn write_with(
        &self,
        data: &[u8],
        off: u64,
        write: impl Fn(&[u8], u64) -> io::Result<()>,
    ) -> io::Result<()> {
        if self.faults.full.load(Ordering::SeqCst) {
            write(&data[..data.len() / 2], off)?;
            return Err(io::Error::from(io::ErrorKind::StorageFull));
        }
        match self.faults.next() {
            Verdict::Ok => write(data, off),
            Verdict::First if self.faults.tear => {
                write(&data[..data.len() / 2], off)?;
                Err(injected())
            }
            Verdict::First | Verdict::Fail => Err(injected()),
        }
    }
}

impl DiskFile for FaultyFile {
    fn read_at(&self, buf: &mut [u8], off: u64) -> io::Result<usize> {
        self.faults.check()?;
        self.inner.read_at(buf, off)
    }

    fn write_at(&self, data: &[u8], off: u64) -> io::Result<()> {
        self.write_with(data, off, |d, o| self.inner.write_at(d, o))
    }

    fn write_direct_at(&self, data: &[u8], off: u64) -> io::Result<bool> {
        let direct = std::cell::Cell::new(false);
        self.write_with(data, off, |d, o| {
            direct.set(self.inner.write_direct_at(d, o)?);
            Ok(())
        })?;
        Ok(direct.get())
    }

    fn len(&self) -> io::Result<u64> {
        self.faults.check()?;
        self.inner.len()
    }

    fn set_len(&self, len: u64) -> io::Result<()> {
        self.faults.check()?;
        self.inner.set_len(len)
    }

    fn sync_data(&self) -> io::Result<()> {
        self.faults.check_sync()?;
        self.faults.check()?;
        self.inner.sync_data()
    }

    fn punch_hole(&self, off: u64, len: u64) -> io::Result<()> {
        self.faults.check()?;
        self.inner.punch_hole(off, len)
    }

    fn drop_cache(&self) -> io::Result<()> {
        self.inner.drop_cache()
    }

    fn drop_range(&self, off: u64, len: u64) -> io::Result<()> {
        self.inner.drop_range(off, len)
    }

    fn will_need(&self, off: u64, len: u64) -> io::Result<()> {
        self.inner.will_need(off, len)
    }

    fn start_writeback(&self, off: u64, len: u64) -> io::Result<()> {
        self.inner.start_writeback(off, len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn direct_writes_land_like_cached_ones() {
        let dir = tempfile::tempdir().unwrap();
        let disk = FileDisk::new(dir.path()).unwrap();
        let f = disk.open("a").unwrap();
        let bytes: Vec<u8> = (0..64 << 10)
            .map(|i: u32| (i * 7 + i / 4096) as u8)
            .collect();
        let mut want = Vec::new();
        // Whether this file system takes direct IO at all (tmpfs may not): every aligned write
        // below must then say the same.
        let direct = f.write_direct_at(&bytes[..4096], 0).unwrap();
        want.extend_from_slice(&bytes[..4096]);
        // Aligned at every offset of the buffer's address (the direct write copies what is not),
        // then lengths and offsets direct IO cannot take (written through the cache).
        for (i, skew) in [0usize, 1, 512, 4095].into_iter().enumerate() {
            let mut buf = vec![0u8; skew];
            buf.extend_from_slice(&bytes[..32 << 10]);
            buf[skew] = i as u8;
            let went = f.write_direct_at(&buf[skew..], want.len() as u64).unwrap();
            assert_eq!(went, direct);
            want.extend_from_slice(&buf[skew..]);
        }
        // Larger than the buffer a thread keeps.
        let big: Vec<u8> = bytes
            .iter()
            .copied()
            .cycle()
            .take((1 << 20) + 4097)
            .collect();
        f.write_direct_at(&big[1..], want.len() as u64).unwrap();
        want.extend_from_slice(&big[1..]);
        let went = f.write_direct_at(&bytes[..5000], want.len() as u64);
        assert!(!went.unwrap(), "an unaligned length goes through the cache");
        want.extend_from_slice(&bytes[..5000]);
        let went = f.write_direct_at(&bytes[..8192], want.len() as u64);
        assert!(!went.unwrap(), "an unaligned offset goes through the cache");
        want.extend_from_slice(&bytes[..8192]);
        // Over what the cache holds: a cached write, read back, then overwritten direct.
        f.write_at(&[9; 4096], 4096).unwrap();
        want[4096..8192].fill(9);
        let mut got = vec![0u8; want.len()];
        assert_eq!(f.read_at(&mut got, 0).unwrap(), want.len());
        assert_eq!(got, want);
        f.write_direct_at(&bytes[..8192], 0).unwrap();
        want[..8192].copy_from_slice(&bytes[..8192]);
        // Renamed: the direct descriptor is the same file, whatever its name.
        disk.rename("a", "b").unwrap();
        f.write_direct_at(&bytes[..4096], 16384).unwrap();
        want[16384..20480].copy_from_slice(&bytes[..4096]);
        f.sync_data().unwrap();
        drop(f);
        let g = disk.open_existing("b").unwrap();
        assert_eq!(g.len().unwrap(), want.len() as u64);
        let mut got = vec![0u8; want.len()];
        assert_eq!(g.read_at(&mut got, 0).unwrap(), want.len());
        assert_eq!(got, want);
    }

    #[test]
    fn mem_crash_keeps_only_synced_content_and_names() {
        let disk = MemDisk::new();
        let a = disk.open("a").unwrap();
        a.write_at(b"hello", 0).unwrap();
        a.sync_data().unwrap();
        disk.sync_dir().unwrap();
        a.write_at(b"HELLO world", 0).unwrap();
        let b = disk.open("b").unwrap();
        b.write_at(b"x", 0).unwrap();
        b.sync_data().unwrap();

        let img = disk.crash();
        assert_eq!(img.read_file("a").unwrap(), b"hello");
        assert!(img.read_file("b").is_none(), "b's name was never synced");

        disk.remove("a").unwrap();
        let img = disk.crash();
        assert_eq!(img.read_file("a").unwrap(), b"hello", "unsynced remove");
        // The open handle still works after the remove.
        assert_eq!(a.len().unwrap(), 11);
    }

    #[test]
    fn torn_crash_images_stay_between_synced_and_current() {
        let disk = MemDisk::new();
        let f = disk.open("f").unwrap();
        f.write_at(&[1; 100], 0).unwrap();
        f.sync_data().unwrap();
        disk.sync_dir().unwrap();
        f.write_at(&[2; 2000], 50).unwrap();
        let mut saw_torn = false;
        for seed in 0..64 {
            let img = disk.crash_torn(seed).read_file("f").unwrap();
            assert!((100..=2050).contains(&img.len()));
            assert!(img[..50].iter().all(|&b| b == 1));
            assert!(img[50..].iter().all(|&b| b == 1 || b == 2 || b == 0));
            saw_torn |= img.len() == 2050 && img.contains(&0);
        }
        assert!(saw_torn, "some image tears the large write");
    }

    #[test]
    fn mem_disk_counts_open_handles() {
        let disk = MemDisk::new();
        assert!(
            disk.open_existing("a").is_err(),
            "open_existing never creates"
        );
        let a = disk.open("a").unwrap();
        let a2 = disk.clone().open_existing("a").unwrap();
        assert_eq!(disk.open_files(), 2);
        drop(a);
        assert_eq!(disk.open_files(), 1);
        a2.write_at(b"x", 0).unwrap();
        drop(a2);
        assert_eq!((disk.open_files(), disk.peak_open_files()), (0, 2));
        assert_eq!(disk.read_file("a").unwrap(), b"x", "closing loses nothing");
    }

    #[test]
    fn faulty_disk_runs_out_of_descriptors() {
        let disk = FaultyDisk::new(Arc::new(MemDisk::new()), FaultPlan::default());
        let f = disk.open("f").unwrap();
        disk.set_out_of_fds(true);
        let e = disk.open_existing("f").unwrap_err();
        assert_eq!(
            e.raw_os_error(),
            Some(rustix::io::Errno::MFILE.raw_os_error())
        );
        assert!(disk.open("g").is_err() && disk.sync_dir().is_err() && disk.list().is_err());
        f.write_at(b"open handles work", 0).unwrap();
        f.sync_data().unwrap();
        disk.set_out_of_fds(false);
        assert_eq!(disk.list().unwrap(), ["f"]);
    }

    /// What a failed writeback leaves, in place: the synced content plus any subset of the later
    /// changes (whole or torn); names and handles stay.
    #[test]
    fn lose_unsynced_keeps_synced_content_and_names() {
        let mut saw = std::collections::BTreeSet::new();
        for seed in 0..64 {
            let disk = MemDisk::new();
            let a = disk.open("a").unwrap();
            a.write_at(&[1; 100], 0).unwrap();
            a.sync_data().unwrap();
            a.write_at(&[2; 2000], 50).unwrap();
            let b = disk.open("b").unwrap(); // its name and content were never synced
            b.write_at(b"unsynced", 0).unwrap();
            disk.lose_unsynced(seed);
            let got = disk.read_file("a").unwrap();
            assert!((100..=2050).contains(&got.len()));
            assert!(got[..50].iter().all(|&x| x == 1));
            assert!(got[50..].iter().all(|&x| x == 1 || x == 2 || x == 0));
            saw.insert(got.len());
            assert_eq!(a.len().unwrap(), got.len() as u64, "the handle works");
            let b_got = disk.read_file("b").unwrap();
            assert!(b"unsynced".starts_with(&b_got[..]) || b_got.iter().all(|&x| x == 0));
            assert_eq!(disk.list().unwrap().len(), 2, "names stay");
            disk.sync_dir().unwrap();
            assert_eq!(disk.crash().read_file("a").unwrap(), got, "now durable");
        }
        assert!(
            saw.len() > 1,
            "some seeds drop the write, some keep it: {saw:?}"
        );
    }

    #[test]
    fn faulty_disk_fails_fsyncs_only() {
        let mem = MemDisk::new();
        let disk = FaultyDisk::new(Arc::new(mem.clone()), FaultPlan::default());
        let f = disk.open("f").unwrap();
        disk.set_fail_sync(true);
        f.write_at(b"data", 0).unwrap();
        assert!(f.sync_data().is_err() && disk.sync_dir().is_err());
        assert_eq!(f.len().unwrap(), 4);
        assert_eq!(mem.crash().read_file("f"), None, "nothing synced");
        disk.set_fail_sync(false);
        f.sync_data().unwrap();
        disk.sync_dir().unwrap();
        assert_eq!(mem.crash().read_file("f").unwrap(), b"data");
    }

    #[test]
    fn faulty_disk_fails_after_n_and_tears() {
        let mem = MemDisk::new();
        let disk = FaultyDisk::new(Arc::new(mem.clone()), FaultPlan::fail_after(2).tearing());
        let f = disk.open("f").unwrap(); // op 0
        f.write_at(b"abcd", 0).unwrap(); // op 1
        assert!(f.write_at(b"efgh", 4).is_err()); // op 2: torn
        assert!(f.sync_data().is_err());
        assert_eq!(mem.read_file("f").unwrap(), b"abcdef");
        disk.fail_after_more(None);
        f.sync_data().unwrap();
    }
}
