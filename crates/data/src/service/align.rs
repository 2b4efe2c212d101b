//! Alignment of a new leader's committed offsets with its followers' extents, and the re-check that
//! returns a degraded partition to read-write.

use std::collections::HashMap;
use std::sync::Arc;

use nacre_msgr::{CallOptions, Payload};
use nacre_proto::msg::RemoteError;
use nacre_types::{ExtentId, PartitionId};

use super::append::Track;
use super::{DataNode, Part, err_str, unavailable};
use crate::rpc::*;
use crate::store::ExtentStore;

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

    /// Aligns the committed lengths under `term` (once per term).
    pub(super) async fn ensure_aligned(&self, part: &Part, term: u64) -> Result<(), String> {
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

    pub(super) async fn list_extents(
        &self,
        addr: &str,
        partition: PartitionId,
    ) -> Result<ExtentList, String> {
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
    pub(super) async fn recheck(&self, part: &Part) {
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
}

/// Whether a replica whose extent lengths are `theirs` holds every committed byte.
pub(super) fn holds(theirs: &HashMap<ExtentId, u64>, committed: &[(ExtentId, u64)]) -> bool {
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
pub(super) fn merge_lengths(
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
pub(super) fn holding_all(
    committed: &[(ExtentId, u64)],
    lists: &[(u64, HashMap<ExtentId, u64>)],
) -> Option<u64> {
    lists
        .iter()
        .find(|(_, theirs)| holds(theirs, committed))
        .map(|(node, _)| *node)
}
