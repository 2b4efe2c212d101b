//! The store's bounded cache of open extent files (docs/data-store.md, "Open files").
//!
//! At most `cap` extents have their two files open in the cache; the least recently used one that no
//! call is using is closed to make room, and reopened on demand. A call holds an `Arc<Files>` while
//! it does IO, and the cache never lets go of files while such a clone is alive, so a descriptor is
//! never closed under a call; the count exceeds `cap` only when more than `cap` extents had IO in
//! flight at once (by at most one extent per concurrent call), until the next open makes room. The
//! lock is held only for map updates: opening, fsyncing and closing happen outside it.
//!
//! Files written since their last fsync are fsynced before they close. Closing alone would lose no
//! data, and the group-commit round reopens them to sync anyway, but a writeback error that happens
//! while no descriptor is open can be lost with the inode (if it leaves the kernel's inode cache
//! before the reopen), and the round's fsync would then succeed over lost data.

use std::collections::{BTreeMap, HashMap};
use std::io;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use nacre_types::ExtentId;

use super::format::{crc_name, data_name};
use super::{StoreError, lock};
use crate::io::{Disk, DiskFile};

/// An extent's two open files. They close when the last `Arc` drops.
#[derive(Debug)]
pub(super) struct Files {
    pub data: Arc<dyn DiskFile>,
    pub crc: Arc<dyn DiskFile>,
    /// Changed through these descriptors since their last fsync (maybe): eviction fsyncs them.
    unsynced: AtomicBool,
}

impl Files {
    /// Call after changing the files (after the IO, so that an fsync that began before it never
    /// clears the flag for it).
    pub fn changed(&self) {
        self.unsynced.store(true, Ordering::SeqCst);
    }

    /// Call right before fsyncing both files: every change that completed before is covered.
    pub fn syncing(&self) {
        self.unsynced.store(false, Ordering::SeqCst);
    }
}

/// An extent's files held for a change: marks them changed when dropped, after the call's IO.
#[derive(Debug)]
pub(super) struct Changing(pub Arc<Files>);

impl std::ops::Deref for Changing {
    type Target = Files;

    fn deref(&self) -> &Files {
        &self.0
    }
}

impl Drop for Changing {
    fn drop(&mut self) {
        self.0.changed();
    }
}

/// Why [`FileCache::get`] failed.
#[derive(Debug)]
pub(super) enum CacheError {
    /// Opening the extent's files.
    Open(io::Error),
    /// Fsyncing files written since their last fsync before closing them, to make room: what is on
    /// disk is unknown, as after any failed fsync.
    Sync(io::Error),
}

/// How to open files the cache does not hold.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Open {
    /// Both files must exist (a reopen): a missing one is an error, never silently recreated.
    Existing,
    /// Creating them if missing (a new extent).
    Create,
}

#[derive(Debug)]
pub(super) struct FileCache {
    disk: Arc<dyn Disk>,
    /// At least 1.
    cap: usize,
    /// Whether the store fsyncs at all (`StoreOptions::sync`).
    sync: bool,
    lru: Mutex<Lru>,
}

#[derive(Debug, Default)]
struct Lru {
    /// Grows with every use.
    tick: u64,
    entries: HashMap<ExtentId, Entry>,
    /// `tick` of the last use → extent, least recent first. Same extents as `entries`.
    order: BTreeMap<u64, ExtentId>,
}

#[derive(Debug)]
struct Entry {
    files: Arc<Files>,
    tick: u64,
}

impl Lru {
    fn next_tick(&mut self) -> u64 {
        self.tick += 1;
        self.tick
    }

    /// The extent's files if open, now the most recently used.
    fn touch(&mut self, id: ExtentId) -> Option<Arc<Files>> {
        let tick = self.next_tick();
        let e = self.entries.get_mut(&id)?;
        self.order.remove(&e.tick);
        e.tick = tick;
        self.order.insert(tick, id);
        Some(e.files.clone())
    }

    fn insert(&mut self, id: ExtentId, files: Arc<Files>) {
        let tick = self.next_tick();
        self.order.insert(tick, id);
        if let Some(old) = self.entries.insert(id, Entry { files, tick }) {
            self.order.remove(&old.tick);
        }
    }

    fn remove(&mut self, id: ExtentId) -> Option<Arc<Files>> {
        let e = self.entries.remove(&id)?;
        self.order.remove(&e.tick);
        Some(e.files)
    }

