//! The meta partition state machine (DESIGN.md §6): inodes, dentries, xattrs, the orphan list and
//! the to-free list of one inode range, changed only by [`Command`]s applied in log order.
//!
//! Pure: no IO, no clock, no randomness, no hash-map iteration. A command carries the leader's
//! time, so every replica applying the same log computes the same state, byte for byte (the
//! snapshot of two such replicas is identical). A failed command changes nothing: every handler
//! validates before it mutates.
//!
//! # Representation
//!
//! Memory per file is what limits a meta node, so the common case is kept small:
//! - **Inodes** are numbered in order from the start of the range and never reused, so they live
//!   in chunks of 64 consecutive numbers: a bitmap of the numbers present and a vector of the
//!   present inodes in order (`InodeTable`). An `Inode` is 72 bytes; the chunk map adds about
//!   one byte per inode. Symlink targets and device numbers are rare, so they live in side maps.
//!   Extent keys are a boxed slice (16 bytes in the inode, 40 bytes per key on the heap).
//! - **Dentries** are one `BTreeMap` keyed by the parent's number (big-endian, so keys sort by
//!   parent, then by name bytes) followed by the name, in one allocation; the value is 9 bytes.
//!   Xattrs use the same key scheme (owner inode, then name).
//!
//! For a small file (one inode, one dentry with a 10-byte name, one extent key) this comes to
//! about 72 (inode) + 70 (an 18-byte dentry key and its share of the B-tree) + 40 (extent key) =
//! 182 bytes of heap, 142 without the extent key; see [`MetaPartition::memory_estimate`].
//!
//! # Delegations and write-behind batches
//!
//! A directory created by a client (`Create`/`CreateAt` in `As` or `Batch`) is *delegated* to it
//! for [`DELEGATION_NS`]: until then only that client may change its entries or remove it, so the
//! client may change it ahead of the partition and send the changes later, in a `Batch` (see
//! `Command::As`). Each change of its entries by the holder renews the delegation, unless another
//! client asked for it back (`Recall`). A batch carries a per-client number so that a retried
//! batch is not applied twice; the last number of each client (its *session*) is kept for
//! [`SESSION_NS`] after its last batch.
//!
//! Both expire with time, and time is only the `now` a command carries: whether a delegation or a
//! session still holds is always decided by comparing its time with `now`, never by whether it is
//! still stored. Expired ones are forgotten after every command that succeeds (a failed command
//! changes nothing, not even this), by popping them from the front of an index ordered by time:
//! O(log n) per command, amortized. Forgetting after a success also matters for safety when the
//! leader's clock goes back (a new leader): a change that another client could make because a
//! delegation had ended forgets that delegation at once, so that an earlier `now` can never
//! bring it back and let the holder renew it without knowing of that change.
//!
//! # Invariants (checked by [`MetaPartition::verify`], and on every restore)
//! - Every inode number is in `[start, end)`, at least 1, and below `next`. Numbers are handed out
//!   once (by `CreateInode`, `Create` and `Reserve`); `CreateAt` makes an inode of a number handed
//!   out before that is not an inode now.
//! - An inode is deleted exactly when its nlink is 0, and then it is on the orphan list.
//! - A live directory's nlink is 2 + the number of its subdirectory dentries (all of which live
//!   here, as dentries live with their parent). A dentry's parent is a live local directory.
//! - Extent keys of a file are sorted by file offset, non-empty, non-overlapping, and end at or
//!   before the file size; other kinds have none. Only symlinks have (non-empty) targets.
//! - Every delegation is of a live directory of this partition, to a client other than 0; every
//!   session is of a client other than 0; the time indexes list exactly the delegations' ends and
//!   the sessions' last batch times.
//!
//! What this partition cannot see is the client's job: dentries pointing to inodes of other
//! partitions, directory loops through other partitions (a rename checks the ancestry only as far
//! as the `parent` pointers stay in this partition), and the `parent` pointer of a directory moved
//! by a cross-partition rename (`SetParent`).

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::fmt;
use std::mem::size_of;
use std::ops::Bound;

use nacre_types::{ExtentId, Ino, PartitionId};
use serde::de::{SeqAccess, Visitor};
use serde::ser::SerializeSeq;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::ops::{
    Attr, Command, DELEGATION_NS, Dentry, DirEntry, ExtentKey, FileType, MAX_NAME, MAX_RESERVE,
    MAX_SYMLINK, MAX_XATTR_NAME, MAX_XATTR_VALUE, MetaError, PartitionStats, Query, ROOT_INO,
    Reply, SESSION_NS, SetAttr, XattrMode, check_name, without_suidgid,
};

/// Most links an inode may have; a directory may thus hold `MAX_LINKS - 2` subdirectories.
pub const MAX_LINKS: u32 = 65_000;

/// Version of the format written by [`MetaPartition::snapshot`]: a postcard `u32` version, then
/// the partition (a new layout gets a new version and a decoder of its own). Version 2 added the
/// delegations and the sessions at the end; version 1 snapshots still restore (with none).
pub const SNAPSHOT_VERSION: u32 = 2;

/// Permission bits kept from a mode; the file type is [`FileType`], not mode bits.
const MODE_MASK: u32 = 0o7777;

/// Heap bytes of one stored extent key.
const EXTENT_BYTES: u64 = size_of::<ExtentKey>() as u64;

/// One meta partition: inodes of `[start, end)` and the dentries under the directories among them.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "Image")]
pub struct MetaPartition {
    start: u64,
    end: u64,
    /// The next inode number to hand out.
    next: u64,
    inodes: InodeTable,
    /// `parent (8 bytes BE) ++ name` → target.
    dentries: BTreeMap<Box<[u8]>, DentryVal>,
    /// Symlink targets.
    targets: BTreeMap<u64, Box<[u8]>>,
    /// Device numbers, where not 0.
    rdevs: BTreeMap<u64, u32>,
    /// `ino (8 bytes BE) ++ name` → value.
    xattrs: BTreeMap<Box<[u8]>, Box<[u8]>>,
    /// Deleted inodes awaiting `EvictInode`.
    orphans: BTreeSet<u64>,
    /// Extent keys no inode refers to any more, to free on the data nodes (oldest first).
    to_free: VecDeque<ExtentKey>,
    /// Directory → the client it is delegated to (some may have ended: see `Delegation::live`).
    delegations: BTreeMap<u64, Delegation>,
    /// Client → its last batch (some may be forgotten already: see `Session::live`).
    sessions: BTreeMap<u64, Session>,
    /// `(until, dir)` of every delegation, so that the ended ones are found at the front. Derived
    /// from `delegations` (so not in snapshots).
    #[serde(skip)]
    delegation_ends: BTreeSet<(u64, u64)>,
    /// `(at, client)` of every session, likewise.
    #[serde(skip)]
    session_times: BTreeSet<(u64, u64)>,
    /// Bytes of the variable-size allocations: dentry and xattr keys and values, symlink targets,
    /// extent keys. Kept up to date so that `stats` does not walk the trees; derived from the rest
    /// (so not in snapshots).
    #[serde(skip)]
    heap: u64,
}

impl MetaPartition {
    /// An empty partition for inodes `[start, end)` (an `end` below `start` means an empty range).
    /// The partition whose range holds `ROOT_INO` starts with the root directory (mode 0o755,
    /// uid/gid 0, nlink 2, parent itself, times 0). Inode 0 is never handed out.
    pub fn new(start: u64, end: u64) -> Self {
        let mut p = Self {
            start,
            end: end.max(start),
            next: start.max(1),
            ..Self::default()
        };
        if p.owns(ROOT_INO) {
            let root = Inode::new(FileType::Dir, 0o755, 0, 0, ROOT_INO.0, 0);
            p.inodes.insert(ROOT_INO.0, root);
            p.next = ROOT_INO.0 + 1;
        }
        p
    }

    /// Whether `ino` is in this partition's range.
    pub fn owns(&self, ino: Ino) -> bool {
        self.start <= ino.0 && ino.0 < self.end
    }

    /// Applies a command stamped with the leader's time `now` (ns). A failed command changes nothing.
    ///
    /// Replies: the inode's attributes after `CreateInode`, `LinkInode`, `UnlinkInode` (nlink 0:
    /// now deleted), `SetAttr` and `AppendExtents`; the old dentry after `DeleteDentry` and
    /// `UpdateDentry`; `Created` after `Create` and `CreateAt`; `Removed` after `Remove`;
    /// `Renamed` after `Rename`; `Freed` after `EvictInode`; `Reserved` after `Reserve`; `Batch`
    /// after `Batch`; the wrapped command's reply after `As`; else `Done`.
    /// An inode operation on a number outside the range fails with `WrongPartition`, as does a
    /// dentry operation whose parent is outside it, and `Recall` of a directory outside it (a
    /// misrouted request, as for every other command). Modes keep their permission bits only.
    ///
    /// A command that changes the entries of a directory, or removes one, while it is delegated
    /// to another client fails with `Delegated` before any other check: the holder may have
    /// changes of that directory not sent yet, so no other answer would be right. After every
    /// command that succeeds, the delegations and sessions that ended by `now` are forgotten (see
    /// the module documentation).
    pub fn apply(&mut self, now: u64, cmd: &Command) -> Result<Reply, MetaError> {
        let reply = match cmd {
            Command::As { client, cmd } => {
                if *client == 0 {
                    return Err(MetaError::Invalid("a command on behalf of client 0".into()));
                }
                self.apply_as(now, *client, cmd)
            }
            Command::Batch { client, seq, ops } => self.batch(now, *client, *seq, ops),
            _ => self.apply_as(now, 0, cmd),
        }?;
        self.expire(now);
        Ok(reply)
    }

