//! Extent store tests: against a naive model (`BTreeMap<ExtentId, Vec<u8>>`), across crash images with
//! torn writes, with bit rot, with injected IO failures at every step, on real files, and under
//! concurrent group commit.
#![allow(clippy::unwrap_used)]

use std::collections::{BTreeMap, BTreeSet};
use std::io;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use nacre_data::io::{Disk, DiskFile, FaultPlan, FaultyDisk, FileDisk, MemDisk};
use nacre_data::store::{ExtentStore, SparePool, StoreError, StoreOptions, Trimmed};
use nacre_types::{ErrorCode, ExtentId, crc32c};
use proptest::prelude::*;

/// Small blocks so that short writes span several of them.
const BS: u32 = 64;
const NORMAL: [ExtentId; 3] = [ExtentId(1024), ExtentId(1025), ExtentId(1026)];
const TINY: [ExtentId; 2] = [ExtentId(1), ExtentId(2)];
/// `NORMAL` then `TINY`.
const ALL: [ExtentId; 5] = [NORMAL[0], NORMAL[1], NORMAL[2], TINY[0], TINY[1]];

fn opts() -> StoreOptions {
    StoreOptions {
        block_size: BS,
        sync: true,
        ..StoreOptions::default()
    }
}

/// At most `cap` extents' files open at once.
fn capped(cap: u32) -> StoreOptions {
    StoreOptions {
        max_open_extents: cap,
        ..opts()
    }
}

fn open(disk: &MemDisk) -> ExtentStore {
    ExtentStore::open(Arc::new(disk.clone()), opts()).unwrap()
}

fn open_capped(disk: &MemDisk, cap: u32) -> ExtentStore {
    ExtentStore::open(Arc::new(disk.clone()), capped(cap)).unwrap()
}

fn data_name(id: ExtentId) -> String {
    format!("{}.data", id.0)
}

/// What recovery will count as found of each extent on a disk (`Trimmed::old_len`, at least the
/// recovered length): its data file's length, but no further than the blocks its crc file has
/// records for (past them lie writes whose records never landed, or a recycled file's old bytes).
fn data_lens(disk: &MemDisk) -> BTreeMap<ExtentId, u64> {
    ALL.iter()
        .filter_map(|&id| {
            let data = disk.read_file(&data_name(id))?.len() as u64;
            let crc = disk.read_file(&format!("{}.crc", id.0)).unwrap_or_default();
            let n = crc.len().saturating_sub(128) / 32;
            let bs = u64::from(BS);
            // The end of the last block with a record (all of it if that record is torn).
            let recorded = match n.checked_sub(1) {
                None => 0,
                Some(last) => {
                    let at = 128 + 32 * last;
                    let len = u64::from(u32::from_le_bytes(crc[at..at + 4].try_into().unwrap()));
                    let full = n as u64 * bs;
                    if (1..=bs).contains(&len) {
                        full - bs + len
                    } else {
                        full
                    }
                }
            };
            Some((id, data.min(recorded)))
        })
        .collect()
}

// -------------------------------------------------------------------------------------------------
// The model

/// An operation; numbers are resolved against the model's current state.
#[derive(Clone, Debug)]
enum Op {
    Create(usize),
    Append(usize, Vec<u8>),
    Overwrite(usize, u16, Vec<u8>),
    TinyWrite(usize, u16, Vec<u8>),
    Truncate(usize, u16),
    Punch(usize, u16, u16),
    Delete(usize),
    Read(usize, u16, u16),
    Repair(usize, u16, Vec<u8>),
    Sync,
}

/// A resolved operation.
#[derive(Clone, Debug)]
enum Call {
    Create(ExtentId),
    Write(ExtentId, u64, Vec<u8>),
    Truncate(ExtentId, u64),
    Punch(ExtentId, u64, u64),
    Delete(ExtentId),
    Read(ExtentId, u64, u32),
    Repair(ExtentId, u64, Vec<u8>),
    Sync,
}

fn op() -> impl Strategy<Value = Op> {
    let data = || prop::collection::vec(any::<u8>(), 1..160);
    prop_oneof![
        2 => (0..3usize).prop_map(Op::Create),
        6 => (0..5usize, data()).prop_map(|(e, d)| Op::Append(e, d)),
        3 => (0..5usize, any::<u16>(), data()).prop_map(|(e, o, d)| Op::Overwrite(e, o, d)),
        3 => (0..2usize, 0..300u16, data()).prop_map(|(t, g, d)| Op::TinyWrite(t, g, d)),
        2 => (0..5usize, any::<u16>()).prop_map(|(e, l)| Op::Truncate(e, l)),
        2 => (0..2usize, any::<u16>(), any::<u16>()).prop_map(|(t, o, l)| Op::Punch(t, o, l)),
        1 => (0..3usize).prop_map(Op::Delete),
        3 => (0..5usize, any::<u16>(), any::<u16>()).prop_map(|(e, o, l)| Op::Read(e, o, l)),
        2 => (0..5usize, any::<u16>(), prop::collection::vec(any::<u8>(), 1..=BS as usize))
            .prop_map(|(e, i, d)| Op::Repair(e, i, d)),
        2 => Just(Op::Sync),
    ]
}

/// The naive model, plus what a crash may and may not take away.
#[derive(Debug, Default)]
struct Sim {
    model: BTreeMap<ExtentId, Vec<u8>>,
    /// Content as of the extent's last durable point (a sync, or a truncate or punch, which fsync).
    synced: BTreeMap<ExtentId, Vec<u8>>,
    /// Extents whose name was durable at the last sync.
    dir_synced: BTreeSet<ExtentId>,
    /// Extents created or deleted since the last sync: they may or may not survive a crash.
    names_changed: BTreeSet<ExtentId>,
    /// Extents a failed call may have created or removed files of: unknown from then on.
    unsure: BTreeSet<ExtentId>,
    /// Blocks changed in place since the extent's last durable point (a crash may tear them).
    dirty: BTreeMap<ExtentId, BTreeSet<u64>>,
    /// A failed truncate may have landed: the durable prefix may end here.
    cap: BTreeMap<ExtentId, u64>,
    /// Every content each extent ever had (any verified block must come from one of them).
    history: BTreeMap<ExtentId, Vec<Vec<u8>>>,
}

impl Sim {
    fn bs() -> u64 {
        u64::from(BS)
    }

    fn len(&self, id: ExtentId) -> u64 {
        self.model.get(&id).map_or(0, |v| v.len() as u64)
    }

    fn exists(&self, id: ExtentId) -> bool {
        ExtentStore::is_tiny(id) || self.model.contains_key(&id)
    }

    fn resolve(&self, op: &Op) -> Call {
        let bs = Self::bs();
        match op.clone() {
            Op::Create(i) => Call::Create(NORMAL[i]),
            Op::Append(e, d) => Call::Write(ALL[e], self.len(ALL[e]), d),
            Op::Overwrite(e, o, d) => {
                let id = ALL[e];
                Call::Write(id, u64::from(o) % (self.len(id) + 1), d)
            }
            Op::TinyWrite(t, gap, d) => Call::Write(TINY[t], self.len(TINY[t]) + u64::from(gap), d),
            Op::Truncate(e, l) => {
                let id = ALL[e];
                Call::Truncate(id, u64::from(l) % (self.len(id) + 1))
            }
            Op::Punch(t, o, l) => {
                let id = TINY[t];
                let len = self.len(id);
                let off = u64::from(o) % (len + 1);
                Call::Punch(id, off, u64::from(l) % (len - off + 1))
            }
            Op::Delete(i) => Call::Delete(NORMAL[i]),
            Op::Read(e, o, l) => {
                let id = ALL[e];
                let len = self.len(id);
                let off = u64::from(o) % (len + 1);
                Call::Read(id, off, (u64::from(l) % (len - off + 1)) as u32)
            }
            Op::Repair(e, i, d) => {
                let id = ALL[e];
                let len = self.len(id);
                let blocks = len.div_ceil(bs);
                let mut index = u64::from(i) % (blocks + 1);
                if index == blocks && !len.is_multiple_of(bs) {
                    // Past a partial last block: replace that block instead.
                    index -= 1;
                }
                let data = if (index + 1) * bs < len {
                    // Not the last block: a whole block.
                    d.iter().copied().cycle().take(BS as usize).collect()
                } else {
                    d
                };
                Call::Repair(id, index, data)
            }
            Op::Sync => Call::Sync,
        }
    }

    /// The error a call must fail with, if the model says it cannot succeed.
    fn expected_error(&self, call: &Call) -> Option<ErrorCode> {
        match call {
            Call::Write(id, ..) | Call::Truncate(id, _) | Call::Read(id, ..)
                if !self.exists(*id) =>
            {
                Some(ErrorCode::NotFound)
            }
            _ => None,
        }
    }

    fn exec(store: &ExtentStore, call: &Call) -> Result<Option<Vec<u8>>, StoreError> {
        match call {
            Call::Create(id) => store.create(*id),
            Call::Write(id, off, d) => store.write(*id, *off, d),
            Call::Truncate(id, len) => store.truncate(*id, *len),
            Call::Punch(id, off, len) => store.punch(*id, *off, *len),
            Call::Delete(id) => store.delete(*id),
            Call::Read(id, off, len) => return Ok(Some(store.read(*id, *off, *len)?.to_vec())),
            Call::Repair(id, index, d) => store.repair_block(*id, *index, d),
            Call::Sync => store.sync(),
        }
        .map(|()| None)
    }

    fn record(&mut self, id: ExtentId) {
        let v = self.model.get(&id).cloned().unwrap_or_default();
        self.history.entry(id).or_default().push(v);
    }

    /// Records a content an extent may have on disk without the model having it.
    fn record_maybe(&mut self, id: ExtentId, content: Vec<u8>) {
        self.history.entry(id).or_default().push(content);
    }

    fn created(&mut self, id: ExtentId) {
        if let std::collections::btree_map::Entry::Vacant(e) = self.model.entry(id) {
            e.insert(Vec::new());
            self.names_changed.insert(id);
            self.record(id);
        }
    }

    fn dirty_range(&mut self, id: ExtentId, start: u64, end: u64) {
        let bs = Self::bs();
        if start < end {
            self.dirty
                .entry(id)
                .or_default()
                .extend(start / bs..=(end - 1) / bs);
        }
    }

    fn applied_write(v: &[u8], off: u64, d: &[u8]) -> Vec<u8> {
        let mut v = v.to_vec();
        let (off, end) = (off as usize, off as usize + d.len());
        if v.len() < end {
            v.resize(end, 0);
        }
        v[off..end].copy_from_slice(d);
        v
    }

    /// The store did `call`.
    fn done(&mut self, call: &Call) {
        match call {
            Call::Create(id) => self.created(*id),
            Call::Write(id, off, d) => {
                self.created(*id);
                let old = self.len(*id);
                self.dirty_range(*id, *off, (off + d.len() as u64).min(old));
                let v = Self::applied_write(&self.model[id], *off, d);
                self.model.insert(*id, v);
                self.record(*id);
            }
            Call::Truncate(id, len) => {
                if *len < self.len(*id) {
                    self.model.get_mut(id).unwrap().truncate(*len as usize);
                    self.durable(*id);
                }
            }
            Call::Punch(id, off, len) => {
                if *len > 0 {
                    let v = self.model.get_mut(id).unwrap();
                    v[*off as usize..(off + len) as usize].fill(0);
                    self.durable(*id);
                }
            }
            Call::Delete(id) => {
                if self.model.remove(id).is_some() {
                    self.names_changed.insert(*id);
                }
            }
            Call::Read(..) => {}
            Call::Repair(id, index, d) => {
                let start = index * Self::bs();
                let end = start + d.len() as u64;
                let len = self.len(*id);
                if end < len && len <= start + Self::bs() {
                    self.done(&Call::Truncate(*id, end));
                }
                self.done(&Call::Write(*id, start, d.clone()));
            }
            Call::Sync => {
                self.synced = self.model.clone();
                self.dirty.clear();
                self.cap.clear();
                self.names_changed.clear();
                self.dir_synced = self.model.keys().copied().collect();
            }
        }
    }

    /// Truncate and punch fsync the extent: everything it holds is durable (its name may not be).
    fn durable(&mut self, id: ExtentId) {
        self.synced.insert(id, self.model[&id].clone());
        self.dirty.remove(&id);
        self.cap.remove(&id);
        self.record(id);
    }

    /// `call` failed with an IO error: some of it may have reached the disk.
    fn maybe(&mut self, call: &Call) {
        let bs = Self::bs();
        match call {
            Call::Create(id) | Call::Delete(id) => {
                self.unsure.insert(*id);
            }
            Call::Write(id, off, d) => {
                if !self.model.contains_key(id) {
                    self.unsure.insert(*id);
                }
                let cur = self.model.get(id).cloned().unwrap_or_default();
                self.dirty_range(*id, *off, (off + d.len() as u64).min(cur.len() as u64));
                self.record_maybe(*id, Self::applied_write(&cur, *off, d));
            }
            Call::Truncate(id, len) => {
                if let Some(cur) = self.model.get(id).cloned() {
                    let c = self.cap.entry(*id).or_insert(u64::MAX);
                    *c = (*c).min(*len);
                    self.record_maybe(*id, cur[..*len as usize].to_vec());
                }
            }
            Call::Punch(id, off, len) => {
                if let Some(mut cur) = self.model.get(id).cloned() {
                    self.dirty_range(*id, *off, off + len);
                    cur[*off as usize..(off + len) as usize].fill(0);
                    self.record_maybe(*id, cur);
                }
            }
            Call::Repair(id, index, d) => {
                if !self.model.contains_key(id) {
                    self.unsure.insert(*id);
                }
                let cur = self.model.get(id).cloned().unwrap_or_default();
                let start = index * bs;
                let end = start + d.len() as u64;
                self.dirty.entry(*id).or_default().insert(*index);
                let mut v = cur.clone();
                if end < cur.len() as u64 && cur.len() as u64 <= start + bs {
                    let c = self.cap.entry(*id).or_insert(u64::MAX);
                    *c = (*c).min(end);
                    v.truncate(end as usize);
                    self.record_maybe(*id, v.clone());
                }
                self.record_maybe(*id, Self::applied_write(&v, start, d));
            }
            Call::Read(..) | Call::Sync => {}
        }
    }

