//! The Raft half of a data partition: extent creation, in-place overwrites and releases go through
//! the partition's Raft group and are applied to the extent store on every replica in log order.
//!
//! The store holds the state; the state machine only remembers the next extent id and the last
//! index it applied. Applying is idempotent — creating an existing extent, rewriting the same bytes,
//! deleting a deleted extent — so entries replayed after a restart (from the last snapshot on) leave
//! the store as it was. A snapshot is taken only at log compaction and first makes every applied
//! write durable (`ExtentStore::sync`), so compacted entries never carry the only copy of an
//! overwrite. A replica that installs a snapshot from its leader has missed overwrites it cannot
//! replay: it marks every extent for a block-by-block comparison with the leader (repair).

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use nacre_raft::{RestoreError, StateMachine};
use nacre_types::ExtentId;
use nacre_types::sync::lock;
use serde::{Deserialize, Serialize};

use crate::store::{ExtentStore, FIRST_NORMAL_EXTENT, StoreError};
use nacre_api::data::DataError;

/// A replicated data-partition command. Entries are postcard-encoded.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub enum DataCommand {
    /// Creates the next normal extent; the reply is its id.
    CreateExtent,
    /// Writes `data` at `offset` inside the extent's committed bytes.
    Overwrite {
        extent: ExtentId,
        offset: u64,
        data: bytes::Bytes,
    },
    /// Appends `data` at `offset`, the extent's end (the Raft alternative to primary-backup
    /// appends, for comparison). Replayed entries find the bytes already there.
    Append {
        extent: ExtentId,
        offset: u64,
        data: bytes::Bytes,
    },
    /// Deletes normal extents and punches `(offset, len)` out of tiny ones.
    Release { ranges: Vec<(ExtentId, u64, u64)> },
}

/// The head of a [`DataCommand`] read without copying its data, for [`DataSm::prefetch`]: postcard
/// encodes an enum variant by its index, so the variants here must stay the first ones of
/// `DataCommand`, in order, with the same fields (a test checks it). Later variants fail to decode,
/// which only skips the hint.
#[derive(Debug, Deserialize)]
enum CommandHead<'a> {
    CreateExtent,
    Overwrite {
        extent: ExtentId,
        offset: u64,
        #[serde(borrow)]
        data: &'a [u8],
    },
}

/// What the state machine shares with the service (read without going through the raft loop).
#[derive(Debug, Default)]
pub struct SmShared {
    /// The last log index applied (overwrites included up to here).
    pub applied: AtomicU64,
    /// Extents that must be compared block by block with the leader's copy: an overwrite could not
    /// be applied here (the local copy was short), or a snapshot replaced the log.
    pub suspect: Mutex<BTreeSet<ExtentId>>,
    /// Every extent is suspect (a snapshot was installed).
    pub suspect_all: std::sync::atomic::AtomicBool,
    /// The partition's normal extents as the log says (created and not released), whether or
    /// not this replica's store could apply each entry.
    pub logical: Mutex<Logical>,
}

/// The replicated part of a data partition's state: the same on every replica that applied the
/// same entries, and carried by snapshots.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Logical {
    /// The id the next `CreateExtent` gets.
    pub next_extent: u64,
    /// Normal extents created and not released whole.
    pub live: BTreeSet<ExtentId>,
}

impl Logical {
    /// Whether the log created `extent` (a normal one) and then released it whole. Final: ids are
    /// never handed out again.
    pub fn released(&self, extent: ExtentId) -> bool {
        extent.is_normal() && extent.0 < self.next_extent && !self.live.contains(&extent)
    }
}

impl SmShared {
    pub fn applied(&self) -> u64 {
        self.applied.load(Ordering::Acquire)
    }

    /// Whether the entries applied here released `extent` whole (see [`Logical::released`]).
    pub fn released(&self, extent: ExtentId) -> bool {
        lock(&self.logical).released(extent)
    }

    fn suspect(&self, extent: ExtentId) {
        lock(&self.suspect).insert(extent);
    }

