//! The handlers of the [`Command`](nacre_api::meta::Command)s that change inodes, dentries and xattrs
//! (the dispatcher in `mod.rs` picks one). Every handler checks everything before it changes
//! anything, so a failed command leaves the partition as it was; each keeps `heap` and the orphan
//! and to-free lists in step with what it changes.

use nacre_types::Ino;

use nacre_api::meta::{
    Attr, Dentry, ExtentKey, FileType, MAX_RESERVE, MAX_SYMLINK, MAX_XATTR_VALUE, MetaError, Reply,
    SetAttr, XattrMode, without_suidgid,
};

use super::extents::{key_is_valid, punch, truncate, unreferenced};
use super::inodes::Inode;
use super::keys::{DentryVal, Key, owned_by};
use super::{EXTENT_BYTES, MAX_LINKS, MODE_MASK, MetaPartition};

impl MetaPartition {
    /// Makes inode `node`: number `at` (from an earlier `Reserve`), or the next one. Checks
    /// everything before it changes anything.
    pub(super) fn create_inode(
        &mut self,
        mut node: Inode,
        rdev: u32,
        target: &[u8],
        at: Option<Ino>,
    ) -> Result<Attr, MetaError> {
        let symlink = node.kind == FileType::Symlink;
        if symlink && (target.is_empty() || target.len() > MAX_SYMLINK) {
            return Err(MetaError::InvalidName);
        }
        if !symlink && !target.is_empty() {
            return Err(MetaError::Invalid("only a symlink has a target".into()));
        }
        let ino = match at {
            None if self.next >= self.end => return Err(MetaError::NoInodes),
            None => self.next,
            Some(ino) => self.reserved(ino)?,
        };
        if at.is_none() {
            self.next += 1;
        }
        if symlink {
            // What lstat reports for a symlink: the length of its target.
            node.size = target.len() as u64;
            self.targets.insert(ino, target.into());
            self.heap += target.len() as u64;
        }
        if rdev != 0 {
            self.rdevs.insert(ino, rdev);
        }
        let attr = self.attr(ino, &node);
        self.inodes.insert(ino, node);
        Ok(attr)
    }

    /// `Command::Create` (`at` is `None`) and `Command::CreateAt`: inode `node` (numbered as by
    /// `create_inode`) and its dentry `name` under `parent`, in one step.
    pub(super) fn create(
        &mut self,
        now: i64,
        (parent, name): (Ino, &[u8]),
        node: Inode,
        rdev: u32,
        target: &[u8],
        at: Option<Ino>,
    ) -> Result<Reply, MetaError> {
        // Check everything the dentry needs before making the inode, so that nothing changes on
        // failure.
        let p = self.owned(parent)?;
        let key = Key::dentry(p, name)?;
        let dir = self.live_dir(p)?;
        let kind = node.kind;
        if kind == FileType::Dir && dir.nlink >= MAX_LINKS {
            return Err(MetaError::TooManyLinks);
        }
        if self.dentries.contains_key(key.as_slice()) {
            return Err(MetaError::Exists);
        }
        let parent_was = dir.ctime;
        let attr = self.create_inode(node, rdev, target, at)?;
        let d = Dentry {
            ino: attr.ino,
            kind,
        };
        // Cannot fail now: the parent, the name and the new inode were checked.
        let parent = self.create_dentry(now, parent, name, d)?;
        Ok(Reply::Created {
            attr,
            parent,
            parent_was,
        })
    }

    /// `Command::Reserve`: the next `count` numbers, without inodes.
    pub(super) fn reserve(&mut self, count: u32) -> Result<Reply, MetaError> {
        if count == 0 || count > MAX_RESERVE {
            return Err(MetaError::Invalid(format!(
                "cannot reserve {count} inode numbers (1 to {MAX_RESERVE})"
            )));
        }
        if self.end - self.next < u64::from(count) {
            return Err(MetaError::NoInodes);
        }
        let start = self.next;
        self.next += u64::from(count);
        Ok(Reply::Reserved {
            start,
            end: self.next,
        })
    }

    pub(super) fn link_inode(&mut self, now: i64, ino: Ino) -> Result<Reply, MetaError> {
        let rdev = self.rdev(ino.0);
        let (i, node) = self.live_mut(ino)?;
        if node.kind == FileType::Dir {
            return Err(MetaError::IsDir);
        }
        if node.nlink >= MAX_LINKS {
            return Err(MetaError::TooManyLinks);
        }
        node.nlink += 1;
        node.ctime = node.ctime.max(now);
        Ok(Reply::Attr(node.attr(i, rdev)))
    }

