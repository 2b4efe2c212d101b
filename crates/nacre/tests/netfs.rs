//! `NetFs`, the SDK's `FileSystem` over the network, against real `nacre server` processes (1
//! master, 3 meta and 3 data nodes): a file changed by a long random sequence of writes (appends,
//! overwrites in place, writes into holes and past the end), truncates, `fallocate` in every
//! mode, flushes, reopens and `O_APPEND` writes reads back exactly like a byte-vector model,
//! from this client and from a fresh one; small files land in tiny extents in one packet and
//! read back; a file unlinked while open stays readable and writable through its handle until
//! released.
#![allow(clippy::unwrap_used)] // test helpers outside #[test] fns

use std::sync::Arc;

use bytes::Bytes;
use fastrand::Rng;
use nacre_api::meta::{ROOT_INO, SetAttr};
use nacre_client::netfs::HIDDEN_PREFIX;
use nacre_client::{Caller, Falloc, FileSystem, FsError, HideStep, NetFs, NetFsConfig, OpenFlags};
use nacre_data::store::ExtentStore;

mod common;
use common::cluster::{
    ONE_AT_A_TIME, client_with_volume, open_volume, runtime, shut_down, start_cluster,
};

/// `n` bytes from a seeded generator, so a failure replays exactly.
fn random_bytes(rng: &mut Rng, n: usize) -> Bytes {
    let mut v = vec![0; n];
    rng.fill(&mut v);
    Bytes::from(v)
}

/// Where two byte strings first differ, for failure messages.
fn first_diff(a: &[u8], b: &[u8]) -> String {
    match a.iter().zip(b).position(|(x, y)| x != y) {
        Some(i) => format!(
            "first difference at {i} (lengths {} / {})",
            a.len(),
            b.len()
        ),
        None => format!("lengths {} / {}", a.len(), b.len()),
    }
}

/// The seed and the last operations, for failure messages.
fn log_tail(log: &[String]) -> String {
    let tail = &log[log.len().saturating_sub(12).max(1)..];
    format!("{}\n{}", log[0], tail.join("\n"))
}

fn write_model(model: &mut Vec<u8>, off: u64, data: &[u8]) {
    let end = off as usize + data.len();
    if model.len() < end {
        model.resize(end, 0);
    }
    model[off as usize..end].copy_from_slice(data);
}

/// A client of the volume that writes small files behind, sent `flush_ms` after their close.
async fn writing_behind(
    msgr: &nacre_msgr::Messenger,
    mc: &nacre_client::MasterClient,
    flush_ms: u64,
) -> NetFs {
    let cfg = NetFsConfig {
        write_behind: true,
        flush_delay: Some(std::time::Duration::from_millis(flush_ms)),
        ..NetFsConfig::default()
    };
    NetFs::with_config(open_volume(msgr, mc).await, cfg)
}

/// Opens `ino` with `O_TRUNC`, writes `data` and closes it.
async fn rewrite(fs: &NetFs, ino: nacre_types::Ino, data: Bytes) {
    let trunc = OpenFlags {
        truncate: true,
        ..OpenFlags::WRITE
    };
    let h = fs.open(ino, trunc).await.unwrap();
    fs.write(h, 0, data).await.unwrap();
    fs.flush(h).await.unwrap();
    fs.release(h).await.unwrap();
}

/// Each of `files` (inode, name, bytes) has exactly its bytes, as `fs` reads it.
async fn expect_files(fs: &NetFs, files: &[(nacre_types::Ino, String, Bytes)]) {
    for (ino, name, want) in files {
        let size = fs.getattr(*ino).await.unwrap().size;
        assert_eq!(size, want.len() as u64, "{name}: size");
        let r = fs.open(*ino, OpenFlags::READ).await.unwrap();
        let got = read_all(fs, r, want.len() + 1).await;
        fs.release(r).await.unwrap();
        assert!(got == want[..], "{name}: {}", first_diff(&got, want));
    }
}

async fn read_all(fs: &NetFs, fh: nacre_client::Fh, len: usize) -> Vec<u8> {
    let mut out = Vec::new();
    loop {
        let b = fs.read(fh, out.len() as u64, 1 << 20).await.unwrap();
        if b.is_empty() {
            break;
        }
        out.extend_from_slice(&b);
        assert!(out.len() <= len, "read past the end: {} > {len}", out.len());
    }
    out
}

