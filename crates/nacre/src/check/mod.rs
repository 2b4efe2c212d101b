//! `nacre check`: the reliability harness (issue 8). `nacre check run` starts a cluster of ten
//! `nacre server` processes ([`harness`]), runs the verifying workload ([`workload`]) on it while a
//! fault schedule kills, isolates, fills and corrupts nodes, measures fail-over times with probes,
//! and finally reads everything back: every acknowledged byte must be there, and nothing that was
//! never written.

mod flips;
pub mod garbage;
pub mod gc;
pub mod harness;
pub mod kill_client;
mod mountfs;
pub mod port;
#[cfg(test)]
mod port_tests;
mod probe;
mod restart;
pub mod workload;

use nacre_master::MasterAdmin as _;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use clap::{Args, Subcommand, ValueEnum};
use nacre_api::meta::SetAttr;
use nacre_client::MasterClient;
use nacre_client::{FileSystem, MetaFs, MetaTransport, NetFs, NetFsConfig, NetVolume};
use nacre_master::map::{Command as MapCommand, PartitionStatus};
use nacre_msgr::{Client, Messenger, MsgrConfig, TcpTransport};
use nacre_types::{ExtentId, Ino, PartitionId};
use serde::Serialize;
use tokio::sync::watch;

use harness::{Harness, HarnessConfig, Role};
use probe::{PROBE_LIMIT, Prober, Target, led_by, master_leader, probe_targets};
use workload::{Workload, WorkloadConfig};

const VOLUME: &str = "check";

#[derive(Debug, Args)]
pub struct CheckArgs {
    #[command(subcommand)]
    cmd: CheckCmd,
}

#[derive(Debug, Subcommand)]
enum CheckCmd {
    /// Start a cluster (3 masters, 3 meta, 4 data nodes, one process each), run the verifying
    /// workload under a fault schedule, then check that no acknowledged write was lost.
    ///
    /// Example (the 30-minute soak): `nacre check run --schedule all --duration 30m`. Exits 1 when
    /// anything acknowledged is missing or wrong, or something never written is found.
    Run(RunArgs),
    /// Send malformed frames, oversized lengths and random bytes to nodes' messenger ports (and
    /// HTTP ports with --http), and check each answers cleanly and keeps serving.
    Garbage(GarbageArgs),
    /// The client the `kill-client` schedule starts and kills (not for direct use).
    #[command(hide = true)]
    Client(kill_client::client::ClientArgs),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Schedule {
    /// No faults: the workload and the checker only.
    None,
    /// kill -9 a random data node every interval, restart it.
    KillData,
    /// kill -9 a random meta node every interval, restart it.
    KillMeta,
    /// kill -9 the master leader every interval, restart it.
    KillMaster,
    /// kill -9 a client process writing small files behind, every tenth to half interval, and
    /// check what it had synced; a data or meta node is killed every other interval too.
    KillClient,
    /// Cut one node (data, meta or the master leader, in turn) off the network, heal it.
    Partition,
    /// Fill data node 0's (small, loop-mounted) disk to the last byte; free it late in the run.
    FullDisk,
    /// Flip bytes of committed blocks on random data nodes (never one block on two replicas).
    Corrupt,
    /// Malformed frames and random bytes to every node's ports, every interval.
    Garbage,
    /// A random node fault of the above every interval, one at a time (a full disk for half an
    /// interval), with kill-client's client killed all along: the soak.
    All,
}

#[derive(Debug, Args)]
struct RunArgs {
    #[arg(long, value_enum, default_value = "all")]
    schedule: Schedule,
    /// How long faults are injected (e.g. 60s, 30m).
    #[arg(long, default_value = "60s", value_parser = parse_duration)]
    duration: Duration,
    /// Time between faults.
    #[arg(long, default_value = "5s", value_parser = parse_duration)]
    interval: Duration,
    /// Concurrent clients of the workload (each its own NetFs).
    #[arg(long, default_value_t = 4)]
    clients: usize,
    /// Seed of the workload and the schedule (default: from the clock).
    #[arg(long)]
    seed: Option<u64>,
    /// Directory for the cluster (removed afterwards unless --keep).
    #[arg(long, default_value = ".nacre-check")]
    dir: PathBuf,
    /// Keep the directory (node logs, data, the acknowledgement log).
    #[arg(long)]
    keep: bool,
    /// `NACRE_LOG` of the node processes (their logs are in `DIR/logs`).
    #[arg(long, default_value = "info")]
    node_log: String,
    /// Never use network namespaces: isolate nodes with SIGSTOP.
    #[arg(long)]
    no_netns: bool,
    /// Print the report as one JSON object.
    #[arg(long)]
    json: bool,
    /// Clients write behind as a mount does: creates, removes and renames in the directories
    /// they make, and the data of the small files they close, go out after the call returns
    /// (every client syncs its directories before the check, so nothing a close acknowledged
    /// may be missing).
    #[arg(long)]
    write_behind: bool,
    /// The workload's clients work through a FUSE mount of the volume (a `nacre mount` process
    /// with default flags, in `DIR/mnt`): POSIX calls, the kernel's caches and the mount's
    /// write-behind are in the path, and every error counted is the errno an application saw.
    #[arg(long)]
    fuse: bool,
    /// The volume compresses its data in 64 KiB blocks (`zstd`, `zstd:LEVEL` or `lz4`), in
    /// its clients: every write of the run goes through compressed frames.
    #[arg(long)]
    compress: Option<nacre_api::master::Compression>,
    /// The volume erasure-codes its data as K data and M parity shards (e.g. `2+1`) on K+M data
    /// nodes per partition: reads of a killed node's shards are reconstructed from the others.
    #[arg(long, value_name = "K+M", value_parser = nacre_api::master::parse_ec)]
    ec: Option<nacre_func::EcSpec>,
}

#[derive(Debug, Args)]
struct GarbageArgs {
    /// Messenger addresses (host:port).
    #[arg(required = true)]
    addrs: Vec<String>,
    /// HTTP addresses to hammer too.
    #[arg(long)]
    http: Vec<String>,
    #[arg(long, default_value_t = 1)]
    seed: u64,
}

/// Parses `90`, `90s`, `500ms`, `5m` or `1h`.
pub fn parse_duration(s: &str) -> Result<Duration, DurationError> {
    let s = s.trim();
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let n: u64 = num
        .parse()
        .map_err(|_| DurationError::NotANumber(s.to_string()))?;
    let ms = match unit {
        "ms" => n,
        "" | "s" => n.saturating_mul(1000),
        "m" => n.saturating_mul(60_000),
        "h" => n.saturating_mul(3_600_000),
        _ => {
            return Err(DurationError::UnknownUnit {
                unit: unit.to_string(),
                input: s.to_string(),
            });
        }
    };
    Ok(Duration::from_millis(ms))
}

/// Why [`parse_duration`] refused its input (shown by clap as the argument's error).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum DurationError {
    #[error("{0:?} is not a duration (like 90s, 5m, 1h)")]
    NotANumber(String),
    #[error("unknown unit {unit:?} in {input:?} (ms, s, m or h)")]
    UnknownUnit { unit: String, input: String },
}

