//! Mounting volumes: `nacre mount VOLUME DIR`, `nacre up --mount DIR`, and `nacre down`.

use nacre_master::MasterAdmin as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use clap::Args;
use nacre_client::MasterClient;
use nacre_client::{
    FileSystem, MetaCache, MetaCacheConfig, Metrics, NetFs, NetFsConfig, NetVolume,
};
use nacre_fuse::{MountOptions, Mounted};
use nacre_master::admin::{Admin, CreateVolume};
use nacre_master::map::PartitionStatus;
use nacre_msgr::{Messenger, MsgrConfig, TcpTransport};

/// How a volume is mounted (shared by `nacre mount` and `nacre up --mount`).
#[derive(Clone, Debug, Args)]
pub struct MountFlags {
    /// Seconds the kernel and the client cache attributes.
    #[arg(long, default_value_t = 1.0)]
    pub attr_ttl: f64,
    /// Seconds the kernel and the client cache names (dentries), and answer for missing names in
    /// directories this client made.
    #[arg(long, default_value_t = 1.0)]
    pub entry_ttl: f64,
    /// Kernel write-back caching: faster small writes, but data reaches the cluster (and other
    /// clients) only when the kernel flushes it.
    #[arg(long)]
    pub writeback: bool,
    /// Threads reading FUSE requests.
    #[arg(long, default_value_t = 2)]
    pub fuse_threads: usize,
    /// Apply every create, mkdir, unlink and rmdir before answering it. By default names made
    /// and removed in directories this client made are answered at once and applied behind, in
    /// order, within milliseconds (durable at fsync or unmount; docs/ARCHITECTURE.md,
    /// "Write-behind under directory delegations").
    #[arg(long)]
    pub sync_meta: bool,
    /// Milliseconds a closed small file's data (up to 512 KiB) may wait in the client before it
    /// is sent, packed with other files' into shared tiny extents; sent sooner once 128 KiB are
    /// waiting. `fsync` of the file or of any directory, and unmount, wait for it
    /// (docs/ARCHITECTURE.md, "Write-behind of small files"). 0, or `--sync-meta`: every close
    /// waits until its file's data is durable.
    #[arg(long, default_value_t = 10)]
    pub flush_delay_ms: u64,
    /// Most bytes of closed files waiting to be sent; a close that finds more waits.
    #[arg(long, default_value = "64MiB", value_parser = crate::bench::report::parse_size)]
    pub dirty_max: usize,
    /// HTTP address serving the client's metrics (`/metrics`: file system operations, errors,
    /// latencies and bytes, and its messenger); empty for none.
    #[arg(long, default_value = "127.0.0.1:0")]
    pub metrics_listen: String,
}

impl MountFlags {
    fn options(&self, volume: &str) -> anyhow::Result<MountOptions> {
        Ok(MountOptions {
            volume: volume.to_string(),
            attr_ttl: secs(self.attr_ttl, "attr-ttl")?,
            entry_ttl: secs(self.entry_ttl, "entry-ttl")?,
            writeback: self.writeback,
            threads: self.fuse_threads.max(1),
            ..MountOptions::default()
        })
    }

    /// The client's configuration: write-behind unless `--sync-meta`, with the flush delay
    /// and dirty bytes of the flags. `nacre check`'s killed client uses it too.
    pub fn netfs_config(&self) -> NetFsConfig {
        NetFsConfig {
            write_behind: !self.sync_meta,
            flush_delay: (self.flush_delay_ms > 0)
                .then(|| Duration::from_millis(self.flush_delay_ms)),
            dirty_max: self.dirty_max as u64,
            ..NetFsConfig::default()
        }
    }

    /// The client's cache: names and attributes kept as long as the kernel keeps them.
    pub fn cache_config(&self) -> anyhow::Result<MetaCacheConfig> {
        Ok(MetaCacheConfig {
            attr_ttl: secs(self.attr_ttl, "attr-ttl")?,
            entry_ttl: secs(self.entry_ttl, "entry-ttl")?,
            ..MetaCacheConfig::default()
        })
    }
}

fn secs(s: f64, what: &str) -> anyhow::Result<Duration> {
    Duration::try_from_secs_f64(s)
        .map_err(|_| anyhow::anyhow!("--{what}: {s} is not a valid number of seconds"))
}

