//! Scenario tests of the raft store: whole clusters of `RaftNode`s in one thread, messages delivered
//! by the test (so faults are exact and runs are deterministic), logs in `MemLogStore`s that can lose
//! unsynced writes on a crash. Tests are named after the Raft paper section they check.
#![allow(clippy::unwrap_used)] // test helpers outside #[test] fns

mod common;

use std::sync::Arc;

use common::{Cluster, Kv};
use nacre_raft::{GroupId, LogStore, MemLogStore, NodeConfig, RaftError, RaftNode};

#[test]
fn raft_5_2_election_elects_exactly_one_leader_per_term() {
    let mut c = Cluster::new(3, &[1], NodeConfig::default());
    let l = c.leader(1);
    let term = c.node(l).term(1);
    for id in c.live() {
        assert_eq!(c.node(id).leader(1), l, "node {id} knows the leader");
        assert_eq!(c.node(id).term(1), term);
    }
}

#[test]
fn raft_5_3_replication_applies_the_same_commands_in_the_same_order_everywhere() {
    let mut c = Cluster::new(3, &[1], NodeConfig::default());
    let l = c.leader(1);
    let ids: Vec<_> = (0..100)
        .map(|i| c.propose(l, 1, &format!("k{}={i}", i % 10)).unwrap())
        .collect();
    c.pump();
    c.heartbeat();
    for (i, pid) in ids.iter().enumerate() {
        let prev = if i < 10 {
            String::new()
        } else {
            (i - 10).to_string()
        };
        assert_eq!(c.results[&(l, *pid)], Ok(prev.into_bytes()), "proposal {i}");
    }
    let want = c.map(l, 1);
    assert_eq!(want.len(), 10);
    for id in c.live() {
        assert_eq!(c.map(id, 1), want, "state machine of node {id}");
        let applied = &c.nodes[&id]
            .as_ref()
            .unwrap()
            .state_machine(1)
            .unwrap()
            .applied;
        assert_eq!(applied.len(), 100);
    }
    // Followers refuse proposals and name the leader.
    let f = c.live().into_iter().find(|&id| id != l).unwrap();
    assert_eq!(
        c.propose(f, 1, "x=1"),
        Err(RaftError::NotLeader {
            group: 1,
            leader: l
        })
    );
}

#[test]
fn raft_5_4_a_committed_entry_survives_leader_crash_and_restart() {
    let mut c = Cluster::new(3, &[1], NodeConfig::default());
    let old = c.leader(1);
    for i in 0..20 {
        c.propose(old, 1, &format!("a{i}=1")).unwrap();
    }
    c.pump();
    assert!(c.results.values().all(Result::is_ok));
    c.crash(old);
    let new = c.leader(1);
    assert_ne!(new, old);
    for i in 0..20 {
        c.propose(new, 1, &format!("b{i}=2")).unwrap();
    }
    c.pump();
    c.start(old);
    c.tick(5);
    let want = c.map(new, 1);
    assert_eq!(want.len(), 40);
    for id in c.live() {
        assert_eq!(c.map(id, 1), want, "node {id} after restart");
    }
}

#[test]
fn raft_5_4_a_minority_cannot_commit_and_its_entries_are_dropped_after_heal() {
    let mut c = Cluster::new(3, &[1], NodeConfig::default());
    let old = c.leader(1);
    c.isolate(old);
    let lost = c.propose(old, 1, "lost=1").unwrap();
    c.pump();
    assert!(!c.results.contains_key(&(old, lost)), "minority committed");
    let new = c.leader(1);
    assert_ne!(new, old);
    let kept = c.propose(new, 1, "kept=1").unwrap();
    c.pump();
    assert_eq!(c.results[&(new, kept)], Ok(Vec::new()));
    c.heal();
    c.tick(30);
    assert_eq!(c.results[&(old, lost)], Err(RaftError::Dropped(1)));
    for id in c.live() {
        let m = c.map(id, 1);
        assert!(
            m.contains_key("kept") && !m.contains_key("lost"),
            "node {id}: {m:?}"
        );
    }
}

#[test]
fn raft_7_a_replica_behind_the_compacted_log_catches_up_by_snapshot() {
    let config = NodeConfig {
        compact_after: 20,
        ..NodeConfig::default()
    };
    let mut c = Cluster::new(3, &[1], config);
    let l = c.leader(1);
    let lagging = c.live().into_iter().find(|&id| id != l).unwrap();
    c.isolate(lagging);
    for i in 0..200 {
        c.propose(l, 1, &format!("k{i}={i}")).unwrap();
        c.pump();
    }
    let first = c.logs[&l].first_index(1).unwrap();
    assert!(
        first > 100,
        "leader log not compacted (first index {first})"
    );
    c.heal();
    c.tick(30);
    assert_eq!(c.map(lagging, 1), c.map(l, 1));
    assert_eq!(c.map(lagging, 1).len(), 200);
}

