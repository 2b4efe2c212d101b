//! Write-behind of metadata changes in delegated directories (docs/ARCHITECTURE.md,
//! "Write-behind under directory delegations").
//!
//! A directory this client makes is delegated to it by its partition (`Command::As`): until the
//! delegation ends, no other client may change its entries. So the client knows every entry of
//! such an *owned* directory, and it creates and removes names there without waiting for the
//! partition: it checks the change against what it knows, answers the caller at once, and queues
//! the command. One task per partition sends the queue as `Command::Batch`es, one batch in
//! flight, in order; new inodes take numbers the client reserved beforehand (`Reserve`,
//! `CreateAt`). Every other request of this client to a partition waits until the commands queued
//! for it before the request have been applied (so a later lookup, rename or data commit finds
//! them); `MetaFs::settle` waits for all of them (fsync).
//!
//! A failed queued command cannot fail the call that queued it any more: it is logged, kept as
//! the client's write-behind error (reported by the next `settle`, so by the next fsync), and
//! the directories it touched are no longer trusted. With a live delegation only a lost cluster
//! makes that happen.
//!
//! Delegations end: the client counts one from when it sent the command that granted or renewed
//! it and stops relying on it `DELEGATION_MARGIN_NS` early; a partition that another client asked
//! to `Recall` one says so in its batch replies and to the poller, which then queues a `Release`
//! behind the directory's pending commands.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::time::Instant;

use nacre_api::meta::{
    Attr, Command, Dentry, ExtentKey, FileType, MetaError, Query, Reply, SetAttr,
};
use nacre_api::meta::{DELEGATION_MARGIN_NS, DELEGATION_NS, time::file_time};
use nacre_types::{Ino, PartitionId};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use super::{CallError, Entry, FsError, FsResult, MetaFs, MetaTransport, NewInode};

/// Most commands in one batch.
const BATCH_MAX: usize = 512;
/// Inode numbers asked for at a time, and the stock below which more are asked for.
const RESERVE: u32 = 1024;
const RESERVE_LOW: u64 = 256;
/// Queued commands per partition above which callers wait for the queue to shrink.
const QUEUE_MAX: u64 = 8192;
/// Most names followed in one owned directory; past that it is given up (and changed in step).
const NAMES_MAX: usize = 200_000;
/// How long a batch is retried (unavailable partition, unknown outcome) before it is given up:
/// far longer than any fault the cluster rides out lasts, since its calls were answered already.
const RETRY_FOR: Duration = Duration::from_secs(600);
/// How long before a delegation ends the poller renews it.
const RENEW_BEFORE: Duration = Duration::from_secs(3);
/// Most names in all owned directories together for which delegations are renewed.
const OWNED_NAMES_MAX: usize = 1_000_000;
/// How often the poller asks the partitions which delegations were recalled.
const POLL: Duration = Duration::from_millis(100);
/// Longest wait for room in a queue or for reserved inode numbers.
const WAIT_MAX: Duration = Duration::from_secs(10);
/// How long a partition's queue waits for more commands to join its next batch while nobody
/// waits for the queue: a burst of creates then costs its partitions a few Raft rounds instead
/// of one per round trip, and those rounds do not take the CPU from the burst itself.
const LINGER: Duration = Duration::from_millis(2);

/// The write-behind state of one [`MetaFs`].
#[derive(Debug)]
pub(crate) struct Behind {
    /// Who this client is to the partitions (random, not 0).
    pub(crate) client: u64,
    st: Mutex<State>,
    /// Woken whenever a batch or a reservation finishes.
    progress: tokio::sync::Notify,
}

#[derive(Debug, Default)]
struct State {
    parts: HashMap<PartitionId, Part>,
    owned: HashMap<Ino, Owned>,
    made: HashMap<Ino, Made>,
    /// The first failure of a queued command since the last `settle`.
    failed: Option<String>,
    polling: bool,
    metrics: BehindMetrics,
}

/// What the write-behind queues did, for Prometheus (`nacre_fs_behind_*`).
#[derive(Clone, Debug, Default)]
struct BehindMetrics {
    /// Commands queued, delegation give-backs included.
    queued: Counter,
    /// Commands queued and not yet answered by their partition.
    pending: Gauge,
    /// Batches answered.
    batches: Counter,
    /// Commands that failed, or whose batch was given up.
    failed: Counter,
    /// Delegations given back (`Release` queued).
    released: Counter,
}

impl BehindMetrics {
    fn register(&self, registry: &mut Registry) {
        let r = registry.sub_registry_with_prefix("nacre_fs_behind");
        r.register(
            "queued",
            "Metadata commands written behind (queued), delegation give-backs included",
            self.queued.clone(),
        );
        r.register(
            "pending",
            "Metadata commands written behind and not yet answered by their partition",
            self.pending.clone(),
        );
        r.register(
            "batches",
            "Batches of commands written behind answered by a partition",
            self.batches.clone(),
        );
        r.register(
            "failed",
            "Metadata commands written behind that failed or were given up",
            self.failed.clone(),
        );
        r.register(
            "released",
            "Directory delegations this client gave back",
            self.released.clone(),
        );
    }

    fn queued(&self) {
        self.queued.inc();
        self.pending.inc();
    }
}

