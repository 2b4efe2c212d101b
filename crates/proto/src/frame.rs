//! Frame header encoding and the check-then-parse decoder.

use bytes::{Buf, Bytes, BytesMut};
use nacre_types::{crc32c, crc32c_append};
use thiserror::Error;

use crate::msg::Op;

/// `b"NACR"` read as a little-endian u32.
pub const MAGIC: u32 = u32::from_le_bytes(*b"NACR");
/// The protocol version this build speaks. A peer with another version is rejected, never guessed at.
pub const VERSION: u8 = 1;
/// Size of the fixed header in bytes.
pub const HEADER_LEN: usize = 48;
/// Default bound on body + data of one frame.
pub const DEFAULT_MAX_FRAME: u32 = 16 * 1024 * 1024;

/// What a frame is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Kind {
    /// Expects exactly one `Response` or `Error` with the same request id.
    Request = 1,
    /// Successful reply to a request.
    Response = 2,
    /// Fire-and-forget; no reply (raft traffic, notifications).
    OneWay = 3,
    /// Failed reply to a request; the body is a [`crate::msg::RemoteError`].
    Error = 4,
}

impl Kind {
    fn from_u8(v: u8) -> Option<Self> {
        Some(match v {
            1 => Self::Request,
            2 => Self::Response,
            3 => Self::OneWay,
            4 => Self::Error,
            _ => return None,
        })
    }
}

/// Frame flags. Unknown bits are carried, not rejected, so newer peers can add hints.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Flags(pub u16);

impl Flags {
    /// Background priority (repair, scrub): a receiver may serve it after foreground work.
    pub const BACKGROUND: Flags = Flags(1 << 0);

    /// Whether every bit of `other` is set.
    pub fn contains(self, other: Flags) -> bool {
        self.0 & other.0 == other.0
    }
}

/// Bounds a decoder enforces before buffering a frame.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FrameLimits {
    /// Largest accepted body + data length in bytes.
    pub max_frame: u32,
}

impl Default for FrameLimits {
    fn default() -> Self {
        Self {
            max_frame: DEFAULT_MAX_FRAME,
        }
    }
}

/// Why bytes are not a valid frame.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum FrameError {
    #[error("bad magic {found:#010x} (not a nacre peer?)")]
    BadMagic { found: u32 },
    #[error("unsupported protocol version {found} (this build speaks {VERSION})")]
    UnsupportedVersion { found: u8 },
    #[error("unknown frame kind {found}")]
    UnknownKind { found: u8 },
    #[error("reserved header field is {found:#06x}, must be zero")]
    ReservedNonZero { found: u16 },
    #[error("frame of {len} bytes exceeds the limit of {max} bytes")]
    TooLarge { len: u64, max: u32 },
    #[error("header checksum mismatch: header says {expected:#010x}, computed {actual:#010x}")]
    HeaderCrc { expected: u32, actual: u32 },
    #[error("body checksum mismatch: header says {expected:#010x}, computed {actual:#010x}")]
    BodyCrc { expected: u32, actual: u32 },
    #[error("data checksum mismatch: header says {expected:#010x}, computed {actual:#010x}")]
    DataCrc { expected: u32, actual: u32 },
    #[error("truncated frame: need {needed} bytes, have {have}")]
    Truncated { needed: u64, have: u64 },
    #[error("{extra} trailing bytes after the frame")]
    Trailing { extra: u64 },
}

/// The decoded fixed header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Header {
    pub kind: Kind,
    pub op: Op,
    pub flags: Flags,
    pub request_id: u64,
    pub seq: u64,
    pub body_len: u32,
    pub data_len: u32,
    pub body_crc: u32,
    pub data_crc: u32,
}

impl Header {
    /// Bytes of body and data that follow the header.
    pub fn payload_len(&self) -> usize {
        self.body_len as usize + self.data_len as usize
    }

