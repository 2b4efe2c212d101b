//! `nacre`: one binary for every role of a nacre cluster, its CLI and its benchmarks.

/// Prints a line for the operator of a long-running command (`server`, `up`, `mount`). Unlike
/// `println!` it never panics: a closed stdout (the terminal or the pipe reading it went away) must
/// not take a running cluster down with it.
macro_rules! say {
    ($($t:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stdout(), $($t)*);
    }};
}

mod admin;
mod bench;
mod check;
mod config;
mod fs_cmd;
mod http;
mod mount;
mod node;

use nacre_master::MasterAdmin as _;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use bytes::Bytes;
use clap::{Args, Parser, Subcommand, ValueEnum};
use nacre_msgr::{Messenger, MsgrConfig, Payload, TcpTransport};
use nacre_proto::msg::sys::{Echo, EchoRequest, Ping, PingRequest};

use crate::bench::report::{self, parse_size};
use crate::node::{Node, NodeConfig, RoleName};

/// nacre: a programmable distributed file and object store for container platforms.
///
/// Run `nacre up` to start a local cluster in one process, `nacre server --config FILE` to run one
/// node of a real deployment, and `nacre bench …` to measure. Logs go to stderr; set NACRE_LOG
/// (e.g. `NACRE_LOG=debug` or `NACRE_LOG=nacre_msgr=trace`) to change their level.
#[derive(Debug, Parser)]
#[command(name = "nacre", version, propagate_version = true)]
struct Cli {
    /// How this process's threads are scheduled (Linux): `batch` (SCHED_BATCH) keeps a thread that
    /// wakes another from being preempted by it, so a Raft round sends all its appends and hands its
    /// log write over before the woken threads run; `normal` leaves the default (SCHED_OTHER).
    /// See docs/ARCHITECTURE.md, "Thread scheduling".
    #[arg(long, global = true, value_enum, default_value_t = Sched::Batch)]
    sched: Sched,
    #[command(subcommand)]
    cmd: Cmd,
}

/// The scheduling policy of a nacre process's threads (`--sched`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Sched {
    Batch,
    Normal,
}

#[derive(Debug, Subcommand)]
enum Cmd {
    /// Run one nacre node from a TOML config file (NACRE_* variables override its keys).
    ///
    /// Example: `NACRE_ROLE=master NACRE_MSGR__WORKERS=4 nacre server --config node.toml`. Keys:
    /// name, role (master|meta|data|func|none), listen, advertise, http_listen, data_dir, zone, masters,
    /// heartbeat_ms, capacity, raft_early_appends, spare_bytes, spare_keep_secs, direct_streams,
    /// scrub_rate, scrub_period_secs, gc_period_secs, gc_grace_secs; [master] id, peers, tick_ms, duty_interval_ms,
    /// node_timeout_ms, min_writable_data_partitions, data_partitions_step, meta_split_inodes,
    /// meta_split_memory, meta_split_step, default_tenant, rebuild_after_ms; [msgr] workers, assign, max_frame, conns_per_peer,
    /// max_inflight_per_conn, max_inflight_bytes_per_conn, max_inflight_total,
    /// max_inflight_bytes_total, connect_timeout_ms, default_deadline_ms; [func] workers,
    /// max_inflight. `--print-config` shows them all with their values.
    Server(ServerArgs),
    /// Start a local cluster in this process and keep it running until Ctrl-C.
    ///
    /// One master, three meta nodes, three data nodes (--data-nodes) and one function server
    /// (--funcs), each on its own loopback port with its own directory under DIR. Addresses are printed and written to DIR/up.json, where the admin
    /// commands (`nacre vol create …`) run in the same directory find them.
    Up(UpArgs),
    /// Stop the `nacre up` running in DIR (SIGTERM, then wait until it has unmounted and stopped).
    Down(mount::DownArgs),
    /// Mount a volume with FUSE and serve it until Ctrl-C, SIGTERM or `umount DIR`.
    ///
    /// Example: `nacre mount demo /mnt/demo --master 10.0.0.1:7100`. Needs /dev/fuse (and root, or
    /// the fusermount3 helper).
    Mount(mount::MountArgs),
    /// Cluster-wide status from the master leader.
    Cluster(admin::ClusterArgs),
    /// Meta, data and func nodes.
    Node(admin::NodeArgs),
    /// Function servers: the storage functions callers may run remotely.
    Func(admin::FuncArgs),
    /// Volumes: create, list, info, delete.
    Vol(admin::VolArgs),
    /// Meta and data partitions.
    Partition(admin::PartitionArgs),
    /// Tenants and their access keys.
    Tenant(admin::TenantArgs),
    /// A volume's files without FUSE: ls, stat, put, get, rm, mkdir, cat.
    ///
    /// Paths are volume paths (`/a/b`). Example: `nacre fs put -p ./big.iso /isos/`, then
    /// `nacre fs ls -l /isos`. The cluster is found as the admin commands find it (--master,
    /// NACRE_MASTERS, or ./.nacre/up.json); --volume picks the volume (default: `default`).
    Fs(fs_cmd::FsArgs),
    /// The reliability harness: a multi-process cluster, a verifying workload, fault schedules
    /// (kill -9, network partitions, a full disk, corrupted blocks, bad input) and a checker.
    ///
    /// Example: `sudo nacre check run --schedule kill-data --duration 60s`. Prints the operations,
    /// the faults, fail-over times and whether any acknowledged write was lost (exit 1 if so).
    Check(check::CheckArgs),
    /// Send ping (or echo) requests to a node and print round-trip times.
    Ping(PingArgs),
    /// Benchmarks. Each prints a table, or one JSON object per line with --json.
    #[command(subcommand)]
    Bench(BenchCmd),
}

