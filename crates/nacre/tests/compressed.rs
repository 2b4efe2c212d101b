//! Compressed volumes through the network client: every byte read back as written (against a
//! byte model), stored in checksummed frames that take less room than the data, written behind
//! like any small file, and compressed on the function servers with the fallback the volume
//! names when one is killed under load.
#![allow(clippy::unwrap_used)]

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use fastrand::Rng;
use nacre_api::master::{FuncAt, VolumeFuncs};
use nacre_api::meta::{ExtentKey, ROOT_INO, SetAttr};
use nacre_client::{Caller, FileSystem, FsError, NetFs, NetFsConfig, OpenFlags};
use nacre_types::Ino;

mod common;
use common::cluster::{
    ONE_AT_A_TIME, client_with_volume, create_named, open_named, read_file, runtime, same,
    shut_down, start_cluster, start_node,
};
use common::free_port;

const ME: Caller = Caller { uid: 0, gid: 0 };

fn zstd(at: FuncAt, fallback_inline: bool) -> VolumeFuncs {
    VolumeFuncs {
        compress: Some("zstd".parse().unwrap()),
        at,
        fallback_inline,
        ec: None,
    }
}

/// Text-like bytes: words of a small vocabulary, so that they compress.
fn text(rng: &mut Rng, n: usize) -> Bytes {
    const WORDS: [&str; 12] = [
        "nacre ",
        "extent ",
        "frame ",
        "block ",
        "partition ",
        "raft ",
        "leader ",
        "replica ",
        "client ",
        "volume\n",
        "data ",
        "meta ",
    ];
    let mut out = Vec::with_capacity(n + 16);
    while out.len() < n {
        out.extend_from_slice(WORDS[rng.usize(..WORDS.len())].as_bytes());
    }
    out.truncate(n);
    Bytes::from(out)
}

fn write_model(model: &mut Vec<u8>, off: u64, data: &[u8]) {
    let end = off as usize + data.len();
    if model.len() < end {
        model.resize(end, 0);
    }
    model[off as usize..end].copy_from_slice(data);
}

/// The bytes the keys of `keys` take in their extents: each frame once, however many keys
/// share it.
fn stored_bytes(keys: &[ExtentKey]) -> u64 {
    let mut ranges: Vec<_> = keys
        .iter()
        .map(|k| {
            let (from, to) = k.stored_range();
            (k.partition, k.extent, from, to - from)
        })
        .collect();
    ranges.sort_unstable();
    ranges.dedup();
    ranges.iter().map(|r| r.3).sum()
}