    pub(super) fn unlink_inode(&mut self, now: i64, ino: Ino) -> Result<Reply, MetaError> {
        let (i, node) = self.live(ino)?;
        if node.kind == FileType::Dir && self.has_children(i) {
            return Err(MetaError::NotEmpty);
        }
        let rdev = self.rdev(i);
        let (_, node) = self.live_mut(ino)?;
        node.nlink = match node.kind {
            FileType::Dir => 0,
            _ => node.nlink - 1,
        };
        node.ctime = node.ctime.max(now);
        let attr = node.attr(i, rdev);
        if attr.nlink == 0 {
            self.orphans.insert(i);
            // A deleted directory has no entries left to delegate.
            self.drop_delegation(i);
        }
        Ok(Reply::Attr(attr))
    }

    pub(super) fn evict_inode(&mut self, ino: Ino) -> Result<Reply, MetaError> {
        let i = self.owned(ino)?;
        let node = self.inodes.get(i).ok_or(MetaError::NotFound)?;
        if node.nlink > 0 {
            return Err(MetaError::Invalid(format!("{ino} still has links")));
        }
        let Some(node) = self.inodes.remove(i) else {
            return Err(MetaError::NotFound);
        };
        self.orphans.remove(&i);
        self.rdevs.remove(&i);
        if let Some(t) = self.targets.remove(&i) {
            self.heap -= t.len() as u64;
        }
        let names: Vec<Box<[u8]>> = owned_by(&self.xattrs, i, None)
            .map(|(name, _)| Key::raw(i, name).to_box())
            .collect();
        for key in names {
            if let Some(value) = self.xattrs.remove(&key) {
                self.heap -= (key.len() + value.len()) as u64;
            }
        }
        self.heap -= node.extents.len() as u64 * EXTENT_BYTES;
        let freed = unreferenced(node.extents.into_vec(), &[]);
        self.to_free.extend(freed.iter().copied());
        Ok(Reply::Freed(freed))
    }

    /// `Command::Remove`: the dentry, and the link when the inode is local.
    pub(super) fn remove(
        &mut self,
        now: i64,
        parent: Ino,
        name: &[u8],
        dir: bool,
    ) -> Result<Reply, MetaError> {
        let p = self.owned(parent)?;
        let key = Key::dentry(p, name)?;
        self.live_dir(p)?;
        let d: Dentry = (*self
            .dentries
            .get(key.as_slice())
            .ok_or(MetaError::NotFound)?)
        .into();
        match (dir, d.kind == FileType::Dir) {
            (true, false) => return Err(MetaError::NotDir),
            (false, true) => return Err(MetaError::IsDir),
            _ => {}
        }
        let local = self.owns(d.ino) && self.live(d.ino).is_ok();
        if dir && !local {
            return Err(MetaError::WrongPartition(d.ino));
        }
        if dir && self.has_children(d.ino.0) {
            return Err(MetaError::NotEmpty);
        }
        self.delete_dentry(now, parent, name, Some(d.ino))?;
        let attr = if local {
            let a = match self.unlink_inode(now, d.ino)? {
                Reply::Attr(a) => a,
                other => return Ok(other),
            };
            if a.nlink == 0 {
                self.evict_inode(d.ino)?;
            }
            Some(a)
        } else {
            None
        };
        Ok(Reply::Removed {
            dentry: d,
            attr,
            parent: self.dir_attr(p)?,
        })
    }

    /// `Command::CreateDentry`: the parent's attributes after the change.
    pub(super) fn create_dentry(
        &mut self,
        now: i64,
        parent: Ino,
        name: &[u8],
        d: Dentry,
    ) -> Result<Attr, MetaError> {
        let p = self.owned(parent)?;
        let key = Key::dentry(p, name)?;
        let dir = self.live_dir(p)?;
        if self.dentries.contains_key(key.as_slice()) {
            return Err(MetaError::Exists);
        }
        self.check_target(d)?;
        let subdir = d.kind == FileType::Dir;
        if subdir && dir.nlink >= MAX_LINKS {
            return Err(MetaError::TooManyLinks);
        }
        self.heap += key.len as u64;
        self.dentries.insert(key.to_box(), d.into());
        self.touch_dir(now, p, i32::from(subdir));
        self.dir_attr(p)
    }

