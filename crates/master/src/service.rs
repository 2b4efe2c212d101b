//! The master service: the cluster map in a Raft group of 1 or 3 masters, served over the messenger.
//!
//! Every change goes through Raft as one [`Command`], so a command (say, creating a volume with all its
//! partitions) is applied on every master or on none. Reads of the map go through ReadIndex on the
//! leader. A master that is not the leader answers `NotLeader` with the leader's address, and
//! `nacre_client::MasterClient` follows it.
//!
//! The leader also runs the cluster's duties ([`Master::run_duties`]): it marks silent nodes down,
//! keeps enough writable data partitions per volume, splits a volume's last meta partition when it
//! fills, and asks nodes to create the partition replicas placed on them, retrying with backoff until
//! each node reports the replica in a heartbeat. Whatever is still pending, and why, is in
//! [`MasterStatus`].

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use nacre_msgr::{CallOptions, Client, Payload, Router};
use nacre_proto::msg::RemoteError;
use nacre_raft::{GroupId, RaftError, RaftHandle, RestoreError, StateMachine};
use nacre_types::sync::lock;
use nacre_types::{ErrorCode, NodeId, PartitionId};
use tokio::sync::{Notify, watch};

use nacre_api::data::SweepReport;
use nacre_api::master::{
    CreatePartition, FuncHeartbeat, FuncHeartbeatRequest, GetFuncs, GetGc, GetSpace, GetVolume,
    Heartbeat, HeartbeatReply, MapError, MasterError, MasterStatus, PendingReplica, Register,
    RegisterFunc, RegisterFuncRequest, ReportGc, ReportGcRequest, Status,
};

use crate::map::{ClusterMap, Command, Outcome};
use crate::rpc::{Execute, GetMap};

/// The Raft group holding the cluster map.
pub const MASTER_GROUP: GroupId = 1;

/// The cluster map as a replicated state machine. Commands and results are postcard-encoded. Every
/// new epoch is published on a watch channel ([`MasterSm::epochs`]) so that waiters need not poll.
#[derive(Debug)]
pub struct MasterSm {
    pub map: ClusterMap,
    epochs: watch::Sender<u64>,
}

impl Default for MasterSm {
    fn default() -> Self {
        Self {
            map: ClusterMap::default(),
            epochs: watch::channel(0).0,
        }
    }
}

impl MasterSm {
    /// Notified with the map's epoch whenever it changes on this master.
    pub fn epochs(&self) -> watch::Receiver<u64> {
        self.epochs.subscribe()
    }

    fn publish(&self) {
        let epoch = self.map.epoch;
        self.epochs
            .send_if_modified(|e| std::mem::replace(e, epoch) != epoch);
    }
}

impl StateMachine for MasterSm {
    fn apply(&mut self, _index: u64, command: &[u8]) -> Vec<u8> {
        let result: Result<Outcome, MapError> = match postcard::from_bytes::<Command>(command) {
            Ok(cmd) => self.map.apply(&cmd),
            Err(e) => Err(MapError::Invalid(format!("undecodable command: {e}"))),
        };
        self.publish();
        postcard::to_allocvec(&result).expect("command results are postcard-serializable")
    }

    fn snapshot(&self) -> Vec<u8> {
        self.map.snapshot()
    }

    fn restore(&mut self, snapshot: &[u8]) -> Result<(), RestoreError> {
        self.map =
            ClusterMap::restore(snapshot).map_err(|e| RestoreError::Invalid(e.to_string()))?;
        self.publish();
        Ok(())
    }
}

/// A node that `cmd` would place a replica on although it has not heartbeated within `silence`
/// of `now_ms`. Placement is part of the map's pure state machine, which knows no clock: a node
/// is up until `node_timeout` has passed, so one killed a moment ago would still be chosen. The
/// leader applies the command to a copy first and holds it back while the choice names such a
/// node. (A command that fails here fails for real too: it is sent, and its error recorded.)
pub fn silent_choice(
    map: &ClusterMap,
    cmd: &Command,
    now_ms: u64,
    silence: Duration,
) -> Option<NodeId> {
    let mut trial = map.clone();
    let Ok(Outcome::PartitionsCreated(ids)) = trial.apply(cmd) else {
        return None;
    };
    let silence = silence.as_millis() as u64;
    ids.iter()
        .filter_map(|id| trial.data_partitions.get(id))
        .flat_map(|p| p.replicas.iter())
        .find(|n| {
            trial
                .nodes
                .get(n)
                .is_some_and(|n| now_ms.saturating_sub(n.last_heartbeat_ms) > silence)
        })
        .copied()
}

