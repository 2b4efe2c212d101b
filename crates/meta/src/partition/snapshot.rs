//! Snapshots: the whole partition as bytes (a Raft snapshot) and back. The format is a postcard
//! `u32` version, then the partition; a new layout gets a new version and a decoder of its own,
//! and older versions keep restoring. A restored partition has passed [`MetaPartition::verify`];
//! the derived indexes and `heap` are rebuilt, not stored.

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use serde::Deserialize;

use nacre_api::meta::{ExtentKey, MetaError};

use super::MetaPartition;
use super::calls::Calls;
use super::delegations::{Delegation, Session};
use super::inodes::InodeTable;
use super::keys::DentryVal;

/// Version of the format written by [`MetaPartition::snapshot`]: a postcard `u32` version, then
/// the partition (a new layout gets a new version and a decoder of its own). Version 2 added the
/// delegations and the sessions at the end, version 3 the call sessions after them; version 1
/// and 2 snapshots still restore (with none).
pub const SNAPSHOT_VERSION: u32 = 3;

impl MetaPartition {
    /// The whole partition as bytes (a Raft snapshot): see [`SNAPSHOT_VERSION`].
    pub fn snapshot(&self) -> Vec<u8> {
        // Every collection serializes with a known length, which is all postcard can fail on.
        postcard::to_allocvec(&(SNAPSHOT_VERSION, self)).expect("a partition always serializes")
    }

    /// Rebuilds a partition from [`snapshot`](Self::snapshot) bytes, of this version or of
    /// versions 1 (no delegations, no sessions) and 2 (no call sessions); `Invalid` for anything
    /// that does not decode to a partition satisfying every invariant ([`verify`](Self::verify)).
    pub fn restore(bytes: &[u8]) -> Result<Self, MetaError> {
        let (version, rest) = postcard::take_from_bytes::<u32>(bytes).map_err(bad_snapshot)?;
        // Decoded in two steps (not as `Self`) so that a broken invariant keeps its message.
        let image = match version {
            1 => Delegated::from(decode::<Trees>(rest)?).into(),
            2 => decode::<Delegated>(rest)?.into(),
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
