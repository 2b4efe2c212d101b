//! The data node service: hosts the data partitions the master places here, each an extent store in
//! its own directory plus one Raft group (all groups share the node's raft store and log).
//!
//! Scenario-aware replication (CFS §2.3): appends and tiny writes go primary-backup — the Raft leader
//! of the partition writes locally, forwards the packet to every follower in parallel and
//! acknowledges once all of them (and its own disk) have it; the reply carries the extent's committed
//! length. Overwrites, extent creation and releases go through Raft.
//!
//! Committed lengths live in the leader's memory. A replica that becomes leader (a new Raft term)
//! first *aligns*: it asks every follower for its extents and takes, per extent, the largest
//! committed length any replica knew, or else the shortest copy among the replicas that answered —
//! an acknowledged byte is on every replica, so neither is ever below what was acknowledged.
//! Nothing past the committed length is served.
//!
//! A replica that fails a packet makes the partition read-only (reported to the master as `full`, so
//! clients write elsewhere) until every follower answers again; an extent some follower's copy is
//! too short for takes no appends until the follower holds it, while the partition takes new
//! extents: followers repair themselves in the background by pulling missing blocks from the
//! leader, throttled. Every packet names the leader's term, and a follower that knows a newer one
//! refuses it (a deposed leader acknowledges nothing).
//!
//! A store that failed an IO refuses work until reopened: the duty round reopens it, a leader first
//! handing leadership over, and the replica then compares every extent with the leader's copy
//! (`DataNode::revive_store`, docs/data-store.md "Reopening a failed store").
//!
//! The replication decisions (alignment, degrade, re-check, hand-offs, the per-packet rules) are a
//! pure state machine, [`crate::repl`]; this service is the IO shell around it: it feeds it events
//! (answers of followers, failures, duty rounds) and performs the actions it decides.
//!
//! Where each concern lives:
//! - this file: the node ([`DataNode`]), its hosted partitions (`Part`) and leadership checks;
//! - `config`, `metrics`: [`DataNodeConfig`] (and [`WrapDisk`]), [`DataMetrics`];
//! - `append`: the leader's side of primary-backup appends (per-extent tracks, the inbox that
//!   batches pipelined packets, ordered acknowledgement) and tiny writes;
//! - `forward`: the leader forwarding a batch to every follower, and a follower taking it;
//! - `align`: a new leader's alignment of committed offsets, and the re-check of a read-only
//!   partition;
//! - `repair`: followers pulling what they lack, block repair at read time, reopening a failed store;
//! - `ops`: what goes through Raft (overwrites, Raft appends) and reads;
//! - `router`: one named handler per messenger op;
//! - `scrub`: the background scrub; `gc`: the garbage collection of leaked extents;
//! - `agent`: the duty round and the master agent's [`NodeDuties`](nacre_cluster::NodeDuties)
//!   and [`PartitionHost`](nacre_cluster::PartitionHost).

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use nacre_api::master::{PartitionReport, PartitionSpec, Replica, Role};
use nacre_cluster::{NodeRaft, SpecRegistry, run_node};
use nacre_msgr::Client;
use nacre_proto::msg::RemoteError;
use nacre_raft::{RaftError, RaftHandle};
use nacre_types::sync::lock;
use nacre_types::{ErrorCode, ExtentId, NodeId, PartitionId};
use tokio::sync::watch;

use crate::io::{Disk, FileDisk};
use crate::sm::{DataSm, SmShared, store_error};
use crate::store::{ExtentStore, SparePool, TINY_EXTENTS};
use nacre_api::data::*;

mod agent;
mod align;
mod append;
mod config;
mod forward;
mod gc;
mod metrics;
mod ops;
mod rebuild;
mod repair;
mod room;
mod router;
mod scrub;
#[cfg(test)]
mod tests;

pub use append::MAX_BATCH;
pub use config::{DataNodeConfig, WrapDisk, WrapDiskFn};
pub use metrics::DataMetrics;