/// Tunables of the master's duties.
#[derive(Clone, Debug)]
pub struct MasterConfig {
    /// How often the leader runs its duties.
    pub duty_interval: Duration,
    /// A node silent for longer is marked down.
    pub node_timeout: Duration,
    /// Keep at least this many writable data partitions per volume…
    pub min_writable_data_partitions: u32,
    /// …placing none on a node silent for longer than this (a node killed a moment ago is not
    /// down until `node_timeout`): the duty waits instead.
    pub placement_silence: Duration,
    /// …adding this many at a time.
    pub data_partitions_step: u32,
    /// Split a volume's last meta partition when it holds this many inodes…
    pub meta_split_inodes: u64,
    /// …or uses this much memory (bytes)…
    pub meta_split_memory: u64,
    /// …closing it at `max_inode + meta_split_step`.
    pub meta_split_step: u64,
    /// Longest wait between two attempts to create a replica on a node.
    pub max_create_backoff: Duration,
    /// Time allowed for one create-partition call to a node.
    pub create_timeout: Duration,
    /// Create a `default` tenant (with fresh keys) when the cluster has none, so that volumes can be
    /// created without a tenant step.
    pub default_tenant: bool,
    /// A data node down this long (silent past `node_timeout`, then this) has its replicas of
    /// erasure-coded partitions moved to other data nodes, which rebuild their shards from the
    /// other replicas ([`ClusterMap::rebuild_plan`]).
    pub rebuild_after: Duration,
}

impl Default for MasterConfig {
    fn default() -> Self {
        Self {
            duty_interval: Duration::from_secs(1),
            node_timeout: Duration::from_secs(10),
            min_writable_data_partitions: 2,
            // One and a half of the nodes' default heartbeat interval (2 s).
            placement_silence: Duration::from_secs(3),
            data_partitions_step: 2,
            meta_split_inodes: 1 << 24,
            meta_split_memory: 4 << 30,
            meta_split_step: 1 << 24,
            max_create_backoff: Duration::from_secs(10),
            create_timeout: Duration::from_secs(5),
            default_tenant: true,
            rebuild_after: Duration::from_secs(120),
        }
    }
}

/// The leader's record of one replica it is creating.
#[derive(Clone, Debug, Default)]
struct Attempt {
    attempts: u32,
    last_error: String,
    /// Milliseconds (master clock) before which no new attempt is made.
    next_ms: u64,
    in_flight: bool,
}

#[derive(Debug, Default)]
struct DutyState {
    attempts: BTreeMap<(PartitionId, NodeId), Attempt>,
    errors: Vec<String>,
}

/// One master: its raft handle, the addresses of all masters (for leader hints), and a client to
/// reach nodes.
#[derive(Clone, Debug)]
pub struct Master {
    raft: RaftHandle<MasterSm>,
    /// Master raft id → messenger address.
    masters: BTreeMap<u64, String>,
    nodes: Client,
    config: MasterConfig,
    duties: Arc<Mutex<DutyState>>,
    /// Wakes the duty loop early (after a change that placed new partitions).
    kick: Arc<Notify>,
    /// The latest garbage-collection figures each data partition's leader reported
    /// (`ReportGc`): in memory, on the leader that received them, not in the map.
    gc: Arc<Mutex<BTreeMap<PartitionId, SweepReport>>>,
}

impl Master {
    pub fn new(
        raft: RaftHandle<MasterSm>,
        masters: BTreeMap<u64, String>,
        nodes: Client,
        config: MasterConfig,
    ) -> Self {
        Self {
            raft,
            masters,
            nodes,
            config,
            duties: Arc::default(),
            kick: Arc::new(Notify::new()),
            gc: Arc::default(),
        }
    }

