//! [`FaultyDisk`], a test double: wraps another [`Disk`] and injects failures. Fail-stop after N
//! operations ([`FaultPlan`], optionally tearing the first failing write), and switches for a full
//! device, running out of descriptors and failing fsyncs. Operations are counted across the disk
//! and every file opened through it.

use std::io;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use super::{Disk, DiskFile};

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
    ///
    /// [`FileDisk`]: crate::io::FileDisk
    pub fn set_out_of_fds(&self, on: bool) {
        self.faults.no_fds.store(on, Ordering::SeqCst);
    }

    /// Failing fsyncs: while on, every `sync_data` and `sync_dir` fails (an injected error, as
    /// `EIO` from a failed writeback) and syncs nothing; everything else works. What the kernel
    /// does with the unsynced pages meanwhile is up to the test ([`MemDisk::lose_unsynced`]).
    ///
    /// [`MemDisk::lose_unsynced`]: crate::io::MemDisk::lose_unsynced
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
    use crate::io::MemDisk;

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
