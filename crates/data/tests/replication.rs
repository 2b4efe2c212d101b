//! Scenario tests of the data node's replication (docs/design.md §7, `nacre_data::service`): three
//! `DataNode`s in one process over the in-memory network host one data partition (no master: ids
//! and the spec come from the test, see `common`); the test talks to them with plain messenger
//! calls, following `NotLeader` hints, and stops, restarts, cuts off and damages replicas.
//!
//! - round trip: appends (also pipelined out of order), tiny writes, overwrites, Raft appends and
//!   reads; nothing past the committed length is served; every replica ends with the same bytes.
//! - a stopped follower: appends turn the partition read-only, overwrites (Raft majority) go on;
//!   back, the partition takes appends again and the follower repairs every byte.
//! - a follower that lost its tail: recovery trims it, repair pulls the rest (also while the
//!   partition takes appends: a packet of the extent waits for those bytes, or the extent takes
//!   no appends until the follower holds it).
//! - a flipped bit on the leader: the read repairs the block from a follower.
//! - a leader crash in the middle of pipelined appends, and a new leader whose own copy has an
//!   unacknowledged tail: nothing acknowledged is lost, appends go on at the committed offset.
//! - unsynced appends: acknowledged but neither committed nor served until a later synced packet;
//!   a follower that lost them fails that packet.
//! - releases: deleted extents are gone on every replica, punched tiny ranges read as zeros.
//! - a replica whose extent store failed an IO (injected through its disk): the duty round reopens
//!   it (a leader first hands leadership over), repair compares every extent with the leader's and
//!   fills in what it lacks (a cut tail, an overwrite it could not apply), and the partition takes
//!   appends again.
//!
//! Scenarios run one at a time ([`common::SERIAL`]); every wait has a deadline.
#![allow(clippy::unwrap_used)]

mod common;

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use common::*;
use nacre_api::data::DataError;
use nacre_api::data::{Read, ReadRequest};
use nacre_cluster::PartitionHost as _;
use nacre_data::io::{Disk, FaultPlan, FaultyDisk};
use nacre_data::service::WrapDisk;
use nacre_data::{DataMetrics, DataNodeConfig};
use nacre_types::ExtentId;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn appends_tiny_writes_overwrites_and_reads_round_trip() {
    let _serial = SERIAL.lock().await;
    let c = Cluster::start(1).await;
    let api = &c.api;
    let e = api.create().await.unwrap().unwrap();
    let mut model: Vec<u8> = Vec::new();

    // Sequential appends: partial blocks, exact blocks, a full packet, a few bytes.
    for (i, len) in [1000usize, 4096, 5000, 128 << 10, 3]
        .into_iter()
        .enumerate()
    {
        let data = pattern(i as u64, len);
        let w = api
            .append(e, model.len() as u64, &data)
            .await
            .unwrap()
            .unwrap();
        assert_eq!(w.extent, e);
        assert_eq!(w.offset, model.len() as u64);
        model.extend_from_slice(&data);
        assert_eq!(w.committed, model.len() as u64);
    }
    assert_eq!(api.read_all(e, 0, model.len() as u64).await, model);
    let b = api.read(e, 900, 9000).await.unwrap().unwrap();
    assert_eq!(&b[..], &model[900..9900]);

    // Pipelined appends out of order: packet k+1 is sent before packet k; the leader applies them
    // in offset order.
    for round in 0..4u64 {
        let at = model.len() as u64;
        let (dk, dk1) = (pattern(100 + round, 7000), pattern(200 + round, 9000));
        let (r1, r0) = tokio::join!(api.append(e, at + 7000, &dk1), api.append(e, at, &dk));
        let (w0, w1) = (r0.unwrap().unwrap(), r1.unwrap().unwrap());
        assert_eq!((w0.offset, w1.offset), (at, at + 7000));
        assert_eq!(w1.committed, at + 16_000, "k+1 commits after k");
        model.extend_from_slice(&dk);
        model.extend_from_slice(&dk1);
    }
    // Eight packets in flight at once, sent in reverse order.
    let at = model.len() as u64;
    let packets: Vec<Vec<u8>> = (0..8)
        .map(|k| pattern(300 + k, 3000 + k as usize))
        .collect();
    let mut offsets = Vec::new();
    let mut off = at;
    for p in &packets {
        offsets.push(off);
        off += p.len() as u64;
    }
    let mut tasks = Vec::new();
    for k in (0..8).rev() {
        let (api, data, offset) = (api.clone(), packets[k].clone(), offsets[k]);
        tasks.push(tokio::spawn(
            async move { api.append(e, offset, &data).await },
        ));
    }
    for t in tasks {
        let w = t.await.unwrap().unwrap().unwrap();
        assert!(w.committed >= w.offset);
    }
    for p in &packets {
        model.extend_from_slice(p);
    }
    assert_eq!(api.committed(e).await, model.len() as u64);
    assert_eq!(api.read_all(e, 0, model.len() as u64).await, model);

    // A read past the committed length is refused, even by one byte.
    let len = model.len() as u64;
    match api.read(e, len - 10, 11).await.unwrap() {
        Err(DataError::OutOfRange {
            extent, committed, ..
        }) => assert_eq!((extent, committed), (e, len)),
        other => panic!("expected OutOfRange, got {other:?}"),
    }
    // An append that is not at the end is refused.
    match api.append(e, len - 1, b"x").await.unwrap() {
        Err(DataError::OutOfRange { .. }) => {}
        other => panic!("expected OutOfRange, got {other:?}"),
    }

    // Overwrites (through Raft) inside the committed bytes, across block boundaries.
    let ow = pattern(400, 10_000);
    api.overwrite(e, 3000, &ow).await.unwrap().unwrap();
    model[3000..13_000].copy_from_slice(&ow);
    api.overwrite(e, len - 5, b"tail!").await.unwrap().unwrap();
    model[len as usize - 5..].copy_from_slice(b"tail!");
    match api.overwrite(e, len - 2, b"past").await.unwrap() {
        Err(DataError::OutOfRange { .. }) => {}
        other => panic!("an overwrite past the end must fail: {other:?}"),
    }
    assert_eq!(api.read_all(e, 0, len).await, model);

    // The Raft path for appends works too.
    let dr = pattern(500, 6000);
    let w = api.append_raft(e, len, &dr).await.unwrap().unwrap();
    assert_eq!((w.offset, w.committed), (len, len + 6000));
    model.extend_from_slice(&dr);

    // Tiny writes land on 4 KiB boundaries of tiny extents and read back.
    let t1 = pattern(600, 3000);
    let t2 = pattern(601, 5000);
    let w1 = api.write_tiny(&t1).await.unwrap().unwrap();
    let w2 = api.write_tiny(&t2).await.unwrap().unwrap();
    for (w, t) in [(w1, &t1), (w2, &t2)] {
        assert!((1..=16).contains(&w.extent.0), "{w:?}");
        assert_eq!(w.offset % 4096, 0);
        assert!(w.committed >= w.offset + t.len() as u64);
        let b = api
            .read(w.extent, w.offset, t.len() as u32)
            .await
            .unwrap()
            .unwrap();
        assert_eq!(&b[..], &t[..]);
    }

    // Every replica ends up with the same bytes (followers apply overwrites from the Raft log).
    assert_eq!(api.read_all(e, 0, model.len() as u64).await, model);
    for i in 0..3 {
        c.wait_replica(i, e, &model, true).await;
    }
    let crcs = api.block_crcs(0, e).await.unwrap().unwrap();
    for i in 1..3 {
        assert_eq!(api.block_crcs(i, e).await.unwrap().unwrap(), crcs);
    }
    c.shutdown().await;
}

