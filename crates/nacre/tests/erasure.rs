//! Erasure-coded volumes through the network client: every byte read back as written, stored as
//! stripes of one shard per replica, and read back whole, by reconstruction, with a data node
//! killed.
#![allow(clippy::unwrap_used)]

use std::sync::Arc;

use bytes::Bytes;
use fastrand::Rng;
use nacre_api::master::{VolumeFuncs, parse_ec};
use nacre_api::meta::{ROOT_INO, SetAttr};
use nacre_client::{Caller, FileSystem, NetFs, NetFsConfig, OpenFlags};
use nacre_types::Ino;

mod common;
use common::cluster::{ONE_AT_A_TIME, client_with_volume, create_named, open_named, runtime};
use common::cluster::{read_file, same, start_master_with};
use common::cluster::{shut_down, start_cluster, start_node, wait_writable};
use common::{Proc, free_port};

const ME: Caller = Caller { uid: 0, gid: 0 };

fn coded(ec: &str) -> VolumeFuncs {
    VolumeFuncs {
        ec: Some(parse_ec(ec).unwrap()),
        ..VolumeFuncs::default()
    }
}

/// 1 to `max` random bytes (incompressible, as erasure coding does not care).
fn random(rng: &mut Rng, max: usize) -> Vec<u8> {
    let n = 1 + rng.usize(..max);
    (0..n).map(|_| rng.u8(..)).collect()
}

/// Writes `n` files of up to `max` random bytes into a new directory `dir` and returns them.
async fn write_files(
    fs: &NetFs,
    rng: &mut Rng,
    dir: &str,
    n: usize,
    max: usize,
) -> Vec<(String, Ino, Vec<u8>)> {
    let d = fs
        .mkdir(ROOT_INO, dir.as_bytes(), 0o755, ME)
        .await
        .unwrap()
        .attr
        .ino;
    let mut files = Vec::new();
    for i in 0..n {
        let name = format!("{dir}/{i}");
        let data = random(rng, max);
        let (e, fh) = fs
            .create(d, i.to_string().as_bytes(), 0o644, ME, OpenFlags::WRITE)
            .await
            .unwrap();
        fs.write(fh, 0, Bytes::copy_from_slice(&data))
            .await
            .unwrap();
        fs.flush(fh).await.unwrap();
        fs.release(fh).await.unwrap();
        files.push((name, e.attr.ino, data));
    }
    files
}

async fn check_files(fs: &NetFs, files: &[(String, Ino, Vec<u8>)]) {
    for (name, ino, model) in files {
        if let Err(e) = same(&read_file(fs, *ino).await, model) {
            panic!("{name}: {e}");
        }
    }
}

/// Large files (several runs of whole blocks, then overwrites and a truncate) through `fs`,
/// and small files written behind through `small`; bytes with 4 bits of entropy each when
/// `compressible`.
async fn write_mixed(
    fs: &NetFs,
    small: &NetFs,
    seed: u64,
    compressible: bool,
) -> Vec<(String, Ino, Vec<u8>)> {
    let mut rng = Rng::with_seed(seed);
    let bytes = |rng: &mut Rng, max: usize| {
        let mut b = random(rng, max);
        if compressible {
            b.iter_mut().for_each(|x| *x = b'a' + *x % 16);
        }
        b
    };
    let mut files: Vec<(String, Ino, Vec<u8>)> = Vec::new();
    // Large files (several runs of whole blocks), then overwrites and a truncate.
    for i in 0..3 {
        let name = format!("big{i}");
        let (e, fh) = fs
            .create(ROOT_INO, name.as_bytes(), 0o644, ME, OpenFlags::READ_WRITE)
            .await
            .unwrap();
        let mut model = bytes(&mut rng, 5 << 20);
        let mut at = 0;
        while at < model.len() {
            let end = (at + (128 << 10)).min(model.len());
            let piece = Bytes::copy_from_slice(&model[at..end]);
            fs.write(fh, at as u64, piece).await.unwrap();
            at = end;
        }
        fs.flush(fh).await.unwrap();
        for _ in 0..20 {
            let off = rng.usize(..model.len() + (64 << 10));
            let data = bytes(&mut rng, 30 << 10);
            fs.write(fh, off as u64, Bytes::copy_from_slice(&data))
                .await
                .unwrap();
            if model.len() < off + data.len() {
                model.resize(off + data.len(), 0);
            }
            model[off..off + data.len()].copy_from_slice(&data);
        }
        fs.flush(fh).await.unwrap();
        let size = rng.usize(..model.len());
        fs.setattr(
            e.attr.ino,
            SetAttr {
                size: Some(size as u64),
                ..SetAttr::default()
            },
        )
        .await
        .unwrap();
        model.truncate(size);
        fs.release(fh).await.unwrap();
        files.push((name, e.attr.ino, model));
    }
    // Small files written behind, packed into shared tiny extents, stripe by stripe.
    let d = small
        .mkdir(ROOT_INO, b"d", 0o755, ME)
        .await
        .unwrap()
        .attr
        .ino;
    for i in 0..60 {
        let name = format!("s{i}");
        let data = bytes(&mut rng, 12_000);
        let (e, fh) = small
            .create(d, name.as_bytes(), 0o644, ME, OpenFlags::WRITE)
            .await
            .unwrap();
        small
            .write(fh, 0, Bytes::copy_from_slice(&data))
            .await
            .unwrap();
        small.flush(fh).await.unwrap();
        small.release(fh).await.unwrap();
        files.push((name, e.attr.ino, data));
    }
    small.sync_dir(d).await.unwrap();
    files
}

