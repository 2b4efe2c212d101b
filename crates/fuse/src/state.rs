//! The adapter's state between kernel requests: open directory listings ([`Listing`]), each
//! directory's parent (for `..`), and what the kernel has been told about capabilities and
//! privilege bits, which lets most writes skip a metadata call.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU64};
use std::sync::{Arc, Mutex};

use fuser::{FileHandle, Generation, ReplyEntry};
use nacre_api::meta::{Attr, FileType, SetAttr, without_suidgid};
use nacre_client::{DirEntryPlus, FileSystem, FsError, OpenFlags};
use nacre_types::Ino;
use nacre_types::sync::lock;
use tokio::runtime::Handle;

use crate::{DIR_PAGE, FuseConfig, file_attr};

/// One open directory: what has been listed so far. Index 0 is `.`, 1 is `..`, `2 + i` is
/// `entries[i]`; the FUSE offset of the entry at index `i` is `i + 1` (where the next call goes on).
#[derive(Debug)]
pub(crate) struct Listing {
    pub(crate) dir: Ino,
    pub(crate) parent: Ino,
    pub(crate) entries: Vec<DirEntryPlus>,
    pub(crate) complete: bool,
}

impl Listing {
    /// Lists until `entries` has at least `want` entries or the directory ends.
    pub(crate) async fn fill<F: FileSystem>(&mut self, fs: &F, want: usize) -> Result<(), FsError> {
        while !self.complete && self.entries.len() < want {
            let after = self.entries.last().map(|e| e.entry.name.clone());
            let page = fs.readdir(self.dir, after, DIR_PAGE).await?;
            // The trait allows short pages: only an empty one ends the directory.
            self.complete = page.is_empty();
            // Entries whose inode vanished between listing and reading it are left out.
            self.entries
                .extend(page.into_iter().filter(|e| e.attr.is_some()));
        }
        Ok(())
    }
}

pub(crate) struct Inner<F> {
    pub(crate) fs: Arc<F>,
    pub(crate) rt: Handle,
    pub(crate) cfg: FuseConfig,
    pub(crate) dirs: Mutex<HashMap<u64, Arc<tokio::sync::Mutex<Listing>>>>,
    pub(crate) next_dir: AtomicU64,
    /// Directory → parent, as learned from lookups and listings (for `..` in listings; the
    /// kernel itself resolves `..` through its dentry cache).
    pub(crate) parents: Mutex<HashMap<u64, u64>>,
    /// Files known (within the attribute TTL) to have no `security.capability` xattr. The kernel
    /// asks for it before every write (to drop file capabilities); answering from here saves a
    /// metadata read per write.
    pub(crate) no_caps: Mutex<HashMap<u64, std::time::Instant>>,
    /// The kernel granted `FUSE_HANDLE_KILLPRIV_V2`: it leaves clearing set-user-ID and
    /// set-group-ID bits on write, truncate and chown to this file system, and reads
    /// `security.capability` only once after each attribute refresh, not before every write.
    pub(crate) killpriv: AtomicBool,
    /// Inodes whose attributes, as last handed to the kernel, have set-user-ID or an executable
    /// set-group-ID bit: a write the kernel flags `FUSE_WRITE_KILL_SUIDGID` (its caller lacks
    /// `CAP_FSETID`) clears them first. Any other file needs nothing, which spares every write
    /// a metadata call. As fresh as the kernel's own attribute cache, which it decided from
    /// before killpriv. Dropped when the kernel forgets the inode.
    pub(crate) privileged: Mutex<HashSet<u64>>,
}

/// The xattr the kernel reads before every write.
pub(crate) const CAPS: &[u8] = b"security.capability";
/// Most inodes remembered in `no_caps` (the map is cleared when full).
pub(crate) const NO_CAPS_MAX: usize = 100_000;

impl<F> Inner<F> {
    pub(crate) fn caps_known_absent(&self, ino: u64) -> bool {
        lock(&self.no_caps)
            .get(&ino)
            .is_some_and(|t| t.elapsed() < self.cfg.attr_ttl)
    }

    pub(crate) fn set_caps_absent(&self, ino: u64, absent: bool) {
        let mut m = lock(&self.no_caps);
        if absent {
            if m.len() >= NO_CAPS_MAX {
                m.clear();
            }
            m.insert(ino, std::time::Instant::now());
        } else {
            m.remove(&ino);
        }
    }
}

impl<F> Inner<F> {
    /// `a` as the kernel sees it; remembers whether a write must clear its privilege bits.
    pub(crate) fn out_attr(&self, a: &Attr) -> fuser::FileAttr {
        self.note_mode(a);
        file_attr(a)
    }

    pub(crate) fn note_mode(&self, a: &Attr) {
        let privileged = a.kind != FileType::Dir && without_suidgid(a.mode) != a.mode;
        let mut p = lock(&self.privileged);
        if privileged {
            p.insert(a.ino.0);
        } else if !p.is_empty() {
            p.remove(&a.ino.0);
        }
    }

    pub(crate) fn is_privileged(&self, ino: u64) -> bool {
        lock(&self.privileged).contains(&ino)
    }
}

impl<F: FileSystem> Inner<F> {
    /// Clears set-user-ID and executable set-group-ID bits (before a write by a caller without
    /// `CAP_FSETID`).
    pub(crate) async fn kill_suidgid(&self, ino: Ino) -> Result<(), FsError> {
        let set = SetAttr {
            kill_suidgid: true,
            ..SetAttr::default()
        };
        let a = self.fs.setattr(ino, set).await?;
        self.note_mode(&a);
        Ok(())
    }
}

impl<F> Inner<F> {
    pub(crate) fn learn_parent(&self, attr: &Attr, parent: Ino) {
        if attr.kind == FileType::Dir {
            lock(&self.parents).insert(attr.ino.0, parent.0);
        }
    }

    pub(crate) fn parent_of(&self, dir: Ino) -> Ino {
        lock(&self.parents).get(&dir.0).copied().map_or(dir, Ino)
    }

    pub(crate) fn listing(&self, fh: FileHandle) -> Option<Arc<tokio::sync::Mutex<Listing>>> {
        lock(&self.dirs).get(&fh.0).cloned()
    }

    /// How the file system should open a file the application opened with `flags`.
    pub(crate) fn open_flags(&self, flags: i32) -> OpenFlags {
        let mut f = OpenFlags::from_posix(flags);
        if self.cfg.writeback {
            // The kernel reads around partial page writes and flushes pages through any
            // writable handle at offsets it chose itself.
            f.read |= f.write;
            f.append = false;
        }
        f
    }

    pub(crate) fn entry(&self, reply: ReplyEntry, attr: &Attr) {
        reply.entry_with_ttls(
            &self.cfg.attr_ttl,
            &self.cfg.entry_ttl,
            &self.out_attr(attr),
            Generation(u64::from(attr.generation)),
        );
    }
}
