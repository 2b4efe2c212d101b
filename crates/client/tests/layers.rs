//! The layers (`MetaCache`, `Metrics`) over a toy in-memory file system that counts the calls
//! reaching it. The toy is the truth: anything read through the cache must match it, unless time
//! passed less than a TTL since another client (the toy, called directly) changed it.
#![allow(clippy::unwrap_used)] // helpers outside #[test] fns

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use nacre_api::meta::{Attr, DirEntry, FileType, MetaError, ROOT_INO, SetAttr, XattrMode};
use nacre_client::layers::CacheStats;
use nacre_client::{
    Caller, DirEntryPlus, Entry, Fh, FileSystem, FsError, FsResult, MetaCache, MetaCacheConfig,
    Metrics, OpenFlags, StatFs,
};
use nacre_types::Ino;
use tokio::sync::oneshot;

// ---------------------------------------------------------------------------------------------
// The toy file system.

#[derive(Debug)]
struct Node {
    attr: Attr,
    /// Directories: the parent (to refuse moving a directory into itself) and the entries.
    parent: Ino,
    children: BTreeMap<Vec<u8>, Ino>,
    data: Vec<u8>,
    target: Vec<u8>,
    xattrs: BTreeMap<Vec<u8>, Vec<u8>>,
}

#[derive(Debug)]
struct ToyState {
    nodes: HashMap<Ino, Node>,
    next_ino: u64,
    next_fh: u64,
    handles: HashMap<Fh, (Ino, OpenFlags)>,
    /// Logical time: every change gets a new mtime/ctime, so any change shows in `Attr`.
    clock: i64,
}

/// A `getattr` held between reading the inode and answering (to race it with a mutation).
#[derive(Debug)]
struct Hold {
    read_done: oneshot::Sender<()>,
    go: oneshot::Receiver<()>,
}

#[derive(Debug)]
struct Toy {
    st: Mutex<ToyState>,
    calls: Mutex<HashMap<&'static str, u64>>,
    hold_getattr: Mutex<Option<Hold>>,
}

fn err<T>(e: MetaError) -> FsResult<T> {
    Err(FsError::Meta(e))
}

impl Toy {
    fn new() -> Self {
        let mut nodes = HashMap::new();
        nodes.insert(
            ROOT_INO,
            Toy::node(ROOT_INO, FileType::Dir, 0o755, ROOT_INO, 0),
        );
        Self {
            st: Mutex::new(ToyState {
                nodes,
                next_ino: 2,
                next_fh: 1,
                handles: HashMap::new(),
                clock: 1,
            }),
            calls: Mutex::default(),
            hold_getattr: Mutex::default(),
        }
    }

    fn node(ino: Ino, kind: FileType, mode: u32, parent: Ino, now: i64) -> Node {
        Node {
            attr: Attr {
                ino,
                kind,
                mode,
                uid: 0,
                gid: 0,
                size: 0,
                nlink: if kind == FileType::Dir { 2 } else { 1 },
                rdev: 0,
                atime: now,
                mtime: now,
                ctime: now,
                generation: 0,
            },
            parent,
            children: BTreeMap::new(),
            data: Vec::new(),
            target: Vec::new(),
            xattrs: BTreeMap::new(),
        }
    }

    fn count(&self, op: &'static str) {
        *self.calls.lock().unwrap().entry(op).or_default() += 1;
    }

    /// Calls of `op` that reached the toy.
    fn calls(&self, op: &str) -> u64 {
        self.calls.lock().unwrap().get(op).copied().unwrap_or(0)
    }

    fn with<T>(
        &self,
        op: &'static str,
        f: impl FnOnce(&mut ToyState) -> FsResult<T>,
    ) -> FsResult<T> {
        self.count(op);
        f(&mut self.st.lock().unwrap())
    }
}

impl ToyState {
    fn tick(&mut self) -> i64 {
        self.clock += 1;
        self.clock
    }

    fn get(&self, ino: Ino) -> FsResult<&Node> {
        self.nodes
            .get(&ino)
            .ok_or(FsError::Meta(MetaError::NotFound))
    }

    fn get_mut(&mut self, ino: Ino) -> FsResult<&mut Node> {
        self.nodes
            .get_mut(&ino)
            .ok_or(FsError::Meta(MetaError::NotFound))
    }

    fn dir(&self, ino: Ino) -> FsResult<&Node> {
        let n = self.get(ino)?;
        if n.attr.kind != FileType::Dir {
            return err(MetaError::NotDir);
        }
        Ok(n)
    }

    fn child(&self, parent: Ino, name: &[u8]) -> FsResult<Ino> {
        self.dir(parent)?
            .children
            .get(name)
            .copied()
            .ok_or(FsError::Meta(MetaError::NotFound))
    }

    fn touch_dir(&mut self, dir: Ino, nlink_delta: i32) {
        let now = self.tick();
        if let Some(d) = self.nodes.get_mut(&dir) {
            d.attr.mtime = now;
            d.attr.ctime = now;
            d.attr.nlink = d.attr.nlink.saturating_add_signed(nlink_delta);
        }
    }

    /// Adds a name; returns the new inode and the parent's ctime before the change.
    fn add(&mut self, parent: Ino, name: &[u8], kind: FileType, mode: u32) -> FsResult<(Ino, i64)> {
        nacre_api::meta::check_name(name)?;
        if self.dir(parent)?.children.contains_key(name) {
            return err(MetaError::Exists);
        }
        let was = self.get(parent)?.attr.ctime;
        let ino = Ino(self.next_ino);
        self.next_ino += 1;
        let now = self.tick();
        self.nodes
            .insert(ino, Toy::node(ino, kind, mode, parent, now));
        self.get_mut(parent)?.children.insert(name.to_vec(), ino);
        self.touch_dir(parent, i32::from(kind == FileType::Dir));
        Ok((ino, was))
    }