#[test]
fn netfs_files_match_a_byte_model_across_writes_truncates_and_reopens() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let dir = tempfile::tempdir().unwrap();
    let cluster = start_cluster(dir.path());
    runtime().block_on(async {
        let (msgr, mc) = client_with_volume(&cluster.master_addr).await;
        let connect = || async { NetFs::new(open_volume(&msgr, &mc).await) };
        let fs = connect().await;
        let me = Caller { uid: 0, gid: 0 };

        // A long random sequence on one file against a model.
        let (attr, mut fh) = fs
            .create(ROOT_INO, b"f", 0o644, me, OpenFlags::READ_WRITE)
            .await
            .unwrap();
        let ino = attr.attr.ino;
        let mut model: Vec<u8> = Vec::new();
        let mut log: Vec<String> = Vec::new();
        // NACRE_TEST_SEED (hex) and NACRE_TEST_STEPS replay or lengthen the sequence.
        let seed = std::env::var("NACRE_TEST_SEED")
            .ok()
            .and_then(|s| u64::from_str_radix(s.trim_start_matches("0x"), 16).ok())
            .unwrap_or(0x5eed_1234_abcd_0001);
        let steps: u32 = std::env::var("NACRE_TEST_STEPS")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(500);
        log.push(format!("seed {seed:#x}"));
        let mut rng = Rng::with_seed(seed);
        for step in 0..steps {
            let len = model.len() as u64;
            match rng.u64(..13) {
                0..=4 => {
                    let off = match rng.u64(..4) {
                        0 | 1 => len,                    // append
                        2 => rng.u64(..len + 1),         // inside (overwrite)
                        _ => len + rng.u64(..200 << 10), // past the end: a hole
                    };
                    let n = if rng.u64(..3) == 0 {
                        1 + rng.u64(..400 << 10)
                    } else {
                        1 + rng.u64(..8 << 10)
                    } as usize;
                    let data = random_bytes(&mut rng, n);
                    log.push(format!("{step}: write {off}+{n} (size {len})"));
                    let took = fs.write(fh, off, data.clone()).await.unwrap();
                    assert_eq!(took as usize, n, "step {step}");
                    write_model(&mut model, off, &data);
                }
                5 | 6 => {
                    let off = rng.u64(..len + 10);
                    let n = 1 + rng.u64(..300 << 10) as u32;
                    let got = fs.read(fh, off, n).await.unwrap();
                    let from = (off as usize).min(model.len());
                    let to = (off as usize + n as usize).min(model.len());
                    assert_eq!(got.len(), to - from, "step {step}: read {off}+{n} of {len}");
                    assert!(
                        got[..] == model[from..to],
                        "step {step}: read {off}+{n}: {}; ops:\n{}",
                        first_diff(&got, &model[from..to]),
                        log_tail(&log)
                    );
                }
                7 => {
                    log.push(format!("{step}: flush"));
                    fs.flush(fh).await.unwrap();
                }
                8 => {
                    let size = rng.u64(..len + (100 << 10));
                    log.push(format!("{step}: truncate {size} (size {len})"));
                    let a = fs
                        .setattr(
                            ino,
                            SetAttr {
                                size: Some(size),
                                ..SetAttr::default()
                            },
                        )
                        .await
                        .unwrap();
                    assert_eq!(a.size, size, "step {step}");
                    model.resize(size as usize, 0);
                }
                9 => {
                    log.push(format!("{step}: reopen"));
                    fs.release(fh).await.unwrap();
                    fh = fs.open(ino, OpenFlags::READ_WRITE).await.unwrap();
                }
                10 => {
                    let ah = fs
                        .open(
                            ino,
                            OpenFlags {
                                append: true,
                                ..OpenFlags::WRITE
                            },
                        )
                        .await
                        .unwrap();
                    let n = 1 + rng.u64(..20 << 10) as usize;
                    let data = random_bytes(&mut rng, n);
                    log.push(format!("{step}: O_APPEND write {n} (size {len})"));
                    // The offset named is ignored with O_APPEND.
                    fs.write(ah, 0, data.clone()).await.unwrap();
                    let end = model.len() as u64;
                    write_model(&mut model, end, &data);
                    fs.release(ah).await.unwrap();
                }
                11 => {
                    let off = rng.u64(..len + 10);
                    let n = 1 + rng.u64(..300 << 10);
                    let mode = match rng.u64(..5) {
                        0 => Falloc::Allocate,
                        1 => Falloc::KeepSize,
                        2 => Falloc::PunchHole,
                        3 => Falloc::ZeroRange { keep_size: false },
                        _ => Falloc::ZeroRange { keep_size: true },
                    };
                    log.push(format!("{step}: fallocate {mode:?} {off}+{n} (size {len})"));
                    fs.fallocate(fh, mode, off, n).await.unwrap();
                    let end = (off + n) as usize;
                    if mode.punches() && (off as usize) < model.len() {
                        let to = end.min(model.len());
                        model[off as usize..to].fill(0);
                    }
                    if !mode.keeps_size() && model.len() < end {
                        model.resize(end, 0);
                    }
                }
                _ => {
                    let all = read_all(&fs, fh, model.len()).await;
                    assert!(
                        all == model,
                        "step {step}: whole file differs: {}; ops:\n{}",
                        first_diff(&all, &model),
                        log_tail(&log)
                    );
                }
            }
        }
        fs.release(fh).await.unwrap();
        assert_eq!(fs.getattr(ino).await.unwrap().size, model.len() as u64);

        // Another client sees exactly the same bytes.
        let other = connect().await;
        let fh2 = other.open(ino, OpenFlags::READ).await.unwrap();
        assert!(read_all(&other, fh2, model.len()).await == model);
        other.release(fh2).await.unwrap();
        // A read-only handle takes no writes, nor fallocate.
        let ro = fs.open(ino, OpenFlags::READ).await.unwrap();
        assert!(fs.write(ro, 0, Bytes::from_static(b"x")).await.is_err());
        assert!(matches!(
            fs.fallocate(ro, Falloc::PunchHole, 0, 1).await,
            Err(FsError::NotOpenFor(_))
        ));
        fs.release(ro).await.unwrap();

        // Small files: one packet each into a tiny extent, read back by another client.
        let mut small = Vec::new();
        for i in 0..40u64 {
            let name = format!("small.{i}");
            let (a, h) = fs
                .create(ROOT_INO, name.as_bytes(), 0o644, me, OpenFlags::WRITE)
                .await
                .unwrap();
            let n = 1 + rng.u64(..16 << 10) as usize;
            let data = random_bytes(&mut rng, n);
            // Written in pieces, as `cp` of a small file would.
            for (k, piece) in data.chunks(4096).enumerate() {
                fs.write(h, (k * 4096) as u64, Bytes::copy_from_slice(piece))
                    .await
                    .unwrap();
            }
            fs.release(h).await.unwrap();
            small.push((a.attr.ino, data));
        }
        for (ino, data) in &small {
            let (a, keys) = other.meta().extents(*ino).await.unwrap();
            assert_eq!(a.size, data.len() as u64);
            assert_eq!(keys.len(), 1, "{keys:?}");
            assert!(ExtentStore::is_tiny(keys[0].extent), "{keys:?}");
            let h = other.open(*ino, OpenFlags::READ).await.unwrap();
            assert!(read_all(&other, h, data.len()).await == data[..]);
            other.release(h).await.unwrap();
        }
        // Overwriting part of a small file rewrites that range elsewhere; the rest stays.
        let (ino0, data0) = &small[0];
        let h = fs.open(*ino0, OpenFlags::READ_WRITE).await.unwrap();
        fs.write(h, 0, Bytes::from_static(b"HEAD")).await.unwrap();
        fs.release(h).await.unwrap();
        let mut want = data0.to_vec();
        write_model(&mut want, 0, b"HEAD");
        let h = other.open(*ino0, OpenFlags::READ).await.unwrap();
        assert!(read_all(&other, h, want.len()).await == want);
        other.release(h).await.unwrap();

        // A file unlinked while open stays usable through its handle until released.
        let (a, h) = fs
            .create(ROOT_INO, b"tmp", 0o600, me, OpenFlags::READ_WRITE)
            .await
            .unwrap();
        let body = random_bytes(&mut rng, 300 << 10);
        fs.write(h, 0, body.clone()).await.unwrap();
        fs.flush(h).await.unwrap();
        fs.unlink(ROOT_INO, b"tmp").await.unwrap();
        assert!(fs.lookup(ROOT_INO, b"tmp").await.is_err());
        let listed = fs.readdir(ROOT_INO, None, 0).await.unwrap();
        assert!(
            listed.iter().all(|e| e.entry.ino != a.attr.ino),
            "hidden file listed"
        );
        fs.write(h, body.len() as u64, Bytes::from_static(b"tail"))
            .await
            .unwrap();
        let mut want = body.to_vec();
        want.extend_from_slice(b"tail");
        assert!(read_all(&fs, h, want.len()).await == want);
        fs.release(h).await.unwrap();
        // Released: the inode is gone for good.
        assert!(fs.getattr(a.attr.ino).await.is_err());
        let after = fs.readdir(ROOT_INO, None, 0).await.unwrap();
        assert_eq!(after.len(), listed.len());
        let raw = fs.meta().readdir(ROOT_INO, None, 0).await.unwrap();
        assert_eq!(raw.len(), listed.len(), "the hidden name is removed too");

        // An unlink racing the last release of the file it removes (FUSE sends RELEASE after
        // close(2) returns; SQLite deletes its journal right after closing it): wherever between
        // the unlink's steps the release lands, the name and the inode go, and no hidden name is
        // left behind. Landing after the lookup once kept the name (a "deleted" journal that
        // rolled a committed transaction back); landing after the rename leaked the hidden file.
        for step in [HideStep::LookedUp, HideStep::Renamed] {
            let name = format!("race-{step:?}");
            let (a, h) = fs
                .create(ROOT_INO, name.as_bytes(), 0o600, me, OpenFlags::READ_WRITE)
                .await
                .unwrap();
            let (reached_tx, mut reached) = tokio::sync::mpsc::unbounded_channel();
            let go = Arc::new(tokio::sync::Notify::new());
            let hold = go.clone();
            fs.set_hide_hook(Some(Arc::new(move |at| {
                let (tx, hold) = (reached_tx.clone(), hold.clone());
                Box::pin(async move {
                    if at == step {
                        let _ = tx.send(());
                        hold.notified().await;
                    }
                })
            })));
            let unlink = tokio::spawn({
                let (fs, name) = (fs.clone(), name.clone());
                async move { fs.unlink(ROOT_INO, name.as_bytes()).await }
            });
            reached.recv().await.unwrap();
            fs.release(h).await.unwrap();
            go.notify_one();
            unlink.await.unwrap().unwrap();
            fs.set_hide_hook(None);
            assert!(
                fs.lookup(ROOT_INO, name.as_bytes()).await.is_err(),
                "{name}"
            );
            let raw = other.meta().readdir(ROOT_INO, None, 0).await.unwrap();
            assert!(
                raw.iter().all(|e| !e.name.starts_with(HIDDEN_PREFIX)),
                "{name}: a hidden name is left"
            );
            assert!(fs.getattr(a.attr.ino).await.is_err(), "{name}: inode left");
        }

        // Buffered bytes that cannot be committed (another client removed the file) fail the
        // call that commits them, and the next flush reports it again: never a silent success.
        let (_, h) = fs
            .create(ROOT_INO, b"gone", 0o644, me, OpenFlags::READ_WRITE)
            .await
            .unwrap();
        fs.write(h, 0, Bytes::from_static(b"0123456789"))
            .await
            .unwrap();
        other.unlink(ROOT_INO, b"gone").await.unwrap();
        assert!(fs.read(h, 0, 10).await.is_err(), "read commits first");
        assert!(matches!(
            fs.flush(h).await,
            Err(nacre_client::FsError::WriteFailed(_))
        ));
        fs.release(h).await.unwrap();

        shut_down(&msgr).await;
    });
}

