//! [`MetaCache`]: attributes by inode and dentries by (parent, name), each kept for a short TTL in
//! a bounded table with CLOCK eviction (docs/design.md §8: the client caches inodes and dentries
//! for a short TTL and refreshes them on open).
//!
//! **Served from the cache:** `getattr` (a fresh attribute), `lookup` (a fresh dentry *and* a fresh
//! attribute of its inode). `lookup`, `getattr`, `readdir` and the creating calls fill it. `open`
//! drops the inode's attribute, so the next `getattr` after an open reads the truth.
//!
//! **Missing names** are answered without asking only in a *complete* directory: one whose every
//! entry this client knows, as of the directory's ctime at some moment. A directory becomes
//! complete when this client makes it (`mkdir`: empty, at the ctime it was made with) and stays
//! complete through this client's own creates in it, as long as each create reports that it found
//! the directory at exactly the ctime the cache holds (`Entry::parent_was`): the meta partition
//! moves a directory's ctime forward on every change of its entries, so nothing else changed it in
//! between. Any other change that passes through (remove, rename, setattr, a create that could not
//! tell), a lookup that finds a name the cache did not know, or the TTL running out since the last
//! such confirmation, ends it. A name another client adds to a complete directory is thus missed
//! for at most the dentry TTL, as a name it removes is still served for at most that long. Through
//! FUSE this saves the meta request of the `LOOKUP` the kernel sends before every create and
//! mkdir of a new name.
//!
//! **Invalidation.** Every mutation passing through drops what it may change, after the inner call
//! returns and whether or not it failed (a failed call may have been applied):
//!
//! | call | dropped |
//! | --- | --- |
//! | setattr, setxattr, removexattr, open | the inode's attribute |
//! | create, mkdir, symlink | the parent's attribute (the new dentry and attribute are cached) |
//! | link | the new parent's and the inode's attributes (then cached anew) |
//! | unlink, rmdir | the dentry, the parent's and the target's attributes |
//! | rename | both dentries, both parents', the moved and the replaced inode's attributes |
//! | write, fallocate, flush, fsync, release | the file's attribute |
//!
//! A call that changed a directory's entries returns the directory's attributes right after the
//! change when it learnt them (one meta request does the change and answers them); they are cached
//! in place of the dropped ones. That matters through FUSE: the kernel asks for the parent's
//! attributes (to check permissions) before every create or remove in it, and would otherwise find
//! them just dropped by the previous one.
//!
//! unlink, rmdir and rename need the target inodes: from a fresh cached dentry, else from a lookup
//! underneath before the call.
//!
//! **Races inside this client.** A fill that raced with an invalidation of the same key would
//! bring back what the mutation made stale. Every invalidation stamps its key's stripe with a
//! sequence number; a fill is dropped when its key's stripe was stamped after the fill's call
//! began. Changes by *other* clients are seen within the TTL (CFS semantics: no leases).

use std::borrow::Borrow;
use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use bytes::Bytes;
use nacre_api::meta::{Attr, FileType, MetaError, SetAttr, XattrMode};
use nacre_types::Ino;
use tokio::time::Instant;

use crate::fs::{Caller, DirEntryPlus, Falloc, Fh, FileSystem, OpenFlags, StatFs};
use crate::meta::{Entry, FsError, FsResult};

/// How long and how much [`MetaCache`] keeps.
#[derive(Clone, Debug)]
pub struct MetaCacheConfig {
    /// How long an inode's attributes are served without asking.
    pub attr_ttl: Duration,
    /// How long a dentry is served without asking.
    pub entry_ttl: Duration,
    /// Most attributes kept, and separately most dentries (0 turns the cache off).
    pub capacity: usize,
}

impl Default for MetaCacheConfig {
    fn default() -> Self {
        Self {
            attr_ttl: Duration::from_secs(1),
            entry_ttl: Duration::from_secs(1),
            capacity: 100_000,
        }
    }
}

/// What the cache did so far.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CacheStats {
    /// `getattr` and `lookup` calls answered from the cache.
    pub hits: u64,
    /// `getattr` and `lookup` calls passed to the inner file system.
    pub misses: u64,
    /// Attributes and dentries held now (fresh or not yet evicted).
    pub attrs: usize,
    pub entries: usize,
}

