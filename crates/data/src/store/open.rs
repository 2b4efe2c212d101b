//! Opening a store and reopening a failed one (docs/data-store.md, "Recovery" and "Reopening a
//! failed store"): list the disk's files, drop the remnants of unsynced creates and deletes,
//! recover every extent (`recovery.rs`) and build the in-memory state from what is on disk. A
//! reopen replaces the whole state under the gate held exclusively, so no call sees a
//! half-replaced store; `failed` is cleared only by a reopen that succeeded, and each one bumps
//! the epoch.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, RwLock};
use std::time::Instant;

use nacre_types::ExtentId;

use super::cache::{self, CacheError, FileCache, Open};
use super::commit::Commit;
use super::format::{self, crc_name, data_name};
use super::spares::SparePool;
use super::{
    Dirty, Extent, ExtentStore, MAX_BLOCK_SIZE, MAX_EXTENT_BLOCKS, MIN_BLOCK_SIZE, State,
    StoreError, StoreOptions, Trash, Trimmed, crc, kind, lock, recovery, write,
};
use crate::io::Disk;

/// What recovery found, at open or at a reopen.
#[derive(Clone, Debug, Default)]
pub(super) struct Recovery {
    trimmed: Vec<Trimmed>,
    bad_blocks: Vec<(ExtentId, u64)>,
}

/// A store's state as recovered from its files.
struct Loaded {
    extents: HashMap<ExtentId, Arc<Extent>>,
    recovery: Recovery,
    /// Remnants were removed: the next round fsyncs the directory.
    dir_dirty: bool,
    /// Files of deleted extents not removed yet ([`format::trash_name`]).
    trash: Vec<String>,
}

/// Lists the disk's files and recovers every extent (docs/data-store.md, "Recovery"), opening the
/// files through `cache`. `drop_cache`: first drop the files' cached pages (a reopen after a failed
/// IO: they may hold bytes the disk does not).
fn load(
    disk: &dyn Disk,
    cache: &FileCache,
    opts: &StoreOptions,
    drop_cache: bool,
) -> Result<Loaded, StoreError> {
    // (data file, crc file) present
    let mut found: BTreeMap<ExtentId, (bool, bool)> = BTreeMap::new();
    let mut trash = Vec::new();
    for name in disk.list().map_err(cache::open_error)? {
        if format::is_trash(&name) {
            trash.push(name);
            continue;
        }
        match format::parse_name(&name) {
            Some((id, k)) if kind(id).is_ok() => {
                let e = found.entry(id).or_default();
                match k {
                    format::Kind::Data => e.0 = true,
                    format::Kind::Crc => e.1 = true,
                }
            }
            _ => tracing::debug!(name, "the extent store ignores a file it does not own"),
        }
    }
    let mut extents = HashMap::new();
    let mut recovery = Recovery::default();
    let mut dir_dirty = false;
    for (id, files) in found {
        if files != (true, true) {
            // A create or a delete that was not synced: the extent was never durably there (or
            // durably gone), so drop the remnant.
            disk.remove(&data_name(id))?;
            disk.remove(&crc_name(id))?;
            dir_dirty = true;
            tracing::info!(extent = %id, "removed the remnant of an unsynced create or delete");
            continue;
        }
        // Recovery changes files only to cut them, and then fsyncs them.
        let f = cache.get(id, Open::Existing).map_err(|e| match e {
            CacheError::Open(e) => cache::open_error(e),
            CacheError::Sync(e) => StoreError::Io(e),
        })?;
        if drop_cache {
            for file in [&f.data, &f.crc] {
                // Best effort: pages still dirty stay (a later fsync writes them or fails).
                if let Err(e) = file.drop_cache() {
                    tracing::warn!(extent = %id, error = %e, "cannot drop an extent file's cached pages");
                }
            }
        }
        let r = recovery::recover(id, &*f.data, &*f.crc, opts.block_size, opts.sync)?;
        if r.len != r.found_len {
            recovery.trimmed.push(Trimmed {
                extent: id,
                old_len: r.found_len,
                new_len: r.len,
            });
        }
        recovery.bad_blocks.extend(r.bad.iter().map(|&b| (id, b)));
        let state = State {
            deleted: false,
            born: true,
            len: r.len,
            blocks: r.blocks,
            hdr: r.cursor,
            uncached: 0,
            kicked: r.len,
            file_len: r.len,
            grown: Instant::now(),
        };
        extents.insert(id, Arc::new(Extent::new(id, state)));
    }
    Ok(Loaded {
        extents,
        recovery,
        dir_dirty,
        trash,
    })
}

impl ExtentStore {
    /// Opens the store, recovering every extent: a torn tail (last blocks whose bytes do not match
    /// their persisted CRC, or data past the CRC records) is trimmed to the end of the last verified
    /// block; [`ExtentStore::recovery_report`] lists what was trimmed.
    pub fn open(disk: Arc<dyn Disk>, opts: StoreOptions) -> Result<Self, StoreError> {
        Self::open_with_spares(disk, opts, SparePool::new())
    }

