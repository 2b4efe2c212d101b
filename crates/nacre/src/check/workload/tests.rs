//! Tests of the workload and its checker over a small in-memory file system (`MemFs`) that can
//! inject failures.

use std::sync::Arc;
use std::sync::atomic::AtomicU32;

use bytes::Bytes;
use nacre_api::meta::{Attr, DirEntry, FileType, SetAttr, XattrMode};
use nacre_client::{Caller, DirEntryPlus, Entry, Fh, StatFs};

use super::content::{Content, stream};
use super::model::{Expect, FileModel};
use super::*;

#[derive(Debug)]
enum Node {
    Dir(BTreeMap<Vec<u8>, u64>),
    File(Vec<u8>),
}

#[derive(Debug)]
struct Mem {
    nodes: BTreeMap<u64, Node>,
    handles: BTreeMap<u64, (u64, OpenFlags)>,
    next: u64,
    rng: Rng,
}

/// A small, correct in-memory file system (writes apply at once; an open with `truncate` and
/// `write` empties the file). With `fault_permille` set,
/// that share of calls fail: half before applying, half after (a write then applies a
/// random prefix), and a tenth of those never answer (the caller's timeout or stop ends them).
#[derive(Debug)]
pub(in crate::check) struct MemFs {
    m: Mutex<Mem>,
    fault_permille: AtomicU32,
}

fn enoent() -> FsError {
    MetaError::NotFound.into()
}

fn injected() -> FsError {
    unknown("injected")
}

impl Mem {
    fn attr(&self, ino: u64) -> FsResult<Attr> {
        let (kind, size) = match self.nodes.get(&ino).ok_or_else(enoent)? {
            Node::Dir(_) => (FileType::Dir, 0),
            Node::File(d) => (FileType::File, d.len() as u64),
        };
        Ok(Attr {
            ino: Ino(ino),
            kind,
            mode: 0o644,
            uid: 0,
            gid: 0,
            size,
            nlink: 1,
            rdev: 0,
            atime: 0,
            mtime: 0,
            ctime: 0,
            generation: 0,
        })
    }

    fn dir(&mut self, ino: Ino) -> FsResult<&mut BTreeMap<Vec<u8>, u64>> {
        match self.nodes.get_mut(&ino.0) {
            Some(Node::Dir(d)) => Ok(d),
            Some(_) => Err(MetaError::NotDir.into()),
            None => Err(enoent()),
        }
    }

    fn child(&mut self, parent: Ino, name: &[u8]) -> FsResult<u64> {
        self.dir(parent)?.get(name).copied().ok_or_else(enoent)
    }

    fn add(&mut self, parent: Ino, name: &[u8], node: Node) -> FsResult<Attr> {
        if self.dir(parent)?.contains_key(name) {
            return Err(MetaError::Exists.into());
        }
        self.next += 1;
        let ino = self.next;
        self.nodes.insert(ino, node);
        self.dir(parent)?.insert(name.to_vec(), ino);
        self.attr(ino)
    }

    fn open(&mut self, ino: u64, flags: OpenFlags) -> Fh {
        self.next += 1;
        self.handles.insert(self.next, (ino, flags));
        Fh(self.next)
    }

    fn file(&mut self, fh: Fh) -> FsResult<(&mut Vec<u8>, OpenFlags)> {
        let (ino, flags) = *self.handles.get(&fh.0).ok_or(FsError::BadHandle(fh.0))?;
        match self.nodes.get_mut(&ino) {
            Some(Node::File(d)) => Ok((d, flags)),
            _ => Err(MetaError::IsDir.into()),
        }
    }

    /// The directory and name of a volume path, and the inode there.
    pub(super) fn at(&mut self, path: &str) -> (Ino, Vec<u8>, Option<u64>) {
        let names: Vec<&str> = path.split('/').filter(|c| !c.is_empty()).collect();
        let (last, dirs) = names.split_last().unwrap();
        let mut dir = ROOT_INO;
        for d in dirs {
            dir = Ino(self.child(dir, d.as_bytes()).unwrap());
        }
        let ino = self.child(dir, last.as_bytes()).ok();
        (dir, last.as_bytes().to_vec(), ino)
    }

    fn data(&mut self, path: &str) -> &mut Vec<u8> {
        let ino = self.at(path).2.unwrap();
        match self.nodes.get_mut(&ino) {
            Some(Node::File(d)) => d,
            _ => panic!("{path} is not a file"),
        }
    }
}

