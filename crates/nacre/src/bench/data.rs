//! `nacre bench data`: the data path through the client SDK against a local cluster started in this
//! process (1 master, 3 meta and 3 data nodes on loopback TCP, extent stores and raft-engine logs in
//! a temporary directory under `NACRE_BENCH_DIR` or the system's, 3 replicas per data partition).
//!
//! Workloads, each run for `secs` at every `inflight` (concurrent operations):
//! - `seq-write`: each of `inflight` streams writes 1 MiB at a time (8 pipelined 128 KiB appends,
//!   primary-backup); one operation is one acknowledged MiB.
//! - `overwrite-4k`, `overwrite-64k`: aligned random overwrites through Raft inside extents
//!   prefilled with `file_mib` MiB each (one per data partition).
//! - `read-4k`: aligned random reads of the prefilled extents (CRC-verified on the leader).
//! - `append-pb`, `append-raft`: 128 KiB appends, one outstanding per stream, through
//!   primary-backup versus through the partition's Raft group: what scenario-aware replication buys.
//! - `disk`: the raw disk under the bench directory, for scale: 1 MiB sequential writes to a file,
//!   each followed by fdatasync (the durability every replica gives an append), one writer per
//!   `inflight`.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use bytes::Bytes;
use nacre_client::MasterClient;
use nacre_client::{NetVolume, SeqWriter};
use nacre_msgr::{Messenger, MsgrConfig, TcpTransport};
use nacre_types::{ExtentId, PartitionId};
use serde::Serialize;

use crate::bench::cluster::{LocalCluster, bench_dir};
use crate::bench::report::percentiles_us;

pub const WORKLOADS: [&str; 8] = [
    "disk",
    "seq-write",
    "overwrite-4k",
    "overwrite-64k",
    "read-4k",
    "append-pb",
    "append-4k",
    "append-raft",
];

#[derive(Clone, Debug)]
pub struct Params {
    pub workloads: Vec<String>,
    pub inflight: Vec<usize>,
    pub secs: f64,
    pub file_mib: u64,
    pub data_partitions: u32,
    /// Each value runs the cluster's workloads once, on a fresh cluster whose data nodes bundle
    /// this many connections per peer for replication (1: no bundles).
    pub bundle_conns: Vec<usize>,
    /// Messenger workers of each data node.
    pub data_workers: usize,
}

#[derive(Clone, Debug, Serialize)]
pub struct DataRow {
    pub bench: &'static str,
    #[serde(rename = "impl")]
    pub implementation: &'static str,
    pub workload: String,
    pub size: usize,
    pub inflight: usize,
    pub replicas: u8,
    /// Connections per bundle between data nodes (1: no bundles).
    pub bundle_conns: usize,
    pub ops: u64,
    pub secs: f64,
    pub ops_per_s: f64,
    pub mib_per_s: f64,
    pub p50_us: f64,
    pub p99_us: f64,
}

fn op_size(workload: &str) -> usize {
    match workload {
        "overwrite-4k" | "read-4k" | "append-4k" => 4096,
        "overwrite-64k" => 64 << 10,
        "append-pb" | "append-raft" => 128 << 10,
        _ => 1 << 20,
    }
}

/// Runs the workloads; `on_row` sees each row as it is measured.
pub async fn run(p: &Params, mut on_row: impl FnMut(&DataRow)) -> anyhow::Result<Vec<DataRow>> {
    for w in &p.workloads {
        anyhow::ensure!(
            WORKLOADS.contains(&w.as_str()),
            "unknown workload {w:?}; known: {}",
            WORKLOADS.join(", ")
        );
    }
    let mut rows = Vec::new();
    if p.workloads.iter().any(|w| w == "disk") {
        for &n in &p.inflight {
            let row = disk(n, p.secs).await?;
            on_row(&row);
            rows.push(row);
        }
    }
    if p.workloads.iter().all(|w| w == "disk") {
        return Ok(rows);
    }
    for &bundle in &p.bundle_conns {
        let more = run_cluster(p, bundle, &mut on_row).await?;
        rows.extend(more);
    }
    Ok(rows)
}