    /// Runs `op` on the store and the model; checks reads and expected errors.
    fn step(&mut self, store: &ExtentStore, op: &Op) -> Result<(), StoreError> {
        let call = self.resolve(op);
        let result = Self::exec(store, &call);
        if let Some(code) = self.expected_error(&call) {
            match &result {
                Err(e) if e.code() == code => return Ok(()),
                Err(StoreError::Io(_) | StoreError::Failed) => {}
                other => panic!("{call:?}: expected {code:?}, got {other:?}"),
            }
        }
        match result {
            Ok(read) => {
                if let (Call::Read(id, off, len), Some(bytes)) = (&call, read) {
                    let v = self.model.get(id).map_or(&[][..], |v| &v[..]);
                    assert_eq!(
                        bytes,
                        v[*off as usize..*off as usize + *len as usize],
                        "{call:?}"
                    );
                }
                self.done(&call);
                Ok(())
            }
            Err(e @ StoreError::Io(_)) => {
                self.maybe(&call);
                Err(e)
            }
            Err(e) => Err(e),
        }
    }

    /// The store holds exactly the model.
    fn check_exact(&self, store: &ExtentStore) {
        let want: Vec<(ExtentId, u64)> = self
            .model
            .iter()
            .map(|(id, v)| (*id, v.len() as u64))
            .collect();
        assert_eq!(store.extents(), want);
        for (id, v) in &self.model {
            assert_eq!(store.read(*id, 0, v.len() as u32).unwrap(), v[..], "{id}");
            let crcs: Vec<u32> = v.chunks(BS as usize).map(crc32c).collect();
            assert_eq!(store.block_crcs(*id).unwrap(), crcs, "{id}");
        }
    }

    /// The store, reopened on a crash image whose data files had `found` lengths, keeps everything
    /// durable, serves only bytes some state of the extent had, and reports its trims.
    fn check_recovered(&self, store: &ExtentStore, found: &BTreeMap<ExtentId, u64>) {
        let bs = Self::bs();
        let listed: BTreeMap<ExtentId, u64> = store.extents().into_iter().collect();
        let report: BTreeMap<ExtentId, Trimmed> = store
            .recovery_report()
            .iter()
            .map(|t| (t.extent, *t))
            .collect();
        for id in ALL {
            let uncertain = self.names_changed.contains(&id) || self.unsure.contains(&id);
            let durable = self.dir_synced.contains(&id) && !uncertain;
            let Some(&len) = listed.get(&id) else {
                assert!(!durable, "{id} was durable and is gone");
                continue;
            };
            assert!(durable || uncertain, "{id} appeared from nowhere");
            let found_len = found[&id].max(len);
            if found_len == len {
                assert!(!report.contains_key(&id), "{id}: {:?}", report.get(&id));
            } else {
                let t = Trimmed {
                    extent: id,
                    old_len: found_len,
                    new_len: len,
                };
                assert_eq!(report.get(&id), Some(&t));
            }
            let dirty = self.dirty.get(&id).cloned().unwrap_or_default();
            if durable {
                let s = &self.synced[&id];
                let stable = dirty
                    .first()
                    .map_or(s.len() as u64, |&b| (b * bs).min(s.len() as u64))
                    .min(self.cap.get(&id).copied().unwrap_or(u64::MAX));
                assert!(len >= stable, "{id}: {len} bytes, {stable} were durable");
                if stable > 0 {
                    assert_eq!(
                        store.read(id, 0, stable as u32).unwrap(),
                        s[..stable as usize],
                        "{id}: durable bytes changed"
                    );
                }
            }
            let history = self.history.get(&id).map_or(&[][..], |h| &h[..]);
            for b in 0..len.div_ceil(bs) {
                let start = b * bs;
                let n = (len - start).min(bs);
                match store.read(id, start, n as u32) {
                    Ok(bytes) => {
                        let (s, e) = (start as usize, (start + n) as usize);
                        assert!(
                            history.iter().any(|h| h.len() >= e && h[s..e] == bytes[..]),
                            "{id} block {b}: bytes no state ever had: {bytes:?}"
                        );
                    }
                    Err(StoreError::Corrupt { block, .. }) => {
                        assert_eq!(block, b);
                        assert!(
                            uncertain || dirty.contains(&b),
                            "{id} block {b} is corrupt but was not changed in place"
                        );
                    }
                    Err(e) => panic!("{id} block {b}: {e}"),
                }
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 1000, ..ProptestConfig::default() })]

    /// Reads always equal the model; a clean reopen finds exactly the model.
    #[test]
    fn store_matches_model(ops in prop::collection::vec(op(), 1..60)) {
        let disk = MemDisk::new();
        let store = open(&disk);
        let mut sim = Sim::default();
        for op in &ops {
            sim.step(&store, op).unwrap();
        }
        sim.check_exact(&store);
        store.sync().unwrap();
        drop(store);
        let store = open(&disk);
        prop_assert!(store.recovery_report().is_empty(), "{:?}", store.recovery_report());
        sim.check_exact(&store);
    }

    /// After a crash (unsynced writes lost, kept or torn), the reopened store keeps everything synced,
    /// serves nothing unverified and reports what it trimmed.
    #[test]
    fn crash_recovery(ops in prop::collection::vec(op(), 1..50), seed in any::<u64>()) {
        check_crash_recovery(&ops, seed, &opts());
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 500, ..ProptestConfig::default() })]

    /// The same with one extent's files open at a time: nearly every call reopens its extent, and
    /// every sync round reopens extents whose files were closed after they were written.
    #[test]
    fn crash_recovery_with_evicted_files(
        ops in prop::collection::vec(op(), 1..50),
        seed in any::<u64>(),
    ) {
        check_crash_recovery(&ops, seed, &capped(1));
    }
}

fn check_crash_recovery(ops: &[Op], seed: u64, opts: &StoreOptions) {
    let disk = MemDisk::new();
    let store = ExtentStore::open(Arc::new(disk.clone()), opts.clone()).unwrap();
    let mut sim = Sim::default();
    for op in ops {
        sim.step(&store, op).unwrap();
    }
    let cap = opts.max_open_extents as usize;
    assert!(store.open_extents() <= cap);
    assert!(
        disk.peak_open_files() <= 2 * cap,
        "{}",
        disk.peak_open_files()
    );
    for image in [
        disk.crash(),
        disk.crash_torn(seed),
        disk.crash_torn(seed ^ 0x5555),
    ] {
        let found = data_lens(&image);
        let recovered = ExtentStore::open(Arc::new(image.clone()), opts.clone()).unwrap();
        sim.check_recovered(&recovered, &found);
        // Recovery is idempotent.
        drop(recovered);
        let again = ExtentStore::open(Arc::new(image.clone()), opts.clone()).unwrap();
        assert!(
            again.recovery_report().is_empty(),
            "{:?}",
            again.recovery_report()
        );
        drop(again);
        assert!(image.peak_open_files() <= 2 * cap);
    }
}

// -------------------------------------------------------------------------------------------------
// Targeted cases

#[test]
fn normal_and_tiny_semantics() {
    let disk = MemDisk::new();
    let s = open(&disk);
    let n = ExtentId(1024);
    let t = ExtentId(3);
    assert!(matches!(s.write(n, 0, b"x"), Err(StoreError::NotFound(_))));
    s.create(n).unwrap();
    s.create(n).unwrap();
    s.write(n, 0, b"hello").unwrap();
    let e = s.write(n, 6, b"gap").unwrap_err();
    assert!(
        matches!(e, StoreError::OutOfRange { extent_len: 5, .. }),
        "{e}"
    );
    assert_eq!(e.code(), ErrorCode::InvalidArgument);
    // Tiny extents exist lazily and accept a gap.
    assert_eq!(s.len(t).unwrap(), 0);
    assert!(s.extents().iter().all(|(id, _)| *id != t));
    s.write(t, 4096, b"small file").unwrap();
    assert_eq!(s.len(t).unwrap(), 4106);
    assert_eq!(s.read(t, 4090, 8).unwrap()[..], b"\0\0\0\0\0\0sm"[..]);
    assert_eq!(s.extents(), vec![(t, 4106), (n, 5)]);
    // Normal extents are punched too (the unused parts of a file's extent); punching zeros
    // bytes in place.
    s.punch(n, 1, 1).unwrap();
    assert_eq!(s.read(n, 0, 5).unwrap()[..], b"h\0llo"[..]);
    s.write(n, 1, b"e").unwrap();
    // Wrong-kind and reserved ids.
    assert!(matches!(s.delete(t), Err(StoreError::Invalid(_))));
    assert!(matches!(
        s.create(ExtentId(100)),
        Err(StoreError::Invalid(_))
    ));
    assert!(matches!(
        s.write(ExtentId(0), 0, b"x"),
        Err(StoreError::Invalid(_))
    ));
    // Ranges.
    assert!(matches!(
        s.read(n, 3, 3),
        Err(StoreError::OutOfRange { .. })
    ));
    assert!(s.read(n, 5, 0).unwrap().is_empty());
    assert!(matches!(s.truncate(n, 6), Err(StoreError::Invalid(_))));
    assert!(matches!(
        s.punch(t, 4100, 7),
        Err(StoreError::OutOfRange { .. })
    ));
    s.truncate(n, 2).unwrap();
    assert_eq!(s.read(n, 0, 2).unwrap()[..], b"he"[..]);
    s.delete(n).unwrap();
    s.delete(n).unwrap();
    assert!(matches!(s.len(n), Err(StoreError::NotFound(_))));
    assert_eq!(StoreError::NotFound(n).code(), ErrorCode::NotFound);
    assert_eq!(StoreError::Failed.code(), ErrorCode::Internal);
}

/// Creating an extent only registers it: its files are made by its first write or by the next
/// sync round, whichever comes first, and the round makes them durable with the directory.
#[test]
fn created_extents_get_their_files_from_the_first_write_or_the_next_round() {
    let disk = MemDisk::new();
    let s = open(&disk);
    let [a, b, c] = NORMAL;
    let has_files = |d: &MemDisk, id: ExtentId| d.read_file(&data_name(id)).is_some();
    for id in NORMAL {
        s.create(id).unwrap();
        assert!(!has_files(&disk, id), "{id}");
        assert_eq!(s.len(id).unwrap(), 0);
        assert!(s.read(id, 0, 0).unwrap().is_empty());
        assert!(matches!(
            s.read(id, 0, 1),
            Err(StoreError::OutOfRange { extent_len: 0, .. })
        ));
    }
    assert_eq!(s.extents(), vec![(a, 0), (b, 0), (c, 0)]);
    s.write(a, 0, b"first").unwrap();
    assert!(has_files(&disk, a));
    assert!(!has_files(&disk, b));
    // Deleting one that never had files.
    s.delete(c).unwrap();
    assert!(matches!(s.len(c), Err(StoreError::NotFound(_))));
    assert!(matches!(s.write(c, 0, b"x"), Err(StoreError::NotFound(_))));
    // Nothing is durable before the round; after it, both survive a crash.
    let r = open(&disk.crash());
    assert!(r.extents().is_empty(), "{:?}", r.extents());
    s.sync().unwrap();
    assert!(has_files(&disk, b));
    assert!(!has_files(&disk, c));
    let r = open(&disk.crash());
    assert!(r.recovery_report().is_empty());
    assert_eq!(r.extents(), vec![(a, 5), (b, 0)]);
    assert_eq!(r.read(a, 0, 5).unwrap()[..], b"first"[..]);
    // A leftover of a delete whose remove failed does not show through the new files.
    disk.open(&data_name(c))
        .unwrap()
        .write_at(b"stale", 0)
        .unwrap();
    s.repair_block(c, 0, b"new").unwrap();
    assert_eq!(s.read(c, 0, 3).unwrap()[..], b"new"[..]);
    assert_eq!(disk.read_file(&data_name(c)).unwrap(), b"new");
    s.sync().unwrap();
    assert_eq!(open(&disk.crash()).read(c, 0, 3).unwrap()[..], b"new"[..]);
}

#[test]
fn open_rejects_a_different_block_size() {
    let disk = MemDisk::new();
    let s = open(&disk);
    s.create(NORMAL[0]).unwrap();
    s.write(NORMAL[0], 0, &[1; 100]).unwrap();
    s.sync().unwrap();
    drop(s);
    let other = StoreOptions {
        block_size: 128,
        ..opts()
    };
    let e = ExtentStore::open(Arc::new(disk.clone()), other).unwrap_err();
    assert!(matches!(e, StoreError::Invalid(_)), "{e}");
    let bad = StoreOptions {
        block_size: 1,
        ..opts()
    };
    assert!(ExtentStore::open(Arc::new(disk.clone()), bad).is_err());
    let e = ExtentStore::open(Arc::new(disk), capped(0)).unwrap_err();
    assert!(matches!(e, StoreError::Invalid(_)), "{e}");
}