#[derive(Debug, Args)]
struct ServerArgs {
    /// TOML configuration file.
    #[arg(long, short)]
    config: Option<PathBuf>,
    /// Print the effective configuration (after NACRE_* overrides) and exit.
    #[arg(long)]
    print_config: bool,
}

#[derive(Debug, Args)]
struct UpArgs {
    /// Directory for the cluster's state (created if missing).
    #[arg(long, default_value = ".nacre")]
    dir: PathBuf,
    /// Messenger listen address of the master.
    #[arg(long, default_value = "127.0.0.1:0")]
    listen: String,
    /// HTTP listen address of the master (metrics and the admin API).
    #[arg(long, default_value = "127.0.0.1:0")]
    http_listen: String,
    /// Also mount the volume (created if missing) on this directory (created if missing).
    #[arg(long)]
    mount: Option<PathBuf>,
    /// The volume --mount mounts.
    #[arg(long, default_value = "default")]
    volume: String,
    /// Function servers to start (0 for none).
    #[arg(long, default_value_t = 1)]
    funcs: usize,
    /// Data nodes to start (at least one; an erasure-coded volume K+M needs K+M of them).
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u16).range(1..))]
    data_nodes: u16,
    #[command(flatten)]
    mount_flags: mount::MountFlags,
}

#[derive(Debug, Args)]
struct PingArgs {
    /// Address of the node (`host:port`).
    addr: String,
    /// Number of requests.
    #[arg(long, short = 'n', default_value_t = 5)]
    count: u32,
    /// Send echo requests carrying this many bytes (e.g. 4k) instead of pings.
    #[arg(long, value_parser = parse_size)]
    size: Option<usize>,
    /// Per-request timeout in milliseconds.
    #[arg(long, default_value_t = 3000)]
    timeout_ms: u64,
}

#[derive(Debug, Subcommand)]
enum BenchCmd {
    /// Echo RPCs through the messenger on loopback, beside raw blocking TCP in the same run.
    Msgr(BenchMsgrArgs),
    /// The mdtest phases (TreeCreation … TreeRemoval) through the client SDK against a local
    /// cluster in this process (1 master, 3 meta nodes, 3 replicas); or, with --memory N, the bytes
    /// a meta partition needs per small file.
    Meta(BenchMetaArgs),
    /// The data path through the client SDK against a local cluster in this process (1 master, 3
    /// meta and 3 data nodes, 3 replicas): sequential writes, random overwrites and reads, and
    /// primary-backup versus Raft appends, beside the raw disk.
    Data(BenchDataArgs),
    /// Raft replication: 3 stores in this process (loopback TCP, raft-engine logs in a temp dir);
    /// proposals/s and commit latency, idle CPU and memory per group.
    Raft(BenchRaftArgs),
    /// Everyday file-system work on any mounted directory (a nacre or ceph-fuse mount, a local
    /// disk): small-file creates with data, untar, cp -r, rm -rf, git clone and checkout, rename
    /// and unlink storms. Each phase ends with fsync of its directory and syncfs, inside the time.
    Fs(BenchFsArgs),
    /// Storage functions inline and on a function server, in one run against a local cluster
    /// in this process (1 master, 3 meta, 3 data nodes, 1 function server): each transform's
    /// calls/s and GB/s, and 4 KiB random writes and 64 KiB writes through the client on a
    /// zstd-compressed volume compressing inline and one compressing on the server.
    Func(BenchFuncArgs),
}

#[derive(Debug, Args)]
struct BenchFuncArgs {
    /// Parts, comma-separated: transforms, randwrite-4k, write-64k.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "transforms,randwrite-4k,write-64k"
    )]
    parts: Vec<String>,
    /// Calls or writers in flight, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1,4,16,64")]
    depth: Vec<usize>,
    /// Measured seconds per configuration.
    #[arg(long, default_value_t = 5.0)]
    secs: f64,
    /// MiB of each randwrite-4k writer's file (written before the timing).
    #[arg(long, default_value_t = 8)]
    file_mib: u64,
    /// One JSON object per line instead of a table.
    #[arg(long)]
    json: bool,
}