/// A metadata cache over `inner`.
#[derive(Debug)]
pub struct MetaCache<F> {
    inner: F,
    cfg: MetaCacheConfig,
    state: Mutex<State>,
    hits: AtomicU64,
    misses: AtomicU64,
}

/// Stripes of invalidation stamps (per table); more stripes, fewer fills dropped needlessly.
const STRIPES: usize = 1024;

/// Most complete directories kept, and most names kept per complete directory.
const COMPLETE_DIRS: usize = 4096;
const COMPLETE_NAMES: usize = 16_384;

/// A directory whose every entry this client knows (see the module docs).
#[derive(Debug)]
struct Complete {
    /// The directory's ctime when `names` were its entries.
    ctime: i64,
    names: std::collections::HashSet<Vec<u8>>,
    /// Until when a missing name is answered without asking.
    expires: Instant,
}

#[derive(Debug)]
struct State {
    attrs: Clock<Ino, Attr>,
    entries: Clock<(Ino, Vec<u8>), Ino>,
    /// Sequence of invalidations.
    seq: u64,
    /// Per stripe, the `seq` of the last invalidation of a key hashing to it.
    attr_stamps: Vec<u64>,
    entry_stamps: Vec<u64>,
    /// The inode of every handle opened through this layer (writes invalidate its attributes).
    handles: HashMap<Fh, Ino>,
    /// Complete directories; an invalidation of a directory's attribute ends its completeness.
    complete: HashMap<Ino, Complete>,
    /// While `complete` is full: the earliest time one of its entries expires. Until then a new
    /// directory is not recorded without looking through the table (which cost every mkdir a
    /// scan of thousands of entries once it filled).
    complete_full_until: Option<Instant>,
}

fn attr_stripe(ino: Ino) -> usize {
    (ino.0.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 54) as usize % STRIPES
}

fn entry_stripe(parent: Ino, name: &[u8]) -> usize {
    let mut h = std::hash::DefaultHasher::new();
    parent.0.hash(&mut h);
    name.hash(&mut h);
    h.finish() as usize % STRIPES
}

impl State {
    fn inval_attr(&mut self, ino: Ino) {
        self.seq += 1;
        self.attr_stamps[attr_stripe(ino)] = self.seq;
        self.attrs.remove(&ino);
        self.complete.remove(&ino);
    }

    /// Records `dir` as complete (at `c.ctime`, with `c.names`), unless the table is full of
    /// unexpired ones or the directory has too many names to keep.
    fn set_complete(&mut self, dir: Ino, c: Complete, now: Instant) {
        if c.names.len() > COMPLETE_NAMES {
            return;
        }
        if self.complete.len() >= COMPLETE_DIRS && !self.complete.contains_key(&dir) {
            if self.complete_full_until.is_some_and(|t| now < t) {
                return;
            }
            self.complete.retain(|_, c| c.expires > now);
            if self.complete.len() >= COMPLETE_DIRS {
                self.complete_full_until = self.complete.values().map(|c| c.expires).min();
                return;
            }
        }
        self.complete_full_until = None;
        self.complete.insert(dir, c);
    }

    /// Whether `name` is known to be missing from `parent` at `now`.
    fn known_missing(&self, parent: Ino, name: &[u8], now: Instant) -> bool {
        self.complete
            .get(&parent)
            .is_some_and(|c| c.expires > now && !c.names.contains(name))
            && nacre_api::meta::check_name(name).is_ok()
    }

    fn inval_entry(&mut self, parent: Ino, name: &[u8]) {
        self.seq += 1;
        self.entry_stamps[entry_stripe(parent, name)] = self.seq;
        self.entries.remove(&(parent, name.to_vec()));
    }

    /// Caches `attr` unless its inode was invalidated after `since`.
    fn fill_attr(&mut self, since: u64, attr: &Attr, expires: Instant) {
        if self.attr_stamps[attr_stripe(attr.ino)] <= since {
            self.attrs.insert(attr.ino, attr.clone(), expires);
        }
    }

    fn fill_entry(&mut self, since: u64, parent: Ino, name: &[u8], ino: Ino, expires: Instant) {
        if self.entry_stamps[entry_stripe(parent, name)] <= since {
            self.entries.insert((parent, name.to_vec()), ino, expires);
        }
    }

