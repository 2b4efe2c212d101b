//! The node side of the master protocol: register, heartbeat, and host what the master assigns.
//!
//! A meta or data node implements [`PartitionHost`]; [`run_agent`] registers the node, sends a
//! heartbeat every interval with the host's usage and per-partition reports, and reconciles the host
//! with the assignment that comes back: partitions assigned but not hosted are created (or updated,
//! e.g. a meta partition whose range was closed by a split), partitions hosted but no longer assigned
//! are removed — but only on the word of a map newer than the partition, so a stale answer never
//! drops data. [`node_router`] serves the master's direct create requests, which make new
//! partitions usable without waiting for the next heartbeat.

use std::future::Future;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

pub use nacre_msgr::BoxFuture;
use nacre_msgr::{Payload, Router};
use nacre_types::{NodeId, PartitionId};
use tokio::sync::watch;

use crate::client::MasterClient;
use crate::map::{MapError, PartitionReport, PartitionSpec, Role};
use crate::rpc::{CreatePartition, HeartbeatReply, RegisterRequest};
use crate::service::MasterError;

/// What a node hosts, as seen by the master protocol.
pub trait PartitionHost: Send + Sync + 'static {
    /// Specs of the partitions hosted now.
    fn hosted(&self) -> Vec<PartitionSpec>;
    /// Per-partition figures for the next heartbeat.
    fn reports(&self) -> Vec<PartitionReport>;
    /// Bytes used of the node's capacity (memory on meta nodes, disk on data nodes).
    fn used(&self) -> u64;
    /// Hosts `spec`, or updates the hosted partition of that id to it. Idempotent.
    fn ensure(&self, spec: PartitionSpec) -> BoxFuture<'_, Result<(), String>>;
    /// Stops hosting a partition and deletes its data.
    fn remove(&self, id: PartitionId) -> BoxFuture<'_, Result<(), String>>;
}

/// How a node presents itself to the master.
#[derive(Clone, Debug)]
pub struct AgentConfig {
    pub register: RegisterRequest,
    pub heartbeat_interval: Duration,
}

/// The messenger ops a node serves for the master.
pub fn node_router(host: Arc<dyn PartitionHost>) -> Router {
    Router::new().route::<CreatePartition, _, _>(move |spec, _inc| {
        let host = host.clone();
        async move {
            let id = spec.id;
            let r = host.ensure(spec).await;
            if let Err(e) = &r {
                tracing::warn!(partition = %id, error = %e, "cannot create partition");
            }
            Ok((r, Payload::none()))
        }
    })
}

