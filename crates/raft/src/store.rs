//! The raft store driver: runs a node's [`RaftNode`] on a thread of its own and connects it to its
//! peers through the messenger.
//!
//! One loop per node: every `tick_interval` it ticks all awake groups (hibernating ones cost nothing),
//! drains commands and inbound messages, runs one `Ready` round (one log write for every group), and
//! sends what every group has for a peer in **one** frame per peer. Each node also sends an empty
//! batch to every peer every `keepalive_ticks` ticks; a peer not heard from for `peer_timeout_ticks`
//! is reported down to the `RaftNode`, which wakes the followers of groups it led, and the lowest
//! live voter of each campaigns at once.
//! With `StoreConfig::async_log` the round's log write goes to a `raft-log-N` thread instead
//! (see `LogWriter`), and the loop goes on while it syncs.
//!
//! The thread is dedicated because raft-engine's read cache is per thread (see `EngineLogStore`).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::thread;
use std::time::Duration;

use bytes::Bytes;
use nacre_msgr::{Client, MsgrError, Payload};
use nacre_proto::msg::raft::{RaftBatch, RaftBatchRpc, RaftEnvelope};
use nacre_proto::msg::{Rpc, encode_body};
use protobuf::Message as _;
use raft::eraftpb::{ConfChangeV2, Message};
use tokio::sync::{mpsc, oneshot, watch};

use crate::log::{GroupId, LogError, LogStore, LogWrite};
use crate::node::{
    LogJob, NodeConfig, ProposalId, RaftError, RaftNode, ReadGate, StateMachine, Written,
};

static EXIT_ON_LOG_FAILURE: std::sync::atomic::AtomicBool =
    std::sync::atomic::AtomicBool::new(false);

/// Makes a failed raft log write end the process (exit code 74) instead of only stopping that
/// store. A server process hosts one role: with its log gone it would still answer pings and
/// heartbeats while taking part in nothing; exiting is what its supervisor (and its peers' failure
/// detection) understands. `nacre up` runs every node in one process and leaves this off.
pub fn exit_process_on_log_failure(on: bool) {
    EXIT_ON_LOG_FAILURE.store(on, std::sync::atomic::Ordering::Relaxed);
}

/// Settings of a raft store.
#[derive(Clone, Debug)]
pub struct StoreConfig {
    pub node: NodeConfig,
    /// Length of one logical tick.
    pub tick_interval: Duration,
    /// Ticks between node-level keepalives to each peer.
    pub keepalive_ticks: u64,
    /// Ticks without hearing from a peer before it is considered down: the followers of groups
    /// it led give up its lease and the lowest live voter campaigns at once. Must stay above the
    /// read lease (a third of the minimum election timeout) plus clock drift.
    pub peer_timeout_ticks: u64,
    /// Ticks after which a proposal or read still unanswered fails with [`RaftError::Timeout`] (its
    /// outcome is then unknown: it may still be applied).
    pub request_timeout_ticks: u64,
    /// How often log files whose entries are all compacted are reclaimed.
    pub purge_interval: Duration,
    /// A leader's new entries go to the followers before its own log write (which then overlaps
    /// theirs) rather than after it. Off by default: with every replica's log on one disk, as in
    /// `nacre up` and on our benchmark host, the overlapping syncs slow each other down and the
    /// extra thread wake-ups cost throughput (measured in docs/benchmarks.md, "Appends before
    /// the leader's write"); with replicas on separate disks it takes one sync off each commit.
    pub early_appends: bool,
    /// Log writes are made by a thread of their own while the Raft thread goes on: it steps
    /// acknowledgements, commits, applies and answers during a sync, and gathers the next
    /// round's entries, which the writer then writes and syncs together (raft-rs's asynchronous
    /// Ready). Synchronously, each round waits for its sync, and so does everything that arrives
    /// meanwhile, however little it has to write.
    pub async_log: bool,
    /// The loop runs as a task on one of the messenger's workers instead of on a thread of its
    /// own. A proposal from a request handler, a peer's message read by the messenger and the
    /// answer back to the handler then each pass between tasks of one thread instead of waking
    /// another one: at one write in flight that is four or five cross-thread wake-ups fewer per
    /// Raft write on the leader and two per follower (docs/benchmarks.md, "Overwrites patch the
    /// block CRC; the Raft loop on the messenger's worker"). The loop's applies and log reads then hold up that worker's
    /// connections while they run, so it suits state machines whose applies are short.
    pub on_msgr_worker: bool,
    /// Times every synced log write (entries, hard state, snapshots: the `fdatasync` every commit
    /// waits for) into this histogram, e.g. a node's `nacre_raft_log_sync_seconds`.
    pub log_sync_seconds: Option<prometheus_client::metrics::histogram::Histogram>,
}

