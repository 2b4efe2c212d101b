//! The decisions of a data partition's primary-backup replication (CFS §2.3; docs/ARCHITECTURE.md,
//! "Replication is scenario-aware", "Committed lengths", "Failures"), as a pure state machine.
//!
//! # The loop
//!
//! [`Replication`] is one replica's view of one partition. It does no IO, takes no locks, reads no
//! clock and spawns nothing: the data node service (`crate::service`) is the shell around it. The
//! shell turns what happened into an [`Event`], hands it to [`Replication::step`], then drains
//! [`Replication::ready`] and performs each [`Action`] in order — sending, truncating, handing
//! leadership over — feeding what came of it back as further events. This is raft-rs's Ready
//! loop:
//!
//! ```text
//!   shell                                   Replication
//!   ─────                                   ───────────
//!   Elected { term, local, known }   ──▶    asks the first follower
//!                                    ◀──    ListExtents { round, follower }
//!   (calls it) Listed / Unreachable  ──▶    asks the next, … then, all answered,
//!                                    ◀──    Settle { term, extents }
//!   (holds the track table)
//!   Settle { released, busy }        ──▶    per extent: the committed offset, and whether
//!                                    ◀──    Track { extent, committed, len, cut }, …,
//!                                           Degrade { reason }?, Aligned { term }
//! ```
//!
//! The shell keeps the per-extent lengths the hot path needs (`service::append`'s `Track`: where
//! the next packet starts, what every replica has, what is committed); the per-packet rules it
//! applies to them are the pure functions of [`extent`].
//!
//! # What it decides
//!
//! - **Align.** A replica that leads under a new term asks every follower, one after the other,
//!   for its extents (length, committed offset it knows), then takes per extent the largest
//!   committed offset any replica knew, or else the shortest copy among the replicas that
//!   answered. Bytes past that on the leader are an unacknowledged tail of an earlier leader: it
//!   cuts them (unless a write to the extent is in flight here). A follower that did not answer,
//!   or committed bytes the leader lacks, degrade the partition.
//! - **Degrade.** A follower that does not take a packet (unreachable, failed), or a local store
//!   that refuses a write, makes the partition read-only ([`Action::Degrade`], reported `full` to
//!   the master) until a re-check in which every follower answers ([`Action::Writable`]). A leader
//!   that lacks committed bytes itself hands leadership to a replica holding them all
//!   ([`Action::TransferLeader`]): leaders do not repair.
//! - **Lag.** A follower whose copy of an extent is shorter than the next append needs (a
//!   restarted replica that missed packets) cannot take appends to *that* extent, but takes new
//!   extents like any other. So the extent alone takes no more appends ([`Action::Lags`]; the
//!   client moves to a new extent, as on a read-only partition) while the follower repairs it in
//!   the background, and the rest of the partition stays, or becomes, writable. Alignment and
//!   every re-check decide which extents lag; a follower that refuses a packet because its copy
//!   does not continue where the packet starts makes the extent lag too. A re-check that finds
//!   every follower holding an extent's bytes lets it take appends again ([`Action::CaughtUp`]).
//! - **Deposed.** A follower that knows a newer Raft term than the one the leader's packet names
//!   refuses it ([`extent::check_term`]); the leader fails the write, degrades nothing, and takes
//!   no more writes under its old term ([`Event::Deposed`], [`Replication::superseded`]).
//! - **Repair.** A follower compares suspect extents block by block and copies the committed
//!   bytes it lacks from the leader ([`repair_steps`]).
//! - **Reopen.** A store that failed an IO is reopened by a follower (or a lone replica); a leader
//!   hands leadership over first ([`Event::StoreFailed`]). After a reopen, as after a restart,
//!   nothing is aligned and no committed offset is known: the lengths on disk are all there is
//!   until the next alignment.
//!
//! # Invariants
//!
//! - An acknowledged byte is on every replica, so neither the largest committed offset any
//!   replica knew nor the shortest copy is below what was acknowledged: alignment never commits
//!   less than was acknowledged, and never cuts an acknowledged byte.
//! - Never acknowledge past what every replica holds; never serve past the committed offset.
//! - A follower never cuts below the committed offset it was told ([`extent::follower_take`]).
//! - A degraded partition stays degraded until a re-check in which every follower answered; the
//!   first reason is kept.
//! - No append is taken into an extent that lags: every replica holds where the next append of
//!   a writable extent starts (for a tiny extent, its committed bytes: its writes go past every
//!   copy's end, and a follower short of committed bytes there would be left with a gap).
//! - Released extents count for nobody: alignment makes no track for them.
//! - A replica told of a newer term never again writes under an older one.

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};

