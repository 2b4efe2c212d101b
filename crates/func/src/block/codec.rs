//! The codecs behind block frames: zstd (one context per thread) and lz4 (lz4_flex). Built with
//! the `codecs` feature.

use std::cell::RefCell;
use std::io::Cursor;

use bytes::Bytes;

use super::{
    BlockHeader, Codec, CodecId, FLAG_RAW, HEADER_LEN, MAGIC, MAX_BLOCK_LEN, MIN_SAVING_SHIFT,
    VERSION, read_header,
};
use crate::{FuncError, checksum};

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

impl Codec {
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
