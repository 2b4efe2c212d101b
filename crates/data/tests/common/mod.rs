//! A three-node data partition in one process: `DataNode`s over the in-memory network, each given
//! its node id directly and the partition spec by the test (no master). Waits are bounded: every
//! loop has a deadline, and polls (where no event exists) are short.
#![allow(clippy::unwrap_used, dead_code)]

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use bytes::Bytes;
use nacre_api::data::DataError;
use nacre_api::data::*;
use nacre_api::master::{PartitionKind, PartitionSpec, Replica};
use nacre_cluster::PartitionHost;
use nacre_data::{DataNode, DataNodeConfig};
use nacre_msgr::mem::MemNetwork;
use nacre_msgr::{Client, Messenger, MsgrConfig, MsgrError, Payload};
use nacre_proto::msg::Rpc;
use nacre_types::{ErrorCode, ExtentId, NodeId, PartitionId};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio::time::Instant;

/// The one data partition every test uses.
pub const PID: PartitionId = PartitionId(7);
/// Small CRC blocks, so that a few KiB span several of them.
pub const BS: u32 = 4096;
/// Bound on every wait for the cluster to reach a state.
pub const DEADLINE: Duration = Duration::from_secs(20);
/// Interval of the few polls (conditions with no event to wait on).
pub const POLL: Duration = Duration::from_millis(20);

/// The scenarios share a 2-core machine: running them one at a time keeps Raft's 20 ms ticks and
/// the 1 s replication timeout meaningful.
pub static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

pub use nacre_testkit::pattern;

pub fn config(dir: &Path) -> DataNodeConfig {
    let mut cfg = DataNodeConfig::new(dir.to_path_buf());
    cfg.raft.tick_interval = Duration::from_millis(20);
    // The read lease is derived from the tick: recompute it for the shorter tick, else it would
    // outlast the election timeout.
    cfg.raft = cfg.raft.with_read_lease();
    // A ReadIndex a new leader gets before it committed an entry of its term is dropped by raft-rs
    // and only fails at this timeout (callers retry reads): keep it short.
    cfg.raft.request_timeout_ticks = 25;
    cfg.store.block_size = BS;
    cfg.report_interval = Duration::from_millis(50);
    cfg.replicate_timeout = Duration::from_secs(1);
    cfg
}

/// One data node "process": its messenger, server, and run loop.
pub struct Proc {
    pub addr: String,
    pub node: DataNode,
    msgr: Messenger,
    stop: watch::Sender<bool>,
    runner: JoinHandle<()>,
    server: JoinHandle<std::io::Result<()>>,
    _id: watch::Sender<Option<NodeId>>,
}

impl Proc {
    /// Starts node `i` (id `i + 1`, host `data{i}`) on `root/data{i}`, listening at `at` (a restart)
    /// or a fresh port.
    pub async fn start(
        net: &MemNetwork,
        i: usize,
        root: &Path,
        at: Option<&str>,
        tweak: fn(&mut DataNodeConfig),
    ) -> Self {
        let host = format!("data{i}");
        let msgr = Messenger::new(
            &host,
            MsgrConfig {
                workers: 1,
                ..MsgrConfig::default()
            },
            Arc::new(net.transport(&host)),
        )
        .unwrap();
        let bind = at.map_or_else(|| format!("{host}:0"), str::to_string);
        let l = msgr.transport().bind(&bind).await.unwrap();
        let addr = l.local_addr().unwrap();
        let dir = root.join(&host);
        let mut cfg = config(&dir);
        tweak(&mut cfg);
        // A stopped instance's raft store has released its log's lock once its stop returned.
        let node = DataNode::open(&cfg, msgr.client())
            .unwrap_or_else(|e| panic!("cannot open {}: {e}", dir.display()));
        let (stop, _) = watch::channel(false);
        let mut rx = stop.subscribe();
        let server = tokio::spawn(msgr.serve(l, Arc::new(node.router()), async move {
            let _ = rx.wait_for(|s| *s).await;
        }));
        // Published before the run loop starts: it adopts it at once.
        let (id_tx, id_rx) = watch::channel(Some(NodeId(i as u64 + 1)));
        let (run, mut rx) = (node.clone(), stop.subscribe());
        let runner = tokio::spawn(async move {
            run.run(id_rx, async move {
                let _ = rx.wait_for(|s| *s).await;
            })
            .await;
        });
        Self {
            addr,
            node,
            msgr,
            stop,
            runner,
            server,
            _id: id_tx,
        }
    }

    /// Stops the run loop (and with it the raft store, whose log is closed when it returns), the
    /// server and the messenger.
    pub async fn shut(self) {
        let _ = self.stop.send(true);
        tokio::time::timeout(DEADLINE, self.runner)
            .await
            .expect("the run loop did not stop")
            .unwrap();
        let _ = tokio::time::timeout(DEADLINE, self.server)
            .await
            .expect("the server did not stop");
        drop(self.node);
        let msgr = self.msgr;
        tokio::task::spawn_blocking(move || msgr.shutdown())
            .await
            .unwrap();
    }
}

