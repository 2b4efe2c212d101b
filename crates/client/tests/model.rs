//! The metadata workflows over several in-memory meta partitions, checked against a naive POSIX
//! model; and the same workflows with failures injected between their steps, checked for the CFS
//! invariant: every reachable dentry points to a live inode whose link count covers its names.
#![allow(clippy::unwrap_used)] // test helpers outside #[test] fns

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use nacre_api::meta::{Attr, Command, FileType, MetaError, Query, ROOT_INO, Reply};
use nacre_client::{CallError, FsError, FsResult, MetaFs, MetaRange, MetaTransport, NewInode};
use nacre_meta::MetaPartition;
use nacre_types::{Ino, PartitionId};
use proptest::prelude::*;

/// What happens to the next write calls.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Fault {
    None,
    /// Refused before applying.
    NotApplied,
    /// Applied, but the reply is lost.
    AppliedLost,
    /// Not applied, and the caller cannot tell.
    LostRequest,
}

/// Meta partitions in memory: three ranges, the last open-ended (small ranges so that inodes spread).
struct MemMeta {
    parts: Mutex<Vec<(MetaRange, MetaPartition)>>,
    clock: AtomicU64,
    /// Faults for the coming write calls, in order (then none).
    faults: Mutex<Vec<Fault>>,
    /// The number of commands of every write-behind batch applied.
    batches: Mutex<Vec<usize>>,
}

impl MemMeta {
    fn new() -> Self {
        let ranges = [(1, 40), (40, 80), (80, u64::MAX)];
        let parts = ranges
            .iter()
            .enumerate()
            .map(|(i, &(s, e))| {
                (
                    MetaRange {
                        id: PartitionId(i as u64 + 1),
                        start: s,
                        end: e,
                        writable: true,
                    },
                    MetaPartition::new(s, e),
                )
            })
            .collect();
        Self {
            parts: Mutex::new(parts),
            clock: AtomicU64::new(1_000),
            faults: Mutex::new(Vec::new()),
            batches: Mutex::new(Vec::new()),
        }
    }

    fn next_fault(&self) -> Fault {
        let mut f = self.faults.lock().unwrap();
        if f.is_empty() {
            Fault::None
        } else {
            f.remove(0)
        }
    }
}

impl MetaTransport for MemMeta {
    fn partitions(&self) -> std::sync::Arc<[MetaRange]> {
        self.parts
            .lock()
            .unwrap()
            .iter()
            .map(|(r, _)| r.clone())
            .collect()
    }

    async fn write(
        &self,
        partition: PartitionId,
        cmd: Command,
    ) -> Result<Result<Reply, MetaError>, CallError> {
        let fault = self.next_fault();
        match fault {
            Fault::NotApplied => return Err(CallError::NotApplied("injected".into())),
            Fault::LostRequest => return Err(CallError::Unknown("injected".into())),
            _ => {}
        }
        let now = self.clock.fetch_add(1, Ordering::Relaxed);
        let mut parts = self.parts.lock().unwrap();
        let (_, p) = parts
            .iter_mut()
            .find(|(r, _)| r.id == partition)
            .ok_or_else(|| CallError::NotApplied("no such partition".into()))?;
        let r = p.apply(now, &cmd);
        if let Command::Batch { ops, .. } = &cmd {
            self.batches.lock().unwrap().push(ops.len());
        }
        if fault == Fault::AppliedLost {
            return Err(CallError::Unknown("injected".into()));
        }
        Ok(r)
    }

    async fn read(
        &self,
        partition: PartitionId,
        query: Query,
    ) -> Result<Result<Reply, MetaError>, CallError> {
        let parts = self.parts.lock().unwrap();
        let (_, p) = parts
            .iter()
            .find(|(r, _)| r.id == partition)
            .ok_or_else(|| CallError::NotApplied("no such partition".into()))?;
        Ok(p.query(&query))
    }
}

// ---------------------------------------------------------------------------------------------
// The naive model: a tree of nodes with link counts.

#[derive(Clone, Debug)]
struct MNode {
    kind: FileType,
    mode: u32,
    children: BTreeMap<Vec<u8>, usize>,
}

#[derive(Clone, Debug)]
struct Model {
    nodes: Vec<MNode>,
    parent: Vec<usize>,
}

impl Model {
    fn new() -> Self {
        Self {
            nodes: vec![MNode {
                kind: FileType::Dir,
                mode: 0o755,
                children: BTreeMap::new(),
            }],
            parent: vec![0],
        }
    }

