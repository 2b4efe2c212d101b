//! A nacre process: messenger, system ops, HTTP endpoint, and one role (master, meta, data or
//! func).

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use nacre_api::master::{RegisterFuncRequest, RegisterRequest};
use nacre_client::MasterClient;
use nacre_cluster::{AgentConfig, PartitionHost, node_router, run_agent};
use nacre_data::{DataNode, DataNodeConfig};
use nacre_funcsvc::{FuncAgentConfig, FuncMetrics, FuncServer, FuncServerConfig, run_func_agent};
use nacre_master::map::Role;
use nacre_master::{MASTER_GROUP, Master, MasterConfig, MasterSm};
use nacre_meta::{MetaNode, MetaNodeConfig};
use nacre_msgr::{
    AssignKind, BalanceConfig, BalanceKind, Messenger, MsgrConfig, Payload, Router, TcpTransport,
};
use nacre_proto::msg::sys::{
    ConnectionInfo, Echo, EchoResponse, MsgrInfo, MsgrInfoResponse, Ping, PingResponse, WorkerInfo,
};
use nacre_raft::{EngineLogStore, LogStore, RaftHandle, StoreConfig};
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;
use serde::{Deserialize, Serialize};
use tokio::sync::watch;
use tokio::task::JoinHandle;

/// The role a process plays.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RoleName {
    /// Only the messenger's system ops (ping, echo) and metrics.
    #[default]
    None,
    Master,
    Meta,
    Data,
    /// A function server: storage functions for callers, registered with the masters.
    Func,
}

/// Configuration of one `nacre server` process (TOML, with `NACRE_*` overrides).
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct NodeConfig {
    /// Name reported by `ping` and used in logs and thread names.
    pub name: String,
    /// `master`, `meta`, `data`, `func` or `none`.
    pub role: RoleName,
    /// Messenger listen address (`host:port`; port 0 picks a free one).
    pub listen: String,
    /// Address other nodes use to reach this one; empty means the bound listen address.
    pub advertise: String,
    /// HTTP listen address (`/metrics`, `/health`, and the admin API `/api/v1` on masters); empty
    /// disables it.
    pub http_listen: String,
    /// Directory for the role's durable state.
    pub data_dir: PathBuf,
    /// Failure domain; replicas go to distinct zones when there are enough.
    pub zone: String,
    /// Messenger addresses of the masters (meta, data and func nodes).
    pub masters: Vec<String>,
    /// Milliseconds between heartbeats to the master (meta, data and func nodes).
    pub heartbeat_ms: u64,
    /// Bytes offered to the cluster: memory on meta nodes, disk on data nodes. 0 measures it (total
    /// memory, or the size of the file system holding `data_dir`).
    pub capacity: u64,
    /// Raft leaders send new entries to followers before writing them to their own log (see
    /// `StoreConfig::early_appends`). Unset, the role decides: on for data nodes, whose 4 KiB
    /// overwrites it speeds up even with every replica on one disk; off for masters and meta nodes,
    /// whose creation rates it lowers there. Turn it on where each replica has a disk of its own.
    pub raft_early_appends: Option<bool>,
    /// Data nodes: most bytes of deleted extents' data files kept for new extents to take (they
    /// then append over allocated blocks, and nothing is freed while writes run), never more than
    /// a quarter of the free space; 0 removes every deleted extent's files at once.
    pub spare_bytes: u64,
    /// Data nodes: seconds a spare is kept at most, and how long an extent may sit idle in a
    /// longer recycled file before the rest is cut.
    pub spare_keep_secs: u64,
    /// Data nodes: while at least this many extents have appends under way on the node, appends
    /// go to the disk past the page cache (less CPU per byte with many streams; a lone stream is
    /// quicker through the cache); 0: never.
    pub direct_streams: u32,
    /// Data nodes: bytes per second the background scrub reads and checks against the block
    /// CRCs, repairing bad blocks from another replica; 0: no scrub.
    pub scrub_rate: u64,
    /// Data nodes: seconds between the starts of two scrub passes.
    pub scrub_period_secs: u64,
    /// Data nodes: seconds between two garbage-collection sweeps of the partitions a node leads
    /// (leaked extents; docs/ARCHITECTURE.md, "Garbage collection"); 0: none.
    pub gc_period_secs: u64,
    /// Data nodes: seconds a normal extent must go without a write before a sweep may delete it
    /// (at least 1800: `nacre_api::data::MIN_GC_GRACE`; a smaller value is raised to it).
    pub gc_grace_secs: u64,
    pub msgr: MsgrSection,
    pub master: MasterSection,
    pub func: FuncSection,
}

