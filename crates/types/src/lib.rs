//! Identifiers, error codes and checksums shared by every nacre crate.
//!
//! This crate is pure: no IO, no async, and no clock but the monotonic one of
//! [`OncePerSecond::admit_now`]. Everything in it is cheap to copy and stable on the wire (ids are
//! plain little-endian integers once encoded). [`sync`] holds the workspace's one policy for
//! poisoned locks.

pub mod sync;

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};

use serde::{Deserialize, Serialize};

macro_rules! id_type {
    ($(#[$meta:meta])* $name:ident($inner:ty), $prefix:literal) => {
        $(#[$meta])*
        #[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
        #[serde(transparent)]
        pub struct $name(pub $inner);

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, concat!($prefix, "{}"), self.0)
            }
        }

        impl From<$inner> for $name {
            fn from(v: $inner) -> Self {
                Self(v)
            }
        }
    };
}

id_type!(
    /// A node of the cluster (any role), assigned by the master at registration.
    NodeId(u64),
    "node-"
);
id_type!(
    /// A volume (a file system namespace and its data).
    VolumeId(u64),
    "vol-"
);
id_type!(
    /// A meta or data partition; unique across the cluster.
    PartitionId(u64),
    "p-"
);
id_type!(
    /// An inode number; inode ranges are split among meta partitions.
    Ino(u64),
    "ino-"
);
id_type!(
    /// An extent inside a data partition.
    ExtentId(u64),
    "ext-"
);

/// Extent ids `1..=TINY_EXTENTS` name a data partition's tiny extents: files shared by small files,
/// whose freed ranges are punched out. Larger ids are normal extents (one file each), deleted whole
/// once no file uses any of their bytes.
pub const TINY_EXTENTS: u64 = 16;

/// The first normal extent id; ids between the tiny ones and this are reserved.
pub const FIRST_NORMAL_EXTENT: u64 = 1024;

impl ExtentId {
    pub fn is_tiny(self) -> bool {
        (1..=TINY_EXTENTS).contains(&self.0)
    }

    pub fn is_normal(self) -> bool {
        self.0 >= FIRST_NORMAL_EXTENT
    }
}

/// Error codes that cross the wire in error frames. Each layer maps its own typed errors onto one of these;
/// the code is stable, the message is for humans.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[non_exhaustive]
pub enum ErrorCode {
    /// The peer could not decode the request body.
    BadRequest,
    /// No handler is registered for the op code.
    UnknownOp,
    /// The handler failed for a reason not covered by a more specific code.
    Internal,
    /// The peer is shutting down or overloaded; retry elsewhere or later.
    Unavailable,
    /// The request's deadline passed at the peer before it was served.
    DeadlineExceeded,
    /// The receiver is not the leader of the group; the message may carry a hint.
    NotLeader,
    /// The receiver does not host the addressed partition or group.
    UnknownGroup,
    /// The caller's view of the cluster is stale (epoch mismatch).
    StaleEpoch,
    /// The object addressed does not exist.
    NotFound,
    /// The object already exists.
    AlreadyExists,
    /// An argument is out of range or malformed.
    InvalidArgument,
    /// A checksum did not match.
    Corrupt,
    /// The peer is up but at its bound of work in flight: the same peer can take the request
    /// shortly (unlike `Unavailable`, no reason to count it down).
    Busy,
    /// A code this build does not know (sent by a newer peer).
    Unknown(u32),
}

impl ErrorCode {
    /// The stable numeric form used on the wire.
    pub fn as_u32(self) -> u32 {
        match self {
            Self::BadRequest => 1,
            Self::UnknownOp => 2,
            Self::Internal => 3,
            Self::Unavailable => 4,
            Self::DeadlineExceeded => 5,
            Self::NotLeader => 6,
            Self::UnknownGroup => 7,
            Self::StaleEpoch => 8,
            Self::NotFound => 9,
            Self::AlreadyExists => 10,
            Self::InvalidArgument => 11,
            Self::Corrupt => 12,
            Self::Busy => 13,
            Self::Unknown(c) => c,
        }
    }

    /// A short stable name (`not_leader`), for metric labels and logs.
    pub fn name(self) -> &'static str {
        match self {
            Self::BadRequest => "bad_request",
            Self::UnknownOp => "unknown_op",
            Self::Internal => "internal",
            Self::Unavailable => "unavailable",
            Self::DeadlineExceeded => "deadline_exceeded",
            Self::NotLeader => "not_leader",
            Self::UnknownGroup => "unknown_group",
            Self::StaleEpoch => "stale_epoch",
            Self::NotFound => "not_found",
            Self::AlreadyExists => "already_exists",
            Self::InvalidArgument => "invalid_argument",
            Self::Corrupt => "corrupt",
            Self::Busy => "busy",
            Self::Unknown(_) => "unknown",
        }
    }

    /// Inverse of [`ErrorCode::as_u32`]; unknown numbers are kept, not rejected.
    pub fn from_u32(code: u32) -> Self {
        match code {
            1 => Self::BadRequest,
            2 => Self::UnknownOp,
            3 => Self::Internal,
            4 => Self::Unavailable,
            5 => Self::DeadlineExceeded,
            6 => Self::NotLeader,
            7 => Self::UnknownGroup,
            8 => Self::StaleEpoch,
            9 => Self::NotFound,
            10 => Self::AlreadyExists,
            11 => Self::InvalidArgument,
            12 => Self::Corrupt,
            13 => Self::Busy,
            c => Self::Unknown(c),
        }
    }
}

