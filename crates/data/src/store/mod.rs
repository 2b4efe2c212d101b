//! The extent store of one data partition (DESIGN.md §7): extents in files behind a [`Disk`], a
//! CRC-32C per block checked on every read, group-committed `fdatasync`, and recovery that trims torn
//! tails. The byte formats, the commit protocol and the invariants are in `docs/data-store.md`.
//!
//! Extents `1..=TINY_EXTENTS` are **tiny extents**: shared files that small files are written into at
//! any offset at or past the end (the service aligns them to 4 KiB) and released with
//! [`ExtentStore::punch`]. Extents from [`FIRST_NORMAL_EXTENT`] on are **normal extents**: one per
//! file, appended to and overwritten in place, removed with [`ExtentStore::delete`].
//!
//! Concurrency: the extent map is behind an `RwLock` held only for lookups and inserts; every extent
//! has its own `RwLock`, read-held by reads (so reads of one extent run in parallel) and write-held by
//! changes. No lock is held across an fsync except in `truncate` and `punch`, whose ordering needs it,
//! and in a call whose open closes files written since their last fsync (rare: see `cache.rs`).
//! Besides, every call holds a gate shared for its whole duration, which [`ExtentStore::reopen`]
//! takes exclusively to replace the state of a failed store.
//!
//! Lock order: `reopening` (reopens only), the gate, an extent's state, the cache's mutex, the
//! extent map, the dirty set, the trash list, the spare pool. The group commit's `commit` mutex is never
//! held while another lock is taken; a caller waiting for a round holds only the gate (shared), and
//! the round it waits for ends once its IO returns, so a reopen waiting for the gate waits for IO,
//! never for another lock.
//!
//! Open files: at most [`StoreOptions::max_open_extents`] extents have their files open (`cache.rs`);
//! the rest are closed and reopened on demand. Memory (lengths, CRCs) stays resident for every extent.

mod cache;
mod crc;
mod format;
mod recovery;
mod spares;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{
    Arc, Condvar, Mutex, MutexGuard, PoisonError, RwLock, RwLockReadGuard, RwLockWriteGuard,
    TryLockError,
};
use std::time::Instant;

use bytes::Bytes;
use nacre_types::{ErrorCode, ExtentId, crc32c, crc32c_append};
use serde::{Deserialize, Serialize};

use crate::io::{Disk, DiskFile};
use cache::{CacheError, Changing, FileCache, Files, Open};
use format::{Header, RECORD, Record, SLOT, crc_name, data_name, record_at, trash_name};
pub use spares::{Spare, SparePool};

/// Ids `1..=TINY_EXTENTS` are tiny extents.
pub const TINY_EXTENTS: u64 = nacre_types::TINY_EXTENTS;
/// The first id of a normal extent (ids between the tiny ones and this are reserved).
pub const FIRST_NORMAL_EXTENT: u64 = nacre_types::FIRST_NORMAL_EXTENT;
/// Default size of a checksummed block.
pub const DEFAULT_BLOCK_SIZE: u32 = 128 * 1024;
/// Smallest and largest accepted block sizes.
pub const MIN_BLOCK_SIZE: u32 = 16;
pub const MAX_BLOCK_SIZE: u32 = 64 << 20;
/// Most blocks an extent may have (bounds memory: 8 bytes per block).
pub const MAX_EXTENT_BLOCKS: u64 = 1 << 22;

/// Default for [`StoreOptions::max_open_extents`]: 512 descriptors per store (see there).
pub const DEFAULT_MAX_OPEN_EXTENTS: u32 = 256;

/// Appends of at least this many bytes to a normal extent are written with
/// [`DiskFile::write_direct_at`].
const DIRECT_FROM: usize = 32 << 10;

/// Default for [`StoreOptions::sync_fs_from`].
pub const DEFAULT_SYNC_FS_FROM: u32 = 4;
/// Default [`StoreOptions::writeback_after`]: one append packet.
pub const DEFAULT_WRITEBACK_AFTER: u32 = 128 * 1024;

/// Page granularity of [`StoreOptions::drop_synced`]: the page holding the previous mark is asked
/// again (it may have been partial then; the OS keeps pages only partly inside a range).
const DROP_ALIGN: u64 = 4096;

/// A gap (tiny extents) up to this size is written as zeros with the data, in one write.
const INLINE_GAP: u64 = 64 * 1024;

/// Settings of an [`ExtentStore`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct StoreOptions {
    /// Bytes covered by one CRC. Fixed for the life of the store: opening with another size fails.
    pub block_size: u32,
    /// `false` makes [`ExtentStore::sync`] (and the fsyncs inside truncate and punch) no-ops: nothing
    /// is durable. For benchmarks.
    pub sync: bool,
    /// Most extents whose files (two each: `.data`, `.crc`) are open at once; the least recently
    /// used are closed and reopened on demand (at least 1). Exceeded only while more extents than
    /// this have calls in flight at once.
    ///
    /// A node runs one store per data partition replica, so its descriptors are about
    /// `2 × max_open_extents × partitions`. The default, 256, is 512 descriptors per partition: a node
    /// with 30 partitions stays under 16,000 (room for sockets and the Raft logs under a 20,000 limit),
    /// and 256 extents cover a partition's working set (its 16 tiny extents, the extents being appended
    /// to, hot reads). A miss costs two `open`s, small next to the disk read it usually precedes.
    pub max_open_extents: u32,
    /// After a group commit syncs an extent, ask the OS to drop the page-cache pages of what the
    /// round made durable (`DiskFile::drop_range`), so appended data does not pile up in the page
    /// cache. A write that later overwrites part of a dropped block re-reads the block from the disk
    /// (its CRC needs the whole block). See `docs/data-store.md`, "Page cache".
    pub drop_synced: bool,
    /// A group-commit round with at least this many extents syncs the whole file system at once
    /// (`Disk::sync_fs`, `syncfs`) instead of each extent's two files in turn; 0: never. Rounds
    /// of one or two extents (a single stream, small files) keep the per-file `fdatasync`, which
    /// waits for nothing else on the file system.
    pub sync_fs_from: u32,
    /// Once this many bytes were appended to a normal extent since the last time, ask the OS to
    /// start writing them to the device (`DiskFile::start_writeback`) instead of leaving it all to
    /// the next group commit's fsync; 0: never. A stream's sync then waits for its last packet's
    /// pages instead of its whole MiB (docs/data-store.md, "Page cache"). Ignored without `sync`.
    pub writeback_after: u32,
    /// A new normal extent takes the data file of a deleted one (a *spare*, renamed) instead of a
    /// new file: its appends then overwrite blocks the file system already allocated, and the old
    /// blocks are never freed (on a file system mounted with online `discard`, freeing stalls its
    /// journal commits). The old bytes past the new extent's length are never read (no record of
    /// the new crc file vouches for them) and are cut by recovery or
    /// [`ExtentStore::cut_tails`]. Which spares to keep is the caller's choice
    /// ([`ExtentStore::retire_spares`]); `false`: every deleted extent's files are removed.
    pub recycle: bool,
}

impl Default for StoreOptions {
    fn default() -> Self {
        Self {
            block_size: DEFAULT_BLOCK_SIZE,
            sync: true,
            max_open_extents: DEFAULT_MAX_OPEN_EXTENTS,
            drop_synced: true,
            sync_fs_from: DEFAULT_SYNC_FS_FROM,
            writeback_after: DEFAULT_WRITEBACK_AFTER,
            recycle: true,
        }
    }
}

/// An extent whose tail recovery cut: its writes had reached `old_len` bytes (its data file's
/// length, but no further than the blocks its crc file has records for: bytes past those were
/// never vouched for, such as a recycled file's old bytes, and are cut without a report),
/// `new_len` verified.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Trimmed {
    pub extent: ExtentId,
    pub old_len: u64,
    pub new_len: u64,
}