    pub(super) fn delete_dentry(
        &mut self,
        now: i64,
        parent: Ino,
        name: &[u8],
        expect: Option<Ino>,
    ) -> Result<Reply, MetaError> {
        let p = self.owned(parent)?;
        let key = Key::dentry(p, name)?;
        self.live_dir(p)?;
        let d = *self
            .dentries
            .get(key.as_slice())
            .ok_or(MetaError::NotFound)?;
        if expect.is_some_and(|e| e != d.ino()) {
            return Err(MetaError::NotFound);
        }
        self.dentries.remove(key.as_slice());
        self.heap -= key.len as u64;
        self.touch_dir(now, p, -i32::from(d.kind() == FileType::Dir));
        Ok(Reply::Dentry(d.into()))
    }

    pub(super) fn update_dentry(
        &mut self,
        now: i64,
        parent: Ino,
        name: &[u8],
        d: Dentry,
    ) -> Result<Reply, MetaError> {
        let p = self.owned(parent)?;
        let key = Key::dentry(p, name)?;
        self.live_dir(p)?;
        let old = *self
            .dentries
            .get(key.as_slice())
            .ok_or(MetaError::NotFound)?;
        if Dentry::from(old) == d {
            // Already so (a retried command): nothing to do.
            return Ok(Reply::Dentry(d));
        }
        self.check_target(d)?;
        self.check_replace(d.kind, old)?;
        if let Some(slot) = self.dentries.get_mut(key.as_slice()) {
            *slot = d.into();
        }
        self.touch_dir(now, p, 0);
        Ok(Reply::Dentry(old.into()))
    }

    pub(super) fn rename(
        &mut self,
        now: i64,
        src: (Ino, &[u8]),
        dst: (Ino, &[u8]),
    ) -> Result<Reply, MetaError> {
        let sp = self.owned(src.0)?;
        let dp = self.owned(dst.0)?;
        let src_key = Key::dentry(sp, src.1)?;
        let dst_key = Key::dentry(dp, dst.1)?;
        self.live_dir(sp)?;
        let dst_dir_nlink = self.live_dir(dp)?.nlink;
        let moved = *self
            .dentries
            .get(src_key.as_slice())
            .ok_or(MetaError::NotFound)?;
        if src_key.as_slice() == dst_key.as_slice() {
            return self.renamed(None, sp, dp);
        }
        let replaced = self.dentries.get(dst_key.as_slice()).copied();
        if let Some(r) = replaced {
            if r.ino() == moved.ino() {
                // Two names of one inode: POSIX says rename does nothing.
                return self.renamed(None, sp, dp);
            }
            self.check_replace(moved.kind(), r)?;
        }
        let is_dir = |d: Option<DentryVal>| i32::from(d.is_some_and(|d| d.kind() == FileType::Dir));
        let moved_dir = is_dir(Some(moved));
        if moved_dir == 1 && sp != dp {
            if self.is_ancestor(moved.ino, dp) {
                return Err(MetaError::Invalid(
                    "cannot move a directory into itself or its subtree".into(),
                ));
            }
            if replaced.is_none() && dst_dir_nlink >= MAX_LINKS {
                return Err(MetaError::TooManyLinks);
            }
        }
        self.dentries.remove(src_key.as_slice());
        self.heap -= src_key.len as u64;
        match self.dentries.get_mut(dst_key.as_slice()) {
            Some(slot) => *slot = moved,
            None => {
                self.heap += dst_key.len as u64;
                self.dentries.insert(dst_key.to_box(), moved);
            }
        }
        if sp == dp {
            // One change of one directory: one stamp (see `touch_dir`).
            self.touch_dir(now, sp, -is_dir(replaced));
        } else {
            self.touch_dir(now, sp, -moved_dir);
            self.touch_dir(now, dp, moved_dir - is_dir(replaced));
        }
        if let Some(node) = self.local_mut(moved.ino()) {
            node.ctime = node.ctime.max(now);
            if moved_dir == 1 {
                node.parent = dp;
            }
        }
        self.renamed(replaced.map(Dentry::from), sp, dp)
    }

