//! The `FileSystem` trait (docs/design.md §8): what every front end (FUSE, the `nacre fs` commands,
//! later the preload library and the S3 gateway) talks to, and what every layer wraps.
//!
//! A layer is a `FileSystem` holding another one (tower-style): it may answer a call itself (a
//! cache), observe it (metrics), or change it on the way down. The network client ([`crate::NetFs`])
//! sits at the bottom. Errors are typed ([`FsError`]); POSIX errno values exist only in the FUSE
//! front end.
//!
//! Inode numbers are the volume's (`nacre_api::meta::ROOT_INO` is the root directory). Open files are named by a
//! handle ([`Fh`]) that `open`/`create` return and `release` ends; data calls take the handle, so
//! an implementation can keep per-open-file state (write buffers, read-ahead).

use std::future::Future;

use bytes::Bytes;
use nacre_api::meta::{Attr, DirEntry, FileType, SetAttr, XattrMode};
use nacre_types::Ino;

pub use crate::meta::{Entry, FsError, FsResult};

/// An open file's handle.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Fh(pub u64);

/// Who asks: owner of what gets created.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Caller {
    pub uid: u32,
    pub gid: u32,
}

/// How a file is opened.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct OpenFlags {
    pub read: bool,
    pub write: bool,
    /// Every write goes to the end of the file (`O_APPEND`), whatever offset it names.
    pub append: bool,
    /// Truncate to zero on open (`O_TRUNC`).
    pub truncate: bool,
    /// With `truncate` and `write`: the caller may not keep set-user-ID and set-group-ID bits
    /// (it lacks `CAP_FSETID`), so the open clears them (set-group-ID only when the group may
    /// execute), as a truncate by such a caller does — also when the file is empty already.
    pub kill_suidgid: bool,
}

impl OpenFlags {
    pub const READ: Self = Self {
        read: true,
        write: false,
        append: false,
        truncate: false,
        kill_suidgid: false,
    };
    pub const WRITE: Self = Self {
        read: false,
        write: true,
        append: false,
        truncate: false,
        kill_suidgid: false,
    };
    pub const READ_WRITE: Self = Self {
        read: true,
        write: true,
        append: false,
        truncate: false,
        kill_suidgid: false,
    };

    /// From `open(2)` flags.
    pub fn from_posix(flags: i32) -> Self {
        let acc = flags & libc_consts::O_ACCMODE;
        Self {
            read: acc == libc_consts::O_RDONLY || acc == libc_consts::O_RDWR,
            write: acc == libc_consts::O_WRONLY || acc == libc_consts::O_RDWR,
            append: flags & libc_consts::O_APPEND != 0,
            truncate: flags & libc_consts::O_TRUNC != 0,
            kill_suidgid: false,
        }
    }
}

/// The Linux values of the `open(2)` flags this module reads (the client crate does not link libc).
mod libc_consts {
    pub const O_ACCMODE: i32 = 0o3;
    pub const O_RDONLY: i32 = 0o0;
    pub const O_WRONLY: i32 = 0o1;
    pub const O_RDWR: i32 = 0o2;
    pub const O_TRUNC: i32 = 0o1000;
    pub const O_APPEND: i32 = 0o2000;
}

/// What `fallocate` does: the modes of `fallocate(2)` nacre offers. nacre allocates space
/// lazily (data nodes allocate when bytes are written), so none of them reserves space; they
/// change the size and which ranges read as zeros.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Falloc {
    /// Mode 0: the file grows to at least `offset + len` (the new bytes read as zeros).
    Allocate,
    /// `FALLOC_FL_KEEP_SIZE`: nothing changes beyond the checks.
    KeepSize,
    /// `FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE`: the range reads as zeros and its bytes are
    /// freed; the size stays.
    PunchHole,
    /// `FALLOC_FL_ZERO_RANGE` (with `keep_size`, `| FALLOC_FL_KEEP_SIZE`): the range reads as
    /// zeros, as after `PunchHole`; without `keep_size` the file grows to at least
    /// `offset + len`.
    ZeroRange { keep_size: bool },
}

impl Falloc {
    /// Whether the range's bytes are dropped (read as zeros afterwards).
    pub fn punches(self) -> bool {
        matches!(self, Falloc::PunchHole | Falloc::ZeroRange { .. })
    }

    /// Whether the size stays as it is.
    pub fn keeps_size(self) -> bool {
        matches!(
            self,
            Falloc::KeepSize | Falloc::PunchHole | Falloc::ZeroRange { keep_size: true }
        )
    }
}

/// A directory entry with its attributes (readdir-plus). `attr` is `None` when the inode vanished
/// between listing and reading it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DirEntryPlus {
    pub entry: DirEntry,
    pub attr: Option<Attr>,
}

/// What `statfs` reports.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StatFs {
    /// Capacity and free space of the volume's data partitions, in bytes.
    pub total_bytes: u64,
    pub free_bytes: u64,
    /// Inodes in use, and how many more can be created.
    pub files: u64,
    pub free_files: u64,
    /// Preferred IO size.
    pub block_size: u32,
    pub max_name: u32,
}

