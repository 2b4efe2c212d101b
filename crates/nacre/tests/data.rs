//! The data path against real `nacre server` processes (1 master, 3 meta and 3 data nodes on
//! fixed loopback ports, so a restarted node keeps its identity): every acknowledged append and
//! overwrite reads back identical after `kill -9` of a data partition's leader and, later, of a
//! follower, in the middle of the writes, once the killed node is back and repaired; reads never
//! pass the committed length.
#![allow(clippy::unwrap_used)] // test helpers outside #[test] fns

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use nacre_api::data::DataError;
use nacre_client::{DataCallError, MetaFs, NetVolume, NewInode, SeqWriter};

use nacre_api::meta::{ExtentKey, ROOT_INO};
use nacre_types::NodeId;

mod common;
use common::cluster::{
    Cluster, ONE_AT_A_TIME, client_with_volume, open_volume, runtime, shut_down, start_cluster,
    start_node, wait_writable,
};

/// Deterministic bytes for file `f`.
fn content(f: u64, len: usize) -> Vec<u8> {
    let mut s = f.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..len)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            s as u8
        })
        .collect()
}

async fn read_keys(vol: &NetVolume, keys: &[ExtentKey]) -> Result<Vec<u8>, DataCallError> {
    let mut out = Vec::new();
    for k in keys {
        let mut off = 0u64;
        while off < u64::from(k.size) {
            let n = (u64::from(k.size) - off).min(1 << 20) as u32;
            let b = vol
                .read_extent(k.partition, k.extent, k.extent_offset + off, n)
                .await?;
            out.extend_from_slice(&b);
            off += u64::from(n);
        }
    }
    Ok(out)
}

/// Writes files of 1 MiB (8 packets) until `stop`; returns the acknowledged ones.
async fn write_files(
    vol: Arc<NetVolume>,
    first: u64,
    mut stop: tokio::sync::watch::Receiver<bool>,
    progress: tokio::sync::watch::Sender<u64>,
) -> (Vec<(u64, Vec<ExtentKey>)>, u64) {
    let mut acked = Vec::new();
    let mut failed = 0;
    let mut f = first;
    while !*stop.borrow_and_update() && f < first + 10_000 {
        let mut w = SeqWriter::new(vol.clone(), 0, 4);
        let r = async {
            w.write(Bytes::from(content(f, 1 << 20))).await?;
            w.finish().await
        }
        .await;
        match r {
            Ok(keys) => acked.push((f, keys)),
            Err(_) => {
                failed += 1;
                // Everything may be read-only until the killed node is back: do not spin.
                let _ = tokio::time::timeout(Duration::from_millis(200), stop.changed()).await;
            }
        }
        progress.send_modify(|n| *n += 1);
        f += 1;
    }
    (acked, failed)
}

#[test]
fn acknowledged_data_survives_kill_9_of_leader_and_follower() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let dir = tempfile::tempdir().unwrap();
    let Cluster {
        master: _master,
        metas: _metas,
        mut datas,
        data_addrs,
        master_addr,
    } = start_cluster(dir.path());
    runtime().block_on(async {
        let (msgr, mc) = client_with_volume(&master_addr).await;
        let vol = open_volume(&msgr, &mc).await;

        // A file to overwrite while nodes die.
        let mut w = SeqWriter::new(vol.clone(), 0, 4);
        w.write(Bytes::from(content(0, 1 << 20))).await.unwrap();
        let base_keys = w.finish().await.unwrap();
        let mut model = content(0, 1 << 20);
        assert_eq!(read_keys(&vol, &base_keys).await.unwrap(), model);
        // Nothing past the committed length is served.
        let k = &base_keys[base_keys.len() - 1];
        let past = vol
            .read_extent(
                k.partition,
                k.extent,
                k.extent_offset + u64::from(k.size),
                1,
            )
            .await;
        assert!(
            matches!(past, Err(DataCallError::Data(DataError::OutOfRange { .. }))),
            "{past:?}"
        );

        let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
        let (prog_tx, mut prog_rx) = tokio::sync::watch::channel(0u64);
        let writer = tokio::spawn(write_files(vol.clone(), 1, stop_rx, prog_tx));

        let mut overwrites = 0u32;
        for round in 0..2 {
            // Round 0 kills the leader of the base file's partition, round 1 a follower of it.
            let v = mc.volume("v").await.unwrap();
            let part = v
                .data_partitions
                .iter()
                .find(|p| p.spec.id == base_keys[0].partition)
                .unwrap();
            let leader: NodeId = part.leader.unwrap();
            let victim_node = if round == 0 {
                leader
            } else {
                part.spec
                    .replicas
                    .iter()
                    .find(|r| r.node != leader)
                    .unwrap()
                    .node
            };
            let victim_addr = &part
                .spec
                .replicas
                .iter()
                .find(|r| r.node == victim_node)
                .unwrap()
                .addr;
            let victim = data_addrs.iter().position(|a| a == victim_addr).unwrap();

            let seen = *prog_rx.borrow_and_update();
            prog_rx.wait_for(|n| *n >= seen + 3).await.unwrap();
            datas[victim].as_mut().unwrap().kill();
            // Overwrites keep going through Raft (two of three replicas are up); each is retried
            // until acknowledged, so the model knows every byte.
            for i in 0..20u64 {
                let off = ((i * 7919 + u64::from(overwrites) * 104_729) % 255) * 4096;
                let data = content(1_000_000 + u64::from(overwrites), 4096);
                let key = base_keys
                    .iter()
                    .find(|k| k.file_offset <= off && off + 4096 <= k.end())
                    .unwrap();
                let at = key.extent_offset + (off - key.file_offset);
                let mut tries = 0;
                loop {
                    match vol
                        .overwrite(key.partition, key.extent, at, Bytes::from(data.clone()))
                        .await
                    {
                        Ok(()) => break,
                        Err(e) => {
                            tries += 1;
                            assert!(tries < 10, "overwrite keeps failing: {e}");
                        }
                    }
                }
                model[off as usize..off as usize + 4096].copy_from_slice(&data);
                overwrites += 1;
            }
            let seen = *prog_rx.borrow_and_update();
            prog_rx.wait_for(|n| *n >= seen + 2).await.unwrap();
            datas[victim] = None;
            datas[victim] = Some(start_node(
                "data",
                victim,
                &data_addrs[victim],
                &master_addr,
                dir.path(),
            ));
            wait_writable(&mc, "v", Duration::from_secs(60)).await;
        }
        let _ = stop_tx.send(true);
        let (acked, failed) = writer.await.unwrap();
        assert!(
            acked.len() >= 4,
            "too few files acknowledged: {} ({failed} failed)",
            acked.len()
        );

        // Every acknowledged byte reads back identical.
        assert_eq!(read_keys(&vol, &base_keys).await.unwrap(), model);
        for (f, keys) in &acked {
            let got = read_keys(&vol, keys).await.unwrap();
            assert!(
                got == content(*f, 1 << 20),
                "file {f} differs after the crashes"
            );
        }
        eprintln!(
            "{} files acknowledged, {failed} failed during fail-over, {overwrites} overwrites",
            acked.len()
        );
        shut_down(&msgr).await;
    });
}