    /// Deletes the normal extents `store` holds that the log released: entries this replica
    /// skipped by installing a snapshot, or could not apply (a failed store). Only ids the log has
    /// handed out (below `next_extent`), under the lock the state machine takes before it creates
    /// an extent, so an extent being created is never taken for a released one. Returns how many
    /// were deleted.
    pub fn drop_released(&self, store: &ExtentStore) -> Result<usize, StoreError> {
        let logical = lock(&self.logical);
        let mut dropped = 0;
        for (extent, _) in store.extents() {
            if logical.released(extent) {
                store.delete(extent)?;
                lock(&self.suspect).remove(&extent);
                dropped += 1;
            }
        }
        Ok(dropped)
    }
}

/// A failed durability barrier: the extent store could not sync what the log's entries applied.
#[derive(Debug, thiserror::Error)]
#[error("cannot sync the extent store: {0}")]
struct SyncFailed(#[source] StoreError);

/// Snapshots before the live set was kept: only the next extent id.
#[derive(Debug, Serialize, Deserialize)]
struct SnapshotV1 {
    next_extent: u64,
}

#[derive(Debug, Serialize, Deserialize)]
struct Snapshot {
    /// Tells this format from [`SnapshotV1`] (whose encoding is one varint).
    version: u8,
    logical: Logical,
}

const SNAPSHOT_VERSION: u8 = 2;

/// The state machine of one data partition's Raft group.
#[derive(Debug)]
pub struct DataSm {
    pub store: Arc<ExtentStore>,
    pub shared: Arc<SmShared>,
}

impl DataSm {
    /// Starts from the log's beginning (no extents): a snapshot (at restart, the last local one)
    /// and the entries after it, replayed, bring the logical state back. Starting from what the
    /// store holds instead would hand out new ids to replayed creations (and create extents nobody
    /// uses).
    pub fn new(store: Arc<ExtentStore>, shared: Arc<SmShared>) -> Self {
        *lock(&shared.logical) = Logical {
            next_extent: FIRST_NORMAL_EXTENT,
            live: BTreeSet::new(),
        };
        Self { store, shared }
    }

    fn logical(&self) -> std::sync::MutexGuard<'_, Logical> {
        lock(&self.shared.logical)
    }

    fn execute(&mut self, cmd: DataCommand) -> Result<Option<ExtentId>, DataError> {
        match cmd {
            DataCommand::CreateExtent => {
                // The id is taken on every replica, whether or not its store can create the
                // files, so that ids never diverge; the logical lock is held over the create
                // (see `SmShared::drop_released`).
                let mut logical = self.logical();
                let id = ExtentId(logical.next_extent);
                logical.next_extent += 1;
                logical.live.insert(id);
                self.store.create(id).map_err(store_error)?;
                Ok(Some(id))
            }
            DataCommand::Overwrite {
                extent,
                offset,
                data,
            } => {
                let end = offset.saturating_add(data.len() as u64);
                match self.store.len(extent) {
                    Ok(len) if end <= len => {
                        // A write that failed here (ENOSPC, EIO) was applied by the other
                        // replicas: compare this copy with the leader's in the next repair.
                        self.store.write(extent, offset, &data).map_err(|e| {
                            self.shared.suspect(extent);
                            store_error(e)
                        })?;
                    }
                    // The local copy lacks bytes the leader has (appends not yet repaired here):
                    // writing would extend it wrongly. Repair brings the leader's blocks, which
                    // include this write.
                    Ok(_) | Err(StoreError::NotFound(_)) => self.shared.suspect(extent),
                    Err(e) => return Err(store_error(e)),
                }
                Ok(None)
            }
            DataCommand::Append {
                extent,
                offset,
                data,
            } => {
                let end = offset.saturating_add(data.len() as u64);
                let len = match self.store.len(extent) {
                    Ok(len) => len,
                    Err(StoreError::NotFound(_)) => {
                        self.store.create(extent).map_err(store_error)?;
                        0
                    }
                    Err(e) => return Err(store_error(e)),
                };
                if len == offset {
                    self.store.write(extent, offset, &data).map_err(|e| {
                        self.shared.suspect(extent);
                        store_error(e)
                    })?;
                } else if len < end {
                    // Not at the end here: this replica missed appends. Repair catches up.
                    self.shared.suspect(extent);
                    return Err(DataError::OutOfRange {
                        extent,
                        offset,
                        len: data.len() as u64,
                        committed: len,
                    });
                }
                Ok(None)
            }
            DataCommand::Release { ranges } => {
                {
                    // A normal extent released whole (the meta node's offset 0, size u32::MAX)
                    // is gone from the log's view even if this store fails to delete it.
                    let mut logical = self.logical();
                    for (extent, offset, len) in &ranges {
                        if extent.is_normal() && *offset == 0 && *len >= u64::from(u32::MAX) {
                            logical.live.remove(extent);
                        }
                    }
                }
                for (extent, offset, len) in merge_tiny_ranges(ranges) {
                    // A normal extent released from its start to (at least) its end is deleted;
                    // any other range is punched out. Never past the end: the range may not have
                    // reached this replica.
                    let r = match self.store.len(extent) {
                        Ok(have) if offset == 0 && len >= have && !ExtentStore::is_tiny(extent) => {
                            self.store.delete(extent)
                        }
                        Ok(have) if offset < have => {
                            self.store.punch(extent, offset, len.min(have - offset))
                        }
                        Ok(_) | Err(StoreError::NotFound(_)) => Ok(()),
                        Err(e) => Err(e),
                    };
                    r.map_err(store_error)?;
                }
                Ok(None)
            }
        }
    }
}