    /// Drops `ino`'s attribute and, unless another invalidation raced with the call that began
    /// at `since`, caches `attr` (the call's answer) in its place.
    fn replace_attr(&mut self, since: u64, ino: Ino, attr: Option<&Attr>, expires: Instant) {
        self.replace_attrs(since, &[(ino, attr)], expires);
    }

    /// [`State::replace_attr`] for several inodes changed by one call: whether each raced is
    /// decided before any is dropped (they may share a stripe).
    fn replace_attrs(&mut self, since: u64, changed: &[(Ino, Option<&Attr>)], expires: Instant) {
        let raced: Vec<bool> = changed
            .iter()
            .map(|(ino, _)| self.attr_stamps[attr_stripe(*ino)] > since)
            .collect();
        for (ino, _) in changed {
            self.inval_attr(*ino);
        }
        for (&(ino, attr), raced) in changed.iter().zip(raced) {
            if let Some(a) = attr.filter(|a| !raced && a.ino == ino) {
                self.attrs.insert(ino, a.clone(), expires);
            }
        }
    }

    fn replace_entry(&mut self, since: u64, parent: Ino, name: &[u8], ino: Ino, expires: Instant) {
        let raced = self.entry_stamps[entry_stripe(parent, name)] > since;
        self.inval_entry(parent, name);
        if !raced {
            self.entries.insert((parent, name.to_vec()), ino, expires);
        }
    }
}

impl<F: FileSystem> MetaCache<F> {
    pub fn new(inner: F) -> Self {
        Self::with_config(inner, MetaCacheConfig::default())
    }

    pub fn with_config(inner: F, cfg: MetaCacheConfig) -> Self {
        Self {
            inner,
            state: Mutex::new(State {
                attrs: Clock::new(cfg.capacity),
                entries: Clock::new(cfg.capacity),
                seq: 0,
                attr_stamps: vec![0; STRIPES],
                entry_stamps: vec![0; STRIPES],
                handles: HashMap::new(),
                complete: HashMap::new(),
                complete_full_until: None,
            }),
            cfg,
            hits: AtomicU64::new(0),
            misses: AtomicU64::new(0),
        }
    }

    pub fn inner(&self) -> &F {
        &self.inner
    }

    pub fn config(&self) -> &MetaCacheConfig {
        &self.cfg
    }

    pub fn stats(&self) -> CacheStats {
        let st = self.lock();
        CacheStats {
            hits: self.hits.load(Ordering::Relaxed),
            misses: self.misses.load(Ordering::Relaxed),
            attrs: st.attrs.len(),
            entries: st.entries.len(),
        }
    }

    /// Forgets every cached attribute and dentry (open handles stay known).
    pub fn clear(&self) {
        let mut st = self.lock();
        st.seq += 1;
        let seq = st.seq;
        st.attr_stamps.fill(seq);
        st.entry_stamps.fill(seq);
        st.attrs.clear();
        st.entries.clear();
        st.complete.clear();
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // The state is consistent between statements: a panic elsewhere cannot leave it torn.
        nacre_types::sync::lock(&self.state)
    }

    fn begin(&self) -> (u64, Instant) {
        (self.lock().seq, Instant::now())
    }

    fn attr_expiry(&self, began: Instant) -> Instant {
        began + self.cfg.attr_ttl
    }

    fn entry_expiry(&self, began: Instant) -> Instant {
        began + self.cfg.entry_ttl
    }

    /// The inode `parent/name` names: from a fresh dentry, else asked underneath (`None` if it
    /// does not exist or cannot be found out).
    async fn target(&self, parent: Ino, name: &[u8]) -> Option<Ino> {
        let cached = self
            .lock()
            .entries
            .get(&(parent, name.to_vec()), Instant::now())
            .copied();
        match cached {
            Some(ino) => Some(ino),
            None => self.inner.lookup(parent, name).await.ok().map(|a| a.ino),
        }
    }

    /// Drops the attribute of the file `fh` is open on (`forget`: and forgets the handle).
    fn written(&self, fh: Fh, forget: bool) {
        let mut st = self.lock();
        let ino = if forget {
            st.handles.remove(&fh)
        } else {
            st.handles.get(&fh).copied()
        };
        if let Some(ino) = ino {
            st.inval_attr(ino);
        }
    }