use nacre_types::ExtentId;

pub mod extent;

/// A replica's node id (the Raft node id).
pub type Node = u64;

/// Extent lengths, or committed offsets, by extent.
pub type Lengths = Vec<(ExtentId, u64)>;

/// What a listing answers for: a new leader's alignment under a term, or a re-check of a
/// read-only partition (numbered: duty rounds may overlap, and a new re-check supersedes the one
/// under way). Answers for a round no longer under way are ignored.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Round {
    Align { term: u64 },
    Recheck { id: u64 },
}

/// What happened, as the shell tells it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Event {
    /// This replica leads under `term` and has not aligned under it. `followers` in the order to
    /// ask them; `local`: the extents on disk here with their lengths; `known`: the committed
    /// offsets this replica knows (none after a restart or a reopen).
    Elected {
        term: u64,
        followers: Vec<Node>,
        local: Lengths,
        known: Lengths,
    },
    /// A follower's extents: (extent, length, the committed offset it knows).
    Listed {
        round: Round,
        from: Node,
        extents: Vec<(ExtentId, u64, u64)>,
    },
    /// A follower did not answer a listing; `why` names it and says what failed.
    Unreachable {
        round: Round,
        from: Node,
        why: String,
    },
    /// The answer to [`Action::Settle`]: of the extents asked about, those the applied log
    /// released and those with a write in flight here (`None`: cannot tell, so all of them).
    Settle {
        term: u64,
        released: BTreeSet<ExtentId>,
        busy: Option<BTreeSet<ExtentId>>,
    },
    /// A packet (or batch) did not reach every replica, or a replica could not make it durable.
    ReplicationFailed { why: String },
    /// This replica's store refused a write (no space, failed IO).
    LocalWriteRefused { why: String },
    /// Duty round on a partition this replica leads that is read-only or has extents that lag:
    /// `committed` are the committed offsets it tracks (released extents left out), `next`
    /// where the next append of each extent starts (extents left out: at the committed offset),
    /// `local` its lengths on disk.
    Recheck {
        followers: Vec<Node>,
        committed: Lengths,
        next: Lengths,
        local: Lengths,
    },
    /// A follower refused a packet of `extent` because its copy does not continue where the
    /// packet starts (it lacks bytes before it, or the packet would cut committed ones).
    ExtentRefused { extent: ExtentId, why: String },
    /// A follower refused a packet sent under `term`: it knows the newer term `newer`.
    Deposed { term: u64, newer: u64 },
    /// This replica's store failed an IO and refuses work until reopened.
    StoreFailed { leading: bool, followers: Vec<Node> },
    /// The store was reopened (recovered from what is on disk).
    StoreReopened,
}

