//! Self-identifying file content. Every version of every file the killed client writes is a
//! sequence of 32-byte ASCII records, each naming its incarnation, file, version and its own
//! offset in the file, with a check sum:
//!
//! ```text
//! 0003.0000c.0002.0000001000.9f1e\n
//! inc  file  ver  offset     crc
//! ```
//!
//! So bytes that belong elsewhere say where they belong (another file sharing a tiny extent, an
//! older version, another offset), and a zero never appears in anything written: a zero read
//! back is a byte nobody wrote. `nacre fs cat` shows a file's records as lines.

use nacre_types::crc32c;
use serde::Serialize;

/// Bytes per record.
pub const RECORD: u64 = 32;
/// Largest incarnation, file and version numbers and offset a record can hold.
const MAX_INC: u32 = 0xFFFF;
const MAX_FILE: u32 = 0xF_FFFF;
const MAX_VERSION: u32 = 0xFFFF;
const MAX_OFFSET: u64 = 0xFF_FFFF_FFFF;

/// One version of one file of one incarnation of the client.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub struct VersionId {
    pub inc: u32,
    pub file: u32,
    pub version: u32,
}

impl std::fmt::Display for VersionId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "i{}/f{} v{}", self.inc, self.file, self.version)
    }
}

/// A number too large for a record's field.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{what} {value} does not fit a content record (at most {max})")]
pub struct TooLarge {
    pub what: &'static str,
    pub value: u64,
    pub max: u64,
}

impl VersionId {
    /// Checks that every field, and offsets up to `len`, fit a record.
    pub fn fits(&self, len: u64) -> Result<(), TooLarge> {
        let check = |what, value: u64, max: u64| {
            if value > max {
                Err(TooLarge { what, value, max })
            } else {
                Ok(())
            }
        };
        check("incarnation", self.inc.into(), MAX_INC.into())?;
        check("file", self.file.into(), MAX_FILE.into())?;
        check("version", self.version.into(), MAX_VERSION.into())?;
        check("length", len, MAX_OFFSET)
    }
}

const HEX: &[u8; 16] = b"0123456789abcdef";

fn put_hex(out: &mut [u8], mut v: u64) {
    for b in out.iter_mut().rev() {
        *b = HEX[(v & 0xF) as usize];
        v >>= 4;
    }
}

fn get_hex(s: &[u8]) -> Option<u64> {
    s.iter().try_fold(0u64, |acc, &c| {
        let d = match c {
            b'0'..=b'9' => c - b'0',
            b'a'..=b'f' => c - b'a' + 10,
            _ => return None,
        };
        Some(acc << 4 | u64::from(d))
    })
}

/// The record at `off` (a multiple of [`RECORD`]) of version `id`.
fn record(id: VersionId, off: u64) -> [u8; RECORD as usize] {
    let mut r = [b'.'; RECORD as usize];
    put_hex(&mut r[0..4], id.inc.into());
    put_hex(&mut r[5..10], id.file.into());
    put_hex(&mut r[11..15], id.version.into());
    put_hex(&mut r[16..26], off);
    let crc = crc32c(&r[..26]) & 0xFFFF;
    put_hex(&mut r[27..31], crc.into());
    r[31] = b'\n';
    r
}

/// Bytes `from..from + len` of version `id`.
pub fn bytes(id: VersionId, from: u64, len: u64) -> Vec<u8> {
    let mut out = Vec::with_capacity(len as usize);
    let end = from + len;
    let mut at = from - from % RECORD;
    while at < end {
        let r = record(id, at);
        let lo = from.saturating_sub(at) as usize;
        let hi = (end - at).min(RECORD) as usize;
        out.extend_from_slice(&r[lo..hi]);
        at += RECORD;
    }
    out
}

/// Where the whole record `r` belongs, if it is one (its check sum right).
pub fn decode(r: &[u8]) -> Option<(VersionId, u64)> {
    if r.len() != RECORD as usize || r[31] != b'\n' || [4, 10, 15, 26].iter().any(|&i| r[i] != b'.')
    {
        return None;
    }
    let field = |a: usize, b: usize| get_hex(&r[a..b]);
    let id = VersionId {
        inc: u32::try_from(field(0, 4)?).ok()?,
        file: u32::try_from(field(5, 10)?).ok()?,
        version: u32::try_from(field(11, 15)?).ok()?,
    };
    let off = field(16, 26)?;
    let crc = field(27, 31)?;
    (u64::from(crc32c(&r[..26]) & 0xFFFF) == crc).then_some((id, off))
}

/// What the bytes of a file at `at` are, if they are not what they should be: the record of
/// `data` that holds `at`, decoded when it is whole and valid.
pub fn identify(data: &[u8], at: u64) -> Found {
    let start = (at - at % RECORD) as usize;
    let Some(r) = data.get(start..start + RECORD as usize) else {
        return Found::Unknown;
    };
    if r.iter().all(|&b| b == 0) {
        return Found::Zeros;
    }
    match decode(r) {
        Some((id, off)) => Found::Record { id, off },
        None if data.get(at as usize) == Some(&0) => Found::Zeros,
        None => Found::Unknown,
    }
}

/// What [`identify`] found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Found {
    /// A whole record of all zeros, or a zero byte: nothing ever wrote it.
    Zeros,
    /// A valid record of version `id` written at `off` of its file.
    Record { id: VersionId, off: u64 },
    /// Not a record (a torn or partial one, or garbage).
    Unknown,
}