impl Default for NodeConfig {
    fn default() -> Self {
        Self {
            name: "nacre".into(),
            role: RoleName::None,
            listen: "127.0.0.1:7100".into(),
            advertise: String::new(),
            http_listen: "127.0.0.1:9100".into(),
            data_dir: PathBuf::from("nacre-data"),
            zone: "default".into(),
            masters: Vec::new(),
            heartbeat_ms: 2000,
            capacity: 0,
            raft_early_appends: None,
            spare_bytes: 1 << 30,
            spare_keep_secs: 60,
            direct_streams: 8,
            scrub_rate: 16 << 20,
            scrub_period_secs: 24 * 3600,
            gc_period_secs: 600,
            gc_grace_secs: 3600,
            msgr: MsgrSection::default(),
            master: MasterSection::default(),
            func: FuncSection::default(),
        }
    }
}

/// The `[master]` table: settings of a master process.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct MasterSection {
    /// This master's raft id (1, 2, 3).
    pub id: u64,
    /// Every master as `"ID=host:port"`, this one included; empty for a single master.
    pub peers: Vec<String>,
    /// Raft tick in milliseconds; elections start after 10 to 20 silent ticks.
    pub tick_ms: u64,
    pub duty_interval_ms: u64,
    /// A node silent this long is marked down and its partitions read-only.
    pub node_timeout_ms: u64,
    pub min_writable_data_partitions: u32,
    /// New data partitions go to no node silent for longer (keep it above the nodes'
    /// `heartbeat_ms`).
    pub placement_silence_ms: u64,
    pub data_partitions_step: u32,
    pub meta_split_inodes: u64,
    pub meta_split_memory: u64,
    pub meta_split_step: u64,
    /// Create a `default` tenant when there is none.
    pub default_tenant: bool,
    /// A data node down this long has its shards of erasure-coded partitions rebuilt on
    /// other nodes.
    pub rebuild_after_ms: u64,
}

impl Default for MasterSection {
    fn default() -> Self {
        let d = MasterConfig::default();
        Self {
            id: 1,
            peers: Vec::new(),
            tick_ms: 100,
            duty_interval_ms: d.duty_interval.as_millis() as u64,
            node_timeout_ms: d.node_timeout.as_millis() as u64,
            min_writable_data_partitions: d.min_writable_data_partitions,
            placement_silence_ms: d.placement_silence.as_millis() as u64,
            data_partitions_step: d.data_partitions_step,
            meta_split_inodes: d.meta_split_inodes,
            meta_split_memory: d.meta_split_memory,
            meta_split_step: d.meta_split_step,
            default_tenant: d.default_tenant,
            rebuild_after_ms: d.rebuild_after.as_millis() as u64,
        }
    }
}

impl MasterSection {
    fn to_config(&self) -> MasterConfig {
        MasterConfig {
            duty_interval: Duration::from_millis(self.duty_interval_ms.max(1)),
            node_timeout: Duration::from_millis(self.node_timeout_ms),
            min_writable_data_partitions: self.min_writable_data_partitions,
            placement_silence: Duration::from_millis(self.placement_silence_ms),
            data_partitions_step: self.data_partitions_step,
            meta_split_inodes: self.meta_split_inodes,
            meta_split_memory: self.meta_split_memory,
            meta_split_step: self.meta_split_step,
            default_tenant: self.default_tenant,
            rebuild_after: Duration::from_millis(self.rebuild_after_ms),
            ..MasterConfig::default()
        }
    }