#[test]
fn an_erasure_coded_volume_reads_every_byte_back_with_a_data_node_killed() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let dir = tempfile::tempdir().unwrap();
    let mut cluster = start_cluster(dir.path());
    runtime().block_on(async {
        let (msgr, mc) = client_with_volume(&cluster.master_addr).await;
        create_named(&mc, "ec", coded("2+1")).await;
        let zstd = VolumeFuncs {
            compress: Some("zstd".parse().unwrap()),
            ..coded("2+1")
        };
        create_named(&mc, "ecz", zstd).await;
        let behind = NetFsConfig {
            write_behind: true,
            flush_delay: Some(std::time::Duration::from_millis(20)),
            ..NetFsConfig::default()
        };
        let mut volumes = Vec::new();
        for (name, compressible) in [("ec", false), ("ecz", true)] {
            let fs = NetFs::new(open_named(&msgr, &mc, name).await);
            let small = NetFs::with_config(open_named(&msgr, &mc, name).await, behind.clone());
            let files = write_mixed(&fs, &small, 20261207, compressible).await;
            volumes.push((name, files));
        }
        for (name, files) in &volumes {
            let other = NetFs::new(open_named(&msgr, &mc, name).await);
            for (file, ino, _) in files {
                let (_, keys) = other.meta().extents(*ino).await.unwrap();
                assert!(
                    keys.iter().all(|k| k.framed.is_some()),
                    "{name} {file}: every key names a stripe's frame"
                );
            }
            check_files(&other, files).await;
        }
        // Compressible bytes take less room than they hold.
        let usage = NetFs::new(open_named(&msgr, &mc, "ecz").await)
            .meta()
            .usage()
            .await
            .unwrap();
        assert!(
            usage.stored_bytes * 10 < usage.logical_bytes * 7,
            "{usage:?}"
        );

        // The data node of the first partition's shard 0 stopped, holding its connections and
        // answering nothing: reads of its shards go to the others after a first attempt, not
        // after the call's timeout (3 s).
        let view = mc.volume("ec").await.unwrap();
        let first = &view.data_partitions[0].spec.replicas[0].addr;
        let dead = cluster.data_addrs.iter().position(|a| a == first).unwrap();
        cluster.datas[dead].as_ref().unwrap().pause();
        let mut slowest = std::time::Duration::ZERO;
        for (name, files) in &volumes {
            let cut_off = NetFs::new(open_named(&msgr, &mc, name).await);
            for (file, ino, model) in files {
                let started = std::time::Instant::now();
                let got = read_file(&cut_off, *ino).await;
                slowest = slowest.max(started.elapsed());
                if let Err(e) = same(&got, model) {
                    panic!("{name} {file}: {e}");
                }
            }
        }
        assert!(
            slowest < std::time::Duration::from_secs(2),
            "a file took {slowest:?} to read with a replica cut off"
        );
        cluster.datas[dead].as_ref().unwrap().resume();

        // The same node gone: every stripe there misses a data shard and is rebuilt from the
        // other data shard and the parity.
        cluster.datas[dead].take().unwrap().kill();
        for (name, files) in &volumes {
            let degraded = NetFs::new(open_named(&msgr, &mc, name).await);
            check_files(&degraded, files).await;
        }

        // Two of three: more shards lost than the code rebuilds. Reads fail, they return no
        // made-up bytes.
        let second = (0..3).find(|&i| cluster.datas[i].is_some()).unwrap();
        cluster.datas[second].take().unwrap().kill();
        let mut vol = open_named(&msgr, &mc, "ec").await;
        // Reads ride out too few shards for `retry_for` before they fail: not 15 s here.
        Arc::get_mut(&mut vol).unwrap().retry_for = std::time::Duration::from_secs(2);
        let lost = NetFs::new(vol);
        let (_, ino, _) = &volumes[0].1[0];
        let fh = lost.open(*ino, OpenFlags::READ).await.unwrap();
        let r = lost.read(fh, 0, 1 << 20).await;
        assert!(r.is_err(), "read with two of three shards gone: {r:?}");
        shut_down(&msgr).await;
    });
}