/// Where a call is cut: after some scheduler rounds (each polls it at least once), or after some
/// time.
#[derive(Clone, Copy, Debug)]
enum Cut {
    Rounds(usize),
    Micros(u64),
}

/// Polls `fut` until `cut`, then drops it (a caller's timeout or `select!` cutting a call at
/// whatever await it reached). Whether it finished first.
async fn cut_at<F: std::future::Future>(fut: F, cut: Cut) -> bool {
    let mut fut = std::pin::pin!(fut);
    match cut {
        Cut::Rounds(n) => {
            for _ in 0..n {
                tokio::select! {
                    biased;
                    _ = &mut fut => return true,
                    () = tokio::task::yield_now() => {}
                }
            }
            false
        }
        Cut::Micros(us) => tokio::time::timeout(std::time::Duration::from_micros(us), fut)
            .await
            .is_ok(),
    }
}

/// A write or fsync whose future is dropped half way (the reliability harness's clients time
/// calls out and stop mid-call) must leave the file as it was or with the whole write, never with
/// a later part of the bytes at an earlier offset. Before NetFs ran such calls on tasks of their
/// own, a write cut while its first packet was being placed left its remaining bytes to be
/// committed at offset 0 by the next release, and an fsync cut while its packets were in flight
/// dropped the buffered bytes without an error.
#[test]
fn cancelled_writes_and_fsyncs_leave_old_or_new_content() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let dir = tempfile::tempdir().unwrap();
    let cluster = start_cluster(dir.path());
    runtime().block_on(async {
        let (msgr, mc) = client_with_volume(&cluster.master_addr).await;
        let vol = open_volume(&msgr, &mc).await;
        let fs = NetFs::new(vol.clone());
        let me = Caller { uid: 0, gid: 0 };
        let mut rng = Rng::with_seed(0xc0ffee);
        // One packet and a part: the packet streams at once, the part stays buffered.
        let len = (128 << 10) + 68_560;
        // Early cuts several times: the release issued next must still run after the write (the
        // runtime may start the two tasks in either order; NetFs keeps issue order).
        let cuts = [
            Cut::Rounds(1),
            Cut::Rounds(1),
            Cut::Rounds(1),
            Cut::Rounds(1),
            Cut::Rounds(2),
            Cut::Rounds(2),
            Cut::Micros(300),
            Cut::Micros(1_000),
            Cut::Micros(3_000),
            Cut::Micros(10_000),
        ];
        for (i, cut) in cuts.into_iter().enumerate() {
            for cut_fsync in [false, true] {
                let name = format!("cut-{i}-{cut_fsync}");
                let (attr, fh) = fs
                    .create(ROOT_INO, name.as_bytes(), 0o644, me, OpenFlags::READ_WRITE)
                    .await
                    .unwrap();
                // Loads the (empty) extent list, so the write's first network call places the
                // first packet: a cut after one round lands there.
                assert!(fs.read(fh, 0, 1).await.unwrap().is_empty());
                let data = random_bytes(&mut rng, len);
                let finished = if cut_fsync {
                    fs.write(fh, 0, data.clone()).await.unwrap();
                    cut_at(fs.fsync(fh), cut).await
                } else {
                    cut_at(fs.write(fh, 0, data.clone()), cut).await
                };
                // The release that follows commits whatever the cut call left.
                let released = fs.release(fh).await;
                let fresh = NetFs::new(vol.clone());
                let h = fresh.open(attr.attr.ino, OpenFlags::READ).await.unwrap();
                let got = read_all(&fresh, h, len).await;
                fresh.release(h).await.unwrap();
                let what = format!(
                    "{name} ({cut:?}): finished {finished}, release {released:?}, {}",
                    first_diff(&got, &data)
                );
                assert!(got.is_empty() || got == data, "neither old nor new: {what}");
                // A call that started runs to its end, so the release commits all of it.
                assert!(released.is_ok() && got == data, "{what}");
            }
        }
        shut_down(&msgr).await;
    });
}