    fn nlink(&self, id: usize) -> u32 {
        let names = self
            .nodes
            .iter()
            .flat_map(|n| n.children.values())
            .filter(|&&c| c == id)
            .count() as u32;
        if self.nodes[id].kind == FileType::Dir {
            2 + self.nodes[id]
                .children
                .values()
                .filter(|&&c| self.nodes[c].kind == FileType::Dir)
                .count() as u32
        } else {
            names
        }
    }

    fn lookup(&self, dir: usize, name: &[u8]) -> Result<usize, MetaError> {
        self.nodes[dir]
            .children
            .get(name)
            .copied()
            .ok_or(MetaError::NotFound)
    }

    fn create(
        &mut self,
        dir: usize,
        name: &[u8],
        kind: FileType,
        mode: u32,
    ) -> Result<(), MetaError> {
        nacre_api::meta::check_name(name)?;
        if self.nodes[dir].children.contains_key(name) {
            return Err(MetaError::Exists);
        }
        self.nodes.push(MNode {
            kind,
            mode,
            children: BTreeMap::new(),
        });
        self.parent.push(dir);
        let id = self.nodes.len() - 1;
        self.nodes[dir].children.insert(name.to_vec(), id);
        Ok(())
    }

    fn unlink(&mut self, dir: usize, name: &[u8]) -> Result<(), MetaError> {
        let id = self.lookup(dir, name)?;
        if self.nodes[id].kind == FileType::Dir {
            return Err(MetaError::IsDir);
        }
        self.nodes[dir].children.remove(name);
        Ok(())
    }

    fn rmdir(&mut self, dir: usize, name: &[u8]) -> Result<(), MetaError> {
        let id = self.lookup(dir, name)?;
        if self.nodes[id].kind != FileType::Dir {
            return Err(MetaError::NotDir);
        }
        if !self.nodes[id].children.is_empty() {
            return Err(MetaError::NotEmpty);
        }
        self.nodes[dir].children.remove(name);
        Ok(())
    }

    fn link(
        &mut self,
        src_dir: usize,
        src: &[u8],
        dir: usize,
        name: &[u8],
    ) -> Result<(), MetaError> {
        let id = self.lookup(src_dir, src)?;
        nacre_api::meta::check_name(name)?;
        if self.nodes[id].kind == FileType::Dir {
            return Err(MetaError::IsDir);
        }
        if self.nodes[dir].children.contains_key(name) {
            return Err(MetaError::Exists);
        }
        self.nodes[dir].children.insert(name.to_vec(), id);
        Ok(())
    }

    fn is_ancestor(&self, a: usize, mut x: usize) -> bool {
        loop {
            if x == a {
                return true;
            }
            if x == 0 {
                return false;
            }
            x = self.parent[x];
        }
    }

    fn rename(&mut self, sd: usize, sn: &[u8], dd: usize, dn: &[u8]) -> Result<(), MetaError> {
        let id = self.lookup(sd, sn)?;
        nacre_api::meta::check_name(dn)?;
        if sd == dd && sn == dn {
            return Ok(());
        }
        if let Ok(d) = self.lookup(dd, dn) {
            if d == id {
                return Ok(());
            }
            match (
                self.nodes[id].kind == FileType::Dir,
                self.nodes[d].kind == FileType::Dir,
            ) {
                (false, true) => return Err(MetaError::IsDir),
                (true, false) => return Err(MetaError::NotDir),
                (true, true) if !self.nodes[d].children.is_empty() => {
                    return Err(MetaError::NotEmpty);
                }
                _ => {}
            }
        }
        if self.nodes[id].kind == FileType::Dir && sd != dd && self.is_ancestor(id, dd) {
            return Err(MetaError::Invalid(String::new()));
        }
        self.nodes[sd].children.remove(sn);
        self.nodes[dd].children.insert(dn.to_vec(), id);
        if self.nodes[id].kind == FileType::Dir {
            self.parent[id] = dd;
        }
        Ok(())
    }

    /// Live directories reachable from the root, as (model id, path).
    fn dirs(&self) -> Vec<(usize, Vec<Vec<u8>>)> {
        let mut out = vec![(0, Vec::new())];
        let mut i = 0;
        while i < out.len() {
            let (id, path) = out[i].clone();
            for (name, &c) in &self.nodes[id].children {
                if self.nodes[c].kind == FileType::Dir {
                    let mut p = path.clone();
                    p.push(name.clone());
                    out.push((c, p));
                }
            }
            i += 1;
        }
        out
    }
}