    fn attr_changed(&self, ino: Ino) {
        self.lock().inval_attr(ino);
    }

    /// After a create-like call: the new dentry and attribute cached, the parent's attribute
    /// replaced by the one the call returned (dropped when it returned none, or failed).
    ///
    /// The parent stays complete when it was and the call found it at the ctime the cache holds;
    /// a new directory starts complete.
    fn created(&self, since: u64, began: Instant, parent: Ino, name: &[u8], e: Option<&Entry>) {
        let mut st = self.lock();
        let dir = e.and_then(|e| e.parent.as_ref());
        // Taken out before the parent's attribute is replaced (which would drop it).
        let was_complete = st.complete.remove(&parent);
        match e {
            Some(e) => {
                st.replace_entry(since, parent, name, e.attr.ino, self.entry_expiry(began));
                let changed = [(e.attr.ino, Some(&e.attr)), (parent, dir)];
                st.replace_attrs(since, &changed, self.attr_expiry(began));
                let now = Instant::now();
                if let (Some(mut c), Some(was), Some(after)) = (was_complete, e.parent_was, dir)
                    && c.ctime == was
                    && after.ctime > was
                {
                    c.names.insert(name.to_vec());
                    c.ctime = after.ctime;
                    c.expires = self.entry_expiry(began);
                    st.set_complete(parent, c, now);
                }
                if e.attr.kind == FileType::Dir && e.parent_was.is_some() {
                    let fresh = Complete {
                        ctime: e.attr.ctime,
                        names: std::collections::HashSet::new(),
                        expires: self.entry_expiry(began),
                    };
                    st.set_complete(e.attr.ino, fresh, now);
                }
            }
            None => st.inval_attr(parent),
        }
    }

    /// After a call that removed or moved names: `dirs`' attributes replaced by those the call
    /// returned (`answer`; dropped when it returned none, or failed), `others`' dropped.
    fn dirs_changed(
        &self,
        since: u64,
        began: Instant,
        dirs: &[Ino],
        answer: Option<&Vec<Attr>>,
        others: &[Ino],
    ) {
        let returned = |d: Ino| answer.and_then(|v| v.iter().find(|a| a.ino == d));
        let changed: Vec<(Ino, Option<&Attr>)> = dirs
            .iter()
            .map(|&d| (d, returned(d)))
            .chain(others.iter().map(|&o| (o, None)))
            .collect();
        self.lock()
            .replace_attrs(since, &changed, self.attr_expiry(began));
    }
}

impl<F: FileSystem> FileSystem for MetaCache<F> {
    async fn lookup(&self, parent: Ino, name: &[u8]) -> FsResult<Attr> {
        let (since, began) = {
            let now = Instant::now();
            let mut st = self.lock();
            if let Some(ino) = st.entries.get(&(parent, name.to_vec()), now).copied()
                && let Some(a) = st.attrs.get(&ino, now)
            {
                self.hits.fetch_add(1, Ordering::Relaxed);
                return Ok(a.clone());
            }
            if st.known_missing(parent, name, now) {
                self.hits.fetch_add(1, Ordering::Relaxed);
                return Err(FsError::Meta(MetaError::NotFound));
            }
            (st.seq, now)
        };
        self.misses.fetch_add(1, Ordering::Relaxed);
        let r = self.inner.lookup(parent, name).await;
        let mut st = self.lock();
        match &r {
            Ok(a) => {
                if st
                    .complete
                    .get(&parent)
                    .is_some_and(|c| !c.names.contains(name))
                {
                    // Someone else added it: this client no longer knows every entry.
                    st.complete.remove(&parent);
                }
                st.fill_entry(since, parent, name, a.ino, self.entry_expiry(began));
                st.fill_attr(since, a, self.attr_expiry(began));
            }
            Err(FsError::Meta(MetaError::NotFound)) => {
                st.entries.remove(&(parent, name.to_vec()));
            }
            Err(_) => {}
        }
        r
    }

