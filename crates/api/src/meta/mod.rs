//! The vocabulary of a meta partition: inode attributes, dentries, extent keys, the commands that
//! change a partition (replicated through its Raft group) and the queries that read it (served by
//! the leader), and their typed errors.
//!
//! A partition owns the inodes of its range `[start, end)` and the dentries whose **parent** inode it
//! owns. Operations that span two partitions (create = inode here, dentry there) are composed by the
//! client from these single-partition steps, in the CFS order that keeps "every dentry points to an
//! existing inode" true under any single failure (see `nacre-client`'s meta module).

pub mod extents;
pub mod rpc;
pub mod time;

use nacre_types::{ExtentId, Ino, PartitionId};
use serde::{Deserialize, Serialize};
use thiserror::Error;

/// The root directory of every volume.
pub const ROOT_INO: Ino = Ino(1);
/// Longest name, in bytes.
pub const MAX_NAME: usize = 255;
/// Longest symlink target, in bytes.
pub const MAX_SYMLINK: usize = 4096;
/// Longest extended attribute name and value, in bytes.
pub const MAX_XATTR_NAME: usize = 255;
pub const MAX_XATTR_VALUE: usize = 64 * 1024;
/// How long a directory delegation lasts after it was granted or last renewed, in the leader's
/// time (ns). A client counts it from when it *sent* the command that granted or renewed it, and
/// stops relying on it [`DELEGATION_MARGIN_NS`] before that ends.
pub const DELEGATION_NS: u64 = 10_000_000_000;
/// How long before a delegation's end (as the client counts it) the client stops relying on it:
/// room for the leaders' clocks to disagree.
pub const DELEGATION_MARGIN_NS: u64 = 1_000_000_000;
/// Most inode numbers one `Reserve` hands out.
pub const MAX_RESERVE: u32 = 65_536;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[repr(u8)]
pub enum FileType {
    File,
    Dir,
    Symlink,
    Fifo,
    Socket,
    CharDev,
    BlockDev,
}

/// A piece of a file: `size` bytes at `file_offset` live in `extent` of data partition `partition`
/// at `extent_offset` — as they are (`framed` is `None`), or inside a compressed block (see
/// [`Framed`]). An inode's keys are sorted by `file_offset` and never overlap.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExtentKey {
    pub file_offset: u64,
    pub partition: PartitionId,
    pub extent: ExtentId,
    pub extent_offset: u64,
    pub size: u32,
    /// CRC-32C of the bytes the key names on the data node: the piece's bytes as written (0 when
    /// unknown, e.g. after a trim), or the whole frame of a framed key (kept by trims, since the
    /// frame is always read whole).
    pub crc: u32,
    /// The piece is part of a compressed block stored as one frame.
    pub framed: Option<Framed>,
}

/// Where a framed key's piece is: its block's frame is `stored` bytes at the key's
/// `extent_offset` (a `nacre_func` block frame: header, checksum, compressed or raw payload), and
/// the piece's `size` bytes start `skip` bytes into the block's decompressed bytes. A key cut to
/// part of its piece keeps the frame and moves `skip`, so several keys may share one frame.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Framed {
    /// Never 0 (a frame has a header), which also keeps `Option<Framed>` at 8 bytes.
    pub stored: std::num::NonZeroU32,
    pub skip: u32,
}

impl ExtentKey {
    pub fn end(&self) -> u64 {
        self.file_offset + u64::from(self.size)
    }

    /// The bytes of its extent the key needs on the data node: its piece, or its block's whole
    /// frame. Only bytes no live key's range covers may be freed.
    pub fn stored_range(&self) -> (u64, u64) {
        let len = self.framed.map_or(self.size, |f| f.stored.get());
        (self.extent_offset, self.extent_offset + u64::from(len))
    }
}

