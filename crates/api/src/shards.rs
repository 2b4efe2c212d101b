//! Where an erasure-coded data partition keeps a stripe (docs/ARCHITECTURE.md, "Erasure-coded
//! volumes").
//!
//! A stripe is the bytes stored for one unit of a file (a block frame), cut into `k` data shards
//! of `ceil(len / k)` bytes (the last zero-padded) and `m` parity shards of the same length.
//! Replica `i` of the partition keeps shard `i` in the same tiny extent at the same offset, the
//! stripe's *base*, that replica 0 chose. Extent keys address a stripe in a logical space `k`
//! times the shards' space: a key's `extent_offset` is `k · base`, and the stripe takes `[k ·
//! base, k · base + len)` of it. Stripes never share shard bytes, so their logical ranges never
//! overlap either, and the meta partitions' range algebra (which frees exactly the ranges no key
//! holds) works on them unchanged; a data node turns a released logical range back into the
//! shard range each replica punches ([`shard_range`]).

use nacre_func::EcSpec;
use nacre_types::ExtentId;

/// A stripe's place on every replica: shard bytes `[base, base + shard_len)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StripeAt {
    pub base: u64,
    pub shard_len: u64,
}

impl StripeAt {
    /// The stripe of `len` stored bytes whose key says `extent_offset`.
    pub fn of_key(ec: EcSpec, extent_offset: u64, len: u64) -> Self {
        let k = u64::from(ec.k.max(1));
        StripeAt {
            base: extent_offset / k,
            shard_len: ec.shard_len(len),
        }
    }

    /// The `extent_offset` of a key for the stripe whose shards start at `base`.
    pub fn key_offset(ec: EcSpec, base: u64) -> u64 {
        base * u64::from(ec.k.max(1))
    }
}

/// The shard range every replica holds for logical range `[offset, offset + len)` of a stripe
/// (or of several consecutive ones): `[offset / k, ceil((offset + len) / k))`. Exact for a
/// stripe's whole range; a range that starts or ends inside a stripe is widened to its shard
/// bytes.
pub fn shard_range(ec: EcSpec, offset: u64, len: u64) -> (u64, u64) {
    let k = u64::from(ec.k.max(1));
    let start = offset / k;
    let end = offset.saturating_add(len).div_ceil(k);
    (start, end - start)
}

/// A release's ranges `(extent, offset, len)` in logical space, as shard ranges; a whole-extent
/// release (`len == u64::MAX`) stays whole.
pub fn shard_ranges(ec: EcSpec, ranges: &[(ExtentId, u64, u64)]) -> Vec<(ExtentId, u64, u64)> {
    ranges
        .iter()
        .map(|&(e, off, len)| {
            if len == u64::MAX {
                (e, off, len)
            } else {
                let (o, l) = shard_range(ec, off, len);
                (e, o, l)
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const EC: EcSpec = EcSpec { k: 4, m: 2 };

    #[test]
    fn a_stripe_s_logical_range_maps_back_to_exactly_its_shards() {
        // Two stripes back to back on the replicas: 1000 and 10 stored bytes.
        let (a, b) = (
            StripeAt {
                base: 4096,
                shard_len: EC.shard_len(1000),
            },
            StripeAt {
                base: 4096 + EC.shard_len(1000),
                shard_len: EC.shard_len(10),
            },
        );
        assert_eq!(a.shard_len, 250);
        assert_eq!(b.shard_len, 3);
        let (ka, kb) = (
            StripeAt::key_offset(EC, a.base),
            StripeAt::key_offset(EC, b.base),
        );
        assert!(ka + 1000 <= kb, "logical ranges do not overlap");
        assert_eq!(StripeAt::of_key(EC, ka, 1000), a);
        assert_eq!(StripeAt::of_key(EC, kb, 10), b);
        assert_eq!(shard_range(EC, ka, 1000), (a.base, a.shard_len));
        assert_eq!(shard_range(EC, kb, 10), (b.base, b.shard_len));
        assert_eq!(
            shard_ranges(EC, &[(ExtentId(1), ka, 1000), (ExtentId(2), 0, u64::MAX)]),
            [
                (ExtentId(1), a.base, a.shard_len),
                (ExtentId(2), 0, u64::MAX)
            ]
        );
    }
}