use crate::repl::extent::track_from_disk;
use crate::repl::{Action, Event, Replication};
use append::{Streams, Track};
pub use scrub::ScrubReport;

/// Why a replica rebuilding its shards refuses reads and writes.
const REBUILDING: &str = "this replica is rebuilding its shards from the others";

/// Tiny writes start on this boundary so a release can punch whole pages.
const TINY_ALIGN: u64 = 4096;

/// How long a partition's measured disk use is reused before its directory is walked again. The
/// walk `stat`s every file of the store; every report (twice a second) and every heartbeat asked for
/// it, which on a node with a few hundred extents per partition was thousands of `statx` a second on
/// the control runtime. Placement does not need it fresher.
const USED_EVERY: Duration = Duration::from_secs(5);

/// One hosted data partition.
#[derive(Debug)]
struct Part {
    id: PartitionId,
    /// This node alone for a partition of an erasure-coded volume ([`Part::ec`]).
    replicas: Mutex<Vec<Replica>>,
    /// The code of an erasure-coded partition: this node holds one shard of each stripe, in a
    /// group of its own (docs/ARCHITECTURE.md, "Erasure-coded volumes").
    ec: Option<nacre_func::EcSpec>,
    /// Which shard of each stripe this replica holds (its place in the partition's replicas);
    /// only shard 0's replica places stripes (`WriteTiny`).
    shard: usize,
    /// Every replica of the partition, in the map's order (for an erasure-coded one, where
    /// `replicas` is this node alone).
    members: Mutex<Vec<Replica>>,
    /// An erasure-coded replica rebuilding its shards from the others (`rebuild`): it serves
    /// nothing and is not reported.
    rebuilding: std::sync::atomic::AtomicBool,
    store: Arc<ExtentStore>,
    shared: Arc<SmShared>,
    tracks: Mutex<HashMap<ExtentId, Arc<Track>>>,
    /// The partition's replication decisions: alignment, degrade, re-check, hand-offs
    /// ([`crate::repl`]). Locked only to step it, never across an `.await`.
    repl: Mutex<Replication>,
    align: tokio::sync::Mutex<()>,
    tiny_pool: Mutex<Vec<ExtentId>>,
    tiny_free: tokio::sync::Semaphore,
    ops: AtomicU64,
    bytes: AtomicU64,
    repairing: tokio::sync::Mutex<()>,
    /// The group's published leader and term (read by `lead`).
    gate: Option<Arc<nacre_raft::ReadGate>>,
    /// One re-check at a time ([`DataNode::recheck`]).
    rechecking: tokio::sync::Mutex<()>,
    /// Woken when the partition turns read-only or writable: the node reports it to the master
    /// at once instead of at the next heartbeat (the node's `Inner::writability`).
    writability: Arc<tokio::sync::Notify>,
    /// The store's disk use and when it was measured ([`Part::used`]).
    used: Mutex<Option<(Instant, u64)>>,
    /// When each normal extent was last active here (`gc`).
    gc: Mutex<gc::Activity>,
    /// The figures of the last garbage-collection sweep this replica ran as leader.
    last_sweep: Mutex<Option<SweepReport>>,
}

impl Part {
    /// Bytes the partition's store takes on disk, measured at most once per [`USED_EVERY`].
    fn used(&self) -> u64 {
        let mut used = lock(&self.used);
        match *used {
            Some((at, bytes)) if at.elapsed() < USED_EVERY => bytes,
            _ => {
                let bytes = self.store.used();
                *used = Some((Instant::now(), bytes));
                bytes
            }
        }
    }

    fn track(&self, extent: ExtentId) -> Result<Arc<Track>, DataError> {
        self.track_with(extent, true)
    }

