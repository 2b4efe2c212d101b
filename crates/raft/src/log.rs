//! The durable log of every Raft group on a node, behind the [`LogStore`] trait.
//!
//! One store holds the entries and the persistent state of all groups of a node, so that one write —
//! and one `fdatasync` — covers every group that has something to persist after a round of `Ready`s
//! (group commit). Implementations: [`crate::MemLogStore`] for tests (it can simulate a crash that loses
//! unsynced writes) and [`crate::EngineLogStore`] on tikv's `raft-engine`.
//!
//! Invariants every implementation keeps, per group:
//! - entries are contiguous: `first_index ..= last_index` are all present;
//! - the log starts right after the truncation point: `first_index == truncated_index + 1`, where the
//!   truncation point is the last entry dropped by compaction or covered by an installed snapshot;
//! - a write is atomic across all the groups it touches, and durable when written with `sync`.

use raft::eraftpb::{ConfState, Entry, HardState, Snapshot, SnapshotMetadata};
use thiserror::Error;

/// Identifies a Raft group (a meta or data partition, or the master group) on a node.
pub type GroupId = u64;

/// The durable state of one group besides its entries.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct GroupState {
    /// Term, vote and commit index, as raft-rs hands them out in `Ready`.
    pub hard_state: HardState,
    /// Membership as of the last applied configuration change or snapshot.
    pub conf_state: ConfState,
    /// Index of the last entry dropped from the log, by compaction or because an installed snapshot
    /// covers it (0 for a new group). The log continues at `truncated_index + 1`.
    pub truncated_index: u64,
    /// Term of the entry at `truncated_index`, which Raft still needs for its log matching check.
    pub truncated_term: u64,
}

/// Changes to one group, applied atomically with the rest of a [`LogWrite`], in this order:
/// snapshot, entries, hard state, conf state, compaction.
#[derive(Clone, Debug, Default)]
pub struct GroupWrite {
    pub group: GroupId,
    /// Installs a snapshot: every entry is dropped and the log restarts after `snapshot.index`; the
    /// snapshot's conf state becomes the group's.
    pub snapshot: Option<SnapshotMetadata>,
    /// Contiguous entries to append. An entry at an index already in the log replaces it and every
    /// entry after it (a new leader overwriting an uncommitted tail).
    pub entries: Vec<Entry>,
    pub hard_state: Option<HardState>,
    pub conf_state: Option<ConfState>,
    /// Drops every entry before this index (the state machine has applied them and can produce a
    /// snapshot covering them). At most `last_index + 1`; a value at or below the first index is a no-op.
    pub compact_to: Option<u64>,
    /// Stores the group's latest state-machine snapshot (data and metadata), replacing the previous
    /// one. Written with the compaction it allows, so entries are never dropped before the state they
    /// produced is durable.
    pub save_snapshot: Option<Snapshot>,
}

impl GroupWrite {
    pub fn new(group: GroupId) -> Self {
        Self {
            group,
            ..Self::default()
        }
    }

    /// Whether the write changes nothing.
    pub fn is_empty(&self) -> bool {
        self.snapshot.is_none()
            && self.entries.is_empty()
            && self.hard_state.is_none()
            && self.conf_state.is_none()
            && self.compact_to.is_none()
            && self.save_snapshot.is_none()
    }
}

/// One atomic write covering any number of groups.
#[derive(Clone, Debug, Default)]
pub struct LogWrite {
    pub groups: Vec<GroupWrite>,
}

impl LogWrite {
    pub fn is_empty(&self) -> bool {
        self.groups.iter().all(GroupWrite::is_empty)
    }
}

