//! Inodes and the inode table. An [`Inode`] is 72 bytes (its number, symlink target and device
//! number live elsewhere); the table keeps inodes in chunks of 64 consecutive numbers, a bitmap of
//! the present ones and a vector of them in order. Invariants (`InodeTable::verify`): no chunk is
//! empty, each chunk's bitmap counts its inodes, and `len` is their total. Serialized as
//! `(ino, inode)` pairs in number order, independent of the chunking.

use std::collections::BTreeMap;
use std::fmt;
use std::mem::size_of;

use nacre_types::Ino;
use serde::de::{SeqAccess, Visitor};
use serde::ser::SerializeSeq;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use nacre_api::meta::{Attr, ExtentKey, FileType, MetaError};

use super::{MODE_MASK, btree_bytes};

/// An inode without its number (the table's key), its symlink target and its device number (side
/// maps): 72 bytes.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(super) struct Inode {
    pub(super) size: u64,
    /// File times, encoded as `Attr`'s (`nacre_api::meta::time`).
    #[serde(with = "nacre_api::meta::time::nanos")]
    pub(super) atime: i64,
    #[serde(with = "nacre_api::meta::time::nanos")]
    pub(super) mtime: i64,
    #[serde(with = "nacre_api::meta::time::nanos")]
    pub(super) ctime: i64,
    /// The directory the inode was created in, or moved to (`..` for a directory).
    pub(super) parent: u64,
    /// Sorted by file offset, non-overlapping; empty but for files.
    pub(super) extents: Box<[ExtentKey]>,
    pub(super) uid: u32,
    pub(super) gid: u32,
    /// 0 once deleted.
    pub(super) nlink: u32,
    /// Permission bits only (`MODE_MASK`).
    pub(super) mode: u16,
    pub(super) kind: FileType,
}

impl Inode {
    /// The attributes of this inode as number `ino` with device number `rdev`. Numbers are never
    /// reused, so the generation is always 0.
    pub(super) fn attr(&self, ino: u64, rdev: u32) -> Attr {
        Attr {
            ino: Ino(ino),
            kind: self.kind,
            mode: u32::from(self.mode),
            uid: self.uid,
            gid: self.gid,
            size: self.size,
            nlink: self.nlink,
            rdev,
            atime: self.atime,
            mtime: self.mtime,
            ctime: self.ctime,
            generation: 0,
        }
    }

    pub(super) fn new(
        kind: FileType,
        mode: u32,
        uid: u32,
        gid: u32,
        parent: u64,
        now: i64,
    ) -> Self {
        Self {
            size: 0,
            atime: now,
            mtime: now,
            ctime: now,
            parent,
            extents: Box::default(),
            uid,
            gid,
            nlink: if kind == FileType::Dir { 2 } else { 1 },
            mode: (mode & MODE_MASK) as u16,
            kind,
        }
    }
}

// The per-file memory budget rests on this size.
const _: () = assert!(size_of::<Inode>() <= 72);

/// Bits of an inode number that pick its slot in a chunk.
const CHUNK_BITS: u32 = 6;

/// Inodes by number, in chunks of 64 consecutive numbers. Numbers are handed out in order, so a
/// chunk fills by pushes; deletions leave it sparse (a chunk holds only its present inodes, so a
/// sparse chunk costs little) and an empty chunk goes away.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(super) struct InodeTable {
    /// `ino >> CHUNK_BITS` → chunk.
    chunks: BTreeMap<u64, Chunk>,
    len: usize,
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct Chunk {
    /// Bit `b` set: inode `(chunk << CHUNK_BITS) | b` is present.
    present: u64,
    /// The present inodes, in number order.
    inodes: Vec<Inode>,
}

impl Chunk {
    /// Where slot `bit`'s inode is (or would go) in `inodes`.
    fn index(&self, bit: u32) -> usize {
        (self.present & ((1u64 << bit) - 1)).count_ones() as usize
    }

    fn has(&self, bit: u32) -> bool {
        self.present & (1u64 << bit) != 0
    }
}

fn chunk_of(ino: u64) -> (u64, u32) {
    (ino >> CHUNK_BITS, (ino & ((1 << CHUNK_BITS) - 1)) as u32)
}

impl InodeTable {
    pub(super) fn len(&self) -> usize {
        self.len
    }

    pub(super) fn get(&self, ino: u64) -> Option<&Inode> {
        let (c, bit) = chunk_of(ino);
        let chunk = self.chunks.get(&c)?;
        if chunk.has(bit) {
            chunk.inodes.get(chunk.index(bit))
        } else {
            None
        }
    }

    pub(super) fn get_mut(&mut self, ino: u64) -> Option<&mut Inode> {
        let (c, bit) = chunk_of(ino);
        let chunk = self.chunks.get_mut(&c)?;
        if chunk.has(bit) {
            let i = chunk.index(bit);
            chunk.inodes.get_mut(i)
        } else {
            None
        }
    }

    /// Adds inode `ino`, which is not present (numbers are handed out once).
    pub(super) fn insert(&mut self, ino: u64, node: Inode) {
        let (c, bit) = chunk_of(ino);
        let chunk = self.chunks.entry(c).or_default();
        if !chunk.has(bit) {
            let i = chunk.index(bit);
            chunk.inodes.insert(i, node);
            chunk.present |= 1 << bit;
            self.len += 1;
        }
    }