    async fn getattr(&self, ino: Ino) -> FsResult<Attr> {
        let (since, began) = {
            let now = Instant::now();
            let mut st = self.lock();
            if let Some(a) = st.attrs.get(&ino, now) {
                self.hits.fetch_add(1, Ordering::Relaxed);
                return Ok(a.clone());
            }
            (st.seq, now)
        };
        self.misses.fetch_add(1, Ordering::Relaxed);
        let r = self.inner.getattr(ino).await;
        let mut st = self.lock();
        match &r {
            Ok(a) => st.fill_attr(since, a, self.attr_expiry(began)),
            Err(FsError::Meta(MetaError::NotFound)) => {
                st.attrs.remove(&ino);
            }
            Err(_) => {}
        }
        r
    }

    async fn setattr(&self, ino: Ino, set: SetAttr) -> FsResult<Attr> {
        let (since, began) = self.begin();
        let r = self.inner.setattr(ino, set).await;
        self.lock()
            .replace_attr(since, ino, r.as_ref().ok(), self.attr_expiry(began));
        r
    }

    async fn create(
        &self,
        parent: Ino,
        name: &[u8],
        mode: u32,
        caller: Caller,
        flags: OpenFlags,
    ) -> FsResult<(Entry, Fh)> {
        let (since, began) = self.begin();
        let r = self.inner.create(parent, name, mode, caller, flags).await;
        self.created(since, began, parent, name, r.as_ref().ok().map(|(e, _)| e));
        if let Ok((e, fh)) = &r {
            self.lock().handles.insert(*fh, e.attr.ino);
        }
        r
    }

    async fn mkdir(&self, parent: Ino, name: &[u8], mode: u32, caller: Caller) -> FsResult<Entry> {
        let (since, began) = self.begin();
        let r = self.inner.mkdir(parent, name, mode, caller).await;
        self.created(since, began, parent, name, r.as_ref().ok());
        r
    }

    async fn symlink(
        &self,
        parent: Ino,
        name: &[u8],
        target: &[u8],
        caller: Caller,
    ) -> FsResult<Entry> {
        let (since, began) = self.begin();
        let r = self.inner.symlink(parent, name, target, caller).await;
        self.created(since, began, parent, name, r.as_ref().ok());
        r
    }

    async fn mknod(
        &self,
        parent: Ino,
        name: &[u8],
        kind: FileType,
        mode: u32,
        rdev: u32,
        caller: Caller,
    ) -> FsResult<Entry> {
        let (since, began) = self.begin();
        let r = self
            .inner
            .mknod(parent, name, kind, mode, rdev, caller)
            .await;
        self.created(since, began, parent, name, r.as_ref().ok());
        r
    }

    async fn link(&self, ino: Ino, new_parent: Ino, new_name: &[u8]) -> FsResult<Entry> {
        let (since, began) = self.begin();
        let r = self.inner.link(ino, new_parent, new_name).await;
        // Success replaces the inode's attribute (new link count); a failed call may have
        // applied it all the same.
        self.created(since, began, new_parent, new_name, r.as_ref().ok());
        if r.is_err() {
            self.lock().inval_attr(ino);
        }
        r
    }

    async fn unlink(&self, parent: Ino, name: &[u8]) -> FsResult<Vec<Attr>> {
        let target = self.target(parent, name).await;
        let (since, began) = self.begin();
        let r = self.inner.unlink(parent, name).await;
        self.lock().inval_entry(parent, name);
        self.dirs_changed(since, began, &[parent], r.as_ref().ok(), target.as_slice());
        r
    }

    async fn rmdir(&self, parent: Ino, name: &[u8]) -> FsResult<Vec<Attr>> {
        let target = self.target(parent, name).await;
        let (since, began) = self.begin();
        let r = self.inner.rmdir(parent, name).await;
        self.lock().inval_entry(parent, name);
        self.dirs_changed(since, began, &[parent], r.as_ref().ok(), target.as_slice());
        r
    }

    async fn rename(
        &self,
        parent: Ino,
        name: &[u8],
        new_parent: Ino,
        new_name: &[u8],
    ) -> FsResult<Vec<Attr>> {
        let moved = self.target(parent, name).await;
        let replaced = self.target(new_parent, new_name).await;
        let (since, began) = self.begin();
        let r = self.inner.rename(parent, name, new_parent, new_name).await;
        {
            let mut st = self.lock();
            st.inval_entry(parent, name);
            st.inval_entry(new_parent, new_name);
        }
        let others: Vec<Ino> = moved.into_iter().chain(replaced).collect();
        let dirs: &[Ino] = if parent == new_parent {
            &[parent]
        } else {
            &[parent, new_parent]
        };
        self.dirs_changed(since, began, dirs, r.as_ref().ok(), &others);
        r
    }