impl Default for StoreConfig {
    fn default() -> Self {
        Self {
            node: NodeConfig::default(),
            tick_interval: Duration::from_millis(100),
            // A keepalive every tick and a peer down after 800 ms of silence: a leader cut off
            // from the network costs its groups about 0.9 s (the timeout, then an immediate
            // campaign), under the 1 s an application should wait at most, and a loop round of
            // up to 700 ms (a node under heavy disk load) does not make its peers count it down.
            keepalive_ticks: 1,
            peer_timeout_ticks: 8,
            request_timeout_ticks: 100,
            purge_interval: Duration::from_secs(10),
            early_appends: false,
            async_log: false,
            on_msgr_worker: false,
            log_sync_seconds: None,
        }
    }
}

impl StoreConfig {
    /// Turns on read leases of a third of the minimum election timeout (`election_tick` ticks): a
    /// leader confirmed by a quorum answers reads without a round trip for that long.
    pub fn with_read_lease(mut self) -> Self {
        let ticks = u32::try_from(self.node.election_tick).unwrap_or(u32::MAX);
        self.node.read_lease = self.tick_interval * ticks / 3;
        self
    }
}

/// A loop round (commands, one Ready) longer than this is logged.
const SLOW_ROUND: Duration = Duration::from_millis(300);

type Reader<S> = Box<dyn FnOnce(Result<&S, RaftError>) + Send>;
/// Gets the state machine and whether this node leads the group.
type LocalReader<S> = Box<dyn FnOnce(Result<(&S, bool), RaftError>) + Send>;
type Reply = oneshot::Sender<Result<Vec<u8>, RaftError>>;

enum Cmd<S> {
    AddGroup {
        group: GroupId,
        voters: Vec<u64>,
        sm: S,
        /// With the group's read gate, so that a caller needs no second turn of the loop.
        reply: oneshot::Sender<Result<Option<Arc<ReadGate>>, RaftError>>,
    },
    Propose {
        group: GroupId,
        command: Vec<u8>,
        reply: oneshot::Sender<Result<Vec<u8>, RaftError>>,
    },
    Read {
        group: GroupId,
        reader: Reader<S>,
    },
    LocalRead {
        group: GroupId,
        reader: LocalReader<S>,
    },
    AddPeers {
        peers: BTreeMap<u64, String>,
    },
    /// A connection to `peer` was refused.
    Refused {
        peer: u64,
    },
    RemoveGroup {
        group: GroupId,
        reply: oneshot::Sender<Result<(), RaftError>>,
    },
    Inbound(RaftBatch),
    ChangeMembership {
        group: GroupId,
        change: ConfChangeV2,
        reply: oneshot::Sender<Result<Vec<u8>, RaftError>>,
    },
    TransferLeader {
        group: GroupId,
        to: u64,
        reply: oneshot::Sender<Result<(), RaftError>>,
    },
    Status {
        reply: oneshot::Sender<StoreStatus>,
    },
    Leader {
        group: GroupId,
        reply: oneshot::Sender<(u64, u64)>,
    },
    Gate {
        group: GroupId,
        reply: oneshot::Sender<Option<Arc<ReadGate>>>,
    },
    Stop {
        reply: oneshot::Sender<()>,
    },
    /// The log writer wrote `jobs` jobs (see [`StoreConfig::async_log`]).
    Written {
        jobs: usize,
        written: Vec<Written>,
        finished: Vec<(ProposalId, Result<Vec<u8>, RaftError>)>,
    },
    /// The log writer failed: what the log holds is unknown.
    LogFailed(RaftError),
    /// A snapshot's durability barrier finished (it ran on the blocking pool).
    BarrierDone {
        group: GroupId,
        token: u64,
        result: Result<(), crate::BarrierError>,
    },
}

/// A snapshot of a store's groups, for tests, metrics and the master.
#[derive(Clone, Debug, Default)]
pub struct StoreStatus {
    pub groups: usize,
    pub leaders: usize,
    pub hibernating: usize,
}

/// Talks to a running raft store. Cheap to clone; the store stops when every handle is dropped.
pub struct RaftHandle<S: StateMachine> {
    id: u64,
    tx: mpsc::UnboundedSender<Cmd<S>>,
    applied: watch::Receiver<u64>,
    down: watch::Receiver<BTreeSet<u64>>,
}

impl<S: StateMachine> Clone for RaftHandle<S> {
    fn clone(&self) -> Self {
        Self {
            id: self.id,
            tx: self.tx.clone(),
            applied: self.applied.clone(),
            down: self.down.clone(),
        }
    }
}

impl<S: StateMachine> std::fmt::Debug for RaftHandle<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RaftHandle").field("id", &self.id).finish()
    }
}

fn stopped() -> RaftError {
    RaftError::Raft("raft store stopped".into())
}

impl<S: StateMachine> RaftHandle<S> {
    pub fn id(&self) -> u64 {
        self.id
    }

    /// The number of log entries this store has applied (all groups), updated after every Ready
    /// round that applied something: wait on it instead of polling a state machine.
    pub fn applied(&self) -> watch::Receiver<u64> {
        self.applied.clone()
    }