#[test]
fn many_groups_elect_and_replicate_on_three_nodes() {
    let groups: Vec<GroupId> = (1..=200).collect();
    let mut c = Cluster::new(3, &groups, NodeConfig::default());
    for &g in &groups {
        let l = c.leader(g);
        c.propose(l, g, &format!("g={g}")).unwrap();
    }
    c.pump();
    c.heartbeat();
    for &g in &groups {
        for id in c.live() {
            assert_eq!(
                c.map(id, g).get("g"),
                Some(&g.to_string()),
                "group {g} on {id}"
            );
        }
    }
}

#[test]
fn raft_7_a_restarted_replica_recovers_its_state_from_its_snapshot_and_log() {
    let config = NodeConfig {
        compact_after: 20,
        ..NodeConfig::default()
    };
    let mut c = Cluster::new(3, &[1], config);
    let l = c.leader(1);
    for i in 0..150 {
        c.propose(l, 1, &format!("k{i}={i}")).unwrap();
        c.pump();
    }
    let follower = c.live().into_iter().find(|&id| id != l).unwrap();
    assert!(
        c.logs[&follower].first_index(1).unwrap() > 50,
        "follower log not compacted"
    );
    // Restart every node, one at a time: each must come back with all 150 keys.
    for id in c.live() {
        c.crash(id);
        c.start(id);
        c.tick(20);
        assert_eq!(c.map(id, 1).len(), 150, "node {id} after restart");
    }
    let l = c.leader(1);
    c.propose(l, 1, "after=1").unwrap();
    c.pump();
    c.heartbeat();
    for id in c.live() {
        assert_eq!(c.map(id, 1).len(), 151, "node {id}");
    }
}

#[test]
fn raft_6_membership_change_under_load_adds_and_removes_replicas() {
    use nacre_raft::eraftpb::{ConfChangeSingle, ConfChangeType, ConfChangeV2};
    let change = |t: ConfChangeType, node: u64| {
        let mut cc = ConfChangeV2::default();
        cc.mut_changes().push(ConfChangeSingle {
            change_type: t,
            node_id: node,
            ..Default::default()
        });
        cc
    };
    let mut c = Cluster::new(3, &[1], NodeConfig::default());
    let l = c.leader(1);
    for i in 0..30 {
        c.propose(l, 1, &format!("before{i}=1")).unwrap();
    }
    c.pump();
    // Node 4 joins with no membership of its own: the leader initializes it with a snapshot.
    c.logs.insert(4, Arc::new(MemLogStore::new()));
    let mut n4 = RaftNode::new(4, c.config.clone(), c.logs[&4].clone() as Arc<dyn LogStore>);
    n4.add_group(1, &[], Kv::default()).unwrap();
    c.nodes.insert(4, Some(n4));
    let add = c
        .node(l)
        .propose_conf_change(1, change(ConfChangeType::AddNode, 4))
        .unwrap();
    // Commands keep flowing while the change commits.
    for i in 0..30 {
        c.propose(l, 1, &format!("during{i}=1")).unwrap();
        c.tick(1);
    }
    c.tick(20);
    assert_eq!(c.results[&(l, add)], Ok(Vec::new()));
    assert_eq!(c.map(4, 1), c.map(l, 1), "new replica caught up");
    assert_eq!(c.map(4, 1).len(), 60);

    // Remove a follower that is not the leader; the other three keep committing.
    let gone = c.live().into_iter().find(|&id| id != l && id != 4).unwrap();
    let rm = c
        .node(l)
        .propose_conf_change(1, change(ConfChangeType::RemoveNode, gone))
        .unwrap();
    c.tick(5);
    assert_eq!(c.results[&(l, rm)], Ok(Vec::new()));
    c.crash(gone);
    c.nodes.remove(&gone);
    c.logs.remove(&gone);
    for i in 0..10 {
        c.propose(l, 1, &format!("after{i}=1")).unwrap();
    }
    c.pump();
    c.heartbeat();
    for id in c.live() {
        assert_eq!(c.map(id, 1).len(), 70, "node {id}");
    }
    // With the removed node gone, a majority of the remaining three (2) still elects a leader.
    let old = c.leader(1);
    c.crash(old);
    let new = c.leader(1);
    assert_ne!(new, old);
}