/// Appends `n` packets of `len` bytes to `e` from its current end (`model`), all acknowledged.
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_follower_makes_the_partition_read_only_until_it_is_repaired() {
    let _serial = SERIAL.lock().await;
    let mut c = Cluster::start(2).await;
    let api = c.api.clone();
    let l = api.leader().await;
    let f = (l + 1) % 3;
    let e = api.create().await.unwrap().unwrap();
    let mut model = Vec::new();
    fill(&api, e, &mut model, 10, 3, 10_000).await;

    c.crash(f).await;
    // The next append cannot reach every replica: refused, and the partition turns read-only.
    let lost = pattern(20, 8000);
    match api.append(e, model.len() as u64, &lost).await.unwrap() {
        Err(DataError::ReadOnly(_)) => {}
        other => panic!("expected ReadOnly, got {other:?}"),
    }
    assert_eq!(api.leader().await, l);
    match api.create().await.unwrap() {
        Err(DataError::ReadOnly(_)) => {}
        other => panic!("a read-only partition creates no extent: {other:?}"),
    }
    match api.write_tiny(b"small").await.unwrap() {
        Err(DataError::ReadOnly(_)) => {}
        other => panic!("a read-only partition takes no tiny write: {other:?}"),
    }
    // Overwrites go through Raft: a majority suffices.
    let ow = pattern(21, 6000);
    api.overwrite(e, 2000, &ow).await.unwrap().unwrap();
    model[2000..8000].copy_from_slice(&ow);
    // Nothing past the committed length is served.
    assert_eq!(api.committed(e).await, model.len() as u64);
    assert_eq!(api.read_all(e, 0, model.len() as u64).await, model);

    // The follower comes back; it catches up (the overwrite from the Raft log) and the leader,
    // re-checking, takes appends again.
    c.restart(f).await;
    c.wait_writable(l).await;
    // The client moves the rest of its stream to a new extent.
    let e2 = api.create().await.unwrap().unwrap();
    let mut model2 = Vec::new();
    fill(&api, e2, &mut model2, 30, 3, 9000).await;
    let w = api.write_tiny(b"small").await.unwrap().unwrap();

    // The restarted follower holds every committed byte (and the unacknowledged packet never
    // reached it).
    c.wait_replica(f, e, &model, true).await;
    c.wait_replica(f, e2, &model2, true).await;
    assert_eq!(api.local_len(f, w.extent).await, w.committed);
    for i in 0..3 {
        c.wait_replica(i, e2, &model2, true).await;
    }
    assert_eq!(api.read_all(e, 0, model.len() as u64).await, model);
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_follower_that_lost_its_tail_is_trimmed_and_repaired() {
    let _serial = SERIAL.lock().await;
    // A follower waits up to half of this for the bytes before a packet: long enough for a repair
    // on a loaded machine.
    let mut c = Cluster::start_with(3, |cfg| {
        cfg.replicate_timeout = std::time::Duration::from_secs(4);
    })
    .await;
    let api = c.api.clone();
    let l = api.leader().await;
    let f = (l + 2) % 3;
    let e = api.create().await.unwrap().unwrap();
    let mut model = Vec::new();
    fill(&api, e, &mut model, 40, 5, 9000).await; // 45 000 bytes: 10 full blocks and a partial one
    c.wait_replica(f, e, &model, true).await;

    // The follower crashes and its last writes did not reach the disk: its data file is short.
    c.crash(f).await;
    let file = c.data_file(f, e);
    truncate(&file, 10_000);
    // It restarts cut off from the leader (so it cannot repair yet): recovery trimmed the extent
    // to its last whole verified block.
    let (fh, lh) = (Cluster::host(f), Cluster::host(l));
    c.net.heal_host(&fh);
    c.net.partition(&fh, &lh);
    c.revive(f).await;
    assert_eq!(api.local_len(f, e).await, 2 * u64::from(BS));
    assert_eq!(std::fs::metadata(&file).unwrap().len(), 2 * u64::from(BS));
    // The leader cannot replicate to it: read-only.
    match api
        .append(e, model.len() as u64, &pattern(50, 4000))
        .await
        .unwrap()
    {
        Err(DataError::ReadOnly(_)) => {}
        other => panic!("expected ReadOnly, got {other:?}"),
    }
    // Reconnected, the follower pulls the missing blocks from the leader and the partition
    // returns to read-write.
    c.net.heal(&fh, &lh);
    c.wait_writable(l).await;
    c.wait_replica(f, e, &model, false).await;
    // Whole blocks below the committed length are identical (the leader's copy may go on with
    // the packet that failed).
    let whole = model.len() / BS as usize;
    assert_eq!(
        api.block_crcs(f, e).await.unwrap().unwrap()[..whole],
        api.block_crcs(l, e).await.unwrap().unwrap()[..whole]
    );
    assert_eq!(api.read_all(e, 0, model.len() as u64).await, model);
    // The client moves on to a new extent.
    let e2 = api.create().await.unwrap().unwrap();
    let mut model2 = Vec::new();
    fill(&api, e2, &mut model2, 60, 4, 5000).await;
    for i in 0..3 {
        c.wait_replica(i, e2, &model2, true).await;
    }

    // The same loss again, but this time the follower comes back while the partition takes
    // appends: nothing turns read-only. The extent it is short of either takes the next packet
    // (which waits on the follower for the repair's bytes) or, if the leader's re-check saw the
    // short copy first, takes no appends (the client moves to a new extent) until the follower
    // holds it; either way the follower repairs it in the background.
    c.crash(f).await;
    truncate(&c.data_file(f, e2), 6000);
    c.restart(f).await;
    let more = pattern(61, 3000);
    match api.append(e2, model2.len() as u64, &more).await.unwrap() {
        Ok(w) => {
            model2.extend_from_slice(&more);
            assert_eq!(w.committed, model2.len() as u64);
        }
        Err(DataError::ReadOnly(why)) => assert!(why.contains("lags"), "{why}"),
        Err(other) => panic!("unexpected refusal: {other:?}"),
    }
    let e3 = api.create().await.unwrap().unwrap();
    let mut model3 = Vec::new();
    fill(&api, e3, &mut model3, 63, 2, 5000).await;
    for i in 0..3 {
        c.wait_replica(i, e2, &model2, false).await;
        c.wait_replica(i, e3, &model3, true).await;
    }
    c.shutdown().await;
}

/// Raft elects on the log, which knows nothing of appends: a replica that lost the tail of an
/// extent in a crash can become leader before it has repaired it. Leaders do not repair, so such
/// a leader would keep the partition read-only for good; it hands leadership to a replica that
/// holds every committed byte, repairs as a follower, and the partition takes writes again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_elected_without_committed_bytes_hands_over_and_is_repaired() {
    let _serial = SERIAL.lock().await;
    // Duty rounds (repairs, re-checks) run only when the test calls them.
    let mut c = Cluster::start_with(11, |cfg| {
        cfg.report_interval = std::time::Duration::from_secs(3600);
        cfg.recheck_interval = std::time::Duration::from_secs(3600);
    })
    .await;
    let api = c.api.clone();
    let l = api.leader().await;
    let (f, g) = ((l + 1) % 3, (l + 2) % 3);
    let (lh, fh, gh) = (Cluster::host(l), Cluster::host(f), Cluster::host(g));
    let e = api.create().await.unwrap().unwrap();
    let mut model = Vec::new();
    fill(&api, e, &mut model, 70, 5, 9000).await;
    // One more packet tells the followers that `model` is committed (a packet carries the
    // committed length before it). Its own bytes are known to be committed only by the leader,
    // which goes down below while f has lost data: two failures, so they are not checked.
    let last = pattern(75, 1000);
    api.append(e, model.len() as u64, &last)
        .await
        .unwrap()
        .unwrap();
    for i in 0..3 {
        c.wait_replica(i, e, &model, false).await;
    }
    // g falls behind in the Raft log: cut off while an extent is created through Raft.
    c.net.partition(&gh, &lh);
    c.net.partition(&gh, &fh);
    api.create().await.unwrap().unwrap();
    // f loses the tail of `e` in a crash, then the leader goes down as well.
    c.crash(f).await;
    truncate(&c.data_file(f, e), 10_000);
    c.crash(l).await;
    // f comes back beside g only. Its log is ahead of g's, so only f can be elected: a leader
    // without the committed bytes of `e`.
    c.net.heal_host(&fh);
    c.net.partition(&fh, &lh);
    c.revive(f).await;
    assert!(api.local_len(f, e).await < model.len() as u64);
    assert_eq!(api.leader().await, f);
    // It hands over to g; once l is back and f has repaired, the partition is writable again.
    c.net.heal_host(&lh);
    c.net.heal(&gh, &fh);
    c.restart(l).await;
    eventually("the partition to become read-write", || async {
        for i in 0..3 {
            c.node(i).maintain().await;
        }
        (0..3)
            .any(|i| {
                c.node(i)
                    .reports()
                    .into_iter()
                    .any(|r| r.id == PID && r.leader && !r.full)
            })
            .then_some(())
    })
    .await;
    c.wait_replica(f, e, &model, false).await;
    assert_eq!(api.read_all(e, 0, model.len() as u64).await, model);
    let end = api.committed(e).await;
    assert!(end >= model.len() as u64);
    // `e` took no appends while f was short of it; the leader's next re-check finds f holding
    // it, and it takes appends again.
    let w = eventually("the repaired extent to take appends again", || async {
        for i in 0..3 {
            c.node(i).maintain().await;
        }
        match api.append(e, end, &pattern(71, 3000)).await.unwrap() {
            Ok(w) => Some(w),
            Err(DataError::ReadOnly(_)) => None,
            Err(other) => panic!("unexpected refusal: {other:?}"),
        }
    })
    .await;
    assert_eq!(w.committed, end + 3000);
    c.shutdown().await;
}

