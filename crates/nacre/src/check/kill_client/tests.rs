//! The journal checker on hand-made journals and contents (it must fail on a lost synced write,
//! another file's bytes and a zero nobody wrote, and pass on lost unsynced writes), and the
//! client's workload on an in-memory file system.
#![allow(clippy::unwrap_used)]

use nacre_api::meta::ROOT_INO;
use nacre_client::{Caller, FileSystem};

use super::check::{Outcomes, check_dir};
use super::client::Runner;
use super::content::{self, Found, VersionId};
use super::journal::{self, JournalError, Op, Record, Writer};
use super::judge::{Expectations, Outcome, Seen, State, Violation, What, judge};
use super::{excerpt, names};
use crate::check::workload::tests::MemFs;

fn exp(text: &str) -> Expectations {
    Expectations::from_records(&journal::parse(text).unwrap()).unwrap()
}

fn id(inc: u32, file: u32, version: u32) -> VersionId {
    VersionId { inc, file, version }
}

/// Version `version` of file `file` of incarnation `inc`, its first `len` bytes.
fn version(inc: u32, file: u32, version: u32, len: u64) -> Vec<u8> {
    content::bytes(id(inc, file, version), 0, len)
}

fn file(data: Vec<u8>) -> Seen {
    Seen::File {
        size: data.len() as u64,
        data,
    }
}

fn verdict(e: &Expectations, f: u32, seen: &Seen) -> Result<Outcome, Violation> {
    let path = format!("/kill-client/i{}/f{f}", e.inc);
    judge(e.inc, f, &e.files[&f], &path, seen)
}

fn what(e: &Expectations, f: u32, seen: &Seen) -> (What, Option<u64>) {
    let v = verdict(e, f, seen).expect_err("must be a violation");
    (v.what, v.offset)
}

/// Incarnation 3, killed while writing f4: f1 synced at v1 then overwritten, f2 fsynced then
/// unlinked, f3 and f4 never synced.
const UNSYNCED: &str = "journal 1 inc 3
start write 1 1 5000
done write 1 1 5000
start write 2 1 300
start fsync 2
done fsync 2
done write 2 1 300
start sync
done sync
start write 1 2 70000
done write 1 2 70000
start write 3 1 100
done write 3 1 100
start unlink 2
done unlink 2
start write 4 1 9000
";

/// Incarnation 4, killed while overwriting f2: f1 fsynced at v2 and untouched since, f2 synced
/// at v1, f3 unlinked and synced.
const SYNCED: &str = "journal 1 inc 4
start write 1 1 5000
done write 1 1 5000
start write 2 1 40000
done write 2 1 40000
start write 3 1 64
done write 3 1 64
start unlink 3
done unlink 3
start sync
done sync
start write 1 2 3000
start fsync 1
done fsync 1
done write 1 2 3000
start write 2 2 100
";

#[test]
fn the_journal_gives_each_file_its_fixed_state_and_what_followed() {
    let e = exp(UNSYNCED);
    let f1 = &e.files[&1];
    assert_eq!(
        f1.fixed,
        State::Version {
            version: 1,
            len: 5000
        }
    );
    assert_eq!(f1.since, vec![(2, 70000)]);
    let f2 = &e.files[&2];
    assert!(f2.unlinked_since && f2.since.is_empty() && f2.current == State::Absent);
    let f4 = &e.files[&4];
    assert!(!f4.covered && f4.fixed == State::Absent && f4.since == vec![(1, 9000)]);
    assert_eq!(e.stats.started, 8);
    assert_eq!((e.stats.fsyncs, e.stats.syncs, e.stats.writes), (1, 1, 5));
    assert_eq!(e.failed, None);
}

#[test]
fn lost_unsynced_writes_pass() {
    let e = exp(UNSYNCED);
    // The overwrite of f1 lost: its synced v1.
    assert_eq!(
        verdict(&e, 1, &file(version(3, 1, 1, 5000))),
        Ok(Outcome::Lost)
    );
    // Or any prefix of v2, or all of it.
    assert_eq!(verdict(&e, 1, &file(Vec::new())), Ok(Outcome::Empty));
    for n in [1, 31, 32, 4096, 69_999] {
        assert_eq!(
            verdict(&e, 1, &file(version(3, 1, 2, n))),
            Ok(Outcome::Partial)
        );
    }
    assert_eq!(
        verdict(&e, 1, &file(version(3, 1, 2, 70000))),
        Ok(Outcome::Newest)
    );
    // The unlink of f2 lost, or not.
    assert_eq!(
        verdict(&e, 2, &file(version(3, 2, 1, 300))),
        Ok(Outcome::Lost)
    );
    assert_eq!(verdict(&e, 2, &Seen::Absent), Ok(Outcome::Newest));
    // f3 and f4 never synced: gone, empty, or a prefix (f4's write was in progress).
    assert_eq!(verdict(&e, 3, &Seen::Absent), Ok(Outcome::Lost));
    assert_eq!(verdict(&e, 3, &file(Vec::new())), Ok(Outcome::Empty));
    assert_eq!(verdict(&e, 4, &Seen::Absent), Ok(Outcome::Lost));
    assert_eq!(
        verdict(&e, 4, &file(version(3, 4, 1, 4096))),
        Ok(Outcome::Partial)
    );
}

