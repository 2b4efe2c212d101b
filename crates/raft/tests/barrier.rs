//! Snapshots of a state machine with a durability barrier: the log is compacted only after the
//! barrier, run off the Raft thread, succeeded; a failed barrier keeps every entry.
#![allow(clippy::unwrap_used)]

use std::sync::{Arc, Mutex};

use nacre_raft::{
    Barrier, LogStore, MemLogStore, NodeConfig, PendingBarrier, RaftNode, RestoreError,
    StateMachine,
};

/// Counts applied commands; its barrier records how many were applied when it ran ("durable").
#[derive(Default)]
struct Counter {
    applied: Arc<Mutex<u64>>,
    durable: Arc<Mutex<u64>>,
}

impl StateMachine for Counter {
    fn apply(&mut self, _index: u64, _command: &[u8]) -> Vec<u8> {
        *self.applied.lock().unwrap() += 1;
        Vec::new()
    }
    fn snapshot(&self) -> Vec<u8> {
        self.applied.lock().unwrap().to_le_bytes().to_vec()
    }
    fn restore(&mut self, snapshot: &[u8]) -> Result<(), RestoreError> {
        let raw: [u8; 8] = snapshot
            .try_into()
            .map_err(|_| RestoreError::Decode("bad snapshot".into()))?;
        *self.applied.lock().unwrap() = u64::from_le_bytes(raw);
        Ok(())
    }
    fn durability_barrier(&self) -> Option<Barrier> {
        let (applied, durable) = (self.applied.clone(), self.durable.clone());
        Some(Box::new(move || {
            *durable.lock().unwrap() = *applied.lock().unwrap();
            Ok(())
        }))
    }
}

fn leader(log: &Arc<MemLogStore>, sm: Counter) -> RaftNode<Counter> {
    let config = NodeConfig {
        compact_after: 10,
        ..NodeConfig::default()
    };
    let mut node = RaftNode::new(1, config, log.clone());
    node.add_group(1, &[1], sm).unwrap();
    node.campaign(1).unwrap();
    for _ in 0..10 {
        node.process_ready().unwrap();
    }
    assert!(node.is_leader(1));
    node
}

/// Proposes `n` commands, one Ready round each; returns the barriers handed out.
fn propose(node: &mut RaftNode<Counter>, n: usize) -> Vec<PendingBarrier> {
    let mut barriers = Vec::new();
    for _ in 0..n {
        node.propose(1, b"x".to_vec()).unwrap();
        barriers.extend(node.process_ready().unwrap().barriers);
    }
    barriers
}

#[test]
fn the_log_is_compacted_only_after_the_snapshot_barrier_succeeded() {
    let log = Arc::new(MemLogStore::new());
    let sm = Counter::default();
    let (applied, durable) = (sm.applied.clone(), sm.durable.clone());
    let mut node = leader(&log, sm);
    let first = log.first_index(1).unwrap();

    // Past compact_after: one snapshot is taken and waits for its barrier; nothing is compacted.
    let mut barriers = propose(&mut node, 30);
    assert_eq!(barriers.len(), 1, "one pending snapshot at a time");
    assert_eq!(log.first_index(1).unwrap(), first);
    assert_eq!(log.saved_snapshot(1).unwrap(), None);

    // A failed barrier: the snapshot is dropped, the log keeps everything.
    let b = barriers.remove(0);
    node.barrier_done(b.group, b.token, Err("disk full".into()));
    let mut barriers = propose(&mut node, 1);
    assert_eq!(log.first_index(1).unwrap(), first);
    assert_eq!(log.saved_snapshot(1).unwrap(), None);
    assert_eq!(barriers.len(), 1, "a new snapshot after the failed one");

    // Its barrier succeeds: saved at the index it was taken at, log compacted.
    let b = barriers.remove(0);
    (b.run)().unwrap();
    let at_barrier = *durable.lock().unwrap();
    propose(&mut node, 5); // applied while the barrier ran: not covered by the snapshot
    node.barrier_done(b.group, b.token, Ok(()));
    assert!(node.process_ready().unwrap().barriers.is_empty());
    let snap = log.saved_snapshot(1).unwrap().expect("snapshot saved");
    let covered = u64::from_le_bytes(snap.data.as_ref().try_into().unwrap());
    assert!(
        covered <= at_barrier,
        "snapshot covers {covered}, barrier made {at_barrier} durable"
    );
    assert!(log.first_index(1).unwrap() > first, "log compacted");
    assert!(log.first_index(1).unwrap() <= snap.get_metadata().index + 1);

    // A stale report (token already used) changes nothing.
    node.barrier_done(b.group, b.token, Ok(()));
    propose(&mut node, 1);

    // Restart from the log: the snapshot and the entries after it give every command back.
    let total = *applied.lock().unwrap();
    drop(node);
    let sm = Counter::default();
    let applied = sm.applied.clone();
    let mut node = RaftNode::new(1, NodeConfig::default(), log.clone());
    node.add_group(1, &[], sm).unwrap();
    for _ in 0..10 {
        node.process_ready().unwrap();
    }
    assert_eq!(*applied.lock().unwrap(), total);
}