/// An inode's attributes as clients see them. Times are signed nanoseconds since the Unix epoch
/// (negative before 1970; 1677 to 2262), encoded as the two's-complement bit pattern of the
/// `i64` in a `u64` ([`time::nanos`]): a time at or after 1970 has the same encoding as that
/// number of nanoseconds as a `u64`, so log entries and snapshots that hold times as `u64` decode
/// to the same times.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Attr {
    pub ino: Ino,
    pub kind: FileType,
    /// Permission bits (`0o7777`), without the file type.
    pub mode: u32,
    pub uid: u32,
    pub gid: u32,
    pub size: u64,
    pub nlink: u32,
    pub rdev: u32,
    #[serde(with = "time::nanos")]
    pub atime: i64,
    #[serde(with = "time::nanos")]
    pub mtime: i64,
    #[serde(with = "time::nanos")]
    pub ctime: i64,
    /// Bumped when an inode number is reused (never, today: numbers are not reused).
    pub generation: u32,
}

/// What a dentry points to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Dentry {
    pub ino: Ino,
    pub kind: FileType,
}

/// One directory entry, as listed.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DirEntry {
    pub name: Vec<u8>,
    pub ino: Ino,
    pub kind: FileType,
}

/// Attribute changes; `None` leaves a field alone.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SetAttr {
    pub mode: Option<u32>,
    pub uid: Option<u32>,
    pub gid: Option<u32>,
    /// Truncate or extend. Shrinking drops (or trims) extent keys past the new size; dropped keys
    /// join the partition's list of extents to free on the data nodes.
    pub size: Option<u64>,
    /// Signed ns since the epoch, encoded as in [`Attr`].
    #[serde(with = "time::opt_nanos")]
    pub atime: Option<i64>,
    #[serde(with = "time::opt_nanos")]
    pub mtime: Option<i64>,
    /// Also clear set-user-ID, and set-group-ID when the group may execute, of a non-directory
    /// (after `mode` if both are given): what chown, and a write or truncate by a caller without
    /// `CAP_FSETID`, must do. Not part of a command's encoding: [`Command::SetAttr`] never
    /// clears them and [`Command::SetAttrKillSuid`] always does (a variant of its own so that
    /// log entries written before it existed still decode); a client picks the command by this
    /// field.
    #[serde(skip)]
    pub kill_suidgid: bool,
}

/// `mode` without set-user-ID, and without set-group-ID when the group may execute (a
/// set-group-ID file the group cannot execute is marked for mandatory locking, not a privilege,
/// and keeps the bit): what chown, and a write or truncate by a caller without `CAP_FSETID`,
/// leave of a file's mode.
pub fn without_suidgid(mode: u32) -> u32 {
    let sgid_exec = libc_mode::S_ISGID | libc_mode::S_IXGRP;
    let mut m = mode & !libc_mode::S_ISUID;
    if m & sgid_exec == sgid_exec {
        m &= !libc_mode::S_ISGID;
    }
    m
}

/// The mode bits `without_suidgid` looks at (as in `<sys/stat.h>`).
mod libc_mode {
    pub const S_ISUID: u32 = 0o4000;
    pub const S_ISGID: u32 = 0o2000;
    pub const S_IXGRP: u32 = 0o0010;
}

/// How `SetXattr` treats an existing attribute.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum XattrMode {
    /// Create or replace.
    #[default]
    Upsert,
    /// Fail with `Exists` if present (XATTR_CREATE).
    Create,
    /// Fail with `NoXattr` if absent (XATTR_REPLACE).
    Replace,
}

