//! Snapshots: the whole partition as bytes (a Raft snapshot) and back. The format is a postcard
//! `u32` version, then the partition; a new layout gets a new version and a decoder of its own,
//! and older versions keep restoring. A restored partition has passed [`MetaPartition::verify`];
//! the derived indexes and `heap` are rebuilt, not stored.

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use serde::Deserialize;

use nacre_api::meta::{ExtentKey, FileType, MetaError};
use nacre_types::{ExtentId, PartitionId};

use super::MetaPartition;
use super::calls::Calls;
use super::delegations::{Delegation, Session};
use super::inodes::{Inode, InodeTable};
use super::keys::DentryVal;

/// Version of the format written by [`MetaPartition::snapshot`]: a postcard `u32` version, then
/// the partition (a new layout gets a new version and a decoder of its own). Version 2 added the
/// delegations and the sessions at the end, version 3 the call sessions after them, version 4
/// the `framed` field of every extent key; version 1 to 3 snapshots still restore (with none,
/// and every key raw).
pub const SNAPSHOT_VERSION: u32 = 4;

impl MetaPartition {
    /// The whole partition as bytes (a Raft snapshot): see [`SNAPSHOT_VERSION`].
    pub fn snapshot(&self) -> Vec<u8> {
        // Every collection serializes with a known length, which is all postcard can fail on.
        postcard::to_allocvec(&(SNAPSHOT_VERSION, self)).expect("a partition always serializes")
    }

    /// Rebuilds a partition from [`snapshot`](Self::snapshot) bytes, of this version or of
    /// versions 1 (no delegations, no sessions), 2 (no call sessions) and 3 (extent keys without
    /// `framed`); `Invalid` for anything
    /// that does not decode to a partition satisfying every invariant ([`verify`](Self::verify)).
    pub fn restore(bytes: &[u8]) -> Result<Self, MetaError> {
        let (version, rest) = postcard::take_from_bytes::<u32>(bytes).map_err(bad_snapshot)?;
        // Decoded in two steps (not as `Self`) so that a broken invariant keeps its message.
        let image = match version {
            1 => Delegated::from(Trees::try_from(decode::<RawTrees>(rest)?)?).into(),
            2 => Delegated::try_from(decode::<RawDelegated>(rest)?)?.into(),
            3 => Image::try_from(decode::<RawImage>(rest)?)?,
            SNAPSHOT_VERSION => decode::<Image>(rest)?,
            _ => {
                return Err(MetaError::Invalid(format!(
                    "bad snapshot: unknown version {version}"
                )));
            }
        };
        Self::try_from(image)
    }
}

/// Version 1 of the snapshot layout, which version 2 continues: [`MetaPartition`]'s serialized
/// fields up to `to_free`, in the same order, decoded before the invariants are checked.
#[derive(Deserialize)]
struct Trees {
    start: u64,
    end: u64,
    next: u64,
    inodes: InodeTable,
    dentries: BTreeMap<Box<[u8]>, DentryVal>,
    targets: BTreeMap<u64, Box<[u8]>>,
    rdevs: BTreeMap<u64, u32>,
    xattrs: BTreeMap<Box<[u8]>, Box<[u8]>>,
    orphans: BTreeSet<u64>,
    to_free: VecDeque<ExtentKey>,
}

/// Version 2 of the snapshot layout, which version 3 continues: version 1's followed by the
/// delegations and the batch sessions. Postcard writes a nested struct as its fields.
#[derive(Deserialize)]
struct Delegated {
    trees: Trees,
    delegations: BTreeMap<u64, Delegation>,
    sessions: BTreeMap<u64, Session>,
}

/// A version 1 snapshot: no delegations, no sessions.
impl From<Trees> for Delegated {
    fn from(trees: Trees) -> Self {
        Self {
            trees,
            delegations: BTreeMap::new(),
            sessions: BTreeMap::new(),
        }
    }
}

/// A decoded snapshot (version 3) before its invariants are checked: all of [`MetaPartition`]'s
/// serialized fields, version 2's followed by the call sessions.
#[derive(Deserialize)]
pub(super) struct Image {
    delegated: Delegated,
    calls: BTreeMap<u64, Calls>,
}

/// A version 2 snapshot: no call sessions.
impl From<Delegated> for Image {
    fn from(delegated: Delegated) -> Self {
        Self {
            delegated,
            calls: BTreeMap::new(),
        }
    }
}

impl TryFrom<Image> for MetaPartition {
    type Error = MetaError;

