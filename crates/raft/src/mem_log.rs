//! An in-memory [`LogStore`] for one-process cluster tests.
//!
//! It keeps two images: what readers see, and what survives a crash (writes made with `sync`, plus
//! everything before them). [`MemLogStore::crash`] drops the difference, like a power cut drops unsynced
//! writes; [`MemLogStore::fail_writes`] makes writes fail, like a broken disk.

use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;

use protobuf::Message as _;
use raft::eraftpb::Entry;

use crate::log::{GroupId, GroupState, GroupWrite, LogError, LogStore, LogWrite, validate};

#[derive(Clone, Debug, Default)]
struct Group {
    state: GroupState,
    saved: Option<raft::eraftpb::Snapshot>,
    /// `entries[0].index == state.truncated_index + 1` when not empty.
    entries: VecDeque<Entry>,
}

impl Group {
    fn first(&self) -> u64 {
        self.state.truncated_index + 1
    }

    fn last(&self) -> u64 {
        self.state.truncated_index + self.entries.len() as u64
    }

    fn apply(&mut self, w: &GroupWrite) {
        if let Some(m) = &w.snapshot {
            self.entries.clear();
            self.state.truncated_index = m.index;
            self.state.truncated_term = m.term;
            self.state.conf_state = m.get_conf_state().clone();
        }
        if let Some(e) = w.entries.first() {
            let keep = (e.index - self.first()) as usize;
            self.entries.truncate(keep);
            self.entries.extend(w.entries.iter().cloned());
        }
        if let Some(hs) = &w.hard_state {
            self.state.hard_state = hs.clone();
        }
        if let Some(cs) = &w.conf_state {
            self.state.conf_state = cs.clone();
        }
        if let Some(c) = w.compact_to
            && c > self.first()
        {
            let drop = (c - self.first()) as usize;
            if let Some(last_dropped) = self.entries.get(drop - 1) {
                self.state.truncated_term = last_dropped.term;
            }
            self.entries.drain(..drop);
            self.state.truncated_index = c - 1;
        }
        if let Some(snap) = &w.save_snapshot {
            self.saved = Some(snap.clone());
        }
    }
}

#[derive(Debug, Default)]
struct Inner {
    live: HashMap<GroupId, Group>,
    durable: HashMap<GroupId, Group>,
    /// Writes applied to `live` but not yet to `durable`.
    unsynced: Vec<LogWrite>,
    /// Writes still allowed before every write fails (`None`: no limit).
    writes_left: Option<u64>,
}

/// In-memory log store with crash and failure injection.
#[derive(Debug, Default)]
pub struct MemLogStore {
    inner: Mutex<Inner>,
}

impl MemLogStore {
    pub fn new() -> Self {
        Self::default()
    }

    /// Simulates a crash and restart: writes not made durable by a synced write are lost.
    pub fn crash(&self) {
        let mut g = self.lock();
        g.live = g.durable.clone();
        g.unsynced.clear();
    }

    /// After `n` more successful writes, every write fails with an I/O error (and applies nothing).
    pub fn fail_writes(&self, n: u64) {
        self.lock().writes_left = Some(n);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        nacre_types::sync::lock(&self.inner)
    }
}

fn apply_all(groups: &mut HashMap<GroupId, Group>, write: &LogWrite) {
    for w in write.groups.iter().filter(|w| !w.is_empty()) {
        groups.entry(w.group).or_default().apply(w);
    }
}

impl LogStore for MemLogStore {
    fn write(&self, write: &LogWrite, sync: bool) -> Result<(), LogError> {
        let mut g = self.lock();
        if let Some(left) = g.writes_left.as_mut() {
            if *left == 0 {
                return Err(LogError::Io("injected write failure".into()));
            }
            *left -= 1;
        }
        // Validate everything first so that a bad group write leaves the whole batch unapplied;
        // `bounds` tracks (first, last) of groups written more than once in the batch.
        let mut bounds: HashMap<GroupId, (u64, u64)> = HashMap::new();
        for w in &write.groups {
            let b = bounds.entry(w.group).or_insert_with(|| {
                g.live
                    .get(&w.group)
                    .map_or((1, 0), |x| (x.first(), x.last()))
            });
            let (first, last) = match &w.snapshot {
                Some(m) => (m.index + 1, m.index),
                None => *b,
            };
            validate(w, first, last)?;
            let last = w
                .entries
                .first()
                .map_or(last, |e| e.index + w.entries.len() as u64 - 1);
            let first = w.compact_to.filter(|c| *c > first).unwrap_or(first);
            *b = (first, last);
        }
        apply_all(&mut g.live, write);
        g.unsynced.push(write.clone());
        if sync {
            let pending = std::mem::take(&mut g.unsynced);
            for w in &pending {
                apply_all(&mut g.durable, w);
            }
        }
        Ok(())
    }

    fn state(&self, group: GroupId) -> Result<Option<GroupState>, LogError> {
        Ok(self.lock().live.get(&group).map(|g| g.state.clone()))
    }

    fn entries(
        &self,
        group: GroupId,
        low: u64,
        high: u64,
        max_size: Option<u64>,
    ) -> Result<Vec<Entry>, LogError> {
        let g = self.lock();
        let grp = g.live.get(&group).ok_or(LogError::UnknownGroup(group))?;
        check_range(group, low, high, grp.first(), grp.last())?;
        let mut out = Vec::new();
        let mut size = 0u64;
        for e in grp
            .entries
            .range((low - grp.first()) as usize..(high - grp.first()) as usize)
        {
            size += u64::from(e.compute_size());
            if !out.is_empty() && max_size.is_some_and(|m| size > m) {
                break;
            }
            out.push(e.clone());
        }
        Ok(out)
    }

    fn first_index(&self, group: GroupId) -> Result<u64, LogError> {
        let g = self.lock();
        Ok(g.live
            .get(&group)
            .ok_or(LogError::UnknownGroup(group))?
            .first())
    }

    fn last_index(&self, group: GroupId) -> Result<u64, LogError> {
        let g = self.lock();
        Ok(g.live
            .get(&group)
            .ok_or(LogError::UnknownGroup(group))?
            .last())
    }

    fn saved_snapshot(&self, group: GroupId) -> Result<Option<raft::eraftpb::Snapshot>, LogError> {
        Ok(self.lock().live.get(&group).and_then(|g| g.saved.clone()))
    }

    fn groups(&self) -> Vec<GroupId> {
        let mut v: Vec<_> = self.lock().live.keys().copied().collect();
        v.sort_unstable();
        v
    }
}

/// Checks that `[low, high)` lies within the entries `[first, last]`.
pub(crate) fn check_range(
    group: GroupId,
    low: u64,
    high: u64,
    first: u64,
    last: u64,
) -> Result<(), LogError> {
    if low < first {
        return Err(LogError::Compacted {
            group,
            index: low,
            first,
        });
    }
    if high > last + 1 || low > high {
        return Err(LogError::Unavailable {
            group,
            index: high.saturating_sub(1).max(low),
            last,
        });
    }
    Ok(())
}
