//! The algebra of a file's extent keys: validity, overlaying a new key on the sorted,
//! non-overlapping keys of a file, truncating them, punching a range out of them, and which
//! parts of dropped keys no live key refers to any more (only those may be freed). Pure
//! functions over slices of [`ExtentKey`].

use nacre_types::{ExtentId, PartitionId};

use nacre_api::meta::ExtentKey;
pub(super) use nacre_api::meta::extents::cut;

/// A key can be stored: it covers at least one byte, and neither its file range nor its extent
/// range overflows.
pub(super) fn key_is_valid(k: &ExtentKey) -> bool {
    let stored = k.framed.map_or(k.size, |f| f.stored.get());
    k.size > 0
        && k.framed
            .is_none_or(|f| f.skip.checked_add(k.size).is_some())
        && k.file_offset.checked_add(u64::from(k.size)).is_some()
        && k.extent_offset.checked_add(u64::from(stored)).is_some()
}

/// The extent bytes `k` holds on its data node, as a raw key over them: a framed key's whole
/// frame (shared by every key cut from its block), a raw key itself.
fn as_stored(k: &ExtentKey) -> ExtentKey {
    match k.framed {
        None => *k,
        Some(f) => ExtentKey {
            size: f.stored.get(),
            crc: k.crc,
            framed: None,
            ..*k
        },
    }
}

/// An inode's keys are valid, sorted, non-overlapping and within `size`.
pub(super) fn check_extents(keys: &[ExtentKey], size: u64) -> Result<(), String> {
    let mut end = 0;
    for k in keys {
        if !key_is_valid(k) || k.file_offset < end {
            return Err(format!("extent key {k:?} invalid or out of order"));
        }
        end = k.end();
    }
    if end > size {
        return Err(format!("extent keys end at {end}, past the size {size}"));
    }
    Ok(())
}

/// Splits `keys` at file offset `size`: the keys before it (the one straddling it trimmed) and the
/// keys past it.
pub(super) fn truncate(keys: &[ExtentKey], size: u64) -> (Vec<ExtentKey>, Vec<ExtentKey>) {
    let at = keys.partition_point(|k| k.file_offset < size);
    let (kept, dropped) = keys.split_at(at);
    let mut kept = kept.to_vec();
    if let Some(k) = kept.last_mut()
        && k.end() > size
    {
        *k = cut(k, k.file_offset, size);
    }
    (kept, dropped.to_vec())
}