pub fn run(a: CheckArgs) -> anyhow::Result<()> {
    match a.cmd {
        CheckCmd::Run(r) => run_check(r),
        CheckCmd::Garbage(g) => run_garbage(g),
        CheckCmd::Client(c) => kill_client::client::run(c),
    }
}

fn messenger(name: &str) -> anyhow::Result<Messenger> {
    let cfg = MsgrConfig {
        workers: 1,
        connect_timeout: Duration::from_secs(2),
        ..MsgrConfig::default()
    };
    Ok(Messenger::new(name, cfg, Arc::new(TcpTransport))?)
}

fn run_garbage(a: GarbageArgs) -> anyhow::Result<()> {
    crate::runtime()?.block_on(async move {
        let msgr = messenger("check-garbage")?;
        let mut bad = 0;
        for addr in &a.addrs {
            let r = garbage::hammer_msgr(&msgr.client(), addr, a.seed).await;
            bad += r.problems.len();
            println!("{r}");
        }
        for addr in &a.http {
            let r = garbage::hammer_http(addr, a.seed).await;
            bad += r.problems.len();
            println!("{r}");
        }
        let m = msgr.clone();
        tokio::task::spawn_blocking(move || m.shutdown()).await?;
        if bad > 0 {
            bail!("{bad} bad inputs were not answered cleanly");
        }
        Ok(())
    })
}

/// One injected fault.
#[derive(Clone, Debug, Serialize)]
struct Fault {
    at_ms: u64,
    kind: &'static str,
    node: String,
    detail: String,
}

/// Fail-overs the summary lists one by one (the slowest).
const SHOWN_FAILOVERS: usize = 8;
/// Size of data node 0's loop-mounted disk: room for its share of a 30-minute soak's data and
/// Raft logs (2 GiB filled at minute 25 of a `--fuse` soak), so that only the `full-disk` fault
/// fills it. A sparse file: it takes only what is written.
const SMALL_DISK_MIB: u64 = 6144;

/// Time from a fault to the first successful write on a partition its node led.
#[derive(Clone, Debug, Serialize)]
struct Failover {
    kind: &'static str,
    node: String,
    target: String,
    /// None: no write succeeded within the probe's limit.
    ms: Option<u64>,
}

#[derive(Debug, Serialize)]
struct Summary {
    schedule: Schedule,
    seed: u64,
    duration_s: u64,
    clients: usize,
    isolation: &'static str,
    /// The volume's compression (`--compress`), as text; `none` without.
    compression: String,
    /// The volume's erasure code (`--ec`), as `K+M`; `none` without.
    erasure_code: String,
    ops_acked: u64,
    ops_failed: u64,
    /// With `--fuse`: why the mount could not be unmounted cleanly.
    mount_error: Option<String>,
    /// The workload's failed calls by the errno an application would have seen.
    errors: std::collections::BTreeMap<String, u64>,
    /// Clients that could not make their directories and did no work.
    clients_gave_up: u64,
    faults: Vec<Fault>,
    failovers: Vec<Failover>,
    failover_p50_ms: Option<u64>,
    failover_p99_ms: Option<u64>,
    failover_max_ms: Option<u64>,
    /// Per data node restart: how long until its partitions were writable again.
    restarts: Vec<restart::Recovery>,
    /// The slowest of those (from the node's report to the master until every partition was
    /// writable, by the master's view and by a write); None: none measured, or one never was.
    restart_writable_max_ms: Option<u64>,
    corrupt_blocks_detected: usize,
    /// Bad blocks the data nodes' background scrub found (a pass every `SCRUB_PERIOD_SECS`), and
    /// of those the ones no replica could repair.
    scrub_bad_blocks: usize,
    scrub_unrepaired: usize,
    /// Whether the scrub found every flipped byte in live data (`flips`).
    flips: flips::FlipReport,
    garbage_problems: Vec<String>,
    report: workload::Report,
    /// For each path with a finding: its lines of the acknowledgement log (what was acknowledged).
    history: std::collections::BTreeMap<String, Vec<String>>,
    healed_within_ms: Option<u64>,
    /// Why the cluster was not writable again in time: the partitions still read-only or
    /// without a leader when the wait ended.
    not_healed: Option<String>,
    /// Normal extents after the run: on the data nodes' disks, and used by the volume's files.
    extents: Option<ExtentUse>,
    /// The garbage collector's sweeps after the workload stopped (`gc`).
    gc: gc::GcOutcome,
    /// The killed clients (`kill-client`, `all`): their violations are in `report` too.
    kill_client: Option<kill_client::Report>,
}