    /// The peers this store considers down: not heard from for `peer_timeout_ticks`, or their
    /// address refused a connection. A peer is up again with its next message. A hint, not a
    /// verdict: a live peer whose loop runs a long round misses keepalives too. A new data leader
    /// skips asking such a follower for its extents rather than wait for it.
    pub fn peers_down(&self) -> watch::Receiver<BTreeSet<u64>> {
        self.down.clone()
    }

    /// Hosts a group (see [`RaftNode::add_group`]).
    pub async fn add_group(&self, group: GroupId, voters: &[u64], sm: S) -> Result<(), RaftError> {
        self.add_group_gated(group, voters, sm).await.map(drop)
    }

    /// [`RaftHandle::add_group`], returning the group's [`RaftHandle::read_gate`] from the same
    /// turn of the loop: a node opening its groups while the loop waits on log writes pays one
    /// wait per group, not two.
    pub async fn add_group_gated(
        &self,
        group: GroupId,
        voters: &[u64],
        sm: S,
    ) -> Result<Option<Arc<ReadGate>>, RaftError> {
        let (reply, rx) = oneshot::channel();
        self.tx
            .send(Cmd::AddGroup {
                group,
                voters: voters.to_vec(),
                sm,
                reply,
            })
            .map_err(|_| stopped())?;
        rx.await.map_err(|_| stopped())?
    }

    /// Proposes `command` to `group` on this node and waits until it is applied here (the state
    /// machine's response) or fails. Not leader: [`RaftError::NotLeader`] at once, with a hint.
    pub async fn propose(&self, group: GroupId, command: Vec<u8>) -> Result<Vec<u8>, RaftError> {
        let (reply, rx) = oneshot::channel();
        self.tx
            .send(Cmd::Propose {
                group,
                command,
                reply,
            })
            .map_err(|_| stopped())?;
        rx.await.map_err(|_| stopped())?
    }

    /// A linearizable read: once the leader has confirmed its leadership and applied everything
    /// committed before the call, `f` runs on the group's state machine.
    pub async fn read<R, F>(&self, group: GroupId, f: F) -> Result<R, RaftError>
    where
        R: Send + 'static,
        F: FnOnce(&S) -> R + Send + 'static,
    {
        let (tx, rx) = oneshot::channel();
        let reader: Reader<S> = Box::new(move |sm| {
            let _ = tx.send(sm.map(f));
        });
        self.tx
            .send(Cmd::Read { group, reader })
            .map_err(|_| stopped())?;
        rx.await.map_err(|_| stopped())?
    }

    /// The gate that says when `group`'s state machine may be read without [`RaftHandle::read`]
    /// (see [`ReadGate`]), for a state machine that shares its state with the caller; `None` if the
    /// group is not hosted here. It stays valid while the group is; one added again has a new gate.
    pub async fn read_gate(&self, group: GroupId) -> Result<Option<Arc<ReadGate>>, RaftError> {
        let (reply, rx) = oneshot::channel();
        self.tx
            .send(Cmd::Gate { group, reply })
            .map_err(|_| stopped())?;
        rx.await.map_err(|_| stopped())
    }

    /// Runs `f` on this replica's state machine as it is now, with whether this node leads the group:
    /// not linearizable (a follower may lag), for stats and reports.
    pub async fn local_read<R, F>(&self, group: GroupId, f: F) -> Result<R, RaftError>
    where
        R: Send + 'static,
        F: FnOnce(&S, bool) -> R + Send + 'static,
    {
        let (tx, rx) = oneshot::channel();
        let reader: LocalReader<S> = Box::new(move |r| {
            let _ = tx.send(r.map(|(sm, leader)| f(sm, leader)));
        });
        self.tx
            .send(Cmd::LocalRead { group, reader })
            .map_err(|_| stopped())?;
        rx.await.map_err(|_| stopped())?
    }

    /// Adds peers (node id → messenger address) this store may have to talk to, e.g. the replicas of
    /// a newly hosted group. Known peers keep their connection; a changed address replaces it.
    pub fn add_peers(&self, peers: BTreeMap<u64, String>) -> Result<(), RaftError> {
        self.tx.send(Cmd::AddPeers { peers }).map_err(|_| stopped())
    }

    /// Stops hosting `group` on this node: its state machine is dropped and requests waiting on it
    /// fail. The group's records stay in the log (they are not reclaimed yet).
    pub async fn remove_group(&self, group: GroupId) -> Result<(), RaftError> {
        let (reply, rx) = oneshot::channel();
        self.tx
            .send(Cmd::RemoveGroup { group, reply })
            .map_err(|_| stopped())?;
        rx.await.map_err(|_| stopped())?
    }

    /// Proposes a membership change (add or remove voters or learners) on this node, the leader;
    /// resolves when it is applied here.
    pub async fn change_membership(
        &self,
        group: GroupId,
        change: ConfChangeV2,
    ) -> Result<(), RaftError> {
        let (reply, rx) = oneshot::channel();
        self.tx
            .send(Cmd::ChangeMembership {
                group,
                change,
                reply,
            })
            .map_err(|_| stopped())?;
        rx.await.map_err(|_| stopped())?.map(|_| ())
    }

