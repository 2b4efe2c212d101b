//! The one error type of every storage function.

use serde::{Deserialize, Serialize};

use crate::block::{CodecId, HEADER_LEN};
use crate::call::{Function, InputKind};

/// Why a storage function refused its input. Every variant names one failure; none of them is a
/// panic in disguise, and no function returns data it could not verify.
///
/// Serializable so that a function server can send the exact error back to its caller.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error, Serialize, Deserialize)]
pub enum FuncError {
    // ---- block frames ----
    /// Fewer bytes than a block frame header.
    #[error("block frame is {len} bytes, shorter than its {HEADER_LEN}-byte header")]
    Truncated { len: usize },
    /// The first bytes are not a nacre block frame's magic.
    #[error("not a block frame: magic {found:02x?}")]
    BadMagic { found: [u8; 3] },
    /// A frame version this build does not read.
    #[error("block frame version {version} is not supported (this build reads version 1)")]
    UnsupportedVersion { version: u8 },
    /// The header's own CRC-32C does not match its bytes: the header is corrupt.
    #[error(
        "block frame header checksum mismatch: stored {stored:#010x}, computed {computed:#010x}"
    )]
    HeaderChecksum { stored: u32, computed: u32 },
    /// A codec id that no codec has.
    #[error("unknown codec id {id}")]
    UnknownCodec { id: u8 },
    /// Flag bits that this version does not define.
    #[error("unknown block frame flags {flags:#04x}")]
    UnknownFlags { flags: u8 },
    /// The reserved header bytes are not zero.
    #[error("block frame reserved bytes are not zero")]
    ReservedNotZero,
    /// A block (or a stored payload) longer than [`MAX_BLOCK_LEN`](crate::MAX_BLOCK_LEN).
    #[error("block of {len} bytes exceeds the {max}-byte limit")]
    BlockTooLarge { len: u64, max: u32 },
    /// The header's stored length does not account for the frame's bytes (truncated or trailing).
    #[error("block frame is {actual} bytes but its header says {expected}")]
    FrameLength { expected: u64, actual: u64 },
    /// A raw frame whose stored and uncompressed lengths differ.
    #[error("raw block stores {stored} bytes for an uncompressed length of {len}")]
    RawLength { stored: u32, len: u32 },
    /// A compressed frame whose payload is not smaller than the block (the encoder stores those raw).
    #[error("compressed block stores {stored} bytes for an uncompressed length of {len}")]
    NotCompressed { stored: u32, len: u32 },
    /// Codec `none` on a frame that does not have the raw flag.
    #[error("block frame with codec none is not flagged raw")]
    NoneNotRaw,
    /// The codec rejected the payload.
    #[error("{codec} payload is corrupt: {reason}")]
    Corrupt { codec: CodecId, reason: String },
    /// The payload decompressed to a different length than the header says.
    #[error("{codec} payload decompressed to {actual} bytes, header says {expected}")]
    DecompressedLength {
        codec: CodecId,
        expected: u32,
        actual: u64,
    },
    /// The uncompressed bytes do not match the frame's CRC-32C.
    #[error("block data checksum mismatch: stored {stored:#010x}, computed {computed:#010x}")]
    DataChecksum { stored: u32, computed: u32 },
    /// A zstd level outside the range the library accepts.
    #[error("zstd level {level} is outside {min}..={max}")]
    BadLevel { level: i32, min: i32, max: i32 },
    /// The compressor itself failed (out of memory; never the data's fault).
    #[error("{codec} compression failed: {reason}")]
    Compress { codec: CodecId, reason: String },

    // ---- erasure coding ----
    /// `k` or `m` is zero, or `k + m` exceeds the code's limit.
    #[error("invalid erasure code {k}+{m}: need k >= 1, m >= 1, k + m <= {max}")]
    BadEcSpec { k: u8, m: u8, max: usize },
    /// A stripe with the wrong number of shard slots.
    #[error("stripe has {actual} shard slots, {k}+{m} needs {expected}", expected = *k as usize + *m as usize)]
    ShardCount { k: u8, m: u8, actual: usize },
    /// A shard whose length differs from the stripe's shard length.
    #[error("shard {index} is {actual} bytes, the stripe's shards are {expected}")]
    ShardLength {
        index: usize,
        expected: u64,
        actual: u64,
    },
    /// More shards missing (or corrupt) than parity shards.
    #[error("{missing} shards missing or corrupt, a {k}+{m} stripe survives at most {m}")]
    TooManyMissing { missing: usize, k: u8, m: u8 },
    /// The library refused a call that the checks above should have caught.
    #[error("erasure coding failed: {reason}")]
    Erasure { reason: String },

    // ---- dispatch ----
    /// [`apply`](crate::apply) got an input of the wrong kind for its call.
    #[error("{function} takes {expected} input, got {actual}")]
    WrongInput {
        function: Function,
        expected: InputKind,
        actual: InputKind,
    },
}
