//! The extent store of one data partition (docs/design.md §7): extents in files behind a [`Disk`], a
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
//!
//! Files: this one holds the types (options, errors, an extent's state) and the helpers every call
//! uses (the gate, lookups, failing the store); `open.rs` opens and reopens, `lifecycle.rs` creates
//! and deletes extents, `write.rs`, `read.rs` and `shrink.rs` change and read them, `commit.rs` runs
//! the group commit. Below them: `cache.rs` (open files), `format.rs` (bytes on disk), `crc.rs`,
//! `recovery.rs` (one extent at open), `spares.rs` (recycled files).

mod cache;
mod commit;
mod crc;
mod format;
mod lifecycle;
mod open;
mod read;
mod recovery;
mod shrink;
mod spares;
mod write;

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, RwLock, RwLockReadGuard, TryLockError};
use std::time::Instant;

// The workspace's lock policy (nacre_types::sync). Critical sections here update memory only after
// their IO succeeded, so a panic never leaves a half-updated state behind.
use nacre_types::sync::{lock, read, write};
use nacre_types::{ErrorCode, ExtentId, crc32c};
use serde::{Deserialize, Serialize};

use crate::io::{Disk, DiskFile};
use cache::{CacheError, FileCache, Files, Open};
use commit::Commit;
use open::Recovery;
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

/// Default for [`StoreOptions::sync_fs_from`].
pub const DEFAULT_SYNC_FS_FROM: u32 = 4;
/// Default [`StoreOptions::writeback_after`]: one append packet.
pub const DEFAULT_WRITEBACK_AFTER: u32 = 128 * 1024;

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

impl ExtentStore {
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