    /// The wire form, with the header CRC filled in.
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[0..4].copy_from_slice(&MAGIC.to_le_bytes());
        b[4] = VERSION;
        b[5] = self.kind as u8;
        b[6..8].copy_from_slice(&self.op.0.to_le_bytes());
        b[8..10].copy_from_slice(&self.flags.0.to_le_bytes());
        // 10..12 reserved, zero.
        b[12..20].copy_from_slice(&self.request_id.to_le_bytes());
        b[20..28].copy_from_slice(&self.seq.to_le_bytes());
        b[28..32].copy_from_slice(&self.body_len.to_le_bytes());
        b[32..36].copy_from_slice(&self.data_len.to_le_bytes());
        b[36..40].copy_from_slice(&self.body_crc.to_le_bytes());
        b[40..44].copy_from_slice(&self.data_crc.to_le_bytes());
        let crc = crc32c(&b[0..44]);
        b[44..48].copy_from_slice(&crc.to_le_bytes());
        b
    }

    /// Parses and validates a header: magic, version, kind, reserved bits, CRC and length limit.
    pub fn decode(b: &[u8; HEADER_LEN], limits: FrameLimits) -> Result<Self, FrameError> {
        let u16_at = |o: usize| u16::from_le_bytes([b[o], b[o + 1]]);
        let u32_at = |o: usize| u32::from_le_bytes([b[o], b[o + 1], b[o + 2], b[o + 3]]);
        let u64_at = |o: usize| {
            let mut w = [0u8; 8];
            w.copy_from_slice(&b[o..o + 8]);
            u64::from_le_bytes(w)
        };
        let magic = u32_at(0);
        if magic != MAGIC {
            return Err(FrameError::BadMagic { found: magic });
        }
        if b[4] != VERSION {
            return Err(FrameError::UnsupportedVersion { found: b[4] });
        }
        // Check the CRC before trusting any other field.
        let expected = u32_at(44);
        let actual = crc32c(&b[0..44]);
        if expected != actual {
            return Err(FrameError::HeaderCrc { expected, actual });
        }
        let kind = Kind::from_u8(b[5]).ok_or(FrameError::UnknownKind { found: b[5] })?;
        let reserved = u16_at(10);
        if reserved != 0 {
            return Err(FrameError::ReservedNonZero { found: reserved });
        }
        let header = Header {
            kind,
            op: Op(u16_at(6)),
            flags: Flags(u16_at(8)),
            request_id: u64_at(12),
            seq: u64_at(20),
            body_len: u32_at(28),
            data_len: u32_at(32),
            body_crc: u32_at(36),
            data_crc: u32_at(40),
        };
        let len = u64::from(header.body_len) + u64::from(header.data_len);
        if len > u64::from(limits.max_frame) {
            return Err(FrameError::TooLarge {
                len,
                max: limits.max_frame,
            });
        }
        Ok(header)
    }
}

/// One message: header, postcard body, raw data segment.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Frame {
    pub header: Header,
    pub body: Bytes,
    pub data: Bytes,
}

impl Frame {
    /// Builds a frame, computing both payload CRCs.
    pub fn new(kind: Kind, op: Op, request_id: u64, body: Bytes, data: Bytes) -> Self {
        let data_crc = if data.is_empty() { 0 } else { crc32c(&data) };
        Self::with_data_crc(kind, op, request_id, body, data, data_crc)
    }

    /// Builds a frame whose data CRC is already known (e.g. data received in a verified frame and sent on
    /// unchanged), saving a pass over the data. A wrong `data_crc` makes the receiver reject the frame.
    pub fn with_data_crc(
        kind: Kind,
        op: Op,
        request_id: u64,
        body: Bytes,
        data: Bytes,
        data_crc: u32,
    ) -> Self {
        // Lengths beyond u32 cannot pass any receiver's limit; saturate so the receiver rejects them.
        let body_len = u32::try_from(body.len()).unwrap_or(u32::MAX);
        let data_len = u32::try_from(data.len()).unwrap_or(u32::MAX);
        let header = Header {
            kind,
            op,
            flags: Flags::default(),
            request_id,
            seq: 0,
            body_len,
            data_len,
            body_crc: crc32c(&body),
            data_crc,
        };
        Self { header, body, data }
    }

