//! The meta partition state machine (pure: no IO, no clock, no async). IN PROGRESS.

use nacre_types::Ino;
use serde::{Deserialize, Serialize};

use crate::ops::{Command, MetaError, PartitionStats, Query, Reply};

/// One meta partition: inodes of `[start, end)` and the dentries under the directories among them.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct MetaPartition {
    start: u64,
    end: u64,
}

impl MetaPartition {
    /// An empty partition for inodes `[start, end)`. The partition whose range holds `ROOT_INO`
    /// starts with the root directory (mode 0o755, uid/gid 0, nlink 2, parent itself).
    pub fn new(start: u64, end: u64) -> Self {
        Self { start, end }
    }

    /// Whether `ino` is in this partition's range.
    pub fn owns(&self, ino: Ino) -> bool {
        self.start <= ino.0 && ino.0 < self.end
    }

    /// Applies a command stamped with the leader's time `now` (ns). A failed command changes nothing.
    pub fn apply(&mut self, now: u64, cmd: &Command) -> Result<Reply, MetaError> {
        let _ = (now, cmd);
        Err(MetaError::Invalid("not implemented yet".into()))
    }

    /// Answers a read.
    pub fn query(&self, q: &Query) -> Result<Reply, MetaError> {
        let _ = q;
        Err(MetaError::Invalid("not implemented yet".into()))
    }

    pub fn stats(&self) -> PartitionStats {
        PartitionStats {
            start: self.start,
            end: self.end,
            ..PartitionStats::default()
        }
    }

    /// The whole partition as bytes (a Raft snapshot).
    pub fn snapshot(&self) -> Vec<u8> {
        postcard::to_allocvec(self).unwrap_or_default()
    }

    pub fn restore(bytes: &[u8]) -> Result<Self, MetaError> {
        postcard::from_bytes(bytes).map_err(|e| MetaError::Invalid(format!("bad snapshot: {e}")))
    }
}