/// The parts of `dropped` keys whose bytes no key in `live` refers to any more: only those may be
/// freed. A client that extends a piece records a longer key over the same extent bytes, which
/// drops the shorter key; freeing it would destroy live data. A normal extent (id from
/// `FIRST_NORMAL_EXTENT`) no live key uses at all is freed whole, as one key with offset 0 and size `u32::MAX` (the data node deletes
/// it); the unused ranges of others are punched out. O((dropped + live) · log).
pub(super) fn unreferenced(dropped: Vec<ExtentKey>, live: &[ExtentKey]) -> Vec<ExtentKey> {
    if dropped.is_empty() {
        return dropped;
    }
    // In extent bytes: a framed key holds its whole frame, and several keys may share one.
    let shared = dropped.iter().any(|k| k.framed.is_some());
    let mut dropped: Vec<ExtentKey> = dropped.iter().map(as_stored).collect();
    if shared {
        dropped.sort_unstable_by_key(|k| (k.partition, k.extent, k.extent_offset, k.size));
        dropped.dedup_by_key(|k| (k.partition, k.extent, k.extent_offset, k.size));
    }
    let mut extents: Vec<_> = dropped.iter().map(|k| (k.partition, k.extent)).collect();
    extents.sort_unstable();
    extents.dedup();
    // The extent ranges live keys use in those extents, by extent and start...
    let mut used: Vec<_> = live
        .iter()
        .filter(|k| extents.binary_search(&(k.partition, k.extent)).is_ok())
        .map(|k| {
            let (start, end) = k.stored_range();
            ((k.partition, k.extent), start, end)
        })
        .collect();
    used.sort_unstable();
    // ...and the furthest end reached so far within each extent (non-decreasing per extent).
    let mut reach = Vec::with_capacity(used.len());
    let mut last = None;
    for &(extent, _, end) in &used {
        let r = match last {
            Some((e, r)) if e == extent => end.max(r),
            _ => end,
        };
        reach.push(r);
        last = Some((extent, r));
    }
    let mut out = Vec::with_capacity(dropped.len());
    let mut whole: Vec<(PartitionId, ExtentId)> = Vec::new();
    for d in &dropped {
        let (mut pos, end) = (d.extent_offset, d.extent_offset + u64::from(d.size));
        let extent = (d.partition, d.extent);
        let group = used.partition_point(|u| u.0 < extent);
        let group_end = used.partition_point(|u| u.0 <= extent);
        if group == group_end && d.extent.is_normal() {
            // No live key uses this normal extent any more: release all of it (the data node
            // deletes it), once.
            if !whole.contains(&extent) {
                whole.push(extent);
                out.push(ExtentKey {
                    file_offset: 0,
                    extent_offset: 0,
                    size: u32::MAX,
                    crc: 0,
                    ..*d
                });
            }
            continue;
        }
        // The ranges before `first` all end at or before `pos`.
        let first = group + reach[group..group_end].partition_point(|&r| r <= pos);
        for &(_, from, to) in &used[first..group_end] {
            if from >= end {
                break;
            }
            if from > pos {
                out.push(cut_extent(d, pos, from));
            }
            pos = pos.max(to);
        }
        if pos < end {
            out.push(cut_extent(d, pos, end));
        }
    }
    out
}

/// `key` cut to the extent range `[from, to)` within it.
fn cut_extent(key: &ExtentKey, from: u64, to: u64) -> ExtentKey {
    let offset = key.file_offset + (from - key.extent_offset);
    cut(key, offset, offset + (to - from))
}