    /// Keeps the figures of data partitions' garbage-collection sweeps (this master must lead).
    pub async fn report_gc(&self, reports: Vec<SweepReport>) -> Result<(), MasterError> {
        self.read(|_| ()).await?;
        let mut gc = lock(&self.gc);
        for r in reports {
            gc.insert(r.partition, r);
        }
        Ok(())
    }

    /// The latest sweep figures per data partition (this master must lead).
    pub async fn gc_reports(&self) -> Result<Vec<SweepReport>, MasterError> {
        self.read(|_| ()).await?;
        Ok(lock(&self.gc).values().cloned().collect())
    }

    fn not_leader(&self, leader: u64) -> MasterError {
        MasterError::NotLeader {
            leader: self.masters.get(&leader).cloned(),
        }
    }

    /// Applies `cmd` through Raft (this master must lead).
    pub async fn execute(&self, cmd: &Command) -> Result<Outcome, MasterError> {
        let bytes =
            postcard::to_allocvec(cmd).map_err(|e| MasterError::Unavailable(e.to_string()))?;
        let out = match self.raft.propose(MASTER_GROUP, bytes).await {
            Ok(result) => postcard::from_bytes::<Result<Outcome, MapError>>(&result)
                .map_err(|e| MasterError::Unavailable(format!("bad result: {e}")))?
                .map_err(MasterError::from),
            Err(RaftError::NotLeader { leader, .. }) => Err(self.not_leader(leader)),
            Err(e) => Err(MasterError::Unavailable(e.to_string())),
        }?;
        if matches!(
            out,
            Outcome::VolumeCreated(_) | Outcome::PartitionsCreated(_)
        ) {
            self.kick.notify_one();
        }
        Ok(out)
    }

    /// Reads from the map linearizably on the leader.
    pub async fn read<R, F>(&self, f: F) -> Result<R, MasterError>
    where
        R: Send + 'static,
        F: FnOnce(&ClusterMap) -> R + Send + 'static,
    {
        match self
            .raft
            .read(MASTER_GROUP, move |sm: &MasterSm| f(&sm.map))
            .await
        {
            Ok(r) => Ok(r),
            Err(RaftError::NotLeader { leader, .. }) => Err(self.not_leader(leader)),
            Err(e) => Err(MasterError::Unavailable(e.to_string())),
        }
    }

    /// The current map, read linearizably on the leader.
    pub async fn map(&self) -> Result<ClusterMap, MasterError> {
        self.read(|m| m.clone()).await
    }