#[derive(Debug, Default)]
struct Part {
    queue: Vec<Queued>,
    sending: bool,
    /// Number of the last batch sent.
    seq: u64,
    /// Commands queued so far, and how many of them have been sent and answered.
    queued: u64,
    done: u64,
    /// Reserved inode numbers, `[start, end)` ranges.
    free: VecDeque<(u64, u64)>,
    reserving: bool,
    /// The partition has no inode number left to reserve.
    exhausted: bool,
    /// Someone waits for the queue (a request to the partition, a settle, another client's
    /// recall): the next batch goes without lingering.
    urgent: bool,
}

impl Part {
    fn stock(&self) -> u64 {
        self.free.iter().map(|(s, e)| e - s).sum()
    }

    fn take_ino(&mut self) -> Option<Ino> {
        let (s, e) = self.free.front_mut()?;
        let ino = *s;
        *s += 1;
        if *s == *e {
            self.free.pop_front();
        }
        Some(Ino(ino))
    }
}

#[derive(Debug)]
struct Queued {
    cmd: Command,
    /// The directory whose entries the command changes (its delegation is what makes it safe);
    /// `None` for a file's extent keys, which need no delegation.
    dir: Option<Ino>,
    /// A directory the command makes (delegated to this client when it is applied).
    born: Option<Ino>,
}

/// A directory delegated to this client, with every entry it has.
#[derive(Debug)]
struct Owned {
    part: PartitionId,
    /// When this client stops relying on the delegation.
    until: Instant,
    names: HashMap<Box<[u8]>, Known>,
    /// The directory's attributes as this client's changes left them.
    attr: Attr,
}

#[derive(Clone, Copy, Debug)]
struct Known {
    ino: Ino,
    kind: FileType,
    /// A file this client made here and never linked elsewhere: one link, which a remove drops.
    single: bool,
}

/// A non-directory this client made behind the partition's back, with its attributes as this
/// client's own changes left them. Attributes of files are not delegated: another client's
/// change is missed in the attributes a `setattr` written behind returns, for at most
/// [`MADE_FOR`].
#[derive(Debug)]
struct Made {
    part: PartitionId,
    attr: Attr,
    since: Instant,
}

/// How long the attributes of a file this client made are relied on.
const MADE_FOR: Duration = Duration::from_secs(5);

/// The inode whose attributes `cmd` changes (a file's data, attributes, links or xattrs).
fn changes_inode(cmd: &Command) -> Option<Ino> {
    match cmd {
        Command::AppendExtents { ino, .. }
        | Command::SetAttr { ino, .. }
        | Command::SetAttrKillSuid { ino, .. }
        | Command::LinkInode { ino }
        | Command::UnlinkInode { ino }
        | Command::EvictInode { ino }
        | Command::SetXattr { ino, .. }
        | Command::RemoveXattr { ino, .. }
        | Command::Fallocate { ino, .. } => Some(*ino),
        _ => None,
    }
}

/// A queued command's place: its partition and its number in that partition's queue.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Applied(PartitionId, u64);

/// How long a delegation granted or renewed by a command sent at `sent` can be relied on.
fn lease_end(sent: Instant) -> Instant {
    sent + Duration::from_nanos(DELEGATION_NS - DELEGATION_MARGIN_NS)
}

fn now_ns() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
}

/// `attr` after `set` (not a size), as the partition's `SetAttr` will make it.
fn set_attr(attr: &mut Attr, set: &SetAttr) {
    if let Some(mode) = set.mode {
        attr.mode = mode & 0o7777;
    }
    if set.kill_suidgid && attr.kind != FileType::Dir {
        attr.mode = nacre_api::meta::without_suidgid(attr.mode);
    }
    attr.uid = set.uid.unwrap_or(attr.uid);
    attr.gid = set.gid.unwrap_or(attr.gid);
    attr.atime = set.atime.unwrap_or(attr.atime);
    attr.mtime = set.mtime.unwrap_or(attr.mtime);
    attr.ctime = attr.ctime.max(file_time(now_ns()));
}

/// A directory's attributes after a change of its entries, as the partition will make them.
fn touched(attr: &mut Attr, subdirs: i32) {
    attr.nlink = attr.nlink.saturating_add_signed(subdirs);
    let t = nacre_api::meta::dir_changed_at(attr.ctime, file_time(now_ns()));
    attr.mtime = t;
    attr.ctime = t;
}

impl Behind {
    /// Registers the `nacre_fs_behind_*` metrics in `registry`.
    pub(crate) fn register_metrics(&self, registry: &mut Registry) {
        self.lock().metrics.register(registry);
    }

