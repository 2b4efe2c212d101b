//! The meta node service: hosts the meta partitions the master places here, one Raft group each
//! (all groups share the node's raft store and log), and serves `MetaWrite`/`MetaRead` on the
//! leaders. A replica that does not lead answers `NotLeader` with the leader's address.
//!
//! Lifecycle: the node's raft id is the `NodeId` the master assigned at registration, persisted in
//! `DIR/node-id`. The raft store starts once the id is known (at once on a restart), and opens every
//! partition recorded in the partition registry; new partitions arrive through
//! [`PartitionHost::ensure`] (the master's create request or a heartbeat reconciliation).

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, RwLock, RwLockReadGuard, RwLockWriteGuard};
use std::time::Duration;

use nacre_api::master::{MasterError, PartitionKind, PartitionReport, PartitionSpec, Role};
use nacre_client::{DataCallError, MasterClient, NetVolume};
use nacre_cluster::{
    BoxFuture, HostError, NodeRaft, PartitionRole, SpecRegistry, Updated, run_node,
};
use nacre_msgr::{Client, Payload, Router};
use nacre_proto::msg::RemoteError;
use nacre_proto::msg::raft::RaftBatchRpc;
use nacre_raft::{RaftError, RaftHandle, ReadGate, RestoreError, StateMachine, StoreConfig};
use nacre_types::sync::{self, lock};
use nacre_types::{ErrorCode, NodeId, PartitionId};
use tokio::sync::watch;

use crate::partition::MetaPartition;
use nacre_api::meta::rpc::{MetaRead, MetaWrite};
use nacre_api::meta::{Command, MetaError, Query, Reply};

/// How long one release of freed extents may look for a data partition's leader.
const RELEASE_RETRY_FOR: Duration = Duration::from_secs(2);

/// A meta partition as a Raft state machine. Entries are postcard `(now_ns, Command)`; results are
/// postcard `Result<Reply, MetaError>`.
///
/// The partition is shared with the node's messenger threads, which answer reads from it directly
/// while the group's [`ReadGate`] is open (the leader holds a read lease and has applied everything
/// committed): a read then waits neither for the Raft thread nor for its log write. The Raft thread
/// takes the write lock for each command it applies.
#[derive(Debug)]
pub struct MetaSm {
    partition: Arc<RwLock<MetaPartition>>,
}

impl MetaSm {
    pub fn new(partition: MetaPartition) -> Self {
        Self {
            partition: Arc::new(RwLock::new(partition)),
        }
    }

    /// The partition, for reading.
    pub fn partition(&self) -> RwLockReadGuard<'_, MetaPartition> {
        sync::read(&self.partition)
    }

    fn partition_mut(&self) -> RwLockWriteGuard<'_, MetaPartition> {
        sync::write(&self.partition)
    }
}

impl StateMachine for MetaSm {
    fn apply(&mut self, _index: u64, command: &[u8]) -> Vec<u8> {
        let result = match postcard::from_bytes::<(u64, Command)>(command) {
            Ok((now, cmd)) => self.partition_mut().apply(now, &cmd),
            Err(e) => Err(MetaError::Invalid(format!("undecodable command: {e}"))),
        };
        postcard::to_allocvec(&result).expect("replies are postcard-serializable")
    }

    fn snapshot(&self) -> Vec<u8> {
        self.partition().snapshot()
    }

    fn restore(&mut self, snapshot: &[u8]) -> Result<(), RestoreError> {
        let restored =
            MetaPartition::restore(snapshot).map_err(|e| RestoreError::Invalid(e.to_string()))?;
        *self.partition_mut() = restored;
        Ok(())
    }
}

/// A hosted partition's state and the gate that says when it may be read off the Raft thread.
struct Direct {
    partition: Arc<RwLock<MetaPartition>>,
    gate: Arc<ReadGate>,
}

/// Settings of a meta node.
#[derive(Clone, Debug)]
pub struct MetaNodeConfig {
    pub dir: PathBuf,
    pub raft: StoreConfig,
    /// How often per-partition reports are refreshed for heartbeats (and orphans swept).
    pub report_interval: Duration,
    /// An inode deleted (nlink 0) but not evicted by its client for this long is evicted by the
    /// partition leader. Clients evict at once (or, with open files, at the last close), so this only
    /// cleans up after clients that failed or died in between.
    pub orphan_grace: Duration,
    /// Masters to ask for volume views, to release freed extents on the data nodes. Empty: freed
    /// extents stay listed.
    pub masters: Vec<String>,
}