/// The client a mount serves the kernel from, on `msgr`: `NetFs` configured by `flags`, over a
/// connection to `volume`. The messenger's workers go on with the calls they wake
/// (`nacre_client::task`); the messenger must outlive the client.
pub async fn connect_netfs(
    msgr: &Messenger,
    masters: Vec<String>,
    volume: &str,
    flags: &MountFlags,
) -> anyhow::Result<NetFs> {
    for i in 0..msgr.workers().len() {
        msgr.workers()
            .get(i)
            .spawn(async { nacre_client::task::resume_calls_here() })
            .await?;
    }
    let mc = MasterClient::new(msgr.client(), masters);
    let vol = NetVolume::connect(msgr.client(), mc, volume)
        .await
        .map_err(|e| anyhow::anyhow!("cannot open volume {volume}: {e}"))?;
    Ok(NetFs::with_config(Arc::new(vol), flags.netfs_config()))
}

#[derive(Debug, Args)]
pub struct MountArgs {
    /// The volume to mount.
    volume: String,
    /// Mount point (created if missing).
    dir: PathBuf,
    /// Master addresses (`host:port`, comma-separated). Defaults to the masters of the `nacre up`
    /// cluster whose state is in --up-dir.
    #[arg(long, env = "NACRE_MASTERS", value_delimiter = ',')]
    master: Vec<String>,
    /// Where `nacre up` keeps its state (its up.json names the masters).
    #[arg(long, default_value = ".nacre")]
    up_dir: PathBuf,
    #[command(flatten)]
    flags: MountFlags,
}

#[derive(Debug, Args)]
pub struct DownArgs {
    /// The directory `nacre up` runs in.
    #[arg(long, default_value = ".nacre")]
    dir: PathBuf,
    /// Seconds to wait for it to stop.
    #[arg(long, default_value_t = 30.0)]
    wait: f64,
}

/// A volume mounted through a client of its own: the kernel over `Metrics<MetaCache<NetFs>>`.
pub struct VolumeMount {
    pub mounted: Mounted,
    /// Where the client's metrics are served, if they are.
    pub metrics_addr: Option<String>,
    http_stop: Option<tokio::sync::oneshot::Sender<()>>,
    msgr: Messenger,
    evictor: tokio::task::JoinHandle<()>,
    fs: Arc<Metrics<MetaCache<NetFs>>>,
}

impl VolumeMount {
    /// Connects to `volume` through `masters` and mounts it on `dir` (created if missing). Call
    /// inside the runtime whose tasks will serve the file system.
    pub async fn start(
        masters: Vec<String>,
        volume: &str,
        dir: &Path,
        flags: &MountFlags,
    ) -> anyhow::Result<Self> {
        let opts = flags.options(volume)?;
        match std::fs::metadata(dir) {
            // A stale mount of a dead process: mount() detaches it.
            Err(e) if e.raw_os_error() == Some(libc::ENOTCONN) => {}
            _ => std::fs::create_dir_all(dir)
                .with_context(|| format!("cannot create {}", dir.display()))?,
        }
        let msgr = Messenger::new(
            &format!("mount-{volume}"),
            MsgrConfig {
                workers: 1,
                ..MsgrConfig::default()
            },
            Arc::new(TcpTransport),
        )?;
        let r = async {
            let mc = MasterClient::new(msgr.client(), masters.clone());
            wait_volume_ready(&mc, volume).await?;
            let netfs = connect_netfs(&msgr, masters, volume, flags).await?;
            let mut registry = prometheus_client::registry::Registry::default();
            msgr.register_metrics(&mut registry);
            let cache = flags.cache_config()?;
            netfs.meta().register_metrics(&mut registry);
            let fs = Arc::new(Metrics::new(
                MetaCache::with_config(netfs, cache),
                &mut registry,
            ));
            let (metrics_addr, http_stop) = serve_metrics(&flags.metrics_listen, registry).await?;
            let for_evictor = fs.clone();
            let rt = tokio::runtime::Handle::current();
            let dir = dir.to_path_buf();
            // The FUSE handshake blocks: not on a runtime worker.
            let mounted =
                tokio::task::spawn_blocking(move || nacre_fuse::mount(fs, rt, &dir, &opts))
                    .await??;
            let evictor = tokio::spawn(evict_orphans(for_evictor.clone()));
            anyhow::Ok((mounted, metrics_addr, http_stop, evictor, for_evictor))
        }
        .await;
        match r {
            Ok((mounted, metrics_addr, http_stop, evictor, fs)) => Ok(Self {
                mounted,
                metrics_addr,
                http_stop,
                msgr,
                evictor,
                fs,
            }),
            Err(e) => {
                shutdown(msgr).await;
                Err(e)
            }
        }
    }