    /// `Rename`'s reply: the replaced dentry and the parents' attributes as they are now.
    fn renamed(&self, replaced: Option<Dentry>, sp: u64, dp: u64) -> Result<Reply, MetaError> {
        let mut parents = vec![self.dir_attr(sp)?];
        if dp != sp {
            parents.push(self.dir_attr(dp)?);
        }
        Ok(Reply::Renamed { replaced, parents })
    }

    pub(super) fn set_attr(
        &mut self,
        now: i64,
        ino: Ino,
        set: &SetAttr,
        kill_suidgid: bool,
    ) -> Result<Reply, MetaError> {
        let rdev = self.rdev(ino.0);
        let (i, node) = self.live_mut(ino)?;
        if set.size.is_some() {
            match node.kind {
                FileType::File => {}
                FileType::Dir => return Err(MetaError::IsDir),
                _ => return Err(MetaError::Invalid("size of a non-regular file".into())),
            }
        }
        let old_keys = node.extents.len() as u64;
        let mut freed = Vec::new();
        if let Some(size) = set.size {
            if node.extents.last().is_some_and(|k| k.end() > size) {
                let (kept, dropped) = truncate(&node.extents, size);
                freed = unreferenced(dropped, &kept);
                node.extents = kept.into_boxed_slice();
            }
            node.size = size;
            node.mtime = now;
        }
        if let Some(mode) = set.mode {
            node.mode = (mode & MODE_MASK) as u16;
        }
        if kill_suidgid && node.kind != FileType::Dir {
            node.mode = without_suidgid(u32::from(node.mode)) as u16;
        }
        node.uid = set.uid.unwrap_or(node.uid);
        node.gid = set.gid.unwrap_or(node.gid);
        node.atime = set.atime.unwrap_or(node.atime);
        node.mtime = set.mtime.unwrap_or(node.mtime);
        node.ctime = node.ctime.max(now);
        let (attr, new_keys) = (node.attr(i, rdev), node.extents.len() as u64);
        self.heap = self.heap - old_keys * EXTENT_BYTES + new_keys * EXTENT_BYTES;
        self.to_free.extend(freed);
        Ok(Reply::Attr(attr))
    }

    pub(super) fn append_extents(
        &mut self,
        now: i64,
        ino: Ino,
        extents: &[ExtentKey],
    ) -> Result<Reply, MetaError> {
        let rdev = self.rdev(ino.0);
        let (i, node) = self.live_mut(ino)?;
        match node.kind {
            FileType::File => {}
            FileType::Dir => return Err(MetaError::IsDir),
            _ => return Err(MetaError::Invalid("extents of a non-regular file".into())),
        }
        if let Some(bad) = extents.iter().find(|k| !key_is_valid(k)) {
            return Err(MetaError::Invalid(format!("bad extent key {bad:?}")));
        }
        let old_keys = node.extents.len() as u64;
        let mut keys = std::mem::take(&mut node.extents).into_vec();
        let mut dropped = Vec::new();
        nacre_api::meta::extents::overlay_all(&mut keys, extents, &mut dropped);
        let freed = unreferenced(dropped, &keys);
        node.size = node.size.max(keys.last().map_or(0, ExtentKey::end));
        node.extents = keys.into_boxed_slice();
        node.mtime = now;
        node.ctime = node.ctime.max(now);
        let (attr, new_keys) = (node.attr(i, rdev), node.extents.len() as u64);
        self.heap = self.heap - old_keys * EXTENT_BYTES + new_keys * EXTENT_BYTES;
        self.to_free.extend(freed);
        Ok(Reply::Attr(attr))
    }