    /// The masters as id → address; `own` is this master's advertised address.
    pub fn peer_map(&self, own: &str) -> anyhow::Result<BTreeMap<u64, String>> {
        let mut peers = BTreeMap::new();
        for p in &self.peers {
            let (id, addr) = p
                .split_once('=')
                .with_context(|| format!("master.peers: {p:?} is not ID=host:port"))?;
            let id: u64 = id
                .trim()
                .parse()
                .with_context(|| format!("master.peers: bad id in {p:?}"))?;
            anyhow::ensure!(id > 0, "master.peers: ids start at 1 ({p:?})");
            peers.insert(id, addr.trim().to_string());
        }
        if peers.is_empty() {
            peers.insert(self.id, own.to_string());
        }
        match peers.get(&self.id) {
            Some(a) if a == own => Ok(peers),
            Some(a) => anyhow::bail!(
                "master.peers gives {a} for this master (id {}), but it is reachable at {own}; \
                 set listen or advertise to match",
                self.id
            ),
            None => anyhow::bail!("master.id {} is not among master.peers", self.id),
        }
    }
}

/// The `[func]` table: settings of a function server.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct FuncSection {
    /// Calls running at once, each on its own thread; 0: one per CPU.
    pub workers: usize,
    /// Calls admitted at once (running or waiting for a worker); beyond, callers are told to
    /// go elsewhere. Registered with the master as the server's capacity.
    pub max_inflight: usize,
}

impl Default for FuncSection {
    fn default() -> Self {
        Self {
            workers: 0,
            max_inflight: FuncServerConfig::default().max_inflight,
        }
    }
}

impl FuncSection {
    fn to_config(&self) -> FuncServerConfig {
        let d = FuncServerConfig::default();
        FuncServerConfig {
            workers: if self.workers == 0 {
                d.workers
            } else {
                self.workers
            },
            max_inflight: self.max_inflight.max(1),
            ..d
        }
    }
}

/// The `[msgr]` table: messenger tuning.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct MsgrSection {
    pub workers: usize,
    /// `round-robin` or `least-connections`.
    pub assign: String,
    /// Connection balancer: `off`, `busy`, `bytes` or `frames` (what counts as load).
    pub balance: String,
    pub balance_interval_ms: u64,
    /// Move connections when the standard deviation of worker loads exceeds this fraction of the
    /// busiest worker's load.
    pub balance_threshold: f64,
    pub balance_max_moves: usize,
    /// Intervals a moved connection stays put.
    pub balance_cooldown: u32,
    /// Leave connections alone while the busiest worker is busy less than this fraction of the time.
    pub balance_min_busy: f64,
    /// Dual workers: handle a connection's requests on the worker after the one that reads them.
    pub dual: bool,
    pub max_frame: u32,
    pub conns_per_peer: usize,
    /// Connections of a bundle (replication between data nodes); 1: no bundles.
    pub bundle_conns: usize,
    pub max_inflight_per_conn: u32,
    pub max_inflight_bytes_per_conn: u32,
    pub max_inflight_total: u32,
    pub max_inflight_bytes_total: u32,
    pub connect_timeout_ms: u64,
    pub default_deadline_ms: u64,
}