#[derive(Debug, Args)]
struct BenchFsArgs {
    /// The directory to measure (a mount point or any directory in one); the benchmark works in
    /// a fresh subdirectory, removed at the end.
    #[arg(long)]
    dir: PathBuf,
    /// The `impl` of every row (e.g. nacre, ceph-fuse, tmpfs).
    #[arg(long, default_value = "fs")]
    label: String,
    /// Workloads, comma-separated: create, create-parallel, untar, cp, rm, git-clone,
    /// git-checkout, rename, unlink, holes, holes-mmap, overwrite, or all.
    #[arg(long, value_delimiter = ',', default_value = "all")]
    workloads: Vec<String>,
    /// File sizes of `create` (comma-separated; units k, m).
    #[arg(long, value_delimiter = ',', value_parser = parse_size, default_value = "1k,4k,16k,64k,128k")]
    sizes: Vec<usize>,
    /// Files per writer in `create` and `create-parallel`.
    #[arg(long, default_value_t = 500)]
    files: usize,
    /// Writer threads of `create-parallel`, each in its own directory.
    #[arg(long, default_value_t = 2)]
    writers: usize,
    /// File size of `create-parallel`.
    #[arg(long, value_parser = parse_size, default_value = "4k")]
    parallel_size: usize,
    /// The tree archived (outside --dir) and unpacked by `untar`.
    #[arg(long, default_value = "/usr/share/doc")]
    tree: PathBuf,
    /// Archive a generated tree of this many files (1 KiB to 256 KiB) instead of --tree.
    #[arg(long, conflicts_with = "tree")]
    gen_tree: Option<usize>,
    /// Files of the rename and unlink storms.
    #[arg(long, default_value_t = 1000)]
    storm: usize,
    /// The local repository `git-clone` clones (any directory inside it).
    #[arg(long, default_value = ".")]
    git_repo: PathBuf,
    /// How many commits before HEAD `git-checkout` goes (and back).
    #[arg(long, default_value_t = 200)]
    git_back: usize,
    /// 4 KiB files created, synced and removed before the first phase, not timed.
    #[arg(long, default_value_t = 100)]
    warmup_files: usize,
    /// File size of `holes`, `holes-mmap` and `overwrite` (units k, m, g).
    #[arg(long, value_parser = parse_size, default_value = "256m")]
    sparse_size: usize,
    /// 4 KiB writes of `overwrite`.
    #[arg(long, default_value_t = 8192)]
    overwrites: u64,
    /// One JSON object per line instead of a table.
    #[arg(long)]
    json: bool,
}

#[derive(Debug, Args)]
struct BenchMetaArgs {
    /// Concurrent clients, each in its own subtree.
    #[arg(long, default_value_t = 4)]
    clients: usize,
    /// Directories and files per client.
    #[arg(long, default_value_t = 1000)]
    items: usize,
    /// Branching of each client's tree.
    #[arg(long, default_value_t = 4)]
    branch: usize,
    /// Depth of each client's tree.
    #[arg(long, default_value_t = 2)]
    depth: usize,
    /// Meta partitions of the benchmark volume.
    #[arg(long, default_value_t = 3)]
    meta_partitions: u32,
    /// How the clients send meta writes, a run each: `once` (exactly-once calls, as every client
    /// does) and `plain` (bare commands: what exactly-once costs).
    #[arg(long, value_delimiter = ',', default_value = "once")]
    calls: Vec<bench::meta::Calls>,
    /// Measure memory per small file with this many files in a bare partition instead.
    #[arg(long)]
    memory: Option<u64>,
    /// Extent keys per file for --memory.
    #[arg(long, default_value_t = 0)]
    extents: u64,
    /// One JSON object per line instead of a table.
    #[arg(long)]
    json: bool,
}

#[derive(Debug, Args)]
struct BenchDataArgs {
    /// Workloads, comma-separated: disk, seq-write, overwrite-4k, overwrite-64k, read-4k,
    /// append-pb, append-4k, append-raft.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "disk,seq-write,overwrite-4k,overwrite-64k,read-4k,append-pb,append-raft"
    )]
    workloads: Vec<String>,
    /// Concurrent operations, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1,16,128")]
    inflight: Vec<usize>,
    /// Measured seconds per configuration.
    #[arg(long, default_value_t = 5.0)]
    secs: f64,
    /// MiB per prefilled extent (one per data partition) for overwrites and reads.
    #[arg(long, default_value_t = 64)]
    file_mib: u64,
    /// Data partitions of the benchmark volume.
    #[arg(long, default_value_t = 3)]
    data_partitions: u32,
    /// Connections per bundle between data nodes (comma-separated: each value runs the
    /// workloads on a fresh cluster; 1: no bundles).
    #[arg(long, value_delimiter = ',', default_value = "1")]
    bundle_conns: Vec<usize>,
    /// Messenger workers of each data node.
    #[arg(long, default_value_t = 1)]
    data_workers: usize,
    /// One JSON object per line instead of a table.
    #[arg(long)]
    json: bool,
}

#[derive(Debug, Args)]
struct BenchRaftArgs {
    /// Numbers of groups (each on all 3 nodes), comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1,1000")]
    groups: Vec<usize>,
    /// Command sizes, comma-separated (units k, m).
    #[arg(long, value_delimiter = ',', value_parser = parse_size, default_value = "64,4k")]
    sizes: Vec<usize>,
    /// Proposals in flight (closed-loop clients spread over the groups).
    #[arg(long, default_value_t = 64)]
    inflight: usize,
    /// Measured seconds per configuration.
    #[arg(long, default_value_t = 5.0)]
    secs: f64,
    /// Seconds of CPU measurement while every group hibernates.
    #[arg(long, default_value_t = 5.0)]
    idle_secs: f64,
    /// One JSON object per line instead of a table.
    #[arg(long)]
    json: bool,
}