#[derive(Clone, Debug)]
enum Op {
    Create {
        dir: usize,
        name: u8,
        kind: u8,
    },
    Unlink {
        dir: usize,
        name: u8,
    },
    Rmdir {
        dir: usize,
        name: u8,
    },
    Link {
        sdir: usize,
        sname: u8,
        dir: usize,
        name: u8,
    },
    Rename {
        sdir: usize,
        sname: u8,
        dir: usize,
        name: u8,
    },
    Chmod {
        dir: usize,
        name: u8,
        mode: u16,
    },
}

fn name(n: u8) -> Vec<u8> {
    format!("n{}", n % 6).into_bytes()
}

fn arb_op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (any::<usize>(), any::<u8>(), 0u8..3).prop_map(|(dir, name, kind)| Op::Create { dir, name, kind }),
        1 => (any::<usize>(), any::<u8>()).prop_map(|(dir, name)| Op::Unlink { dir, name }),
        1 => (any::<usize>(), any::<u8>()).prop_map(|(dir, name)| Op::Rmdir { dir, name }),
        1 => (any::<usize>(), any::<u8>(), any::<usize>(), any::<u8>())
            .prop_map(|(sdir, sname, dir, name)| Op::Link { sdir, sname, dir, name }),
        2 => (any::<usize>(), any::<u8>(), any::<usize>(), any::<u8>())
            .prop_map(|(sdir, sname, dir, name)| Op::Rename { sdir, sname, dir, name }),
        1 => (any::<usize>(), any::<u8>(), any::<u16>()).prop_map(|(dir, name, mode)| Op::Chmod { dir, name, mode }),
    ]
}

fn block_on<F: std::future::Future>(f: F) -> F::Output {
    tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap()
        .block_on(f)
}

/// Creates arriving one by one in a directory the client owns go to the partition as one batch:
/// while nobody waits for the queue it lingers for more. A settle does not wait for the linger.
#[test]
fn creates_written_behind_share_a_batch_and_a_settle_does_not_linger() {
    tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()
        .unwrap()
        .block_on(async {
            let fs = MetaFs::with_write_behind(MemMeta::new());
            let dir = fs
                .create(ROOT_INO, b"d", &NewInode::dir(0o755, 1, 1))
                .await
                .unwrap()
                .attr
                .ino;
            fs.settle().await.unwrap();
            let file = NewInode::file(0o644, 1, 1);
            let batches = || fs.transport().batches.lock().unwrap().clone();
            let start = batches().len();
            // (The partitions here hold a few dozen inodes each.)
            for i in 0..20 {
                fs.create(dir, format!("f{i}").as_bytes(), &file)
                    .await
                    .unwrap();
                // Lets the queue's pump run between two creates (time stands still meanwhile).
                tokio::task::yield_now().await;
            }
            // Past the linger; then the pump sends (a bounded number of turns).
            tokio::time::advance(Duration::from_millis(3)).await;
            for _ in 0..100 {
                if batches().len() > start {
                    break;
                }
                tokio::task::yield_now().await;
            }
            assert_eq!(batches()[start..], [20], "one batch for the burst");

            let t = tokio::time::Instant::now();
            for i in 0..3 {
                fs.create(dir, format!("g{i}").as_bytes(), &file)
                    .await
                    .unwrap();
            }
            fs.settle().await.unwrap();
            assert_eq!(
                t.elapsed(),
                Duration::ZERO,
                "the settle sent the batch at once"
            );
            assert_eq!(batches()[start + 1..], [3]);
        });
}

/// A directory the client made stays its own while the client lives: the poller renews its
/// delegation before it ends, so creates there are still written behind long after.
#[test]
fn directories_a_client_made_stay_its_own() {
    tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()
        .unwrap()
        .block_on(async {
            let fs = MetaFs::with_write_behind(MemMeta::new());
            let dir = fs
                .create(ROOT_INO, b"d", &NewInode::dir(0o755, 1, 1))
                .await
                .unwrap()
                .attr
                .ino;
            fs.settle().await.unwrap();
            // Three delegations' length, in the poller's steps.
            let steps = 3 * nacre_api::meta::DELEGATION_NS / 100_000_000;
            for _ in 0..steps {
                tokio::time::advance(Duration::from_millis(100)).await;
                tokio::task::yield_now().await;
            }
            let batches = || fs.transport().batches.lock().unwrap().clone();
            let start = batches().len();
            fs.create(dir, b"f", &NewInode::file(0o644, 1, 1))
                .await
                .unwrap();
            fs.settle().await.unwrap();
            assert_eq!(
                batches()[start..],
                [1],
                "the create went behind, in a batch"
            );
        });
}