/// Packets sent without `sync`: acknowledged once on every replica, but committed (and served)
/// only with the extent's next synced packet; a follower that lost them makes that packet fail
/// rather than commit bytes it does not hold.
/// A packet the leader refuses (here a stale retry of one already written, as after a lost reply)
/// never reaches the followers: they would cut their tails back to its offset to make room for it
/// (the bytes past it, acknowledged, would then live on the leader alone).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_packet_leaves_the_followers_tails_alone() {
    let _serial = SERIAL.lock().await;
    let c = Cluster::start(16).await;
    let api = c.api.clone();
    let e = api.create().await.unwrap().unwrap();
    let mut model = Vec::new();
    fill(&api, e, &mut model, 110, 2, 5000).await;
    // Two unsynced packets past what the followers know is committed.
    let retried = pattern(120, 5000);
    for data in [retried.clone(), pattern(121, 5000)] {
        api.append_with(e, model.len() as u64, &data, false)
            .await
            .unwrap()
            .unwrap();
        model.extend_from_slice(&data);
    }
    // The first of them again.
    match api.append_with(e, 10_000, &retried, false).await.unwrap() {
        Err(DataError::OutOfRange { .. }) => {}
        other => panic!("expected OutOfRange, got {other:?}"),
    }
    for i in 0..3 {
        assert_eq!(api.local_len(i, e).await, model.len() as u64, "replica {i}");
    }
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unsynced_appends_are_committed_only_by_a_later_synced_one() {
    let _serial = SERIAL.lock().await;
    let mut c = Cluster::start_with(5, |cfg| {
        cfg.replicate_timeout = std::time::Duration::from_secs(2);
    })
    .await;
    let api = c.api.clone();
    let l = api.leader().await;
    let f = (l + 1) % 3;
    let e = api.create().await.unwrap().unwrap();
    let mut model = Vec::new();

    for round in 0..2u64 {
        let start = model.len() as u64;
        // Two unsynced packets: acknowledged, nothing committed, nothing served.
        for k in 0..2 {
            let data = pattern(10 * round + k, 7000);
            let w = api
                .append_with(e, model.len() as u64, &data, false)
                .await
                .unwrap()
                .unwrap();
            assert_eq!((w.offset, w.committed), (model.len() as u64, start));
            model.extend_from_slice(&data);
        }
        assert_eq!(api.committed(e).await, start);
        match api.read(e, start, 1).await.unwrap() {
            Err(DataError::OutOfRange { committed, .. }) => assert_eq!(committed, start),
            other => panic!("read past the committed length: {other:?}"),
        }
        // The synced one commits them all.
        let data = pattern(10 * round + 2, 3000);
        let w = api
            .append_with(e, model.len() as u64, &data, true)
            .await
            .unwrap()
            .unwrap();
        model.extend_from_slice(&data);
        assert_eq!(w.committed, model.len() as u64);
        assert_eq!(api.read_all(e, 0, model.len() as u64).await, model);
    }
    for i in 0..3 {
        c.wait_replica(i, e, &model, true).await;
    }

    // An unsynced packet reaches every replica, then a follower crashes and loses it (its file
    // ends at the committed length again).
    let committed = model.len() as u64;
    let lost = pattern(30, 6000);
    api.append_with(e, committed, &lost, false)
        .await
        .unwrap()
        .unwrap();
    c.crash(f).await;
    truncate(&c.data_file(f, e), committed);
    c.restart(f).await;
    // The synced packet after it cannot reach every replica whole: it fails, and nothing past
    // the old committed length is committed or served.
    match api
        .append_with(e, committed + lost.len() as u64, &pattern(31, 100), true)
        .await
        .unwrap()
    {
        Err(DataError::ReadOnly(_)) => {}
        other => panic!("expected ReadOnly, got {other:?}"),
    }
    assert_eq!(api.committed(e).await, committed);
    assert!(matches!(
        api.read(e, committed, 1).await.unwrap(),
        Err(DataError::OutOfRange { .. })
    ));
    assert_eq!(api.read_all(e, 0, committed).await, model);
    c.shutdown().await;
}

