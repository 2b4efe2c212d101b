//! What a file holds, as segments of seeded pseudo-random streams ([`Content`]), not bytes: a
//! client's model stays small whatever the file sizes, and bytes are made only when writing and
//! when checking. Also the workload's deterministic generator ([`Rng`]).

use bytes::Bytes;

const GOLDEN: u64 = 0x9e37_79b9_7f4a_7c15;

/// The splitmix64 finalizer.
fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// splitmix64: tiny, deterministic, good enough to pick operations.
#[derive(Clone, Debug)]
pub(super) struct Rng(pub(super) u64);

impl Rng {
    pub(super) fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(GOLDEN);
        mix(self.0)
    }

    pub(super) fn below(&mut self, n: u64) -> u64 {
        if n == 0 { 0 } else { self.next() % n }
    }

    /// In `lo..=hi` (`lo` if empty).
    pub(super) fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.below(hi.saturating_sub(lo) + 1)
    }
}

/// Bytes `from..` of the stream `seed` into `out`: random access, so a segment cut anywhere
/// still names its bytes.
fn fill(seed: u64, from: u64, out: &mut [u8]) {
    let (mut i, mut k) = (from, 0);
    while k < out.len() {
        let word = mix(seed ^ (i >> 3).wrapping_mul(GOLDEN)).to_le_bytes();
        let start = (i & 7) as usize;
        let n = (8 - start).min(out.len() - k);
        out[k..k + n].copy_from_slice(&word[start..start + n]);
        k += n;
        i += n as u64;
    }
}

pub(super) fn stream(seed: u64, len: u64) -> Bytes {
    let mut v = vec![0u8; len as usize];
    fill(seed, 0, &mut v);
    Bytes::from(v)
}

/// File bytes `off..off + len` are bytes `from..` of the stream `seed`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Seg {
    off: u64,
    len: u64,
    seed: u64,
    from: u64,
}

/// A file's content: `len` bytes, the segments over zeros (holes, extensions).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(super) struct Content {
    pub(super) len: u64,
    /// Sorted, not overlapping, inside `len`.
    segs: Vec<Seg>,
}

impl Content {
    /// After writing `len` bytes of stream `seed` at `off` (past the end: a hole of zeros).
    pub(super) fn written(&self, off: u64, len: u64, seed: u64) -> Self {
        let mut c = self.cut(off, off + len);
        c.segs.push(Seg {
            off,
            len,
            seed,
            from: 0,
        });
        c.segs.sort_by_key(|s| s.off);
        c.len = c.len.max(off + len);
        c
    }

    /// After a truncate (or an extension with zeros).
    pub(super) fn resized(&self, size: u64) -> Self {
        let mut c = self.cut(size, u64::MAX);
        c.len = size;
        c
    }

    /// Without the segments' bytes in `from..to`.
    fn cut(&self, from: u64, to: u64) -> Self {
        let mut segs = Vec::with_capacity(self.segs.len() + 1);
        for s in &self.segs {
            let end = s.off + s.len;
            if end <= from || s.off >= to {
                segs.push(*s);
                continue;
            }
            if s.off < from {
                segs.push(Seg {
                    len: from - s.off,
                    ..*s
                });
            }
            if end > to {
                segs.push(Seg {
                    off: to,
                    len: end - to,
                    seed: s.seed,
                    from: s.from + (to - s.off),
                });
            }
        }
        Self {
            len: self.len,
            segs,
        }
    }

    pub(super) fn bytes(&self) -> Vec<u8> {
        let mut out = vec![0u8; self.len as usize];
        for s in &self.segs {
            fill(
                s.seed,
                s.from,
                &mut out[s.off as usize..(s.off + s.len) as usize],
            );
        }
        out
    }
}
