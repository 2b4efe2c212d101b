//! Erasure coding: stripes against the plain bytes they encode, any `m` shards lost or corrupt.

#![allow(clippy::unwrap_used)] // helpers and proptest bodies outside #[test] fns

use bytes::Bytes;
use nacre_func::{
    EcSpec, FuncError, MAX_SHARDS, Shard, Stripe, checksum, ec_encode, ec_encode_bytes, ec_rebuild,
    ec_reconstruct, ec_reconstruct_shards, ec_reconstruct_verified,
};
use proptest::prelude::*;

const SPECS: [(u8, u8); 7] = [(1, 1), (2, 1), (3, 2), (4, 2), (6, 3), (8, 3), (10, 4)];

fn spec() -> impl Strategy<Value = EcSpec> {
    prop::sample::select(SPECS.to_vec()).prop_map(|(k, m)| EcSpec::new(k, m).unwrap())
}

/// Lengths around the edges (0, 1, multiples of k and one off) as well as random ones.
fn data() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        prop::collection::vec(any::<u8>(), 0..5000),
        prop::collection::vec(any::<u8>(), 0..=2),
        (
            prop::sample::select(vec![8usize, 24, 120, 240, 2520]),
            -1isize..=1
        )
            .prop_flat_map(|(n, d)| prop::collection::vec(any::<u8>(), (n as isize + d) as usize)),
    ]
}

/// A stripe and a set of `lost` distinct shard indices, drawn together.
fn stripe_and_losses(extra: usize) -> impl Strategy<Value = (Vec<u8>, Stripe, Vec<usize>)> {
    (spec(), data()).prop_flat_map(move |(spec, data)| {
        let stripe = ec_encode(spec, &data).unwrap();
        let n = spec.total();
        let most = (usize::from(spec.m) + extra).min(n);
        let lost = prop::sample::subsequence((0..n).collect::<Vec<_>>(), 0..=most);
        (Just(data), Just(stripe), lost)
    })
}

fn slots(stripe: &Stripe, lost: &[usize]) -> Vec<Option<Bytes>> {
    stripe
        .shards
        .iter()
        .enumerate()
        .map(|(i, s)| (!lost.contains(&i)).then(|| s.data.clone()))
        .collect()
}

fn flip(shard: &Shard, at: usize) -> Shard {
    let mut d = shard.data.to_vec();
    let i = at % d.len();
    d[i] ^= 0x40;
    Shard {
        data: d.into(),
        crc: shard.crc,
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 192, ..ProptestConfig::default() })]

    /// The stripe is the padded bytes cut in k, then parity; every shard has its CRC.
    #[test]
    fn encode_lays_out_the_stripe(spec in spec(), data in data()) {
        let s = ec_encode(spec, &data).unwrap();
        let (k, n) = (usize::from(spec.k), spec.total());
        let l = data.len().div_ceil(k);
        prop_assert_eq!(s.spec, spec);
        prop_assert_eq!(s.len, data.len() as u64);
        prop_assert_eq!(s.shards.len(), n);
        let mut padded = data.clone();
        padded.resize(k * l, 0);
        for (i, shard) in s.shards.iter().enumerate() {
            prop_assert_eq!(shard.data.len(), l);
            prop_assert_eq!(shard.crc, crc32c::crc32c(&shard.data));
            if i < k {
                prop_assert_eq!(&shard.data[..], &padded[i * l..(i + 1) * l]);
            }
        }
    }

    #[test]
    fn any_m_lost_shards_reconstruct((data, stripe, lost) in stripe_and_losses(0)) {
        let spec = stripe.spec;
        let out = ec_reconstruct(spec, slots(&stripe, &lost), stripe.len).unwrap();
        prop_assert_eq!(&out[..], &data[..]);
        let all = ec_reconstruct_shards(spec, slots(&stripe, &lost)).unwrap();
        let want: Vec<Bytes> = stripe.shards.iter().map(|s| s.data.clone()).collect();
        prop_assert_eq!(all, want);
        let rebuilt = ec_rebuild(spec, stripe.clone().into_slots().into_iter().enumerate()
            .map(|(i, s)| s.filter(|_| !lost.contains(&i))).collect()).unwrap();
        prop_assert_eq!(&rebuilt.shards, &stripe.shards);
        prop_assert_eq!(&rebuilt.rebuilt, &lost);
    }

    #[test]
    fn more_than_m_lost_is_an_error((_data, stripe, lost) in stripe_and_losses(3)) {
        let spec = stripe.spec;
        prop_assume!(lost.len() > usize::from(spec.m));
        let want = FuncError::TooManyMissing { missing: lost.len(), k: spec.k, m: spec.m };
        prop_assert_eq!(ec_reconstruct(spec, slots(&stripe, &lost), stripe.len), Err(want.clone()));
        prop_assert_eq!(ec_reconstruct_shards(spec, slots(&stripe, &lost)), Err(want));
        let r = ec_rebuild(spec, slots(&stripe, &lost).into_iter().zip(&stripe.shards)
            .map(|(s, sh)| s.map(|_| sh.clone())).collect());
        let is_too_many = matches!(r, Err(FuncError::TooManyMissing { .. }));
        prop_assert!(is_too_many);
    }

    /// Shards corrupted (bytes changed, CRC kept) count as missing when CRCs are checked: with at
    /// most m bad or missing in all the stripe still reads back exactly, and the rebuild names
    /// every bad one; one more is an error, never wrong bytes.
    #[test]
    fn corrupt_shards_are_detected_and_rebuilt(
        (data, stripe, bad) in stripe_and_losses(1),
        corrupt_mask in any::<u64>(),
        at in any::<usize>(),
    ) {
        let spec = stripe.spec;
        prop_assume!(stripe.len > 0);
        // Each bad shard is either corrupt or missing, per a bit of the mask.
        let slots: Vec<Option<Shard>> = stripe.shards.iter().enumerate().map(|(i, s)| {
            match bad.iter().position(|&b| b == i) {
                None => Some(s.clone()),
                Some(j) if corrupt_mask >> (j % 64) & 1 == 1 => Some(flip(s, at)),
                Some(_) => None,
            }
        }).collect();
        let read = ec_reconstruct_verified(spec, slots.clone(), stripe.len);
        let rebuilt = ec_rebuild(spec, slots);
        if bad.len() <= usize::from(spec.m) {
            prop_assert_eq!(&read.unwrap()[..], &data[..]);
            let rebuilt = rebuilt.unwrap();
            prop_assert_eq!(&rebuilt.shards, &stripe.shards);
            prop_assert_eq!(&rebuilt.rebuilt, &bad);
        } else {
            let read_failed = matches!(read, Err(FuncError::TooManyMissing { .. }));
            let rebuild_failed = matches!(rebuilt, Err(FuncError::TooManyMissing { .. }));
            prop_assert!(read_failed && rebuild_failed);
        }
    }
}

