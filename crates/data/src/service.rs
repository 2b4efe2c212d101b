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
//! clients write elsewhere) until every follower again holds every committed byte: followers repair
//! themselves by pulling missing blocks from the leader, throttled.
//!
//! A store that failed an IO refuses work until reopened: the duty round reopens it, a leader first
//! handing leadership over, and the replica then compares every extent with the leader's copy
//! (`DataNode::revive_store`, docs/data-store.md "Reopening a failed store").

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use nacre_api::master::{PartitionKind, PartitionReport, PartitionSpec, Replica, Role};
use nacre_cluster::{BoxFuture, NodeDuties, NodeRaft, PartitionHost, SpecRegistry, run_node};
use nacre_msgr::{CallOptions, Client, MsgrError, Payload, Router};
use nacre_proto::msg::RemoteError;
use nacre_proto::msg::raft::RaftBatchRpc;
use nacre_proto::msg::sys::{Ping, PingRequest};
use nacre_raft::{RaftError, RaftHandle, StoreConfig};
use nacre_types::{ErrorCode, ExtentId, NodeId, PartitionId};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use tokio::sync::watch;

use crate::io::{Disk, FileDisk};
use crate::rpc::*;
use crate::sm::{DataCommand, DataSm, SmShared, store_error};
use crate::store::{ExtentStore, SparePool, StoreError, StoreOptions, TINY_EXTENTS};

/// Tiny writes start on this boundary so a release can punch whole pages.
const TINY_ALIGN: u64 = 4096;

/// How long a partition's measured disk use is reused before its directory is walked again. The
/// walk `stat`s every file of the store; every report (twice a second) and every heartbeat asked for
/// it, which on a node with a few hundred extents per partition was thousands of `statx` a second on
/// the control runtime. Placement does not need it fresher.
const USED_EVERY: Duration = Duration::from_secs(5);

/// Settings of a data node.
#[derive(Clone, Debug)]
pub struct DataNodeConfig {
    pub dir: PathBuf,
    pub raft: StoreConfig,
    pub store: StoreOptions,
    /// How often reports are refreshed, read-only partitions re-checked and repairs run.
    pub report_interval: Duration,
    /// How long the leader waits for a follower's answer to a packet before it checks that the
    /// follower is alive at all (a ping). One that answers the ping is slow, not gone (a saturated
    /// disk), and is waited for up to `replicate_stall_limit`; one that does not fails the packet
    /// and turns the partition read-only.
    pub replicate_timeout: Duration,
    /// Longest wait for a live but slow follower, or for an earlier packet of the same extent.
    pub replicate_stall_limit: Duration,
    /// Bytes per second a repair may copy (per node), so foreground IO keeps the bandwidth.
    pub repair_rate: u64,
    /// Most bytes of deleted extents' data files a node keeps for new extents to take
    /// (`StoreOptions::recycle`: their appends then reuse allocated blocks, and no blocks are
    /// freed while writes run), over all its partitions; never more than a quarter of the file
    /// system's free space. The oldest go first.
    pub spare_bytes: u64,
    /// How long a spare is kept at most; also how long an extent living in a longer recycled file
    /// may go without growing before the rest of the file is cut (`ExtentStore::cut_tails`).
    pub spare_keep: Duration,
    /// While at least this many extents have appends in flight on the node, appends bypass the
    /// page cache (`ExtentStore::write_uncached`): with many streams the node runs out of CPU
    /// before disk, and a direct write costs less of it; with few, each stream waits on its own
    /// writes and the cache's quicker ones serve it better. 0: never.
    pub direct_streams: u32,
    /// Gauges the node keeps up to date (registered by the caller); `None`: none.
    pub metrics: Option<DataMetrics>,
    /// Wraps each partition's disk (its directory, the `FileDisk`) before its store opens it:
    /// tests inject faults with it. `None`: the `FileDisk` itself.
    pub wrap_disk: Option<WrapDisk>,
}

/// A data node's own gauges, refreshed every duty round (`DataNodeConfig::metrics`).
#[derive(Clone, Debug, Default)]
pub struct DataMetrics {
    spare_bytes: Gauge,
    spare_files: Gauge,
    recycled: Gauge,
    append_batches: Counter,
    append_batched: Counter,
}

impl DataMetrics {
    /// Registers the gauges (`nacre_data_*`).
    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            "nacre_data_spare_bytes",
            "Bytes of deleted extents' data files kept for new extents to take (at most \
             spare_bytes per node, a quarter of the free space, each for spare_keep)",
            self.spare_bytes.clone(),
        );
        registry.register(
            "nacre_data_spare_files",
            "Deleted extents' data files kept for new extents to take",
            self.spare_files.clone(),
        );
        registry.register(
            "nacre_data_recycled_extents",
            "New extents that took a deleted extent's data file, since the hosted partitions' \
             stores opened",
            self.recycled.clone(),
        );
        registry.register(
            "nacre_data_append_batches",
            "Batches of append packets this node wrote and forwarded as leader (consecutive \
             packets of an extent that waited while the batch before them was written)",
            self.append_batches.clone(),
        );
        registry.register(
            "nacre_data_append_batched_packets",
            "Append packets in those batches",
            self.append_batched.clone(),
        );
    }

    /// `nacre_data_spare_bytes` as of the last duty round.
    pub fn spare_bytes(&self) -> i64 {
        self.spare_bytes.get()
    }

    /// `nacre_data_spare_files` as of the last duty round.
    pub fn spare_files(&self) -> i64 {
        self.spare_files.get()
    }

    /// `nacre_data_recycled_extents` as of the last duty round.
    pub fn recycled(&self) -> i64 {
        self.recycled.get()
    }
}

/// Given a partition's directory and disk, the disk its store uses.
pub type WrapDiskFn = dyn Fn(&Path, Arc<dyn Disk>) -> Arc<dyn Disk> + Send + Sync;

/// A function wrapping a partition's disk ([`DataNodeConfig::wrap_disk`]).
#[derive(Clone)]
pub struct WrapDisk(pub Arc<WrapDiskFn>);

impl std::fmt::Debug for WrapDisk {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("WrapDisk")
    }
}

impl DataNodeConfig {
    pub fn new(dir: PathBuf) -> Self {
        let mut raft = StoreConfig::default().with_read_lease();
        // Overwrites carry data: keep the log short behind the snapshots.
        raft.node.compact_after = 2_000;
        // A leader's appends leave before its own log write, so a lone overwrite waits for one
        // sync instead of the leader's then a follower's (docs/benchmarks.md, "Data partitions
        // send their appends early").
        raft.early_appends = true;
        // Log writes on a thread of their own: acknowledgements, commits and replies do not
        // wait behind another round's sync (docs/benchmarks.md, "Log writes off the Raft
        // thread"). Meta nodes keep writing on their Raft thread: the metadata phases measured
        // lower with it.
        raft.async_log = true;
        // The Raft loop shares the messenger's worker with the request handlers that propose and
        // the connections that carry its messages: fewer thread wake-ups per overwrite
        // (docs/benchmarks.md, "Overwrites patch the block CRC; the Raft loop on the messenger's worker"). Its applies are short
        // (one `pwrite` and a CRC patch) and their reads are prefetched.
        raft.on_msgr_worker = true;
        Self {
            dir,
            raft,
            // A CRC per 32 KiB: a 4 KiB overwrite or read touches 32 KiB, not 128 KiB (1.5x the 4 KiB
            // overwrites/s measured), for 8 bytes of memory per block (256 MiB per TiB of data).
            store: StoreOptions {
                block_size: 32 << 10,
                ..StoreOptions::default()
            },
            report_interval: Duration::from_millis(500),
            replicate_timeout: Duration::from_secs(5),
            replicate_stall_limit: Duration::from_secs(60),
            repair_rate: 64 << 20,
            // docs/benchmarks.md, "Recycling deleted extents' files".
            spare_bytes: 1 << 30,
            spare_keep: Duration::from_secs(60),
            // docs/benchmarks.md, "Appends past the page cache".
            direct_streams: 8,
            metrics: None,
            wrap_disk: None,
        }
    }
}

/// Per-extent append state.
#[derive(Debug)]
struct Track {
    /// Serializes the check-write-advance step of appends to this extent.
    write: Mutex<()>,
    /// Leader: append packets waiting for their local write ([`DataNode::write_batches`]).
    inbox: Mutex<Inbox>,
    /// Where the next packet must start (the end of the last one written locally).
    next: watch::Sender<u64>,
    /// Every byte below is written on every replica (maybe not durable yet): packets of the
    /// extent are acknowledged in offset order through it.
    replicated: watch::Sender<u64>,
    /// Every byte below is durable on every replica.
    committed: watch::Sender<u64>,
    /// Appends to this extent under way here ([`Streams`]).
    appending: AtomicUsize,
}

impl Track {
    fn new(next: u64, committed: u64) -> Arc<Self> {
        Arc::new(Self {
            write: Mutex::new(()),
            inbox: Mutex::new(Inbox::default()),
            next: watch::Sender::new(next),
            replicated: watch::Sender::new(committed),
            committed: watch::Sender::new(committed),
            appending: AtomicUsize::new(0),
        })
    }

    fn committed(&self) -> u64 {
        *self.committed.borrow()
    }

    /// Holds the extent's write lock ([`Track::write`]).
    fn lock_write(&self) -> Result<std::sync::MutexGuard<'_, ()>, DataError> {
        self.write
            .lock()
            .map_err(|_| DataError::Io("poisoned".into()))
    }

    /// Raises the committed length (and so the replicated one) to `upto`.
    fn commit(&self, upto: u64) {
        grow(&self.replicated, upto);
        grow(&self.committed, upto);
    }
}

/// A leader's append packets of one extent that wait to be written, by offset, and whether a task
/// writes them ([`DataNode::write_batches`]).
#[derive(Debug, Default)]
struct Inbox {
    waiting: BTreeMap<u64, Arrived>,
    writing: bool,
}

/// An append packet that reached the leader.
#[derive(Debug)]
struct Arrived {
    data: Payload,
    sync: bool,
    /// The packet's result once written here and sent to every follower.
    done: tokio::sync::oneshot::Sender<Result<(), DataError>>,
}

