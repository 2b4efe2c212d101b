//! raft-rs's [`Storage`] for one group, over the node's shared [`LogStore`].

use std::cell::Cell;
use std::collections::VecDeque;
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
    /// The most recently written entries (contiguous), so that replicating and applying them does
    /// not read them back from the log: raft-engine reads and checksums a whole write batch to
    /// return one entry of it, which is quadratic when a batch holds many large entries.
    cache: VecDeque<Entry>,
    cache_bytes: usize,
    /// Appends handed to the log writer and not written yet, oldest first: (first, last) index
    /// (a raft store with [`crate::StoreConfig::async_log`]). The cache keeps their entries
    /// whatever its bounds: until written, it is the only place they can be read from.
    unwritten: VecDeque<(u64, u64)>,
}

/// Bounds of one group's entry cache.
const CACHE_MAX_BYTES: usize = 8 << 20;
const CACHE_MAX_ENTRIES: usize = 4096;

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
            cache: VecDeque::new(),
            cache_bytes: 0,
            unwritten: VecDeque::new(),
        }
    }

    /// Caches entries `[first, last]` that are handed to the log writer, before they are written
    /// (raft-rs reads its log back from here at once).
    pub fn append_unwritten(&mut self, entries: &[Entry]) {
        if let (Some(first), Some(last)) = (entries.first(), entries.last()) {
            self.unwritten.push_back((first.index, last.index));
        }
        self.cache_append(entries);
    }

    /// The oldest append handed to the log writer is written.
    pub fn written(&mut self) {
        self.unwritten.pop_front();
        self.evict();
    }

    /// Whether the cache may drop the entry at `index`: it is written, and no unwritten append
    /// replaces it.
    fn evictable(&self, index: u64) -> bool {
        self.unwritten.iter().all(|&(first, _)| index < first)
    }

    fn evict(&mut self) {
        while self.cache_bytes > CACHE_MAX_BYTES || self.cache.len() > CACHE_MAX_ENTRIES {
            match self.cache.front() {
                Some(e) if self.evictable(e.index) => {}
                _ => break,
            }
            match self.cache.pop_front() {
                Some(e) => self.cache_bytes -= e.data.len(),
                None => break,
            }
        }
    }

    /// Records entries just written to the log: an entry at an index already cached replaces it
    /// and everything after it, as in the log.
    pub fn cache_append(&mut self, entries: &[Entry]) {
        let Some(first) = entries.first() else {
            return;
        };
        let next = self.cache.back().map(|e| e.index + 1);
        match (self.cache.front().map(|e| e.index), next) {
            (Some(front), Some(next)) if first.index >= front && first.index <= next => {
                while self.cache.back().is_some_and(|e| e.index >= first.index) {
                    if let Some(e) = self.cache.pop_back() {
                        self.cache_bytes -= e.data.len();
                    }
                }
            }
            _ => self.cache_clear(),
        }
        for e in entries {
            self.cache_bytes += e.data.len();
            self.cache.push_back(e.clone());
        }
        self.evict();
    }

    /// Forgets the cached entries (a snapshot replaced the log).
    pub fn cache_clear(&mut self) {
        self.cache.clear();
        self.cache_bytes = 0;
    }

    /// The cached entry at `idx`.
    fn cached(&self, idx: u64) -> Option<&Entry> {
        let front = self.cache.front()?.index;
        let i = usize::try_from(idx.checked_sub(front)?).ok()?;
        self.cache.get(i)
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
        let max_size = max_size.into();
        let front = self.cache.front().map(|e| e.index);
        if low < high && self.cached(high - 1).is_some() && front.is_some_and(|f| low < f) {
            // The older part is only in the log, the newer (perhaps not written yet) only here.
            let front = front.unwrap_or(low);
            let mut out = self
                .log
                .entries(self.group, low, front, max_size)
                .map_err(to_raft)?;
            let mut size: u64 = out
                .iter()
                .map(|e| u64::from(protobuf::Message::compute_size(e)))
                .sum();
            if out.len() as u64 == front - low {
                for idx in front..high {
                    let Some(e) = self.cached(idx) else { break };
                    size += u64::from(protobuf::Message::compute_size(e));
                    if max_size.is_some_and(|m| size > m) {
                        break;
                    }
                    out.push(e.clone());
                }
            }
            return Ok(out);
        }
        if low < high && self.cached(low).is_some() && self.cached(high - 1).is_some() {
            // raft-rs's rule: at least one entry, then as many as fit in `max_size`.
            let mut out = Vec::new();
            let mut size = 0u64;
            for idx in low..high {
                let Some(e) = self.cached(idx) else { break };
                size += u64::from(protobuf::Message::compute_size(e));
                if !out.is_empty() && max_size.is_some_and(|m| size > m) {
                    break;
                }
                out.push(e.clone());
            }
            return Ok(out);
        }
        self.log
            .entries(self.group, low, high, max_size)
            .map_err(to_raft)
    }

    fn term(&self, idx: u64) -> raft::Result<u64> {
        if let Some(e) = self.cached(idx) {
            return Ok(e.term);
        }
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
        // Every entry appended is cached first, and only written ones are dropped from the front:
        // the cache's last entry is the log's, written or not.
        if let Some(e) = self.cache.back() {
            return Ok(e.index);
        }
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

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;
    use crate::MemLogStore;

    fn entry(index: u64, term: u64, len: usize) -> Entry {
        Entry {
            index,
            term,
            data: vec![index as u8; len].into(),
            ..Default::default()
        }
    }

    #[test]
    fn the_cache_serves_recent_entries_and_follows_log_overwrites() {
        let mut s = GroupStorage::new(1, Arc::new(MemLogStore::new()));
        s.cache_append(&(1..=5).map(|i| entry(i, 1, 10)).collect::<Vec<_>>());
        assert_eq!(s.term(3).unwrap(), 1);
        let got = s
            .entries(2, 5, None, GetEntriesContext::empty(false))
            .unwrap();
        assert_eq!(got.iter().map(|e| e.index).collect::<Vec<_>>(), [2, 3, 4]);
        // A new leader replaces the tail from index 4.
        s.cache_append(&[entry(4, 2, 10), entry(5, 2, 10), entry(6, 2, 10)]);
        assert_eq!(s.term(3).unwrap(), 1);
        assert_eq!(s.term(5).unwrap(), 2);
        assert_eq!(s.cached(6).map(|e| e.term), Some(2));
        // max_size: at least one entry, then only what fits.
        let one = u64::from(protobuf::Message::compute_size(&entry(1, 1, 10)));
        let got = s
            .entries(1, 7, one + 1, GetEntriesContext::empty(false))
            .unwrap();
        assert_eq!(got.len(), 1);
        // A gap (entries after a snapshot) starts the cache over.
        s.cache_append(&[entry(100, 3, 10)]);
        assert!(s.cached(5).is_none());
        assert_eq!(s.cached(100).map(|e| e.term), Some(3));
        // Bounded.
        let big: Vec<Entry> = (101..=200).map(|i| entry(i, 3, 1 << 20)).collect();
        s.cache_append(&big);
        assert!(s.cache_bytes <= CACHE_MAX_BYTES);
        assert_eq!(s.cache.back().map(|e| e.index), Some(200));
    }

    #[test]
    fn unwritten_entries_stay_cached_and_count_as_the_log_until_written() {
        let log = Arc::new(MemLogStore::new());
        let mut s = GroupStorage::new(1, log.clone());
        let mut w = crate::GroupWrite::new(1);
        w.entries = (1..=3).map(|i| entry(i, 1, 10)).collect();
        log.write(&crate::LogWrite { groups: vec![w] }, true)
            .unwrap();
        // Entries 4..=13 of 1 MiB each: over the cache's bound, not written yet.
        let big: Vec<Entry> = (4..=13).map(|i| entry(i, 1, 1 << 20)).collect();
        s.append_unwritten(&big);
        assert_eq!(s.last_index().unwrap(), 13);
        assert_eq!(s.cache.front().map(|e| e.index), Some(4));
        // A range from the log into the cache.
        let got = s
            .entries(2, 6, None, GetEntriesContext::empty(false))
            .unwrap();
        assert_eq!(
            got.iter().map(|e| e.index).collect::<Vec<_>>(),
            [2, 3, 4, 5]
        );
        // Written: the cache goes back within its bound, keeping the newest.
        let mut w = crate::GroupWrite::new(1);
        w.entries = big;
        log.write(&crate::LogWrite { groups: vec![w] }, true)
            .unwrap();
        s.written();
        assert!(s.cache_bytes <= CACHE_MAX_BYTES);
        assert_eq!(s.last_index().unwrap(), 13);
        assert_eq!(s.cache.back().map(|e| e.index), Some(13));
    }
}