    /// One link fewer; the inode goes at zero (directories: when removed).
    fn drop_link(&mut self, ino: Ino) {
        let now = self.tick();
        let gone = match self.nodes.get_mut(&ino) {
            Some(n) if n.attr.kind == FileType::Dir => true,
            Some(n) => {
                n.attr.nlink -= 1;
                n.attr.ctime = now;
                n.attr.nlink == 0
            }
            None => false,
        };
        if gone && !self.handles.values().any(|(i, _)| *i == ino) {
            self.nodes.remove(&ino);
        }
    }

    /// What a create-like call answers: the inode and its directory, as they are now.
    fn entry(&self, ino: Ino, parent: Ino, parent_was: Option<i64>) -> FsResult<Entry> {
        Ok(Entry {
            attr: self.get(ino)?.attr.clone(),
            parent: Some(self.get(parent)?.attr.clone()),
            parent_was,
        })
    }

    fn handle(&self, fh: Fh) -> FsResult<(Ino, OpenFlags)> {
        self.handles
            .get(&fh)
            .copied()
            .ok_or(FsError::BadHandle(fh.0))
    }

    fn open(&mut self, ino: Ino, flags: OpenFlags) -> Fh {
        let fh = Fh(self.next_fh);
        self.next_fh += 1;
        self.handles.insert(fh, (ino, flags));
        fh
    }

    /// Whether `ino` is `dir` or below it.
    fn within(&self, mut ino: Ino, dir: Ino) -> bool {
        loop {
            if ino == dir {
                return true;
            }
            match self.nodes.get(&ino) {
                Some(n) if ino != ROOT_INO => ino = n.parent,
                _ => return false,
            }
        }
    }
}

impl FileSystem for Toy {
    async fn lookup(&self, parent: Ino, name: &[u8]) -> FsResult<Attr> {
        self.with("lookup", |st| {
            let ino = st.child(parent, name)?;
            Ok(st.get(ino)?.attr.clone())
        })
    }

    async fn getattr(&self, ino: Ino) -> FsResult<Attr> {
        let r = self.with("getattr", |st| Ok(st.get(ino)?.attr.clone()));
        let hold = self.hold_getattr.lock().unwrap().take();
        if let Some(h) = hold {
            let _ = h.read_done.send(());
            let _ = h.go.await;
        }
        r
    }

    async fn setattr(&self, ino: Ino, set: SetAttr) -> FsResult<Attr> {
        self.with("setattr", |st| {
            let now = st.tick();
            let n = st.get_mut(ino)?;
            if let Some(m) = set.mode {
                n.attr.mode = m;
            }
            if let Some(u) = set.uid {
                n.attr.uid = u;
            }
            if let Some(g) = set.gid {
                n.attr.gid = g;
            }
            if let Some(s) = set.size {
                n.data.resize(s as usize, 0);
                n.attr.size = s;
                n.attr.mtime = now;
            }
            if let Some(t) = set.atime {
                n.attr.atime = t;
            }
            if let Some(t) = set.mtime {
                n.attr.mtime = t;
            }
            n.attr.ctime = now;
            Ok(n.attr.clone())
        })
    }

    async fn create(
        &self,
        parent: Ino,
        name: &[u8],
        mode: u32,
        _caller: Caller,
        flags: OpenFlags,
    ) -> FsResult<(Entry, Fh)> {
        self.with("create", |st| {
            let (ino, was) = st.add(parent, name, FileType::File, mode)?;
            let fh = st.open(ino, flags);
            Ok((st.entry(ino, parent, Some(was))?, fh))
        })
    }

    async fn mkdir(&self, parent: Ino, name: &[u8], mode: u32, _caller: Caller) -> FsResult<Entry> {
        self.with("mkdir", |st| {
            let (ino, was) = st.add(parent, name, FileType::Dir, mode)?;
            st.entry(ino, parent, Some(was))
        })
    }

    async fn symlink(
        &self,
        parent: Ino,
        name: &[u8],
        target: &[u8],
        _caller: Caller,
    ) -> FsResult<Entry> {
        self.with("symlink", |st| {
            let (ino, was) = st.add(parent, name, FileType::Symlink, 0o777)?;
            let n = st.get_mut(ino)?;
            n.target = target.to_vec();
            n.attr.size = target.len() as u64;
            st.entry(ino, parent, Some(was))
        })
    }

    async fn mknod(
        &self,
        parent: Ino,
        name: &[u8],
        kind: FileType,
        mode: u32,
        rdev: u32,
        _caller: Caller,
    ) -> FsResult<Entry> {
        self.with("mknod", |st| {
            let (ino, was) = st.add(parent, name, kind, mode)?;
            st.get_mut(ino)?.attr.rdev = rdev;
            st.entry(ino, parent, Some(was))
        })
    }

    async fn link(&self, ino: Ino, new_parent: Ino, new_name: &[u8]) -> FsResult<Entry> {
        self.with("link", |st| {
            nacre_api::meta::check_name(new_name)?;
            if st.get(ino)?.attr.kind == FileType::Dir {
                return err(MetaError::IsDir);
            }
            if st.dir(new_parent)?.children.contains_key(new_name) {
                return err(MetaError::Exists);
            }
            st.get_mut(new_parent)?
                .children
                .insert(new_name.to_vec(), ino);
            st.touch_dir(new_parent, 0);
            let now = st.tick();
            let n = st.get_mut(ino)?;
            n.attr.nlink += 1;
            n.attr.ctime = now;
            st.entry(ino, new_parent, None)
        })
    }

    async fn unlink(&self, parent: Ino, name: &[u8]) -> FsResult<Vec<Attr>> {
        self.with("unlink", |st| {
            let ino = st.child(parent, name)?;
            if st.get(ino)?.attr.kind == FileType::Dir {
                return err(MetaError::IsDir);
            }
            st.get_mut(parent)?.children.remove(name);
            st.touch_dir(parent, 0);
            st.drop_link(ino);
            Ok(vec![st.get(parent)?.attr.clone()])
        })
    }