    pub(crate) fn new() -> Self {
        Self {
            client: crate::random_client_id(),
            st: Mutex::default(),
            progress: tokio::sync::Notify::new(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock leaves plain data behind; carry on with it.
        nacre_types::sync::lock(&self.st)
    }

    /// Waits until `ready` holds (checked under the lock), at most `max`; whether it held.
    async fn wait_until(&self, max: Duration, mut ready: impl FnMut(&mut State) -> bool) -> bool {
        let deadline = tokio::time::Instant::now() + max;
        loop {
            let notified = self.progress.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if ready(&mut self.lock()) {
                return true;
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                return ready(&mut self.lock());
            }
        }
    }

    /// Stops trusting `dir`, and gives its delegation back behind the commands queued for it
    /// (which still go out, in order) so that other clients need not wait for it to run out.
    /// The caller [`kick`]s the pumps.
    fn disown(st: &mut State, dir: Ino) {
        let Some(o) = st.owned.remove(&dir) else {
            return;
        };
        if o.until <= Instant::now() {
            return;
        }
        let part = st.parts.entry(o.part).or_default();
        part.queue.push(Queued {
            cmd: Command::Release { dirs: vec![dir] },
            dir: Some(dir),
            born: None,
        });
        part.queued += 1;
        part.urgent = true;
        st.metrics.queued();
        st.metrics.released.inc();
    }

    /// The live owned directory `dir`, forgetting it when its delegation ran out.
    fn owned(st: &mut State, dir: Ino) -> Option<&mut Owned> {
        if st
            .owned
            .get(&dir)
            .is_some_and(|o| o.until <= Instant::now())
        {
            st.owned.remove(&dir);
        }
        st.owned.get_mut(&dir)
    }
}

impl<T: MetaTransport> MetaFs<T> {
    fn behind(&self) -> Option<&Arc<Behind>> {
        self.behind.as_ref()
    }

    /// The command as this client sends it: on its behalf when it writes behind.
    pub(super) fn on_behalf(&self, cmd: Command) -> Command {
        match self.behind() {
            Some(b) => Command::As {
                client: b.client,
                cmd: Box::new(cmd),
            },
            None => cmd,
        }
    }

    /// Before a request to `p`: waits until the commands queued for `p` so far are applied, and
    /// stops trusting the owned directories `cmd` changes (it changes them in step with the
    /// partition). Bounded by the batches' own retry limit.
    pub(super) async fn before(&self, p: PartitionId, cmd: Option<&Command>) {
        let Some(b) = self.behind() else { return };
        let target = {
            let mut st = b.lock();
            if let Some(cmd) = cmd {
                for d in cmd.entry_dirs().chain(cmd.attr_target()) {
                    Behind::disown(&mut st, d);
                }
                if let Some(ino) = changes_inode(cmd) {
                    st.made.remove(&ino);
                }
                kick(&self.t, b, &mut st);
            }
            match st.parts.get_mut(&p) {
                Some(part) if part.done < part.queued => {
                    part.urgent = true;
                    part.queued
                }
                _ => return,
            }
        };
        b.progress.notify_waiters();
        b.wait_until(RETRY_FOR + WAIT_MAX, |st| {
            st.parts.get(&p).is_none_or(|part| part.done >= target)
        })
        .await;
    }

    /// After a `Create` this client sent on its own behalf made a directory: the partition
    /// delegated it to this client, which owns it (empty) from now on.
    pub(super) fn made_dir(&self, p: PartitionId, attr: &Attr, sent: Instant) {
        let Some(b) = self.behind() else { return };
        if attr.kind != FileType::Dir {
            return;
        }
        let mut st = b.lock();
        st.owned.insert(
            attr.ino,
            Owned {
                part: p,
                until: lease_end(sent),
                names: HashMap::new(),
                attr: attr.clone(),
            },
        );
        self.start_poller(b, &mut st);
        // Numbers in every partition new names may go to, so that the first of them need not
        // wait for a reservation.
        self.reserve_more(b, &mut st, p);
        for w in self.t.partitions().iter().filter(|w| w.writable) {
            self.reserve_more(b, &mut st, w.id);
        }
    }

    /// `ino` gets another link: no name of it in an owned directory holds its only link any
    /// more (removing or replacing one drops a link, not the file).
    pub(super) fn linked(&self, ino: Ino) {
        if let Some(b) = self.behind() {
            let mut st = b.lock();
            st.made.remove(&ino);
            for o in st.owned.values_mut() {
                for k in o.names.values_mut().filter(|k| k.ino == ino) {
                    k.single = false;
                }
            }
        }
    }

    /// A directory removed the synchronous way is no longer owned.
    pub(super) fn forget_dir(&self, dir: Ino) {
        if let Some(b) = self.behind() {
            b.lock().owned.remove(&dir);
        }
    }

    /// Registers the write-behind metrics (`nacre_fs_behind_*`) in `registry`; nothing when this
    /// client does not write behind.
    pub fn register_metrics(&self, registry: &mut Registry) {
        if let Some(b) = self.behind() {
            b.register_metrics(registry);
        }
    }

    /// Waits until every queued command was applied (or given up); returns the write-behind
    /// error since the last call, if any. What fsync calls.
    pub async fn settle(&self) -> FsResult<()> {
        let Some(b) = self.behind() else {
            return Ok(());
        };
        let targets: Vec<(PartitionId, u64)> = b
            .lock()
            .parts
            .iter_mut()
            .map(|(p, part)| {
                part.urgent |= part.done < part.queued;
                (*p, part.queued)
            })
            .collect();
        b.progress.notify_waiters();
        b.wait_until(RETRY_FOR + WAIT_MAX, |st| {
            targets
                .iter()
                .all(|(p, t)| st.parts.get(p).is_none_or(|part| part.done >= *t))
        })
        .await;
        match b.lock().failed.take() {
            Some(e) => Err(FsError::Unavailable(CallError::Unknown(format!(
                "a metadata change written behind failed: {e}"
            )))),
            None => Ok(()),
        }
    }

    /// The attributes of `dir` while this client owns it: no other client may change them
    /// (the partition refuses their `SetAttr`s and `SetXattr`s until the delegation ends), and
    /// this client's own changes either go behind, updating them here, or end the ownership.
    pub(super) fn owned_attr(&self, dir: Ino) -> Option<Attr> {
        let b = self.behind()?;
        let mut st = b.lock();
        Behind::owned(&mut st, dir).map(|o| o.attr.clone())
    }

    /// The dentry `name` under an owned `parent`, answered from what this client knows; `None`
    /// when `parent` is not owned.
    pub(super) fn lookup_behind(&self, parent: Ino, name: &[u8]) -> Option<FsResult<Dentry>> {
        let b = self.behind()?;
        let mut st = b.lock();
        let o = Behind::owned(&mut st, parent)?;
        Some(match o.names.get(name) {
            Some(k) => Ok(Dentry {
                ino: k.ino,
                kind: k.kind,
            }),
            None => Err(MetaError::NotFound.into()),
        })
    }

    /// Creates `name` in an owned `parent` behind the partition's back; `None` when it must go
    /// the synchronous way (not owned, or no inode number to be had).
    pub(super) async fn create_behind(
        &self,
        parent: Ino,
        name: &[u8],
        new: &NewInode,
    ) -> Option<FsResult<Entry>> {
        let b = self.behind()?.clone();
        let deadline = Instant::now() + WAIT_MAX;
        let mut asked = false;
        loop {
            let wait_for = {
                let mut st = b.lock();
                let o = Behind::owned(&mut st, parent)?;
                if o.names.contains_key(name) {
                    return Some(Err(MetaError::Exists.into()));
                }
                let p = o.part;
                let full = o.names.len() >= NAMES_MAX;
                let part = st.parts.entry(p).or_default();
                if part.queued - part.done >= QUEUE_MAX && !full {
                    Some(p)
                } else if let Some(ino) = part.take_ino().filter(|_| !full) {
                    return self
                        .queue_create(&b, &mut st, p, parent, name, new, ino)
                        .map(Ok);
                } else if !full && !part.exhausted && (!asked || part.reserving) {
                    asked = true;
                    self.reserve_more(&b, &mut st, p);
                    Some(p)
                } else {
                    // No number to be had (the range is used up, or asking failed), or too many
                    // names to follow: the synchronous way, in step with the partition.
                    Behind::disown(&mut st, parent);
                    kick(&self.t, &b, &mut st);
                    return None;
                }
            };
            let Some(p) = wait_for else { continue };
            let ready = b
                .wait_until(deadline.saturating_duration_since(Instant::now()), |st| {
                    st.parts.get(&p).is_none_or(|part| {
                        part.queued - part.done < QUEUE_MAX
                            && (!part.free.is_empty() || !part.reserving)
                    })
                })
                .await;
            if !ready {
                let mut st = b.lock();
                Behind::disown(&mut st, parent);
                kick(&self.t, &b, &mut st);
                return None;
            }
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn queue_create(
        &self,
        b: &Arc<Behind>,
        st: &mut State,
        p: PartitionId,
        parent: Ino,
        name: &[u8],
        new: &NewInode,
        ino: Ino,
    ) -> Option<Entry> {
        let now = file_time(now_ns());
        let dir = new.kind == FileType::Dir;
        let attr = Attr {
            ino,
            kind: new.kind,
            mode: new.mode & 0o7777,
            uid: new.uid,
            gid: new.gid,
            size: if new.kind == FileType::Symlink {
                new.target.len() as u64
            } else {
                0
            },
            nlink: if dir { 2 } else { 1 },
            rdev: new.rdev,
            atime: now,
            mtime: now,
            ctime: now,
            generation: 0,
        };
        let o = st.owned.get_mut(&parent)?;
        let parent_was = o.attr.ctime;
        o.names.insert(
            name.into(),
            Known {
                ino,
                kind: new.kind,
                single: new.kind == FileType::File,
            },
        );
        touched(&mut o.attr, i32::from(dir));
        let (parent_attr, until) = (o.attr.clone(), o.until);
        if dir {
            // Nobody can see the new directory before its command is applied, and it is
            // delegated to this client when it is: owned from now on.
            st.owned.insert(
                ino,
                Owned {
                    part: p,
                    until,
                    names: HashMap::new(),
                    attr: attr.clone(),
                },
            );
        }
        if !dir {
            if st.made.len() >= NAMES_MAX {
                st.made.retain(|_, m| m.since.elapsed() < MADE_FOR);
            }
            if st.made.len() < NAMES_MAX {
                let since = Instant::now();
                let m = Made {
                    part: p,
                    attr: attr.clone(),
                    since,
                };
                st.made.insert(ino, m);
            }
        }
        let cmd = new.command(parent, name, Some(ino));
        self.enqueue(
            b,
            st,
            p,
            Queued {
                cmd,
                dir: Some(parent),
                born: dir.then_some(ino),
            },
        );
        Some(Entry {
            attr,
            parent: Some(parent_attr),
            parent_was: Some(parent_was),
        })
    }

    /// Removes `name` from an owned `parent` behind the partition's back when this client knows
    /// it can (a file it made there, an owned empty directory); `None` when it must go the
    /// synchronous way. Returns the parent's attributes after the change and the removed inode
    /// (its last link is gone).
    pub(super) fn remove_behind(
        &self,
        parent: Ino,
        name: &[u8],
        dir: bool,
    ) -> Option<FsResult<(Vec<Attr>, Ino)>> {
        let b = self.behind()?.clone();
        let mut st = b.lock();
        let o = Behind::owned(&mut st, parent)?;
        let p = o.part;
        let Some(k) = o.names.get(name).copied() else {
            return Some(Err(MetaError::NotFound.into()));
        };
        match (dir, k.kind == FileType::Dir) {
            (true, false) => return Some(Err(MetaError::NotDir.into())),
            (false, true) => return Some(Err(MetaError::IsDir.into())),
            _ => {}
        }
        if dir {
            match Behind::owned(&mut st, k.ino) {
                Some(child) if !child.names.is_empty() => {
                    return Some(Err(MetaError::NotEmpty.into()));
                }
                Some(child) if child.part == p => {}
                _ => {
                    Behind::disown(&mut st, parent);
                    kick(&self.t, &b, &mut st);
                    return None;
                }
            }
        } else if !k.single {
            Behind::disown(&mut st, parent);
            kick(&self.t, &b, &mut st);
            return None;
        }
        if dir {
            // Its commands (all before this one in the queue) still go out.
            Behind::disown(&mut st, k.ino);
        }
        st.made.remove(&k.ino);
        let o = st.owned.get_mut(&parent)?;
        o.names.remove(name);
        touched(&mut o.attr, if dir { -1 } else { 0 });
        let parent_attr = o.attr.clone();
        let cmd = Command::Remove {
            parent,
            name: name.to_vec(),
            dir,
        };
        self.enqueue(
            &b,
            &mut st,
            p,
            Queued {
                cmd,
                dir: Some(parent),
                born: None,
            },
        );
        Some(Ok((vec![parent_attr], k.ino)))
    }

    /// Renames behind the partition's back when this client knows it can: both parents owned and
    /// in one partition, a directory only within its parent, and the destination either free
    /// or a file this client made there (whose one link the rename drops). `None` when it must
    /// go the synchronous way. Returns the parents' attributes after the change.
    pub(super) fn rename_behind(
        &self,
        src_parent: Ino,
        src_name: &[u8],
        dst_parent: Ino,
        dst_name: &[u8],
    ) -> Option<FsResult<Vec<Attr>>> {
        let b = self.behind()?.clone();
        let mut st = b.lock();
        let p = Behind::owned(&mut st, src_parent)?.part;
        if Behind::owned(&mut st, dst_parent)?.part != p {
            return None;
        }
        let src = Behind::owned(&mut st, src_parent)?
            .names
            .get(src_name)
            .copied();
        let Some(src) = src else {
            return Some(Err(MetaError::NotFound.into()));
        };
        let dst = Behind::owned(&mut st, dst_parent)?
            .names
            .get(dst_name)
            .copied();
        if let Some(d) = dst {
            if d.ino == src.ino {
                return Some(Ok(Vec::new()));
            }
            match (src.kind == FileType::Dir, d.kind == FileType::Dir) {
                (false, true) => return Some(Err(MetaError::IsDir.into())),
                (true, false) => return Some(Err(MetaError::NotDir.into())),
                _ => {}
            }
        }
        let simple = (src.kind != FileType::Dir || src_parent == dst_parent)
            && dst.is_none_or(|d| d.single && d.kind != FileType::Dir);
        if !simple {
            for d in [src_parent, dst_parent] {
                Behind::disown(&mut st, d);
            }
            kick(&self.t, &b, &mut st);
            return None;
        }
        let mut parents = Vec::new();
        let o = st.owned.get_mut(&src_parent)?;
        o.names.remove(src_name);
        if src_parent == dst_parent {
            o.names.insert(dst_name.into(), src);
        }
        touched(&mut o.attr, 0);
        parents.push(o.attr.clone());
        if src_parent != dst_parent {
            let o = st.owned.get_mut(&dst_parent)?;
            o.names.insert(dst_name.into(), src);
            touched(&mut o.attr, 0);
            parents.push(o.attr.clone());
        }
        if let Some(m) = st.made.get_mut(&src.ino) {
            m.attr.ctime = m.attr.ctime.max(file_time(now_ns()));
        }
        if let Some(d) = dst {
            st.made.remove(&d.ino);
        }
        let mut cmds = vec![Command::Rename {
            src_parent,
            src_name: src_name.to_vec(),
            dst_parent,
            dst_name: dst_name.to_vec(),
        }];
        if let Some(d) = dst {
            // The replaced file's one link goes with its name.
            cmds.push(Command::UnlinkInode { ino: d.ino });
            cmds.push(Command::EvictInode { ino: d.ino });
        }
        for cmd in cmds {
            self.enqueue(
                &b,
                &mut st,
                p,
                Queued {
                    cmd,
                    dir: Some(dst_parent),
                    born: None,
                },
            );
        }
        Some(Ok(parents))
    }

    /// The attributes of a file this client made (within [`MADE_FOR`]), as its own changes left
    /// them: what a lookup or getattr answers without waiting for the queue to reach its
    /// partition (another client's change of them is missed for at most that long).
    pub(super) fn made_attr(&self, ino: Ino) -> Option<Attr> {
        let b = self.behind()?;
        let st = b.lock();
        let m = st.made.get(&ino)?;
        (m.since.elapsed() < MADE_FOR).then(|| m.attr.clone())
    }

    /// `ino` is a file this client made (within [`MADE_FOR`]) and has set no extended attribute
    /// on since: it has none (a `setxattr` goes the synchronous way and forgets the file).
    pub(super) fn made_bare(&self, ino: Ino) -> bool {
        self.behind().is_some_and(|b| {
            b.lock()
                .made
                .get(&ino)
                .is_some_and(|m| m.since.elapsed() < MADE_FOR)
        })
    }

    /// Changes the attributes of an owned directory, or of a file this client made, behind the
    /// partition's back (not a size: truncation frees data, the synchronous way); `None` when
    /// it must go the synchronous way. Returns the attributes after the change as this client
    /// knows them.
    pub(super) fn setattr_behind(&self, ino: Ino, set: &SetAttr) -> Option<FsResult<Attr>> {
        if set.size.is_some() {
            return None;
        }
        let b = self.behind()?.clone();
        let mut st = b.lock();
        if let Some(o) = Behind::owned(&mut st, ino) {
            // An owned directory's attributes are this client's to answer for and change.
            let p = o.part;
            if st
                .parts
                .get(&p)
                .is_some_and(|part| part.queued - part.done >= QUEUE_MAX)
            {
                return None;
            }
            let o = st.owned.get_mut(&ino)?;
            set_attr(&mut o.attr, set);
            let attr = o.attr.clone();
            let cmd = Command::SetAttr {
                ino,
                set: set.clone(),
            };
            let q = Queued {
                cmd,
                dir: Some(ino),
                born: None,
            };
            self.enqueue(&b, &mut st, p, q);
            return Some(Ok(attr));
        }
        let m = st.made.get(&ino)?;
        let p = m.part;
        let full = st
            .parts
            .get(&p)
            .is_some_and(|part| part.queued - part.done >= QUEUE_MAX);
        if m.since.elapsed() >= MADE_FOR || full {
            st.made.remove(&ino);
            return None;
        }
        let m = st.made.get_mut(&ino)?;
        set_attr(&mut m.attr, set);
        let attr = m.attr.clone();
        let cmd = if set.kill_suidgid {
            Command::SetAttrKillSuid {
                ino,
                set: set.clone(),
            }
        } else {
            Command::SetAttr {
                ino,
                set: set.clone(),
            }
        };
        self.enqueue_file(&b, &mut st, p, cmd);
        Some(Ok(attr))
    }

    /// Records written pieces of `ino` behind the partition's back: queued after every command
    /// this client queued before (its create among them), sent in the partition's next batch;
    /// then `times` (set explicitly while the piece was being written), which the key's commit
    /// would otherwise stamp over. Waits while the queue is full (at most [`WAIT_MAX`], then
    /// queues anyway: data is never dropped for want of room). A removed file's key is dropped
    /// without an error; any other failure is reported by the next `settle`. Without
    /// write-behind, both are applied before this returns.
    pub(crate) async fn append_extents_behind(
        &self,
        ino: Ino,
        keys: Vec<ExtentKey>,
        times: Option<SetAttr>,
    ) -> FsResult<Option<Applied>> {
        let Some(b) = self.behind().cloned() else {
            self.append_extents(ino, keys).await?;
            if let Some(set) = times {
                self.setattr(ino, set).await?;
            }
            return Ok(None);
        };
        let p = self.partition_of(ino)?;
        b.wait_until(WAIT_MAX, |st| {
            st.parts
                .get(&p)
                .is_none_or(|part| part.queued - part.done < QUEUE_MAX)
        })
        .await;
        let mut st = b.lock();
        if let Some(m) = st.made.get_mut(&ino) {
            let now = file_time(now_ns());
            m.attr.size = m
                .attr
                .size
                .max(keys.iter().map(ExtentKey::end).max().unwrap_or(0));
            m.attr.mtime = now;
            m.attr.ctime = m.attr.ctime.max(now);
            if let Some(t) = &times {
                m.attr.atime = t.atime.unwrap_or(m.attr.atime);
                m.attr.mtime = t.mtime.unwrap_or(m.attr.mtime);
            }
        }
        let cmds = std::iter::once(Command::AppendExtents { ino, extents: keys })
            .chain(times.map(|set| Command::SetAttr { ino, set }));
        for cmd in cmds {
            self.enqueue_file(&b, &mut st, p, cmd);
        }
        let queued = st.parts.get(&p).map_or(0, |part| part.queued);
        Ok(Some(Applied(p, queued)))
    }

    /// Waits until the commands `marks` name are applied (or given up), at most as long as a
    /// batch is retried.
    pub(crate) async fn applied(&self, marks: &[Applied]) {
        let Some(b) = self.behind() else { return };
        {
            let mut st = b.lock();
            for Applied(p, _) in marks {
                if let Some(part) = st.parts.get_mut(p) {
                    part.urgent |= part.done < part.queued;
                }
            }
        }
        b.progress.notify_waiters();
        b.wait_until(RETRY_FOR + WAIT_MAX, |st| {
            marks
                .iter()
                .all(|Applied(p, n)| st.parts.get(p).is_none_or(|part| part.done >= *n))
        })
        .await;
    }

    /// Queues a command about a file (no directory's delegation needed for it).
    fn enqueue_file(&self, b: &Arc<Behind>, st: &mut State, p: PartitionId, cmd: Command) {
        let q = Queued {
            cmd,
            dir: None,
            born: None,
        };
        self.enqueue(b, st, p, q);
    }

    fn enqueue(&self, b: &Arc<Behind>, st: &mut State, p: PartitionId, q: Queued) {
        let part = st.parts.entry(p).or_default();
        // Only names need inode numbers.
        let names = q.dir.is_some();
        part.queue.push(q);
        part.queued += 1;
        if part.queue.len() == BATCH_MAX {
            // A full batch goes without lingering.
            b.progress.notify_waiters();
        }
        let low = names && part.stock() < RESERVE_LOW;
        st.metrics.queued();
        kick(&self.t, b, st);
        if low {
            self.reserve_more(b, st, p);
        }
    }

    /// Asks `p` for more inode numbers in the background, unless that is under way.
    fn reserve_more(&self, b: &Arc<Behind>, st: &mut State, p: PartitionId) {
        let part = st.parts.entry(p).or_default();
        if part.reserving || part.exhausted || part.stock() >= RESERVE_LOW {
            return;
        }
        part.reserving = true;
        let (t, b) = (self.t.clone(), b.clone());
        tokio::spawn(async move {
            // Fewer when the range has fewer left; none at all when it is used up.
            let mut count = RESERVE;
            let got = loop {
                match t.write(p, Command::Reserve { count }).await {
                    Ok(Err(MetaError::NoInodes)) if count > 1 => count /= 2,
                    other => break other,
                }
            };
            let mut st = b.lock();
            let part = st.parts.entry(p).or_default();
            part.reserving = false;
            match got {
                Ok(Ok(Reply::Reserved { start, end })) if start < end => {
                    part.free.push_back((start, end));
                }
                Ok(Err(MetaError::NoInodes)) => part.exhausted = true,
                other => {
                    tracing::debug!(partition = %p, reply = ?other, "no inode numbers reserved")
                }
            }
            drop(st);
            b.progress.notify_waiters();
        });
    }

    fn start_poller(&self, b: &Arc<Behind>, st: &mut State) {
        if st.polling {
            return;
        }
        st.polling = true;
        tokio::spawn(poll(self.t.clone(), b.clone()));
    }
}

/// Starts a pump for every partition with queued commands and none running.
fn kick<T: MetaTransport>(t: &Arc<T>, b: &Arc<Behind>, st: &mut State) {
    for (p, part) in st.parts.iter_mut() {
        if !part.sending && !part.queue.is_empty() {
            part.sending = true;
            tokio::spawn(pump(t.clone(), b.clone(), *p));
        }
    }
}

/// Sends partition `p`'s queue, one batch at a time, until it is empty; each batch waits up to
/// [`LINGER`] for more commands unless it is full or someone waits for it.
async fn pump<T: MetaTransport>(t: Arc<T>, b: Arc<Behind>, p: PartitionId) {
    let ready = |st: &mut State| {
        st.parts
            .get(&p)
            .is_none_or(|part| part.urgent || part.queue.len() >= BATCH_MAX)
    };
    loop {
        if !ready(&mut b.lock()) {
            b.wait_until(LINGER, ready).await;
        }
        let (seq, batch) = {
            let mut st = b.lock();
            let part = st.parts.entry(p).or_default();
            if part.queue.is_empty() {
                part.sending = false;
                part.urgent = false;
                return;
            }
            let n = part.queue.len().min(BATCH_MAX);
            if n == part.queue.len() {
                part.urgent = false;
            }
            part.seq += 1;
            (part.seq, part.queue.drain(..n).collect::<Vec<Queued>>())
        };
        let cmd = Command::Batch {
            client: b.client,
            seq,
            ops: batch.iter().map(|q| q.cmd.clone()).collect(),
        };
        let sent = Instant::now();
        let outcome = send(&*t, p, cmd).await;
        let mut st = b.lock();
        match outcome {
            Ok((results, recalled)) => {
                st.metrics.batches.inc();
                for (q, r) in batch.iter().zip(results.iter()) {
                    match r {
                        Ok(_) => {}
                        Err(MetaError::NotFound) if q.dir.is_none() => {
                            // The file was removed before its keys arrived: nothing to record.
                            tracing::debug!(partition = %p, cmd = ?q.cmd, "extent keys of a removed file dropped");
                        }
                        Err(e) => {
                            st.metrics.failed.inc();
                            tracing::warn!(partition = %p, cmd = ?q.cmd, error = %e, "a metadata change written behind failed");
                            st.failed.get_or_insert_with(|| format!("{:?}: {e}", q.cmd));
                            if let Some(d) = q.dir {
                                Behind::disown(&mut st, d);
                            }
                        }
                    }
                }
                for d in &recalled {
                    Behind::disown(&mut st, *d);
                }
                let until = lease_end(sent);
                for q in &batch {
                    for d in q.dir.into_iter().chain(q.born) {
                        if let Some(o) = st.owned.get_mut(&d)
                            && !recalled.contains(&d)
                            && o.until < until
                        {
                            o.until = until;
                        }
                    }
                }
            }
            Err(e) => {
                tracing::warn!(partition = %p, commands = batch.len(), error = %e, "metadata changes written behind were given up");
                st.failed.get_or_insert_with(|| e.to_string());
                st.metrics.failed.inc_by(batch.len() as u64);
                for q in &batch {
                    for d in q.dir.into_iter().chain(q.born) {
                        Behind::disown(&mut st, d);
                    }
                }
            }
        }
        if let Some(part) = st.parts.get_mut(&p) {
            part.done += batch.len() as u64;
        }
        st.metrics.pending.dec_by(batch.len() as i64);
        // Releases queued for other partitions by the disowning above.
        kick(&t, &b, &mut st);
        drop(st);
        b.progress.notify_waiters();
    }
}

/// Why a batch was given up (every command in it counts as failed).
#[derive(Debug, thiserror::Error)]
enum BatchError {
    #[error("unexpected reply {0:?}")]
    UnexpectedReply(Reply),
    /// The partition refused the batch as a whole.
    #[error(transparent)]
    Meta(MetaError),
    /// No outcome before the retries ran out.
    #[error(transparent)]
    Call(CallError),
}

/// One batch, retried with the same number (the partition applies it once) while the partition
/// is unavailable or the outcome unknown, for at most `RETRY_FOR`.
async fn send<T: MetaTransport>(
    t: &T,
    p: PartitionId,
    cmd: Command,
) -> Result<(Vec<Result<Reply, MetaError>>, Vec<Ino>), BatchError> {
    let deadline = Instant::now() + RETRY_FOR;
    let mut pause = Duration::from_millis(5);
    loop {
        match t.write(p, cmd.clone()).await {
            Ok(Ok(Reply::Batch { results, recalled })) => return Ok((results, recalled)),
            Ok(Ok(other)) => return Err(BatchError::UnexpectedReply(other)),
            Ok(Err(e)) => return Err(BatchError::Meta(e)),
            Err(e) => {
                if Instant::now() + pause >= deadline {
                    return Err(BatchError::Call(e));
                }
                tracing::debug!(partition = %p, error = %e, "batch retried");
            }
        }
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(Duration::from_millis(500));
    }
}

/// While this client owns directories: forgets the ones whose delegation ran out, and asks
/// their partitions which were recalled, to give those back behind their pending commands.
async fn poll<T: MetaTransport>(t: Arc<T>, b: Arc<Behind>) {
    loop {
        tokio::time::sleep(POLL).await;
        let parts: Vec<PartitionId> = {
            let mut st = b.lock();
            let now = Instant::now();
            st.owned.retain(|_, o| o.until > now);
            if st.owned.is_empty() {
                st.polling = false;
                return;
            }
            let mut parts: Vec<PartitionId> = st.owned.values().map(|o| o.part).collect();
            parts.sort_unstable();
            parts.dedup();
            parts
        };
        for p in parts {
            let q = Query::Recalled { client: b.client };
            let Ok(Ok(Reply::Inos(dirs))) = t.read(p, q).await else {
                continue;
            };
            if dirs.is_empty() {
                continue;
            }
            let mut st = b.lock();
            for d in &dirs {
                Behind::disown(&mut st, *d);
            }
            kick(&t, &b, &mut st);
        }
        renew(&*t, &b).await;
    }
}

/// Renews, a partition at a time, the delegations of owned directories that would otherwise
/// end within [`RENEW_BEFORE`], while all owned directories together hold at most
/// [`OWNED_NAMES_MAX`] names: a tree this client made stays its own while it lives, unless
/// another client recalls it.
async fn renew<T: MetaTransport>(t: &T, b: &Behind) {
    let due: HashMap<PartitionId, Vec<Ino>> = {
        let st = b.lock();
        let names: usize = st.owned.values().map(|o| o.names.len()).sum();
        if names > OWNED_NAMES_MAX {
            return;
        }
        let soon = Instant::now() + RENEW_BEFORE;
        let mut due: HashMap<PartitionId, Vec<Ino>> = HashMap::new();
        for (dir, o) in &st.owned {
            if o.until < soon {
                due.entry(o.part).or_default().push(*dir);
            }
        }
        due
    };
    for (p, dirs) in due {
        let sent = Instant::now();
        let cmd = Command::As {
            client: b.client,
            cmd: Box::new(Command::Renew { dirs }),
        };
        match t.write(p, cmd).await {
            Ok(Ok(Reply::Inos(renewed))) => {
                let mut st = b.lock();
                let until = lease_end(sent);
                for d in renewed {
                    if let Some(o) = st.owned.get_mut(&d)
                        && o.until < until
                    {
                        o.until = until;
                    }
                }
            }
            other => tracing::debug!(partition = %p, reply = ?other, "delegations not renewed"),
        }
    }
}