    /// `cmd` on behalf of `client` (0: none): refused if it would change a directory delegated to
    /// another client; on success, grants a directory it created and renews the delegations of
    /// the directories whose entries it changed (for a client).
    fn apply_as(&mut self, now: u64, client: u64, cmd: &Command) -> Result<Reply, MetaError> {
        self.check_delegations(now, client, cmd)?;
        if let Command::Release { dirs } = cmd {
            for dir in dirs {
                if client != 0
                    && self
                        .delegations
                        .get(&dir.0)
                        .is_some_and(|d| d.holder == client)
                {
                    self.drop_delegation(dir.0);
                }
            }
        }
        let reply = self.execute(now, cmd)?;
        if client != 0 {
            for dir in cmd.entry_dirs() {
                if let Some(d) = self.held(now, client, dir) {
                    self.set_delegation(dir.0, d.renewed(now));
                }
            }
            // A new directory (made with its name, or as the inode a client names elsewhere
            // next): nobody else can know it yet.
            let made = match (&reply, cmd) {
                (Reply::Created { attr, .. }, _)
                | (Reply::Attr(attr), Command::CreateInode { .. }) => Some(attr),
                _ => None,
            };
            if let Some(attr) = made
                && attr.kind == FileType::Dir
            {
                self.set_delegation(attr.ino.0, Delegation::granted(client, now));
            }
        }
        Ok(reply)
    }

    /// `Command::Batch`. Only a malformed batch fails as a whole (and changes nothing);
    /// each command's failure is its result.
    fn batch(
        &mut self,
        now: u64,
        client: u64,
        seq: u64,
        ops: &[Command],
    ) -> Result<Reply, MetaError> {
        if client == 0 {
            return Err(MetaError::Invalid("a batch of client 0".into()));
        }
        if ops.iter().any(nests) {
            return Err(MetaError::Invalid("As or Batch inside a batch".into()));
        }
        if self
            .sessions
            .get(&client)
            .is_some_and(|s| s.live(now) && s.seq >= seq)
        {
            // Applied before: a retry after an unknown outcome.
            return Ok(Reply::Batch {
                results: Vec::new(),
                recalled: Vec::new(),
            });
        }
        let mut touched = BTreeSet::new();
        let mut results = Vec::with_capacity(ops.len());
        for op in ops {
            touched.extend(op.entry_dirs());
            results.push(self.apply_as(now, client, op));
        }
        if let Some(old) = self.sessions.insert(client, Session { seq, at: now }) {
            self.session_times.remove(&(old.at, client));
        }
        self.session_times.insert((now, client));
        // The directories the client may have changed ahead of the partition and may no longer
        // treat as its own (`BTreeSet`: sorted, once each).
        let recalled = touched
            .into_iter()
            .filter(|&dir| self.held(now, client, dir).is_none())
            .collect();
        Ok(Reply::Batch { results, recalled })
    }

    /// One command of any client (`As` and `Batch` are unwrapped by the callers).
    fn execute(&mut self, now: u64, cmd: &Command) -> Result<Reply, MetaError> {
        match cmd {
            Command::CreateInode {
                kind,
                mode,
                uid,
                gid,
                rdev,
                parent,
                target,
            } => {
                let node = Inode::new(*kind, *mode, *uid, *gid, parent.0, now);
                self.create_inode(node, *rdev, target, None)
                    .map(Reply::Attr)
            }
            // One arm, so that both share every check (`CreateAt` only picks the number).
            Command::Create {
                parent,
                name,
                kind,
                mode,
                uid,
                gid,
                rdev,
                target,
            }
            | Command::CreateAt {
                parent,
                name,
                kind,
                mode,
                uid,
                gid,
                rdev,
                target,
                ..
            } => {
                let at = match cmd {
                    Command::CreateAt { ino, .. } => Some(*ino),
                    _ => None,
                };
                let node = Inode::new(*kind, *mode, *uid, *gid, parent.0, now);
                self.create(now, (*parent, name), node, *rdev, target, at)
            }
            Command::Remove { parent, name, dir } => self.remove(now, *parent, name, *dir),
            Command::LinkInode { ino } => self.link_inode(now, *ino),
            Command::UnlinkInode { ino } => self.unlink_inode(now, *ino),
            Command::EvictInode { ino } => self.evict_inode(*ino),
            Command::CreateDentry {
                parent,
                name,
                ino,
                kind,
            } => self
                .create_dentry(
                    now,
                    *parent,
                    name,
                    Dentry {
                        ino: *ino,
                        kind: *kind,
                    },
                )
                .map(Reply::Attr),
            Command::DeleteDentry {
                parent,
                name,
                expect,
            } => self.delete_dentry(now, *parent, name, *expect),
            Command::UpdateDentry {
                parent,
                name,
                ino,
                kind,
            } => self.update_dentry(
                now,
                *parent,
                name,
                Dentry {
                    ino: *ino,
                    kind: *kind,
                },
            ),
            Command::Rename {
                src_parent,
                src_name,
                dst_parent,
                dst_name,
            } => self.rename(now, (*src_parent, src_name), (*dst_parent, dst_name)),
            Command::SetAttr { ino, set } => self.set_attr(now, *ino, set, false),
            Command::SetAttrKillSuid { ino, set } => self.set_attr(now, *ino, set, true),
            Command::AppendExtents { ino, extents } => self.append_extents(now, *ino, extents),
            Command::SetXattr {
                ino,
                name,
                value,
                mode,
            } => self.set_xattr(now, *ino, name, value, *mode),
            Command::RemoveXattr { ino, name } => self.remove_xattr(now, *ino, name),
            Command::AckFreed { count, first } => self.ack_freed(*count, first.as_ref()),
            Command::SetParent { ino, parent } => {
                let (_, node) = self.live_mut(*ino)?;
                node.parent = parent.0;
                Ok(Reply::Done)
            }
            Command::SetEnd { end } => self.set_end(*end),
            Command::Reserve { count } => self.reserve(*count),
            Command::Recall { dir } => {
                let i = self.owned(*dir)?;
                if let Some(d) = self.delegations.get_mut(&i)
                    && d.live(now)
                {
                    // Ends at its time; `until` stays, so the index stays right.
                    d.recalled = true;
                }
                Ok(Reply::Done)
            }
            Command::Release { .. } => Ok(Reply::Done), // done by `apply_as`, which knows who
            Command::As { .. } | Command::Batch { .. } => {
                Err(MetaError::Invalid("As and Batch do not nest".into()))
            }
        }
    }

    /// Answers a read. `limit` 0 means no limit (`ReadDir`, `ReadDirPlus`, `Orphans`, `ToFree`);
    /// callers page through large directories with a limit. `ToFree` answers `Reply::Freed`.
    pub fn query(&self, q: &Query) -> Result<Reply, MetaError> {
        match q {
            Query::GetAttr { ino } => {
                let (i, node) = self.live(*ino)?;
                Ok(Reply::Attr(self.attr(i, node)))
            }
            Query::Parent { ino } => {
                let (_, node) = self.live(*ino)?;
                Ok(Reply::Inos(vec![Ino(node.parent)]))
            }
            Query::BatchGet { inos } => Ok(Reply::Attrs(
                inos.iter()
                    .filter_map(|&ino| self.live(ino).ok())
                    .map(|(i, node)| self.attr(i, node))
                    .collect(),
            )),
            Query::Lookup { parent, name } => {
                let p = self.owned(*parent)?;
                let key = Key::dentry(p, name)?;
                self.live_dir(p)?;
                let d = self
                    .dentries
                    .get(key.as_slice())
                    .ok_or(MetaError::NotFound)?;
                Ok(Reply::Dentry((*d).into()))
            }
            Query::LookupPlus { parent, name } => {
                let p = self.owned(*parent)?;
                let key = Key::dentry(p, name)?;
                self.live_dir(p)?;
                let d: Dentry = (*self
                    .dentries
                    .get(key.as_slice())
                    .ok_or(MetaError::NotFound)?)
                .into();
                let attr = self.live(d.ino).ok().map(|(i, n)| self.attr(i, n));
                Ok(Reply::Found { dentry: d, attr })
            }
            Query::ReadDir {
                parent,
                after,
                limit,
            } => Ok(Reply::Entries(
                self.read_dir(*parent, after.as_deref(), *limit)?
                    .map(|(entry, _)| entry)
                    .collect(),
            )),
            Query::ReadDirPlus {
                parent,
                after,
                limit,
            } => Ok(Reply::EntriesPlus(
                self.read_dir(*parent, after.as_deref(), *limit)?
                    .map(|(entry, d)| {
                        let attr = self.live(d.ino()).ok().map(|(i, n)| self.attr(i, n));
                        (entry, attr)
                    })
                    .collect(),
            )),
            Query::GetExtents { ino } => {
                let (i, node) = self.live(*ino)?;
                Ok(Reply::Extents(self.attr(i, node), node.extents.to_vec()))
            }
            Query::ReadLink { ino } => {
                let (i, node) = self.live(*ino)?;
                match self.targets.get(&i) {
                    Some(t) if node.kind == FileType::Symlink => Ok(Reply::Bytes(t.to_vec())),
                    _ => Err(MetaError::Invalid(format!("{ino} is not a symlink"))),
                }
            }
            Query::GetXattr { ino, name } => {
                let (i, _) = self.live(*ino)?;
                let key = Key::xattr(i, name)?;
                let value = self.xattrs.get(key.as_slice()).ok_or(MetaError::NoXattr)?;
                Ok(Reply::Bytes(value.to_vec()))
            }
            Query::ListXattr { ino } => {
                let (i, _) = self.live(*ino)?;
                Ok(Reply::Names(
                    owned_by(&self.xattrs, i, None)
                        .map(|(name, _)| name.to_vec())
                        .collect(),
                ))
            }
            Query::Orphans { limit } => Ok(Reply::Inos(
                self.orphans
                    .iter()
                    .take(take_limit(*limit))
                    .map(|&i| Ino(i))
                    .collect(),
            )),
            Query::ToFree { limit } => Ok(Reply::Freed(
                self.to_free
                    .iter()
                    .take(take_limit(*limit))
                    .copied()
                    .collect(),
            )),
            Query::Stats => Ok(Reply::Stats(self.stats())),
            Query::Recalled { client } => Ok(Reply::Inos(
                self.delegations
                    .iter()
                    .filter(|(_, d)| d.holder == *client && d.recalled)
                    .map(|(dir, _)| Ino(*dir))
                    .collect(),
            )),
        }
    }