    /// Total encoded length.
    pub fn encoded_len(&self) -> usize {
        HEADER_LEN + self.body.len() + self.data.len()
    }

    /// The whole frame as one contiguous buffer (tests and fuzzing; the messenger writes the three parts
    /// with vectored IO instead).
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(self.encoded_len());
        v.extend_from_slice(&self.header.encode());
        v.extend_from_slice(&self.body);
        v.extend_from_slice(&self.data);
        v
    }
}

/// Streaming decode from a connection's read buffer, for a single call.
///
/// Returns `Ok(None)` when `buf` does not yet hold a whole frame (incomplete is not an error); the caller
/// reads more and calls again. On success the frame's bytes are split off `buf` without copying.
/// A header error is returned as soon as the 48 header bytes are present. A connection should keep a
/// [`Decoder`] instead, which does not checksum the same bytes again on every call.
pub fn decode(buf: &mut BytesMut, limits: FrameLimits) -> Result<Option<Frame>, FrameError> {
    Decoder::new(limits).decode(buf)
}

/// The streaming decoder of one connection.
///
/// It checksums a frame's data segment as the bytes arrive, while they are still in cache and while the
/// rest of the frame is in flight, so that completing a large frame costs no separate pass over it.
#[derive(Clone, Debug)]
pub struct Decoder {
    limits: FrameLimits,
    partial: Option<Partial>,
}

/// A frame whose header has been validated but whose payload is not complete yet.
#[derive(Clone, Copy, Debug)]
struct Partial {
    header: Header,
    /// Data bytes already covered by `data_crc`.
    data_done: usize,
    data_crc: u32,
}

impl Decoder {
    pub fn new(limits: FrameLimits) -> Self {
        Self {
            limits,
            partial: None,
        }
    }

    /// Like [`decode`], but remembers the header and the data checksum so far between calls. `buf`
    /// must be the same buffer on every call, only ever appended to between calls.
    pub fn decode(&mut self, buf: &mut BytesMut) -> Result<Option<Frame>, FrameError> {
        let p = match &mut self.partial {
            Some(p) => p,
            None => {
                let Some(header) = peek_header(buf, self.limits)? else {
                    return Ok(None);
                };
                self.partial.insert(Partial {
                    header,
                    data_done: 0,
                    data_crc: 0,
                })
            }
        };
        let h = p.header;
        let data_start = HEADER_LEN + h.body_len as usize;
        let total = data_start + h.data_len as usize;
        let available = buf.len().min(total);
        if available > data_start + p.data_done {
            p.data_crc = crc32c_append(p.data_crc, &buf[data_start + p.data_done..available]);
            p.data_done = available - data_start;
        }
        if buf.len() < total {
            // Make room for the rest of the frame in one allocation rather than growing step by step.
            buf.reserve(total - buf.len());
            return Ok(None);
        }
        let data_crc = p.data_crc;
        self.partial = None;
        buf.advance(HEADER_LEN);
        let body = buf.split_to(h.body_len as usize).freeze();
        let data = buf.split_to(h.data_len as usize).freeze();
        verify_body(&h, &body)?;
        if data_crc != h.data_crc {
            return Err(FrameError::DataCrc {
                expected: h.data_crc,
                actual: data_crc,
            });
        }
        Ok(Some(Frame {
            header: h,
            body,
            data,
        }))
    }
}

/// Parses the header at the front of `buf` if all of it is present.
pub fn peek_header(buf: &[u8], limits: FrameLimits) -> Result<Option<Header>, FrameError> {
    let Some(raw) = buf.first_chunk::<HEADER_LEN>() else {
        return Ok(None);
    };
    Header::decode(raw, limits).map(Some)
}