#[test]
fn a_compressed_volume_reads_back_every_write_from_frames_that_take_less_room() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let dir = tempfile::tempdir().unwrap();
    let cluster = start_cluster(dir.path());
    runtime().block_on(async {
        let (msgr, mc) = client_with_volume(&cluster.master_addr).await;
        create_named(&mc, "z", zstd(FuncAt::Inline, true)).await;
        let fs = NetFs::new(open_named(&msgr, &mc, "z").await);
        let mut rng = Rng::with_seed(43);
        let mut files: Vec<(Ino, Vec<u8>)> = Vec::new();
        for i in 0..3 {
            let (e, fh) = fs
                .create(
                    ROOT_INO,
                    format!("f{i}").as_bytes(),
                    0o644,
                    ME,
                    OpenFlags::READ_WRITE,
                )
                .await
                .unwrap();
            files.push((e.attr.ino, Vec::new()));
            fs.release(fh).await.unwrap();
        }
        let mut log = Vec::new();
        for step in 0..240 {
            let k = rng.usize(..files.len());
            let (ino, model) = &mut files[k];
            let len = model.len() as u64;
            let fh = fs.open(*ino, OpenFlags::READ_WRITE).await.unwrap();
            match rng.u32(..10) {
                // Appends, up to past the run's commit of whole blocks (2 MiB).
                0..=3 => {
                    let n = if rng.u32(..6) == 0 {
                        1 + rng.usize(..3 << 20)
                    } else {
                        1 + rng.usize(..40 << 10)
                    };
                    let data = text(&mut rng, n);
                    log.push(format!("{step}: f{k} append {n} at {len}"));
                    let mut at = 0;
                    while at < n {
                        let piece = data.slice(at..(at + (128 << 10)).min(n));
                        fs.write(fh, len + at as u64, piece.clone()).await.unwrap();
                        at += piece.len();
                    }
                    write_model(model, len, &data);
                }
                // Overwrites inside (a part of a frame), or past the end (a hole).
                4..=6 => {
                    let off = if rng.bool() {
                        rng.u64(..len + 1)
                    } else {
                        len + rng.u64(..100 << 10)
                    };
                    let n = 1 + rng.usize(..20 << 10);
                    let data = text(&mut rng, n);
                    log.push(format!("{step}: f{k} write {n} at {off} (size {len})"));
                    fs.write(fh, off, data.clone()).await.unwrap();
                    write_model(model, off, &data);
                }
                7 => {
                    let size = rng.u64(..len + (64 << 10));
                    log.push(format!("{step}: f{k} truncate {size} (size {len})"));
                    fs.setattr(
                        *ino,
                        SetAttr {
                            size: Some(size),
                            ..SetAttr::default()
                        },
                    )
                    .await
                    .unwrap();
                    model.resize(size as usize, 0);
                }
                _ => {
                    let off = rng.u64(..len + 1);
                    let n = 1 + rng.u32(..200 << 10);
                    let got = fs.read(fh, off, n).await.unwrap();
                    let from = (off as usize).min(model.len());
                    let to = (from + n as usize).min(model.len());
                    if let Err(e) = same(&got, &model[from..to]) {
                        panic!(
                            "step {step}: f{k} read {n} at {off}: {e}; ops:\n{}",
                            log.join("\n")
                        );
                    }
                }
            }
            fs.flush(fh).await.unwrap();
            fs.release(fh).await.unwrap();
        }
        // Another client reads every file from its keys, all framed, and they take less room
        // than the data (zstd on text: several times less).
        let other = NetFs::new(open_named(&msgr, &mc, "z").await);
        let (mut logical, mut stored) = (0u64, 0u64);
        for (i, (ino, model)) in files.iter().enumerate() {
            if let Err(e) = same(&read_file(&other, *ino).await, model) {
                panic!("f{i}: {e}; ops:\n{}", log.join("\n"));
            }
            let (attr, keys) = other.meta().extents(*ino).await.unwrap();
            assert_eq!(attr.size, model.len() as u64);
            assert!(
                keys.iter().all(|k| k.framed.is_some()),
                "f{i}: a key is not framed"
            );
            logical += keys.iter().map(|k| u64::from(k.size)).sum::<u64>();
            stored += stored_bytes(&keys);
        }
        // What `vol info` shows: the same figures, summed by the meta partitions.
        let u = other.meta().usage().await.unwrap();
        assert_eq!(
            (u.files, u.logical_bytes, u.stored_bytes),
            (3, logical, stored)
        );
        assert!(logical > 4 << 20, "the sequence wrote {logical} bytes");
        assert!(
            stored * 2 < logical,
            "{stored} bytes stored for {logical} bytes of text"
        );
        shut_down(&msgr).await;
    });
}

#[test]
fn small_files_on_a_compressed_volume_are_written_behind_and_synced() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let dir = tempfile::tempdir().unwrap();
    let cluster = start_cluster(dir.path());
    runtime().block_on(async {
        let (msgr, mc) = client_with_volume(&cluster.master_addr).await;
        create_named(&mc, "z", zstd(FuncAt::Inline, true)).await;
        let cfg = NetFsConfig {
            write_behind: true,
            flush_delay: Some(Duration::from_millis(20)),
            ..NetFsConfig::default()
        };
        let fs = NetFs::with_config(open_named(&msgr, &mc, "z").await, cfg);
        let d = fs.mkdir(ROOT_INO, b"d", 0o755, ME).await.unwrap().attr.ino;
        let mut rng = Rng::with_seed(7);
        let mut files = Vec::new();
        for i in 0..200 {
            let (e, fh) = fs
                .create(d, format!("f{i}").as_bytes(), 0o644, ME, OpenFlags::WRITE)
                .await
                .unwrap();
            let n = 1 + rng.usize(..(if i % 20 == 0 { 300 << 10 } else { 9000 }));
            let data = text(&mut rng, n);
            fs.write(fh, 0, data.clone()).await.unwrap();
            fs.flush(fh).await.unwrap();
            fs.release(fh).await.unwrap();
            files.push((e.attr.ino, data));
        }
        fs.sync_dir(d).await.unwrap();
        let other = NetFs::new(open_named(&msgr, &mc, "z").await);
        for (i, (ino, data)) in files.iter().enumerate() {
            if let Err(e) = same(&read_file(&other, *ino).await, data) {
                panic!("f{i}: {e}");
            }
            let (_, keys) = other.meta().extents(*ino).await.unwrap();
            assert!(
                keys.iter().all(|k| k.framed.is_some()),
                "f{i}: a key is not framed"
            );
        }
        shut_down(&msgr).await;
    });
}