/// A file system: the network client or a layer over another file system.
///
/// Every method is cancel-safe only in the sense that a dropped future leaves the file system
/// consistent (as after a failed call); front ends should let calls run to completion.
pub trait FileSystem: Send + Sync + 'static {
    /// The attributes of `name` in directory `parent`.
    fn lookup(&self, parent: Ino, name: &[u8]) -> impl Future<Output = FsResult<Attr>> + Send;

    fn getattr(&self, ino: Ino) -> impl Future<Output = FsResult<Attr>> + Send;

    /// chmod/chown/truncate/utimes. A size change applies to data still buffered in open handles
    /// too (they are flushed first).
    fn setattr(&self, ino: Ino, set: SetAttr) -> impl Future<Output = FsResult<Attr>> + Send;

    /// Creates a regular file and opens it.
    fn create(
        &self,
        parent: Ino,
        name: &[u8],
        mode: u32,
        caller: Caller,
        flags: OpenFlags,
    ) -> impl Future<Output = FsResult<(Entry, Fh)>> + Send;

    fn mkdir(
        &self,
        parent: Ino,
        name: &[u8],
        mode: u32,
        caller: Caller,
    ) -> impl Future<Output = FsResult<Entry>> + Send;

    fn symlink(
        &self,
        parent: Ino,
        name: &[u8],
        target: &[u8],
        caller: Caller,
    ) -> impl Future<Output = FsResult<Entry>> + Send;

    /// A special file `parent/name` of `kind` — a FIFO, a UNIX socket, or a character or block
    /// device numbered `rdev` — with permission bits `mode`. Regular files come from `create`,
    /// directories from `mkdir`, symlinks from `symlink`; any other `kind` is invalid.
    fn mknod(
        &self,
        parent: Ino,
        name: &[u8],
        kind: FileType,
        mode: u32,
        rdev: u32,
        caller: Caller,
    ) -> impl Future<Output = FsResult<Entry>> + Send;

    /// A new hard link `new_parent/new_name` to `ino`.
    fn link(
        &self,
        ino: Ino,
        new_parent: Ino,
        new_name: &[u8],
    ) -> impl Future<Output = FsResult<Entry>> + Send;

    /// Removes a non-directory name. Returns the attributes, right after the call, of the
    /// directories it changed, as far as it learnt them (possibly none); so do `rmdir` and
    /// `rename`.
    fn unlink(&self, parent: Ino, name: &[u8]) -> impl Future<Output = FsResult<Vec<Attr>>> + Send;

    fn rmdir(&self, parent: Ino, name: &[u8]) -> impl Future<Output = FsResult<Vec<Attr>>> + Send;

    /// Moves `parent/name` to `new_parent/new_name`, replacing a compatible destination.
    fn rename(
        &self,
        parent: Ino,
        name: &[u8],
        new_parent: Ino,
        new_name: &[u8],
    ) -> impl Future<Output = FsResult<Vec<Attr>>> + Send;

    fn readlink(&self, ino: Ino) -> impl Future<Output = FsResult<Vec<u8>>> + Send;

    /// Entries of `dir` in name order strictly after `after`, at most `limit` (0: all), with
    /// attributes. `.` and `..` are not listed.
    fn readdir(
        &self,
        dir: Ino,
        after: Option<Vec<u8>>,
        limit: u32,
    ) -> impl Future<Output = FsResult<Vec<DirEntryPlus>>> + Send;

    fn open(&self, ino: Ino, flags: OpenFlags) -> impl Future<Output = FsResult<Fh>> + Send;

    /// Up to `len` bytes at `offset` (fewer at the end of the file).
    fn read(&self, fh: Fh, offset: u64, len: u32) -> impl Future<Output = FsResult<Bytes>> + Send;

    /// Writes `data` at `offset` (at the end with [`OpenFlags::append`]); returns the bytes taken.
    /// The data may stay buffered until `flush`, `fsync` or `release`.
    fn write(&self, fh: Fh, offset: u64, data: Bytes)
    -> impl Future<Output = FsResult<u32>> + Send;

    /// `fallocate(2)` over `[offset, offset + len)` of the file `fh` is open on (for writing):
    /// see [`Falloc`]. `len` must be at least 1 and the end within `u64` (else invalid). Data
    /// still buffered in the file's handles is flushed first. A file system that offers none
    /// of it answers [`FsError::Unsupported`].
    fn fallocate(
        &self,
        fh: Fh,
        mode: Falloc,
        offset: u64,
        len: u64,
    ) -> impl Future<Output = FsResult<()>> + Send {
        let _ = (fh, mode, offset, len);
        async { Err(FsError::Unsupported("fallocate")) }
    }

    /// Makes everything written through `fh` durable and visible to other clients (`close(2)`).
    fn flush(&self, fh: Fh) -> impl Future<Output = FsResult<()>> + Send;

    /// As `flush`, and makes every earlier change of names and attributes durable too (a file
    /// system may acknowledge those before they are: write-behind).
    fn fsync(&self, fh: Fh) -> impl Future<Output = FsResult<()>> + Send;

    /// Makes every earlier change of names and attributes durable (`fsync` on a directory, and
    /// unmount). Nothing to do where each change is durable when its call returns.
    fn sync_dir(&self, dir: Ino) -> impl Future<Output = FsResult<()>> + Send {
        let _ = dir;
        async { Ok(()) }
    }

    /// Flushes and forgets the handle.
    fn release(&self, fh: Fh) -> impl Future<Output = FsResult<()>> + Send;

    fn statfs(&self) -> impl Future<Output = FsResult<StatFs>> + Send;

    fn getxattr(&self, ino: Ino, name: &[u8]) -> impl Future<Output = FsResult<Vec<u8>>> + Send;

    fn setxattr(
        &self,
        ino: Ino,
        name: &[u8],
        value: &[u8],
        mode: XattrMode,
    ) -> impl Future<Output = FsResult<()>> + Send;

    fn listxattr(&self, ino: Ino) -> impl Future<Output = FsResult<Vec<Vec<u8>>>> + Send;

    fn removexattr(&self, ino: Ino, name: &[u8]) -> impl Future<Output = FsResult<()>> + Send;
}
