//! Garbage collection of leaked extents against real `nacre server` processes (1 master, 3 meta
//! and 3 data nodes): an extent written through the data path whose key is never committed is
//! deleted by a sweep on every replica, committed files (streamed and tiny) stay intact, and
//! `nacre vol info`'s figures show it; a client never commits a key past its bound, and commits
//! a long-open file's streamed bytes on its own.
#![allow(clippy::unwrap_used)] // test helpers outside #[test] fns

use std::time::{Duration, Instant};

use bytes::Bytes;
use nacre_api::data::DataError;
use nacre_api::meta::{ExtentKey, ROOT_INO};
use nacre_client::{
    Caller, DataCallError, FileSystem, FsError, MetaFs, NetFs, NetFsConfig, NetVolume, NewInode,
    OpenFlags, SeqWriter,
};
use nacre_master::admin::Admin;

mod common;
use common::cluster::{
    ONE_AT_A_TIME, client_with_volume, open_volume, runtime, shut_down, start_cluster,
};

fn content(seed: u64, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u64).wrapping_mul(31).wrapping_add(seed) as u8)
        .collect()
}

async fn read_keys(vol: &NetVolume, keys: &[ExtentKey]) -> Result<Vec<u8>, DataCallError> {
    let mut out = Vec::new();
    for k in keys {
        let b = vol
            .read_extent(k.partition, k.extent, k.extent_offset, k.size)
            .await?;
        out.extend_from_slice(&b);
    }
    Ok(out)
}

/// Streams `data` into new normal extents and returns their keys (committing nothing).
async fn stream(vol: &std::sync::Arc<NetVolume>, data: Vec<u8>) -> Vec<ExtentKey> {
    let mut w = SeqWriter::new(vol.clone(), 0, 4);
    w.write(Bytes::from(data)).await.unwrap();
    w.finish().await.unwrap()
}

#[test]
fn a_sweep_deletes_a_leaked_extent_and_keeps_committed_files() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let dir = tempfile::tempdir().unwrap();
    let c = start_cluster(dir.path());
    runtime().block_on(async {
        let (msgr, mc) = client_with_volume(&c.master_addr).await;
        let vol = open_volume(&msgr, &mc).await;
        let meta = MetaFs::new(
            NetVolume::connect(msgr.client(), mc.clone(), "v")
                .await
                .unwrap(),
        );
        // A committed file in a normal extent.
        let kept = meta
            .create(ROOT_INO, b"kept", &NewInode::file(0o644, 0, 0))
            .await
            .unwrap();
        let kept_keys = stream(&vol, content(1, 300 << 10)).await;
        meta.append_extents(kept.attr.ino, kept_keys.clone())
            .await
            .unwrap();
        // A committed file unlinked but not evicted would still be referenced; a committed small
        // file through NetFs lands in a tiny extent, which is never collected.
        let fs = NetFs::new(open_volume(&msgr, &mc).await);
        let me = Caller { uid: 0, gid: 0 };
        let (small, fh) = fs
            .create(ROOT_INO, b"small", 0o644, me, OpenFlags::READ_WRITE)
            .await
            .unwrap();
        fs.write(fh, 0, Bytes::from(content(2, 5000)))
            .await
            .unwrap();
        fs.release(fh).await.unwrap();
        // The leak: bytes written, their key never committed.
        let leaked = stream(&vol, content(3, 200 << 10)).await;
        assert_eq!(read_keys(&vol, &leaked).await.unwrap().len(), 200 << 10);

        let admin = Admin::new(mc.clone());
        // A grace longer than the test: everything is too young, nothing is freed, the leak is
        // counted as unreferenced.
        let young = admin.sweep("v", Duration::from_secs(3600)).await.unwrap();
        assert!(young.iter().all(|r| r.error.is_none()), "{young:?}");
        assert_eq!(young.iter().map(|r| r.freed).sum::<u64>(), 0);
        assert_eq!(
            young.iter().map(|r| r.unreferenced_bytes).sum::<u64>(),
            200 << 10,
            "{young:?}"
        );
        // A grace of 0 (no client writes now): the leak goes.
        let swept = admin.sweep("v", Duration::ZERO).await.unwrap();
        assert!(swept.iter().all(|r| r.error.is_none()), "{swept:?}");
        let leaked_extents: std::collections::BTreeSet<_> =
            leaked.iter().map(|k| (k.partition, k.extent)).collect();
        assert_eq!(
            swept.iter().map(|r| r.freed).sum::<u64>(),
            leaked_extents.len() as u64,
            "{swept:?}"
        );
        assert_eq!(swept.iter().map(|r| r.freed_bytes).sum::<u64>(), 200 << 10);
        assert!(
            swept.iter().map(|r| r.referenced_bytes).sum::<u64>() >= 300 << 10,
            "{swept:?}"
        );
        match read_keys(&vol, &leaked).await {
            Err(DataCallError::Data(DataError::NotFound(_))) => {}
            other => panic!(
                "the leaked extent is still readable: {:?}",
                other.map(|b| b.len())
            ),
        }
        // Committed files are intact.
        assert_eq!(
            read_keys(&vol, &kept_keys).await.unwrap(),
            content(1, 300 << 10)
        );
        let fh = fs.open(small.attr.ino, OpenFlags::READ).await.unwrap();
        assert_eq!(
            fs.read(fh, 0, 1 << 20).await.unwrap(),
            Bytes::from(content(2, 5000))
        );
        fs.release(fh).await.unwrap();
        // A second sweep finds nothing left, and `vol info` shows the partitions' figures.
        let again = admin.sweep("v", Duration::ZERO).await.unwrap();
        assert_eq!(again.iter().map(|r| r.unreferenced).sum::<u64>(), 0);
        let info = admin.volume("v").await.unwrap();
        assert_eq!(info.gc.unswept, 0, "{:?}", info.gc);
        assert_eq!(info.gc.unreferenced_bytes, 0);
        assert!(info.gc.referenced_bytes >= 300 << 10, "{:?}", info.gc);
        // The release went through Raft: the extent's files are gone from every replica (renamed
        // out of the extent namespace at once, removed or recycled later).
        // Followers apply the release a moment after the leader: wait for it (bounded).
        let root = dir.path().to_path_buf();
        let files: Vec<std::path::PathBuf> = leaked_extents
            .iter()
            .flat_map(|(p, e)| {
                let root = root.clone();
                (0..3).map(move |i| {
                    root.join(format!("data-{i}"))
                        .join("extents")
                        .join(p.0.to_string())
                        .join(format!("{}.data", e.0))
                })
            })
            .collect();
        let deadline = Instant::now() + Duration::from_secs(10);
        while let Some(f) = files.iter().find(|f| f.exists()) {
            assert!(Instant::now() < deadline, "{} is still there", f.display());
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        shut_down(&msgr).await;
    });
}