    pub(super) fn remove(&mut self, ino: u64) -> Option<Inode> {
        let (c, bit) = chunk_of(ino);
        let chunk = self.chunks.get_mut(&c)?;
        let i = chunk.index(bit);
        if !chunk.has(bit) || i >= chunk.inodes.len() {
            return None;
        }
        let node = chunk.inodes.remove(i);
        chunk.present &= !(1 << bit);
        self.len -= 1;
        if chunk.present == 0 {
            self.chunks.remove(&c);
        } else if chunk.inodes.len() * 2 <= chunk.inodes.capacity() {
            chunk.inodes.shrink_to_fit();
        }
        Some(node)
    }

    /// Inodes in number order.
    pub(super) fn iter(&self) -> impl Iterator<Item = (u64, &Inode)> + '_ {
        self.chunks.iter().flat_map(|(&c, chunk)| {
            Bits(chunk.present)
                .zip(&chunk.inodes)
                .map(move |(bit, node)| ((c << CHUNK_BITS) | u64::from(bit), node))
        })
    }

    /// Heap bytes: the chunk map and the chunks' vectors (not the extent keys).
    pub(super) fn heap_bytes(&self) -> u64 {
        let slots: usize = self.chunks.values().map(|c| c.inodes.capacity()).sum();
        btree_bytes(self.chunks.len(), size_of::<u64>(), size_of::<Chunk>())
            + (slots * size_of::<Inode>()) as u64
    }

    pub(super) fn verify(&self) -> Result<(), MetaError> {
        let mut len = 0;
        for (c, chunk) in &self.chunks {
            if chunk.present == 0 || chunk.present.count_ones() as usize != chunk.inodes.len() {
                return Err(MetaError::Invalid(format!(
                    "broken invariant: inode chunk {c} holds {} inodes, bitmap {:#x}",
                    chunk.inodes.len(),
                    chunk.present
                )));
            }
            len += chunk.inodes.len();
        }
        if len != self.len {
            return Err(MetaError::Invalid(format!(
                "broken invariant: {len} inodes counted as {}",
                self.len
            )));
        }
        Ok(())
    }
}

/// The set bits of a word, lowest first.
struct Bits(u64);

impl Iterator for Bits {
    type Item = u32;

    fn next(&mut self) -> Option<u32> {
        if self.0 == 0 {
            return None;
        }
        let bit = self.0.trailing_zeros();
        self.0 &= self.0 - 1;
        Some(bit)
    }
}

/// Serialized as a sequence of `(ino, inode)` in number order, independent of the chunking.
impl Serialize for InodeTable {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut seq = s.serialize_seq(Some(self.len))?;
        for entry in self.iter() {
            seq.serialize_element(&entry)?;
        }
        seq.end()
    }
}

impl<'de> Deserialize<'de> for InodeTable {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct TableVisitor;

        impl<'de> Visitor<'de> for TableVisitor {
            type Value = InodeTable;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a sequence of (ino, inode) in increasing ino order")
            }

            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<InodeTable, A::Error> {
                let mut table = InodeTable::default();
                let mut last = None;
                while let Some((ino, node)) = seq.next_element::<(u64, Inode)>()? {
                    if last.is_some_and(|l| ino <= l) {
                        return Err(serde::de::Error::custom("inodes out of order"));
                    }
                    last = Some(ino);
                    table.insert(ino, node);
                }
                Ok(table)
            }
        }

        d.deserialize_seq(TableVisitor)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `Inode` as snapshots encoded it with unsigned times.
    #[derive(Serialize)]
    struct OldInode {
        size: u64,
        atime: u64,
        mtime: u64,
        ctime: u64,
        parent: u64,
        extents: Box<[ExtentKey]>,
        uid: u32,
        gid: u32,
        nlink: u32,
        mode: u16,
        kind: FileType,
    }

    fn inode(t: i64) -> Inode {
        Inode {
            size: 5,
            atime: t,
            mtime: t.wrapping_add(1),
            ctime: 1_765_000_000_000_000_000,
            ..Inode::new(FileType::File, 0o644, 1, 2, 1, 0)
        }
    }

    #[test]
    fn snapshots_with_unsigned_times_decode_unchanged() {
        for t in [0u64, 1_765_000_000_123_456_789] {
            let old = OldInode {
                size: 5,
                atime: t,
                mtime: t + 1,
                ctime: 1_765_000_000_000_000_000,
                parent: 1,
                extents: Box::default(),
                uid: 1,
                gid: 2,
                nlink: 1,
                mode: 0o644,
                kind: FileType::File,
            };
            let bytes = postcard::to_allocvec(&old).unwrap();
            let new = inode(t as i64);
            assert_eq!(postcard::from_bytes::<Inode>(&bytes).unwrap(), new);
            assert_eq!(postcard::to_allocvec(&new).unwrap(), bytes);
        }
    }

    #[test]
    fn times_before_1970_survive_a_snapshot() {
        let mut table = InodeTable::default();
        table.insert(7, inode(-315_619_199_876_543_211));
        table.insert(8, inode(i64::MIN));
        let bytes = postcard::to_allocvec(&table).unwrap();
        assert_eq!(postcard::from_bytes::<InodeTable>(&bytes).unwrap(), table);
    }
}