/// The ranges of a release with those of each tiny extent sorted and joined where they touch or
/// overlap: small files packed side by side and removed together cost one punch, not one each.
/// Normal extents' ranges stay as they are (one released from its start to its end is deleted).
fn merge_tiny_ranges(ranges: Vec<(ExtentId, u64, u64)>) -> Vec<(ExtentId, u64, u64)> {
    let (mut tiny, mut out): (Vec<_>, Vec<_>) =
        ranges.into_iter().partition(|r| ExtentStore::is_tiny(r.0));
    tiny.sort_unstable();
    for (extent, offset, len) in tiny.into_iter().filter(|r| r.2 > 0) {
        let end = offset.saturating_add(len);
        match out.last_mut() {
            Some((e, o, l)) if *e == extent && ExtentStore::is_tiny(*e) && *o + *l >= offset => {
                *l = (*o + *l).max(end) - *o;
            }
            _ => out.push((extent, offset, end - offset)),
        }
    }
    out
}

/// Maps a store error onto what a client is told.
pub fn store_error(e: StoreError) -> DataError {
    match e {
        StoreError::NotFound(id) => DataError::NotFound(id),
        StoreError::OutOfRange {
            extent,
            offset,
            len,
            extent_len,
        } => DataError::OutOfRange {
            extent,
            offset,
            len,
            committed: extent_len,
        },
        StoreError::Corrupt { extent, block, .. } => DataError::Corrupt { extent, block },
        StoreError::Invalid(m) => DataError::Invalid(m),
        StoreError::NoSpace => DataError::ReadOnly("the data node's disk is full".into()),
        other => DataError::Io(other.to_string()),
    }
}

impl StateMachine for DataSm {
    fn apply(&mut self, index: u64, command: &[u8]) -> Vec<u8> {
        let result = match postcard::from_bytes::<DataCommand>(command) {
            Ok(cmd) => self.execute(cmd),
            Err(e) => Err(DataError::Invalid(format!("undecodable command: {e}"))),
        };
        self.shared.applied.store(index, Ordering::Release);
        if let Err(DataError::Io(e)) = &result {
            tracing::error!(error = %e, index, "data partition cannot apply an entry");
        }
        postcard::to_allocvec(&result).unwrap_or_default()
    }

    /// An overwrite re-reads the blocks it covers in part (`ExtentStore::prefetch`): start reading
    /// them while the entry goes through the log.
    fn prefetch(&self, command: &[u8]) {
        if let Ok(CommandHead::Overwrite {
            extent,
            offset,
            data,
        }) = postcard::from_bytes::<CommandHead<'_>>(command)
        {
            self.store.prefetch(extent, offset, data.len() as u64);
        }
    }

    fn snapshot(&self) -> Vec<u8> {
        postcard::to_allocvec(&Snapshot {
            version: SNAPSHOT_VERSION,
            logical: self.logical().clone(),
        })
        .unwrap_or_default()
    }

    /// The log behind a snapshot is dropped once it is saved: what the entries applied (overwrites
    /// above all) must be on disk first. The sync runs off the Raft thread, so a large backlog of
    /// dirty pages stalls none of the node's groups.
    fn durability_barrier(&self) -> Option<nacre_raft::Barrier> {
        let store = self.store.clone();
        Some(Box::new(move || {
            store.sync().map_err(|e| SyncFailed(e).into())
        }))
    }

