use nacre_types::Ino;
use serde::Serialize;

use super::file_time;
use crate::meta::{Attr, Command, FileType, Reply, SetAttr};

/// `Attr` as it was encoded with unsigned times.
#[derive(Serialize)]
struct OldAttr {
    ino: Ino,
    kind: FileType,
    mode: u32,
    uid: u32,
    gid: u32,
    size: u64,
    nlink: u32,
    rdev: u32,
    atime: u64,
    mtime: u64,
    ctime: u64,
    generation: u32,
}

/// `SetAttr` as it was encoded with unsigned times.
#[derive(Serialize)]
struct OldSetAttr {
    mode: Option<u32>,
    uid: Option<u32>,
    gid: Option<u32>,
    size: Option<u64>,
    atime: Option<u64>,
    mtime: Option<u64>,
}

/// `Command` as it was encoded with unsigned times, up to `SetAttr` (variant 10); the variants
/// before it only hold its place.
#[derive(Serialize)]
#[expect(dead_code, reason = "placeholders for the variant index")]
enum OldCommand {
    V0,
    V1,
    V2,
    V3,
    V4,
    V5,
    V6,
    V7,
    V8,
    V9,
    SetAttr { ino: Ino, set: OldSetAttr },
}

/// `Reply` as it was encoded with unsigned times, up to `Created` (variant 5).
#[derive(Serialize)]
#[expect(dead_code, reason = "placeholders for the variant index")]
enum OldReply {
    V0,
    Attr(OldAttr),
    V2,
    V3,
    V4,
    Created {
        attr: OldAttr,
        parent: OldAttr,
        parent_was: u64,
    },
}

fn old_attr(ino: u64, t: u64) -> OldAttr {
    OldAttr {
        ino: Ino(ino),
        kind: FileType::File,
        mode: 0o644,
        uid: 1000,
        gid: 100,
        size: 4096,
        nlink: 1,
        rdev: 0,
        atime: t,
        mtime: t + 1,
        ctime: t + 2,
        generation: 0,
    }
}

fn attr(ino: u64, t: i64) -> Attr {
    Attr {
        ino: Ino(ino),
        kind: FileType::File,
        mode: 0o644,
        uid: 1000,
        gid: 100,
        size: 4096,
        nlink: 1,
        rdev: 0,
        atime: t,
        mtime: t + 1,
        ctime: t + 2,
        generation: 0,
    }
}

/// Times an old encoding held: 0, small, today's, and the largest a `u64` that is a valid `i64`.
const OLD_TIMES: [u64; 4] = [0, 127, 1_765_000_000_123_456_789, i64::MAX as u64 - 2];

#[test]
fn entries_encoded_with_unsigned_times_decode_to_the_same_values() {
    for t in OLD_TIMES {
        let ts = t as i64;
        let bytes = postcard::to_allocvec(&old_attr(7, t)).unwrap();
        assert_eq!(postcard::from_bytes::<Attr>(&bytes).unwrap(), attr(7, ts));
        assert_eq!(
            postcard::to_allocvec(&attr(7, ts)).unwrap(),
            bytes,
            "same bytes"
        );

        // A Raft log entry of a meta partition: `(now, Command)`.
        let old = OldCommand::SetAttr {
            ino: Ino(9),
            set: OldSetAttr {
                mode: Some(0o600),
                uid: None,
                gid: None,
                size: Some(1),
                atime: Some(t),
                mtime: None,
            },
        };
        let new = Command::SetAttr {
            ino: Ino(9),
            set: SetAttr {
                mode: Some(0o600),
                size: Some(1),
                atime: Some(ts),
                ..SetAttr::default()
            },
        };
        let bytes = postcard::to_allocvec(&(t, old)).unwrap();
        assert_eq!(
            postcard::from_bytes::<(u64, Command)>(&bytes).unwrap(),
            (t, new.clone())
        );
        assert_eq!(postcard::to_allocvec(&(t, new)).unwrap(), bytes);

        let old = OldReply::Created {
            attr: old_attr(10, t),
            parent: old_attr(1, t),
            parent_was: t,
        };
        let new = Reply::Created {
            attr: attr(10, ts),
            parent: attr(1, ts),
            parent_was: ts,
        };
        let bytes = postcard::to_allocvec(&old).unwrap();
        assert_eq!(postcard::from_bytes::<Reply>(&bytes).unwrap(), new);
        let bytes = postcard::to_allocvec(&OldReply::Attr(old_attr(3, t))).unwrap();
        assert_eq!(
            postcard::from_bytes::<Reply>(&bytes).unwrap(),
            Reply::Attr(attr(3, ts))
        );
    }
}

#[test]
fn times_before_1970_round_trip_with_their_nanoseconds() {
    // 1960-01-01T00:00:00.123456789Z, the first representable time, and one ns before 1970.
    for t in [-315_619_199_876_543_211, i64::MIN, -1] {
        let a = Attr {
            ctime: 5,
            ..attr(7, t)
        };
        let bytes = postcard::to_allocvec(&a).unwrap();
        assert_eq!(postcard::from_bytes::<Attr>(&bytes).unwrap(), a);

        let c = Command::SetAttr {
            ino: Ino(9),
            set: SetAttr {
                atime: Some(t),
                mtime: Some(t),
                ..SetAttr::default()
            },
        };
        let bytes = postcard::to_allocvec(&(1u64, &c)).unwrap();
        assert_eq!(
            postcard::from_bytes::<(u64, Command)>(&bytes).unwrap(),
            (1, c)
        );
    }
}

#[test]
fn a_clock_reading_is_the_same_file_time_until_2262() {
    assert_eq!(file_time(0), 0);
    assert_eq!(
        file_time(1_765_000_000_123_456_789),
        1_765_000_000_123_456_789
    );
    assert_eq!(file_time(u64::MAX), i64::MAX);
}