#[test]
fn idle_groups_hibernate_and_wake_on_proposals_and_leader_loss() {
    let groups: Vec<GroupId> = (1..=300).collect();
    let mut c = Cluster::new(3, &groups, NodeConfig::default());
    for &g in &groups {
        c.leader(g);
    }
    // Let every group settle and hibernate, then count what an idle cluster sends.
    c.tick(60);
    for id in c.live() {
        assert_eq!(c.node(id).hibernating(), groups.len(), "node {id}");
    }
    let before = c.messages;
    c.tick(200);
    assert_eq!(c.messages, before, "an idle cluster sent messages");

    // A proposal wakes its group and commits.
    let l = c
        .live()
        .into_iter()
        .find(|&id| c.node(id).is_leader(7))
        .unwrap();
    let pid = c.propose(l, 7, "woke=1").unwrap();
    c.pump();
    assert_eq!(c.results[&(l, pid)], Ok(Vec::new()));

    // Losing the leader's node wakes the followers of its groups, which elect new leaders.
    let led: Vec<GroupId> = groups
        .iter()
        .copied()
        .filter(|&g| c.node(l).is_leader(g))
        .collect();
    assert!(!led.is_empty());
    c.crash(l);
    // Before any tick: the lowest live voter of each group campaigned at once and won.
    c.pump();
    let first = c.live().into_iter().min().unwrap();
    for &g in &led {
        assert!(
            c.node(first).is_leader(g),
            "group {g} waits for an election timeout"
        );
    }
    for &g in &led {
        let nl = c.leader(g);
        assert_ne!(nl, l);
        let pid = c.propose(nl, g, "after=1").unwrap();
        c.pump();
        assert_eq!(c.results[&(nl, pid)], Ok(Vec::new()), "group {g}");
    }
}

#[test]
fn raft_thesis_3_10_leader_transfer_moves_leadership_to_the_chosen_replica() {
    let mut c = Cluster::new(3, &[1], NodeConfig::default());
    let old = c.leader(1);
    c.propose(old, 1, "a=1").unwrap();
    c.pump();
    let to = c.live().into_iter().find(|&id| id != old).unwrap();
    // Every node publishes the leader and term it knows in its read gate (what services check
    // before proposing, without asking the Raft thread), and follows the transfer.
    let gates: Vec<_> = c
        .live()
        .into_iter()
        .map(|id| (id, c.node(id).read_gate(1).unwrap()))
        .collect();
    let term = c.node(old).term(1);
    for (id, g) in &gates {
        assert_eq!(g.leader_term(), (old, term), "node {id}");
    }
    c.node(old).transfer_leader(1, to).unwrap();
    c.tick(5);
    assert_eq!(c.leader(1), to);
    let pid = c.propose(to, 1, "b=2").unwrap();
    c.pump();
    c.heartbeat();
    assert_eq!(c.results[&(to, pid)], Ok(Vec::new()));
    for id in c.live() {
        assert_eq!(c.map(id, 1).len(), 2, "node {id}");
    }
    let new_term = c.node(to).term(1);
    assert!(new_term > term);
    for (id, g) in &gates {
        assert_eq!(g.leader_term(), (to, new_term), "node {id}");
    }
    // Only a leader can hand leadership over.
    assert!(matches!(
        c.node(old).transfer_leader(1, old),
        Err(RaftError::NotLeader { .. })
    ));
}

/// Three nodes with a 300 ms read lease, group 1's leader and one write ("k=1") applied.
fn leased_cluster() -> (Cluster, u64, std::time::Duration) {
    let lease = std::time::Duration::from_millis(300);
    let config = NodeConfig {
        read_lease: lease,
        ..NodeConfig::default()
    };
    let mut c = Cluster::new(3, &[1], config);
    let l = c.leader(1);
    let p = c.propose(l, 1, "k=1").unwrap();
    c.pump();
    assert!(c.results.contains_key(&(l, p)));
    (c, l, lease)
}