#[derive(Debug, Args)]
struct BenchMsgrArgs {
    /// Message sizes (comma-separated; units k, m). Default 4k,64k,1m; with --skew 4k,8k,64k,1m.
    #[arg(long, value_delimiter = ',', value_parser = parse_size)]
    sizes: Option<Vec<usize>>,
    /// The connection balancer's experiment: two heavy and six light connections (or a uniform
    /// control) on a two-worker server, static against balanced against balanced+dual.
    #[arg(long)]
    skew: bool,
    /// With --skew: messenger modes to compare (static, balanced, balanced+dual, bundles).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "static,balanced,balanced+dual,bundles"
    )]
    modes: Vec<String>,
    /// With --skew: offered loads (skewed, uniform).
    #[arg(long, value_delimiter = ',', default_value = "skewed,uniform")]
    loads: Vec<String>,
    /// With --skew: the balancer's interval in milliseconds.
    #[arg(long, default_value_t = 100)]
    interval_ms: u64,
    /// With --skew: the balancer's threshold (fraction of the busiest worker's load).
    #[arg(long, default_value_t = 0.2)]
    threshold: f64,
    /// Requests in flight (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "1,16,128")]
    inflight: Vec<usize>,
    /// Measured seconds per configuration and implementation.
    #[arg(long, default_value_t = 2.0)]
    secs: f64,
    /// Warm-up seconds before each measurement.
    #[arg(long, default_value_t = 0.5)]
    warmup_secs: f64,
    /// The measured time is split into this many rounds, alternating raw and nacre.
    #[arg(long, default_value_t = 4)]
    rounds: usize,
    /// Skip the raw TCP baseline.
    #[arg(long)]
    no_baseline: bool,
    /// Server messenger workers.
    #[arg(long, default_value_t = 1)]
    server_workers: usize,
    /// Client messenger workers.
    #[arg(long, default_value_t = 1)]
    client_workers: usize,
    /// Client connections to the server.
    #[arg(long, default_value_t = 1)]
    conns: usize,
    /// One JSON object per line instead of a table.
    #[arg(long)]
    json: bool,
}

fn main() -> anyhow::Result<()> {
    tune_allocator();
    let cli = Cli::parse();
    init_logging();
    set_sched(cli.sched);
    match cli.cmd {
        Cmd::Server(a) => server(a),
        Cmd::Up(a) => up(a),
        Cmd::Down(a) => mount::run_down(a),
        Cmd::Mount(a) => mount::run_mount(a),
        Cmd::Cluster(a) => admin_cli(admin::AdminCmd::Cluster(a)),
        Cmd::Node(a) => admin_cli(admin::AdminCmd::Node(a)),
        Cmd::Func(a) => admin_cli(admin::AdminCmd::Func(a)),
        Cmd::Vol(a) => admin_cli(admin::AdminCmd::Vol(a)),
        Cmd::Partition(a) => admin_cli(admin::AdminCmd::Partition(a)),
        Cmd::Tenant(a) => admin_cli(admin::AdminCmd::Tenant(a)),
        Cmd::Fs(a) => fs_cmd::run(a),
        Cmd::Check(a) => check::run(a),
        Cmd::Ping(a) => ping(a),
        Cmd::Bench(BenchCmd::Msgr(a)) => bench_msgr(a),
        Cmd::Bench(BenchCmd::Raft(a)) => bench_raft(a),
        Cmd::Bench(BenchCmd::Meta(a)) => bench_meta(a),
        Cmd::Bench(BenchCmd::Data(a)) => bench_data(a),
        Cmd::Bench(BenchCmd::Fs(a)) => bench_fs(a),
        Cmd::Bench(BenchCmd::Func(a)) => bench_func(a),
    }
}

/// An admin command: like other Unix tools, it ends quietly when its output pipe closes
/// (`nacre vol list | head -3`) instead of failing on the broken pipe.
fn admin_cli(cmd: admin::AdminCmd) -> anyhow::Result<()> {
    default_sigpipe();
    admin::run(cmd)
}

#[allow(unsafe_code)]
fn default_sigpipe() {
    // SAFETY: restores the default disposition of SIGPIPE before any other thread exists; only the
    // short-lived admin commands do this (servers keep Rust's default of ignoring it).
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
}

/// Keeps glibc malloc from returning large freed buffers to the kernel at once.
///
/// With the defaults, every allocation of 128 KiB or more (a 1 MiB frame, a 128 KiB packet) is a fresh
/// `mmap` and every free a `munmap` or heap trim, so each buffer is page-faulted in again: `nacre bench
/// msgr` measured about 200 minor faults per 1 MiB round trip and ~40% lower throughput. Serving them
/// from the heap and trimming only past 512 MiB of free memory removes that.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
#[allow(unsafe_code)]
fn tune_allocator() {
    // SAFETY: mallopt only adjusts allocator parameters; it is called before any other thread exists.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 64 << 20);
        libc::mallopt(libc::M_TRIM_THRESHOLD, 512 << 20);
    }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn tune_allocator() {}

/// Sets the calling thread's scheduling policy; threads it starts later inherit it (so this runs
/// before any other thread exists). With SCHED_OTHER, a thread that wakes another on a 2-vCPU host is
/// often preempted by it on the spot: a leader's Raft thread, having sent its first follower the
/// append, waited for that follower's messenger and Raft threads to run before it sent the second
/// append and handed over its own log write (`perf sched timehist`, 4 KiB writes through FUSE).
/// SCHED_BATCH threads never preempt on wake-up; they run when the waker blocks, at the next tick, or
/// on an idle CPU. A failure (a sandbox that forbids the call) is logged and changes nothing else.
#[cfg(target_os = "linux")]
#[allow(unsafe_code)]
fn set_sched(sched: Sched) {
    let policy = match sched {
        Sched::Batch => libc::SCHED_BATCH,
        Sched::Normal => return,
    };
    let param = libc::sched_param { sched_priority: 0 };
    // SAFETY: `param` is a valid sched_param for the duration of the call; pid 0 is this thread.
    if unsafe { libc::sched_setscheduler(0, policy, &param) } != 0 {
        let e = std::io::Error::last_os_error();
        tracing::warn!(error = %e, "cannot set the SCHED_BATCH policy; threads keep the default");
    }
}