    /// Unmounts (lazily if files are still open), applies the metadata changes still written
    /// behind, and closes the client.
    pub async fn stop(self) -> anyhow::Result<()> {
        let Self {
            mounted,
            http_stop,
            msgr,
            evictor,
            fs,
            ..
        } = self;
        evictor.abort();
        if let Some(stop) = http_stop {
            let _ = stop.send(());
        }
        let r = tokio::task::spawn_blocking(move || mounted.unmount()).await;
        if let Err(e) = fs.sync_dir(nacre_api::meta::ROOT_INO).await {
            tracing::warn!(error = %e, "metadata changes written behind were lost at unmount");
        }
        shutdown(msgr).await;
        r??;
        Ok(())
    }
}

/// How often a mount retries evicting the inodes its failed creates left behind.
const EVICT_EVERY: std::time::Duration = std::time::Duration::from_secs(30);

/// Retries, every [`EVICT_EVERY`], the evictions of orphan inodes (a create whose dentry failed
/// after its inode was made, and whose undo failed too: CFS's client-side orphan list).
async fn evict_orphans(fs: Arc<Metrics<MetaCache<NetFs>>>) {
    let mut tick = tokio::time::interval(EVICT_EVERY);
    tick.tick().await;
    loop {
        tick.tick().await;
        let left = fs.inner().inner().meta().evict_orphans().await;
        if left > 0 {
            tracing::warn!(left, "orphan inodes still not evicted; retrying later");
        }
    }
}

async fn shutdown(msgr: Messenger) {
    let _ = tokio::task::spawn_blocking(move || msgr.shutdown()).await;
}

/// Creates `volume` (owned by the default tenant, default layout) unless it exists.
pub async fn ensure_volume(master: &str, volume: &str) -> anyhow::Result<()> {
    let msgr = Messenger::new(
        "up-volume",
        MsgrConfig {
            workers: 1,
            ..MsgrConfig::default()
        },
        Arc::new(TcpTransport),
    )?;
    let r = async {
        let mc = MasterClient::new(msgr.client(), vec![master.to_string()]);
        if !mc.cluster_map().await?.volumes.contains_key(volume) {
            Admin::new(mc.clone())
                .create_volume(&CreateVolume {
                    name: volume.to_string(),
                    ..CreateVolume::default()
                })
                .await
                .with_context(|| format!("cannot create volume {volume}"))?;
            println!("created volume {volume}");
        }
        anyhow::Ok(())
    }
    .await;
    shutdown(msgr).await;
    r
}