/// Cuts a file as a crash that lost its unsynced end would.
fn truncate(file: &std::path::Path, len: u64) {
    std::fs::OpenOptions::new()
        .write(true)
        .open(file)
        .unwrap()
        .set_len(len)
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flipped_bit_on_the_leader_is_repaired_from_a_follower_at_read_time() {
    flipped_bit_repaired(4, 10_000, |_| {}).await;
}

/// The same with appends written past the page cache (`direct_streams`: always).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flipped_bit_in_an_uncached_append_is_repaired_at_read_time() {
    flipped_bit_repaired(14, 32 << 10, |cfg| cfg.direct_streams = 1).await;
}

/// An extent of four appends of `packet` bytes (pattern seeds `seeds.0`) with a 3,000-byte
/// overwrite (`seeds.1`) at `overwrite_at`, on every replica and applied by every follower: a
/// block is repaired only from a replica that has applied every Raft entry the leader has (else
/// it could lack an overwrite). Returns the extent, its bytes and the leader.
async fn settled_extent(
    c: &Cluster,
    seeds: (u64, u64),
    packet: usize,
    overwrite_at: usize,
) -> (ExtentId, Vec<u8>, usize) {
    let api = c.api.clone();
    let e = api.create().await.unwrap().unwrap();
    let mut model = Vec::new();
    fill(&api, e, &mut model, seeds.0, 4, packet).await;
    let ow = pattern(seeds.1, 3000);
    api.overwrite(e, overwrite_at as u64, &ow)
        .await
        .unwrap()
        .unwrap();
    model[overwrite_at..overwrite_at + 3000].copy_from_slice(&ow);
    let l = api.leader().await;
    let applied = api.list(l).await.unwrap().applied;
    for i in 0..3 {
        c.wait_replica(i, e, &model, true).await;
        until_applied(
            c.node(i),
            "the followers to apply the overwrite",
            || async { (api.list(i).await.ok()?.applied >= applied).then_some(()) },
        )
        .await;
    }
    (e, model, l)
}

async fn flipped_bit_repaired(seed: u64, packet: usize, tweak: fn(&mut DataNodeConfig)) {
    let _serial = SERIAL.lock().await;
    let c = Cluster::start_with(seed, tweak).await;
    let api = c.api.clone();
    let (e, model, l) = settled_extent(&c, (70, 80), packet, 12_000).await;

    // Bit rot in block 3 of the leader's copy.
    let file = c.data_file(l, e);
    let at = 3 * u64::from(BS) + 123;
    let mut bytes = std::fs::read(&file).unwrap();
    bytes[at as usize] ^= 0x10;
    std::fs::write(&file, &bytes).unwrap();
    assert_ne!(&bytes[..model.len()], &model[..]);

    // The read checks the block's CRC, fetches the block from a follower, rewrites it, and serves
    // the right bytes.
    let b = api.read(e, at - 100, 1000).await.unwrap().unwrap();
    assert_eq!(&b[..], &model[at as usize - 100..at as usize + 900]);
    assert_eq!(api.read_all(e, 0, model.len() as u64).await, model);
    // The leader's file is fixed on disk.
    assert_eq!(std::fs::read(&file).unwrap(), model);
    let crcs = api.block_crcs(l, e).await.unwrap().unwrap();
    for i in 0..3 {
        assert_eq!(api.block_crcs(i, e).await.unwrap().unwrap(), crcs);
    }
    c.shutdown().await;
}