#[cfg(not(target_os = "linux"))]
fn set_sched(_: Sched) {}

fn init_logging() {
    let filter = tracing_subscriber::EnvFilter::try_from_env("NACRE_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info,raft_engine=warn"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr)
        .init();
}

/// Stack of this process's runtime threads. Async calls nest, and unoptimized (test) builds give
/// their polls frames of hundreds of KB (`nacre check`'s client steps reach ~1.9 MB, measured with
/// gdb), over tokio's 2 MiB default; only touched pages cost memory.
pub(crate) const STACK_BYTES: usize = 16 << 20;

pub(crate) fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("nacre-ctl")
        .thread_stack_size(STACK_BYTES)
        .enable_all()
        .build()?)
}

/// Resolves when the process is asked to stop (Ctrl-C or SIGTERM).
async fn stop_signal() {
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {},
        _ = term => {},
    }
}

fn server(a: ServerArgs) -> anyhow::Result<()> {
    let cfg: NodeConfig = config::load_from_process_env(a.config.as_deref())?;
    if a.print_config {
        print!("{}", toml::to_string_pretty(&cfg)?);
        return Ok(());
    }
    nacre_raft::store::exit_process_on_log_failure(true);
    runtime()?.block_on(async {
        let node = Node::start(&cfg).await?;
        say!(
            "nacre node {} ({:?}) listening on {}",
            node.name,
            node.role,
            node.addr
        );
        if let Some(m) = &node.http_addr {
            say!("http: http://{m}/metrics");
        }
        stop_signal().await;
        node.stop().await
    })
}

fn up(a: UpArgs) -> anyhow::Result<()> {
    std::fs::create_dir_all(&a.dir)
        .with_context(|| format!("cannot create {}", a.dir.display()))?;
    let path = a.dir.join("up.json");
    let ports_path = a.dir.join("ports.json");
    let ports = load_ports(&ports_path);
    runtime()?.block_on(async {
        // Listening for the stop signals from the start: a SIGTERM while starting still stops
        // (and unmounts) in order instead of killing the process.
        let stop = tokio::spawn(stop_signal());
        let default_listen = "127.0.0.1:0";
        let master = Node::start(&NodeConfig {
            name: "master-1".into(),
            role: RoleName::Master,
            listen: reuse_addr(&ports, "master-1", "listen", &a.listen, default_listen),
            http_listen: reuse_addr(&ports, "master-1", "http", &a.http_listen, default_listen),
            data_dir: a.dir.join("master-1"),
            ..NodeConfig::default()
        })
        .await?;
        let mut nodes = vec![];
        for (role, count) in [
            (RoleName::Meta, 3),
            (RoleName::Data, usize::from(a.data_nodes)),
            (RoleName::Func, a.funcs),
        ] {
            for i in 1..=count {
                let name = format!("{role:?}-{i}").to_lowercase();
                let started = Node::start(&NodeConfig {
                    name: name.clone(),
                    role,
                    listen: reuse_addr(&ports, &name, "listen", default_listen, default_listen),
                    http_listen: reuse_addr(&ports, &name, "http", default_listen, default_listen),
                    data_dir: a.dir.join(&name),
                    masters: vec![master.addr.clone()],
                    heartbeat_ms: 1000,
                    msgr: node::MsgrSection {
                        workers: 1,
                        ..Default::default()
                    },
                    ..NodeConfig::default()
                })
                .await;
                match started {
                    Ok(n) => nodes.push(n),
                    Err(e) => {
                        let _ = stop_all(nodes, master).await;
                        return Err(e);
                    }
                }
            }
        }
        let all = || std::iter::once(&master).chain(nodes.iter());
        // Every node keeps its address across restarts: the master knows nodes by address and
        // places replicas on nodes, so a node on a new port would be a new, empty node.
        let recorded: serde_json::Map<String, serde_json::Value> = all()
            .map(|n| {
                (
                    n.name.clone(),
                    serde_json::json!({ "listen": n.addr, "http": n.http_addr }),
                )
            })
            .collect();
        let ready = async {
            write_atomic(
                &ports_path,
                serde_json::to_string_pretty(&recorded)?.as_bytes(),
            )?;
            wait_until_ready(&master.addr, nodes.len()).await?;
            if a.mount.is_some() {
                mount::ensure_volume(&master.addr, &a.volume).await?;
            }
            anyhow::Ok(())
        };
        if let Err(e) = ready.await {
            let _ = stop_all(nodes, master).await;
            return Err(e);
        }
        let describe = |n: &Node| {
            serde_json::json!({
                "name": n.name, "role": n.role, "addr": n.addr, "http": n.http_addr,
            })
        };
        let info = serde_json::json!({
            "pid": std::process::id(),
            "masters": [master.addr],
            "admin": master.http_addr.as_ref().map(|h| format!("http://{h}/api/v1")),
            "nodes": all().map(describe).collect::<Vec<_>>(),
            "mount": a.mount.as_ref().map(|m| m.display().to_string()),
        });
        write_atomic(&path, serde_json::to_string_pretty(&info)?.as_bytes())?;
        say!("nacre is up (state in {})", a.dir.display());
        for n in all() {
            say!(
                "  {:<8} {:<21} http://{}/metrics",
                n.name,
                n.addr,
                n.http_addr.as_deref().unwrap_or("-")
            );
        }
        if let Some(h) = &master.http_addr {
            say!("  admin API http://{h}/api/v1/status");
        }
        let mounted = match &a.mount {
            Some(dir) => {
                match mount::VolumeMount::start(
                    vec![master.addr.clone()],
                    &a.volume,
                    dir,
                    &a.mount_flags,
                )
                .await
                {
                    Ok(m) => {
                        say!(
                            "mounted volume {} on {}",
                            a.volume,
                            m.mounted.dir().display()
                        );
                        if let Some(h) = &m.metrics_addr {
                            say!("  client metrics http://{h}/metrics");
                        }
                        Some(m)
                    }
                    Err(e) => {
                        let _ = stop_all(nodes, master).await;
                        let _ = std::fs::remove_file(&path);
                        return Err(e.context(format!("cannot mount on {}", dir.display())));
                    }
                }
            }
            None => None,
        };
        say!("try: nacre cluster status; nacre vol create demo; nacre vol info demo");
        say!(
            "Ctrl-C (or `nacre down --dir {}`) stops it.",
            a.dir.display()
        );
        let _ = stop.await;
        say!("stopping…");
        let mut r = Ok(());
        // Unmount first: the file system needs the nodes to flush what is still open.
        if let Some(m) = mounted {
            match m.stop().await {
                Ok(()) => say!("unmounted"),
                Err(e) => r = Err(e),
            }
        }
        if let Err(e) = stop_all(nodes, master).await {
            r = Err(e);
        }
        let _ = std::fs::remove_file(&path);
        r
    })
}