    async fn rmdir(&self, parent: Ino, name: &[u8]) -> FsResult<Vec<Attr>> {
        self.with("rmdir", |st| {
            let ino = st.child(parent, name)?;
            if !st.dir(ino)?.children.is_empty() {
                return err(MetaError::NotEmpty);
            }
            st.get_mut(parent)?.children.remove(name);
            st.touch_dir(parent, -1);
            st.drop_link(ino);
            Ok(vec![st.get(parent)?.attr.clone()])
        })
    }

    async fn rename(
        &self,
        parent: Ino,
        name: &[u8],
        new_parent: Ino,
        new_name: &[u8],
    ) -> FsResult<Vec<Attr>> {
        self.with("rename", |st| {
            nacre_api::meta::check_name(new_name)?;
            let ino = st.child(parent, name)?;
            st.dir(new_parent)?;
            let is_dir = st.get(ino)?.attr.kind == FileType::Dir;
            if is_dir && st.within(new_parent, ino) {
                return err(MetaError::Invalid(
                    "a directory cannot move into itself".into(),
                ));
            }
            let old = st.dir(new_parent)?.children.get(new_name).copied();
            if let Some(old) = old {
                if old == ino {
                    return Ok(Vec::new());
                }
                let old_dir = st.get(old)?.attr.kind == FileType::Dir;
                match (is_dir, old_dir) {
                    (true, false) => return err(MetaError::NotDir),
                    (false, true) => return err(MetaError::IsDir),
                    (true, true) if !st.get(old)?.children.is_empty() => {
                        return err(MetaError::NotEmpty);
                    }
                    _ => {}
                }
                st.get_mut(new_parent)?.children.remove(new_name);
                if old_dir {
                    st.touch_dir(new_parent, -1);
                }
                st.drop_link(old);
            }
            st.get_mut(parent)?.children.remove(name);
            st.get_mut(new_parent)?
                .children
                .insert(new_name.to_vec(), ino);
            let delta = i32::from(is_dir && parent != new_parent);
            st.touch_dir(parent, -delta);
            st.touch_dir(new_parent, delta);
            let now = st.tick();
            let n = st.get_mut(ino)?;
            n.attr.ctime = now;
            n.parent = new_parent;
            let mut dirs = vec![st.get(parent)?.attr.clone()];
            if new_parent != parent {
                dirs.push(st.get(new_parent)?.attr.clone());
            }
            Ok(dirs)
        })
    }

    async fn readlink(&self, ino: Ino) -> FsResult<Vec<u8>> {
        self.with("readlink", |st| Ok(st.get(ino)?.target.clone()))
    }

    async fn readdir(
        &self,
        dir: Ino,
        after: Option<Vec<u8>>,
        limit: u32,
    ) -> FsResult<Vec<DirEntryPlus>> {
        self.with("readdir", |st| {
            let d = st.dir(dir)?;
            let limit = if limit == 0 {
                usize::MAX
            } else {
                limit as usize
            };
            Ok(d.children
                .iter()
                .filter(|(name, _)| after.as_ref().is_none_or(|a| *name > a))
                .take(limit)
                .map(|(name, ino)| {
                    let attr = st.nodes.get(ino).map(|n| n.attr.clone());
                    DirEntryPlus {
                        entry: DirEntry {
                            name: name.clone(),
                            ino: *ino,
                            kind: attr.as_ref().map_or(FileType::File, |a| a.kind),
                        },
                        attr,
                    }
                })
                .collect())
        })
    }

    async fn open(&self, ino: Ino, flags: OpenFlags) -> FsResult<Fh> {
        self.with("open", |st| {
            let now = st.tick();
            let n = st.get_mut(ino)?;
            if flags.truncate && flags.write {
                n.data.clear();
                n.attr.size = 0;
                n.attr.mtime = now;
            }
            Ok(st.open(ino, flags))
        })
    }

    async fn read(&self, fh: Fh, offset: u64, len: u32) -> FsResult<Bytes> {
        self.with("read", |st| {
            let (ino, _) = st.handle(fh)?;
            let d = &st.get(ino)?.data;
            let from = (offset as usize).min(d.len());
            let to = (from + len as usize).min(d.len());
            Ok(Bytes::copy_from_slice(&d[from..to]))
        })
    }

    async fn write(&self, fh: Fh, offset: u64, data: Bytes) -> FsResult<u32> {
        self.with("write", |st| {
            let (ino, flags) = st.handle(fh)?;
            if !flags.write {
                return Err(FsError::NotOpenFor("writing"));
            }
            let now = st.tick();
            let n = st.get_mut(ino)?;
            let at = if flags.append {
                n.data.len()
            } else {
                offset as usize
            };
            if n.data.len() < at + data.len() {
                n.data.resize(at + data.len(), 0);
            }
            n.data[at..at + data.len()].copy_from_slice(&data);
            n.attr.size = n.data.len() as u64;
            n.attr.mtime = now;
            n.attr.ctime = now;
            Ok(data.len() as u32)
        })
    }

    async fn flush(&self, fh: Fh) -> FsResult<()> {
        self.with("flush", |st| st.handle(fh).map(|_| ()))
    }

    async fn fsync(&self, fh: Fh) -> FsResult<()> {
        self.with("fsync", |st| st.handle(fh).map(|_| ()))
    }

    async fn release(&self, fh: Fh) -> FsResult<()> {
        self.with("release", |st| {
            let (ino, _) = st.handle(fh)?;
            st.handles.remove(&fh);
            if st.nodes.get(&ino).is_some_and(|n| n.attr.nlink == 0) {
                st.nodes.remove(&ino);
            }
            Ok(())
        })
    }

    async fn statfs(&self) -> FsResult<StatFs> {
        self.with("statfs", |st| {
            Ok(StatFs {
                files: st.nodes.len() as u64,
                ..StatFs::default()
            })
        })
    }

