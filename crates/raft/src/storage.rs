//! raft-rs's [`Storage`] for one group, over the node's shared [`LogStore`].

use std::cell::Cell;
use std::sync::Arc;

use raft::eraftpb::{Entry, Snapshot};
use raft::{GetEntriesContext, RaftState, Storage, StorageError};

use crate::log::{GroupId, LogError, LogStore};

/// The view of one group's log that its `RawNode` reads.
///
/// Writes do not go through here: the raft store collects every group's `Ready` into one
/// [`crate::LogWrite`]. The latest state-machine snapshot is kept here so that raft-rs can send it to a
/// follower that is behind the log's truncation point; when none is recent enough, raft-rs is told to
/// retry and the driver is asked (through [`GroupStorage::take_snapshot_request`]) to make one.
pub struct GroupStorage {
    group: GroupId,
    log: Arc<dyn LogStore>,
    snapshot: Option<Snapshot>,
    snapshot_wanted: Cell<bool>,
}

impl std::fmt::Debug for GroupStorage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GroupStorage")
            .field("group", &self.group)
            .field(
                "snapshot_index",
                &self.snapshot.as_ref().map(|s| s.get_metadata().index),
            )
            .finish()
    }
}

impl GroupStorage {
    pub fn new(group: GroupId, log: Arc<dyn LogStore>) -> Self {
        Self {
            group,
            log,
            snapshot: None,
            snapshot_wanted: Cell::new(false),
        }
    }

    /// Keeps `snapshot` to send to followers that need one.
    pub fn set_snapshot(&mut self, snapshot: Snapshot) {
        self.snapshot = Some(snapshot);
    }

    /// The snapshot kept for followers, if any.
    pub fn snapshot_ref(&self) -> Option<&Snapshot> {
        self.snapshot.as_ref()
    }

    /// Whether raft-rs asked for a snapshot newer than the one kept (and clears the request).
    pub fn take_snapshot_request(&self) -> bool {
        self.snapshot_wanted.replace(false)
    }
}

fn to_raft(e: LogError) -> raft::Error {
    match e {
        LogError::Compacted { .. } => raft::Error::Store(StorageError::Compacted),
        LogError::Unavailable { .. } => raft::Error::Store(StorageError::Unavailable),
        other => raft::Error::Store(StorageError::Other(Box::new(other))),
    }
}

impl Storage for GroupStorage {
    fn initial_state(&self) -> raft::Result<RaftState> {
        Ok(match self.log.state(self.group).map_err(to_raft)? {
            Some(s) => RaftState::new(s.hard_state, s.conf_state),
            None => RaftState::default(),
        })
    }

    fn entries(
        &self,
        low: u64,
        high: u64,
        max_size: impl Into<Option<u64>>,
        _context: GetEntriesContext,
    ) -> raft::Result<Vec<Entry>> {
        self.log
            .entries(self.group, low, high, max_size.into())
            .map_err(to_raft)
    }

    fn term(&self, idx: u64) -> raft::Result<u64> {
        match self.log.term(self.group, idx) {
            // A group that has never been written has the empty log: term 0 at index 0.
            Err(LogError::UnknownGroup(_)) if idx == 0 => Ok(0),
            r => r.map_err(to_raft),
        }
    }

    fn first_index(&self) -> raft::Result<u64> {
        match self.log.first_index(self.group) {
            Err(LogError::UnknownGroup(_)) => Ok(1),
            r => r.map_err(to_raft),
        }
    }

    fn last_index(&self) -> raft::Result<u64> {
        match self.log.last_index(self.group) {
            Err(LogError::UnknownGroup(_)) => Ok(0),
            r => r.map_err(to_raft),
        }
    }

    fn snapshot(&self, request_index: u64, _to: u64) -> raft::Result<Snapshot> {
        match &self.snapshot {
            Some(s) if s.get_metadata().index >= request_index => Ok(s.clone()),
            _ => {
                self.snapshot_wanted.set(true);
                Err(raft::Error::Store(
                    StorageError::SnapshotTemporarilyUnavailable,
                ))
            }
        }
    }
}