    fn try_from(image: Image) -> Result<Self, MetaError> {
        let Image {
            delegated:
                Delegated {
                    trees: i,
                    delegations,
                    sessions,
                },
            calls,
        } = image;
        let mut p = Self {
            start: i.start,
            end: i.end,
            next: i.next,
            inodes: i.inodes,
            dentries: i.dentries,
            targets: i.targets,
            rdevs: i.rdevs,
            xattrs: i.xattrs,
            orphans: i.orphans,
            to_free: i.to_free,
            delegation_ends: delegations.iter().map(|(&dir, d)| (d.until, dir)).collect(),
            session_times: sessions.iter().map(|(&c, s)| (s.at, c)).collect(),
            call_times: calls.iter().map(|(&c, s)| (s.at, c)).collect(),
            delegations,
            sessions,
            calls,
            heap: 0,
        };
        p.heap = p.count_heap();
        p.verify()?;
        Ok(p)
    }
}

/// An extent key as versions 1 to 3 encoded it: no `framed` field (every key raw).
#[derive(Deserialize)]
#[cfg_attr(test, derive(serde::Serialize))]
struct RawKey {
    file_offset: u64,
    partition: PartitionId,
    extent: ExtentId,
    extent_offset: u64,
    size: u32,
    crc: u32,
}

impl From<RawKey> for ExtentKey {
    fn from(k: RawKey) -> Self {
        Self {
            file_offset: k.file_offset,
            partition: k.partition,
            extent: k.extent,
            extent_offset: k.extent_offset,
            size: k.size,
            crc: k.crc,
            framed: None,
        }
    }
}

/// An inode as versions 1 to 3 encoded it: [`Inode`]'s fields, keys without `framed`.
#[derive(Deserialize)]
#[cfg_attr(test, derive(serde::Serialize))]
struct RawInode {
    size: u64,
    #[serde(with = "nacre_api::meta::time::nanos")]
    atime: i64,
    #[serde(with = "nacre_api::meta::time::nanos")]
    mtime: i64,
    #[serde(with = "nacre_api::meta::time::nanos")]
    ctime: i64,
    parent: u64,
    extents: Vec<RawKey>,
    uid: u32,
    gid: u32,
    nlink: u32,
    mode: u16,
    kind: FileType,
}

/// [`Trees`] as versions 1 to 3 encoded it (inodes as `(ino, inode)` in number order).
#[derive(Deserialize)]
struct RawTrees {
    start: u64,
    end: u64,
    next: u64,
    inodes: Vec<(u64, RawInode)>,
    dentries: BTreeMap<Box<[u8]>, DentryVal>,
    targets: BTreeMap<u64, Box<[u8]>>,
    rdevs: BTreeMap<u64, u32>,
    xattrs: BTreeMap<Box<[u8]>, Box<[u8]>>,
    orphans: BTreeSet<u64>,
    to_free: VecDeque<RawKey>,
}

impl TryFrom<RawTrees> for Trees {
    type Error = MetaError;

    fn try_from(t: RawTrees) -> Result<Self, MetaError> {
        let mut inodes = InodeTable::default();
        let mut last = None;
        for (ino, n) in t.inodes {
            if last.is_some_and(|l| ino <= l) {
                return Err(MetaError::Invalid(
                    "bad snapshot: inodes out of order".into(),
                ));
            }
            last = Some(ino);
            let node = Inode {
                size: n.size,
                atime: n.atime,
                mtime: n.mtime,
                ctime: n.ctime,
                parent: n.parent,
                extents: n.extents.into_iter().map(ExtentKey::from).collect(),
                uid: n.uid,
                gid: n.gid,
                nlink: n.nlink,
                mode: n.mode,
                kind: n.kind,
            };
            inodes.insert(ino, node);
        }
        Ok(Self {
            start: t.start,
            end: t.end,
            next: t.next,
            inodes,
            dentries: t.dentries,
            targets: t.targets,
            rdevs: t.rdevs,
            xattrs: t.xattrs,
            orphans: t.orphans,
            to_free: t.to_free.into_iter().map(ExtentKey::from).collect(),
        })
    }
}

/// [`Delegated`] as versions 2 and 3 encoded it.
#[derive(Deserialize)]
struct RawDelegated {
    trees: RawTrees,
    delegations: BTreeMap<u64, Delegation>,
    sessions: BTreeMap<u64, Session>,
}

impl TryFrom<RawDelegated> for Delegated {
    type Error = MetaError;

    fn try_from(d: RawDelegated) -> Result<Self, MetaError> {
        Ok(Self {
            trees: d.trees.try_into()?,
            delegations: d.delegations,
            sessions: d.sessions,
        })
    }
}

