//! The raft store of one node: every group it hosts, driven by one tick and one `Ready` round.
//!
//! This is a synchronous state machine in the style of raft-rs: the caller feeds it ticks, messages
//! from peers and proposals, then calls [`RaftNode::process_ready`], which persists what every group
//! needs in **one** log write (group commit), applies committed entries, and returns the messages to
//! send and the outcomes of finished proposals. Sockets, threads and clocks belong to the caller, so
//! whole clusters can be driven deterministically in tests.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

use nacre_types::sync::lock;
use protobuf::Message as _;
use raft::eraftpb::{ConfChange, ConfChangeV2, Entry, EntryType, Message, MessageType, Snapshot};
use raft::{Config, RawNode, StateRole};
use thiserror::Error;

use crate::log::{GroupId, GroupWrite, LogError, LogStore, LogWrite};
use crate::storage::GroupStorage;

/// A replicated state machine. `apply` is called once per committed command, in log order, on every
/// replica; it must be deterministic.
pub trait StateMachine: Send + 'static {
    /// Applies the command at `index` and returns the response for its proposer.
    fn apply(&mut self, index: u64, command: &[u8]) -> Vec<u8>;
    /// The whole state, to send to a replica that is too far behind for the log.
    fn snapshot(&self) -> Vec<u8>;
    /// Replaces the state with a snapshot's.
    fn restore(&mut self, snapshot: &[u8]) -> Result<(), RestoreError>;
    /// What must run before a snapshot taken now may let the log drop the entries applied so far:
    /// work that makes their effects durable (a state machine that keeps data in files syncs
    /// them). It runs off the Raft thread, after [`StateMachine::snapshot`] was taken; the snapshot
    /// is saved and the log compacted only once it succeeded, so the node's other groups never wait
    /// for it. `None` (the default): applied effects need nothing more than the snapshot.
    fn durability_barrier(&self) -> Option<Barrier> {
        None
    }
    /// Called on every replica with each command as it reaches this replica's log (before it is
    /// applied, and with the store's log writer thread right after its log write is handed over),
    /// on the leader too: a chance to start IO its `apply` will need (reads into a cache), so that
    /// it overlaps the log's fsync and the round trip. It must not change the state: the entry may
    /// never commit. The default does nothing.
    fn prefetch(&self, command: &[u8]) {
        let _ = command;
    }
}

/// Why a state machine could not take a snapshot's state ([`StateMachine::restore`]). Its text is
/// the state machine's own.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum RestoreError {
    /// The bytes do not decode as a snapshot of this state machine.
    #[error("{0}")]
    Decode(String),
    /// The snapshot decodes, but to a state the state machine refuses (a broken invariant).
    #[error("{0}")]
    Invalid(String),
}

/// Work that makes a state machine's applied effects durable ([`StateMachine::durability_barrier`]).
pub type Barrier = Box<dyn FnOnce() -> Result<(), BarrierError> + Send>;

/// Why a [`Barrier`] failed: the state machine's own error (the node logs it and keeps the log).
pub type BarrierError = Box<dyn std::error::Error + Send + Sync>;

/// A barrier handed out by a Ready round, to run off the Raft thread and report with
/// [`RaftNode::barrier_done`].
pub struct PendingBarrier {
    pub group: GroupId,
    pub token: u64,
    pub run: Barrier,
}

impl std::fmt::Debug for PendingBarrier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PendingBarrier")
            .field("group", &self.group)
            .field("token", &self.token)
            .finish()
    }
}

/// Log position at which a new group starts, as if a snapshot had installed its initial membership.
pub const INIT_INDEX: u64 = 5;
/// Term of that position.
pub const INIT_TERM: u64 = 5;

/// Identifies a proposal until its outcome is reported.
pub type ProposalId = u64;

/// Why a proposal or an operation on a group failed.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum RaftError {
    /// This replica is not the leader; `leader` is the node it believes is (0 if unknown).
    #[error("not the leader of group {group} (leader hint: node {leader})")]
    NotLeader { group: GroupId, leader: u64 },
    #[error("group {0} is not hosted on this node")]
    UnknownGroup(GroupId),
    #[error("group {0} already exists on this node")]
    GroupExists(GroupId),
    /// The proposal's log position was taken by another leader's entry: it was not applied.
    #[error("proposal dropped by a change of leader in group {0}")]
    Dropped(GroupId),
    #[error(transparent)]
    Log(#[from] LogError),
    /// raft-rs rejected the operation (e.g. a proposal while a leader transfer is in progress).
    #[error("raft: {0}")]
    Raft(String),
    /// No outcome in time; the command may still be applied.
    #[error("no outcome in time (the command may still be applied)")]
    Timeout,
    #[error("state machine of group {group} rejected a snapshot: {reason}")]
    Restore {
        group: GroupId,
        reason: RestoreError,
    },
}

impl From<raft::Error> for RaftError {
    fn from(e: raft::Error) -> Self {
        Self::Raft(e.to_string())
    }
}

/// What one [`RaftNode::process_ready`] produced.
#[derive(Debug, Default)]
pub struct ReadyOutput {
    /// Messages to deliver, each with its group.
    pub messages: Vec<(GroupId, Message)>,
    /// Outcomes of proposals made on this node: the state machine's response, or why not applied.
    pub finished: Vec<(ProposalId, Result<Vec<u8>, RaftError>)>,
    /// Reads started with [`RaftNode::read_index`] that may now be served from the group's state
    /// machine: everything committed before the read started has been applied.
    pub reads: Vec<(GroupId, ProposalId)>,
    /// Log entries applied to state machines in this round (all groups).
    pub applied: u64,
    /// Durability barriers of snapshots taken in this round: run each off the Raft thread, then
    /// report it with [`RaftNode::barrier_done`].
    pub barriers: Vec<PendingBarrier>,
    /// The commands of the normal entries this round handed to its log write
    /// ([`RaftNode::process_ready_async`] only): pass them to [`RaftNode::prefetch`] once that
    /// write is on its way.
    pub prefetch: Vec<(GroupId, bytes::Bytes)>,
}

/// What a Ready round hands out before its log write (see [`RaftNode::process_ready_with`]).
#[derive(Debug, Default)]
pub struct EarlyOutput {
    /// Messages that may leave before the write, each with its group.
    pub messages: Vec<(GroupId, Message)>,
    /// Outcomes of proposals already committed, as in [`ReadyOutput::finished`].
    pub finished: Vec<(ProposalId, Result<Vec<u8>, RaftError>)>,
}

