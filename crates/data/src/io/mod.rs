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
//!
//! The backends live one per module: [`FileDisk`] in `file`, the test doubles in [`mem`] and
//! [`faulty`] (public: other crates' tests, `nacre check` and the benches use them). This module
//! holds the traits and the helpers they share; every backend is also re-exported here.

pub mod faulty;
mod file;
pub mod mem;

pub use self::faulty::{FaultPlan, FaultyDisk};
pub use self::file::FileDisk;
pub use self::mem::MemDisk;

use std::io;
use std::path::Path;
use std::sync::Arc;

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