/// A change to a partition. Every command is applied with the time the leader stamped on it
/// (`now`, ns since the epoch), so all replicas compute the same state.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Command {
    /// Allocates the next free inode number of the range (`NoInodes` when the range is used up).
    /// Files, symlinks and special files start with nlink 1, directories with nlink 2. `parent` is
    /// recorded (for directories it is what `..` means). `target` is the symlink target (empty for
    /// others; `InvalidName` if empty for a symlink or longer than `MAX_SYMLINK`).
    CreateInode {
        kind: FileType,
        mode: u32,
        uid: u32,
        gid: u32,
        rdev: u32,
        parent: Ino,
        target: Vec<u8>,
    },
    /// `CreateInode` and `CreateDentry` in one atomic step, when the parent is in this partition and
    /// the new inode can be allocated here: the fast path for creating a file (or directory) next to
    /// its parent. Errors as for the two commands; `NoInodes` when the range is used up (the caller
    /// then allocates the inode elsewhere). Replies `Created`: the new inode's attributes and the
    /// parent's after the change.
    Create {
        parent: Ino,
        name: Vec<u8>,
        kind: FileType,
        mode: u32,
        uid: u32,
        gid: u32,
        rdev: u32,
        target: Vec<u8>,
    },
    /// Removes `name` under `parent` and, when its inode lives in this partition, drops that link in
    /// the same atomic step (evicting the inode at nlink 0). With `dir` the entry must be a directory
    /// (`NotDir`) that, when local, has no entries (`NotEmpty`); a directory whose inode lives in
    /// another partition is refused with `WrongPartition` and nothing changes (the caller checks
    /// emptiness there first). Without `dir` the entry must not be a directory (`IsDir`). Replies
    /// `Removed`: the attributes after the drop when the inode is local, `None` when it lives
    /// elsewhere (the caller drops the link there), and the parent's attributes after the change.
    Remove {
        parent: Ino,
        name: Vec<u8>,
        dir: bool,
    },
    /// nlink + 1 (a new hard link). `IsDir` for directories; `NotFound` for an unknown or deleted inode.
    LinkInode {
        ino: Ino,
    },
    /// nlink − 1 after its dentry was removed. A directory must have no dentries in this partition
    /// (`NotEmpty`) and goes from 2 to 0 at once. At nlink 0 the inode is marked deleted: it is
    /// invisible to lookups and attribute reads, stays on the partition's orphan list, and is removed
    /// by `EvictInode` once its extents are freed.
    UnlinkInode {
        ino: Ino,
    },
    /// Removes a deleted (nlink 0) inode for good; `Invalid` if it still has links. Its extent keys
    /// join the to-free list (freed on the data nodes by the partition leader) and are returned.
    EvictInode {
        ino: Ino,
    },
    /// Adds `name` → `ino` under `parent` (which must be a live directory in this partition).
    /// `Exists` if the name is taken; for `kind == Dir` the parent's nlink grows by one. Updates the
    /// parent's mtime and ctime. Replies with the parent's attributes after the change (`Attr`).
    CreateDentry {
        parent: Ino,
        name: Vec<u8>,
        ino: Ino,
        kind: FileType,
    },
    /// Removes `name` under `parent`, returns what it pointed to. With `expect`, fails with
    /// `NotFound` unless the dentry points to that inode (protects against a concurrent replace).
    /// For directories the parent's nlink drops by one.
    DeleteDentry {
        parent: Ino,
        name: Vec<u8>,
        expect: Option<Ino>,
    },
    /// Points an existing dentry to another inode of the same kind class (dir only replaces dir, a
    /// non-dir only a non-dir: else `IsDir`/`NotDir`); returns the old target.
    UpdateDentry {
        parent: Ino,
        name: Vec<u8>,
        ino: Ino,
        kind: FileType,
    },
    /// Atomic rename when both parents are in this partition: moves the dentry, replacing an existing
    /// destination of a compatible kind (a directory may only replace an *empty* directory, which the
    /// caller has checked with the destination inode's partition; `NotEmpty` when the replaced
    /// directory's dentries are known here and exist). Renaming onto itself is a no-op. Parents'
    /// nlink and times follow POSIX. Replies `Renamed`: the replaced dentry, if any (the caller
    /// unlinks it), and the parents' attributes as they are after the call.
    Rename {
        src_parent: Ino,
        src_name: Vec<u8>,
        dst_parent: Ino,
        dst_name: Vec<u8>,
    },
    /// chmod/chown/truncate/utimes; updates ctime (and mtime on a size change).
    SetAttr {
        ino: Ino,
        set: SetAttr,
    },
    /// Records written pieces of a file: each new key replaces whatever range it overlaps (older keys
    /// are trimmed or dropped; dropped ones join the to-free list); size becomes at least the end of
    /// the last key. Updates mtime and ctime, also with no keys (what a client sends after writing
    /// in place). `IsDir` on a directory.
    AppendExtents {
        ino: Ino,
        extents: Vec<ExtentKey>,
    },
    SetXattr {
        ino: Ino,
        name: Vec<u8>,
        value: Vec<u8>,
        mode: XattrMode,
    },
    RemoveXattr {
        ino: Ino,
        name: Vec<u8>,
    },
    /// Forgets the first `count` entries of the to-free list (after they were freed on data nodes).
    /// With `first`, only if the list still starts with that entry: a retried acknowledgement whose
    /// first attempt was applied changes nothing.
    AckFreed {
        count: u64,
        first: Option<ExtentKey>,
    },
    /// Records `parent` as the parent directory of `ino` (a directory moved to a parent in another
    /// partition). `NotFound` for an unknown or deleted inode.
    SetParent {
        ino: Ino,
        parent: Ino,
    },
    /// Narrows the inode range to `[start, end)` (the master closed this partition in a split).
    /// `Invalid` if inodes at or past `end` were already allocated.
    SetEnd {
        end: u64,
    },
    /// `cmd` on behalf of `client` (not 0). Commands without it come from no client in particular.
    ///
    /// **Directory delegations.** A directory may be *delegated* to one client until a time:
    /// while it is, only that client may change the directory's entries or remove the directory
    /// (every other command that would — `Create`, `CreateAt`, `CreateDentry`, `DeleteDentry`,
    /// `UpdateDentry`, `Remove`, `Rename` with it as a parent, a `Remove` or `UnlinkInode` or
    /// rename-replace of the directory itself — fails with `Delegated(dir)` and changes nothing).
    /// So the holder knows every entry of the directory without asking, and may answer and
    /// change it ahead of the partition (write-behind). A `Create` or `CreateAt` of a directory
    /// (or a `CreateInode` of one, whose name the client then adds in another partition) on
    /// behalf of a client grants the new directory to that client until `now + DELEGATION_NS`; a successful change of the entries of a directory delegated to the client
    /// renews it to `now + DELEGATION_NS`, unless it was recalled. A delegation whose time has
    /// passed is gone (forgotten lazily, in a way every replica computes alike); removing the
    /// directory drops it. `As` inside `As` or `Batch` is `Invalid`.
    As {
        client: u64,
        cmd: Box<Command>,
    },
    /// The commands of one client's write-behind queue, applied in order, each as `As { client,
    /// op }`, in one log entry; replies `Reply::Batch` with one result per command (a failed
    /// command changes nothing, the others still apply). `seq` grows by one per batch a client
    /// sends to this partition; a batch whose `seq` is at or below the last one applied for the
    /// client is not applied again and replies `Reply::Batch` with no results (a retry after an
    /// unknown outcome). A client's last `seq` is forgotten once it sent nothing for
    /// `SESSION_NS`. `Batch` or `As` inside a batch is `Invalid`.
    Batch {
        client: u64,
        seq: u64,
        ops: Vec<Command>,
    },
    /// Hands out the next `count` (1..=`MAX_RESERVE`) inode numbers of the range without making
    /// inodes: the caller creates them later with `CreateAt` (the numbers of a caller that never
    /// does are lost, which is harmless). `NoInodes` when fewer than `count` are left, `Invalid`
    /// for a count of 0 or over `MAX_RESERVE`. Replies `Reserved`.
    Reserve {
        count: u32,
    },
    /// `Create` with an inode number from an earlier `Reserve` (in the range, below the next
    /// number to hand out, and not an inode now: `Invalid` otherwise). Replies `Created`.
    CreateAt {
        ino: Ino,
        parent: Ino,
        name: Vec<u8>,
        kind: FileType,
        mode: u32,
        uid: u32,
        gid: u32,
        rdev: u32,
        target: Vec<u8>,
    },
    /// Another client wants to change a directory delegated to someone else: the delegation is
    /// no longer renewed and ends at its current time (the holder learns it from the next batch
    /// that touches the directory: `Reply::Batch::recalled`). `Done` also when the directory is
    /// not delegated.
    Recall {
        dir: Ino,
    },
    /// On behalf of a client (`As`, `Batch`): gives back the delegations of `dirs` this client
    /// holds (recalled or not), so that other clients need not wait for them to end. Directories
    /// not delegated to the client, or outside the range, are left alone. Replies `Done`.
    Release {
        dirs: Vec<Ino>,
    },
    /// `SetAttr`, and in the same change set-user-ID is cleared, and set-group-ID if the group
    /// may execute, unless the inode is a directory (`set.kill_suidgid` is ignored: this
    /// command always clears them). Replies `Attr`.
    SetAttrKillSuid {
        ino: Ino,
        set: SetAttr,
    },
    /// `fallocate(2)` of a regular file over `[offset, offset + len)` (`len` at least 1, the end
    /// within `u64`: else `Invalid`). With `punch` the range is cut out of the extent keys (keys
    /// across its ends keep their parts outside it), so it reads as zeros; the bytes no key
    /// refers to any more join the to-free list. Without `keep_size` the size becomes at least
    /// `offset + len`. No space is reserved: data nodes allocate when bytes are written. Updates
    /// mtime and ctime when it punches or grows the file. `IsDir` on a directory, `Invalid` on
    /// other non-regular files. Replies `Attr`.
    Fallocate {
        ino: Ino,
        offset: u64,
        len: u64,
        punch: bool,
        keep_size: bool,
    },
    /// On behalf of a client (`As`, `Batch`): renews the delegations of `dirs` this client still
    /// holds (live and not recalled) to `now + DELEGATION_NS`, so that a tree it made stays its
    /// own while it uses it without changing every directory. Others are left alone. Replies
    /// `Inos` with the directories renewed.
    Renew {
        dirs: Vec<Ino>,
    },
    /// `cmd` (anything but `Once`) as call `seq` of `client` (not 0), applied **at most once**:
    /// a client that does not learn the outcome of a call sends the same call again, with the
    /// same `seq`, until it does (across resets, leader changes and restarts), and every copy
    /// after the first replies what the first did. Replies `Outcome` with `cmd`'s result, failure
    /// included (so a retried `Create` that succeeded is not `Exists`).
    ///
    /// The partition keeps, per client (its *call session*), the results of its calls at or above
    /// `done_below`: the client promises that it holds the answer to every call numbered below
    /// it (the lowest call it still waits for, on any partition), so those results are dropped.
    /// A copy of a call below the session's `done_below` is not applied and replies
    /// `Outcome(Err(Invalid))`: its client was answered already. A session is forgotten when its
    /// client made no call for `SESSION_NS`, far longer than any client retries a call.
    Once {
        client: u64,
        seq: u64,
        done_below: u64,
        cmd: Box<Command>,
    },
}