impl MemFs {
    pub(in crate::check) fn new(seed: u64) -> Arc<Self> {
        let root = (ROOT_INO.0, Node::Dir(BTreeMap::new()));
        Arc::new(Self {
            m: Mutex::new(Mem {
                nodes: BTreeMap::from([root]),
                handles: BTreeMap::new(),
                next: ROOT_INO.0,
                rng: Rng(seed),
            }),
            fault_permille: AtomicU32::new(0),
        })
    }

    /// Changes the bytes of the file at volume path `path` (a test's damage).
    pub(in crate::check) fn edit(&self, path: &str, f: impl FnOnce(&mut Vec<u8>)) {
        f(lock(&self.m).data(path));
    }

    /// Removes the name `path` (a test's damage).
    pub(in crate::check) fn remove(&self, path: &str) {
        let mut m = lock(&self.m);
        let (dir, name, _) = m.at(path);
        m.dir(dir).unwrap().remove(&name);
    }

    /// Applies `f` (told whether the call is going to fail anyway) under the fault plan.
    async fn op<T>(&self, f: impl FnOnce(&mut Mem, bool) -> FsResult<T>) -> FsResult<T> {
        let p = u64::from(self.fault_permille.load(Relaxed));
        let (r, hang) = {
            let mut m = lock(&self.m);
            match m.rng.below(1000) {
                x if x >= p => (f(&mut m, false), false),
                x if x % 2 == 0 => (Err(injected()), false),
                x => (f(&mut m, true).and(Err(injected())), x < p / 5),
            }
        };
        if hang {
            std::future::pending::<()>().await;
        }
        r
    }
}

/// Trait methods the workload never calls.
macro_rules! unsupported {
    ($($name:ident($($arg:ty),*) -> $t:ty;)*) => {$(
        async fn $name(&self, $(_: $arg),*) -> FsResult<$t> {
            Err(MetaError::Invalid("unsupported".into()).into())
        }
    )*};
}

impl FileSystem for MemFs {
    async fn lookup(&self, parent: Ino, name: &[u8]) -> FsResult<Attr> {
        self.op(|m, _| m.child(parent, name).and_then(|i| m.attr(i)))
            .await
    }

    async fn getattr(&self, ino: Ino) -> FsResult<Attr> {
        self.op(|m, _| m.attr(ino.0)).await
    }

    async fn setattr(&self, ino: Ino, set: SetAttr) -> FsResult<Attr> {
        self.op(|m, _| {
            if let (Some(size), Some(Node::File(d))) = (set.size, m.nodes.get_mut(&ino.0)) {
                d.resize(size as usize, 0);
            }
            m.attr(ino.0)
        })
        .await
    }

    async fn create(
        &self,
        parent: Ino,
        name: &[u8],
        _: u32,
        _: Caller,
        flags: OpenFlags,
    ) -> FsResult<(Entry, Fh)> {
        self.op(|m, _| {
            let attr = m.add(parent, name, Node::File(Vec::new()))?;
            let fh = m.open(attr.ino.0, flags);
            Ok((Entry::bare(attr), fh))
        })
        .await
    }

    async fn mkdir(&self, parent: Ino, name: &[u8], _: u32, _: Caller) -> FsResult<Entry> {
        self.op(|m, _| {
            let attr = m.add(parent, name, Node::Dir(BTreeMap::new()))?;
            Ok(Entry::bare(attr))
        })
        .await
    }

    async fn unlink(&self, parent: Ino, name: &[u8]) -> FsResult<Vec<Attr>> {
        self.op(|m, _| {
            m.child(parent, name)?;
            m.dir(parent)?.remove(name);
            Ok(Vec::new())
        })
        .await
    }

    async fn rename(&self, p: Ino, name: &[u8], np: Ino, new_name: &[u8]) -> FsResult<Vec<Attr>> {
        self.op(|m, _| {
            let ino = m.child(p, name)?;
            m.dir(np)?;
            m.dir(p)?.remove(name);
            m.dir(np)?.insert(new_name.to_vec(), ino);
            Ok(Vec::new())
        })
        .await
    }

    async fn readdir(
        &self,
        dir: Ino,
        after: Option<Vec<u8>>,
        limit: u32,
    ) -> FsResult<Vec<DirEntryPlus>> {
        self.op(|m, _| {
            let limit = if limit == 0 {
                usize::MAX
            } else {
                limit as usize
            };
            let after = after.unwrap_or_default();
            let entries: Vec<(Vec<u8>, u64)> = m
                .dir(dir)?
                .iter()
                .filter(|(n, _)| after.is_empty() || **n > after)
                .take(limit)
                .map(|(n, i)| (n.clone(), *i))
                .collect();
            let plus = entries.into_iter().map(|(name, ino)| {
                let attr = m.attr(ino).ok();
                let kind = attr.as_ref().map_or(FileType::File, |a| a.kind);
                let entry = DirEntry {
                    name,
                    ino: Ino(ino),
                    kind,
                };
                DirEntryPlus { entry, attr }
            });
            Ok(plus.collect())
        })
        .await
    }

