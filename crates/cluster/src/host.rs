//! The node lifecycle that meta and data nodes share, written once.
//!
//! A role ([`PartitionRole`]: the meta node, the data node) says how to open, update and close one
//! of its partitions and what its periodic duties are; this module turns that into the node's
//! [`NodeDuties`] (start under the master's id, reopen every registered partition, tick, stop) and
//! its [`PartitionHost`] (what the agent and the master's create requests call). The invariants it
//! keeps for every role:
//! - a partition is recorded in the node's [`SpecRegistry`](crate::SpecRegistry) only once it is
//!   open (or updated) here, so a restart never reopens a partition that failed to open;
//! - a node hosts only partitions of its own role;
//! - removing a partition removes its Raft group first, then its record, then its local state, so a
//!   crash in between leaves at worst a directory that the next removal cleans up.

use std::sync::Arc;

use nacre_api::master::{PartitionKind, PartitionReport, PartitionSpec, Role};
use nacre_msgr::BoxFuture;
use nacre_raft::{RaftError, StateMachine};
use nacre_types::{NodeId, PartitionId};
use thiserror::Error;

use crate::agent::PartitionHost;
use crate::node::{NodeDuties, NodeRaft};
use crate::registry::SpecRegistry;

/// Why a node cannot start, or host, update or drop a partition.
#[derive(Debug, Error)]
pub enum HostError {
    #[error("a {role} node cannot host {kind} partition {id}")]
    WrongKind {
        role: &'static str,
        kind: &'static str,
        id: PartitionId,
    },
    #[error("this {0} node is not registered yet")]
    NotRegistered(&'static str),
    #[error(
        "the master now calls this node {assigned}, but its data belongs to node-{own}; refusing \
         to serve (was the node's address changed?)"
    )]
    IdMismatch { assigned: NodeId, own: u64 },
    /// A local file failed; `context` names it.
    #[error("{context}: {source}")]
    Io {
        context: String,
        source: std::io::Error,
    },
    #[error(transparent)]
    Raft(#[from] RaftError),
    /// The role could not open or change the partition (its store, its state machine).
    #[error("partition {id}: {reason}")]
    Partition { id: PartitionId, reason: String },
}

impl HostError {
    /// A failure of the role's own state for partition `id`.
    pub fn partition(id: PartitionId, reason: impl std::fmt::Display) -> Self {
        Self::Partition {
            id,
            reason: reason.to_string(),
        }
    }

    pub(crate) fn io(context: impl std::fmt::Display, source: std::io::Error) -> Self {
        Self::Io {
            context: context.to_string(),
            source,
        }
    }
}

/// The name of a role in messages and logs.
pub fn role_name(role: Role) -> &'static str {
    match role {
        Role::Master => "master",
        Role::Meta => "meta",
        Role::Data => "data",
        Role::Func => "func",
    }
}

/// The role of the nodes that host a partition of `kind`.
fn kind_name(kind: &PartitionKind) -> &'static str {
    match kind {
        PartitionKind::Meta { .. } => "meta",
        PartitionKind::Data | PartitionKind::Shards { .. } => "data",
    }
}

/// Whether a hosted partition took a changed spec.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Updated {
    /// It did: record the new spec.
    Now,
    /// Not yet (e.g. a follower waits for its leader to apply the change): keep the old record;
    /// the next heartbeat asks again.
    Later,
}