/// What the shell must do, in order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Action {
    /// Ask `follower` for its extents; answer with [`Event::Listed`] or [`Event::Unreachable`].
    ListExtents { round: Round, follower: Node },
    /// Every follower answered the alignment under `term`: hold the track table (no write may
    /// take a track until the [`Action::Track`]s that follow replace it) and answer with
    /// [`Event::Settle`] about `extents`.
    Settle { term: u64, extents: Vec<ExtentId> },
    /// The extent's track after alignment: committed offset `committed`, `len` bytes here. With
    /// `cut`, truncate it to `committed` first (appends then continue at `committed`; if the
    /// truncation fails, at `len`). The tracks of one alignment replace the whole table.
    Track {
        extent: ExtentId,
        committed: u64,
        len: u64,
        cut: bool,
    },
    /// The partition becomes read-only (it was not): take no appends, report it full.
    Degrade { reason: String },
    /// Alignment under `term` is done: serve appends and reads.
    Aligned { term: u64 },
    /// Hand leadership to `to`.
    TransferLeader { to: Node, why: TransferReason },
    /// The partition takes appends again; `was` is why it was read-only.
    Writable { was: String },
    /// A re-check ended with the partition still read-only.
    StillReadOnly { why: String },
    /// The extent takes no appends until a re-check finds every follower holding its bytes.
    Lags { extent: ExtentId, why: String },
    /// These extents, which lagged, take appends again.
    CaughtUp { extents: Vec<ExtentId> },
    /// This replica takes no more writes under `term`: a replica knows the newer term `newer`.
    Superseded { term: u64, newer: u64 },
    /// Reopen the failed store: forget every track first (as a restart does), then answer with
    /// [`Event::StoreReopened`] if it worked.
    Reopen,
}

/// Why a leader hands leadership over.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TransferReason {
    /// It lacks committed bytes that `to` holds.
    LacksCommitted,
    /// Its store failed.
    StoreFailed,
}

/// A new leader's alignment under way.
#[derive(Debug)]
struct Aligning {
    term: u64,
    ask: VecDeque<Node>,
    local: Lengths,
    known: HashMap<ExtentId, u64>,
    lists: Vec<Vec<(ExtentId, u64, u64)>>,
    unreachable: Vec<String>,
    /// Set once every follower answered: the extents asked about in [`Action::Settle`].
    settling: bool,
}

/// A re-check under way.
#[derive(Debug)]
struct Rechecking {
    id: u64,
    ask: VecDeque<Node>,
    committed: Lengths,
    /// Where each extent's next append starts (see [`Event::Recheck`]).
    next: HashMap<ExtentId, u64>,
    /// Extents whose committed bytes this leader lacks.
    short: Vec<ExtentId>,
    lists: Vec<(Node, HashMap<ExtentId, u64>)>,
    /// Extents made to lag while the round ran: its listings may predate the refusal.
    refused: BTreeSet<ExtentId>,
}

/// One replica's replication state of one partition (see the module doc).
#[derive(Debug, Default)]
pub struct Replication {
    /// The term under which this replica, as leader, aligned.
    aligned: Option<u64>,
    /// Why the partition takes no appends, if it does not.
    degraded: Option<String>,
    /// Extents that take no appends: a follower's copy is short of where the next one starts.
    lagging: BTreeSet<ExtentId>,
    /// The newest term a follower told this replica of, when it refused a packet.
    newer: Option<u64>,
    aligning: Option<Aligning>,
    rechecking: Option<Rechecking>,
    /// Re-checks started (to number them).
    rechecks: u64,
    /// Leadership hand-offs asked because the store failed (to pick the follower).
    handoffs: u64,
    ready: Vec<Action>,
}

impl Replication {
    pub fn new() -> Self {
        Self::default()
    }

    /// Whether this replica aligned under `term`.
    pub fn aligned(&self, term: u64) -> bool {
        self.aligned == Some(term)
    }

    /// Why the partition is read-only, if it is.
    pub fn degraded(&self) -> Option<&str> {
        self.degraded.as_deref()
    }

    /// The term under which this replica, as leader, aligned (None: not since it started or
    /// reopened its store). Packets it forwards name it.
    pub fn aligned_term(&self) -> Option<u64> {
        self.aligned
    }

    /// Whether `extent` takes no appends because a follower's copy of it is short.
    pub fn lagging(&self, extent: ExtentId) -> bool {
        self.lagging.contains(&extent)
    }

    /// The extents that take no appends because a follower's copy is short.
    pub fn lagging_extents(&self) -> &BTreeSet<ExtentId> {
        &self.lagging
    }