/// Why a log operation failed.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum LogError {
    /// The underlying storage failed; after a failed write the store must not be trusted until it is
    /// reopened (what was written is unknown).
    #[error("raft log storage failed: {0}")]
    Io(String),
    #[error("entries of group {group} before index {first} are compacted (asked for {index})")]
    Compacted {
        group: GroupId,
        index: u64,
        first: u64,
    },
    #[error("entry {index} of group {group} is not in the log (last index {last})")]
    Unavailable {
        group: GroupId,
        index: u64,
        last: u64,
    },
    #[error("unknown raft group {0}")]
    UnknownGroup(GroupId),
    /// The write would break an invariant of the log (a gap, entries inside a snapshot, ...). Nothing
    /// of it was applied.
    #[error("invalid write to group {group}: {reason}")]
    Invalid { group: GroupId, reason: String },
    /// A stored record does not decode.
    #[error("corrupt raft log record of group {group}: {reason}")]
    Corrupt { group: GroupId, reason: String },
}

/// The durable log of all groups of one node.
pub trait LogStore: Send + Sync + 'static {
    /// Applies `write` atomically; with `sync` it is on stable storage when this returns.
    /// Reclaims storage whose entries are all compacted; returns groups whose old entries keep
    /// storage from being reclaimed (they should be compacted). Stores without such storage do
    /// nothing.
    fn purge(&self) -> Result<Vec<GroupId>, LogError> {
        Ok(Vec::new())
    }

    fn write(&self, write: &LogWrite, sync: bool) -> Result<(), LogError>;

    /// The persistent state of `group`, or `None` if the group has never been written.
    fn state(&self, group: GroupId) -> Result<Option<GroupState>, LogError>;

    /// Entries `[low, high)`, stopping early once their encoded size passes `max_size` (at least one
    /// entry is returned when the range is not empty).
    fn entries(
        &self,
        group: GroupId,
        low: u64,
        high: u64,
        max_size: Option<u64>,
    ) -> Result<Vec<Entry>, LogError>;

    /// Index of the first entry: `truncated_index + 1`.
    fn first_index(&self, group: GroupId) -> Result<u64, LogError>;

    /// Index of the last entry, or `truncated_index` when the log holds no entry.
    fn last_index(&self, group: GroupId) -> Result<u64, LogError>;

    /// Term of the entry at `index`; also answers for the truncation point.
    fn term(&self, group: GroupId, index: u64) -> Result<u64, LogError> {
        let state = self.state(group)?.ok_or(LogError::UnknownGroup(group))?;
        if index == state.truncated_index {
            return Ok(state.truncated_term);
        }
        let first = self.first_index(group)?;
        if index < first {
            return Err(LogError::Compacted {
                group,
                index,
                first,
            });
        }
        let last = self.last_index(group)?;
        if index > last {
            return Err(LogError::Unavailable { group, index, last });
        }
        let e = self.entries(group, index, index + 1, None)?;
        e.first()
            .map(|e| e.term)
            .ok_or(LogError::Unavailable { group, index, last })
    }

    /// The snapshot last stored with [`GroupWrite::save_snapshot`], if any.
    fn saved_snapshot(&self, group: GroupId) -> Result<Option<Snapshot>, LogError>;

    /// Every group with state in the store.
    fn groups(&self) -> Vec<GroupId>;
}

/// Checks the entries and compaction of a group write against the group's bounds `(first, last)`
/// as they are after the write's snapshot (if any). Nothing is applied when this fails.
pub(crate) fn validate(w: &GroupWrite, first: u64, last: u64) -> Result<(), LogError> {
    let invalid = |reason: String| LogError::Invalid {
        group: w.group,
        reason,
    };
    let mut last_after = last;
    if let Some(e) = w.entries.first() {
        if e.index < first {
            return Err(invalid(format!(
                "entry {} is before the first index {first} (truncated)",
                e.index
            )));
        }
        if e.index > last + 1 {
            return Err(invalid(format!(
                "entry {} leaves a gap after the last index {last}",
                e.index
            )));
        }
        for pair in w.entries.windows(2) {
            if pair[1].index != pair[0].index + 1 {
                return Err(invalid(format!(
                    "entries {} and {} are not contiguous",
                    pair[0].index, pair[1].index
                )));
            }
        }
        last_after = e.index + w.entries.len() as u64 - 1;
    }
    if let Some(c) = w.compact_to
        && c > last_after + 1
    {
        return Err(invalid(format!(
            "cannot compact to {c}: the last index is {last_after}"
        )));
    }
    Ok(())
}
