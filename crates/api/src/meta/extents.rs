//! The algebra of a file's extent keys that both sides use: the meta partition records new
//! keys with it, and a client keeps its cached copy of a file's keys in step the same way
//! instead of fetching them all again after each change.

use super::ExtentKey;

/// `key` cut to the file range `[from, to)` within it; the CRC survives only an uncut key.
pub fn cut(key: &ExtentKey, from: u64, to: u64) -> ExtentKey {
    let whole = from == key.file_offset && to == key.end();
    ExtentKey {
        file_offset: from,
        extent_offset: key.extent_offset + (from - key.file_offset),
        // Within the key's own size.
        size: (to - from) as u32,
        crc: if whole { key.crc } else { 0 },
        ..*key
    }
}

/// Records `new` over `keys` (sorted, non-overlapping): parts of older keys outside its range stay
/// (trimmed), older keys entirely inside it go to `dropped`.
pub fn overlay(keys: &mut Vec<ExtentKey>, new: ExtentKey, dropped: &mut Vec<ExtentKey>) {
    let (start, end) = (new.file_offset, new.end());
    // Keys are sorted and disjoint, so their ends are sorted too: keys[first..last] overlap `new`.
    let first = keys.partition_point(|k| k.end() <= start);
    let last = keys.partition_point(|k| k.file_offset < end).max(first);
    let (mut left, mut right) = (None, None);
    for k in &keys[first..last] {
        if k.file_offset < start {
            left = Some(cut(k, k.file_offset, start));
        }
        if k.end() > end {
            right = Some(cut(k, end, k.end()));
        }
        if k.file_offset >= start && k.end() <= end {
            dropped.push(*k);
        }
    }
    keys.splice(first..last, left.into_iter().chain([new]).chain(right));
}
