//! `nacre bench meta`: the mdtest phases of the CFS paper through the client SDK, against a local
//! cluster started in this process (1 master and 3 meta nodes on loopback TCP, raft-engine logs in a
//! temporary directory, 3 replicas per meta partition).
//!
//! Like `md_bench.py` (../shared/anchors/ceph), every client works in its own subtree: a tree of
//! branching `branch` and depth `depth` whose leaves receive `items` directories and `items` empty
//! files per client. Each phase starts on a barrier; its rate is all clients' operations divided by
//! the wall time until the last client finished. Phases: TreeCreation, DirCreation, DirStat,
//! DirRemoval, FileCreation, FileStat, FileRemoval, TreeRemoval.
//!
//! `--memory N` instead measures the memory a meta partition needs per small file: N files (inode +
//! dentry with a short name, optionally one extent key) created in a bare partition, bytes allocated
//! read from glibc's `mallinfo2` before and after.

use std::sync::Arc;
use std::time::Instant;

use anyhow::Context as _;
use nacre_api::meta::{Command, ExtentKey, FileType, ROOT_INO};
use nacre_client::MasterClient;
use nacre_client::{MetaFs, NetVolume, NewInode};
use nacre_meta::MetaPartition;
use nacre_msgr::{Messenger, MsgrConfig, TcpTransport};
use nacre_types::{ExtentId, Ino, PartitionId};
use serde::Serialize;
use tokio::sync::Barrier;

use crate::bench::cluster::LocalCluster;

pub const PHASES: [&str; 8] = [
    "TreeCreation",
    "DirCreation",
    "DirStat",
    "DirRemoval",
    "FileCreation",
    "FileStat",
    "FileRemoval",
    "TreeRemoval",
];

#[derive(Clone, Debug)]
pub struct Params {
    pub clients: usize,
    pub items: usize,
    pub branch: usize,
    pub depth: usize,
    pub meta_partitions: u32,
    /// How clients send meta writes, each in a run of its own: `once` (exactly-once calls, what
    /// every client does) and `plain` (bare commands, for the cost of `once`).
    pub calls: Vec<Calls>,
}

/// How a run's clients send meta writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Calls {
    /// `Command::Once`: every write applies once however often it is sent.
    Once,
    /// Bare commands.
    Plain,
}

impl Calls {
    fn implementation(self) -> &'static str {
        match self {
            Calls::Once => "nacre",
            Calls::Plain => "nacre-plain-calls",
        }
    }
}

#[derive(Clone, Debug, Serialize)]
pub struct MetaRow {
    pub bench: &'static str,
    #[serde(rename = "impl")]
    pub implementation: &'static str,
    pub phase: &'static str,
    pub clients: usize,
    pub items: usize,
    pub branch: usize,
    pub depth: usize,
    pub replicas: u8,
    pub ops: u64,
    pub secs: f64,
    pub ops_per_s: f64,
}

/// One client's subtree: tree nodes parents-first, and its leaves.
fn tree(branch: usize, depth: usize) -> (Vec<Vec<usize>>, Vec<Vec<usize>>) {
    let mut nodes = vec![Vec::new()];
    let mut level = vec![Vec::new()];
    for _ in 0..depth {
        let mut next = Vec::new();
        for p in &level {
            for b in 0..branch {
                let mut c: Vec<usize> = p.clone();
                c.push(b);
                next.push(c);
            }
        }
        nodes.extend(next.iter().cloned());
        level = next;
    }
    (nodes, level)
}

/// Runs the phases; `on_row` sees each row as it is measured.
pub async fn run(p: &Params, mut on_row: impl FnMut(&MetaRow)) -> anyhow::Result<Vec<MetaRow>> {
    let cluster = LocalCluster::start(3, 0).await?;
    let msgr = Messenger::new(
        "bench-meta-client",
        MsgrConfig {
            workers: 1,
            ..MsgrConfig::default()
        },
        Arc::new(TcpTransport),
    )?;
    let mc = MasterClient::new(msgr.client(), vec![cluster.master.clone()]);
    let (mut rows, mut failed) = (Vec::new(), None);
    // Each mode on a volume of its own, one after the other on the same cluster.
    for (k, &calls) in p.calls.iter().enumerate() {
        let volume = format!("mdtest{k}");
        cluster
            .create_volume(&mc, &volume, p.meta_partitions, 0)
            .await?;
        let mut clients = Vec::new();
        for _ in 0..p.clients {
            let mut meta = NetVolume::connect(msgr.client(), mc.clone(), &volume)
                .await
                .map_err(|e| anyhow::anyhow!("cannot open the volume: {e}"))?;
            meta.exactly_once = calls == Calls::Once;
            clients.push(Arc::new(MetaFs::new(meta)));
        }
        match phases(p, calls.implementation(), &clients, &mut on_row).await {
            Ok(r) => rows.extend(r),
            Err(e) => {
                failed = Some(e);
                break;
            }
        }
    }
    let rows = failed.map_or(Ok(rows), Err);
    let m = msgr.clone();
    tokio::task::spawn_blocking(move || m.shutdown()).await?;
    cluster.stop().await?;
    rows
}