struct Inner {
    dir: PathBuf,
    registry: SpecRegistry,
    client: Client,
    raft: NodeRaft<MetaSm>,
    /// Partition → node id → address, for leader hints.
    replicas: Mutex<BTreeMap<PartitionId, BTreeMap<u64, String>>>,
    reports: Mutex<Vec<PartitionReport>>,
    orphan_grace: Duration,
    /// When this node, as leader, first saw each orphan.
    orphans_seen: Mutex<BTreeMap<(PartitionId, u64), std::time::Instant>>,
    /// Operations served per partition since start, and the counts at the last report.
    ops: Mutex<BTreeMap<PartitionId, (u64, u64)>>,
    last_report: Mutex<Option<std::time::Instant>>,
    /// The master, for volume views; `None` when no master is configured.
    master: Option<MasterClient>,
    /// Each volume's data partitions, reached through the SDK (leaders followed, views refreshed).
    volumes: Mutex<BTreeMap<String, Arc<NetVolume>>>,
    /// Partitions readable without the Raft thread (see [`MetaSm`]).
    direct: Mutex<BTreeMap<PartitionId, Arc<Direct>>>,
}

/// A running meta node. Cheap to clone.
#[derive(Clone)]
pub struct MetaNode {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for MetaNode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MetaNode")
            .field("dir", &self.inner.dir)
            .finish()
    }
}

fn unavailable(m: impl Into<String>) -> RemoteError {
    RemoteError::new(ErrorCode::Unavailable, m)
}

impl MetaNode {
    /// Opens the node's state in `config.dir`. If the node has an id from an earlier run, its raft
    /// store and partitions start now; otherwise once [`MetaNode::run`] learns the id.
    pub fn open(config: &MetaNodeConfig, client: Client) -> std::io::Result<Self> {
        let raft = NodeRaft::open(&config.dir, "meta", config.raft.clone(), client.clone())?;
        let registry = SpecRegistry::open(&config.dir.join("partitions"), Role::Meta)?;
        let master = (!config.masters.is_empty())
            .then(|| MasterClient::new(client.clone(), config.masters.clone()));
        let node = Self {
            inner: Arc::new(Inner {
                dir: config.dir.clone(),
                registry,
                client,
                raft,
                replicas: Mutex::default(),
                reports: Mutex::default(),
                orphan_grace: config.orphan_grace,
                orphans_seen: Mutex::default(),
                ops: Mutex::default(),
                last_report: Mutex::default(),
                master,
                volumes: Mutex::default(),
                direct: Mutex::default(),
            }),
        };
        Ok(node)
    }

    /// The id this node runs under, once known.
    pub fn id(&self) -> Option<NodeId> {
        self.inner.raft.id()
    }

    /// Log entries applied by this node's partitions, once its raft store runs (see
    /// `RaftHandle::applied`).
    pub fn applied(&self) -> Option<watch::Receiver<u64>> {
        self.inner.raft.get().map(RaftHandle::applied)
    }

    fn raft(&self) -> Result<&RaftHandle<MetaSm>, HostError> {
        self.inner.raft.handle()
    }

    /// Hosts `spec`'s group (idempotent: an already hosted group is left alone).
    async fn open_partition(&self, spec: &PartitionSpec) -> Result<(), OpenError> {
        let PartitionKind::Meta { start, end } = spec.kind else {
            return Err(OpenError::NotMeta(spec.id));
        };
        let raft = self.raft()?;
        let peers: BTreeMap<u64, String> = spec
            .replicas
            .iter()
            .map(|r| (r.node.0, r.addr.clone()))
            .collect();
        raft.add_peers(peers.clone())?;
        let voters: Vec<u64> = peers.keys().copied().collect();
        let sm = MetaSm::new(MetaPartition::new(start, end));
        let partition = Arc::clone(&sm.partition);
        match raft.add_group_gated(spec.id.0, &voters, sm).await {
            Ok(gate) => {
                if let Some(gate) = gate {
                    let direct = Arc::new(Direct { partition, gate });
                    lock(&self.inner.direct).insert(spec.id, direct);
                }
            }
            Err(RaftError::GroupExists(_)) => {}
            Err(e) => return Err(e.into()),
        }
        lock(&self.inner.replicas).insert(spec.id, peers);
        Ok(())
    }