/// What a meta or data node adds to the shared lifecycle. Implementing it gives the node
/// [`NodeDuties`] and [`PartitionHost`].
pub trait PartitionRole: Send + Sync + 'static {
    /// The Raft state machine of one partition.
    type Sm: StateMachine;
    /// [`Role::Meta`] or [`Role::Data`].
    const ROLE: Role;

    /// The node's raft store.
    fn node_raft(&self) -> &NodeRaft<Self::Sm>;
    /// The partitions the node was asked to host.
    fn registry(&self) -> &SpecRegistry;
    /// Opens a partition: its local state and its Raft group. Idempotent.
    fn open(&self, spec: &PartitionSpec) -> BoxFuture<'_, Result<(), HostError>>;
    /// Brings a hosted partition in line with a changed spec (replicas, a closed inode range).
    fn update(&self, spec: &PartitionSpec) -> BoxFuture<'_, Result<Updated, HostError>>;
    /// Drops the partition's local state, once its group and its record are gone.
    fn close(&self, id: PartitionId) -> BoxFuture<'_, Result<(), HostError>>;
    /// Per-partition figures for the next heartbeat.
    fn reports(&self) -> Vec<PartitionReport>;
    /// Bytes used of the node's capacity.
    fn used(&self) -> u64;
    /// Periodic work: reports, sweeps, repairs.
    fn tick(&self) -> BoxFuture<'_, ()>;
    /// See [`PartitionHost::report_now`].
    fn report_now(&self) -> Option<Arc<tokio::sync::Notify>> {
        None
    }
    /// Opens the partitions registered on disk when the node starts, one after the other unless
    /// the role opens them concurrently (a data node does: until a restarted replica hosts its
    /// partition again, that partition takes no appends).
    fn open_all(
        &self,
        specs: Vec<PartitionSpec>,
    ) -> BoxFuture<'_, Vec<(PartitionId, Result<(), HostError>)>> {
        Box::pin(async move {
            let mut out = Vec::with_capacity(specs.len());
            for spec in specs {
                out.push((spec.id, self.open(&spec).await));
            }
            out
        })
    }
}

impl<R: PartitionRole> NodeDuties for R {
    fn role(&self) -> &'static str {
        role_name(R::ROLE)
    }

    fn id(&self) -> Option<NodeId> {
        self.node_raft().id()
    }

    fn adopt(&self, id: NodeId) -> BoxFuture<'_, Result<(), HostError>> {
        Box::pin(async move {
            self.node_raft().adopt(id)?;
            for (id, r) in self.open_all(self.registry().specs()).await {
                if let Err(e) = r {
                    tracing::error!(
                        role = role_name(R::ROLE),
                        partition = %id,
                        error = %e,
                        "cannot open partition"
                    );
                }
            }
            Ok(())
        })
    }

    fn tick(&self) -> BoxFuture<'_, ()> {
        PartitionRole::tick(self)
    }

    fn stop(&self) -> BoxFuture<'_, ()> {
        Box::pin(async move {
            if let Some(r) = self.node_raft().get() {
                let _ = r.stop().await;
            }
        })
    }
}

impl<R: PartitionRole> PartitionHost for R {
    fn hosted(&self) -> Vec<PartitionSpec> {
        self.registry().specs()
    }

    fn reports(&self) -> Vec<PartitionReport> {
        PartitionRole::reports(self)
    }

    fn used(&self) -> u64 {
        PartitionRole::used(self)
    }

    fn report_now(&self) -> Option<Arc<tokio::sync::Notify>> {
        PartitionRole::report_now(self)
    }

    fn ensure(&self, spec: PartitionSpec) -> BoxFuture<'_, Result<(), HostError>> {
        Box::pin(async move {
            let kind = kind_name(&spec.kind);
            if kind != role_name(R::ROLE) {
                return Err(HostError::WrongKind {
                    role: role_name(R::ROLE),
                    kind,
                    id: spec.id,
                });
            }
            if self.registry().get(spec.id).is_some() {
                if self.update(&spec).await? == Updated::Later {
                    return Ok(());
                }
            } else {
                self.open(&spec).await?;
            }
            self.registry().record(spec)
        })
    }

    fn remove(&self, id: PartitionId) -> BoxFuture<'_, Result<(), HostError>> {
        Box::pin(async move {
            if let Some(raft) = self.node_raft().get() {
                match raft.remove_group(id.0).await {
                    Ok(()) | Err(RaftError::UnknownGroup(_)) => {}
                    Err(e) => return Err(e.into()),
                }
            }
            self.registry().forget(id)?;
            self.close(id).await
        })
    }
}