/// Stops the data and meta nodes, then the master.
async fn stop_all(nodes: Vec<Node>, master: Node) -> anyhow::Result<()> {
    let mut r = Ok(());
    for n in nodes {
        if let Err(e) = n.stop().await {
            r = Err(e);
        }
    }
    if let Err(e) = master.stop().await {
        r = Err(e);
    }
    r
}

/// The addresses `nacre up` bound last time (DIR/ports.json): node name → {"listen", "http"}.
fn load_ports(path: &std::path::Path) -> serde_json::Value {
    std::fs::read_to_string(path)
        .ok()
        .and_then(|t| serde_json::from_str(&t).ok())
        .unwrap_or(serde_json::Value::Null)
}

/// The address a node of `nacre up` binds: what the user asked for, else the one it had last
/// time if that is still free, else `default` (a free port), with a warning.
fn reuse_addr(
    ports: &serde_json::Value,
    name: &str,
    key: &str,
    asked: &str,
    default: &str,
) -> String {
    if asked != default {
        return asked.to_string();
    }
    let Some(last) = ports[name][key].as_str() else {
        return default.to_string();
    };
    // Probe by binding (and closing at once); the node binds it again right after.
    if std::net::TcpListener::bind(last).is_ok() {
        return last.to_string();
    }
    if key == "listen" {
        eprintln!(
            "warning: {name} cannot get its address {last} back (in use); it takes a new one \
             and the cluster sees it as a new, empty node: its partition replicas stay unreachable \
             (partitions keep working while a majority of their replicas is up)"
        );
    } else {
        eprintln!("warning: {name}'s HTTP address {last} is in use; it takes a new one");
    }
    default.to_string()
}