/// The inode of a directory path in the real file system.
async fn resolve(fs: &MetaFs<impl MetaTransport>, path: &[Vec<u8>]) -> Ino {
    let mut ino = ROOT_INO;
    for c in path {
        ino = fs.lookup_dentry(ino, c).await.unwrap().ino;
    }
    ino
}

/// Checks that directory attributes a call returned are what the partitions hold now (the model
/// test runs one call at a time), and drops them.
async fn dirs_fresh(fs: &MetaFs<impl MetaTransport>, r: FsResult<Vec<Attr>>) -> FsResult<()> {
    for d in r? {
        assert_eq!(
            fs.getattr(d.ino).await.unwrap(),
            d,
            "returned parent attributes"
        );
    }
    Ok(())
}

fn kind_of(k: u8) -> FileType {
    match k % 3 {
        0 => FileType::File,
        1 => FileType::Dir,
        _ => FileType::Symlink,
    }
}

fn same_error(real: &Result<(), FsError>, model: &Result<(), MetaError>) -> bool {
    match (real, model) {
        (Ok(()), Ok(())) => true,
        (Err(FsError::Meta(MetaError::Invalid(_))), Err(MetaError::Invalid(_))) => true,
        (Err(FsError::Meta(a)), Err(b)) => a == b,
        _ => false,
    }
}

/// Applies one op to both; returns (real result, model result).
async fn step(
    fs: &MetaFs<impl MetaTransport>,
    model: &mut Model,
    op: &Op,
) -> (Result<(), FsError>, Result<(), MetaError>) {
    let dirs = model.dirs();
    let pick = |i: usize| dirs[i % dirs.len()].clone();
    match op {
        Op::Create { dir, name: n, kind } => {
            let (mid, path) = pick(*dir);
            let parent = resolve(fs, &path).await;
            let k = kind_of(*kind);
            let new = match k {
                FileType::Dir => NewInode::dir(0o755, 1, 1),
                FileType::Symlink => NewInode::symlink(b"target", 1, 1),
                _ => NewInode::file(0o644, 1, 1),
            };
            let mode = new.mode;
            let real = fs.create(parent, &name(*n), &new).await;
            let real = dirs_fresh(fs, real.map(|e| e.parent.into_iter().collect())).await;
            (real, model.create(mid, &name(*n), k, mode))
        }
        Op::Unlink { dir, name: n } => {
            let (mid, path) = pick(*dir);
            let parent = resolve(fs, &path).await;
            (
                dirs_fresh(fs, fs.unlink(parent, &name(*n)).await).await,
                model.unlink(mid, &name(*n)),
            )
        }
        Op::Rmdir { dir, name: n } => {
            let (mid, path) = pick(*dir);
            let parent = resolve(fs, &path).await;
            (
                dirs_fresh(fs, fs.rmdir(parent, &name(*n)).await).await,
                model.rmdir(mid, &name(*n)),
            )
        }
        Op::Link {
            sdir,
            sname,
            dir,
            name: n,
        } => {
            let (smid, spath) = pick(*sdir);
            let (mid, path) = pick(*dir);
            let sparent = resolve(fs, &spath).await;
            let parent = resolve(fs, &path).await;
            let real = match fs.lookup_dentry(sparent, &name(*sname)).await {
                Ok(d) => {
                    let r = fs.link(d.ino, parent, &name(*n)).await;
                    dirs_fresh(fs, r.map(|e| e.parent.into_iter().collect())).await
                }
                Err(e) => Err(e),
            };
            (real, model.link(smid, &name(*sname), mid, &name(*n)))
        }
        Op::Rename {
            sdir,
            sname,
            dir,
            name: n,
        } => {
            let (smid, spath) = pick(*sdir);
            let (mid, path) = pick(*dir);
            let sparent = resolve(fs, &spath).await;
            let parent = resolve(fs, &path).await;
            let real = fs.rename(sparent, &name(*sname), parent, &name(*n)).await;
            let real = dirs_fresh(fs, real).await;
            (real, model.rename(smid, &name(*sname), mid, &name(*n)))
        }
        Op::Chmod { dir, name: n, mode } => {
            let (mid, path) = pick(*dir);
            let parent = resolve(fs, &path).await;
            let mode = u32::from(*mode) & 0o7777;
            let real = match fs.lookup_dentry(parent, &name(*n)).await {
                Ok(d) => fs
                    .setattr(
                        d.ino,
                        nacre_api::meta::SetAttr {
                            mode: Some(mode),
                            ..Default::default()
                        },
                    )
                    .await
                    .map(|_| ()),
                Err(e) => Err(e),
            };
            let m = model
                .lookup(mid, &name(*n))
                .map(|id| model.nodes[id].mode = mode);
            (real, m)
        }
    }
}