    /// Milliseconds since the Unix epoch on this master's clock (only the leader stamps commands).
    pub fn now_ms() -> u64 {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64)
    }

    /// The leader's status: who leads, replicas still being created, failed duties.
    pub async fn status(&self) -> Result<MasterStatus, MasterError> {
        let leader = self
            .raft
            .leader(MASTER_GROUP)
            .await
            .map_err(|e| MasterError::Unavailable(e.to_string()))?;
        if leader != self.raft.id() {
            return Err(self.not_leader(leader));
        }
        let pending = self.read(pending_with_addrs).await?;
        let duties = lock(&self.duties);
        Ok(MasterStatus {
            leader,
            masters: self.masters.clone(),
            pending: pending
                .into_iter()
                .map(|(partition, node, addr)| {
                    let a = duties
                        .attempts
                        .get(&(partition, node))
                        .cloned()
                        .unwrap_or_default();
                    PendingReplica {
                        partition,
                        node,
                        addr,
                        attempts: a.attempts,
                        last_error: a.last_error,
                    }
                })
                .collect(),
            duty_errors: duties.errors.clone(),
        })
    }

    /// Runs the leader's periodic duties until `shutdown` resolves. Followers skip them, so a new
    /// leader takes over after a failover.
    pub async fn run_duties(&self, shutdown: impl std::future::Future<Output = ()>) {
        let mut shutdown = std::pin::pin!(shutdown);
        let mut tick = tokio::time::interval(self.config.duty_interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
        loop {
            tokio::select! {
                _ = &mut shutdown => return,
                _ = tick.tick() => {}
                _ = self.kick.notified() => {}
            }
            if self.raft.leader(MASTER_GROUP).await.ok() != Some(self.raft.id()) {
                continue;
            }
            let errors = self.duty_round().await;
            lock(&self.duties).errors = errors;
        }
    }

    /// One round of duties; returns what failed.
    async fn duty_round(&self) -> Vec<String> {
        let mut errors = Vec::new();
        let cmd = Command::CheckLiveness {
            now_ms: Self::now_ms(),
            timeout_ms: self.config.node_timeout.as_millis() as u64,
        };
        if let Err(e) = self.execute(&cmd).await {
            // Not leading any more, most likely; the next leader runs the duties.
            tracing::debug!(error = %e, "liveness check not applied");
            return errors;
        }
        let map = match self.map().await {
            Ok(m) => m,
            Err(e) => {
                tracing::debug!(error = %e, "duties: map not readable");
                return errors;
            }
        };
        for cmd in self.planned_changes(&map) {
            match self.execute(&cmd).await {
                Ok(_) => tracing::info!(?cmd, "duty applied"),
                Err(e) => {
                    tracing::warn!(?cmd, error = %e, "duty failed");
                    errors.push(format!("{}: {e}", describe(&cmd)));
                }
            }
        }
        self.push_creates().await;
        errors
    }

    /// Changes the map needs now: a default tenant, data partitions, meta partition splits.
    fn planned_changes(&self, map: &ClusterMap) -> Vec<Command> {
        let c = &self.config;
        let mut cmds = Vec::new();
        if c.default_tenant && map.tenants.is_empty() {
            match (random_hex(10), random_hex(20)) {
                (Ok(ak), Ok(sk)) => cmds.push(Command::CreateTenant {
                    name: "default".into(),
                    access_key: format!("NACRE{}", ak.to_uppercase()),
                    secret_key: sk,
                }),
                (Err(e), _) | (_, Err(e)) => {
                    tracing::warn!(error = %e, "no randomness for tenant keys");
                }
            }
        }
        cmds.extend(map.rebuild_plan(
            Self::now_ms(),
            self.config.rebuild_after.as_millis() as u64,
            c.placement_silence.as_millis() as u64,
        ));
        for v in map.volumes.values() {
            let writable = map.writable_data_partitions(&v.name);
            if writable < c.min_writable_data_partitions {
                let cmd = Command::AddDataPartitions {
                    volume: v.name.clone(),
                    count: c
                        .data_partitions_step
                        .max(c.min_writable_data_partitions - writable),
                };
                match silent_choice(map, &cmd, Self::now_ms(), c.placement_silence) {
                    Some(node) => tracing::info!(
                        volume = %v.name, %node,
                        "new data partitions would go to a node silent for a while; waiting"
                    ),
                    None => cmds.push(cmd),
                }
            }
            if let Some(last) = v
                .meta_partitions
                .last()
                .and_then(|id| map.meta_partitions.get(id))
                && (last.inode_count >= c.meta_split_inodes || last.memory >= c.meta_split_memory)
            {
                cmds.push(Command::SplitMetaPartition {
                    volume: v.name.clone(),
                    step: c.meta_split_step,
                });
            }
        }
        cmds
    }

    /// Asks nodes to create the replicas placed on them that they have not reported yet, with
    /// exponential backoff per replica. Calls run concurrently and record their outcome.
    async fn push_creates(&self) {
        let Ok(work) = self
            .read(|m| {
                m.pending_replicas()
                    .into_iter()
                    .filter_map(|(p, n)| {
                        let addr = m.nodes.get(&n)?.addr.clone();
                        Some((p, n, addr, m.spec(p)?))
                    })
                    .collect::<Vec<_>>()
            })
            .await
        else {
            return;
        };
        let now = Self::now_ms();
        let mut d = lock(&self.duties);
        let live: std::collections::BTreeSet<(PartitionId, NodeId)> =
            work.iter().map(|(p, n, _, _)| (*p, *n)).collect();
        d.attempts.retain(|k, _| live.contains(k));
        for (p, n, addr, spec) in work {
            let a = d.attempts.entry((p, n)).or_default();
            if a.in_flight || a.next_ms > now {
                continue;
            }
            a.in_flight = true;
            a.attempts += 1;
            let backoff = (100u64 << a.attempts.min(16))
                .min(self.config.max_create_backoff.as_millis() as u64);
            let (client, duties, timeout) = (
                self.nodes.clone(),
                self.duties.clone(),
                self.config.create_timeout,
            );
            tokio::spawn(async move {
                let opts = CallOptions {
                    timeout: Some(timeout),
                    ..Default::default()
                };
                let result = match client
                    .call_with::<CreatePartition>(&addr, &spec, Payload::none(), opts)
                    .await
                {
                    Ok((Ok(()), _)) => Ok(()),
                    Ok((Err(reason), _)) => Err(reason),
                    Err(e) => Err(e.to_string()),
                };
                if let Err(e) = &result {
                    tracing::warn!(partition = %p, node = %n, %addr, error = %e, "partition not created");
                }
                if let Some(a) = lock(&duties).attempts.get_mut(&(p, n)) {
                    a.in_flight = false;
                    // After a success, wait for the node's heartbeat to confirm before asking again.
                    a.next_ms = Self::now_ms() + backoff;
                    a.last_error = result.err().unwrap_or_default();
                }
            });
        }
    }

    /// The master's ops (its raft traffic is served by the raft handle's own router).
    pub fn router(&self) -> Router {
        let (a, b, c, d, e, f, g) = (
            self.clone(),
            self.clone(),
            self.clone(),
            self.clone(),
            self.clone(),
            self.clone(),
            self.clone(),
        );
        Router::new()
            .route::<Execute, _, _>(move |cmd, _inc| {
                let m = a.clone();
                async move { map_result(m.execute(&cmd).await) }
            })
            .route::<GetMap, _, _>(move |_req, _inc| {
                let m = b.clone();
                async move {
                    m.map()
                        .await
                        .map(|map| (map, Payload::none()))
                        .map_err(remote)
                }
            })
            .route::<GetVolume, _, _>(move |req, _inc| {
                let m = c.clone();
                async move {
                    m.read(move |map| map.volume_view(&req.name))
                        .await
                        .map(|v| (v, Payload::none()))
                        .map_err(remote)
                }
            })
            .route::<Register, _, _>(move |req, _inc| {
                let m = d.clone();
                async move {
                    let cmd = Command::RegisterNode {
                        addr: req.addr,
                        role: req.role,
                        zone: req.zone,
                        capacity: req.capacity,
                        now_ms: Self::now_ms(),
                    };
                    map_result(m.execute(&cmd).await.and_then(|o| match o {
                        Outcome::NodeRegistered(id) => Ok(id),
                        other => Err(unexpected(&other)),
                    }))
                }
            })
            .route::<Heartbeat, _, _>(move |req, _inc| {
                let m = e.clone();
                async move {
                    let cmd = Command::Heartbeat {
                        node: req.node,
                        used: req.used,
                        now_ms: Self::now_ms(),
                        partitions: req.partitions,
                    };
                    map_result(m.execute(&cmd).await.and_then(|o| match o {
                        Outcome::Assigned { epoch, partitions } => Ok(HeartbeatReply {
                            epoch,
                            assigned: partitions,
                        }),
                        other => Err(unexpected(&other)),
                    }))
                }
            })
            .route::<Status, _, _>(move |_req, _inc| {
                let m = f.clone();
                async move {
                    m.status()
                        .await
                        .map(|s| (s, Payload::none()))
                        .map_err(remote)
                }
            })
            .route::<GetSpace, _, _>(move |_req, _inc| {
                let m = g.clone();
                async move {
                    m.read(|map| map.data_space())
                        .await
                        .map(|s| (s, Payload::none()))
                        .map_err(remote)
                }
            })
            .route::<ReportGc, _, _>({
                let m = self.clone();
                move |req: ReportGcRequest, _inc| {
                    let m = m.clone();
                    async move {
                        m.report_gc(req.reports)
                            .await
                            .map(|()| ((), Payload::none()))
                            .map_err(remote)
                    }
                }
            })
            .route::<GetGc, _, _>({
                let m = self.clone();
                move |_req, _inc| {
                    let m = m.clone();
                    async move {
                        m.gc_reports()
                            .await
                            .map(|r| (r, Payload::none()))
                            .map_err(remote)
                    }
                }
            })
            .route::<RegisterFunc, _, _>({
                let m = self.clone();
                move |req: RegisterFuncRequest, _inc| {
                    let m = m.clone();
                    async move {
                        let cmd = Command::RegisterFunc {
                            addr: req.addr,
                            zone: req.zone,
                            functions: req.functions,
                            capacity: req.capacity,
                            now_ms: Self::now_ms(),
                        };
                        map_result(m.execute(&cmd).await.and_then(|o| match o {
                            Outcome::NodeRegistered(id) => Ok(id),
                            other => Err(unexpected(&other)),
                        }))
                    }
                }
            })
            .route::<FuncHeartbeat, _, _>({
                let m = self.clone();
                move |req: FuncHeartbeatRequest, _inc| {
                    let m = m.clone();
                    async move {
                        let cmd = Command::FuncHeartbeat {
                            node: req.node,
                            load: req.load,
                            now_ms: Self::now_ms(),
                        };
                        map_result(m.execute(&cmd).await.map(|_| ()))
                    }
                }
            })
            .route::<GetFuncs, _, _>({
                let m = self.clone();
                move |_req, _inc| {
                    let m = m.clone();
                    async move {
                        m.read(|map| map.func_view())
                            .await
                            .map(|v| (v, Payload::none()))
                            .map_err(remote)
                    }
                }
            })
    }
}