/// Calls that follow the partition's leader.
#[derive(Clone)]
pub struct Api {
    pub client: Client,
    pub addrs: Arc<Vec<String>>,
    leader: Arc<AtomicUsize>,
}

pub type Out<T> = Result<Result<T, DataError>, MsgrError>;

impl Api {
    /// Calls `R` on the replica believed to lead, following `NotLeader` hints. Retries answers given
    /// before the request had any effect (not the leader, partition not hosted yet, not aligned, no
    /// connection; `Unavailable` comes from the leadership check, or for Raft ops a dropped
    /// proposal), and, if the op is `idempotent`, a Raft timeout.
    pub async fn call<R: Rpc>(
        &self,
        req: &R::Request,
        data: &Bytes,
        idempotent: bool,
    ) -> Result<(R::Response, Payload, usize), MsgrError> {
        let deadline = Instant::now() + DEADLINE;
        let n = self.addrs.len();
        let mut i = self.leader.load(Ordering::Relaxed);
        loop {
            let payload = if data.is_empty() {
                Payload::none()
            } else {
                Payload::new(data.clone())
            };
            let e = match self.client.call::<R>(&self.addrs[i], req, payload).await {
                Ok((r, p)) => {
                    self.leader.store(i, Ordering::Relaxed);
                    return Ok((r, p, i));
                }
                Err(e) => e,
            };
            let (next, hinted) = match &e {
                MsgrError::Remote { error, .. } if error.code() == ErrorCode::NotLeader => {
                    match error
                        .leader_hint
                        .as_ref()
                        .and_then(|h| self.addrs.iter().position(|a| a == h))
                        .filter(|&j| j != i)
                    {
                        Some(j) => (j, true),
                        None => ((i + 1) % n, false),
                    }
                }
                MsgrError::Remote { error, .. }
                    if matches!(
                        error.code(),
                        ErrorCode::UnknownGroup | ErrorCode::Unavailable
                    ) =>
                {
                    ((i + 1) % n, false)
                }
                MsgrError::Connect { .. } => ((i + 1) % n, false),
                MsgrError::Remote { error, .. }
                    if idempotent && error.code() == ErrorCode::DeadlineExceeded =>
                {
                    (i, false)
                }
                _ => return Err(e),
            };
            if Instant::now() > deadline {
                return Err(e);
            }
            if !hinted {
                tokio::time::sleep(POLL).await;
            }
            i = next;
        }
    }

    /// The index of the replica that leads (and has aligned) the partition.
    pub async fn leader(&self) -> usize {
        // A read of an extent that does not exist: served (NotFound) only by the leader.
        let req = ReadRequest {
            partition: PID,
            extent: ExtentId(u64::MAX),
            offset: 0,
            len: 1,
        };
        let (r, _, i) = self.call::<Read>(&req, &Bytes::new(), true).await.unwrap();
        assert!(matches!(r, Err(DataError::NotFound(_))), "{r:?}");
        i
    }

    pub async fn create(&self) -> Out<ExtentId> {
        let req = CreateExtentRequest { partition: PID };
        Ok(self
            .call::<CreateExtent>(&req, &Bytes::new(), false)
            .await?
            .0)
    }

    pub async fn append(&self, extent: ExtentId, offset: u64, data: &[u8]) -> Out<Written> {
        self.append_with(extent, offset, data, true).await
    }

    /// An append that is synced on every replica before its reply, or (without `sync`) only written.
    pub async fn append_with(
        &self,
        extent: ExtentId,
        offset: u64,
        data: &[u8],
        sync: bool,
    ) -> Out<Written> {
        let req = AppendRequest {
            partition: PID,
            extent,
            offset,
            sync,
        };
        Ok(self
            .call::<Append>(&req, &Bytes::copy_from_slice(data), false)
            .await?
            .0)
    }

    pub async fn append_raft(&self, extent: ExtentId, offset: u64, data: &[u8]) -> Out<Written> {
        let req = AppendRequest {
            partition: PID,
            extent,
            offset,
            sync: true,
        };
        Ok(self
            .call::<AppendRaft>(&req, &Bytes::copy_from_slice(data), false)
            .await?
            .0)
    }

    pub async fn write_tiny(&self, data: &[u8]) -> Out<Written> {
        let req = WriteTinyRequest { partition: PID };
        Ok(self
            .call::<WriteTiny>(&req, &Bytes::copy_from_slice(data), false)
            .await?
            .0)
    }