    /// The newer term a follower knows, if one told this replica of a term newer than `term`:
    /// then this replica must not write under `term`.
    pub fn superseded(&self, term: u64) -> Option<u64> {
        self.newer.filter(|n| *n > term)
    }

    /// The actions decided since the last call, in order.
    pub fn ready(&mut self) -> Vec<Action> {
        std::mem::take(&mut self.ready)
    }

    /// Takes one event.
    pub fn step(&mut self, event: Event) {
        match event {
            Event::Elected {
                term,
                followers,
                local,
                known,
            } => {
                self.aligning = Some(Aligning {
                    term,
                    ask: followers.into(),
                    local,
                    known: known.into_iter().collect(),
                    lists: Vec::new(),
                    unreachable: Vec::new(),
                    settling: false,
                });
                self.ask_next_align();
            }
            Event::Listed {
                round,
                from,
                extents,
            } => match round {
                Round::Align { term } => {
                    if let Some(a) = self.aligning_for(term) {
                        a.lists.push(extents);
                        self.ask_next_align();
                    }
                }
                Round::Recheck { id } => {
                    if let Some(r) = self.rechecking.as_mut().filter(|r| r.id == id) {
                        r.lists
                            .push((from, extents.iter().map(|(e, l, _)| (*e, *l)).collect()));
                        self.ask_next_recheck();
                    }
                }
            },
            Event::Unreachable { round, from, why } => match round {
                Round::Align { term } => {
                    if let Some(a) = self.aligning_for(term) {
                        a.unreachable.push(why);
                        self.ask_next_align();
                    }
                }
                Round::Recheck { id } => {
                    let Some(r) = self.rechecking.as_ref().filter(|r| r.id == id) else {
                        return;
                    };
                    // Every follower must answer before the partition is writable again; a
                    // leader that lacks bytes still looks for one that holds them all.
                    if r.short.is_empty() {
                        self.rechecking = None;
                        if self.degraded.is_some() {
                            self.ready.push(Action::StillReadOnly {
                                why: format!("follower node-{from} does not answer: {why}"),
                            });
                        }
                    } else {
                        self.ask_next_recheck();
                    }
                }
            },
            Event::Settle {
                term,
                released,
                busy,
            } => self.settle(term, &released, busy.as_ref()),
            Event::ReplicationFailed { why } | Event::LocalWriteRefused { why } => {
                self.degrade(why)
            }
            Event::Recheck {
                followers,
                committed,
                next,
                local,
            } => {
                let local: HashMap<ExtentId, u64> = local.into_iter().collect();
                let short = committed
                    .iter()
                    .filter(|(e, c)| local.get(e).copied().unwrap_or(0) < *c)
                    .map(|(e, _)| *e)
                    .collect();
                self.rechecks += 1;
                self.rechecking = Some(Rechecking {
                    id: self.rechecks,
                    ask: followers.into(),
                    committed,
                    next: next.into_iter().collect(),
                    short,
                    lists: Vec::new(),
                    refused: BTreeSet::new(),
                });
                self.ask_next_recheck();
            }
            Event::ExtentRefused { extent, why } => {
                if let Some(r) = self.rechecking.as_mut() {
                    r.refused.insert(extent);
                }
                if self.lagging.insert(extent) {
                    self.ready.push(Action::Lags { extent, why });
                }
            }
            Event::Deposed { term, newer } => {
                if newer > term && self.newer.is_none_or(|n| newer > n) {
                    self.newer = Some(newer);
                    self.ready.push(Action::Superseded { term, newer });
                }
            }
            Event::StoreFailed { leading, followers } => {
                if leading && !followers.is_empty() {
                    // The same follower for a few rounds (asking another aborts a hand-off in
                    // progress), then the next one, in case that one is down.
                    let n = self.handoffs as usize;
                    self.handoffs += 1;
                    self.ready.push(Action::TransferLeader {
                        to: followers[n / 4 % followers.len()],
                        why: TransferReason::StoreFailed,
                    });
                } else {
                    self.ready.push(Action::Reopen);
                }
            }
            Event::StoreReopened => {
                self.aligned = None;
                self.lagging.clear();
            }
        }
    }

