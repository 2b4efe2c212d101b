//! A data partition after a replica's restart, and packets of a deposed leader (docs/ARCHITECTURE.md,
//! "Writable again after a restart: what the protocol requires" and "Deposed leaders"): three
//! `DataNode`s in one process over the in-memory network, as in `replication.rs` (see `common`).
//!
//! - a follower back from a crash, short of an extent's bytes: the partition takes new extents
//!   within a bound of its return, before the follower has repaired anything; the extent it is
//!   short of takes no appends; the follower repairs it in the background.
//! - a follower refuses a packet sent under an older Raft term than it knows (`StaleTerm`).
//!
//! Scenarios run one at a time ([`common::SERIAL`]); every wait has a deadline.
#![allow(clippy::unwrap_used)]

mod common;

use std::time::Duration;

use bytes::Bytes;
use common::*;
use nacre_api::data::{DataError, Replicate, ReplicateRequest};
use nacre_msgr::Payload;
use nacre_types::ExtentId;
use tokio::time::Instant;

/// How soon after a restarted replica hosts its partition again the partition must take a new
/// extent's append (the cluster-wide aim is 2 s after the node reports to the master; here the
/// leader's re-check runs every 200 ms).
const WRITABLE_WITHIN: Duration = Duration::from_secs(2);

/// Appends `n` packets of `len` deterministic bytes (seeded from `seed`) to `e`, one after the
/// other, extending `model`.
async fn fill(api: &Api, e: ExtentId, model: &mut Vec<u8>, seed: u64, n: usize, len: usize) {
    for k in 0..n {
        let data = pattern(seed + k as u64, len);
        let w = api
            .append(e, model.len() as u64, &data)
            .await
            .unwrap()
            .unwrap();
        model.extend_from_slice(&data);
        assert_eq!(w.committed, model.len() as u64);
    }
}

fn truncate(file: &std::path::Path, len: u64) {
    std::fs::OpenOptions::new()
        .write(true)
        .open(file)
        .unwrap()
        .set_len(len)
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_follower_short_of_bytes_blocks_only_its_extent_while_it_repairs() {
    let _serial = SERIAL.lock().await;
    let mut c = Cluster::start(31).await;
    let api = c.api.clone();
    let l = api.leader().await;
    let f = (l + 1) % 3;
    let e = api.create().await.unwrap().unwrap();
    let mut model = Vec::new();
    fill(&api, e, &mut model, 10, 3, 9000).await;
    c.wait_replica(f, e, &model, true).await;

    // The follower crashes; the next packet cannot reach it and the partition turns read-only.
    c.crash(f).await;
    match api
        .append(e, model.len() as u64, &pattern(20, 5000))
        .await
        .unwrap()
    {
        Err(DataError::ReadOnly(_)) => {}
        other => panic!("expected ReadOnly, got {other:?}"),
    }
    // Its copy of the extent lost its end in the crash too: it lacks committed bytes.
    truncate(&c.data_file(f, e), u64::from(BS));

    // Back: the partition takes a new extent's appends within the bound, whatever the
    // follower has repaired by then.
    c.restart(f).await;
    let back = Instant::now();
    let fresh = pattern(30, 6000);
    let e2 = eventually("a new extent to take an append", || async {
        let e2 = api.create().await.ok()?.ok()?;
        api.append(e2, 0, &fresh).await.ok()?.ok()?;
        Some(e2)
    })
    .await;
    let took = back.elapsed();
    assert!(
        took <= WRITABLE_WITHIN,
        "the partition took {took:?} to take appends after the follower returned"
    );

    // The extent the follower is short of takes no appends (the client moves on).
    match api
        .append(e, model.len() as u64, &pattern(21, 4000))
        .await
        .unwrap()
    {
        Err(DataError::ReadOnly(why)) => assert!(why.contains("lags"), "{why}"),
        other => panic!("expected ReadOnly, got {other:?}"),
    }
    // In the background the follower repairs every committed byte of it (whole blocks: the
    // last may carry bytes past the committed length, which are never served), and every
    // replica holds the new extent.
    c.wait_replica(f, e, &model, false).await;
    for i in 0..3 {
        c.wait_replica(i, e2, &fresh, true).await;
    }
    assert_eq!(api.read_all(e, 0, model.len() as u64).await, model);
    c.shutdown().await;
}

/// Raft §5.1 for primary-backup packets: once a new leader is elected, a follower refuses a
/// packet sent under the old term (what a deposed leader that has not heard of the election
/// sends).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_follower_refuses_a_packet_of_an_older_term() {
    let _serial = SERIAL.lock().await;
    let mut c = Cluster::start(32).await;
    let api = c.api.clone();
    let l = api.leader().await;
    let e = api.create().await.unwrap().unwrap();
    let mut model = Vec::new();
    fill(&api, e, &mut model, 40, 2, 4096).await;

    // A new leader in a newer term.
    c.crash(l).await;
    let l2 = api.leader().await;
    let g = (0..3).find(|&i| i != l && i != l2).unwrap();
    let stale = ReplicateRequest {
        partition: PID,
        extent: e,
        offset: model.len() as u64,
        committed: model.len() as u64,
        sync: true,
        // The first leader's term at most: the new one's is newer.
        term: 1,
    };
    let (r, _) = api
        .client
        .call::<Replicate>(
            &api.addrs[g],
            &stale,
            Payload::new(Bytes::from(pattern(41, 4096))),
        )
        .await
        .unwrap();
    match r {
        Err(DataError::StaleTerm { sent: 1, current }) => assert!(current > 1),
        other => panic!("expected StaleTerm, got {other:?}"),
    }
    // Nothing was written.
    assert_eq!(api.local_len(g, e).await, model.len() as u64);
    c.shutdown().await;
}