/// The cluster workloads on a fresh cluster whose data nodes bundle `bundle` connections.
async fn run_cluster(
    p: &Params,
    bundle: usize,
    on_row: &mut impl FnMut(&DataRow),
) -> anyhow::Result<Vec<DataRow>> {
    let mut rows = Vec::new();
    let data_msgr = crate::node::MsgrSection {
        workers: p.data_workers,
        bundle_conns: bundle,
        ..crate::node::MsgrSection::default()
    };
    let cluster = LocalCluster::start_with(3, 3, 0, &data_msgr).await?;
    let msgr = Messenger::new(
        "bench-data-client",
        MsgrConfig {
            workers: 1,
            ..MsgrConfig::default()
        },
        Arc::new(TcpTransport),
    )?;
    let out = async {
        let mc = MasterClient::new(msgr.client(), vec![cluster.master.clone()]);
        cluster
            .create_volume(&mc, "data", 1, p.data_partitions)
            .await?;
        let vol = Arc::new(
            NetVolume::connect(msgr.client(), mc.clone(), "data")
                .await
                .map_err(|e| anyhow::anyhow!("cannot open the volume: {e}"))?,
        );
        let payload = {
            // Incompressible and the same on every run.
            let mut v = vec![0u8; (1 << 20) + 4096];
            fastrand::Rng::with_seed(0x9e37_79b9_7f4a_7c15).fill(&mut v);
            Bytes::from(v)
        };
        let mut files = Vec::new();
        if p.workloads
            .iter()
            .any(|w| w.starts_with("overwrite") || w.starts_with("read"))
        {
            files = prefill(&vol, &payload, p.file_mib).await?;
        }
        for w in p.workloads.iter().filter(|w| *w != "disk") {
            for &n in &p.inflight {
                let mut row = measure(&vol, w, n, p.secs, &payload, &files).await?;
                row.bundle_conns = bundle;
                on_row(&row);
                rows.push(row);
            }
        }
        anyhow::Ok(rows)
    }
    .await;
    let m = msgr.clone();
    tokio::task::spawn_blocking(move || m.shutdown()).await?;
    cluster.stop().await?;
    out
}

/// One extent of `mib` MiB per data partition, written with appends.
async fn prefill(
    vol: &Arc<NetVolume>,
    payload: &Bytes,
    mib: u64,
) -> anyhow::Result<Vec<(PartitionId, ExtentId, u64)>> {
    let mut files = Vec::new();
    for part in vol.data_partitions().iter() {
        let extent = vol
            .create_extent(part.id)
            .await
            .map_err(|e| anyhow::anyhow!("create extent: {e}"))?;
        let mut off = 0u64;
        let mut pending = tokio::task::JoinSet::new();
        // Sequential appends to one extent, several in flight.
        while off < mib << 20 {
            let data = payload.slice(..128 << 10);
            let v = vol.clone();
            let id = part.id;
            let at = off;
            pending.spawn(async move { v.append(id, extent, at, data).await });
            off += 128 << 10;
            if pending.len() >= 8
                && let Some(r) = pending.join_next().await
            {
                r?.map_err(|e| anyhow::anyhow!("prefill: {e}"))?;
            }
        }
        while let Some(r) = pending.join_next().await {
            r?.map_err(|e| anyhow::anyhow!("prefill: {e}"))?;
        }
        files.push((part.id, extent, off));
    }
    Ok(files)
}

async fn measure(
    vol: &Arc<NetVolume>,
    workload: &str,
    inflight: usize,
    secs: f64,
    payload: &Bytes,
    files: &[(PartitionId, ExtentId, u64)],
) -> anyhow::Result<DataRow> {
    let size = op_size(workload);
    let start = Instant::now();
    let until = start + Duration::from_secs_f64(secs);
    let ops = Arc::new(AtomicU64::new(0));
    let mut tasks = tokio::task::JoinSet::new();
    for t in 0..inflight {
        let vol = vol.clone();
        let payload = payload.clone();
        let files = files.to_vec();
        let workload = workload.to_string();
        let ops = ops.clone();
        tasks.spawn(async move {
            let mut lat = Vec::new();
            // Offsets from a deterministic generator, one stream per task.
            let mut rng =
                fastrand::Rng::with_seed(0x2545_f491_4f6c_dd1du64 ^ ((t as u64 + 1) << 32));
            let mut stream: Option<SeqWriter> = None;
            let mut ext: Option<(PartitionId, ExtentId, u64)> = None;
            while Instant::now() < until {
                let t0 = Instant::now();
                match workload.as_str() {
                    "seq-write" => {
                        let w = stream.get_or_insert_with(|| SeqWriter::new(vol.clone(), 0, 8));
                        w.write(payload.slice(..size)).await?;
                        w.flush().await?;
                    }
                    "overwrite-4k" | "overwrite-64k" | "read-4k" => {
                        let (p, e, len) = files[rng.usize(..files.len())];
                        let slots = (len / size as u64).max(1);
                        let off = rng.u64(..slots) * size as u64;
                        if workload.starts_with("read") {
                            vol.read_extent(p, e, off, size as u32).await?;
                        } else {
                            let at = (off as usize) % 4096;
                            vol.overwrite(p, e, off, payload.slice(at..at + size))
                                .await?;
                        }
                    }
                    "append-pb" | "append-4k" | "append-raft" => {
                        let (p, e, off) = match ext {
                            Some(x) if x.2 < nacre_client::data::MAX_EXTENT => x,
                            _ => {
                                let p = vol
                                    .pick_writable(t, &[])
                                    .ok_or(nacre_client::DataCallError::NoWritablePartition)?;
                                (p, vol.create_extent(p).await?, 0)
                            }
                        };
                        let data = payload.slice(..size);
                        if workload == "append-raft" {
                            vol.append_raft(p, e, off, data).await?;
                        } else {
                            vol.append(p, e, off, data).await?;
                        }
                        ext = Some((p, e, off + size as u64));
                    }
                    other => {
                        return Err(anyhow::anyhow!("unknown workload {other}"));
                    }
                }
                lat.push(t0.elapsed().as_nanos() as u64);
                ops.fetch_add(1, Ordering::Relaxed);
            }
            if let Some(w) = stream {
                w.finish().await?;
            }
            anyhow::Ok(lat)
        });
    }
    let mut lat = Vec::new();
    while let Some(r) = tasks.join_next().await {
        lat.extend(r.context("benchmark task panicked")??);
    }
    let secs = start.elapsed().as_secs_f64();
    Ok(row(
        workload,
        size,
        inflight,
        ops.load(Ordering::Relaxed),
        secs,
        &mut lat,
    ))
}

