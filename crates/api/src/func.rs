//! Function server ops (`0x05xx`): one storage function applied to bytes carried in the frame's
//! data segment (docs/design.md §9).
//!
//! A request's body is a [`CallRequest`]: the [`Call`] (a function and its parameters) and the
//! *layout* of its input — either one run of bytes, or shard slots with each present shard's length
//! and CRC-32C. The bytes themselves travel in the data segment (CRC-checked by the messenger),
//! never in the postcard body: a bytes input is the whole segment; shard slots are the present
//! shards concatenated in slot order. A response's body is `Result<OutputLayout, FuncError>` and
//! its data segment holds the output's bytes the same way. [`split_input`], [`join_input`],
//! [`split_output`] and [`join_output`] convert between the two forms; the `join` side checks that
//! the described lengths account for the segment exactly and never panics on what a peer sent.
//!
//! A [`FuncError`] is an answer (the function refused its input) and travels in the body; it is
//! the same for every instance, so a caller does not retry it. A server that cannot take a call
//! now (in-flight bound reached, shutting down, function not offered) answers an error frame with
//! `ErrorCode::Unavailable`, which a caller retries on another instance.

use bytes::{Bytes, BytesMut};
use nacre_func::{Call, EcSpec, FuncError, Input, MAX_SHARDS, Output, Rebuilt, Shard, Stripe};
use nacre_proto::Op;
use nacre_proto::msg::Rpc;
use serde::{Deserialize, Serialize};
use thiserror::Error;

/// Applies one storage function (op `0x0501`). Pure: sending it twice, or to two servers, yields
/// the same answer, so callers retry it freely.
#[derive(Debug)]
pub struct Apply;

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CallRequest {
    pub call: Call,
    pub input: InputLayout,
}

impl Rpc for Apply {
    const OP: Op = Op(0x0501);
    const NAME: &'static str = "func_apply";
    type Request = CallRequest;
    type Response = Result<OutputLayout, FuncError>;
}

/// The length and CRC-32C of one shard whose bytes are in the data segment.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShardMeta {
    pub len: u64,
    pub crc: u32,
}

/// How a call's input is laid out in the data segment.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum InputLayout {
    /// The segment is the input.
    Bytes,
    /// `k + m` slots; the present shards' bytes follow each other in the segment, in slot order.
    Shards(Vec<Option<ShardMeta>>),
}

/// How a call's output is laid out in the data segment.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum OutputLayout {
    /// The segment is the output ([`Output::Bytes`]).
    Bytes,
    /// A stripe's shards, concatenated in order ([`Output::Stripe`]).
    Stripe {
        spec: EcSpec,
        len: u64,
        shards: Vec<ShardMeta>,
    },
    /// Every shard of a stripe, concatenated in order, and the indices rebuilt
    /// ([`Output::Rebuilt`]).
    Rebuilt {
        shards: Vec<ShardMeta>,
        rebuilt: Vec<u32>,
    },
    /// No segment ([`Output::Checksum`]).
    Checksum(u32),
}

/// A layout that does not describe its data segment: the peer is broken or not a nacre peer.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum LayoutError {
    #[error("the layout describes {described} bytes, the data segment holds {actual}")]
    Length { described: u64, actual: u64 },
    #[error("{slots} shard slots, more than the {MAX_SHARDS} a stripe can have")]
    TooManyShards { slots: usize },
    #[error("a {k}+{m} stripe with {shards} shards")]
    ShardCount { k: u8, m: u8, shards: usize },
    #[error("shard index {index} in a stripe of {shards} shards")]
    ShardIndex { index: u32, shards: usize },
}

/// An input as a layout and a data segment. A bytes input is not copied; shards are copied
/// into one segment.
pub fn split_input(input: &Input) -> (InputLayout, Bytes) {
    match input {
        Input::Bytes(b) => (InputLayout::Bytes, b.clone()),
        Input::Shards(slots) => {
            let metas = slots
                .iter()
                .map(|s| s.as_ref().map(meta))
                .collect::<Vec<_>>();
            let shards = slots.iter().flatten();
            (InputLayout::Shards(metas), concat(shards))
        }
    }
}