impl Command {
    /// The inode whose attributes or extended attributes this command sets. A delegated
    /// directory's holder answers for its attributes, so only the holder may set them.
    pub fn attr_target(&self) -> Option<Ino> {
        match self {
            Command::SetAttr { ino, .. }
            | Command::SetAttrKillSuid { ino, .. }
            | Command::SetXattr { ino, .. }
            | Command::RemoveXattr { ino, .. } => Some(*ino),
            _ => None,
        }
    }

    /// The directories whose entries this command changes (for a delegation, the ones only
    /// their holder may change): the parent, or a rename's two parents.
    pub fn entry_dirs(&self) -> impl Iterator<Item = Ino> + use<> {
        let (first, second) = match self {
            Command::Create { parent, .. }
            | Command::CreateAt { parent, .. }
            | Command::CreateDentry { parent, .. }
            | Command::DeleteDentry { parent, .. }
            | Command::UpdateDentry { parent, .. }
            | Command::Remove { parent, .. } => (Some(*parent), None),
            Command::Rename {
                src_parent,
                dst_parent,
                ..
            } => (
                Some(*src_parent),
                (dst_parent != src_parent).then_some(*dst_parent),
            ),
            _ => (None, None),
        };
        first.into_iter().chain(second)
    }
}

/// How long a client's last batch number, and its call session (`Command::Once`), are remembered
/// after its last batch or call (leader time, ns).
pub const SESSION_NS: u64 = 3_600_000_000_000;

