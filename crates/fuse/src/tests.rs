use super::*;

fn attr() -> Attr {
    Attr {
        ino: Ino(42),
        kind: FileType::File,
        mode: 0o104_755, // a type bit that must not leak into perm
        uid: 1000,
        gid: 100,
        size: 1025,
        nlink: 3,
        rdev: 7,
        atime: 1_700_000_000_123_456_789,
        mtime: 1_700_000_001_000_000_001,
        ctime: 5,
        generation: 9,
    }
}

#[test]
fn attributes_convert() {
    let a = attr();
    let f = file_attr(&a);
    assert_eq!(f.ino, INodeNo(42));
    assert_eq!(f.size, 1025);
    assert_eq!(f.blocks, 3);
    assert_eq!(f.perm, 0o4755);
    assert_eq!(f.kind, fuser::FileType::RegularFile);
    assert_eq!((f.nlink, f.uid, f.gid, f.rdev), (3, 1000, 100, 7));
    assert_eq!(f.blksize, 128 * 1024);
    assert_eq!(
        f.atime.duration_since(UNIX_EPOCH).ok(),
        Some(Duration::new(1_700_000_000, 123_456_789))
    );
    assert_eq!(
        f.mtime.duration_since(UNIX_EPOCH).ok(),
        Some(Duration::new(1_700_000_001, 1))
    );
    assert_eq!(
        f.ctime.duration_since(UNIX_EPOCH).ok(),
        Some(Duration::new(0, 5))
    );
    for (size, blocks) in [(0, 0), (1, 1), (512, 1), (513, 2), (1 << 30, 1 << 21)] {
        assert_eq!(file_attr(&Attr { size, ..a.clone() }).blocks, blocks);
    }
    for (k, want) in [
        (FileType::Dir, fuser::FileType::Directory),
        (FileType::Symlink, fuser::FileType::Symlink),
        (FileType::Fifo, fuser::FileType::NamedPipe),
        (FileType::Socket, fuser::FileType::Socket),
        (FileType::CharDev, fuser::FileType::CharDevice),
        (FileType::BlockDev, fuser::FileType::BlockDevice),
    ] {
        assert_eq!(
            file_attr(&Attr {
                kind: k,
                ..a.clone()
            })
            .kind,
            want
        );
    }
}

#[test]
fn times_round_trip() {
    let t = UNIX_EPOCH + Duration::new(1_234, 567);
    assert_eq!(nanos(t), 1_234_000_000_567);
    assert_eq!(time_or_now(TimeOrNow::SpecificTime(t)), 1_234_000_000_567);
    assert!(time_or_now(TimeOrNow::Now) > 1_600_000_000_000_000_000);
    // Before 1970: 1960-01-01T00:00:00.123456789Z, and the ends of the range.
    for ns in [-315_619_199_876_543_211, -1, i64::MIN, i64::MAX] {
        assert_eq!(nanos(time(ns)), ns);
    }
    assert_eq!(
        time(-1_500_000_000),
        UNIX_EPOCH - Duration::from_millis(1_500)
    );
    let a = file_attr(&Attr {
        mtime: -315_619_199_876_543_211,
        ..attr()
    });
    assert_eq!(
        a.mtime,
        UNIX_EPOCH - Duration::new(315_619_199, 876_543_211)
    );
}

#[test]
fn times_before_1970_from_the_kernel_keep_their_nanoseconds() {
    // The kernel's `timespec {-315_619_200, 123_456_789}` (1960-01-01T00:00:00.123456789Z), as
    // fuser 0.18 decodes it: the nanoseconds taken away instead of added.
    let decoded = UNIX_EPOCH - Duration::new(315_619_200, 123_456_789);
    assert_eq!(
        time_or_now(TimeOrNow::SpecificTime(decoded)),
        -315_619_199_876_543_211
    );
    let decoded = UNIX_EPOCH - Duration::new(1, 0); // {-1, 0}
    assert_eq!(
        time_or_now(TimeOrNow::SpecificTime(decoded)),
        -1_000_000_000
    );
}
