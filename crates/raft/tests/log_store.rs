//! The log stores against a naive model: random multi-group batches of appends (with overwrites),
//! snapshot installs, hard-state updates and compactions, plus invalid writes that must change nothing.
//! The raft-engine store is also reopened from disk mid-sequence and must come back identical.
#![allow(clippy::unwrap_used)] // test helpers outside #[test] fns

use std::collections::BTreeMap;

use nacre_raft::eraftpb::{ConfState, Entry, HardState, SnapshotMetadata};
use nacre_raft::{
    EngineLogStore, GroupId, GroupState, GroupWrite, LogError, LogStore, LogWrite, MemLogStore,
};
use proptest::prelude::*;

/// What a group's log should hold.
#[derive(Clone, Debug, Default)]
struct ModelGroup {
    state: GroupState,
    entries: Vec<Entry>,
}

impl ModelGroup {
    fn first(&self) -> u64 {
        self.state.truncated_index + 1
    }
    fn last(&self) -> u64 {
        self.state.truncated_index + self.entries.len() as u64
    }
}

#[derive(Clone, Debug)]
enum Op {
    /// Append `n` entries of `term` starting `back` entries before the end (0 = right after it).
    Append {
        back: u64,
        n: u64,
        term: u64,
    },
    /// Append leaving a gap (invalid).
    Gap,
    Snapshot {
        ahead: u64,
        term: u64,
    },
    Hard {
        term: u64,
        vote: u64,
        commit: u64,
    },
    Conf {
        voters: Vec<u64>,
    },
    /// Compact `keep_from` entries after the first (clamped to the valid range).
    Compact {
        skip: u64,
    },
}

fn entry(index: u64, term: u64) -> Entry {
    Entry {
        index,
        term,
        data: format!("{index}@{term}").into_bytes().into(),
        ..Default::default()
    }
}

/// Turns an op into a write for `group` given the model, or `None` when the op is meant to be invalid.
fn to_write(op: &Op, group: GroupId, m: &ModelGroup) -> (GroupWrite, bool) {
    let mut w = GroupWrite::new(group);
    let valid = match op {
        Op::Append { back, n, term } => {
            let start = (m.last() + 1).saturating_sub(*back).max(m.first());
            w.entries = (start..start + n).map(|i| entry(i, *term)).collect();
            true
        }
        Op::Gap => {
            w.entries = vec![entry(m.last() + 2, 1)];
            false
        }
        Op::Snapshot { ahead, term } => {
            let mut meta = SnapshotMetadata {
                index: m.last() + ahead,
                term: *term,
                ..Default::default()
            };
            meta.set_conf_state(ConfState {
                voters: vec![1, 2, 3],
                ..Default::default()
            });
            w.snapshot = Some(meta);
            true
        }
        Op::Hard { term, vote, commit } => {
            w.hard_state = Some(HardState {
                term: *term,
                vote: *vote,
                commit: *commit,
                ..Default::default()
            });
            true
        }
        Op::Conf { voters } => {
            w.conf_state = Some(ConfState {
                voters: voters.clone(),
                ..Default::default()
            });
            true
        }
        Op::Compact { skip } => {
            w.compact_to = Some((m.first() + skip).min(m.last() + 1));
            true
        }
    };
    (w, valid)
}

fn apply_model(m: &mut ModelGroup, w: &GroupWrite) {
    if let Some(s) = &w.snapshot {
        m.entries.clear();
        m.state.truncated_index = s.index;
        m.state.truncated_term = s.term;
        m.state.conf_state = s.get_conf_state().clone();
    }
    if let Some(e) = w.entries.first() {
        m.entries.truncate((e.index - m.first()) as usize);
        m.entries.extend(w.entries.iter().cloned());
    }
    if let Some(hs) = &w.hard_state {
        m.state.hard_state = hs.clone();
    }
    if let Some(cs) = &w.conf_state {
        m.state.conf_state = cs.clone();
    }
    if let Some(c) = w.compact_to
        && c > m.first()
    {
        let drop = (c - m.first()) as usize;
        m.state.truncated_term = m.entries[drop - 1].term;
        m.entries.drain(..drop);
        m.state.truncated_index = c - 1;
    }
}

