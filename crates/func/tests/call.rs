//! The call vocabulary: `apply` runs the same functions as a direct call, and calls, inputs,
//! outputs and errors survive postcard, the messenger's body encoding.

#![allow(clippy::unwrap_used)] // helpers and proptest bodies outside #[test] fns

use bytes::Bytes;
use nacre_func::{
    Call, Codec, EcSpec, FuncError, Function, Input, InputKind, Output, apply, checksum,
    compress_block, decompress_block, ec_encode,
};
use serde::{Serialize, de::DeserializeOwned};

fn postcard_round_trip<T: Serialize + DeserializeOwned + PartialEq + std::fmt::Debug>(v: &T) {
    let bytes = postcard::to_stdvec(v).unwrap();
    let back: T = postcard::from_bytes(&bytes).unwrap();
    assert_eq!(&back, v);
}

fn text() -> Bytes {
    Bytes::from("storage functions as micro-services; ".repeat(200))
}

#[test]
fn apply_runs_each_function() {
    let data = text();
    let spec = EcSpec::new(4, 2).unwrap();

    let codec = Codec::Zstd { level: 3 };
    let Output::Bytes(frame) =
        apply(&Call::Compress { codec }, Input::Bytes(data.clone())).unwrap()
    else {
        panic!("compress returns bytes");
    };
    assert_eq!(frame, compress_block(codec, &data).unwrap());
    assert_eq!(
        apply(&Call::Decompress, Input::Bytes(frame)).unwrap(),
        Output::Bytes(data.clone())
    );

    let Output::Stripe(stripe) =
        apply(&Call::EcEncode { spec }, Input::Bytes(data.clone())).unwrap()
    else {
        panic!("ec_encode returns a stripe");
    };
    assert_eq!(stripe, ec_encode(spec, &data).unwrap());

    let mut slots = stripe.clone().into_slots();
    slots[0] = None;
    slots[5] = None;
    let len = stripe.len;
    assert_eq!(
        apply(
            &Call::EcReconstruct { spec, len },
            Input::Shards(slots.clone())
        )
        .unwrap(),
        Output::Bytes(data.clone())
    );
    let Output::Rebuilt(r) = apply(&Call::EcRebuild { spec }, Input::Shards(slots)).unwrap() else {
        panic!("ec_rebuild returns the rebuilt stripe");
    };
    assert_eq!(r.shards, stripe.shards);
    assert_eq!(r.rebuilt, vec![0, 5]);

    assert_eq!(
        apply(&Call::Checksum, Input::Bytes(data.clone())).unwrap(),
        Output::Checksum(checksum(&data))
    );
}

#[test]
fn apply_refuses_the_wrong_input() {
    let r = apply(
        &Call::EcReconstruct {
            spec: EcSpec { k: 2, m: 1 },
            len: 3,
        },
        Input::Bytes(text()),
    );
    let want = FuncError::WrongInput {
        function: Function::EcReconstruct,
        expected: InputKind::Shards,
        actual: InputKind::Bytes,
    };
    assert_eq!(r, Err(want.clone()));
    assert_eq!(
        want.to_string(),
        "ec_reconstruct takes shards input, got bytes"
    );
    assert!(matches!(
        apply(&Call::Decompress, Input::Shards(vec![])),
        Err(FuncError::WrongInput {
            function: Function::Decompress,
            ..
        })
    ));
    // Errors of the functions themselves pass through.
    assert!(matches!(
        apply(&Call::Decompress, Input::Bytes(text())),
        Err(FuncError::BadMagic { .. })
    ));
}

#[test]
fn every_call_names_its_function() {
    let spec = EcSpec { k: 2, m: 1 };
    let calls = [
        Call::Compress { codec: Codec::Lz4 },
        Call::Decompress,
        Call::EcEncode { spec },
        Call::EcReconstruct { spec, len: 1 },
        Call::EcRebuild { spec },
        Call::Checksum,
    ];
    let functions: Vec<Function> = calls.iter().map(Call::function).collect();
    assert_eq!(functions, Function::ALL);
}

#[test]
fn the_vocabulary_survives_postcard() {
    let spec = EcSpec { k: 8, m: 3 };
    for call in [
        Call::Compress { codec: Codec::None },
        Call::Compress {
            codec: Codec::Zstd { level: -7 },
        },
        Call::Compress { codec: Codec::Lz4 },
        Call::Decompress,
        Call::EcEncode { spec },
        Call::EcReconstruct {
            spec,
            len: u64::MAX,
        },
        Call::EcRebuild { spec },
        Call::Checksum,
    ] {
        postcard_round_trip(&call);
    }
    let stripe = ec_encode(spec, &text()).unwrap();
    postcard_round_trip(&Input::Bytes(text()));
    let mut slots = stripe.clone().into_slots();
    slots[3] = None;
    postcard_round_trip(&Input::Shards(slots));
    postcard_round_trip(&Output::Stripe(stripe));
    postcard_round_trip(&Output::Checksum(7));
    postcard_round_trip(&Output::Bytes(compress_block(Codec::Lz4, &text()).unwrap()));
    for e in [
        decompress_block(b"nope").unwrap_err(),
        decompress_block(&[0u8; 40]).unwrap_err(),
        FuncError::Corrupt {
            codec: nacre_func::CodecId::Lz4,
            reason: "offset out of bounds".into(),
        },
        FuncError::TooManyMissing {
            missing: 3,
            k: 4,
            m: 2,
        },
    ] {
        postcard_round_trip(&e);
    }
}