/// Decodes exactly one frame that must fill `input` completely.
pub fn decode_exact(input: &[u8], limits: FrameLimits) -> Result<Frame, FrameError> {
    let truncated = |needed: usize| FrameError::Truncated {
        needed: needed as u64,
        have: input.len() as u64,
    };
    let header = peek_header(input, limits)?.ok_or_else(|| truncated(HEADER_LEN))?;
    let total = HEADER_LEN + header.payload_len();
    match input.len().cmp(&total) {
        std::cmp::Ordering::Less => return Err(truncated(total)),
        std::cmp::Ordering::Greater => {
            return Err(FrameError::Trailing {
                extra: (input.len() - total) as u64,
            });
        }
        std::cmp::Ordering::Equal => {}
    }
    let body_end = HEADER_LEN + header.body_len as usize;
    let body = Bytes::copy_from_slice(&input[HEADER_LEN..body_end]);
    let data = Bytes::copy_from_slice(&input[body_end..total]);
    verify_payload(&header, &body, &data)?;
    Ok(Frame { header, body, data })
}

fn verify_body(header: &Header, body: &[u8]) -> Result<(), FrameError> {
    let actual = crc32c(body);
    if actual != header.body_crc {
        return Err(FrameError::BodyCrc {
            expected: header.body_crc,
            actual,
        });
    }
    Ok(())
}