/// The input a layout and a data segment describe; shards are slices of `data` (no copy). The
/// shards' CRCs are carried as sent: the function checks them.
pub fn join_input(layout: InputLayout, data: Bytes) -> Result<Input, LayoutError> {
    match layout {
        InputLayout::Bytes => Ok(Input::Bytes(data)),
        InputLayout::Shards(metas) => {
            if metas.len() > MAX_SHARDS {
                return Err(LayoutError::TooManyShards { slots: metas.len() });
            }
            let mut cut = Cutter::new(data);
            let slots = metas
                .into_iter()
                .map(|m| m.map(|m| cut.shard(m)).transpose())
                .collect::<Result<Vec<_>, _>>()?;
            cut.finish()?;
            Ok(Input::Shards(slots))
        }
    }
}

/// An output as a layout and a data segment. Bytes are not copied; shards are copied into one
/// segment.
pub fn split_output(output: &Output) -> (OutputLayout, Bytes) {
    match output {
        Output::Bytes(b) => (OutputLayout::Bytes, b.clone()),
        Output::Stripe(s) => (
            OutputLayout::Stripe {
                spec: s.spec,
                len: s.len,
                shards: s.shards.iter().map(meta).collect(),
            },
            concat(s.shards.iter()),
        ),
        Output::Rebuilt(r) => (
            OutputLayout::Rebuilt {
                shards: r.shards.iter().map(meta).collect(),
                // Indices are below MAX_SHARDS (256).
                rebuilt: r.rebuilt.iter().map(|&i| i as u32).collect(),
            },
            concat(r.shards.iter()),
        ),
        Output::Checksum(c) => (OutputLayout::Checksum(*c), Bytes::new()),
    }
}

/// The output a layout and a data segment describe; shards are slices of `data`.
pub fn join_output(layout: OutputLayout, data: Bytes) -> Result<Output, LayoutError> {
    let shards = |metas: Vec<ShardMeta>, data: Bytes| {
        if metas.len() > MAX_SHARDS {
            return Err(LayoutError::TooManyShards { slots: metas.len() });
        }
        let mut cut = Cutter::new(data);
        let shards = metas
            .into_iter()
            .map(|m| cut.shard(m))
            .collect::<Result<Vec<_>, _>>()?;
        cut.finish()?;
        Ok(shards)
    };
    match layout {
        OutputLayout::Bytes => Ok(Output::Bytes(data)),
        OutputLayout::Stripe {
            spec,
            len,
            shards: metas,
        } => {
            if metas.len() != spec.total() {
                return Err(LayoutError::ShardCount {
                    k: spec.k,
                    m: spec.m,
                    shards: metas.len(),
                });
            }
            Ok(Output::Stripe(Stripe {
                spec,
                len,
                shards: shards(metas, data)?,
            }))
        }
        OutputLayout::Rebuilt {
            shards: metas,
            rebuilt,
        } => {
            let n = metas.len();
            if let Some(&index) = rebuilt.iter().find(|&&i| i as usize >= n) {
                return Err(LayoutError::ShardIndex { index, shards: n });
            }
            Ok(Output::Rebuilt(Rebuilt {
                shards: shards(metas, data)?,
                rebuilt: rebuilt.into_iter().map(|i| i as usize).collect(),
            }))
        }
        OutputLayout::Checksum(c) => {
            if !data.is_empty() {
                return Err(LayoutError::Length {
                    described: 0,
                    actual: data.len() as u64,
                });
            }
            Ok(Output::Checksum(c))
        }
    }
}

fn meta(s: &Shard) -> ShardMeta {
    ShardMeta {
        len: s.data.len() as u64,
        crc: s.crc,
    }
}

fn concat<'a>(shards: impl Iterator<Item = &'a Shard> + Clone) -> Bytes {
    let total = shards.clone().map(|s| s.data.len()).sum();
    let mut out = BytesMut::with_capacity(total);
    for s in shards {
        out.extend_from_slice(&s.data);
    }
    out.freeze()
}

/// Cuts a data segment into consecutive shards.
struct Cutter {
    data: Bytes,
    at: usize,
}

impl Cutter {
    fn new(data: Bytes) -> Self {
        Self { data, at: 0 }
    }

    fn shard(&mut self, m: ShardMeta) -> Result<Shard, LayoutError> {
        let left = self.data.len() - self.at;
        let len =
            usize::try_from(m.len)
                .ok()
                .filter(|&l| l <= left)
                .ok_or(LayoutError::Length {
                    described: (self.at as u64).saturating_add(m.len),
                    actual: self.data.len() as u64,
                })?;
        let data = self.data.slice(self.at..self.at + len);
        self.at += len;
        Ok(Shard { data, crc: m.crc })
    }

