//! Byte layouts of the extent store's files (docs/data-store.md). Every integer is little-endian.
//!
//! `<id>.data` holds the extent's bytes and nothing else. `<id>.crc` holds two header slots and then
//! one 32-byte record per block:
//!
//! ```text
//! offset 0    header slot 0 (64 bytes)
//! offset 64   header slot 1 (64 bytes)
//! offset 128  record of block 0, then block 1, ... (32 bytes each)
//! ```

use nacre_types::{ExtentId, crc32c};

/// Size of one header slot.
pub(super) const SLOT: u64 = 64;
/// Where the block records start.
pub(super) const RECORDS_AT: u64 = 2 * SLOT;
/// Size of one block record.
pub(super) const RECORD: u64 = 32;

const MAGIC: [u8; 4] = *b"NXCR";
const VERSION: u16 = 1;
/// Record flag: `alt` holds a second CRC that also verifies the block (its content before a punch whose
/// data change may not be durable yet).
const ALT: u32 = 1;

const DATA_SUFFIX: &str = ".data";
const CRC_SUFFIX: &str = ".crc";
const TRASH_SUFFIX: &str = ".deleted";

pub(super) fn data_name(id: ExtentId) -> String {
    format!("{}{DATA_SUFFIX}", id.0)
}

pub(super) fn crc_name(id: ExtentId) -> String {
    format!("{}{CRC_SUFFIX}", id.0)
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Kind {
    Data,
    Crc,
}

/// What a deleted extent's file is renamed to (`<id>.data.deleted`, `<id>.crc.deleted`) until it is
/// removed: removing a large file is slow, so it happens later, off the deleting thread.
pub(super) fn trash_name(name: &str) -> String {
    format!("{name}{TRASH_SUFFIX}")
}

/// Whether `name` is a deleted extent's file waiting for removal ([`trash_name`]).
pub(super) fn is_trash(name: &str) -> bool {
    name.strip_suffix(TRASH_SUFFIX)
        .is_some_and(|n| parse_name(n).is_some())
}

/// Parses `<id>.data` / `<id>.crc` with `id` in canonical decimal (no sign, no leading zero).
pub(super) fn parse_name(name: &str) -> Option<(ExtentId, Kind)> {
    let (num, kind) = if let Some(n) = name.strip_suffix(DATA_SUFFIX) {
        (n, Kind::Data)
    } else {
        (name.strip_suffix(CRC_SUFFIX)?, Kind::Crc)
    };
    if num.is_empty() || !num.bytes().all(|b| b.is_ascii_digit()) || num.starts_with('0') {
        return None;
    }
    num.parse().ok().map(|id| (ExtentId(id), kind))
}

/// A commit header: the extent length `len` was durable when a sync (or truncate) that wrote this
/// header completed, and `tail_crc` is the CRC of the partial last block `[len - len % bs, len)`
/// (0 when `len` is block aligned).
///
/// ```text
/// 0  magic "NXCR"   4  version u16 (1)   6  reserved u16 (0)
/// 8  block_size u32   12 tail_crc u32   16 seq u64   24 len u64
/// 32 reserved (28 zero bytes)   60 crc32c of bytes 0..60
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Header {
    pub block_size: u32,
    pub tail_crc: u32,
    /// Grows with every header written to the extent: the larger of two valid slots is the newer.
    pub seq: u64,
    pub len: u64,
}

/// What a header slot holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Slot {
    /// Never written (all zeros, or absent).
    Empty,
    /// Written but not intact: a write torn by a crash.
    Torn,
    Valid(Header),
    /// Intact but of a format version this build does not know.
    Unsupported(u16),
}

impl Header {
    pub fn encode(&self) -> [u8; SLOT as usize] {
        let mut b = [0u8; SLOT as usize];
        b[0..4].copy_from_slice(&MAGIC);
        b[4..6].copy_from_slice(&VERSION.to_le_bytes());
        b[8..12].copy_from_slice(&self.block_size.to_le_bytes());
        b[12..16].copy_from_slice(&self.tail_crc.to_le_bytes());
        b[16..24].copy_from_slice(&self.seq.to_le_bytes());
        b[24..32].copy_from_slice(&self.len.to_le_bytes());
        let crc = crc32c(&b[..60]);
        b[60..64].copy_from_slice(&crc.to_le_bytes());
        b
    }

