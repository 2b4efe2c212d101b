//! The invariant checker ([`MetaPartition::verify`]): every invariant listed in the module
//! documentation of `partition`, checked in O(size · log size). Restoring a snapshot runs it;
//! tests run it after each step.

use std::collections::{BTreeMap, BTreeSet};

use nacre_types::Ino;

use nacre_api::meta::{FileType, MAX_SYMLINK, MAX_XATTR_VALUE, MetaError, check_name};

use super::extents::check_extents;
use super::keys::{check_xattr_name, split_key};
use super::{MAX_LINKS, MODE_MASK, MetaPartition};

impl MetaPartition {
    /// Checks every invariant listed in the module documentation (O(size · log size)); `Invalid`
    /// names the first one broken. Restoring a snapshot runs it; tests run it after each step.
    pub fn verify(&self) -> Result<(), MetaError> {
        fn broken(what: String) -> Result<(), MetaError> {
            Err(MetaError::Invalid(format!("broken invariant: {what}")))
        }
        if self.start > self.end || self.next < self.start {
            return broken(format!(
                "range [{}, {}) with next inode {}",
                self.start, self.end, self.next
            ));
        }
        self.inodes.verify()?;
        let mut subdirs: BTreeMap<u64, u64> = BTreeMap::new();
        for (key, d) in &self.dentries {
            let (parent, name) = split_key(key);
            if let Err(e) = check_name(name) {
                return broken(format!("dentry {name:?} under {parent}: {e}"));
            }
            match self.inodes.get(parent) {
                Some(p) if p.kind == FileType::Dir && p.nlink > 0 => {}
                _ => return broken(format!("dentry {name:?} under a non-directory {parent}")),
            }
            if d.kind() == FileType::Dir {
                *subdirs.entry(parent).or_default() += 1;
            }
        }
        for (i, node) in self.inodes.iter() {
            if i == 0 || !self.owns(Ino(i)) || i >= self.next {
                return broken(format!("inode {i} outside the allocated range"));
            }
            if node.mode > MODE_MASK as u16 || node.nlink > MAX_LINKS {
                return broken(format!(
                    "inode {i}: mode {:o}, nlink {}",
                    node.mode, node.nlink
                ));
            }
            if (node.nlink == 0) != self.orphans.contains(&i) {
                return broken(format!("inode {i}: nlink {} vs orphan list", node.nlink));
            }
            let dirs = subdirs.get(&i).copied().unwrap_or(0);
            if node.kind == FileType::Dir && node.nlink > 0 && u64::from(node.nlink) != 2 + dirs {
                return broken(format!(
                    "directory {i}: nlink {} with {dirs} subdirectories",
                    node.nlink
                ));
            }
            if node.kind != FileType::File && !node.extents.is_empty() {
                return broken(format!("inode {i}: extent keys on a {:?}", node.kind));
            }
            if let Err(e) = check_extents(&node.extents, node.size) {
                return broken(format!("inode {i}: {e}"));
            }
            let target = self.targets.get(&i);
            if (node.kind == FileType::Symlink) != target.is_some() {
                return broken(format!(
                    "inode {i}: a {:?} with target {target:?}",
                    node.kind
                ));
            }
        }
        if let Some((i, t)) = self
            .targets
            .iter()
            .find(|(i, t)| t.is_empty() || t.len() > MAX_SYMLINK || self.inodes.get(**i).is_none())
        {
            return broken(format!("symlink target {t:?} of inode {i}"));
        }
        if let Some((i, _)) = self
            .rdevs
            .iter()
            .find(|(i, r)| **r == 0 || self.inodes.get(**i).is_none())
        {
            return broken(format!("device number of inode {i}"));
        }
        if let Some(i) = self.orphans.iter().find(|i| self.inodes.get(**i).is_none()) {
            return broken(format!("orphan {i} is not an inode"));
        }
        for (key, value) in &self.xattrs {
            let (i, name) = split_key(key);
            if check_xattr_name(name).is_err()
                || value.len() > MAX_XATTR_VALUE
                || self.inodes.get(i).is_none()
            {
                return broken(format!("xattr {name:?} of inode {i}"));
            }
        }
        for (&dir, d) in &self.delegations {
            let live_dir = self.owns(Ino(dir))
                && matches!(self.inodes.get(dir), Some(n) if n.kind == FileType::Dir && n.nlink > 0);
            if !live_dir || d.holder == 0 {
                return broken(format!(
                    "delegation {d:?} of {dir}: not a live local directory, or to client 0"
                ));
            }
        }
        if self.sessions.contains_key(&0) {
            return broken("a session of client 0".into());
        }
        let ends = self.delegations.iter().map(|(&dir, d)| (d.until, dir));
        let times = self.sessions.iter().map(|(&client, s)| (s.at, client));
        if !indexes(&self.delegation_ends, ends) || !indexes(&self.session_times, times) {
            return broken("the time indexes of the delegations and sessions".into());
        }
        if self.calls.contains_key(&0) {
            return broken("a call session of client 0".into());
        }
        for (client, c) in &self.calls {
            if c.results
                .first_key_value()
                .is_some_and(|(&seq, _)| seq < c.done_below)
            {
                return broken(format!(
                    "call session of {client:#x} keeps a result below {}",
                    c.done_below
                ));
            }
        }
        let call_times = self.calls.iter().map(|(&client, c)| (c.at, client));
        if !indexes(&self.call_times, call_times) {
            return broken("the time index of the call sessions".into());
        }
        let heap = self.count_heap();
        if heap != self.heap {
            return broken(format!("heap bytes {} counted as {heap}", self.heap));
        }
        Ok(())
    }
}

/// Whether `index` lists exactly `entries` (distinct ones).
fn indexes(
    index: &BTreeSet<(u64, u64)>,
    mut entries: impl ExactSizeIterator<Item = (u64, u64)>,
) -> bool {
    entries.len() == index.len() && entries.all(|e| index.contains(&e))
}