/// The read lease: a confirmed ReadIndex round lets the leader answer reads without messages until
/// the lease (measured from the round's send time) runs out; then a new round is needed. Time is
/// passed in, so the test is exact.
#[test]
fn read_lease_answers_locally_until_it_expires_and_never_outlives_leadership() {
    use std::time::Instant;
    let (mut c, l, lease) = leased_cluster();

    let t0 = Instant::now();
    // No lease yet: a ReadIndex round (messages to the followers).
    let before = c.messages;
    let r1 = c.node(l).read(1, t0).unwrap();
    c.pump();
    assert!(c.messages > before, "the first read needs a quorum round");
    assert_eq!(c.read_values[&(l, r1)]["k"], "1");

    // Within the lease: answered with no message at all, and it sees every committed write.
    let p2 = c.propose(l, 1, "k=2").unwrap();
    c.pump();
    assert!(c.results.contains_key(&(l, p2)));
    let before = c.messages;
    let r2 = c.node(l).read(1, t0 + lease / 2).unwrap();
    c.pump();
    assert_eq!(c.messages, before, "a read inside the lease sends nothing");
    assert_eq!(c.read_values[&(l, r2)]["k"], "2");

    // Past the lease: a new round.
    let before = c.messages;
    let r3 = c.node(l).read(1, t0 + lease * 2).unwrap();
    c.pump();
    assert!(c.messages > before);
    assert!(c.read_values.contains_key(&(l, r3)));

    // The leader is cut off and replaced. Even "inside" its last lease by its own clock, a read on
    // the old leader is never answered with stale data once a new term exists there; and while
    // it still believes it leads, only a confirmed round (impossible now) could answer it.
    c.isolate(l);
    let others: Vec<u64> = c.live().into_iter().filter(|&n| n != l).collect();
    let new = c.leader(1);
    assert!(others.contains(&new));
    let p3 = c.propose(new, 1, "k=3").unwrap();
    c.pump();
    assert!(c.results.contains_key(&(new, p3)));
    let late = t0 + lease * 3;
    match c.node(l).read(1, late) {
        Ok(r) => {
            c.pump();
            assert!(
                !c.read_values.contains_key(&(l, r)),
                "an isolated old leader answered a read"
            );
        }
        Err(RaftError::NotLeader { .. }) => {}
        Err(e) => panic!("unexpected {e}"),
    }
}

/// The read gate (reads off the Raft thread) opens with the lease on the leader only, shuts when
/// the lease runs out, and shuts at once when the leader starts handing leadership over, before the
/// transferee can campaign; the new leader's opens only with a lease of its own.
#[test]
fn the_read_gate_follows_the_lease_and_shuts_on_a_leader_transfer() {
    use std::time::Instant;
    let (mut c, l, lease) = leased_cluster();
    let t0 = Instant::now();
    let gate = c.node(l).read_gate(1).unwrap();
    assert!(!gate.open_at(t0), "open before any lease");

    let r = c.node(l).read(1, t0).unwrap();
    c.pump();
    assert!(c.read_values.contains_key(&(l, r)));
    assert!(gate.open_at(t0 + lease / 2));
    assert!(!gate.open_at(t0 + lease), "open past the lease");
    let followers: Vec<u64> = c.live().into_iter().filter(|&n| n != l).collect();
    for &f in &followers {
        assert!(!c.node(f).read_gate(1).unwrap().open_at(t0 + lease / 2));
    }

    let to = followers[0];
    c.node(l).transfer_leader(1, to).unwrap();
    assert!(
        !gate.open_at(t0 + lease / 2),
        "still open once a transfer began"
    );
    c.pump();
    assert_eq!(c.leader(1), to);
    assert!(!gate.open_at(t0 + lease / 2));
    let new_gate = c.node(to).read_gate(1).unwrap();
    let t1 = Instant::now();
    assert!(!new_gate.open_at(t1), "the new leader has no lease yet");
    let r = c.node(to).read(1, t1).unwrap();
    c.pump();
    assert_eq!(c.read_values[&(to, r)]["k"], "1");
    assert!(new_gate.open_at(t1 + lease / 2));

    // A group no longer hosted keeps no open gate.
    c.node(to).remove_group(1).unwrap();
    assert!(!new_gate.open_at(t1 + lease / 2));
}