    /// Decodes a slot; `b` may be short (a crc file cut inside its headers).
    pub fn decode(b: &[u8]) -> Slot {
        if b.iter().all(|&x| x == 0) {
            return Slot::Empty;
        }
        if b.len() < SLOT as usize || b[0..4] != MAGIC || crc32c(&b[..60]) != u32_at(b, 60) {
            return Slot::Torn;
        }
        let version = u16::from_le_bytes([b[4], b[5]]);
        if version != VERSION {
            return Slot::Unsupported(version);
        }
        Slot::Valid(Header {
            block_size: u32_at(b, 8),
            tail_crc: u32_at(b, 12),
            seq: u64_at(b, 16),
            len: u64_at(b, 24),
        })
    }
}

/// A block record: `crc` is the CRC-32C of the first `len` bytes of the block (`len` is the block
/// size except for the last block). `epoch` is the `seq` the extent's next header was to get when
/// the record was written, so a record is newer than a header iff `epoch > header.seq`.
///
/// ```text
/// 0 len u32   4 crc u32   8 alt u32   12 flags u32 (bit 0: alt is valid; other bits 0)
/// 16 epoch u64   24 reserved u64 (0)
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) struct Record {
    pub len: u32,
    pub crc: u32,
    pub alt: Option<u32>,
    pub epoch: u64,
}

impl Record {
    pub fn new(len: u32, crc: u32, epoch: u64) -> Self {
        Self {
            len,
            crc,
            alt: None,
            epoch,
        }
    }

    pub fn encode(&self) -> [u8; RECORD as usize] {
        let mut b = [0u8; RECORD as usize];
        b[0..4].copy_from_slice(&self.len.to_le_bytes());
        b[4..8].copy_from_slice(&self.crc.to_le_bytes());
        if let Some(alt) = self.alt {
            b[8..12].copy_from_slice(&alt.to_le_bytes());
            b[12..16].copy_from_slice(&ALT.to_le_bytes());
        }
        b[16..24].copy_from_slice(&self.epoch.to_le_bytes());
        b
    }

    /// Decodes a full record (any bit pattern is a record; the data decides if it verifies).
    pub fn decode(b: &[u8]) -> Self {
        Self {
            len: u32_at(b, 0),
            crc: u32_at(b, 4),
            alt: (u32_at(b, 12) & ALT != 0).then(|| u32_at(b, 8)),
            epoch: u64_at(b, 16),
        }
    }
}

/// Offset of block `block`'s record in the crc file.
pub(super) fn record_at(block: u64) -> u64 {
    RECORDS_AT + block * RECORD
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    let mut x = [0u8; 4];
    if let Some(s) = b.get(at..at + 4) {
        x.copy_from_slice(s);
    }
    u32::from_le_bytes(x)
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    let mut x = [0u8; 8];
    if let Some(s) = b.get(at..at + 8) {
        x.copy_from_slice(s);
    }
    u64::from_le_bytes(x)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_reject_non_canonical() {
        assert_eq!(data_name(ExtentId(1024)), "1024.data");
        assert_eq!(parse_name("1024.data"), Some((ExtentId(1024), Kind::Data)));
        assert_eq!(parse_name("7.crc"), Some((ExtentId(7), Kind::Crc)));
        for bad in [
            "01.data",
            ".data",
            "x.crc",
            "1.dat",
            "-1.crc",
            "99999999999999999999.data",
        ] {
            assert_eq!(parse_name(bad), None, "{bad}");
        }
    }

    #[test]
    fn header_round_trips_and_detects_tears() {
        let h = Header {
            block_size: 4096,
            tail_crc: 7,
            seq: 3,
            len: 12345,
        };
        let b = h.encode();
        assert_eq!(Header::decode(&b), Slot::Valid(h));
        assert_eq!(Header::decode(&[0; 64]), Slot::Empty);
        assert_eq!(Header::decode(&b[..40]), Slot::Torn);
        let mut t = b;
        t[30] ^= 1;
        assert_eq!(Header::decode(&t), Slot::Torn);
    }

    #[test]
    fn record_round_trips() {
        for r in [
            Record::new(5, 9, 4),
            Record {
                len: 1,
                crc: 2,
                alt: Some(3),
                epoch: u64::MAX,
            },
        ] {
            assert_eq!(Record::decode(&r.encode()), r);
        }
    }
}