    /// The extent's track, made from the local length if there is none: `len_committed` says
    /// whether that length counts as committed. A follower's does not: it may end in an
    /// unacknowledged tail of an earlier leader, which the next packet at the committed offset must
    /// be able to drop; the leader's packets tell it what is committed.
    fn track_with(&self, extent: ExtentId, len_committed: bool) -> Result<Arc<Track>, DataError> {
        let mut tracks = lock(&self.tracks);
        if let Some(t) = tracks.get(&extent) {
            return Ok(t.clone());
        }
        let len = self.store.len(extent).map_err(store_error)?;
        let (next, committed) = track_from_disk(len, len_committed);
        let t = Track::new(next, committed);
        tracks.insert(extent, t.clone());
        Ok(t)
    }

    /// Steps the partition's replication core with `event` and drains what it decided.
    fn step(&self, event: Event) -> Vec<Action> {
        let mut r = lock(&self.repl);
        r.step(event);
        r.ready()
    }

    /// Tells the core that a write failed on some replica (`event` is
    /// [`Event::ReplicationFailed`] or [`Event::LocalWriteRefused`]): the partition degrades.
    fn fail(&self, event: Event) {
        for action in self.step(event) {
            self.note(&action);
        }
    }

    /// Performs an action of the core that takes no IO: they are logs of a state change, and a
    /// change of the partition's writability is reported to the master at once
    /// ([`Part::writability`]).
    fn note(&self, action: &Action) {
        match action {
            Action::Degrade { reason } => {
                self.writability.notify_one();
                tracing::warn!(partition = %self.id, reason = %reason, "data partition is read-only")
            }
            Action::Writable { was } => {
                self.writability.notify_one();
                tracing::info!(partition = %self.id, was = %was, "data partition is read-write again")
            }
            Action::Lags { extent, why } => {
                tracing::info!(partition = %self.id, %extent, why = %why, "extent takes no appends until a follower repairs it")
            }
            Action::CaughtUp { extents } => {
                tracing::info!(partition = %self.id, extents = ?extents, "extents take appends again")
            }
            Action::Superseded { term, newer } => {
                tracing::warn!(partition = %self.id, term, newer, "a replica knows a newer term: this leader was deposed")
            }
            Action::StillReadOnly { why } => {
                tracing::debug!(partition = %self.id, why = %why, "re-check: the partition stays read-only")
            }
            Action::Aligned { term } => {
                tracing::info!(partition = %self.id, term, "data partition aligned")
            }
            other => {
                tracing::debug!(partition = %self.id, action = ?other, "replication action not taken here")
            }
        }
    }

    /// Whether this replica, as leader, aligned the committed lengths under `term`.
    fn aligned(&self, term: u64) -> bool {
        lock(&self.repl).aligned(term)
    }

    /// Why the partition takes no appends, if it does not.
    fn degraded(&self) -> Option<String> {
        if self.is_rebuilding() {
            return Some(REBUILDING.into());
        }
        lock(&self.repl).degraded().map(str::to_owned)
    }