/// Waits (at most 30 s) until every node has registered and the default tenant exists, so that
/// `nacre vol create` works as soon as `nacre up` says it is up.
async fn wait_until_ready(master: &str, nodes: usize) -> anyhow::Result<()> {
    let msgr = Messenger::new(
        "up-check",
        MsgrConfig {
            workers: 1,
            ..MsgrConfig::default()
        },
        Arc::new(TcpTransport),
    )?;
    let mc = nacre_client::MasterClient::new(msgr.client(), vec![master.to_string()]);
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut last = String::from("no answer yet");
    let ready = loop {
        match mc.cluster_map().await {
            Ok(m) if m.nodes.len() >= nodes && m.tenants.contains_key("default") => break true,
            Ok(m) => {
                last = format!(
                    "{} of {nodes} nodes registered, default tenant {}",
                    m.nodes.len(),
                    if m.tenants.contains_key("default") {
                        "present"
                    } else {
                        "missing"
                    }
                )
            }
            Err(e) => last = e.to_string(),
        }
        if Instant::now() >= deadline {
            break false;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let m = msgr.clone();
    tokio::task::spawn_blocking(move || m.shutdown()).await?;
    anyhow::ensure!(ready, "the local cluster did not come up in 30 s: {last}");
    Ok(())
}

/// temp → fsync → rename → fsync dir, so readers never see a half-written file.
fn write_atomic(path: &std::path::Path, contents: &[u8]) -> anyhow::Result<()> {
    use std::io::Write as _;
    let dir = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(std::path::Path::new("."));
    let tmp = path.with_extension("tmp");
    let mut f =
        std::fs::File::create(&tmp).with_context(|| format!("cannot create {}", tmp.display()))?;
    f.write_all(contents)?;
    f.sync_all()?;
    std::fs::rename(&tmp, path)
        .with_context(|| format!("cannot rename {} to {}", tmp.display(), path.display()))?;
    std::fs::File::open(dir)?.sync_all()?;
    Ok(())
}

fn ping(a: PingArgs) -> anyhow::Result<()> {
    runtime()?.block_on(async {
        let cfg = MsgrConfig {
            workers: 1,
            default_deadline: Duration::from_millis(a.timeout_ms),
            connect_timeout: Duration::from_millis(a.timeout_ms),
            ..MsgrConfig::default()
        };
        let msgr = Messenger::new("ping", cfg, Arc::new(TcpTransport))?;
        let client = msgr.client();
        let data = a.size.map(|n| Bytes::from(vec![0x5a; n]));
        let mut failures = 0;
        for seq in 0..a.count {
            let t = Instant::now();
            let what = match &data {
                None => client
                    .call::<Ping>(&a.addr, &PingRequest {}, Payload::none())
                    .await
                    .map(|(r, _)| format!("{} (version {})", r.name, r.version)),
                Some(d) => client
                    .call::<Echo>(&a.addr, &EchoRequest {}, Payload::new(d.clone()))
                    .await
                    .map(|(_, p)| format!("{} bytes echoed", p.len())),
            };
            match what {
                Ok(w) => println!(
                    "{}: seq={seq} time={:.1} µs",
                    w,
                    t.elapsed().as_secs_f64() * 1e6
                ),
                Err(e) => {
                    failures += 1;
                    println!("seq={seq} error: {e}");
                }
            }
        }
        let m = msgr.clone();
        tokio::task::spawn_blocking(move || m.shutdown()).await?;
        anyhow::ensure!(failures == 0, "{failures} of {} requests failed", a.count);
        Ok(())
    })
}

fn bench_msgr(a: BenchMsgrArgs) -> anyhow::Result<()> {
    anyhow::ensure!(a.secs > 0.0, "--secs must be positive");
    if a.skew {
        return bench_msgr_skew(a);
    }
    anyhow::ensure!(
        a.inflight.iter().all(|&n| n > 0),
        "--inflight values must be at least 1"
    );
    let p = bench::msgr::Params {
        sizes: a.sizes.unwrap_or_else(|| vec![4 << 10, 64 << 10, 1 << 20]),
        inflight: a.inflight,
        duration: Duration::from_secs_f64(a.secs),
        warmup: Duration::from_secs_f64(a.warmup_secs.max(0.0)),
        rounds: a.rounds.max(1),
        baseline: !a.no_baseline,
        server_workers: a.server_workers,
        client_workers: a.client_workers,
        conns: a.conns,
    };
    let json = a.json;
    let rows = bench::msgr::run(&p, |r| {
        if json {
            let _ = report::print_json(std::slice::from_ref(r));
        } else {
            eprintln!(
                "  {} size={} inflight={}: {:.0} ops/s",
                r.implementation,
                report::human_size(r.size),
                r.inflight,
                r.ops_per_s
            );
        }
    })?;
    if !json {
        report::print_table(&rows);
    }
    Ok(())
}

fn bench_msgr_skew(a: BenchMsgrArgs) -> anyhow::Result<()> {
    let modes = a
        .modes
        .iter()
        .map(|m| bench::skew::Mode::parse(m))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| anyhow::anyhow!("--modes: {e}"))?;
    let loads = a
        .loads
        .iter()
        .map(|m| bench::skew::Load::parse(m))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| anyhow::anyhow!("--loads: {e}"))?;
    anyhow::ensure!(
        a.threshold > 0.0 && a.threshold <= 1.0,
        "--threshold must be in (0, 1]"
    );
    anyhow::ensure!(a.interval_ms > 0, "--interval-ms must be positive");
    let p = bench::skew::Params {
        sizes: a
            .sizes
            .unwrap_or_else(|| vec![4 << 10, 8 << 10, 64 << 10, 1 << 20]),
        modes,
        loads,
        duration: Duration::from_secs_f64(a.secs),
        warmup: Duration::from_secs_f64(a.warmup_secs.max(0.0)),
        interval: Duration::from_millis(a.interval_ms),
        threshold: a.threshold,
        rounds: a.rounds.max(1),
    };
    let json = a.json;
    let rows = bench::skew::run(&p, |r| {
        if json {
            let _ = report::print_json(std::slice::from_ref(r));
        } else {
            eprintln!(
                "  {} {} size={}: {:.0} ops/s",
                r.implementation,
                r.load,
                report::human_size(r.size),
                r.ops_per_s
            );
        }
    })?;
    if !json {
        report::print_skew_table(&rows);
    }
    Ok(())
}

fn bench_meta(a: BenchMetaArgs) -> anyhow::Result<()> {
    if let Some(files) = a.memory {
        anyhow::ensure!(files > 0, "--memory needs at least one file");
        let row = bench::meta::memory(files, a.extents)?;
        if a.json {
            println!("{}", serde_json::to_string(&row)?);
        } else {
            println!(
                "{} files, {} extent keys each: {:.1} bytes per file allocated ({:.1} estimated by the partition)",
                row.files,
                row.extent_keys_per_file,
                row.bytes_per_file,
                row.estimated_bytes_per_file
            );
        }
        return Ok(());
    }
    anyhow::ensure!(
        a.clients > 0 && a.items > 0 && a.branch > 0 && a.meta_partitions > 0,
        "--clients, --items, --branch and --meta-partitions must be at least 1"
    );
    let p = bench::meta::Params {
        clients: a.clients,
        items: a.items,
        branch: a.branch,
        depth: a.depth,
        meta_partitions: a.meta_partitions,
        calls: a.calls,
    };
    let json = a.json;
    let rows = runtime()?.block_on(bench::meta::run(&p, |r| {
        if json {
            if let Ok(line) = serde_json::to_string(r) {
                println!("{line}");
            }
        } else {
            eprintln!("  {}: {:.0} ops/s", r.phase, r.ops_per_s);
        }
    }))?;
    if !json {
        bench::meta::print_table(&rows);
    }
    Ok(())
}

