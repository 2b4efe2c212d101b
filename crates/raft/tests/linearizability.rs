//! A replicated register under faults is linearizable: clients write unique values and read through
//! ReadIndex while nodes are isolated, crashed and restarted; the recorded history (invocation and
//! response times, values) is checked against a sequential register by exhaustive search
//! (Wing & Gong), in many seeded runs.
#![allow(clippy::unwrap_used)] // test helpers outside #[test] fns

mod common;

use std::collections::{BTreeMap, HashSet};

use common::Cluster;
use nacre_raft::{NodeConfig, ProposalId};

#[derive(Clone, Debug)]
enum Kind {
    Write(u64),
    /// The value read (0: never written).
    Read(u64),
}

#[derive(Clone, Debug)]
struct Op {
    kind: Kind,
    invoked: u64,
    /// `None`: no answer (the proposer crashed or lost leadership); the op may or may not have
    /// taken effect.
    returned: Option<u64>,
}

/// Whether some order of the ops, respecting real time, is a valid history of a register.
fn linearizable(ops: &[Op]) -> bool {
    fn search(
        ops: &[Op],
        done: &mut Vec<bool>,
        value: u64,
        memo: &mut HashSet<(Vec<bool>, u64)>,
    ) -> bool {
        // Finished when every op that returned is placed (unanswered ops are optional).
        if ops
            .iter()
            .zip(done.iter())
            .all(|(o, d)| *d || o.returned.is_none())
        {
            return true;
        }
        if !memo.insert((done.clone(), value)) {
            return false;
        }
        // An op can go next only if no pending op returned before it was invoked.
        let horizon = ops
            .iter()
            .zip(done.iter())
            .filter(|(_, d)| !**d)
            .filter_map(|(o, _)| o.returned)
            .min()
            .unwrap_or(u64::MAX);
        for i in 0..ops.len() {
            if done[i] || ops[i].invoked > horizon {
                continue;
            }
            let next = match ops[i].kind {
                Kind::Write(v) => Some(v),
                Kind::Read(v) if v == value => Some(value),
                Kind::Read(_) => None,
            };
            if let Some(next) = next {
                done[i] = true;
                if search(ops, done, next, memo) {
                    return true;
                }
                done[i] = false;
            }
        }
        false
    }
    search(ops, &mut vec![false; ops.len()], 0, &mut HashSet::new())
}

#[test]
fn the_checker_rejects_a_stale_read() {
    let w = |v, a, b| Op {
        kind: Kind::Write(v),
        invoked: a,
        returned: Some(b),
    };
    let r = |v, a, b| Op {
        kind: Kind::Read(v),
        invoked: a,
        returned: Some(b),
    };
    assert!(linearizable(&[
        w(1, 0, 1),
        r(1, 2, 3),
        w(2, 4, 5),
        r(2, 6, 7)
    ]));
    // Reading 1 after the write of 2 completed is stale.
    assert!(!linearizable(&[w(1, 0, 1), w(2, 2, 3), r(1, 4, 5)]));
    // Overlapping ops may be ordered either way.
    assert!(linearizable(&[w(1, 0, 5), r(1, 1, 2), r(0, 1, 3)]));
    // An unanswered write may have happened.
    assert!(linearizable(&[
        Op {
            kind: Kind::Write(9),
            invoked: 0,
            returned: None
        },
        r(9, 3, 4)
    ]));
}

/// One seeded run. With `read_index == false`, reads are served at once from the state machine of a
/// random live node (possibly isolated or behind): the unsafe shortcut the checker must catch.
fn run(seed: u64, read_index: bool) -> Vec<Op> {
    run_with(seed, read_index, std::time::Duration::ZERO, false)
}