    /// Lets go of the least recently used files no call is using until at most `keep` extents are
    /// left (more if the others are in use). The caller closes what this returns after unlocking
    /// ([`FileCache::close`]). Every clone of an entry's `Arc` is made under the lock, so a count of 1 seen
    /// here cannot grow before the entry is gone.
    #[must_use]
    fn shrink(&mut self, keep: usize) -> Vec<Arc<Files>> {
        let excess = self.entries.len().saturating_sub(keep);
        if excess == 0 {
            return Vec::new();
        }
        let idle: Vec<ExtentId> = self
            .order
            .values()
            .filter(|id| {
                self.entries
                    .get(id)
                    .is_some_and(|e| Arc::strong_count(&e.files) == 1)
            })
            .take(excess)
            .copied()
            .collect();
        idle.into_iter().filter_map(|id| self.remove(id)).collect()
    }
}

/// `EMFILE` (the process is out of descriptors) or `ENFILE` (the system is).
pub(super) fn out_of_fds(e: &io::Error) -> bool {
    use rustix::io::Errno;
    e.raw_os_error()
        .is_some_and(|c| c == Errno::MFILE.raw_os_error() || c == Errno::NFILE.raw_os_error())
}

/// Running out of descriptors is transient (descriptors come back as other files close) and an open
/// changes nothing on disk, so it gets its own error, which does not fail the store.
pub(super) fn open_error(e: io::Error) -> StoreError {
    if out_of_fds(&e) {
        tracing::warn!(error = %e, "the extent store cannot open a file");
        StoreError::TooManyOpenFiles
    } else {
        StoreError::Io(e)
    }
}

impl FileCache {
    pub fn new(disk: Arc<dyn Disk>, cap: usize, sync: bool) -> Self {
        Self {
            disk,
            cap: cap.max(1),
            sync,
            lru: Mutex::new(Lru::default()),
        }
    }

    /// Closes files the cache let go of, fsyncing those changed since their last fsync first.
    fn close(&self, evicted: Vec<Arc<Files>>) -> Result<(), CacheError> {
        let mut result = Ok(());
        for f in evicted {
            if self.sync && result.is_ok() && f.unsynced.load(Ordering::SeqCst) {
                result = f
                    .data
                    .sync_data()
                    .and_then(|()| f.crc.sync_data())
                    .map_err(CacheError::Sync);
            }
        }
        result
    }

    /// The extent's files, opened (or, with `Open::Create`, made) if the cache does not hold them.
    /// The caller holds the extent's state lock and has checked that it is not deleted (so an open
    /// cannot race its delete), or is the store's recovery at open.
    pub fn get(&self, id: ExtentId, how: Open) -> Result<Arc<Files>, CacheError> {
        if let Some(f) = lock(&self.lru).touch(id) {
            return Ok(f);
        }
        // Room first, so the new files never take the count past the cap.
        let evicted = lock(&self.lru).shrink(self.cap - 1);
        self.close(evicted)?;
        let open = |name: String| match how {
            Open::Existing => self.disk.open_existing(&name),
            Open::Create => self.disk.open(&name),
        };
        let data = open(data_name(id)).map_err(CacheError::Open)?;
        let crc = open(crc_name(id)).map_err(CacheError::Open)?;
        let opened = Arc::new(Files {
            data,
            crc,
            unsynced: AtomicBool::new(false),
        });
        let (files, ours, evicted) = {
            let mut lru = lock(&self.lru);
            let (files, ours) = match lru.touch(id) {
                // Another call opened them meanwhile: use those, close ours (never written).
                Some(theirs) => (theirs, Some(opened)),
                None => {
                    lru.insert(id, opened.clone());
                    (opened, None)
                }
            };
            // `files` is in use (we hold a clone), so this never closes it.
            (files, ours, lru.shrink(self.cap))
        };
        drop(ours);
        self.close(evicted)?;
        Ok(files)
    }

    /// The extent's files if the cache holds them open; never opens them.
    pub fn cached(&self, id: ExtentId) -> Option<Arc<Files>> {
        lock(&self.lru).touch(id)
    }

    /// Lets go of an extent's files (a delete: no fsync); they close once no call uses them.
    pub fn forget(&self, id: ExtentId) {
        let closed = lock(&self.lru).remove(id);
        drop(closed);
    }