    /// Runs until `shutdown`: adopts the id the agent publishes on `id`, and every
    /// `report_interval` refreshes the per-partition reports, evicts stale orphans and releases
    /// freed extents.
    pub async fn run(
        &self,
        id: watch::Receiver<Option<NodeId>>,
        report_interval: Duration,
        shutdown: impl std::future::Future<Output = ()>,
    ) {
        run_node(self, id, report_interval, shutdown).await;
    }

    /// The highest inode allocated across this node's replicas, as applied locally (for tests and
    /// tools that wait for a replica to catch up).
    pub async fn applied_max_inode(&self) -> u64 {
        let Some(raft) = self.inner.raft.get() else {
            return 0;
        };
        let mut max = 0;
        for spec in self.inner.registry.specs() {
            if let Ok(m) = raft
                .local_read(spec.id.0, |sm: &MetaSm, _| sm.partition().stats().max_inode)
                .await
            {
                max = max.max(m);
            }
        }
        max
    }

    /// Evicts, on the partitions this node leads, inodes deleted longer than `orphan_grace` ago.
    async fn sweep_orphans(&self) {
        let Some(raft) = self.inner.raft.get() else {
            return;
        };
        let now = std::time::Instant::now();
        let mut live = std::collections::BTreeSet::new();
        for spec in self.inner.registry.specs() {
            let id = spec.id;
            let orphans = raft
                .local_read(id.0, |sm: &MetaSm, leader| {
                    if !leader {
                        return Vec::new();
                    }
                    match sm.partition().query(&Query::Orphans { limit: 1024 }) {
                        Ok(Reply::Inos(v)) => v,
                        _ => Vec::new(),
                    }
                })
                .await
                .unwrap_or_default();
            for ino in orphans {
                live.insert((id, ino.0));
                let first = *lock(&self.inner.orphans_seen)
                    .entry((id, ino.0))
                    .or_insert(now);
                if now.duration_since(first) < self.inner.orphan_grace {
                    continue;
                }
                let Ok(bytes) = postcard::to_allocvec(&(now_ns(), Command::EvictInode { ino }))
                else {
                    continue;
                };
                match raft.propose(id.0, bytes).await {
                    Ok(_) => tracing::info!(partition = %id, %ino, "evicted an orphan inode"),
                    Err(e) => {
                        tracing::debug!(partition = %id, %ino, error = %e, "orphan not evicted")
                    }
                }
            }
        }
        lock(&self.inner.orphans_seen).retain(|k, _| live.contains(k));
    }

    /// On the partitions this node leads, releases the extents of evicted inodes on the data nodes
    /// (deleted or hole-punched there) and then drops them from the to-free list. Release is
    /// idempotent, so a failure anywhere only means trying again next time.
    async fn release_freed(&self) {
        let Some(raft) = self.inner.raft.get() else {
            return;
        };
        if self.inner.master.is_none() {
            return;
        }
        for spec in self.inner.registry.specs() {
            let id = spec.id;
            let keys = raft
                .local_read(id.0, |sm: &MetaSm, leader| {
                    if !leader {
                        return Vec::new();
                    }
                    match sm.partition().query(&Query::ToFree { limit: 256 }) {
                        Ok(Reply::Freed(v)) => v,
                        _ => Vec::new(),
                    }
                })
                .await
                .unwrap_or_default();
            if keys.is_empty() {
                continue;
            }
            let mut by_part: BTreeMap<PartitionId, Vec<(nacre_types::ExtentId, u64, u64)>> =
                BTreeMap::new();
            for k in &keys {
                by_part.entry(k.partition).or_default().push((
                    k.extent,
                    k.extent_offset,
                    u64::from(k.size),
                ));
            }
            let mut all_done = true;
            for (dp, ranges) in by_part {
                if let Err(e) = self.release_on(&spec.volume, dp, ranges).await {
                    tracing::debug!(partition = %dp, error = %e, "extents not released yet");
                    all_done = false;
                    break;
                }
            }
            if !all_done {
                continue;
            }
            let cmd = Command::AckFreed {
                count: keys.len() as u64,
                first: keys.first().copied(),
            };
            let Ok(bytes) = postcard::to_allocvec(&(now_ns(), cmd)) else {
                continue;
            };
            match raft.propose(id.0, bytes).await {
                Ok(_) => tracing::debug!(partition = %id, n = keys.len(), "freed extents released"),
                Err(e) => tracing::debug!(partition = %id, error = %e, "to-free list not trimmed"),
            }
        }
    }