    pub async fn overwrite(&self, extent: ExtentId, offset: u64, data: &[u8]) -> Out<()> {
        let req = OverwriteRequest {
            partition: PID,
            extent,
            offset,
        };
        Ok(self
            .call::<Overwrite>(&req, &Bytes::copy_from_slice(data), true)
            .await?
            .0)
    }

    pub async fn read(&self, extent: ExtentId, offset: u64, len: u32) -> Out<Bytes> {
        let req = ReadRequest {
            partition: PID,
            extent,
            offset,
            len,
        };
        let (r, data, _) = self.call::<Read>(&req, &Bytes::new(), true).await?;
        Ok(r.map(|()| data.bytes))
    }

    /// Reads `[offset, offset + len)` in pieces of at most 128 KiB.
    pub async fn read_all(&self, extent: ExtentId, offset: u64, len: u64) -> Vec<u8> {
        let mut out = Vec::with_capacity(len as usize);
        let mut at = offset;
        while at < offset + len {
            let n = (offset + len - at).min(128 << 10) as u32;
            let b = self.read(extent, at, n).await.unwrap().unwrap();
            assert_eq!(b.len(), n as usize);
            out.extend_from_slice(&b);
            at += u64::from(n);
        }
        out
    }

    /// The extent's committed length as the leader sees it (a read past everything reports it).
    pub async fn committed(&self, extent: ExtentId) -> u64 {
        match self.read(extent, 0, u32::MAX).await.unwrap() {
            Err(DataError::OutOfRange { committed, .. }) => committed,
            other => panic!("expected OutOfRange, got {other:?}"),
        }
    }

    pub async fn release(&self, ranges: Vec<(ExtentId, u64, u64)>) -> Out<()> {
        let req = ReleaseRequest {
            partition: PID,
            ranges,
        };
        Ok(self.call::<Release>(&req, &Bytes::new(), true).await?.0)
    }

    /// Replica-to-replica ops, sent by the test to one node.
    pub async fn list(&self, i: usize) -> Result<ExtentList, MsgrError> {
        let req = ListExtentsRequest { partition: PID };
        let (r, _) = self
            .client
            .call::<ListExtents>(&self.addrs[i], &req, Payload::none())
            .await?;
        Ok(r.unwrap())
    }

    /// The local length of `extent` on node `i` (0 if it has none).
    pub async fn local_len(&self, i: usize, extent: ExtentId) -> u64 {
        let list = self.list(i).await.unwrap();
        list.extents
            .iter()
            .find(|(e, _, _)| *e == extent)
            .map_or(0, |(_, l, _)| *l)
    }

    /// Every byte node `i` holds of `extent`, verified block by block (`FetchBlocks`).
    pub async fn fetch_all(&self, i: usize, extent: ExtentId) -> Out<Vec<u8>> {
        let mut out = Vec::new();
        let mut first = 0;
        loop {
            let req = FetchBlocksRequest {
                partition: PID,
                extent,
                first,
                count: 64,
            };
            let (r, data) = self
                .client
                .call::<FetchBlocks>(&self.addrs[i], &req, Payload::none())
                .await?;
            if let Err(e) = r {
                return Ok(Err(e));
            }
            out.extend_from_slice(&data.bytes);
            if data.bytes.len() < 64 * BS as usize {
                return Ok(Ok(out));
            }
            first += 64;
        }
    }

    pub async fn block_crcs(&self, i: usize, extent: ExtentId) -> Out<Vec<u32>> {
        let req = BlockCrcsRequest {
            partition: PID,
            extent,
        };
        let (r, _) = self
            .client
            .call::<BlockCrcs>(&self.addrs[i], &req, Payload::none())
            .await?;
        Ok(r.map(|(_, crcs, _)| crcs))
    }
}

/// Three data nodes hosting [`PID`], and a client messenger.
pub struct Cluster {
    pub net: MemNetwork,
    pub root: tempfile::TempDir,
    pub procs: Vec<Option<Proc>>,
    pub api: Api,
    cli: Messenger,
    tweak: fn(&mut DataNodeConfig),
}

/// Polls `check` until it returns `Some`, at most [`DEADLINE`].
pub async fn eventually<T, F, Fut>(what: &str, check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    nacre_testkit::eventually(DEADLINE, POLL, check)
        .await
        .unwrap_or_else(|| panic!("timed out waiting for {what}"))
}

/// Re-checks `check` each time node `node` applies Raft entries, until it returns `Some` (at most
/// [`DEADLINE`]).
pub async fn until_applied<T, F, Fut>(node: &DataNode, what: &str, check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let mut applied = node.applied().expect("the node's raft store runs");
    nacre_testkit::until_changed(&mut applied, DEADLINE, check)
        .await
        .unwrap_or_else(|| panic!("timed out waiting for {what} (or the raft store stopped)"))
}

impl Cluster {
    pub async fn start(seed: u64) -> Self {
        Self::start_with(seed, |_| {}).await
    }