    /// Asks this node, the leader of `group`, to hand leadership to node `to`.
    pub async fn transfer_leader(&self, group: GroupId, to: u64) -> Result<(), RaftError> {
        let (reply, rx) = oneshot::channel();
        self.tx
            .send(Cmd::TransferLeader { group, to, reply })
            .map_err(|_| stopped())?;
        rx.await.map_err(|_| stopped())?
    }

    /// Stops the store and waits until its log is closed (so it can be reopened). Requests still
    /// waiting fail.
    pub async fn stop(&self) -> Result<(), RaftError> {
        let (reply, rx) = oneshot::channel();
        self.tx.send(Cmd::Stop { reply }).map_err(|_| stopped())?;
        rx.await.map_err(|_| stopped())
    }

    /// The node this store believes leads `group` (0 if unknown).
    pub async fn leader(&self, group: GroupId) -> Result<u64, RaftError> {
        Ok(self.leader_term(group).await?.0)
    }

    /// The node this store believes leads `group` (0 if unknown) and the group's current term here.
    /// A node that sees itself as leader under a new term knows it was elected (again) since.
    pub async fn leader_term(&self, group: GroupId) -> Result<(u64, u64), RaftError> {
        let (reply, rx) = oneshot::channel();
        self.tx
            .send(Cmd::Leader { group, reply })
            .map_err(|_| stopped())?;
        rx.await.map_err(|_| stopped())
    }

    pub async fn status(&self) -> Result<StoreStatus, RaftError> {
        let (reply, rx) = oneshot::channel();
        self.tx.send(Cmd::Status { reply }).map_err(|_| stopped())?;
        rx.await.map_err(|_| stopped())
    }

    /// Delivers a batch received from a peer (the messenger handler calls this).
    pub fn deliver(&self, batch: RaftBatch) {
        let _ = self.tx.send(Cmd::Inbound(batch));
    }

    /// A messenger router serving this store's inbound raft traffic.
    pub fn router(&self) -> nacre_msgr::Router {
        let h = self.clone();
        nacre_msgr::Router::new().route::<RaftBatchRpc, _, _>(move |batch, _inc| {
            h.deliver(batch);
            async { Ok(((), Payload::none())) }
        })
    }
}

/// Starts the raft store of node `id`, on a thread of its own or on one of `client`'s messenger
/// workers ([`StoreConfig::on_msgr_worker`]). `peers` maps every other node id to its messenger
/// address; `client` sends to them.
pub fn start<S: StateMachine>(
    id: u64,
    config: StoreConfig,
    log: Arc<dyn LogStore>,
    peers: BTreeMap<u64, String>,
    client: Client,
) -> std::io::Result<RaftHandle<S>> {
    let log: Arc<dyn LogStore> = match &config.log_sync_seconds {
        Some(h) => Arc::new(crate::timed_log::TimedLog::new(log, h.clone())),
        None => log,
    };
    let (tx, rx) = mpsc::unbounded_channel();
    let own = tx.downgrade();
    let (applied_tx, applied) = watch::channel(0u64);
    let (down_tx, down) = watch::channel(BTreeSet::new());
    let watches = (applied_tx, down_tx);
    if config.on_msgr_worker {
        let node = RaftNode::new(id, config.node.clone(), log.clone());
        let worker = client.clone();
        // Detached: the loop ends on `stop`, when every handle is dropped, or with the worker.
        drop(worker.spawn(run(node, config, (own, rx), peers, client, watches, log)));
        return Ok(RaftHandle {
            id,
            tx,
            applied,
            down,
        });
    }
    thread::Builder::new()
        .name(format!("raft-{id}"))
        .spawn(move || {
            let rt = match tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            {
                Ok(rt) => rt,
                Err(e) => {
                    tracing::error!(node = id, error = %e, "cannot start the raft store runtime");
                    return;
                }
            };
            let node = RaftNode::new(id, config.node.clone(), log.clone());
            rt.block_on(run(node, config, (own, rx), peers, client, watches, log));
        })?;
    Ok(RaftHandle {
        id,
        tx,
        applied,
        down,
    })
}

/// Hands each outcome to the proposal waiting for it.
fn finish(
    proposals: &mut HashMap<ProposalId, (u64, Reply)>,
    finished: Vec<(ProposalId, Result<Vec<u8>, RaftError>)>,
) {
    for (pid, result) in finished {
        if let Some((_, tx)) = proposals.remove(&pid) {
            let _ = tx.send(result);
        }
    }
}