/// How many normal extents (one file each on every replica) the data nodes hold after the run,
/// against how many the volume's files refer to. The difference is extents no file will ever
/// read: freed ones not yet released, and ones written by calls that failed before their keys
/// were committed.
#[derive(Debug, Serialize)]
struct ExtentUse {
    /// Distinct (partition, extent) pairs with files on any data node.
    on_disk: usize,
    /// Distinct (partition, extent) pairs the keys of the volume's files name.
    referenced: usize,
    /// On disk but named by no key.
    unreferenced: usize,
    /// Named by a key but on no data node's disk (must be 0).
    missing: usize,
    /// Files walked (hidden ones included).
    files: usize,
    /// Their extent keys.
    keys: usize,
}

fn run_check(a: RunArgs) -> anyhow::Result<()> {
    let seed = a.seed.unwrap_or_else(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(1)
    });
    if a.dir.exists() {
        std::fs::remove_dir_all(&a.dir)
            .with_context(|| format!("cannot clear {}", a.dir.display()))?;
    }
    let netns = !a.no_netns && harness::netns_available();
    let small_disk = matches!(a.schedule, Schedule::FullDisk | Schedule::All);
    if a.schedule == Schedule::FullDisk && !harness::small_disk_available() {
        bail!("the full-disk schedule needs root, mkfs.ext4 and a loop device");
    }
    let cfg = HarnessConfig {
        dir: std::fs::canonicalize(".")?.join(&a.dir),
        exe: std::env::current_exe()?,
        netns,
        // Room for what a 30-minute run writes (about 300 MB per data node): the fault fills it
        // to the last byte anyway.
        small_disk_mib: (small_disk && harness::small_disk_available()).then_some(SMALL_DISK_MIB),
        log: a.node_log.clone(),
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        // A client's step nests the workload's futures over the file system's calls (in test
        // builds frames of up to ~460 KB each): see `STACK_BYTES`.
        .thread_stack_size(crate::STACK_BYTES)
        .enable_all()
        .build()?;
    let keep = a.keep;
    let dir = cfg.dir.clone();
    let out = rt.block_on(async move {
        let mut h = Harness::start(cfg)?;
        // Ctrl-C or SIGTERM (a CI job cancelled) still stops the processes and deletes the
        // namespaces: that happens when the harness drops.
        let r = tokio::select! {
            r = drive(&mut h, &a, seed) => r,
            () = crate::stop_signal() => Err(anyhow::anyhow!("interrupted; the cluster is stopped")),
        };
        drop(h);
        r
    });
    if !keep {
        let _ = std::fs::remove_dir_all(&dir);
    }
    let (summary, json) = out?;
    if json {
        println!("{}", serde_json::to_string(&summary)?);
    } else {
        print_summary(&summary);
    }
    if summary.report.lost_ops > 0
        || !summary.report.findings.is_empty()
        || !summary.garbage_problems.is_empty()
        || summary.failovers.iter().any(|f| f.ms.is_none())
        || summary.mount_error.is_some()
        || !summary.gc.ok()
        || !summary.flips.missed.is_empty()
    {
        bail!("the check failed (see the report above)");
    }
    Ok(())
}