/// Cuts the file range `[from, to)` out of `keys` (sorted, non-overlapping): the keys with the
/// parts outside it, and the pieces inside it (both sorted). A key across an end of the range
/// leaves its outer part; one across the whole range leaves two.
pub(super) fn punch(keys: &[ExtentKey], from: u64, to: u64) -> (Vec<ExtentKey>, Vec<ExtentKey>) {
    // Ends are sorted too (see `overlay`): keys[first..last] overlap the range.
    let first = keys.partition_point(|k| k.end() <= from);
    let last = keys.partition_point(|k| k.file_offset < to).max(first);
    let mut kept = Vec::with_capacity(keys.len() + 1);
    kept.extend_from_slice(&keys[..first]);
    let mut punched = Vec::with_capacity(last - first);
    let mut right = None;
    for k in &keys[first..last] {
        if k.file_offset < from {
            kept.push(cut(k, k.file_offset, from));
        }
        punched.push(cut(k, k.file_offset.max(from), k.end().min(to)));
        if k.end() > to {
            right = Some(cut(k, to, k.end()));
        }
    }
    kept.extend(right);
    kept.extend_from_slice(&keys[last..]);
    (kept, punched)
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn key(file_offset: u64, extent: u64, extent_offset: u64, size: u32) -> ExtentKey {
        ExtentKey {
            file_offset,
            partition: PartitionId(1),
            extent: ExtentId(extent),
            extent_offset,
            size,
            crc: 7,
            framed: None,
        }
    }

    #[test]
    fn punch_keeps_the_parts_outside_the_range() {
        let keys = [key(0, 1, 0, 10), key(10, 2, 100, 10), key(30, 3, 0, 10)];
        // Inside one key: it splits in two, the middle is punched.
        let (kept, punched) = punch(&keys[..1], 2, 5);
        assert_eq!(
            kept,
            [
                ExtentKey {
                    crc: 0,
                    ..key(0, 1, 0, 2)
                },
                ExtentKey {
                    crc: 0,
                    ..key(5, 1, 5, 5)
                }
            ]
        );
        assert_eq!(
            punched,
            [ExtentKey {
                crc: 0,
                ..key(2, 1, 2, 3)
            }]
        );
        // Across keys and a hole: the ends are trimmed, a key wholly inside goes whole (CRC kept).
        let (kept, punched) = punch(&keys, 5, 35);
        assert_eq!(
            kept,
            [
                ExtentKey {
                    crc: 0,
                    ..key(0, 1, 0, 5)
                },
                ExtentKey {
                    crc: 0,
                    ..key(35, 3, 5, 5)
                }
            ]
        );
        assert_eq!(
            punched,
            [
                ExtentKey {
                    crc: 0,
                    ..key(5, 1, 5, 5)
                },
                key(10, 2, 100, 10),
                ExtentKey {
                    crc: 0,
                    ..key(30, 3, 0, 5)
                }
            ]
        );
        // A hole, or past the end: nothing changes.
        assert_eq!(punch(&keys, 20, 30), (keys.to_vec(), Vec::new()));
        assert_eq!(punch(&keys, 40, u64::MAX), (keys.to_vec(), Vec::new()));
        assert_eq!(punch(&[], 0, 1), (Vec::new(), Vec::new()));
    }

    /// Disjoint sorted keys from (gap, size) pairs, each in an extent of its own.
    /// A compressed block of 64 KiB stored as a 5,000-byte frame at extent offset 4,096 of a
    /// tiny extent, as one key over the whole block.
    fn framed_block() -> ExtentKey {
        ExtentKey {
            framed: Some(nacre_api::meta::Framed {
                stored: std::num::NonZeroU32::new(5000).unwrap(),
                skip: 0,
            }),
            crc: 9,
            ..key(0, 1, 4096, 65536)
        }
    }

    #[test]
    fn keys_cut_from_one_frame_free_it_once_and_only_when_none_is_left() {
        let block = framed_block();
        // A hole punched in the middle leaves two keys on the one frame.
        let (kept, punched) = punch(&[block], 1000, 2000);
        assert_eq!(kept.len(), 2);
        for k in &kept {
            assert_eq!(k.stored_range(), (4096, 9096));
            assert_eq!(k.crc, 9, "a framed key keeps its frame's CRC");
        }
        let right = kept[1].framed.unwrap();
        assert_eq!(
            (kept[1].file_offset, right.skip, kept[1].size),
            (2000, 2000, 63536)
        );
        // The punched piece frees nothing: the frame is still in use.
        assert!(unreferenced(punched, &kept).is_empty());
        // One of the two dropped: still nothing.
        assert!(unreferenced(vec![kept[0]], &kept[1..]).is_empty());
        // Both dropped: the frame, once, as a plain range of the extent.
        let freed = unreferenced(kept.clone(), &[]);
        assert_eq!(freed.len(), 1);
        assert_eq!(freed[0].framed, None);
        assert_eq!((freed[0].extent_offset, freed[0].size), (4096, 5000));
    }

    #[test]
    fn a_framed_key_is_valid_only_with_its_piece_and_frame_in_range() {
        assert!(key_is_valid(&framed_block()));
        let mut k = framed_block();
        let ten = std::num::NonZeroU32::new(10).unwrap();
        k.framed = Some(nacre_api::meta::Framed {
            stored: ten,
            skip: u32::MAX,
        });
        assert!(!key_is_valid(&k));
        k.framed = Some(nacre_api::meta::Framed {
            stored: ten,
            skip: 0,
        });
        k.extent_offset = u64::MAX - 5;
        assert!(!key_is_valid(&k));
    }

    fn keys_from(spec: &[(u8, u8)]) -> Vec<ExtentKey> {
        let mut at = 0;
        let mut out = Vec::new();
        for (i, &(gap, size)) in spec.iter().enumerate() {
            at += u64::from(gap);
            out.push(key(at, i as u64, u64::from(gap) * 3, u32::from(size) + 1));
            at += u64::from(size) + 1;
        }
        out
    }

    /// File byte → (extent, extent offset).
    fn bytes(keys: &[ExtentKey]) -> std::collections::BTreeMap<u64, (u64, u64)> {
        keys.iter()
            .flat_map(|k| {
                (0..u64::from(k.size))
                    .map(move |b| (k.file_offset + b, (k.extent.0, k.extent_offset + b)))
            })
            .collect()
    }

    proptest! {
        /// Against a byte map: the kept keys map every byte outside the range as before and
        /// nothing inside it; the punched pieces map exactly the bytes inside it; both stay
        /// valid, sorted and disjoint.
        #[test]
        fn punch_matches_a_byte_map(
            spec in proptest::collection::vec((0..8u8, 0..8u8), 0..8),
            from in 0..80u64,
            len in 1..40u64,
        ) {
            let keys = keys_from(&spec);
            let to = from + len;
            let (kept, punched) = punch(&keys, from, to);
            prop_assert!(check_extents(&kept, u64::MAX).is_ok(), "{kept:?}");
            prop_assert!(check_extents(&punched, u64::MAX).is_ok(), "{punched:?}");
            let before = bytes(&keys);
            let inside = |b: &u64| (from..to).contains(b);
            let want_kept: std::collections::BTreeMap<_, _> =
                before.iter().filter(|(b, _)| !inside(b)).map(|(b, p)| (*b, *p)).collect();
            let want_punched: std::collections::BTreeMap<_, _> =
                before.iter().filter(|(b, _)| inside(b)).map(|(b, p)| (*b, *p)).collect();
            prop_assert_eq!(bytes(&kept), want_kept);
            prop_assert_eq!(bytes(&punched), want_punched);
        }

        /// A sorted batch wholly in holes (a client's pieces) is merged in place, as overlaying
        /// the keys one by one would, and drops nothing.
        #[test]
        fn overlay_all_into_holes_is_overlay_one_by_one(
            spec in proptest::collection::vec((0..4u8, 0..6u8, proptest::bool::ANY), 0..60),
        ) {
            let all = keys_from(&spec.iter().map(|(g, z, _)| (*g, *z)).collect::<Vec<_>>());
            let (mut keys, mut batch) = (Vec::new(), Vec::new());
            for (k, (_, _, is_new)) in all.into_iter().zip(&spec) {
                if *is_new { batch.push(k) } else { keys.push(k) }
            }
            let (mut one, mut one_dropped) = (keys.clone(), Vec::new());
            for k in &batch {
                nacre_api::meta::extents::overlay(&mut one, *k, &mut one_dropped);
            }
            let (mut merged, mut dropped) = (keys, Vec::new());
            nacre_api::meta::extents::overlay_all(&mut merged, &batch, &mut dropped);
            prop_assert_eq!(merged, one);
            prop_assert!(dropped.is_empty() && one_dropped.is_empty());
        }

        /// `overlay_all` of a sorted batch gives the keys and the dropped keys of overlaying
        /// them one by one.
        #[test]
        fn overlay_all_is_overlay_one_by_one(
            old in proptest::collection::vec((0..8u8, 0..8u8), 0..40),
            new in proptest::collection::vec((0..6u8, 0..6u8), 0..16),
        ) {
            let keys = keys_from(&old);
            let batch: Vec<ExtentKey> = keys_from(&new)
                .into_iter()
                .map(|k| ExtentKey { extent: nacre_types::ExtentId(100 + k.extent.0), ..k })
                .collect();
            let (mut one, mut one_dropped) = (keys.clone(), Vec::new());
            for k in &batch {
                nacre_api::meta::extents::overlay(&mut one, *k, &mut one_dropped);
            }
            let (mut all, mut all_dropped) = (keys, Vec::new());
            nacre_api::meta::extents::overlay_all(&mut all, &batch, &mut all_dropped);
            prop_assert_eq!(all, one);
            one_dropped.sort_by_key(|k| (k.file_offset, k.extent));
            all_dropped.sort_by_key(|k| (k.file_offset, k.extent));
            prop_assert_eq!(all_dropped, one_dropped);
        }
    }
}