/// Group commit counters.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SyncStats {
    /// Calls of [`ExtentStore::sync`] that waited for a round (not counting `sync: false` stores).
    pub calls: u64,
    /// Rounds run (each fsyncs every file written since the previous round).
    pub rounds: u64,
}

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("extent {0} not found")]
    NotFound(ExtentId),
    #[error("extent {extent}: {len} bytes at {offset} are out of range (length {extent_len})")]
    OutOfRange {
        extent: ExtentId,
        offset: u64,
        len: u64,
        extent_len: u64,
    },
    #[error("extent {extent}: block {block} (at {offset}) fails its checksum")]
    Corrupt {
        extent: ExtentId,
        /// Index of the block.
        block: u64,
        /// Offset of the block's first byte.
        offset: u64,
    },
    #[error("invalid request: {0}")]
    Invalid(String),
    #[error("io error: {0}")]
    Io(#[from] std::io::Error),
    /// An fsync, or the IO of a change, failed earlier: what is on disk is unknown, so the store
    /// refuses all work until it is reopened ([`ExtentStore::reopen`], which recovers from what is
    /// on disk). Also what calls get while a reopen runs, and what [`ExtentStore::sync_since`]
    /// returns when a reopen came after the caller's writes.
    #[error("the store failed an IO earlier; reopen it")]
    Failed,
    /// A write found the disk full. Nothing changed in memory and what reached the files lies past
    /// the extent's length or in blocks whose records still hold the old CRC (as after a crash in
    /// the middle of the write), so unlike other IO errors this does not fail the store: writes
    /// work again once there is room.
    #[error("no space left on the disk")]
    NoSpace,
    /// The process (`EMFILE`) or the system (`ENFILE`) is out of file descriptors, so an extent's
    /// files could not be opened (or reopened after the store closed them to bound its descriptors).
    /// Nothing changed; the call can be retried once descriptors are free, and the store keeps
    /// working. A `sync` that fails this way leaves the unsynced extents for the next round.
    #[error("too many open files")]
    TooManyOpenFiles,
}

impl StoreError {
    pub fn code(&self) -> ErrorCode {
        match self {
            Self::NotFound(_) => ErrorCode::NotFound,
            Self::OutOfRange { .. } | Self::Invalid(_) => ErrorCode::InvalidArgument,
            Self::Corrupt { .. } => ErrorCode::Corrupt,
            Self::Io(_) | Self::Failed => ErrorCode::Internal,
            Self::NoSpace | Self::TooManyOpenFiles => ErrorCode::Unavailable,
        }
    }

    /// An error that changed nothing the store cannot describe, so it does not fail the store.
    fn is_transient(&self) -> bool {
        matches!(self, Self::NoSpace | Self::TooManyOpenFiles)
    }
}

/// The CRC of one block as cached in memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Block {
    /// CRC-32C of the block's bytes (the first `len % block_size` for the last block).
    crc: u32,
    /// Known not to match its bytes (found at recovery, or a truncate cut a block that failed): reads
    /// fail with `Corrupt` until a write replaces the whole block.
    bad: bool,
    /// `crc` was computed by this process from the bytes it wrote, so the block's bytes and its CRC
    /// agree as far as this process knows: an overwrite may patch the CRC from the bytes it
    /// replaces ([`crc::patch`]) instead of re-reading and verifying the whole block. Blocks found
    /// at open are not: a crash may have left bytes and record apart (a torn overwrite), and only a
    /// whole-block read tells; so is no block of a write that failed part way.
    checked: bool,
}

impl Block {
    /// A block whose bytes this process just wrote (or read and verified) under `crc`.
    fn good(crc: u32) -> Self {
        Self {
            crc,
            bad: false,
            checked: true,
        }
    }

    /// A block's record as found at open; reads still verify it.
    fn recorded(crc: u32) -> Self {
        Self {
            crc,
            bad: false,
            checked: false,
        }
    }

    /// A block known not to match `crc`.
    fn rotten(crc: u32) -> Self {
        Self {
            crc,
            bad: true,
            checked: false,
        }
    }
}

/// Where the next commit header goes.
#[derive(Clone, Copy, Debug)]
struct Cursor {
    /// Slot (0 or 1) to write next; the other one holds the last header known durable.
    slot: u64,
    /// Sequence number of the next header.
    seq: u64,
    /// Headers written since open: an fsync confirms a header only if no other was written since.
    generation: u64,
    /// Length in each slot's header (`u64::MAX`: none). While they differ, recovery must read the
    /// range between them, so a round that leaves them different queues a second header.
    lens: [u64; 2],
}

#[derive(Debug)]
struct State {
    deleted: bool,
    /// Its files exist (or existed when the store was opened). An extent is registered without
    /// them ([`ExtentStore::create`]); its first write, or the next sync round, makes them.
    born: bool,
    len: u64,
    /// One per block: `len.div_ceil(block_size)` entries.
    blocks: Vec<Block>,
    hdr: Cursor,
    /// Bytes below this were synced and asked out of the page cache (see `sync_extents`).
    uncached: u64,
    /// Appended bytes below this were handed to the OS's write-back (`writeback_after`).
    kicked: u64,
    /// Size of the data file as far as this store knows, at least `len`: more while the extent
    /// lives in a recycled file ([`StoreOptions::recycle`]) it has not grown over yet.
    file_len: u64,
    /// When the extent last grew (kept while `file_len > len`: [`ExtentStore::cut_tails`]).
    grown: Instant,
}

impl State {
    /// A registered extent without files yet: empty, no header written.
    fn unborn() -> Self {
        Self {
            deleted: false,
            born: false,
            len: 0,
            blocks: Vec::new(),
            hdr: Cursor {
                slot: 0,
                seq: 1,
                generation: 0,
                lens: [u64::MAX; 2],
            },
            uncached: 0,
            kicked: 0,
            file_len: 0,
            grown: Instant::now(),
        }
    }
}

/// An extent's memory. Its files are in the store's [`FileCache`], open or not.
#[derive(Debug)]
struct Extent {
    id: ExtentId,
    /// In the dirty set. Set only under the dirty-set lock after inserting, cleared when a round takes
    /// the set: so `true` means "a round not yet started will sync this extent".
    dirty: AtomicBool,
    state: RwLock<State>,
}

#[derive(Debug, Default)]
struct Dirty {
    extents: HashMap<ExtentId, Arc<Extent>>,
    /// A file was created or removed since the last round.
    dir: bool,
}

#[derive(Debug, Default)]
struct Commit {
    /// Rounds started; rounds are serialized, so a round `r` starts only after `r - 1` finished.
    started: u64,
    finished: u64,
    /// The last round that succeeded. A round that fails transiently (out of descriptors) puts what
    /// it did not sync back into the dirty set, so every write before round `r` started is durable
    /// once `last_ok >= r`.
    last_ok: u64,
    running: bool,
    calls: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Tiny,
    Normal,
}

/// Deleted extents' files ([`ExtentStore::delete`]) and the extents living in recycled ones.
#[derive(Debug, Default)]
struct Trash {
    /// Renamed files to remove ([`ExtentStore::remove_deleted`]).
    remove: Vec<String>,
    /// Extents whose data file (a recycled one) is longer than they are.
    tails: HashSet<ExtentId>,
}

impl Trash {
    /// What open found on disk: all of it to remove (the sizes are unknown, and a reopen's
    /// recovery must not meet a half-recycled file).
    fn found(names: Vec<String>) -> Self {
        Self {
            remove: names,
            ..Self::default()
        }
    }
}

/// The extent store of one data partition. `Send + Sync`; every method takes `&self`.
pub struct ExtentStore {
    disk: Arc<dyn Disk>,
    opts: StoreOptions,
    bs: u64,
    max_len: u64,
    /// CRC of a block of zeros.
    zero_block_crc: u32,
    /// Held shared by every call that uses the state below for the whole call, exclusively by
    /// [`ExtentStore::reopen`] while it replaces that state. Calls only `try_read` it: while a
    /// reopen runs or waits, they are refused (`Failed`, which the store is) rather than blocked.
    /// Never taken twice by one call (a waiting reopen would deadlock it): public methods do not
    /// call each other.
    gate: RwLock<()>,
    /// Serializes reopens.
    reopening: Mutex<()>,
    /// Reopens so far.
    epoch: AtomicU64,
    extents: RwLock<HashMap<ExtentId, Arc<Extent>>>,
    /// The extents' open files, bounded.
    cache: FileCache,
    /// Deleted extents' files: to remove, or kept for new extents.
    trash: Mutex<Trash>,
    /// Deleted extents' data files kept for new extents: this store's own pool, or its node's.
    spares: Arc<SparePool>,
    /// New extents that took a spare since open ([`ExtentStore::recycled`]).
    recycled: AtomicU64,
    dirty: Mutex<Dirty>,
    commit: Mutex<Commit>,
    round_done: Condvar,
    /// Set by an IO error that leaves the files unknown; cleared only by a successful reopen.
    failed: AtomicBool,
    recovery: Mutex<Recovery>,
}