    /// Figures for heartbeats and `statfs`.
    pub fn stats(&self) -> PartitionStats {
        PartitionStats {
            start: self.start,
            end: self.end,
            inodes: self.inodes.len() as u64,
            dentries: self.dentries.len() as u64,
            max_inode: self.max_inode(),
            orphans: self.orphans.len() as u64,
            to_free: self.to_free.len() as u64,
            memory: self.memory_estimate(),
        }
    }

    /// Highest inode number handed out so far (0 if none).
    pub fn max_inode(&self) -> u64 {
        if self.next > self.start.max(1) {
            self.next - 1
        } else {
            0
        }
    }

    /// Estimated heap bytes held by the partition: the exact sizes of the variable-length
    /// allocations and vectors, plus B-tree nodes at a typical fill (see `btree_bytes`).
    /// Allocator overhead (size classes, headers) is not included. Costs O(inodes / 64).
    pub fn memory_estimate(&self) -> u64 {
        self.inodes.heap_bytes()
            + btree_bytes(
                self.dentries.len(),
                size_of::<Box<[u8]>>(),
                size_of::<DentryVal>(),
            )
            + btree_bytes(self.targets.len(), size_of::<u64>(), size_of::<Box<[u8]>>())
            + btree_bytes(self.rdevs.len(), size_of::<u64>(), size_of::<u32>())
            + btree_bytes(
                self.xattrs.len(),
                size_of::<Box<[u8]>>(),
                size_of::<Box<[u8]>>(),
            )
            + btree_bytes(self.orphans.len(), size_of::<u64>(), 0)
            + btree_bytes(
                self.delegations.len(),
                size_of::<u64>(),
                size_of::<Delegation>(),
            )
            + btree_bytes(self.sessions.len(), size_of::<u64>(), size_of::<Session>())
            + btree_bytes(
                self.delegation_ends.len() + self.session_times.len(),
                size_of::<(u64, u64)>(),
                0,
            )
            + self.to_free.capacity() as u64 * EXTENT_BYTES
            + self.heap
    }

    /// The whole partition as bytes (a Raft snapshot): see [`SNAPSHOT_VERSION`].
    pub fn snapshot(&self) -> Vec<u8> {
        // Every collection serializes with a known length, which is all postcard can fail on.
        postcard::to_allocvec(&(SNAPSHOT_VERSION, self)).expect("a partition always serializes")
    }

    /// Rebuilds a partition from [`snapshot`](Self::snapshot) bytes, of this version or of
    /// version 1 (which had no delegations and no sessions); `Invalid` for anything that does not
    /// decode to a partition satisfying every invariant ([`verify`](Self::verify)).
    pub fn restore(bytes: &[u8]) -> Result<Self, MetaError> {
        let (version, rest) = postcard::take_from_bytes::<u32>(bytes).map_err(bad_snapshot)?;
        // Decoded in two steps (not as `Self`) so that a broken invariant keeps its message.
        let image = match version {
            1 => decode::<Trees>(rest)?.into(),
            SNAPSHOT_VERSION => decode::<Image>(rest)?,
            _ => {
                return Err(MetaError::Invalid(format!(
                    "bad snapshot: unknown version {version}"
                )));
            }
        };
        Self::try_from(image)
    }

    /// Checks every invariant listed in the module documentation (O(size · log size)); `Invalid`
    /// names the first one broken. Restoring a snapshot runs it; tests run it after each step.
    pub fn verify(&self) -> Result<(), MetaError> {
        fn broken(what: String) -> Result<(), MetaError> {
            Err(MetaError::Invalid(format!("broken invariant: {what}")))
        }
        if self.start > self.end || self.next < self.start {
            return broken(format!(
                "range [{}, {}) with next inode {}",
                self.start, self.end, self.next
            ));
        }
        self.inodes.verify()?;
        let mut subdirs: BTreeMap<u64, u64> = BTreeMap::new();
        for (key, d) in &self.dentries {
            let (parent, name) = split_key(key);
            if let Err(e) = check_name(name) {
                return broken(format!("dentry {name:?} under {parent}: {e}"));
            }
            match self.inodes.get(parent) {
                Some(p) if p.kind == FileType::Dir && p.nlink > 0 => {}
                _ => return broken(format!("dentry {name:?} under a non-directory {parent}")),
            }
            if d.kind() == FileType::Dir {
                *subdirs.entry(parent).or_default() += 1;
            }
        }
        for (i, node) in self.inodes.iter() {
            if i == 0 || !self.owns(Ino(i)) || i >= self.next {
                return broken(format!("inode {i} outside the allocated range"));
            }
            if node.mode > MODE_MASK as u16 || node.nlink > MAX_LINKS {
                return broken(format!(
                    "inode {i}: mode {:o}, nlink {}",
                    node.mode, node.nlink
                ));
            }
            if (node.nlink == 0) != self.orphans.contains(&i) {
                return broken(format!("inode {i}: nlink {} vs orphan list", node.nlink));
            }
            let dirs = subdirs.get(&i).copied().unwrap_or(0);
            if node.kind == FileType::Dir && node.nlink > 0 && u64::from(node.nlink) != 2 + dirs {
                return broken(format!(
                    "directory {i}: nlink {} with {dirs} subdirectories",
                    node.nlink
                ));
            }
            if node.kind != FileType::File && !node.extents.is_empty() {
                return broken(format!("inode {i}: extent keys on a {:?}", node.kind));
            }
            if let Err(e) = check_extents(&node.extents, node.size) {
                return broken(format!("inode {i}: {e}"));
            }
            let target = self.targets.get(&i);
            if (node.kind == FileType::Symlink) != target.is_some() {
                return broken(format!(
                    "inode {i}: a {:?} with target {target:?}",
                    node.kind
                ));
            }
        }
        if let Some((i, t)) = self
            .targets
            .iter()
            .find(|(i, t)| t.is_empty() || t.len() > MAX_SYMLINK || self.inodes.get(**i).is_none())
        {
            return broken(format!("symlink target {t:?} of inode {i}"));
        }
        if let Some((i, _)) = self
            .rdevs
            .iter()
            .find(|(i, r)| **r == 0 || self.inodes.get(**i).is_none())
        {
            return broken(format!("device number of inode {i}"));
        }
        if let Some(i) = self.orphans.iter().find(|i| self.inodes.get(**i).is_none()) {
            return broken(format!("orphan {i} is not an inode"));
        }
        for (key, value) in &self.xattrs {
            let (i, name) = split_key(key);
            if check_xattr_name(name).is_err()
                || value.len() > MAX_XATTR_VALUE
                || self.inodes.get(i).is_none()
            {
                return broken(format!("xattr {name:?} of inode {i}"));
            }
        }
        for (&dir, d) in &self.delegations {
            let live_dir = self.owns(Ino(dir))
                && matches!(self.inodes.get(dir), Some(n) if n.kind == FileType::Dir && n.nlink > 0);
            if !live_dir || d.holder == 0 {
                return broken(format!(
                    "delegation {d:?} of {dir}: not a live local directory, or to client 0"
                ));
            }
        }
        if self.sessions.contains_key(&0) {
            return broken("a session of client 0".into());
        }
        let ends = self.delegations.iter().map(|(&dir, d)| (d.until, dir));
        let times = self.sessions.iter().map(|(&client, s)| (s.at, client));
        if !indexes(&self.delegation_ends, ends) || !indexes(&self.session_times, times) {
            return broken("the time indexes of the delegations and sessions".into());
        }
        let heap = self.count_heap();
        if heap != self.heap {
            return broken(format!("heap bytes {} counted as {heap}", self.heap));
        }
        Ok(())
    }

    // --- Commands ---------------------------------------------------------------------------

    /// Makes inode `node`: number `at` (from an earlier `Reserve`), or the next one. Checks
    /// everything before it changes anything.
    fn create_inode(
        &mut self,
        mut node: Inode,
        rdev: u32,
        target: &[u8],
        at: Option<Ino>,
    ) -> Result<Attr, MetaError> {
        let symlink = node.kind == FileType::Symlink;
        if symlink && (target.is_empty() || target.len() > MAX_SYMLINK) {
            return Err(MetaError::InvalidName);
        }
        if !symlink && !target.is_empty() {
            return Err(MetaError::Invalid("only a symlink has a target".into()));
        }
        let ino = match at {
            None if self.next >= self.end => return Err(MetaError::NoInodes),
            None => self.next,
            Some(ino) => self.reserved(ino)?,
        };
        if at.is_none() {
            self.next += 1;
        }
        if symlink {
            // What lstat reports for a symlink: the length of its target.
            node.size = target.len() as u64;
            self.targets.insert(ino, target.into());
            self.heap += target.len() as u64;
        }
        if rdev != 0 {
            self.rdevs.insert(ino, rdev);
        }
        let attr = self.attr(ino, &node);
        self.inodes.insert(ino, node);
        Ok(attr)
    }

