//! Storage functions: pure transforms on bytes that a volume chains on its data path (DESIGN §9).
//!
//! Block compression ([`compress_block`], [`decompress_block`]: zstd or lz4), Reed-Solomon erasure
//! coding ([`ec_encode`], [`ec_reconstruct`], [`ec_rebuild`], …) and CRC-32C ([`checksum`]). No IO,
//! no async, no clocks: a client or data node calls them inline, and a function server runs the
//! same code through [`apply`] for a [`Call`] that arrived over the messenger. Every decoder
//! validates its input and answers a typed [`FuncError`]; none panics on bad bytes, none returns
//! bytes it could not verify.
//!
//! # Block frame
//!
//! A compressed block is a self-describing frame: a fixed 24-byte little-endian header, then the
//! payload.
//!
//! ```text
//! off len field
//!   0   3 magic "NCB"
//!   3   1 version (1)
//!   4   1 codec: 0 none, 1 zstd, 2 lz4
//!   5   1 flags: bit 0 RAW (the payload is the block itself); other bits must be zero
//!   6   2 reserved (must be zero)
//!   8   4 uncompressed length
//!  12   4 stored (payload) length
//!  16   4 CRC-32C of the uncompressed block
//!  20   4 CRC-32C of header bytes 0..20
//!  24   … payload: the zstd frame, the lz4 block, or the raw block
//! ```
//!
//! Invariants a decoder checks, in this order:
//! - the frame is at least 24 bytes, starts with the magic and version 1, and its header CRC matches
//!   (so every header field below is as written);
//! - the codec is known, unknown flag bits and the reserved bytes are zero;
//! - both lengths are at most [`MAX_BLOCK_LEN`] (16 MiB), so a decoder never allocates more than that
//!   whatever a header claims;
//! - the frame is exactly `24 + stored length` bytes: a truncated frame or trailing bytes are errors;
//! - RAW ⇒ stored length = uncompressed length; not RAW ⇒ codec is not `none` and stored length <
//!   uncompressed length (the encoder stores raw whatever does not shrink);
//! - the payload decodes to exactly the uncompressed length, into a buffer of that capacity;
//! - the decoded bytes match the data CRC before they are returned.
//!
//! Hence a single flipped or missing byte anywhere is an error, except in a compressed payload,
//! where a change that decodes to the very same bytes (two encodings of one block) is harmless: the
//! data CRC guarantees the bytes returned are the bytes compressed.
//!
//! The encoder stores a block raw when compression saves less than 1/8 of it
//! ([`MIN_SAVING_SHIFT`]): reading such a block compressed would cost a decompression for almost no
//! space. A raw frame keeps the codec that was tried, for accounting.
//!
//! # Stripes
//!
//! [`ec_encode`] cuts `len` bytes into `k` data shards of `L = ceil(len / k)` bytes (the last
//! zero-padded) and computes `m` parity shards of `L` bytes (reed-solomon-erasure, GF(2^8), SIMD):
//! any `k` of the `k + m` shards rebuild the others. A [`Stripe`] records `len`, since padding
//! cannot be told from data, and each [`Shard`] carries the CRC-32C of its bytes. Readers hand back
//! `k + m` slots, `None` for a shard they could not read. [`ec_reconstruct_verified`] and
//! [`ec_rebuild`] check each shard against its CRC and treat a corrupt one as missing, so a stripe
//! survives any `m` shards lost *or* corrupt; [`ec_reconstruct`] and [`ec_reconstruct_shards`] take
//! bare bytes and trust them. An empty stripe has `k + m` empty shards. [`ec_encode_bytes`] lends
//! the full data shards from the caller's [`bytes::Bytes`] instead of copying them.
//!
//! # Calls
//!
//! A [`Call`] names a function and its parameters and is serde-serializable (postcard-friendly:
//! externally tagged enums only, nothing that needs a self-describing format); its payload travels
//! as an [`Input`], and its result or [`FuncError`] comes back the same way. [`apply`] is the one
//! dispatcher, and [`Function`] the parameterless names a server advertises.
//!
//! # Features
//!
//! `codecs` (default) builds the transforms: zstd, lz4 and Reed-Solomon, two of which compile C
//! code. Without it the crate is the vocabulary alone — [`Call`], [`Function`], [`Input`],
//! [`Output`], [`Codec`], [`EcSpec`], [`Shard`], [`Stripe`], [`FuncError`], [`read_header`] and
//! [`checksum`] — so that `nacre-api` can carry calls on the wire without every front end
//! building the codecs; whoever runs a function (a function server, a client running it inline)
//! turns the feature on.

pub mod block;
pub mod call;
pub mod ec;
mod error;

pub use block::{
    BlockHeader, Codec, CodecId, FLAG_RAW, HEADER_LEN, MAGIC, MAX_BLOCK_LEN, MIN_SAVING_SHIFT,
    VERSION, read_header,
};
#[cfg(feature = "codecs")]
pub use block::{compress_block, decompress_block};
#[cfg(feature = "codecs")]
pub use call::apply;
pub use call::{Call, Function, Input, InputKind, Output};
pub use ec::{EcSpec, MAX_SHARDS, Rebuilt, Shard, Stripe};
#[cfg(feature = "codecs")]
pub use ec::{
    ec_encode, ec_encode_bytes, ec_rebuild, ec_reconstruct, ec_reconstruct_shards,
    ec_reconstruct_verified,
};
pub use error::FuncError;

/// CRC-32C (Castagnoli) of `data`: the workspace's one implementation
/// ([`nacre_types::crc32c`], hardware accelerated), so a shard or block CRC computed here can be
/// compared with one computed anywhere else in nacre.
#[inline]
pub fn checksum(data: &[u8]) -> u32 {
    nacre_types::crc32c(data)
}