    async fn open(&self, ino: Ino, flags: OpenFlags) -> FsResult<Fh> {
        self.op(|m, _| {
            m.attr(ino.0)?;
            if let (true, Some(Node::File(d))) =
                (flags.truncate && flags.write, m.nodes.get_mut(&ino.0))
            {
                d.clear();
            }
            Ok(m.open(ino.0, flags))
        })
        .await
    }

    async fn read(&self, fh: Fh, offset: u64, len: u32) -> FsResult<Bytes> {
        self.op(|m, _| {
            let (d, _) = m.file(fh)?;
            let from = (offset as usize).min(d.len());
            let to = (from + len as usize).min(d.len());
            Ok(Bytes::copy_from_slice(&d[from..to]))
        })
        .await
    }

    async fn write(&self, fh: Fh, offset: u64, data: Bytes) -> FsResult<u32> {
        self.op(|m, failing| {
            let n = if failing {
                m.rng.below(data.len() as u64 + 1) as usize
            } else {
                data.len()
            };
            let (d, flags) = m.file(fh)?;
            let at = if flags.append {
                d.len()
            } else {
                offset as usize
            };
            if d.len() < at + n {
                d.resize(at + n, 0);
            }
            d[at..at + n].copy_from_slice(&data[..n]);
            Ok(n as u32)
        })
        .await
    }

    async fn flush(&self, fh: Fh) -> FsResult<()> {
        self.op(|m, _| m.file(fh).map(|_| ())).await
    }

    async fn fsync(&self, fh: Fh) -> FsResult<()> {
        self.flush(fh).await
    }

    async fn release(&self, fh: Fh) -> FsResult<()> {
        self.op(|m, _| {
            let h = m.handles.remove(&fh.0);
            h.map(|_| ()).ok_or(FsError::BadHandle(fh.0))
        })
        .await
    }

    unsupported! {
        symlink(Ino, &[u8], &[u8], Caller) -> Entry;
        mknod(Ino, &[u8], FileType, u32, u32, Caller) -> Entry;
        link(Ino, Ino, &[u8]) -> Entry;
        rmdir(Ino, &[u8]) -> Vec<Attr>;
        readlink(Ino) -> Vec<u8>;
        statfs() -> StatFs;
        getxattr(Ino, &[u8]) -> Vec<u8>;
        setxattr(Ino, &[u8], &[u8], XattrMode) -> ();
        listxattr(Ino) -> Vec<Vec<u8>>;
        removexattr(Ino, &[u8]) -> ();
    }
}

fn config(clients: usize, seed: u64, ops: Option<u64>) -> WorkloadConfig {
    WorkloadConfig {
        clients,
        seed,
        root: "check".into(),
        max_file_bytes: 384 * KIB,
        max_files_per_client: 12,
        ops_limit: ops,
    }
}

/// The workload through `MountFs` on a plain directory (what `--fuse` runs on a mount): every
/// call the workload makes works through POSIX calls, and the checker, reading back through
/// them too, finds everything.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_workload_runs_through_posix_calls() {
    let dir = tempfile::tempdir().unwrap();
    let fs = Arc::new(crate::check::mountfs::MountFs::new(
        dir.path().to_path_buf(),
    ));
    let w = Arc::new(Workload::new(config(2, 3, Some(200)), None).unwrap());
    let (_tx, rx) = watch::channel(false);
    let mut set = tokio::task::JoinSet::new();
    for id in 0..2 {
        let (w, fs, rx) = (w.clone(), fs.clone(), rx.clone());
        set.spawn(async move { w.run_client(id, &*fs, rx).await });
    }
    while let Some(r) = set.join_next().await {
        r.unwrap();
    }
    let s = w.stats().snapshot();
    assert_eq!((s.failed, s.gave_up), (0, 0), "{s:?}");
    assert!(s.acked > 200 && s.reads_verified > 0, "{s:?}");
    let r = w.verify(&*fs).await;
    assert!(r.findings.is_empty(), "{r}");
    assert!(r.files_checked > 5, "{r}");
}