    fn finish(self) -> Result<(), LayoutError> {
        if self.at != self.data.len() {
            return Err(LayoutError::Length {
                described: self.at as u64,
                actual: self.data.len() as u64,
            });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;
    use nacre_func::{Codec, checksum};
    use nacre_proto::msg::{decode_body, encode_body};

    fn shard(b: &'static [u8]) -> Shard {
        Shard {
            data: Bytes::from_static(b),
            crc: checksum(b),
        }
    }

    #[test]
    fn inputs_survive_the_split_and_the_body_stays_small() {
        let big = Bytes::from(vec![7u8; 1 << 16]);
        for input in [
            Input::Bytes(big.clone()),
            Input::Bytes(Bytes::new()),
            Input::Shards(vec![Some(shard(b"abcd")), None, Some(shard(b"efgh")), None]),
            Input::Shards(vec![None, None]),
        ] {
            let (layout, data) = split_input(&input);
            let req = CallRequest {
                call: Call::Compress {
                    codec: Codec::Zstd { level: 1 },
                },
                input: layout,
            };
            let body = encode_body(&req);
            assert!(body.len() < 64, "the bytes are not in the body");
            let req: CallRequest = decode_body("call", &body).unwrap();
            assert_eq!(join_input(req.input, data).unwrap(), input);
        }
    }

    #[test]
    fn outputs_survive_the_split() {
        let spec = EcSpec::new(2, 1).unwrap();
        for out in [
            Output::Bytes(Bytes::from_static(b"hello")),
            Output::Stripe(Stripe {
                spec,
                len: 7,
                shards: vec![shard(b"abcd"), shard(b"efg\0"), shard(b"pqrs")],
            }),
            Output::Rebuilt(Rebuilt {
                shards: vec![shard(b"ab"), shard(b"cd"), shard(b"ef")],
                rebuilt: vec![1],
            }),
            Output::Checksum(42),
        ] {
            let (layout, data) = split_output(&out);
            let r: Result<OutputLayout, FuncError> = Ok(layout);
            let back: Result<OutputLayout, FuncError> =
                decode_body("reply", &encode_body(&r)).unwrap();
            assert_eq!(join_output(back.unwrap(), data).unwrap(), out);
        }
    }

    #[test]
    fn a_layout_that_does_not_match_its_segment_is_an_error() {
        let two = |a, b| {
            InputLayout::Shards(vec![
                Some(ShardMeta { len: a, crc: 0 }),
                Some(ShardMeta { len: b, crc: 0 }),
            ])
        };
        let data = Bytes::from_static(b"0123456789");
        assert!(join_input(two(4, 6), data.clone()).is_ok());
        for bad in [two(4, 5), two(4, 7), two(u64::MAX, 1), two(11, 0)] {
            assert!(matches!(
                join_input(bad, data.clone()),
                Err(LayoutError::Length { .. })
            ));
        }
        let many = InputLayout::Shards(vec![None; MAX_SHARDS + 1]);
        assert!(matches!(
            join_input(many, Bytes::new()),
            Err(LayoutError::TooManyShards { .. })
        ));
        let stripe = OutputLayout::Stripe {
            spec: EcSpec::new(1, 1).unwrap(),
            len: 3,
            shards: vec![ShardMeta { len: 3, crc: 0 }; 2],
        };
        assert!(join_output(stripe, Bytes::from_static(b"abcde")).is_err());
        let stripe = OutputLayout::Stripe {
            spec: EcSpec::new(2, 1).unwrap(),
            len: 2,
            shards: vec![ShardMeta { len: 1, crc: 0 }; 2],
        };
        assert!(matches!(
            join_output(stripe, Bytes::from_static(b"ab")),
            Err(LayoutError::ShardCount { .. })
        ));
        let rebuilt = OutputLayout::Rebuilt {
            shards: vec![ShardMeta { len: 1, crc: 0 }; 2],
            rebuilt: vec![2],
        };
        assert!(matches!(
            join_output(rebuilt, Bytes::from_static(b"ab")),
            Err(LayoutError::ShardIndex { .. })
        ));
        assert!(join_output(OutputLayout::Checksum(1), Bytes::from_static(b"x")).is_err());
    }

    #[test]
    fn a_func_error_is_an_answer_in_the_body() {
        let r: Result<OutputLayout, FuncError> = Err(FuncError::DataChecksum {
            stored: 1,
            computed: 2,
        });
        let back: Result<OutputLayout, FuncError> = decode_body("reply", &encode_body(&r)).unwrap();
        assert_eq!(back, r);
    }
}