    /// Lets go of every extent's files, without an fsync: a reopen, after which recovery decides
    /// what is on disk. They close once no call uses them (none does during a reopen).
    pub fn clear(&self) {
        let closed = std::mem::take(&mut *lock(&self.lru));
        drop(closed);
    }

    /// Extents whose files the cache holds open.
    pub fn len(&self) -> usize {
        lock(&self.lru).entries.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::io::{FaultPlan, FaultyDisk, MemDisk};

    const A: ExtentId = ExtentId(1024);
    const B: ExtentId = ExtentId(1025);
    const C: ExtentId = ExtentId(1026);

    #[test]
    fn least_recently_used_idle_files_close_and_files_in_use_never_do() {
        let mem = MemDisk::new();
        let cache = FileCache::new(Arc::new(mem.clone()), 2, true);
        for id in [A, B, C] {
            drop(cache.get(id, Open::Create).unwrap());
        }
        // A was the least recently used.
        assert_eq!(cache.len(), 2);
        assert_eq!(mem.open_files(), 4);
        assert!(lock(&cache.lru).entries.contains_key(&C));
        assert!(!lock(&cache.lru).entries.contains_key(&A));
        // B and C in use: opening A goes over the cap rather than close them under their calls.
        let b = cache.get(B, Open::Existing).unwrap();
        let c = cache.get(C, Open::Existing).unwrap();
        let a = cache.get(A, Open::Existing).unwrap();
        assert_eq!(cache.len(), 3);
        assert_eq!(mem.open_files(), 6);
        b.data.write_at(b"still open", 0).unwrap();
        drop((a, b, c));
        // The next miss brings the count back under the cap.
        cache.forget(A);
        drop(cache.get(A, Open::Existing).unwrap());
        assert_eq!(cache.len(), 2);
        assert_eq!(mem.open_files(), 4);
        drop(cache);
        assert_eq!(mem.open_files(), 0);
    }

    #[test]
    fn reopening_never_creates_a_file() {
        let mem = MemDisk::new();
        let cache = FileCache::new(Arc::new(mem.clone()), 1, true);
        let e = cache.get(A, Open::Existing).unwrap_err();
        assert!(matches!(e, CacheError::Open(e) if e.kind() == io::ErrorKind::NotFound));
        assert!(mem.read_file(&data_name(A)).is_none());
    }

    /// Files changed since their last fsync are fsynced before they close; others are not.
    #[test]
    fn evicting_changed_files_fsyncs_them_first() {
        let mem = MemDisk::new();
        let faulty = FaultyDisk::new(Arc::new(mem.clone()), FaultPlan::default());
        let cache = FileCache::new(Arc::new(faulty.clone()), 1, true);
        for id in [A, B, C] {
            drop(cache.get(id, Open::Create).unwrap());
        }
        mem.sync_dir().unwrap();
        let a = cache.get(A, Open::Existing).unwrap();
        a.data.write_at(b"changed", 0).unwrap();
        a.changed();
        drop(a);
        drop(cache.get(B, Open::Existing).unwrap()); // closes A
        assert_eq!(mem.crash().read_file(&data_name(A)).unwrap(), b"changed");

        let b = cache.get(B, Open::Existing).unwrap();
        b.data.write_at(b"synced by a round", 0).unwrap();
        b.changed();
        b.syncing();
        drop(b);
        drop(cache.get(A, Open::Existing).unwrap()); // closes B, no fsync
        assert_eq!(mem.crash().read_file(&data_name(B)).unwrap(), b"");

        // A failed fsync is reported as such, not as a failed open.
        let a = cache.get(A, Open::Existing).unwrap();
        a.data.write_at(b"lost?", 0).unwrap();
        a.changed();
        drop(a);
        faulty.fail_after_more(Some(0));
        let e = cache.get(C, Open::Existing).unwrap_err();
        assert!(matches!(e, CacheError::Sync(_)), "{e:?}");
    }

    #[test]
    fn out_of_descriptors_is_its_own_error() {
        let e = io::Error::from_raw_os_error(rustix::io::Errno::MFILE.raw_os_error());
        assert!(matches!(open_error(e), StoreError::TooManyOpenFiles));
        let e = io::Error::from_raw_os_error(rustix::io::Errno::NFILE.raw_os_error());
        assert!(matches!(open_error(e), StoreError::TooManyOpenFiles));
        let e = io::Error::from(io::ErrorKind::NotFound);
        assert!(matches!(open_error(e), StoreError::Io(_)));
    }
}