    async fn getxattr(&self, ino: Ino, name: &[u8]) -> FsResult<Vec<u8>> {
        self.with("getxattr", |st| {
            st.get(ino)?
                .xattrs
                .get(name)
                .cloned()
                .ok_or(FsError::Meta(MetaError::NoXattr))
        })
    }

    async fn setxattr(
        &self,
        ino: Ino,
        name: &[u8],
        value: &[u8],
        _mode: XattrMode,
    ) -> FsResult<()> {
        self.with("setxattr", |st| {
            let now = st.tick();
            let n = st.get_mut(ino)?;
            n.xattrs.insert(name.to_vec(), value.to_vec());
            n.attr.ctime = now;
            Ok(())
        })
    }

    async fn listxattr(&self, ino: Ino) -> FsResult<Vec<Vec<u8>>> {
        self.with("listxattr", |st| {
            Ok(st.get(ino)?.xattrs.keys().cloned().collect())
        })
    }

    async fn removexattr(&self, ino: Ino, name: &[u8]) -> FsResult<()> {
        self.with("removexattr", |st| {
            let now = st.tick();
            let n = st.get_mut(ino)?;
            n.xattrs
                .remove(name)
                .ok_or(FsError::Meta(MetaError::NoXattr))?;
            n.attr.ctime = now;
            Ok(())
        })
    }
}

// ---------------------------------------------------------------------------------------------
// Helpers.

const ME: Caller = Caller { uid: 0, gid: 0 };

fn cache() -> MetaCache<Toy> {
    MetaCache::new(Toy::new())
}

async fn mkfile(fs: &impl FileSystem, parent: Ino, name: &str, data: &[u8]) -> Attr {
    let (a, fh) = fs
        .create(parent, name.as_bytes(), 0o644, ME, OpenFlags::WRITE)
        .await
        .unwrap();
    if !data.is_empty() {
        fs.write(fh, 0, Bytes::copy_from_slice(data)).await.unwrap();
    }
    fs.release(fh).await.unwrap();
    a.attr
}

fn not_found<T: std::fmt::Debug>(r: FsResult<T>) {
    assert!(
        matches!(r, Err(FsError::Meta(MetaError::NotFound))),
        "expected NotFound, got {r:?}"
    );
}

// ---------------------------------------------------------------------------------------------
// MetaCache.

#[tokio::test(start_paused = true)]
async fn cached_lookups_and_getattrs_do_not_reach_the_inner_fs() {
    let c = cache();
    // Made by "another client": nothing of it is cached.
    let d = c
        .inner()
        .mkdir(ROOT_INO, b"d", 0o755, ME)
        .await
        .unwrap()
        .attr;
    let f = mkfile(c.inner(), d.ino, "f", b"hello").await;

    for _ in 0..3 {
        assert_eq!(c.lookup(ROOT_INO, b"d").await.unwrap().ino, d.ino);
        let got = c.lookup(d.ino, b"f").await.unwrap();
        assert_eq!((got.ino, got.size), (f.ino, 5));
        assert_eq!(c.getattr(f.ino).await.unwrap().size, 5);
    }
    assert_eq!(c.inner().calls("lookup"), 2);
    assert_eq!(c.inner().calls("getattr"), 0);
    let s = c.stats();
    assert_eq!((s.hits, s.misses), (7, 2));
    assert_eq!((s.attrs, s.entries), (2, 2));

    // getattr alone fills only the attribute: a lookup still needs the dentry.
    let g = mkfile(c.inner(), ROOT_INO, "g", b"").await;
    c.getattr(g.ino).await.unwrap();
    c.getattr(g.ino).await.unwrap();
    assert_eq!(c.inner().calls("getattr"), 1);
    c.lookup(ROOT_INO, b"g").await.unwrap();
    assert_eq!(c.inner().calls("lookup"), 3);
}

#[tokio::test(start_paused = true)]
async fn readdir_and_creates_fill_the_cache() {
    let c = cache();
    for i in 0..5 {
        mkfile(c.inner(), ROOT_INO, &format!("f{i}"), b"x").await;
    }
    let entries = c.readdir(ROOT_INO, None, 0).await.unwrap();
    assert_eq!(entries.len(), 5);
    for e in &entries {
        let a = c.lookup(ROOT_INO, &e.entry.name).await.unwrap();
        assert_eq!(Some(a), e.attr);
    }
    assert_eq!(c.inner().calls("lookup"), 0);

    let d = c.mkdir(ROOT_INO, b"d", 0o755, ME).await.unwrap().attr;
    let f = mkfile(&c, d.ino, "new", b"").await;
    let s = c.symlink(d.ino, b"s", b"new", ME).await.unwrap();
    let l = c.link(f.ino, ROOT_INO, b"hard").await.unwrap();
    assert_eq!(l.attr.nlink, 2);
    assert_eq!(c.lookup(d.ino, b"s").await.unwrap(), s.attr);
    assert_eq!(c.lookup(ROOT_INO, b"hard").await.unwrap(), l.attr);
    assert_eq!(c.lookup(d.ino, b"new").await.unwrap().nlink, 2);
    assert_eq!(c.inner().calls("lookup"), 0);
    // The parents changed (mtime, nlink); each call answered their new attributes, which are
    // served from the cache.
    let before = c.inner().calls("getattr");
    assert_eq!(
        c.getattr(d.ino).await.unwrap(),
        c.inner().getattr(d.ino).await.unwrap()
    );
    assert_eq!(
        c.getattr(ROOT_INO).await.unwrap(),
        c.inner().getattr(ROOT_INO).await.unwrap()
    );
    assert_eq!(c.inner().calls("getattr"), before + 2, "only the toy's own");
}