    /// Releases extent ranges on a data partition of `volume` (its leader, found and followed by
    /// the SDK's volume routing). Idempotent.
    async fn release_on(
        &self,
        volume: &str,
        partition: PartitionId,
        ranges: Vec<(nacre_types::ExtentId, u64, u64)>,
    ) -> Result<(), ReleaseError> {
        let known = lock(&self.inner.volumes).get(volume).cloned();
        let vol = match known {
            Some(v) => v,
            None => {
                let master = self.inner.master.clone().ok_or(ReleaseError::NoMaster)?;
                let mut vol = NetVolume::connect(self.inner.client.clone(), master, volume).await?;
                // A release is retried on the next report anyway: do not hold up the node's duties.
                vol.retry_for = RELEASE_RETRY_FOR;
                let vol = Arc::new(vol);
                lock(&self.inner.volumes).insert(volume.to_string(), Arc::clone(&vol));
                vol
            }
        };
        Ok(vol.release(partition, ranges).await?)
    }

    fn count_op(&self, p: PartitionId) {
        lock(&self.inner.ops).entry(p).or_default().0 += 1;
    }

    /// Operations per second per partition since the last call.
    fn op_rates(&self) -> BTreeMap<PartitionId, u64> {
        let now = std::time::Instant::now();
        let secs = lock(&self.inner.last_report)
            .replace(now)
            .map_or(0.0, |t| now.duration_since(t).as_secs_f64());
        let mut ops = lock(&self.inner.ops);
        ops.iter_mut()
            .map(|(p, (total, last))| {
                let delta = total.saturating_sub(std::mem::replace(last, *total));
                let rate = if secs > 0.0 { delta as f64 / secs } else { 0.0 };
                (*p, rate.round() as u64)
            })
            .collect()
    }

    async fn refresh_reports(&self) {
        let Some(raft) = self.inner.raft.get() else {
            return;
        };
        let rates = self.op_rates();
        let mut reports = Vec::new();
        for spec in self.inner.registry.specs() {
            let id = spec.id;
            let ops_per_s = rates.get(&id).copied().unwrap_or(0);
            let r = raft
                .local_read(id.0, move |sm: &MetaSm, leader| {
                    let s = sm.partition().stats();
                    PartitionReport {
                        id,
                        leader,
                        inode_count: s.inodes,
                        max_inode: s.max_inode,
                        used: s.memory,
                        full: false,
                        ops_per_s,
                        bytes_per_s: 0,
                    }
                })
                .await;
            if let Ok(r) = r {
                reports.push(r);
            }
        }
        *lock(&self.inner.reports) = reports;
    }

    fn leader_hint(&self, partition: PartitionId, leader: u64) -> Option<String> {
        lock(&self.inner.replicas)
            .get(&partition)?
            .get(&leader)
            .cloned()
    }

    fn remote(&self, partition: PartitionId, e: RaftError) -> RemoteError {
        match e {
            RaftError::NotLeader { leader, .. } => RemoteError {
                leader_hint: self.leader_hint(partition, leader),
                ..RemoteError::new(ErrorCode::NotLeader, "not the partition leader")
            },
            RaftError::UnknownGroup(g) => RemoteError::new(
                ErrorCode::UnknownGroup,
                format!("meta partition {g} is not hosted here"),
            ),
            // The proposal may still be applied: the caller must not assume either way.
            e @ RaftError::Timeout => RemoteError::new(ErrorCode::DeadlineExceeded, e.to_string()),
            other => unavailable(other.to_string()),
        }
    }

    /// The messenger ops of a meta node: its raft traffic (delivered once the store runs) and the
    /// meta ops. The agent's ops are separate (`nacre_cluster::node_router`).
    pub fn router(&self) -> Router {
        let (w, r, b) = (self.clone(), self.clone(), self.clone());
        Router::new()
            .route::<RaftBatchRpc, _, _>(move |batch, _inc| {
                if let Some(raft) = b.inner.raft.get() {
                    raft.deliver(batch);
                }
                async { Ok(((), Payload::none())) }
            })
            .route::<MetaWrite, _, _>(move |req, _inc| {
                let node = w.clone();
                async move {
                    let raft = node.raft().map_err(|e| unavailable(e.to_string()))?;
                    node.count_op(req.partition);
                    let bytes = postcard::to_allocvec(&(now_ns(), req.cmd))
                        .map_err(|e| RemoteError::new(ErrorCode::BadRequest, e.to_string()))?;
                    let out = raft
                        .propose(req.partition.0, bytes)
                        .await
                        .map_err(|e| node.remote(req.partition, e))?;
                    let result = postcard::from_bytes::<Result<Reply, MetaError>>(&out)
                        .map_err(|e| unavailable(format!("bad result: {e}")))?;
                    Ok((result, Payload::none()))
                }
            })
            .route::<MetaRead, _, _>(move |req, _inc| {
                let node = r.clone();
                async move {
                    let raft = node.raft().map_err(|e| unavailable(e.to_string()))?;
                    node.count_op(req.partition);
                    let q: Query = req.query;
                    let direct = lock(&node.inner.direct).get(&req.partition).cloned();
                    if let Some(d) = direct
                        && d.gate.open_at(std::time::Instant::now())
                    {
                        let part = sync::read(&d.partition);
                        return Ok((part.query(&q), Payload::none()));
                    }
                    let result = raft
                        .read(req.partition.0, move |sm: &MetaSm| sm.partition().query(&q))
                        .await
                        .map_err(|e| node.remote(req.partition, e))?;
                    Ok((result, Payload::none()))
                }
            })
    }
}