    fn aligning_for(&mut self, term: u64) -> Option<&mut Aligning> {
        self.aligning
            .as_mut()
            .filter(|a| a.term == term && !a.settling)
    }

    fn degrade(&mut self, why: String) {
        if self.degraded.is_none() {
            self.degraded = Some(why.clone());
            self.ready.push(Action::Degrade { reason: why });
        }
    }

    /// Asks the next follower for the alignment under way, or, all answered, asks to settle.
    fn ask_next_align(&mut self) {
        let Some(a) = self.aligning.as_mut() else {
            return;
        };
        let round = Round::Align { term: a.term };
        if let Some(follower) = a.ask.pop_front() {
            self.ready.push(Action::ListExtents { round, follower });
            return;
        }
        a.settling = true;
        let mut extents: BTreeSet<ExtentId> = a.local.iter().map(|(e, _)| *e).collect();
        extents.extend(a.lists.iter().flatten().map(|(e, _, _)| *e));
        self.ready.push(Action::Settle {
            term: a.term,
            extents: extents.into_iter().collect(),
        });
    }

    fn settle(
        &mut self,
        term: u64,
        released: &BTreeSet<ExtentId>,
        busy: Option<&BTreeSet<ExtentId>>,
    ) {
        let Some(a) = self.aligning.take_if(|a| a.term == term && a.settling) else {
            return;
        };
        // In extent order, so that what the shell does (and a script expects) is deterministic.
        let lens: BTreeMap<ExtentId, (u64, u64)> =
            merge_lengths(&a.local, &a.known, &a.lists, |e| released.contains(&e))
                .into_iter()
                .collect();
        let mut short = Vec::new();
        let mut lagging = BTreeSet::new();
        for (extent, (min, max_c)) in lens {
            let committed = max_c.max(min);
            let len = a
                .local
                .iter()
                .find(|(id, _)| *id == extent)
                .map_or(0, |(_, l)| *l);
            if len < committed {
                short.push(extent);
            }
            let busy = busy.is_none_or(|b| b.contains(&extent));
            let cut = len > committed && !busy && !extent.is_tiny();
            // Where the next append starts once the track is installed; a write in flight here
            // is on its way to the followers, so its extent is judged by its next packet.
            let next = if cut { committed } else { len.max(committed) };
            let need = need(extent, committed, next);
            let short_copy = a.lists.iter().any(|list| {
                list.iter()
                    .find(|(e, _, _)| *e == extent)
                    .map_or(0, |(_, l, _)| *l)
                    < need
            });
            if short_copy && !busy {
                lagging.insert(extent);
            }
            self.ready.push(Action::Track {
                extent,
                committed,
                len,
                cut,
            });
        }
        // A new term's tracks replace the old ones, and so does what lags.
        self.lagging = lagging;
        for extent in &self.lagging {
            self.ready.push(Action::Lags {
                extent: *extent,
                why: "a follower's copy is short at the leader change".into(),
            });
        }
        if !a.unreachable.is_empty() {
            self.degrade(format!(
                "replicas unreachable at leader change: {}",
                a.unreachable.join(", ")
            ));
        }
        if !short.is_empty() {
            self.degrade(format!(
                "the leader lacks committed bytes of extents {short:?}"
            ));
        }
        self.aligned = Some(term);
        self.ready.push(Action::Aligned { term });
    }