impl fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Unknown(c) => write!(f, "unknown error code {c}"),
            other => fmt::Debug::fmt(other, f),
        }
    }
}

/// CRC-32C (Castagnoli) of `data`, hardware accelerated where the CPU allows.
///
/// `crc-fast` folds with carry-less multiplication (`VPCLMULQDQ` on AVX-512 CPUs) where the
/// `crc32c` crate runs the `crc32` instruction three streams wide: 66 against 31 GB/s on 32 KiB
/// and 128 KiB buffers on our benchmark VM, so the seven passes a replicated append makes over its
/// bytes (client, leader and followers' frame checks, three replicas' block CRCs) cost about half
/// as much (docs/benchmarks.md, "A faster CRC-32C"). The values are the same CRC-32C: stores
/// written before read back unchanged (`crc_matches_the_reference_implementation`).
#[inline]
pub fn crc32c(data: &[u8]) -> u32 {
    crc_fast::crc32_iscsi(data)
}

/// Continues a CRC-32C over another piece: `crc32c_append(crc32c(a), b) == crc32c(a ++ b)`.
#[inline]
pub fn crc32c_append(crc: u32, data: &[u8]) -> u32 {
    if data.is_empty() {
        return crc;
    }
    // The digest's state is the register before the final inversion, so a finished CRC resumes
    // from its complement.
    let mut d =
        crc_fast::Digest::new_with_init_state(crc_fast::CrcAlgorithm::Crc32Iscsi, u64::from(!crc));
    d.update(data);
    // The state of a 32-bit CRC fits in 32 bits.
    d.finalize() as u32
}

/// CRC-32C's polynomial, bit-reflected (bit 31 is the coefficient of x^0).
const CRC32C_POLY: u32 = 0x82F6_3B78;

/// `a · b mod P` over GF(2), both in CRC-32C's reflected representation.
const fn gf2_mul(a: u32, mut b: u32) -> u32 {
    let mut p = 0;
    let mut m = 1u32 << 31;
    while m != 0 {
        if a & m != 0 {
            p ^= b;
        }
        b = if b & 1 != 0 {
            (b >> 1) ^ CRC32C_POLY
        } else {
            b >> 1
        };
        m >>= 1;
    }
    p
}

/// `X2N[k]` is x^(2^k) mod P, by repeated squaring (no reliance on the period of x).
const X2N: [u32; 67] = {
    let mut t = [0u32; 67];
    t[0] = 1 << 30;
    let mut k = 1;
    while k < t.len() {
        t[k] = gf2_mul(t[k - 1], t[k - 1]);
        k += 1;
    }
    t
};

/// CRC-32C of `a ++ b` from `crc32c(a)`, `crc32c(b)` and `b`'s length in bytes, without reading
/// either: `crc32c_combine(crc32c(a), crc32c(b), b.len()) == crc32c(a ++ b)`. A GF(2)
/// multiplication per set bit of the length: 74 ns for a 128 KiB length here, against 6.4 µs for
/// a pass over 128 KiB and 55 µs for the `crc32c` crate's own combine, which squares 32×32 bit
/// matrices per bit of the length (docs/benchmarks.md, "One CRC pass per packet fewer").
pub fn crc32c_combine(crc1: u32, crc2: u32, len2: u64) -> u32 {
    // x^(8·len2) mod P: x^(2^(k+3)) for every bit k set in len2.
    let mut shift = 1u32 << 31;
    let mut n = len2;
    let mut k = 3;
    while n != 0 {
        if n & 1 != 0 {
            shift = gf2_mul(X2N[k], shift);
        }
        n >>= 1;
        k += 1;
    }
    gf2_mul(shift, crc1) ^ crc2
}

/// Admits one log line per second and counts the lines it turned away meanwhile: for warnings a
/// fault can repeat on every call. The caller's clock gives the second (`admit(now)`).
#[derive(Debug)]
pub struct OncePerSecond {
    /// The second of the last line admitted, plus one (0: none yet).
    last: AtomicU64,
    dropped: AtomicU64,
}

impl OncePerSecond {
    pub const fn new() -> Self {
        Self {
            last: AtomicU64::new(0),
            dropped: AtomicU64::new(0),
        }
    }