/// Compares the whole reachable tree: names, kinds, modes and link counts.
async fn compare_trees(fs: &MetaFs<impl MetaTransport>, model: &Model) -> Result<(), String> {
    let mut stack = vec![(ROOT_INO, 0usize)];
    while let Some((ino, mid)) = stack.pop() {
        let attr = fs.getattr(ino).await.map_err(|e| e.to_string())?;
        if attr.nlink != model.nlink(mid) {
            return Err(format!(
                "nlink of {ino}: {} vs model {}",
                attr.nlink,
                model.nlink(mid)
            ));
        }
        if attr.mode != model.nodes[mid].mode {
            return Err(format!(
                "mode of {ino}: {:o} vs {:o}",
                attr.mode, model.nodes[mid].mode
            ));
        }
        if attr.kind != FileType::Dir {
            continue;
        }
        let entries = fs
            .readdir_plus(ino, None, 0)
            .await
            .map_err(|e| e.to_string())?;
        let names: Vec<&[u8]> = entries.iter().map(|(e, _)| e.name.as_slice()).collect();
        let want: Vec<&[u8]> = model.nodes[mid]
            .children
            .keys()
            .map(Vec::as_slice)
            .collect();
        if names != want {
            return Err(format!("entries of {ino}: {names:?} vs model {want:?}"));
        }
        for (e, a) in entries {
            let c = model.nodes[mid].children[&e.name];
            if e.kind != model.nodes[c].kind {
                return Err(format!("kind of {:?}", e.name));
            }
            if a.as_ref().map(|a| a.nlink) != Some(model.nlink(c)) {
                return Err(format!("readdir-plus attr of {:?}: {a:?}", e.name));
            }
            let looked = fs.lookup(ino, &e.name).await.map_err(|e| e.to_string())?;
            if Some(&looked) != a.as_ref() {
                return Err(format!(
                    "lookup of {:?}: {looked:?} vs readdir-plus {a:?}",
                    e.name
                ));
            }
            stack.push((e.ino, c));
        }
    }
    Ok(())
}