/// A read of a partition (served by the leader, linearizably).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Query {
    GetAttr {
        ino: Ino,
    },
    /// The recorded parent of `ino` (what `..` means for a directory), as `Reply::Inos(vec![parent])`.
    Parent {
        ino: Ino,
    },
    /// Attributes of the inodes found (unknown and deleted ones are skipped).
    BatchGet {
        inos: Vec<Ino>,
    },
    Lookup {
        parent: Ino,
        name: Vec<u8>,
    },
    /// `Lookup` plus the target's attributes when its inode lives in this partition (`Found`).
    LookupPlus {
        parent: Ino,
        name: Vec<u8>,
    },
    /// Entries of `parent` in name order, strictly after `after` (all when `None`), at most `limit`.
    ReadDir {
        parent: Ino,
        after: Option<Vec<u8>>,
        limit: u32,
    },
    /// Like `ReadDir`, each entry with its attributes when the inode lives in this partition.
    ReadDirPlus {
        parent: Ino,
        after: Option<Vec<u8>>,
        limit: u32,
    },
    /// Attributes and extent keys (sorted by file offset).
    GetExtents {
        ino: Ino,
    },
    ReadLink {
        ino: Ino,
    },
    GetXattr {
        ino: Ino,
        name: Vec<u8>,
    },
    ListXattr {
        ino: Ino,
    },
    /// Inodes on the orphan list (deleted, not yet evicted), at most `limit`.
    Orphans {
        limit: u32,
    },
    /// The to-free list's first `limit` extent keys.
    ToFree {
        limit: u32,
    },
    Stats,
    /// The directories delegated to `client` that another client recalled (`Reply::Inos`, in
    /// order; one that ended may be listed until it is forgotten): what the holder should give
    /// back.
    Recalled {
        client: u64,
    },
    /// Of `extents` (normal extents of data partitions, sorted), the ones this partition still
    /// references: named by an extent key of any inode it holds, live or deleted and not yet
    /// evicted, or by its to-free list (what it will still read or free). Answers
    /// `Reply::Referenced`, sorted. The data partitions' garbage collector asks every meta
    /// partition of the volume and deletes only what none references (docs/ARCHITECTURE.md,
    /// "Garbage collection").
    Referenced {
        extents: Vec<(PartitionId, ExtentId)>,
    },
    /// What the partition's live files hold and take ([`Usage`]), as `Reply::Usage`. Walks
    /// every key: for `vol info`, not for a hot path.
    Usage,
}