impl Drop for ExtentStore {
    fn drop(&mut self) {
        // Its spares are found and removed by the next open of its directory.
        self.spares.forget(&self.disk);
    }
}

impl std::fmt::Debug for ExtentStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ExtentStore")
            .field("disk", &self.disk)
            .field("opts", &self.opts)
            .field("extents", &read(&self.extents).len())
            .field("open_extents", &self.cache.len())
            .field("failed", &self.failed.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

// Critical sections update memory only after their IO succeeded, so a panic elsewhere never leaves a
// half-updated state behind: poisoning is ignored.
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

fn read<T>(l: &RwLock<T>) -> RwLockReadGuard<'_, T> {
    l.read().unwrap_or_else(PoisonError::into_inner)
}

fn write<T>(l: &RwLock<T>) -> RwLockWriteGuard<'_, T> {
    l.write().unwrap_or_else(PoisonError::into_inner)
}

fn kind(id: ExtentId) -> Result<Kind, StoreError> {
    match id.0 {
        1..=TINY_EXTENTS => Ok(Kind::Tiny),
        FIRST_NORMAL_EXTENT.. => Ok(Kind::Normal),
        _ => Err(StoreError::Invalid(format!(
            "extent id {} is reserved",
            id.0
        ))),
    }
}

/// What recovery found, at open or at a reopen.
#[derive(Clone, Debug, Default)]
struct Recovery {
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

    pub fn is_tiny(id: ExtentId) -> bool {
        id.is_tiny()
    }

    pub fn block_size(&self) -> u32 {
        self.opts.block_size
    }

    pub fn options(&self) -> &StoreOptions {
        &self.opts
    }

    /// Extents whose files the store holds open now (at most `max_open_extents`, unless more extents
    /// than that have calls in flight at once).
    pub fn open_extents(&self) -> usize {
        self.cache.len()
    }

    /// Creates an empty extent; idempotent (an existing extent is left unchanged). Only registers
    /// it: its files are made by its first write, or by the next [`ExtentStore::sync`] round if that
    /// comes first, so a create costs no file-system work where it is called (a data partition's
    /// Raft apply, on a messenger worker). Durable after the next [`ExtentStore::sync`].
    pub fn create(&self, id: ExtentId) -> Result<(), StoreError> {
        let _gate = self.enter()?;
        self.changing(|| {
            kind(id)?;
            self.register(id);
            Ok(())
        })
    }

    /// Writes `data` at `offset`. Normal extents: `offset <= len` (appending or overwriting in place;
    /// past the end is `OutOfRange`). Tiny extents also accept any `offset >= len` (the gap reads as
    /// zeros). Extends the length when it writes past it and updates the block CRCs; a partially
    /// overwritten block gets its CRC patched from the bytes the write replaces if this process
    /// computed that CRC ([`Block::checked`]), else it is re-read and must verify first (else
    /// `Corrupt`, nothing written). Not durable until [`ExtentStore::sync`].
    pub fn write(&self, id: ExtentId, offset: u64, data: &[u8]) -> Result<(), StoreError> {
        self.write_hinted(id, offset, data, false)
    }

    /// Writes like [`ExtentStore::write`], except that an append of at least 32 KiB to a normal
    /// extent goes to the disk without passing through the OS's page cache
    /// ([`DiskFile::write_direct_at`]) where the disk can. The bytes are no more durable before
    /// [`ExtentStore::sync`] than `write`'s, but their copy into the cache, its write-back and its
    /// dropping after the sync (`drop_synced`) are spared: less CPU per byte for a node with many
    /// streams to append. A stream whose writes wait for each other (one extent's appends are
    /// written in order) may go slower, since each write then waits for the device.
    pub fn write_uncached(&self, id: ExtentId, offset: u64, data: &[u8]) -> Result<(), StoreError> {
        self.write_hinted(id, offset, data, true)
    }

    fn write_hinted(
        &self,
        id: ExtentId,
        offset: u64,
        data: &[u8],
        direct: bool,
    ) -> Result<(), StoreError> {
        let _gate = self.enter()?;
        self.changing(|| {
            let ext = self.writable(id)?;
            let mut st = write(&ext.state);
            if st.deleted {
                return Err(StoreError::NotFound(id));
            }
            if offset > st.len && !Self::is_tiny(id) {
                return Err(StoreError::OutOfRange {
                    extent: id,
                    offset,
                    len: data.len() as u64,
                    extent_len: st.len,
                });
            }
            let f = self.files_to_change(id, &mut st)?;
            self.write_locked(&ext, &f, &mut st, offset, data, direct)
                .map_err(|e| match e {
                    StoreError::Io(io) if io.kind() == std::io::ErrorKind::StorageFull => {
                        StoreError::NoSpace
                    }
                    e => e,
                })?;
            drop(st);
            self.mark_dirty(&ext);
            Ok(())
        })
    }

    /// A hint that `[offset, offset + len)` of extent `id` will soon be overwritten: starts reading
    /// the blocks the write covers only in part (their CRCs need their other bytes) into the page
    /// cache without waiting (only the bytes the write replaces, where it will patch the block's
    /// CRC from them), so the write finds them there (`StoreOptions::drop_synced` dropped
    /// them once they were synced). Every replica's state machine calls it as an overwrite reaches
    /// its Raft log (`DataSm::prefetch`), which hides the read behind the log's fsync. Never fails:
    /// a hint that cannot be given is skipped.
    pub fn prefetch(&self, id: ExtentId, offset: u64, len: u64) {
        let Ok(_gate) = self.enter() else { return };
        let Ok(Some(ext)) = self.find(id) else { return };
        let bs = self.bs;
        let (ranges, f) = {
            let st = read(&ext.state);
            let end = offset.saturating_add(len).min(st.len);
            if st.deleted || offset >= end {
                return;
            }
            let (first, last) = (offset / bs, (end - 1) / bs);
            // What the write will read of a block it covers in part: the bytes it replaces, if it
            // can patch the block's CRC from them, else the whole block.
            let needed = |b: u64| {
                let (start, blen) = (b * bs, (st.len - b * bs).min(bs));
                if offset <= start && end >= start + blen {
                    return None;
                }
                let blk = st.blocks.get(b as usize)?;
                let stop = offset.saturating_add(len).min(start + bs);
                Some(if blk.checked && !blk.bad && stop <= start + blen {
                    let from = offset.max(start);
                    (from, end.min(start + blen) - from)
                } else {
                    (start, blen)
                })
            };
            let mut ranges = Vec::with_capacity(2);
            ranges.extend(needed(first));
            if last != first {
                ranges.extend(needed(last));
            }
            if ranges.is_empty() {
                return;
            }
            // Under the state lock, as `files` asks: a delete cannot slip in between.
            let Ok(f) = self.files(id, Open::Existing) else {
                return;
            };
            (ranges, f)
        };
        for (start, blen) in ranges {
            let _ = f.data.will_need(start, blen);
        }
    }

    /// Shrinks an extent to `len` (drops an unacknowledged tail); `len` past the end is `Invalid`.
    /// Durable when it returns (it fsyncs: a crash must not bring the dropped bytes back).
    pub fn truncate(&self, id: ExtentId, len: u64) -> Result<(), StoreError> {
        let _gate = self.enter()?;
        self.changing(|| {
            let Some(ext) = self.find(id)? else {
                return if len == 0 {
                    Ok(())
                } else {
                    Err(StoreError::Invalid(format!(
                        "{id}: cannot truncate an empty extent to {len}"
                    )))
                };
            };
            let mut st = write(&ext.state);
            if st.deleted {
                return Err(StoreError::NotFound(id));
            }
            if len > st.len {
                return Err(StoreError::Invalid(format!(
                    "{id}: cannot truncate to {len}, past its length {}",
                    st.len
                )));
            }
            if len < st.len {
                let f = self.files_to_change(id, &mut st)?;
                self.truncate_locked(&f, &mut st, len)?;
            }
            drop(st);
            self.mark_dirty(&ext);
            Ok(())
        })
    }