#[test]
fn a_deleted_file_has_its_extents_released_on_the_data_nodes() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let dir = tempfile::tempdir().unwrap();
    let c = start_cluster(dir.path());
    runtime().block_on(async {
        let (msgr, mc) = client_with_volume(&c.master_addr).await;
        let vol = open_volume(&msgr, &mc).await;
        let fs = MetaFs::new(
            NetVolume::connect(msgr.client(), mc.clone(), "v")
                .await
                .unwrap(),
        );
        let f = fs
            .create(ROOT_INO, b"f", &NewInode::file(0o644, 0, 0))
            .await
            .unwrap();
        let mut w = SeqWriter::new(vol.clone(), 0, 4);
        w.write(Bytes::from(content(7, 300 << 10))).await.unwrap();
        let keys = w.finish().await.unwrap();
        fs.append_extents(f.attr.ino, keys.clone()).await.unwrap();
        assert_eq!(read_keys(&vol, &keys).await.unwrap(), content(7, 300 << 10));
        // Each key's CRC is that of its bytes (packet CRCs folded in without a second pass).
        let whole = content(7, 300 << 10);
        assert_eq!(
            keys.len(),
            1,
            "three packets of one extent make one key: {keys:?}"
        );
        for k in &keys {
            let bytes = &whole[k.file_offset as usize..k.end() as usize];
            assert_eq!(k.crc, nacre_types::crc32c(bytes), "key {k:?}");
        }
        fs.unlink(ROOT_INO, b"f").await.unwrap();
        // The meta partition's leader releases the evicted inode's extents within a few report
        // rounds (every 100 ms here).
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            match read_keys(&vol, &keys).await {
                Err(DataCallError::Data(DataError::NotFound(_))) => break,
                other => assert!(
                    Instant::now() < deadline,
                    "the extent was not released: {:?}",
                    other.map(|b| b.len())
                ),
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        shut_down(&msgr).await;
    });
}

/// A stream whose packets are refused while the flush sends its last one (the window full, so
/// the flush waits for the oldest, which fails) writes every byte again elsewhere before the
/// flush returns: the keys cover the whole stream. A flush that returned with the refused packets
/// only queued would leave their keys missing and the stream's file offset moved back to the
/// first of them, so the next append's keys would take their file range.
#[test]
fn a_refused_last_window_is_rewritten_before_the_flush_returns() {
    const PACKET: usize = 128 << 10;
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let dir = tempfile::tempdir().unwrap();
    let c = start_cluster(dir.path());
    runtime().block_on(async {
        let (msgr, mc) = client_with_volume(&c.master_addr).await;
        let vol = open_volume(&msgr, &mc).await;
        let first = content(11, PACKET);
        let mut w = SeqWriter::new(vol.clone(), 0, 4);
        w.write(Bytes::from(first.clone())).await.unwrap();
        w.flush().await.unwrap();
        let mut keys = w.take_keys();
        let k = keys[0];
        assert_eq!((keys.len(), k.size as usize), (1, PACKET), "{keys:?}");
        // Another writer appends to the stream's extent, so the stream's next packet, at the
        // offset it expects, is refused (out of range: the client moves on).
        vol.append(
            k.partition,
            k.extent,
            PACKET as u64,
            Bytes::from(vec![7u8; 4096]),
        )
        .await
        .unwrap();
        // Three whole packets and a short one: with four in flight allowed, the window fills only
        // when the flush sends the last.
        let more = content(12, 3 * PACKET + 1000);
        w.write(Bytes::from(more.clone())).await.unwrap();
        w.flush().await.unwrap();
        keys.extend(w.take_keys());
        let mut want = first;
        want.extend_from_slice(&more);
        let mut at = 0;
        for k in &keys {
            assert_eq!(k.file_offset, at, "keys leave a gap or overlap: {keys:?}");
            at = k.end();
        }
        assert_eq!(at, want.len() as u64, "keys: {keys:?}");
        assert!(read_keys(&vol, &keys).await.unwrap() == want);
        shut_down(&msgr).await;
    });
}
