//! File system metadata over meta partitions: the CFS workflows (docs/design.md §6).
//!
//! An inode lives in the partition whose range holds its number; a dentry lives in the partition
//! that owns its parent. Operations touching two partitions are not atomic; they are ordered so that
//! **every dentry points to a live inode whose link count covers it** under any single failure:
//!
//! - create: inode first, then dentry. If the dentry fails, the inode is unlinked and evicted (or, if
//!   that fails too, kept on this client's orphan list and evicted later).
//! - link: nlink + 1, then the dentry; on failure nlink − 1.
//! - unlink: the dentry first, then nlink − 1; at 0 the inode is evicted.
//! - rmdir: the dentry first (after an emptiness check), then the directory inode; if it turned out
//!   not empty (a racing create), the dentry is put back.
//! - rename within a partition is one atomic command; across partitions a file is linked (nlink + 1),
//!   the new dentry created, the old one deleted, and the extra link dropped.
//!
//! Outcomes of a failed call are of two kinds ([`CallError`]): *not applied* (safe to undo or retry)
//! and *unknown* (the command may have been applied). After an unknown outcome the workflow either
//! finds out (a lookup tells whether a dentry exists) or leaves the state as is, erring on the side
//! of an unreachable inode (a space leak, cleaned later) rather than a dentry without an inode.

mod behind;

use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::time::Instant;

use behind::Behind;

use nacre_api::meta::{
    Attr, Command, Dentry, DirEntry, FileType, MetaError, Query, Reply, SetAttr,
};
use nacre_api::meta::{ExtentKey, Usage, XattrMode};
use nacre_types::sync::lock;
use nacre_types::{Ino, PartitionId};
use thiserror::Error;

/// A meta partition of the volume, as the client routes to it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MetaRange {
    pub id: PartitionId,
    pub start: u64,
    pub end: u64,
    /// New inodes may be allocated here.
    pub writable: bool,
}

/// Why a call to a partition failed (beyond the partition's own answer).
#[derive(Clone, Debug, Error, PartialEq, Eq)]
pub enum CallError {
    /// The command was certainly not applied (no leader reachable, partition not hosted, …).
    #[error("not applied: {0}")]
    NotApplied(String),
    /// The command may or may not have been applied (timeout or lost reply after sending).
    #[error("outcome unknown: {0}")]
    Unknown(String),
}

/// Reaches the meta partitions of one volume.
pub trait MetaTransport: Send + Sync + 'static {
    /// The volume's meta partitions in inode-range order (shared: asked on every operation).
    fn partitions(&self) -> Arc<[MetaRange]>;
    /// Applies a command on the partition's leader.
    fn write(
        &self,
        partition: PartitionId,
        cmd: Command,
    ) -> impl Future<Output = Result<Result<Reply, MetaError>, CallError>> + Send;
    /// Reads the partition on its leader.
    fn read(
        &self,
        partition: PartitionId,
        query: Query,
    ) -> impl Future<Output = Result<Result<Reply, MetaError>, CallError>> + Send;
}

impl<T: MetaTransport> MetaTransport for Arc<T> {
    fn partitions(&self) -> Arc<[MetaRange]> {
        (**self).partitions()
    }

    fn write(
        &self,
        partition: PartitionId,
        cmd: Command,
    ) -> impl Future<Output = Result<Result<Reply, MetaError>, CallError>> + Send {
        (**self).write(partition, cmd)
    }

    fn read(
        &self,
        partition: PartitionId,
        query: Query,
    ) -> impl Future<Output = Result<Result<Reply, MetaError>, CallError>> + Send {
        (**self).read(partition, query)
    }
}

