//! Writes into holes of an open file (a sparse file filled at random offsets: databases, VM
//! images, downloaders, `mmap`): kept in memory as *pieces* until the file's next commit
//! (`close`, `fsync`, a write over a piece that is not into a hole, a size change; reads see
//! them without committing them), then written like small files, many pieces to a packet in shared tiny extents, and
//! their keys committed in batches. So a write into a hole costs a memory copy, not a
//! replicated write and a key commit, and its cost does not grow with the file's keys.
//!
//! Pieces never overlap each other, a key or the run; neighbours merge up to a packet (128 KiB).
//! A run that grows onto pieces takes them over: its bytes replace the parts of pieces they
//! cover, and the pieces that continue it without a gap join it. So the chunks of a large
//! `O_DIRECT` write, which FUSE sends in parallel and which may arrive out of order past the end
//! of a file allocated ahead, still end up in one normal extent.
//! A file's pieces are bounded by [`PIECES_MAX`]: past that the write commits them first.

use std::collections::BTreeMap;

use bytes::{Bytes, BytesMut};
use nacre_api::data::MAX_PACKET;

use super::files::{overlapping, record_keys};
use super::{FileState, Inner, OpenFile};
use crate::meta::FsResult;

/// Most bytes of pieces one open file keeps before a write commits them.
pub(super) const PIECES_MAX: usize = 16 << 20;

/// Most keys in one `AppendExtents`.
const KEYS_PER_COMMIT: usize = 1024;

impl Inner {
    /// Keeps `data` at `off` as a piece when `[off, off + len)` is a hole of the committed file
    /// (no key there, inside its size, outside the run); `false` when it is not one.
    pub(super) fn buffer_hole(&self, st: &mut FileState, off: u64, data: &[u8]) -> bool {
        let end = off + data.len() as u64;
        let Some(keys) = st.extents.as_deref() else {
            return false;
        };
        let in_run = st
            .run
            .as_ref()
            .is_some_and(|r| off < r.end() && r.start < end);
        if in_run || end > st.size || !overlapping(keys, off, end).is_empty() {
            return false;
        }
        st.pieces_bytes += insert(&mut st.pieces, off, data);
        true
    }

    /// Writes the pieces of `f` (see the module docs) and commits their keys.
    pub(super) async fn commit_pieces(&self, f: &OpenFile, st: &mut FileState) -> FsResult<()> {
        if st.pieces.is_empty() {
            return Ok(());
        }
        let pieces = std::mem::take(&mut st.pieces);
        st.pieces_bytes = 0;
        // As units (raw pieces, or compressed blocks), packed in offset order.
        let mut units = Vec::new();
        for (off, bytes) in pieces {
            units.extend(self.units(off, bytes.freeze()).await?);
        }
        let keys = self.place_units(f.ino.0 as usize, units).await?;
        for batch in keys.chunks(KEYS_PER_COMMIT) {
            self.meta.append_extents(f.ino, batch.to_vec()).await?;
            record_keys(st, batch.to_vec());
        }
        st.times_stale = false;
        st.ahead = None;
        Ok(())
    }
}

/// `bytes` (the committed file from `from`) with the pieces of `st` over them: what a read
/// returns without committing the pieces first (an `mmap` of a sparse file reads every page it
/// touches, around the pages it has written).
pub(super) fn over(st: &FileState, from: u64, bytes: Bytes) -> Bytes {
    let to = from + bytes.len() as u64;
    let mut out = BytesMut::from(&bytes[..]);
    let first = st
        .pieces
        .range(..=from)
        .next_back()
        .map_or(from, |(s, _)| *s);
    for (&s, b) in st.pieces.range(first..to) {
        let e = s + b.len() as u64;
        let (lo, hi) = (s.max(from), e.min(to));
        if lo < hi {
            out[(lo - from) as usize..(hi - from) as usize]
                .copy_from_slice(&b[(lo - s) as usize..(hi - s) as usize]);
        }
    }
    out.freeze()
}

/// Whether a piece of `st` overlaps `[from, to)`.
pub(super) fn overlap(st: &FileState, from: u64, to: u64) -> bool {
    st.pieces
        .range(..to)
        .next_back()
        .is_some_and(|(s, b)| *s + b.len() as u64 > from)
}

/// Drops the bytes of `pieces` inside `[from, to)` (written over since, outside the pieces),
/// keeping what lies on either side. Returns the bytes dropped.
pub(super) fn cut(pieces: &mut BTreeMap<u64, BytesMut>, from: u64, to: u64) -> usize {
    let first = pieces
        .range(..=from)
        .next_back()
        .filter(|(s, b)| **s + b.len() as u64 > from)
        .map_or(from, |(s, _)| *s);
    let hit: Vec<u64> = pieces.range(first..to).map(|(s, _)| *s).collect();
    let mut dropped = 0;
    for s in hit {
        let Some(mut b) = pieces.remove(&s) else {
            continue;
        };
        let e = s + b.len() as u64;
        let (lo, hi) = (s.max(from), e.min(to));
        dropped += (hi - lo) as usize;
        if hi < e {
            pieces.insert(hi, b.split_off((hi - s) as usize));
        }
        if s < lo {
            b.truncate((lo - s) as usize);
            pieces.insert(s, b);
        }
    }
    dropped
}