#[test]
fn a_lost_data_node_s_shards_are_rebuilt_on_another_and_serve_reads() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let dir = tempfile::tempdir().unwrap();
    let master_addr = format!("127.0.0.1:{}", free_port());
    // A silent node is down after 2 s, and its erasure-coded replicas move half a second later.
    let _master = start_master_with(
        &master_addr,
        dir.path(),
        &[
            ("NACRE_MASTER__NODE_TIMEOUT_MS", "2000".into()),
            ("NACRE_MASTER__REBUILD_AFTER_MS", "500".into()),
        ],
    );
    let mut procs: Vec<Proc> = Vec::new();
    let mut datas: Vec<(String, Option<Proc>)> = Vec::new();
    for i in 0..3 {
        let a = format!("127.0.0.1:{}", free_port());
        procs.push(start_node("meta", i, &a, &master_addr, dir.path()));
    }
    for i in 0..4 {
        let a = format!("127.0.0.1:{}", free_port());
        let p = start_node("data", i, &a, &master_addr, dir.path());
        datas.push((a, Some(p)));
    }
    for p in procs
        .iter_mut()
        .chain(datas.iter_mut().filter_map(|(_, p)| p.as_mut()))
    {
        p.wait_log(
            "registered with the master",
            std::time::Duration::from_secs(30),
        );
    }
    runtime().block_on(async {
        let (msgr, mc) = client_with_volume(&master_addr).await;
        create_named(&mc, "ec", coded("2+1")).await;
        let fs = NetFs::new(open_named(&msgr, &mc, "ec").await);
        let mut rng = Rng::with_seed(7);
        let mut files = write_files(&fs, &mut rng, "small", 40, 20_000).await;
        files.extend(write_files(&fs, &mut rng, "large", 4, 3 << 20).await);

        // A node holding a replica of the first partition dies for good.
        let view = mc.volume("ec").await.unwrap();
        let part = &view.data_partitions[0];
        let holders: Vec<String> = part.spec.replicas.iter().map(|r| r.addr.clone()).collect();
        let lost = datas.iter().position(|(a, _)| *a == holders[0]).unwrap();
        datas[lost].1.take().unwrap().kill();
        // The master moves its replicas to the fourth node, which rebuilds them; then the
        // partitions are writable again.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        loop {
            let v = mc.volume("ec").await.unwrap();
            let moved = v
                .data_partitions
                .iter()
                .all(|p| p.spec.replicas.iter().all(|r| r.addr != holders[0]));
            if moved {
                break;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "replicas not moved off the lost node"
            );
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        }
        wait_writable(&mc, "ec", std::time::Duration::from_secs(60)).await;

        // Another original holder dies too: each stripe of the first partition now needs the
        // rebuilt shard.
        let second = datas.iter().position(|(a, _)| *a == holders[1]).unwrap();
        datas[second].1.take().unwrap().kill();
        let reader = NetFs::new(open_named(&msgr, &mc, "ec").await);
        check_files(&reader, &files).await;
        shut_down(&msgr).await;
    });
}