/// Most bytes a leader writes and forwards as one batch: consecutive packets of an extent that
/// arrived while the previous batch was being written. Four packets: larger batches write and send
/// fewer, bigger pieces, but a follower starts writing a batch only once all of it has arrived
/// (1 MiB and 256 KiB both measured slower; docs/benchmarks.md, "Appends batched on the leader").
pub const MAX_BATCH: usize = 512 << 10;

/// The extents of a node with appends under way (as leader or follower): how many streams the
/// node is writing at once (`DataNodeConfig::direct_streams`).
#[derive(Debug, Default)]
struct Streams(AtomicUsize);

impl Streams {
    /// Counts an append to `track` until the guard drops.
    fn enter(&self, track: Arc<Track>) -> Appending<'_> {
        if track.appending.fetch_add(1, Ordering::Relaxed) == 0 {
            self.0.fetch_add(1, Ordering::Relaxed);
        }
        Appending {
            streams: self,
            track,
        }
    }

    fn now(&self) -> usize {
        self.0.load(Ordering::Relaxed)
    }
}

/// An append counted in [`Streams`].
struct Appending<'a> {
    streams: &'a Streams,
    track: Arc<Track>,
}

impl Drop for Appending<'_> {
    fn drop(&mut self) {
        // Every decrement follows its own increment, so neither count goes below zero.
        if self.track.appending.fetch_sub(1, Ordering::Relaxed) == 1 {
            self.streams.0.fetch_sub(1, Ordering::Relaxed);
        }
    }
}

/// Raises a watched length to `upto` (never lowers it).
fn grow(len: &watch::Sender<u64>, upto: u64) {
    len.send_if_modified(|c| {
        let grew = upto > *c;
        *c = (*c).max(upto);
        grew
    });
}

/// One hosted data partition.
#[derive(Debug)]
struct Part {
    id: PartitionId,
    replicas: Mutex<Vec<Replica>>,
    store: Arc<ExtentStore>,
    shared: Arc<SmShared>,
    tracks: Mutex<HashMap<ExtentId, Arc<Track>>>,
    /// The term under which this replica, as leader, aligned the committed lengths.
    aligned_term: Mutex<Option<u64>>,
    align: tokio::sync::Mutex<()>,
    /// Why the partition takes no appends, if it does not.
    degraded: Mutex<Option<String>>,
    tiny_pool: Mutex<Vec<ExtentId>>,
    tiny_free: tokio::sync::Semaphore,
    ops: AtomicU64,
    bytes: AtomicU64,
    repairing: tokio::sync::Mutex<()>,
    /// Leadership hand-offs asked because the store failed (to pick the follower).
    handoffs: AtomicU64,
    /// The group's published leader and term (read by `lead`).
    gate: Option<Arc<nacre_raft::ReadGate>>,
    /// The store's disk use and when it was measured ([`Part::used`]).
    used: Mutex<Option<(Instant, u64)>>,
}

impl Part {
    /// Bytes the partition's store takes on disk, measured at most once per [`USED_EVERY`].
    fn used(&self) -> u64 {
        let Ok(mut used) = self.used.lock() else {
            return self.store.used();
        };
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
        let mut tracks = self
            .tracks
            .lock()
            .map_err(|_| DataError::Io("poisoned".into()))?;
        if let Some(t) = tracks.get(&extent) {
            return Ok(t.clone());
        }
        let len = self.store.len(extent).map_err(store_error)?;
        let t = Track::new(len, if len_committed { len } else { 0 });
        tracks.insert(extent, t.clone());
        Ok(t)
    }

    fn degrade(&self, why: String) {
        if let Ok(mut d) = self.degraded.lock() {
            if d.is_none() {
                tracing::warn!(partition = %self.id, reason = %why, "data partition is read-only");
            }
            d.get_or_insert(why);
        }
    }

    fn degraded(&self) -> Option<String> {
        self.degraded.lock().ok().and_then(|d| d.clone())
    }

    fn followers(&self, me: u64) -> Vec<Replica> {
        self.replicas
            .lock()
            .map(|r| r.iter().filter(|r| r.node.0 != me).cloned().collect())
            .unwrap_or_default()
    }

    fn addr_of(&self, node: u64) -> Option<String> {
        self.replicas
            .lock()
            .ok()?
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
    opening: tokio::sync::Mutex<()>,
    /// Repair budget: bytes that may still be copied before the next refill.
    repair_tokens: tokio::sync::Mutex<(f64, Instant)>,
    /// Deleted extents' data files every partition's new extents may take (`retire_spares`).
    spares: Arc<SparePool>,
    streams: Streams,
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
                opening: tokio::sync::Mutex::new(()),
                repair_tokens: tokio::sync::Mutex::new((0.0, Instant::now())),
                spares: SparePool::new(),
                streams: Streams::default(),
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
        self.inner.raft.handle()
    }

    async fn adopt(&self, id: NodeId) -> Result<(), String> {
        self.inner.raft.adopt(id)?;
        for spec in self.inner.registry.specs() {
            if let Err(e) = self.open_partition(&spec).await {
                tracing::error!(partition = %spec.id, error = %e, "cannot open data partition");
            }
        }
        Ok(())
    }

    fn part_dir(&self, id: PartitionId) -> PathBuf {
        self.inner.dir.join("extents").join(id.0.to_string())
    }

    /// Hosts `spec`'s store and group (idempotent), or updates its replica list.
    async fn open_partition(&self, spec: &PartitionSpec) -> Result<(), String> {
        if spec.kind != PartitionKind::Data {
            return Err(format!("partition {} is not a data partition", spec.id));
        }
        let raft = self.raft()?;
        let peers: BTreeMap<u64, String> = spec
            .replicas
            .iter()
            .map(|r| (r.node.0, r.addr.clone()))
            .collect();
        raft.add_peers(peers.clone()).map_err(err_str)?;
        // The master's create request and a heartbeat may both ask for a new partition: one store
        // per directory, so opening is one at a time.
        let _one = self.inner.opening.lock().await;
        if let Some(p) = self.part(spec.id) {
            if let Ok(mut r) = p.replicas.lock() {
                *r = spec.replicas.clone();
            }
            return Ok(());
        }
        let dir = self.part_dir(spec.id);
        let cfg = self.inner.config.store.clone();
        let wrap = self.inner.config.wrap_disk.clone();
        let spares = self.inner.spares.clone();
        let store = tokio::task::spawn_blocking(move || {
            std::fs::create_dir_all(&dir).map_err(err_str)?;
            let disk: Arc<dyn Disk> = Arc::new(FileDisk::new(&dir).map_err(err_str)?);
            let disk = wrap.map_or(disk.clone(), |w| (w.0)(&dir, disk));
            // One pool for the node: a new extent takes a spare of any partition.
            ExtentStore::open_with_spares(disk, cfg, spares).map_err(err_str)
        })
        .await
        .map_err(err_str)??;
        for t in store.recovery_report() {
            // A torn or unsynced tail, or the old bytes of a recycled file past its extent.
            tracing::info!(partition = %spec.id, trimmed = ?t, "extent file cut to its last verified block");
        }
        let store = Arc::new(store);
        let shared = Arc::new(SmShared::default());
        // Blocks recovery kept although they fail their CRC: compared with the leader's copy at the
        // next repair (a leader repairs them when a read finds them).
        if let Ok(mut s) = shared.suspect.lock() {
            s.extend(store.recovery_bad_blocks().iter().map(|(e, _)| *e));
        }
        let voters: Vec<u64> = peers.keys().copied().collect();
        let sm = DataSm::new(store.clone(), shared.clone());
        match raft.add_group(spec.id.0, &voters, sm).await {
            Ok(()) | Err(RaftError::GroupExists(_)) => {}
            Err(e) => return Err(e.to_string()),
        }
        let gate = raft.read_gate(spec.id.0).await.map_err(|e| e.to_string())?;
        let part = Arc::new(Part {
            id: spec.id,
            replicas: Mutex::new(spec.replicas.clone()),
            store,
            shared,
            tracks: Mutex::default(),
            aligned_term: Mutex::new(None),
            align: tokio::sync::Mutex::new(()),
            degraded: Mutex::new(None),
            tiny_pool: Mutex::new((1..=TINY_EXTENTS).rev().map(ExtentId).collect()),
            tiny_free: tokio::sync::Semaphore::new(TINY_EXTENTS as usize),
            ops: AtomicU64::new(0),
            bytes: AtomicU64::new(0),
            repairing: tokio::sync::Mutex::new(()),
            handoffs: AtomicU64::new(0),
            gate,
            used: Mutex::new(None),
        });
        if let Ok(mut parts) = self.inner.parts.lock() {
            parts.insert(spec.id, part);
        }
        Ok(())
    }

