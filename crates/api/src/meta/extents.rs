//! The algebra of a file's extent keys that both sides use: the meta partition records new
//! keys with it, and a client keeps its cached copy of a file's keys in step the same way
//! instead of fetching them all again after each change.

use super::{ExtentKey, Framed};

/// `key` cut to the file range `[from, to)` within it. A raw key's CRC survives only uncut; a
/// framed key keeps its frame (and the frame's CRC) and moves its offset into the block.
pub fn cut(key: &ExtentKey, from: u64, to: u64) -> ExtentKey {
    let whole = from == key.file_offset && to == key.end();
    // Within the key's own size.
    let (head, size) = ((from - key.file_offset) as u32, (to - from) as u32);
    match key.framed {
        Some(f) => ExtentKey {
            file_offset: from,
            size,
            framed: Some(Framed {
                skip: f.skip + head,
                ..f
            }),
            ..*key
        },
        None => ExtentKey {
            file_offset: from,
            extent_offset: key.extent_offset + u64::from(head),
            size,
            crc: if whole { key.crc } else { 0 },
            ..*key
        },
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

/// Whether no key of `keys` (sorted, disjoint) overlaps `n`.
fn in_hole(keys: &[ExtentKey], n: &ExtentKey) -> bool {
    let first = keys.partition_point(|k| k.end() <= n.file_offset);
    keys.get(first).is_none_or(|k| k.file_offset >= n.end())
}

/// Merges `new` (sorted, disjoint, each in a hole of `keys`) into `keys` in place, from the back:
/// one exact growth of the vector and each old key moved at most once, in runs.
fn insert_into_holes(keys: &mut Vec<ExtentKey>, new: &[ExtentKey]) {
    let old = keys.len();
    keys.reserve_exact(new.len());
    keys.extend_from_slice(new);
    let (mut i, mut w) = (old, keys.len());
    for n in new.iter().rev() {
        let p = keys[..i].partition_point(|k| k.file_offset < n.file_offset);
        keys.copy_within(p..i, w - (i - p));
        w -= i - p;
        i = p;
        w -= 1;
        keys[w] = *n;
    }
}

/// [`overlay`] of every key of `new` in turn, in one pass over `keys` when `new` is sorted and
/// disjoint (a client's batch of written pieces): the runs of old keys no new key touches are
/// copied whole, so a batch of k keys into a file of n costs O(k log n) searches and one copy of
/// the keys, not a splice per key nor a step per old key. The result, and what goes to `dropped`,
/// are exactly those of the keys overlaid one by one.
pub fn overlay_all(keys: &mut Vec<ExtentKey>, new: &[ExtentKey], dropped: &mut Vec<ExtentKey>) {
    let sorted = new.windows(2).all(|w| w[0].end() <= w[1].file_offset);
    if new.len() < 8 || !sorted {
        for k in new {
            overlay(keys, *k, dropped);
        }
        return;
    }
    if new.iter().all(|n| in_hole(keys, n)) {
        insert_into_holes(keys, new);
        return;
    }
    // What is left of the old keys: each old key meets the new keys over it in order, as the
    // one-by-one overlay would (a remainder wholly inside one new key is dropped).
    let mut rest = Vec::with_capacity(keys.len() + 2);
    let (mut i, mut p) = (0, 0);
    while i < keys.len() {
        // The first new key that ends past the start of old key i.
        p += new[p..].partition_point(|n| n.end() <= keys[i].file_offset);
        let Some(next) = new.get(p) else {
            rest.extend_from_slice(&keys[i..]);
            break;
        };
        // Old keys that end before it starts: untouched.
        let j = i + keys[i..].partition_point(|k| k.end() <= next.file_offset);
        if j > i {
            rest.extend_from_slice(&keys[i..j]);
            i = j;
            continue;
        }
        let mut cur = Some(keys[i]);
        for n in &new[p..] {
            let Some(c) = cur else { break };
            if n.file_offset >= c.end() {
                break;
            }
            let (start, end) = (n.file_offset, n.end());
            if c.file_offset >= start && c.end() <= end {
                dropped.push(c);
                cur = None;
                break;
            }
            if c.file_offset < start {
                rest.push(cut(&c, c.file_offset, start));
            }
            cur = (c.end() > end).then(|| cut(&c, end, c.end()));
        }
        if let Some(c) = cur {
            rest.push(c);
        }
        i += 1;
    }
    // Both sorted and all disjoint: merged by offset, the runs between new keys copied whole.
    let mut out = Vec::with_capacity(rest.len() + new.len());
    let mut i = 0;
    for n in new {
        let j = i + rest[i..].partition_point(|r| r.file_offset < n.file_offset);
        out.extend_from_slice(&rest[i..j]);
        out.push(*n);
        i = j;
    }
    out.extend_from_slice(&rest[i..]);
    *keys = out;
}
