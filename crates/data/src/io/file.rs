//! [`FileDisk`]: real files in one directory, the backend of a data node. Writes go through the
//! page cache (`pwrite`) or, for large aligned appends, around it (`O_DIRECT`, through a second
//! descriptor of the same file); durability is `fdatasync`/`syncfs` and the directory's `fsync`.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

use rustix::fs::FallocateFlags;

use super::{Disk, DiskFile, check_name};

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
}