/// Small files written behind (`NetFsConfig::flush_delay`): closes return before the bytes are
/// sent; this client reads them back at once; another client sees them after a directory fsync
/// (`sync_dir`), many files packed into one tiny extent, each key exactly its file's bytes.
/// Explicit times set before `close` survive the later commit; a file removed before its bytes
/// went out leaves nothing behind; a file replaced by `rename` gets its bytes first; `fsync` of
/// one file makes it visible alone; a tiny `dirty_max` makes closes wait, not fail.
#[test]
fn small_files_written_behind_are_packed_read_back_and_synced() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let dir = tempfile::tempdir().unwrap();
    let cluster = start_cluster(dir.path());
    runtime().block_on(async {
        let (msgr, mc) = client_with_volume(&cluster.master_addr).await;
        // A delay no test outlives: rounds start only when a packet's worth (or `dirty_max`) is
        // waiting, or on a sync.
        let cfg = NetFsConfig {
            write_behind: true,
            flush_delay: Some(std::time::Duration::from_secs(3600)),
            dirty_max: 96 << 10,
            ..NetFsConfig::default()
        };
        let fs = NetFs::with_config(open_volume(&msgr, &mc).await, cfg);
        let other = NetFs::new(open_volume(&msgr, &mc).await);
        let me = Caller { uid: 0, gid: 0 };
        let mut rng = Rng::with_seed(0x5eed_0041);
        let d = fs.mkdir(ROOT_INO, b"d", 0o755, me).await.unwrap().attr.ino;

        let mut files = Vec::new();
        for i in 0..60u64 {
            let name = format!("f{i}");
            let (a, h) = fs
                .create(d, name.as_bytes(), 0o644, me, OpenFlags::WRITE)
                .await
                .unwrap();
            let n = 1 + rng.usize(..6 << 10);
            let data = random_bytes(&mut rng, n);
            fs.write(h, 0, data.clone()).await.unwrap();
            fs.flush(h).await.unwrap();
            fs.release(h).await.unwrap();
            // This client sees its own bytes before they are sent.
            assert_eq!(
                fs.getattr(a.attr.ino).await.unwrap().size,
                data.len() as u64
            );
            let r = fs.open(a.attr.ino, OpenFlags::READ).await.unwrap();
            assert!(read_all(&fs, r, data.len()).await == data[..], "{name}");
            fs.release(r).await.unwrap();
            files.push((name, a.attr.ino, data));
        }

        // A file of several packets goes behind too, in packet-sized pieces.
        let (a, h) = fs
            .create(d, b"bigger", 0o644, me, OpenFlags::WRITE)
            .await
            .unwrap();
        let bigger = random_bytes(&mut rng, 300 << 10);
        for (k, piece) in bigger.chunks(64 << 10).enumerate() {
            fs.write(h, (k << 16) as u64, Bytes::copy_from_slice(piece))
                .await
                .unwrap();
        }
        fs.release(h).await.unwrap();
        let bigger_ino = a.attr.ino;

        // mtime set while the bytes were unsent (as `tar x` does) outlives their commit.
        let (a, h) = fs
            .create(d, b"dated", 0o644, me, OpenFlags::WRITE)
            .await
            .unwrap();
        fs.write(h, 0, Bytes::from_static(b"old")).await.unwrap();
        let when = -1_000_000_000_123_456_789i64; // 1938, to the nanosecond
        let set = SetAttr {
            mtime: Some(when),
            ..SetAttr::default()
        };
        fs.setattr(a.attr.ino, set).await.unwrap();
        fs.release(h).await.unwrap();
        let dated = a.attr.ino;

        // Removed before its bytes went out: nothing to write, no error later.
        let (a, h) = fs
            .create(d, b"scratch", 0o644, me, OpenFlags::WRITE)
            .await
            .unwrap();
        fs.write(h, 0, Bytes::from_static(b"scratch"))
            .await
            .unwrap();
        fs.release(h).await.unwrap();
        fs.unlink(d, b"scratch").await.unwrap();
        assert!(fs.getattr(a.attr.ino).await.is_err());

        // Replaced by a rename: the source's bytes end up under the destination's name.
        for (name, body) in [(&b"old"[..], &b"replaced"[..]), (b"new", b"renamed")] {
            let (_, h) = fs
                .create(d, name, 0o644, me, OpenFlags::WRITE)
                .await
                .unwrap();
            fs.write(h, 0, Bytes::copy_from_slice(body)).await.unwrap();
            fs.release(h).await.unwrap();
        }
        fs.rename(d, b"new", d, b"old").await.unwrap();

        // Appended to after its close: one file, both pieces.
        let (a, h) = fs
            .create(d, b"log", 0o644, me, OpenFlags::WRITE)
            .await
            .unwrap();
        fs.write(h, 0, Bytes::from_static(b"one,")).await.unwrap();
        fs.release(h).await.unwrap();
        let h = fs
            .open(
                a.attr.ino,
                OpenFlags {
                    append: true,
                    ..OpenFlags::WRITE
                },
            )
            .await
            .unwrap();
        fs.write(h, 0, Bytes::from_static(b"two")).await.unwrap();
        fs.release(h).await.unwrap();
        let log = a.attr.ino;

        // fsync of one file commits it alone, before any directory sync.
        let (a, h) = fs
            .create(d, b"synced", 0o644, me, OpenFlags::WRITE)
            .await
            .unwrap();
        fs.write(h, 0, Bytes::from_static(b"durable"))
            .await
            .unwrap();
        fs.fsync(h).await.unwrap();
        fs.release(h).await.unwrap();
        let (attr, keys) = other.meta().extents(a.attr.ino).await.unwrap();
        assert_eq!((attr.size, keys.len()), (7, 1));

        fs.sync_dir(d).await.unwrap();
        let mut shared = std::collections::HashMap::new();
        for (name, ino, data) in &files {
            let (attr, keys) = other.meta().extents(*ino).await.unwrap();
            assert_eq!(attr.size, data.len() as u64, "{name}");
            assert_eq!(keys.len(), 1, "{name}: {keys:?}");
            let k = keys[0];
            assert!(ExtentStore::is_tiny(k.extent), "{name}: {k:?}");
            assert_eq!(k.size as usize, data.len(), "{name}");
            assert_eq!(k.crc, nacre_types::crc32c(data), "{name}");
            *shared.entry((k.partition, k.extent)).or_insert(0) += 1;
            let h = other.open(*ino, OpenFlags::READ).await.unwrap();
            assert!(read_all(&other, h, data.len()).await == data[..], "{name}");
            other.release(h).await.unwrap();
        }
        assert!(
            shared.values().any(|&n| n > 1),
            "no two files share a tiny extent: {shared:?}"
        );
        assert_eq!(other.getattr(dated).await.unwrap().mtime, when);
        let read = |ino| {
            let other = other.clone();
            async move {
                let h = other.open(ino, OpenFlags::READ).await.unwrap();
                let size = other.getattr(ino).await.unwrap().size as usize;
                let got = read_all(&other, h, size).await;
                other.release(h).await.unwrap();
                got
            }
        };
        assert_eq!(read(log).await, b"one,two");
        assert!(read(bigger_ino).await == bigger[..], "bigger");
        let (_, keys) = other.meta().extents(bigger_ino).await.unwrap();
        assert_eq!(keys.len(), 3, "{keys:?}");
        assert!(
            keys.iter().all(|k| ExtentStore::is_tiny(k.extent)),
            "{keys:?}"
        );
        let old = other.lookup(d, b"old").await.unwrap();
        assert_eq!(read(old.ino).await, b"renamed");
        assert!(other.lookup(d, b"scratch").await.is_err());
        shut_down(&msgr).await;
    });
}