#[test]
fn a_lost_synced_write_fails() {
    let e = exp(SYNCED);
    // f1's fsynced v2 must be there, whole.
    assert_eq!(
        verdict(&e, 1, &file(version(4, 1, 2, 3000))),
        Ok(Outcome::Synced)
    );
    assert_eq!(what(&e, 1, &Seen::Absent), (What::SyncedLost, None));
    assert_eq!(
        what(&e, 1, &file(version(4, 1, 2, 2999))),
        (What::Short, Some(2999))
    );
    assert_eq!(what(&e, 1, &file(Vec::new())), (What::Short, Some(0)));
    // The older version is not enough: the record at offset 0 names v1.
    assert_eq!(
        what(&e, 1, &file(version(4, 1, 1, 5000))),
        (What::Stale, Some(0))
    );
    // f2 was synced by the directory fsync: its overwrite in progress may be lost, the file not.
    assert_eq!(what(&e, 2, &Seen::Absent), (What::SyncedLost, None));
    assert_eq!(
        verdict(&e, 2, &file(version(4, 2, 1, 40000))),
        Ok(Outcome::Lost)
    );
    // f3's unlink was synced.
    assert_eq!(verdict(&e, 3, &Seen::Absent), Ok(Outcome::Synced));
    assert_eq!(
        what(&e, 3, &file(version(4, 3, 1, 64))),
        (What::Resurrected, None)
    );
    assert!(What::SyncedLost.loses_synced() && !What::Foreign.loses_synced());
}

#[test]
fn bytes_of_another_file_fail() {
    let e = exp(SYNCED);
    // A record of f3 (it shared a tiny extent with f2, say) inside synced f2.
    let mut data = version(4, 2, 1, 40000);
    let theirs = version(4, 3, 1, 64);
    data[4096..4128].copy_from_slice(&theirs[32..64]);
    let v = verdict(&e, 2, &file(data)).unwrap_err();
    assert_eq!((v.what, v.offset), (What::Foreign, Some(4096)), "{v}");
    assert!(v.detail.contains("i4/f3 v1 offset 32"), "{v}");
    // Another incarnation's bytes in a file being written (a prefix of v2 is allowed).
    let mut data = version(4, 2, 2, 100);
    data[64..96].copy_from_slice(&version(3, 2, 2, 96)[64..96]);
    assert_eq!(what(&e, 2, &file(data)), (What::Foreign, Some(64)));
    // A single byte of another file: whatever it is called, it fails.
    for at in [0usize, 17, 2999] {
        let mut data = version(4, 1, 2, 3000);
        let other = version(4, 2, 1, 3000);
        if data[at] == other[at] {
            continue;
        }
        data[at] = other[at];
        let v = verdict(&e, 1, &file(data)).unwrap_err();
        assert_eq!(v.offset, Some(at as u64), "{v}");
    }
    // This file's bytes at the wrong offset.
    let mut data = version(4, 1, 2, 3000);
    data.copy_within(0..32, 1024);
    assert_eq!(what(&e, 1, &file(data)), (What::Misplaced, Some(1024)));
}

#[test]
fn a_zero_nobody_wrote_fails() {
    let e = exp(SYNCED);
    // A block of zeros in a synced file.
    let mut data = version(4, 1, 2, 3000);
    data[1024..1536].fill(0);
    assert_eq!(what(&e, 1, &file(data)), (What::NeverWritten, Some(1024)));
    // One zero byte.
    let mut data = version(4, 1, 2, 3000);
    data[777] = 0;
    assert_eq!(what(&e, 1, &file(data)), (What::NeverWritten, Some(777)));
    // A file being written whose size got ahead of its bytes: a prefix, then zeros.
    let mut data = version(4, 2, 2, 100);
    data[60..].fill(0);
    assert_eq!(what(&e, 2, &file(data)), (What::NeverWritten, Some(60)));
    // A never-synced file of zeros.
    let u = exp(UNSYNCED);
    assert_eq!(
        what(&u, 3, &file(vec![0; 100])),
        (What::NeverWritten, Some(0))
    );
    // Garbage that is no record.
    assert_eq!(
        what(&u, 3, &file(vec![b'x'; 100])),
        (What::NeverWritten, Some(0))
    );
}