async fn phases(
    p: &Params,
    implementation: &'static str,
    clients: &[Arc<MetaFs<NetVolume>>],
    on_row: &mut impl FnMut(&MetaRow),
) -> anyhow::Result<Vec<MetaRow>> {
    // Every client's root directory, made before the clock starts.
    let mut roots = Vec::new();
    for (i, fs) in clients.iter().enumerate() {
        let name = format!("rank.{i}");
        let a = fs
            .create(ROOT_INO, name.as_bytes(), &NewInode::dir(0o755, 0, 0))
            .await?;
        roots.push(a.attr.ino);
        // Connect to the partition leader the client's tree will use, as a mounted client already
        // is when mdtest starts.
        fs.getattr(a.attr.ino).await?;
    }
    let (nodes, leaves) = tree(p.branch, p.depth);
    let shared = Arc::new(Shared {
        nodes,
        leaves,
        items: p.items,
    });
    let mut rows = Vec::new();
    // Per client: inode of each tree node (index in `nodes`), filled by TreeCreation.
    let mut state: Vec<Vec<Ino>> = roots.iter().map(|&r| vec![r]).collect();
    for phase in PHASES {
        let barrier = Arc::new(Barrier::new(clients.len() + 1));
        let mut tasks = Vec::new();
        for (i, fs) in clients.iter().enumerate() {
            let (fs, barrier, shared) = (fs.clone(), barrier.clone(), shared.clone());
            let inos = std::mem::take(&mut state[i]);
            tasks.push(tokio::spawn(async move {
                barrier.wait().await;
                let r = run_phase(phase, &fs, &shared, inos).await;
                (Instant::now(), r)
            }));
        }
        barrier.wait().await;
        let start = Instant::now();
        let mut end = start;
        let mut ops = 0u64;
        for (i, t) in tasks.into_iter().enumerate() {
            let (done, r) = t.await?;
            let (n, inos) = r.with_context(|| format!("{phase} failed"))?;
            ops += n;
            state[i] = inos;
            end = end.max(done);
        }
        let secs = (end - start).as_secs_f64().max(1e-9);
        let row = MetaRow {
            bench: "meta",
            implementation,
            phase,
            clients: clients.len(),
            items: p.items,
            branch: p.branch,
            depth: p.depth,
            replicas: 3,
            ops,
            secs,
            ops_per_s: ops as f64 / secs,
        };
        on_row(&row);
        rows.push(row);
    }
    Ok(rows)
}

struct Shared {
    nodes: Vec<Vec<usize>>,
    leaves: Vec<Vec<usize>>,
    items: usize,
}

/// Runs one phase for one client. `inos` holds the client's tree (index-aligned with
/// `shared.nodes`); returns the ops done and the (possibly updated) tree.
async fn run_phase(
    phase: &str,
    fs: &MetaFs<NetVolume>,
    s: &Shared,
    mut inos: Vec<Ino>,
) -> anyhow::Result<(u64, Vec<Ino>)> {
    let leaf_ino = |inos: &[Ino], i: usize| -> Ino {
        let leaf = &s.leaves[i % s.leaves.len()];
        let idx = s.nodes.iter().position(|n| n == leaf).unwrap_or(0);
        inos[idx]
    };
    let mut ops = 0u64;
    match phase {
        "TreeCreation" => {
            // inos[0] is the client's root; create the others parents-first.
            for node in s.nodes.iter().skip(1) {
                let parent_path = &node[..node.len() - 1];
                let parent_idx = s
                    .nodes
                    .iter()
                    .position(|n| n.as_slice() == parent_path)
                    .unwrap_or(0);
                let name = format!("t{}", node[node.len() - 1]);
                let a = fs
                    .create(
                        inos[parent_idx],
                        name.as_bytes(),
                        &NewInode::dir(0o755, 0, 0),
                    )
                    .await?;
                inos.push(a.attr.ino);
                ops += 1;
            }
        }
        "DirCreation" | "FileCreation" => {
            let (prefix, new) = if phase == "DirCreation" {
                ("dir", NewInode::dir(0o755, 0, 0))
            } else {
                ("file", NewInode::file(0o644, 0, 0))
            };
            for i in 0..s.items {
                let name = format!("{prefix}.{i}");
                fs.create(leaf_ino(&inos, i), name.as_bytes(), &new).await?;
                ops += 1;
            }
        }
        "DirStat" | "FileStat" => {
            let prefix = if phase == "DirStat" { "dir" } else { "file" };
            for i in 0..s.items {
                let name = format!("{prefix}.{i}");
                fs.lookup(leaf_ino(&inos, i), name.as_bytes()).await?;
                ops += 1;
            }
        }
        "DirRemoval" => {
            for i in 0..s.items {
                let name = format!("dir.{i}");
                fs.rmdir(leaf_ino(&inos, i), name.as_bytes()).await?;
                ops += 1;
            }
        }
        "FileRemoval" => {
            for i in 0..s.items {
                let name = format!("file.{i}");
                fs.unlink(leaf_ino(&inos, i), name.as_bytes()).await?;
                ops += 1;
            }
        }
        "TreeRemoval" => {
            // Children before parents; the client's root stays (as in md_bench.py's tree phase).
            for node in s.nodes.iter().skip(1).rev() {
                let parent_path = &node[..node.len() - 1];
                let parent_idx = s
                    .nodes
                    .iter()
                    .position(|n| n.as_slice() == parent_path)
                    .unwrap_or(0);
                let name = format!("t{}", node[node.len() - 1]);
                fs.rmdir(inos[parent_idx], name.as_bytes()).await?;
                ops += 1;
            }
        }
        other => anyhow::bail!("unknown phase {other}"),
    }
    Ok((ops, inos))
}