/// A file written behind, then truncated on open and written again at once (a shell's
/// `echo a > f; echo b > f`), under the attribute cache as a mount stacks them: its size and
/// bytes are the second write's at every moment.
#[test]
fn a_file_rewritten_at_once_is_never_seen_empty() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let dir = tempfile::tempdir().unwrap();
    let cluster = start_cluster(dir.path());
    runtime().block_on(async {
        let (msgr, mc) = client_with_volume(&cluster.master_addr).await;
        let cfg = NetFsConfig {
            write_behind: true,
            flush_delay: Some(std::time::Duration::from_millis(1)),
            ..NetFsConfig::default()
        };
        // Under the attribute cache, as a mount stacks them; the kernel asks for the attributes
        // between the truncating open and the write.
        let fs =
            nacre_client::MetaCache::new(NetFs::with_config(open_volume(&msgr, &mc).await, cfg));
        let me = Caller { uid: 0, gid: 0 };
        let d = fs.mkdir(ROOT_INO, b"q", 0o755, me).await.unwrap().attr.ino;
        for i in 0..300 {
            let name = format!("f{i}");
            let (a, h) = fs
                .create(d, name.as_bytes(), 0o644, me, OpenFlags::WRITE)
                .await
                .unwrap();
            fs.write(h, 0, Bytes::from_static(b"hello\n"))
                .await
                .unwrap();
            fs.flush(h).await.unwrap();
            fs.release(h).await.unwrap();
            let trunc = OpenFlags {
                truncate: true,
                ..OpenFlags::WRITE
            };
            let h = fs.open(a.attr.ino, trunc).await.unwrap();
            assert_eq!(
                fs.getattr(a.attr.ino).await.unwrap().size,
                0,
                "{name}: truncated"
            );
            fs.write(h, 0, Bytes::from_static(b"hello again\n"))
                .await
                .unwrap();
            fs.flush(h).await.unwrap();
            fs.release(h).await.unwrap();
            let size = fs.getattr(a.attr.ino).await.unwrap().size;
            assert_eq!(size, 12, "{name}: size");
            let looked = fs.lookup(d, name.as_bytes()).await.unwrap().size;
            assert_eq!(looked, 12, "{name}: looked up");
            let r = fs.open(a.attr.ino, OpenFlags::READ).await.unwrap();
            let mut got = Vec::new();
            loop {
                let b = fs.read(r, got.len() as u64, 64).await.unwrap();
                if b.is_empty() {
                    break;
                }
                got.extend_from_slice(&b);
            }
            assert_eq!(&got[..], b"hello again\n", "{name}");
            fs.release(r).await.unwrap();
        }
        shut_down(&msgr).await;
    });
}

