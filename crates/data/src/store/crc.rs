//! CRC-32C arithmetic for block records: moving a CRC past runs of zero bytes in logarithmic time,
//! and patching a block's CRC for an in-place overwrite from the overwritten bytes alone.
//!
//! A CRC is linear over GF(2) apart from a term that depends only on the length: for messages
//! `x`, `y`, `z` of one length, `crc(x ^ y ^ z) = crc(x) ^ crc(y) ^ crc(z)`. Replacing bytes
//! `[a, b)` of a block `O` (length `L`) by `P` gives `N = O ^ D ^ E`, where `D` and `E` are zeros
//! except for the old and the new bytes at `[a, b)`. The zeros before `a` contribute nothing to the
//! difference and the `L - b` zeros after it multiply it by `x^(8(L-b))` modulo the polynomial, so
//! `crc(N) = crc(O) ^ shift(crc(O[a..b]) ^ crc(P), L - b)`: a 4 KiB overwrite of a data node's
//! 32 KiB block reads and checksums 4 KiB, not the block.

use std::sync::OnceLock;

use nacre_types::crc32c;

/// The reflected CRC-32C polynomial.
const POLY: u32 = 0x82F6_3B78;

/// A linear map on 32-bit CRC registers: column `i` is the image of bit `i`.
type Matrix = [u32; 32];

fn times(m: &Matrix, mut v: u32) -> u32 {
    let mut out = 0;
    let mut i = 0;
    while v != 0 {
        if v & 1 == 1 {
            out ^= m[i];
        }
        v >>= 1;
        i += 1;
    }
    out
}

fn square(m: &Matrix) -> Matrix {
    let mut out = [0; 32];
    for (o, &col) in out.iter_mut().zip(m) {
        *o = times(m, col);
    }
    out
}

/// `OPS[k]` moves a CRC register past `2^k` zero bytes.
fn ops() -> &'static [Matrix; 64] {
    static OPS: OnceLock<[Matrix; 64]> = OnceLock::new();
    OPS.get_or_init(|| {
        // One zero bit: shift right, folding the polynomial in when the low bit falls out.
        let mut bit = [0u32; 32];
        bit[0] = POLY;
        for (i, col) in bit.iter_mut().enumerate().skip(1) {
            *col = 1 << (i - 1);
        }
        let byte = square(&square(&square(&bit)));
        let mut ops = [[0u32; 32]; 64];
        ops[0] = byte;
        for k in 1..64 {
            ops[k] = square(&ops[k - 1]);
        }
        ops
    })
}

/// The linear part of appending `n` zero bytes: what `crc` contributes to the CRC of its message
/// followed by `n` zeros (`crc32c_combine(crc, 0, n)`), in `O(log n)`.
pub(crate) fn shift(mut crc: u32, n: u64) -> u32 {
    let ops = ops();
    let mut n = n;
    let mut k = 0;
    while n != 0 {
        if n & 1 == 1 {
            crc = times(&ops[k], crc);
        }
        n >>= 1;
        k += 1;
    }
    crc
}

/// Continues `crc` (of some message) over `n` zero bytes: the CRC of the message followed by `n`
/// zeros. The register is the CRC's complement (CRC-32C starts from and ends with all ones).
pub(crate) fn zeros(crc: u32, n: u64) -> u32 {
    !shift(!crc, n)
}

/// The CRC of a block whose CRC was `crc` after `old` (its bytes at some range) became `new` (as
/// long), with `after` bytes of the block following that range.
pub(crate) fn patch(crc: u32, old: &[u8], new: &[u8], after: u64) -> u32 {
    debug_assert_eq!(old.len(), new.len());
    crc ^ shift(crc32c(old) ^ crc32c(new), after)
}

#[cfg(test)]
mod tests {
    use super::*;
    use nacre_types::crc32c_append;
    use proptest::prelude::*;

    fn zeros_slow(mut crc: u32, n: u64) -> u32 {
        let z = [0u8; 997];
        let mut left = n;
        while left > 0 {
            let k = left.min(z.len() as u64);
            crc = crc32c_append(crc, &z[..k as usize]);
            left -= k;
        }
        crc
    }

    #[test]
    fn shift_matches_the_crates_combine() {
        for (crc, n) in [
            (0u32, 0u64),
            (1, 1),
            (0xDEAD_BEEF, 7),
            (u32::MAX, 4096),
            (12345, 131_071),
        ] {
            assert_eq!(
                shift(crc, n),
                crc32c::crc32c_combine(crc, 0, n as usize),
                "crc {crc:#x} n {n}"
            );
        }
    }

    #[test]
    fn zeros_matches_feeding_zeros() {
        for n in [0u64, 1, 3, 64, 4095, 4096, 4097, 131_072, 1 << 20] {
            for crc in [0u32, 0x1234_5678, u32::MAX] {
                assert_eq!(zeros(crc, n), zeros_slow(crc, n), "crc {crc:#x} n {n}");
            }
        }
    }

    proptest! {
        #[test]
        fn patch_equals_recomputing(
            block in prop::collection::vec(any::<u8>(), 1..3000),
            a in any::<prop::sample::Index>(),
            b in any::<prop::sample::Index>(),
            fill in any::<u8>(),
        ) {
            let (a, b) = (a.index(block.len()), b.index(block.len()));
            let (a, b) = (a.min(b), a.max(b) + 1);
            let new: Vec<u8> = (a..b).map(|i| (i as u8).wrapping_mul(31) ^ fill).collect();
            let mut patched = block.clone();
            patched[a..b].copy_from_slice(&new);
            let after = (block.len() - b) as u64;
            prop_assert_eq!(patch(crc32c(&block), &block[a..b], &new, after), crc32c(&patched));
        }
    }
}