#[test]
fn a_client_commits_streamed_runs_in_time_and_never_past_its_bound() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let dir = tempfile::tempdir().unwrap();
    let c = start_cluster(dir.path());
    runtime().block_on(async {
        let (msgr, mc) = client_with_volume(&c.master_addr).await;
        let me = Caller { uid: 0, gid: 0 };
        let data = Bytes::from(content(4, 1 << 20));
        // A bound of 0: any streamed run's commit comes too late and fails, committing nothing.
        let strict = NetFs::with_config(
            open_volume(&msgr, &mc).await,
            NetFsConfig {
                commit_within: Duration::ZERO,
                commit_every: Duration::from_secs(3600),
                ..NetFsConfig::default()
            },
        );
        let (late, fh) = strict
            .create(ROOT_INO, b"late", 0o644, me, OpenFlags::READ_WRITE)
            .await
            .unwrap();
        strict.write(fh, 0, data.clone()).await.unwrap();
        match strict.fsync(fh).await {
            Err(FsError::WriteFailed(m)) => assert!(m.contains("nothing committed"), "{m}"),
            other => panic!("a commit past the bound answered {other:?}"),
        }
        let _ = strict.release(fh).await;
        let fresh = NetFs::new(open_volume(&msgr, &mc).await);
        assert_eq!(fresh.getattr(late.attr.ino).await.unwrap().size, 0);

        // A file left open after a write: the client commits its streamed bytes by itself.
        let eager = NetFs::with_config(
            open_volume(&msgr, &mc).await,
            NetFsConfig {
                commit_every: Duration::from_millis(100),
                ..NetFsConfig::default()
            },
        );
        let (open, fh) = eager
            .create(ROOT_INO, b"open", 0o644, me, OpenFlags::READ_WRITE)
            .await
            .unwrap();
        eager.write(fh, 0, data.clone()).await.unwrap();
        // Seen by another client once committed: wait for that (bounded), no fixed sleep.
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let size = fresh.getattr(open.attr.ino).await.unwrap().size;
            if size == data.len() as u64 {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "the open file's streamed bytes were not committed: size {size}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        eager.release(fh).await.unwrap();
        let fh = fresh.open(open.attr.ino, OpenFlags::READ).await.unwrap();
        let mut back = Vec::new();
        loop {
            let b = fresh.read(fh, back.len() as u64, 1 << 20).await.unwrap();
            if b.is_empty() {
                break;
            }
            back.extend_from_slice(&b);
        }
        assert_eq!(back, data.to_vec());
        shut_down(&msgr).await;
    });
}