#[test]
fn a_size_the_bytes_do_not_bear_out_fails() {
    let e = exp(SYNCED);
    let data = version(4, 1, 2, 3000);
    let seen = Seen::File { size: 4096, data };
    assert_eq!(what(&e, 1, &seen), (What::SizeMismatch, Some(3000)));
}

#[test]
fn a_journal_that_contradicts_itself_is_refused() {
    let bad = |text: &str| {
        let r = Expectations::from_records(&journal::parse(text).unwrap());
        assert!(
            matches!(r, Err(JournalError::Inconsistent { .. })),
            "{text}: {r:?}"
        );
    };
    bad("start write 1 1 10\n");
    bad("journal 1 inc 1\ndone write 1 1 10\n");
    bad("journal 1 inc 1\nstart write 1 2 10\n");
    bad("journal 1 inc 1\nstart write 1 1 10\ndone write 1 1 10\nstart write 1 3 10\n");
    bad("journal 1 inc 1\nstart unlink 1\n");
    bad("journal 1 inc 1\nstart write 1 1 1099511627776\n");
    bad("journal 1 inc 1\nstart sync\nfail sync: timed out\nstart sync\n");
    assert!(matches!(
        journal::parse("journal 1 inc 1\nstart frobnicate 1\n"),
        Err(JournalError::Bad { line: 2, .. })
    ));
}

#[test]
fn a_line_cut_by_the_kill_is_ignored() {
    let r = journal::parse("journal 1 inc 2\nstart write 1 1 10\ndone wri").unwrap();
    assert_eq!(r.len(), 2);
    let e = Expectations::from_records(&r).unwrap();
    assert_eq!(e.files[&1].since, vec![(1, 10)]);
    let e = exp("journal 1 inc 2\nstart sync\nfail sync: unavailable: timed out\n");
    assert_eq!(e.failed.as_deref(), Some("sync: unavailable: timed out"));
}

#[test]
fn records_round_trip() {
    for r in [
        Record::Header { inc: 7 },
        Record::Start(Op::Write {
            file: 1,
            version: 2,
            len: 3,
        }),
        Record::Done(Op::Unlink { file: 4 }),
        Record::Start(Op::Fsync { file: 5 }),
        Record::Done(Op::Sync),
        Record::Fail("write 1 2 3: no\nspace".into()),
    ] {
        let parsed = journal::parse(&format!("{r}\n")).unwrap();
        let want = match r {
            Record::Fail(s) => Record::Fail(s.replace('\n', " ")),
            r => r,
        };
        assert_eq!(parsed, vec![(1, want)]);
    }
}

#[test]
fn content_names_itself_everywhere_and_has_no_zeros() {
    let v = id(12, 345, 6);
    let all = content::bytes(v, 0, 10_000);
    assert!(!all.contains(&0));
    assert_eq!(&all[..27], b"000c.00159.0006.0000000000.");
    assert_eq!(&all[32..59], b"000c.00159.0006.0000000020.");
    assert_eq!((all[31], all[63]), (b'\n', b'\n'));
    for (from, len) in [(0, 0), (1, 5), (31, 2), (32, 32), (100, 9000), (9999, 1)] {
        assert_eq!(
            content::bytes(v, from, len),
            &all[from as usize..(from + len) as usize]
        );
    }
    for off in (0..9984).step_by(32) {
        assert_eq!(content::decode(&all[off..off + 32]), Some((v, off as u64)));
    }
    let mut torn = all[64..96].to_vec();
    torn[20] ^= 1;
    assert_eq!(content::decode(&torn), None);
    assert_eq!(
        content::identify(&all, 100),
        Found::Record { id: v, off: 96 }
    );
    assert_eq!(content::identify(&[0; 64], 40), Found::Zeros);
    assert!(id(1, 1, 1).fits(1 << 30).is_ok());
    assert!(id(1 << 16, 1, 1).fits(1).is_err());
    assert!(id(1, 1 << 20, 1).fits(1).is_err());
}