impl Default for MsgrSection {
    fn default() -> Self {
        let d = MsgrConfig::default();
        Self {
            workers: d.workers,
            assign: d.assign.to_string(),
            balance: d.balance.policy.to_string(),
            balance_interval_ms: d.balance.interval.as_millis() as u64,
            balance_threshold: d.balance.threshold,
            balance_max_moves: d.balance.max_moves,
            balance_cooldown: d.balance.cooldown,
            balance_min_busy: d.balance.min_busy,
            dual: d.dual,
            max_frame: d.max_frame,
            conns_per_peer: d.conns_per_peer,
            bundle_conns: d.bundle_conns,
            max_inflight_per_conn: d.max_inflight_per_conn,
            max_inflight_bytes_per_conn: d.max_inflight_bytes_per_conn,
            max_inflight_total: d.max_inflight_total,
            max_inflight_bytes_total: d.max_inflight_bytes_total,
            connect_timeout_ms: d.connect_timeout.as_millis() as u64,
            default_deadline_ms: d.default_deadline.as_millis() as u64,
        }
    }
}

impl MsgrSection {
    pub fn to_config(&self) -> anyhow::Result<MsgrConfig> {
        let assign: AssignKind = self
            .assign
            .parse()
            .map_err(|e: String| anyhow::anyhow!("msgr.assign: {e}"))?;
        let policy: BalanceKind = self
            .balance
            .parse()
            .map_err(|e: String| anyhow::anyhow!("msgr.balance: {e}"))?;
        let c = MsgrConfig {
            workers: self.workers,
            assign,
            balance: BalanceConfig {
                policy,
                interval: Duration::from_millis(self.balance_interval_ms),
                threshold: self.balance_threshold,
                max_moves: self.balance_max_moves,
                cooldown: self.balance_cooldown,
                min_busy: self.balance_min_busy,
            },
            dual: self.dual,
            max_frame: self.max_frame,
            conns_per_peer: self.conns_per_peer,
            bundle_conns: self.bundle_conns,
            max_inflight_per_conn: self.max_inflight_per_conn,
            max_inflight_bytes_per_conn: self.max_inflight_bytes_per_conn,
            max_inflight_total: self.max_inflight_total,
            max_inflight_bytes_total: self.max_inflight_bytes_total,
            connect_timeout: Duration::from_millis(self.connect_timeout_ms),
            default_deadline: Duration::from_millis(self.default_deadline_ms),
        };
        c.validate()?;
        Ok(c)
    }
}

/// A started node.
#[derive(Debug)]
pub struct Node {
    pub name: String,
    pub role: RoleName,
    pub addr: String,
    pub http_addr: Option<String>,
    msgr: Messenger,
    raft: Option<RaftHandle<MasterSm>>,
    stop: watch::Sender<bool>,
    tasks: Vec<JoinHandle<anyhow::Result<()>>>,
}

/// The ops every process serves, whatever its roles.
pub fn system_router(name: &str, msgr: &Messenger) -> Router {
    let name = name.to_string();
    let info_name = name.clone();
    let msgr = msgr.clone();
    Router::new()
        .route::<Ping, _, _>(move |_req, _inc| {
            let name = name.clone();
            async move {
                Ok((
                    PingResponse {
                        name,
                        version: env!("CARGO_PKG_VERSION").to_string(),
                    },
                    Payload::none(),
                ))
            }
        })
        .route::<Echo, _, _>(|_req, inc| async move { Ok((EchoResponse {}, inc.data)) })
        .route::<MsgrInfo, _, _>(move |_req, _inc| {
            let resp = msgr_info(&info_name, &msgr);
            async move { Ok((resp, Payload::none())) }
        })
}

fn msgr_info(name: &str, msgr: &Messenger) -> MsgrInfoResponse {
    let ms = |d: Duration| u64::try_from(d.as_millis()).unwrap_or(u64::MAX);
    let cfg = msgr.config();
    MsgrInfoResponse {
        name: name.to_string(),
        balance: cfg.balance.policy.to_string(),
        dual: cfg.dual,
        migrations: msgr.migrations(),
        workers: msgr
            .worker_stats()
            .into_iter()
            .map(|w| WorkerInfo {
                index: w.index as u32,
                connections: w.connections,
                bytes: w.bytes,
                frames: w.frames,
                busy_ms: ms(w.busy),
            })
            .collect(),
        connections: msgr
            .connections()
            .into_iter()
            .map(|c| ConnectionInfo {
                id: c.id,
                side: c.side.to_string(),
                peer: c.peer,
                worker: c.worker as u32,
                busy_ms: ms(c.busy),
                bytes: c.bytes,
                frames: c.frames,
                migrations: c.migrations,
            })
            .collect(),
    }
}