/// A Ready round's log write handed to a writer instead of made in the round
/// ([`RaftNode::process_ready_async`]). Jobs must be written in the order they were made; then
/// `messages` may leave, `finished` be answered, and [`RaftNode::on_written`] be told `written`.
#[derive(Debug, Default)]
pub struct LogJob {
    pub write: LogWrite,
    /// Whether the write must be on stable storage before anything below happens.
    pub sync: bool,
    /// Messages that must wait for the write (a follower's acknowledgements, votes).
    pub messages: Vec<(GroupId, Message)>,
    /// Outcomes that must wait for the write (a membership change's).
    pub finished: Vec<(ProposalId, Result<Vec<u8>, RaftError>)>,
    /// What to report to [`RaftNode::on_written`] once written.
    pub written: Vec<Written>,
}

/// One group's Ready made durable by a [`LogJob`].
#[derive(Clone, Copy, Debug)]
pub struct Written {
    group: GroupId,
    number: u64,
    entries: bool,
}

/// Timing and sizing of every group on a node.
#[derive(Clone, Debug)]
pub struct NodeConfig {
    /// Ticks without a heartbeat before a follower campaigns (randomized up to twice this).
    pub election_tick: usize,
    pub heartbeat_tick: usize,
    pub max_size_per_msg: u64,
    pub max_inflight_msgs: usize,
    /// Entries kept in the log beyond the applied index before it is compacted behind a snapshot.
    pub compact_after: u64,
    /// Bytes of commands applied since the last snapshot past which the log is compacted too,
    /// however few the entries (`u64::MAX`, the default: never): for groups whose commands carry
    /// data, where `compact_after` of them would keep gigabytes of log on disk and to replay at a
    /// restart.
    pub compact_after_bytes: u64,
    /// Ticks a group must be idle (nothing to replicate, everyone caught up) before it hibernates:
    /// it stops ticking, so its leader sends no heartbeats and its followers start no elections.
    /// Followers hibernate after this many ticks, leaders after twice as many. A follower wakes on
    /// any message but a heartbeat, and when the node hosting its leader is reported down
    /// ([`RaftNode::set_peer_alive`]). 0 disables hibernation.
    pub hibernate_after: usize,
    /// How long after a ReadIndex round it **sent** was confirmed by a quorum a leader may answer
    /// reads without another round ([`RaftNode::read`]). No other leader can exist before the
    /// followers' election timeout runs out after that round, so this must stay well under the
    /// minimum election timeout in real time (`election_tick` ticks), minus clock drift. It survives
    /// hibernation: a leader that stopped ticking has no lease until a new round confirms it. Zero
    /// disables it.
    pub read_lease: std::time::Duration,
    /// A leader tells its followers a new commit index only with its next append or heartbeat,
    /// not with a message of its own (raft-rs's `skip_bcast_commit`). Each commit otherwise costs
    /// every follower a message, a wake of its Raft thread and a log write; followers then apply
    /// later: at most a heartbeat later, and before they hibernate (a follower whose log runs past
    /// its commit index is not `quiescent`). Reads are served by leaders, and reads of a
    /// follower's state machine track its applied index.
    pub skip_bcast_commit: bool,
    /// Bytes of committed entries one group applies in one Ready round (raft-rs's
    /// `max_committed_size_per_ready`); the rest follow in the next rounds. A restarted node
    /// replays its groups' logs since their snapshots; in one round that would hold its loop (no
    /// keepalives, no other group) for as long as the whole replay takes, tens of seconds on a
    /// busy disk, and its peers would count it down. The rest is applied in the following rounds,
    /// at least one a tick (4 MiB a tick is 40 MiB/s a group, more than a disk under such a
    /// replay gives).
    pub max_apply_per_ready: u64,
    /// Bytes of committed entries a Ready round applies across all groups: past it, the groups
    /// not reached yet wait for the next round ([`RaftNode::round_was_cut`]), which starts with
    /// them. A replay of many groups then holds the loop (and, on a messenger worker, its
    /// connections) for a round of this size at a time, not for every group's share at once.
    pub max_apply_per_round: u64,
}

impl Default for NodeConfig {
    fn default() -> Self {
        Self {
            election_tick: 10,
            heartbeat_tick: 2,
            max_size_per_msg: 1 << 20,
            max_inflight_msgs: 256,
            compact_after: 10_000,
            compact_after_bytes: u64::MAX,
            hibernate_after: 20,
            read_lease: std::time::Duration::ZERO,
            skip_bcast_commit: true,
            max_apply_per_ready: 4 << 20,
            max_apply_per_round: 4 << 20,
        }
    }
}

/// Whether a leader's state machine may be read as it is, without asking the Raft thread: the
/// leader publishes here, after every Ready round of its group, until when its read lease covers a
/// read of what it has applied (its lease is valid in its term, it has committed an entry of that
/// term, applied everything committed, and is not handing leadership over). A transfer revokes it
/// before the new leader can be told to campaign. What it has applied then includes every write
/// acknowledged before the read began (a write is acknowledged once applied on the leader); what
/// the leader commits later is concurrent with the read. No other leader can commit anything before
/// the lease ends ([`NodeConfig::read_lease`]).
///
/// The gate also carries the group's leader and term as this node last saw them (after its last
/// message or Ready round), so a service can turn away requests this node cannot lead without a
/// round trip to the Raft thread, which may be busy writing its log.
#[derive(Debug, Default)]
pub struct ReadGate {
    until: std::sync::Mutex<Option<Instant>>,
    leader_term: std::sync::Mutex<(u64, u64)>,
}

impl ReadGate {
    /// Whether a read of the state machine at `now` is linearizable.
    pub fn open_at(&self, now: Instant) -> bool {
        lock(&self.until).is_some_and(|until| now < until)
    }

    /// The group's leader (0 if unknown) and term as this node last saw them. Only a hint for
    /// routing: a proposal made on it still fails if this node has stopped leading.
    pub fn leader_term(&self) -> (u64, u64) {
        *lock(&self.leader_term)
    }

    fn set_leader_term(&self, leader: u64, term: u64) {
        *lock(&self.leader_term) = (leader, term);
    }

    fn set(&self, until: Option<Instant>) {
        *lock(&self.until) = until;
    }
}

