//! Block compression in self-describing, checksummed frames (the layout is in the crate doc).

use std::cell::RefCell;
use std::fmt;
use std::io::Cursor;

use bytes::Bytes;
use serde::{Deserialize, Serialize};

use crate::{FuncError, checksum};

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

    /// Checks the parameters without compressing anything.
    pub fn validate(self) -> Result<(), FuncError> {
        if let Codec::Zstd { level } = self {
            let range = zstd::compression_level_range();
            if !range.contains(&level) {
                return Err(FuncError::BadLevel {
                    level,
                    min: *range.start(),
                    max: *range.end(),
                });
            }
        }
        Ok(())
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

impl BlockHeader {
    fn encode(&self) -> [u8; HEADER_LEN] {
        let mut h = [0u8; HEADER_LEN];
        h[0..3].copy_from_slice(&MAGIC);
        h[3] = VERSION;
        h[4] = self.codec as u8;
        h[5] = if self.raw { FLAG_RAW } else { 0 };
        // 6..8 reserved, zero.
        h[8..12].copy_from_slice(&self.len.to_le_bytes());
        h[12..16].copy_from_slice(&self.stored_len.to_le_bytes());
        h[16..20].copy_from_slice(&self.crc.to_le_bytes());
        let hcrc = checksum(&h[0..20]);
        h[20..24].copy_from_slice(&hcrc.to_le_bytes());
        h
    }
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

// One zstd context per thread: creating one costs an allocation and a table setup that is a
// visible fraction of compressing a 64 KiB block. Contexts keep no data between calls.
thread_local! {
    static ZSTD_COMPRESSOR: RefCell<Option<zstd::bulk::Compressor<'static>>> =
        const { RefCell::new(None) };
    static ZSTD_DECOMPRESSOR: RefCell<Option<zstd::bulk::Decompressor<'static>>> =
        const { RefCell::new(None) };
}

fn zstd_compress_into(level: i32, input: &[u8], out: &mut Vec<u8>) -> Result<(), FuncError> {
    let fail = |e: std::io::Error| FuncError::Compress {
        codec: CodecId::Zstd,
        reason: e.to_string(),
    };
    ZSTD_COMPRESSOR.with(|cell| {
        let mut slot = cell.borrow_mut();
        let c = match slot.as_mut() {
            Some(c) => {
                c.set_compression_level(level).map_err(fail)?;
                c
            }
            None => slot.insert(zstd::bulk::Compressor::new(level).map_err(fail)?),
        };
        // The cursor makes zstd write after the header, into the vector's spare capacity.
        let start = out.len() as u64;
        let mut cursor = Cursor::new(std::mem::take(out));
        cursor.set_position(start);
        let r = c.compress_to_buffer(input, &mut cursor);
        *out = cursor.into_inner();
        r.map(|_| ()).map_err(fail)
    })
}

fn zstd_decompress(payload: &[u8], len: u32) -> Result<Vec<u8>, FuncError> {
    let corrupt = |e: std::io::Error| FuncError::Corrupt {
        codec: CodecId::Zstd,
        reason: e.to_string(),
    };
    ZSTD_DECOMPRESSOR.with(|cell| {
        let mut slot = cell.borrow_mut();
        let d = match slot.as_mut() {
            Some(d) => d,
            None => slot.insert(zstd::bulk::Decompressor::new().map_err(corrupt)?),
        };
        // Capacity bounds the output: zstd fails rather than writing past `len` bytes.
        let mut out = Vec::with_capacity(len as usize);
        d.decompress_to_buffer(payload, &mut out).map_err(corrupt)?;
        Ok(out)
    })
}

/// Compresses `block` into a frame. Returns a raw frame when the codec is [`Codec::None`] or
/// compression would not save [`MIN_SAVING_SHIFT`]'s share of the block.
///
/// Fails only on a block above [`MAX_BLOCK_LEN`], an invalid zstd level, or a compressor that
/// cannot allocate.
pub fn compress_block(codec: Codec, block: &[u8]) -> Result<Bytes, FuncError> {
    codec.validate()?;
    let len = u32::try_from(block.len())
        .ok()
        .filter(|&l| l <= MAX_BLOCK_LEN)
        .ok_or(FuncError::BlockTooLarge {
            len: block.len() as u64,
            max: MAX_BLOCK_LEN,
        })?;
    let crc = checksum(block);
    // Kept compressed only at or below this length; always < len.
    let keep_at_most = block
        .len()
        .saturating_sub((block.len() >> MIN_SAVING_SHIFT).max(1));

    let mut out = match codec {
        Codec::None => Vec::new(),
        Codec::Zstd { level } => {
            let mut out =
                Vec::with_capacity(HEADER_LEN + zstd::zstd_safe::compress_bound(block.len()));
            out.resize(HEADER_LEN, 0);
            zstd_compress_into(level, block, &mut out)?;
            out
        }
        Codec::Lz4 => {
            let mut out =
                vec![0u8; HEADER_LEN + lz4_flex::block::get_maximum_output_size(block.len())];
            let n = lz4_flex::block::compress_into(block, &mut out[HEADER_LEN..]).map_err(|e| {
                FuncError::Compress {
                    codec: CodecId::Lz4,
                    reason: e.to_string(),
                }
            })?;
            out.truncate(HEADER_LEN + n);
            out
        }
    };

    let compressed_len = out.len().saturating_sub(HEADER_LEN);
    let raw = codec == Codec::None || compressed_len > keep_at_most;
    if raw {
        out.clear();
        out.reserve_exact(HEADER_LEN + block.len());
        out.resize(HEADER_LEN, 0);
        out.extend_from_slice(block);
    }
    let stored_len = (out.len() - HEADER_LEN) as u32;
    let header = BlockHeader {
        codec: codec.id(),
        raw,
        len,
        stored_len,
        crc,
    };
    out[..HEADER_LEN].copy_from_slice(&header.encode());
    Ok(Bytes::from(out))
}

/// Decodes a frame made by [`compress_block`]: validates the header ([`read_header`]),
/// decompresses into at most the header's length, and checks the result's length and CRC-32C.
/// Every failure is a [`FuncError`]; data is returned only once its checksum matches.
pub fn decompress_block(frame: &[u8]) -> Result<Bytes, FuncError> {
    let header = read_header(frame)?;
    let payload = &frame[HEADER_LEN..];
    let out = if header.raw {
        payload.to_vec()
    } else {
        match header.codec {
            CodecId::Zstd => zstd_decompress(payload, header.len)?,
            CodecId::Lz4 => {
                let mut out = vec![0u8; header.len as usize];
                let n = lz4_flex::block::decompress_into(payload, &mut out).map_err(|e| {
                    FuncError::Corrupt {
                        codec: CodecId::Lz4,
                        reason: e.to_string(),
                    }
                })?;
                out.truncate(n);
                out
            }
            // read_header refuses a compressed frame with codec none.
            CodecId::None => return Err(FuncError::NoneNotRaw),
        }
    };
    if out.len() as u64 != u64::from(header.len) {
        return Err(FuncError::DecompressedLength {
            codec: header.codec,
            expected: header.len,
            actual: out.len() as u64,
        });
    }
    let computed = checksum(&out);
    if computed != header.crc {
        return Err(FuncError::DataChecksum {
            stored: header.crc,
            computed,
        });
    }
    Ok(Bytes::from(out))
}