impl Node {
    /// Binds the listeners and starts serving. Call from inside a tokio runtime.
    pub async fn start(cfg: &NodeConfig) -> anyhow::Result<Self> {
        let msgr = Messenger::new(&cfg.name, cfg.msgr.to_config()?, Arc::new(TcpTransport))?;
        let mut registry = Registry::default();
        msgr.register_metrics(&mut registry);
        // Masters, meta and data nodes each run one Raft store; its synced log writes.
        let log_sync = Histogram::new(exponential_buckets(25e-6, 2.0, 17));
        registry.register(
            "nacre_raft_log_sync_seconds",
            "Time of each synced Raft log write (what every commit waits for on each replica), \
             25 us doubling to about 1.6 s",
            log_sync.clone(),
        );
        // Registered on every node (zero where no data node runs), like the Raft histogram.
        let data_metrics = nacre_data::DataMetrics::default();
        data_metrics.register(&mut registry);
        let func_metrics = FuncMetrics::default();
        func_metrics.register(&mut registry);
        let registry = Arc::new(registry);
        let (stop, _) = watch::channel(false);
        let stopped = |stop: &watch::Sender<bool>| {
            let mut rx = stop.subscribe();
            async move {
                let _ = rx.wait_for(|s| *s).await;
            }
        };
        let mut tasks: Vec<JoinHandle<anyhow::Result<()>>> = Vec::new();

        let l = tokio::net::TcpListener::bind(&cfg.listen)
            .await
            .with_context(|| format!("cannot listen on {} (listen)", cfg.listen))?;
        let listener = TcpTransport::listener(l);
        let addr = if cfg.advertise.is_empty() {
            listener.local_addr()?
        } else {
            cfg.advertise.clone()
        };

        let mut router = system_router(&cfg.name, &msgr);
        let mut admin = None;
        let mut raft = None;
        match cfg.role {
            RoleName::None => {}
            RoleName::Master => {
                let peers = cfg.master.peer_map(&addr)?;
                let dir = cfg.data_dir.join("raft");
                std::fs::create_dir_all(&dir)
                    .with_context(|| format!("cannot create {}", dir.display()))?;
                let log: Arc<dyn LogStore> =
                    Arc::new(EngineLogStore::open(&dir).with_context(|| {
                        format!("cannot open the raft log in {}", dir.display())
                    })?);
                let store = StoreConfig {
                    tick_interval: Duration::from_millis(cfg.master.tick_ms.max(1)),
                    early_appends: cfg.raft_early_appends.unwrap_or(false),
                    log_sync_seconds: Some(log_sync.clone()),
                    ..StoreConfig::default()
                };
                let others = peers
                    .iter()
                    .filter(|(id, _)| **id != cfg.master.id)
                    .map(|(id, a)| (*id, a.clone()))
                    .collect();
                let handle = nacre_raft::store::start::<MasterSm>(
                    cfg.master.id,
                    store,
                    log,
                    others,
                    msgr.client(),
                )?;
                let voters: Vec<u64> = peers.keys().copied().collect();
                handle
                    .add_group(MASTER_GROUP, &voters, MasterSm::default())
                    .await
                    .context("cannot start the master's raft group")?;
                let master = Master::new(
                    handle.clone(),
                    peers.clone(),
                    msgr.client(),
                    cfg.master.to_config(),
                );
                router = router.merge(handle.router()).merge(master.router());
                let duties = master.clone();
                let done = stopped(&stop);
                tasks.push(tokio::spawn(async move {
                    duties.run_duties(done).await;
                    Ok(())
                }));
                let mc = MasterClient::new(msgr.client(), peers.into_values().collect());
                admin = Some(nacre_master::admin::Admin::new(mc));
                raft = Some(handle);
            }
            RoleName::Meta | RoleName::Data => {
                anyhow::ensure!(
                    !cfg.masters.is_empty(),
                    "a {:?} node needs the masters' addresses (masters = [\"host:port\", …])",
                    cfg.role
                );
                let role = if cfg.role == RoleName::Meta {
                    Role::Meta
                } else {
                    Role::Data
                };
                let (id_tx, id_rx) = watch::channel(None);
                let host: Arc<dyn PartitionHost> = if role == Role::Meta {
                    let meta_cfg = MetaNodeConfig {
                        dir: cfg.data_dir.clone(),
                        raft: StoreConfig {
                            early_appends: cfg.raft_early_appends.unwrap_or(false),
                            log_sync_seconds: Some(log_sync.clone()),
                            ..StoreConfig::default()
                        }
                        .with_read_lease(),
                        report_interval: Duration::from_millis(cfg.heartbeat_ms.max(10) / 2),
                        orphan_grace: Duration::from_secs(600),
                        masters: cfg.masters.clone(),
                    };
                    let meta = MetaNode::open(&meta_cfg, msgr.client()).with_context(|| {
                        format!("cannot open the meta node in {}", cfg.data_dir.display())
                    })?;
                    router = router.merge(meta.router());
                    let (runner, done) = (meta.clone(), stopped(&stop));
                    let interval = meta_cfg.report_interval;
                    tasks.push(tokio::spawn(async move {
                        runner.run(id_rx, interval, done).await;
                        Ok(())
                    }));
                    Arc::new(meta)
                } else {
                    let mut data_cfg = DataNodeConfig::new(cfg.data_dir.clone());
                    data_cfg.report_interval = Duration::from_millis(cfg.heartbeat_ms.max(10) / 2);
                    if let Some(early) = cfg.raft_early_appends {
                        data_cfg.raft.early_appends = early;
                    }
                    data_cfg.raft.log_sync_seconds = Some(log_sync.clone());
                    data_cfg.metrics = Some(data_metrics.clone());
                    data_cfg.spare_bytes = cfg.spare_bytes;
                    data_cfg.spare_keep = Duration::from_secs(cfg.spare_keep_secs);
                    data_cfg.direct_streams = cfg.direct_streams;
                    data_cfg.scrub_rate = cfg.scrub_rate;
                    data_cfg.scrub_period = Duration::from_secs(cfg.scrub_period_secs);
                    data_cfg.gc_period = Duration::from_secs(cfg.gc_period_secs);
                    data_cfg.gc_grace = Duration::from_secs(cfg.gc_grace_secs);
                    data_cfg.masters = cfg.masters.clone();
                    let data = DataNode::open(&data_cfg, msgr.client()).with_context(|| {
                        format!("cannot open the data node in {}", cfg.data_dir.display())
                    })?;
                    router = router.merge(data.router());
                    let (runner, done) = (data.clone(), stopped(&stop));
                    tasks.push(tokio::spawn(async move {
                        runner.run(id_rx, done).await;
                        Ok(())
                    }));
                    Arc::new(data)
                };
                router = router.merge(node_router(host.clone()));
                let capacity = if cfg.capacity > 0 {
                    cfg.capacity
                } else {
                    measured_capacity(role, &cfg.data_dir)
                };
                let agent = AgentConfig {
                    register: RegisterRequest {
                        addr: addr.clone(),
                        role,
                        zone: cfg.zone.clone(),
                        capacity,
                    },
                    heartbeat_interval: Duration::from_millis(cfg.heartbeat_ms.max(10)),
                };
                let mc = MasterClient::new(msgr.client(), cfg.masters.clone());
                let done = stopped(&stop);
                tasks.push(tokio::spawn(async move {
                    run_agent(mc, agent, host, id_tx, done).await;
                    Ok(())
                }));
            }
            RoleName::Func => {
                anyhow::ensure!(
                    !cfg.masters.is_empty(),
                    "a func node needs the masters' addresses (masters = [\"host:port\", …])"
                );
                let server = FuncServer::new(cfg.func.to_config(), func_metrics.clone());
                router = router.merge(server.router());
                let agent = FuncAgentConfig {
                    register: RegisterFuncRequest {
                        addr: addr.clone(),
                        zone: cfg.zone.clone(),
                        functions: server.config().functions.clone(),
                        capacity: u32::try_from(server.config().max_inflight).unwrap_or(u32::MAX),
                    },
                    heartbeat_interval: Duration::from_millis(cfg.heartbeat_ms.max(10)),
                };
                let mc = MasterClient::new(msgr.client(), cfg.masters.clone());
                let (id_tx, _) = watch::channel(None);
                let done = stopped(&stop);
                tasks.push(tokio::spawn(async move {
                    run_func_agent(mc, agent, server, id_tx, done).await;
                    Ok(())
                }));
            }
        }

        let serve = msgr.serve(listener, Arc::new(router), stopped(&stop));
        tasks.push(tokio::spawn(async move { Ok(serve.await?) }));

        let http_addr = if cfg.http_listen.is_empty() {
            None
        } else {
            let l = tokio::net::TcpListener::bind(&cfg.http_listen)
                .await
                .with_context(|| format!("cannot listen on {} (http_listen)", cfg.http_listen))?;
            let haddr = l.local_addr()?.to_string();
            let mut app = crate::http::router(registry);
            if let Some(admin) = admin {
                app = app.merge(crate::admin::http_router(admin));
            }
            let done = stopped(&stop);
            tasks.push(tokio::spawn(async move {
                crate::http::serve(l, app, done).await?;
                Ok(())
            }));
            Some(haddr)
        };
        tracing::info!(name = %cfg.name, role = ?cfg.role, %addr, http = ?http_addr, "node started");
        Ok(Self {
            name: cfg.name.clone(),
            role: cfg.role,
            addr,
            http_addr,
            msgr,
            raft,
            stop,
            tasks,
        })
    }