    /// [`ExtentStore::open`], keeping the data files of deleted extents in `spares`, a pool other
    /// stores (a node's) may share: a new extent takes the newest spare it can, from its own
    /// directory or, where both have one on a real file system, another store's
    /// ([`Disk::adopt`]). The pool's owner bounds what it holds ([`SparePool::retire`]).
    pub fn open_with_spares(
        disk: Arc<dyn Disk>,
        opts: StoreOptions,
        spares: Arc<SparePool>,
    ) -> Result<Self, StoreError> {
        if !(MIN_BLOCK_SIZE..=MAX_BLOCK_SIZE).contains(&opts.block_size) {
            return Err(StoreError::Invalid(format!(
                "block size {} is not in {MIN_BLOCK_SIZE}..={MAX_BLOCK_SIZE}",
                opts.block_size
            )));
        }
        if opts.max_open_extents == 0 {
            return Err(StoreError::Invalid(
                "max_open_extents must be at least 1".into(),
            ));
        }
        let bs = u64::from(opts.block_size);
        let cache = FileCache::new(
            disk.clone(),
            usize::try_from(opts.max_open_extents).unwrap_or(usize::MAX),
            opts.sync,
        );
        let loaded = load(&*disk, &cache, &opts, false)?;
        Ok(Self {
            disk,
            max_len: bs * MAX_EXTENT_BLOCKS,
            zero_block_crc: crc::zeros(0, bs),
            bs,
            opts,
            gate: RwLock::new(()),
            reopening: Mutex::new(()),
            epoch: AtomicU64::new(0),
            extents: RwLock::new(loaded.extents),
            cache,
            trash: Mutex::new(Trash::found(loaded.trash)),
            spares,
            recycled: AtomicU64::new(0),
            dirty: Mutex::new(Dirty {
                extents: HashMap::new(),
                dir: loaded.dir_dirty,
            }),
            commit: Mutex::new(Commit::default()),
            round_done: Condvar::new(),
            failed: AtomicBool::new(false),
            recovery: Mutex::new(loaded.recovery),
        })
    }

    /// Brings a failed store back (docs/data-store.md, "Failure"): runs what [`ExtentStore::open`]
    /// runs — list the files, recover every extent from what is on disk — on the same disk and
    /// replaces the whole in-memory state with the result. Every open file is closed first
    /// (without an fsync) and the files' cached pages are dropped where the disk can
    /// ([`DiskFile::drop_cache`]), since after a failed fsync the page cache may hold bytes that
    /// never reached the disk. Writes
    /// that were not synced before the failure may be gone (trimmed, or their blocks marked bad);
    /// [`ExtentStore::recovery_report`] and [`ExtentStore::recovery_bad_blocks`] then describe this
    /// recovery, and [`ExtentStore::epoch`] grows by one.
    ///
    /// Waits for the calls in flight to finish; calls that arrive meanwhile are refused with
    /// `Failed`. If recovery fails (the disk still fails), the store stays failed and this can be
    /// called again. A store that has not failed is left alone (`Ok`).
    ///
    /// [`DiskFile::drop_cache`]: crate::io::DiskFile::drop_cache
    pub fn reopen(&self) -> Result<(), StoreError> {
        if !self.is_failed() {
            return Ok(());
        }
        // One reopen at a time, and none on a store another one just brought back: `failed` is
        // cleared only under this lock.
        let _one = lock(&self.reopening);
        if !self.is_failed() {
            return Ok(());
        }
        // Every call holds the gate shared for its whole duration (a `sync` caller waiting for a
        // round included, and the round's runner, whose round ends once its IO returns): with it
        // held exclusively, no call is in flight and none can start.
        let _all = write(&self.gate);
        self.cache.clear();
        let loaded = load(&*self.disk, &self.cache, &self.opts, true)?;
        // Nothing refers to the old extents any more: no call is in flight, and the dirty set
        // (which held them) is replaced too. Extents registered without files yet are gone, like
        // any create not synced before the failure.
        *write(&self.extents) = loaded.extents;
        *lock(&self.dirty) = Dirty {
            extents: HashMap::new(),
            dir: loaded.dir_dirty,
        };
        // What is still on disk of the deleted extents (spares included: the list held only
        // names); recovery cut every recycled file to its extent.
        self.spares.forget(&self.disk);
        *lock(&self.trash) = Trash::found(loaded.trash);
        tracing::debug!(
            trimmed = loaded.recovery.trimmed.len(),
            bad_blocks = loaded.recovery.bad_blocks.len(),
            "extent store reopened"
        );
        *lock(&self.recovery) = loaded.recovery;
        self.epoch.fetch_add(1, Ordering::SeqCst);
        self.failed.store(false, Ordering::SeqCst);
        Ok(())
    }

    /// Whether the store failed an IO and refuses work until [`ExtentStore::reopen`]ed.
    pub fn is_failed(&self) -> bool {
        self.failed.load(Ordering::SeqCst)
    }

    /// How many times the store was reopened. A write is covered by a later `sync` only if no
    /// reopen came between them (a reopen may lose what was not synced before the failure): a
    /// caller that must know takes the epoch before its writes and syncs with
    /// [`ExtentStore::sync_since`].
    pub fn epoch(&self) -> u64 {
        self.epoch.load(Ordering::SeqCst)
    }

    /// Extents whose tail the last recovery (at open, or at the last [`ExtentStore::reopen`]) cut.
    pub fn recovery_report(&self) -> Vec<Trimmed> {
        lock(&self.recovery).trimmed.clone()
    }

    /// Blocks the last recovery (at open, or at the last reopen) kept although they fail their CRC
    /// (extent, block index): they read as `Corrupt` until repaired. Only an in-place change
    /// (overwrite, repair) torn by a crash or a failed IO leaves these, or damage to the files.
    pub fn recovery_bad_blocks(&self) -> Vec<(ExtentId, u64)> {
        lock(&self.recovery).bad_blocks.clone()
    }
}
