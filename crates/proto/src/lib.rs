//! The nacre wire format.
//!
//! Every message is one [`Frame`]: a fixed 48-byte little-endian [`Header`], a postcard-encoded body and an
//! optional raw data segment carried as [`bytes::Bytes`] so that payloads are never copied between the
//! socket buffer and their consumer. The header, the body and the data each carry a CRC-32C.
//!
//! ```text
//! off len field
//!   0   4 magic "NACR"
//!   4   1 protocol version (1)
//!   5   1 kind: 1 request, 2 response, 3 one-way, 4 error
//!   6   2 op code
//!   8   2 flags
//!  10   2 reserved (must be zero)
//!  12   8 request id (matches a response to its request; 0 for one-way frames)
//!  20   8 sequence number (orders frames spread over a bundle of connections; 0 when unused)
//!  28   4 body length
//!  32   4 data length
//!  36   4 body CRC-32C
//!  40   4 data CRC-32C (0 when there is no data)
//!  44   4 header CRC-32C of bytes 0..44
//! ```
//!
//! Decoding never panics: every malformed input maps to a [`FrameError`]. Lengths are checked against
//! [`FrameLimits`] as soon as the header is complete, before any body is buffered.

pub mod frame;
pub mod msg;

pub use frame::{
    DEFAULT_MAX_FRAME, Decoder, Flags, Frame, FrameError, FrameLimits, HEADER_LEN, Header, Kind,
    MAGIC, VERSION, decode, decode_exact,
};
pub use msg::{DecodeError, Op, Rpc, decode_body, encode_body};
