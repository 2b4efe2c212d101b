//! Block compression in self-describing, checksummed frames (the layout is in the crate doc).

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::{FuncError, checksum};

#[cfg(feature = "codecs")]
mod codec;
#[cfg(feature = "codecs")]
pub use codec::{compress_block, decompress_block};

/// Bytes before the payload.
pub const HEADER_LEN: usize = 24;
/// First three bytes of every frame: "NCB", nacre compressed block.
pub const MAGIC: [u8; 3] = *b"NCB";
/// The frame version this build writes and reads.
pub const VERSION: u8 = 1;
/// Largest uncompressed block (and so largest payload) a frame may describe. A decoder allocates
/// at most this much whatever a header says, so a forged length cannot exhaust memory.
pub const MAX_BLOCK_LEN: u32 = 16 << 20;
/// Flag bit: the payload is the block itself, not compressed.
pub const FLAG_RAW: u8 = 0x01;
const KNOWN_FLAGS: u8 = FLAG_RAW;

/// A block is stored compressed only when that saves at least `len >> MIN_SAVING_SHIFT` bytes
/// (1/8, 12.5 %, ZFS's rule) and at least one byte. Below that every read would pay a
/// decompression for almost no space, so the block is stored raw.
pub const MIN_SAVING_SHIFT: u32 = 3;

/// A compression codec and its parameters, as a volume or a [`Call`](crate::Call) names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Codec {
    /// Store blocks raw (still framed and checksummed).
    None,
    /// Zstandard at `level` (zstd's range, negative levels included; 0 is zstd's default, 3).
    Zstd { level: i32 },
    /// LZ4 block format (lz4_flex).
    Lz4,
}

impl Codec {
    /// The id written in a frame header.
    pub fn id(self) -> CodecId {
        match self {
            Codec::None => CodecId::None,
            Codec::Zstd { .. } => CodecId::Zstd,
            Codec::Lz4 => CodecId::Lz4,
        }
    }
}

/// The codec byte of a frame header: which decoder reads the payload. Levels are not recorded
/// because decoding does not need them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[repr(u8)]
pub enum CodecId {
    None = 0,
    Zstd = 1,
    Lz4 = 2,
}

impl CodecId {
    fn from_u8(id: u8) -> Result<Self, FuncError> {
        match id {
            0 => Ok(CodecId::None),
            1 => Ok(CodecId::Zstd),
            2 => Ok(CodecId::Lz4),
            _ => Err(FuncError::UnknownCodec { id }),
        }
    }
}

impl fmt::Display for CodecId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            CodecId::None => "none",
            CodecId::Zstd => "zstd",
            CodecId::Lz4 => "lz4",
        })
    }
}

/// A validated frame header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockHeader {
    /// The codec the block was compressed with (kept on raw frames: the codec that was tried).
    pub codec: CodecId,
    /// The payload is the block itself.
    pub raw: bool,
    /// Length of the uncompressed block.
    pub len: u32,
    /// Length of the payload after the header.
    pub stored_len: u32,
    /// CRC-32C of the uncompressed block.
    pub crc: u32,
}
fn le_u32(b: &[u8], at: usize) -> u32 {
    let mut w = [0u8; 4];
    w.copy_from_slice(&b[at..at + 4]);
    u32::from_le_bytes(w)
}

/// Reads and validates a frame's header against the frame's length, without touching the payload:
/// enough to learn a block's uncompressed length. [`decompress_block`] does this first.
pub fn read_header(frame: &[u8]) -> Result<BlockHeader, FuncError> {
    if frame.len() < HEADER_LEN {
        return Err(FuncError::Truncated { len: frame.len() });
    }
    let h = &frame[..HEADER_LEN];
    if h[0..3] != MAGIC {
        return Err(FuncError::BadMagic {
            found: [h[0], h[1], h[2]],
        });
    }
    if h[3] != VERSION {
        return Err(FuncError::UnsupportedVersion { version: h[3] });
    }
    let stored = le_u32(h, 20);
    let computed = checksum(&h[0..20]);
    if stored != computed {
        return Err(FuncError::HeaderChecksum { stored, computed });
    }
    let codec = CodecId::from_u8(h[4])?;
    let flags = h[5];
    if flags & !KNOWN_FLAGS != 0 {
        return Err(FuncError::UnknownFlags { flags });
    }
    if h[6] != 0 || h[7] != 0 {
        return Err(FuncError::ReservedNotZero);
    }
    let header = BlockHeader {
        codec,
        raw: flags & FLAG_RAW != 0,
        len: le_u32(h, 8),
        stored_len: le_u32(h, 12),
        crc: le_u32(h, 16),
    };
    for len in [header.len, header.stored_len] {
        if len > MAX_BLOCK_LEN {
            return Err(FuncError::BlockTooLarge {
                len: u64::from(len),
                max: MAX_BLOCK_LEN,
            });
        }
    }
    let expected = HEADER_LEN as u64 + u64::from(header.stored_len);
    if frame.len() as u64 != expected {
        return Err(FuncError::FrameLength {
            expected,
            actual: frame.len() as u64,
        });
    }
    if header.raw {
        if header.stored_len != header.len {
            return Err(FuncError::RawLength {
                stored: header.stored_len,
                len: header.len,
            });
        }
    } else if codec == CodecId::None {
        return Err(FuncError::NoneNotRaw);
    } else if header.stored_len >= header.len {
        return Err(FuncError::NotCompressed {
            stored: header.stored_len,
            len: header.len,
        });
    }
    Ok(header)
}