/// Takes the pieces that continue `at` without a gap, in order: the bytes from `at` on.
pub(super) fn take_following(pieces: &mut BTreeMap<u64, BytesMut>, mut at: u64) -> Vec<BytesMut> {
    let mut out = Vec::new();
    while let Some(b) = pieces.remove(&at) {
        at += b.len() as u64;
        out.push(b);
    }
    out
}

/// Puts `data` at `off` into `pieces` (disjoint): over the parts of pieces it overlaps, into
/// neighbours it touches while they stay within a packet, as new pieces elsewhere. Returns the
/// bytes added.
fn insert(pieces: &mut BTreeMap<u64, BytesMut>, off: u64, data: &[u8]) -> usize {
    let end = off + data.len() as u64;
    // Overwrite what overlaps, and note the gaps left.
    let mut gaps = Vec::new();
    let mut pos = off;
    let first = pieces
        .range(..=off)
        .next_back()
        .filter(|(s, b)| **s + b.len() as u64 > off)
        .map_or(off, |(s, _)| *s);
    for (&s, b) in pieces.range_mut(first..end) {
        let e = s + b.len() as u64;
        if s > pos {
            gaps.push((pos, s));
        }
        let (from, to) = (s.max(off), e.min(end));
        b[(from - s) as usize..(to - s) as usize]
            .copy_from_slice(&data[(from - off) as usize..(to - off) as usize]);
        pos = pos.max(to);
    }
    if pos < end {
        gaps.push((pos, end));
    }
    let mut added = 0;
    for (from, to) in gaps {
        let bytes = &data[(from - off) as usize..(to - off) as usize];
        added += bytes.len();
        // Onto the end of the piece just before, if it ends here and has room.
        let left = pieces
            .range_mut(..from)
            .next_back()
            .filter(|(s, b)| **s + b.len() as u64 == from && b.len() + bytes.len() <= MAX_PACKET);
        if let Some((_, b)) = left {
            b.extend_from_slice(bytes);
            continue;
        }
        pieces.insert(from, BytesMut::from(bytes));
    }
    added
}

#[cfg(test)]
mod tests {
    use super::*;

    fn flat(pieces: &BTreeMap<u64, BytesMut>) -> BTreeMap<u64, u8> {
        pieces
            .iter()
            .flat_map(|(s, b)| b.iter().enumerate().map(move |(i, x)| (s + i as u64, *x)))
            .collect()
    }

    proptest::proptest! {
        /// Against a byte map: the pieces hold exactly the bytes written last, never overlap,
        /// and count each byte once.
        #[test]
        fn pieces_match_a_byte_map(
            writes in proptest::collection::vec((0..300u64, 1..200usize, 0..255u8), 1..40),
        ) {
            let mut pieces = BTreeMap::new();
            let mut want = BTreeMap::new();
            let mut total = 0;
            for (off, len, fill) in writes {
                let data = vec![fill; len];
                total += insert(&mut pieces, off, &data);
                for i in 0..len as u64 {
                    want.insert(off + i, fill);
                }
            }
            let mut end = 0;
            for (s, b) in &pieces {
                proptest::prop_assert!(*s >= end, "overlap at {}", s);
                proptest::prop_assert!(!b.is_empty());
                end = s + b.len() as u64;
            }
            proptest::prop_assert_eq!(flat(&pieces), want.clone());
            proptest::prop_assert_eq!(total, want.len());
        }

        /// A cut removes exactly the bytes in its range, and the pieces that follow a point
        /// without a gap come out in order.
        #[test]
        fn cut_and_take_following_match_a_byte_map(
            writes in proptest::collection::vec((0..300u64, 1..200usize, 0..255u8), 1..30),
            from in 0..400u64,
            len in 0..200u64,
            at in 0..400u64,
        ) {
            let mut pieces = BTreeMap::new();
            for (off, n, fill) in writes {
                insert(&mut pieces, off, &vec![fill; n]);
            }
            let mut want = flat(&pieces);
            let before = want.len();
            want.retain(|o, _| *o < from || *o >= from + len);
            let dropped = cut(&mut pieces, from, from + len);
            proptest::prop_assert_eq!(dropped, before - want.len());
            proptest::prop_assert_eq!(flat(&pieces), want.clone());
            let mut end = 0;
            for (s, b) in &pieces {
                proptest::prop_assert!(*s >= end && !b.is_empty());
                end = s + b.len() as u64;
            }
            let taken: Vec<u8> = take_following(&mut pieces, at).concat();
            let mut o = at;
            for x in &taken {
                proptest::prop_assert_eq!(want.remove(&o), Some(*x));
                o += 1;
            }
            proptest::prop_assert!(!pieces.contains_key(&o));
            proptest::prop_assert_eq!(flat(&pieces), want);
        }
    }
}