/// A file of 128-512 KiB closed behind (a run the flusher packs into tiny extents, or a
/// truncating open streams to a normal extent), truncated on open at once and written small
/// again, then its directory synced: another client reads the second version, never an empty
/// file.
#[test]
fn a_larger_file_rewritten_small_at_once_keeps_its_second_version() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let dir = tempfile::tempdir().unwrap();
    let cluster = start_cluster(dir.path());
    runtime().block_on(async {
        let (msgr, mc) = client_with_volume(&cluster.master_addr).await;
        let fs = writing_behind(&msgr, &mc, 10).await;
        let me = Caller { uid: 0, gid: 0 };
        let d = fs.mkdir(ROOT_INO, b"r", 0o755, me).await.unwrap().attr.ino;
        let mut rng = Rng::with_seed(42);
        let mut files = Vec::new();
        for i in 0..60 {
            let name = format!("f{i}");
            let (a, h) = fs
                .create(d, name.as_bytes(), 0o644, me, OpenFlags::WRITE)
                .await
                .unwrap();
            let n1 = rng.usize(131_073..300_000);
            let v1 = random_bytes(&mut rng, n1);
            for (k, piece) in v1.chunks(65_536).enumerate() {
                fs.write(h, (k * 65_536) as u64, Bytes::copy_from_slice(piece))
                    .await
                    .unwrap();
            }
            fs.flush(h).await.unwrap();
            fs.release(h).await.unwrap();
            // Every third file, the flusher writes the first version out before the truncating
            // open (a directory sync waits for it); the others race it.
            if i % 3 == 1 {
                fs.sync_dir(d).await.unwrap();
            }
            let n2 = rng.usize(1..120_000);
            let v2 = random_bytes(&mut rng, n2);
            rewrite(&fs, a.attr.ino, v2.clone()).await;
            files.push((a.attr.ino, name, v2));
        }
        fs.sync_dir(d).await.unwrap();
        // Another client, with nothing cached.
        let other = NetFs::new(open_volume(&msgr, &mc).await);
        expect_files(&other, &files).await;
        shut_down(&msgr).await;
    });
}

