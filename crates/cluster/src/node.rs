//! The lifecycle of a meta or data node: its raft store starts under the id the master assigned
//! ([`NodeRaft`]), and [`run_node`] drives its periodic duties until shutdown.

use std::future::Future;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use nacre_msgr::BoxFuture;
use nacre_types::NodeId;
use tokio::sync::watch;

use crate::registry::{read_node_id, write_node_id};

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

    /// The running store, or why there is none. (A `String` until the data node's service, which
    /// returns it as is, takes [`NodeRaftError`].)
    pub fn handle(&self) -> Result<&nacre_raft::RaftHandle<S>, String> {
        self.raft
            .get()
            .ok_or_else(|| NodeRaftError::NotRegistered { role: self.role }.to_string())
    }

    /// The id this node runs under, once known.
    pub fn id(&self) -> Option<NodeId> {
        self.raft.get().map(|r| NodeId(r.id()))
    }

    /// Runs under `id` from now on (persisting it), or checks that the running store has that id.
    pub fn adopt(&self, id: NodeId) -> Result<(), NodeRaftError> {
        match self.raft.get() {
            Some(r) if r.id() != id.0 => Err(NodeRaftError::IdMismatch {
                given: id,
                held: NodeId(r.id()),
            }),
            Some(_) => Ok(()),
            None => {
                let io = |source| NodeRaftError::Io {
                    dir: self.dir.clone(),
                    source,
                };
                write_node_id(&self.dir, id).map_err(io)?;
                self.start(id).map_err(io)
            }
        }
    }
}

/// Why a node's raft store does not run, or cannot run under the id the master gave it.
#[derive(Debug, thiserror::Error)]
pub enum NodeRaftError {
    /// The master has not given this node an id yet (and no earlier run persisted one).
    #[error("this {role} node is not registered yet")]
    NotRegistered { role: &'static str },
    /// The node's data belongs to another node id.
    #[error(
        "the master now calls this node {given}, but its data belongs to {held}; refusing to \
         serve (was the node's address changed?)"
    )]
    IdMismatch { given: NodeId, held: NodeId },
    /// The id could not be persisted in the node's directory, or the store not started there.
    #[error("{}: {source}", dir.display())]
    Io {
        dir: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// For the [`NodeDuties`] implementations, whose `adopt` returns a `String` until that trait's
/// signature changes.
impl From<NodeRaftError> for String {
    fn from(e: NodeRaftError) -> Self {
        e.to_string()
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