/// Why a file system operation failed.
#[derive(Clone, Debug, Error, PartialEq, Eq)]
pub enum FsError {
    #[error(transparent)]
    Meta(#[from] MetaError),
    #[error("metadata unavailable: {0}")]
    Unavailable(#[from] CallError),
    /// Reading or writing file data failed.
    #[error("data: {0}")]
    Data(#[from] crate::data::DataCallError),
    /// The file handle is unknown (never opened, or already released).
    #[error("bad file handle {0}")]
    BadHandle(u64),
    /// The handle was not opened for this (a write on a read-only handle, …).
    #[error("file not open for {0}")]
    NotOpenFor(&'static str),
    /// Earlier buffered writes of this file failed; the error was reported then, and the data
    /// written since the last successful flush is lost.
    #[error("an earlier write of this file failed: {0}")]
    WriteFailed(String),
    /// The file system does not offer this operation, or not in this mode.
    #[error("{0} is not supported")]
    Unsupported(&'static str),
    /// Less space is free than the call asked for.
    #[error("{wanted} bytes asked for, {free} free")]
    NoSpace { wanted: u64, free: u64 },
    /// A storage function the data passes through (compression) could not run.
    #[error("storage function: {0}")]
    Func(#[from] crate::func::FuncCallError),
}

pub type FsResult<T> = Result<T, FsError>;

/// What a call that adds a name answers: the named inode's attributes and, when the call learnt
/// them, its directory's attributes right after the change. A cache keeps the directory's, since
/// the kernel asks for them before the next change in that directory.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Entry {
    pub attr: Attr,
    pub parent: Option<Attr>,
    /// The parent's ctime just before the change, when the change was one atomic step that
    /// learnt it (see `Reply::Created`).
    pub parent_was: Option<i64>,
}

impl Entry {
    /// An entry whose call learnt nothing about the directory.
    pub fn bare(attr: Attr) -> Self {
        Self {
            attr,
            parent: None,
            parent_was: None,
        }
    }
}

/// What a new inode is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NewInode {
    pub kind: FileType,
    pub mode: u32,
    pub uid: u32,
    pub gid: u32,
    pub rdev: u32,
    /// Symlink target.
    pub target: Vec<u8>,
}

impl NewInode {
    pub fn file(mode: u32, uid: u32, gid: u32) -> Self {
        Self {
            kind: FileType::File,
            mode,
            uid,
            gid,
            rdev: 0,
            target: Vec::new(),
        }
    }

    pub fn dir(mode: u32, uid: u32, gid: u32) -> Self {
        Self {
            kind: FileType::Dir,
            ..Self::file(mode, uid, gid)
        }
    }

    /// The one-step command that makes it as `name` under `parent`: `Create`, or `CreateAt` with
    /// a reserved number.
    fn command(&self, parent: Ino, name: &[u8], at: Option<Ino>) -> Command {
        let (name, target) = (name.to_vec(), self.target.clone());
        let (kind, mode, uid, gid, rdev) = (self.kind, self.mode, self.uid, self.gid, self.rdev);
        match at {
            Some(ino) => Command::CreateAt {
                ino,
                parent,
                name,
                kind,
                mode,
                uid,
                gid,
                rdev,
                target,
            },
            None => Command::Create {
                parent,
                name,
                kind,
                mode,
                uid,
                gid,
                rdev,
                target,
            },
        }
    }

    pub fn symlink(target: &[u8], uid: u32, gid: u32) -> Self {
        Self {
            kind: FileType::Symlink,
            target: target.to_vec(),
            ..Self::file(0o777, uid, gid)
        }
    }
}

fn unexpected(r: &Reply) -> FsError {
    FsError::Meta(MetaError::Invalid(format!("unexpected reply {r:?}")))
}

/// File system metadata of one volume.
#[derive(Debug)]
pub struct MetaFs<T> {
    t: Arc<T>,
    /// Round-robin cursor over writable partitions for new inodes.
    next: AtomicUsize,
    /// Inodes whose eviction failed: (partition, inode), retried by [`MetaFs::evict_orphans`].
    orphans: Mutex<Vec<Ino>>,
    /// Write-behind in delegated directories, when on (see the `behind` module).
    behind: Option<Arc<Behind>>,
}

/// How long a change waits for a directory delegated to another client: the delegation's
/// length and a second more (the holder gives it back sooner when asked to).
const DELEGATED_WAIT: Duration =
    Duration::from_nanos(nacre_api::meta::DELEGATION_NS + 1_000_000_000);

impl<T: MetaTransport> MetaFs<T> {
    /// Every change is applied before its call returns.
    pub fn new(t: T) -> Self {
        Self {
            t: Arc::new(t),
            next: AtomicUsize::new(0),
            orphans: Mutex::new(Vec::new()),
            behind: None,
        }
    }

    /// Creates and removes names in the directories this client makes ahead of the partitions
    /// (write-behind under directory delegations); [`MetaFs::settle`] waits for them.
    pub fn with_write_behind(t: T) -> Self {
        Self {
            behind: Some(Arc::new(Behind::new())),
            ..Self::new(t)
        }
    }

    pub fn transport(&self) -> &T {
        &self.t
    }

    /// The partition owning `ino`.
    pub fn partition_of(&self, ino: Ino) -> FsResult<PartitionId> {
        self.t
            .partitions()
            .iter()
            .find(|p| p.start <= ino.0 && ino.0 < p.end)
            .map(|p| p.id)
            .ok_or(FsError::Meta(MetaError::NotFound))
    }

    /// Applies `cmd` on `p` after this client's commands queued for `p`. A directory delegated
    /// to another client is recalled and the command retried until the delegation ends.
    async fn write(&self, p: PartitionId, cmd: Command) -> FsResult<Reply> {
        self.before(p, Some(&cmd)).await;
        let makes_dir = matches!(
            cmd,
            Command::Create {
                kind: FileType::Dir,
                ..
            }
        );
        let cmd = self.on_behalf(cmd);
        let deadline = Instant::now() + DELEGATED_WAIT;
        let mut pause = Duration::from_millis(2);
        let mut recalled = Vec::new();
        loop {
            let sent = Instant::now();
            match self.t.write(p, cmd.clone()).await? {
                Err(MetaError::Delegated(dir)) if Instant::now() + pause < deadline => {
                    // Not applied. Ask the holder to give it back (once); retry meanwhile.
                    if !recalled.contains(&dir) {
                        recalled.push(dir);
                        if let Err(e) = self.t.write(p, Command::Recall { dir }).await {
                            tracing::debug!(%dir, error = %e, "recall not sent");
                        }
                    }
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(Duration::from_millis(100));
                }
                Err(e) => return Err(e.into()),
                Ok(r) => {
                    if makes_dir && let Reply::Created { attr, .. } = &r {
                        self.made_dir(p, attr, sent);
                    }
                    return Ok(r);
                }
            }
        }
    }

    async fn read(&self, p: PartitionId, q: Query) -> FsResult<Reply> {
        self.before(p, None).await;
        Ok(self.t.read(p, q).await??)
    }

    async fn write_ino(&self, ino: Ino, cmd: Command) -> FsResult<Reply> {
        self.write(self.partition_of(ino)?, cmd).await
    }

    async fn read_ino(&self, ino: Ino, q: Query) -> FsResult<Reply> {
        self.read(self.partition_of(ino)?, q).await
    }

    fn attr(r: Reply) -> FsResult<Attr> {
        match r {
            Reply::Attr(a) => Ok(a),
            other => Err(unexpected(&other)),
        }
    }

    pub async fn getattr(&self, ino: Ino) -> FsResult<Attr> {
        if let Some(a) = self.made_attr(ino) {
            return Ok(a);
        }
        if let Some(a) = self.owned_attr(ino) {
            return Ok(a);
        }
        Self::attr(self.read_ino(ino, Query::GetAttr { ino }).await?)
    }

    /// The dentry `name` under `parent`.
    pub async fn lookup_dentry(&self, parent: Ino, name: &[u8]) -> FsResult<Dentry> {
        if let Some(known) = self.lookup_behind(parent, name) {
            return known;
        }
        let q = Query::Lookup {
            parent,
            name: name.to_vec(),
        };
        match self.read_ino(parent, q).await? {
            Reply::Dentry(d) => Ok(d),
            other => Err(unexpected(&other)),
        }
    }

    /// The dentry and, when its inode lives with the parent, its attributes (one round trip).
    async fn lookup_plus(&self, parent: Ino, name: &[u8]) -> FsResult<(Dentry, Option<Attr>)> {
        let q = Query::LookupPlus {
            parent,
            name: name.to_vec(),
        };
        match self.read_ino(parent, q).await? {
            Reply::Found { dentry, attr } => Ok((dentry, attr)),
            other => Err(unexpected(&other)),
        }
    }

    /// Attributes of `name` under `parent`: one round trip when the inode lives with its parent,
    /// two otherwise.
    pub async fn lookup(&self, parent: Ino, name: &[u8]) -> FsResult<Attr> {
        match self.lookup_behind(parent, name) {
            Some(Err(e)) => return Err(e),
            // A directory this client owns answers from here (a path walk through a tree it
            // made, once the kernel's entries expired, asks for every component).
            Some(Ok(d)) if d.kind == FileType::Dir => {
                if let Some(a) = self.owned_attr(d.ino) {
                    return Ok(a);
                }
            }
            // So does a file it made there (`made_attr`).
            Some(Ok(d)) => {
                if let Some(a) = self.made_attr(d.ino) {
                    return Ok(a);
                }
            }
            None => {}
        }
        match self.lookup_plus(parent, name).await? {
            (_, Some(a)) => Ok(a),
            (d, None) => self.getattr(d.ino).await,
        }
    }

    /// Allocates an inode in a writable partition (round robin; full ranges are skipped).
    async fn create_inode(&self, parent: Ino, new: &NewInode) -> FsResult<Attr> {
        let all = self.t.partitions();
        let parts: Vec<&MetaRange> = all.iter().filter(|p| p.writable).collect();
        if parts.is_empty() {
            return Err(MetaError::NoInodes.into());
        }
        let first = self.next.fetch_add(1, Ordering::Relaxed);
        let mut last = FsError::Meta(MetaError::NoInodes);
        for i in 0..parts.len() {
            let p = &parts[(first + i) % parts.len()];
            let cmd = Command::CreateInode {
                kind: new.kind,
                mode: new.mode,
                uid: new.uid,
                gid: new.gid,
                rdev: new.rdev,
                parent,
                target: new.target.clone(),
            };
            match self.write(p.id, cmd).await {
                Ok(r) => return Self::attr(r),
                Err(FsError::Meta(MetaError::NoInodes)) => continue,
                // Not applied: another partition may do. Unknown: an inode may leak; try elsewhere.
                Err(e @ FsError::Unavailable(_)) => last = e,
                Err(e) => return Err(e),
            }
        }
        Err(last)
    }

    /// Drops one link of `ino`; evicts it when none is left (and says so). Failures to evict
    /// keep it on the orphan list.
    async fn drop_link(&self, ino: Ino) -> FsResult<bool> {
        let a = Self::attr(self.write_ino(ino, Command::UnlinkInode { ino }).await?)?;
        if a.nlink == 0 {
            self.evict(ino).await;
        }
        Ok(a.nlink == 0)
    }

    async fn evict(&self, ino: Ino) {
        match self.write_ino(ino, Command::EvictInode { ino }).await {
            Ok(_) | Err(FsError::Meta(MetaError::NotFound)) => {}
            Err(e) => {
                tracing::debug!(%ino, error = %e, "eviction deferred");
                lock(&self.orphans).push(ino);
            }
        }
    }

    /// Retries deferred evictions; returns how many are still pending.
    pub async fn evict_orphans(&self) -> usize {
        let pending: Vec<Ino> = std::mem::take(&mut *lock(&self.orphans));
        for ino in pending {
            self.evict(ino).await;
        }
        lock(&self.orphans).len()
    }

    /// Whether `name` under `parent` points to `ino` (to settle an unknown outcome).
    async fn dentry_is(&self, parent: Ino, name: &[u8], ino: Ino) -> FsResult<bool> {
        match self.lookup_dentry(parent, name).await {
            Ok(d) => Ok(d.ino == ino),
            Err(FsError::Meta(MetaError::NotFound)) => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// Creates `name` under `parent`. An inode goes to its parent's partition, in one atomic step,
    /// when that partition has room — except directories made directly under the root, which are
    /// spread over the writable partitions (round robin) so that top-level trees (one per workload,
    /// typically) land on different partitions and their leaders. A remote inode is created first,
    /// then its dentry.
    pub async fn create(&self, parent: Ino, name: &[u8], new: &NewInode) -> FsResult<Entry> {
        nacre_api::meta::check_name(name)?;
        if let Some(done) = self.create_behind(parent, name, new).await {
            return done;
        }
        let pp = self.partition_of(parent)?;
        let parts = self.t.partitions();
        let local = if new.kind == FileType::Dir && parent == nacre_api::meta::ROOT_INO {
            let writable: Vec<&MetaRange> = parts.iter().filter(|p| p.writable).collect();
            let pick = self.next.fetch_add(1, Ordering::Relaxed);
            writable
                .get(pick % writable.len().max(1))
                .is_some_and(|p| p.id == pp)
        } else {
            parts.iter().any(|p| p.id == pp && p.writable)
        };
        if local {
            match self.write(pp, new.command(parent, name, None)).await {
                Err(FsError::Meta(MetaError::NoInodes)) => {} // full: allocate elsewhere
                Ok(Reply::Created {
                    attr,
                    parent,
                    parent_was,
                }) => {
                    return Ok(Entry {
                        attr,
                        parent: Some(parent),
                        parent_was: Some(parent_was),
                    });
                }
                Ok(other) => return Err(unexpected(&other)),
                Err(e) => return Err(e),
            }
        }
        self.create_remote(parent, name, new).await
    }

    /// Create with the inode in another partition: inode first, then dentry.
    async fn create_remote(&self, parent: Ino, name: &[u8], new: &NewInode) -> FsResult<Entry> {
        let sent = Instant::now();
        let attr = self.create_inode(parent, new).await?;
        let cmd = Command::CreateDentry {
            parent,
            name: name.to_vec(),
            ino: attr.ino,
            kind: new.kind,
        };
        match self.write_ino(parent, cmd).await {
            Ok(r) => {
                // A directory's inode made on this client's behalf is delegated to it.
                self.made_dir(self.partition_of(attr.ino)?, &attr, sent);
                Ok(Entry {
                    attr,
                    parent: Self::attr(r).ok(),
                    parent_was: None,
                })
            }
            Err(FsError::Unavailable(CallError::Unknown(m))) => {
                // Did the dentry make it? Only a definite "no" allows undoing the inode.
                match self.dentry_is(parent, name, attr.ino).await {
                    Ok(true) => Ok(Entry::bare(attr)),
                    Ok(false) => {
                        self.undo_inode(attr.ino).await;
                        Err(CallError::Unknown(m).into())
                    }
                    Err(e) => Err(e),
                }
            }
            Err(e) => {
                self.undo_inode(attr.ino).await;
                Err(e)
            }
        }
    }

    /// Removes an inode that no dentry points to.
    async fn undo_inode(&self, ino: Ino) {
        match self.write_ino(ino, Command::UnlinkInode { ino }).await {
            Ok(_) => self.evict(ino).await,
            Err(e) => {
                // Left with a link and no dentry: unreachable, never dangling. Keep it for later.
                tracing::debug!(%ino, error = %e, "orphan inode left behind");
                lock(&self.orphans).push(ino);
            }
        }
    }

    /// A new name for an existing inode: nlink + 1, then the dentry.
    pub async fn link(&self, ino: Ino, parent: Ino, name: &[u8]) -> FsResult<Entry> {
        nacre_api::meta::check_name(name)?;
        self.linked(ino);
        let attr = Self::attr(self.write_ino(ino, Command::LinkInode { ino }).await?)?;
        let cmd = Command::CreateDentry {
            parent,
            name: name.to_vec(),
            ino,
            kind: attr.kind,
        };
        let undo = match self.write_ino(parent, cmd).await {
            Ok(r) => {
                return Ok(Entry {
                    attr,
                    parent: Self::attr(r).ok(),
                    parent_was: None,
                });
            }
            Err(FsError::Unavailable(CallError::Unknown(m))) => {
                match self.dentry_is(parent, name, ino).await {
                    Ok(true) => {
                        return Ok(Entry::bare(attr));
                    }
                    Ok(false) => FsError::from(CallError::Unknown(m)),
                    // Cannot tell: keep the extra link (a leak, not a dangling dentry).
                    Err(e) => return Err(e),
                }
            }
            Err(e) => e,
        };
        if let Err(e) = self.write_ino(ino, Command::UnlinkInode { ino }).await {
            tracing::debug!(%ino, error = %e, "extra link left behind");
        }
        Err(undo)
    }

    /// Removes a non-directory name: the dentry first, then one link — one atomic step when the
    /// inode lives with its parent. After an unknown outcome nothing more is done (at worst a remote
    /// inode keeps a link it no longer needs: a leak, never a dangling name). Returns the parent's
    /// attributes after the removal.
    pub async fn unlink(&self, parent: Ino, name: &[u8]) -> FsResult<Vec<Attr>> {
        Ok(self.unlink_reporting(parent, name).await?.0)
    }

    /// [`MetaFs::unlink`], also returning the inode when its last link went with the name (it
    /// is deleted), as far as this client learnt it.
    pub async fn unlink_reporting(
        &self,
        parent: Ino,
        name: &[u8],
    ) -> FsResult<(Vec<Attr>, Option<Ino>)> {
        if let Some(done) = self.remove_behind(parent, name, false) {
            return done.map(|(dirs, ino)| (dirs, Some(ino)));
        }
        let cmd = Command::Remove {
            parent,
            name: name.to_vec(),
            dir: false,
        };
        match self.write_ino(parent, cmd).await? {
            Reply::Removed {
                dentry,
                attr,
                parent,
            } => {
                let gone = match attr {
                    Some(a) => a.nlink == 0,
                    None => self.drop_link(dentry.ino).await?,
                };
                Ok((vec![parent], gone.then_some(dentry.ino)))
            }
            other => Err(unexpected(&other)),
        }
    }

    /// Deletes the dentry `name` → `ino`, settling an unknown outcome by a lookup.
    async fn delete_dentry(&self, parent: Ino, name: &[u8], ino: Ino) -> FsResult<()> {
        let cmd = Command::DeleteDentry {
            parent,
            name: name.to_vec(),
            expect: Some(ino),
        };
        match self.write_ino(parent, cmd).await {
            Ok(_) => Ok(()),
            Err(FsError::Unavailable(CallError::Unknown(m))) => {
                if self.dentry_is(parent, name, ino).await? {
                    Err(CallError::Unknown(m).into())
                } else {
                    Ok(())
                }
            }
            Err(e) => Err(e),
        }
    }

    /// Removes an empty directory: one atomic step when its inode lives with its parent; else an
    /// emptiness check, the dentry, then the inode. Returns the parent's attributes after the
    /// removal when the one-step path learnt them.
    pub async fn rmdir(&self, parent: Ino, name: &[u8]) -> FsResult<Vec<Attr>> {
        if let Some(done) = self.remove_behind(parent, name, true) {
            return done.map(|(dirs, _)| dirs);
        }
        let cmd = Command::Remove {
            parent,
            name: name.to_vec(),
            dir: true,
        };
        let ino = match self.write_ino(parent, cmd).await {
            Ok(Reply::Removed { parent, dentry, .. }) => {
                self.forget_dir(dentry.ino);
                return Ok(vec![parent]);
            }
            Ok(other) => return Err(unexpected(&other)),
            Err(FsError::Meta(MetaError::WrongPartition(ino))) => ino,
            Err(e) => return Err(e),
        };
        let d = Dentry {
            ino,
            kind: FileType::Dir,
        };
        if !self.is_empty_dir(d.ino).await? {
            return Err(MetaError::NotEmpty.into());
        }
        self.delete_dentry(parent, name, d.ino).await?;
        match self
            .write_ino(d.ino, Command::UnlinkInode { ino: d.ino })
            .await
        {
            Ok(_) => {
                self.evict(d.ino).await;
                Ok(Vec::new())
            }
            Err(FsError::Meta(MetaError::NotEmpty)) => {
                // A create raced in: put the name back.
                let cmd = Command::CreateDentry {
                    parent,
                    name: name.to_vec(),
                    ino: d.ino,
                    kind: FileType::Dir,
                };
                if let Err(e) = self.write_ino(parent, cmd).await {
                    tracing::warn!(ino = %d.ino, error = %e, "non-empty directory left unreachable");
                }
                Err(MetaError::NotEmpty.into())
            }
            Err(e) => Err(e),
        }
    }

    async fn is_empty_dir(&self, ino: Ino) -> FsResult<bool> {
        let q = Query::ReadDir {
            parent: ino,
            after: None,
            limit: 1,
        };
        match self.read_ino(ino, q).await? {
            Reply::Entries(e) => Ok(e.is_empty()),
            other => Err(unexpected(&other)),
        }
    }

    /// Renames `src_name` under `src_parent` to `dst_name` under `dst_parent`, replacing a
    /// compatible destination. Returns the parents' attributes after the rename when both are in
    /// one partition (the one-step path), else none.
    pub async fn rename(
        &self,
        src_parent: Ino,
        src_name: &[u8],
        dst_parent: Ino,
        dst_name: &[u8],
    ) -> FsResult<Vec<Attr>> {
        nacre_api::meta::check_name(dst_name)?;
        if let Some(done) = self.rename_behind(src_parent, src_name, dst_parent, dst_name) {
            return done;
        }
        let src = self.lookup_dentry(src_parent, src_name).await?;
        if src_parent == dst_parent && src_name == dst_name {
            return Ok(Vec::new());
        }
        let dst = match self.lookup_dentry(dst_parent, dst_name).await {
            Ok(d) => Some(d),
            Err(FsError::Meta(MetaError::NotFound)) => None,
            Err(e) => return Err(e),
        };
        if let Some(d) = dst {
            if d.ino == src.ino {
                return Ok(Vec::new()); // two names of one inode: POSIX says do nothing
            }
            match (src.kind == FileType::Dir, d.kind == FileType::Dir) {
                (false, true) => return Err(MetaError::IsDir.into()),
                (true, false) => return Err(MetaError::NotDir.into()),
                (true, true) if !self.is_empty_dir(d.ino).await? => {
                    return Err(MetaError::NotEmpty.into());
                }
                _ => {}
            }
        }
        if src.kind == FileType::Dir && src_parent != dst_parent {
            self.check_not_ancestor(src.ino, dst_parent).await?;
        }
        let ps = self.partition_of(src_parent)?;
        let pd = self.partition_of(dst_parent)?;
        if ps == pd {
            let cmd = Command::Rename {
                src_parent,
                src_name: src_name.to_vec(),
                dst_parent,
                dst_name: dst_name.to_vec(),
            };
            let (replaced, parents) = match self.write(ps, cmd).await? {
                Reply::Renamed { replaced, parents } => (replaced, parents),
                other => return Err(unexpected(&other)),
            };
            // The partition updated the parent pointer if it holds the directory's inode.
            if src.kind == FileType::Dir
                && src_parent != dst_parent
                && self.partition_of(src.ino)? != ps
                && let Err(e) = self.set_parent(src.ino, dst_parent).await
            {
                tracing::warn!(ino = %src.ino, error = %e, "moved directory keeps its old parent pointer");
            }
            if let Some(r) = replaced {
                self.drop_link(r.ino).await?;
            }
            return Ok(parents);
        }
        self.rename_across(src_parent, src_name, src, dst_parent, dst_name, dst)
            .await?;
        Ok(Vec::new())
    }

    /// Fails with `Invalid` if `dir` is `target` or one of its ancestors.
    async fn check_not_ancestor(&self, dir: Ino, target: Ino) -> FsResult<()> {
        let mut x = target;
        // Bounded by the tree depth; a cycle (which must not exist) would stop at the bound.
        for _ in 0..4096 {
            if x == dir {
                return Err(MetaError::Invalid(
                    "cannot move a directory into itself or its subtree".into(),
                )
                .into());
            }
            if x == nacre_api::meta::ROOT_INO {
                return Ok(());
            }
            x = self.parent_of(x).await?;
        }
        Err(MetaError::Invalid("directory tree too deep".into()).into())
    }

    async fn parent_of(&self, ino: Ino) -> FsResult<Ino> {
        match self.read_ino(ino, Query::Parent { ino }).await? {
            Reply::Inos(v) => v.first().copied().ok_or(FsError::Meta(MetaError::NotFound)),
            other => Err(unexpected(&other)),
        }
    }

    async fn rename_across(
        &self,
        src_parent: Ino,
        src_name: &[u8],
        src: Dentry,
        dst_parent: Ino,
        dst_name: &[u8],
        dst: Option<Dentry>,
    ) -> FsResult<()> {
        let file = src.kind != FileType::Dir;
        // Files: an extra link covers the moment both names exist.
        if file {
            self.write_ino(src.ino, Command::LinkInode { ino: src.ino })
                .await?;
        }
        let put = match dst {
            Some(_) => Command::UpdateDentry {
                parent: dst_parent,
                name: dst_name.to_vec(),
                ino: src.ino,
                kind: src.kind,
            },
            None => Command::CreateDentry {
                parent: dst_parent,
                name: dst_name.to_vec(),
                ino: src.ino,
                kind: src.kind,
            },
        };
        let placed = match self.write_ino(dst_parent, put).await {
            Ok(_) => Ok(()),
            Err(FsError::Unavailable(CallError::Unknown(m))) => {
                match self.dentry_is(dst_parent, dst_name, src.ino).await {
                    Ok(true) => Ok(()),
                    Ok(false) => Err(CallError::Unknown(m).into()),
                    Err(e) => return Err(e), // keep the extra link: a leak at worst
                }
            }
            Err(e) => Err(e),
        };
        if let Err(e) = placed {
            if file
                && let Err(u) = self
                    .write_ino(src.ino, Command::UnlinkInode { ino: src.ino })
                    .await
            {
                tracing::debug!(ino = %src.ino, error = %u, "extra link left behind");
            }
            return Err(e);
        }
        if !file && let Err(e) = self.set_parent(src.ino, dst_parent).await {
            tracing::warn!(ino = %src.ino, error = %e, "moved directory keeps its old parent pointer");
        }
        // The old name goes; then the extra link and the replaced inode's link.
        self.delete_dentry(src_parent, src_name, src.ino).await?;
        if file {
            self.drop_link(src.ino).await?;
        }
        if let Some(d) = dst {
            self.drop_link(d.ino).await?;
        }
        Ok(())
    }

    async fn set_parent(&self, ino: Ino, parent: Ino) -> FsResult<()> {
        self.write_ino(ino, Command::SetParent { ino, parent })
            .await
            .map(|_| ())
    }

    /// Entries of `dir` after `after`, at most `limit`.
    pub async fn readdir(
        &self,
        dir: Ino,
        after: Option<&[u8]>,
        limit: u32,
    ) -> FsResult<Vec<DirEntry>> {
        let q = Query::ReadDir {
            parent: dir,
            after: after.map(<[u8]>::to_vec),
            limit,
        };
        match self.read_ino(dir, q).await? {
            Reply::Entries(e) => Ok(e),
            other => Err(unexpected(&other)),
        }
    }

    /// Entries with attributes: one round trip to the directory's partition, plus one batch per
    /// other partition holding some of the entries' inodes.
    pub async fn readdir_plus(
        &self,
        dir: Ino,
        after: Option<&[u8]>,
        limit: u32,
    ) -> FsResult<Vec<(DirEntry, Option<Attr>)>> {
        let q = Query::ReadDirPlus {
            parent: dir,
            after: after.map(<[u8]>::to_vec),
            limit,
        };
        let mut entries = match self.read_ino(dir, q).await? {
            Reply::EntriesPlus(e) => e,
            other => return Err(unexpected(&other)),
        };
        let mut missing: std::collections::BTreeMap<PartitionId, Vec<Ino>> = Default::default();
        for (e, a) in &entries {
            if a.is_none() {
                missing
                    .entry(self.partition_of(e.ino)?)
                    .or_default()
                    .push(e.ino);
            }
        }
        for (p, inos) in missing {
            let attrs = match self.read(p, Query::BatchGet { inos }).await? {
                Reply::Attrs(a) => a,
                other => return Err(unexpected(&other)),
            };
            let by_ino: std::collections::HashMap<Ino, Attr> =
                attrs.into_iter().map(|a| (a.ino, a)).collect();
            for (e, a) in entries.iter_mut() {
                if a.is_none() {
                    *a = by_ino.get(&e.ino).cloned();
                }
            }
        }
        Ok(entries)
    }

    /// Attributes of many inodes, one round trip per partition (unknown inodes are skipped).
    pub async fn batch_getattr(&self, inos: &[Ino]) -> FsResult<Vec<Attr>> {
        let mut by_part: std::collections::BTreeMap<PartitionId, Vec<Ino>> = Default::default();
        for &ino in inos {
            by_part
                .entry(self.partition_of(ino)?)
                .or_default()
                .push(ino);
        }
        let mut out = Vec::with_capacity(inos.len());
        for (p, inos) in by_part {
            match self.read(p, Query::BatchGet { inos }).await? {
                Reply::Attrs(a) => out.extend(a),
                other => return Err(unexpected(&other)),
            }
        }
        Ok(out)
    }

    pub async fn setattr(&self, ino: Ino, set: SetAttr) -> FsResult<Attr> {
        if let Some(done) = self.setattr_behind(ino, &set) {
            return done;
        }
        let cmd = if set.kill_suidgid {
            Command::SetAttrKillSuid { ino, set }
        } else {
            Command::SetAttr { ino, set }
        };
        Self::attr(self.write_ino(ino, cmd).await?)
    }

    pub async fn readlink(&self, ino: Ino) -> FsResult<Vec<u8>> {
        match self.read_ino(ino, Query::ReadLink { ino }).await? {
            Reply::Bytes(b) => Ok(b),
            other => Err(unexpected(&other)),
        }
    }

    pub async fn append_extents(&self, ino: Ino, extents: Vec<ExtentKey>) -> FsResult<Attr> {
        Self::attr(
            self.write_ino(ino, Command::AppendExtents { ino, extents })
                .await?,
        )
    }

    /// `Command::Fallocate`: punches `[offset, offset + len)` out of the file's keys (`punch`)
    /// and grows the size to at least its end (unless `keep_size`).
    pub async fn fallocate(
        &self,
        ino: Ino,
        (offset, len): (u64, u64),
        punch: bool,
        keep_size: bool,
    ) -> FsResult<Attr> {
        let cmd = Command::Fallocate {
            ino,
            offset,
            len,
            punch,
            keep_size,
        };
        Self::attr(self.write_ino(ino, cmd).await?)
    }

    /// The attributes of `ino` and, unless this client answers for them itself (a file it made
    /// or one in a directory it owns, whose keys may still be on their way), its extent keys:
    /// what an open for reading needs before its first read, in one round trip.
    pub async fn open_read(&self, ino: Ino) -> FsResult<(Attr, Option<Vec<ExtentKey>>)> {
        if let Some(a) = self.made_attr(ino).or_else(|| self.owned_attr(ino)) {
            return Ok((a, None));
        }
        let (attr, keys) = self.extents(ino).await?;
        Ok((attr, Some(keys)))
    }

    pub async fn extents(&self, ino: Ino) -> FsResult<(Attr, Vec<ExtentKey>)> {
        match self.read_ino(ino, Query::GetExtents { ino }).await? {
            Reply::Extents(a, e) => Ok((a, e)),
            other => Err(unexpected(&other)),
        }
    }

    pub async fn set_xattr(
        &self,
        ino: Ino,
        name: &[u8],
        value: &[u8],
        mode: XattrMode,
    ) -> FsResult<()> {
        let cmd = Command::SetXattr {
            ino,
            name: name.to_vec(),
            value: value.to_vec(),
            mode,
        };
        self.write_ino(ino, cmd).await.map(|_| ())
    }

    pub async fn get_xattr(&self, ino: Ino, name: &[u8]) -> FsResult<Vec<u8>> {
        if self.made_bare(ino) {
            // Through FUSE every write(2) asks for `security.capability` first.
            return Err(MetaError::NoXattr.into());
        }
        let q = Query::GetXattr {
            ino,
            name: name.to_vec(),
        };
        match self.read_ino(ino, q).await? {
            Reply::Bytes(b) => Ok(b),
            other => Err(unexpected(&other)),
        }
    }

    pub async fn list_xattr(&self, ino: Ino) -> FsResult<Vec<Vec<u8>>> {
        if self.made_bare(ino) {
            return Ok(Vec::new());
        }
        match self.read_ino(ino, Query::ListXattr { ino }).await? {
            Reply::Names(n) => Ok(n),
            other => Err(unexpected(&other)),
        }
    }

    pub async fn remove_xattr(&self, ino: Ino, name: &[u8]) -> FsResult<()> {
        let cmd = Command::RemoveXattr {
            ino,
            name: name.to_vec(),
        };
        self.write_ino(ino, cmd).await.map(|_| ())
    }

    /// What the volume's live files hold and take in extents, summed over its partitions
    /// (`Query::Usage`: each partition walks its keys).
    pub async fn usage(&self) -> FsResult<Usage> {
        let mut u = Usage::default();
        for p in self.t.partitions().iter() {
            match self.read(p.id, Query::Usage).await? {
                Reply::Usage(one) => u.add(&one),
                other => return Err(unexpected(&other)),
            }
        }
        Ok(u)
    }

    /// Inodes and dentries across the volume's partitions.
    pub async fn statfs(&self) -> FsResult<(u64, u64)> {
        let mut inodes = 0;
        let mut dentries = 0;
        for p in self.t.partitions().iter() {
            match self.read(p.id, Query::Stats).await? {
                Reply::Stats(s) => {
                    inodes += s.inodes;
                    dentries += s.dentries;
                }
                other => return Err(unexpected(&other)),
            }
        }
        Ok((inodes, dentries))
    }
}