/// Bit rot on a follower that nobody reads: the scrub finds it and repairs the block from
/// another replica; a second pass finds nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_scrub_repairs_a_flipped_bit_on_a_follower() {
    let _serial = SERIAL.lock().await;
    let c = Cluster::start_with(21, |_| {}).await;
    let (e, model, l) = settled_extent(&c, (90, 91), 10_000, 20_000).await;
    let f = (l + 1) % 3;
    let file = c.data_file(f, e);
    let at = 2 * u64::from(BS) + 77;
    let mut bytes = std::fs::read(&file).unwrap();
    bytes[at as usize] ^= 0x04;
    std::fs::write(&file, &bytes).unwrap();

    let r = c.node(f).scrub(u64::MAX).await;
    assert_eq!((r.bad_blocks, r.repaired), (1, 1), "{r:?}");
    assert!(r.bytes >= model.len() as u64, "{r:?}");
    assert_eq!(
        std::fs::read(&file).unwrap(),
        model,
        "the follower's copy is fixed on disk"
    );
    let again = c.node(f).scrub(u64::MAX).await;
    assert_eq!((again.bad_blocks, again.repaired), (0, 0), "{again:?}");
    // The other replicas had nothing to find.
    for i in (0..3).filter(|i| *i != f) {
        assert_eq!(c.node(i).scrub(u64::MAX).await.bad_blocks, 0);
    }
    c.shutdown().await;
}

/// A node whose disk is full takes no new bytes, whichever replica it is: the partition turns
/// read-only (new extents and appends go to other partitions) and stays so through its leader's
/// re-checks, which would otherwise find every follower answering and take appends the full
/// replica refuses.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_node_keeps_its_partition_read_only() {
    let _serial = SERIAL.lock().await;
    let c = Cluster::start_with(24, |cfg| {
        if cfg.dir.ends_with("data1") {
            cfg.full_ppm = 0;
        }
    })
    .await;
    let api = c.api.clone();
    let l = api.leader().await;
    // A new extent, then an append to it: refused as soon as the node has measured its disk.
    let refused = || async {
        let e = match api.create().await.unwrap() {
            Ok(e) => e,
            Err(DataError::ReadOnly(why)) => return Some(why),
            Err(other) => panic!("unexpected refusal: {other:?}"),
        };
        match api.append(e, 0, &pattern(1, 1000)).await.unwrap() {
            Err(DataError::ReadOnly(why)) => Some(why),
            Ok(_) => None,
            Err(other) => panic!("unexpected refusal: {other:?}"),
        }
    };
    let why = eventually("the full node to refuse new bytes", || async {
        // A duty round measures the disk (and degrades the partitions a full node leads).
        c.node(1).maintain().await;
        refused().await
    })
    .await;
    assert!(why.contains("disk is full"), "{why}");
    for _ in 0..3 {
        c.node(l).maintain().await;
        let why = refused().await.expect("a full node took new bytes");
        assert!(why.contains("disk is full"), "{why}");
    }
    c.shutdown().await;
}

/// A follower behind on appends holds a shorter copy of an extent's last block (or none of
/// it): a repair of the leader's copy never takes it, which would cut acknowledged bytes off. With
/// only such a follower reachable the pass reports the block and leaves the extent as it is; with
/// a whole copy back, the next pass repairs the block from it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_scrub_never_repairs_from_a_shorter_copy() {
    let _serial = SERIAL.lock().await;
    // Repairs crawl, so the short follower stays short.
    let mut c = Cluster::start_with(23, |cfg| cfg.repair_rate = 1).await;
    let api = c.api.clone();
    let l = api.leader().await;
    let (f, g) = ((l + 1) % 3, (l + 2) % 3);
    let e = api.create().await.unwrap().unwrap();
    let mut model = Vec::new();
    fill(&api, e, &mut model, 41, 5, 9000).await; // 10 full blocks and 4040 bytes
    for i in [f, g] {
        c.wait_replica(i, e, &model, true).await;
    }
    c.crash(f).await;
    truncate(&c.data_file(f, e), 10_000);
    c.restart(f).await;
    assert_eq!(api.local_len(f, e).await, 2 * u64::from(BS));

    // Bit rot in the leader's last block, with only the short copy reachable.
    let file = c.data_file(l, e);
    let mut bytes = std::fs::read(&file).unwrap();
    bytes[model.len() - 100] ^= 0x20;
    std::fs::write(&file, &bytes).unwrap();
    let (lh, gh) = (Cluster::host(l), Cluster::host(g));
    c.net.partition(&lh, &gh);
    let r = c.node(l).scrub(u64::MAX).await;
    assert_eq!((r.bad_blocks, r.repaired), (1, 0), "{r:?}");
    assert_eq!(api.local_len(l, e).await, model.len() as u64);
    assert_eq!(std::fs::read(&file).unwrap(), bytes);

    c.net.heal(&lh, &gh);
    let r = c.node(l).scrub(u64::MAX).await;
    assert_eq!((r.bad_blocks, r.repaired), (1, 1), "{r:?}");
    assert_eq!(std::fs::read(&file).unwrap(), model);
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acknowledged_appends_survive_a_leader_crash_in_the_middle_of_a_pipeline() {
    leader_crash_mid_pipeline(5, 6000, 400, |_| {}).await;
}

/// The same with appends written past the page cache (`direct_streams`: always): whole 4 KiB
/// pages, so that they go to the device directly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acknowledged_uncached_appends_survive_a_leader_crash() {
    leader_crash_mid_pipeline(15, 32 << 10, 400, |cfg| cfg.direct_streams = 1).await;
}