proptest! {
    // Stripes whose shards span several of the coder's 8 KiB column slices, a partial last one
    // included; fewer cases, as each is up to 100 KiB.
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    #[test]
    fn wide_shards_reconstruct(
        spec in spec(),
        len in 0usize..100_000,
        seed in any::<u64>(),
        lost_seed in any::<u64>(),
    ) {
        let mut x = seed;
        let data: Vec<u8> = (0..len).map(|_| { x = x.wrapping_mul(6364136223846793005).wrapping_add(1); (x >> 56) as u8 }).collect();
        let stripe = ec_encode(spec, &data).unwrap();
        // The m lost shards: a rotation of the indices picked by the seed, data shards first.
        let n = spec.total();
        let first = (lost_seed % n as u64) as usize;
        let lost: Vec<usize> = (0..usize::from(spec.m)).map(|j| (first + j) % n).collect();
        prop_assert_eq!(&ec_reconstruct(spec, slots(&stripe, &lost), stripe.len).unwrap()[..], &data[..]);
        let all = ec_reconstruct_shards(spec, slots(&stripe, &lost)).unwrap();
        prop_assert!(all.iter().zip(&stripe.shards).all(|(a, s)| a == &s.data));
    }

    /// Encoding from `Bytes` lends the full data shards and gives the same stripe.
    #[test]
    fn encode_bytes_is_encode_without_the_copy(spec in spec(), data in data()) {
        let owned = Bytes::from(data.clone());
        let s = ec_encode_bytes(spec, owned.clone()).unwrap();
        prop_assert_eq!(&s, &ec_encode(spec, &data).unwrap());
        let l = data.len().div_ceil(usize::from(spec.k));
        for (i, shard) in s.shards.iter().enumerate().take(usize::from(spec.k)) {
            if l > 0 && (i + 1) * l <= data.len() {
                prop_assert_eq!(shard.data.as_ptr(), owned[i * l..].as_ptr(), "shard {} was copied", i);
            }
        }
    }
}