fn print_summary(s: &Summary) {
    println!(
        "schedule {:?}, seed {}, {} s of faults, {} clients, isolation by {}, compression {}, \
         erasure code {}",
        s.schedule, s.seed, s.duration_s, s.clients, s.isolation, s.compression, s.erasure_code
    );
    println!(
        "operations: {} acknowledged, {} failed (during faults)",
        s.ops_acked, s.ops_failed
    );
    if let Some(e) = &s.mount_error {
        println!("MOUNT: {e}");
    }
    if !s.errors.is_empty() {
        let errors: Vec<String> = s.errors.iter().map(|(e, n)| format!("{e} ×{n}")).collect();
        println!("errors the clients saw: {}", errors.join(", "));
    }
    if s.clients_gave_up > 0 {
        println!(
            "WARNING: {} clients could not make their directories and did no work",
            s.clients_gave_up
        );
    }
    let mut kinds: Vec<&str> = s.faults.iter().map(|f| f.kind).collect();
    kinds.sort_unstable();
    kinds.dedup();
    let counts: Vec<String> = kinds
        .iter()
        .map(|k| format!("{} {k}", s.faults.iter().filter(|f| f.kind == *k).count()))
        .collect();
    println!("faults injected: {}", counts.join(", "));
    if !s.failovers.is_empty() {
        let show = |v: Option<u64>| v.map_or("-".into(), |v| v.to_string());
        println!(
            "fail-over (fault to first successful write on a partition the node led): {} measured, p50 {} ms, p99 {} ms, max {} ms",
            s.failovers.len(),
            show(s.failover_p50_ms),
            show(s.failover_p99_ms),
            show(s.failover_max_ms),
        );
        // The slowest, each with its cause.
        let mut slow: Vec<&Failover> = s.failovers.iter().filter(|f| f.ms.is_some()).collect();
        slow.sort_by_key(|f| std::cmp::Reverse(f.ms));
        for f in slow.iter().take(SHOWN_FAILOVERS) {
            println!(
                "  {:>6} ms  {} after {} of {}",
                show(f.ms),
                f.target,
                f.kind,
                f.node
            );
        }
        for f in s.failovers.iter().filter(|f| f.ms.is_none()) {
            println!(
                "  no write on {} within {PROBE_LIMIT:?} after {} of {}",
                f.target, f.kind, f.node
            );
        }
    }
    if !s.restarts.is_empty() {
        println!(
            "data node restarts ({} measured): from the node's report to the master until every partition on it was writable (view / write), aim {} ms:",
            s.restarts.len(),
            restart::WRITABLE_WITHIN.as_millis()
        );
        let ms = |v: Option<u64>| v.map_or("never".to_string(), |v| format!("{v} ms"));
        for r in &s.restarts {
            println!(
                "  {} at {} s: reported {} after the restart, {} partitions writable after {} / {} (slowest {}){}",
                r.node,
                r.at_ms / 1000,
                ms(r.reported_ms),
                r.partitions,
                ms(r.view_ms),
                ms(r.write_ms),
                r.slowest.as_deref().unwrap_or("-"),
                if r.within_limit() {
                    ""
                } else {
                    "  OVER THE LIMIT"
                }
            );
        }
        println!(
            "  max {}",
            s.restart_writable_max_ms
                .map_or("never".to_string(), |v| format!("{v} ms"))
        );
    }
    if s.corrupt_blocks_detected > 0 {
        println!(
            "corrupt blocks detected and repaired on read: {}",
            s.corrupt_blocks_detected
        );
    }
    let fl = &s.flips;
    if fl.repaired + fl.not_live + fl.missed.len() + fl.unknown.len() > 0 {
        println!(
            "flipped blocks after the run: {} in live data and repaired, {} no longer live, {} missed by the scrub{}",
            fl.repaired,
            fl.not_live,
            fl.missed.len(),
            if fl.unknown.is_empty() {
                String::new()
            } else {
                format!(", {} not asked", fl.unknown.len())
            }
        );
        for m in fl.missed.iter().chain(&fl.unknown).take(8) {
            println!("  {m}");
        }
        if !fl.scrub_incomplete.is_empty() {
            println!(
                "  scrub passes not completed in time on: {}",
                fl.scrub_incomplete.join(", ")
            );
        }
    }
    if s.scrub_bad_blocks > 0 {
        println!(
            "corrupt blocks found by the scrub: {} ({} no replica could repair)",
            s.scrub_bad_blocks, s.scrub_unrepaired
        );
    }
    for p in &s.garbage_problems {
        println!("bad input not handled cleanly: {p}");
    }
    match s.healed_within_ms {
        Some(ms) => println!("cluster writable again {ms} ms after the last fault"),
        None => println!(
            "cluster NOT fully writable again after the last fault: {}",
            s.not_healed.as_deref().unwrap_or("unknown")
        ),
    }
    if let Some(e) = &s.extents {
        println!(
            "normal extents: {} on disk, {} used by {} files ({} keys), {} unused, {} missing",
            e.on_disk, e.referenced, e.files, e.keys, e.unreferenced, e.missing
        );
    }
    let g = &s.gc;
    println!(
        "garbage collection after the run: {} extents ({} bytes) freed, {} referenced, {} unreferenced left ({} bytes)",
        g.freed, g.freed_bytes, g.referenced, g.unreferenced_left, g.unreferenced_left_bytes
    );
    for e in &g.errors {
        println!("  {e}");
    }
    if let Some(k) = &s.kill_client {
        print_kill_client(k);
    }
    println!("{}", s.report);
    for (path, lines) in &s.history {
        println!("acknowledged operations (or journal lines) on {path}:");
        for l in lines {
            println!("  {l}");
        }
    }
}

async fn connect(client: Client, masters: &[String]) -> anyhow::Result<Arc<NetVolume>> {
    let mc = MasterClient::new(client.clone(), masters.to_vec());
    let vol = NetVolume::connect(client, mc, VOLUME)
        .await
        .map_err(|e| anyhow::anyhow!("cannot open volume {VOLUME}: {e}"))?;
    Ok(Arc::new(vol))
}