/// What files hold and what that takes in extents.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Usage {
    /// Live regular files.
    pub files: u64,
    /// File bytes their keys hold (holes not counted).
    pub logical_bytes: u64,
    /// Extent bytes those keys need (one replica): a compressed block's frame once however many
    /// keys share it ([`ExtentKey::stored_range`]).
    pub stored_bytes: u64,
}

impl Usage {
    pub fn add(&mut self, o: &Usage) {
        self.files += o.files;
        self.logical_bytes += o.logical_bytes;
        self.stored_bytes += o.stored_bytes;
    }

    /// The usage of one file's keys (sorted by file offset, as an inode holds them).
    pub fn of_file(keys: &[ExtentKey]) -> Usage {
        let mut stored: Vec<(PartitionId, ExtentId, u64, u64)> = keys
            .iter()
            .map(|k| {
                let (from, to) = k.stored_range();
                (k.partition, k.extent, from, to)
            })
            .collect();
        stored.sort_unstable();
        // Ranges of one extent merged where they overlap (keys cut from one frame share it).
        let mut bytes = 0;
        let mut cur: Option<(PartitionId, ExtentId, u64, u64)> = None;
        for r in stored {
            match &mut cur {
                Some(c) if (c.0, c.1) == (r.0, r.1) && r.2 <= c.3 => c.3 = c.3.max(r.3),
                _ => {
                    if let Some(c) = cur.replace(r) {
                        bytes += c.3 - c.2;
                    }
                }
            }
        }
        if let Some(c) = cur {
            bytes += c.3 - c.2;
        }
        Usage {
            files: 1,
            logical_bytes: keys.iter().map(|k| u64::from(k.size)).sum(),
            stored_bytes: bytes,
        }
    }
}