impl PartitionRole for MetaNode {
    type Sm = MetaSm;
    const ROLE: Role = Role::Meta;

    fn node_raft(&self) -> &NodeRaft<MetaSm> {
        &self.inner.raft
    }

    fn registry(&self) -> &SpecRegistry {
        &self.inner.registry
    }

    fn open(&self, spec: &PartitionSpec) -> BoxFuture<'_, Result<(), HostError>> {
        let spec = spec.clone();
        Box::pin(async move {
            self.open_partition(&spec)
                .await
                .map_err(|e| HostError::partition(spec.id, e))
        })
    }

    fn update(&self, spec: &PartitionSpec) -> BoxFuture<'_, Result<Updated, HostError>> {
        let spec = spec.clone();
        Box::pin(async move {
            let PartitionKind::Meta { end, .. } = spec.kind else {
                return Err(HostError::partition(spec.id, "not a meta partition"));
            };
            // Hosted: the master may have closed the range (a split). The leader applies it; every
            // replica records the new spec once its state machine has it.
            let id = spec.id;
            let raft = self.inner.raft.handle()?;
            let (cur_end, leader) = raft
                .local_read(id.0, |sm: &MetaSm, leader| {
                    (sm.partition().stats().end, leader)
                })
                .await?;
            if cur_end != end && leader {
                let bytes = postcard::to_allocvec(&(now_ns(), Command::SetEnd { end }))
                    .map_err(|e| HostError::partition(id, e))?;
                let out = raft.propose(id.0, bytes).await?;
                postcard::from_bytes::<Result<Reply, MetaError>>(&out)
                    .map_err(|e| HostError::partition(id, e))?
                    .map_err(|e| {
                        HostError::partition(id, format!("cannot close it at {end}: {e}"))
                    })?;
            } else if cur_end != end {
                // A follower waits for the leader's SetEnd to reach it; the next heartbeat retries.
                return Ok(Updated::Later);
            }
            lock(&self.inner.replicas).insert(
                id,
                spec.replicas
                    .iter()
                    .map(|r| (r.node.0, r.addr.clone()))
                    .collect(),
            );
            Ok(Updated::Now)
        })
    }

    fn close(&self, id: PartitionId) -> BoxFuture<'_, Result<(), HostError>> {
        Box::pin(async move {
            lock(&self.inner.direct).remove(&id);
            lock(&self.inner.replicas).remove(&id);
            Ok(())
        })
    }

    fn reports(&self) -> Vec<PartitionReport> {
        lock(&self.inner.reports).clone()
    }

    fn used(&self) -> u64 {
        PartitionRole::reports(self).iter().map(|r| r.used).sum()
    }

    fn tick(&self) -> BoxFuture<'_, ()> {
        Box::pin(async move {
            self.refresh_reports().await;
            self.sweep_orphans().await;
            self.release_freed().await;
        })
    }
}

/// Why a partition could not be opened on this node.
#[derive(Debug, thiserror::Error)]
enum OpenError {
    #[error("partition {0} is not a meta partition")]
    NotMeta(PartitionId),
    #[error(transparent)]
    Node(#[from] HostError),
    #[error(transparent)]
    Raft(#[from] RaftError),
}

/// Why freed extents could not be released on a data partition (retried on the next report).
#[derive(Debug, thiserror::Error)]
enum ReleaseError {
    #[error("no master configured")]
    NoMaster,
    /// The volume's view could not be had from the master.
    #[error(transparent)]
    Master(#[from] MasterError),
    #[error(transparent)]
    Data(#[from] DataCallError),
}

fn now_ns() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64)
}