    /// `Command::Create` (`at` is `None`) and `Command::CreateAt`: inode `node` (numbered as by
    /// `create_inode`) and its dentry `name` under `parent`, in one step.
    fn create(
        &mut self,
        now: u64,
        (parent, name): (Ino, &[u8]),
        node: Inode,
        rdev: u32,
        target: &[u8],
        at: Option<Ino>,
    ) -> Result<Reply, MetaError> {
        // Check everything the dentry needs before making the inode, so that nothing changes on
        // failure.
        let p = self.owned(parent)?;
        let key = Key::dentry(p, name)?;
        let dir = self.live_dir(p)?;
        let kind = node.kind;
        if kind == FileType::Dir && dir.nlink >= MAX_LINKS {
            return Err(MetaError::TooManyLinks);
        }
        if self.dentries.contains_key(key.as_slice()) {
            return Err(MetaError::Exists);
        }
        let parent_was = dir.ctime;
        let attr = self.create_inode(node, rdev, target, at)?;
        let d = Dentry {
            ino: attr.ino,
            kind,
        };
        // Cannot fail now: the parent, the name and the new inode were checked.
        let parent = self.create_dentry(now, parent, name, d)?;
        Ok(Reply::Created {
            attr,
            parent,
            parent_was,
        })
    }

    /// `Command::Reserve`: the next `count` numbers, without inodes.
    fn reserve(&mut self, count: u32) -> Result<Reply, MetaError> {
        if count == 0 || count > MAX_RESERVE {
            return Err(MetaError::Invalid(format!(
                "cannot reserve {count} inode numbers (1 to {MAX_RESERVE})"
            )));
        }
        if self.end - self.next < u64::from(count) {
            return Err(MetaError::NoInodes);
        }
        let start = self.next;
        self.next += u64::from(count);
        Ok(Reply::Reserved {
            start,
            end: self.next,
        })
    }

    fn link_inode(&mut self, now: u64, ino: Ino) -> Result<Reply, MetaError> {
        let rdev = self.rdev(ino.0);
        let (i, node) = self.live_mut(ino)?;
        if node.kind == FileType::Dir {
            return Err(MetaError::IsDir);
        }
        if node.nlink >= MAX_LINKS {
            return Err(MetaError::TooManyLinks);
        }
        node.nlink += 1;
        node.ctime = node.ctime.max(now);
        Ok(Reply::Attr(node.attr(i, rdev)))
    }

    fn unlink_inode(&mut self, now: u64, ino: Ino) -> Result<Reply, MetaError> {
        let (i, node) = self.live(ino)?;
        if node.kind == FileType::Dir && self.has_children(i) {
            return Err(MetaError::NotEmpty);
        }
        let rdev = self.rdev(i);
        let (_, node) = self.live_mut(ino)?;
        node.nlink = match node.kind {
            FileType::Dir => 0,
            _ => node.nlink - 1,
        };
        node.ctime = node.ctime.max(now);
        let attr = node.attr(i, rdev);
        if attr.nlink == 0 {
            self.orphans.insert(i);
            // A deleted directory has no entries left to delegate.
            self.drop_delegation(i);
        }
        Ok(Reply::Attr(attr))
    }

    fn evict_inode(&mut self, ino: Ino) -> Result<Reply, MetaError> {
        let i = self.owned(ino)?;
        let node = self.inodes.get(i).ok_or(MetaError::NotFound)?;
        if node.nlink > 0 {
            return Err(MetaError::Invalid(format!("{ino} still has links")));
        }
        let Some(node) = self.inodes.remove(i) else {
            return Err(MetaError::NotFound);
        };
        self.orphans.remove(&i);
        self.rdevs.remove(&i);
        if let Some(t) = self.targets.remove(&i) {
            self.heap -= t.len() as u64;
        }
        let names: Vec<Box<[u8]>> = owned_by(&self.xattrs, i, None)
            .map(|(name, _)| Key::raw(i, name).to_box())
            .collect();
        for key in names {
            if let Some(value) = self.xattrs.remove(&key) {
                self.heap -= (key.len() + value.len()) as u64;
            }
        }
        self.heap -= node.extents.len() as u64 * EXTENT_BYTES;
        let freed = unreferenced(node.extents.into_vec(), &[]);
        self.to_free.extend(freed.iter().copied());
        Ok(Reply::Freed(freed))
    }

    /// `Command::Remove`: the dentry, and the link when the inode is local.
    fn remove(
        &mut self,
        now: u64,
        parent: Ino,
        name: &[u8],
        dir: bool,
    ) -> Result<Reply, MetaError> {
        let p = self.owned(parent)?;
        let key = Key::dentry(p, name)?;
        self.live_dir(p)?;
        let d: Dentry = (*self
            .dentries
            .get(key.as_slice())
            .ok_or(MetaError::NotFound)?)
        .into();
        match (dir, d.kind == FileType::Dir) {
            (true, false) => return Err(MetaError::NotDir),
            (false, true) => return Err(MetaError::IsDir),
            _ => {}
        }
        let local = self.owns(d.ino) && self.live(d.ino).is_ok();
        if dir && !local {
            return Err(MetaError::WrongPartition(d.ino));
        }
        if dir && self.has_children(d.ino.0) {
            return Err(MetaError::NotEmpty);
        }
        self.delete_dentry(now, parent, name, Some(d.ino))?;
        let attr = if local {
            let a = match self.unlink_inode(now, d.ino)? {
                Reply::Attr(a) => a,
                other => return Ok(other),
            };
            if a.nlink == 0 {
                self.evict_inode(d.ino)?;
            }
            Some(a)
        } else {
            None
        };
        Ok(Reply::Removed {
            dentry: d,
            attr,
            parent: self.dir_attr(p)?,
        })
    }

    /// `Command::CreateDentry`: the parent's attributes after the change.
    fn create_dentry(
        &mut self,
        now: u64,
        parent: Ino,
        name: &[u8],
        d: Dentry,
    ) -> Result<Attr, MetaError> {
        let p = self.owned(parent)?;
        let key = Key::dentry(p, name)?;
        let dir = self.live_dir(p)?;
        if self.dentries.contains_key(key.as_slice()) {
            return Err(MetaError::Exists);
        }
        self.check_target(d)?;
        let subdir = d.kind == FileType::Dir;
        if subdir && dir.nlink >= MAX_LINKS {
            return Err(MetaError::TooManyLinks);
        }
        self.heap += key.len as u64;
        self.dentries.insert(key.to_box(), d.into());
        self.touch_dir(now, p, i32::from(subdir));
        self.dir_attr(p)
    }

    fn delete_dentry(
        &mut self,
        now: u64,
        parent: Ino,
        name: &[u8],
        expect: Option<Ino>,
    ) -> Result<Reply, MetaError> {
        let p = self.owned(parent)?;
        let key = Key::dentry(p, name)?;
        self.live_dir(p)?;
        let d = *self
            .dentries
            .get(key.as_slice())
            .ok_or(MetaError::NotFound)?;
        if expect.is_some_and(|e| e != d.ino()) {
            return Err(MetaError::NotFound);
        }
        self.dentries.remove(key.as_slice());
        self.heap -= key.len as u64;
        self.touch_dir(now, p, -i32::from(d.kind() == FileType::Dir));
        Ok(Reply::Dentry(d.into()))
    }

    fn update_dentry(
        &mut self,
        now: u64,
        parent: Ino,
        name: &[u8],
        d: Dentry,
    ) -> Result<Reply, MetaError> {
        let p = self.owned(parent)?;
        let key = Key::dentry(p, name)?;
        self.live_dir(p)?;
        let old = *self
            .dentries
            .get(key.as_slice())
            .ok_or(MetaError::NotFound)?;
        if Dentry::from(old) == d {
            // Already so (a retried command): nothing to do.
            return Ok(Reply::Dentry(d));
        }
        self.check_target(d)?;
        self.check_replace(d.kind, old)?;
        if let Some(slot) = self.dentries.get_mut(key.as_slice()) {
            *slot = d.into();
        }
        self.touch_dir(now, p, 0);
        Ok(Reply::Dentry(old.into()))
    }

    fn rename(
        &mut self,
        now: u64,
        src: (Ino, &[u8]),
        dst: (Ino, &[u8]),
    ) -> Result<Reply, MetaError> {
        let sp = self.owned(src.0)?;
        let dp = self.owned(dst.0)?;
        let src_key = Key::dentry(sp, src.1)?;
        let dst_key = Key::dentry(dp, dst.1)?;
        self.live_dir(sp)?;
        let dst_dir_nlink = self.live_dir(dp)?.nlink;
        let moved = *self
            .dentries
            .get(src_key.as_slice())
            .ok_or(MetaError::NotFound)?;
        if src_key.as_slice() == dst_key.as_slice() {
            return self.renamed(None, sp, dp);
        }
        let replaced = self.dentries.get(dst_key.as_slice()).copied();
        if let Some(r) = replaced {
            if r.ino() == moved.ino() {
                // Two names of one inode: POSIX says rename does nothing.
                return self.renamed(None, sp, dp);
            }
            self.check_replace(moved.kind(), r)?;
        }
        let is_dir = |d: Option<DentryVal>| i32::from(d.is_some_and(|d| d.kind() == FileType::Dir));
        let moved_dir = is_dir(Some(moved));
        if moved_dir == 1 && sp != dp {
            if self.is_ancestor(moved.ino, dp) {
                return Err(MetaError::Invalid(
                    "cannot move a directory into itself or its subtree".into(),
                ));
            }
            if replaced.is_none() && dst_dir_nlink >= MAX_LINKS {
                return Err(MetaError::TooManyLinks);
            }
        }
        self.dentries.remove(src_key.as_slice());
        self.heap -= src_key.len as u64;
        match self.dentries.get_mut(dst_key.as_slice()) {
            Some(slot) => *slot = moved,
            None => {
                self.heap += dst_key.len as u64;
                self.dentries.insert(dst_key.to_box(), moved);
            }
        }
        if sp == dp {
            // One change of one directory: one stamp (see `touch_dir`).
            self.touch_dir(now, sp, -is_dir(replaced));
        } else {
            self.touch_dir(now, sp, -moved_dir);
            self.touch_dir(now, dp, moved_dir - is_dir(replaced));
        }
        if let Some(node) = self.local_mut(moved.ino()) {
            node.ctime = node.ctime.max(now);
            if moved_dir == 1 {
                node.parent = dp;
            }
        }
        self.renamed(replaced.map(Dentry::from), sp, dp)
    }

