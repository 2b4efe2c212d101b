//! `nacre bench func`: storage functions inline against on a function server, the seed's Tables 2
//! and 3 on nacre. One run starts a local cluster in this process (1 master, 3 meta nodes, 3 data
//! nodes, 1 function server; loopback TCP, data under `NACRE_BENCH_DIR` or the system's temp
//! directory) and measures:
//!
//! - **Transforms** (`transform` rows): each function through a [`FuncClient`] at `depth` calls
//!   in flight for `secs`, inline (on this process's blocking threads) and as a service (on the
//!   function server): calls/s and GB/s of input. Compression takes 64 KiB blocks of text-like
//!   bytes (about 3:1 for zstd-1); checksum and erasure coding (4+2) take 1 MiB; reconstruct
//!   rebuilds a stripe missing its first two data shards. Inline at depth 1 is one core's figure.
//! - **Writes through the client** (`randwrite-4k`, `write-64k` rows) on two volumes compressed
//!   with zstd-1 and two erasure-coded 2+1 (`ec-2+1`: one stripe of two data shards and a parity
//!   shard per 64 KiB block), one of each running its function inline and one on the function
//!   server (no fallback: every block goes there). At depth `D`, `D` writers each own a file: `randwrite-4k` writes 4 KiB at
//!   random aligned offsets of a file of `file_mib` MiB written beforehand (each write a
//!   copy-on-write of a piece of a compressed block: compress, replicated append, key commit);
//!   `write-64k` appends 64 KiB writes to a new file. Each writer ends with an `fsync` inside the
//!   timing, so the figures include the data made durable.
//!
//! The table puts each service figure beside the inline one of the same configuration.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use bytes::Bytes;
use comfy_table::{Cell, CellAlignment, Table, presets::UTF8_FULL_CONDENSED};
use nacre_api::master::{FuncAt, VolumeFuncs};
use nacre_api::meta::ROOT_INO;
use nacre_client::{
    Caller, FileSystem, FuncClient, FuncClientConfig, FuncPolicy, MasterClient, NetFs, NetVolume,
    OpenFlags,
};
use nacre_func::{Call, Codec, EcSpec, Input};
use nacre_msgr::{Messenger, MsgrConfig, TcpTransport};
use serde::Serialize;

use crate::bench::cluster::LocalCluster;

#[derive(Clone, Debug)]
pub struct Params {
    /// Calls or writers in flight, for the transforms and the writes.
    pub depths: Vec<usize>,
    pub secs: f64,
    /// Size of each `randwrite-4k` writer's file.
    pub file_mib: u64,
    /// Which parts run: `transforms`, `randwrite-4k`, `write-64k`.
    pub parts: Vec<String>,
}

pub const PARTS: [&str; 3] = ["transforms", "randwrite-4k", "write-64k"];

#[derive(Clone, Debug, Serialize)]
pub struct FuncRow {
    pub bench: &'static str,
    /// `inline` or `service`.
    #[serde(rename = "impl")]
    pub implementation: &'static str,
    /// The transform (`compress-zstd1`, …) or the write workload.
    pub workload: String,
    /// The volume's functions for a write workload (`zstd-1`, `ec-2+1`), `-` for a transform.
    pub volume: &'static str,
    /// Bytes of input per call, or per write.
    pub size: usize,
    pub depth: usize,
    pub ops: u64,
    pub secs: f64,
    pub ops_per_s: f64,
    pub mib_per_s: f64,
}

/// Text-like bytes (words of a small vocabulary), the same on every run.
fn text(len: usize) -> Bytes {
    const WORDS: [&str; 16] = [
        "extent ",
        "partition ",
        "leader ",
        "replica ",
        "raft ",
        "inode ",
        "write ",
        "read ",
        "volume ",
        "stripe ",
        "shard ",
        "node ",
        "client ",
        "commit\n",
        "block ",
        "frame ",
    ];
    let mut rng = fastrand::Rng::with_seed(0x7e57);
    let mut out = Vec::with_capacity(len + 16);
    while out.len() < len {
        out.extend_from_slice(WORDS[rng.usize(..WORDS.len())].as_bytes());
        if rng.u32(..8) == 0 {
            out.extend_from_slice(rng.u32(..100_000).to_string().as_bytes());
        }
    }
    out.truncate(len);
    Bytes::from(out)
}