/// Waits (at most 60 s) until every partition of the volume has a leader and its data partitions
/// take writes.
async fn wait_volume_ready(mc: &MasterClient, volume: &str) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let why = match mc.volume(volume).await {
            Ok(v) => {
                let leaderless = v
                    .meta_partitions
                    .iter()
                    .chain(&v.data_partitions)
                    .filter(|p| p.leader.is_none())
                    .count();
                let ro = v
                    .data_partitions
                    .iter()
                    .filter(|p| p.status != PartitionStatus::Rw)
                    .count();
                if leaderless == 0 && ro == 0 {
                    return Ok(());
                }
                format!(
                    "{leaderless} partitions without a leader, {ro} data partitions not writable"
                )
            }
            Err(e) => e.to_string(),
        };
        anyhow::ensure!(
            Instant::now() < deadline,
            "volume {volume} is not ready after 60 s: {why}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Serves `registry` on `listen` (nothing when empty): the bound address and the stop switch.
async fn serve_metrics(
    listen: &str,
    registry: prometheus_client::registry::Registry,
) -> anyhow::Result<(Option<String>, Option<tokio::sync::oneshot::Sender<()>>)> {
    if listen.is_empty() {
        return Ok((None, None));
    }
    let listener = tokio::net::TcpListener::bind(listen)
        .await
        .with_context(|| format!("cannot listen on {listen} for metrics"))?;
    let addr = listener.local_addr()?.to_string();
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let app = crate::http::router(Arc::new(registry));
    tokio::spawn(async move {
        let stopped = async {
            let _ = rx.await;
        };
        if let Err(e) = crate::http::serve(listener, app, stopped).await {
            tracing::warn!(error = %e, "client metrics server failed");
        }
    });
    Ok((Some(addr), Some(tx)))
}

/// `nacre mount`: mounts and serves until Ctrl-C, SIGTERM, or an unmount from outside.
pub fn run_mount(a: MountArgs) -> anyhow::Result<()> {
    let masters = crate::admin::resolve_masters_in(&a.master, &a.up_dir)?;
    crate::runtime()?.block_on(async move {
        let stop = tokio::spawn(crate::stop_signal());
        let m = VolumeMount::start(masters, &a.volume, &a.dir, &a.flags).await?;
        say!(
            "mounted volume {} on {} (Ctrl-C or `umount {}` ends it)",
            a.volume,
            m.mounted.dir().display(),
            m.mounted.dir().display()
        );
        if let Some(h) = &m.metrics_addr {
            say!("client metrics: http://{h}/metrics");
        }
        let ended = m.mounted.ended();
        tokio::select! {
            _ = stop => say!("unmounting…"),
            _ = ended => say!("unmounted from outside"),
        }
        m.stop().await?;
        say!("unmounted");
        Ok(())
    })
}

/// `nacre down`: asks the `nacre up` of `dir` to stop (SIGTERM) and waits until it has.
pub fn run_down(a: DownArgs) -> anyhow::Result<()> {
    use rustix::process::{Pid, Signal};
    let path = a.dir.join("up.json");
    let text = std::fs::read_to_string(&path).map_err(|e| {
        anyhow::anyhow!(
            "nacre up is not running in {} (cannot read {}: {e})",
            a.dir.display(),
            path.display()
        )
    })?;
    let v: serde_json::Value =
        serde_json::from_str(&text).with_context(|| format!("cannot parse {}", path.display()))?;
    let pid = v["pid"]
        .as_i64()
        .and_then(|p| i32::try_from(p).ok())
        .and_then(Pid::from_raw)
        .with_context(|| format!("{} has no valid pid", path.display()))?;
    // A stale up.json (the process was killed) may name a pid reused by another program.
    let cmdline =
        std::fs::read(format!("/proc/{}/cmdline", pid.as_raw_nonzero())).unwrap_or_default();
    let is_up = cmdline.split(|b| *b == 0).any(|arg| arg == b"up");
    anyhow::ensure!(
        is_up,
        "nacre up is not running in {} (process {} from {} is gone); remove the stale file",
        a.dir.display(),
        pid.as_raw_nonzero(),
        path.display()
    );
    // Watch the process through a pidfd: it becomes readable when the process exits (a zombie
    // counts), which `kill(pid, 0)` cannot tell.
    let pidfd = rustix::process::pidfd_open(pid, rustix::process::PidfdFlags::empty())
        .with_context(|| format!("cannot watch process {}", pid.as_raw_nonzero()))?;
    rustix::process::kill_process(pid, Signal::TERM)
        .with_context(|| format!("cannot signal process {}", pid.as_raw_nonzero()))?;
    println!("stopping nacre up (pid {})…", pid.as_raw_nonzero());
    let wait = Duration::try_from_secs_f64(a.wait.max(0.0)).unwrap_or(Duration::from_secs(30));
    let timeout = rustix::event::Timespec {
        tv_sec: wait.as_secs() as i64,
        tv_nsec: i64::from(wait.subsec_nanos()),
    };
    let mut fds = [rustix::event::PollFd::new(
        &pidfd,
        rustix::event::PollFlags::IN,
    )];
    let deadline = Instant::now() + wait;
    loop {
        match rustix::event::poll(&mut fds, Some(&timeout)) {
            Ok(n) if n > 0 => break,
            Ok(_) => anyhow::bail!(
                "nacre up (pid {}) did not stop within {:.0} s",
                pid.as_raw_nonzero(),
                wait.as_secs_f64()
            ),
            Err(rustix::io::Errno::INTR) if Instant::now() < deadline => continue,
            Err(e) => return Err(e).context("cannot wait for the process"),
        }
    }
    println!("nacre up stopped");
    Ok(())
}