fn unexpected(o: &Outcome) -> MasterError {
    MasterError::Unavailable(format!("unexpected outcome {o:?}"))
}

fn pending_with_addrs(m: &ClusterMap) -> Vec<(PartitionId, NodeId, String)> {
    m.pending_replicas()
        .into_iter()
        .map(|(p, n)| {
            let addr = m.nodes.get(&n).map(|n| n.addr.clone()).unwrap_or_default();
            (p, n, addr)
        })
        .collect()
}

fn describe(cmd: &Command) -> String {
    match cmd {
        Command::AddDataPartitions { volume, count } => {
            format!("adding {count} data partitions to volume {volume}")
        }
        Command::SplitMetaPartition { volume, .. } => {
            format!("splitting the last meta partition of volume {volume}")
        }
        Command::CreateTenant { name, .. } => format!("creating tenant {name}"),
        Command::ReplaceReplica {
            partition,
            old,
            new,
        } => format!("moving the shards of {partition} from {old} to {new}"),
        other => format!("{other:?}"),
    }
}

/// `n` random bytes from the kernel, as lowercase hex.
pub(crate) fn random_hex(n: usize) -> std::io::Result<String> {
    use std::io::Read as _;
    let mut buf = vec![0u8; n];
    std::fs::File::open("/dev/urandom")?.read_exact(&mut buf)?;
    Ok(buf.iter().map(|b| format!("{b:02x}")).collect())
}

/// Map errors travel in the response body (they are answers); the rest become error frames.
fn map_result<T>(r: Result<T, MasterError>) -> Result<(Result<T, MapError>, Payload), RemoteError> {
    match r {
        Ok(v) => Ok((Ok(v), Payload::none())),
        Err(MasterError::Map(e)) => Ok((Err(e), Payload::none())),
        Err(e) => Err(remote(e)),
    }
}

pub(crate) fn remote(e: MasterError) -> RemoteError {
    match e {
        MasterError::NotLeader { leader } => RemoteError {
            leader_hint: leader,
            ..RemoteError::new(ErrorCode::NotLeader, "not the master leader")
        },
        MasterError::Unavailable(m) => RemoteError::new(ErrorCode::Unavailable, m),
        MasterError::Map(e) => RemoteError::new(ErrorCode::InvalidArgument, e.to_string()),
    }
}