    /// `Rename`'s reply: the replaced dentry and the parents' attributes as they are now.
    fn renamed(&self, replaced: Option<Dentry>, sp: u64, dp: u64) -> Result<Reply, MetaError> {
        let mut parents = vec![self.dir_attr(sp)?];
        if dp != sp {
            parents.push(self.dir_attr(dp)?);
        }
        Ok(Reply::Renamed { replaced, parents })
    }

    fn set_attr(
        &mut self,
        now: u64,
        ino: Ino,
        set: &SetAttr,
        kill_suidgid: bool,
    ) -> Result<Reply, MetaError> {
        let rdev = self.rdev(ino.0);
        let (i, node) = self.live_mut(ino)?;
        if set.size.is_some() {
            match node.kind {
                FileType::File => {}
                FileType::Dir => return Err(MetaError::IsDir),
                _ => return Err(MetaError::Invalid("size of a non-regular file".into())),
            }
        }
        let old_keys = node.extents.len() as u64;
        let mut freed = Vec::new();
        if let Some(size) = set.size {
            if node.extents.last().is_some_and(|k| k.end() > size) {
                let (kept, dropped) = truncate(&node.extents, size);
                freed = unreferenced(dropped, &kept);
                node.extents = kept.into_boxed_slice();
            }
            node.size = size;
            node.mtime = now;
        }
        if let Some(mode) = set.mode {
            node.mode = (mode & MODE_MASK) as u16;
        }
        if kill_suidgid && node.kind != FileType::Dir {
            node.mode = without_suidgid(u32::from(node.mode)) as u16;
        }
        node.uid = set.uid.unwrap_or(node.uid);
        node.gid = set.gid.unwrap_or(node.gid);
        node.atime = set.atime.unwrap_or(node.atime);
        node.mtime = set.mtime.unwrap_or(node.mtime);
        node.ctime = node.ctime.max(now);
        let (attr, new_keys) = (node.attr(i, rdev), node.extents.len() as u64);
        self.heap = self.heap - old_keys * EXTENT_BYTES + new_keys * EXTENT_BYTES;
        self.to_free.extend(freed);
        Ok(Reply::Attr(attr))
    }

    fn append_extents(
        &mut self,
        now: u64,
        ino: Ino,
        extents: &[ExtentKey],
    ) -> Result<Reply, MetaError> {
        let rdev = self.rdev(ino.0);
        let (i, node) = self.live_mut(ino)?;
        match node.kind {
            FileType::File => {}
            FileType::Dir => return Err(MetaError::IsDir),
            _ => return Err(MetaError::Invalid("extents of a non-regular file".into())),
        }
        if let Some(bad) = extents.iter().find(|k| !key_is_valid(k)) {
            return Err(MetaError::Invalid(format!("bad extent key {bad:?}")));
        }
        let old_keys = node.extents.len() as u64;
        let mut keys = std::mem::take(&mut node.extents).into_vec();
        let mut dropped = Vec::new();
        for key in extents {
            overlay(&mut keys, *key, &mut dropped);
        }
        let freed = unreferenced(dropped, &keys);
        node.size = node.size.max(keys.last().map_or(0, ExtentKey::end));
        node.extents = keys.into_boxed_slice();
        node.mtime = now;
        node.ctime = node.ctime.max(now);
        let (attr, new_keys) = (node.attr(i, rdev), node.extents.len() as u64);
        self.heap = self.heap - old_keys * EXTENT_BYTES + new_keys * EXTENT_BYTES;
        self.to_free.extend(freed);
        Ok(Reply::Attr(attr))
    }

    fn set_xattr(
        &mut self,
        now: u64,
        ino: Ino,
        name: &[u8],
        value: &[u8],
        mode: XattrMode,
    ) -> Result<Reply, MetaError> {
        let (i, _) = self.live(ino)?;
        let key = Key::xattr(i, name)?;
        if value.len() > MAX_XATTR_VALUE {
            return Err(MetaError::Invalid(format!(
                "xattr value of {} bytes (at most {MAX_XATTR_VALUE})",
                value.len()
            )));
        }
        let old = self.xattrs.get(key.as_slice()).map(|v| v.len());
        match (mode, old) {
            (XattrMode::Create, Some(_)) => return Err(MetaError::Exists),
            (XattrMode::Replace, None) => return Err(MetaError::NoXattr),
            _ => {}
        }
        self.heap -= old.map_or(0, |v| (key.len + v) as u64);
        self.heap += (key.len + value.len()) as u64;
        self.xattrs.insert(key.to_box(), value.into());
        if let Some(node) = self.local_mut(Ino(i)) {
            node.ctime = node.ctime.max(now);
        }
        Ok(Reply::Done)
    }

    fn remove_xattr(&mut self, now: u64, ino: Ino, name: &[u8]) -> Result<Reply, MetaError> {
        let (i, _) = self.live(ino)?;
        let key = Key::xattr(i, name)?;
        let value = self
            .xattrs
            .remove(key.as_slice())
            .ok_or(MetaError::NoXattr)?;
        self.heap -= (key.len + value.len()) as u64;
        if let Some(node) = self.local_mut(Ino(i)) {
            node.ctime = node.ctime.max(now);
        }
        Ok(Reply::Done)
    }

    fn ack_freed(&mut self, count: u64, first: Option<&ExtentKey>) -> Result<Reply, MetaError> {
        if first.is_some() && self.to_free.front() != first {
            return Ok(Reply::Done);
        }
        let n = usize::try_from(count)
            .ok()
            .filter(|&n| n <= self.to_free.len())
            .ok_or_else(|| {
                MetaError::Invalid(format!(
                    "cannot ack {count} freed extents, {} are listed",
                    self.to_free.len()
                ))
            })?;
        self.to_free.drain(..n);
        if self.to_free.len() * 4 < self.to_free.capacity() {
            self.to_free.shrink_to_fit();
        }
        Ok(Reply::Done)
    }

    fn set_end(&mut self, end: u64) -> Result<Reply, MetaError> {
        if end < self.next || end < self.start {
            return Err(MetaError::Invalid(format!(
                "cannot end the range at {end}: inodes up to {} are allocated",
                self.max_inode()
            )));
        }
        if end > self.end {
            return Err(MetaError::Invalid(format!(
                "cannot widen the range from {} to {end}",
                self.end
            )));
        }
        self.end = end;
        Ok(Reply::Done)
    }

    // --- Delegations and sessions ----------------------------------------------------------

    /// `dir`'s delegation if it is `client`'s, has not ended and was not recalled: one the
    /// client may rely on, and that its changes renew.
    fn held(&self, now: u64, client: u64, dir: Ino) -> Option<Delegation> {
        self.delegations
            .get(&dir.0)
            .filter(|d| d.live(now) && d.holder == client && !d.recalled)
            .copied()
    }

    /// `Delegated(dir)` if `cmd` would change the entries of `dir`, remove it or set its
    /// attributes, while it is delegated to another client than `client`.
    fn check_delegations(&self, now: u64, client: u64, cmd: &Command) -> Result<(), MetaError> {
        if self.delegations.is_empty() {
            // The common case costs no lookups.
            return Ok(());
        }
        for dir in cmd
            .entry_dirs()
            .chain(self.removed_dir(cmd))
            .chain(cmd.attr_target())
        {
            if self
                .delegations
                .get(&dir.0)
                .is_some_and(|d| d.live(now) && d.holder != client)
            {
                return Err(MetaError::Delegated(dir));
            }
        }
        Ok(())
    }

    /// The local directory `cmd` would remove (or replace) if it succeeded, which its holder
    /// alone may do: the directory of a `Remove` with `dir`, the destination directory a
    /// `Rename` would replace, the inode of an `UnlinkInode` (only directories are delegated).
    fn removed_dir(&self, cmd: &Command) -> Option<Ino> {
        let dentry = |parent: Ino, name: &[u8]| {
            let key = Key::dentry(self.owned(parent).ok()?, name).ok()?;
            self.dentries.get(key.as_slice()).copied()
        };
        let dir = |d: DentryVal| (d.kind() == FileType::Dir).then_some(d.ino());
        match cmd {
            Command::Remove {
                parent,
                name,
                dir: true,
            } => dentry(*parent, name).and_then(dir),
            Command::Rename {
                src_parent,
                src_name,
                dst_parent,
                dst_name,
            } => {
                let moved = dentry(*src_parent, src_name)?;
                // Onto another name of the same inode (or itself), a rename changes nothing.
                dentry(*dst_parent, dst_name)
                    .filter(|r| r.ino() != moved.ino())
                    .and_then(dir)
            }
            Command::UnlinkInode { ino } => Some(*ino),
            _ => None,
        }
    }

    /// Records `d` as `dir`'s delegation, replacing any other.
    fn set_delegation(&mut self, dir: u64, d: Delegation) {
        if let Some(old) = self.delegations.insert(dir, d) {
            self.delegation_ends.remove(&(old.until, dir));
        }
        self.delegation_ends.insert((d.until, dir));
    }

    fn drop_delegation(&mut self, dir: u64) {
        if let Some(old) = self.delegations.remove(&dir) {
            self.delegation_ends.remove(&(old.until, dir));
        }
    }

    /// Forgets the delegations and sessions that ended by `now`, from the front of their time
    /// indexes: each is forgotten once, so this costs O(log n) per command, amortized.
    fn expire(&mut self, now: u64) {
        while let Some(&(until, dir)) = self.delegation_ends.first()
            && until <= now
        {
            self.delegation_ends.pop_first();
            self.delegations.remove(&dir);
        }
        while let Some(&(at, client)) = self.session_times.first()
            && !session_live(at, now)
        {
            self.session_times.pop_first();
            self.sessions.remove(&client);
        }
    }