#[test]
fn an_excerpt_has_the_file_and_the_syncs() {
    let lines = excerpt(SYNCED, Some(2));
    assert_eq!(
        lines,
        vec![
            "1: journal 1 inc 4",
            "4: start write 2 1 40000",
            "5: done write 2 1 40000",
            "11: done sync",
            "16: start write 2 2 100",
        ]
    );
    // Many syncs after the file's write: its lines stay, with the sync that covered it.
    let mut j = String::from("journal 1 inc 1\nstart write 1 1 10\ndone write 1 1 10\n");
    j.push_str(&"start sync\ndone sync\n".repeat(100));
    j.push_str("start write 2 1 10\n");
    assert_eq!(
        excerpt(&j, Some(1)),
        vec![
            "1: journal 1 inc 1",
            "2: start write 1 1 10",
            "3: done write 1 1 10",
            "5: done sync",
            "204: start write 2 1 10",
        ]
    );
}

/// Runs the client's workload on `fs` in `/kill-client/i{inc}`; returns its expectations.
async fn run_client(fs: &MemFs, inc: u32, ops: u64) -> Expectations {
    let root = fs
        .mkdir(ROOT_INO, b"kill-client", 0o755, Caller::default())
        .await
        .unwrap()
        .attr
        .ino;
    let dir = fs
        .mkdir(root, format!("i{inc}").as_bytes(), 0o755, Caller::default())
        .await
        .unwrap()
        .attr
        .ino;
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("journal");
    let mut w = Writer::create(&path).unwrap();
    w.put(&Record::Header { inc }).unwrap();
    Runner::new(fs, dir, inc, 99, w).run(ops).await.unwrap();
    exp(&std::fs::read_to_string(&path).unwrap())
}

/// On a file system that loses nothing every file is in its newest state; damage is found.
#[tokio::test(start_paused = true)]
async fn the_client_on_a_file_system_that_loses_nothing_checks_clean() {
    let fs = MemFs::new(1);
    let e = run_client(&fs, 7, 600).await;
    let s = &e.stats;
    assert!(
        s.writes > 200 && s.unlinks > 50 && s.fsyncs > 20 && s.syncs > 10,
        "{s:?}"
    );
    let base = "/kill-client/i7";
    let got = check_dir(&*fs, base, &names(7), &e).await;
    assert_eq!(got.violations, Vec::new());
    assert!(got.unreadable.is_empty());
    let o = &got.outcomes;
    assert_eq!((o.lost, o.empty, o.partial), (0, 0, 0), "{o:?}");
    assert_eq!(o.synced + o.newest, e.files.len() as u64);
    assert!(o.synced > 0 && o.newest > 0, "{o:?}");

    // Damage: a synced file gone, another file's record in a second, a zero in a third, and a
    // name the client never made.
    let synced: Vec<u32> = e
        .files
        .iter()
        .filter(|(_, h)| !h.touched() && matches!(h.fixed, State::Version { len, .. } if len >= 64))
        .map(|(&f, _)| f)
        .collect();
    let [gone, foreign, zeroed, ..] = synced[..] else {
        panic!("too few synced files: {synced:?}");
    };
    fs.remove(&format!("{base}/f{gone}"));
    let theirs = content::bytes(id(7, gone, 1), 32, 32);
    fs.edit(&format!("{base}/f{foreign}"), |d| {
        d[32..64].copy_from_slice(&theirs);
    });
    fs.edit(&format!("{base}/f{zeroed}"), |d| d[40] = 0);
    let dir = fs.lookup(ROOT_INO, b"kill-client").await.unwrap().ino;
    let dir = fs.lookup(dir, b"i7").await.unwrap().ino;
    let flags = nacre_client::OpenFlags::WRITE;
    let (_, fh) = fs
        .create(dir, b"stray", 0o644, Caller::default(), flags)
        .await
        .unwrap();
    fs.release(fh).await.unwrap();
    let got = check_dir(&*fs, base, &names(7), &e).await;
    let mut found: Vec<(String, What, Option<u64>)> = got
        .violations
        .iter()
        .map(|v| (v.path.clone(), v.what, v.offset))
        .collect();
    found.sort();
    let mut want = vec![
        (format!("{base}/f{gone}"), What::SyncedLost, None),
        (format!("{base}/f{foreign}"), What::Foreign, Some(32)),
        (format!("{base}/f{zeroed}"), What::NeverWritten, Some(40)),
        (format!("{base}/stray"), What::Unexpected, None),
    ];
    want.sort();
    assert_eq!(found, want, "{:#?}", got.violations);
    assert_eq!(
        got.outcomes,
        Outcomes {
            synced: o.synced - 3,
            ..o.clone()
        }
    );
}