fn verify_payload(header: &Header, body: &[u8], data: &[u8]) -> Result<(), FrameError> {
    verify_body(header, body)?;
    // The CRC of no bytes is 0, which is also what a frame without data carries.
    let actual = crc32c(data);
    if actual != header.data_crc {
        return Err(FrameError::DataCrc {
            expected: header.data_crc,
            actual,
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn sample() -> Frame {
        Frame::new(
            Kind::Request,
            Op(7),
            42,
            Bytes::from_static(b"body"),
            Bytes::from_static(b"some raw data"),
        )
    }

    #[test]
    fn header_is_48_bytes_little_endian() {
        let f = sample();
        let b = f.header.encode();
        assert_eq!(&b[0..4], b"NACR");
        assert_eq!(b[4], VERSION);
        assert_eq!(u64::from_le_bytes(b[12..20].try_into().unwrap()), 42);
    }

    #[test]
    fn each_corruption_has_its_own_error() {
        let limits = FrameLimits::default();
        let good = sample().to_bytes();
        assert!(decode_exact(&good, limits).is_ok());

        let mut b = good.clone();
        b[0] ^= 1;
        assert!(matches!(
            decode_exact(&b, limits),
            Err(FrameError::BadMagic { .. })
        ));

        let mut b = good.clone();
        b[4] = 9;
        assert_eq!(
            decode_exact(&b, limits),
            Err(FrameError::UnsupportedVersion { found: 9 })
        );

        let mut b = good.clone();
        b[13] ^= 1;
        assert!(matches!(
            decode_exact(&b, limits),
            Err(FrameError::HeaderCrc { .. })
        ));

        let mut b = good.clone();
        b[HEADER_LEN] ^= 1;
        assert!(matches!(
            decode_exact(&b, limits),
            Err(FrameError::BodyCrc { .. })
        ));

        let mut b = good.clone();
        let last = b.len() - 1;
        b[last] ^= 1;
        assert!(matches!(
            decode_exact(&b, limits),
            Err(FrameError::DataCrc { .. })
        ));

        assert!(matches!(
            decode_exact(&good[..good.len() - 1], limits),
            Err(FrameError::Truncated { .. })
        ));
        assert!(matches!(
            decode_exact(&good[..10], limits),
            Err(FrameError::Truncated { .. })
        ));
        let small = FrameLimits { max_frame: 8 };
        assert!(matches!(
            decode_exact(&good, small),
            Err(FrameError::TooLarge { .. })
        ));
    }

    #[test]
    fn oversized_length_is_rejected_before_buffering() {
        let mut f = sample();
        f.header.data_len = u32::MAX;
        let mut buf = BytesMut::from(&f.header.encode()[..]);
        // Only the header is present, yet the limit is enforced at once.
        assert!(matches!(
            decode(&mut buf, FrameLimits::default()),
            Err(FrameError::TooLarge { .. })
        ));
    }

    #[test]
    fn streaming_decode_waits_for_whole_frames() {
        let a = sample();
        let b = Frame::new(Kind::OneWay, Op(1), 0, Bytes::new(), Bytes::new());
        let mut wire = a.to_bytes();
        wire.extend_from_slice(&b.to_bytes());
        let mut buf = BytesMut::new();
        let mut out = Vec::new();
        // Feed one byte at a time: every prefix is either incomplete or yields whole frames.
        for byte in wire {
            buf.extend_from_slice(&[byte]);
            while let Some(f) = decode(&mut buf, FrameLimits::default()).expect("valid stream") {
                out.push(f);
            }
        }
        assert_eq!(out, vec![a, b]);
        assert!(buf.is_empty());
    }

    fn arb_kind() -> impl Strategy<Value = Kind> {
        prop_oneof![
            Just(Kind::Request),
            Just(Kind::Response),
            Just(Kind::OneWay),
            Just(Kind::Error)
        ]
    }

    proptest! {
        #[test]
        fn round_trip(
            kind in arb_kind(),
            op in any::<u16>(),
            flags in any::<u16>(),
            request_id in any::<u64>(),
            seq in any::<u64>(),
            body in proptest::collection::vec(any::<u8>(), 0..512),
            data in proptest::collection::vec(any::<u8>(), 0..4096),
        ) {
            let mut f = Frame::new(kind, Op(op), request_id, Bytes::from(body), Bytes::from(data));
            f.header.flags = Flags(flags);
            f.header.seq = seq;
            let wire = f.to_bytes();
            prop_assert_eq!(&decode_exact(&wire, FrameLimits::default())?, &f);
            let mut buf = BytesMut::from(&wire[..]);
            prop_assert_eq!(decode(&mut buf, FrameLimits::default())?, Some(f));
            prop_assert!(buf.is_empty());
        }

        #[test]
        fn stateful_decoder_matches_exact_decoding_under_any_chunking(
            frames in proptest::collection::vec(
                (arb_kind(), any::<u64>(), proptest::collection::vec(any::<u8>(), 0..64),
                 proptest::collection::vec(any::<u8>(), 0..3000)),
                1..6,
            ),
            chunks in proptest::collection::vec(1usize..700, 1..40),
        ) {
            let frames: Vec<Frame> = frames
                .into_iter()
                .map(|(k, id, b, d)| Frame::new(k, Op(3), id, Bytes::from(b), Bytes::from(d)))
                .collect();
            let wire: Vec<u8> = frames.iter().flat_map(|f| f.to_bytes()).collect();
            let mut dec = Decoder::new(FrameLimits::default());
            let mut buf = BytesMut::new();
            let mut out = Vec::new();
            let mut rest = &wire[..];
            let mut i = 0;
            while !rest.is_empty() {
                let n = chunks[i % chunks.len()].min(rest.len());
                buf.extend_from_slice(&rest[..n]);
                rest = &rest[n..];
                i += 1;
                while let Some(f) = dec.decode(&mut buf)? {
                    out.push(f);
                }
            }
            prop_assert_eq!(out, frames);
            prop_assert!(buf.is_empty());
        }

        #[test]
        fn arbitrary_bytes_never_panic(input in proptest::collection::vec(any::<u8>(), 0..256)) {
            let _ = decode_exact(&input, FrameLimits::default());
            let mut buf = BytesMut::from(&input[..]);
            let _ = decode(&mut buf, FrameLimits { max_frame: 64 });
        }

        #[test]
        fn any_single_bit_flip_is_detected(pos in any::<prop::sample::Index>(), bit in 0u8..8) {
            let wire = sample().to_bytes();
            let mut bad = wire.clone();
            let i = pos.index(bad.len());
            bad[i] ^= 1 << bit;
            prop_assert!(decode_exact(&bad, FrameLimits::default()).is_err());
        }
    }
}