    async fn readlink(&self, ino: Ino) -> FsResult<Vec<u8>> {
        self.inner.readlink(ino).await
    }

    async fn readdir(
        &self,
        dir: Ino,
        after: Option<Vec<u8>>,
        limit: u32,
    ) -> FsResult<Vec<DirEntryPlus>> {
        let (since, began) = self.begin();
        let r = self.inner.readdir(dir, after, limit).await;
        if let Ok(entries) = &r {
            let mut st = self.lock();
            for e in entries {
                st.fill_entry(
                    since,
                    dir,
                    &e.entry.name,
                    e.entry.ino,
                    self.entry_expiry(began),
                );
                if let Some(a) = &e.attr {
                    st.fill_attr(since, a, self.attr_expiry(began));
                }
            }
        }
        r
    }

    async fn open(&self, ino: Ino, flags: OpenFlags) -> FsResult<Fh> {
        let r = self.inner.open(ino, flags).await;
        let mut st = self.lock();
        // Refreshed on open: another client may have changed the file.
        st.inval_attr(ino);
        if let Ok(fh) = &r {
            st.handles.insert(*fh, ino);
        }
        r
    }

    async fn read(&self, fh: Fh, offset: u64, len: u32) -> FsResult<Bytes> {
        self.inner.read(fh, offset, len).await
    }

    async fn write(&self, fh: Fh, offset: u64, data: Bytes) -> FsResult<u32> {
        let r = self.inner.write(fh, offset, data).await;
        self.written(fh, false);
        r
    }

    async fn fallocate(&self, fh: Fh, mode: Falloc, offset: u64, len: u64) -> FsResult<()> {
        let r = self.inner.fallocate(fh, mode, offset, len).await;
        self.written(fh, false);
        r
    }

    async fn flush(&self, fh: Fh) -> FsResult<()> {
        let r = self.inner.flush(fh).await;
        self.written(fh, false);
        r
    }

    async fn fsync(&self, fh: Fh) -> FsResult<()> {
        let r = self.inner.fsync(fh).await;
        self.written(fh, false);
        r
    }

    async fn sync_dir(&self, dir: Ino) -> FsResult<()> {
        self.inner.sync_dir(dir).await
    }

    async fn release(&self, fh: Fh) -> FsResult<()> {
        let r = self.inner.release(fh).await;
        self.written(fh, true);
        r
    }

    async fn statfs(&self) -> FsResult<StatFs> {
        self.inner.statfs().await
    }

    async fn getxattr(&self, ino: Ino, name: &[u8]) -> FsResult<Vec<u8>> {
        self.inner.getxattr(ino, name).await
    }

    async fn setxattr(&self, ino: Ino, name: &[u8], value: &[u8], mode: XattrMode) -> FsResult<()> {
        let r = self.inner.setxattr(ino, name, value, mode).await;
        self.attr_changed(ino);
        r
    }

    async fn listxattr(&self, ino: Ino) -> FsResult<Vec<Vec<u8>>> {
        self.inner.listxattr(ino).await
    }

    async fn removexattr(&self, ino: Ino, name: &[u8]) -> FsResult<()> {
        let r = self.inner.removexattr(ino, name).await;
        self.attr_changed(ino);
        r
    }
}

// ---------------------------------------------------------------------------------------------
// A bounded table with expiry and CLOCK eviction.

#[derive(Debug)]
struct Slot<K, V> {
    key: K,
    value: V,
    expires: Instant,
    /// Set on every hit; the hand clears it and evicts slots found clear (second chance).
    referenced: bool,
}

/// At most `cap` entries. Expired entries are dropped when met (on `get`, or by the hand).
#[derive(Debug)]
struct Clock<K, V> {
    index: HashMap<K, usize>,
    slots: Vec<Option<Slot<K, V>>>,
    free: Vec<usize>,
    hand: usize,
    cap: usize,
}