/// Every dentry reachable from the root points to a live inode, and a file's link count is at least
/// the number of its reachable names.
async fn check_invariant(fs: &MetaFs<impl MetaTransport>) -> Result<(), String> {
    let mut names: BTreeMap<Ino, u32> = BTreeMap::new();
    let mut stack = vec![ROOT_INO];
    let mut seen = std::collections::BTreeSet::new();
    while let Some(dir) = stack.pop() {
        if !seen.insert(dir) {
            continue;
        }
        let entries = fs.readdir(dir, None, 0).await.map_err(|e| e.to_string())?;
        for e in entries {
            let a = fs.getattr(e.ino).await.map_err(|err| {
                format!("dentry {:?} in {dir} points to {}: {err}", e.name, e.ino)
            })?;
            if a.nlink == 0 {
                return Err(format!(
                    "dentry {:?} points to deleted inode {}",
                    e.name, e.ino
                ));
            }
            if a.kind == FileType::Dir {
                stack.push(e.ino);
            } else {
                *names.entry(e.ino).or_default() += 1;
            }
        }
    }
    for (ino, n) in names {
        let a = fs.getattr(ino).await.map_err(|e| e.to_string())?;
        if a.nlink < n {
            return Err(format!("inode {ino} has {n} names but nlink {}", a.nlink));
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

    #[test]
    fn workflows_over_partitions_match_a_naive_model(ops in proptest::collection::vec(arb_op(), 1..60)) {
        block_on(async {
            let fs = MetaFs::new(MemMeta::new());
            let mut model = Model::new();
            for (i, op) in ops.iter().enumerate() {
                let (real, m) = step(&fs, &mut model, op).await;
                prop_assert!(same_error(&real, &m), "op {i} {op:?}: real {real:?}, model {m:?}");
            }
            if let Err(e) = compare_trees(&fs, &model).await {
                prop_assert!(false, "{e}");
            }
            // Nothing is left behind: every inode is reachable (no leak without failures).
            let (inodes, _) = fs.statfs().await.unwrap();
            let live = model.dirs().len() as u64
                + model.nodes.iter().enumerate().filter(|(id, n)| n.kind != FileType::Dir && model.nlink(*id) > 0).count() as u64;
            prop_assert_eq!(inodes, live, "inodes stored vs reachable");
            Ok(())
        })?;
    }

    /// The same with write-behind: creates, removes and renames in directories the client made
    /// are answered from what it knows and applied later, in order; after a settle the
    /// partitions hold exactly the model's tree.
    #[test]
    fn workflows_written_behind_match_a_naive_model(ops in proptest::collection::vec(arb_op(), 1..60)) {
        tokio::runtime::Builder::new_current_thread().enable_time().build().unwrap().block_on(async {
            let mem = Arc::new(MemMeta::new());
            let fs = MetaFs::with_write_behind(mem.clone());
            let mut model = Model::new();
            for (i, op) in ops.iter().enumerate() {
                let (real, m) = step(&fs, &mut model, op).await;
                prop_assert!(same_error(&real, &m), "op {i} {op:?}: real {real:?}, model {m:?}");
            }
            prop_assert!(fs.settle().await.is_ok(), "a change written behind failed");
            // Read back by a client that knows nothing: what the partitions hold.
            let plain = MetaFs::new(mem);
            if let Err(e) = compare_trees(&plain, &model).await {
                prop_assert!(false, "{e}");
            }
            let (inodes, _) = plain.statfs().await.unwrap();
            let live = model.dirs().len() as u64
                + model.nodes.iter().enumerate().filter(|(id, n)| n.kind != FileType::Dir && model.nlink(*id) > 0).count() as u64;
            prop_assert_eq!(inodes, live, "inodes stored vs reachable");
            Ok(())
        })?;
    }

    #[test]
    fn failures_between_steps_never_leave_a_dangling_dentry(
        ops in proptest::collection::vec(arb_op(), 1..40),
        faults in proptest::collection::vec((0u8..4, 0usize..6), 1..40),
    ) {
        block_on(async {
            let fs = MetaFs::new(MemMeta::new());
            let mut model = Model::new();
            for (i, op) in ops.iter().enumerate() {
                // Arm a fault for one of the next few write calls of this op.
                let (kind, after) = faults[i % faults.len()];
                let fault = match kind { 0 => Fault::NotApplied, 1 => Fault::AppliedLost, 2 => Fault::LostRequest, _ => Fault::None };
                {
                    let mut f = fs.transport().faults.lock().unwrap();
                    f.clear();
                    f.extend(std::iter::repeat_n(Fault::None, after));
                    f.push(fault);
                }
                // The model is only used to pick existing directories: resync it from the real tree.
                let _ = step(&fs, &mut model, op).await;
                fs.transport().faults.lock().unwrap().clear();
                if let Err(e) = check_invariant(&fs).await {
                    prop_assert!(false, "after op {i} {op:?} with {fault:?} at write {after}: {e}");
                }
                model = rebuild_model(&fs).await;
            }
            Ok(())
        })?;
    }
}

/// A model of the real tree (for choosing directories after failures made them diverge).
async fn rebuild_model(fs: &MetaFs<impl MetaTransport>) -> Model {
    let mut model = Model::new();
    let mut stack = vec![(ROOT_INO, 0usize)];
    let mut ids: BTreeMap<Ino, usize> = BTreeMap::from([(ROOT_INO, 0)]);
    while let Some((ino, mid)) = stack.pop() {
        for e in fs.readdir(ino, None, 0).await.unwrap() {
            let id = match ids.get(&e.ino) {
                Some(&id) => id,
                None => {
                    model.nodes.push(MNode {
                        kind: e.kind,
                        mode: 0,
                        children: BTreeMap::new(),
                    });
                    model.parent.push(mid);
                    let id = model.nodes.len() - 1;
                    ids.insert(e.ino, id);
                    if e.kind == FileType::Dir {
                        stack.push((e.ino, id));
                    }
                    id
                }
            };
            model.nodes[mid].children.insert(e.name, id);
        }
    }
    model
}