    /// At second `now`: `Some(lines turned away since the last one)` when a line may be written.
    pub fn admit(&self, now: u64) -> Option<u64> {
        let last = self.last.load(Ordering::Relaxed);
        if last != now + 1
            && self
                .last
                .compare_exchange(last, now + 1, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
        {
            return Some(self.dropped.swap(0, Ordering::Relaxed));
        }
        self.dropped.fetch_add(1, Ordering::Relaxed);
        None
    }
}

impl OncePerSecond {
    /// [`admit`](Self::admit) at the current second of a monotonic clock that starts at the
    /// process's first call.
    pub fn admit_now(&self) -> Option<u64> {
        static START: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();
        let now = START
            .get_or_init(std::time::Instant::now)
            .elapsed()
            .as_secs();
        self.admit(now)
    }
}

impl Default for OncePerSecond {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_codes_keep_their_wire_numbers_and_names() {
        let all = [
            ErrorCode::BadRequest,
            ErrorCode::UnknownOp,
            ErrorCode::Internal,
            ErrorCode::Unavailable,
            ErrorCode::DeadlineExceeded,
            ErrorCode::NotLeader,
            ErrorCode::UnknownGroup,
            ErrorCode::StaleEpoch,
            ErrorCode::NotFound,
            ErrorCode::AlreadyExists,
            ErrorCode::InvalidArgument,
            ErrorCode::Corrupt,
            ErrorCode::Busy,
        ];
        for (i, c) in all.iter().enumerate() {
            assert_eq!(c.as_u32(), i as u32 + 1, "{c}");
        }
        let names: std::collections::BTreeSet<_> = all.iter().map(|c| c.name()).collect();
        assert_eq!(names.len(), all.len(), "names are distinct");
    }

    #[test]
    fn crc_combine_matches_the_crc_of_the_concatenation() {
        // Lengths around the bits that matter: empty, odd, powers of two, a packet.
        let data: Vec<u8> = (0..300_000u32)
            .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
            .collect();
        for split in [
            0usize, 1, 7, 8, 4095, 4096, 65_536, 131_072, 131_073, 299_999, 300_000,
        ] {
            for end in [split, split + 1, split + 4096, split + 131_072, 300_000] {
                let end = end.min(data.len());
                let (a, b) = (&data[..split], &data[split..end]);
                assert_eq!(
                    crc32c_combine(crc32c(a), crc32c(b), b.len() as u64),
                    crc32c(&data[..end]),
                    "split {split} end {end}"
                );
            }
        }
        // The crate's own (slow) combine agrees on a length beyond what we could allocate.
        let big = (1u64 << 40) + 12_345;
        assert_eq!(
            crc32c_combine(0x1234_5678, 0x9abc_def0, big),
            ::crc32c::crc32c_combine(0x1234_5678, 0x9abc_def0, big as usize)
        );
    }

    #[test]
    fn error_code_round_trips_including_unknown() {
        for code in 0..64u32 {
            assert_eq!(ErrorCode::from_u32(code).as_u32(), code);
        }
    }

    #[test]
    fn crc_matches_the_reference_implementation() {
        // Every length up to 1 KiB from every start alignment up to 64, then sizes around the
        // block and packet sizes: the same values the `crc32c` crate gives, which wrote the CRCs
        // already on disk.
        let data: Vec<u8> = (0..300_000u32)
            .map(|i| (i.wrapping_mul(2_654_435_761) >> 11) as u8)
            .collect();
        for start in 0..64 {
            for len in 0..1024 {
                let d = &data[start..start + len];
                assert_eq!(crc32c(d), ::crc32c::crc32c(d), "start {start} len {len}");
            }
        }
        for len in [
            4095, 4096, 4097, 32_767, 32_768, 65_536, 131_071, 131_072, 299_000,
        ] {
            for start in [0, 1, 13, 1000] {
                let d = &data[start..start + len];
                assert_eq!(crc32c(d), ::crc32c::crc32c(d), "start {start} len {len}");
                // Resumed at any split, small or large pieces.
                for split in [0, 1, 100, len / 2, len - 1, len] {
                    let (a, b) = d.split_at(split);
                    assert_eq!(
                        crc32c_append(crc32c(a), b),
                        ::crc32c::crc32c(d),
                        "start {start} len {len} split {split}"
                    );
                    assert_eq!(
                        crc32c_append(0x1234_5678, b),
                        ::crc32c::crc32c_append(0x1234_5678, b)
                    );
                }
            }
        }
    }

    #[test]
    fn crc_append_matches_whole() {
        let (a, b) = (b"hello ".as_slice(), b"world".as_slice());
        assert_eq!(crc32c_append(crc32c(a), b), crc32c(b"hello world"));
        assert_eq!(crc32c_append(0, b"hello world"), crc32c(b"hello world"));
        assert_eq!(crc32c(b""), 0);
        // The standard check value of CRC-32C.
        assert_eq!(crc32c(b"123456789"), 0xE306_9283);
    }

    /// One line a second: the rest of that second's lines are counted and reported with the next.
    #[test]
    fn warnings_are_admitted_once_a_second_and_the_rest_counted() {
        let q = OncePerSecond::new();
        assert_eq!(q.admit(0), Some(0));
        assert_eq!(q.admit(0), None);
        assert_eq!(q.admit(0), None);
        assert_eq!(q.admit(1), Some(2));
        assert_eq!(q.admit(1), None);
        assert_eq!(q.admit(7), Some(1));
    }
}