/// Waits (bounded) until every partition of the volume is writable with a leader.
async fn wait_writable(mc: &MasterClient, within: Duration) -> anyhow::Result<()> {
    let deadline = Instant::now() + within;
    loop {
        let blocked = match mc.volume(VOLUME).await {
            Ok(v) if v.data_partitions.is_empty() => vec!["no data partitions".to_string()],
            Ok(v) => not_writable(&v),
            Err(e) => vec![format!("volume view: {e}")],
        };
        if blocked.is_empty() {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!(
                "volume {VOLUME} not writable within {within:?}: {}",
                blocked.join("; ")
            );
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// The partitions of `v` that cannot take writes (read-only, or no leader known), described.
fn not_writable(v: &nacre_master::map::VolumeView) -> Vec<String> {
    let kinds = v
        .meta_partitions
        .iter()
        .map(|p| ("meta", p))
        .chain(v.data_partitions.iter().map(|p| ("data", p)));
    kinds
        .filter(|(_, p)| p.status != PartitionStatus::Rw || p.leader.is_none())
        .map(|(kind, p)| {
            let replicas: Vec<String> =
                p.spec.replicas.iter().map(|r| r.node.to_string()).collect();
            format!(
                "{kind} partition {} ({:?}, leader {}, replicas {})",
                p.spec.id,
                p.status,
                p.leader.map_or("none".to_string(), |l| l.to_string()),
                replicas.join(",")
            )
        })
        .collect()
}

async fn drive(h: &mut Harness, a: &RunArgs, seed: u64) -> anyhow::Result<(Summary, bool)> {
    let msgr = messenger("check")?;
    let masters = h.masters();
    let mc = MasterClient::new(msgr.client(), masters.clone());
    h.wait_healthy(&mc, Duration::from_secs(60)).await?;
    mc.execute(&MapCommand::CreateTenant {
        name: "check".into(),
        access_key: "CHECK".into(),
        secret_key: "0123456789abcdef".into(),
    })
    .await?;
    mc.execute(&MapCommand::CreateVolume {
        name: VOLUME.into(),
        owner: "check".into(),
        replicas: 3,
        capacity: 0,
        meta_partitions: 3,
        data_partitions: 4,
        inode_step: 1 << 20,
        funcs: nacre_api::master::VolumeFuncs {
            compress: a.compress,
            ec: a.ec,
            ..Default::default()
        },
    })
    .await?;
    wait_writable(&mc, Duration::from_secs(60)).await?;

    let probe_vol = connect(msgr.client(), &masters).await?;
    let probe_fs = Arc::new(NetFs::new(probe_vol.clone()));
    let targets = probe_targets(&probe_fs, &probe_vol).await?;
    let prober = Prober {
        mc: mc.clone(),
        vol: probe_vol,
        fs: probe_fs,
        n: Arc::default(),
    };

    let wl = Arc::new(Workload::new(
        WorkloadConfig {
            clients: a.clients,
            seed,
            root: "check".into(),
            ..WorkloadConfig::default()
        },
        Some(h.dir().join("acks.jsonl")),
    )?);
    let (stop_tx, stop_rx) = watch::channel(false);
    let mut clients = tokio::task::JoinSet::new();
    let mount = if a.fuse {
        let mnt = h.dir().join("mnt");
        let m = mountfs::Mount::start(
            h.exe(),
            VOLUME,
            &masters,
            &mnt,
            &h.dir().join("logs").join("mount.log"),
            &a.node_log,
        )
        .await?;
        let fs = Arc::new(mountfs::MountFs::new(mnt));
        for id in 0..a.clients {
            let (wl, stop, fs) = (wl.clone(), stop_rx.clone(), fs.clone());
            clients.spawn(async move {
                wl.run_client(id, &*fs, stop).await;
            });
        }
        Some(m)
    } else {
        None
    };
    for id in (0..a.clients).filter(|_| !a.fuse) {
        let vol = connect(msgr.client(), &masters).await?;
        let (wl, stop) = (wl.clone(), stop_rx.clone());
        let cfg = NetFsConfig {
            write_behind: a.write_behind,
            flush_delay: a.write_behind.then_some(Duration::from_millis(10)),
            // The run sweeps with a short grace at its end (`gc`): these clients keep the
            // matching bound on their key commits.
            commit_within: gc::CLIENT_COMMIT_WITHIN,
            commit_every: gc::CLIENT_COMMIT_EVERY,
            ..NetFsConfig::default()
        };
        clients.spawn(async move {
            let fs = NetFs::with_config(vol, cfg);
            wl.run_client(id, &fs, stop).await;
            if let Err(e) = fs.sync_dir(nacre_api::meta::ROOT_INO).await {
                tracing::warn!(client = id, error = %e, "changes written behind were lost");
            }
        });
    }

    let start = Instant::now();
    let crash_loop = matches!(a.schedule, Schedule::KillClient | Schedule::All).then(|| {
        let mut c = kill_client::Crashes::new(kill_client::Ctx {
            exe: h.exe().to_path_buf(),
            masters: masters.clone(),
            dir: h.dir().to_path_buf(),
            log: a.node_log.clone(),
            interval: a.interval,
            seed,
            start,
            client: msgr.client(),
        });
        let stop = stop_rx.clone();
        tokio::spawn(async move {
            let r = c.run(stop).await;
            (c, r)
        })
    });
    let mut faults = Vec::new();
    let mut probes = tokio::task::JoinSet::new();
    let mut restarts = tokio::task::JoinSet::new();
    let restart_vol = connect(msgr.client(), &masters).await?;
    // Counts the faults injected: a restart's measurement ends at the next one.
    let (faults_tx, faults_rx) = watch::channel(0u64);
    let mut garbage_problems = Vec::new();
    // The fault schedule's randomness, reproducible from the seed.
    let mut rng = fastrand::Rng::with_seed(seed ^ 0x5EED_F00D);
    let mut turn = 0usize;
    let mut client_turn = 0usize;
    let mut kinds = vec![
        Schedule::KillData,
        Schedule::KillMeta,
        Schedule::KillMaster,
        Schedule::Partition,
        Schedule::Corrupt,
        Schedule::Garbage,
    ];
    // In the soak a full disk is one fault among the others, for one interval: with it standing
    // all along, any data node fault beside it leaves two of four data nodes unusable, fewer
    // than three replicas need.
    if h.has_small_disk() && a.schedule == Schedule::All {
        kinds.push(Schedule::FullDisk);
    }
    if a.schedule == Schedule::FullDisk {
        let n = h.fill_disk()?;
        faults.push(Fault {
            at_ms: 0,
            kind: "full-disk",
            node: "data-0".into(),
            detail: format!("filled with {} MiB", n >> 20),
        });
    }
    let free_at = a.duration * 2 / 3;
    let mut freed = false;
    while start.elapsed() < a.duration {
        tokio::time::sleep(a.interval / 2).await;
        for (node, status) in h.restart_exited()? {
            faults.push(fault(start, "supervisor-restart", &node, status));
        }
        if a.schedule == Schedule::FullDisk && !freed && start.elapsed() >= free_at {
            h.free_disk()?;
            freed = true;
            // Its node may have stopped on the full disk (a failed raft log write exits): a
            // supervisor would start it again.
            if let Some(&k) = h.of(Role::Data).first() {
                h.spawn(k)?;
            }
            faults.push(fault(start, "free-disk", "data-0", String::new()));
        }
        let kind = match a.schedule {
            Schedule::All => kinds[rng.usize(..kinds.len())],
            // Every other interval a node: a data node, then a meta node.
            Schedule::KillClient => {
                client_turn += 1;
                match client_turn % 4 {
                    2 => Schedule::KillData,
                    0 => Schedule::KillMeta,
                    _ => Schedule::None,
                }
            }
            s => s,
        };
        let half = a.interval / 2;
        match kind {
            Schedule::None => tokio::time::sleep(half).await,
            // The full-disk schedule fills the disk once, all along (above).
            Schedule::FullDisk if a.schedule == Schedule::FullDisk => {
                tokio::time::sleep(half).await
            }
            Schedule::FullDisk => {
                faults_tx.send_modify(|n| *n += 1);
                let n = h.fill_disk()?;
                faults.push(fault(
                    start,
                    "full-disk",
                    "data-0",
                    format!("filled with {} MiB", n >> 20),
                ));
                tokio::time::sleep(half).await;
                h.free_disk()?;
                if let Some(&k) = h.of(Role::Data).first() {
                    h.spawn(k)?;
                }
                faults.push(fault(start, "free-disk", "data-0", String::new()));
                let _ = h.wait_healthy(&mc, Duration::from_secs(30)).await;
            }
            Schedule::KillData | Schedule::KillMeta | Schedule::KillMaster => {
                let k = match kind {
                    Schedule::KillMaster => match master_leader(&mc, h).await {
                        Some(k) => k,
                        None => continue,
                    },
                    Schedule::KillMeta => pick(&h.of(Role::Meta), &mut rng),
                    _ => pick(&h.of(Role::Data), &mut rng),
                };
                let name = h.nodes[k].name.clone();
                let mut led = led_by(&mc, &h.nodes[k].addr, &targets).await;
                if kind == Schedule::KillMaster {
                    led = vec![Target::Master];
                }
                let label = kind_label(kind);
                faults_tx.send_modify(|n| *n += 1);
                h.kill(k);
                let t0 = Instant::now();
                faults.push(fault(start, label, &name, format!("{} led", led.len())));
                prober.spawn_probes(&mut probes, led, label, &name, t0);
                tokio::time::sleep(half).await;
                let restarted = restart::now();
                h.spawn(k)?;
                if h.nodes[k].role == Role::Data {
                    restarts.spawn(restart::measure(
                        mc.clone(),
                        restart_vol.clone(),
                        name.clone(),
                        h.nodes[k].addr.clone(),
                        restarted,
                        start,
                        faults_rx.clone(),
                    ));
                }
                // One failure at a time: the next fault waits for this node to be back.
                let _ = h.wait_healthy(&mc, Duration::from_secs(30)).await;
            }
            Schedule::Partition => {
                let k = match turn % 3 {
                    0 => pick(&h.of(Role::Data), &mut rng),
                    1 => pick(&h.of(Role::Meta), &mut rng),
                    _ => match master_leader(&mc, h).await {
                        Some(k) => k,
                        None => continue,
                    },
                };
                turn += 1;
                let name = h.nodes[k].name.clone();
                let mut led = led_by(&mc, &h.nodes[k].addr, &targets).await;
                if h.nodes[k].role == Role::Master {
                    led = vec![Target::Master];
                }
                faults_tx.send_modify(|n| *n += 1);
                h.isolate(k)?;
                let t0 = Instant::now();
                faults.push(fault(start, "partition", &name, h.isolation.to_string()));
                prober.spawn_probes(&mut probes, led, "partition", &name, t0);
                tokio::time::sleep(half).await;
                h.heal(k)?;
                let _ = h.wait_healthy(&mc, Duration::from_secs(30)).await;
            }
            Schedule::Corrupt => {
                for _ in 0..3 {
                    let k = pick(&h.of(Role::Data), &mut rng);
                    let node = h.nodes[k].name.clone();
                    match h.corrupt(k, &mut rng) {
                        Ok(Some(what)) => faults.push(fault(start, "corrupt", &node, what)),
                        Ok(None) => {}
                        // Flipping a byte can fail too (a byte in a punched hole of a full
                        // disk needs a block): no fault then, and the run goes on.
                        Err(e) => faults.push(fault(start, "corrupt-failed", &node, e.to_string())),
                    }
                }
                tokio::time::sleep(half).await;
            }
            Schedule::Garbage => {
                let client = msgr.client();
                // Bad input is for serving nodes: not one that is down (exited on a full disk,
                // or restarted by the supervisor step and not listening yet).
                let serving: Vec<usize> = (0..h.nodes.len())
                    .filter(|&k| !h.nodes[k].isolated() && h.nodes[k].alive())
                    .collect();
                let mut skipped = Vec::new();
                for n in serving.iter().map(|&k| &h.nodes[k]) {
                    let s = rng.u64(..);
                    let r = garbage::hammer_msgr(&client, &n.addr, s).await;
                    if r.down_before {
                        skipped.push(n.name.clone());
                        continue;
                    }
                    garbage_problems.extend(r.problems.iter().map(|p| format!("{}: {p}", n.name)));
                    let r = garbage::hammer_http(&n.http, s).await;
                    garbage_problems.extend(r.problems.iter().map(|p| format!("{}: {p}", n.name)));
                }
                let detail = if skipped.is_empty() {
                    String::new()
                } else {
                    format!("skipped (not serving before): {}", skipped.join(", "))
                };
                faults.push(fault(start, "garbage", "all nodes", detail));
                tokio::time::sleep(half).await;
            }
            Schedule::All | Schedule::KillClient => {
                unreachable!("All and KillClient are resolved to a kind above")
            }
        }
    }
    // Heal: every node running and connected, the disk freed.
    for k in 0..h.nodes.len() {
        h.heal(k)?;
        h.spawn(k)?;
    }
    h.free_disk()?;
    let last_fault = Instant::now();
    h.wait_healthy(&mc, Duration::from_secs(60)).await?;
    let healed = wait_writable(&mc, Duration::from_secs(120)).await;
    let healed_within_ms = healed
        .as_ref()
        .ok()
        .map(|()| last_fault.elapsed().as_millis() as u64);
    let not_healed = healed.err().map(|e| e.to_string());
    // A few seconds of writes on the healed cluster, then stop.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let _ = stop_tx.send(true);
    while clients.join_next().await.is_some() {}
    // Unmounting writes out what the mount holds behind; a mount that cannot is a failure.
    let mount_error = match mount {
        Some(m) => m.stop().await.err().map(|e| format!("{e:#}")),
        None => None,
    };
    let mut crashes = match crash_loop {
        Some(t) => {
            let (c, r) = t.await?;
            r.context("the kill-client loop failed")?;
            Some(c)
        }
        None => None,
    };
    let mut failovers: Vec<Failover> = Vec::new();
    while let Some(Ok(f)) = probes.join_next().await {
        failovers.push(f);
    }
    let mut recoveries: Vec<restart::Recovery> = Vec::new();
    while let Some(Ok(r)) = restarts.join_next().await {
        recoveries.push(r);
    }
    recoveries.sort_by_key(|r| r.at_ms);
    let restart_writable_max_ms = recoveries
        .iter()
        .map(restart::Recovery::worst_ms)
        .try_fold(0, |m, w| w.map(|w| m.max(w)))
        .filter(|_| !recoveries.is_empty());
    // Nothing writes any more: collect the leaked extents before the checker reads everything
    // back, so that it also shows the sweep deleted nothing a file uses.
    let gc = gc::sweep_at_end(&mc)
        .await
        .unwrap_or_else(|e| gc::GcOutcome {
            errors: vec![format!("cannot sweep: {e}")],
            ..gc::GcOutcome::default()
        });
    let flips = flips::verify(h, &msgr.client(), &h.flips).await;
    let verify_vol = connect(msgr.client(), &masters).await?;
    let mut report = wl.verify(&NetFs::new(verify_vol.clone())).await;
    if let Some(c) = &mut crashes {
        c.recheck(&NetFs::new(verify_vol.clone())).await;
        let v = &c.report.violations;
        report.lost_ops += v.iter().filter(|v| v.what.loses_synced()).count() as u64;
        report
            .findings
            .extend(v.iter().cloned().map(workload::Finding::Crash));
        faults.append(&mut c.faults);
        faults.sort_by_key(|f| f.at_ms);
    }
    let extents = match extent_use(h, &verify_vol).await {
        Ok(e) => Some(e),
        Err(e) => {
            tracing::warn!(error = %e, "could not account for the extents");
            None
        }
    };
    let stats = wl.stats().snapshot();
    let mut history = history(&h.dir().join("acks.jsonl"), &report);
    if let Some(c) = &crashes {
        history.extend(c.report.journals.clone());
    }
    let mut ms: Vec<u64> = failovers.iter().filter_map(|f| f.ms).collect();
    ms.sort_unstable();
    let data_nodes: Vec<usize> = (0..h.nodes.len())
        .filter(|&k| h.nodes[k].role == Role::Data)
        .collect();
    let count = |what: &str| -> usize { data_nodes.iter().map(|&k| h.log_matches(k, what)).sum() };
    let detected = count("checksum mismatch on read");
    let scrub_bad_blocks = count("scrub: checksum mismatch");
    let scrub_unrepaired = count("scrub: no replica could repair");
    let summary = Summary {
        schedule: a.schedule,
        seed,
        duration_s: a.duration.as_secs(),
        clients: a.clients,
        isolation: h.isolation,
        compression: a
            .compress
            .map_or_else(|| "none".to_string(), |c| c.to_string()),
        erasure_code: a
            .ec
            .map_or_else(|| "none".to_string(), |ec| format!("{}+{}", ec.k, ec.m)),
        ops_acked: stats.acked,
        ops_failed: stats.failed,
        errors: stats.errors.clone(),
        mount_error,
        clients_gave_up: stats.gave_up,
        faults,
        failover_p50_ms: ms.get(ms.len() / 2).copied(),
        failover_p99_ms: ms
            .get((ms.len() * 99).div_ceil(100).saturating_sub(1))
            .copied(),
        failover_max_ms: ms.last().copied(),
        failovers,
        restarts: recoveries,
        restart_writable_max_ms,
        corrupt_blocks_detected: detected,
        scrub_bad_blocks,
        scrub_unrepaired,
        flips,
        garbage_problems,
        report,
        history,
        healed_within_ms,
        not_healed,
        extents,
        gc,
        kill_client: crashes.map(|c| c.report),
    };
    let m = msgr.clone();
    tokio::task::spawn_blocking(move || m.shutdown()).await?;
    Ok((summary, a.json))
}

/// Walks the volume's tree for the extents its files use, and the data nodes' directories for
/// the extents they hold (`DIR/extents/PARTITION/ID.data`).
async fn extent_use(h: &Harness, vol: &Arc<NetVolume>) -> anyhow::Result<ExtentUse> {
    use std::collections::BTreeSet;
    let meta = MetaFs::new(vol.clone());
    let mut used: BTreeSet<(u64, u64)> = BTreeSet::new();
    let (mut files, mut keys) = (0usize, 0usize);
    let mut dirs = vec![nacre_api::meta::ROOT_INO];
    while let Some(dir) = dirs.pop() {
        let mut after: Option<Vec<u8>> = None;
        loop {
            let page = meta.readdir(dir, after.as_deref(), 1024).await?;
            let Some(last) = page.last() else { break };
            after = Some(last.name.clone());
            for e in &page {
                match e.kind {
                    nacre_api::meta::FileType::Dir => dirs.push(e.ino),
                    nacre_api::meta::FileType::File => {
                        let (_, ks) = meta.extents(e.ino).await?;
                        files += 1;
                        keys += ks.len();
                        used.extend(
                            ks.iter()
                                .filter(|k| k.extent.is_normal())
                                .map(|k| (k.partition.0, k.extent.0)),
                        );
                    }
                    _ => {}
                }
            }
        }
    }
    let mut on_disk: BTreeSet<(u64, u64)> = BTreeSet::new();
    for n in h.nodes.iter().filter(|n| n.role == Role::Data) {
        for part in std::fs::read_dir(n.dir.join("extents"))
            .into_iter()
            .flatten()
            .flatten()
        {
            let Some(p) = part
                .file_name()
                .to_str()
                .and_then(|s| s.parse::<u64>().ok())
            else {
                continue;
            };
            for f in std::fs::read_dir(part.path())
                .into_iter()
                .flatten()
                .flatten()
            {
                let name = f.file_name();
                let id = name
                    .to_str()
                    .and_then(|s| s.strip_suffix(".data"))
                    .and_then(|s| s.parse::<u64>().ok());
                if let Some(id) = id.filter(|&id| ExtentId(id).is_normal()) {
                    on_disk.insert((p, id));
                }
            }
        }
    }
    Ok(ExtentUse {
        on_disk: on_disk.len(),
        referenced: used.len(),
        unreferenced: on_disk.difference(&used).count(),
        missing: used.difference(&on_disk).count(),
        files,
        keys,
    })
}

/// The acknowledgement log's lines about each path the report has a finding for (the log
/// names a file by `path`, and by `from` when it was renamed).
fn history(
    acks: &std::path::Path,
    report: &workload::Report,
) -> std::collections::BTreeMap<String, Vec<String>> {
    let mut out = std::collections::BTreeMap::new();
    if report.findings.is_empty() {
        return out;
    }
    let text = std::fs::read_to_string(acks).unwrap_or_default();
    for f in &report.findings {
        let quoted = format!("\"{}\"", f.path());
        let lines: Vec<String> = text
            .lines()
            .filter(|l| l.contains(&quoted))
            .map(String::from)
            .collect();
        out.insert(f.path().to_string(), lines);
    }
    out
}

fn print_kill_client(k: &kill_client::Report) {
    let j = &k.journal;
    println!(
        "killed clients: {} incarnations, {} killed, {} ended by themselves, {} not ready; \
         {} calls ({} writes of {} bytes, {} unlinks, {} fsyncs, {} directory syncs acknowledged)",
        k.incarnations,
        k.kills,
        k.exited,
        k.not_ready,
        j.started,
        j.writes,
        j.bytes_written,
        j.unlinks,
        j.fsyncs,
        j.syncs
    );
    let o = &k.outcomes;
    println!(
        "  {} checks, {} files ({} bytes): {} as synced, {} as last written, {} with unsynced \
         changes lost, {} empty, {} cut to a prefix; {} deferred; {} rechecked at the end \
         ({} changed); {} violations",
        k.checks,
        k.files_checked,
        k.bytes_read,
        o.synced,
        o.newest,
        o.lost,
        o.empty,
        o.partial,
        k.deferred,
        k.rechecked_files,
        k.changed_since_check,
        k.violations.len()
    );
    for f in &k.failures {
        println!("  ended by a failed call: {f}");
    }
    for c in &k.changes {
        println!("  changed after its check: {c}");
    }
}

fn fault(start: Instant, kind: &'static str, node: &str, detail: String) -> Fault {
    Fault {
        at_ms: start.elapsed().as_millis() as u64,
        kind,
        node: node.to_string(),
        detail,
    }
}

fn kind_label(s: Schedule) -> &'static str {
    match s {
        Schedule::KillData => "kill-data",
        Schedule::KillMeta => "kill-meta",
        Schedule::KillMaster => "kill-master",
        _ => "other",
    }
}

fn pick(of: &[usize], rng: &mut fastrand::Rng) -> usize {
    of[rng.usize(..of.len().max(1))]
}