async fn leader_crash_mid_pipeline(
    seed: u64,
    packet_len: usize,
    packets_n: usize,
    tweak: fn(&mut DataNodeConfig),
) {
    let _serial = SERIAL.lock().await;
    let mut c = Cluster::start_with(seed, tweak).await;
    let api = c.api.clone();
    let e = api.create().await.unwrap().unwrap();
    let old = api.leader().await;

    // One stream of packets, 6 in flight, sent to the leader only (no leader following: after a
    // failure the rest of the stream is not acknowledged).
    let stream = pattern(90, packet_len * packets_n);
    let (acks_tx, mut acks) = tokio::sync::watch::channel(0usize);
    let writer = {
        let (api, stream) = (api.clone(), stream.clone());
        tokio::spawn(async move {
            let mut inflight = std::collections::VecDeque::new();
            let mut next = 0;
            let mut acked_end = 0u64;
            loop {
                while inflight.len() < 6 && next < packets_n {
                    let (api, off) = (api.clone(), (next * packet_len) as u64);
                    let data = stream[next * packet_len..(next + 1) * packet_len].to_vec();
                    inflight
                        .push_back(tokio::spawn(async move { api.append(e, off, &data).await }));
                    next += 1;
                }
                let Some(t) = inflight.pop_front() else {
                    break;
                };
                match t.await.unwrap() {
                    Ok(Ok(w)) => {
                        assert!(w.committed >= w.offset + packet_len as u64);
                        acked_end = acked_end.max(w.offset + packet_len as u64);
                        acks_tx.send_modify(|n| *n += 1);
                    }
                    Ok(Err(DataError::ReadOnly(_) | DataError::OutOfRange { .. })) | Err(_) => {
                        for t in inflight.drain(..) {
                            let _ = t.await;
                        }
                        break;
                    }
                    Ok(Err(other)) => panic!("append: {other:?}"),
                }
            }
            acked_end
        })
    };
    acks.wait_for(|n| *n >= 40).await.unwrap();
    c.crash(old).await;
    let acked = writer.await.unwrap();
    assert!(acked >= 40 * packet_len as u64);
    assert!(acked < stream.len() as u64, "the crash cut the stream");

    // A new leader is elected and aligns: nothing acknowledged is lost, and the bytes below the
    // committed length are the stream's.
    let l = api.leader().await;
    assert_ne!(l, old);
    let committed = api.committed(e).await;
    for i in 0..3 {
        if i != old {
            eprintln!(
                "DIAG node {i} len {} (leader {l}) committed {committed} acked {acked}",
                api.local_len(i, e).await
            );
        }
    }
    assert!(
        committed >= acked,
        "committed {committed} is below the acknowledged {acked}"
    );
    assert_eq!(
        api.read_all(e, 0, committed).await,
        &stream[..committed as usize]
    );
    // The crashed replica is unreachable: the partition takes no appends.
    match api.append(e, committed, b"more").await.unwrap() {
        Err(DataError::ReadOnly(_)) => {}
        other => panic!("expected ReadOnly, got {other:?}"),
    }

    // The old leader restarts (with whatever tail it had written); once every replica holds the
    // committed bytes, appends continue at the committed offset.
    c.restart(old).await;
    let l = api.leader().await;
    c.wait_writable(l).await;
    let more = pattern(91, 7000);
    let w = api.append(e, committed, &more).await.unwrap().unwrap();
    assert_eq!((w.offset, w.committed), (committed, committed + 7000));
    let mut model = stream[..committed as usize].to_vec();
    model.extend_from_slice(&more);
    assert_eq!(api.read_all(e, 0, model.len() as u64).await, model);
    for i in 0..3 {
        c.wait_replica(i, e, &model, true).await;
    }
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_leader_with_an_unacknowledged_tail_continues_at_the_committed_offset() {
    let _serial = SERIAL.lock().await;
    let mut c = Cluster::start(6).await;
    let api = c.api.clone();
    let e = api.create().await.unwrap().unwrap();
    let mut model = Vec::new();
    fill(&api, e, &mut model, 100, 3, 5000).await;
    let old = api.leader().await;
    let (next, s) = ((old + 1) % 3, (old + 2) % 3);

    // Replica `s` loses the old leader: it misses an overwrite (so its Raft log is behind and it
    // cannot win the next election) and the next packet, which only the old leader and `next`
    // store. That packet is not acknowledged.
    c.net.partition(&Cluster::host(s), &Cluster::host(old));
    let ow = pattern(101, 3000);
    api.overwrite(e, 1000, &ow).await.unwrap().unwrap();
    model[1000..4000].copy_from_slice(&ow);
    let tail = pattern(102, 8000);
    match api.append(e, model.len() as u64, &tail).await.unwrap() {
        Err(DataError::ReadOnly(_)) => {}
        other => panic!("expected ReadOnly, got {other:?}"),
    }
    let len = model.len() as u64;
    assert_eq!(api.local_len(next, e).await, len + 8000);
    assert_eq!(api.local_len(s, e).await, len);

    // The old leader crashes: `next` (with the unacknowledged tail) is the only possible leader.
    c.crash(old).await;
    assert_eq!(api.leader().await, next);
    assert_eq!(api.committed(e).await, len);
    assert_eq!(api.read_all(e, 0, len).await, model);

    // With every replica back, appends continue at the committed offset; the tail is dropped
    // everywhere.
    c.restart(old).await;
    c.wait_writable(next).await;
    let more = pattern(103, 5000);
    let w = api.append(e, len, &more).await.unwrap().unwrap();
    assert_eq!((w.offset, w.committed), (len, len + 5000));
    model.extend_from_slice(&more);
    assert_eq!(api.read_all(e, 0, model.len() as u64).await, model);
    for i in 0..3 {
        c.wait_replica(i, e, &model, true).await;
    }
    c.shutdown().await;
}

/// A node keeps no more spare bytes than `spare_bytes` (here none): a deleted extent's data file
/// is removed at the next tick like its crc file.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spares_past_the_nodes_budget_are_removed() {
    let _serial = SERIAL.lock().await;
    let c = Cluster::start_with(8, |cfg| cfg.spare_bytes = 0).await;
    let api = c.api.clone();
    let e = api.create().await.unwrap().unwrap();
    let mut model = Vec::new();
    fill(&api, e, &mut model, 150, 1, 9000).await;
    for i in 0..3 {
        c.wait_replica(i, e, &model, true).await;
    }
    api.release(vec![(e, 0, u64::MAX)]).await.unwrap().unwrap();
    for i in 0..3 {
        until_applied(c.node(i), "the release to be applied", || async {
            match api.fetch_all(i, e).await.ok()? {
                Err(DataError::NotFound(x)) if x == e => Some(()),
                _ => None,
            }
        })
        .await;
        c.node(i).maintain().await;
        for ext in ["data.deleted", "crc.deleted"] {
            let f = c.data_file(i, e).with_extension(ext);
            assert!(!f.exists(), "node {i} still has {}", f.display());
        }
    }
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn releases_delete_extents_and_punch_tiny_ranges_on_every_replica() {
    let _serial = SERIAL.lock().await;
    let c = Cluster::start_with(7, |cfg| cfg.metrics = Some(DataMetrics::default())).await;
    let api = c.api.clone();
    let e = api.create().await.unwrap().unwrap();
    let keep = api.create().await.unwrap().unwrap();
    let (mut model, mut kept) = (Vec::new(), Vec::new());
    fill(&api, e, &mut model, 110, 2, 9000).await;
    fill(&api, keep, &mut kept, 120, 1, 3000).await;
    // Three small files; they go to tiny extents, on 4 KiB boundaries.
    let files: Vec<Vec<u8>> = (0..3).map(|k| pattern(130 + k, 5000)).collect();
    let mut written = Vec::new();
    for f in &files {
        written.push(api.write_tiny(f).await.unwrap().unwrap());
    }
    for i in 0..3 {
        c.wait_replica(i, e, &model, true).await;
        assert!(c.data_file(i, e).exists());
    }

    // The meta node releases extent `e` and the second small file.
    let gone = written[1];
    api.release(vec![
        (e, 0, u64::MAX),
        (gone.extent, gone.offset, files[1].len() as u64),
    ])
    .await
    .unwrap()
    .unwrap();
    // Releases are idempotent.
    api.release(vec![(e, 0, u64::MAX)]).await.unwrap().unwrap();

    // The deleted extent is gone on every replica (followers apply the release from the log).
    match api.read(e, 0, 100).await.unwrap() {
        Err(DataError::NotFound(x)) => assert_eq!(x, e),
        other => panic!("expected NotFound, got {other:?}"),
    }
    for i in 0..3 {
        until_applied(
            c.node(i),
            "the release to be applied on every replica",
            || async {
                match api.fetch_all(i, e).await.ok()? {
                    Err(DataError::NotFound(x)) if x == e => Some(()),
                    _ => None,
                }
            },
        )
        .await;
        assert!(matches!(
            api.block_crcs(i, e).await.unwrap(),
            Err(DataError::NotFound(_))
        ));
        assert!(!c.data_file(i, e).exists(), "node {i} still has the file");
        assert!(
            api.list(i)
                .await
                .unwrap()
                .extents
                .iter()
                .all(|(x, _, _)| *x != e)
        );
    }
    // A replica renames a deleted extent's files (the release was applied on a messenger worker;
    // removing a large file is slow): it removes the crc file at its next tick, on the blocking
    // pool, and keeps the data file for a new extent (a spare, within the node's budget).
    for i in 0..3 {
        let data = c.data_file(i, e).with_extension("data.deleted");
        let crc = c.data_file(i, e).with_extension("crc.deleted");
        c.node(i).maintain().await;
        assert!(!crc.exists(), "node {i} still has {}", crc.display());
        assert!(
            data.exists(),
            "node {i} removed its spare {}",
            data.display()
        );
        let m = c.node(i).metrics().unwrap();
        assert_eq!((m.spare_files(), m.spare_bytes()), (1, model.len() as i64));
    }
    // The next extent takes it on every replica: its data file is e's, renamed, and reads back
    // only what was written to it.
    let next = api.create().await.unwrap().unwrap();
    let mut fresh = Vec::new();
    fill(&api, next, &mut fresh, 140, 1, 3000).await;
    for i in 0..3 {
        c.wait_replica(i, next, &fresh, true).await;
        assert!(!c.data_file(i, e).with_extension("data.deleted").exists());
        let on_disk = std::fs::metadata(c.data_file(i, next)).unwrap().len();
        assert_eq!(
            on_disk,
            model.len() as u64,
            "node {i}: not the recycled file"
        );
        assert_eq!(api.fetch_all(i, next).await.unwrap().unwrap(), fresh);
        c.node(i).maintain().await;
        let m = c.node(i).metrics().unwrap();
        assert_eq!((m.spare_files(), m.spare_bytes(), m.recycled()), (0, 0, 1));
    }
    // Appending to it is refused too.
    match api.append(e, model.len() as u64, b"late").await.unwrap() {
        Err(DataError::NotFound(_)) => {}
        other => panic!("expected NotFound, got {other:?}"),
    }

    // The punched range reads as zeros everywhere; the other files and extents are intact.
    let zeros = vec![0u8; files[1].len()];
    let b = api
        .read(gone.extent, gone.offset, files[1].len() as u32)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(&b[..], &zeros[..]);
    for (w, f) in written.iter().zip(&files) {
        if *w == gone {
            continue;
        }
        let b = api
            .read(w.extent, w.offset, f.len() as u32)
            .await
            .unwrap()
            .unwrap();
        assert_eq!(&b[..], &f[..]);
    }
    for i in 0..3 {
        let (o, n) = (gone.offset as usize, files[1].len());
        until_applied(
            c.node(i),
            "the punch to be applied on every replica",
            || async {
                let all = api.fetch_all(i, gone.extent).await.ok()?.ok()?;
                (all.get(o..o + n)? == &zeros[..]).then_some(())
            },
        )
        .await;
        let all = api.fetch_all(i, gone.extent).await.unwrap().unwrap();
        for (w, f) in written.iter().zip(&files) {
            if w.extent == gone.extent && *w != gone {
                let o = w.offset as usize;
                assert_eq!(&all[o..o + f.len()], &f[..]);
            }
        }
        c.wait_replica(i, keep, &kept, true).await;
    }
    assert_eq!(api.read_all(keep, 0, kept.len() as u64).await, kept);
    c.shutdown().await;
}

/// The faulty disk of every partition store the nodes opened, by directory.
static DISKS: Mutex<Vec<(PathBuf, FaultyDisk)>> = Mutex::new(Vec::new());

/// A node configuration whose partition stores run on [`FaultyDisk`]s the test can reach.
fn faulty_disks(cfg: &mut nacre_data::DataNodeConfig) {
    cfg.wrap_disk = Some(WrapDisk(Arc::new(|dir: &Path, disk: Arc<dyn Disk>| {
        let faulty = FaultyDisk::new(disk, FaultPlan::default());
        DISKS
            .lock()
            .unwrap()
            .push((dir.to_path_buf(), faulty.clone()));
        Arc::new(faulty) as Arc<dyn Disk>
    })));
}

/// The disk of node `i`'s store of the partition.
fn disk_of(c: &Cluster, i: usize) -> FaultyDisk {
    let dir = c
        .root
        .path()
        .join(Cluster::host(i))
        .join("extents")
        .join(PID.0.to_string());
    let disks = DISKS.lock().unwrap();
    disks
        .iter()
        .rev()
        .find(|(d, _)| *d == dir)
        .map(|(_, f)| f.clone())
        .unwrap()
}

/// Node `i`'s store refuses work: a fetch from it fails (not just an empty answer).
async fn assert_store_failed(api: &Api, i: usize, e: ExtentId) {
    match api.fetch_all(i, e).await.unwrap() {
        Err(DataError::Io(m)) => assert!(m.contains("failed an IO"), "{m}"),
        other => panic!("node {i}'s store should refuse work: {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_follower_whose_store_failed_is_reopened_and_repaired() {
    let _serial = SERIAL.lock().await;
    let c = Cluster::start_with(8, faulty_disks).await;
    let api = c.api.clone();
    let l = api.leader().await;
    let f = (l + 1) % 3;
    let e = api.create().await.unwrap().unwrap();
    let mut model = Vec::new();
    fill(&api, e, &mut model, 130, 4, 9000).await; // 36 000 bytes: 8 full blocks and a partial one
    c.wait_replica(f, e, &model, true).await;

    // The follower's disk fails every IO: the next packet fails its store, and the partition
    // turns read-only. Its duty rounds try to reopen the store and cannot.
    let disk = disk_of(&c, f);
    disk.fail_after_more(Some(0));
    match api
        .append(e, model.len() as u64, &pattern(131, 5000))
        .await
        .unwrap()
    {
        Err(DataError::ReadOnly(_)) => {}
        other => panic!("expected ReadOnly, got {other:?}"),
    }
    assert_store_failed(&api, f, e).await;
    // An overwrite commits through Raft (a majority) and cannot be applied on the follower.
    let ow = pattern(132, 6000);
    api.overwrite(e, 2000, &ow).await.unwrap().unwrap();
    model[2000..8000].copy_from_slice(&ow);
    // And its file lost its end, as a failed writeback can leave it.
    truncate(&c.data_file(f, e), 10_000);
    assert_store_failed(&api, f, e).await;

    // The disk works again: a duty round reopens the store (recovery cuts the extent to its two
    // whole blocks), the repair compares every extent with the leader's copy (bringing the
    // overwrite) and copies what is missing, and the leader, re-checking, takes appends again.
    disk.fail_after_more(None);
    c.wait_writable(l).await;
    c.wait_replica(f, e, &model, false).await;
    let whole = model.len() / BS as usize;
    assert_eq!(
        api.block_crcs(f, e).await.unwrap().unwrap()[..whole],
        api.block_crcs(l, e).await.unwrap().unwrap()[..whole]
    );
    assert_eq!(api.read_all(e, 0, model.len() as u64).await, model);
    // The client moves on to a new extent; the reopened follower takes its packets.
    let e2 = api.create().await.unwrap().unwrap();
    let mut model2 = Vec::new();
    fill(&api, e2, &mut model2, 133, 3, 7000).await;
    let w = api.write_tiny(b"small").await.unwrap().unwrap();
    for i in 0..3 {
        c.wait_replica(i, e2, &model2, true).await;
    }
    assert_eq!(api.local_len(f, w.extent).await, w.committed);
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_whose_store_failed_hands_over_then_is_reopened_and_repaired() {
    let _serial = SERIAL.lock().await;
    let c = Cluster::start_with(9, faulty_disks).await;
    let api = c.api.clone();
    let old = api.leader().await;
    let e = api.create().await.unwrap().unwrap();
    let mut model = Vec::new();
    fill(&api, e, &mut model, 140, 3, 9000).await;

    // The leader's disk fails every IO: its own write of the next packet fails its store.
    let disk = disk_of(&c, old);
    disk.fail_after_more(Some(0));
    match api
        .append(e, model.len() as u64, &pattern(141, 5000))
        .await
        .unwrap()
    {
        // Read-only: the client writes the bytes to another partition.
        Err(DataError::ReadOnly(_)) => {}
        Err(e) => panic!("a failed store must tell the client to write elsewhere, not {e:?}"),
        Ok(w) => panic!("the leader's disk fails, yet the append was acknowledged: {w:?}"),
    }
    // Its duty round hands leadership to a follower (a read of a missing extent is answered
    // `NotFound` only by an aligned leader).
    let req = ReadRequest {
        partition: PID,
        extent: ExtentId(u64::MAX),
        offset: 0,
        len: 1,
    };
    let l = eventually("another leader", || async {
        let (r, _, i) = api.call::<Read>(&req, &Bytes::new(), true).await.ok()?;
        (i != old && matches!(r, Err(DataError::NotFound(_)))).then_some(i)
    })
    .await;
    assert_store_failed(&api, old, e).await;
    // An overwrite the old leader cannot apply.
    let ow = pattern(142, 3000);
    api.overwrite(e, 10_000, &ow).await.unwrap().unwrap();
    model[10_000..13_000].copy_from_slice(&ow);
    assert_eq!(api.read_all(e, 0, model.len() as u64).await, model);
    // And an extent it cannot create (its Raft state machine still counts the id).
    let e2 = api.create().await.unwrap().unwrap();

    // The disk works again: the old leader, now a follower, reopens its store and repairs it.
    disk.fail_after_more(None);
    c.wait_writable(l).await;
    c.wait_replica(old, e, &model, false).await;
    let mut model2 = Vec::new();
    fill(&api, e2, &mut model2, 143, 3, 7000).await;
    for i in 0..3 {
        c.wait_replica(i, e2, &model2, true).await;
    }
    assert_eq!(api.read_all(e, 0, model.len() as u64).await, model);
    c.shutdown().await;
}