    /// Reads `len` bytes at `offset`, verifying every block it touches against its CRC (whole blocks
    /// are read and checked; only the asked range is returned). Past the end is `OutOfRange`.
    pub fn read(&self, id: ExtentId, offset: u64, len: u32) -> Result<Bytes, StoreError> {
        let _gate = self.enter()?;
        let out_of_range = |extent_len| StoreError::OutOfRange {
            extent: id,
            offset,
            len: u64::from(len),
            extent_len,
        };
        let end = offset
            .checked_add(u64::from(len))
            .ok_or_else(|| out_of_range(0))?;
        let Some(ext) = self.find(id)? else {
            return if end == 0 {
                Ok(Bytes::new())
            } else {
                Err(out_of_range(0))
            };
        };
        let st = read(&ext.state);
        if st.deleted {
            return Err(StoreError::NotFound(id));
        }
        if end > st.len {
            return Err(out_of_range(st.len));
        }
        if len == 0 {
            return Ok(Bytes::new());
        }
        let bs = self.bs;
        let first = offset / bs;
        let last = (end - 1) / bs;
        let start = first * bs;
        let stop = st.len.min((last + 1) * bs);
        let f = self.files(id, Open::Existing)?;
        let mut buf = vec![0u8; (stop - start) as usize];
        let got = f.data.read_at(&mut buf, start)?;
        drop(f);
        for (i, chunk) in buf.chunks(bs as usize).enumerate() {
            let b = first + i as u64;
            let blk = st.blocks[b as usize];
            let complete = got >= i * bs as usize + chunk.len();
            if blk.bad || !complete || crc32c(chunk) != blk.crc {
                return Err(StoreError::Corrupt {
                    extent: id,
                    block: b,
                    offset: b * bs,
                });
            }
        }
        drop(st);
        Ok(Bytes::from(buf).slice((offset - start) as usize..(end - start) as usize))
    }

    /// Length of an extent (0 for a tiny extent not written yet).
    pub fn len(&self, id: ExtentId) -> Result<u64, StoreError> {
        let _gate = self.enter()?;
        let Some(ext) = self.find(id)? else {
            return Ok(0);
        };
        let st = read(&ext.state);
        if st.deleted {
            return Err(StoreError::NotFound(id));
        }
        Ok(st.len)
    }

    /// The per-block CRCs, for comparing replicas during repair. A block known bad reports the
    /// complement of its expected CRC, so that it never matches a healthy replica's.
    pub fn block_crcs(&self, id: ExtentId) -> Result<Vec<u32>, StoreError> {
        let _gate = self.enter()?;
        let Some(ext) = self.find(id)? else {
            return Ok(Vec::new());
        };
        let st = read(&ext.state);
        if st.deleted {
            return Err(StoreError::NotFound(id));
        }
        Ok(st
            .blocks
            .iter()
            .map(|b| if b.bad { !b.crc } else { b.crc })
            .collect())
    }

    /// Replaces block `index` wholesale with `data` (a healthy replica's copy: `block_size` bytes, or
    /// fewer for the last block), creating the extent if missing and recomputing the CRC. The block
    /// may be the next one past the end (the extent grows), or for a tiny extent any block past it.
    /// A shorter last block shrinks the extent (durably, as [`ExtentStore::truncate`]). Never reads
    /// the old bytes, so it fixes a corrupt block. Not durable until [`ExtentStore::sync`].
    pub fn repair_block(&self, id: ExtentId, index: u64, data: &[u8]) -> Result<(), StoreError> {
        let _gate = self.enter()?;
        self.changing(|| {
            let k = kind(id)?;
            let bs = self.bs;
            if data.is_empty() || data.len() as u64 > bs {
                return Err(StoreError::Invalid(format!(
                    "{id}: a repaired block has 1..={bs} bytes, not {}",
                    data.len()
                )));
            }
            let start = index
                .checked_mul(bs)
                .filter(|s| s + bs <= self.max_len)
                .ok_or_else(|| StoreError::Invalid(format!("{id}: block {index} is too far")))?;
            let ext = self.register(id);
            let mut st = write(&ext.state);
            if st.deleted {
                return Err(StoreError::NotFound(id));
            }
            if k == Kind::Normal && start > st.len {
                return Err(StoreError::OutOfRange {
                    extent: id,
                    offset: start,
                    len: data.len() as u64,
                    extent_len: st.len,
                });
            }
            let end = start + data.len() as u64;
            if st.len > start + bs && data.len() as u64 != bs {
                return Err(StoreError::Invalid(format!(
                    "{id}: block {index} is not the last one and needs {bs} bytes, not {}",
                    data.len()
                )));
            }
            let f = self.files_to_change(id, &mut st)?;
            if start < st.len && end < st.len && st.len <= start + bs {
                // The last block, shorter on the healthy replica.
                self.truncate_locked(&f, &mut st, end)?;
            }
            self.write_locked(&ext, &f, &mut st, start, data, false)?;
            drop(st);
            self.mark_dirty(&ext);
            Ok(())
        })
    }

    /// Deletes a normal extent (removes its files); idempotent. Durable after the next sync.
    pub fn delete(&self, id: ExtentId) -> Result<(), StoreError> {
        let _gate = self.enter()?;
        self.changing(|| {
            if kind(id)? == Kind::Tiny {
                return Err(StoreError::Invalid(format!(
                    "{id} is a tiny extent: release its ranges with punch"
                )));
            }
            let Some(ext) = self.lookup(id) else {
                return Ok(());
            };
            let bytes = {
                let mut st = write(&ext.state);
                st.deleted = true;
                // Under the state lock: a call that reopens (or makes) files checks `deleted`
                // under it first.
                self.cache.forget(id);
                st.file_len.max(st.len)
            };
            lock(&self.dirty).dir = true;
            // Removing a large file is slow (its blocks are freed then: tens of ms for a full
            // extent under load), renaming it is not: the files are renamed out of the extent
            // namespace here (the caller is a Raft apply, on a messenger worker that serves every
            // partition's packets) and removed later by `remove_deleted`. They go before the
            // entry: until it leaves the map, a call that registers the id finds the deleted
            // extent, so it cannot make files that these renames then take.
            let mut renamed = Vec::with_capacity(2);
            let mut result = Ok(());
            for name in [data_name(id), crc_name(id)] {
                let trash = trash_name(&name);
                match self.disk.rename(&name, &trash) {
                    Ok(()) => renamed.push(trash),
                    // An extent that never had files (created, never changed, no round since).
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                    Err(e) => {
                        result = Err(e);
                        break;
                    }
                }
            }
            write(&self.extents).remove(&id);
            let mut trash = lock(&self.trash);
            trash.tails.remove(&id);
            for name in renamed {
                if self.opts.recycle && bytes > 0 && name == trash_name(&data_name(id)) {
                    self.spares.give(Spare {
                        disk: self.disk.clone(),
                        name,
                        bytes,
                        since: Instant::now(),
                    });
                } else {
                    trash.remove.push(name);
                }
            }
            drop(trash);
            result?;
            Ok(())
        })
    }

    /// Removes the files of extents deleted since the last call (renamed by
    /// [`ExtentStore::delete`], or found at open): a file system frees a file's blocks when it is
    /// removed, which takes tens of milliseconds for a full extent under load, so `delete` leaves
    /// it to this call and the data service makes it on the blocking pool every tick. Returns how
    /// many files it removed. A failure keeps the rest for the next call and does not fail the
    /// store (no extent's state depends on these files); a crash before it loses nothing, since
    /// the next open finds the renamed files again.
    pub fn remove_deleted(&self) -> Result<usize, StoreError> {
        let names = std::mem::take(&mut lock(&self.trash).remove);
        for (i, name) in names.iter().enumerate() {
            if let Err(e) = self.disk.remove(name) {
                lock(&self.trash).remove.extend(names[i..].iter().cloned());
                return Err(StoreError::Io(e));
            }
        }
        Ok(names.len())
    }

    /// Files of deleted extents waiting for [`ExtentStore::remove_deleted`].
    pub fn deleted_files(&self) -> usize {
        lock(&self.trash).remove.len()
    }

    /// The spares of this store's pool ([`StoreOptions::recycle`]; a node's pool holds every
    /// store's): each one's bytes and when its extent was deleted, oldest first.
    pub fn spares(&self) -> Vec<(u64, Instant)> {
        self.spares.list()
    }

    /// Retires the spares of this store's pool whose extents were deleted at or before `until`
    /// ([`SparePool::retire`]): those of this store go to [`ExtentStore::remove_deleted`], others
    /// are removed here. Returns their bytes. Keeping spares keeps their space taken: the pool's
    /// owner bounds it (the data service keeps at most `spare_bytes` per node, for at most
    /// `spare_keep`).
    pub fn retire_spares(&self, until: Instant) -> u64 {
        let mut bytes = 0;
        for s in self.spares.retire(until) {
            bytes += s.bytes;
            if Arc::ptr_eq(&s.disk, &self.disk) {
                lock(&self.trash).remove.push(s.name);
            } else if let Err(e) = s.disk.remove(&s.name) {
                tracing::warn!(file = s.name, error = %e, "cannot remove a spare");
            }
        }
        bytes
    }