/// raft-rs drops a ReadIndex request on a leader that has not committed an entry of its own term
/// yet (Raft §6.4: it does not know the commit index yet). The store defers such reads and issues
/// them once that entry commits, instead of leaving the caller to time out.
#[test]
fn raft_6_4_a_read_on_a_new_leader_is_answered_once_its_first_entry_commits() {
    use raft::eraftpb::MessageType;
    let mut c = Cluster::new(3, &[1], NodeConfig::default());
    let old = c.leader(1);
    let p = c.propose(old, 1, "k=1").unwrap();
    c.pump();
    assert!(c.results.contains_key(&(old, p)));

    // Depose the leader; elect another but hold back the append responses that would let it
    // commit its first entry.
    c.isolate(old);
    let others: Vec<u64> = c.live().into_iter().filter(|&n| n != old).collect();
    let mut held = Vec::new();
    let mut new = None;
    'elect: for _ in 0..500 {
        for &id in &others {
            c.node(id).tick();
        }
        for _ in 0..100 {
            let mut moved = false;
            for &id in &others {
                let out = c.node(id).process_ready().unwrap();
                for (g, m) in out.messages {
                    if m.to == old {
                        continue;
                    }
                    moved = true;
                    if m.get_msg_type() == MessageType::MsgAppendResponse {
                        held.push((g, m));
                    } else {
                        let to = m.to;
                        let _ = c.node(to).step(g, m);
                    }
                }
            }
            if let Some(&l) = others.iter().find(|&&id| c.node(id).is_leader(1)) {
                new = Some(l);
                break 'elect;
            }
            if !moved {
                break;
            }
        }
    }
    let new = new.expect("no new leader");
    let r = c.node(new).read_index(1).unwrap();
    for (g, m) in held {
        let to = m.to;
        let _ = c.node(to).step(g, m);
    }
    c.pump();
    assert_eq!(c.read_values[&(new, r)]["k"], "1");
}

/// Runs one Ready round on `id` and delivers every message it sends; returns the outcomes of
/// proposals it reported.
fn round_and_deliver(c: &mut Cluster, id: u64) -> Vec<nacre_raft::ProposalId> {
    let out = c.node(id).process_ready().unwrap();
    for (g, m) in out.messages {
        let to = m.to;
        c.node(to).step(g, m).unwrap();
    }
    out.finished.into_iter().map(|(pid, _)| pid).collect()
}

#[test]
fn a_committed_outcome_is_handed_out_before_the_write_of_newer_entries() {
    let mut c = Cluster::new(3, &[1], NodeConfig::default());
    let l = c.leader(1);
    c.pump();
    let followers: Vec<u64> = c.live().into_iter().filter(|&id| id != l).collect();
    let a = c.propose(l, 1, "a=1").unwrap();
    // The leader writes `a` and sends it; the followers write it and acknowledge.
    assert!(round_and_deliver(&mut c, l).is_empty());
    for &f in &followers {
        round_and_deliver(&mut c, f);
    }
    // `a` is committed now. The next round applies it and also writes a newer entry, `b`.
    let b = c.propose(l, 1, "b=2").unwrap();
    let log = c.logs[&l].clone();
    let written_before = log.last_index(1).unwrap();
    let (mut early, mut sent) = (Vec::new(), Vec::new());
    let out = c
        .node(l)
        .process_ready_with(|e| {
            // Handed out before the write: `b` is not in the log yet.
            assert_eq!(log.last_index(1).unwrap(), written_before);
            early.extend(e.finished);
            sent.extend(e.messages);
        })
        .unwrap();
    assert_eq!(
        early,
        vec![(a, Ok(Vec::new()))],
        "a's outcome, before the write"
    );
    assert!(out.finished.is_empty(), "{:?}", out.finished);
    assert_eq!(log.last_index(1).unwrap(), written_before + 1, "b written");
    // `b` commits as usual.
    for (g, m) in sent.into_iter().chain(out.messages) {
        let to = m.to;
        c.node(to).step(g, m).unwrap();
    }
    c.pump();
    c.heartbeat();
    assert_eq!(c.results[&(l, b)], Ok(Vec::new()));
    for id in c.live() {
        assert_eq!(c.map(id, 1).get("b").map(String::as_str), Some("2"));
    }
}

/// `skip_bcast_commit`: a commit reaches the followers with the leader's next heartbeat (or append),
/// not with a message of its own; without it, they apply as soon as the leader commits.
#[test]
fn followers_learn_a_commit_with_the_next_heartbeat_unless_it_is_broadcast() {
    for skip in [true, false] {
        let config = NodeConfig {
            skip_bcast_commit: skip,
            ..NodeConfig::default()
        };
        let heartbeat = config.heartbeat_tick;
        let mut c = Cluster::new(3, &[1], config);
        let leader = c.leader(1);
        c.propose(leader, 1, "a=1").unwrap();
        c.pump();
        assert_eq!(c.map(leader, 1).get("a").map(String::as_str), Some("1"));
        let followers: Vec<u64> = c.voters().into_iter().filter(|&id| id != leader).collect();
        for &f in &followers {
            assert_eq!(
                c.map(f, 1).contains_key("a"),
                !skip,
                "follower {f}, skip {skip}"
            );
        }
        c.tick(heartbeat);
        for &f in &followers {
            assert_eq!(c.map(f, 1).get("a").map(String::as_str), Some("1"));
        }
    }
}