/// Writes 700 KiB of text (seeded by `seed`) to a new file `name` and closes it.
async fn write_text(fs: &NetFs, name: &str, seed: u64) -> Result<(Ino, Bytes), FsError> {
    let data = text(&mut Rng::with_seed(seed), 700 << 10);
    let (e, fh) = fs
        .create(ROOT_INO, name.as_bytes(), 0o644, ME, OpenFlags::WRITE)
        .await?;
    fs.write(fh, 0, data.clone()).await?;
    let r = fs.flush(fh).await;
    fs.release(fh).await.ok();
    r.map(|()| (e.attr.ino, data))
}

#[test]
fn writes_compressed_on_function_servers_ride_out_their_death_by_the_volumes_policy() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let dir = tempfile::tempdir().unwrap();
    let cluster = start_cluster(dir.path());
    let addr = format!("127.0.0.1:{}", free_port());
    let mut func = start_node("func", 0, &addr, &cluster.master_addr, dir.path());
    func.wait_log("function server registered", Duration::from_secs(30));
    runtime().block_on(async {
        let (msgr, mc) = client_with_volume(&cluster.master_addr).await;
        create_named(&mc, "fall", zstd(FuncAt::Service, true)).await;
        create_named(&mc, "strict", zstd(FuncAt::Service, false)).await;
        let fall = NetFs::new(open_named(&msgr, &mc, "fall").await);
        let strict = NetFs::new(open_named(&msgr, &mc, "strict").await);
        let b = write_text(&strict, "b", 11).await.unwrap();
        // Four writers on the volume that may fall back; the server is killed while they are
        // in the middle of their files (after each finished its first).
        let done = Arc::new(tokio::sync::Semaphore::new(0));
        let mut writers = tokio::task::JoinSet::new();
        for t in 0..4u64 {
            let (fs, done) = (fall.clone(), done.clone());
            writers.spawn(async move {
                let mut files = Vec::new();
                for i in 0..5 {
                    let name = format!("w{t}-{i}");
                    let f = write_text(&fs, &name, t * 10 + i).await;
                    files.push((name, f));
                    done.add_permits(1);
                }
                files
            });
        }
        drop(done.acquire_many(4).await.unwrap());
        func.kill();
        let mut written = Vec::new();
        while let Some(r) = writers.join_next().await {
            for (name, f) in r.unwrap() {
                match f {
                    Ok(f) => written.push(f),
                    Err(e) => panic!("{name}: a write failed though the volume falls back: {e}"),
                }
            }
        }
        // The server is gone: the strict volume fails the write with an error that says why.
        match write_text(&strict, "d", 12).await {
            Err(FsError::Func(e)) => assert!(
                e.to_string()
                    .contains("no function server could run compress"),
                "{e}"
            ),
            other => panic!("a strict volume wrote without its function server: {other:?}"),
        }
        let other = NetFs::new(open_named(&msgr, &mc, "fall").await);
        assert_eq!(written.len(), 20);
        for (ino, data) in &written {
            same(&read_file(&other, *ino).await, data).unwrap();
        }
        let other = NetFs::new(open_named(&msgr, &mc, "strict").await);
        same(&read_file(&other, b.0).await, &b.1).unwrap();
        shut_down(&msgr).await;
    });
}