/// Figures a partition reports (to the master, in heartbeats, and to `nacre bench meta`).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PartitionStats {
    pub start: u64,
    pub end: u64,
    /// Live and deleted-but-not-evicted inodes.
    pub inodes: u64,
    pub dentries: u64,
    /// Highest inode number allocated so far (0 if none).
    pub max_inode: u64,
    pub orphans: u64,
    pub to_free: u64,
    /// Estimated heap bytes held by the trees.
    pub memory: u64,
}

/// The answer to a command or query.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Reply {
    Done,
    Attr(Attr),
    Attrs(Vec<Attr>),
    Dentry(Dentry),
    /// `LookupPlus`: the dentry, with attributes when the inode is local.
    Found {
        dentry: Dentry,
        attr: Option<Attr>,
    },
    /// `Create`: the new inode's attributes, and its parent's after the change. `parent_was` is
    /// the parent's ctime just before the change: when it is the ctime a client last saw, no
    /// other change of the parent's entries came in between (a change of a directory's entries
    /// always moves its ctime forward).
    Created {
        attr: Attr,
        parent: Attr,
        #[serde(with = "time::nanos")]
        parent_was: i64,
    },
    /// `Remove`: the removed dentry, its inode's attributes after the drop when local, and the
    /// parent's attributes after the change.
    Removed {
        dentry: Dentry,
        attr: Option<Attr>,
        parent: Attr,
    },
    /// `Rename`: the replaced destination, if any, and the parents' attributes after the call (the
    /// source directory's first; one when source and destination directory are the same).
    Renamed {
        replaced: Option<Dentry>,
        parents: Vec<Attr>,
    },
    Entries(Vec<DirEntry>),
    EntriesPlus(Vec<(DirEntry, Option<Attr>)>),
    Extents(Attr, Vec<ExtentKey>),
    /// `EvictInode`: the evicted inode's extents.
    Freed(Vec<ExtentKey>),
    Bytes(Vec<u8>),
    Names(Vec<Vec<u8>>),
    Inos(Vec<Ino>),
    Stats(PartitionStats),
    /// `Batch`: one result per command, in order (none when the batch was applied before), and the
    /// directories touched by the batch whose delegation to this client is recalled or gone.
    Batch {
        results: Vec<Result<Reply, MetaError>>,
        recalled: Vec<Ino>,
    },
    /// `Reserve`: the inode numbers `[start, end)`.
    Reserved {
        start: u64,
        end: u64,
    },
    /// `Once`: the call's result, the first time it was applied.
    Outcome(Box<Result<Reply, MetaError>>),
    /// `Query::Referenced`: the extents asked about that the partition references, sorted.
    Referenced(Vec<(PartitionId, ExtentId)>),
    /// `Query::Usage`.
    Usage(Usage),
}