/// Commands that carry data compact the log by bytes, however few the entries, and the
/// snapshot keeps no more than half the byte budget of log behind it.
#[test]
fn the_log_is_compacted_past_its_byte_budget() {
    let log = Arc::new(MemLogStore::new());
    let config = NodeConfig {
        compact_after: 10_000,
        compact_after_bytes: 64 << 10,
        ..NodeConfig::default()
    };
    let mut node = RaftNode::new(1, config, log.clone());
    node.add_group(1, &[1], Counter::default()).unwrap();
    node.campaign(1).unwrap();
    for _ in 0..10 {
        node.process_ready().unwrap();
    }
    let first = log.first_index(1).unwrap();
    // 15 commands of 4 KiB stay under the budget: nothing taken.
    let mut barriers = Vec::new();
    for _ in 0..15 {
        node.propose(1, vec![7; 4096]).unwrap();
        barriers.extend(node.process_ready().unwrap().barriers);
    }
    assert!(barriers.is_empty(), "under the byte budget");
    // The 16th reaches 64 KiB.
    node.propose(1, vec![7; 4096]).unwrap();
    barriers.extend(node.process_ready().unwrap().barriers);
    assert_eq!(barriers.len(), 1, "a snapshot past the byte budget");
    let b = barriers.remove(0);
    (b.run)().unwrap();
    node.barrier_done(b.group, b.token, Ok(()));
    node.process_ready().unwrap();
    let snap = log.saved_snapshot(1).unwrap().expect("snapshot saved");
    let kept = snap.get_metadata().index + 1 - log.first_index(1).unwrap();
    assert!(log.first_index(1).unwrap() > first, "log compacted");
    // Half the budget at 4 KiB an entry: 8 entries (not the 5,000 `compact_after` keeps).
    assert!(kept <= 9, "{kept} entries kept behind the snapshot");
}

/// A restarted node replays its log since the last snapshot in rounds of at most
/// `max_apply_per_ready` bytes of commands, so its loop gets back to its ticks and messages
/// between them.
#[test]
fn a_restart_replays_the_log_in_rounds_of_bounded_size() {
    let log = Arc::new(MemLogStore::new());
    let config = NodeConfig {
        max_apply_per_ready: 4 << 10,
        ..NodeConfig::default()
    };
    {
        let mut node = RaftNode::new(1, config.clone(), log.clone());
        node.add_group(1, &[1], Counter::default()).unwrap();
        node.campaign(1).unwrap();
        for _ in 0..10 {
            node.process_ready().unwrap();
        }
        assert!(node.is_leader(1));
        for _ in 0..100 {
            node.propose(1, vec![7u8; 400]).unwrap();
        }
        for _ in 0..50 {
            node.process_ready().unwrap();
        }
    }
    let sm = Counter::default();
    let applied = sm.applied.clone();
    let mut node = RaftNode::new(1, config, log.clone());
    node.add_group(1, &[1], sm).unwrap();
    node.campaign(1).unwrap();
    let mut rounds = Vec::new();
    let mut last = 0;
    for _ in 0..200 {
        node.process_ready().unwrap();
        let now = *applied.lock().unwrap();
        if now > last {
            rounds.push(now - last);
        }
        last = now;
    }
    assert!(last >= 100, "replayed {last} commands");
    // A round applies twice (its Ready's entries, then those committed after its write), each
    // at most 4 KiB of 400-byte commands and the entry that crosses the limit: at most 22.
    assert!(rounds.len() >= 4, "{rounds:?}");
    assert!(rounds.iter().all(|&n| n <= 22), "{rounds:?}");
}

/// A restarted node with many groups to replay applies at most `max_apply_per_round` bytes of
/// commands (and the group that crosses it) in one round, across groups, and says so
/// (`round_was_cut`); the next round starts with the groups left, so each is replayed.
#[test]
fn a_restart_of_many_groups_replays_them_in_rounds_of_bounded_size() {
    const GROUPS: u64 = 8;
    let log = Arc::new(MemLogStore::new());
    let config = NodeConfig {
        max_apply_per_ready: 1 << 20,
        max_apply_per_round: 8 << 10,
        ..NodeConfig::default()
    };
    {
        let mut node = RaftNode::new(1, config.clone(), log.clone());
        for g in 1..=GROUPS {
            node.add_group(g, &[1], Counter::default()).unwrap();
            node.campaign(g).unwrap();
        }
        for _ in 0..10 {
            node.process_ready().unwrap();
        }
        for g in 1..=GROUPS {
            assert!(node.is_leader(g));
            for _ in 0..50 {
                node.propose(g, vec![7u8; 400]).unwrap();
            }
        }
        for _ in 0..50 {
            node.process_ready().unwrap();
        }
    }
    let mut node = RaftNode::new(1, config, log.clone());
    let mut applied = Vec::new();
    for g in 1..=GROUPS {
        let sm = Counter::default();
        applied.push(sm.applied.clone());
        node.add_group(g, &[1], sm).unwrap();
        node.campaign(g).unwrap();
    }
    let total =
        |a: &[Arc<std::sync::Mutex<u64>>]| -> u64 { a.iter().map(|x| *x.lock().unwrap()).sum() };
    let (mut last, mut rounds, mut cut) = (0, Vec::new(), 0);
    for _ in 0..100 {
        node.process_ready().unwrap();
        cut += u32::from(node.round_was_cut());
        let now = total(&applied);
        if now > last {
            rounds.push(now - last);
        }
        last = now;
    }
    for (g, a) in applied.iter().enumerate() {
        assert!(
            *a.lock().unwrap() >= 50,
            "group {} replayed {}",
            g + 1,
            a.lock().unwrap()
        );
    }
    // A round takes groups until 8 KiB of commands (20 of 400 bytes) are applied: one group's
    // whole log (50 commands and the leader's entries) and never a second.
    assert!(cut >= 4, "no round was cut ({rounds:?})");
    assert!(rounds.iter().all(|&n| n <= 60), "{rounds:?}");
}