fn check(store: &dyn LogStore, model: &BTreeMap<GroupId, ModelGroup>) {
    assert_eq!(store.groups(), model.keys().copied().collect::<Vec<_>>());
    for (g, m) in model {
        assert_eq!(
            store.state(*g).unwrap().as_ref(),
            Some(&m.state),
            "state of {g}"
        );
        assert_eq!(store.first_index(*g).unwrap(), m.first(), "first of {g}");
        assert_eq!(store.last_index(*g).unwrap(), m.last(), "last of {g}");
        let got = store.entries(*g, m.first(), m.last() + 1, None).unwrap();
        assert_eq!(got, m.entries, "entries of {g}");
        for i in m.state.truncated_index..=m.last() {
            let want = if i == m.state.truncated_index {
                m.state.truncated_term
            } else {
                m.entries[(i - m.first()) as usize].term
            };
            assert_eq!(store.term(*g, i).unwrap(), want, "term {i} of {g}");
        }
        if m.first() > 1 {
            assert!(matches!(
                store.entries(*g, m.first() - 1, m.last() + 1, None),
                Err(LogError::Compacted { .. })
            ));
        }
        assert!(matches!(
            store.entries(*g, m.first(), m.last() + 2, None),
            Err(LogError::Unavailable { .. })
        ));
    }
}

fn arb_op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (0u64..4, 1u64..6, 1u64..5).prop_map(|(back, n, term)| Op::Append { back, n, term }),
        1 => Just(Op::Gap),
        1 => (0u64..4, 1u64..9).prop_map(|(ahead, term)| Op::Snapshot { ahead, term }),
        2 => (1u64..9, 0u64..4, 0u64..50).prop_map(|(term, vote, commit)| Op::Hard { term, vote, commit }),
        1 => proptest::collection::vec(1u64..6, 0..4).prop_map(|voters| Op::Conf { voters }),
        2 => (0u64..8).prop_map(|skip| Op::Compact { skip }),
    ]
}

/// Batches of (group, op) pairs; a batch is applied as one atomic write.
fn arb_batches() -> impl Strategy<Value = Vec<Vec<(GroupId, Op)>>> {
    proptest::collection::vec(proptest::collection::vec((1u64..4, arb_op()), 1..4), 1..40)
}