/// Registers the node and heartbeats until `shutdown` resolves. The node's id (once registered) is
/// published on `id`.
pub async fn run_agent(
    master: MasterClient,
    config: AgentConfig,
    host: Arc<dyn PartitionHost>,
    id: watch::Sender<Option<NodeId>>,
    shutdown: impl Future<Output = ()>,
) {
    let mut shutdown = std::pin::pin!(shutdown);
    let mut tick = tokio::time::interval(config.heartbeat_interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    loop {
        tokio::select! {
            _ = &mut shutdown => return,
            _ = tick.tick() => {}
        }
        let current = *id.borrow();
        match current {
            None => match master.register(&config.register).await {
                Ok(node) => {
                    tracing::info!(%node, role = ?config.register.role, "registered with the master");
                    id.send_replace(Some(node));
                    // Report at once rather than one interval later.
                    tick.reset_immediately();
                }
                Err(e) => tracing::warn!(error = %e, "cannot register with the master"),
            },
            Some(node) => match master.heartbeat(node, host.used(), host.reports()).await {
                Ok(reply) => reconcile(host.as_ref(), &reply).await,
                Err(MasterError::Map(MapError::UnknownNode(_))) => {
                    tracing::warn!(%node, "the master does not know this node; registering again");
                    id.send_replace(None);
                }
                Err(e) => tracing::warn!(error = %e, "heartbeat failed"),
            },
        }
    }
}

/// Brings the host in line with the master's assignment.
pub async fn reconcile(host: &dyn PartitionHost, reply: &HeartbeatReply) {
    let hosted = host.hosted();
    for spec in &reply.assigned {
        if hosted.iter().any(|h| h == spec) {
            continue;
        }
        let id = spec.id;
        if let Err(e) = host.ensure(spec.clone()).await {
            tracing::warn!(partition = %id, error = %e, "cannot create assigned partition");
        }
    }
    for h in hosted {
        let assigned = reply.assigned.iter().any(|s| s.id == h.id);
        if !assigned && reply.epoch > h.created_epoch {
            tracing::info!(partition = %h.id, "partition no longer assigned; removing it");
            if let Err(e) = host.remove(h.id).await {
                tracing::warn!(partition = %h.id, error = %e, "cannot remove partition");
            }
        }
    }
}

/// A durable record of the partitions a node was asked to host: one file, replaced atomically
/// (write, fsync, rename, fsync the directory). The meta and data roles keep their partitions'
/// state beside it; this is what tells them, after a restart, which partitions to open.
#[derive(Debug)]
pub struct SpecRegistry {
    path: Option<PathBuf>,
    specs: Mutex<Vec<PartitionSpec>>,
    role: Role,
}

impl SpecRegistry {
    /// Opens (or creates) the registry in `dir`.
    pub fn open(dir: &Path, role: Role) -> std::io::Result<Self> {
        std::fs::create_dir_all(dir)?;
        let path = dir.join("partitions.bin");
        let specs = match std::fs::read(&path) {
            Ok(bytes) => postcard::from_bytes(&bytes).map_err(|e| {
                std::io::Error::new(
                    std::io::ErrorKind::InvalidData,
                    format!("{}: corrupt partition registry: {e}", path.display()),
                )
            })?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
            Err(e) => return Err(e),
        };
        Ok(Self {
            path: Some(path),
            specs: Mutex::new(specs),
            role,
        })
    }

    /// A registry that lives in memory only (tests).
    pub fn in_memory(role: Role) -> Self {
        Self {
            path: None,
            specs: Mutex::default(),
            role,
        }
    }

    pub fn specs(&self) -> Vec<PartitionSpec> {
        self.specs.lock().map(|s| s.clone()).unwrap_or_default()
    }

    fn persist(&self, specs: &[PartitionSpec]) -> Result<(), String> {
        let Some(path) = &self.path else {
            return Ok(());
        };
        let bytes = postcard::to_allocvec(specs).map_err(|e| e.to_string())?;
        let tmp = path.with_extension("tmp");
        let write = || -> std::io::Result<()> {
            use std::io::Write as _;
            let mut f = std::fs::File::create(&tmp)?;
            f.write_all(&bytes)?;
            f.sync_all()?;
            std::fs::rename(&tmp, path)?;
            if let Some(dir) = path.parent() {
                std::fs::File::open(dir)?.sync_all()?;
            }
            Ok(())
        };
        write().map_err(|e| format!("{}: {e}", path.display()))
    }

    fn change(&self, f: impl FnOnce(&mut Vec<PartitionSpec>)) -> Result<(), String> {
        let mut specs = self
            .specs
            .lock()
            .map_err(|_| "partition registry poisoned".to_string())?;
        let mut next = specs.clone();
        f(&mut next);
        if next != *specs {
            self.persist(&next)?;
            *specs = next;
        }
        Ok(())
    }
}

impl PartitionHost for SpecRegistry {
    fn hosted(&self) -> Vec<PartitionSpec> {
        self.specs()
    }

    fn reports(&self) -> Vec<PartitionReport> {
        self.specs()
            .iter()
            .map(|s| PartitionReport {
                id: s.id,
                ..PartitionReport::default()
            })
            .collect()
    }

    fn used(&self) -> u64 {
        0
    }

    fn ensure(&self, spec: PartitionSpec) -> BoxFuture<'_, Result<(), String>> {
        let r = match (&spec.kind, self.role) {
            (crate::map::PartitionKind::Meta { .. }, Role::Meta)
            | (crate::map::PartitionKind::Data, Role::Data) => self.change(|specs| {
                specs.retain(|s| s.id != spec.id);
                specs.push(spec);
                specs.sort_by_key(|s| s.id);
            }),
            _ => Err(format!(
                "a {:?} node cannot host partition {} of kind {:?}",
                self.role, spec.id, spec.kind
            )),
        };
        Box::pin(async move { r })
    }

    fn remove(&self, id: PartitionId) -> BoxFuture<'_, Result<(), String>> {
        let r = self.change(|specs| specs.retain(|s| s.id != id));
        Box::pin(async move { r })
    }
}

/// The node id persisted in `DIR/node-id` by an earlier run, if any.
pub fn read_node_id(dir: &Path) -> std::io::Result<Option<NodeId>> {
    match std::fs::read_to_string(dir.join("node-id")) {
        Ok(s) => s
            .trim()
            .parse::<u64>()
            .map(|n| Some(NodeId(n)))
            .map_err(|e| {
                std::io::Error::new(
                    std::io::ErrorKind::InvalidData,
                    format!("{}: bad node id: {e}", dir.join("node-id").display()),
                )
            }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e),
    }
}

/// Persists the node id in `DIR/node-id` (temp file, fsync, rename, fsync dir).
pub fn write_node_id(dir: &Path, id: NodeId) -> std::io::Result<()> {
    use std::io::Write as _;
    std::fs::create_dir_all(dir)?;
    let tmp = dir.join("node-id.tmp");
    let mut f = std::fs::File::create(&tmp)?;
    writeln!(f, "{}", id.0)?;
    f.sync_all()?;
    std::fs::rename(&tmp, dir.join("node-id"))?;
    std::fs::File::open(dir)?.sync_all()
}

/// The raft store of a node whose identity comes from the master (meta and data nodes). Its raft id
/// is the `NodeId` the master assigned, persisted in `DIR/node-id`; the store (log in `DIR/raft`)
/// starts once that id is known — at once on a restart.
pub struct NodeRaft<S: nacre_raft::StateMachine> {
    dir: PathBuf,
    role: &'static str,
    config: nacre_raft::StoreConfig,
    client: nacre_msgr::Client,
    raft: std::sync::OnceLock<nacre_raft::RaftHandle<S>>,
}