    /// Asks the next follower for the re-check under way, or, all answered, decides it.
    fn ask_next_recheck(&mut self) {
        let Some(r) = self.rechecking.as_mut() else {
            return;
        };
        if let Some(follower) = r.ask.pop_front() {
            let round = Round::Recheck { id: r.id };
            self.ready.push(Action::ListExtents { round, follower });
            return;
        }
        let Some(r) = self.rechecking.take() else {
            return;
        };
        if !r.short.is_empty() {
            self.ready.push(match holding_all(&r.committed, &r.lists) {
                Some(to) => Action::TransferLeader {
                    to,
                    why: TransferReason::LacksCommitted,
                },
                None => Action::StillReadOnly {
                    why: format!(
                        "this leader lacks committed bytes of extents {:?} and no replica holds \
                         them all",
                        r.short
                    ),
                },
            });
            return;
        }
        // Every follower answered: the partition takes appends again, except to the extents
        // some follower's copy is too short for, which it repairs in the background. By
        // extent, the first follower short of its bytes:
        let mut short_on: BTreeMap<ExtentId, Node> = BTreeMap::new();
        for (e, c) in &r.committed {
            let need = need(*e, *c, r.next.get(e).copied().unwrap_or(*c));
            if let Some((node, _)) = r
                .lists
                .iter()
                .find(|(_, theirs)| theirs.get(e).copied().unwrap_or(0) < need)
            {
                short_on.insert(*e, *node);
            }
        }
        let mut lagging: BTreeSet<ExtentId> = short_on.keys().copied().collect();
        lagging.extend(r.refused.iter().copied());
        let caught: Vec<ExtentId> = self.lagging.difference(&lagging).copied().collect();
        for extent in lagging.difference(&self.lagging) {
            let why = match short_on.get(extent) {
                Some(node) => format!("follower node-{node} lacks bytes (repair pending)"),
                None => "a follower refused a packet".to_string(),
            };
            self.ready.push(Action::Lags {
                extent: *extent,
                why,
            });
        }
        self.lagging = lagging;
        if !caught.is_empty() {
            self.ready.push(Action::CaughtUp { extents: caught });
        }
        if let Some(was) = self.degraded.take() {
            self.ready.push(Action::Writable { was });
        }
    }
}

/// The length every replica must hold for an extent to take appends: where the next append
/// starts, or for a tiny extent its committed offset (tiny writes go past every copy's end, so
/// only a copy short of committed bytes, which the write would leave behind a gap, counts).
pub fn need(extent: ExtentId, committed: u64, next: u64) -> u64 {
    if extent.is_tiny() {
        committed
    } else {
        committed.max(next)
    }
}

/// Whether a replica whose extent lengths are `theirs` holds every committed byte.
pub fn holds(theirs: &HashMap<ExtentId, u64>, committed: &[(ExtentId, u64)]) -> bool {
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
pub fn merge_lengths(
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
pub fn holding_all(
    committed: &[(ExtentId, u64)],
    lists: &[(Node, HashMap<ExtentId, u64>)],
) -> Option<Node> {
    lists
        .iter()
        .find(|(_, theirs)| holds(theirs, committed))
        .map(|(node, _)| *node)
}

/// One step of a follower's repair of an extent from the leader.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RepairStep {
    /// Compare the block CRCs below `upto` with the leader's and fetch the blocks that differ.
    Compare { upto: u64 },
    /// Copy `count` whole blocks from block `first`.
    Copy { first: u64, count: u32 },
}

/// Most blocks one repair fetch asks for.
pub const REPAIR_BLOCKS: u32 = 8;

/// How a follower holding `have` bytes of an extent whose committed offset on the leader is
/// `committed` repairs it, in order: a suspect extent (blocks that failed their CRC, or every
/// extent after a reopen or a snapshot install) is compared first, then the committed bytes it
/// lacks are copied, whole blocks of `block_size`, [`REPAIR_BLOCKS`] at a time.
pub fn repair_steps(have: u64, committed: u64, suspect: bool, block_size: u64) -> Vec<RepairStep> {
    let mut steps = Vec::new();
    if suspect {
        steps.push(RepairStep::Compare {
            upto: have.min(committed),
        });
    }
    if have < committed && block_size > 0 {
        let last = committed.div_ceil(block_size);
        let mut b = have / block_size;
        while b < last {
            let count = (last - b).min(u64::from(REPAIR_BLOCKS)) as u32;
            steps.push(RepairStep::Copy { first: b, count });
            b += u64::from(count);
        }
    }
    steps
}
