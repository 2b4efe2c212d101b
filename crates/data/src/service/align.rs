//! Alignment of a new leader's committed offsets with its followers' extents, and the re-check that
//! returns a degraded partition to read-write.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use nacre_api::master::Replica;
use nacre_msgr::{CallOptions, Payload};
use nacre_proto::msg::RemoteError;
use nacre_types::sync::lock;
use nacre_types::{ExtentId, PartitionId};

use super::agent::join_all;
use super::append::Track;
use super::{DataNode, Part, err_str, unavailable};
use crate::repl::{Action, Event, Lengths, Round};
use nacre_api::data::*;
use nacre_cluster::BoxFuture;

impl DataNode {
    /// Checks that this node leads the partition and has aligned it under the current term.
    ///
    /// The leader and term come from what the Raft thread published after its last message or
    /// Ready round, not from a request to it: under load that thread spends most of its time in
    /// log writes, and every request would wait for one (up to a sync) before its proposal was
    /// even made. A view that is a moment stale is harmless: a proposal on a node that has just
    /// stopped leading fails `NotLeader`, and one that has just started leading is turned away
    /// with a hint the client follows again.
    pub(super) async fn lead(&self, part: &Part) -> Result<(), RemoteError> {
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

    /// Aligns the committed lengths under `term` (once per term): feeds the replication core
    /// ([`crate::repl`]) this replica's lengths and each follower's list, and installs the tracks
    /// it decides, cutting the unacknowledged tails it names.
    pub(super) async fn ensure_aligned(&self, part: &Part, term: u64) -> Result<(), String> {
        if let Some(newer) = lock(&part.repl).superseded(term) {
            return Err(format!(
                "a replica knows term {newer}: this node no longer leads under term {term}"
            ));
        }
        if part.aligned(term) {
            return Ok(());
        }
        let _guard = part.align.lock().await;
        if part.aligned(term) {
            return Ok(());
        }
        let me = self.raft()?.id();
        let followers = part.followers(me);
        let known: Vec<(ExtentId, u64)> = lock(&part.tracks)
            .iter()
            .map(|(e, t)| (*e, t.committed()))
            .collect();
        let mut ready = part.step(Event::Elected {
            term,
            followers: followers.iter().map(|r| r.node.0).collect(),
            local: part.store.extents(),
            known,
        });
        while !ready.is_empty() {
            let (lists, others) = self.list_all(part, &followers, ready, true).await;
            let mut next = Vec::new();
            for ev in lists {
                next.extend(part.step(ev));
            }
            for action in others {
                match action {
                    Action::Settle { term, extents } => {
                        next.extend(self.settle(part, term, &extents));
                    }
                    other => part.note(&other),
                }
            }
            ready = next;
        }
        Ok(())
    }

    /// Asks every follower that `actions` name for its extents at once, each waiting at most
    /// `recheck_timeout` (a follower cut off costs one timeout, not one per follower in turn).
    /// With `skip_down` (a new leader's alignment), a follower the node's Raft store reports
    /// down is not asked: that is most often the old leader, and waiting for it would add to the
    /// fail-over. A re-check asks every follower: a restarted node answers as soon as its
    /// partition is open, before its first keepalive (its first Raft rounds replay its logs).
    /// Returns the answers in the actions' order, and the other actions.
    async fn list_all(
        &self,
        part: &Part,
        followers: &[Replica],
        actions: Vec<Action>,
        skip_down: bool,
    ) -> (Vec<Event>, Vec<Action>) {
        let timeout = self.inner.config.recheck_timeout;
        let mut asks: Vec<BoxFuture<'_, Event>> = Vec::new();
        let mut others = Vec::new();
        for action in actions {
            match action {
                Action::ListExtents { round, follower } => asks.push(Box::pin(
                    self.list_follower(part, followers, round, follower, timeout, skip_down),
                )),
                other => others.push(other),
            }
        }
        (join_all(asks).await, others)
    }

    /// Asks a follower for its extents (waiting at most `timeout`), as the answer the core takes.
    async fn list_follower(
        &self,
        part: &Part,
        followers: &[Replica],
        round: Round,
        follower: u64,
        timeout: Duration,
        skip_down: bool,
    ) -> Event {
        let Some(addr) = followers
            .iter()
            .find(|r| r.node.0 == follower)
            .map(|r| r.addr.clone())
        else {
            return Event::Unreachable {
                round,
                from: follower,
                why: format!("node-{follower}: not a replica"),
            };
        };
        if skip_down
            && self
                .raft()
                .is_ok_and(|r| r.peers_down().borrow().contains(&follower))
        {
            return Event::Unreachable {
                round,
                from: follower,
                why: format!(
                    "{addr}: node-{follower} is down (no Raft message within the peer timeout)"
                ),
            };
        }
        match self.list_extents(&addr, part.id, timeout).await {
            Ok(list) => Event::Listed {
                round,
                from: follower,
                extents: list.extents,
            },
            Err(e) => Event::Unreachable {
                round,
                from: follower,
                why: format!("{addr}: {e}"),
            },
        }
    }

    /// Ends an alignment: with the track table held (no write can take an extent's track
    /// meanwhile), tells the core which extents the applied log released and which have a write
    /// in flight here (their track is held), cuts the tails it names and installs its tracks in
    /// place of the table. Returns the core's other actions.
    fn settle(&self, part: &Part, term: u64, extents: &[ExtentId]) -> Vec<Action> {
        let released = extents
            .iter()
            .copied()
            .filter(|e| part.shared.released(*e))
            .collect();
        let mut held = lock(&part.tracks);
        let busy = Some(
            extents
                .iter()
                .copied()
                .filter(|e| held.get(e).is_some_and(|t| Arc::strong_count(t) > 1))
                .collect(),
        );
        let mut tracks = HashMap::new();
        let mut rest = Vec::new();
        for action in part.step(Event::Settle {
            term,
            released,
            busy,
        }) {
            match action {
                Action::Track {
                    extent,
                    committed,
                    len,
                    cut,
                } => {
                    // A write in flight here keeps its track (and so its lock): a fresh one
                    // would let the next write start where that one is still writing.
                    if let Some(t) = held.get(&extent).filter(|t| Arc::strong_count(t) > 1) {
                        t.commit(committed);
                        t.next.send_if_modified(|n| {
                            let grew = committed > *n;
                            *n = (*n).max(committed);
                            grew
                        });
                        tracks.insert(extent, t.clone());
                        continue;
                    }
                    // The length now, not the one listed when the round began: a replica's
                    // write may have ended since.
                    let mut have = part.store.len(extent).unwrap_or(len).max(len);
                    if cut && part.store.truncate(extent, committed).is_ok() {
                        have = committed;
                    }
                    tracks.insert(extent, Track::new(have.max(committed), committed));
                }
                other => rest.push(other),
            }
        }
        *held = tracks;
        rest
    }

    pub(super) async fn list_extents(
        &self,
        addr: &str,
        partition: PartitionId,
        timeout: Duration,
    ) -> Result<ExtentList, String> {
        let opts = CallOptions {
            timeout: Some(timeout),
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

    /// A read-only partition returns to read-write once every follower answers; extents some
    /// follower's copy is too short for take no appends until it holds their bytes (it repairs
    /// them in the background), and the others take appends at once. A leader that lacks
    /// committed bytes itself (a replica that lost its tail and was elected before it repaired
    /// it) never gets them, since leaders do not repair: it hands the partition to a follower that
    /// holds them all, and repairs as a follower. The core ([`crate::repl`]) decides; this asks
    /// the followers and hands leadership over. One re-check of a partition at a time.
    pub(super) async fn recheck(&self, part: &Part) {
        let Ok(raft) = self.raft() else {
            return;
        };
        let Ok(_one) = part.rechecking.try_lock() else {
            return;
        };
        // Read-only while this node's disk is full (`room`).
        if self.disk_full() {
            return;
        }
        // Tracks of extents released since they were made (a release this leader applied but did
        // not propose, or one applied after the alignment) would otherwise ask for bytes nobody
        // keeps, and the extent would lag for good.
        let (committed, next): (Lengths, Lengths) = {
            let mut t = lock(&part.tracks);
            t.retain(|e, _| !part.shared.released(*e));
            t.iter()
                .map(|(e, t)| ((*e, t.committed()), (*e, *t.next.borrow())))
                .unzip()
        };
        let local = committed
            .iter()
            .map(|(e, _)| (*e, part.store.len(*e).unwrap_or(0)))
            .collect();
        let followers = part.followers(raft.id());
        let mut ready = part.step(Event::Recheck {
            followers: followers.iter().map(|r| r.node.0).collect(),
            committed,
            next,
            local,
        });
        while !ready.is_empty() {
            let (lists, others) = self.list_all(part, &followers, ready, false).await;
            let mut next = Vec::new();
            for ev in lists {
                next.extend(part.step(ev));
            }
            for action in others {
                match action {
                    Action::TransferLeader { to, .. } => {
                        let r = raft.transfer_leader(part.id.0, to).await;
                        tracing::warn!(partition = %part.id, to, result = ?r, "this leader lacks committed bytes; handing leadership to a replica that holds them");
                    }
                    other => part.note(&other),
                }
            }
            ready = next;
        }
    }

    /// Every `recheck_interval`, re-checks each partition this node leads that is read-only or
    /// has extents that lag, each in a task of its own: a follower that does not answer holds up
    /// only its own partition's re-check.
    pub(super) async fn recheck_forever(&self) {
        let mut tick = tokio::time::interval(self.inner.config.recheck_interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let Ok(me) = self.raft().map(|r| r.id()) else {
                continue;
            };
            let parts: Vec<Arc<Part>> = lock(&self.inner.parts).values().cloned().collect();
            for part in parts {
                let leads = part.gate.as_ref().is_some_and(|g| g.leader_term().0 == me);
                if !leads || !part.needs_recheck() || part.rechecking.try_lock().is_err() {
                    continue;
                }
                let node = self.clone();
                tokio::spawn(async move { node.recheck(&part).await });
            }
        }
    }

    /// Reports at once (an extra heartbeat) when a partition turned read-only or writable: the
    /// master's view, and so the clients', follow within a round trip instead of a heartbeat
    /// interval.
    pub(super) async fn report_changes(&self) {
        loop {
            self.inner.writability.notified().await;
            let parts: Vec<Arc<Part>> = lock(&self.inner.parts).values().cloned().collect();
            self.refresh_reports(&parts).await;
            self.inner.report_now.notify_one();
        }
    }
}