impl<S: nacre_raft::StateMachine> std::fmt::Debug for NodeRaft<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NodeRaft")
            .field("dir", &self.dir)
            .field("role", &self.role)
            .field("id", &self.id())
            .finish()
    }
}

impl<S: nacre_raft::StateMachine> NodeRaft<S> {
    /// Opens the node's identity in `dir`; starts the store if an earlier run persisted an id.
    pub fn open(
        dir: &Path,
        role: &'static str,
        config: nacre_raft::StoreConfig,
        client: nacre_msgr::Client,
    ) -> std::io::Result<Self> {
        let node = Self {
            dir: dir.to_path_buf(),
            role,
            config,
            client,
            raft: std::sync::OnceLock::new(),
        };
        if let Some(id) = read_node_id(dir)? {
            node.start(id)?;
        }
        Ok(node)
    }

    fn start(&self, id: NodeId) -> std::io::Result<()> {
        if self.raft.get().is_some() {
            return Ok(());
        }
        let dir = self.dir.join("raft");
        std::fs::create_dir_all(&dir)?;
        let log: Arc<dyn nacre_raft::LogStore> =
            Arc::new(nacre_raft::EngineLogStore::open(&dir).map_err(std::io::Error::other)?);
        let handle = nacre_raft::store::start::<S>(
            id.0,
            self.config.clone(),
            log,
            std::collections::BTreeMap::new(),
            self.client.clone(),
        )?;
        let _ = self.raft.set(handle);
        tracing::info!(node = %id, role = self.role, "raft store started");
        Ok(())
    }

    /// The running store, if the id is known.
    pub fn get(&self) -> Option<&nacre_raft::RaftHandle<S>> {
        self.raft.get()
    }

    /// The running store, or why there is none.
    pub fn handle(&self) -> Result<&nacre_raft::RaftHandle<S>, String> {
        self.raft
            .get()
            .ok_or_else(|| format!("this {} node is not registered yet", self.role))
    }

    /// The id this node runs under, once known.
    pub fn id(&self) -> Option<NodeId> {
        self.raft.get().map(|r| NodeId(r.id()))
    }

    /// Runs under `id` from now on (persisting it), or checks that the running store has that id.
    pub fn adopt(&self, id: NodeId) -> Result<(), String> {
        match self.raft.get() {
            Some(r) if r.id() != id.0 => Err(format!(
                "the master now calls this node {id}, but its data belongs to node-{}; refusing \
                 to serve (was the node's address changed?)",
                r.id()
            )),
            Some(_) => Ok(()),
            None => {
                write_node_id(&self.dir, id).map_err(|e| e.to_string())?;
                self.start(id).map_err(|e| e.to_string())
            }
        }
    }
}

/// What [`run_node`] drives on a meta or data node.
pub trait NodeDuties: Send + Sync {
    /// "meta" or "data", for logs.
    fn role(&self) -> &'static str;
    /// The id the node runs under, once known.
    fn id(&self) -> Option<NodeId>;
    /// Starts serving under `id` (persisting it) and opens the partitions registered on disk.
    fn adopt(&self, id: NodeId) -> BoxFuture<'_, Result<(), String>>;
    /// Periodic work: reports, sweeps, repairs.
    fn tick(&self) -> BoxFuture<'_, ()>;
    /// Stops the node's raft store.
    fn stop(&self) -> BoxFuture<'_, ()>;
}

/// Runs a node until `shutdown`: serves at once under an id known from disk (even before the master
/// answers), else adopts the id the agent publishes on `id`; calls [`NodeDuties::tick`] every
/// `interval`.
pub async fn run_node(
    node: &impl NodeDuties,
    mut id: watch::Receiver<Option<NodeId>>,
    interval: Duration,
    shutdown: impl Future<Output = ()>,
) {
    let role = node.role();
    let mut shutdown = std::pin::pin!(shutdown);
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    let mut adopted = false;
    let mut agent_gone = false;
    if let Some(known) = node.id() {
        match node.adopt(known).await {
            Ok(()) => adopted = true,
            Err(e) => tracing::error!(role, error = %e, "cannot reopen the partitions"),
        }
    }
    // An id published before this call is not a change: look at it now.
    let mut current = *id.borrow_and_update();
    loop {
        match current.take() {
            Some(n) if !adopted => match node.adopt(n).await {
                Ok(()) => adopted = true,
                Err(e) => tracing::error!(role, error = %e, "cannot start the node"),
            },
            Some(n) if node.id() != Some(n) => tracing::error!(
                role,
                node = %n,
                own = ?node.id(),
                "the master registered this node under another id; its partitions keep running \
                 under the id on disk"
            ),
            _ => {}
        }
        tokio::select! {
            _ = &mut shutdown => break,
            changed = id.changed(), if !agent_gone => {
                if changed.is_err() {
                    // The agent is gone (shutting down); keep serving what we have.
                    agent_gone = true;
                } else {
                    current = *id.borrow_and_update();
                }
            }
            _ = tick.tick() => node.tick().await,
        }
    }
    node.stop().await;
}