    fn is_rebuilding(&self) -> bool {
        self.rebuilding.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Why an append to `extent` is refused, if it is: the partition is read-only, or the extent
    /// lags on a follower (the client then moves to a new extent).
    fn refuses_appends(&self, extent: ExtentId) -> Option<String> {
        let r = lock(&self.repl);
        if let Some(why) = r.degraded() {
            return Some(why.to_owned());
        }
        r.lagging(extent).then(|| {
            format!("extent {extent} lags on a follower and takes no appends until it is repaired")
        })
    }

    /// Whether the partition needs a re-check: it is read-only, or extents lag.
    fn needs_recheck(&self) -> bool {
        let r = lock(&self.repl);
        r.degraded().is_some() || !r.lagging_extents().is_empty()
    }

    fn followers(&self, me: u64) -> Vec<Replica> {
        lock(&self.replicas)
            .iter()
            .filter(|r| r.node.0 != me)
            .cloned()
            .collect()
    }

    fn addr_of(&self, node: u64) -> Option<String> {
        lock(&self.replicas)
            .iter()
            .find(|r| r.node.0 == node)
            .map(|r| r.addr.clone())
    }
}

/// Per partition: operations and bytes served as leader (monotonic counters).
type Counters = BTreeMap<PartitionId, (u64, u64)>;

struct Inner {
    dir: PathBuf,
    config: DataNodeConfig,
    registry: SpecRegistry,
    client: Client,
    raft: NodeRaft<DataSm>,
    parts: Mutex<BTreeMap<PartitionId, Arc<Part>>>,
    reports: Mutex<Vec<PartitionReport>>,
    /// When reports were last refreshed, with each partition's (ops, bytes) counters then.
    last_report: Mutex<Option<(Instant, Counters)>>,
    /// One opening of a partition at a time, per partition.
    opening: Mutex<HashMap<PartitionId, Arc<tokio::sync::Mutex<()>>>>,
    /// Repair budget: bytes that may still be copied before the next refill.
    repair_tokens: tokio::sync::Mutex<(f64, Instant)>,
    /// Deleted extents' data files every partition's new extents may take (`retire_spares`).
    spares: Arc<SparePool>,
    streams: Streams,
    /// Held by the running garbage-collection sweep (one at a time).
    gc_running: tokio::sync::Mutex<()>,
    /// Woken by a partition whose writability changed (`Part::writability`).
    writability: Arc<tokio::sync::Notify>,
    /// Woken once the reports show such a change: the agent heartbeats at once
    /// ([`nacre_cluster::PartitionHost::report_now`]).
    report_now: Arc<tokio::sync::Notify>,
    /// Whether the data disk is full (`room`).
    room: room::Room,
}

/// A running data node. Cheap to clone.
#[derive(Clone)]
pub struct DataNode {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for DataNode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DataNode")
            .field("dir", &self.inner.dir)
            .finish()
    }
}

fn unavailable(m: impl Into<String>) -> RemoteError {
    RemoteError::new(ErrorCode::Unavailable, m)
}

fn err_str(e: impl std::fmt::Display) -> String {
    e.to_string()
}

impl DataNode {
    /// Opens the node's state in `config.dir`. If the node has an id from an earlier run, its raft
    /// store and partitions start now; otherwise once [`DataNode::run`] learns the id.
    pub fn open(config: &DataNodeConfig, client: Client) -> std::io::Result<Self> {
        let registry = SpecRegistry::open(&config.dir.join("partitions"), Role::Data)?;
        let raft = NodeRaft::open(&config.dir, "data", config.raft.clone(), client.clone())?;
        let node = Self {
            inner: Arc::new(Inner {
                dir: config.dir.clone(),
                config: config.clone(),
                registry,
                client,
                raft,
                parts: Mutex::default(),
                reports: Mutex::default(),
                last_report: Mutex::default(),
                opening: Mutex::default(),
                repair_tokens: tokio::sync::Mutex::new((0.0, Instant::now())),
                spares: SparePool::new(),
                streams: Streams::default(),
                gc_running: tokio::sync::Mutex::new(()),
                writability: Arc::default(),
                report_now: Arc::default(),
                room: room::Room::default(),
            }),
        };
        Ok(node)
    }

    /// The id this node runs under, once known.
    pub fn id(&self) -> Option<NodeId> {
        self.inner.raft.id()
    }

    /// Log entries applied by this node's partitions, once its raft store runs (see
    /// `RaftHandle::applied`): tests wait on it instead of polling.
    pub fn applied(&self) -> Option<watch::Receiver<u64>> {
        self.inner.raft.get().map(RaftHandle::applied)
    }

    fn raft(&self) -> Result<&RaftHandle<DataSm>, String> {
        self.inner.raft.handle().map_err(|e| e.to_string())
    }

    fn part_dir(&self, id: PartitionId) -> PathBuf {
        self.inner.dir.join("extents").join(id.0.to_string())
    }

