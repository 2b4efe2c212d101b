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

use nacre_raft::StateMachine;
use nacre_types::ExtentId;
use serde::{Deserialize, Serialize};

use crate::rpc::DataError;
use crate::store::{ExtentStore, FIRST_NORMAL_EXTENT, StoreError};

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
}

impl SmShared {
    pub fn applied(&self) -> u64 {
        self.applied.load(Ordering::Acquire)
    }

    fn suspect(&self, extent: ExtentId) {
        if let Ok(mut s) = self.suspect.lock() {
            s.insert(extent);
        }
    }
}

#[derive(Debug, Serialize, Deserialize)]
struct Snapshot {
    next_extent: u64,
}

/// The state machine of one data partition's Raft group.
#[derive(Debug)]
pub struct DataSm {
    pub store: Arc<ExtentStore>,
    pub shared: Arc<SmShared>,
    next_extent: u64,
}

impl DataSm {
    pub fn new(store: Arc<ExtentStore>, shared: Arc<SmShared>) -> Self {
        let next_extent = store
            .extents()
            .iter()
            .map(|(id, _)| id.0 + 1)
            .max()
            .unwrap_or(FIRST_NORMAL_EXTENT)
            .max(FIRST_NORMAL_EXTENT);
        Self {
            store,
            shared,
            next_extent,
        }
    }

    fn execute(&mut self, cmd: DataCommand) -> Result<Option<ExtentId>, DataError> {
        match cmd {
            DataCommand::CreateExtent => {
                let id = ExtentId(self.next_extent);
                self.store.create(id).map_err(store_error)?;
                self.next_extent += 1;
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
                for (extent, offset, len) in ranges {
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

    fn snapshot(&self) -> Vec<u8> {
        // The log behind this snapshot is about to be dropped: what it applied must be on disk.
        if let Err(e) = self.store.sync() {
            tracing::error!(error = %e, "cannot sync the extent store before a snapshot");
        }
        postcard::to_allocvec(&Snapshot {
            next_extent: self.next_extent,
        })
        .unwrap_or_default()
    }

    fn restore(&mut self, snapshot: &[u8]) -> Result<(), String> {
        let s: Snapshot = postcard::from_bytes(snapshot).map_err(|e| e.to_string())?;
        self.next_extent = self.next_extent.max(s.next_extent);
        self.shared
            .suspect_all
            .store(true, std::sync::atomic::Ordering::Release);
        Ok(())
    }
}