/// Why a meta operation failed. The FUSE layer maps these to errno (only there).
#[derive(Clone, Debug, Error, PartialEq, Eq, Serialize, Deserialize)]
pub enum MetaError {
    #[error("file exists")]
    Exists,
    #[error("no such file or directory")]
    NotFound,
    #[error("not a directory")]
    NotDir,
    #[error("is a directory")]
    IsDir,
    #[error("directory not empty")]
    NotEmpty,
    #[error("file name too long (over {MAX_NAME} bytes)")]
    NameTooLong,
    #[error("invalid name (empty, '.', '..', or containing '/' or NUL)")]
    InvalidName,
    #[error("inode {0} does not belong to this partition")]
    WrongPartition(Ino),
    #[error("no free inode left in this partition's range")]
    NoInodes,
    #[error("no such extended attribute")]
    NoXattr,
    #[error("too many links")]
    TooManyLinks,
    #[error("invalid argument: {0}")]
    Invalid(String),
    /// The directory is delegated to another client, which may be changing it ahead of this
    /// partition: send `Recall` and retry (the delegation ends within `DELEGATION_NS`).
    #[error("directory {0} is delegated to another client; retry")]
    Delegated(Ino),
}

/// A directory's mtime and ctime after a change of its entries at `now` (a file time,
/// [`time::file_time`]): `now`, or one past the old ctime when the clock is not ahead of it, so
/// that the ctime always moves forward (a client that writes behind predicts the partition's
/// value with it).
pub fn dir_changed_at(ctime: i64, now: i64) -> i64 {
    if ctime >= now {
        ctime.saturating_add(1)
    } else {
        now
    }
}

/// Checks a dentry name: 1..=255 bytes, not `.` or `..`, no `/` or NUL.
pub fn check_name(name: &[u8]) -> Result<(), MetaError> {
    if name.len() > MAX_NAME {
        return Err(MetaError::NameTooLong);
    }
    if name.is_empty() || name == b"." || name == b".." || name.iter().any(|&b| b == b'/' || b == 0)
    {
        return Err(MetaError::InvalidName);
    }
    Ok(())
}

#[cfg(test)]
mod usage_tests {
    use std::num::NonZeroU32;

    use super::*;

    fn key(file_offset: u64, extent: u64, extent_offset: u64, size: u32) -> ExtentKey {
        ExtentKey {
            file_offset,
            partition: PartitionId(1),
            extent: ExtentId(extent),
            extent_offset,
            size,
            crc: 0,
            framed: None,
        }
    }

    #[test]
    fn a_frame_shared_by_keys_counts_once_and_raw_keys_count_their_bytes() {
        let framed = |k: ExtentKey, stored: u32, skip: u32| ExtentKey {
            framed: Some(Framed {
                stored: NonZeroU32::new(stored).unwrap_or(NonZeroU32::MIN),
                skip,
            }),
            ..k
        };
        // One 64 KiB block stored in a 9,000-byte frame, cut by a hole into two keys; a raw
        // key of 100 bytes in another extent; a second frame right after the first.
        let keys = [
            framed(key(0, 7, 0, 4096), 9000, 0),
            framed(key(8192, 7, 0, 65536 - 8192), 9000, 8192),
            framed(key(65536, 7, 9000, 1000), 300, 0),
            key(70000, 8, 50, 100),
        ];
        let u = Usage::of_file(&keys);
        assert_eq!(u.files, 1);
        assert_eq!(u.logical_bytes, 4096 + 65536 - 8192 + 1000 + 100);
        assert_eq!(u.stored_bytes, 9000 + 300 + 100);
    }
}
