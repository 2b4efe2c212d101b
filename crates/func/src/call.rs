//! The vocabulary of storage functions and the one dispatcher that runs them, so that an inline
//! caller and a remote function server execute the same code for the same [`Call`].

use std::fmt;

use bytes::Bytes;
use serde::{Deserialize, Serialize};

use crate::{Codec, EcSpec, Rebuilt, Shard, Stripe};

/// The name of a storage function, without parameters: what a function server advertises and
/// what metrics are labelled with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum Function {
    Compress,
    Decompress,
    EcEncode,
    EcReconstruct,
    EcRebuild,
    Checksum,
}

impl Function {
    /// Every function, in declaration order.
    pub const ALL: [Function; 6] = [
        Function::Compress,
        Function::Decompress,
        Function::EcEncode,
        Function::EcReconstruct,
        Function::EcRebuild,
        Function::Checksum,
    ];

    /// The kind of [`Input`] it takes.
    pub fn input_kind(self) -> InputKind {
        match self {
            Function::EcReconstruct | Function::EcRebuild => InputKind::Shards,
            _ => InputKind::Bytes,
        }
    }
}

impl fmt::Display for Function {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Function::Compress => "compress",
            Function::Decompress => "decompress",
            Function::EcEncode => "ec_encode",
            Function::EcReconstruct => "ec_reconstruct",
            Function::EcRebuild => "ec_rebuild",
            Function::Checksum => "checksum",
        })
    }
}

/// One invocation: a function and its parameters. The payload travels separately as an
/// [`Input`], so that a messenger can carry it as raw bytes after a small postcard body.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Call {
    /// Bytes → a block frame ([`compress_block`]).
    Compress { codec: Codec },
    /// A block frame → bytes ([`decompress_block`]).
    Decompress,
    /// Bytes → a [`Stripe`] ([`ec_encode_bytes`]).
    EcEncode { spec: EcSpec },
    /// Shard slots with CRCs → the `len` original bytes ([`ec_reconstruct_verified`]).
    EcReconstruct { spec: EcSpec, len: u64 },
    /// Shard slots with CRCs → every shard, missing and corrupt ones rebuilt ([`ec_rebuild`]).
    EcRebuild { spec: EcSpec },
    /// Bytes → their CRC-32C ([`checksum`]).
    Checksum,
}

impl Call {
    pub fn function(&self) -> Function {
        match self {
            Call::Compress { .. } => Function::Compress,
            Call::Decompress => Function::Decompress,
            Call::EcEncode { .. } => Function::EcEncode,
            Call::EcReconstruct { .. } => Function::EcReconstruct,
            Call::EcRebuild { .. } => Function::EcRebuild,
            Call::Checksum => Function::Checksum,
        }
    }
}

/// A call's payload.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Input {
    Bytes(Bytes),
    /// `k + m` slots, `None` for a shard that could not be read.
    Shards(Vec<Option<Shard>>),
}

impl Input {
    pub fn kind(&self) -> InputKind {
        match self {
            Input::Bytes(_) => InputKind::Bytes,
            Input::Shards(_) => InputKind::Shards,
        }
    }
}

/// The two shapes of [`Input`], for [`FuncError::WrongInput`](crate::FuncError::WrongInput).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum InputKind {
    Bytes,
    Shards,
}

impl fmt::Display for InputKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            InputKind::Bytes => "bytes",
            InputKind::Shards => "shards",
        })
    }
}

/// A call's result.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Output {
    /// From compress (a frame), decompress and reconstruct (the original bytes).
    Bytes(Bytes),
    Stripe(Stripe),
    Rebuilt(Rebuilt),
    Checksum(u32),
}

/// Runs `call` on `input`. The only entry point a function server needs. Built with the `codecs`
/// feature.
#[cfg(feature = "codecs")]
pub fn apply(call: &Call, input: Input) -> Result<Output, crate::FuncError> {
    use crate::{
        FuncError, checksum, compress_block, decompress_block, ec_encode_bytes, ec_rebuild,
        ec_reconstruct_verified,
    };
    let function = call.function();
    match (call, input) {
        (Call::Compress { codec }, Input::Bytes(b)) => {
            compress_block(*codec, &b).map(Output::Bytes)
        }
        (Call::Decompress, Input::Bytes(b)) => decompress_block(&b).map(Output::Bytes),
        (Call::EcEncode { spec }, Input::Bytes(b)) => ec_encode_bytes(*spec, b).map(Output::Stripe),
        (Call::EcReconstruct { spec, len }, Input::Shards(s)) => {
            ec_reconstruct_verified(*spec, s, *len).map(Output::Bytes)
        }
        (Call::EcRebuild { spec }, Input::Shards(s)) => ec_rebuild(*spec, s).map(Output::Rebuilt),
        (Call::Checksum, Input::Bytes(b)) => Ok(Output::Checksum(checksum(&b))),
        (_, input) => Err(FuncError::WrongInput {
            function,
            expected: function.input_kind(),
            actual: input.kind(),
        }),
    }
}