/// A file allocated ahead (`fallocate`, as fio and downloaders do) and then written in 128 KiB
/// chunks that arrive out of order (FUSE sends the chunks of one large `O_DIRECT` write in
/// parallel): the bytes read back right, and they land in a few normal extents, so later
/// overwrites go in place, not in many small copy-on-write pieces.
#[test]
fn chunks_past_the_end_of_an_allocated_file_land_in_normal_extents() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let dir = tempfile::tempdir().unwrap();
    let cluster = start_cluster(dir.path());
    runtime().block_on(async {
        let (msgr, mc) = client_with_volume(&cluster.master_addr).await;
        let fs = NetFs::new(open_volume(&msgr, &mc).await);
        let me = Caller { uid: 0, gid: 0 };
        let (attr, fh) = fs
            .create(ROOT_INO, b"alloc", 0o644, me, OpenFlags::READ_WRITE)
            .await
            .unwrap();
        let ino = attr.attr.ino;
        const CHUNK: usize = 128 << 10;
        const CHUNKS: usize = 64; // 8 MiB
        fs.fallocate(fh, Falloc::Allocate, 0, (CHUNK * CHUNKS) as u64)
            .await
            .unwrap();
        let mut rng = Rng::with_seed(0xa110c);
        let data = random_bytes(&mut rng, CHUNK * CHUNKS);
        // Groups of 8 chunks (one 1 MiB write), each group's chunks in a shuffled order.
        for group in (0..CHUNKS).collect::<Vec<_>>().chunks(8) {
            let mut order = group.to_vec();
            rng.shuffle(&mut order);
            for k in order {
                let off = k * CHUNK;
                let n = fs
                    .write(fh, off as u64, data.slice(off..off + CHUNK))
                    .await
                    .unwrap();
                assert_eq!(n as usize, CHUNK);
            }
        }
        fs.fsync(fh).await.unwrap();
        let got = read_all(&fs, fh, data.len()).await;
        assert!(got[..] == data[..], "{}", first_diff(&got, &data));
        let (_, keys) = fs.meta().extents(ino).await.unwrap();
        let tiny = keys.iter().filter(|k| k.extent.is_tiny()).count();
        assert_eq!(tiny, 0, "keys in tiny extents: {keys:?}");
        assert!(keys.len() <= 8, "{} keys: {keys:?}", keys.len());
        fs.release(fh).await.unwrap();
    });
}