    /// `ino` as `CreateAt` may use it: handed out before (by `Reserve`, or as any number below
    /// `next`) and not an inode now.
    fn reserved(&self, ino: Ino) -> Result<u64, MetaError> {
        if self.owns(ino) && ino.0 >= 1 && ino.0 < self.next && self.inodes.get(ino.0).is_none() {
            Ok(ino.0)
        } else {
            Err(MetaError::Invalid(format!(
                "{ino} is not a reserved inode number free in [{}, {})",
                self.start, self.next
            )))
        }
    }

    // --- Helpers ----------------------------------------------------------------------------

    fn owned(&self, ino: Ino) -> Result<u64, MetaError> {
        if self.owns(ino) {
            Ok(ino.0)
        } else {
            Err(MetaError::WrongPartition(ino))
        }
    }

    /// A live (not deleted) inode of this partition.
    fn live(&self, ino: Ino) -> Result<(u64, &Inode), MetaError> {
        let i = self.owned(ino)?;
        match self.inodes.get(i) {
            Some(node) if node.nlink > 0 => Ok((i, node)),
            _ => Err(MetaError::NotFound),
        }
    }

    fn live_mut(&mut self, ino: Ino) -> Result<(u64, &mut Inode), MetaError> {
        let i = self.owned(ino)?;
        match self.inodes.get_mut(i) {
            Some(node) if node.nlink > 0 => Ok((i, node)),
            _ => Err(MetaError::NotFound),
        }
    }

    fn live_dir(&self, i: u64) -> Result<&Inode, MetaError> {
        let (_, node) = self.live(Ino(i))?;
        if node.kind == FileType::Dir {
            Ok(node)
        } else {
            Err(MetaError::NotDir)
        }
    }

    /// The inode if it lives here (deleted or not).
    fn local_mut(&mut self, ino: Ino) -> Option<&mut Inode> {
        if self.owns(ino) {
            self.inodes.get_mut(ino.0)
        } else {
            None
        }
    }

    /// A dentry may only point to a local inode that is live and of the dentry's kind (inodes of
    /// other partitions are the client's to check).
    fn check_target(&self, d: Dentry) -> Result<(), MetaError> {
        if !self.owns(d.ino) {
            return Ok(());
        }
        match self.inodes.get(d.ino.0) {
            Some(node) if node.nlink > 0 && node.kind == d.kind => Ok(()),
            Some(node) if node.nlink > 0 => Err(MetaError::Invalid(format!(
                "{} is a {:?}, not a {:?}",
                d.ino, node.kind, d.kind
            ))),
            _ => Err(MetaError::NotFound),
        }
    }

    /// Whether a dentry of `kind` may replace `old`: a directory only an empty directory, a
    /// non-directory only a non-directory.
    fn check_replace(&self, kind: FileType, old: DentryVal) -> Result<(), MetaError> {
        match (kind == FileType::Dir, old.kind() == FileType::Dir) {
            (false, true) => Err(MetaError::IsDir),
            (true, false) => Err(MetaError::NotDir),
            (true, true) if self.has_children(old.ino) => Err(MetaError::NotEmpty),
            _ => Ok(()),
        }
    }

    /// Whether directory `dir` has dentries here.
    fn has_children(&self, dir: u64) -> bool {
        owned_by(&self.dentries, dir, None).next().is_some()
    }

    /// Whether `dir` is `x` or one of its ancestors, following `parent` pointers while they stay
    /// in this partition (bounded by the number of inodes, in case of a loop).
    fn is_ancestor(&self, dir: u64, mut x: u64) -> bool {
        for _ in 0..=self.inodes.len() {
            if x == dir {
                return true;
            }
            match self.inodes.get(x) {
                Some(node) if node.parent != x => x = node.parent,
                _ => return false,
            }
        }
        false
    }

    /// Stamps a directory's mtime and ctime after a dentry change and adjusts its nlink by the
    /// change in its subdirectories (validated by the caller).
    ///
    /// The stamp is `now`, or one past the directory's ctime when that is not earlier: every
    /// change of a directory's entries moves its ctime forward, and no other change moves it back
    /// (ctime never decreases). So a client that knows the directory's entries as of ctime `v` and
    /// learns that its own change found ctime `v` (`Reply::Created::parent_was`) knows that no
    /// other change came in between.
    fn touch_dir(&mut self, now: u64, dir: u64, subdirs: i32) {
        if let Some(node) = self.inodes.get_mut(dir) {
            node.nlink = node.nlink.saturating_add_signed(subdirs);
            let t = crate::ops::dir_changed_at(node.ctime, now);
            node.mtime = t;
            node.ctime = t;
        }
    }

    fn attr(&self, ino: u64, node: &Inode) -> Attr {
        node.attr(ino, self.rdev(ino))
    }

    /// The attributes of live directory `i` (a parent, after a change of its entries).
    fn dir_attr(&self, i: u64) -> Result<Attr, MetaError> {
        Ok(self.attr(i, self.live_dir(i)?))
    }

    fn rdev(&self, ino: u64) -> u32 {
        self.rdevs.get(&ino).copied().unwrap_or(0)
    }

    /// Entries of live directory `parent` after `after`, at most `limit` (0: all).
    fn read_dir(
        &self,
        parent: Ino,
        after: Option<&[u8]>,
        limit: u32,
    ) -> Result<impl Iterator<Item = (DirEntry, DentryVal)> + '_, MetaError> {
        let p = self.owned(parent)?;
        self.live_dir(p)?;
        Ok(owned_by(&self.dentries, p, after)
            .take(take_limit(limit))
            .map(|(name, d)| {
                let entry = DirEntry {
                    name: name.to_vec(),
                    ino: d.ino(),
                    kind: d.kind(),
                };
                (entry, *d)
            }))
    }

    /// Recounts what `heap` tracks.
    fn count_heap(&self) -> u64 {
        let dentries: usize = self.dentries.keys().map(|k| k.len()).sum();
        let targets: usize = self.targets.values().map(|t| t.len()).sum();
        let xattrs: usize = self.xattrs.iter().map(|(k, v)| k.len() + v.len()).sum();
        let extents: usize = self.inodes.iter().map(|(_, n)| n.extents.len()).sum();
        (dentries + targets + xattrs) as u64 + extents as u64 * EXTENT_BYTES
    }
}

/// Whether `cmd` wraps commands (which only the top level may).
fn nests(cmd: &Command) -> bool {
    matches!(cmd, Command::As { .. } | Command::Batch { .. })
}

/// Whether `index` lists exactly `entries` (distinct ones).
fn indexes(
    index: &BTreeSet<(u64, u64)>,
    mut entries: impl ExactSizeIterator<Item = (u64, u64)>,
) -> bool {
    entries.len() == index.len() && entries.all(|e| index.contains(&e))
}

/// `limit` as a count to take, 0 meaning all.
fn take_limit(limit: u32) -> usize {
    match limit {
        0 => usize::MAX,
        n => n as usize,
    }
}

/// Approximate heap bytes of a `BTreeMap` with `len` entries of `key` + `val` bytes. std's nodes
/// hold up to 11 entries (plus a 16-byte header, and 12 child pointers in internal nodes); nodes
/// filled in key order keep 6 or 7 of them (random order: about 7.5), so this counts one node of
/// 11 slots, plus 16 bytes for the internal nodes' share, per 6 entries. Measured with a counting
/// allocator it is within 10 % (sequential keys) to 30 % high (random keys).
fn btree_bytes(len: usize, key: usize, val: usize) -> u64 {
    (len as u64 * (32 + 11 * (key + val) as u64)).div_ceil(6)
}

// --- Keys ----------------------------------------------------------------------------------------

/// Longest dentry or xattr key: an 8-byte owner, then a name.
const KEY_MAX: usize = 8 + if MAX_NAME > MAX_XATTR_NAME {
    MAX_NAME
} else {
    MAX_XATTR_NAME
};

/// A dentry or xattr key built on the stack, for lookups without allocating: the owner inode's
/// number (big-endian, so that keys sort by owner, then by name bytes), then the name.
struct Key {
    len: usize,
    buf: [u8; KEY_MAX],
}

impl Key {
    /// The key of dentry `name` under `parent` (`NameTooLong`/`InvalidName` as `check_name`).
    fn dentry(parent: u64, name: &[u8]) -> Result<Self, MetaError> {
        check_name(name)?;
        Ok(Self::raw(parent, name))
    }

    /// The key of xattr `name` of inode `ino`.
    fn xattr(ino: u64, name: &[u8]) -> Result<Self, MetaError> {
        check_xattr_name(name)?;
        Ok(Self::raw(ino, name))
    }

    /// Names are checked by the constructors above; a longer one would be cut, never overflow.
    fn raw(owner: u64, name: &[u8]) -> Self {
        let name = &name[..name.len().min(KEY_MAX - 8)];
        let mut buf = [0; KEY_MAX];
        buf[..8].copy_from_slice(&owner.to_be_bytes());
        buf[8..8 + name.len()].copy_from_slice(name);
        Self {
            len: 8 + name.len(),
            buf,
        }
    }

    fn as_slice(&self) -> &[u8] {
        &self.buf[..self.len]
    }

    fn to_box(&self) -> Box<[u8]> {
        self.as_slice().into()
    }
}

/// The owner and the name of a stored key (keys shorter than 8 bytes never get stored; they would
/// read as owner 0).
fn split_key(key: &[u8]) -> (u64, &[u8]) {
    match key.split_first_chunk::<8>() {
        Some((owner, name)) => (u64::from_be_bytes(*owner), name),
        None => (0, key),
    }
}

