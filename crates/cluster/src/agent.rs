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
use std::sync::Arc;
use std::time::Duration;

use nacre_api::master::{
    CreatePartition, HeartbeatReply, MapError, MasterError, PartitionReport, PartitionSpec,
    RegisterRequest,
};
use nacre_client::MasterClient;
pub use nacre_msgr::BoxFuture;
use nacre_msgr::{Payload, Router};
use nacre_types::{NodeId, PartitionId};
use tokio::sync::watch;

use crate::host::HostError;

/// What a node hosts, as seen by the master protocol.
pub trait PartitionHost: Send + Sync + 'static {
    /// Specs of the partitions hosted now.
    fn hosted(&self) -> Vec<PartitionSpec>;
    /// Per-partition figures for the next heartbeat.
    fn reports(&self) -> Vec<PartitionReport>;
    /// Bytes used of the node's capacity (memory on meta nodes, disk on data nodes).
    fn used(&self) -> u64;
    /// Hosts `spec`, or updates the hosted partition of that id to it. Idempotent.
    fn ensure(&self, spec: PartitionSpec) -> BoxFuture<'_, Result<(), HostError>>;
    /// Stops hosting a partition and deletes its data.
    fn remove(&self, id: PartitionId) -> BoxFuture<'_, Result<(), HostError>>;
    /// Woken when the reports changed in a way the master should learn of at once (a data
    /// partition turned read-only or writable): the agent heartbeats then instead of waiting
    /// for the interval. None: only the interval.
    fn report_now(&self) -> Option<Arc<tokio::sync::Notify>> {
        None
    }
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
            // The reply carries the reason as text (the master shows it in its status).
            let r = host.ensure(spec).await.map_err(|e| e.to_string());
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
    let report_now = host.report_now();
    let changed = || async {
        match &report_now {
            Some(n) => n.notified().await,
            None => std::future::pending().await,
        }
    };
    loop {
        tokio::select! {
            _ = &mut shutdown => return,
            _ = tick.tick() => {}
            () = changed() => {}
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