/// [`run`] with nacre's own read lease (`read_lease`); the cluster's clock advances 100 ms per tick.
/// With `direct`, every other read first tries a random live node's [`ReadGate`]: if it is open, the
/// node's state machine is read at once, as a meta node's messenger thread does.
fn run_with(seed: u64, read_index: bool, read_lease: std::time::Duration, direct: bool) -> Vec<Op> {
    // Deterministic per seed.
    let mut rng = fastrand::Rng::with_seed(seed);
    let config = NodeConfig {
        read_lease,
        ..NodeConfig::default()
    };
    let base = std::time::Instant::now();
    let mut c = Cluster::new(3, &[1], config);
    c.leader(1);
    let mut pending: BTreeMap<(u64, ProposalId), Op> = BTreeMap::new();
    let mut history = Vec::new();
    let mut next_value = 1;
    let mut direct_reads = 0;
    for ticks in 0..60u32 {
        match rng.u64(..10) {
            // Faults: isolate or crash a node, or heal everything and restart the dead.
            0 => {
                let n = 1 + rng.u64(..3);
                c.isolate(n);
            }
            1 => {
                let n = 1 + rng.u64(..3);
                if c.live().len() == 3 {
                    c.crash(n);
                    // Its clients never hear back: writes may or may not have taken effect.
                    let lost: Vec<_> = pending.keys().filter(|k| k.0 == n).copied().collect();
                    for key in lost {
                        let op = pending.remove(&key).unwrap();
                        if matches!(op.kind, Kind::Write(_)) {
                            history.push(op);
                        }
                    }
                }
            }
            2 => {
                c.heal();
                for n in 1..=3 {
                    if c.nodes[&n].is_none() {
                        c.start(n);
                    }
                }
            }
            k if k >= 7 && !read_index => {
                let live = c.live();
                let n = live[rng.usize(..live.len())];
                let v = c.map(n, 1).get("x").map_or(0, |s| s.parse().unwrap());
                history.push(Op {
                    kind: Kind::Read(v),
                    invoked: c.step,
                    returned: Some(c.step),
                });
            }
            k if k >= 7 && direct && rng.u64(..2) == 0 => {
                let live = c.live();
                let n = live[rng.usize(..live.len())];
                let now = base + std::time::Duration::from_millis(100) * ticks;
                let open = c.node(n).read_gate(1).is_some_and(|g| g.open_at(now));
                if open {
                    let v = c.map(n, 1).get("x").map_or(0, |s| s.parse().unwrap());
                    history.push(Op {
                        kind: Kind::Read(v),
                        invoked: c.step,
                        returned: Some(c.step),
                    });
                    direct_reads += 1;
                }
            }
            // Client operations go to whichever node believes it leads.
            k => {
                let leaders: Vec<u64> = c
                    .live()
                    .into_iter()
                    .filter(|&n| c.node(n).is_leader(1))
                    .collect();
                if let Some(&l) = leaders.get(rng.usize(..leaders.len().max(1))) {
                    let invoked = c.step;
                    if k < 7 {
                        let v = next_value;
                        next_value += 1;
                        if let Ok(pid) = c.propose(l, 1, &format!("x={v}")) {
                            let op = Op {
                                kind: Kind::Write(v),
                                invoked,
                                returned: None,
                            };
                            pending.insert((l, pid), op);
                        }
                    } else if let Ok(rid) = c
                        .node(l)
                        .read(1, base + std::time::Duration::from_millis(100) * ticks)
                    {
                        pending.insert(
                            (l, rid),
                            Op {
                                kind: Kind::Read(0),
                                invoked,
                                returned: None,
                            },
                        );
                    }
                }
            }
        }
        c.tick(1);
        // Collect answers.
        let keys: Vec<_> = pending.keys().copied().collect();
        for key in keys {
            if let Some(map) = c.read_values.get(&key) {
                let mut op = pending.remove(&key).unwrap();
                let v = map.get("x").map_or(0, |s| s.parse().unwrap());
                op.kind = Kind::Read(v);
                op.returned = Some(c.finished_at[&key]);
                history.push(op);
            } else if let Some(r) = c.results.get(&key) {
                let mut op = pending.remove(&key).unwrap();
                if r.is_ok() {
                    op.returned = Some(c.finished_at[&key]);
                    history.push(op);
                }
                // A dropped write never took effect: it is not part of the history.
            }
        }
    }
    if direct {
        DIRECT_READS.fetch_add(direct_reads, std::sync::atomic::Ordering::Relaxed);
    }
    // Unanswered writes may or may not have taken effect; unanswered reads observed nothing.
    history.extend(
        pending
            .into_values()
            .filter(|op| matches!(op.kind, Kind::Write(_))),
    );
    history
}

#[test]
fn a_register_stays_linearizable_under_partitions_and_crashes() {
    let mut reads = 0;
    let mut writes = 0;
    for seed in 0..40 {
        let history = run(seed, true);
        reads += history
            .iter()
            .filter(|o| matches!(o.kind, Kind::Read(_)))
            .count();
        writes += history
            .iter()
            .filter(|o| matches!(o.kind, Kind::Write(_)))
            .count();
        assert!(linearizable(&history), "seed {seed}: {history:#?}");
    }
    // The runs must have exercised both kinds of operation.
    assert!(reads > 50 && writes > 50, "reads {reads}, writes {writes}");
}

#[test]
fn the_check_catches_stale_reads_served_without_read_index() {
    let violations = (0..40)
        .filter(|&seed| !linearizable(&run(seed, false)))
        .count();
    assert!(
        violations > 0,
        "no run read a stale value: the harness cannot detect stale reads"
    );
}

/// nacre's read lease (a third of the election timeout, counted from a confirmed round's send
/// time) under the same faults: crashes, isolations and elections.
#[test]
fn read_leases_stay_linearizable_under_faults() {
    for seed in 200..240 {
        let history = run_with(seed, true, std::time::Duration::from_millis(333), false);
        assert!(linearizable(&history), "seed {seed}: {history:#?}");
    }
}

/// Reads served off the Raft thread while a leader's [`ReadGate`] is open (as a meta node's
/// messenger threads serve lookups) under the same faults: never stale.
static DIRECT_READS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

#[test]
fn reads_through_an_open_read_gate_stay_linearizable_under_faults() {
    let direct = || DIRECT_READS.load(std::sync::atomic::Ordering::Relaxed);
    // At least 60 runs, and more (at most 300) until the gates opened often enough for the check
    // to mean something: how often they open varies with raft-rs's random election timeouts.
    let mut seed = 300;
    while seed < 360 || (direct() <= 30 && seed < 600) {
        let history = run_with(seed, true, std::time::Duration::from_millis(333), true);
        assert!(linearizable(&history), "seed {seed}: {history:#?}");
        seed += 1;
    }
    assert!(
        direct() > 30,
        "only {} reads through an open gate in {} runs",
        direct(),
        seed - 300
    );
}