    /// New extents that took a spare's file since the store opened.
    pub fn recycled(&self) -> u64 {
        self.recycled.load(Ordering::Relaxed)
    }

    /// Extents living in a recycled file longer than they are ([`ExtentStore::cut_tails`]).
    pub fn tails(&self) -> usize {
        lock(&self.trash).tails.len()
    }

    /// Cuts the data file of every extent that lives in a recycled file longer than itself and has
    /// not grown since `idle_since` to the extent's length (freeing the old bytes, slow for a large
    /// file: call it off the hot path). Returns how many it cut. The cut changes nothing the store
    /// describes (no byte below the length), so it needs no fsync (a crash before it lands leaves
    /// the old bytes, which recovery cuts) and a failure does not fail the store: the extent keeps
    /// its tail for the next call.
    pub fn cut_tails(&self, idle_since: Instant) -> Result<usize, StoreError> {
        let _gate = self.enter()?;
        let ids: Vec<ExtentId> = lock(&self.trash).tails.iter().copied().collect();
        let mut cut = 0;
        for id in ids {
            let Some(ext) = self.lookup(id) else {
                lock(&self.trash).tails.remove(&id);
                continue;
            };
            let mut st = write(&ext.state);
            if st.deleted || st.file_len <= st.len {
                lock(&self.trash).tails.remove(&id);
                continue;
            }
            if st.grown > idle_since {
                continue;
            }
            let f = self.files(id, Open::Existing)?;
            f.data.set_len(st.len)?;
            st.file_len = st.len;
            lock(&self.trash).tails.remove(&id);
            cut += 1;
        }
        Ok(cut)
    }

    /// Punches `[offset, offset + len)` out of a tiny extent: the range reads as zeros, its space is
    /// freed (whole file-system blocks), the size does not change. Recomputes the CRCs of the blocks it
    /// touches; a block it covers only in part must verify first (else `Corrupt`, nothing changed).
    ///
    /// Durable when it returns. The new block records keep the old CRC as an alternative and are
    /// fsynced (with a commit header) before the data changes, then the data is fsynced: a crash at
    /// any point leaves every block verifiable, punched or not (unless it tears a 32-byte record
    /// write, which a disk with atomic sector writes never does).
    pub fn punch(&self, id: ExtentId, offset: u64, len: u64) -> Result<(), StoreError> {
        let _gate = self.enter()?;
        self.changing(|| {
            kind(id)?;
            let out_of_range = |extent_len| StoreError::OutOfRange {
                extent: id,
                offset,
                len,
                extent_len,
            };
            let end = offset.checked_add(len).ok_or_else(|| out_of_range(0))?;
            let Some(ext) = self.find(id)? else {
                return if end == 0 {
                    Ok(())
                } else {
                    Err(out_of_range(0))
                };
            };
            let mut st = write(&ext.state);
            if st.deleted {
                return Err(StoreError::NotFound(id));
            }
            if end > st.len {
                return Err(out_of_range(st.len));
            }
            if len == 0 {
                return Ok(());
            }
            let f = self.files_to_change(id, &mut st)?;
            let bs = self.bs;
            let first = offset / bs;
            let last = (end - 1) / bs;
            let mut blocks = Vec::with_capacity((last - first + 1) as usize);
            let mut records = Vec::with_capacity(blocks.capacity() * RECORD as usize);
            for b in first..=last {
                let start = b * bs;
                let blen = (st.len - start).min(bs);
                let (ps, pe) = (offset.max(start), end.min(start + blen));
                let old = st.blocks[b as usize];
                let (crc, alt) = if ps == start && pe == start + blen {
                    (self.zeros_crc(blen), (!old.bad).then_some(old.crc))
                } else {
                    let mut buf = vec![0u8; blen as usize];
                    let verified = self.read_block(&f, &mut buf, start, old)?;
                    buf[(ps - start) as usize..(pe - start) as usize].fill(0);
                    let crc = crc32c(&buf);
                    // An unverified block is accepted only if punching makes it match its CRC.
                    if !verified && crc != old.crc {
                        return Err(self.corrupt(id, b));
                    }
                    (crc, verified.then_some(old.crc))
                };
                let rec = Record {
                    len: blen as u32,
                    crc,
                    alt,
                    epoch: st.hdr.seq,
                };
                records.extend_from_slice(&rec.encode());
                blocks.push((Block::good(crc), alt.is_some(), blen));
            }
            let tail_crc = match (st.len % bs, blocks.last()) {
                (0, _) => 0,
                (_, Some((blk, _, _))) if last + 1 == st.blocks.len() as u64 => blk.crc,
                _ => st.blocks.last().map_or(0, |b| b.crc),
            };
            f.crc.write_at(&records, record_at(first))?;
            let len_now = st.len;
            let generation = self.write_header(&f, &mut st, len_now, tail_crc)?;
            self.fsync_file(&*f.crc)?;
            f.data.punch_hole(offset, len)?;
            self.fsync_file(&*f.data)?;
            if self.opts.sync {
                Self::header_durable(&mut st, generation);
            }
            for (i, &(block, alt, blen)) in blocks.iter().enumerate() {
                let b = first + i as u64;
                st.blocks[b as usize] = block;
                if alt {
                    // The punch is durable: drop the alternative (unsynced, best effort; a record
                    // that keeps it costs only a read at recovery).
                    let rec = Record::new(blen as u32, block.crc, st.hdr.seq);
                    f.crc.write_at(&rec.encode(), record_at(b))?;
                }
            }
            drop(st);
            self.mark_dirty(&ext);
            Ok(())
        })
    }

    /// Every extent and its length (tiny ones included once they exist), by id.
    pub fn extents(&self) -> Vec<(ExtentId, u64)> {
        let all: Vec<Arc<Extent>> = read(&self.extents).values().cloned().collect();
        let mut out: Vec<(ExtentId, u64)> = all
            .iter()
            .filter_map(|e| {
                let st = read(&e.state);
                (!st.deleted).then_some((e.id, st.len))
            })
            .collect();
        out.sort_unstable();
        out
    }

    /// Makes every write before this call durable: data, CRC records, created and removed files.
    ///
    /// Group commit: a caller waits for a round that started after its call; whoever finds no round
    /// running runs the next one for everybody, fsyncing every file written since the previous round
    /// began. After an IO error in a round (or in any change) the store returns `Failed` for
    /// everything until reopened.
    pub fn sync(&self) -> Result<(), StoreError> {
        let _gate = self.enter()?;
        self.sync_entered()
    }

    /// [`ExtentStore::sync`] for writes made at `epoch` ([`ExtentStore::epoch`], taken before
    /// them): fails with `Failed` if the store was reopened since, since that may have lost them.
    pub fn sync_since(&self, epoch: u64) -> Result<(), StoreError> {
        let _gate = self.enter()?;
        // Under the gate: no reopen can come between this check and the round.
        if self.epoch() != epoch {
            return Err(StoreError::Failed);
        }
        self.sync_entered()
    }

    /// The group commit of [`ExtentStore::sync`], under the gate.
    fn sync_entered(&self) -> Result<(), StoreError> {
        if !self.opts.sync {
            return Ok(());
        }
        let mut c = lock(&self.commit);
        c.calls += 1;
        // The running round (if any) may have taken the dirty set before our writes: wait for the next.
        let target = c.started + 1;
        loop {
            self.check()?;
            if c.last_ok >= target {
                return Ok(());
            }
            if c.finished >= target {
                // Every round since our call ran out of descriptors (the only transient error a
                // round has); our writes wait in the dirty set for a later one.
                return Err(StoreError::TooManyOpenFiles);
            }
            if c.running {
                c = self
                    .round_done
                    .wait(c)
                    .unwrap_or_else(PoisonError::into_inner);
                continue;
            }
            c.running = true;
            c.started += 1;
            let round = c.started;
            drop(c);
            let result = self.round();
            c = lock(&self.commit);
            c.running = false;
            c.finished = round;
            match result {
                Ok(()) => c.last_ok = round,
                Err(e) if e.is_transient() => {}
                Err(e) => {
                    self.fail(&e);
                    self.round_done.notify_all();
                    return Err(e);
                }
            }
            self.round_done.notify_all();
        }
    }

