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

#[test]
fn fallocate_modes_map_as_linux_checks_them() {
    use libc::{
        FALLOC_FL_COLLAPSE_RANGE as COLLAPSE, FALLOC_FL_INSERT_RANGE as INSERT,
        FALLOC_FL_KEEP_SIZE as KEEP, FALLOC_FL_PUNCH_HOLE as PUNCH,
        FALLOC_FL_UNSHARE_RANGE as UNSHARE, FALLOC_FL_ZERO_RANGE as ZERO,
    };
    const NO_HIDE: i32 = 0x04; // FALLOC_FL_NO_HIDE_STALE
    let ok = [
        (0, Falloc::Allocate),
        (KEEP, Falloc::KeepSize),
        (PUNCH | KEEP, Falloc::PunchHole),
        (ZERO, Falloc::ZeroRange { keep_size: false }),
        (ZERO | KEEP, Falloc::ZeroRange { keep_size: true }),
    ];
    for (mode, want) in ok {
        assert_eq!(falloc_mode(mode, 10, 20), Ok(want), "{mode:#x}");
    }
    let bad = [
        (PUNCH, Errno::EOPNOTSUPP),
        (PUNCH | ZERO, Errno::EOPNOTSUPP),
        (PUNCH | ZERO | KEEP, Errno::EOPNOTSUPP),
        (COLLAPSE, Errno::EOPNOTSUPP),
        (INSERT, Errno::EOPNOTSUPP),
        (UNSHARE, Errno::EOPNOTSUPP),
        (NO_HIDE | PUNCH | KEEP, Errno::EOPNOTSUPP),
        (0x1000, Errno::EOPNOTSUPP),
        (-1, Errno::EOPNOTSUPP),
    ];
    for (mode, want) in bad {
        assert_eq!(falloc_mode(mode, 10, 20), Err(want), "{mode:#x}");
    }
    // Lengths and offsets, checked before the mode as the kernel does.
    assert_eq!(falloc_mode(COLLAPSE, 0, 0), Err(Errno::EINVAL));
    assert_eq!(falloc_mode(0, 1 << 63, 1), Err(Errno::EINVAL));
    assert_eq!(falloc_mode(0, 0, 1 << 63), Err(Errno::EINVAL));
    assert_eq!(falloc_mode(0, i64::MAX as u64, 1), Err(Errno::EFBIG));
    assert_eq!(falloc_mode(0, i64::MAX as u64 - 1, 1), Ok(Falloc::Allocate));
}