/// Names and values of the entries of `map` owned by `owner`, in name order, strictly after
/// `after` (from the first when `None`).
fn owned_by<'a, V>(
    map: &'a BTreeMap<Box<[u8]>, V>,
    owner: u64,
    after: Option<&[u8]>,
) -> impl Iterator<Item = (&'a [u8], &'a V)> + 'a {
    let mut start = owner.to_be_bytes().to_vec();
    let lower = match after {
        Some(name) => {
            start.extend_from_slice(name);
            Bound::Excluded(start)
        }
        None => Bound::Included(start),
    };
    map.range::<[u8], _>((lower.as_ref().map(Vec::as_slice), Bound::Unbounded))
        .map(|(k, v)| (split_key(k), v))
        .take_while(move |((o, _), _)| *o == owner)
        .map(|((_, name), v)| (name, v))
}

/// Xattr names: 1..=`MAX_XATTR_NAME` bytes without NUL.
fn check_xattr_name(name: &[u8]) -> Result<(), MetaError> {
    if name.len() > MAX_XATTR_NAME {
        return Err(MetaError::NameTooLong);
    }
    if name.is_empty() || name.contains(&0) {
        return Err(MetaError::InvalidName);
    }
    Ok(())
}

// --- Inodes --------------------------------------------------------------------------------------

/// An inode without its number (the table's key), its symlink target and its device number (side
/// maps): 72 bytes.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
struct Inode {
    size: u64,
    atime: u64,
    mtime: u64,
    ctime: u64,
    /// The directory the inode was created in, or moved to (`..` for a directory).
    parent: u64,
    /// Sorted by file offset, non-overlapping; empty but for files.
    extents: Box<[ExtentKey]>,
    uid: u32,
    gid: u32,
    /// 0 once deleted.
    nlink: u32,
    /// Permission bits only (`MODE_MASK`).
    mode: u16,
    kind: FileType,
}

impl Inode {
    /// The attributes of this inode as number `ino` with device number `rdev`. Numbers are never
    /// reused, so the generation is always 0.
    fn attr(&self, ino: u64, rdev: u32) -> Attr {
        Attr {
            ino: Ino(ino),
            kind: self.kind,
            mode: u32::from(self.mode),
            uid: self.uid,
            gid: self.gid,
            size: self.size,
            nlink: self.nlink,
            rdev,
            atime: self.atime,
            mtime: self.mtime,
            ctime: self.ctime,
            generation: 0,
        }
    }

    fn new(kind: FileType, mode: u32, uid: u32, gid: u32, parent: u64, now: u64) -> Self {
        Self {
            size: 0,
            atime: now,
            mtime: now,
            ctime: now,
            parent,
            extents: Box::default(),
            uid,
            gid,
            nlink: if kind == FileType::Dir { 2 } else { 1 },
            mode: (mode & MODE_MASK) as u16,
            kind,
        }
    }
}

// The per-file memory budget rests on these sizes.
const _: () = assert!(size_of::<Inode>() <= 72);
const _: () = assert!(size_of::<DentryVal>() == 9);

/// Bits of an inode number that pick its slot in a chunk.
const CHUNK_BITS: u32 = 6;

/// Inodes by number, in chunks of 64 consecutive numbers. Numbers are handed out in order, so a
/// chunk fills by pushes; deletions leave it sparse (a chunk holds only its present inodes, so a
/// sparse chunk costs little) and an empty chunk goes away.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct InodeTable {
    /// `ino >> CHUNK_BITS` → chunk.
    chunks: BTreeMap<u64, Chunk>,
    len: usize,
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct Chunk {
    /// Bit `b` set: inode `(chunk << CHUNK_BITS) | b` is present.
    present: u64,
    /// The present inodes, in number order.
    inodes: Vec<Inode>,
}

impl Chunk {
    /// Where slot `bit`'s inode is (or would go) in `inodes`.
    fn index(&self, bit: u32) -> usize {
        (self.present & ((1u64 << bit) - 1)).count_ones() as usize
    }

    fn has(&self, bit: u32) -> bool {
        self.present & (1u64 << bit) != 0
    }
}

fn chunk_of(ino: u64) -> (u64, u32) {
    (ino >> CHUNK_BITS, (ino & ((1 << CHUNK_BITS) - 1)) as u32)
}

impl InodeTable {
    fn len(&self) -> usize {
        self.len
    }

    fn get(&self, ino: u64) -> Option<&Inode> {
        let (c, bit) = chunk_of(ino);
        let chunk = self.chunks.get(&c)?;
        if chunk.has(bit) {
            chunk.inodes.get(chunk.index(bit))
        } else {
            None
        }
    }

    fn get_mut(&mut self, ino: u64) -> Option<&mut Inode> {
        let (c, bit) = chunk_of(ino);
        let chunk = self.chunks.get_mut(&c)?;
        if chunk.has(bit) {
            let i = chunk.index(bit);
            chunk.inodes.get_mut(i)
        } else {
            None
        }
    }

    /// Adds inode `ino`, which is not present (numbers are handed out once).
    fn insert(&mut self, ino: u64, node: Inode) {
        let (c, bit) = chunk_of(ino);
        let chunk = self.chunks.entry(c).or_default();
        if !chunk.has(bit) {
            let i = chunk.index(bit);
            chunk.inodes.insert(i, node);
            chunk.present |= 1 << bit;
            self.len += 1;
        }
    }

    fn remove(&mut self, ino: u64) -> Option<Inode> {
        let (c, bit) = chunk_of(ino);
        let chunk = self.chunks.get_mut(&c)?;
        let i = chunk.index(bit);
        if !chunk.has(bit) || i >= chunk.inodes.len() {
            return None;
        }
        let node = chunk.inodes.remove(i);
        chunk.present &= !(1 << bit);
        self.len -= 1;
        if chunk.present == 0 {
            self.chunks.remove(&c);
        } else if chunk.inodes.len() * 2 <= chunk.inodes.capacity() {
            chunk.inodes.shrink_to_fit();
        }
        Some(node)
    }

    /// Inodes in number order.
    fn iter(&self) -> impl Iterator<Item = (u64, &Inode)> + '_ {
        self.chunks.iter().flat_map(|(&c, chunk)| {
            Bits(chunk.present)
                .zip(&chunk.inodes)
                .map(move |(bit, node)| ((c << CHUNK_BITS) | u64::from(bit), node))
        })
    }

    /// Heap bytes: the chunk map and the chunks' vectors (not the extent keys).
    fn heap_bytes(&self) -> u64 {
        let slots: usize = self.chunks.values().map(|c| c.inodes.capacity()).sum();
        btree_bytes(self.chunks.len(), size_of::<u64>(), size_of::<Chunk>())
            + (slots * size_of::<Inode>()) as u64
    }

    fn verify(&self) -> Result<(), MetaError> {
        let mut len = 0;
        for (c, chunk) in &self.chunks {
            if chunk.present == 0 || chunk.present.count_ones() as usize != chunk.inodes.len() {
                return Err(MetaError::Invalid(format!(
                    "broken invariant: inode chunk {c} holds {} inodes, bitmap {:#x}",
                    chunk.inodes.len(),
                    chunk.present
                )));
            }
            len += chunk.inodes.len();
        }
        if len != self.len {
            return Err(MetaError::Invalid(format!(
                "broken invariant: {len} inodes counted as {}",
                self.len
            )));
        }
        Ok(())
    }
}

/// The set bits of a word, lowest first.
struct Bits(u64);

impl Iterator for Bits {
    type Item = u32;

    fn next(&mut self) -> Option<u32> {
        if self.0 == 0 {
            return None;
        }
        let bit = self.0.trailing_zeros();
        self.0 &= self.0 - 1;
        Some(bit)
    }
}

/// Serialized as a sequence of `(ino, inode)` in number order, independent of the chunking.
impl Serialize for InodeTable {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut seq = s.serialize_seq(Some(self.len))?;
        for entry in self.iter() {
            seq.serialize_element(&entry)?;
        }
        seq.end()
    }
}

impl<'de> Deserialize<'de> for InodeTable {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct TableVisitor;

        impl<'de> Visitor<'de> for TableVisitor {
            type Value = InodeTable;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a sequence of (ino, inode) in increasing ino order")
            }

            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<InodeTable, A::Error> {
                let mut table = InodeTable::default();
                let mut last = None;
                while let Some((ino, node)) = seq.next_element::<(u64, Inode)>()? {
                    if last.is_some_and(|l| ino <= l) {
                        return Err(serde::de::Error::custom("inodes out of order"));
                    }
                    last = Some(ino);
                    table.insert(ino, node);
                }
                Ok(table)
            }
        }

        d.deserialize_seq(TableVisitor)
    }
}

// --- Dentries ------------------------------------------------------------------------------------

/// What a dentry points to, packed into 9 bytes (B-tree nodes hold 11 of these side by side).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(from = "Dentry", into = "Dentry")]
#[repr(C, packed)]
struct DentryVal {
    ino: u64,
    kind: FileType,
}

impl DentryVal {
    fn ino(self) -> Ino {
        Ino(self.ino)
    }

    fn kind(self) -> FileType {
        self.kind
    }
}

impl From<Dentry> for DentryVal {
    fn from(d: Dentry) -> Self {
        Self {
            ino: d.ino.0,
            kind: d.kind,
        }
    }
}

impl From<DentryVal> for Dentry {
    fn from(d: DentryVal) -> Self {
        Self {
            ino: d.ino(),
            kind: d.kind(),
        }
    }
}

// --- Extent keys ---------------------------------------------------------------------------------

/// A key can be stored: it covers at least one byte, and neither its file range nor its extent
/// range overflows.
fn key_is_valid(k: &ExtentKey) -> bool {
    k.size > 0
        && k.file_offset.checked_add(u64::from(k.size)).is_some()
        && k.extent_offset.checked_add(u64::from(k.size)).is_some()
}