/// Runs the parts; `on_row` sees each row as it is measured.
pub async fn run(p: &Params, mut on_row: impl FnMut(&FuncRow)) -> anyhow::Result<Vec<FuncRow>> {
    for part in &p.parts {
        anyhow::ensure!(
            PARTS.contains(&part.as_str()),
            "unknown part {part:?}; known: {}",
            PARTS.join(", ")
        );
    }
    let cluster = LocalCluster::start_with_funcs(3, 3, 1).await?;
    let msgr = Messenger::new(
        "bench-func-client",
        MsgrConfig {
            workers: 1,
            ..MsgrConfig::default()
        },
        Arc::new(TcpTransport),
    )?;
    let out = async {
        let mc = MasterClient::new(msgr.client(), vec![cluster.master.clone()]);
        let compress = Some("zstd:1".parse().map_err(anyhow::Error::msg)?);
        let zstd = |at| VolumeFuncs {
            compress,
            at,
            fallback_inline: false,
            ec: None,
        };
        cluster
            .create_volume_with(&mc, "inline", 1, 3, zstd(FuncAt::Inline))
            .await?;
        cluster
            .create_volume_with(&mc, "service", 1, 3, zstd(FuncAt::Service))
            .await?;
        let ec = |at| VolumeFuncs {
            ec: Some(EcSpec { k: 2, m: 1 }),
            at,
            ..VolumeFuncs::default()
        };
        cluster
            .create_volume_with(&mc, "ec-inline", 1, 3, ec(FuncAt::Inline))
            .await?;
        cluster
            .create_volume_with(&mc, "ec-service", 1, 3, ec(FuncAt::Service))
            .await?;
        wait_for_funcs(&mc).await?;
        let mut rows = Vec::new();
        let mut emit = |r: FuncRow, rows: &mut Vec<FuncRow>| {
            on_row(&r);
            rows.push(r);
        };
        if p.parts.iter().any(|x| x == "transforms") {
            for (name, at) in [("inline", FuncAt::Inline), ("service", FuncAt::Service)] {
                let funcs = FuncClient::new(
                    mc.clone(),
                    FuncClientConfig {
                        at,
                        policy: FuncPolicy {
                            fallback_inline: false,
                        },
                        ..FuncClientConfig::default()
                    },
                );
                for (workload, size, call, input) in transforms()? {
                    for &depth in &p.depths {
                        let r =
                            transform(&funcs, name, workload, size, &call, &input, depth, p.secs)
                                .await?;
                        emit(r, &mut rows);
                    }
                }
            }
        }
        for workload in ["randwrite-4k", "write-64k"] {
            if !p.parts.iter().any(|x| x == workload) {
                continue;
            }
            for (volume, names) in VOLUMES {
                for &depth in &p.depths {
                    for (name, implementation) in names.into_iter().zip(["inline", "service"]) {
                        let vol = NetVolume::connect(msgr.client(), mc.clone(), name)
                            .await
                            .map_err(|e| anyhow::anyhow!("cannot open volume {name}: {e}"))?;
                        let fs = NetFs::new(Arc::new(vol));
                        let r = writes(&fs, implementation, volume, workload, depth, p).await?;
                        emit(r, &mut rows);
                    }
                }
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

/// The volumes the writes run on: (their functions, the names of the volume running them
/// inline and of the one running them on the function server).
const VOLUMES: [(&str, [&str; 2]); 2] = [
    ("zstd-1", ["inline", "service"]),
    ("ec-2+1", ["ec-inline", "ec-service"]),
];

/// Waits (bounded) until the master lists a function server that is up.
async fn wait_for_funcs(mc: &MasterClient) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(30);
    while mc.funcs().await?.instances.is_empty() {
        anyhow::ensure!(
            Instant::now() < deadline,
            "the function server did not register in 30 s"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Ok(())
}

/// (workload, input bytes, call, input) of each transform.
fn transforms() -> anyhow::Result<Vec<(&'static str, usize, Call, Input)>> {
    let block = text(64 << 10);
    let mib = text(1 << 20);
    let zstd = Codec::Zstd { level: 1 };
    let frame = nacre_func::compress_block(zstd, &block)?;
    let spec = EcSpec::new(4, 2)?;
    let mut slots = nacre_func::ec_encode(spec, &mib)?.into_slots();
    slots[0] = None;
    slots[1] = None;
    Ok(vec![
        (
            "compress-zstd1",
            block.len(),
            Call::Compress { codec: zstd },
            Input::Bytes(block.clone()),
        ),
        (
            "compress-lz4",
            block.len(),
            Call::Compress { codec: Codec::Lz4 },
            Input::Bytes(block.clone()),
        ),
        (
            "decompress-zstd1",
            block.len(),
            Call::Decompress,
            Input::Bytes(frame),
        ),
        (
            "checksum",
            mib.len(),
            Call::Checksum,
            Input::Bytes(mib.clone()),
        ),
        (
            "ec-encode-4+2",
            mib.len(),
            Call::EcEncode { spec },
            Input::Bytes(mib.clone()),
        ),
        (
            "ec-reconstruct-4+2",
            mib.len(),
            Call::EcReconstruct {
                spec,
                len: mib.len() as u64,
            },
            Input::Shards(slots),
        ),
    ])
}

#[allow(clippy::too_many_arguments)]
async fn transform(
    funcs: &FuncClient,
    implementation: &'static str,
    workload: &str,
    size: usize,
    call: &Call,
    input: &Input,
    depth: usize,
    secs: f64,
) -> anyhow::Result<FuncRow> {
    let start = Instant::now();
    let until = start + Duration::from_secs_f64(secs);
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..depth {
        let (funcs, call, input) = (funcs.clone(), *call, input.clone());
        tasks.spawn(async move {
            let mut n = 0u64;
            while Instant::now() < until {
                funcs.call(call, input.clone()).await?;
                n += 1;
            }
            anyhow::Ok(n)
        });
    }
    let ops = total(tasks).await?;
    Ok(row(
        implementation,
        "-",
        workload,
        size,
        depth,
        ops,
        start.elapsed(),
    ))
}

/// The operations the tasks counted, once every one has ended.
async fn total(mut tasks: tokio::task::JoinSet<anyhow::Result<u64>>) -> anyhow::Result<u64> {
    let mut ops = 0;
    while let Some(r) = tasks.join_next().await {
        ops += r.context("benchmark task panicked")??;
    }
    Ok(ops)
}

fn row(
    implementation: &'static str,
    volume: &'static str,
    workload: &str,
    size: usize,
    depth: usize,
    ops: u64,
    took: Duration,
) -> FuncRow {
    let secs = took.as_secs_f64();
    FuncRow {
        bench: "func",
        implementation,
        workload: workload.to_string(),
        volume,
        size,
        depth,
        ops,
        secs,
        ops_per_s: ops as f64 / secs,
        mib_per_s: (ops as f64 * size as f64) / secs / f64::from(1 << 20),
    }
}

/// `depth` writers, each on a file of its own, for `secs`; each ends with an fsync (timed).
async fn writes(
    fs: &NetFs,
    implementation: &'static str,
    volume: &'static str,
    workload: &str,
    depth: usize,
    p: &Params,
) -> anyhow::Result<FuncRow> {
    let me = Caller { uid: 0, gid: 0 };
    let size: usize = if workload == "randwrite-4k" {
        4 << 10
    } else {
        64 << 10
    };
    let payload = text(1 << 20);
    let file_len = p.file_mib << 20;
    let mut handles = Vec::new();
    for w in 0..depth {
        let name = format!("{workload}-{depth}-{w}");
        let (_, fh) = fs
            .create(ROOT_INO, name.as_bytes(), 0o644, me, OpenFlags::READ_WRITE)
            .await
            .with_context(|| format!("cannot create {name}"))?;
        if workload == "randwrite-4k" {
            // Written beforehand (not timed): the random writes land on compressed blocks.
            let mut off = 0;
            while off < file_len {
                let n = (file_len - off).min(payload.len() as u64);
                fs.write(fh, off, payload.slice(..n as usize)).await?;
                off += n;
            }
            fs.fsync(fh).await?;
        }
        handles.push(fh);
    }
    let start = Instant::now();
    let until = start + Duration::from_secs_f64(p.secs);
    let mut tasks = tokio::task::JoinSet::new();
    for (w, fh) in handles.into_iter().enumerate() {
        let (fs, payload, random) = (fs.clone(), payload.clone(), workload == "randwrite-4k");
        tasks.spawn(async move {
            let mut rng = fastrand::Rng::with_seed(0x5eed ^ w as u64);
            let (mut n, mut end) = (0u64, 0u64);
            while Instant::now() < until {
                let at = rng.usize(..payload.len() - size);
                let data = payload.slice(at..at + size);
                let off = if random {
                    rng.u64(..file_len / size as u64) * size as u64
                } else {
                    end
                };
                fs.write(fh, off, data).await?;
                end += size as u64;
                n += 1;
            }
            fs.fsync(fh).await?;
            fs.release(fh).await?;
            anyhow::Ok(n)
        });
    }
    let ops = total(tasks).await?;
    Ok(row(
        implementation,
        volume,
        workload,
        size,
        depth,
        ops,
        start.elapsed(),
    ))
}

/// The rows, each service figure beside the inline one of the same workload and depth.
pub fn print_table(rows: &[FuncRow]) {
    let mut t = Table::new();
    t.load_preset(UTF8_FULL_CONDENSED);
    t.set_header([
        "workload",
        "volume",
        "size",
        "depth",
        "inline ops/s",
        "inline MiB/s",
        "service ops/s",
        "service MiB/s",
        "service ÷ inline",
    ]);
    let right = |s: String| Cell::new(s).set_alignment(CellAlignment::Right);
    for r in rows.iter().filter(|r| r.implementation == "inline") {
        let svc = rows.iter().find(|s| {
            s.implementation == "service"
                && s.workload == r.workload
                && s.volume == r.volume
                && s.depth == r.depth
        });
        let (so, sm, ratio) = svc.map_or(("-".into(), "-".into(), "-".into()), |s| {
            (
                format!("{:.0}", s.ops_per_s),
                format!("{:.1}", s.mib_per_s),
                format!("{:.2}", s.ops_per_s / r.ops_per_s.max(f64::MIN_POSITIVE)),
            )
        });
        t.add_row(vec![
            Cell::new(&r.workload),
            Cell::new(r.volume),
            right(crate::bench::report::human_size(r.size)),
            right(r.depth.to_string()),
            right(format!("{:.0}", r.ops_per_s)),
            right(format!("{:.1}", r.mib_per_s)),
            right(so),
            right(sm),
            right(ratio),
        ]);
    }
    println!("{t}");
}