fn row(
    workload: &str,
    size: usize,
    inflight: usize,
    ops: u64,
    secs: f64,
    lat: &mut [u64],
) -> DataRow {
    let ps = percentiles_us(lat, &[50.0, 99.0]);
    DataRow {
        bench: "data",
        implementation: if workload == "disk" { "disk" } else { "nacre" },
        workload: workload.to_string(),
        size,
        inflight,
        replicas: if workload == "disk" { 1 } else { 3 },
        bundle_conns: 1,
        ops,
        secs,
        ops_per_s: ops as f64 / secs,
        mib_per_s: ops as f64 * size as f64 / secs / f64::from(1 << 20),
        p50_us: ps[0],
        p99_us: ps[1],
    }
}

/// The raw disk: `inflight` writers each appending 1 MiB + fdatasync to their own file, with
/// `O_DIRECT` as `fio --direct=1` does. Buffered appends measure the page cache instead: on the VMs
/// we benchmark on, copying into pages the file never had costs more than the disk (fio `--direct=0`
/// into a growing file: 438 MiB/s; `--direct=1`: 1,612 MiB/s; docs/benchmarks.md).
async fn disk(inflight: usize, secs: f64) -> anyhow::Result<DataRow> {
    let dir = tempfile::tempdir_in(bench_dir()).context("cannot create a temporary directory")?;
    let start = Instant::now();
    let until = start + Duration::from_secs_f64(secs);
    let mut tasks = Vec::new();
    for i in 0..inflight {
        let path = dir.path().join(format!("disk-{i}"));
        tasks.push(tokio::task::spawn_blocking(move || {
            use std::io::Write as _;
            use std::os::unix::fs::OpenOptionsExt as _;
            let open = |flags| {
                std::fs::OpenOptions::new()
                    .write(true)
                    .create(true)
                    .truncate(true)
                    .custom_flags(flags)
                    .open(&path)
            };
            // File systems without O_DIRECT (tmpfs) refuse it with EINVAL: they have no disk below.
            let mut f = match open(libc::O_DIRECT) {
                Err(e) if e.raw_os_error() == Some(libc::EINVAL) => open(0)?,
                r => r?,
            };
            // O_DIRECT wants the buffer aligned to the device's logical block (4 KiB covers all).
            let raw = vec![0x5au8; (1 << 20) + 4096];
            let at = raw.as_ptr().align_offset(4096);
            let buf = &raw[at..at + (1 << 20)];
            let mut lat = Vec::new();
            while Instant::now() < until {
                let t0 = Instant::now();
                f.write_all(buf)?;
                f.sync_data()?;
                lat.push(t0.elapsed().as_nanos() as u64);
            }
            std::io::Result::Ok(lat)
        }));
    }
    let mut lat = Vec::new();
    for t in tasks {
        lat.extend(t.await??);
    }
    let secs = start.elapsed().as_secs_f64();
    let ops = lat.len() as u64;
    Ok(row("disk", 1 << 20, inflight, ops, secs, &mut lat))
}

pub fn print_table(rows: &[DataRow]) {
    let mut t = comfy_table::Table::new();
    t.load_preset(comfy_table::presets::UTF8_FULL_CONDENSED);
    t.set_header([
        "workload", "impl", "bundle", "size", "inflight", "ops/s", "MiB/s", "p50 µs", "p99 µs",
    ]);
    for r in rows {
        t.add_row(vec![
            r.workload.clone(),
            r.implementation.to_string(),
            r.bundle_conns.to_string(),
            crate::bench::report::human_size(r.size),
            r.inflight.to_string(),
            format!("{:.0}", r.ops_per_s),
            format!("{:.1}", r.mib_per_s),
            format!("{:.0}", r.p50_us),
            format!("{:.0}", r.p99_us),
        ]);
    }
    println!("{t}");
}