impl<K: Hash + Eq + Clone, V> Clock<K, V> {
    fn new(cap: usize) -> Self {
        Self {
            index: HashMap::new(),
            slots: Vec::new(),
            free: Vec::new(),
            hand: 0,
            cap,
        }
    }

    fn len(&self) -> usize {
        self.index.len()
    }

    fn clear(&mut self) {
        self.index.clear();
        self.slots.clear();
        self.free.clear();
        self.hand = 0;
    }

    /// The value of a fresh entry.
    fn get<Q>(&mut self, key: &Q, now: Instant) -> Option<&V>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        let i = *self.index.get(key)?;
        let fresh = self.slots[i].as_ref().is_some_and(|s| s.expires > now);
        if !fresh {
            self.remove(key);
            return None;
        }
        let s = self.slots[i].as_mut()?;
        s.referenced = true;
        Some(&s.value)
    }

    fn remove<Q>(&mut self, key: &Q)
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        if let Some(i) = self.index.remove(key) {
            self.slots[i] = None;
            self.free.push(i);
        }
    }

    fn insert(&mut self, key: K, value: V, expires: Instant) {
        if self.cap == 0 {
            return;
        }
        if let Some(&i) = self.index.get(&key)
            && let Some(s) = self.slots[i].as_mut()
        {
            s.value = value;
            s.expires = expires;
            s.referenced = true;
            return;
        }
        let slot = Slot {
            key: key.clone(),
            value,
            expires,
            referenced: false,
        };
        let i = if let Some(i) = self.free.pop() {
            i
        } else if self.slots.len() < self.cap {
            self.slots.push(None);
            self.slots.len() - 1
        } else {
            self.evict()
        };
        self.slots[i] = Some(slot);
        self.index.insert(key, i);
    }

    /// Frees a slot of a full table and returns it: the first slot past the hand that is expired
    /// or was not referenced since the hand last passed (at most two turns).
    fn evict(&mut self) -> usize {
        let now = Instant::now();
        loop {
            let i = self.hand;
            self.hand = (self.hand + 1) % self.slots.len();
            match &mut self.slots[i] {
                None => return i,
                Some(s) if s.referenced && s.expires > now => s.referenced = false,
                Some(s) => {
                    self.index.remove(&s.key);
                    self.slots[i] = None;
                    return i;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clock_keeps_at_most_cap_and_prefers_referenced_entries() {
        let far = Instant::now() + Duration::from_secs(3600);
        let mut c: Clock<u32, u32> = Clock::new(3);
        for k in 0..3 {
            c.insert(k, k * 10, far);
        }
        // 0 and 2 are used; 1 is not, so it goes first.
        assert_eq!(c.get(&0, Instant::now()), Some(&0));
        assert_eq!(c.get(&2, Instant::now()), Some(&20));
        c.insert(3, 30, far);
        assert_eq!(c.len(), 3);
        assert_eq!(c.get(&1, Instant::now()), None);
        assert_eq!(c.get(&3, Instant::now()), Some(&30));
        for k in 10..100 {
            c.insert(k, k, far);
            assert!(c.len() <= 3);
        }
        assert_eq!(c.index.len(), c.slots.iter().flatten().count());
    }

    #[test]
    fn clock_drops_expired_entries_and_reuses_removed_slots() {
        let now = Instant::now();
        let mut c: Clock<u32, u32> = Clock::new(2);
        c.insert(1, 1, now + Duration::from_secs(1));
        c.insert(2, 2, now + Duration::from_secs(100));
        assert_eq!(c.get(&1, now + Duration::from_secs(2)), None);
        assert_eq!(c.len(), 1);
        c.insert(3, 3, now + Duration::from_secs(100));
        assert_eq!(c.slots.len(), 2);
        c.remove(&2);
        c.insert(4, 4, now + Duration::from_secs(100));
        assert_eq!(c.slots.len(), 2);
        assert_eq!(c.get(&4, now), Some(&4));
        assert_eq!(c.get(&3, now), Some(&3));

        let mut off: Clock<u32, u32> = Clock::new(0);
        off.insert(1, 1, now + Duration::from_secs(1));
        assert_eq!(off.get(&1, now), None);
    }
}
