//! Fuzzes the frame decoders of `nacre-proto`.
//!
//! Input layout: the first byte picks the chunk size used to feed the streaming decoder (0 = everything at
//! once, n = n bytes per read); the remaining bytes are the wire stream. Both `decode_exact` and the
//! streaming `decode` see the same stream, once with a small and once with the default frame limit.
//!
//! Invariants checked (besides "never panics"):
//! - every frame either decoder returns re-encodes (`Frame::to_bytes`) to exactly the bytes it came from;
//! - `decode` returning `Ok(None)` leaves the buffer untouched;
//! - streaming and exact decoding agree: on a single-frame input both yield the same frame, and on other
//!   inputs the first frame or error of the stream is what `decode_exact` says about that frame's bytes;
//! - a frame accepted under the small limit is accepted, identically, under the default limit.
#![no_main]

use bytes::BytesMut;
use libfuzzer_sys::fuzz_target;
use nacre_proto::{
    DEFAULT_MAX_FRAME, Decoder, Frame, FrameError, FrameLimits, HEADER_LEN, decode_exact,
};

const SMALL: FrameLimits = FrameLimits { max_frame: 64 };
const DEFAULT: FrameLimits = FrameLimits {
    max_frame: DEFAULT_MAX_FRAME,
};

/// What the streaming decoder made of a whole input.
struct Stream {
    frames: Vec<Frame>,
    /// The error that ended the stream, if any.
    error: Option<FrameError>,
    /// Bytes left in the buffer after the last call (only meaningful without an error).
    leftover: usize,
}

fn stream_decode(wire: &[u8], chunk: usize, limits: FrameLimits) -> Stream {
    // The stateful decoder a connection keeps, which checksums data as it arrives.
    let mut decoder = Decoder::new(limits);
    let mut buf = BytesMut::new();
    let mut frames = Vec::new();
    // Offset in `wire` of the first byte not yet consumed by a decoded frame.
    let mut consumed = 0usize;
    for piece in wire.chunks(chunk) {
        buf.extend_from_slice(piece);
        loop {
            let before = buf.len();
            let before_bytes = buf.to_vec();
            match decoder.decode(&mut buf) {
                Ok(Some(frame)) => {
                    let used = before - buf.len();
                    assert!(
                        used >= HEADER_LEN,
                        "frame of {used} bytes is shorter than a header"
                    );
                    assert_eq!(
                        frame.encoded_len(),
                        used,
                        "encoded_len differs from bytes consumed"
                    );
                    assert_eq!(
                        frame.to_bytes(),
                        &wire[consumed..consumed + used],
                        "streamed frame does not re-encode to the bytes it was decoded from"
                    );
                    consumed += used;
                    frames.push(frame);
                }
                Ok(None) => {
                    assert_eq!(&buf[..], &before_bytes[..], "Ok(None) modified the buffer");
                    break;
                }
                Err(error) => {
                    return Stream {
                        frames,
                        error: Some(error),
                        leftover: buf.len(),
                    };
                }
            }
        }
    }
    assert_eq!(
        &buf[..],
        &wire[consumed..],
        "buffer does not hold the unconsumed tail"
    );
    Stream {
        frames,
        error: None,
        leftover: buf.len(),
    }
}

fn check(wire: &[u8], chunk: usize, limits: FrameLimits) -> Result<Frame, FrameError> {
    let exact = decode_exact(wire, limits);
    if let Ok(frame) = &exact {
        assert_eq!(
            frame.to_bytes(),
            wire,
            "exact frame does not re-encode to its input"
        );
    }
    let stream = stream_decode(wire, chunk, limits);

    match &exact {
        // A single whole frame: the stream yields exactly that frame and nothing else.
        Ok(frame) => {
            assert_eq!(
                stream.error, None,
                "exact decode succeeded, streaming failed"
            );
            assert_eq!(
                stream.frames.len(),
                1,
                "exact decode found one frame, streaming a different count"
            );
            assert_eq!(
                &stream.frames[0], frame,
                "streaming and exact decoding disagree"
            );
            assert_eq!(stream.leftover, 0);
        }
        // Not enough bytes for one frame: the stream waits for more, it does not fail.
        Err(FrameError::Truncated { .. }) => {
            assert!(
                stream.frames.is_empty(),
                "streaming decoded a frame from a truncated input"
            );
            assert_eq!(
                stream.error, None,
                "streaming failed on a merely incomplete input"
            );
            assert_eq!(stream.leftover, wire.len());
        }
        // More than one frame's worth: the stream's first outcome is the exact verdict on the first frame.
        Err(FrameError::Trailing { extra }) => {
            let first_len = wire.len() - usize::try_from(*extra).expect("extra fits usize");
            assert!(first_len >= HEADER_LEN);
            match decode_exact(&wire[..first_len], limits) {
                Ok(first) => {
                    assert!(
                        !stream.frames.is_empty(),
                        "streaming missed a valid first frame"
                    );
                    assert_eq!(
                        stream.frames[0], first,
                        "streaming and exact disagree on the first frame"
                    );
                }
                Err(e) => {
                    assert!(
                        stream.frames.is_empty(),
                        "streaming accepted a first frame exact rejects"
                    );
                    assert_eq!(
                        stream.error,
                        Some(e),
                        "streaming and exact report different errors"
                    );
                }
            }
        }
        // A header or checksum error on an input of exactly one frame's length (or a header error with any
        // length): the stream reports the same error before yielding anything.
        Err(e) => {
            assert!(
                stream.frames.is_empty(),
                "streaming accepted a frame exact rejects with {e}"
            );
            assert_eq!(
                stream.error.as_ref(),
                Some(e),
                "streaming and exact report different errors"
            );
        }
    }
    exact
}

fuzz_target!(|input: &[u8]| {
    let Some((&selector, wire)) = input.split_first() else {
        return;
    };
    let chunk = if selector == 0 {
        wire.len().max(1)
    } else {
        usize::from(selector)
    };

    let small = check(wire, chunk, SMALL);
    let default = check(wire, chunk, DEFAULT);
    if let Ok(frame) = small {
        assert_eq!(
            default,
            Ok(frame),
            "a frame within the small limit must pass the default limit"
        );
    }
});