fn bench_data(a: BenchDataArgs) -> anyhow::Result<()> {
    anyhow::ensure!(
        a.inflight.iter().all(|n| *n > 0) && a.secs > 0.0 && a.file_mib > 0,
        "--inflight values, --secs and --file-mib must be positive"
    );
    anyhow::ensure!(
        a.data_partitions > 0,
        "--data-partitions must be at least 1"
    );
    anyhow::ensure!(
        a.bundle_conns.iter().all(|&n| n > 0) && a.data_workers > 0,
        "--bundle-conns values and --data-workers must be at least 1"
    );
    let p = bench::data::Params {
        workloads: a.workloads,
        inflight: a.inflight,
        secs: a.secs,
        file_mib: a.file_mib,
        data_partitions: a.data_partitions,
        bundle_conns: a.bundle_conns,
        data_workers: a.data_workers,
    };
    let json = a.json;
    let rows = runtime()?.block_on(bench::data::run(&p, |r| {
        if json {
            if let Ok(line) = serde_json::to_string(r) {
                println!("{line}");
            }
        } else {
            eprintln!(
                "  {} x{}: {:.0} ops/s, {:.1} MiB/s",
                r.workload, r.inflight, r.ops_per_s, r.mib_per_s
            );
        }
    }))?;
    if !json {
        bench::data::print_table(&rows);
    }
    Ok(())
}

fn bench_func(a: BenchFuncArgs) -> anyhow::Result<()> {
    anyhow::ensure!(
        a.depth.iter().all(|n| *n > 0) && a.secs > 0.0 && a.file_mib > 0,
        "--depth values, --secs and --file-mib must be positive"
    );
    let p = bench::func::Params {
        depths: a.depth,
        secs: a.secs,
        file_mib: a.file_mib,
        parts: a.parts,
    };
    let json = a.json;
    let rows = runtime()?.block_on(bench::func::run(&p, |r| {
        if json {
            if let Ok(line) = serde_json::to_string(r) {
                println!("{line}");
            }
        } else {
            eprintln!(
                "  {} {} x{}: {:.0} ops/s, {:.1} MiB/s",
                r.implementation, r.workload, r.depth, r.ops_per_s, r.mib_per_s
            );
        }
    }))?;
    if !json {
        bench::func::print_table(&rows);
    }
    Ok(())
}

fn bench_raft(a: BenchRaftArgs) -> anyhow::Result<()> {
    anyhow::ensure!(
        a.secs > 0.0 && a.idle_secs > 0.0,
        "--secs and --idle-secs must be positive"
    );
    anyhow::ensure!(
        a.inflight > 0 && a.groups.iter().all(|&g| g > 0),
        "--inflight and --groups must be at least 1"
    );
    let p = bench::raft::Params {
        groups: a.groups,
        sizes: a.sizes,
        inflight: a.inflight,
        duration: Duration::from_secs_f64(a.secs),
        idle: Duration::from_secs_f64(a.idle_secs),
    };
    let json = a.json;
    let rows = runtime()?.block_on(bench::raft::run(&p, |r| {
        if json {
            if let Ok(line) = serde_json::to_string(r) {
                println!("{line}");
            }
        } else {
            eprintln!(
                "  groups={} size={}: {:.0} proposals/s",
                r.groups,
                report::human_size(r.size),
                r.ops_per_s
            );
        }
    }))?;
    if !json {
        bench::raft::print_table(&rows);
    }
    Ok(())
}

fn bench_fs(a: BenchFsArgs) -> anyhow::Result<()> {
    let p = bench::fs::Params {
        dir: a.dir,
        label: a.label,
        workloads: bench::fs::Workload::parse_list(&a.workloads)?,
        sizes: a.sizes,
        files: a.files,
        writers: a.writers,
        parallel_size: a.parallel_size,
        tree: match a.gen_tree {
            Some(files) => bench::fs::TreeSource::Generated { files },
            None => bench::fs::TreeSource::Dir(a.tree),
        },
        storm: a.storm,
        git_repo: a.git_repo,
        git_back: a.git_back,
        warmup_files: a.warmup_files,
        sparse_size: a.sparse_size as u64,
        overwrites: a.overwrites,
    };
    let json = a.json;
    let rows = bench::fs::run(&p, |r| {
        if json {
            println!("{}", r.to_json());
        } else {
            eprintln!(
                "  {} {}: {:.0} {}/s in {:.2} s",
                r.workload,
                r.params
                    .iter()
                    .map(|(k, v)| format!("{k}={v}"))
                    .collect::<Vec<_>>()
                    .join(" "),
                r.rate(),
                r.unit,
                r.secs
            );
        }
    })?;
    if !json {
        bench::fs::print_table(&rows);
    }
    Ok(())
}