#[test]
fn a_flipped_bit_is_reported_and_repaired() {
    let disk = MemDisk::new();
    let s = open(&disk);
    let id = NORMAL[0];
    let good: Vec<u8> = (0..200u8).collect();
    s.create(id).unwrap();
    s.write(id, 0, &good).unwrap();
    s.sync().unwrap();
    disk.corrupt(&data_name(id), 70).unwrap();

    let e = s.read(id, 0, 200).unwrap_err();
    assert!(
        matches!(e, StoreError::Corrupt { extent, block: 1, offset: 64 } if extent == id),
        "{e}"
    );
    assert_eq!(e.code(), ErrorCode::Corrupt);
    // Other blocks still read; a range inside the bad block does not.
    assert_eq!(s.read(id, 0, 64).unwrap()[..], good[..64]);
    assert_eq!(s.read(id, 128, 72).unwrap()[..], good[128..]);
    assert!(s.read(id, 100, 1).is_err());
    // A partial overwrite cannot bless the rotten bytes: it patches the block's CRC for the bytes
    // it replaces, and the rot elsewhere in the block still fails it.
    s.write(id, 80, b"zz").unwrap();
    assert!(matches!(
        s.read(id, 64, 64),
        Err(StoreError::Corrupt { block: 1, .. })
    ));

    s.repair_block(id, 1, &good[64..128]).unwrap();
    assert_eq!(s.read(id, 0, 200).unwrap()[..], good[..]);
    s.sync().unwrap();

    // Rot found only after a reopen (blocks below the durable length are not read at open).
    disk.corrupt(&data_name(id), 10).unwrap();
    drop(s);
    let s = open(&disk);
    assert!(s.recovery_report().is_empty());
    assert!(matches!(
        s.read(id, 0, 10),
        Err(StoreError::Corrupt { block: 0, .. })
    ));
    // A block found at open is verified whole before an overwrite patches it.
    assert!(matches!(
        s.write(id, 20, b"zz"),
        Err(StoreError::Corrupt { block: 0, .. })
    ));
    let crcs = s.block_crcs(id).unwrap();
    assert_eq!(
        crcs[0],
        crc32c(&good[..64]),
        "the expected CRC, not the rotten one"
    );
    s.repair_block(id, 0, &good[..64]).unwrap();
    assert_eq!(s.read(id, 0, 200).unwrap()[..], good[..]);
}

#[test]
fn torn_tail_is_trimmed_and_reported() {
    let disk = MemDisk::new();
    let s = open(&disk);
    let id = NORMAL[0];
    s.create(id).unwrap();
    s.write(id, 0, &[1; 100]).unwrap();
    s.sync().unwrap();
    s.write(id, 100, &[2; 100]).unwrap();
    drop(s);
    // The process died (the unsynced append is in the files) and a bit of block 2 is wrong.
    disk.corrupt(&data_name(id), 150).unwrap();
    let s = open(&disk);
    assert_eq!(
        s.recovery_report(),
        &[Trimmed {
            extent: id,
            old_len: 200,
            new_len: 128
        }]
    );
    let mut want = vec![1; 100];
    want.extend([2; 28]);
    assert_eq!(s.read(id, 0, 128).unwrap()[..], want[..]);

    // Data past the records (a write whose records never landed, or a recycled file's old bytes)
    // is cut too, and not reported: nothing vouched for it.
    drop(s);
    let f = disk.open(&data_name(id)).unwrap();
    f.write_at(&[9; 30], 128).unwrap();
    let s = open(&disk);
    assert!(s.recovery_report().is_empty());
    assert_eq!(s.len(id).unwrap(), 128);
    assert_eq!(disk.read_file(&data_name(id)).unwrap().len(), 128);
}

#[test]
fn punched_blocks_survive_any_crash() {
    let disk = MemDisk::new();
    let s = open(&disk);
    let t = TINY[0];
    let content: Vec<u8> = (0..=255u8).cycle().take(500).collect();
    s.write(t, 0, &content).unwrap();
    s.sync().unwrap();
    s.punch(t, 10, 100).unwrap();
    s.punch(t, 30, 200).unwrap();
    s.write(t, 500, b"after").unwrap();
    for seed in 0..64 {
        let image = disk.crash_torn(seed);
        let r = open(&image);
        assert!(r.recovery_bad_blocks().is_empty(), "seed {seed}");
        let got = r.read(t, 0, 500).unwrap();
        let mut want = content.clone();
        want[10..230].fill(0);
        assert_eq!(got[..], want[..], "seed {seed}: punches are durable");
    }
}

// -------------------------------------------------------------------------------------------------
// Injected failures

fn faulty_workload() -> Vec<Op> {
    vec![
        Op::Create(0),
        Op::Append(0, vec![1; 100]),
        Op::Sync,
        Op::Append(0, vec![2; 90]),
        Op::TinyWrite(0, 10, vec![3; 150]),
        Op::Sync,
        Op::Overwrite(0, 30, vec![4; 70]),
        Op::Punch(0, 20, 100),
        Op::Create(1),
        Op::Append(1, vec![5; 200]),
        Op::Truncate(0, 150),
        Op::Read(0, 10, 100),
        Op::Sync,
        Op::Append(1, vec![6; 40]),
        Op::Repair(0, 1, vec![7; 64]),
        Op::Delete(1),
        Op::Append(4, vec![8; 30]),
        Op::Sync,
        Op::Append(0, vec![9; 64]),
        Op::Overwrite(0, 5, vec![10; 20]),
        Op::Repair(0, 2, vec![11; 20]),
        Op::Sync,
    ]
}

/// Runs `workload` on a disk that fails after `n` operations (tearing the failing write), then
/// checks every crash image and the files as left. Returns whether the workload never hit the fault.
fn run_with_fault(workload: &[Op], n: u64, seed: u64, opts: &StoreOptions) -> bool {
    let mem = MemDisk::new();
    let faulty = FaultyDisk::new(Arc::new(mem.clone()), FaultPlan::fail_after(n).tearing());
    let mut sim = Sim::default();
    let mut completed = true;
    if let Ok(store) = ExtentStore::open(Arc::new(faulty), opts.clone()) {
        let mut failed = false;
        // A failed read whose open had to close (so first fsync) another extent's files.
        let mut read_failed = false;
        for op in workload {
            let r = sim.step(&store, op);
            if failed {
                assert!(matches!(r, Err(StoreError::Failed)), "n={n} {op:?}: {r:?}");
            }
            match r {
                Ok(()) => {}
                // A read's IO error changes nothing, but when it is the fsync of files the read's
                // open closed to make room, it fails the store.
                Err(StoreError::Io(_)) if matches!(op, Op::Read(..)) => {
                    completed = false;
                    read_failed = true;
                }
                Err(StoreError::Failed) if failed || read_failed => failed = true,
                Err(e) => {
                    assert!(matches!(e, StoreError::Io(_)), "n={n} {op:?}: {e}");
                    completed = false;
                    failed = true;
                }
            }
        }
        if failed {
            assert!(matches!(store.len(NORMAL[0]), Err(StoreError::Failed)));
            assert!(matches!(store.sync(), Err(StoreError::Failed)));
        }
    } else {
        completed = false;
    }
    for (i, image) in [
        mem.crash(),
        mem.crash_torn(seed),
        mem.crash_torn(!seed),
        mem,
    ]
    .into_iter()
    .enumerate()
    {
        let found = data_lens(&image);
        let store = ExtentStore::open(Arc::new(image), opts.clone())
            .unwrap_or_else(|e| panic!("n={n} image {i}: reopen failed: {e}"));
        sim.check_recovered(&store, &found);
    }
    completed
}

/// Fails the disk after every possible number of operations: no panic; once a change failed (an
/// fsync or any write), everything returns `Failed`; every crash image, and the files as left,
/// recover.
#[test]
fn fail_after_every_n_operations() {
    let workload = faulty_workload();
    let mut n = 0;
    while !run_with_fault(&workload, n, n, &opts()) {
        n += 1;
    }
    assert!(n > 50, "the workload did only {n} operations");
}

/// The same with one extent's files open at a time, so that reopens (and the sync round's reopens
/// of evicted dirty extents) fail too.
#[test]
fn fail_after_every_n_operations_with_evicted_files() {
    let workload = faulty_workload();
    let mut n = 0;
    while !run_with_fault(&workload, n, n, &capped(1)) {
        n += 1;
    }
    assert!(n > 50, "the workload did only {n} operations");
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 500, ..ProptestConfig::default() })]

    /// Random workloads failing at a random operation.
    #[test]
    fn random_workloads_fail_anywhere(
        ops in prop::collection::vec(op(), 1..40),
        n in 0..300u64,
        seed in any::<u64>(),
    ) {
        run_with_fault(&ops, n, seed, &opts());
    }
}

// -------------------------------------------------------------------------------------------------
// Real files

/// A real file starts its write-back of a written range (`sync_file_range`), accepts an empty one,
/// and refuses one past `i64::MAX` with an error rather than a wrapped offset.
#[test]
fn file_disk_starts_write_back() {
    let dir = tempfile::tempdir().unwrap();
    let disk = FileDisk::new(dir.path()).unwrap();
    let f = disk.open("1024.data").unwrap();
    f.write_at(&vec![5; 1 << 20], 0).unwrap();
    f.start_writeback(0, 1 << 20).unwrap();
    f.start_writeback(1 << 20, 0).unwrap();
    let e = f.start_writeback(u64::MAX - 1, 1).unwrap_err();
    assert_eq!(e.kind(), io::ErrorKind::InvalidInput);
    f.sync_data().unwrap();
    let mut back = vec![0; 1 << 20];
    assert_eq!(f.read_at(&mut back, 0).unwrap(), 1 << 20);
    assert!(back.iter().all(|&b| b == 5));
}

#[test]
fn file_disk_punch_frees_space_and_reopens() {
    let dir = tempfile::tempdir().unwrap();
    let disk: Arc<dyn Disk> = Arc::new(FileDisk::new(dir.path()).unwrap());
    let s = ExtentStore::open(disk.clone(), StoreOptions::default()).unwrap();
    let t = ExtentId(1);
    let files: Vec<Vec<u8>> = (1..=3u8).map(|i| vec![i; 64 << 10]).collect();
    for (i, f) in files.iter().enumerate() {
        s.write(t, (i as u64) * (64 << 10), f).unwrap();
    }
    let n = ExtentId(1024);
    s.create(n).unwrap();
    s.write(n, 0, &vec![7; 300 << 10]).unwrap();
    s.sync().unwrap();
    let before = s.used();
    assert!(before >= 3 * (64 << 10), "{before}");

    s.punch(t, 64 << 10, 64 << 10).unwrap();
    let after = s.used();
    assert!(after < before, "punching frees space: {before} -> {after}");
    assert_eq!(s.len(t).unwrap(), 3 * (64 << 10), "size unchanged");
    assert!(
        s.read(t, 64 << 10, 64 << 10)
            .unwrap()
            .iter()
            .all(|&b| b == 0)
    );
    assert_eq!(s.read(t, 0, 64 << 10).unwrap()[..], files[0][..]);
    assert_eq!(s.read(t, 128 << 10, 64 << 10).unwrap()[..], files[2][..]);

    s.delete(n).unwrap();
    s.sync().unwrap();
    // The space comes back when the renamed files are removed (the data file once it is no
    // longer kept for a new extent).
    assert_eq!(s.used(), after);
    assert_eq!(s.spares().len(), 1);
    s.retire_spares(Instant::now());
    assert_eq!(s.remove_deleted().unwrap(), 2);
    assert!(s.used() < after);
    drop(s);

    let s = ExtentStore::open(disk, StoreOptions::default()).unwrap();
    assert!(s.recovery_report().is_empty());
    assert_eq!(s.extents(), vec![(t, 3 * (64 << 10))]);
    assert!(
        s.read(t, 64 << 10, 64 << 10)
            .unwrap()
            .iter()
            .all(|&b| b == 0)
    );
    assert_eq!(s.read(t, 128 << 10, 64 << 10).unwrap()[..], files[2][..]);
    let mut names = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect::<Vec<_>>();
    names.sort();
    assert_eq!(names, ["1.crc", "1.data"]);
}

// -------------------------------------------------------------------------------------------------
// Group commit

/// A disk whose fsyncs wait while a gate is closed, and which counts the bytes read from data files.
#[derive(Debug, Default)]
struct Gate {
    state: Mutex<GateState>,
    changed: Condvar,
    data_read: AtomicU64,
    /// Every page-cache hint, in order.
    hints: Mutex<Vec<Hint>>,
    /// `sync_data` and `sync_fs` calls.
    file_syncs: AtomicU64,
    fs_syncs: AtomicU64,
    /// `sync_fs` fails.
    fs_sync_fails: std::sync::atomic::AtomicBool,
    /// Every `start_writeback`: file, offset, length.
    writebacks: Mutex<Vec<(String, u64, u64)>>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
struct Hint {
    will_need: bool,
    file: String,
    off: u64,
    len: u64,
    /// The file's length at its last `sync_data` before the hint.
    synced: u64,
}

#[derive(Debug, Default)]
struct GateState {
    closed: bool,
    waiting: usize,
}

impl Gate {
    fn set(&self, closed: bool) {
        self.state.lock().unwrap().closed = closed;
        self.changed.notify_all();
    }

    fn pass(&self) {
        let mut s = self.state.lock().unwrap();
        s.waiting += 1;
        self.changed.notify_all();
        while s.closed {
            s = self.changed.wait(s).unwrap();
        }
        s.waiting -= 1;
    }

    fn wait_for_waiters(&self, n: usize) {
        let mut s = self.state.lock().unwrap();
        while s.waiting < n {
            s = self.changed.wait(s).unwrap();
        }
    }
}

#[derive(Debug)]
struct GateDisk {
    inner: MemDisk,
    gate: Arc<Gate>,
}

#[derive(Debug)]
struct GateFile {
    inner: Arc<dyn DiskFile>,
    gate: Arc<Gate>,
    name: String,
    is_data: bool,
    synced: AtomicU64,
}

impl GateFile {
    fn hint(&self, will_need: bool, off: u64, len: u64) {
        self.gate.hints.lock().unwrap().push(Hint {
            will_need,
            file: self.name.clone(),
            off,
            len,
            synced: self.synced.load(Ordering::SeqCst),
        });
    }
}

impl GateDisk {
    /// A store over `inner` behind a fresh (open) gate, and the gate.
    fn store(inner: MemDisk, opts: StoreOptions) -> (ExtentStore, Arc<Gate>) {
        let gate = Arc::new(Gate::default());
        let disk = GateDisk {
            inner,
            gate: gate.clone(),
        };
        (ExtentStore::open(Arc::new(disk), opts).unwrap(), gate)
    }