#[test]
fn spec_limits() {
    let bad = |k, m| FuncError::BadEcSpec {
        k,
        m,
        max: MAX_SHARDS,
    };
    assert_eq!(EcSpec::new(0, 1), Err(bad(0, 1)));
    assert_eq!(EcSpec::new(1, 0), Err(bad(1, 0)));
    assert_eq!(EcSpec::new(200, 57), Err(bad(200, 57)));
    assert_eq!(
        ec_encode(EcSpec { k: 4, m: 0 }, b"x").unwrap_err(),
        bad(4, 0)
    );
    assert_eq!(
        ec_reconstruct(EcSpec { k: 0, m: 2 }, vec![], 0).unwrap_err(),
        bad(0, 2)
    );
    assert!(EcSpec::new(255, 1).is_ok());
    assert_eq!(
        FuncError::BadEcSpec {
            k: 0,
            m: 1,
            max: MAX_SHARDS
        }
        .to_string(),
        "invalid erasure code 0+1: need k >= 1, m >= 1, k + m <= 256"
    );
}

#[test]
fn the_widest_code_round_trips() {
    let spec = EcSpec::new(200, 56).unwrap();
    let data: Vec<u8> = (0..1000u32).map(|i| (i * 31 % 251) as u8).collect();
    let s = ec_encode(spec, &data).unwrap();
    let lost: Vec<usize> = (0..56).map(|i| i * 3).collect();
    assert_eq!(ec_reconstruct(spec, slots(&s, &lost), s.len).unwrap(), data);
}

#[test]
fn wrong_slot_count() {
    let spec = EcSpec::new(4, 2).unwrap();
    let s = ec_encode(spec, b"hello stripe").unwrap();
    let mut short = slots(&s, &[]);
    short.pop();
    let want = FuncError::ShardCount {
        k: 4,
        m: 2,
        actual: 5,
    };
    assert_eq!(
        ec_reconstruct(spec, short.clone(), s.len),
        Err(want.clone())
    );
    assert_eq!(ec_reconstruct_shards(spec, short), Err(want.clone()));
    let mut short = s.clone().into_slots();
    short.pop();
    assert_eq!(
        ec_reconstruct_verified(spec, short.clone(), s.len),
        Err(want.clone())
    );
    assert_eq!(ec_rebuild(spec, short), Err(want.clone()));
    assert_eq!(want.to_string(), "stripe has 5 shard slots, 4+2 needs 6");
}

#[test]
fn shard_length_mismatch() {
    let spec = EcSpec::new(2, 1).unwrap();
    let s = ec_encode(spec, b"0123456789").unwrap();
    let mut bad = slots(&s, &[0]);
    bad[2] = Some(Bytes::from_static(b"0123"));
    assert_eq!(
        ec_reconstruct(spec, bad.clone(), s.len),
        Err(FuncError::ShardLength {
            index: 2,
            expected: 5,
            actual: 4
        })
    );
    assert_eq!(
        ec_reconstruct_shards(spec, bad),
        Err(FuncError::ShardLength {
            index: 2,
            expected: 5,
            actual: 4
        })
    );
    // A length that does not fit the shards.
    assert_eq!(
        ec_reconstruct(spec, slots(&s, &[1]), 100),
        Err(FuncError::ShardLength {
            index: 0,
            expected: 50,
            actual: 5
        })
    );
}

#[test]
fn an_empty_stripe() {
    let spec = EcSpec::new(3, 2).unwrap();
    let s = ec_encode(spec, b"").unwrap();
    assert_eq!(s.len, 0);
    assert!(
        s.shards
            .iter()
            .all(|sh| sh.data.is_empty() && sh.crc == checksum(b""))
    );
    assert_eq!(
        ec_reconstruct(spec, slots(&s, &[0, 4]), 0).unwrap(),
        Bytes::new()
    );
    assert_eq!(
        ec_reconstruct_shards(spec, slots(&s, &[1, 2])).unwrap(),
        vec![Bytes::new(); 5]
    );
    assert!(matches!(
        ec_reconstruct(spec, slots(&s, &[0, 1, 2]), 0),
        Err(FuncError::TooManyMissing { missing: 3, .. })
    ));
}

#[test]
fn a_corrupt_crc_is_a_corrupt_shard() {
    let spec = EcSpec::new(4, 2).unwrap();
    let data: Vec<u8> = (0..4096u32).map(|i| i as u8).collect();
    let s = ec_encode(spec, &data).unwrap();
    let mut slots = s.clone().into_slots();
    if let Some(sh) = slots[1].as_mut() {
        sh.crc ^= 1;
    }
    assert_eq!(
        ec_reconstruct_verified(spec, slots.clone(), s.len).unwrap(),
        data
    );
    let r = ec_rebuild(spec, slots).unwrap();
    assert_eq!(r.rebuilt, vec![1]);
    assert_eq!(r.shards, s.shards);
}