/// An inode's keys are valid, sorted, non-overlapping and within `size`.
fn check_extents(keys: &[ExtentKey], size: u64) -> Result<(), String> {
    let mut end = 0;
    for k in keys {
        if !key_is_valid(k) || k.file_offset < end {
            return Err(format!("extent key {k:?} invalid or out of order"));
        }
        end = k.end();
    }
    if end > size {
        return Err(format!("extent keys end at {end}, past the size {size}"));
    }
    Ok(())
}

/// `key` cut to the file range `[from, to)` within it; the CRC survives only an uncut key.
fn cut(key: &ExtentKey, from: u64, to: u64) -> ExtentKey {
    let whole = from == key.file_offset && to == key.end();
    ExtentKey {
        file_offset: from,
        extent_offset: key.extent_offset + (from - key.file_offset),
        // Within the key's own size.
        size: (to - from) as u32,
        crc: if whole { key.crc } else { 0 },
        ..*key
    }
}

/// Records `new` over `keys` (sorted, non-overlapping): parts of older keys outside its range stay
/// (trimmed), older keys entirely inside it go to `dropped`.
fn overlay(keys: &mut Vec<ExtentKey>, new: ExtentKey, dropped: &mut Vec<ExtentKey>) {
    let (start, end) = (new.file_offset, new.end());
    // Keys are sorted and disjoint, so their ends are sorted too: keys[first..last] overlap `new`.
    let first = keys.partition_point(|k| k.end() <= start);
    let last = keys.partition_point(|k| k.file_offset < end).max(first);
    let (mut left, mut right) = (None, None);
    for k in &keys[first..last] {
        if k.file_offset < start {
            left = Some(cut(k, k.file_offset, start));
        }
        if k.end() > end {
            right = Some(cut(k, end, k.end()));
        }
        if k.file_offset >= start && k.end() <= end {
            dropped.push(*k);
        }
    }
    keys.splice(first..last, left.into_iter().chain([new]).chain(right));
}

/// Splits `keys` at file offset `size`: the keys before it (the one straddling it trimmed) and the
/// keys past it.
fn truncate(keys: &[ExtentKey], size: u64) -> (Vec<ExtentKey>, Vec<ExtentKey>) {
    let at = keys.partition_point(|k| k.file_offset < size);
    let (kept, dropped) = keys.split_at(at);
    let mut kept = kept.to_vec();
    if let Some(k) = kept.last_mut()
        && k.end() > size
    {
        *k = cut(k, k.file_offset, size);
    }
    (kept, dropped.to_vec())
}

/// The parts of `dropped` keys whose bytes no key in `live` refers to any more: only those may be
/// freed. A client that extends a piece records a longer key over the same extent bytes, which
/// drops the shorter key; freeing it would destroy live data. A normal extent (id from
/// `FIRST_NORMAL_EXTENT`) no live key uses at all is freed whole, as one key with offset 0 and size `u32::MAX` (the data node deletes
/// it); the unused ranges of others are punched out. O((dropped + live) · log).
fn unreferenced(dropped: Vec<ExtentKey>, live: &[ExtentKey]) -> Vec<ExtentKey> {
    if dropped.is_empty() {
        return dropped;
    }
    let mut extents: Vec<_> = dropped.iter().map(|k| (k.partition, k.extent)).collect();
    extents.sort_unstable();
    extents.dedup();
    // The extent ranges live keys use in those extents, by extent and start...
    let mut used: Vec<_> = live
        .iter()
        .filter(|k| extents.binary_search(&(k.partition, k.extent)).is_ok())
        .map(|k| {
            let start = k.extent_offset;
            ((k.partition, k.extent), start, start + u64::from(k.size))
        })
        .collect();
    used.sort_unstable();
    // ...and the furthest end reached so far within each extent (non-decreasing per extent).
    let mut reach = Vec::with_capacity(used.len());
    let mut last = None;
    for &(extent, _, end) in &used {
        let r = match last {
            Some((e, r)) if e == extent => end.max(r),
            _ => end,
        };
        reach.push(r);
        last = Some((extent, r));
    }
    let mut out = Vec::with_capacity(dropped.len());
    let mut whole: Vec<(PartitionId, ExtentId)> = Vec::new();
    for d in &dropped {
        let (mut pos, end) = (d.extent_offset, d.extent_offset + u64::from(d.size));
        let extent = (d.partition, d.extent);
        let group = used.partition_point(|u| u.0 < extent);
        let group_end = used.partition_point(|u| u.0 <= extent);
        if group == group_end && d.extent.is_normal() {
            // No live key uses this normal extent any more: release all of it (the data node
            // deletes it), once.
            if !whole.contains(&extent) {
                whole.push(extent);
                out.push(ExtentKey {
                    file_offset: 0,
                    extent_offset: 0,
                    size: u32::MAX,
                    crc: 0,
                    ..*d
                });
            }
            continue;
        }
        // The ranges before `first` all end at or before `pos`.
        let first = group + reach[group..group_end].partition_point(|&r| r <= pos);
        for &(_, from, to) in &used[first..group_end] {
            if from >= end {
                break;
            }
            if from > pos {
                out.push(cut_extent(d, pos, from));
            }
            pos = pos.max(to);
        }
        if pos < end {
            out.push(cut_extent(d, pos, end));
        }
    }
    out
}

/// `key` cut to the extent range `[from, to)` within it.
fn cut_extent(key: &ExtentKey, from: u64, to: u64) -> ExtentKey {
    let offset = key.file_offset + (from - key.extent_offset);
    cut(key, offset, offset + (to - from))
}

// --- Delegations and sessions --------------------------------------------------------------

/// A directory delegated to a client (see `Command::As`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
struct Delegation {
    /// The client (never 0).
    holder: u64,
    /// When it ends (leader time, ns): it holds while `now < until`.
    until: u64,
    /// Another client asked for the directory (`Recall`): no longer renewed.
    recalled: bool,
}

impl Delegation {
    fn granted(holder: u64, now: u64) -> Self {
        Self {
            holder,
            until: now.saturating_add(DELEGATION_NS),
            recalled: false,
        }
    }

    /// Renewed at `now`. Never shortened, though after a leader change `now` may be behind the
    /// time that set `until`: a later end costs nothing (only the holder may change the
    /// directory meanwhile), and it leaves more room to leaders' clocks that disagree by more
    /// than the margin.
    fn renewed(self, now: u64) -> Self {
        Self {
            until: self.until.max(now.saturating_add(DELEGATION_NS)),
            ..self
        }
    }

    fn live(&self, now: u64) -> bool {
        now < self.until
    }
}

/// A client's last applied batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
struct Session {
    seq: u64,
    /// When it was applied (leader time, ns).
    at: u64,
}

impl Session {
    fn live(&self, now: u64) -> bool {
        session_live(self.at, now)
    }
}

/// Whether a session whose last batch was applied `at` is remembered at `now`.
fn session_live(at: u64, now: u64) -> bool {
    now < at.saturating_add(SESSION_NS)
}

// --- Snapshots -----------------------------------------------------------------------------------

/// Version 1 of the snapshot layout, which version 2 continues: [`MetaPartition`]'s serialized
/// fields up to `to_free`, in the same order, decoded before the invariants are checked.
#[derive(Deserialize)]
struct Trees {
    start: u64,
    end: u64,
    next: u64,
    inodes: InodeTable,
    dentries: BTreeMap<Box<[u8]>, DentryVal>,
    targets: BTreeMap<u64, Box<[u8]>>,
    rdevs: BTreeMap<u64, u32>,
    xattrs: BTreeMap<Box<[u8]>, Box<[u8]>>,
    orphans: BTreeSet<u64>,
    to_free: VecDeque<ExtentKey>,
}

/// A decoded snapshot (version 2) before its invariants are checked: all of [`MetaPartition`]'s
/// serialized fields. Postcard writes a nested struct as its fields, so this is version 1's
/// layout followed by the new fields.
#[derive(Deserialize)]
struct Image {
    trees: Trees,
    delegations: BTreeMap<u64, Delegation>,
    sessions: BTreeMap<u64, Session>,
}

/// A version 1 snapshot: no delegations, no sessions.
impl From<Trees> for Image {
    fn from(trees: Trees) -> Self {
        Self {
            trees,
            delegations: BTreeMap::new(),
            sessions: BTreeMap::new(),
        }
    }
}

impl TryFrom<Image> for MetaPartition {
    type Error = MetaError;

    fn try_from(image: Image) -> Result<Self, MetaError> {
        let Image {
            trees: i,
            delegations,
            sessions,
        } = image;
        let mut p = Self {
            start: i.start,
            end: i.end,
            next: i.next,
            inodes: i.inodes,
            dentries: i.dentries,
            targets: i.targets,
            rdevs: i.rdevs,
            xattrs: i.xattrs,
            orphans: i.orphans,
            to_free: i.to_free,
            delegation_ends: delegations.iter().map(|(&dir, d)| (d.until, dir)).collect(),
            session_times: sessions.iter().map(|(&c, s)| (s.at, c)).collect(),
            delegations,
            sessions,
            heap: 0,
        };
        p.heap = p.count_heap();
        p.verify()?;
        Ok(p)
    }
}

fn bad_snapshot(e: postcard::Error) -> MetaError {
    MetaError::Invalid(format!("bad snapshot: {e}"))
}

/// `T` from all of `bytes`.
fn decode<'a, T: Deserialize<'a>>(bytes: &'a [u8]) -> Result<T, MetaError> {
    let (t, rest) = postcard::take_from_bytes::<T>(bytes).map_err(bad_snapshot)?;
    if !rest.is_empty() {
        return Err(MetaError::Invalid(format!(
            "bad snapshot: {} trailing bytes",
            rest.len()
        )));
    }
    Ok(t)
}