    fn part(&self, id: PartitionId) -> Option<Arc<Part>> {
        self.inner.parts.lock().ok()?.get(&id).cloned()
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
    /// refreshes reports, re-checks read-only partitions and repairs what this node lacks.
    pub async fn run(
        &self,
        id: watch::Receiver<Option<NodeId>>,
        shutdown: impl std::future::Future<Output = ()>,
    ) {
        run_node(self, id, self.inner.config.report_interval, shutdown).await;
    }

    /// Bounds what the node's spares keep (`spare_bytes`, a quarter of the free space,
    /// `spare_keep`): the newest stay, the rest are removed (off the worker), and the gauges are
    /// refreshed.
    async fn retire_spares(&self, parts: &[Arc<Part>]) {
        let cfg = &self.inner.config;
        let pool = &self.inner.spares;
        let mut all = pool.list();
        if !all.is_empty() {
            let free = rustix::fs::statvfs(&cfg.dir)
                .map(|v| v.f_bavail.saturating_mul(v.f_frsize))
                .unwrap_or_else(|e| {
                    tracing::warn!(error = %e, "cannot measure the data directory's free space");
                    0
                });
            let budget = cfg.spare_bytes.min(free / 4);
            let too_old = Instant::now().checked_sub(cfg.spare_keep);
            // Newest first: keep while they fit.
            all.sort_by_key(|s| std::cmp::Reverse(s.1));
            let mut kept = 0u64;
            let until = all.into_iter().find_map(|(bytes, since)| {
                kept = kept.saturating_add(bytes);
                (kept > budget || too_old.is_some_and(|t| since <= t)).then_some(since)
            });
            let retired = until.map(|u| pool.retire(u)).unwrap_or_default();
            if !retired.is_empty() {
                // Removing frees their blocks: slow for large files. One that cannot be removed
                // goes back to the pool, to be retired again at the next round.
                let back = pool.clone();
                let removed = off_worker(move || {
                    let n = retired.len();
                    for s in retired {
                        if let Err(e) = s.disk.remove(&s.name) {
                            tracing::warn!(file = s.name, error = %e, "cannot remove a spare");
                            back.give(s);
                        }
                    }
                    Ok(n)
                })
                .await;
                if let Err(e) = removed {
                    tracing::warn!(error = %e, "cannot remove spares");
                }
            }
        }
        if let Some(m) = &cfg.metrics {
            let spares = pool.list();
            let bytes = spares.iter().map(|s| s.0).fold(0u64, u64::saturating_add);
            let recycled: u64 = parts.iter().map(|p| p.store.recycled()).sum();
            let gauge = |v: u64| i64::try_from(v).unwrap_or(i64::MAX);
            m.spare_files.set(gauge(spares.len() as u64));
            m.spare_bytes.set(gauge(bytes));
            m.recycled.set(gauge(recycled));
        }
    }

    /// One round of background duties: leaders align and re-check read-only partitions, followers
    /// repair, and reports are refreshed.
    pub async fn maintain(&self) {
        let parts: Vec<Arc<Part>> = match self.inner.parts.lock() {
            Ok(p) => p.values().cloned().collect(),
            Err(_) => return,
        };
        self.retire_spares(&parts).await;
        let idle_since = Instant::now().checked_sub(self.inner.config.spare_keep);
        for part in &parts {
            if part.store.deleted_files() > 0 {
                // Removing deleted extents' files frees their blocks, slow for large ones: on the
                // blocking pool, not in the Raft apply that deleted them. Also for a failed store
                // (the files are outside its state): the space may be what it failed for.
                let store = part.store.clone();
                if let Err(e) =
                    off_worker(move || store.remove_deleted().map_err(store_error)).await
                {
                    tracing::warn!(partition = %part.id, error = %e, "cannot remove deleted extents' files");
                }
            }
            let lead = self.leader_term(part).await;
            if part.store.is_failed() && !self.revive_store(part, &lead).await {
                continue;
            }
            if let Some(idle_since) = idle_since.filter(|_| part.store.tails() > 0) {
                let store = part.store.clone();
                match off_worker(move || store.cut_tails(idle_since).map_err(store_error)).await {
                    Ok(0) => {}
                    Ok(n) => {
                        tracing::debug!(partition = %part.id, extents = n, "cut recycled files to their extents")
                    }
                    Err(e) => {
                        tracing::warn!(partition = %part.id, error = %e, "cannot cut recycled files to their extents")
                    }
                }
            }
            match part.shared.drop_released(&part.store) {
                Ok(0) => {}
                Ok(n) => {
                    tracing::info!(partition = %part.id, extents = n, "deleted extents the log released (this replica missed the release)")
                }
                Err(e) => {
                    tracing::warn!(partition = %part.id, error = %e, "cannot delete extents the log released")
                }
            }
            match lead {
                Ok(Some(term)) => {
                    if let Err(e) = self.ensure_aligned(part, term).await {
                        tracing::debug!(partition = %part.id, error = %e, "alignment failed");
                    }
                    if part.degraded().is_some() {
                        self.recheck(part).await;
                    }
                }
                Ok(None) => {
                    let node = self.clone();
                    let part = part.clone();
                    // Repairs run in the background so one slow partition does not hold the rest.
                    tokio::spawn(async move {
                        if let Err(e) = node.repair(&part).await {
                            tracing::debug!(partition = %part.id, error = %e, "repair incomplete");
                        }
                    });
                }
                Err(_) => {}
            }
        }
        self.refresh_reports(&parts).await;
    }

    /// A store that failed an IO refuses all work until reopened (docs/data-store.md, "Failure").
    /// Reopening recovers from what is on disk, which may lack what was not synced before the
    /// failure, and this replica also missed the Raft entries it could not apply meanwhile: only
    /// another replica's copy fills that in. So a leader first hands leadership to a follower (it
    /// repairs nothing itself, and must not serve reads from such a copy); a follower, or a lone
    /// replica, reopens the store, forgets its append tracks (as a restart does) and has every
    /// extent compared with the leader's at its next repair. One attempt per call; returns whether
    /// the store works now.
    async fn revive_store(&self, part: &Part, lead: &Result<Option<u64>, RaftError>) -> bool {
        let (Ok(leading), Ok(raft)) = (lead.as_ref().map(Option::is_some), self.raft()) else {
            return false;
        };
        let followers = part.followers(raft.id());
        if leading && !followers.is_empty() {
            // The same follower for a few rounds (asking another aborts a hand-off in progress),
            // then the next one, in case that one is down.
            let n = part.handoffs.fetch_add(1, Ordering::Relaxed) as usize;
            let to = followers[n / 4 % followers.len()].node.0;
            let r = raft.transfer_leader(part.id.0, to).await;
            tracing::warn!(partition = %part.id, to, result = ?r, "extent store failed; handing leadership over before reopening it");
            return false;
        }
        // A repair in flight would mix what it read before the reopen with what it writes after.
        let Ok(_repair) = part.repairing.try_lock() else {
            return false;
        };
        // Another duty round (they may overlap) brought it back meanwhile: the tracks are in use.
        if !part.store.is_failed() {
            return true;
        }
        // Forgotten while the store still refuses work, so no track is built from the old lengths;
        // a packet that took one earlier fails its `sync_since`.
        if let Ok(mut t) = part.tracks.lock() {
            t.clear();
        }
        let store = part.store.clone();
        match tokio::task::spawn_blocking(move || store.reopen()).await {
            Ok(Ok(())) => {
                part.shared.suspect_all.store(true, Ordering::Release);
                if let Ok(mut t) = part.aligned_term.lock() {
                    *t = None;
                }
                tracing::info!(
                    partition = %part.id,
                    trimmed = ?part.store.recovery_report(),
                    bad_blocks = part.store.recovery_bad_blocks().len(),
                    "extent store reopened; every extent will be compared with the leader's"
                );
                true
            }
            Ok(Err(e)) => {
                tracing::warn!(partition = %part.id, error = %e, "extent store failed and cannot be reopened yet");
                false
            }
            Err(e) => {
                tracing::warn!(partition = %part.id, error = %e, "extent store reopen did not finish");
                false
            }
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

    /// Checks that this node leads the partition and has aligned it under the current term.
    ///
    /// The leader and term come from what the Raft thread published after its last message or
    /// Ready round, not from a request to it: under load that thread spends most of its time in
    /// log writes, and every request would wait for one (up to a sync) before its proposal was
    /// even made. A view that is a moment stale is harmless: a proposal on a node that has just
    /// stopped leading fails `NotLeader`, and one that has just started leading is turned away
    /// with a hint the client follows again.
    async fn lead(&self, part: &Part) -> Result<(), RemoteError> {
        let raft = self.raft().map_err(unavailable)?;
        let (leader, term) = match &part.gate {
            Some(gate) => gate.leader_term(),
            None => raft
                .leader_term(part.id.0)
                .await
                .map_err(|e| self.remote(part, e))?,
        };
        if leader != raft.id() {
            return Err(self.not_leader(part, leader));
        }
        self.ensure_aligned(part, term).await.map_err(unavailable)
    }

    /// Aligns the committed lengths under `term` (once per term).
    async fn ensure_aligned(&self, part: &Part, term: u64) -> Result<(), String> {
        let aligned = |p: &Part| p.aligned_term.lock().ok().and_then(|t| *t) == Some(term);
        if aligned(part) {
            return Ok(());
        }
        let _guard = part.align.lock().await;
        if aligned(part) {
            return Ok(());
        }
        let me = self.raft()?.id();
        let local = part.store.extents();
        let known: HashMap<ExtentId, u64> = part
            .tracks
            .lock()
            .map(|t| t.iter().map(|(e, t)| (*e, t.committed())).collect())
            .unwrap_or_default();
        let mut lists = Vec::new();
        let mut unreachable = Vec::new();
        for r in part.followers(me) {
            match self.list_extents(&r.addr, part.id).await {
                Ok(list) => lists.push(list.extents),
                Err(e) => unreachable.push(format!("{}: {e}", r.addr)),
            }
        }
        let lens = merge_lengths(&local, &known, &lists, |e| part.shared.released(e));
        let mut tracks = HashMap::new();
        let mut short = Vec::new();
        // Held until the new tracks are in place: no write can take an extent's track meanwhile.
        let held = part.tracks.lock().ok();
        for (e, (min, max_c)) in lens {
            let committed = max_c.max(min);
            let mut have = local.iter().find(|(id, _)| *id == e).map_or(0, |(_, l)| *l);
            if have < committed {
                short.push(e);
            }
            // Bytes past the committed length here are an unacknowledged tail (an earlier leader's
            // packets that did not reach every replica): drop them, so that appends continue at the
            // committed offset — unless a write to the extent is still in flight here (its track is
            // held), which may yet be acknowledged.
            let busy = held
                .as_ref()
                .is_none_or(|t| t.get(&e).is_some_and(|t| Arc::strong_count(t) > 1));
            if have > committed
                && !busy
                && !ExtentStore::is_tiny(e)
                && part.store.truncate(e, committed).is_ok()
            {
                have = committed;
            }
            tracks.insert(e, Track::new(have.max(committed), committed));
        }
        if let Some(mut t) = held {
            *t = tracks;
        }
        if !unreachable.is_empty() {
            part.degrade(format!(
                "replicas unreachable at leader change: {}",
                unreachable.join(", ")
            ));
        }
        if !short.is_empty() {
            part.degrade(format!(
                "the leader lacks committed bytes of extents {short:?}"
            ));
        }
        if let Ok(mut t) = part.aligned_term.lock() {
            *t = Some(term);
        }
        tracing::info!(partition = %part.id, term, "data partition aligned");
        Ok(())
    }

    async fn list_extents(&self, addr: &str, partition: PartitionId) -> Result<ExtentList, String> {
        let opts = CallOptions {
            timeout: Some(self.inner.config.replicate_timeout),
            ..CallOptions::default()
        };
        let (r, _) = self
            .inner
            .client
            .call_with::<ListExtents>(
                addr,
                &ListExtentsRequest { partition },
                Payload::none(),
                opts,
            )
            .await
            .map_err(err_str)?;
        r.map_err(err_str)
    }

    /// A read-only partition returns to read-write once every follower answers and holds every
    /// committed byte. A leader that lacks committed bytes itself (a replica that lost its tail and
    /// was elected before it repaired it) never gets them, since leaders do not repair: it hands
    /// the partition to a follower that holds them all, and repairs as a follower.
    async fn recheck(&self, part: &Part) {
        let Ok(raft) = self.raft() else {
            return;
        };
        // Tracks of extents released since they were made (a release this leader applied but did
        // not propose, or one applied after the alignment) would otherwise ask for bytes nobody
        // keeps, and the partition would stay read-only for good.
        let committed: Vec<(ExtentId, u64)> = match part.tracks.lock() {
            Ok(mut t) => {
                t.retain(|e, _| !part.shared.released(*e));
                t.iter().map(|(e, t)| (*e, t.committed())).collect()
            }
            Err(_) => return,
        };
        let short: Vec<ExtentId> = committed
            .iter()
            .filter(|(e, c)| part.store.len(*e).unwrap_or(0) < *c)
            .map(|(e, _)| *e)
            .collect();
        let lacking = !short.is_empty();
        if lacking {
            tracing::debug!(partition = %part.id, extents = ?short, "re-check: this leader lacks committed bytes");
        }
        let mut lists = Vec::new();
        for r in part.followers(raft.id()) {
            match self.list_extents(&r.addr, part.id).await {
                Ok(list) => lists.push((
                    r.node.0,
                    list.extents.iter().map(|(e, l, _)| (*e, *l)).collect(),
                )),
                // Every follower must answer before the partition is writable again.
                Err(e) if !lacking => {
                    tracing::debug!(partition = %part.id, follower = %r.addr, error = %e, "re-check: a follower does not answer");
                    return;
                }
                Err(_) => {}
            }
        }
        if lacking {
            match holding_all(&committed, &lists) {
                Some(to) => {
                    let r = raft.transfer_leader(part.id.0, to).await;
                    tracing::warn!(partition = %part.id, to, result = ?r, "this leader lacks committed bytes; handing leadership to a replica that holds them");
                }
                None => {
                    tracing::debug!(partition = %part.id, "re-check: no replica holds every committed byte")
                }
            }
            return;
        }
        if let Some((node, _)) = lists.iter().find(|(_, theirs)| !holds(theirs, &committed)) {
            tracing::debug!(partition = %part.id, follower = node, "re-check: a follower lacks committed bytes (repair pending)");
            return;
        }
        if let Ok(mut d) = part.degraded.lock()
            && let Some(why) = d.take()
        {
            tracing::info!(partition = %part.id, was = %why, "data partition is read-write again");
        }
    }

    /// Waits for the repair budget to allow `bytes` more.
    async fn throttle(&self, bytes: u64) {
        let rate = self.inner.config.repair_rate.max(1) as f64;
        let wait = {
            let mut b = self.inner.repair_tokens.lock().await;
            let now = Instant::now();
            let refill = now.duration_since(b.1).as_secs_f64() * rate;
            b.0 = (b.0 + refill).min(rate);
            b.1 = now;
            b.0 -= bytes as f64;
            if b.0 < 0.0 {
                Duration::from_secs_f64(-b.0 / rate)
            } else {
                Duration::ZERO
            }
        };
        if !wait.is_zero() {
            tokio::time::sleep(wait).await;
        }
    }

    /// A follower brings its copy up to the leader's committed lengths (and, for suspect extents,
    /// to the leader's block contents).
    async fn repair(&self, part: &Part) -> Result<(), String> {
        let Ok(_one) = part.repairing.try_lock() else {
            return Ok(());
        };
        let raft = self.raft()?;
        let leader = raft.leader(part.id.0).await.map_err(err_str)?;
        if leader == 0 || leader == raft.id() {
            return Ok(());
        }
        let addr = part
            .addr_of(leader)
            .ok_or_else(|| format!("leader node-{leader} is not a known replica"))?;
        let list = self.list_extents(&addr, part.id).await?;
        let all = part.shared.suspect_all.load(Ordering::Acquire);
        let suspects: std::collections::BTreeSet<ExtentId> = part
            .shared
            .suspect
            .lock()
            .map(|s| s.clone())
            .unwrap_or_default();
        let bs = u64::from(part.store.block_size());
        for (extent, _len, committed) in list.extents {
            let have = match part.store.len(extent) {
                Ok(l) => l,
                Err(StoreError::NotFound(_)) => 0,
                Err(e) => return Err(e.to_string()),
            };
            if all || suspects.contains(&extent) {
                self.compare_blocks(part, &addr, extent, have.min(committed))
                    .await?;
                if let Ok(mut s) = part.shared.suspect.lock() {
                    s.remove(&extent);
                }
            }
            if have < committed {
                let first = have / bs;
                let last = committed.div_ceil(bs);
                let mut b = first;
                while b < last {
                    let count = (last - b).min(8) as u32;
                    self.copy_blocks(part, &addr, extent, b, count).await?;
                    b += u64::from(count);
                }
                // A packet may be waiting for these bytes (`take_replica`): its track must see them.
                let track = part
                    .tracks
                    .lock()
                    .ok()
                    .and_then(|t| t.get(&extent).cloned());
                if let (Some(t), Ok(len)) = (track, part.store.len(extent)) {
                    t.next.send_if_modified(|n| {
                        let grew = len > *n;
                        *n = (*n).max(len);
                        grew
                    });
                }
                tracing::info!(partition = %part.id, %extent, from = have, to = committed, "extent repaired");
            }
        }
        if all {
            part.shared.suspect_all.store(false, Ordering::Release);
        }
        Ok(())
    }

    /// Fetches blocks whose CRC differs from the leader's, below `upto`.
    async fn compare_blocks(
        &self,
        part: &Part,
        addr: &str,
        extent: ExtentId,
        upto: u64,
    ) -> Result<(), String> {
        let (r, _) = self
            .inner
            .client
            .call::<BlockCrcs>(
                addr,
                &BlockCrcsRequest {
                    partition: part.id,
                    extent,
                },
                Payload::none(),
            )
            .await
            .map_err(err_str)?;
        let (bs, theirs, _) = r.map_err(err_str)?;
        if bs != part.store.block_size() {
            return Err(format!(
                "block sizes differ: {bs} there, {} here",
                part.store.block_size()
            ));
        }
        let mine = part.store.block_crcs(extent).unwrap_or_default();
        let blocks = upto.div_ceil(u64::from(bs));
        for b in 0..blocks {
            let i = b as usize;
            if mine.get(i) != theirs.get(i) {
                self.copy_blocks(part, addr, extent, b, 1).await?;
            }
        }
        Ok(())
    }

    /// Copies whole blocks from a replica, writing each only when it reflects every overwrite
    /// applied here (see [`DataNode::install_blocks`]).
    async fn copy_blocks(
        &self,
        part: &Part,
        addr: &str,
        extent: ExtentId,
        first: u64,
        count: u32,
    ) -> Result<(), String> {
        for _attempt in 0..5 {
            let (data, applied) = self
                .fetch_blocks(addr, part.id, extent, first, count, true)
                .await?;
            self.throttle(data.len() as u64).await;
            if self
                .install_blocks(part, extent, first, data, applied)
                .await?
            {
                return Ok(());
            }
        }
        Err(format!(
            "extent {extent} blocks {first}+{count}: the source stayed behind this replica's \
             overwrites"
        ))
    }

    async fn fetch_blocks(
        &self,
        addr: &str,
        partition: PartitionId,
        extent: ExtentId,
        first: u64,
        count: u32,
        background: bool,
    ) -> Result<(Bytes, u64), String> {
        let mut opts = CallOptions {
            timeout: Some(self.inner.config.replicate_timeout),
            ..CallOptions::default()
        };
        if background {
            opts.flags = nacre_proto::Flags::BACKGROUND;
        }
        let (r, data) = self
            .inner
            .client
            .call_with::<FetchBlocks>(
                addr,
                &FetchBlocksRequest {
                    partition,
                    extent,
                    first,
                    count,
                },
                Payload::none(),
                opts,
            )
            .await
            .map_err(err_str)?;
        let applied = r.map_err(err_str)?;
        Ok((data.bytes, applied))
    }

    /// Writes blocks fetched from a replica whose partition had applied `applied` entries when it
    /// read them. Runs on the raft loop (between applies), and only if this replica has applied no
    /// entry past `applied`: then any overwrite the blocks lack is still to be applied here, in
    /// order, on top of them. Returns false (nothing written) otherwise.
    async fn install_blocks(
        &self,
        part: &Part,
        extent: ExtentId,
        first: u64,
        data: Bytes,
        applied: u64,
    ) -> Result<bool, String> {
        let raft = self.raft()?;
        let bs = part.store.block_size() as usize;
        let r = raft
            .local_read(part.id.0, move |sm: &DataSm, _| {
                if sm.shared.applied() > applied {
                    return Ok(false);
                }
                for (i, chunk) in data.chunks(bs).enumerate() {
                    sm.store
                        .repair_block(extent, first + i as u64, chunk)
                        .map_err(err_str)?;
                }
                Ok(true)
            })
            .await
            .map_err(err_str)?;
        if matches!(r, Ok(true)) {
            let store = part.store.clone();
            tokio::task::spawn_blocking(move || store.sync())
                .await
                .map_err(err_str)?
                .map_err(err_str)?;
        }
        r
    }

    async fn refresh_reports(&self, parts: &[Arc<Part>]) {
        let now = Instant::now();
        let counts: Counters = parts
            .iter()
            .map(|p| {
                let c = (
                    p.ops.load(Ordering::Relaxed),
                    p.bytes.load(Ordering::Relaxed),
                );
                (p.id, c)
            })
            .collect();
        let (secs, before) = match self.inner.last_report.lock() {
            Ok(mut l) => match l.replace((now, counts.clone())) {
                Some((t, b)) => (now.duration_since(t).as_secs_f64(), b),
                None => (0.0, BTreeMap::new()),
            },
            Err(_) => return,
        };
        let mut reports = Vec::new();
        for p in parts {
            let leader = matches!(self.leader_term(p).await, Ok(Some(_)));
            let (ops, bytes) = counts[&p.id];
            let (ops0, bytes0) = before.get(&p.id).copied().unwrap_or((0, 0));
            let rate = |now: u64, then: u64| {
                if secs > 0.0 {
                    (now.saturating_sub(then) as f64 / secs).round() as u64
                } else {
                    0
                }
            };
            reports.push(PartitionReport {
                id: p.id,
                leader,
                inode_count: 0,
                max_inode: 0,
                used: p.used(),
                full: leader && p.degraded().is_some(),
                ops_per_s: rate(ops, ops0),
                bytes_per_s: rate(bytes, bytes0),
            });
        }
        if let Ok(mut r) = self.inner.reports.lock() {
            *r = reports;
        }
    }

    /// Bytes written to a partition through this node as leader, for stats.
    fn count(&self, part: &Part, bytes: usize) {
        part.ops.fetch_add(1, Ordering::Relaxed);
        part.bytes.fetch_add(bytes as u64, Ordering::Relaxed);
    }

    /// Whether appends now bypass the page cache (`DataNodeConfig::direct_streams`).
    fn uncached(&self) -> bool {
        let from = self.inner.config.direct_streams;
        from > 0 && self.inner.streams.now() >= from as usize
    }

    /// Syncs writes made since the store's `epoch` (taken before them): fails if a reopen came
    /// between, since it may have lost them.
    async fn sync_store(store: &Arc<ExtentStore>, epoch: u64) -> Result<(), DataError> {
        let store = store.clone();
        off_worker(move || store.sync_since(epoch).map_err(store_error)).await
    }

    /// The append state of an extent on the leader. An extent this replica does not know may have
    /// been created through Raft under a previous leader and not be applied here yet: wait until
    /// everything committed is applied, then look again.
    async fn leader_track(&self, part: &Part, extent: ExtentId) -> Result<Arc<Track>, DataError> {
        match part.track(extent) {
            Err(DataError::NotFound(_)) if !ExtentStore::is_tiny(extent) => {
                let raft = self.raft().map_err(DataError::Io)?;
                raft.read(part.id.0, |_| ())
                    .await
                    .map_err(|e| DataError::Io(e.to_string()))?;
                part.track(extent)
            }
            other => other,
        }
    }

    /// Sends a packet to every follower and, with `sync`, syncs it locally (written at store
    /// `epoch`) and has every follower sync it; all must succeed.
    #[expect(clippy::too_many_arguments, reason = "one packet's placement")]
    async fn replicate(
        &self,
        part: &Part,
        extent: ExtentId,
        offset: u64,
        epoch: u64,
        committed: u64,
        data: &Payload,
        sync: bool,
    ) -> Result<(), DataError> {
        let me = self.raft().map_err(DataError::Io)?.id();
        let req = ReplicateRequest {
            partition: part.id,
            extent,
            offset,
            committed,
            sync,
        };
        let (check_after, limit) = (
            self.inner.config.replicate_timeout,
            self.inner.config.replicate_stall_limit,
        );
        let mut sends = tokio::task::JoinSet::new();
        for r in part.followers(me) {
            let client = self.inner.client.clone();
            let req = req.clone();
            let data = Payload::with_crc(data.bytes.clone(), data.crc());
            sends.spawn(async move {
                replicate_to(&client, &r.addr, &req, data, check_after, limit)
                    .await
                    .map_err(|e| format!("{}: {e}", r.addr))
            });
        }
        let local = async {
            if sync {
                Self::sync_store(&part.store, epoch).await
            } else {
                Ok(())
            }
        };
        let (local, remote) = tokio::join!(local, sends.join_all());
        let mut failed: Vec<String> = remote.into_iter().filter_map(Result::err).collect();
        if let Err(e) = local {
            failed.push(format!("local disk: {e}"));
        }
        if failed.is_empty() {
            return Ok(());
        }
        let why = format!("replication failed: {}", failed.join("; "));
        part.degrade(why.clone());
        Err(DataError::ReadOnly(why))
    }

    async fn append(
        &self,
        part: &Arc<Part>,
        req: AppendRequest,
        data: Payload,
    ) -> Result<Written, DataError> {
        if ExtentStore::is_tiny(req.extent) {
            return Err(DataError::Invalid(format!(
                "{} is a tiny extent: write small files with WriteTiny",
                req.extent
            )));
        }
        check_packet(&data)?;
        if let Some(why) = part.degraded() {
            return Err(DataError::ReadOnly(why));
        }
        let track = self.leader_track(part, req.extent).await?;
        let len = data.bytes.len() as u64;
        let (extent, offset) = (req.extent, req.offset);
        let out_of_range = |track: &Track| DataError::OutOfRange {
            extent,
            offset,
            len,
            committed: track.committed(),
        };
        let _appending = self.inner.streams.enter(track.clone());
        // Packets of one extent may arrive out of order: each waits in the inbox until the bytes
        // before it are written here, and is written with the packets then waiting after it.
        let (done, mut written) = tokio::sync::oneshot::channel();
        let start = {
            let mut inbox = track
                .inbox
                .lock()
                .map_err(|_| DataError::Io("poisoned".into()))?;
            // A stale retry (its bytes written already, or a copy of it waiting).
            if offset < *track.next.borrow() || inbox.waiting.contains_key(&offset) {
                return Err(out_of_range(&track));
            }
            inbox.waiting.insert(
                offset,
                Arrived {
                    data,
                    sync: req.sync,
                    done,
                },
            );
            !std::mem::replace(&mut inbox.writing, true)
        };
        if start {
            let (node, part, track) = (self.clone(), part.clone(), track.clone());
            tokio::spawn(async move { node.write_batches(&part, &track, extent).await });
        }
        let stall = self.inner.config.replicate_stall_limit;
        let out = match tokio::time::timeout(stall, &mut written).await {
            Ok(out) => out,
            Err(_) => {
                // Still waiting for the bytes before it: give up. Taken into a batch meanwhile:
                // its result is on the way.
                let gave_up = track
                    .inbox
                    .lock()
                    .map_err(|_| DataError::Io("poisoned".into()))?
                    .waiting
                    .remove(&offset)
                    .is_some();
                if gave_up {
                    return Err(out_of_range(&track));
                }
                written.await
            }
        };
        out.unwrap_or_else(|_| Err(DataError::Io("the extent's writer stopped".into())))?;
        // Acknowledge in offset order: the previous packet must be on every replica first. Then a
        // synced packet commits everything below its end, since each replica wrote the earlier
        // packets before this one and synced after it.
        let mut r = track.replicated.subscribe();
        let prev = tokio::time::timeout(
            self.inner.config.replicate_stall_limit,
            r.wait_for(|r| *r >= req.offset),
        )
        .await
        .is_ok_and(|r| r.is_ok());
        if !prev {
            return Err(DataError::ReadOnly(
                "an earlier packet of this extent did not reach every replica".into(),
            ));
        }
        grow(&track.replicated, req.offset + len);
        if req.sync {
            track.commit(req.offset + len);
        }
        self.count(part, len as usize);
        Ok(Written {
            extent: req.extent,
            offset: req.offset,
            committed: track.committed(),
        })
    }

    /// The leader's writer of an extent's appends, one task per extent while packets wait
    /// (started by the packet that found none running). It takes the packets waiting in the inbox
    /// that continue the extent, up to [`MAX_BATCH`] bytes, writes them here with one write, and
    /// sends them to every follower as one message, while it goes on with the next batch. Each
    /// packet gets the batch's result. Packets a refused batch leaves behind can never be written
    /// in order: they get the same answer.
    async fn write_batches(&self, part: &Arc<Part>, track: &Arc<Track>, extent: ExtentId) {
        loop {
            let Some((offset, batch)) = take_batch(track, extent) else {
                return;
            };
            let sync = batch.iter().any(|a| a.sync);
            let data = join_packets(&batch);
            tracing::trace!(%extent, offset, packets = batch.len(), bytes = data.bytes.len(), "append batch");
            if let Some(m) = &self.inner.config.metrics {
                m.append_batches.inc();
                m.append_batched.inc_by(batch.len() as u64);
            }
            let len = data.bytes.len() as u64;
            let uncached = self.uncached();
            let epoch = part.store.epoch();
            // Written here before it goes to the followers: a packet this replica refuses (out of
            // order, a stale retry) must never reach them, since a follower cuts an unacknowledged
            // tail to make room for it.
            let written = {
                let (track, store, bytes) = (track.clone(), part.store.clone(), data.bytes.clone());
                off_worker(move || {
                    let _w = track.lock_write()?;
                    let committed = track.committed();
                    if *track.next.borrow() != offset {
                        return Err(DataError::OutOfRange {
                            extent,
                            offset,
                            len,
                            committed,
                        });
                    }
                    if uncached {
                        store.write_uncached(extent, offset, &bytes)
                    } else {
                        store.write(extent, offset, &bytes)
                    }
                    .map_err(write_error)?;
                    track.next.send_replace(offset + len);
                    Ok(committed)
                })
                .await
                .inspect_err(|e| degrade_if_full(part, e))
            };
            match written {
                Ok(committed) => {
                    let (node, part) = (self.clone(), part.clone());
                    tokio::spawn(async move {
                        let out = node
                            .replicate(&part, extent, offset, epoch, committed, &data, sync)
                            .await;
                        for a in batch {
                            let _ = a.done.send(out.clone());
                        }
                    });
                }
                Err(e) => {
                    let left = track
                        .inbox
                        .lock()
                        .map(|mut i| std::mem::take(&mut i.waiting))
                        .unwrap_or_default();
                    for a in batch.into_iter().chain(left.into_values()) {
                        let _ = a.done.send(Err(e.clone()));
                    }
                }
            }
        }
    }

    async fn write_tiny(&self, part: &Part, data: Payload) -> Result<Written, DataError> {
        check_packet(&data)?;
        if let Some(why) = part.degraded() {
            return Err(DataError::ReadOnly(why));
        }
        let _permit = part
            .tiny_free
            .acquire()
            .await
            .map_err(|_| DataError::Io("partition closing".into()))?;
        let extent = part
            .tiny_pool
            .lock()
            .ok()
            .and_then(|mut p| p.pop())
            .ok_or_else(|| DataError::Io("no tiny extent free".into()))?;
        let out = self.write_tiny_into(part, extent, &data).await;
        if let Ok(mut p) = part.tiny_pool.lock() {
            p.push(extent);
        }
        out
    }

    async fn write_tiny_into(
        &self,
        part: &Part,
        extent: ExtentId,
        data: &Payload,
    ) -> Result<Written, DataError> {
        let track = match part.track(extent) {
            Ok(t) => t,
            Err(DataError::NotFound(_)) => {
                let t = Track::new(0, 0);
                if let Ok(mut tracks) = part.tracks.lock() {
                    tracks.entry(extent).or_insert(t).clone()
                } else {
                    t
                }
            }
            Err(e) => return Err(e),
        };
        let len = data.bytes.len() as u64;
        let epoch = part.store.epoch();
        let (offset, committed_before) = {
            let (track, store, bytes) = (track.clone(), part.store.clone(), data.bytes.clone());
            off_worker(move || {
                let _w = track.lock_write()?;
                let offset = (*track.next.borrow()).next_multiple_of(TINY_ALIGN);
                store.write(extent, offset, &bytes).map_err(write_error)?;
                track.next.send_replace(offset + len);
                Ok((offset, track.committed()))
            })
            .await
            .inspect_err(|e| degrade_if_full(part, e))?
        };
        self.replicate(part, extent, offset, epoch, committed_before, data, true)
            .await?;
        track.commit(offset + len);
        self.count(part, data.bytes.len());
        Ok(Written {
            extent,
            offset,
            committed: track.committed(),
        })
    }

    /// A follower stores a packet its leader forwarded.
    async fn take_replica(
        &self,
        part: &Part,
        req: ReplicateRequest,
        data: Payload,
    ) -> Result<(), DataError> {
        if data.bytes.is_empty() || data.bytes.len() > MAX_BATCH {
            return Err(DataError::Invalid(format!(
                "a replicated batch of {} bytes; 1 to {MAX_BATCH}",
                data.bytes.len()
            )));
        }
        let epoch = part.store.epoch();
        let tiny = ExtentStore::is_tiny(req.extent);
        let track = match part.track_with(req.extent, false) {
            Ok(t) => t,
            // Created through Raft but not applied here yet (or a tiny extent's first write).
            Err(DataError::NotFound(_)) => {
                if !tiny {
                    part.store.create(req.extent).map_err(store_error)?;
                }
                let t = Track::new(0, 0);
                match part.tracks.lock() {
                    Ok(mut tracks) => tracks.entry(req.extent).or_insert(t).clone(),
                    Err(_) => t,
                }
            }
            Err(e) => return Err(e),
        };
        track.commit(req.committed);
        let _appending = (!tiny).then(|| self.inner.streams.enter(track.clone()));
        let uncached = self.uncached();
        let len = data.bytes.len() as u64;
        if !tiny {
            let mut next = track.next.subscribe();
            let _ = tokio::time::timeout(
                self.inner.config.replicate_timeout / 2,
                next.wait_for(|n| *n >= req.offset),
            )
            .await;
        }
        let (store, bytes) = (part.store.clone(), data.bytes.clone());
        off_worker(move || {
            let _w = track.lock_write()?;
            let have = *track.next.borrow();
            if req.offset < have {
                // A longer, unacknowledged tail from an earlier leader: drop it, never below what
                // is committed.
                if req.offset < track.committed() {
                    return Err(DataError::OutOfRange {
                        extent: req.extent,
                        offset: req.offset,
                        len,
                        committed: track.committed(),
                    });
                }
                store
                    .truncate(req.extent, req.offset)
                    .map_err(store_error)?;
            } else if req.offset > have && !tiny {
                return Err(DataError::OutOfRange {
                    extent: req.extent,
                    offset: req.offset,
                    len,
                    committed: have,
                });
            }
            if uncached {
                store.write_uncached(req.extent, req.offset, &bytes)
            } else {
                store.write(req.extent, req.offset, &bytes)
            }
            .map_err(store_error)?;
            track.next.send_replace(req.offset + len);
            Ok(())
        })
        .await?;
        if req.sync {
            Self::sync_store(&part.store, epoch).await
        } else {
            Ok(())
        }
    }

    async fn overwrite(
        &self,
        part: &Part,
        req: OverwriteRequest,
        data: Payload,
    ) -> Result<Result<(), DataError>, RemoteError> {
        if let Err(e) = check_packet(&data) {
            return Ok(Err(e));
        }
        let len = data.bytes.len() as u64;
        let committed = match self.leader_track(part, req.extent).await {
            Ok(t) => t.committed(),
            Err(e) => return Ok(Err(e)),
        };
        if req.offset.saturating_add(len) > committed {
            return Ok(Err(DataError::OutOfRange {
                extent: req.extent,
                offset: req.offset,
                len,
                committed,
            }));
        }
        let cmd = DataCommand::Overwrite {
            extent: req.extent,
            offset: req.offset,
            data: data.bytes.clone(),
        };
        let out = self.propose(part, &cmd).await?;
        if out.is_ok() {
            self.count(part, data.bytes.len());
        }
        Ok(out.map(|_| ()))
    }

    async fn append_raft(
        &self,
        part: &Part,
        req: AppendRequest,
        data: Payload,
    ) -> Result<Result<Written, DataError>, RemoteError> {
        if let Err(e) = check_packet(&data) {
            return Ok(Err(e));
        }
        let track = match self.leader_track(part, req.extent).await {
            Ok(t) => t,
            Err(e) => return Ok(Err(e)),
        };
        let len = data.bytes.len() as u64;
        let cmd = DataCommand::Append {
            extent: req.extent,
            offset: req.offset,
            data: data.bytes.clone(),
        };
        let out = self.propose(part, &cmd).await?;
        Ok(out.map(|_| {
            track.next.send_if_modified(|n| {
                let grew = req.offset + len > *n;
                *n = (*n).max(req.offset + len);
                grew
            });
            track.commit(req.offset + len);
            self.count(part, data.bytes.len());
            Written {
                extent: req.extent,
                offset: req.offset,
                committed: track.committed(),
            }
        }))
    }

    async fn propose(
        &self,
        part: &Part,
        cmd: &DataCommand,
    ) -> Result<Result<Option<ExtentId>, DataError>, RemoteError> {
        let raft = self.raft().map_err(unavailable)?;
        let bytes = postcard::to_allocvec(cmd)
            .map_err(|e| RemoteError::new(ErrorCode::BadRequest, e.to_string()))?;
        let out = raft
            .propose(part.id.0, bytes)
            .await
            .map_err(|e| self.remote(part, e))?;
        postcard::from_bytes::<Result<Option<ExtentId>, DataError>>(&out)
            .map_err(|e| unavailable(format!("bad result: {e}")))
    }

    /// Reads committed bytes on the leader, verifying block CRCs; a bad block is fetched from a
    /// follower, rewritten here and the read retried.
    async fn read(&self, part: &Part, req: &ReadRequest) -> Result<Bytes, DataError> {
        let committed = self.leader_track(part, req.extent).await?.committed();
        let end = req.offset.saturating_add(u64::from(req.len));
        if end > committed {
            return Err(DataError::OutOfRange {
                extent: req.extent,
                offset: req.offset,
                len: u64::from(req.len),
                committed,
            });
        }
        for _ in 0..3 {
            match part.store.read(req.extent, req.offset, req.len) {
                Ok(b) => return Ok(b),
                Err(StoreError::Corrupt { block, .. }) => {
                    tracing::error!(
                        partition = %part.id, extent = %req.extent, block,
                        "checksum mismatch on read; repairing from a replica"
                    );
                    self.repair_block_from_followers(part, req.extent, block)
                        .await?;
                }
                Err(e) => return Err(store_error(e)),
            }
        }
        Err(DataError::Corrupt {
            extent: req.extent,
            block: req.offset / u64::from(part.store.block_size()),
        })
    }

    async fn repair_block_from_followers(
        &self,
        part: &Part,
        extent: ExtentId,
        block: u64,
    ) -> Result<(), DataError> {
        let me = self.raft().map_err(DataError::Io)?.id();
        for r in part.followers(me) {
            match self
                .fetch_blocks(&r.addr, part.id, extent, block, 1, false)
                .await
            {
                Ok((data, applied)) => {
                    match self
                        .install_blocks(part, extent, block, data, applied)
                        .await
                    {
                        Ok(true) => {
                            tracing::info!(partition = %part.id, %extent, block, from = %r.addr, "block repaired");
                            return Ok(());
                        }
                        Ok(false) => continue,
                        Err(e) => return Err(DataError::Io(e)),
                    }
                }
                Err(e) => {
                    tracing::warn!(partition = %part.id, %extent, block, from = %r.addr, error = %e, "replica cannot supply the block");
                }
            }
        }
        Err(DataError::Corrupt { extent, block })
    }

    fn fetch_local(
        &self,
        part: &Part,
        req: &FetchBlocksRequest,
    ) -> Result<(u64, Bytes), DataError> {
        // The applied index first: the bytes read after it reflect at least that much.
        let applied = part.shared.applied();
        let bs = u64::from(part.store.block_size());
        let len = part.store.len(req.extent).map_err(store_error)?;
        let start = req.first.saturating_mul(bs);
        if start >= len {
            return Ok((applied, Bytes::new()));
        }
        let end = start
            .saturating_add(u64::from(req.count.min(64)) * bs)
            .min(len);
        let data = part
            .store
            .read(req.extent, start, (end - start) as u32)
            .map_err(store_error)?;
        Ok((applied, data))
    }

    /// The messenger ops of a data node: its raft traffic and the data ops. The agent's ops are
    /// separate (`nacre_cluster::node_router`).
    /// The gauges of [`DataNodeConfig::metrics`], if any.
    pub fn metrics(&self) -> Option<&DataMetrics> {
        self.inner.config.metrics.as_ref()
    }

    pub fn router(&self) -> Router {
        let n = self.clone();
        let raft_in = self.clone();
        let router = Router::new().route::<RaftBatchRpc, _, _>(move |batch, _inc| {
            if let Some(raft) = raft_in.inner.raft.get() {
                raft.deliver(batch);
            }
            async { Ok(((), Payload::none())) }
        });
        let node = n.clone();
        let router = router.route::<CreateExtent, _, _>(move |req, _inc| {
            let node = node.clone();
            async move {
                let part = node.hosted_part(req.partition)?;
                node.lead(&part).await?;
                if let Some(why) = part.degraded() {
                    return Ok((Err(DataError::ReadOnly(why)), Payload::none()));
                }
                let out = node.propose(&part, &DataCommand::CreateExtent).await?;
                let out = out.and_then(|id| {
                    id.ok_or_else(|| DataError::Io("create returned no extent".into()))
                });
                if let Ok(id) = out
                    && let Ok(mut t) = part.tracks.lock()
                {
                    t.entry(id).or_insert_with(|| Track::new(0, 0));
                }
                Ok((out, Payload::none()))
            }
        });
        let node = n.clone();
        let router = router.route::<Append, _, _>(move |req, inc| {
            let node = node.clone();
            async move {
                let part = node.hosted_part(req.partition)?;
                node.lead(&part).await?;
                let (extent, offset) = (req.extent, req.offset);
                let out = node.append(&part, req, inc.data).await;
                if let Err(e) = &out {
                    tracing::debug!(partition = %part.id, %extent, offset, error = %e, "append refused");
                }
                Ok((out, Payload::none()))
            }
        });
        let node = n.clone();
        let router = router.route::<AppendRaft, _, _>(move |req, inc| {
            let node = node.clone();
            async move {
                let part = node.hosted_part(req.partition)?;
                node.lead(&part).await?;
                let out = node.append_raft(&part, req, inc.data).await?;
                Ok((out, Payload::none()))
            }
        });
        let node = n.clone();
        let router = router.route::<WriteTiny, _, _>(move |req, inc| {
            let node = node.clone();
            async move {
                let part = node.hosted_part(req.partition)?;
                node.lead(&part).await?;
                Ok((node.write_tiny(&part, inc.data).await, Payload::none()))
            }
        });
        let node = n.clone();
        let router = router.route::<Overwrite, _, _>(move |req, inc| {
            let node = node.clone();
            async move {
                let part = node.hosted_part(req.partition)?;
                node.lead(&part).await?;
                let out = node.overwrite(&part, req, inc.data).await?;
                Ok((out, Payload::none()))
            }
        });
        let node = n.clone();
        let router = router.route::<Read, _, _>(move |req, _inc| {
            let node = node.clone();
            async move {
                let part = node.hosted_part(req.partition)?;
                node.lead(&part).await?;
                // Every overwrite committed before the read is applied here before it is served:
                // at once while the read gate is open (this leader holds its lease and has applied
                // everything committed), else through a read round on the Raft thread.
                let open = part
                    .gate
                    .as_ref()
                    .is_some_and(|g| g.open_at(std::time::Instant::now()));
                if !open {
                    let raft = node.raft().map_err(unavailable)?;
                    raft.read(part.id.0, |_| ())
                        .await
                        .map_err(|e| node.remote(&part, e))?;
                }
                part.ops.fetch_add(1, Ordering::Relaxed);
                match node.read(&part, &req).await {
                    Ok(b) => Ok((Ok(()), Payload::new(b))),
                    Err(e) => Ok((Err(e), Payload::none())),
                }
            }
        });
        let node = n.clone();
        let router = router.route::<Release, _, _>(move |req, _inc| {
            let node = node.clone();
            async move {
                let part = node.hosted_part(req.partition)?;
                node.lead(&part).await?;
                let out = node
                    .propose(
                        &part,
                        &DataCommand::Release {
                            ranges: req.ranges.clone(),
                        },
                    )
                    .await?;
                if out.is_ok()
                    && let Ok(mut t) = part.tracks.lock()
                {
                    for (e, _, _) in &req.ranges {
                        if !ExtentStore::is_tiny(*e) {
                            t.remove(e);
                        }
                    }
                }
                Ok((out.map(|_| ()), Payload::none()))
            }
        });
        let node = n.clone();
        let router = router.route::<Replicate, _, _>(move |req, inc| {
            let node = node.clone();
            async move {
                let part = node.hosted_part(req.partition)?;
                let (extent, offset) = (req.extent, req.offset);
                let out = node.take_replica(&part, req, inc.data).await;
                if let Err(e) = &out {
                    tracing::debug!(partition = %part.id, %extent, offset, error = %e, "replica refused a packet");
                }
                Ok((out, Payload::none()))
            }
        });
        let node = n.clone();
        let router = router.route::<ListExtents, _, _>(move |req, _inc| {
            let node = node.clone();
            async move {
                let part = node.hosted_part(req.partition)?;
                let applied = part.shared.applied();
                let known: HashMap<ExtentId, u64> = part
                    .tracks
                    .lock()
                    .map(|t| t.iter().map(|(e, t)| (*e, t.committed())).collect())
                    .unwrap_or_default();
                let extents = part
                    .store
                    .extents()
                    .into_iter()
                    .map(|(e, len)| (e, len, known.get(&e).copied().unwrap_or(0)))
                    .collect();
                Ok((Ok(ExtentList { extents, applied }), Payload::none()))
            }
        });
        let node = n.clone();
        let router = router.route::<BlockCrcs, _, _>(move |req, _inc| {
            let node = node.clone();
            async move {
                let part = node.hosted_part(req.partition)?;
                let applied = part.shared.applied();
                let out = part
                    .store
                    .block_crcs(req.extent)
                    .map(|c| (part.store.block_size(), c, applied))
                    .map_err(store_error);
                Ok((out, Payload::none()))
            }
        });
        let node = n;
        router.route::<FetchBlocks, _, _>(move |req, _inc| {
            let node = node.clone();
            async move {
                let part = node.hosted_part(req.partition)?;
                match node.fetch_local(&part, &req) {
                    Ok((applied, data)) => Ok((Ok(applied), Payload::new(data))),
                    Err(e) => Ok((Err(e), Payload::none())),
                }
            }
        })
    }
}

/// Sends one packet to a follower. Past `check_after` without an answer, and every `check_after`
/// after that, the follower is pinged: a live one is waited for (up to `limit`), a silent one fails
/// the packet. A saturated disk makes fsyncs take seconds; that is no reason to drop a replica.
async fn replicate_to(
    client: &Client,
    addr: &str,
    req: &ReplicateRequest,
    data: Payload,
    check_after: Duration,
    limit: Duration,
) -> Result<(), String> {
    let opts = CallOptions {
        timeout: Some(limit),
        ..CallOptions::default()
    };
    let call = client.call_with::<Replicate>(addr, req, data, opts);
    tokio::pin!(call);
    let done = |out: Result<(Result<(), DataError>, Payload), MsgrError>| match out {
        Ok((Ok(()), _)) => Ok(()),
        Ok((Err(e), _)) => Err(e.to_string()),
        Err(e) => Err(e.to_string()),
    };
    loop {
        tokio::select! {
            out = &mut call => return done(out),
            () = tokio::time::sleep(check_after) => {}
        }
        tokio::select! {
            out = &mut call => return done(out),
            alive = alive(client, addr, check_after) => if !alive {
                return Err(format!("no answer within {check_after:?}, and none to a ping"));
            }
        }
    }
}

/// Whether `addr` answers at all: any answer, even an error, means its process and link are up.
async fn alive(client: &Client, addr: &str, within: Duration) -> bool {
    let opts = CallOptions {
        timeout: Some(within),
        ..CallOptions::default()
    };
    match client
        .call_with::<Ping>(addr, &PingRequest {}, Payload::none(), opts)
        .await
    {
        Ok(_) | Err(MsgrError::Remote { .. }) => true,
        Err(_) => false,
    }
}

/// What a client is told when this replica's store cannot take an append or a tiny write: a disk
/// error here is not the client's, and another partition can take the bytes (read-only: write
/// elsewhere). The partition turns read-only until the store works again.
fn write_error(e: StoreError) -> DataError {
    match e {
        StoreError::Failed | StoreError::Io(_) => {
            DataError::ReadOnly(format!("this replica's extent store cannot write: {e}"))
        }
        other => store_error(other),
    }
}

/// A leader whose own disk is full takes no appends: read-only until a re-check finds room.
fn degrade_if_full(part: &Part, e: &DataError) {
    if let DataError::ReadOnly(why) = e {
        part.degrade(why.clone());
    }
}

/// Whether a replica whose extent lengths are `theirs` holds every committed byte.
fn holds(theirs: &HashMap<ExtentId, u64>, committed: &[(ExtentId, u64)]) -> bool {
    committed
        .iter()
        .all(|(e, c)| *c == 0 || theirs.get(e).copied().unwrap_or(0) >= *c)
}

/// What a new leader aligns to, per extent: (the shortest copy, the longest committed length any
/// replica knows). `local` and `known` are the leader's lengths and committed lengths, `lists` the
/// followers' (extent, length, committed). An extent only followers list was created through Raft
/// and not applied here yet (its committed bytes, if any, show up in theirs), unless the entries
/// applied here released it: a follower that has not applied the release yet still lists it, and
/// a track for it would ask for bytes nobody keeps, so it gets none.
fn merge_lengths(
    local: &[(ExtentId, u64)],
    known: &HashMap<ExtentId, u64>,
    lists: &[Vec<(ExtentId, u64, u64)>],
    released: impl Fn(ExtentId) -> bool,
) -> HashMap<ExtentId, (u64, u64)> {
    let mut lens: HashMap<ExtentId, (u64, u64)> = local
        .iter()
        .map(|(e, len)| (*e, (*len, known.get(e).copied().unwrap_or(0))))
        .collect();
    for list in lists {
        let theirs: HashMap<ExtentId, (u64, u64)> =
            list.iter().map(|(e, l, c)| (*e, (*l, *c))).collect();
        for (e, (min, max_c)) in lens.iter_mut() {
            let (l, c) = theirs.get(e).copied().unwrap_or((0, 0));
            *min = (*min).min(l);
            *max_c = (*max_c).max(c);
        }
        for (e, (_, c)) in theirs {
            lens.entry(e).or_insert((0, c));
        }
    }
    lens.retain(|e, _| !released(*e));
    lens
}

/// The first replica (node id, extent lengths) that holds every committed byte.
fn holding_all(
    committed: &[(ExtentId, u64)],
    lists: &[(u64, HashMap<ExtentId, u64>)],
) -> Option<u64> {
    lists
        .iter()
        .find(|(_, theirs)| holds(theirs, committed))
        .map(|(node, _)| *node)
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

/// Takes from the inbox the packets that continue the extent from where the leader wrote up to, as
/// one batch of at most [`MAX_BATCH`] bytes, with its offset; refuses the stale ones (below that
/// point). None, and the writer stops: nothing to write yet.
fn take_batch(track: &Track, extent: ExtentId) -> Option<(u64, Vec<Arrived>)> {
    let mut inbox = track.inbox.lock().ok()?;
    let start = *track.next.borrow();
    let mut batch: Vec<Arrived> = Vec::new();
    let (mut at, mut bytes) = (start, 0);
    while let Some(first) = inbox.waiting.first_entry() {
        let offset = *first.key();
        let len = first.get().data.bytes.len();
        if offset < start {
            let a = first.remove();
            let _ = a.done.send(Err(DataError::OutOfRange {
                extent,
                offset,
                len: len as u64,
                committed: track.committed(),
            }));
            continue;
        }
        if offset != at || (bytes > 0 && bytes + len > MAX_BATCH) {
            break;
        }
        batch.push(first.remove());
        at += len as u64;
        bytes += len;
    }
    if batch.is_empty() {
        inbox.writing = false;
        return None;
    }
    Some((start, batch))
}

/// The packets of a batch as one data segment, with its CRC combined from theirs.
fn join_packets(batch: &[Arrived]) -> Payload {
    if let [one] = batch {
        return Payload::with_crc(one.data.bytes.clone(), one.data.crc());
    }
    let total = batch.iter().map(|a| a.data.bytes.len()).sum();
    let mut all = bytes::BytesMut::with_capacity(total);
    let mut crc = 0;
    for a in batch {
        all.extend_from_slice(&a.data.bytes);
        crc = nacre_types::crc32c_combine(crc, a.data.crc(), a.data.bytes.len() as u64);
    }
    Payload::with_crc(all.freeze(), crc)
}

fn check_packet(data: &Payload) -> Result<(), DataError> {
    if data.bytes.is_empty() {
        return Err(DataError::Invalid("empty packet".into()));
    }
    if data.bytes.len() > MAX_PACKET {
        return Err(DataError::Invalid(format!(
            "packet of {} bytes; at most {MAX_PACKET}",
            data.bytes.len()
        )));
    }
    Ok(())
}

impl NodeDuties for DataNode {
    fn role(&self) -> &'static str {
        "data"
    }

    fn id(&self) -> Option<NodeId> {
        DataNode::id(self)
    }

    fn adopt(&self, id: NodeId) -> BoxFuture<'_, Result<(), String>> {
        Box::pin(DataNode::adopt(self, id))
    }

    fn tick(&self) -> BoxFuture<'_, ()> {
        Box::pin(self.maintain())
    }

    fn stop(&self) -> BoxFuture<'_, ()> {
        Box::pin(async move {
            if let Some(r) = self.inner.raft.get() {
                let _ = r.stop().await;
            }
        })
    }
}

