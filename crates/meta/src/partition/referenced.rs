//! `Query::Referenced`: which of a set of normal extents this partition still references, for the
//! data partitions' garbage collector (docs/ARCHITECTURE.md, "Garbage collection").
//!
//! An extent counts as referenced when any extent key of any inode names it — live inodes and
//! deleted ones not yet evicted (orphans keep their keys until `EvictInode`), since a reader may
//! still hold them open — or when the to-free list names it (the partition will still release
//! it; freeing it twice is harmless, but the answer must not depend on that). Read-only: one
//! walk over the inodes' keys, O(keys · log asked).

use nacre_types::{ExtentId, PartitionId};

use nacre_api::meta::ExtentKey;

use super::MetaPartition;

impl MetaPartition {
    /// The extents of `asked` (any order) that some key of this partition names, sorted and
    /// without duplicates.
    pub(super) fn referenced(
        &self,
        asked: &[(PartitionId, ExtentId)],
    ) -> Vec<(PartitionId, ExtentId)> {
        let keys = self
            .inodes
            .iter()
            .flat_map(|(_, node)| node.extents.iter())
            .chain(self.to_free.iter());
        referenced_by(asked, keys)
    }
}

/// The extents of `asked` that one of `keys` names, sorted and without duplicates.
pub(super) fn referenced_by<'a>(
    asked: &[(PartitionId, ExtentId)],
    keys: impl Iterator<Item = &'a ExtentKey>,
) -> Vec<(PartitionId, ExtentId)> {
    let mut asked = asked.to_vec();
    asked.sort_unstable();
    asked.dedup();
    let mut found = vec![false; asked.len()];
    for k in keys {
        if let Ok(i) = asked.binary_search(&(k.partition, k.extent)) {
            found[i] = true;
        }
    }
    asked
        .into_iter()
        .zip(found)
        .filter_map(|(e, f)| f.then_some(e))
        .collect()
}

#[cfg(test)]
mod tests {
    use nacre_api::meta::{Command, FileType, Query, ROOT_INO, Reply};
    use nacre_types::Ino;

    use super::*;

    fn key(file_offset: u64, p: u64, e: u64) -> ExtentKey {
        ExtentKey {
            file_offset,
            partition: PartitionId(p),
            extent: ExtentId(e),
            extent_offset: 0,
            size: 100,
            crc: 0,
            framed: None,
        }
    }

    fn referenced(mp: &MetaPartition, asked: &[(u64, u64)]) -> Vec<(u64, u64)> {
        let extents = asked
            .iter()
            .map(|&(p, e)| (PartitionId(p), ExtentId(e)))
            .collect();
        match mp.query(&Query::Referenced { extents }) {
            Ok(Reply::Referenced(r)) => r.into_iter().map(|(p, e)| (p.0, e.0)).collect(),
            other => panic!("unexpected answer {other:?}"),
        }
    }

    fn file(mp: &mut MetaPartition, name: &[u8]) -> Ino {
        let cmd = Command::Create {
            parent: ROOT_INO,
            name: name.to_vec(),
            kind: FileType::File,
            mode: 0o644,
            uid: 0,
            gid: 0,
            rdev: 0,
            target: Vec::new(),
        };
        match mp.apply(1, &cmd) {
            Ok(Reply::Created { attr, .. }) => attr.ino,
            other => panic!("create failed: {other:?}"),
        }
    }

    /// Keys of live files, of unlinked files not yet evicted, and of the to-free list all count;
    /// an extent of the same id in another partition does not.
    #[test]
    fn live_orphaned_and_to_free_keys_are_referenced() {
        let mut mp = MetaPartition::new(1, 1 << 20);
        let a = file(&mut mp, b"a");
        let b = file(&mut mp, b"b");
        let c = file(&mut mp, b"c");
        for (ino, e) in [(a, 1024), (b, 1025), (c, 1026)] {
            let cmd = Command::AppendExtents {
                ino,
                extents: vec![key(0, 7, e)],
            };
            mp.apply(2, &cmd).unwrap();
        }
        // b: unlinked, an orphan with its keys until evicted.
        let cmd = Command::DeleteDentry {
            parent: ROOT_INO,
            name: b"b".to_vec(),
            expect: None,
        };
        mp.apply(3, &cmd).unwrap();
        mp.apply(3, &Command::UnlinkInode { ino: b }).unwrap();
        // c: removed, evicted at once, its key on the to-free list.
        let cmd = Command::Remove {
            parent: ROOT_INO,
            name: b"c".to_vec(),
            dir: false,
        };
        mp.apply(4, &cmd).unwrap();
        assert!(mp.live(c).is_err());
        assert_eq!((mp.stats().orphans, mp.stats().to_free), (1, 1));
        let asked = [(7, 1027), (7, 1026), (7, 1025), (7, 1024), (8, 1024)];
        assert_eq!(
            referenced(&mp, &asked),
            vec![(7, 1024), (7, 1025), (7, 1026)]
        );
        // Once the to-free list is acknowledged, c's extent is no longer referenced.
        mp.apply(
            5,
            &Command::AckFreed {
                count: 1,
                first: None,
            },
        )
        .unwrap();
        assert_eq!(referenced(&mp, &asked), vec![(7, 1024), (7, 1025)]);
    }

    #[test]
    fn the_answer_is_sorted_and_deduplicated() {
        let keys = [key(0, 1, 1030), key(100, 1, 1030), key(200, 1, 1031)];
        let asked = [
            (PartitionId(1), ExtentId(1031)),
            (PartitionId(1), ExtentId(1030)),
            (PartitionId(1), ExtentId(1031)),
        ];
        assert_eq!(
            referenced_by(&asked, keys.iter()),
            vec![
                (PartitionId(1), ExtentId(1030)),
                (PartitionId(1), ExtentId(1031))
            ]
        );
        assert!(referenced_by(&[], keys.iter()).is_empty());
    }
}