struct Loop<S: StateMachine> {
    node: RaftNode<S>,
    /// Proposal → (tick it was made, who waits for it).
    proposals: HashMap<ProposalId, (u64, Reply)>,
    reads: HashMap<ProposalId, (u64, Reader<S>)>,
    /// Tick at which each peer was last heard from, and whether it is considered up.
    heard: BTreeMap<u64, (u64, bool)>,
    /// Replaced, not changed, when peers change: the log writer sends through the one it got
    /// with each job.
    outboxes: Arc<BTreeMap<u64, Outbox>>,
    /// The log writer ([`StoreConfig::async_log`]), and how many jobs it has not finished.
    writer: Option<LogWriter>,
    in_flight: usize,
    /// Why the log writer stopped, until the loop stops too.
    failed: Option<RaftError>,
    client: Client,
    applied: watch::Sender<u64>,
    /// The peers marked down in `heard`, published for [`RaftHandle::peers_down`].
    down: watch::Sender<BTreeSet<u64>>,
    ticks: u64,
    early_appends: bool,
    /// The loop's own queue, for results of work it hands off (weak: the loop still ends when every
    /// handle is dropped).
    own: mpsc::WeakUnboundedSender<Cmd<S>>,
}

async fn run<S: StateMachine>(
    node: RaftNode<S>,
    config: StoreConfig,
    (own, mut rx): (
        mpsc::WeakUnboundedSender<Cmd<S>>,
        mpsc::UnboundedReceiver<Cmd<S>>,
    ),
    peers: BTreeMap<u64, String>,
    client: Client,
    (applied, down): (watch::Sender<u64>, watch::Sender<BTreeSet<u64>>),
    log: Arc<dyn LogStore>,
) {
    let id = node.id();
    let mut lp = Loop {
        node,
        proposals: HashMap::new(),
        reads: HashMap::new(),
        heard: BTreeMap::new(),
        outboxes: Arc::new(BTreeMap::new()),
        writer: None,
        in_flight: 0,
        failed: None,
        client,
        applied,
        down,
        ticks: 0,
        early_appends: config.early_appends,
        own,
    };
    lp.add_peers(peers);
    if config.async_log {
        match LogWriter::start(
            id,
            log.clone(),
            lp.client.clone(),
            lp.own.clone(),
            config.early_appends,
        ) {
            Ok(w) => lp.writer = Some(w),
            Err(e) => {
                tracing::warn!(node = id, error = %e, "no log writer thread; writing the log on the raft thread")
            }
        }
    }
    let mut tick = tokio::time::interval(config.tick_interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    let mut purge = tokio::time::interval(config.purge_interval);
    purge.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    let mut purging: Option<tokio::task::JoinHandle<()>> = None;
    let mut stop_reply = None;
    // The last round stopped at its apply budget: the next one follows once whatever else
    // waits on this thread or worker (connections, a tick) has had its turn.
    let mut more = false;
    loop {
        let idle = std::time::Instant::now();
        if more {
            tokio::task::yield_now().await;
        }
        tokio::select! {
            () = std::future::ready(()), if more => {}
            _ = purge.tick() => {
                // Reclaims log files whose entries are all compacted, off the raft loop; one at a
                // time.
                if purging.as_ref().is_none_or(|p| p.is_finished()) {
                    let log = log.clone();
                    purging = Some(tokio::task::spawn_blocking(move || match log.purge() {
                        Ok(lagging) if !lagging.is_empty() => tracing::debug!(
                            node = id, groups = ?lagging, "raft log files held by lagging groups"
                        ),
                        Ok(_) => {}
                        Err(e) => tracing::warn!(node = id, error = %e, "raft log purge failed"),
                    }));
                }
                continue;
            }
            cmd = rx.recv() => match cmd {
                Some(Cmd::Stop { reply }) => {
                    stop_reply = Some(reply);
                    break;
                }
                Some(cmd) => lp.handle(cmd),
                None => break,
            },
            _ = tick.tick() => lp.on_tick(&config),
        }
        let busy = std::time::Instant::now();
        // Take everything already queued before the Ready round, so it shares one log write.
        while let Ok(cmd) = rx.try_recv() {
            if let Cmd::Stop { reply } = cmd {
                stop_reply = Some(reply);
                break;
            }
            lp.handle(cmd);
        }
        // A round that installs or saves a snapshot writes the log itself, after the writer.
        while stop_reply.is_none()
            && lp.failed.is_none()
            && lp.in_flight > 0
            && lp.node.needs_sync_round()
        {
            match rx.recv().await {
                Some(Cmd::Stop { reply }) => stop_reply = Some(reply),
                Some(cmd) => lp.handle(cmd),
                None => break,
            }
        }
        if stop_reply.is_some() {
            break;
        }
        let ready = std::time::Instant::now();
        let r = lp.ready();
        more = lp.node.round_was_cut();
        let (took, waited) = (busy.elapsed(), busy.duration_since(idle));
        if took > SLOW_ROUND {
            // Nothing else runs on this loop meanwhile: no keepalives go out, and peers may
            // count this node down after `peer_timeout_ticks`.
            tracing::warn!(
                node = id,
                round_ms = took.as_millis() as u64,
                before_ready_ms = ready.duration_since(busy).as_millis() as u64,
                waited_ms = waited.as_millis() as u64,
                "slow raft loop round"
            );
        }
        if let Err(e) = r {
            // A failed log write leaves the log in an unknown state: stop serving.
            tracing::error!(node = id, error = %e, "raft store stopped");
            if EXIT_ON_LOG_FAILURE.load(std::sync::atomic::Ordering::Relaxed) {
                tracing::error!(
                    node = id,
                    "exiting: a node whose raft log cannot be written must not linger half alive"
                );
                std::process::exit(74); // EX_IOERR
            }
            break;
        }
    }
    for (_, (_, tx)) in lp.proposals.drain() {
        let _ = tx.send(Err(stopped()));
    }
    for (_, (_, reader)) in lp.reads.drain() {
        reader(Err(stopped()));
    }
    if let Some(p) = purging {
        let _ = p.await;
    }
    // What was handed to the writer is written (or failed) before the log closes.
    if let Some(w) = lp.writer.take() {
        w.stop();
    }
    // The log (and raft-engine's files and lock) close with the node, before the stop is confirmed.
    drop(lp);
    drop(log);
    if let Some(reply) = stop_reply {
        let _ = reply.send(());
    }
}

/// Frames to one peer. With `direct` (a leader's appends sent before its log write, see
/// [`StoreConfig::early_appends`]) a frame goes straight onto the peer's connection when nothing
/// is queued before it and the connection takes it without waiting: the loop blocks on its log
/// write right after, and a frame queued for the sender task, which runs on the loop's thread,
/// would wait until the write returned. Otherwise it joins that task's queue, which keeps frames
/// in order.
#[derive(Clone)]
struct Outbox {
    addr: String,
    queue: mpsc::UnboundedSender<Bytes>,
    /// Frames queued and not yet handed to the connection by the sender task.
    queued: Arc<AtomicUsize>,
}

impl Outbox {
    fn send(&self, client: &Client, body: Bytes, direct: bool) {
        let body = if direct && self.queued.load(Ordering::Acquire) == 0 {
            match client.try_send_oneway(&self.addr, RaftBatchRpc::OP, body) {
                Ok(()) => return,
                Err(body) => body,
            }
        } else {
            body
        };
        self.queued.fetch_add(1, Ordering::AcqRel);
        if self.queue.send(body).is_err() {
            self.queued.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

/// Sends raft messages, one frame per peer (`direct`: see [`Outbox`]).
fn send_batches(
    outboxes: &BTreeMap<u64, Outbox>,
    client: &Client,
    from: u64,
    messages: Vec<(GroupId, Message)>,
    direct: bool,
) {
    let mut per_peer: BTreeMap<u64, Vec<RaftEnvelope>> = BTreeMap::new();
    for (group, m) in messages {
        let to = m.to;
        match m.write_to_bytes() {
            Ok(bytes) => per_peer.entry(to).or_default().push(RaftEnvelope {
                group,
                msg: Bytes::from(bytes),
            }),
            Err(e) => tracing::error!(group, error = %e, "cannot encode a raft message"),
        }
    }
    for (peer, msgs) in per_peer {
        if let Some(o) = outboxes.get(&peer) {
            o.send(client, encode_body(&RaftBatch { from, msgs }), direct);
        }
    }
}

impl<S: StateMachine> Loop<S> {
    /// One sender task per peer keeps frames to that peer in order.
    fn add_peers(&mut self, peers: BTreeMap<u64, String>) {
        for (peer, addr) in peers {
            if peer == self.node.id() || self.outboxes.get(&peer).is_some_and(|o| o.addr == addr) {
                continue;
            }
            let (otx, mut orx) = mpsc::unbounded_channel::<Bytes>();
            let queued = Arc::new(AtomicUsize::new(0));
            let (client, to, left) = (self.client.clone(), addr.clone(), queued.clone());
            let own = self.own.clone();
            tokio::spawn(async move {
                while let Some(body) = orx.recv().await {
                    // Raft tolerates lost messages; a failed send is retried by raft itself.
                    if let Err(e) = client
                        .send_oneway(&to, RaftBatchRpc::OP, body, Payload::none())
                        .await
                    {
                        tracing::debug!(addr = %to, error = %e, "raft batch not sent");
                        if matches!(e, MsgrError::Connect { refused: true, .. })
                            && let Some(own) = own.upgrade()
                        {
                            let _ = own.send(Cmd::Refused { peer });
                        }
                    }
                    left.fetch_sub(1, Ordering::AcqRel);
                }
            });
            // Replacing the sender ends the old task once its queue drains.
            let outbox = Outbox {
                addr,
                queue: otx,
                queued,
            };
            Arc::make_mut(&mut self.outboxes).insert(peer, outbox);
            self.heard.entry(peer).or_insert((self.ticks, true));
        }
    }

    /// Tells the node a peer went down or came back, and publishes the set of peers down.
    fn mark(&mut self, peer: u64, alive: bool) {
        if alive {
            tracing::info!(node = self.node.id(), peer, "raft peer is up again");
        } else {
            tracing::info!(node = self.node.id(), peer, "raft peer is down");
        }
        self.node.set_peer_alive(peer, alive);
        self.down.send_if_modified(|d| {
            if alive {
                d.remove(&peer)
            } else {
                d.insert(peer)
            }
        });
    }

    fn handle(&mut self, cmd: Cmd<S>) {
        match cmd {
            Cmd::LocalRead { group, reader } => match self.node.state_machine(group) {
                Some(sm) => reader(Ok((sm, self.node.is_leader(group)))),
                None => reader(Err(RaftError::UnknownGroup(group))),
            },
            Cmd::AddPeers { peers } => self.add_peers(peers),
            Cmd::Refused { peer } => {
                // Nothing listens at the peer's address: its process is gone, and so is any
                // lease it held. Reported down now rather than after `peer_timeout_ticks`.
                if let Some(h) = self.heard.get_mut(&peer)
                    && h.1
                {
                    h.1 = false;
                    self.mark(peer, false);
                }
            }
            Cmd::BarrierDone {
                group,
                token,
                result,
            } => self.node.barrier_done(group, token, result),
            Cmd::Written {
                jobs,
                written,
                finished,
            } => {
                self.in_flight = self.in_flight.saturating_sub(jobs);
                self.node.on_written(&written);
                finish(&mut self.proposals, finished);
            }
            Cmd::LogFailed(e) => {
                self.failed.get_or_insert(e);
            }
            Cmd::RemoveGroup { group, reply } => {
                let _ = reply.send(self.node.remove_group(group));
            }
            Cmd::AddGroup {
                group,
                voters,
                sm,
                reply,
            } => {
                let r = self.node.add_group(group, &voters, sm);
                let _ = reply.send(r.map(|()| self.node.read_gate(group)));
            }
            Cmd::Propose {
                group,
                command,
                reply,
            } => match self.node.propose(group, command) {
                Ok(pid) => {
                    self.proposals.insert(pid, (self.ticks, reply));
                }
                Err(e) => {
                    let _ = reply.send(Err(e));
                }
            },
            Cmd::Read { group, reader } => match self.node.read(group, std::time::Instant::now()) {
                Ok(rid) => {
                    self.reads.insert(rid, (self.ticks, reader));
                }
                Err(e) => reader(Err(e)),
            },
            Cmd::Inbound(batch) => {
                let from = batch.from;
                if let Some(h) = self.heard.get_mut(&from) {
                    let was_down = !h.1;
                    *h = (self.ticks, true);
                    if was_down {
                        self.mark(from, true);
                    }
                }
                for env in batch.msgs {
                    match Message::parse_from_bytes(&env.msg) {
                        Ok(m) => {
                            if let Err(e) = self.node.step(env.group, m) {
                                tracing::debug!(group = env.group, error = %e, "raft message dropped");
                            }
                        }
                        Err(e) => tracing::warn!(from, error = %e, "undecodable raft message"),
                    }
                }
            }
            Cmd::ChangeMembership {
                group,
                change,
                reply,
            } => match self.node.propose_conf_change(group, change) {
                Ok(pid) => {
                    self.proposals.insert(pid, (self.ticks, reply));
                }
                Err(e) => {
                    let _ = reply.send(Err(e));
                }
            },
            Cmd::TransferLeader { group, to, reply } => {
                let _ = reply.send(self.node.transfer_leader(group, to));
            }
            Cmd::Gate { group, reply } => {
                let _ = reply.send(self.node.read_gate(group));
            }
            Cmd::Leader { group, reply } => {
                let _ = reply.send((self.node.leader(group), self.node.term(group)));
            }
            Cmd::Stop { reply } => {
                // Handled by the loop; a stray one is answered at once.
                let _ = reply.send(());
            }
            Cmd::Status { reply } => {
                let groups: Vec<_> = self.node.groups().collect();
                let _ = reply.send(StoreStatus {
                    groups: groups.len(),
                    leaders: groups.iter().filter(|&&g| self.node.is_leader(g)).count(),
                    hibernating: self.node.hibernating(),
                });
            }
        }
    }

    fn on_tick(&mut self, config: &StoreConfig) {
        self.ticks += 1;
        self.node.tick();
        let now = self.ticks;
        let expired = |since: &u64| now.saturating_sub(*since) > config.request_timeout_ticks;
        let late: Vec<_> = self
            .proposals
            .iter()
            .filter(|(_, (t, _))| expired(t))
            .map(|(k, _)| *k)
            .collect();
        for pid in late {
            if let Some((_, tx)) = self.proposals.remove(&pid) {
                let _ = tx.send(Err(RaftError::Timeout));
            }
        }
        let late: Vec<_> = self
            .reads
            .iter()
            .filter(|(_, (t, _))| expired(t))
            .map(|(k, _)| *k)
            .collect();
        for rid in late {
            if let Some((_, reader)) = self.reads.remove(&rid) {
                reader(Err(RaftError::Timeout));
            }
        }
        let mut silent = Vec::new();
        for (&peer, h) in self.heard.iter_mut() {
            if h.1 && self.ticks.saturating_sub(h.0) > config.peer_timeout_ticks {
                h.1 = false;
                silent.push(peer);
            }
        }
        for peer in silent {
            self.mark(peer, false);
        }
        if self.ticks.is_multiple_of(config.keepalive_ticks.max(1)) {
            for o in self.outboxes.values() {
                let batch = RaftBatch {
                    from: self.node.id(),
                    msgs: Vec::new(),
                };
                o.send(&self.client, encode_body(&batch), false);
            }
        }
    }

    fn ready(&mut self) -> Result<(), RaftError> {
        if let Some(e) = self.failed.take() {
            return Err(e);
        }
        let (outboxes, client, from) = (&self.outboxes, &self.client, self.node.id());
        let direct = self.early_appends;
        let proposals = &mut self.proposals;
        let early = |early: crate::node::EarlyOutput| {
            send_batches(outboxes, client, from, early.messages, direct);
            finish(proposals, early.finished);
        };
        let out = match &self.writer {
            Some(w) if !self.node.needs_sync_round() => {
                let (out, job) = self.node.process_ready_async(early)?;
                if let Some(job) = job {
                    w.submit(job, Arc::clone(&self.outboxes))?;
                    self.in_flight += 1;
                }
                // Read-ahead for the entries' applies starts once their appends and their log
                // write are on their way; they are applied in a later round.
                self.node.prefetch(&out.prefetch);
                out
            }
            _ => self.node.process_ready_with(early)?,
        };
        send_batches(&self.outboxes, &self.client, from, out.messages, false);
        for b in out.barriers {
            let own = self.own.clone();
            tokio::task::spawn_blocking(move || {
                let result = (b.run)();
                if let Some(tx) = own.upgrade() {
                    let _ = tx.send(Cmd::BarrierDone {
                        group: b.group,
                        token: b.token,
                        result,
                    });
                }
            });
        }
        if out.applied > 0 {
            self.applied.send_modify(|n| *n += out.applied);
        }
        finish(&mut self.proposals, out.finished);
        for (group, rid) in out.reads {
            if let Some((_, reader)) = self.reads.remove(&rid) {
                match self.node.state_machine(group) {
                    Some(sm) => reader(Ok(sm)),
                    None => reader(Err(RaftError::UnknownGroup(group))),
                }
            }
        }
        Ok(())
    }
}

/// The thread that writes a store's log when [`StoreConfig::async_log`] is on: it takes every
/// job queued, writes them in order as one write with at most one sync, sends the messages that
/// waited for it, and reports back to the loop.
struct LogWriter {
    tx: std::sync::mpsc::Sender<(LogJob, Arc<BTreeMap<u64, Outbox>>)>,
    thread: thread::JoinHandle<()>,
}

impl LogWriter {
    fn start<S: StateMachine>(
        id: u64,
        log: Arc<dyn LogStore>,
        client: Client,
        own: mpsc::WeakUnboundedSender<Cmd<S>>,
        direct: bool,
    ) -> std::io::Result<Self> {
        let (tx, rx) = std::sync::mpsc::channel::<(LogJob, Arc<BTreeMap<u64, Outbox>>)>();
        let thread = thread::Builder::new()
            .name(format!("raft-log-{id}"))
            .spawn(move || {
                while let Ok(first) = rx.recv() {
                    let mut jobs = vec![first];
                    jobs.extend(rx.try_iter());
                    let mut write = LogWrite::default();
                    let mut sync = false;
                    for (job, _) in &mut jobs {
                        write.groups.append(&mut job.write.groups);
                        sync |= job.sync;
                    }
                    if !write.groups.is_empty()
                        && let Err(e) = log.write(&write, sync)
                    {
                        if let Some(tx) = own.upgrade() {
                            let _ = tx.send(Cmd::LogFailed(e.into()));
                        }
                        // Nothing more is written, sent or answered: the loop stops.
                        return;
                    }
                    let n = jobs.len();
                    let mut written = Vec::new();
                    let mut finished = Vec::new();
                    for (job, outboxes) in jobs {
                        send_batches(&outboxes, &client, id, job.messages, direct);
                        written.extend(job.written);
                        finished.extend(job.finished);
                    }
                    let Some(tx) = own.upgrade() else { return };
                    let _ = tx.send(Cmd::Written {
                        jobs: n,
                        written,
                        finished,
                    });
                }
            })?;
        Ok(Self { tx, thread })
    }

    fn submit(&self, job: LogJob, outboxes: Arc<BTreeMap<u64, Outbox>>) -> Result<(), RaftError> {
        self.tx
            .send((job, outboxes))
            .map_err(|_| RaftError::Log(LogError::Io("the raft log writer stopped".into())))
    }

    /// Waits for every job handed over to be written.
    fn stop(self) {
        drop(self.tx);
        let _ = self.thread.join();
    }
}