impl PartitionHost for DataNode {
    fn hosted(&self) -> Vec<PartitionSpec> {
        self.inner.registry.specs()
    }

    fn reports(&self) -> Vec<PartitionReport> {
        self.inner
            .reports
            .lock()
            .map(|r| r.clone())
            .unwrap_or_default()
    }

    fn used(&self) -> u64 {
        self.inner
            .parts
            .lock()
            .map(|p| p.values().map(|p| p.used()).sum())
            .unwrap_or(0)
    }

    fn ensure(&self, spec: PartitionSpec) -> BoxFuture<'_, Result<(), String>> {
        Box::pin(async move {
            if spec.kind != PartitionKind::Data {
                return Err(format!(
                    "a data node cannot host meta partition {}",
                    spec.id
                ));
            }
            self.open_partition(&spec).await?;
            self.inner.registry.ensure(spec).await
        })
    }

    fn remove(&self, id: PartitionId) -> BoxFuture<'_, Result<(), String>> {
        Box::pin(async move {
            if let Ok(raft) = self.raft() {
                match raft.remove_group(id.0).await {
                    Ok(()) | Err(RaftError::UnknownGroup(_)) => {}
                    Err(e) => return Err(e.to_string()),
                }
            }
            if let Ok(mut p) = self.inner.parts.lock() {
                p.remove(&id);
            }
            self.inner.registry.remove(id).await?;
            let dir = self.part_dir(id);
            tokio::task::spawn_blocking(move || match std::fs::remove_dir_all(&dir) {
                Ok(()) => Ok(()),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
                Err(e) => Err(e.to_string()),
            })
            .await
            .map_err(err_str)?
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lens(v: &[(u64, u64)]) -> HashMap<ExtentId, u64> {
        v.iter().map(|(e, l)| (ExtentId(*e), *l)).collect()
    }

    /// The leader hands over only to a replica holding every committed byte; extents with
    /// nothing committed do not count.
    #[test]
    fn a_leader_lacking_bytes_picks_a_replica_that_holds_them_all() {
        let committed = [(ExtentId(1), 100), (ExtentId(2), 50), (ExtentId(3), 0)];
        let short = (2, lens(&[(1, 100), (2, 49)]));
        let missing = (3, lens(&[(1, 100)]));
        let whole = (4, lens(&[(1, 120), (2, 50)]));
        assert_eq!(
            holding_all(&committed, &[short.clone(), missing.clone()]),
            None
        );
        assert_eq!(
            holding_all(&committed, &[short, missing, whole.clone()]),
            Some(4)
        );
        assert!(holds(&whole.1, &committed));
        assert!(holds(&lens(&[]), &[(ExtentId(3), 0)]));
    }

    fn arrive(
        track: &Track,
        offset: u64,
        len: usize,
    ) -> tokio::sync::oneshot::Receiver<Result<(), DataError>> {
        let (done, rx) = tokio::sync::oneshot::channel();
        let data = Payload::new(Bytes::from(vec![offset as u8; len]));
        let mut inbox = track.inbox.lock().unwrap();
        inbox.waiting.insert(
            offset,
            Arrived {
                data,
                sync: false,
                done,
            },
        );
        inbox.writing = true;
        rx
    }

    /// A batch takes the packets that continue the extent from where the leader wrote up to, in
    /// offset order, up to a gap or [`MAX_BATCH`] bytes; packets below that point are refused;
    /// with nothing to take, the writer stops.
    #[test]
    fn a_batch_takes_the_packets_that_continue_the_extent() {
        let e = ExtentId(1024);
        let track = Track::new(100, 100);
        let mut stale = arrive(&track, 50, 10);
        let _a = arrive(&track, 100, 10);
        let _b = arrive(&track, 110, 20);
        let _gap = arrive(&track, 140, 5);
        let (at, batch) = take_batch(&track, e).unwrap();
        assert_eq!(at, 100);
        let lens: Vec<usize> = batch.iter().map(|a| a.data.bytes.len()).collect();
        assert_eq!(lens, [10, 20]);
        assert!(matches!(
            stale.try_recv(),
            Ok(Err(DataError::OutOfRange { offset: 50, .. }))
        ));
        // Written: the packet after the gap waits for the bytes before it.
        track.next.send_replace(130);
        assert!(take_batch(&track, e).is_none());
        assert!(!track.inbox.lock().unwrap().writing);
        assert!(track.inbox.lock().unwrap().waiting.contains_key(&140));

        let track = Track::new(0, 0);
        let mut rxs = Vec::new();
        for k in 0..=(MAX_BATCH / MAX_PACKET) as u64 {
            rxs.push(arrive(&track, k * MAX_PACKET as u64, MAX_PACKET));
        }
        let (at, batch) = take_batch(&track, e).unwrap();
        assert_eq!((at, batch.len()), (0, MAX_BATCH / MAX_PACKET));
        track.next.send_replace(MAX_BATCH as u64);
        let (at, batch) = take_batch(&track, e).unwrap();
        assert_eq!((at, batch.len()), (MAX_BATCH as u64, 1));
    }

    /// A batch's data is its packets' bytes in order, with the CRC of the whole.
    #[test]
    fn a_batch_joins_its_packets_with_their_combined_crc() {
        let track = Track::new(0, 0);
        let _rx: Vec<_> = [(0, 3000), (3000, 5), (3005, 70_000)]
            .into_iter()
            .map(|(o, l)| arrive(&track, o, l))
            .collect();
        let (_, batch) = take_batch(&track, ExtentId(1024)).unwrap();
        let joined = join_packets(&batch);
        let mut want = Vec::new();
        for a in &batch {
            want.extend_from_slice(&a.data.bytes);
        }
        assert_eq!(joined.bytes, want);
        assert_eq!(joined.crc(), nacre_types::crc32c(&want));
        let one = join_packets(&batch[..1]);
        assert_eq!(
            one.bytes.as_ptr(),
            batch[0].data.bytes.as_ptr(),
            "one packet: no copy"
        );
    }

    /// A new leader keeps the shortest copy and the longest committed length; an extent only a
    /// follower lists is tracked (created and not applied here yet) unless this leader applied
    /// its release, which that follower has not yet.
    #[test]
    fn alignment_skips_extents_this_leader_saw_released() {
        let (kept, new, gone) = (ExtentId(1024), ExtentId(1030), ExtentId(1025));
        let local = [(kept, 9000)];
        let known = lens(&[(1024, 8000)]);
        let f = vec![(kept, 8500, 8500), (gone, 7000, 6000)];
        let g = vec![(kept, 9000, 8000), (gone, 7000, 6000), (new, 100, 100)];
        let merged = merge_lengths(&local, &known, &[f, g], |e| e == gone);
        let want: HashMap<ExtentId, (u64, u64)> = [(kept, (8500, 8500)), (new, (0, 100))]
            .into_iter()
            .collect();
        assert_eq!(merged, want);
        // Not released here: a follower's committed bytes the leader lacks.
        let merged = merge_lengths(&local, &known, &[vec![(gone, 7000, 6000)]], |_| false);
        assert_eq!(merged.get(&gone), Some(&(0, 6000)));
        assert_eq!(merged.get(&kept), Some(&(0, 8000)));
    }
}