/// What the kernel does through FUSE: every create or remove in a directory is followed by a
/// `getattr` of that directory. The calls answer the directory's new attributes; the cache serves
/// them, and they are the truth.
#[tokio::test(start_paused = true)]
async fn a_changed_directory_is_served_with_the_attributes_the_change_answered() {
    let c = cache();
    let d = c.mkdir(ROOT_INO, b"d", 0o755, ME).await.unwrap().attr;
    let e = c.mkdir(ROOT_INO, b"e", 0o755, ME).await.unwrap().attr;
    let toy = c.inner();
    let same = |ino: Ino| {
        let c = &c;
        async move {
            let before = toy.calls("getattr");
            let cached = c.getattr(ino).await.unwrap();
            assert_eq!(toy.calls("getattr"), before, "{ino} served from the cache");
            assert_eq!(
                cached,
                toy.getattr(ino).await.unwrap(),
                "{ino} is the truth"
            );
        }
    };
    same(ROOT_INO).await;
    mkfile(&c, d.ino, "f", b"").await;
    same(d.ino).await;
    c.mkdir(d.ino, b"sub", 0o755, ME).await.unwrap();
    same(d.ino).await;
    c.symlink(d.ino, b"s", b"f", ME).await.unwrap();
    same(d.ino).await;
    let f = c.lookup(d.ino, b"f").await.unwrap();
    c.link(f.ino, e.ino, b"f2").await.unwrap();
    same(e.ino).await;
    c.unlink(d.ino, b"s").await.unwrap();
    same(d.ino).await;
    c.rename(d.ino, b"sub", e.ino, b"sub").await.unwrap();
    same(d.ino).await;
    same(e.ino).await;
    c.rename(e.ino, b"f2", e.ino, b"f3").await.unwrap();
    same(e.ino).await;
    c.rmdir(e.ino, b"sub").await.unwrap();
    same(e.ino).await;
}

#[tokio::test(start_paused = true)]
async fn missing_names_are_not_cached() {
    let c = cache();
    not_found(c.lookup(ROOT_INO, b"x").await);
    not_found(c.lookup(ROOT_INO, b"x").await);
    assert_eq!(c.inner().calls("lookup"), 2);
    // Another client creates it: seen at once.
    let a = mkfile(c.inner(), ROOT_INO, "x", b"").await;
    assert_eq!(c.lookup(ROOT_INO, b"x").await.unwrap(), a);
}

#[tokio::test(start_paused = true)]
async fn a_directory_made_here_answers_missing_names_while_its_own_creates_confirm_it() {
    let c = cache();
    let d = c.mkdir(ROOT_INO, b"d", 0o755, ME).await.unwrap().attr;
    // Made empty here: a missing name is answered without asking.
    not_found(c.lookup(d.ino, b"x").await);
    assert_eq!(c.inner().calls("lookup"), 0);
    // This client's creates keep it complete (each found the ctime the cache holds).
    let a = mkfile(&c, d.ino, "a", b"").await;
    let sub = c.mkdir(d.ino, b"sub", 0o755, ME).await.unwrap().attr;
    not_found(c.lookup(d.ino, b"y").await);
    not_found(c.lookup(sub.ino, b"y").await);
    assert_eq!(c.inner().calls("lookup"), 0);
    // A name it has is looked up as usual (the file's attribute went stale when it was closed).
    assert_eq!(c.lookup(d.ino, b"a").await.unwrap().ino, a.ino);
    assert_eq!(c.inner().calls("lookup"), 1);
    // Names that are not names are still the inner file system's to judge.
    let long = vec![b'n'; 300];
    assert!(c.lookup(d.ino, &long).await.is_err());
    assert_eq!(c.inner().calls("lookup"), 2);
    // Another client adds a name: missed within the TTL …
    mkfile(c.inner(), d.ino, "z", b"").await;
    not_found(c.lookup(d.ino, b"z").await);
    // … until this client's next create finds the directory changed behind its back.
    mkfile(&c, d.ino, "b", b"").await;
    assert!(c.lookup(d.ino, b"z").await.is_ok());
    not_found(c.lookup(d.ino, b"w").await);
    assert_eq!(c.inner().calls("lookup"), 4, "no longer complete: asked");
}

#[tokio::test(start_paused = true)]
async fn a_complete_directory_ends_with_its_ttl_and_with_changes_it_cannot_follow() {
    let c = cache();
    let ttl = c.config().entry_ttl;
    let lookups = |c: &MetaCache<Toy>| c.inner().calls("lookup");
    // The TTL counts from the last confirmation.
    let d = c.mkdir(ROOT_INO, b"d", 0o755, ME).await.unwrap().attr;
    tokio::time::advance(ttl / 2).await;
    mkfile(&c, d.ino, "a", b"").await;
    tokio::time::advance(ttl / 2 + ttl / 4).await;
    not_found(c.lookup(d.ino, b"x").await);
    assert_eq!(lookups(&c), 0);
    tokio::time::advance(ttl / 4).await;
    not_found(c.lookup(d.ino, b"x").await);
    assert_eq!(lookups(&c), 1, "expired: asked");
    // A remove, a rename, a setattr, a failed create: each ends it.
    for (i, change) in ["unlink", "rename", "setattr", "exists"].iter().enumerate() {
        let name = format!("e{i}");
        let e = c
            .mkdir(ROOT_INO, name.as_bytes(), 0o755, ME)
            .await
            .unwrap()
            .attr;
        mkfile(&c, e.ino, "f", b"").await;
        not_found(c.lookup(e.ino, b"x").await);
        match *change {
            "unlink" => {
                c.unlink(e.ino, b"f").await.unwrap();
            }
            "rename" => {
                c.rename(e.ino, b"f", e.ino, b"g").await.unwrap();
            }
            "setattr" => {
                let set = SetAttr {
                    mode: Some(0o700),
                    ..SetAttr::default()
                };
                c.setattr(e.ino, set).await.unwrap();
            }
            _ => {
                let r = c.create(e.ino, b"f", 0o644, ME, OpenFlags::WRITE).await;
                assert!(matches!(r, Err(FsError::Meta(MetaError::Exists))));
            }
        }
        let before = lookups(&c);
        not_found(c.lookup(e.ino, b"x").await);
        assert_eq!(lookups(&c), before + 1, "after {change}: asked");
    }
    // A hard link's create cannot tell what it found: asked afterwards.
    let e = c.mkdir(ROOT_INO, b"l", 0o755, ME).await.unwrap().attr;
    let f = mkfile(&c, ROOT_INO, "target", b"").await;
    c.link(f.ino, e.ino, b"h").await.unwrap();
    let before = lookups(&c);
    not_found(c.lookup(e.ino, b"x").await);
    assert_eq!(lookups(&c), before + 1);
}