struct Group<S> {
    node: RawNode<GroupStorage>,
    sm: S,
    /// Published lease for reads off the Raft thread.
    gate: Arc<ReadGate>,
    /// index → (term, proposal) for proposals made here that are not applied yet.
    pending: BTreeMap<u64, (u64, ProposalId)>,
    /// Reads whose read index is known, waiting for the state machine to apply up to it.
    reads: Vec<(u64, ProposalId)>,
    /// Ticks since the group last had something to do.
    idle_ticks: usize,
    hibernating: bool,
    /// Until when, and in which term, this leader may read without a quorum round.
    lease: Option<(Instant, u64)>,
    /// Send times of this leader's ReadIndex rounds not yet confirmed (for the lease).
    read_sent: BTreeMap<ProposalId, Instant>,
    /// Reads asked of a new leader before it committed an entry of its term: raft-rs drops such a
    /// ReadIndex request silently, so they wait here and are issued once it has.
    deferred: Vec<(ProposalId, Option<Instant>)>,
    /// A snapshot taken, waiting for its durability barrier: (token, snapshot, barrier done).
    pending_snapshot: Option<(u64, Snapshot, bool)>,
    /// Entries and their command bytes applied since the last snapshot was taken.
    since_snapshot: (u64, u64),
    /// Entries the last snapshot taken keeps in the log behind it ([`keep_behind`]).
    keep: u64,
}

impl<S: StateMachine> Group<S> {
    /// [`StateMachine::prefetch`] for the normal entries about to be written to the log.
    fn prefetch(&self, entries: &[Entry]) {
        for e in entries.iter().filter(|e| prefetchable(e)) {
            self.sm.prefetch(&e.data);
        }
    }
}

impl<S> Group<S> {
    /// Hands out the reads whose index the state machine has reached.
    fn serve_reads(&mut self, gid: GroupId, out: &mut ReadyOutput) {
        let applied = self.node.raft.raft_log.applied;
        self.reads.retain(|&(index, id)| {
            let ready = index <= applied;
            if ready {
                out.reads.push((gid, id));
            }
            !ready
        });
    }

    /// Records the ReadIndex rounds a quorum confirmed in `rd`, renewing the lease.
    fn take_read_states(&mut self, rd: &mut raft::Ready, lease: std::time::Duration) {
        for rs in rd.take_read_states() {
            if let Ok(raw) = <[u8; 8]>::try_from(rs.request_ctx.as_slice()) {
                let id = u64::from_le_bytes(raw);
                self.reads.push((rs.index, id));
                // A quorum confirmed this leader as of the round's send time.
                if let Some(sent) = self.read_sent.remove(&id) {
                    let until = sent + lease;
                    let term = self.node.raft.term;
                    if self.lease.is_none_or(|(u, t)| t != term || u < until) {
                        self.lease = Some((until, term));
                    }
                }
            }
        }
    }

    /// Sends a ReadIndex round for `id`, or defers it until this leader has committed in its term.
    fn read_round(&mut self, id: ProposalId, sent: Option<Instant>, lease: std::time::Duration) {
        let r = &self.node.raft;
        if r.raft_log.term(r.raft_log.committed).ok() != Some(r.term) {
            self.deferred.push((id, sent));
            return;
        }
        self.node.read_index(id.to_le_bytes().to_vec());
        if let Some(now) = sent {
            // Rounds that never complete (lost leadership) are forgotten after a while.
            self.read_sent
                .retain(|_, t| now.saturating_duration_since(*t) < lease * 20);
            self.read_sent.insert(id, now);
        }
    }

    /// Issues deferred reads once the leader has committed in its term; drops them if it lost
    /// leadership (their callers time out, as for any read a deposed leader cannot answer).
    /// Returns whether rounds were issued.
    fn flush_deferred(&mut self, lease: std::time::Duration) -> bool {
        if self.deferred.is_empty() {
            return false;
        }
        if self.node.raft.state != StateRole::Leader {
            self.deferred.clear();
            return false;
        }
        let r = &self.node.raft;
        if r.raft_log.term(r.raft_log.committed).ok() != Some(r.term) {
            return false;
        }
        for (id, sent) in std::mem::take(&mut self.deferred) {
            self.read_round(id, sent, lease);
        }
        true
    }

    /// Whether the group has nothing in flight: an idle leader with every voter caught up, or a
    /// follower whose leader is alive and whose log is applied up to the end.
    fn quiescent(&self, peer_alive: impl Fn(u64) -> bool) -> bool {
        let r = &self.node.raft;
        let log = &r.raft_log;
        let settled = log.committed == log.last_index()
            && log.applied == log.committed
            && self.pending.is_empty()
            && self.reads.is_empty()
            && !self.node.has_ready();
        match r.state {
            StateRole::Leader => {
                settled
                    && r.lead_transferee.is_none()
                    && r.prs().iter().all(|(_, p)| p.matched == log.last_index())
            }
            StateRole::Follower => settled && r.leader_id != 0 && peer_alive(r.leader_id),
            StateRole::Candidate | StateRole::PreCandidate => false,
        }
    }

    /// Publishes whether the state machine may be read as it is now, and until when (see
    /// [`ReadGate`]); with `lease` zero, never.
    fn publish_gate(&self, lease: std::time::Duration) {
        let r = &self.node.raft;
        let log = &r.raft_log;
        let until = match self.lease {
            Some((until, term))
                if !lease.is_zero()
                    && r.state == StateRole::Leader
                    && term == r.term
                    && r.lead_transferee.is_none()
                    && log.term(log.committed).ok() == Some(r.term)
                    && log.applied >= log.committed =>
            {
                Some(until)
            }
            _ => None,
        };
        self.gate.set(until);
        self.gate.set_leader_term(r.leader_id, r.term);
    }

    /// Closes the gate unless this node still leads with no transfer under way (after a message or
    /// a transfer request that may have changed that).
    fn check_gate(&self) {
        let r = &self.node.raft;
        if r.state != StateRole::Leader || r.lead_transferee.is_some() {
            self.gate.set(None);
        }
        self.gate.set_leader_term(r.leader_id, r.term);
    }

    fn wake(&mut self) {
        self.hibernating = false;
        self.idle_ticks = 0;
    }
}

/// All Raft groups hosted by one node.
pub struct RaftNode<S: StateMachine> {
    id: u64,
    config: NodeConfig,
    log: Arc<dyn LogStore>,
    groups: BTreeMap<GroupId, Group<S>>,
    next_proposal: ProposalId,
    logger: slog::Logger,
    /// Peers known to be down (from node-level liveness, not per-group heartbeats).
    dead_peers: std::collections::BTreeSet<u64>,
    /// Groups touched since the last Ready round: only they can have a `Ready`, so an idle node
    /// does not even look at its hibernating groups.
    dirty: std::collections::BTreeSet<GroupId>,
    /// Barriers handed out since the last Ready round returned, and the next token.
    barriers: Vec<PendingBarrier>,
    next_barrier: u64,
    /// The last round stopped at its apply budget; the next one starts at this group.
    cut_at: Option<GroupId>,
}

