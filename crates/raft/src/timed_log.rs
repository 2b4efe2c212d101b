//! A [`LogStore`] that times its synced writes into a histogram ([`StoreConfig::log_sync_seconds`]),
//! so a node's `/metrics` shows how long its Raft log takes to reach the disk.
//!
//! [`StoreConfig::log_sync_seconds`]: crate::StoreConfig::log_sync_seconds

use std::sync::Arc;
use std::time::Instant;

use prometheus_client::metrics::histogram::Histogram;
use raft::eraftpb::{Entry, Snapshot};

use crate::log::{GroupId, GroupState, LogError, LogStore, LogWrite};

/// Delegates everything to the wrapped log; a `write` with `sync` is timed, failed ones too (a
/// failure that took long is worth seeing).
pub(crate) struct TimedLog {
    inner: Arc<dyn LogStore>,
    synced: Histogram,
}

impl TimedLog {
    pub(crate) fn new(inner: Arc<dyn LogStore>, synced: Histogram) -> Self {
        Self { inner, synced }
    }
}

impl LogStore for TimedLog {
    fn purge(&self) -> Result<Vec<GroupId>, LogError> {
        self.inner.purge()
    }

    fn write(&self, write: &LogWrite, sync: bool) -> Result<(), LogError> {
        if !sync {
            return self.inner.write(write, false);
        }
        let t0 = Instant::now();
        let r = self.inner.write(write, true);
        self.synced.observe(t0.elapsed().as_secs_f64());
        r
    }

    fn state(&self, group: GroupId) -> Result<Option<GroupState>, LogError> {
        self.inner.state(group)
    }

    fn entries(
        &self,
        group: GroupId,
        low: u64,
        high: u64,
        max_size: Option<u64>,
    ) -> Result<Vec<Entry>, LogError> {
        self.inner.entries(group, low, high, max_size)
    }

    fn first_index(&self, group: GroupId) -> Result<u64, LogError> {
        self.inner.first_index(group)
    }

    fn last_index(&self, group: GroupId) -> Result<u64, LogError> {
        self.inner.last_index(group)
    }

    fn term(&self, group: GroupId, index: u64) -> Result<u64, LogError> {
        self.inner.term(group, index)
    }

    fn saved_snapshot(&self, group: GroupId) -> Result<Option<Snapshot>, LogError> {
        self.inner.saved_snapshot(group)
    }

    fn groups(&self) -> Vec<GroupId> {
        self.inner.groups()
    }
}