    /// Stops serving, lets connections finish, and stops the messenger's workers.
    pub async fn stop(self) -> anyhow::Result<()> {
        let _ = self.stop.send(true);
        for t in self.tasks {
            t.await??;
        }
        if let Some(r) = self.raft {
            let _ = r.stop().await;
        }
        let msgr = self.msgr;
        tokio::task::spawn_blocking(move || msgr.shutdown()).await?;
        tracing::info!(name = %self.name, "node stopped");
        Ok(())
    }
}

/// Total memory (meta) or the size of the file system holding `dir` (data), in bytes; 0 if unknown.
fn measured_capacity(role: Role, dir: &std::path::Path) -> u64 {
    match role {
        Role::Data => fs_size(dir).unwrap_or(0),
        _ => std::fs::read_to_string("/proc/meminfo")
            .ok()
            .and_then(|s| {
                let line = s.lines().find(|l| l.starts_with("MemTotal:"))?;
                let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
                Some(kib * 1024)
            })
            .unwrap_or(0),
    }
}

#[allow(unsafe_code)]
fn fs_size(dir: &std::path::Path) -> Option<u64> {
    use std::os::unix::ffi::OsStrExt as _;
    let path = std::ffi::CString::new(dir.as_os_str().as_bytes()).ok()?;
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: `path` is a valid NUL-terminated string and `st` a valid out-pointer.
    let rc = unsafe { libc::statvfs(path.as_ptr(), &mut st) };
    (rc == 0).then(|| st.f_blocks as u64 * st.f_frsize as u64)
}
