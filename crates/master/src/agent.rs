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