/// Runs every client of `w` on `fs` as tasks; `stop_after` acknowledged ops, stops them.
async fn run(w: &Arc<Workload>, fs: &Arc<MemFs>, stop_after: Option<u64>) {
    let (tx, rx) = watch::channel(false);
    let mut set = tokio::task::JoinSet::new();
    for id in 0..w.cfg.clients {
        let (w, fs, rx) = (w.clone(), fs.clone(), rx.clone());
        set.spawn(async move { w.run_client(id, &*fs, rx).await });
    }
    if let Some(n) = stop_after {
        // Sleeping, not yielding: paused time moves only when every task waits, and the
        // clients' hung calls need it to move.
        while w.stats().snapshot().acked < n {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        tx.send(true).unwrap();
    }
    while let Some(r) = set.join_next().await {
        r.unwrap();
    }
    assert_eq!(w.stats().snapshot().gave_up, 0);
}

#[tokio::test(start_paused = true)]
async fn a_run_without_faults_checks_clean() {
    let fs = MemFs::new(1);
    let log = tempfile::NamedTempFile::new().unwrap();
    let cfg = config(3, 7, Some(300));
    let w = Arc::new(Workload::new(cfg, Some(log.path().to_path_buf())).unwrap());
    run(&w, &fs, None).await;
    let r = w.verify(&*fs).await;
    assert!(r.findings.is_empty(), "{r}");
    let s = w.stats().snapshot();
    assert_eq!((s.failed, s.uncertain), (0, 0));
    assert!(s.reads_verified > 10 && s.acked_bytes > 0, "{s:?}");
    assert_eq!(r.acked_ops, s.acked);
    assert!(r.acked_ops > 300 && r.files_checked > 10, "{r}");
    // One JSON line per acknowledged op.
    let text = std::fs::read_to_string(log.path()).unwrap();
    assert_eq!(text.lines().count() as u64, s.acked);
    let first: serde_json::Value = serde_json::from_str(text.lines().next().unwrap()).unwrap();
    assert!(
        first["crc32c"].is_u64() && first["path"].is_string(),
        "{first}"
    );
}

#[tokio::test(start_paused = true)]
async fn injected_failures_leave_only_allowed_outcomes() {
    for seed in 1..=2 {
        let fs = MemFs::new(seed);
        fs.fault_permille.store(150, Relaxed);
        let w = Arc::new(Workload::new(config(3, seed, Some(300)), None).unwrap());
        run(&w, &fs, None).await;
        fs.fault_permille.store(0, Relaxed);
        let r = w.verify(&*fs).await;
        // Half the injected failures come after the call applied: the checker tells the creates,
        // renames and unlinks among them that turned out applied.
        let (applied, others) = false_failures(&r.findings);
        assert!(others.is_empty(), "seed {seed}: {r}");
        assert!(!applied.is_empty(), "seed {seed}: {r}");
        let s = w.stats().snapshot();
        assert!(s.failed > 50 && s.uncertain > 20 && s.acked > 100, "{s:?}");
        // Injected failures are `Unknown` outcomes, which an application sees as EIO.
        let eio = s.errors.get("EIO").copied().unwrap_or(0);
        assert!(eio > 50 && eio <= s.failed && s.errors.len() == 1, "{s:?}");

        // A byte that is neither the acknowledged nor the attempted one is found, in an
        // uncertain file too (a zero is not acceptable just because writes failed).
        let (path, at) = {
            let m = lock(&w.models[0]);
            let (rel, e, at) = m
                .uncertain
                .iter()
                .filter(|ws| ws.len() == 1)
                .filter_map(|ws| ws[0].paths[0].1.as_ref().map(|e| (&ws[0].paths[0].0, e)))
                .find_map(|(rel, e)| {
                    let len = e.a.len.min(e.b.as_ref().map_or(0, |b| b.len));
                    (len > 0).then_some((rel.clone(), e.clone(), len / 2))
                })
                .expect("an uncertain write");
            let (a, b) = (e.a.bytes(), e.b.as_ref().unwrap().bytes());
            let v = (0..=255u8).find(|v| *v != a[at as usize] && *v != b[at as usize]);
            (format!("/check/c0/{rel}"), (at, v.unwrap()))
        };
        {
            let mut m = lock(&fs.m);
            let d = m.data(&path);
            d[at.0 as usize] = at.1;
        }
        let r = w.verify(&*fs).await;
        let (_, others) = false_failures(&r.findings);
        assert!(
            matches!(&others[..], [Finding::Wrong { path: p, offset, .. }]
                if *p == path && *offset == at.0),
            "{r}"
        );
    }
}

#[tokio::test(start_paused = true)]
async fn stopping_abandons_ops_without_losing_any() {
    let fs = MemFs::new(9);
    fs.fault_permille.store(100, Relaxed);
    let w = Arc::new(Workload::new(config(4, 9, None), None).unwrap());
    run(&w, &fs, Some(400)).await;
    fs.fault_permille.store(0, Relaxed);
    let r = w.verify(&*fs).await;
    assert!(false_failures(&r.findings).1.is_empty(), "{r}");
    assert!(r.acked_ops >= 400, "{r}");
}

/// The findings of failed calls that turned out applied, and the others.
fn false_failures(findings: &[Finding]) -> (Vec<Finding>, Vec<Finding>) {
    findings
        .iter()
        .cloned()
        .partition(|f| matches!(f, Finding::FailedButApplied { .. }))
}

#[tokio::test(start_paused = true)]
async fn real_losses_are_found() {
    let fs = MemFs::new(5);
    let w = Arc::new(Workload::new(config(1, 5, Some(300)), None).unwrap());
    run(&w, &fs, None).await;
    let files: Vec<(String, FileModel)> = lock(&w.models[0])
        .files
        .iter()
        .filter(|(_, f)| f.content.len >= 2)
        .map(|(p, f)| (format!("/check/c0/{p}"), f.clone()))
        .take(3)
        .collect();
    let [(flip, f1), (gone, f2), (short, f3)] = &files[..] else {
        panic!("too few files: {files:?}");
    };
    let (l1, l2, l3) = (f1.content.len, f2.content.len, f3.content.len);
    {
        let mut m = lock(&fs.m);
        m.data(flip)[l1 as usize / 2] ^= 0x5a;
        m.data(short).truncate(l3 as usize - 1);
        let (dir, name, _) = m.at(gone);
        m.dir(dir).unwrap().remove(&name);
        let a = m.at("/check/c0/a").2.unwrap();
        let stray = m.add(Ino(a), b"stray", Node::File(vec![7; 10])).unwrap();
        assert_eq!(stray.size, 10);
    }
    let r = w.verify(&*fs).await;
    let want = [
        Finding::Wrong {
            path: flip.clone(),
            offset: l1 / 2,
            differing_bytes: 1,
            expected_size: l1,
            actual_size: l1,
        },
        Finding::Missing {
            path: gone.clone(),
            acked_size: l2,
        },
        Finding::Wrong {
            path: short.clone(),
            offset: l3 - 1,
            differing_bytes: 1,
            expected_size: l3,
            actual_size: l3 - 1,
        },
        Finding::Unexpected {
            path: "/check/c0/a/stray".into(),
            size: 10,
        },
    ];
    for f in &want {
        assert!(r.findings.contains(f), "{f} not in\n{r}");
    }
    assert_eq!(r.findings.len(), want.len(), "{r}");
    assert_eq!(r.lost_ops, 3 + f1.ops + f2.ops + f3.ops);
    let shown = r.to_string();
    assert!(
        shown.contains("missing: ") && shown.contains("unexpected: "),
        "{shown}"
    );
}

#[test]
fn a_failed_write_allows_old_or_new_bytes_only() {
    let a = Content::default().written(0, 100, 1);
    let b = a.written(50, 100, 2);
    let e = Expect {
        a: a.clone(),
        b: Some(b.clone()),
        ops: 1,
    };
    let (ab, bb) = (a.bytes(), b.bytes());
    // Every byte from either, any length in between.
    let mut mixed = bb.clone();
    mixed[60..70].copy_from_slice(&ab[60..70]);
    assert_eq!(e.mismatch(150, &mixed), None);
    assert_eq!(e.mismatch(120, &bb[..120]), None);
    assert_eq!(e.mismatch(100, &ab), None);
    // Too short, too long, a zero neither wrote, a size the bytes do not bear out.
    assert_eq!(e.mismatch(99, &ab[..99]), Some((99, 1)));
    let mut long = bb.clone();
    long.push(0);
    assert_eq!(e.mismatch(151, &long), Some((150, 1)));
    let mut zero = mixed.clone();
    let i = (70..150).find(|&i| bb[i] != 0).unwrap();
    zero[i] = 0;
    assert_eq!(e.mismatch(150, &zero), Some((i as u64, 1)));
    assert_eq!(e.mismatch(150, &bb[..140]), Some((140, 10)));
    // Segments cut anywhere keep naming the same bytes.
    let t = b.resized(120).written(10, 5, 3).resized(200);
    let mut want = bb[..120].to_vec();
    want[10..15].copy_from_slice(&stream(3, 5));
    want.resize(200, 0);
    assert_eq!(t.bytes(), want);
}