#[tokio::test(start_paused = true)]
async fn every_mutation_invalidates_what_it_changes() {
    let c = cache();
    let d = c.mkdir(ROOT_INO, b"d", 0o755, ME).await.unwrap().attr;
    let e = c.mkdir(ROOT_INO, b"e", 0o755, ME).await.unwrap().attr;
    let a = mkfile(&c, d.ino, "a", b"aaaa").await;
    let b = mkfile(&c, e.ino, "b", b"bb").await;
    // Warm everything.
    for (p, n) in [(ROOT_INO, "d"), (ROOT_INO, "e"), (d.ino, "a"), (e.ino, "b")] {
        c.lookup(p, n.as_bytes()).await.unwrap();
    }
    for ino in [ROOT_INO, d.ino, e.ino] {
        c.getattr(ino).await.unwrap();
    }
    let toy = c.inner();
    let truth = |ino: Ino| async move { toy.getattr(ino).await };

    // setattr
    c.setattr(
        a.ino,
        SetAttr {
            mode: Some(0o600),
            ..SetAttr::default()
        },
    )
    .await
    .unwrap();
    assert_eq!(c.getattr(a.ino).await.unwrap().mode, 0o600);
    assert_eq!(c.lookup(d.ino, b"a").await.unwrap().mode, 0o600);

    // rename over an existing file, across directories
    c.rename(d.ino, b"a", e.ino, b"b").await.unwrap();
    not_found(c.lookup(d.ino, b"a").await);
    assert_eq!(c.lookup(e.ino, b"b").await.unwrap().ino, a.ino);
    not_found(c.getattr(b.ino).await);
    for ino in [d.ino, e.ino, a.ino] {
        assert_eq!(c.getattr(ino).await.unwrap(), truth(ino).await.unwrap());
    }

    // rename a directory: its parent's link counts change
    let sub = c.mkdir(d.ino, b"sub", 0o755, ME).await.unwrap().attr;
    c.lookup(d.ino, b"sub").await.unwrap();
    c.getattr(d.ino).await.unwrap();
    c.getattr(e.ino).await.unwrap();
    c.rename(d.ino, b"sub", e.ino, b"sub2").await.unwrap();
    assert_eq!(c.getattr(d.ino).await.unwrap().nlink, 2);
    assert_eq!(c.getattr(e.ino).await.unwrap().nlink, 3);
    assert_eq!(c.lookup(e.ino, b"sub2").await.unwrap().ino, sub.ino);
    not_found(c.lookup(d.ino, b"sub").await);

    // link and unlink: the target's link count
    let l = c.link(a.ino, d.ino, b"l").await.unwrap();
    assert_eq!(l.attr.nlink, 2);
    assert_eq!(c.lookup(e.ino, b"b").await.unwrap().nlink, 2);
    c.unlink(e.ino, b"b").await.unwrap();
    not_found(c.lookup(e.ino, b"b").await);
    assert_eq!(c.getattr(a.ino).await.unwrap().nlink, 1);
    assert_eq!(c.lookup(d.ino, b"l").await.unwrap().nlink, 1);
    assert_eq!(c.getattr(e.ino).await.unwrap(), truth(e.ino).await.unwrap());

    // unlink of a name whose dentry is not cached still drops the target's attribute
    let g = mkfile(c.inner(), ROOT_INO, "g", b"").await;
    c.inner().link(g.ino, ROOT_INO, b"g2").await.unwrap();
    assert_eq!(c.getattr(g.ino).await.unwrap().nlink, 2);
    c.unlink(ROOT_INO, b"g2").await.unwrap();
    assert_eq!(c.getattr(g.ino).await.unwrap().nlink, 1);

    // rmdir
    c.rmdir(e.ino, b"sub2").await.unwrap();
    not_found(c.lookup(e.ino, b"sub2").await);
    not_found(c.getattr(sub.ino).await);
    assert_eq!(c.getattr(e.ino).await.unwrap().nlink, 2);

    // writes, through a handle opened on the cache: size and times
    let fh = c.open(a.ino, OpenFlags::WRITE).await.unwrap();
    c.getattr(a.ino).await.unwrap();
    c.write(fh, 4, Bytes::from_static(b"more")).await.unwrap();
    assert_eq!(c.getattr(a.ino).await.unwrap().size, 8);
    c.setattr(
        a.ino,
        SetAttr {
            size: Some(2),
            ..SetAttr::default()
        },
    )
    .await
    .unwrap();
    assert_eq!(c.getattr(a.ino).await.unwrap().size, 2);
    c.write(fh, 2, Bytes::from_static(b"!")).await.unwrap();
    c.flush(fh).await.unwrap();
    c.fsync(fh).await.unwrap();
    c.release(fh).await.unwrap();
    assert_eq!(c.getattr(a.ino).await.unwrap(), truth(a.ino).await.unwrap());
    assert_eq!(c.lookup(d.ino, b"l").await.unwrap().size, 3);

    // xattrs change ctime
    let before = c.getattr(a.ino).await.unwrap();
    c.setxattr(a.ino, b"user.k", b"v", XattrMode::Upsert)
        .await
        .unwrap();
    let after = c.getattr(a.ino).await.unwrap();
    assert!(after.ctime > before.ctime);
    c.removexattr(a.ino, b"user.k").await.unwrap();
    assert!(c.getattr(a.ino).await.unwrap().ctime > after.ctime);

    // a failed mutation still invalidates (it may have been applied)
    c.getattr(d.ino).await.unwrap();
    assert!(c.mkdir(d.ino, b"l", 0o755, ME).await.is_err());
    let n = c.inner().calls("getattr");
    c.getattr(d.ino).await.unwrap();
    assert_eq!(c.inner().calls("getattr"), n + 1);
}