impl<S: StateMachine> std::fmt::Debug for RaftNode<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RaftNode")
            .field("id", &self.id)
            .field("groups", &self.groups.len())
            .finish()
    }
}

impl<S: StateMachine> RaftNode<S> {
    /// A node with id `id` (non-zero) whose groups persist into `log`.
    pub fn new(id: u64, config: NodeConfig, log: Arc<dyn LogStore>) -> Self {
        Self {
            id,
            config,
            log,
            groups: BTreeMap::new(),
            next_proposal: 1,
            logger: slog::Logger::root(slog::Discard, slog::o!()),
            dead_peers: std::collections::BTreeSet::new(),
            dirty: std::collections::BTreeSet::new(),
            barriers: Vec::new(),
            next_barrier: 1,
            cut_at: None,
        }
    }

    pub fn id(&self) -> u64 {
        self.id
    }

    /// Hosts `group`. If the log has no state for it and `voters` is not empty, the group is created
    /// with `voters` as its members (every initial replica must be created with the same voters); with
    /// no voters the replica waits to be initialized by its leader (a replica being added by a
    /// membership change). If the log has state, the group restarts from it and `voters` is ignored. Committed entries that the state machine has
    /// not seen are applied again from the log (or from the last snapshot) by `process_ready`.
    pub fn add_group(&mut self, group: GroupId, voters: &[u64], sm: S) -> Result<(), RaftError> {
        if self.groups.contains_key(&group) {
            return Err(RaftError::GroupExists(group));
        }
        if self.log.state(group)?.is_none() && !voters.is_empty() {
            // Bootstrap as if a snapshot at INIT_INDEX carried the initial membership (TiKV's trick):
            // a replica added later starts with an empty log, behind the truncation point, so the
            // leader initializes it with a snapshot that includes the membership.
            let mut w = GroupWrite::new(group);
            let mut meta = raft::eraftpb::SnapshotMetadata {
                index: INIT_INDEX,
                term: INIT_TERM,
                ..Default::default()
            };
            meta.set_conf_state(raft::eraftpb::ConfState {
                voters: voters.to_vec(),
                ..Default::default()
            });
            w.snapshot = Some(meta);
            w.hard_state = Some(raft::eraftpb::HardState {
                term: INIT_TERM,
                commit: INIT_INDEX,
                ..Default::default()
            });
            self.log.write(&LogWrite { groups: vec![w] }, true)?;
        }
        let mut storage = GroupStorage::new(group, Arc::clone(&self.log));
        let mut sm = sm;
        let mut applied = 0;
        if let Some(snap) = self.log.saved_snapshot(group)? {
            // Restart: the state machine resumes from its last durable snapshot; raft-rs replays the
            // committed entries after it.
            sm.restore(&snap.data)
                .map_err(|reason| RaftError::Restore { group, reason })?;
            applied = snap.get_metadata().index;
            storage.set_snapshot(snap);
        }
        let cfg = Config {
            id: self.id,
            election_tick: self.config.election_tick,
            heartbeat_tick: self.config.heartbeat_tick,
            max_size_per_msg: self.config.max_size_per_msg,
            max_inflight_msgs: self.config.max_inflight_msgs,
            check_quorum: true,
            pre_vote: true,
            skip_bcast_commit: self.config.skip_bcast_commit,
            applied,
            // Every read confirms leadership with a quorum (ReadIndex); raft-rs's lease-based
            // reads trust a leader that may not have stepped down yet (see `read_lease`).
            read_only_option: raft::ReadOnlyOption::Safe,
            max_committed_size_per_ready: self.config.max_apply_per_ready,
            ..Config::default()
        };
        cfg.validate()?;
        let node = RawNode::new(&cfg, storage, &self.logger)?;
        self.groups.insert(
            group,
            Group {
                node,
                sm,
                gate: Arc::new(ReadGate::default()),
                pending: BTreeMap::new(),
                reads: Vec::new(),
                lease: None,
                read_sent: BTreeMap::new(),
                deferred: Vec::new(),
                pending_snapshot: None,
                since_snapshot: (0, 0),
                keep: 0,
                idle_ticks: 0,
                hibernating: false,
            },
        );
        self.dirty.insert(group);
        Ok(())
    }

    /// Stops hosting `group`: drops its replica and state machine (its log records stay).
    pub fn remove_group(&mut self, group: GroupId) -> Result<(), RaftError> {
        self.groups
            .remove(&group)
            .ok_or(RaftError::UnknownGroup(group))?
            .gate
            .set(None);
        self.dirty.remove(&group);
        Ok(())
    }