/// A file whose keys name compressed blocks (framed keys, over frames in tiny extents) reads back
/// as the blocks' bytes, also where a key was cut by a truncate and a punched hole; a write over
/// it rewrites the range copy-on-write; a frame whose bytes changed on the data node is an error
/// naming the extent, never data.
#[test]
fn framed_keys_read_back_decompressed_and_a_corrupt_frame_is_an_error() {
    use nacre_api::meta::{ExtentKey, Framed};
    use nacre_func::Codec;
    use nacre_func::block::compress_block;
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let dir = tempfile::tempdir().unwrap();
    let cluster = start_cluster(dir.path());
    runtime().block_on(async {
        let (msgr, mc) = client_with_volume(&cluster.master_addr).await;
        let fs = NetFs::new(open_volume(&msgr, &mc).await);
        let vol = fs.volume().clone();
        let me = Caller { uid: 0, gid: 0 };
        let (attr, fh) = fs
            .create(ROOT_INO, b"framed", 0o644, me, OpenFlags::READ_WRITE)
            .await
            .unwrap();
        let ino = attr.attr.ino;
        let text: Vec<u8> = (0..100_000u32)
            .flat_map(|i| format!("line {} of the text\n", i % 977).into_bytes())
            .take(100 << 10)
            .collect();
        let blocks = [&text[..64 << 10], &text[64 << 10..]];
        let mut keys = Vec::new();
        let mut file_offset = 0u64;
        for (i, block) in blocks.iter().enumerate() {
            let frame = compress_block(Codec::Zstd { level: 1 }, block).unwrap();
            assert!(frame.len() < block.len() / 4, "text compresses");
            let p = vol.pick_writable(i, &[]).unwrap();
            let w = vol.write_tiny(p, frame.clone()).await.unwrap();
            keys.push(ExtentKey {
                file_offset,
                partition: p,
                extent: w.extent,
                extent_offset: w.offset,
                size: block.len() as u32,
                crc: nacre_types::crc32c(&frame),
                framed: Some(Framed {
                    stored: std::num::NonZeroU32::new(frame.len() as u32).unwrap(),
                    skip: 0,
                }),
            });
            file_offset += block.len() as u64;
        }
        fs.meta().append_extents(ino, keys.clone()).await.unwrap();
        fs.release(fh).await.unwrap();
        let mut model = text.clone();
        let fh = fs.open(ino, OpenFlags::READ_WRITE).await.unwrap();
        assert!(read_all(&fs, fh, model.len()).await == model);
        // A hole punched across the blocks' boundary and a truncate into the second block cut
        // the keys; what is left still reads from the frames.
        fs.fallocate(fh, Falloc::PunchHole, 60_000, 10_000)
            .await
            .unwrap();
        model[60_000..70_000].fill(0);
        fs.setattr(
            ino,
            SetAttr {
                size: Some(90_000),
                ..SetAttr::default()
            },
        )
        .await
        .unwrap();
        model.truncate(90_000);
        let got = read_all(&fs, fh, model.len()).await;
        assert!(got == model, "{}", first_diff(&got, &model));
        // A write inside a compressed block goes elsewhere, copy-on-write.
        fs.write(fh, 1000, Bytes::from_static(b"written over"))
            .await
            .unwrap();
        model[1000..1012].copy_from_slice(b"written over");
        fs.fsync(fh).await.unwrap();
        let got = read_all(&fs, fh, model.len()).await;
        assert!(got == model, "{}", first_diff(&got, &model));
        fs.release(fh).await.unwrap();
        // The second block's frame changed on its data node (a forged key CRC stands in for
        // a flipped byte the scrub has not repaired): the read fails and names the extent.
        let (_, now) = fs.meta().extents(ino).await.unwrap();
        let mut bad = *now.iter().rev().find(|k| k.framed.is_some()).unwrap();
        bad.crc ^= 1;
        fs.meta().append_extents(ino, vec![bad]).await.unwrap();
        let fresh = NetFs::new(open_volume(&msgr, &mc).await);
        let fh = fresh.open(ino, OpenFlags::READ).await.unwrap();
        let err = fresh
            .read(fh, bad.file_offset, bad.size)
            .await
            .expect_err("a corrupt frame is not data");
        let text = err.to_string();
        assert!(text.contains(&bad.extent.to_string()), "{text}");
        fresh.release(fh).await.unwrap();
        shut_down(&msgr).await;
    });
}

/// Small files rewritten twice with `O_TRUNC` while their earlier versions are still written
/// behind, then one sync of the directory: another client reads each file's last version.
#[test]
fn a_small_file_rewritten_twice_behind_keeps_its_last_version() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let dir = tempfile::tempdir().unwrap();
    let cluster = start_cluster(dir.path());
    runtime().block_on(async {
        let (msgr, mc) = client_with_volume(&cluster.master_addr).await;
        let fs = writing_behind(&msgr, &mc, 50).await;
        let me = Caller { uid: 0, gid: 0 };
        let d = fs.mkdir(ROOT_INO, b"s", 0o755, me).await.unwrap().attr.ino;
        let mut rng = Rng::with_seed(305);
        let mut files = Vec::new();
        for i in 0..60 {
            let name = format!("f{i}");
            let (a, h) = fs
                .create(d, name.as_bytes(), 0o644, me, OpenFlags::WRITE)
                .await
                .unwrap();
            let n = rng.usize(1..9000);
            let first = random_bytes(&mut rng, n);
            fs.write(h, 0, first).await.unwrap();
            fs.flush(h).await.unwrap();
            fs.release(h).await.unwrap();
            let mut last = Bytes::new();
            for _ in 0..2 {
                let n = rng.usize(1..9000);
                last = random_bytes(&mut rng, n);
                rewrite(&fs, a.attr.ino, last.clone()).await;
            }
            files.push((a.attr.ino, name, last));
        }
        fs.sync_dir(d).await.unwrap();
        let other = NetFs::new(open_volume(&msgr, &mc).await);
        expect_files(&other, &files).await;
        shut_down(&msgr).await;
    });
}