#[tokio::test(start_paused = true)]
async fn open_refreshes_what_another_client_changed() {
    let c = cache();
    let f = mkfile(&c, ROOT_INO, "f", b"12345").await;
    assert_eq!(c.lookup(ROOT_INO, b"f").await.unwrap().size, 5);
    // Another client appends: within the TTL the cache still says 5 …
    let fh = c.inner().open(f.ino, OpenFlags::WRITE).await.unwrap();
    c.inner()
        .write(fh, 5, Bytes::from_static(b"678"))
        .await
        .unwrap();
    c.inner().release(fh).await.unwrap();
    assert_eq!(c.getattr(f.ino).await.unwrap().size, 5);
    // … until this client opens the file.
    let fh = c.open(f.ino, OpenFlags::READ).await.unwrap();
    assert_eq!(c.getattr(f.ino).await.unwrap().size, 8);
    assert_eq!(
        c.read(fh, 0, 100).await.unwrap(),
        Bytes::from_static(b"12345678")
    );
    c.release(fh).await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn entries_expire_after_their_ttl() {
    let c = MetaCache::with_config(
        Toy::new(),
        MetaCacheConfig {
            attr_ttl: Duration::from_millis(1000),
            entry_ttl: Duration::from_millis(3000),
            ..MetaCacheConfig::default()
        },
    );
    let f = mkfile(c.inner(), ROOT_INO, "f", b"").await;
    c.lookup(ROOT_INO, b"f").await.unwrap();
    c.inner()
        .setattr(
            f.ino,
            SetAttr {
                mode: Some(0o600),
                ..SetAttr::default()
            },
        )
        .await
        .unwrap();
    tokio::time::advance(Duration::from_millis(999)).await;
    assert_eq!(
        c.getattr(f.ino).await.unwrap().mode,
        0o644,
        "stale within the TTL"
    );
    assert_eq!(c.inner().calls("getattr"), 0);
    tokio::time::advance(Duration::from_millis(1)).await;
    assert_eq!(c.getattr(f.ino).await.unwrap().mode, 0o600);
    assert_eq!(c.inner().calls("getattr"), 1);
    // The dentry lives longer: the lookup needs only the (fresh again) attribute …
    assert_eq!(c.lookup(ROOT_INO, b"f").await.unwrap().mode, 0o600);
    assert_eq!(c.inner().calls("lookup"), 1);
    // … until it expires too, and a rename by another client shows.
    c.inner()
        .rename(ROOT_INO, b"f", ROOT_INO, b"g")
        .await
        .unwrap();
    tokio::time::advance(Duration::from_millis(2000)).await;
    not_found(c.lookup(ROOT_INO, b"f").await);
    assert_eq!(c.stats().entries, 0);
}

#[tokio::test(start_paused = true)]
async fn the_cache_is_bounded() {
    let c = MetaCache::with_config(
        Toy::new(),
        MetaCacheConfig {
            capacity: 16,
            ..MetaCacheConfig::default()
        },
    );
    for i in 0..100 {
        mkfile(c.inner(), ROOT_INO, &format!("f{i}"), b"").await;
    }
    c.readdir(ROOT_INO, None, 0).await.unwrap();
    let s = c.stats();
    assert!(s.attrs <= 16 && s.entries <= 16, "{s:?}");
    // Still a working cache: what was just filled is served.
    c.lookup(ROOT_INO, b"f5").await.unwrap();
    let n = c.inner().calls("lookup");
    c.lookup(ROOT_INO, b"f5").await.unwrap();
    assert_eq!(c.inner().calls("lookup"), n);

    let off = MetaCache::with_config(
        Toy::new(),
        MetaCacheConfig {
            capacity: 0,
            ..MetaCacheConfig::default()
        },
    );
    mkfile(&off, ROOT_INO, "f", b"").await;
    off.lookup(ROOT_INO, b"f").await.unwrap();
    off.lookup(ROOT_INO, b"f").await.unwrap();
    assert_eq!(off.inner().calls("lookup"), 2);
    assert_eq!(
        off.stats(),
        CacheStats {
            hits: 0,
            misses: 2,
            attrs: 0,
            entries: 0
        }
    );
}

#[tokio::test(start_paused = true)]
async fn a_fill_racing_with_a_mutation_does_not_bring_back_stale_attributes() {
    let c = Arc::new(cache());
    let f = mkfile(c.inner(), ROOT_INO, "f", b"").await;
    let (read_done_tx, read_done) = oneshot::channel();
    let (go, go_rx) = oneshot::channel();
    *c.inner().hold_getattr.lock().unwrap() = Some(Hold {
        read_done: read_done_tx,
        go: go_rx,
    });
    // A getattr reads the old attributes underneath …
    let reader = tokio::spawn({
        let c = c.clone();
        async move { c.getattr(f.ino).await }
    });
    read_done.await.unwrap();
    // … a chmod passes through the cache before it answers …
    c.setattr(
        f.ino,
        SetAttr {
            mode: Some(0o600),
            ..SetAttr::default()
        },
    )
    .await
    .unwrap();
    go.send(()).unwrap();
    assert_eq!(reader.await.unwrap().unwrap().mode, 0o644);
    // … and its old answer is not what the cache now serves.
    assert_eq!(c.getattr(f.ino).await.unwrap().mode, 0o600);
}

/// Random operations, all through the cache (no time passes, so nothing expires): after each
/// one, every name and inode read through the cache must read as the toy says.
#[tokio::test(start_paused = true)]
async fn random_operations_through_the_cache_always_read_the_truth() {
    const NAMES: [&[u8]; 4] = [b"a", b"b", b"c", b"d"];
    for seed in 1..=20u64 {
        let c = cache();
        // Deterministic per seed.
        let mut rng = fastrand::Rng::with_seed(seed);
        let mut dirs = vec![ROOT_INO];
        let mut inos = vec![ROOT_INO];
        let mut open: Vec<Fh> = Vec::new();
        for step in 0..300 {
            let p = dirs[rng.usize(..dirs.len())];
            let q = dirs[rng.usize(..dirs.len())];
            let n = NAMES[rng.usize(..NAMES.len())];
            let m = NAMES[rng.usize(..NAMES.len())];
            let what = rng.usize(..14);
            match what {
                0 => {
                    if let Ok(a) = c.mkdir(p, n, 0o755, ME).await {
                        dirs.push(a.attr.ino);
                        inos.push(a.attr.ino);
                    }
                }
                1 => {
                    if let Ok((a, fh)) = c.create(p, n, 0o644, ME, OpenFlags::READ_WRITE).await {
                        inos.push(a.attr.ino);
                        open.push(fh);
                    }
                }
                2 => {
                    let _ = c.unlink(p, n).await;
                }
                3 => {
                    let _ = c.rmdir(p, n).await;
                }
                4 | 5 => {
                    let _ = c.rename(p, n, q, m).await;
                }
                6 => {
                    let ino = inos[rng.usize(..inos.len())];
                    let _ = c.link(ino, q, m).await;
                }
                7 => {
                    let ino = inos[rng.usize(..inos.len())];
                    let set = SetAttr {
                        mode: Some(rng.usize(..0o777) as u32),
                        size: (rng.usize(..2) == 0).then(|| rng.usize(..100) as u64),
                        ..SetAttr::default()
                    };
                    let _ = c.setattr(ino, set).await;
                }
                8 if !open.is_empty() => {
                    let fh = open[rng.usize(..open.len())];
                    let data = Bytes::from(vec![7u8; rng.usize(..50) + 1]);
                    let _ = c.write(fh, rng.usize(..100) as u64, data).await;
                }
                9 if !open.is_empty() => {
                    let fh = open.swap_remove(rng.usize(..open.len()));
                    let _ = c.release(fh).await;
                }
                10 => {
                    let ino = inos[rng.usize(..inos.len())];
                    if let Ok(fh) = c.open(ino, OpenFlags::READ).await {
                        open.push(fh);
                    }
                }
                11 => {
                    let ino = inos[rng.usize(..inos.len())];
                    let _ = c
                        .setxattr(ino, b"user.x", &[rng.usize(..255) as u8], XattrMode::Upsert)
                        .await;
                }
                12 => {
                    let _ = c.readdir(p, None, 0).await;
                }
                _ => {
                    let _ = c.symlink(p, n, b"target", ME).await;
                }
            }
            // Read everything through the cache (filling it) and compare with the truth.
            for &dir in &dirs {
                for &name in &NAMES {
                    let got = c.lookup(dir, name).await;
                    let want = c.inner().lookup(dir, name).await;
                    assert_eq!(
                        got,
                        want,
                        "seed {seed} step {step} op {what}: lookup {dir} {}",
                        String::from_utf8_lossy(name)
                    );
                }
            }
            for &ino in &inos {
                let got = c.getattr(ino).await;
                let want = c.inner().getattr(ino).await;
                assert_eq!(
                    got, want,
                    "seed {seed} step {step} op {what}: getattr {ino}"
                );
            }
        }
        assert!(c.stats().hits > 0);
    }
}

// ---------------------------------------------------------------------------------------------
// Metrics.

#[tokio::test]
async fn metrics_count_calls_errors_latency_and_bytes() {
    let mut reg = prometheus_client::registry::Registry::default();
    let m = Metrics::new(MetaCache::new(Toy::new()), &mut reg);
    let (a, fh) = m
        .create(ROOT_INO, b"f", 0o644, ME, OpenFlags::READ_WRITE)
        .await
        .unwrap();
    assert_eq!(
        m.write(fh, 0, Bytes::from(vec![1u8; 1000])).await.unwrap(),
        1000
    );
    assert_eq!(m.read(fh, 0, 4096).await.unwrap().len(), 1000);
    assert_eq!(m.read(fh, 900, 4096).await.unwrap().len(), 100);
    m.release(fh).await.unwrap();
    assert!(m.release(fh).await.is_err());
    for _ in 0..3 {
        m.lookup(ROOT_INO, b"f").await.unwrap();
    }
    not_found(m.lookup(ROOT_INO, b"missing").await);
    m.getattr(a.attr.ino).await.unwrap();

    let snap = m.snapshot();
    assert_eq!(snap["create"], (1, 0));
    assert_eq!(snap["write"], (1, 0));
    assert_eq!(snap["read"], (2, 0));
    assert_eq!(snap["release"], (2, 1));
    assert_eq!(snap["lookup"], (4, 1));
    assert_eq!(snap["getattr"], (1, 0));
    assert_eq!(snap["rename"], (0, 0));
    assert_eq!(m.bytes(), (1100, 1000));
    // The metrics count every call; the cache under them answered most lookups.
    assert_eq!(m.inner().inner().calls("lookup"), 2);

    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, &reg).unwrap();
    for line in [
        "nacre_fs_ops_total{op=\"lookup\"} 4",
        "nacre_fs_errors_total{op=\"lookup\"} 1",
        "nacre_fs_errors_total{op=\"release\"} 1",
        "nacre_fs_op_seconds_count{op=\"read\"} 2",
        "nacre_fs_read_bytes_total 1100",
        "nacre_fs_written_bytes_total 1000",
        "# TYPE nacre_fs_op_seconds histogram",
    ] {
        assert!(text.lines().any(|l| l == line), "no {line:?} in\n{text}");
    }
}