pub fn print_table(rows: &[MetaRow]) {
    let mut t = comfy_table::Table::new();
    t.load_preset(comfy_table::presets::UTF8_FULL_CONDENSED);
    t.set_header(["phase", "clients", "items", "ops", "secs", "ops/s"]);
    for r in rows {
        t.add_row(vec![
            r.phase.to_string(),
            r.clients.to_string(),
            r.items.to_string(),
            r.ops.to_string(),
            format!("{:.2}", r.secs),
            format!("{:.0}", r.ops_per_s),
        ]);
    }
    println!("{t}");
}

/// Memory per small file in a bare partition.
#[derive(Clone, Debug, Serialize)]
pub struct MemoryRow {
    pub bench: &'static str,
    #[serde(rename = "impl")]
    pub implementation: &'static str,
    pub files: u64,
    pub extent_keys_per_file: u64,
    pub bytes_per_file: f64,
    /// The partition's own estimate, for comparison.
    pub estimated_bytes_per_file: f64,
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
#[allow(unsafe_code)]
fn allocated_bytes() -> u64 {
    // SAFETY: mallinfo2 only reads allocator statistics.
    let mi = unsafe { libc::mallinfo2() };
    (mi.uordblks + mi.hblkhd) as u64
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn allocated_bytes() -> u64 {
    0
}

/// Creates `files` files (inode + dentry named like `file.123456`) in one directory of a bare
/// partition, with `extents` extent keys each, and reports the bytes allocated per file.
pub fn memory(files: u64, extents: u64) -> anyhow::Result<MemoryRow> {
    let mut p = MetaPartition::new(1, u64::MAX);
    let before = allocated_bytes();
    let base = p.stats().memory;
    for i in 0..files {
        let a = match p.apply(
            i,
            &Command::CreateInode {
                kind: FileType::File,
                mode: 0o644,
                uid: 0,
                gid: 0,
                rdev: 0,
                parent: ROOT_INO,
                target: Vec::new(),
            },
        ) {
            Ok(nacre_api::meta::Reply::Attr(a)) => a,
            other => anyhow::bail!("create inode: {other:?}"),
        };
        p.apply(
            i,
            &Command::CreateDentry {
                parent: ROOT_INO,
                name: format!("file.{i}").into_bytes(),
                ino: a.ino,
                kind: FileType::File,
            },
        )
        .map_err(|e| anyhow::anyhow!("create dentry: {e}"))?;
        if extents > 0 {
            let keys = (0..extents)
                .map(|k| ExtentKey {
                    file_offset: k * 4096,
                    partition: PartitionId(7),
                    extent: ExtentId(i),
                    extent_offset: k * 4096,
                    size: 4096,
                    crc: 0,
                    framed: None,
                })
                .collect();
            p.apply(
                i,
                &Command::AppendExtents {
                    ino: a.ino,
                    extents: keys,
                },
            )
            .map_err(|e| anyhow::anyhow!("append extents: {e}"))?;
        }
    }
    let after = allocated_bytes();
    let est = p.stats().memory.saturating_sub(base);
    drop(p);
    Ok(MemoryRow {
        bench: "meta-memory",
        implementation: "nacre",
        files,
        extent_keys_per_file: extents,
        bytes_per_file: after.saturating_sub(before) as f64 / files.max(1) as f64,
        estimated_bytes_per_file: est as f64 / files.max(1) as f64,
    })
}