    /// Hosts `spec`'s store and group (idempotent), or updates its replica list.
    async fn open_partition(&self, spec: &PartitionSpec) -> Result<(), String> {
        if !spec.kind.is_data() {
            return Err(format!("partition {} is not a data partition", spec.id));
        }
        let raft = self.raft()?;
        // A replica of an erasure-coded partition holds its own shards: its group is itself.
        let ec = spec.kind.ec();
        let me = raft.id();
        let shard = spec
            .replicas
            .iter()
            .position(|r| r.node.0 == me)
            .unwrap_or(0);
        let replicas: Vec<Replica> = spec
            .replicas
            .iter()
            .filter(|r| ec.is_none() || r.node.0 == me)
            .cloned()
            .collect();
        if replicas.is_empty() {
            return Err(format!(
                "erasure-coded partition {} has no replica on this node",
                spec.id
            ));
        }
        let peers: BTreeMap<u64, String> = replicas
            .iter()
            .map(|r| (r.node.0, r.addr.clone()))
            .collect();
        raft.add_peers(peers.clone()).map_err(err_str)?;
        // The master's create request and a heartbeat may both ask for a new partition: one store
        // per directory, so a partition is opened by one caller at a time (different partitions
        // open concurrently).
        let one = lock(&self.inner.opening)
            .entry(spec.id)
            .or_default()
            .clone();
        let _one = one.lock().await;
        if let Some(p) = self.part(spec.id) {
            *lock(&p.replicas) = replicas;
            *lock(&p.members) = spec.replicas.clone();
            return Ok(());
        }
        let dir = self.part_dir(spec.id);
        // A replica of an erasure-coded partition in a new directory rebuilds its shards first
        // (`rebuild`), and so does one whose rebuild a restart cut short.
        let marker = dir.join(rebuild::MARKER);
        let rebuilding = ec.is_some() && (!dir.exists() || marker.exists());
        let cfg = self.inner.config.store.clone();
        let wrap = self.inner.config.wrap_disk.clone();
        let spares = self.inner.spares.clone();
        let started = Instant::now();
        let store = tokio::task::spawn_blocking(move || {
            std::fs::create_dir_all(&dir).map_err(err_str)?;
            if rebuilding {
                std::fs::write(&marker, b"").map_err(err_str)?;
            }
            let disk: Arc<dyn Disk> = Arc::new(FileDisk::new(&dir).map_err(err_str)?);
            let disk = wrap.map_or(disk.clone(), |w| (w.0)(&dir, disk));
            // One pool for the node: a new extent takes a spare of any partition.
            ExtentStore::open_with_spares(disk, cfg, spares).map_err(err_str)
        })
        .await
        .map_err(err_str)??;
        let store_opened = started.elapsed();
        for t in store.recovery_report() {
            // A torn or unsynced tail, or the old bytes of a recycled file past its extent.
            tracing::info!(partition = %spec.id, trimmed = ?t, "extent file cut to its last verified block");
        }
        let store = Arc::new(store);
        let shared = Arc::new(SmShared::default());
        // Blocks recovery kept although they fail their CRC: compared with the leader's copy at the
        // next repair (a leader repairs them when a read finds them).
        lock(&shared.suspect).extend(store.recovery_bad_blocks().iter().map(|(e, _)| *e));
        let voters: Vec<u64> = peers.keys().copied().collect();
        let sm = DataSm::new(store.clone(), shared.clone());
        let gate = match raft.add_group_gated(spec.id.0, &voters, sm).await {
            Ok(gate) => gate,
            Err(RaftError::GroupExists(_)) => {
                raft.read_gate(spec.id.0).await.map_err(|e| e.to_string())?
            }
            Err(e) => return Err(e.to_string()),
        };
        let part = Arc::new(Part {
            id: spec.id,
            replicas: Mutex::new(replicas),
            ec,
            shard,
            members: Mutex::new(spec.replicas.clone()),
            rebuilding: std::sync::atomic::AtomicBool::new(rebuilding),
            store,
            shared,
            tracks: Mutex::default(),
            repl: Mutex::new(Replication::new()),
            align: tokio::sync::Mutex::new(()),
            tiny_pool: Mutex::new((1..=TINY_EXTENTS).rev().map(ExtentId).collect()),
            tiny_free: tokio::sync::Semaphore::new(TINY_EXTENTS as usize),
            ops: AtomicU64::new(0),
            bytes: AtomicU64::new(0),
            repairing: tokio::sync::Mutex::new(()),
            gate,
            rechecking: tokio::sync::Mutex::new(()),
            writability: self.inner.writability.clone(),
            used: Mutex::new(None),
            gc: Mutex::default(),
            last_sweep: Mutex::new(None),
        });
        lock(&self.inner.parts).insert(spec.id, part.clone());
        if let Some(ec) = ec.filter(|_| rebuilding) {
            let node = self.clone();
            tokio::spawn(async move { node.rebuild(part, ec).await });
        }
        // Until now the partition answered its leader `UnknownGroup`: on a restart this is what
        // keeps it from taking appends (docs/ARCHITECTURE.md, "Writable again after a restart").
        tracing::info!(
            partition = %spec.id,
            store_ms = store_opened.as_millis() as u64,
            total_ms = started.elapsed().as_millis() as u64,
            "data partition opened"
        );
        Ok(())
    }