    /// `Command::Fallocate`.
    pub(super) fn fallocate(
        &mut self,
        now: i64,
        ino: Ino,
        (offset, len): (u64, u64),
        punch_range: bool,
        keep_size: bool,
    ) -> Result<Reply, MetaError> {
        let rdev = self.rdev(ino.0);
        let (i, node) = self.live_mut(ino)?;
        match node.kind {
            FileType::File => {}
            FileType::Dir => return Err(MetaError::IsDir),
            _ => return Err(MetaError::Invalid("fallocate of a non-regular file".into())),
        }
        let end = offset
            .checked_add(len)
            .filter(|_| len > 0)
            .ok_or_else(|| MetaError::Invalid(format!("fallocate of {len} bytes at {offset}")))?;
        let old_keys = node.extents.len() as u64;
        let mut freed = Vec::new();
        let mut changed = false;
        if punch_range {
            let (kept, punched) = punch(&node.extents, offset, end);
            if !punched.is_empty() {
                freed = unreferenced(punched, &kept);
                node.extents = kept.into_boxed_slice();
            }
            changed = true;
        }
        if !keep_size && end > node.size {
            node.size = end;
            changed = true;
        }
        if changed {
            node.mtime = now;
            node.ctime = node.ctime.max(now);
        }
        let (attr, new_keys) = (node.attr(i, rdev), node.extents.len() as u64);
        self.heap = self.heap - old_keys * EXTENT_BYTES + new_keys * EXTENT_BYTES;
        self.to_free.extend(freed);
        Ok(Reply::Attr(attr))
    }

    pub(super) fn set_xattr(
        &mut self,
        now: i64,
        ino: Ino,
        name: &[u8],
        value: &[u8],
        mode: XattrMode,
    ) -> Result<Reply, MetaError> {
        let (i, _) = self.live(ino)?;
        let key = Key::xattr(i, name)?;
        if value.len() > MAX_XATTR_VALUE {
            return Err(MetaError::Invalid(format!(
                "xattr value of {} bytes (at most {MAX_XATTR_VALUE})",
                value.len()
            )));
        }
        let old = self.xattrs.get(key.as_slice()).map(|v| v.len());
        match (mode, old) {
            (XattrMode::Create, Some(_)) => return Err(MetaError::Exists),
            (XattrMode::Replace, None) => return Err(MetaError::NoXattr),
            _ => {}
        }
        self.heap -= old.map_or(0, |v| (key.len + v) as u64);
        self.heap += (key.len + value.len()) as u64;
        self.xattrs.insert(key.to_box(), value.into());
        if let Some(node) = self.local_mut(Ino(i)) {
            node.ctime = node.ctime.max(now);
        }
        Ok(Reply::Done)
    }

    pub(super) fn remove_xattr(
        &mut self,
        now: i64,
        ino: Ino,
        name: &[u8],
    ) -> Result<Reply, MetaError> {
        let (i, _) = self.live(ino)?;
        let key = Key::xattr(i, name)?;
        let value = self
            .xattrs
            .remove(key.as_slice())
            .ok_or(MetaError::NoXattr)?;
        self.heap -= (key.len + value.len()) as u64;
        if let Some(node) = self.local_mut(Ino(i)) {
            node.ctime = node.ctime.max(now);
        }
        Ok(Reply::Done)
    }

    pub(super) fn ack_freed(
        &mut self,
        count: u64,
        first: Option<&ExtentKey>,
    ) -> Result<Reply, MetaError> {
        if first.is_some() && self.to_free.front() != first {
            return Ok(Reply::Done);
        }
        let n = usize::try_from(count)
            .ok()
            .filter(|&n| n <= self.to_free.len())
            .ok_or_else(|| {
                MetaError::Invalid(format!(
                    "cannot ack {count} freed extents, {} are listed",
                    self.to_free.len()
                ))
            })?;
        self.to_free.drain(..n);
        if self.to_free.len() * 4 < self.to_free.capacity() {
            self.to_free.shrink_to_fit();
        }
        Ok(Reply::Done)
    }

    pub(super) fn set_end(&mut self, end: u64) -> Result<Reply, MetaError> {
        if end < self.next || end < self.start {
            return Err(MetaError::Invalid(format!(
                "cannot end the range at {end}: inodes up to {} are allocated",
                self.max_inode()
            )));
        }
        if end > self.end {
            return Err(MetaError::Invalid(format!(
                "cannot widen the range from {} to {end}",
                self.end
            )));
        }
        self.end = end;
        Ok(Reply::Done)
    }

    /// `ino` as `CreateAt` may use it: handed out before (by `Reserve`, or as any number below
    /// `next`) and not an inode now.
    fn reserved(&self, ino: Ino) -> Result<u64, MetaError> {
        if self.owns(ino) && ino.0 >= 1 && ino.0 < self.next && self.inodes.get(ino.0).is_none() {
            Ok(ino.0)
        } else {
            Err(MetaError::Invalid(format!(
                "{ino} is not a reserved inode number free in [{}, {})",
                self.start, self.next
            )))
        }
    }
}