    /// Group commit counters.
    pub fn sync_stats(&self) -> SyncStats {
        let c = lock(&self.commit);
        SyncStats {
            calls: c.calls,
            rounds: c.finished,
        }
    }

    /// Bytes on disk ([`Disk::used`]); 0 if the disk cannot tell.
    pub fn used(&self) -> u64 {
        self.disk.used().unwrap_or_else(|e| {
            tracing::warn!(error = %e, "cannot measure the extent store's disk use");
            0
        })
    }

    // ---------------------------------------------------------------------------------------------

    /// Enters a call: holds the gate shared (refused while a reopen runs or waits for it) and
    /// checks that the store has not failed.
    fn enter(&self) -> Result<RwLockReadGuard<'_, ()>, StoreError> {
        let gate = match self.gate.try_read() {
            Ok(g) => g,
            Err(TryLockError::Poisoned(e)) => e.into_inner(),
            Err(TryLockError::WouldBlock) => return Err(StoreError::Failed),
        };
        self.check()?;
        Ok(gate)
    }

    fn check(&self) -> Result<(), StoreError> {
        if self.failed.load(Ordering::SeqCst) {
            Err(StoreError::Failed)
        } else {
            Ok(())
        }
    }

    fn corrupt(&self, extent: ExtentId, block: u64) -> StoreError {
        StoreError::Corrupt {
            extent,
            block,
            offset: block * self.bs,
        }
    }

    fn lookup(&self, id: ExtentId) -> Option<Arc<Extent>> {
        read(&self.extents).get(&id).cloned()
    }

    /// The extent, `None` for a tiny extent not created yet, `NotFound` for a missing normal one.
    fn find(&self, id: ExtentId) -> Result<Option<Arc<Extent>>, StoreError> {
        let k = kind(id)?;
        match self.lookup(id) {
            Some(e) => Ok(Some(e)),
            None if k == Kind::Tiny => Ok(None),
            None => Err(StoreError::NotFound(id)),
        }
    }

    /// The extent to write to, registering a tiny extent on first use.
    fn writable(&self, id: ExtentId) -> Result<Arc<Extent>, StoreError> {
        match self.find(id)? {
            Some(e) => Ok(e),
            None => Ok(self.register(id)),
        }
    }

    /// Registers an empty extent without making its files ([`ExtentStore::create`]): they are made
    /// by the first call that changes it, or by the next sync round, whichever comes first
    /// ([`ExtentStore::files_to_change`]). Returns the extent already registered, if any.
    fn register(&self, id: ExtentId) -> Arc<Extent> {
        let mut all = write(&self.extents);
        if let Some(e) = all.get(&id) {
            return e.clone();
        }
        let ext = Arc::new(Extent::new(id, State::unborn()));
        all.insert(id, ext.clone());
        drop(all);
        // The round that takes it makes its files (if no write did before) and syncs the directory.
        self.mark_dirty(&ext);
        ext
    }

    /// The files of `id`, whose state `st` is (write-locked by the caller, not deleted): opened if
    /// the cache closed them, made first if the extent has none yet. Making them empties leftovers
    /// of a delete whose rename failed, so they cannot show through, and has the next round sync
    /// the directory.
    fn born_files(&self, id: ExtentId, st: &mut State) -> Result<Arc<Files>, StoreError> {
        if st.born {
            return self.files(id, Open::Existing);
        }
        let recycled = self.recycle(id);
        let files = self.files(id, Open::Create)?;
        // The crc file always starts empty: no record may vouch for a recycled file's old bytes.
        let fresh: &[&Arc<dyn DiskFile>] = if recycled.is_some() {
            &[&files.crc]
        } else {
            &[&files.data, &files.crc]
        };
        for f in fresh {
            if f.len()? != 0 {
                f.set_len(0)?;
                files.changed();
            }
        }
        st.born = true;
        if let Some(bytes) = recycled {
            st.file_len = bytes;
            st.grown = Instant::now();
            lock(&self.trash).tails.insert(id);
        }
        lock(&self.dirty).dir = true;
        Ok(files)
    }

    /// Makes the newest spare this store can take ([`SparePool`]) the data file of normal extent
    /// `id` (renamed, or moved from another store's directory; [`StoreOptions::recycle`]); returns
    /// its bytes. `None` if there was none, or the move failed: a spare of this store then goes to
    /// removal, another store's back to the pool (its own store can still rename it).
    fn recycle(&self, id: ExtentId) -> Option<u64> {
        if !self.opts.recycle || Self::is_tiny(id) {
            return None;
        }
        let spare = self.spares.take_for(&self.disk)?;
        let own = Arc::ptr_eq(&spare.disk, &self.disk);
        let moved = match spare.disk.location() {
            _ if own => self.disk.rename(&spare.name, &data_name(id)),
            Some(from) => self.disk.adopt(from, &spare.name, &data_name(id)),
            None => Err(std::io::Error::new(
                std::io::ErrorKind::Unsupported,
                "the spare's disk has no location",
            )),
        };
        match moved {
            Ok(()) => {
                self.recycled.fetch_add(1, Ordering::Relaxed);
                Some(spare.bytes)
            }
            // Removed meanwhile (its store reopened).
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
            Err(e) => {
                tracing::warn!(file = spare.name, error = %e, "cannot recycle a deleted extent's file");
                if own {
                    lock(&self.trash).remove.push(spare.name);
                } else {
                    // Another directory (on another file system, say): it stays its store's.
                    self.spares.give(spare);
                }
                None
            }
        }
    }

    /// An extent's files (`cache.rs`), opened if the cache closed them. Call under the extent's state
    /// lock, having checked that it is not deleted. Closing other files to make room fsyncs those
    /// written since their last fsync; if that fails, the store fails (whatever the call).
    fn files(&self, id: ExtentId, how: Open) -> Result<Arc<Files>, StoreError> {
        self.cache.get(id, how).map_err(|e| match e {
            CacheError::Open(e) => cache::open_error(e),
            CacheError::Sync(e) => {
                let e = StoreError::Io(e);
                self.fail(&e);
                e
            }
        })
    }

    /// [`ExtentStore::born_files`] for a change: marked changed when the returned guard drops.
    fn files_to_change(&self, id: ExtentId, st: &mut State) -> Result<Changing, StoreError> {
        self.born_files(id, st).map(Changing)
    }

    fn mark_dirty(&self, ext: &Arc<Extent>) {
        if ext.dirty.load(Ordering::SeqCst) {
            return;
        }
        let mut d = lock(&self.dirty);
        d.extents.insert(ext.id, ext.clone());
        ext.dirty.store(true, Ordering::SeqCst);
    }

    fn zeros_crc(&self, n: u64) -> u32 {
        if n == self.bs {
            self.zero_block_crc
        } else {
            crc::zeros(0, n)
        }
    }

    /// Reads a block's bytes into `buf` (its current length) and says whether they verify.
    fn read_block(
        &self,
        f: &Files,
        buf: &mut [u8],
        start: u64,
        blk: Block,
    ) -> Result<bool, StoreError> {
        let got = f.data.read_at(buf, start)?;
        if got < buf.len() {
            buf[got..].fill(0);
            return Ok(false);
        }
        Ok(!blk.bad && crc32c(buf) == blk.crc)
    }

    /// The CRC of a checked block after `piece` replaces its bytes at `at`, from the bytes it
    /// replaces ([`crc::patch`]); `None` when that is not known to be right and the whole block must
    /// be read and verified: the block is not [`Block::checked`] (or bad), the write runs past the
    /// block's end `end`, or the file is shorter than the block.
    fn patched_crc(
        &self,
        f: &Files,
        old: Block,
        at: u64,
        piece: &[u8],
        end: u64,
    ) -> Result<Option<u32>, StoreError> {
        let stop = at + piece.len() as u64;
        if !old.checked || old.bad || stop > end {
            return Ok(None);
        }
        let mut was = vec![0u8; piece.len()];
        if f.data.read_at(&mut was, at)? < was.len() {
            return Ok(None);
        }
        Ok(Some(crc::patch(old.crc, &was, piece, end - stop)))
    }

    /// Runs the IO of a change. An error there leaves the files in a state memory does not describe
    /// (a write may have landed in part), so it fails the store: only recovery can tell what is on
    /// disk.
    fn changing<T>(&self, f: impl FnOnce() -> Result<T, StoreError>) -> Result<T, StoreError> {
        f().inspect_err(|e| {
            if matches!(e, StoreError::Io(_)) {
                self.fail(e);
            }
        })
    }

    fn fail(&self, e: &StoreError) {
        if !self.failed.swap(true, Ordering::SeqCst) {
            tracing::error!(error = %e, "extent store IO failed; refusing work until reopened");
        }
    }

    /// fsyncs one file unless the store does not sync; a failure fails the store.
    fn fsync_file(&self, f: &dyn DiskFile) -> Result<(), StoreError> {
        if !self.opts.sync {
            return Ok(());
        }
        f.sync_data().map_err(|e| {
            let e = StoreError::Io(e);
            self.fail(&e);
            e
        })
    }

    /// Writes a commit header for length `len` into the cursor's slot; returns its generation.
    fn write_header(
        &self,
        f: &Files,
        st: &mut State,
        len: u64,
        tail_crc: u32,
    ) -> Result<u64, StoreError> {
        let h = Header {
            block_size: self.opts.block_size,
            tail_crc,
            seq: st.hdr.seq,
            len,
        };
        st.hdr.seq = st.hdr.seq.saturating_add(1);
        st.hdr.generation += 1;
        st.hdr.lens[st.hdr.slot as usize] = len;
        f.crc.write_at(&h.encode(), st.hdr.slot * SLOT)?;
        Ok(st.hdr.generation)
    }

    /// An fsync that started after header `generation` was written completed: if no header was written
    /// since, that slot now holds the durable header and the next one goes to the other slot.
    fn header_durable(st: &mut State, generation: u64) {
        if st.hdr.generation == generation {
            st.hdr.slot = 1 - st.hdr.slot;
        }
    }

    /// The write path: computes the new CRC of every block the write changes (re-reading a block it
    /// overwrites only in part), writes the data, then the records, then updates memory.
    /// `direct`: see [`ExtentStore::write_uncached`].
    fn write_locked(
        &self,
        ext: &Extent,
        f: &Files,
        st: &mut State,
        offset: u64,
        data: &[u8],
        direct: bool,
    ) -> Result<(), StoreError> {
        if data.is_empty() {
            return Ok(());
        }
        let bs = self.bs;
        let end = offset
            .checked_add(data.len() as u64)
            .filter(|&e| e <= self.max_len)
            .ok_or_else(|| {
                StoreError::Invalid(format!(
                    "{}: a write may not end past {} bytes",
                    ext.id, self.max_len
                ))
            })?;
        let old_len = st.len;
        let new_len = old_len.max(end);
        // A gap (tiny extents) changes blocks from the old end on.
        let first = offset.min(old_len) / bs;
        let last = (end - 1) / bs;
        let mut blocks = Vec::with_capacity((last - first + 1) as usize);
        let mut records = Vec::with_capacity(blocks.capacity() * RECORD as usize);
        for b in first..=last {
            let start = b * bs;
            let new_blen = (new_len - start).min(bs);
            let old_blen = old_len.saturating_sub(start).min(bs);
            // The part of the write inside this block.
            let (ws, we) = (offset.max(start), end.min(start + new_blen));
            let piece: &[u8] = if ws < we {
                &data[(ws - offset) as usize..(we - offset) as usize]
            } else {
                &[]
            };
            let block = if old_blen == 0 {
                // A new block: zeros (a gap) up to the piece, which runs to the block's end.
                let zeros = new_blen - piece.len() as u64;
                if zeros == bs {
                    Block::good(self.zero_block_crc)
                } else {
                    Block::good(crc32c_append(crc::zeros(0, zeros), piece))
                }
            } else if ws == start && we == start + new_blen {
                Block::good(crc32c(piece))
            } else {
                let old = st.blocks[b as usize];
                if ws >= start + old_blen {
                    // Appending to the last block, maybe after a gap: extend its CRC, no read. A bad
                    // block stays bad.
                    let gap = new_blen - old_blen - piece.len() as u64;
                    Block {
                        crc: crc32c_append(crc::zeros(old.crc, gap), piece),
                        ..old
                    }
                } else if let Some(crc) = self.patched_crc(f, old, ws, piece, start + old_blen)? {
                    Block::good(crc)
                } else {
                    let mut buf = vec![0u8; new_blen as usize];
                    let verified = self.read_block(f, &mut buf[..old_blen as usize], start, old)?;
                    buf[(ws - start) as usize..(we - start) as usize].copy_from_slice(piece);
                    let crc = crc32c(&buf);
                    // Never bless bytes that failed their CRC, unless this write makes the block
                    // match its record: the replay of a write that a crash tore.
                    if !verified && crc != old.crc {
                        return Err(self.corrupt(ext.id, b));
                    }
                    Block::good(crc)
                }
            };
            let rec = Record::new(new_blen as u32, block.crc, st.hdr.seq);
            records.extend_from_slice(&rec.encode());
            blocks.push(block);
        }

        let direct = direct && data.len() >= DIRECT_FROM && !Self::is_tiny(ext.id);
        let mut went_direct = false;
        let mut io = || -> Result<(), StoreError> {
            if offset > old_len {
                let gap = offset - old_len;
                if gap <= INLINE_GAP {
                    let mut buf = Vec::with_capacity(gap as usize + data.len());
                    buf.resize(gap as usize, 0);
                    buf.extend_from_slice(data);
                    f.data.write_at(&buf, old_len)?;
                } else {
                    // Cut whatever lies past the end, so the gap is a hole of zeros.
                    f.data.set_len(old_len)?;
                    f.data.write_at(data, offset)?;
                }
            } else if offset == old_len && direct {
                went_direct = f.data.write_direct_at(data, offset)?;
            } else {
                f.data.write_at(data, offset)?;
            }
            f.crc.write_at(&records, record_at(first))?;
            Ok(())
        };
        if let Err(e) = io() {
            // Part of the bytes may have landed (a transient error such as ENOSPC leaves the store
            // running): the old CRCs no longer vouch for them, so later overwrites verify the blocks.
            for blk in st.blocks.iter_mut().skip(first as usize).take(blocks.len()) {
                blk.checked = false;
            }
            return Err(e);
        }

        for (i, block) in blocks.into_iter().enumerate() {
            let b = first as usize + i;
            if b < st.blocks.len() {
                st.blocks[b] = block;
            } else {
                st.blocks.push(block);
            }
        }
        st.len = new_len;
        if st.file_len > new_len {
            st.grown = Instant::now();
        } else {
            if st.file_len > old_len {
                // Grown over the whole recycled file: no tail left to cut.
                lock(&self.trash).tails.remove(&ext.id);
            }
            st.file_len = new_len;
        }
        if went_direct {
            // Nothing of the append is in the page cache: no write-back to start for it, nothing
            // to drop after the round's sync (unless cached bytes before it still wait for both).
            if st.kicked == old_len {
                st.kicked = new_len;
            }
            if st.uncached == old_len {
                st.uncached = new_len;
            }
        }
        self.start_writeback(ext.id, f, st, offset >= old_len);
        Ok(())
    }

    /// After a write: once `writeback_after` bytes were appended to a normal extent since the last
    /// kick, starts their write-back. Tiny extents are synced right after each write anyway, and
    /// in-place writes are few and small. A failed hint is ignored (the round's fsync reports
    /// write-back errors).
    fn start_writeback(&self, id: ExtentId, f: &Files, st: &mut State, appended: bool) {
        let every = u64::from(self.opts.writeback_after);
        if every == 0 || !self.opts.sync || !appended || Self::is_tiny(id) {
            return;
        }
        // A truncate may have cut below the mark.
        let from = st.kicked.min(st.len);
        if st.len - from >= every {
            let _ = f.data.start_writeback(from, st.len - from);
            st.kicked = st.len;
        } else {
            st.kicked = from;
        }
    }

    /// Shrinks to `len < st.len`, durably: the new end record and a header saying `len` are fsynced
    /// before the files are cut, and the cut is fsynced before new writes can refill the range.
    fn truncate_locked(&self, f: &Files, st: &mut State, len: u64) -> Result<(), StoreError> {
        let bs = self.bs;
        let k = len / bs;
        let p = len % bs;
        let tail = if p == 0 {
            None
        } else {
            let old = st.blocks[k as usize];
            let old_blen = (st.len - k * bs).min(bs);
            let mut buf = vec![0u8; old_blen as usize];
            let verified = self.read_block(f, &mut buf, k * bs, old)?;
            let crc = crc32c(&buf[..p as usize]);
            // A block that failed keeps a CRC that cannot match, so recovery does not bless it.
            Some(if verified {
                Block::good(crc)
            } else {
                Block::rotten(!crc)
            })
        };
        // No record is rewritten (a torn one could spoil a durable block): the header's `tail_crc`
        // verifies the new last block, and records past `len` are older than the header, which
        // recovery ignores.
        let tail_crc = tail.map_or(0, |b| b.crc);
        let generation = self.write_header(f, st, len, tail_crc)?;
        self.fsync_file(&*f.data)?;
        self.fsync_file(&*f.crc)?;
        let nblocks = len.div_ceil(bs);
        st.len = len;
        st.blocks.truncate(nblocks as usize);
        if let Some(b) = tail {
            st.blocks[k as usize] = b;
        }
        if self.opts.sync {
            Self::header_durable(st, generation);
        }
        f.data.set_len(len)?;
        st.file_len = len;
        f.crc.set_len(record_at(nblocks))?;
        // The other slot still says the old, longer length; recovery may fall back to it (when a
        // later in-place write is torn) and must not find the dropped bytes promised there.
        let generation = self.write_header(f, st, len, tail_crc)?;
        self.fsync_file(&*f.data)?;
        self.fsync_file(&*f.crc)?;
        if self.opts.sync {
            Self::header_durable(st, generation);
        }
        Ok(())
    }

    /// One group-commit round: for every extent written since the last round, a commit header for
    /// its current length, then fsync of its data and crc files (reopening them if the cache closed
    /// them since the write: an fsync through any descriptor flushes the file); then the directory if
    /// files came or went. An IO error fails the store (what reached the disk is unknown). Running
    /// out of descriptors does not: nothing was written for the extents not synced yet, so they go
    /// back into the dirty set (with the directory) for the next round.
    fn round(&self) -> Result<(), StoreError> {
        let extents = {
            let mut d = lock(&self.dirty);
            for e in d.extents.values() {
                e.dirty.store(false, Ordering::SeqCst);
            }
            std::mem::take(&mut d.extents)
        };
        let extents: Vec<Arc<Extent>> = extents.into_values().collect();
        let mut again = Vec::new();
        let mut done = 0;
        let result = self.sync_extents(&extents, &mut done, &mut again);
        // Taken after the extents: the files this round made for extents registered without them
        // are in the directory it syncs (so is whatever came or went since the round began).
        let dir = std::mem::take(&mut lock(&self.dirty).dir);
        let result = result.and_then(|()| {
            if dir {
                self.disk.sync_dir().map_err(cache::open_error)?;
            }
            Ok(())
        });
        if result.is_err() {
            // Only a transient error leaves the store working; put back what this round did not
            // finish (harmless after other errors: the store refuses work anyway).
            if dir {
                lock(&self.dirty).dir = true;
            }
            again.extend(extents[done..].iter().cloned());
        }
        for ext in &again {
            self.mark_dirty(ext);
        }
        result
    }

    /// The extents' part of a round; `done` counts the extents finished (synced or skipped). A
    /// round of at least [`StoreOptions::sync_fs_from`] extents writes every header, then syncs the
    /// whole file system once ([`Disk::sync_fs`]), falling back to the files one by one if it
    /// cannot; a smaller round syncs each extent's data and crc files in turn. An extent's files are
    /// held only while it is being prepared or synced, so rounds keep the open-file bound.
    fn sync_extents(
        &self,
        extents: &[Arc<Extent>],
        done: &mut usize,
        again: &mut Vec<Arc<Extent>>,
    ) -> Result<(), StoreError> {
        let whole = self.opts.sync_fs_from > 0 && extents.len() >= self.opts.sync_fs_from as usize;
        if !whole {
            for ext in extents {
                let p = self.prepare_sync(ext)?;
                // From here on the extent is not put back if the round fails: only an IO error can
                // follow, and that fails the store.
                *done += 1;
                if let Some(p) = p {
                    sync_files(&p.files)?;
                    self.synced(ext, p, again);
                }
            }
            return Ok(());
        }
        let mut ready = Vec::with_capacity(extents.len());
        let mut prepared = Ok(());
        for ext in extents {
            match self.prepare_sync(ext) {
                Ok(Some(p)) => {
                    // Closing them before the sync below is fine: it covers closed files too.
                    p.files.syncing();
                    ready.push((ext, p.generation, p.synced));
                }
                Ok(None) => {}
                Err(e) => {
                    // The ones prepared before still get synced; the rest go back (`done`).
                    prepared = Err(e);
                    break;
                }
            }
            *done += 1;
        }
        // A failed `syncfs` falls back to the files' own fsyncs: they report any write-back error
        // of these files, and one of another file on the file system does not fail this store.
        let all = !ready.is_empty() && matches!(self.disk.sync_fs(), Ok(true));
        let mut ready = ready.into_iter();
        while let Some((ext, generation, synced)) = ready.next() {
            let files = if all {
                // Dropping pages needs the files; only if still open.
                self.cache.cached(ext.id)
            } else {
                // Reopened if the cache closed them: an fsync through any descriptor flushes.
                let f = match self.files(ext.id, Open::Existing) {
                    Ok(f) => f,
                    Err(e) => {
                        // Out of descriptors: these wait for the next round.
                        again.push(ext.clone());
                        again.extend(ready.map(|(ext, _, _)| ext.clone()));
                        return Err(e);
                    }
                };
                sync_files(&f)?;
                Some(f)
            };
            match files {
                Some(files) => self.synced(
                    ext,
                    Prepared {
                        files,
                        generation,
                        synced,
                    },
                    again,
                ),
                None => self.header_synced(ext, generation, again),
            }
        }
        prepared
    }

    /// After an extent's files were synced: drops the synced pages (`drop_synced`), lets go of the
    /// files, marks the header durable.
    fn synced(&self, ext: &Arc<Extent>, p: Prepared, again: &mut Vec<Arc<Extent>>) {
        if self.opts.drop_synced {
            // Best effort: failing to drop costs memory, not data.
            let _ = p.files.data.drop_range(p.synced.0, p.synced.1);
        }
        drop(p.files);
        self.header_synced(ext, p.generation, again);
    }

    fn header_synced(&self, ext: &Arc<Extent>, generation: u64, again: &mut Vec<Arc<Extent>>) {
        let mut st = write(&ext.state);
        Self::header_durable(&mut st, generation);
        // Recovery reads every block between the two headers' lengths (the newer header's round
        // may not have completed). Writing the same length into the other slot next round bounds
        // that to the last block once the extent goes idle; an extent still being written gets a
        // new header every round anyway.
        if st.hdr.lens[0] != st.hdr.lens[1] {
            again.push(ext.clone());
        }
    }

    /// Writes the header of a round for `ext`'s current length; returns its files, the header's
    /// generation and the range the round makes durable past what earlier rounds dropped (from the
    /// page holding the old mark: that page may have been partial then). `None`: deleted.
    fn prepare_sync(&self, ext: &Extent) -> Result<Option<Prepared>, StoreError> {
        let mut st = write(&ext.state);
        if st.deleted {
            return Ok(None);
        }
        let f = self.born_files(ext.id, &mut st)?;
        let len = st.len;
        let tail_crc = match (len % self.bs, st.blocks.last()) {
            (0, _) | (_, None) => 0,
            (_, Some(b)) => b.crc,
        };
        let generation = self.write_header(&f, &mut st, len, tail_crc)?;
        let from = st.uncached.min(len) / DROP_ALIGN * DROP_ALIGN;
        st.uncached = len;
        Ok(Some(Prepared {
            files: f,
            generation,
            synced: (from, len - from),
        }))
    }
}

/// An extent's data and crc files, fsynced (marked synced first, so closing them after needs none).
fn sync_files(f: &Files) -> std::io::Result<()> {
    f.syncing();
    f.data.sync_data()?;
    f.crc.sync_data()
}

/// An extent a round wrote a header for ([`ExtentStore::prepare_sync`]).
struct Prepared {
    files: Arc<Files>,
    generation: u64,
    /// `(offset, len)` of what the round makes durable past what earlier rounds dropped.
    synced: (u64, u64),
}

impl Extent {
    fn new(id: ExtentId, state: State) -> Self {
        Self {
            id,
            dirty: AtomicBool::new(false),
            state: RwLock::new(state),
        }
    }
}