    /// Groups hosted here.
    pub fn groups(&self) -> impl Iterator<Item = GroupId> + '_ {
        self.groups.keys().copied()
    }

    /// The gate through which `group`'s state machine may be read off this node's thread (see
    /// [`ReadGate`]): the same `Arc` for as long as the group is hosted here.
    pub fn read_gate(&self, group: GroupId) -> Option<Arc<ReadGate>> {
        self.groups.get(&group).map(|g| Arc::clone(&g.gate))
    }

    /// The state machine of `group`.
    pub fn state_machine(&self, group: GroupId) -> Option<&S> {
        self.groups.get(&group).map(|g| &g.sm)
    }

    /// Whether this node leads `group`.
    pub fn is_leader(&self, group: GroupId) -> bool {
        self.groups
            .get(&group)
            .is_some_and(|g| g.node.raft.state == StateRole::Leader)
    }

    /// The leader of `group` as this node knows it (0 if unknown).
    pub fn leader(&self, group: GroupId) -> u64 {
        self.groups.get(&group).map_or(0, |g| g.node.raft.leader_id)
    }

    /// The term of `group` on this node.
    pub fn term(&self, group: GroupId) -> u64 {
        self.groups.get(&group).map_or(0, |g| g.node.raft.term)
    }

    /// Advances every group's logical clock by one tick.
    pub fn tick(&mut self) {
        let dead = &self.dead_peers;
        let after = self.config.hibernate_after;
        for (&gid, g) in self.groups.iter_mut() {
            if g.hibernating {
                continue;
            }
            self.dirty.insert(gid);
            // Judged before the tick: a leader's tick queues heartbeats, which are not work.
            let quiet = after > 0 && g.quiescent(|p| !dead.contains(&p));
            g.node.tick();
            if !quiet {
                g.idle_ticks = 0;
                continue;
            }
            g.idle_ticks += 1;
            // A leader waits twice as long, so its followers are asleep before its heartbeats
            // stop (a follower still awake would otherwise time out and campaign).
            let needed = if g.node.raft.state == StateRole::Leader {
                2 * after
            } else {
                after
            };
            if g.idle_ticks >= needed {
                g.hibernating = true;
            }
        }
    }

    /// Records node-level liveness of a peer (the driver's per-node heartbeats). Followers whose
    /// leader is on a peer that went down wake up (if hibernating), and the lowest live voter of
    /// each such group campaigns at once.
    pub fn set_peer_alive(&mut self, peer: u64, alive: bool) {
        if alive {
            self.dead_peers.remove(&peer);
            return;
        }
        self.dead_peers.insert(peer);
        let me = self.id;
        for (&gid, g) in self.groups.iter_mut() {
            if g.node.raft.leader_id == peer {
                g.wake();
                self.dirty.insert(gid);
                // The leader's lease on this follower's vote is over: it has not been heard from
                // for the peer timeout, which is longer than the read lease it may still count
                // on (`NodeConfig::read_lease`, a third of an election timeout), so granting a
                // vote now cannot make two leaders serve reads.
                let r = &mut g.node.raft;
                r.election_elapsed = r.election_elapsed.max(r.election_timeout());
                // The lowest live voter campaigns at once instead of after an election timeout
                // (the others wait theirs, so they do not split the vote).
                let conf = g.node.raft.prs().conf().to_conf_state();
                let first_live = conf
                    .get_voters()
                    .iter()
                    .copied()
                    .filter(|v| *v != peer && !self.dead_peers.contains(v))
                    .min();
                if first_live == Some(me)
                    && let Err(e) = g.node.campaign()
                {
                    tracing::debug!(group = gid, error = %e, "campaign after the leader's node went down failed");
                }
            }
        }
    }

    /// Groups hosted here that are hibernating.
    pub fn hibernating(&self) -> usize {
        self.groups.values().filter(|g| g.hibernating).count()
    }

    /// Makes this replica campaign for leadership of `group` now.
    pub fn campaign(&mut self, group: GroupId) -> Result<(), RaftError> {
        let g = self.group_mut(group)?;
        g.wake();
        g.node.campaign()?;
        Ok(())
    }

    /// Hands a message from a peer to `group`.
    pub fn step(&mut self, group: GroupId, msg: Message) -> Result<(), RaftError> {
        let g = self.group_mut(group)?;
        // Heartbeats keep a hibernating follower's view of its leader fresh without waking it; any
        // other message means there is work (entries, votes, reads): resume ticking.
        if !matches!(
            msg.get_msg_type(),
            MessageType::MsgHeartbeat | MessageType::MsgHeartbeatResponse
        ) {
            g.wake();
        }
        let r = g.node.step(msg);
        g.check_gate();
        r?;
        Ok(())
    }

    /// Proposes `command` to `group`. The outcome arrives in a later [`ReadyOutput::finished`].
    pub fn propose(&mut self, group: GroupId, command: Vec<u8>) -> Result<ProposalId, RaftError> {
        self.append(group, |node| node.propose(Vec::new(), command))
    }

    /// The group if this node leads it (woken: there is work), else `NotLeader` with a hint.
    fn leading(&mut self, group: GroupId) -> Result<&mut Group<S>, RaftError> {
        let g = self.group_mut(group)?;
        if g.node.raft.state != StateRole::Leader {
            return Err(RaftError::NotLeader {
                group,
                leader: g.node.raft.leader_id,
            });
        }
        g.wake();
        Ok(g)
    }

    /// Appends one entry through `f` on the leader and tracks it as a proposal.
    fn append(
        &mut self,
        group: GroupId,
        f: impl FnOnce(&mut RawNode<GroupStorage>) -> raft::Result<()>,
    ) -> Result<ProposalId, RaftError> {
        let id = self.next_proposal;
        let g = self.leading(group)?;
        let before = g.node.raft.raft_log.last_index();
        f(&mut g.node)?;
        let index = g.node.raft.raft_log.last_index();
        if index != before + 1 {
            // raft-rs dropped the proposal (e.g. during a leader transfer) without an error.
            return Err(RaftError::Dropped(group));
        }
        let term = g.node.raft.term;
        g.pending.insert(index, (term, id));
        self.next_proposal += 1;
        Ok(id)
    }

    /// Starts a linearizable read of `group` on its leader. When it appears in
    /// [`ReadyOutput::reads`], the state machine reflects every write committed before this call.
    pub fn read_index(&mut self, group: GroupId) -> Result<ProposalId, RaftError> {
        let id = self.next_proposal;
        let lease = self.config.read_lease;
        self.leading(group)?.read_round(id, None, lease);
        self.next_proposal += 1;
        Ok(id)
    }

    /// A linearizable read of `group` on its leader at time `now`: answered from the leader's read
    /// lease when it holds one (no message; see [`NodeConfig::read_lease`]), else by a ReadIndex
    /// round, whose confirmation renews the lease from the time it was sent.
    pub fn read(&mut self, group: GroupId, now: Instant) -> Result<ProposalId, RaftError> {
        let lease = self.config.read_lease;
        if lease.is_zero() {
            return self.read_index(group);
        }
        let id = self.next_proposal;
        let g = self.leading(group)?;
        let r = &g.node.raft;
        let committed = r.raft_log.committed;
        let valid = g
            .lease
            .is_some_and(|(until, term)| now < until && term == r.term)
            && r.lead_transferee.is_none()
            && r.raft_log.term(committed).ok() == Some(r.term);
        if valid {
            g.reads.push((committed, id));
        } else {
            g.read_round(id, Some(now), lease);
        }
        self.next_proposal += 1;
        Ok(id)
    }

    /// Asks the leader of `group` (this node) to hand leadership to `to`, which must be a voter. The
    /// transfer completes when `to` wins the election it is told to start; proposals are refused
    /// meanwhile.
    pub fn transfer_leader(&mut self, group: GroupId, to: u64) -> Result<(), RaftError> {
        let g = self.leading(group)?;
        g.node.transfer_leader(to);
        g.check_gate();
        Ok(())
    }

    /// Proposes a membership change of `group`.
    pub fn propose_conf_change(
        &mut self,
        group: GroupId,
        cc: ConfChangeV2,
    ) -> Result<ProposalId, RaftError> {
        self.append(group, |node| node.propose_conf_change(Vec::new(), cc))
    }

    /// The group, marked as touched (it may have a `Ready` now).
    fn group_mut(&mut self, group: GroupId) -> Result<&mut Group<S>, RaftError> {
        let g = self
            .groups
            .get_mut(&group)
            .ok_or(RaftError::UnknownGroup(group))?;
        self.dirty.insert(group);
        Ok(g)
    }

    /// Reports the outcome of a barrier from [`ReadyOutput::barriers`]. On success the snapshot it
    /// guarded is saved, and the log compacted behind it, in the next Ready round; on failure the
    /// snapshot is dropped and a later round takes another. Unknown tokens (a group removed, or a
    /// newer snapshot installed meanwhile) are ignored.
    pub fn barrier_done(&mut self, group: GroupId, token: u64, result: Result<(), BarrierError>) {
        let Some(g) = self.groups.get_mut(&group) else {
            return;
        };
        match &mut g.pending_snapshot {
            Some((t, _, done)) if *t == token => match result {
                Ok(()) => {
                    *done = true;
                    self.dirty.insert(group);
                }
                Err(reason) => {
                    tracing::warn!(group, %reason, "a snapshot's durability barrier failed; the log keeps its entries");
                    g.pending_snapshot = None;
                }
            },
            _ => {}
        }
    }

    /// Runs one `Ready` round for every group with something to do: one log write for all of them,
    /// then messages and applied results.
    pub fn process_ready(&mut self) -> Result<ReadyOutput, RaftError> {
        let mut messages = Vec::new();
        let mut finished = Vec::new();
        let mut out = self.process_ready_with(|early| {
            messages.extend(early.messages);
            finished.extend(early.finished);
        })?;
        messages.append(&mut out.messages);
        out.messages = messages;
        finished.append(&mut out.finished);
        out.finished = finished;
        Ok(out)
    }

    /// [`RaftNode::process_ready`], handing to `early`, *before* the log write, what need not wait
    /// for it:
    /// - the messages that may leave before it (a leader's appends and heartbeats: raft lets the
    ///   leader persist in parallel with its followers, thesis §10.2.1), so that the followers'
    ///   disk writes overlap the leader's;
    /// - the outcomes of proposals whose entries were committed before this round and applied in
    ///   it. They are on a majority already; the write is of newer entries, and waiting for its
    ///   sync would add one log sync to every reply while proposals keep arriving.
    ///
    /// The rest is in the output.
    pub fn process_ready_with(
        &mut self,
        mut early_out: impl FnMut(EarlyOutput),
    ) -> Result<ReadyOutput, RaftError> {
        let mut out = ReadyOutput::default();
        self.save_durable_snapshots()?;
        let mut early = Vec::new();
        let mut early_finished = Vec::new();
        let mut write = LogWrite::default();
        let mut readies = Vec::new();
        let mut sync = false;
        let order = self.round_order();
        let mut round_bytes = 0u64;
        for (i, &gid) in order.iter().enumerate() {
            if self.cut_round(&order[i..], round_bytes) {
                break;
            }
            let Some(g) = self.groups.get_mut(&gid) else {
                continue;
            };
            if g.flush_deferred(self.config.read_lease) {
                self.dirty.insert(gid);
            }
            if !g.node.has_ready() {
                // Lease reads wait only for the state machine to catch up.
                g.serve_reads(gid, &mut out);
                continue;
            }
            let mut rd = g.node.ready();
            early.extend(rd.take_messages().into_iter().map(|m| (gid, m)));
            g.take_read_states(&mut rd, self.config.read_lease);
            let mut gw = GroupWrite::new(gid);
            if !rd.snapshot().is_empty() {
                let snap = rd.snapshot().clone();
                g.sm.restore(&snap.data)
                    .map_err(|reason| RaftError::Restore { group: gid, reason })?;
                gw.snapshot = Some(snap.get_metadata().clone());
                gw.save_snapshot = Some(snap.clone());
                // A snapshot taken here before is older than this one.
                g.pending_snapshot = None;
                g.node.mut_store().set_snapshot(snap);
            }
            let committed = rd.take_committed_entries();
            round_bytes += entry_bytes(&committed);
            let before = out.finished.len();
            let mut conf = apply_entries(gid, g, committed, &mut out)?;
            if conf.is_none() {
                // A membership change's outcome waits until its conf state is written.
                early_finished.extend(out.finished.drain(before..));
            }
            gw.entries = rd.take_entries();
            g.prefetch(&gw.entries);
            gw.hard_state = rd.hs().cloned();
            if conf.is_some() {
                gw.conf_state = conf.take();
            }
            sync |= rd.must_sync() || gw.conf_state.is_some() || gw.snapshot.is_some();
            write.groups.push(gw);
            readies.push((gid, rd));
        }
        if !early.is_empty() || !early_finished.is_empty() {
            early_out(EarlyOutput {
                messages: early,
                finished: early_finished,
            });
        }
        if readies.is_empty() {
            out.barriers = std::mem::take(&mut self.barriers);
            return Ok(out);
        }
        self.log.write(&write, sync)?;
        for gw in &write.groups {
            if let Some(g) = self.groups.get_mut(&gw.group) {
                if gw.snapshot.is_some() {
                    g.node.mut_store().cache_clear();
                }
                g.node.mut_store().cache_append(&gw.entries);
            }
        }

        let mut after = LogWrite::default();
        let mut after_sync = false;
        for (gid, rd) in readies {
            let Some(g) = self.groups.get_mut(&gid) else {
                continue;
            };
            let mut rd = rd;
            out.messages
                .extend(rd.take_persisted_messages().into_iter().map(|m| (gid, m)));
            let mut light = g.node.advance(rd);
            let mut gw = GroupWrite::new(gid);
            if let Some(commit) = light.commit_index() {
                let mut hs = g.node.raft.hard_state();
                hs.commit = commit;
                gw.hard_state = Some(hs);
            }
            out.messages
                .extend(light.take_messages().into_iter().map(|m| (gid, m)));
            let committed = light.take_committed_entries();
            if let Some(cs) = apply_entries(gid, g, committed, &mut out)? {
                gw.conf_state = Some(cs);
                after_sync = true;
            }
            g.node.advance_apply();
            g.serve_reads(gid, &mut out);
            self.maybe_compact(gid, &mut gw);
            if !gw.is_empty() {
                after.groups.push(gw);
            }
            if let Some(g) = self.groups.get(&gid) {
                g.publish_gate(self.config.read_lease);
            }
            if self
                .groups
                .get_mut(&gid)
                .is_some_and(|g| g.flush_deferred(self.config.read_lease))
            {
                self.dirty.insert(gid);
            }
            // More to do (e.g. committed entries beyond one fetch): look again next round.
            if self.groups.get(&gid).is_some_and(|g| g.node.has_ready()) {
                self.dirty.insert(gid);
            }
        }
        if !after.is_empty() {
            self.log.write(&after, after_sync)?;
        }
        out.barriers = std::mem::take(&mut self.barriers);
        Ok(out)
    }

    /// The dirty groups in the order a round takes them: from where the last round stopped at
    /// its apply budget, if it did, so no group waits behind the same others twice.
    fn round_order(&mut self) -> Vec<GroupId> {
        let dirty = std::mem::take(&mut self.dirty);
        match self.cut_at.take() {
            Some(from) => {
                let mut order: Vec<GroupId> = dirty.range(from..).copied().collect();
                order.extend(dirty.range(..from));
                order
            }
            None => dirty.into_iter().collect(),
        }
    }

    /// Whether a round that has applied `bytes` stops before the groups `left`; if so they wait
    /// for the next round, which starts with them.
    fn cut_round(&mut self, left: &[GroupId], bytes: u64) -> bool {
        let Some(&next) = left.first() else {
            return false;
        };
        if bytes < self.config.max_apply_per_round {
            return false;
        }
        self.dirty.extend(left);
        self.cut_at = Some(next);
        true
    }

    /// Whether the last Ready round stopped at its apply budget with groups left: the caller
    /// runs the next round without waiting for a tick or a message.
    pub fn round_was_cut(&self) -> bool {
        self.cut_at.is_some()
    }

    /// Whether the next Ready round must write its log itself, after every [`LogJob`] handed out
    /// before is written, rather than be made with [`RaftNode::process_ready_async`]: a snapshot
    /// to install or to save changes the log's bounds, which raft-rs reads back at once.
    pub fn needs_sync_round(&self) -> bool {
        self.dirty.iter().any(|gid| {
            self.groups.get(gid).is_some_and(|g| {
                g.node.raft.raft_log.unstable_snapshot().is_some()
                    || g.pending_snapshot
                        .as_ref()
                        .is_some_and(|(_, _, done)| *done)
            })
        })
    }

    /// [`RaftNode::process_ready_with`] without waiting for the log: the round's write, and what
    /// must follow it, come back as a [`LogJob`] for a writer thread, while this thread goes on
    /// to the next round (raft-rs's asynchronous Ready; thesis §10.2.1 for the leader). Entries
    /// committed on a quorum are applied once written here too (raft-rs hands out no others), so
    /// a leader's acknowledgement still means the entry is durable on it. Call only when
    /// [`RaftNode::needs_sync_round`] is false; jobs must be written in order.
    pub fn process_ready_async(
        &mut self,
        mut early_out: impl FnMut(EarlyOutput),
    ) -> Result<(ReadyOutput, Option<LogJob>), RaftError> {
        let mut out = ReadyOutput::default();
        let mut job = LogJob::default();
        let mut early = Vec::new();
        let mut early_finished = Vec::new();
        let order = self.round_order();
        let mut round_bytes = 0u64;
        for (i, &gid) in order.iter().enumerate() {
            if self.cut_round(&order[i..], round_bytes) {
                break;
            }
            let Some(g) = self.groups.get_mut(&gid) else {
                continue;
            };
            if g.flush_deferred(self.config.read_lease) {
                self.dirty.insert(gid);
            }
            if !g.node.has_ready() {
                g.serve_reads(gid, &mut out);
                continue;
            }
            if g.node.raft.raft_log.unstable_snapshot().is_some() {
                // needs_sync_round said otherwise: leave it to the next (synchronous) round.
                self.dirty.insert(gid);
                continue;
            }
            let mut rd = g.node.ready();
            early.extend(rd.take_messages().into_iter().map(|m| (gid, m)));
            g.take_read_states(&mut rd, self.config.read_lease);
            let mut gw = GroupWrite::new(gid);
            let committed = rd.take_committed_entries();
            round_bytes += entry_bytes(&committed);
            let before = out.finished.len();
            let conf = apply_entries(gid, g, committed, &mut out)?;
            if conf.is_none() {
                early_finished.extend(out.finished.drain(before..));
            } else {
                // A membership change's outcome waits until its conf state is written.
                job.finished.extend(out.finished.drain(before..));
                gw.conf_state = conf;
                job.sync = true;
            }
            gw.entries = rd.take_entries();
            // Prefetched by the caller after the round: a read-ahead started here would delay a
            // leader's appends and a follower's log write (4 KiB overwrites at one in flight
            // through FUSE: +3.5-5.7 %, docs/benchmarks.md).
            out.prefetch.extend(
                gw.entries
                    .iter()
                    .filter(|e| prefetchable(e))
                    .map(|e| (gid, e.data.clone())),
            );
            gw.hard_state = rd.hs().cloned();
            job.sync |= rd.must_sync();
            job.messages
                .extend(rd.take_persisted_messages().into_iter().map(|m| (gid, m)));
            let entries = !gw.entries.is_empty();
            g.node.mut_store().append_unwritten(&gw.entries);
            job.written.push(Written {
                group: gid,
                number: rd.number(),
                entries,
            });
            g.node.advance_append_async(rd);
            g.node.advance_apply();
            g.serve_reads(gid, &mut out);
            if !gw.is_empty() {
                job.write.groups.push(gw);
            }
            let mut compact = GroupWrite::new(gid);
            self.maybe_compact(gid, &mut compact);
            if !compact.is_empty() {
                job.write.groups.push(compact);
            }
            if let Some(g) = self.groups.get_mut(&gid) {
                g.publish_gate(self.config.read_lease);
                if g.flush_deferred(self.config.read_lease) || g.node.has_ready() {
                    self.dirty.insert(gid);
                }
            }
        }
        if !early.is_empty() || !early_finished.is_empty() {
            early_out(EarlyOutput {
                messages: early,
                finished: early_finished,
            });
        }
        out.barriers = std::mem::take(&mut self.barriers);
        let job = (!job.written.is_empty() || !job.write.is_empty()).then_some(job);
        Ok((out, job))
    }

    /// [`StateMachine::prefetch`] for the commands a round handed out ([`ReadyOutput::prefetch`]).
    pub fn prefetch(&self, commands: &[(GroupId, bytes::Bytes)]) {
        for (gid, command) in commands {
            if let Some(g) = self.groups.get(gid) {
                g.sm.prefetch(command);
            }
        }
    }

    /// A [`LogJob`]'s write is done: its groups learn that their entries are durable here (a
    /// leader may now commit and apply them).
    pub fn on_written(&mut self, written: &[Written]) {
        for w in written {
            if let Some(g) = self.groups.get_mut(&w.group) {
                g.node.on_persist_ready(w.number);
                if w.entries {
                    g.node.mut_store().written();
                }
                self.dirty.insert(w.group);
            }
        }
    }

    /// Saves the snapshots whose barriers succeeded, compacting the log behind each, in one write.
    fn save_durable_snapshots(&mut self) -> Result<(), RaftError> {
        let mut write = LogWrite::default();
        for gid in &self.dirty {
            let Some(g) = self.groups.get_mut(gid) else {
                continue;
            };
            let Some((_, snap, _)) = g.pending_snapshot.take_if(|(_, _, done)| *done) else {
                continue;
            };
            let mut gw = GroupWrite::new(*gid);
            Self::install_own_snapshot(g, snap, g.keep, &mut gw);
            if !gw.is_empty() {
                write.groups.push(gw);
            }
        }
        if !write.is_empty() {
            self.log.write(&write, false)?;
        }
        Ok(())
    }

    /// Saves a snapshot this replica took (in `gw`, with the compaction behind it). Superseded
    /// ones (an older index than the group's current snapshot) change nothing.
    fn install_own_snapshot(g: &mut Group<S>, snap: Snapshot, keep: u64, gw: &mut GroupWrite) {
        let index = snap.get_metadata().index;
        let first = g.node.raft.raft_log.first_index();
        if index + 1 < first
            || g.node
                .store()
                .snapshot_ref()
                .is_some_and(|s| s.get_metadata().index > index)
            || index > g.node.raft.raft_log.applied
        {
            return;
        }
        // Saved in the same write as the compaction: the log never loses entries whose effects are
        // not durable in a snapshot.
        gw.save_snapshot = Some(snap.clone());
        g.node.mut_store().set_snapshot(snap);
        // Keep the last entries so that a follower slightly behind catches up from the log.
        let compact_to = index.saturating_sub(keep);
        if compact_to > first {
            gw.compact_to = Some(compact_to);
        }
    }

    /// Snapshots a group's state machine and drops applied entries when the log has grown past
    /// `compact_after` entries beyond the last snapshot, or when raft-rs asked for a newer snapshot.
    fn maybe_compact(&mut self, gid: GroupId, gw: &mut GroupWrite) {
        let Some(g) = self.groups.get_mut(&gid) else {
            return;
        };
        // One snapshot at a time: a request from raft-rs stays until the pending one is saved.
        if g.pending_snapshot.is_some() {
            return;
        }
        let applied = g.node.raft.raft_log.applied;
        let first = g.node.raft.raft_log.first_index();
        let wanted = g.node.store().take_snapshot_request();
        let big = g.since_snapshot.1 >= self.config.compact_after_bytes;
        if applied < first || (!wanted && !big && applied - first < self.config.compact_after) {
            return;
        }
        let Ok(term) = g.node.raft.raft_log.term(applied) else {
            return;
        };
        let mut snap = Snapshot {
            data: g.sm.snapshot().into(),
            ..Default::default()
        };
        let meta = snap.mut_metadata();
        meta.index = applied;
        meta.term = term;
        meta.set_conf_state(g.node.raft.prs().conf().to_conf_state());
        let keep = keep_behind(&self.config, g.since_snapshot);
        g.since_snapshot = (0, 0);
        g.keep = keep;
        match g.sm.durability_barrier() {
            None => Self::install_own_snapshot(g, snap, keep, gw),
            Some(run) => {
                let token = self.next_barrier;
                self.next_barrier += 1;
                g.pending_snapshot = Some((token, snap, false));
                self.barriers.push(PendingBarrier {
                    group: gid,
                    token,
                    run,
                });
            }
        }
    }
}