    fn wrap(&self, name: &str, inner: Arc<dyn DiskFile>) -> Arc<dyn DiskFile> {
        Arc::new(GateFile {
            inner,
            gate: self.gate.clone(),
            name: name.to_string(),
            is_data: name.ends_with(".data"),
            synced: AtomicU64::new(0),
        })
    }
}

impl Disk for GateDisk {
    fn open(&self, name: &str) -> io::Result<Arc<dyn DiskFile>> {
        Ok(self.wrap(name, self.inner.open(name)?))
    }
    fn open_existing(&self, name: &str) -> io::Result<Arc<dyn DiskFile>> {
        Ok(self.wrap(name, self.inner.open_existing(name)?))
    }
    fn list(&self) -> io::Result<Vec<String>> {
        self.inner.list()
    }
    fn remove(&self, name: &str) -> io::Result<()> {
        self.inner.remove(name)
    }
    fn rename(&self, from: &str, to: &str) -> io::Result<()> {
        self.inner.rename(from, to)
    }
    fn sync_dir(&self) -> io::Result<()> {
        self.inner.sync_dir()
    }
    fn sync_fs(&self) -> io::Result<bool> {
        self.gate.fs_syncs.fetch_add(1, Ordering::SeqCst);
        if self.gate.fs_sync_fails.load(Ordering::SeqCst) {
            return Err(io::Error::other("injected syncfs failure"));
        }
        self.inner.sync_fs()
    }
    fn used(&self) -> io::Result<u64> {
        self.inner.used()
    }
}

impl DiskFile for GateFile {
    fn read_at(&self, buf: &mut [u8], off: u64) -> io::Result<usize> {
        let n = self.inner.read_at(buf, off)?;
        if self.is_data {
            self.gate.data_read.fetch_add(n as u64, Ordering::SeqCst);
        }
        Ok(n)
    }
    fn write_at(&self, data: &[u8], off: u64) -> io::Result<()> {
        self.inner.write_at(data, off)
    }
    fn len(&self) -> io::Result<u64> {
        self.inner.len()
    }
    fn set_len(&self, len: u64) -> io::Result<()> {
        self.inner.set_len(len)
    }
    fn sync_data(&self) -> io::Result<()> {
        self.gate.pass();
        self.gate.file_syncs.fetch_add(1, Ordering::SeqCst);
        let len = self.inner.len()?;
        self.inner.sync_data()?;
        self.synced.store(len, Ordering::SeqCst);
        Ok(())
    }
    fn punch_hole(&self, off: u64, len: u64) -> io::Result<()> {
        self.inner.punch_hole(off, len)
    }
    fn drop_range(&self, off: u64, len: u64) -> io::Result<()> {
        self.hint(false, off, len);
        Ok(())
    }
    fn will_need(&self, off: u64, len: u64) -> io::Result<()> {
        self.hint(true, off, len);
        Ok(())
    }
    fn start_writeback(&self, off: u64, len: u64) -> io::Result<()> {
        self.gate
            .writebacks
            .lock()
            .unwrap()
            .push((self.name.clone(), off, len));
        self.inner.start_writeback(off, len)
    }
}

/// Appends to a normal extent start the write-back of every `writeback_after` bytes (the range
/// appended since the last start, never past what was written); in-place writes, tiny extents, a
/// store that does not sync and `writeback_after: 0` start none; the bytes are the same either way.
#[test]
fn appends_start_their_write_back() {
    let with = |every: u32, sync: bool| StoreOptions {
        writeback_after: every,
        sync,
        ..opts()
    };
    let mem = MemDisk::new();
    let (s, gate) = GateDisk::store(mem.clone(), with(256, true));
    let kicks = || std::mem::take(&mut *gate.writebacks.lock().unwrap());
    let id = NORMAL[0];
    let name = data_name(id);
    s.create(id).unwrap();
    s.write(id, 0, &[1; 100]).unwrap();
    assert_eq!(kicks(), []);
    s.write(id, 100, &[2; 200]).unwrap();
    assert_eq!(kicks(), [(name.clone(), 0, 300)]);
    s.write(id, 10, &[3; 10]).unwrap();
    s.write(id, 300, &[4; 100]).unwrap();
    assert_eq!(kicks(), [], "an overwrite, then too little appended");
    s.truncate(id, 350).unwrap();
    s.write(id, 350, &[5; 300]).unwrap();
    assert_eq!(
        kicks(),
        [(name.clone(), 300, 350)],
        "from the mark, below the cut"
    );
    s.write(TINY[0], 0, &[6; 1000]).unwrap();
    assert_eq!(kicks(), [], "tiny extents are synced at once anyway");
    s.sync().unwrap();
    drop(s);
    let s = open(&mem);
    let mut want = vec![1u8; 10];
    want.extend([3; 10]);
    want.extend([1; 80]);
    want.extend([2; 200]);
    want.extend([4; 50]);
    want.extend([5; 300]);
    assert_eq!(s.read(id, 0, 650).unwrap()[..], want[..]);
    drop(s);

    for (every, sync) in [(0, true), (256, false)] {
        let (s, gate) = GateDisk::store(MemDisk::new(), with(every, sync));
        s.create(id).unwrap();
        s.write(id, 0, &[7; 1000]).unwrap();
        assert_eq!(*gate.writebacks.lock().unwrap(), [], "{every} {sync}");
    }
}

/// A round with `sync_fs_from` extents or more syncs the file system once instead of each file; a
/// smaller one syncs the files; a failed `sync_fs` falls back to the files. Every write is durable
/// after each.
#[test]
fn large_rounds_sync_the_file_system_once() {
    let mem = MemDisk::new();
    let o = StoreOptions {
        sync_fs_from: 3,
        ..opts()
    };
    let (s, gate) = GateDisk::store(mem.clone(), o);
    for id in NORMAL {
        s.create(id).unwrap();
    }
    s.sync().unwrap();
    let counts = || {
        (
            gate.fs_syncs.swap(0, Ordering::SeqCst),
            gate.file_syncs.swap(0, Ordering::SeqCst),
        )
    };
    counts();
    let mut model: BTreeMap<ExtentId, Vec<u8>> = BTreeMap::new();
    let mut write = |id: ExtentId, byte: u8, len: usize| {
        let m = model.entry(id).or_default();
        s.write(id, m.len() as u64, &vec![byte; len]).unwrap();
        m.extend(std::iter::repeat_n(byte, len));
    };
    for (i, id) in NORMAL.into_iter().enumerate() {
        write(id, i as u8 + 1, 1000 + i);
    }
    s.sync().unwrap();
    assert_eq!(counts(), (1, 0), "three extents: one syncfs, no file fsync");
    // The next round writes the same lengths into the extents' other header slots.
    s.sync().unwrap();
    counts();
    write(NORMAL[0], 9, 300);
    write(TINY[0], 8, 70);
    s.sync().unwrap();
    assert_eq!(counts(), (0, 4), "two extents: their four files");
    gate.fs_sync_fails.store(true, Ordering::SeqCst);
    for id in ALL {
        write(id, 7, 130);
    }
    s.sync().unwrap();
    assert_eq!(
        counts(),
        (1, 10),
        "a failed syncfs falls back to the ten files"
    );
    drop(s);
    let s = open(&mem.crash());
    for (id, data) in &model {
        assert_eq!(
            s.read(*id, 0, data.len() as u32).unwrap()[..],
            data[..],
            "{id}"
        );
    }
}

/// A group commit asks the OS to drop what it made durable, only that, and from the page holding
/// the previous mark; an overwrite's prefetch asks for exactly the blocks it covers in part; with
/// `drop_synced` off nothing is dropped.
#[test]
fn synced_appends_leave_the_page_cache_and_partial_overwrites_are_prefetched() {
    let mem = MemDisk::new();
    let (s, gate) = GateDisk::store(mem.clone(), opts());
    let id = NORMAL[0];
    let data: Vec<u8> = (0..15_000u32).map(|i| (i % 251) as u8).collect();
    s.create(id).unwrap();
    s.write(id, 0, &data[..10_000]).unwrap();
    s.sync().unwrap();
    s.write(id, 10_000, &data[10_000..]).unwrap();
    s.sync().unwrap();
    let name = data_name(id);
    let drops: Vec<(u64, u64)> = gate
        .hints
        .lock()
        .unwrap()
        .iter()
        .filter(|h| !h.will_need && h.file == name)
        .inspect(|h| assert!(h.off + h.len <= h.synced, "dropped unsynced bytes: {h:?}"))
        .map(|h| (h.off, h.len))
        .collect();
    assert_eq!(drops, [(0, 10_000), (8192, 15_000 - 8192)]);

    // Blocks are 64 bytes; the extent's last block holds 15,000 - 14,976 = 24. This process wrote
    // every block, so an overwrite patches their CRCs and needs only the bytes it replaces.
    let asked = |s: &ExtentStore, gate: &Gate, offset: u64, len: u64| {
        gate.hints.lock().unwrap().clear();
        s.prefetch(id, offset, len);
        let h = gate.hints.lock().unwrap();
        assert!(h.iter().all(|h| h.will_need && h.file == name), "{h:?}");
        h.iter().map(|h| (h.off, h.len)).collect::<Vec<_>>()
    };
    assert_eq!(asked(&s, &gate, 100, 10), [(100, 10)]);
    assert_eq!(asked(&s, &gate, 128, 64), [], "a whole block needs no read");
    assert_eq!(asked(&s, &gate, 130, 100), [(130, 62), (192, 38)]);
    assert_eq!(asked(&s, &gate, 64, 150), [(192, 22)]);
    assert_eq!(asked(&s, &gate, 14_980, 20), [(14_980, 20)]);
    assert_eq!(
        asked(&s, &gate, 14_990, 20),
        [(14_976, 24)],
        "grows the block"
    );
    assert_eq!(asked(&s, &gate, 14_976, 24), [], "the whole last block");
    assert_eq!(asked(&s, &gate, 15_000, 10), [], "past the end");
    s.prefetch(NORMAL[1], 0, 10);
    assert_eq!(s.read(id, 0, 15_000).unwrap()[..], data[..]);
    drop(s);

    let keep = StoreOptions {
        drop_synced: false,
        ..opts()
    };
    let (s, gate) = GateDisk::store(mem.crash(), keep);
    // Blocks found at open are verified whole before their first overwrite; after it, patched.
    assert_eq!(asked(&s, &gate, 100, 10), [(64, 64)]);
    assert_eq!(asked(&s, &gate, 130, 100), [(128, 64), (192, 64)]);
    s.write(id, 100, &data[100..110]).unwrap();
    assert_eq!(asked(&s, &gate, 100, 10), [(100, 10)]);
    assert_eq!(s.read(id, 0, 15_000).unwrap()[..], data[..]);
    s.write(id, 15_000, b"more").unwrap();
    s.sync().unwrap();
    assert!(gate.hints.lock().unwrap().iter().all(|h| h.will_need));
}

/// Opening reads only the last block of an extent that is idle (synced, then one more round), not
/// the extent: blocks below the length two headers agree on were durable.
#[test]
fn recovery_reads_only_the_tail_of_idle_extents() {
    let mem = MemDisk::new();
    let s = open(&mem);
    let id = NORMAL[0];
    s.create(id).unwrap();
    s.write(id, 0, &vec![5; 100 * BS as usize + 10]).unwrap();
    s.sync().unwrap();
    // The extent is idle: the next round writes its length into the other header slot.
    s.create(NORMAL[1]).unwrap();
    s.sync().unwrap();
    drop(s);
    let (s, gate) = GateDisk::store(mem.clone(), opts());
    assert_eq!(s.len(id).unwrap(), 100 * u64::from(BS) + 10);
    assert_eq!(
        gate.data_read.load(Ordering::SeqCst),
        10,
        "only the partial last block"
    );
}

/// Callers that arrive while a round is in its fsyncs share the next round.
#[test]
fn group_commit_shares_rounds() {
    let mem = MemDisk::new();
    let (store, gate) = GateDisk::store(mem.clone(), opts());
    let store = Arc::new(store);
    for id in NORMAL {
        store.create(id).unwrap();
    }
    store.sync().unwrap();
    assert_eq!(store.sync_stats().rounds, 1);

    gate.set(true);
    let first = {
        let s = store.clone();
        std::thread::spawn(move || {
            s.write(NORMAL[0], 0, b"first").unwrap();
            s.sync()
        })
    };
    gate.wait_for_waiters(1);
    let others: Vec<_> = [
        (NORMAL[1], &b"second"[..]),
        (NORMAL[2], b"third"),
        (TINY[0], b"fourth"),
    ]
    .into_iter()
    .map(|(id, d)| {
        let s = store.clone();
        std::thread::spawn(move || {
            s.write(id, 0, d).unwrap();
            s.sync()
        })
    })
    .collect();
    // Wait until all four callers are inside sync (no sleeping: poll the counter).
    let deadline = Instant::now() + Duration::from_secs(30);
    while store.sync_stats().calls < 5 {
        assert!(Instant::now() < deadline, "callers never arrived");
        std::thread::yield_now();
    }
    gate.set(false);
    first.join().unwrap().unwrap();
    for t in others {
        t.join().unwrap().unwrap();
    }
    let stats = store.sync_stats();
    assert_eq!(stats.calls, 5);
    assert_eq!(stats.rounds, 3, "the three late callers shared one round");

    let image = mem.crash();
    let s = open(&image);
    assert_eq!(s.read(NORMAL[0], 0, 5).unwrap()[..], b"first"[..]);
    assert_eq!(s.read(NORMAL[1], 0, 6).unwrap()[..], b"second"[..]);
    assert_eq!(s.read(NORMAL[2], 0, 5).unwrap()[..], b"third"[..]);
    assert_eq!(s.read(TINY[0], 0, 6).unwrap()[..], b"fourth"[..]);
}

/// Many writers syncing at once: every sync makes that caller's write durable, and rounds are
/// shared (never more rounds than calls).
#[test]
fn concurrent_syncs_are_durable() {
    let mem = MemDisk::new();
    let store = Arc::new(open(&mem));
    let ids = [NORMAL[0], NORMAL[1], NORMAL[2], TINY[0]];
    for id in NORMAL {
        store.create(id).unwrap();
    }
    let threads: Vec<_> = ids
        .into_iter()
        .enumerate()
        .map(|(t, id)| {
            let s = store.clone();
            let mem = mem.clone();
            std::thread::spawn(move || {
                for i in 0..25u64 {
                    let d = vec![(t * 25) as u8 + i as u8; 40];
                    s.write(id, i * 40, &d).unwrap();
                    s.sync().unwrap();
                    let image = mem.crash().read_file(&data_name(id)).unwrap();
                    assert_eq!(image[(i * 40) as usize..][..40], d[..], "{id} write {i}");
                    // Reads of one extent from several threads meanwhile.
                    assert_eq!(s.read(id, i * 40, 40).unwrap()[..], d[..]);
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    let stats = store.sync_stats();
    assert_eq!(stats.calls, 100);
    assert!(stats.rounds <= stats.calls, "{stats:?}");
    let s = open(&mem.crash());
    assert!(s.recovery_report().is_empty());
    for id in ids {
        assert_eq!(s.len(id).unwrap(), 1000);
    }
}

/// ENOSPC fails the write, not the store: nothing changes in memory, the half-written bytes never
/// show, and once there is room writes, syncs and a reopen work as if the failed write never was.
/// A failed overwrite inside the extent is like one a crash tore: its blocks fail their CRC (never
/// serving the torn bytes) until a replica's copy repairs them.
#[test]
fn a_full_disk_fails_the_write_not_the_store() {
    let mem = MemDisk::new();
    let faulty = FaultyDisk::new(Arc::new(mem.clone()), FaultPlan::default());
    let store = ExtentStore::open(Arc::new(faulty.clone()), opts()).unwrap();
    let (e, t) = (NORMAL[0], TINY[0]);
    store.create(e).unwrap();
    store.write(e, 0, &[1; 300]).unwrap();
    store.write(t, 0, &[1; 100]).unwrap();
    store.sync().unwrap();
    faulty.set_full(true);
    // An append, a tiny write and an overwrite of block 1 (64..128).
    for (id, off, len) in [(e, 300, 500), (t, 128, 64), (e, 64, 64)] {
        let r = store.write(id, off, &vec![2; len]);
        assert!(matches!(r, Err(StoreError::NoSpace)), "{id} {off}: {r:?}");
    }
    assert_eq!(StoreError::NoSpace.code(), ErrorCode::Unavailable);
    faulty.set_full(false);
    assert_eq!(store.len(e).unwrap(), 300);
    assert_eq!(&store.read(e, 0, 64).unwrap()[..], &[1; 64][..]);
    assert_eq!(&store.read(e, 128, 172).unwrap()[..], &[1; 172][..]);
    assert!(matches!(
        store.read(e, 64, 64),
        Err(StoreError::Corrupt { block: 1, .. })
    ));
    store.repair_block(e, 1, &[1; 64]).unwrap();
    store.write(e, 300, &[3; 500]).unwrap();
    store.write(t, 128, &[3; 64]).unwrap();
    store.sync().unwrap();
    drop(store);
    let store = open(&mem);
    let mut want = vec![1u8; 300];
    want.extend_from_slice(&[3; 500]);
    assert_eq!(&store.read(e, 0, 800).unwrap()[..], &want[..]);
    assert_eq!(&store.read(t, 128, 64).unwrap()[..], &[3; 64][..]);
}

// -------------------------------------------------------------------------------------------------
// Bounded open files (docs/data-store.md, "Open files")

/// `n` bytes from a fixed-seed generator (the workloads below replay from their seeds).
fn random_bytes(rng: &mut fastrand::Rng, n: usize) -> Vec<u8> {
    let mut v = vec![0; n];
    rng.fill(&mut v);
    v
}

/// Every extent of the model reads back whole, with the model's lengths and nothing else.
fn check_model(store: &ExtentStore, model: &BTreeMap<ExtentId, Vec<u8>>) {
    let want: Vec<(ExtentId, u64)> = model.iter().map(|(id, v)| (*id, v.len() as u64)).collect();
    assert_eq!(store.extents(), want);
    for (id, v) in model {
        assert_eq!(
            store.read(*id, 0, v.len() as u32).unwrap()[..],
            v[..],
            "{id}"
        );
    }
}

/// 200 normal extents and 4 tiny ones with at most 8 extents' files open: a seeded random
/// interleaving of create, append, overwrite, read, truncate, punch, delete and sync matches the
/// model, the disk never has more than 16 files open (not even inside a call), and everything reads
/// back after a clean reopen and after a crash following the last sync.
#[test]
fn open_files_stay_bounded_across_many_extents() {
    const CAP: u32 = 8;
    const FILES: usize = 2 * CAP as usize;
    for seed in 0..3u64 {
        let disk = MemDisk::new();
        let store = open_capped(&disk, CAP);
        let mut rng = fastrand::Rng::with_seed(seed);
        let mut model: BTreeMap<ExtentId, Vec<u8>> = BTreeMap::new();
        let normal = |i: u64| ExtentId(1024 + i);
        let mut most = 0;
        for step in 0..4000 {
            let id = if rng.u64(..10) == 0 {
                ExtentId(1 + rng.u64(..4))
            } else {
                normal(rng.u64(..200))
            };
            let exists = model.contains_key(&id);
            let len = model.get(&id).map_or(0, |v| v.len() as u64);
            match rng.u64(..16) {
                // Creating is the most common at first, so the extents pile up.
                0..=2 if !id.is_tiny() => {
                    store.create(id).unwrap();
                    model.entry(id).or_default();
                }
                3..=6 if exists || id.is_tiny() => {
                    // Append (a tiny extent after a gap), or overwrite in place.
                    let off = match rng.u64(..3) {
                        0 => rng.u64(..len + 1),
                        _ if id.is_tiny() => len + rng.u64(..100),
                        _ => len,
                    };
                    let n = 1 + rng.u64(..200) as usize;
                    let d = random_bytes(&mut rng, n);
                    store.write(id, off, &d).unwrap();
                    let v = model.entry(id).or_default();
                    let end = off as usize + d.len();
                    if v.len() < end {
                        v.resize(end, 0);
                    }
                    v[off as usize..end].copy_from_slice(&d);
                }
                7..=9 if exists => {
                    let off = rng.u64(..len + 1);
                    let n = rng.u64(..len - off + 1);
                    let got = store.read(id, off, n as u32).unwrap();
                    assert_eq!(got[..], model[&id][off as usize..(off + n) as usize]);
                }
                10 if exists => {
                    let to = rng.u64(..len + 1);
                    store.truncate(id, to).unwrap();
                    model.get_mut(&id).unwrap().truncate(to as usize);
                }
                11 if exists => {
                    let off = rng.u64(..len + 1);
                    let n = rng.u64(..len - off + 1);
                    store.punch(id, off, n).unwrap();
                    model.get_mut(&id).unwrap()[off as usize..(off + n) as usize].fill(0);
                }
                12 if exists && !id.is_tiny() => {
                    store.delete(id).unwrap();
                    model.remove(&id);
                }
                13 => store.sync().unwrap(),
                _ => {}
            }
            most = most.max(model.len());
            assert!(
                store.open_extents() <= CAP as usize,
                "seed {seed} step {step}: {} extents open",
                store.open_extents()
            );
            assert!(disk.open_files() <= FILES, "seed {seed} step {step}");
        }
        assert!(most > 10 * CAP as usize, "seed {seed}: only {most} extents");
        check_model(&store, &model);
        store.sync().unwrap();
        assert!(
            disk.peak_open_files() <= FILES,
            "{}",
            disk.peak_open_files()
        );
        drop(store);
        assert_eq!(disk.open_files(), 0, "closing the store closes its files");

        // Recovery at open keeps the bound too.
        let store = open_capped(&disk, CAP);
        assert!(store.recovery_report().is_empty());
        check_model(&store, &model);
        drop(store);
        let image = disk.crash();
        let store = open_capped(&image, CAP);
        check_model(&store, &model);
        assert!(disk.peak_open_files() <= FILES);
        assert!(image.peak_open_files() <= FILES);
    }
}

/// The length in the newest valid commit header of an extent's crc file (docs/data-store.md, "Files").
fn header_len(disk: &MemDisk, id: ExtentId) -> Option<u64> {
    let crc = disk.read_file(&format!("{}.crc", id.0))?;
    let u64_at = |b: &[u8], at: usize| u64::from_le_bytes(b[at..at + 8].try_into().unwrap());
    (0..2)
        .filter_map(|i| crc.get(64 * i..64 * (i + 1)))
        .filter(|h| h[..4] == *b"NXCR")
        .max_by_key(|h| u64_at(h, 16))
        .map(|h| u64_at(h, 24))
}

/// Writes to extents whose files were closed before the sync are made durable by it (the round
/// reopens them to write their commit headers), and truncate, punch, repair and delete work on
/// extents whose files are closed.
#[test]
fn sync_makes_writes_to_evicted_extents_durable() {
    let disk = MemDisk::new();
    let s = open_capped(&disk, 1);
    let [a, b, c] = NORMAL;
    for id in NORMAL {
        s.create(id).unwrap();
    }
    s.sync().unwrap();
    // Each write closes the previous extent's files, with its write not yet synced.
    s.write(a, 0, &[1; 150]).unwrap();
    s.write(b, 0, &[2; 150]).unwrap();
    s.write(c, 0, &[3; 150]).unwrap();
    assert_eq!(s.open_extents(), 1);
    assert_eq!(disk.open_files(), 2);
    s.sync().unwrap();
    let image = disk.crash();
    for id in NORMAL {
        assert_eq!(
            header_len(&image, id),
            Some(150),
            "{id}: the round committed it"
        );
    }
    let r = open_capped(&image, 1);
    assert!(r.recovery_report().is_empty());
    for (id, byte) in [(a, 1), (b, 2), (c, 3)] {
        assert_eq!(r.read(id, 0, 150).unwrap()[..], [byte; 150][..], "{id}");
    }

    // Changes on closed extents: each call reopens its extent and closes the previous one.
    s.truncate(a, 100).unwrap(); // durable when it returns
    s.punch(b, 10, 20).unwrap(); // durable when it returns
    s.repair_block(c, 0, &[4; 64]).unwrap();
    s.delete(a).unwrap();
    s.write(b, 150, &[5; 50]).unwrap();
    s.write(TINY[0], 0, &[6; 10]).unwrap();
    let image = disk.crash();
    let r = open_capped(&image, 1);
    assert_eq!(r.len(a).unwrap(), 100, "the truncate is durable");
    let mut want_b = vec![2; 150];
    want_b[10..30].fill(0);
    assert_eq!(
        r.read(b, 0, 150).unwrap()[..],
        want_b[..],
        "the punch is durable"
    );
    drop(r);
    s.sync().unwrap();
    assert_eq!(disk.peak_open_files(), 2);
    let image = disk.crash();
    let r = open_capped(&image, 1);
    assert!(matches!(r.len(a), Err(StoreError::NotFound(_))));
    want_b.extend([5; 50]);
    assert_eq!(r.read(b, 0, 200).unwrap()[..], want_b[..]);
    let mut want_c = vec![4; 64];
    want_c.extend([3; 86]);
    assert_eq!(r.read(c, 0, 150).unwrap()[..], want_c[..]);
    assert_eq!(r.read(TINY[0], 0, 10).unwrap()[..], [6; 10][..]);
    let names: BTreeSet<String> = image.list().unwrap().into_iter().collect();
    assert!(!names.contains(&data_name(a)), "{names:?}");
}

/// EMFILE is transient: the call that cannot open its files fails with `TooManyOpenFiles`
/// (`Unavailable`), nothing changes, and the store keeps working; a sync that cannot reopen a dirty
/// extent fails and leaves it dirty, and the next sync makes it durable.
#[test]
fn out_of_descriptors_fails_the_call_not_the_store() {
    let mem = MemDisk::new();
    let faulty = FaultyDisk::new(Arc::new(mem.clone()), FaultPlan::default());
    let s = ExtentStore::open(Arc::new(faulty.clone()), capped(1)).unwrap();
    let [a, b, c] = NORMAL;
    s.create(a).unwrap();
    s.create(b).unwrap();
    s.sync().unwrap();
    s.write(a, 0, &[1; 100]).unwrap();
    s.write(b, 0, &[2; 100]).unwrap(); // closes a's files, a dirty
    faulty.set_out_of_fds(true);

    let no_fds = |r: Result<_, StoreError>| {
        let e = r.unwrap_err();
        assert!(matches!(e, StoreError::TooManyOpenFiles), "{e}");
        assert_eq!(e.code(), ErrorCode::Unavailable);
    };
    // b's files are open: it keeps working.
    s.write(b, 100, &[2; 28]).unwrap();
    assert_eq!(s.read(b, 0, 128).unwrap()[..], [2; 128][..]);
    // a's are not.
    no_fds(s.read(a, 0, 100).map(drop));
    no_fds(s.write(a, 100, &[9; 10]));
    no_fds(s.truncate(a, 50));
    no_fds(s.punch(a, 0, 10));
    no_fds(s.repair_block(a, 0, &[9; 64]));
    // Creating registers the extent and opens nothing; its files wait for a round that can.
    s.create(c).unwrap();
    no_fds(s.write(TINY[0], 0, b"tiny"));
    no_fds(s.sync());
    no_fds(s.sync());
    // Nothing changed, and the store did not fail.
    assert_eq!(s.len(a).unwrap(), 100);
    assert_eq!(s.len(c).unwrap(), 0);
    assert_eq!(s.len(TINY[0]).unwrap(), 0);
    assert!(mem.crash().read_file(&data_name(c)).is_none());
    // Closing a's files to open b's fsynced a's data, but no round committed its length.
    assert_eq!(header_len(&mem.crash(), a), Some(0));
    no_fds(ExtentStore::open(Arc::new(faulty.clone()), capped(1)).map(drop));

    faulty.set_out_of_fds(false);
    s.sync().unwrap();
    assert_eq!(header_len(&mem.crash(), a), Some(100));
    let r = open_capped(&mem.crash(), 1);
    assert!(r.recovery_report().is_empty());
    assert_eq!(r.read(a, 0, 100).unwrap()[..], [1; 100][..]);
    assert_eq!(r.read(b, 0, 128).unwrap()[..], [2; 128][..]);
    assert_eq!(r.len(c).unwrap(), 0);
    drop(r);
    s.write(a, 100, &[3; 10]).unwrap();
    s.sync().unwrap();
    let r = open_capped(&mem.crash(), 1);
    assert_eq!(r.len(a).unwrap(), 110);
    assert_eq!(r.len(c).unwrap(), 0);

    // A round that cannot fsync the directory (it opens it) keeps the names for the next one.
    s.delete(c).unwrap();
    faulty.set_out_of_fds(true);
    no_fds(s.sync());
    faulty.set_out_of_fds(false);
    assert_eq!(open_capped(&mem.crash(), 1).len(c).unwrap(), 0);
    s.sync().unwrap();
    let r = open_capped(&mem.crash(), 1);
    assert!(matches!(r.len(c), Err(StoreError::NotFound(_))));
}

/// Threads writing, syncing and reading 32 extents with 2 open at a time: every sync makes that
/// thread's write durable, reads see it, and the open files stay bounded by the cap plus a few per
/// concurrent call (never by the number of extents).
#[test]
fn concurrent_calls_with_evictions() {
    const CAP: u32 = 2;
    const THREADS: usize = 4;
    const PER_THREAD: u64 = 8;
    let mem = MemDisk::new();
    let store = Arc::new(open_capped(&mem, CAP));
    let ids = |t: usize| (0..PER_THREAD).map(move |i| ExtentId(1024 + t as u64 * PER_THREAD + i));
    for t in 0..THREADS {
        for id in ids(t) {
            store.create(id).unwrap();
        }
    }
    let threads: Vec<_> = (0..THREADS)
        .map(|t| {
            let s = store.clone();
            let mem = mem.clone();
            std::thread::spawn(move || {
                let ids: Vec<ExtentId> = ids(t).collect();
                for i in 0..40u64 {
                    let id = ids[(i % PER_THREAD) as usize];
                    let off = (i / PER_THREAD) * 40;
                    let d = vec![(t * 40) as u8 + i as u8; 40];
                    s.write(id, off, &d).unwrap();
                    s.sync().unwrap();
                    let image = mem.crash().read_file(&data_name(id)).unwrap();
                    assert_eq!(image[off as usize..][..40], d[..], "{id} write {i}");
                    assert_eq!(s.read(id, off, 40).unwrap()[..], d[..]);
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    let cap = CAP as usize;
    assert!(store.open_extents() <= cap.max(THREADS));
    let bound = 2 * (cap + 3 * THREADS + 1);
    assert!(bound < 2 * THREADS * PER_THREAD as usize);
    assert!(
        mem.peak_open_files() <= bound,
        "{} files open at once",
        mem.peak_open_files()
    );
    let s = open_capped(&mem.crash(), CAP);
    assert!(s.recovery_report().is_empty());
    for t in 0..THREADS {
        for id in ids(t) {
            assert_eq!(s.len(id).unwrap(), 200);
        }
    }
}

/// This process's descriptors open on files under `dir` (other tests run in parallel in this
/// process, so the whole of /proc/self/fd would be noisy).
fn fds_under(dir: &std::path::Path) -> usize {
    let dir = dir.canonicalize().unwrap();
    std::fs::read_dir("/proc/self/fd")
        .unwrap()
        .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
        .filter(|target| target.starts_with(&dir))
        .count()
}

/// On real files: a delete renames the extent's files out of its namespace at once, and
/// `remove_deleted` removes them later (removing a large file is slow); a store opened before that
/// finds them and removes them on its next call. Extents that never had files leave nothing.
#[test]
fn deleted_extents_are_removed_later() {
    let dir = tempfile::tempdir().unwrap();
    let disk: Arc<dyn Disk> = Arc::new(FileDisk::new(dir.path()).unwrap());
    let s = ExtentStore::open(disk.clone(), capped(1)).unwrap();
    let [a, b, c] = NORMAL;
    s.create(a).unwrap();
    s.create(b).unwrap();
    s.write(a, 0, &[1; 4 * BS as usize]).unwrap();
    s.write(b, 0, &[2; 4 * BS as usize]).unwrap(); // closes a's files
    s.sync().unwrap();
    s.create(c).unwrap(); // no files until a write or a round
    s.delete(a).unwrap();
    s.delete(b).unwrap();
    s.delete(c).unwrap();
    // The crc files go to removal, the data files are kept for new extents (c had none).
    assert_eq!(s.deleted_files(), 2);
    let spares = s.spares();
    assert_eq!(
        spares.iter().map(|sp| sp.0).collect::<Vec<_>>(),
        [4 * BS as u64; 2]
    );
    let mut names = disk.list().unwrap();
    names.sort();
    assert_eq!(
        names,
        [
            "1024.crc.deleted",
            "1024.data.deleted",
            "1025.crc.deleted",
            "1025.data.deleted"
        ]
    );
    assert!(s.extents().is_empty());
    s.sync().unwrap();
    // Reopened before the removal: the extents stay gone and the files are found again.
    drop(s);
    let s = ExtentStore::open(disk.clone(), capped(1)).unwrap();
    assert!(s.extents().is_empty());
    assert!(s.recovery_report().is_empty());
    assert_eq!(s.deleted_files(), 4);
    assert_eq!(s.remove_deleted().unwrap(), 4);
    assert_eq!(s.deleted_files(), 0);
    assert!(disk.list().unwrap().is_empty());
    assert_eq!(s.remove_deleted().unwrap(), 0);
    // A new extent and a delete after a crash that kept only the renames' directory entries.
    let mem = MemDisk::new();
    let s = open(&mem);
    s.create(a).unwrap();
    s.write(a, 0, b"gone soon").unwrap();
    s.sync().unwrap();
    s.delete(a).unwrap();
    s.sync().unwrap();
    let r = open(&mem.crash());
    assert!(r.extents().is_empty());
    assert_eq!(r.deleted_files(), 2);
    assert_eq!(s.retire_spares(Instant::now()), 9);
    assert_eq!(s.remove_deleted().unwrap(), 2);
    assert!(mem.read_file(&data_name(a)).is_none());
}

/// A new extent takes a deleted extent's data file: the old bytes past its length are never read,
/// not after a crash either, and are cut once it stops growing; spares are retired on demand.
#[test]
fn new_extents_recycle_deleted_extents_files() {
    let mem = MemDisk::new();
    let s = open(&mem);
    let [a, b, c] = NORMAL;
    let old: Vec<u8> = (0..10 * BS).map(|i| (i % 251) as u8).collect();
    s.create(a).unwrap();
    s.write(a, 0, &old).unwrap();
    s.sync().unwrap();
    s.delete(a).unwrap();
    s.sync().unwrap();
    assert_eq!(s.spares().len(), 1);
    assert_eq!(s.spares()[0].0, 10 * u64::from(BS));
    // b takes a's data file (renamed), with a new crc file.
    s.create(b).unwrap();
    s.write(b, 0, &[7; 100]).unwrap();
    assert!(s.spares().is_empty());
    assert!(mem.read_file(&format!("{}.data.deleted", a.0)).is_none());
    assert_eq!(
        mem.read_file(&data_name(b)).unwrap().len(),
        10 * BS as usize
    );
    assert_eq!(s.len(b).unwrap(), 100);
    assert_eq!(&s.read(b, 0, 100).unwrap()[..], &[7; 100]);
    let past = s.read(b, 0, 101).unwrap_err();
    assert!(matches!(past, StoreError::OutOfRange { .. }), "{past:?}");
    assert_eq!(s.tails(), 1);
    // Not cut while it grew after the given instant.
    let before = Instant::now() - Duration::from_secs(3600);
    assert_eq!(s.cut_tails(before).unwrap(), 0);
    s.sync().unwrap();
    // A crash: recovery cuts the old bytes, b keeps what was synced.
    let r = open(&mem.crash());
    assert_eq!(r.extents(), vec![(b, 100)]);
    assert_eq!(&r.read(b, 0, 100).unwrap()[..], &[7; 100]);
    assert!(r.recovery_report().is_empty(), "{:?}", r.recovery_report());
    assert_eq!(
        mem.crash().read_file(&data_name(b)).unwrap().len(),
        10 * BS as usize
    );
    drop(r);
    // An unsynced append into the recycled file is kept only if it verifies: a crash image that
    // lost its bytes but kept its records (or the reverse) never serves a's old bytes.
    s.write(b, 100, &[8; 3 * BS as usize]).unwrap();
    for seed in 0..16 {
        let r = open(&mem.crash_torn(seed));
        let len = r.len(b).unwrap();
        assert!((100..=100 + 3 * u64::from(BS)).contains(&len), "{len}");
        let got = r.read(b, 0, len as u32).unwrap();
        assert_eq!(&got[..100], &[7; 100]);
        assert!(
            got[100..].iter().all(|&x| x == 8),
            "seed {seed}: old bytes served"
        );
    }
    // Idle since: cut to the extent's length.
    assert_eq!(s.cut_tails(Instant::now()).unwrap(), 1);
    assert_eq!(s.tails(), 0);
    let len = 100 + 3 * BS as usize;
    assert_eq!(mem.read_file(&data_name(b)).unwrap().len(), len);
    // An extent that grows over its whole recycled file has no tail to cut.
    s.delete(b).unwrap();
    s.create(c).unwrap();
    s.write(c, 0, &vec![9; 2 * len]).unwrap();
    assert_eq!(s.tails(), 0);
    assert_eq!(
        &s.read(c, 0, 2 * len as u32).unwrap()[..],
        &vec![9; 2 * len][..]
    );
    // Retired spares are removed; without `recycle`, deleted data files are removed too.
    s.delete(c).unwrap();
    assert_eq!(s.retire_spares(Instant::now()), 2 * len as u64);
    // c's two files and the crc files of a and b.
    assert_eq!(s.remove_deleted().unwrap(), 4);
    assert!(mem.read_file(&format!("{}.data.deleted", c.0)).is_none());
    let no = ExtentStore::open(
        Arc::new(MemDisk::new()),
        StoreOptions {
            recycle: false,
            ..opts()
        },
    )
    .unwrap();
    no.create(a).unwrap();
    no.write(a, 0, &old).unwrap();
    no.delete(a).unwrap();
    assert!(no.spares().is_empty());
    assert_eq!(no.deleted_files(), 2);
}

/// On real files: with a cap of 4, 40 extents written, synced, read and reopened never hold more
/// than 8 descriptors (counted in /proc/self/fd), and dropping the store closes them all.
#[test]
fn file_disk_descriptors_stay_bounded() {
    const CAP: u32 = 4;
    let dir = tempfile::tempdir().unwrap();
    let disk: Arc<dyn Disk> = Arc::new(FileDisk::new(dir.path()).unwrap());
    let before = fds_under(dir.path());
    assert_eq!(before, 0);
    let bounded = |what: &str| {
        let n = fds_under(dir.path());
        assert!(n <= 2 * CAP as usize, "{what}: {n} descriptors open");
    };
    let content = |i: u64| vec![i as u8; 3 * BS as usize + (i as usize % 7)];
    let ids: Vec<ExtentId> = (0..40).map(|i| ExtentId(1024 + i)).collect();
    let s = ExtentStore::open(disk.clone(), capped(CAP)).unwrap();
    for (i, &id) in ids.iter().enumerate() {
        s.create(id).unwrap();
        s.write(id, 0, &content(i as u64)).unwrap();
        bounded("writing");
    }
    assert_eq!(s.open_extents(), CAP as usize);
    s.sync().unwrap();
    bounded("after a sync of 40 dirty extents");
    for (i, &id) in ids.iter().enumerate().rev() {
        let want = content(i as u64);
        assert_eq!(s.read(id, 0, want.len() as u32).unwrap()[..], want[..]);
        bounded("reading");
    }
    drop(s);
    assert_eq!(
        fds_under(dir.path()),
        0,
        "dropping the store closes its files"
    );

    let s = ExtentStore::open(disk, capped(CAP)).unwrap();
    bounded("after recovery");
    assert!(s.recovery_report().is_empty());
    for (i, &id) in ids.iter().enumerate() {
        let want = content(i as u64);
        assert_eq!(s.read(id, 0, want.len() as u32).unwrap()[..], want[..]);
        s.truncate(id, 10).unwrap();
        bounded("truncating");
    }
    drop(s);
    assert_eq!(fds_under(dir.path()), before);
}

// -------------------------------------------------------------------------------------------------
// Reopening a failed store (docs/data-store.md, "Failure")

/// Every call that uses the store's state refuses a failed store.
fn assert_refuses(store: &ExtentStore) {
    let (e, t) = (NORMAL[0], TINY[0]);
    let results = [
        store.create(NORMAL[2]),
        store.write(t, 0, b"x"),
        store.truncate(e, 0),
        store.read(e, 0, 1).map(drop),
        store.len(e).map(drop),
        store.block_crcs(e).map(drop),
        store.repair_block(e, 0, b"x"),
        store.punch(t, 0, 1),
        store.delete(e),
        store.sync(),
        store.sync_since(store.epoch()),
    ];
    for (i, r) in results.into_iter().enumerate() {
        assert!(matches!(r, Err(StoreError::Failed)), "call {i}: {r:?}");
    }
}

/// An fsync fails: the store refuses everything until reopened. The reopen (on the same disk, whose
/// unsynced changes a failed writeback kept, lost or tore) keeps everything synced, keeps each
/// unsynced append whole or trims it (reads verify: never garbage), reports the cut, and the store
/// works again. `sync_since` an epoch from before the reopen fails: the writes it covered may be
/// gone.
#[test]
fn reopen_recovers_a_store_whose_fsync_failed() {
    let (e, t) = (NORMAL[0], TINY[0]);
    let synced: Vec<u8> = (0..300u32).map(|i| i as u8).collect();
    let appended: Vec<u8> = (0..500u32).map(|i| (i * 7) as u8).collect();
    let mut model_e = synced.clone();
    model_e.extend_from_slice(&appended);
    let mut model_t = vec![2u8; 100];
    model_t.resize(128, 0);
    model_t.extend_from_slice(&[3; 64]);
    let mut lens = BTreeSet::new();
    for seed in 0..40 {
        let mem = MemDisk::new();
        let faulty = FaultyDisk::new(Arc::new(mem.clone()), FaultPlan::default());
        let store = ExtentStore::open(Arc::new(faulty.clone()), opts()).unwrap();
        store.create(e).unwrap();
        store.write(e, 0, &synced).unwrap();
        store.write(t, 0, &[2; 100]).unwrap();
        store.sync().unwrap();
        let epoch = store.epoch();
        store.write(e, 300, &appended).unwrap();
        store.write(t, 128, &[3; 64]).unwrap();

        faulty.set_fail_sync(true);
        assert!(matches!(store.sync(), Err(StoreError::Io(_))));
        assert!(store.is_failed());
        assert_refuses(&store);
        // A reopen of a store that did not fail does nothing; of a failed one while the fsyncs
        // still fail, it works if recovery needs none (nothing to cut) — not tested here.
        mem.lose_unsynced(seed);
        faulty.set_fail_sync(false);
        let found = data_lens(&mem);
        store.reopen().unwrap();
        assert!(!store.is_failed());
        assert_eq!(store.epoch(), epoch + 1);

        assert_eq!(
            store.read(e, 0, 300).unwrap()[..],
            synced[..],
            "seed {seed}"
        );
        assert_eq!(store.read(t, 0, 100).unwrap()[..], model_t[..100]);
        let len = store.len(e).unwrap();
        assert!((300..=800).contains(&len), "seed {seed}: {len}");
        assert_eq!(
            store.read(e, 0, len as u32).unwrap()[..],
            model_e[..len as usize]
        );
        let len_t = store.len(t).unwrap();
        assert!((100..=192).contains(&len_t), "seed {seed}: {len_t}");
        assert_eq!(
            store.read(t, 0, len_t as u32).unwrap()[..],
            model_t[..len_t as usize]
        );
        for tr in store.recovery_report() {
            assert_eq!(tr.old_len, found[&tr.extent].max(tr.new_len));
            assert_eq!(tr.new_len, store.len(tr.extent).unwrap());
        }
        let trimmed: BTreeSet<ExtentId> =
            store.recovery_report().iter().map(|t| t.extent).collect();
        for (id, l) in [(e, len), (t, len_t)] {
            assert_eq!(trimmed.contains(&id), found[&id] > l, "seed {seed} {id}");
        }
        assert!(store.recovery_bad_blocks().is_empty(), "appends only");
        lens.insert(len);

        assert!(matches!(store.sync_since(epoch), Err(StoreError::Failed)));
        assert!(
            !store.is_failed(),
            "an old epoch fails the call, not the store"
        );
        // A reopen of a store that works is a no-op.
        store.reopen().unwrap();
        assert_eq!(store.epoch(), epoch + 1);
        let epoch = store.epoch();
        store.write(e, len, b"after").unwrap();
        store.write(t, len_t, b"tiny").unwrap();
        store.sync_since(epoch).unwrap();
        drop(store);
        let s = open(&mem.crash());
        assert!(s.recovery_report().is_empty());
        let mut want = model_e[..len as usize].to_vec();
        want.extend_from_slice(b"after");
        assert_eq!(s.read(e, 0, want.len() as u32).unwrap()[..], want[..]);
        assert_eq!(s.len(t).unwrap(), len_t + 4);
    }
    assert!(
        lens.len() > 2,
        "some seeds keep, cut or tear the append: {lens:?}"
    );
}

/// A reopen while the disk still fails (at every step of it) fails and leaves the store failed
/// (refusing everything), and can be tried again; once the disk works, it succeeds, with what was
/// synced intact. Recovery that must cut a torn tail needs an fsync: it fails while fsyncs do.
#[test]
fn reopen_fails_while_the_disk_does_and_works_once_it_recovers() {
    let e = NORMAL[0];
    let mem = MemDisk::new();
    let faulty = FaultyDisk::new(Arc::new(mem.clone()), FaultPlan::default());
    let store = ExtentStore::open(Arc::new(faulty.clone()), opts()).unwrap();
    let synced = vec![1u8; 300];
    store.create(e).unwrap();
    store.create(NORMAL[1]).unwrap();
    store.write(e, 0, &synced).unwrap();
    store.write(NORMAL[1], 0, &[5; 200]).unwrap();
    store.write(TINY[0], 0, &[6; 70]).unwrap();
    store.sync().unwrap();
    store.write(e, 300, &[2; 500]).unwrap();

    faulty.set_fail_sync(true);
    assert!(matches!(store.sync(), Err(StoreError::Io(_))));
    // The append's last block is damaged: recovery must cut it, and fsync the cut.
    mem.corrupt(&data_name(e), 790).unwrap();
    assert!(matches!(store.reopen(), Err(StoreError::Io(_))));
    assert!(store.is_failed());
    assert_refuses(&store);

    // Everything fails: the reopen fails at its first step.
    faulty.set_fail_sync(false);
    faulty.fail_after_more(Some(0));
    assert!(matches!(store.reopen(), Err(StoreError::Io(_))));
    assert_refuses(&store);
    // The disk fails after n more operations, for every n until a reopen gets through.
    let mut n = 0;
    loop {
        faulty.fail_after_more(Some(n));
        match store.reopen() {
            Ok(()) => break,
            Err(StoreError::Io(_)) => {
                assert!(store.is_failed(), "n={n}");
                assert_refuses(&store);
            }
            Err(e) => panic!("n={n}: {e}"),
        }
        n += 1;
        assert!(n < 1000, "the reopen never got through");
    }
    faulty.fail_after_more(None);
    assert!(n > 5, "the reopen took only {n} operations");
    assert!(!store.is_failed());
    assert_eq!(store.epoch(), 1, "failed reopens do not count");
    let len = store.len(e).unwrap();
    assert!((300..790).contains(&len), "{len}");
    let mut want = synced.clone();
    want.resize(len as usize, 2);
    assert_eq!(store.read(e, 0, len as u32).unwrap()[..], want[..]);
    assert_eq!(store.read(NORMAL[1], 0, 200).unwrap()[..], [5; 200][..]);
    assert_eq!(store.read(TINY[0], 0, 70).unwrap()[..], [6; 70][..]);
    store.write(e, len, b"works").unwrap();
    store.sync().unwrap();
    drop(store);
    let s = open(&mem.crash());
    want.extend_from_slice(b"works");
    assert_eq!(s.read(e, 0, want.len() as u32).unwrap()[..], want[..]);
}

/// Runs `ops` with every fsync failing from op `fail_at` on (and a write and a sync at the end, so
/// the store fails), lets the failed writeback keep, lose or tear each unsynced change (`seed`),
/// reopens, and checks the result as for a crash. Then the store keeps working: after cutting
/// extents at their first block a torn in-place change left unreadable, a second workload matches
/// the model, and so does a clean open afterwards.
fn check_reopen_after_failed_fsync(
    ops: &[Op],
    fail_at: usize,
    seed: u64,
    more: &[Op],
    opts: &StoreOptions,
) {
    let mem = MemDisk::new();
    let faulty = FaultyDisk::new(Arc::new(mem.clone()), FaultPlan::default());
    let store = ExtentStore::open(Arc::new(faulty.clone()), opts.clone()).unwrap();
    let mut sim = Sim::default();
    let fail_at = fail_at % (ops.len() + 1);
    let tail = [Op::TinyWrite(1, 0, vec![42]), Op::Sync];
    for (i, op) in ops.iter().chain(&tail).enumerate() {
        if i == fail_at {
            faulty.set_fail_sync(true);
        }
        match sim.step(&store, op) {
            Ok(()) | Err(StoreError::Failed) => {}
            Err(StoreError::Io(_)) => assert!(i >= fail_at, "op {i} {op:?}"),
            Err(e) => panic!("op {i} {op:?}: {e}"),
        }
    }
    assert!(store.is_failed());
    assert_refuses(&store);
    mem.lose_unsynced(seed);
    faulty.set_fail_sync(false);
    let found = data_lens(&mem);
    store.reopen().unwrap();
    sim.check_recovered(&store, &found);

    // Cut every extent at its first unreadable block, then go on from what the store holds.
    let bs = u64::from(BS);
    let mut model = BTreeMap::new();
    for (id, len) in store.extents() {
        let mut good = Vec::new();
        for b in 0..len.div_ceil(bs) {
            let n = (len - b * bs).min(bs);
            match store.read(id, b * bs, n as u32) {
                Ok(bytes) => good.extend_from_slice(&bytes),
                Err(StoreError::Corrupt { .. }) => break,
                Err(e) => panic!("{id} block {b}: {e}"),
            }
        }
        if (good.len() as u64) < len {
            store.truncate(id, good.len() as u64).unwrap();
        }
        model.insert(id, good);
    }
    store.sync().unwrap();
    let mut sim = Sim {
        synced: model.clone(),
        dir_synced: model.keys().copied().collect(),
        history: model.iter().map(|(id, v)| (*id, vec![v.clone()])).collect(),
        model,
        ..Sim::default()
    };
    for op in more {
        sim.step(&store, op).unwrap();
    }
    sim.check_exact(&store);
    store.sync().unwrap();
    drop(store);
    let store = ExtentStore::open(Arc::new(mem), opts.clone()).unwrap();
    assert!(store.recovery_report().is_empty());
    sim.check_exact(&store);
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, ..ProptestConfig::default() })]

    /// Random workloads whose fsyncs start failing at a random point: see
    /// [`check_reopen_after_failed_fsync`].
    #[test]
    fn reopen_after_a_failed_fsync_recovers_like_a_crash(
        ops in prop::collection::vec(op(), 1..40),
        fail_at in any::<usize>(),
        seed in any::<u64>(),
        more in prop::collection::vec(op(), 1..30),
    ) {
        check_reopen_after_failed_fsync(&ops, fail_at, seed, &more, &opts());
    }

    /// The same with one extent's files open at a time (an open that closes unsynced files fsyncs
    /// them, so reads fail the store too).
    #[test]
    fn reopen_after_a_failed_fsync_with_evicted_files(
        ops in prop::collection::vec(op(), 1..40),
        fail_at in any::<usize>(),
        seed in any::<u64>(),
        more in prop::collection::vec(op(), 1..30),
    ) {
        check_reopen_after_failed_fsync(&ops, fail_at, seed, &more, &capped(1));
    }
}

/// Receives a thread's result, failing (instead of hanging) if it does not come: a deadlock.
fn within<T>(rx: &std::sync::mpsc::Receiver<T>, what: &str) -> T {
    rx.recv_timeout(Duration::from_secs(30))
        .unwrap_or_else(|_| panic!("{what}: no answer within 30 s (a deadlock?)"))
}

/// Runs `f` on a thread; its result comes on the returned channel.
fn spawn<T: Send + 'static>(
    f: impl FnOnce() -> T + Send + 'static,
) -> std::sync::mpsc::Receiver<T> {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx
}

/// A reopen waits for the calls in flight — a group-commit round blocked in an fsync and a caller
/// waiting for the next round — while new calls are refused at once; the round, which the store's
/// failure overtook, ends with an error for both callers, and then the reopen runs.
#[test]
fn reopen_waits_for_calls_in_flight_and_refuses_new_ones() {
    let mem = MemDisk::new();
    let gate = Arc::new(Gate::default());
    let gated = GateDisk {
        inner: mem.clone(),
        gate: gate.clone(),
    };
    let faulty = FaultyDisk::new(Arc::new(gated), FaultPlan::default());
    let store = Arc::new(ExtentStore::open(Arc::new(faulty.clone()), opts()).unwrap());
    for id in NORMAL {
        store.create(id).unwrap();
        store.write(id, 0, &[1; 100]).unwrap();
    }
    store.sync().unwrap();
    let calls = store.sync_stats().calls;

    gate.set(true);
    // A runs a round and blocks in its first fsync; B waits for the next round.
    let a = {
        let s = store.clone();
        spawn(move || {
            s.write(NORMAL[0], 100, b"a").unwrap();
            s.sync()
        })
    };
    gate.wait_for_waiters(1);
    let b = {
        let s = store.clone();
        spawn(move || {
            s.write(NORMAL[1], 100, b"b").unwrap();
            s.sync()
        })
    };
    let deadline = Instant::now() + Duration::from_secs(30);
    while store.sync_stats().calls < calls + 2 {
        assert!(Instant::now() < deadline, "B never called sync");
        std::thread::yield_now();
    }
    // A truncate's fsync fails: the store fails while A and B are inside.
    faulty.set_fail_sync(true);
    assert!(matches!(
        store.truncate(NORMAL[2], 50),
        Err(StoreError::Io(_))
    ));
    faulty.set_fail_sync(false);
    assert!(store.is_failed());
    let reopen = {
        let s = store.clone();
        spawn(move || s.reopen())
    };
    // New calls are refused at once, never blocked behind the reopen.
    for _ in 0..100 {
        assert!(matches!(store.len(NORMAL[0]), Err(StoreError::Failed)));
        assert!(matches!(store.sync(), Err(StoreError::Failed)));
    }
    assert!(store.is_failed(), "the reopen waits for A and B");
    gate.set(false);
    assert!(matches!(within(&a, "A"), Err(StoreError::Failed)));
    assert!(matches!(within(&b, "B"), Err(StoreError::Failed)));
    within(&reopen, "the reopen").unwrap();
    assert!(!store.is_failed());
    // Nothing was lost on this disk (its writeback did not fail): the reopen finds it all.
    assert_eq!(store.read(NORMAL[0], 0, 101).unwrap()[100], b'a');
    assert_eq!(store.read(NORMAL[1], 0, 101).unwrap()[100], b'b');
    // The failed truncate left the old length or the new one (its first header landed).
    let len = store.len(NORMAL[2]).unwrap();
    assert!(len == 50 || len == 100, "{len}");
    assert_eq!(
        store.read(NORMAL[2], 0, len as u32).unwrap()[..],
        [1; 100][..len as usize]
    );
    store.write(NORMAL[2], len, b"c").unwrap();
    store.sync().unwrap();
}

/// Threads append, sync (`sync_since`) and read their own extents while the store fails and is
/// reopened five times, each time losing or tearing some unsynced writes: no panic, no deadlock,
/// every call either works or returns an error, no sync claims a write the reopen lost, and at the
/// end every extent holds exactly what its thread's model says (also after a crash).
#[test]
fn calls_on_other_threads_while_the_store_fails_and_is_reopened() {
    const THREADS: u64 = 4;
    let mem = MemDisk::new();
    let faulty = FaultyDisk::new(Arc::new(mem.clone()), FaultPlan::default());
    let store = Arc::new(ExtentStore::open(Arc::new(faulty.clone()), capped(3)).unwrap());
    let ids: Vec<ExtentId> = (0..THREADS).map(|t| ExtentId(1024 + t)).collect();
    for &id in &ids {
        store.create(id).unwrap();
    }
    store.sync().unwrap();
    let progress = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let deadline = Instant::now() + Duration::from_secs(60);
    let threads: Vec<_> = ids
        .iter()
        .enumerate()
        .map(|(t, &id)| {
            let (s, progress, stop) = (store.clone(), progress.clone(), stop.clone());
            spawn(move || {
                let mut rng = fastrand::Rng::with_seed(t as u64);
                let mut model: Vec<u8> = Vec::new();
                let mut synced = 0u64;
                let mut epoch = s.epoch();
                // After an error: wait for the store to work, then learn what it kept.
                let resync = |model: &mut Vec<u8>, synced: u64, epoch: &mut u64| loop {
                    assert!(Instant::now() < deadline, "{id}: the store never came back");
                    *epoch = s.epoch();
                    let len = match s.len(id) {
                        Ok(len) => len,
                        Err(StoreError::Failed) => {
                            std::thread::yield_now();
                            continue;
                        }
                        Err(e) => panic!("{id}: {e}"),
                    };
                    assert!(len >= synced, "{id}: {len} bytes, {synced} were synced");
                    assert!(len <= model.len() as u64, "{id}: {len} > {}", model.len());
                    match s.read(id, 0, len as u32) {
                        Ok(b) => assert_eq!(b[..], model[..len as usize], "{id}"),
                        // Io: the read's open closed other unsynced files, and their fsync failed.
                        Err(StoreError::Failed | StoreError::Io(_)) => continue,
                        Err(e) => panic!("{id}: {e}"),
                    }
                    if s.epoch() == *epoch {
                        model.truncate(len as usize);
                        return;
                    }
                };
                let mut i = 0u64;
                while !stop.load(Ordering::SeqCst) || i < 20 {
                    i += 1;
                    assert!(Instant::now() < deadline, "{id}: still running");
                    let n = 1 + rng.u64(..90) as usize;
                    let d = random_bytes(&mut rng, n);
                    let at = model.len() as u64;
                    match s.write(id, at, &d) {
                        Ok(()) => model.extend_from_slice(&d),
                        Err(StoreError::Failed | StoreError::Io(_)) => {
                            resync(&mut model, synced, &mut epoch);
                            continue;
                        }
                        Err(e) => panic!("{id}: {e}"),
                    }
                    match s.sync_since(epoch) {
                        Ok(()) => synced = model.len() as u64,
                        Err(StoreError::Failed | StoreError::Io(_)) => {
                            resync(&mut model, synced, &mut epoch);
                            continue;
                        }
                        Err(e) => panic!("{id}: {e}"),
                    }
                    let off = rng.u64(..model.len() as u64);
                    match s.read(id, off, (model.len() as u64 - off) as u32) {
                        Ok(b) => assert_eq!(b[..], model[off as usize..], "{id}"),
                        Err(StoreError::Failed | StoreError::Io(_)) => {
                            resync(&mut model, synced, &mut epoch);
                            continue;
                        }
                        Err(e) => panic!("{id}: {e}"),
                    }
                    progress.fetch_add(1, Ordering::SeqCst);
                }
                // Leave the extent synced, as the model says.
                loop {
                    match s.sync_since(epoch) {
                        Ok(()) => return (id, model),
                        Err(_) => resync(&mut model, synced, &mut epoch),
                    }
                }
            })
        })
        .collect();
    let wait_progress = |n: u64| {
        let want = progress.load(Ordering::SeqCst) + n;
        while progress.load(Ordering::SeqCst) < want {
            assert!(Instant::now() < deadline, "no progress");
            std::thread::yield_now();
        }
    };
    for round in 0..5 {
        wait_progress(30);
        faulty.set_fail_sync(true);
        while !store.is_failed() {
            assert!(Instant::now() < deadline, "no sync failed");
            std::thread::yield_now();
        }
        mem.lose_unsynced(round);
        faulty.set_fail_sync(false);
        store.reopen().unwrap();
    }
    wait_progress(30);
    stop.store(true, Ordering::SeqCst);
    let models: Vec<(ExtentId, Vec<u8>)> = threads
        .iter()
        .map(|rx| within(rx, "a worker thread"))
        .collect();
    assert_eq!(store.epoch(), 5);
    let model: BTreeMap<ExtentId, Vec<u8>> = models.into_iter().collect();
    check_model(&store, &model);
    drop(store);
    check_model(&open(&mem.crash()), &model);
}

/// On real files (where a reopen also drops the files' cached pages): a failed fsync, a reopen, and
/// everything written (the page cache kept it: the writeback did not really fail) reads back.
#[test]
fn file_disk_reopen_after_a_failed_fsync() {
    let dir = tempfile::tempdir().unwrap();
    let faulty = FaultyDisk::new(
        Arc::new(FileDisk::new(dir.path()).unwrap()),
        FaultPlan::default(),
    );
    let s = ExtentStore::open(Arc::new(faulty.clone()), opts()).unwrap();
    let e = NORMAL[0];
    s.create(e).unwrap();
    s.write(e, 0, &[1; 1000]).unwrap();
    s.sync().unwrap();
    s.write(e, 1000, &[2; 1000]).unwrap();
    faulty.set_fail_sync(true);
    assert!(matches!(s.sync(), Err(StoreError::Io(_))));
    faulty.set_fail_sync(false);
    s.reopen().unwrap();
    let mut want = vec![1u8; 1000];
    want.resize(2000, 2);
    assert_eq!(s.read(e, 0, 2000).unwrap()[..], want[..]);
    assert!(s.recovery_report().is_empty());
    s.write(e, 2000, b"more").unwrap();
    s.sync().unwrap();
    drop(s);
    let s = ExtentStore::open(Arc::new(FileDisk::new(dir.path()).unwrap()), opts()).unwrap();
    assert_eq!(s.len(e).unwrap(), 2004);
}

/// Stores sharing a pool (a node's): a new extent of one store takes a spare another store's
/// delete left, moved into its directory, on real files; a disk without a location (MemDisk)
/// takes only its own.
#[test]
fn stores_sharing_a_pool_take_each_others_spares() {
    let (da, db) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let pool = SparePool::new();
    let open_in = |dir: &std::path::Path| {
        let disk: Arc<dyn Disk> = Arc::new(FileDisk::new(dir).unwrap());
        ExtentStore::open_with_spares(disk, opts(), pool.clone()).unwrap()
    };
    let (a, b) = (open_in(da.path()), open_in(db.path()));
    let [x, y, _] = NORMAL;
    a.create(x).unwrap();
    a.write(x, 0, &[1; 5 * BS as usize]).unwrap();
    a.sync().unwrap();
    a.delete(x).unwrap();
    assert_eq!(b.spares().len(), 1, "one pool");
    b.create(y).unwrap();
    b.write(y, 0, &[2; 10]).unwrap();
    b.sync().unwrap();
    assert!(b.spares().is_empty());
    assert_eq!(b.recycled(), 1);
    assert!(!da.path().join("1024.data.deleted").exists());
    let moved = db.path().join("1025.data");
    assert_eq!(std::fs::metadata(&moved).unwrap().len(), 5 * u64::from(BS));
    assert_eq!(&b.read(y, 0, 10).unwrap()[..], &[2; 10]);
    // Reopened: the recycled file is cut to its extent, nothing reported.
    drop(b);
    let b = open_in(db.path());
    assert!(b.recovery_report().is_empty());
    assert_eq!(b.extents(), vec![(y, 10)]);
    assert_eq!(std::fs::metadata(&moved).unwrap().len(), 10);
    // A store dropped takes its spares out of the pool (its next open removes the files).
    b.delete(y).unwrap();
    assert_eq!(a.spares().len(), 1);
    drop(b);
    assert!(a.spares().is_empty());

    let mem_pool = SparePool::new();
    let (ma, mb) = (MemDisk::new(), MemDisk::new());
    let a = ExtentStore::open_with_spares(Arc::new(ma.clone()), opts(), mem_pool.clone()).unwrap();
    let b = ExtentStore::open_with_spares(Arc::new(mb.clone()), opts(), mem_pool.clone()).unwrap();
    a.create(x).unwrap();
    a.write(x, 0, &[1; 100]).unwrap();
    a.delete(x).unwrap();
    b.create(y).unwrap();
    b.write(y, 0, &[2; 10]).unwrap();
    assert_eq!((b.recycled(), mem_pool.list().len()), (0, 1));
    assert_eq!(mb.read_file(&data_name(y)).unwrap().len(), 10);
    a.create(ExtentId(1030)).unwrap();
    a.write(ExtentId(1030), 0, &[3; 10]).unwrap();
    assert_eq!((a.recycled(), mem_pool.list().len()), (1, 0));
}

/// Appends written past the page cache (`write_uncached`, on real files): whole 4 KiB pages go
/// to the device directly, others through the cache, a recycled file takes them too; everything
/// reads back, a flipped bit in a directly written block is caught by its CRC, and a reopen finds
/// every synced byte.
#[test]
fn uncached_appends_read_back_and_are_verified() {
    let dir = tempfile::tempdir().unwrap();
    let open_here = || {
        let disk: Arc<dyn Disk> = Arc::new(FileDisk::new(dir.path()).unwrap());
        ExtentStore::open(disk, opts()).unwrap()
    };
    let bytes = |seed: u64, len: usize| -> Vec<u8> {
        (0..len as u64)
            .map(|i| (i * 31 + seed * 7 + (i >> 12)) as u8)
            .collect()
    };
    let s = open_here();
    let [x, y, _] = NORMAL;
    let mut want = Vec::new();
    s.create(x).unwrap();
    // 64 KiB pieces (direct), one of 5,000 bytes (cached; the pieces after it start off a page
    // boundary, cached as well), written from buffers at odd addresses.
    for (k, len) in [64 << 10, 64 << 10, 5000, 64 << 10, 32 << 10]
        .into_iter()
        .enumerate()
    {
        let piece = bytes(k as u64, len);
        let mut odd = vec![0u8; 1];
        odd.extend_from_slice(&piece);
        s.write_uncached(x, want.len() as u64, &odd[1..]).unwrap();
        want.extend_from_slice(&piece);
    }
    // An in-place write over directly written bytes goes through the cache and patches its CRC.
    s.write(x, 70_000, &[7; 3000]).unwrap();
    want[70_000..73_000].fill(7);
    s.sync().unwrap();
    assert_eq!(s.read(x, 0, want.len() as u32).unwrap()[..], want[..]);

    // Recycled: a new extent's direct appends overwrite a deleted extent's blocks.
    s.delete(x).unwrap();
    s.create(y).unwrap();
    let fresh = bytes(9, 128 << 10);
    s.write_uncached(y, 0, &fresh).unwrap();
    s.sync().unwrap();
    assert_eq!(s.recycled(), 1);
    assert_eq!(s.read(y, 0, fresh.len() as u32).unwrap()[..], fresh[..]);

    // Bit rot in the second block (below a completed sync's length, so recovery keeps the block
    // and leaves it to the read): caught on read.
    s.write(y, fresh.len() as u64, &[3; 100]).unwrap();
    s.sync().unwrap();
    drop(s);
    let file = dir.path().join(format!("{}.data", y.0));
    let mut on_disk = std::fs::read(&file).unwrap();
    on_disk[u64::from(BS) as usize + 5] ^= 0x01;
    std::fs::write(&file, &on_disk).unwrap();
    let s = open_here();
    assert_eq!(s.len(y).unwrap(), fresh.len() as u64 + 100);
    assert!(matches!(
        s.read(y, u64::from(BS), 100),
        Err(StoreError::Corrupt { block: 1, .. })
    ));
    assert_eq!(s.read(y, 0, 64).unwrap()[..], fresh[..64]);
    assert_eq!(s.read(y, 128, 1000).unwrap()[..], fresh[128..1128]);
}