    fn restore(&mut self, snapshot: &[u8]) -> Result<(), RestoreError> {
        match postcard::from_bytes::<Snapshot>(snapshot) {
            Ok(s) if s.version == SNAPSHOT_VERSION => *self.logical() = s.logical,
            _ => {
                // An older snapshot: the next id only; what the store holds counts as live.
                let s: SnapshotV1 = postcard::from_bytes(snapshot)
                    .map_err(|e| RestoreError::Decode(e.to_string()))?;
                let live = self
                    .store
                    .extents()
                    .into_iter()
                    .map(|(id, _)| id)
                    .filter(|id| id.is_normal())
                    .collect();
                *self.logical() = Logical {
                    next_extent: s.next_extent,
                    live,
                };
            }
        }
        self.shared
            .suspect_all
            .store(true, std::sync::atomic::Ordering::Release);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;
    use crate::io::MemDisk;
    use crate::store::StoreOptions;
    use nacre_raft::StateMachine;
    use proptest::prelude::*;

    proptest! {
        /// Merged ranges punch exactly the bytes the ranges did, each tiny extent's once and in
        /// order, and leave normal extents' ranges alone.
        #[test]
        fn merged_ranges_cover_what_the_ranges_did(
            ranges in proptest::collection::vec((prop_oneof![1u64..4, 1024u64..1026], 0u64..300, 0u64..60), 0..40),
        ) {
            let ranges: Vec<_> = ranges.into_iter().map(|(e, o, l)| (ExtentId(e), o, l)).collect();
            let merged = super::merge_tiny_ranges(ranges.clone());
            let normal = |v: &[(ExtentId, u64, u64)]| -> Vec<(ExtentId, u64, u64)> {
                v.iter().copied().filter(|r| !ExtentStore::is_tiny(r.0)).collect()
            };
            prop_assert_eq!(normal(&merged), normal(&ranges));
            let bytes = |v: &[(ExtentId, u64, u64)]| -> BTreeSet<(u64, u64)> {
                v.iter()
                    .filter(|r| ExtentStore::is_tiny(r.0))
                    .flat_map(|&(e, o, l)| (o..o + l).map(move |b| (e.0, b)))
                    .collect()
            };
            prop_assert_eq!(bytes(&merged), bytes(&ranges));
            let tiny: Vec<_> = merged.iter().filter(|r| ExtentStore::is_tiny(r.0)).collect();
            for w in tiny.windows(2) {
                prop_assert!(w[0].2 > 0);
                prop_assert!((w[0].0, w[0].1 + w[0].2) < (w[1].0, w[1].1), "{:?}", w);
            }
        }
    }

    fn store(disk: &MemDisk) -> Arc<ExtentStore> {
        Arc::new(ExtentStore::open(Arc::new(disk.clone()), StoreOptions::default()).unwrap())
    }

    fn apply(
        sm: &mut DataSm,
        index: u64,
        cmd: &DataCommand,
    ) -> Result<Option<ExtentId>, DataError> {
        let out = sm.apply(index, &postcard::to_allocvec(cmd).unwrap());
        postcard::from_bytes(&out).unwrap()
    }

    fn whole(extent: ExtentId) -> DataCommand {
        DataCommand::Release {
            ranges: vec![(extent, 0, u64::from(u32::MAX))],
        }
    }

    fn normal(store: &ExtentStore) -> Vec<ExtentId> {
        store
            .extents()
            .into_iter()
            .map(|(e, _)| e)
            .filter(|e| e.is_normal())
            .collect()
    }

    /// A restart without a snapshot replays the whole log: the creations must get the ids they
    /// got the first time, and make no new extents.
    #[test]
    fn replayed_creations_get_their_first_ids() {
        let disk = MemDisk::new();
        let st = store(&disk);
        let mut sm = DataSm::new(st.clone(), Arc::default());
        let log = [
            DataCommand::CreateExtent,
            DataCommand::CreateExtent,
            whole(ExtentId(1024)),
        ];
        let first: Vec<_> = (1..)
            .zip(&log)
            .map(|(i, c)| apply(&mut sm, i, c).unwrap())
            .collect();
        assert_eq!(first[..2], [Some(ExtentId(1024)), Some(ExtentId(1025))]);
        st.sync().unwrap();
        drop(sm);
        let st = store(&disk);
        let mut sm = DataSm::new(st.clone(), Arc::default());
        let again: Vec<_> = (1..)
            .zip(&log)
            .map(|(i, c)| apply(&mut sm, i, c).unwrap())
            .collect();
        assert_eq!(first, again);
        assert_eq!(normal(&st), [ExtentId(1025)]);
    }

    /// A replica that installs a snapshot over a release it never applied deletes the released
    /// extent; extents the log still has, and ids it has not handed out yet, are kept.
    #[test]
    fn releases_missed_under_a_snapshot_are_applied_afterwards() {
        // The leader: three extents, the middle one released, then a snapshot.
        let leader = store(&MemDisk::new());
        let mut lsm = DataSm::new(leader.clone(), Arc::default());
        for i in 1..=3 {
            apply(&mut lsm, i, &DataCommand::CreateExtent).unwrap();
        }
        apply(&mut lsm, 4, &whole(ExtentId(1025))).unwrap();
        let snap = lsm.snapshot();
        assert_eq!(normal(&leader), [ExtentId(1024), ExtentId(1026)]);

        // The follower applied the creations but not the release, and has an extent with an id
        // the log has not handed out (as if created by a later entry it applied early).
        let follower = store(&MemDisk::new());
        let shared = Arc::new(SmShared::default());
        let mut fsm = DataSm::new(follower.clone(), shared.clone());
        for i in 1..=3 {
            apply(&mut fsm, i, &DataCommand::CreateExtent).unwrap();
        }
        follower.create(ExtentId(1027)).unwrap();
        fsm.restore(&snap).unwrap();
        assert_eq!(shared.drop_released(&follower).unwrap(), 1);
        assert_eq!(
            normal(&follower),
            [ExtentId(1024), ExtentId(1026), ExtentId(1027)]
        );
        assert_eq!(shared.drop_released(&follower).unwrap(), 0);
        // The next creation continues the leader's ids.
        assert_eq!(
            apply(&mut fsm, 5, &DataCommand::CreateExtent).unwrap(),
            Some(ExtentId(1027))
        );
    }

    /// `CommandHead` reads an encoded overwrite's head without its data copied, and nothing else
    /// as an overwrite (its variants mirror `DataCommand`'s first ones).
    #[test]
    fn command_heads_mirror_commands() {
        let enc = |c: &DataCommand| postcard::to_allocvec(c).unwrap();
        let bytes = enc(&DataCommand::Overwrite {
            extent: ExtentId(1030),
            offset: 70_000,
            data: bytes::Bytes::from(vec![7u8; 300]),
        });
        match postcard::from_bytes::<CommandHead<'_>>(&bytes).unwrap() {
            CommandHead::Overwrite {
                extent,
                offset,
                data,
            } => assert_eq!(
                (extent, offset, data),
                (ExtentId(1030), 70_000, &[7u8; 300][..])
            ),
            other => panic!("{other:?}"),
        }
        assert!(matches!(
            postcard::from_bytes::<CommandHead<'_>>(&enc(&DataCommand::CreateExtent)),
            Ok(CommandHead::CreateExtent)
        ));
        for other in [
            DataCommand::Append {
                extent: ExtentId(1030),
                offset: 0,
                data: bytes::Bytes::from_static(b"x"),
            },
            DataCommand::Release { ranges: vec![] },
        ] {
            assert!(postcard::from_bytes::<CommandHead<'_>>(&enc(&other)).is_err());
        }
    }

    /// Snapshots from before the live set decode: the next id is kept, what the store holds
    /// counts as live.
    #[test]
    fn version_1_snapshots_restore() {
        let st = store(&MemDisk::new());
        st.create(ExtentId(1030)).unwrap();
        let shared = Arc::new(SmShared::default());
        let mut sm = DataSm::new(st.clone(), shared.clone());
        let v1 = postcard::to_allocvec(&SnapshotV1 { next_extent: 1031 }).unwrap();
        sm.restore(&v1).unwrap();
        assert_eq!(shared.drop_released(&st).unwrap(), 0);
        assert_eq!(
            apply(&mut sm, 1, &DataCommand::CreateExtent).unwrap(),
            Some(ExtentId(1031))
        );
    }
}