    /// [`Cluster::start`] with every node's configuration changed by `tweak`.
    pub async fn start_with(seed: u64, tweak: fn(&mut DataNodeConfig)) -> Self {
        let net = MemNetwork::new(seed);
        let root = tempfile::tempdir().unwrap();
        let mut procs = Vec::new();
        for i in 0..3 {
            procs.push(Some(Proc::start(&net, i, root.path(), None, tweak).await));
        }
        let addrs: Vec<String> = procs.iter().flatten().map(|p| p.addr.clone()).collect();
        let spec = PartitionSpec {
            id: PID,
            volume: "vol".into(),
            kind: PartitionKind::Data,
            replicas: addrs
                .iter()
                .enumerate()
                .map(|(i, a)| Replica {
                    node: NodeId(i as u64 + 1),
                    addr: a.clone(),
                })
                .collect(),
            created_epoch: 1,
        };
        for p in procs.iter().flatten() {
            // Fails until the run loop has adopted the node's id.
            eventually("the node to host the partition", || async {
                p.node.ensure(spec.clone()).await.ok()
            })
            .await;
        }
        let cli = Messenger::new(
            "cli",
            MsgrConfig {
                workers: 1,
                ..MsgrConfig::default()
            },
            Arc::new(net.transport("cli")),
        )
        .unwrap();
        let api = Api {
            client: cli.client(),
            addrs: Arc::new(addrs),
            leader: Arc::new(AtomicUsize::new(0)),
        };
        Self {
            net,
            root,
            procs,
            api,
            cli,
            tweak,
        }
    }

    pub fn node(&self, i: usize) -> &DataNode {
        &self.procs[i].as_ref().unwrap().node
    }

    pub fn host(i: usize) -> String {
        format!("data{i}")
    }

    /// The data file of `extent` on node `i`.
    pub fn data_file(&self, i: usize, extent: ExtentId) -> PathBuf {
        self.root
            .path()
            .join(Self::host(i))
            .join("extents")
            .join(PID.0.to_string())
            .join(format!("{}.data", extent.0))
    }

    /// Cuts node `i` off the network at once (connections reset), then stops it.
    pub async fn crash(&mut self, i: usize) {
        self.net.isolate(&Self::host(i));
        self.procs[i].take().unwrap().shut().await;
    }

    /// Starts node `i` again on its directory and address (healing its links) and waits until it
    /// hosts the partition again.
    pub async fn restart(&mut self, i: usize) {
        self.net.heal_host(&Self::host(i));
        self.revive(i).await;
    }

    /// [`Cluster::restart`] without healing its links first.
    pub async fn revive(&mut self, i: usize) {
        let addr = self.api.addrs[i].clone();
        self.procs[i] =
            Some(Proc::start(&self.net, i, self.root.path(), Some(&addr), self.tweak).await);
        eventually("the restarted node to host the partition", || async {
            self.api.list(i).await.ok()
        })
        .await;
    }

    /// Runs repair rounds on the followers and alignment/re-check rounds on the leader `l` until it
    /// takes appends again (its report no longer says full).
    pub async fn wait_writable(&self, l: usize) {
        eventually("the partition to become read-write", || async {
            // Followers start their repairs (in the background), then the leader re-checks them.
            for (i, p) in self.procs.iter().enumerate() {
                if let Some(p) = p.as_ref().filter(|_| i != l) {
                    p.node.maintain().await;
                }
            }
            let node = self.node(l);
            node.maintain().await;
            let r = node.reports().into_iter().find(|r| r.id == PID)?;
            (r.leader && !r.full).then_some(())
        })
        .await;
    }

    /// Waits until node `i` holds `want` for `extent` (verified block by block): exactly, or
    /// followed by bytes past the committed length (which are never served) unless `exact`.
    pub async fn wait_replica(&self, i: usize, extent: ExtentId, want: &[u8], exact: bool) {
        let what = format!("node {i} to hold {} bytes of {extent}", want.len());
        let deadline = Instant::now() + DEADLINE;
        loop {
            let have = self.api.fetch_all(i, extent).await;
            if let Ok(Ok(have)) = &have
                && (have == want || (!exact && have.starts_with(want)))
            {
                return;
            }
            if Instant::now() > deadline {
                let seen = have
                    .map(|h| h.map(|h| (h.len(), h.iter().zip(want).position(|(a, b)| a != b))));
                panic!(
                    "timed out waiting for {what}: last saw (length, first difference) {seen:?}"
                );
            }
            tokio::time::sleep(POLL).await;
        }
    }

    pub async fn shutdown(self) {
        for p in self.procs.into_iter().flatten() {
            p.shut().await;
        }
        let cli = self.cli;
        tokio::task::spawn_blocking(move || cli.shutdown())
            .await
            .unwrap();
    }
}