    fn part(&self, id: PartitionId) -> Option<Arc<Part>> {
        lock(&self.inner.parts).get(&id).cloned()
    }

    fn hosted_part(&self, id: PartitionId) -> Result<Arc<Part>, RemoteError> {
        self.part(id).ok_or_else(|| {
            RemoteError::new(
                ErrorCode::UnknownGroup,
                format!("data partition {id} is not hosted here"),
            )
        })
    }

    /// Runs until `shutdown`: adopts the id the agent publishes on `id`; every `report_interval`
    /// refreshes reports and repairs what this node lacks; every `recheck_interval` re-checks the
    /// partitions it leads that are read-only or have extents that lag (`align`); reports a
    /// partition's change of writability at once; every `scrub_period` scrubs its replicas
    /// (`scrub`); every `gc_period` sweeps the partitions it leads for leaked extents (`gc`).
    pub async fn run(
        &self,
        id: watch::Receiver<Option<NodeId>>,
        shutdown: impl std::future::Future<Output = ()>,
    ) {
        tokio::select! {
            () = run_node(self, id, self.inner.config.report_interval, shutdown) => {}
            () = self.scrub_forever() => {}
            () = self.gc_forever() => {}
            () = self.recheck_forever() => {}
            () = self.report_changes() => {}
        }
    }

    /// `Some(term)` if this node leads the partition's group.
    async fn leader_term(&self, part: &Part) -> Result<Option<u64>, RaftError> {
        let raft = self.raft().map_err(RaftError::Raft)?;
        let (leader, term) = raft.leader_term(part.id.0).await?;
        Ok((leader == raft.id()).then_some(term))
    }

    fn not_leader(&self, part: &Part, leader: u64) -> RemoteError {
        RemoteError {
            leader_hint: part.addr_of(leader),
            ..RemoteError::new(ErrorCode::NotLeader, "not the data partition leader")
        }
    }

    fn remote(&self, part: &Part, e: RaftError) -> RemoteError {
        match e {
            RaftError::NotLeader { leader, .. } => self.not_leader(part, leader),
            RaftError::UnknownGroup(g) => RemoteError::new(
                ErrorCode::UnknownGroup,
                format!("data partition {g} is not hosted here"),
            ),
            e @ RaftError::Timeout => RemoteError::new(ErrorCode::DeadlineExceeded, e.to_string()),
            other => unavailable(other.to_string()),
        }
    }
}

/// Runs store work on tokio's blocking pool. A buffered `pwrite` can stall for seconds in the
/// kernel's dirty-page throttling while the disk catches up; on a messenger worker that stall holds
/// up every call the node serves (replication, Raft heartbeats), and with many writers those calls
/// time out and turn partitions read-only.
async fn off_worker<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, DataError> + Send + 'static,
) -> Result<T, DataError> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| DataError::Io(format!("store task failed: {e}")))?
}
