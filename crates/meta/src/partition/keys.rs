//! How dentries and xattrs are stored: keys are the owner inode's number (big-endian, so that
//! keys sort by owner, then by name bytes) followed by the name, and a dentry's value is packed
//! into 9 bytes ([`DentryVal`]). Names are checked before a key is built, so a key never holds an
//! invalid name.

use std::collections::BTreeMap;
use std::mem::size_of;
use std::ops::Bound;

use nacre_types::Ino;
use serde::{Deserialize, Serialize};

use nacre_api::meta::{Dentry, FileType, MAX_NAME, MAX_XATTR_NAME, MetaError, check_name};

/// Longest dentry or xattr key: an 8-byte owner, then a name.
const KEY_MAX: usize = 8 + if MAX_NAME > MAX_XATTR_NAME {
    MAX_NAME
} else {
    MAX_XATTR_NAME
};

/// A dentry or xattr key built on the stack, for lookups without allocating: the owner inode's
/// number (big-endian, so that keys sort by owner, then by name bytes), then the name.
pub(super) struct Key {
    pub(super) len: usize,
    buf: [u8; KEY_MAX],
}

impl Key {
    /// The key of dentry `name` under `parent` (`NameTooLong`/`InvalidName` as `check_name`).
    pub(super) fn dentry(parent: u64, name: &[u8]) -> Result<Self, MetaError> {
        check_name(name)?;
        Ok(Self::raw(parent, name))
    }

    /// The key of xattr `name` of inode `ino`.
    pub(super) fn xattr(ino: u64, name: &[u8]) -> Result<Self, MetaError> {
        check_xattr_name(name)?;
        Ok(Self::raw(ino, name))
    }

    /// Names are checked by the constructors above; a longer one would be cut, never overflow.
    pub(super) fn raw(owner: u64, name: &[u8]) -> Self {
        let name = &name[..name.len().min(KEY_MAX - 8)];
        let mut buf = [0; KEY_MAX];
        buf[..8].copy_from_slice(&owner.to_be_bytes());
        buf[8..8 + name.len()].copy_from_slice(name);
        Self {
            len: 8 + name.len(),
            buf,
        }
    }

    pub(super) fn as_slice(&self) -> &[u8] {
        &self.buf[..self.len]
    }

    pub(super) fn to_box(&self) -> Box<[u8]> {
        self.as_slice().into()
    }
}

/// The owner and the name of a stored key (keys shorter than 8 bytes never get stored; they would
/// read as owner 0).
pub(super) fn split_key(key: &[u8]) -> (u64, &[u8]) {
    match key.split_first_chunk::<8>() {
        Some((owner, name)) => (u64::from_be_bytes(*owner), name),
        None => (0, key),
    }
}

/// Names and values of the entries of `map` owned by `owner`, in name order, strictly after
/// `after` (from the first when `None`).
pub(super) fn owned_by<'a, V>(
    map: &'a BTreeMap<Box<[u8]>, V>,
    owner: u64,
    after: Option<&[u8]>,
) -> impl Iterator<Item = (&'a [u8], &'a V)> + 'a {
    let mut start = owner.to_be_bytes().to_vec();
    let lower = match after {
        Some(name) => {
            start.extend_from_slice(name);
            Bound::Excluded(start)
        }
        None => Bound::Included(start),
    };
    map.range::<[u8], _>((lower.as_ref().map(Vec::as_slice), Bound::Unbounded))
        .map(|(k, v)| (split_key(k), v))
        .take_while(move |((o, _), _)| *o == owner)
        .map(|((_, name), v)| (name, v))
}

/// Xattr names: 1..=`MAX_XATTR_NAME` bytes without NUL.
pub(super) fn check_xattr_name(name: &[u8]) -> Result<(), MetaError> {
    if name.len() > MAX_XATTR_NAME {
        return Err(MetaError::NameTooLong);
    }
    if name.is_empty() || name.contains(&0) {
        return Err(MetaError::InvalidName);
    }
    Ok(())
}

/// What a dentry points to, packed into 9 bytes (B-tree nodes hold 11 of these side by side).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(from = "Dentry", into = "Dentry")]
#[repr(C, packed)]
pub(super) struct DentryVal {
    pub(super) ino: u64,
    pub(super) kind: FileType,
}

impl DentryVal {
    pub(super) fn ino(self) -> Ino {
        Ino(self.ino)
    }

    pub(super) fn kind(self) -> FileType {
        self.kind
    }
}

impl From<Dentry> for DentryVal {
    fn from(d: Dentry) -> Self {
        Self {
            ino: d.ino.0,
            kind: d.kind,
        }
    }
}

impl From<DentryVal> for Dentry {
    fn from(d: DentryVal) -> Self {
        Self {
            ino: d.ino(),
            kind: d.kind(),
        }
    }
}

// The per-file memory budget rests on this size.
const _: () = assert!(size_of::<DentryVal>() == 9);