/// Applies committed entries to the group's state machine and reports the outcomes of proposals made
/// here. Returns the conf state if a membership change was applied.
/// Whether an entry carries a command for [`StateMachine::prefetch`].
fn prefetchable(e: &Entry) -> bool {
    e.get_entry_type() == EntryType::EntryNormal && !e.data.is_empty()
}

/// Entries a snapshot keeps in the log behind it, so that a follower slightly behind catches up
/// from the log: half of `compact_after`, and no more than half of `compact_after_bytes` at the
/// average size of the entries `since` the last snapshot (`(entries, bytes)`).
fn keep_behind(config: &NodeConfig, (entries, bytes): (u64, u64)) -> u64 {
    let by_count = config.compact_after / 2;
    if bytes == 0 {
        return by_count;
    }
    let by_bytes =
        u128::from(config.compact_after_bytes / 2) * u128::from(entries) / u128::from(bytes);
    by_count.min(u64::try_from(by_bytes).unwrap_or(u64::MAX))
}

/// Bytes of the entries' commands.
fn entry_bytes(entries: &[Entry]) -> u64 {
    entries.iter().map(|e| e.data.len() as u64).sum()
}

fn apply_entries<S: StateMachine>(
    gid: GroupId,
    g: &mut Group<S>,
    entries: Vec<Entry>,
    out: &mut ReadyOutput,
) -> Result<Option<raft::eraftpb::ConfState>, RaftError> {
    let mut conf = None;
    out.applied += entries.len() as u64;
    for e in entries {
        let result = match e.get_entry_type() {
            EntryType::EntryNormal if e.data.is_empty() => Vec::new(),
            EntryType::EntryNormal => {
                g.since_snapshot.0 += 1;
                g.since_snapshot.1 += e.data.len() as u64;
                g.sm.apply(e.index, &e.data)
            }
            EntryType::EntryConfChange => {
                let cc = ConfChange::parse_from_bytes(&e.data)
                    .map_err(|err| RaftError::Raft(format!("bad conf change: {err}")))?;
                conf = Some(g.node.apply_conf_change(&cc)?);
                Vec::new()
            }
            EntryType::EntryConfChangeV2 => {
                let cc = ConfChangeV2::parse_from_bytes(&e.data)
                    .map_err(|err| RaftError::Raft(format!("bad conf change: {err}")))?;
                conf = Some(g.node.apply_conf_change(&cc)?);
                Vec::new()
            }
        };
        // Proposals at positions that were overwritten before this index can never be applied.
        while let Some((&idx, _)) = g.pending.first_key_value() {
            if idx > e.index {
                break;
            }
            let Some((idx, (term, pid))) = g.pending.pop_first() else {
                break;
            };
            let outcome = if idx == e.index && term == e.term {
                Ok(result.clone())
            } else {
                Err(RaftError::Dropped(gid))
            };
            out.finished.push((pid, outcome));
        }
    }
    Ok(conf)
}