/// Runs the batches on `store`; `reopen` is called every few batches to swap in a reopened store.
fn run(
    batches: &[Vec<(GroupId, Op)>],
    mut store: Box<dyn LogStore>,
    mut reopen: impl FnMut(Box<dyn LogStore>) -> Box<dyn LogStore>,
) {
    let mut model: BTreeMap<GroupId, ModelGroup> = BTreeMap::new();
    for (n, batch) in batches.iter().enumerate() {
        let mut scratch = model.clone();
        let mut write = LogWrite::default();
        let mut valid = true;
        for (g, op) in batch {
            let m = scratch.entry(*g).or_default();
            let (w, ok) = to_write(op, *g, m);
            valid &= ok;
            apply_model(m, &w);
            write.groups.push(w);
        }
        let r = store.write(&write, n % 3 == 0);
        if valid {
            r.unwrap();
            model = scratch;
        } else {
            assert!(matches!(r, Err(LogError::Invalid { .. })), "{r:?}");
        }
        check(store.as_ref(), &model);
        if n % 7 == 6 {
            store = reopen(store);
            check(store.as_ref(), &model);
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn mem_log_store_matches_the_model(batches in arb_batches()) {
        run(&batches, Box::new(MemLogStore::new()), |s| s);
    }

    #[test]
    fn engine_log_store_matches_the_model_across_reopens(batches in arb_batches()) {
        // Each engine gets a thread of its own: raft-engine caches the last block read per thread,
        // keyed by file position only (see `EngineLogStore`).
        std::thread::spawn(move || {
            let dir = tempfile::tempdir().unwrap();
            let path = dir.path().to_path_buf();
            let store = Box::new(EngineLogStore::open(&path).unwrap());
            run(&batches, store, |old| {
                drop(old);
                Box::new(EngineLogStore::open(&path).unwrap())
            });
        })
        .join()
        .map_err(|_| TestCaseError::fail("engine case panicked"))?;
    }
}

#[test]
fn a_crash_loses_exactly_the_unsynced_writes() {
    let store = MemLogStore::new();
    let mut w = GroupWrite::new(1);
    w.entries = (1..=3).map(|i| entry(i, 1)).collect();
    store.write(&LogWrite { groups: vec![w] }, true).unwrap();
    let mut w = GroupWrite::new(1);
    w.entries = (4..=5).map(|i| entry(i, 1)).collect();
    store.write(&LogWrite { groups: vec![w] }, false).unwrap();
    assert_eq!(store.last_index(1).unwrap(), 5);
    store.crash();
    assert_eq!(store.last_index(1).unwrap(), 3);
    // A later synced write makes everything before it durable too.
    let mut w = GroupWrite::new(1);
    w.entries = vec![entry(4, 2)];
    store.write(&LogWrite { groups: vec![w] }, false).unwrap();
    let mut w = GroupWrite::new(2);
    w.entries = vec![entry(1, 1)];
    store.write(&LogWrite { groups: vec![w] }, true).unwrap();
    store.crash();
    assert_eq!(store.last_index(1).unwrap(), 4);
    assert_eq!(store.term(1, 4).unwrap(), 2);
    assert_eq!(store.last_index(2).unwrap(), 1);
}

#[test]
fn injected_write_failures_apply_nothing() {
    let store = MemLogStore::new();
    store.fail_writes(1);
    let mut w = GroupWrite::new(1);
    w.entries = vec![entry(1, 1)];
    store
        .write(
            &LogWrite {
                groups: vec![w.clone()],
            },
            true,
        )
        .unwrap();
    w.entries = vec![entry(2, 1)];
    let err = store
        .write(&LogWrite { groups: vec![w] }, true)
        .unwrap_err();
    assert!(matches!(err, LogError::Io(_)));
    assert_eq!(store.last_index(1).unwrap(), 1);
}

#[test]
fn an_invalid_group_write_leaves_the_whole_batch_unapplied() {
    let dir = tempfile::tempdir().unwrap();
    for store in [
        Box::new(MemLogStore::new()) as Box<dyn LogStore>,
        Box::new(EngineLogStore::open(dir.path()).unwrap()),
    ] {
        let mut ok = GroupWrite::new(1);
        ok.entries = vec![entry(1, 1)];
        let mut bad = GroupWrite::new(2);
        bad.entries = vec![entry(5, 1)];
        let err = store
            .write(
                &LogWrite {
                    groups: vec![ok, bad],
                },
                true,
            )
            .unwrap_err();
        assert!(matches!(err, LogError::Invalid { group: 2, .. }), "{err}");
        assert!(store.groups().is_empty());
        assert_eq!(store.state(1).unwrap(), None);
    }
}

#[test]
fn entries_respect_max_size_but_return_at_least_one() {
    let dir = tempfile::tempdir().unwrap();
    for store in [
        Box::new(MemLogStore::new()) as Box<dyn LogStore>,
        Box::new(EngineLogStore::open(dir.path()).unwrap()),
    ] {
        let mut w = GroupWrite::new(7);
        w.entries = (1..=10).map(|i| entry(i, 1)).collect();
        store.write(&LogWrite { groups: vec![w] }, true).unwrap();
        assert_eq!(store.entries(7, 1, 11, Some(0)).unwrap().len(), 1);
        let some = store.entries(7, 1, 11, Some(40)).unwrap();
        assert!(!some.is_empty() && some.len() < 10, "{}", some.len());
        assert_eq!(store.entries(7, 3, 3, None).unwrap(), vec![]);
    }
}

#[test]
fn an_overwrite_in_the_same_batch_replaces_the_earlier_append() {
    let dir = tempfile::tempdir().unwrap();
    for store in [
        Box::new(MemLogStore::new()) as Box<dyn LogStore>,
        Box::new(EngineLogStore::open(dir.path()).unwrap()),
    ] {
        let mut a = GroupWrite::new(2);
        a.entries = (1..=4).map(|i| entry(i, 2)).collect();
        let mut b = GroupWrite::new(2);
        b.entries = (1..=4).map(|i| entry(i, 4)).collect();
        store.write(&LogWrite { groups: vec![a, b] }, true).unwrap();
        let terms: Vec<u64> = store
            .entries(2, 1, 5, None)
            .unwrap()
            .iter()
            .map(|e| e.term)
            .collect();
        assert_eq!(terms, vec![4, 4, 4, 4]);
    }
}

#[test]
fn overwriting_the_whole_log_survives_a_reopen() {
    let dir = tempfile::tempdir().unwrap();
    for sync in [true, false] {
        let g = if sync { 3 } else { 4 };
        {
            let store = EngineLogStore::open(dir.path()).unwrap();
            let mut a = GroupWrite::new(g);
            a.entries = (1..=4).map(|i| entry(i, 2)).collect();
            store.write(&LogWrite { groups: vec![a] }, sync).unwrap();
            let mut b = GroupWrite::new(g);
            b.entries = (1..=4).map(|i| entry(i, 4)).collect();
            store.write(&LogWrite { groups: vec![b] }, sync).unwrap();
            let terms: Vec<u64> = store
                .entries(g, 1, 5, None)
                .unwrap()
                .iter()
                .map(|e| e.term)
                .collect();
            assert_eq!(terms, vec![4, 4, 4, 4], "before reopen, sync {sync}");
        }
        let store = EngineLogStore::open(dir.path()).unwrap();
        let terms: Vec<u64> = store
            .entries(g, 1, 5, None)
            .unwrap()
            .iter()
            .map(|e| e.term)
            .collect();
        assert_eq!(terms, vec![4, 4, 4, 4], "after reopen, sync {sync}");
    }
}

#[test]
fn a_saved_snapshot_survives_reopen_compaction_and_a_later_install() {
    use nacre_raft::eraftpb::Snapshot;
    let dir = tempfile::tempdir().unwrap();
    let snap = |index: u64, data: &str| {
        let mut s = Snapshot {
            data: data.as_bytes().to_vec().into(),
            ..Default::default()
        };
        s.mut_metadata().index = index;
        s.mut_metadata().term = 1;
        s
    };
    {
        let store = EngineLogStore::open(dir.path()).unwrap();
        let mut w = GroupWrite::new(1);
        w.entries = (1..=10).map(|i| entry(i, 1)).collect();
        store.write(&LogWrite { groups: vec![w] }, true).unwrap();
        let mut w = GroupWrite::new(1);
        w.compact_to = Some(6);
        w.save_snapshot = Some(snap(8, "state@8"));
        store.write(&LogWrite { groups: vec![w] }, true).unwrap();
    }
    let store = EngineLogStore::open(dir.path()).unwrap();
    assert_eq!(store.saved_snapshot(1).unwrap(), Some(snap(8, "state@8")));
    assert_eq!(store.first_index(1).unwrap(), 6);
    // Installing a snapshot from a leader cleans the group but keeps the saved state consistent.
    let mut w = GroupWrite::new(1);
    let mut meta = snap(20, "").take_metadata();
    meta.term = 2;
    w.snapshot = Some(meta);
    w.save_snapshot = Some(snap(20, "state@20"));
    store.write(&LogWrite { groups: vec![w] }, true).unwrap();
    assert_eq!(store.saved_snapshot(1).unwrap(), Some(snap(20, "state@20")));
    assert_eq!(store.first_index(1).unwrap(), 21);
    // A later install without a saved snapshot keeps the previous one.
    let mut w = GroupWrite::new(1);
    let mut meta = snap(30, "").take_metadata();
    meta.term = 3;
    w.snapshot = Some(meta);
    store.write(&LogWrite { groups: vec![w] }, true).unwrap();
    assert_eq!(store.saved_snapshot(1).unwrap(), Some(snap(20, "state@20")));
}

/// Log files are reused after compaction (and three files of zeros are written when a log is
/// created): entries written over older entries of the same group in a reused file, and the
/// compaction that freed it, read back exactly after a reopen.
#[test]
fn reused_log_files_read_back_after_a_reopen() {
    let dir = tempfile::tempdir().unwrap();
    let big = |index: u64, round: u64| Entry {
        index,
        term: round,
        data: vec![(index % 251) as u8 ^ round as u8; 64 << 10].into(),
        ..Default::default()
    };
    let files = |suffix: &str| {
        std::fs::read_dir(dir.path())
            .unwrap()
            .filter(|e| {
                e.as_ref()
                    .is_ok_and(|e| e.file_name().to_string_lossy().ends_with(suffix))
            })
            .count()
    };
    let mut next = 1;
    {
        let store = EngineLogStore::open(dir.path()).unwrap();
        assert!(
            files(".reserved") >= 2,
            "a new log starts with reserved files"
        );
        // Rounds of ~38 MiB each, each compacted and purged before the next: once the log has
        // more than 32 files (the 128 MiB purge threshold), compacted files are purged and later
        // rounds land in files that held earlier rounds' entries.
        for round in 1..=8 {
            for _ in 0..12 {
                let mut w = GroupWrite::new(7);
                w.entries = (next..next + 50).map(|i| big(i, round)).collect();
                next += 50;
                store.write(&LogWrite { groups: vec![w] }, true).unwrap();
            }
            let mut w = GroupWrite::new(7);
            w.compact_to = Some(next - 10);
            store.write(&LogWrite { groups: vec![w] }, true).unwrap();
            store.purge().unwrap();
        }
    }
    // Purged files are renamed for reuse when the engine closes.
    let (reserved, live) = (files(".reserved"), files(".raftlog"));
    assert!(reserved >= 2, "{reserved} files kept for reuse");
    assert!(
        live < 40,
        "{live} log files: compacted files were not purged"
    );
    let store = EngineLogStore::open(dir.path()).unwrap();
    assert_eq!(store.first_index(7).unwrap(), next - 10);
    assert_eq!(store.last_index(7).unwrap(), next - 1);
    let got = store.entries(7, next - 10, next, None).unwrap();
    let want: Vec<Entry> = (next - 10..next).map(|i| big(i, 8)).collect();
    assert!(got == want, "entries differ after a reopen");
}