/// [`Image`] as version 3 encoded it.
#[derive(Deserialize)]
struct RawImage {
    delegated: RawDelegated,
    calls: BTreeMap<u64, Calls>,
}

impl TryFrom<RawImage> for Image {
    type Error = MetaError;

    fn try_from(i: RawImage) -> Result<Self, MetaError> {
        Ok(Self {
            delegated: i.delegated.try_into()?,
            calls: i.calls,
        })
    }
}

fn bad_snapshot(e: postcard::Error) -> MetaError {
    MetaError::Invalid(format!("bad snapshot: {e}"))
}

/// `T` from all of `bytes`.
fn decode<'a, T: Deserialize<'a>>(bytes: &'a [u8]) -> Result<T, MetaError> {
    let (t, rest) = postcard::take_from_bytes::<T>(bytes).map_err(bad_snapshot)?;
    if !rest.is_empty() {
        return Err(MetaError::Invalid(format!(
            "bad snapshot: {} trailing bytes",
            rest.len()
        )));
    }
    Ok(t)
}

#[cfg(test)]
mod tests {
    use nacre_api::meta::{Command, Framed, ROOT_INO, Reply};
    use nacre_types::Ino;

    use super::*;

    fn old_key(k: &ExtentKey) -> RawKey {
        RawKey {
            file_offset: k.file_offset,
            partition: k.partition,
            extent: k.extent,
            extent_offset: k.extent_offset,
            size: k.size,
            crc: k.crc,
        }
    }

    /// `p` as a version 3 snapshot (every key raw).
    fn version_3(p: &MetaPartition) -> Vec<u8> {
        let inodes: Vec<(u64, RawInode)> = p
            .inodes
            .iter()
            .map(|(ino, n)| {
                let old = RawInode {
                    size: n.size,
                    atime: n.atime,
                    mtime: n.mtime,
                    ctime: n.ctime,
                    parent: n.parent,
                    extents: n.extents.iter().map(old_key).collect(),
                    uid: n.uid,
                    gid: n.gid,
                    nlink: n.nlink,
                    mode: n.mode,
                    kind: n.kind,
                };
                (ino, old)
            })
            .collect();
        let to_free: Vec<RawKey> = p.to_free.iter().map(old_key).collect();
        postcard::to_allocvec(&(
            3u32,
            (p.start, p.end, p.next, inodes),
            (&p.dentries, &p.targets, &p.rdevs, &p.xattrs, &p.orphans),
            to_free,
            (&p.delegations, &p.sessions, &p.calls),
        ))
        .unwrap()
    }

    fn key(file_offset: u64, extent: u64, size: u32) -> ExtentKey {
        ExtentKey {
            file_offset,
            partition: PartitionId(2),
            extent: ExtentId(extent),
            extent_offset: 0,
            size,
            crc: 5,
            framed: None,
        }
    }

    #[test]
    fn version_3_snapshots_restore_with_every_key_raw() {
        let mut p = MetaPartition::new(1, 1000);
        let create = Command::Create {
            parent: ROOT_INO,
            name: b"f".to_vec(),
            kind: FileType::File,
            mode: 0o644,
            uid: 1,
            gid: 1,
            rdev: 0,
            target: Vec::new(),
        };
        let Ok(Reply::Created { attr, .. }) = p.apply(1, &create) else {
            panic!("create failed");
        };
        let ino: Ino = attr.ino;
        let keys = vec![key(0, 1, 100), key(100, 2, 50)];
        p.apply(2, &Command::AppendExtents { ino, extents: keys })
            .unwrap();
        // Overwritten: extent 1's key goes to the to-free list.
        p.apply(
            3,
            &Command::AppendExtents {
                ino,
                extents: vec![key(0, 3, 100)],
            },
        )
        .unwrap();
        assert_eq!(p.to_free.len(), 1);
        let old = version_3(&p);
        assert_eq!(MetaPartition::restore(&old).unwrap(), p);
        // A framed key is written only as version 4.
        let framed = ExtentKey {
            framed: Some(Framed {
                stored: std::num::NonZeroU32::new(40).unwrap(),
                skip: 10,
            }),
            ..key(150, 4, 20)
        };
        p.apply(
            4,
            &Command::AppendExtents {
                ino,
                extents: vec![framed],
            },
        )
        .unwrap();
        let now = p.snapshot();
        assert_eq!(now[0], 4);
        assert_eq!(MetaPartition::restore(&now).unwrap(), p);
        // Version 3 bytes are not read as version 4, nor the other way round.
        let mut v4_claimed = old.clone();
        v4_claimed[0] = 4;
        assert!(MetaPartition::restore(&v4_claimed).is_err());
    }
}
