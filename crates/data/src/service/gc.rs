//! Garbage collection of leaked normal extents: a mark-and-sweep between a data partition's
//! leader and the meta partitions of its volume, with a grace period (docs/ARCHITECTURE.md,
//! "Garbage collection").
//!
//! A client writes an extent's bytes first and commits their key to a meta partition after; a
//! stream that moves to another partition after a failure, or a client whose commit fails, leaves
//! an extent no key names. The meta partitions free what their keys stop naming (`Release`), but
//! never learn of these. So every `gc_period` each partition leader:
//! 1. lists its normal extents (tiny extents are shared by many files and freed by punching
//!    holes; they are never collected), and keeps as *candidates* those idle for at least the
//!    grace: no create, write or overwrite seen by this replica since (an extent this replica has
//!    not seen before counts as active from the moment the sweep first lists it);
//! 2. asks every meta partition of the volume (`Query::Referenced`) which of its extents they
//!    still reference — keys of live and orphaned inodes and the to-free list;
//! 3. deletes the candidates no meta partition references through the partition's Raft group
//!    (`Release` of the whole extent, as the meta partitions' own releases do), so every replica
//!    frees them. If any meta partition does not answer, that round deletes nothing.
//!
//! **Why a key committed during the sweep is safe.** Clients never commit a key for a normal
//! extent more than `KEY_COMMIT_WITHIN` after sending the first write that key covers (they fail
//! the commit instead), and a commit sent is applied within the rest of the grace or never. A
//! candidate's last write reached this replica at least `grace` before the listing, so any key a
//! client may still commit for it was applied before the listing — and the linearizable read of
//! step 2, which comes after, sees it. The grace of the background sweep is at least
//! [`MIN_GC_GRACE`], twice `KEY_COMMIT_WITHIN`.
//!
//! The pure parts — which extents are candidates ([`Activity`]) and what a sweep deletes and
//! counts ([`decide`]) — take times and answers as inputs and are tested without IO.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use nacre_api::data::{DataError, MIN_GC_GRACE, SweepReport};
use nacre_api::master::{ReportGc, ReportGcRequest};
use nacre_api::meta::{Query, Reply};
use nacre_client::{MasterClient, MetaTransport, NetVolume};
use nacre_types::sync::lock;
use nacre_types::{ExtentId, PartitionId};

use super::{DataNode, Part};
use crate::sm::DataCommand;

/// Most extents asked about in one `Query::Referenced` (16 bytes each on the wire).
const QUERY_CHUNK: usize = 8192;
/// Most extents deleted by one `Release` entry.
const RELEASE_CHUNK: usize = 256;

/// When each normal extent of a partition was last active on this replica: created (first
/// listed by a sweep), written, or overwritten. Every replica keeps one (appends touch it on the
/// leader, replicated packets on the followers), so a new leader knows of every acknowledged
/// write; the extents it never saw written count from its first listing.
#[derive(Debug, Default)]
pub(super) struct Activity {
    last: HashMap<ExtentId, Instant>,
}

impl Activity {
    /// `extent` was created, written or overwritten at `now`.
    pub(super) fn touch(&mut self, extent: ExtentId, now: Instant) {
        let t = self.last.entry(extent).or_insert(now);
        *t = (*t).max(now);
    }

    /// The normal extents of `listed` idle at `now` for at least `grace`, in `listed`'s order.
    /// Extents listed for the first time are active from `now`; extents no longer listed are
    /// forgotten.
    pub(super) fn candidates(
        &mut self,
        listed: &[(ExtentId, u64)],
        now: Instant,
        grace: Duration,
    ) -> Vec<ExtentId> {
        let listed_set: BTreeSet<ExtentId> = listed.iter().map(|(e, _)| *e).collect();
        self.last.retain(|e, _| listed_set.contains(e));
        let mut out = Vec::new();
        for &(e, _) in listed {
            if !e.is_normal() {
                continue;
            }
            let since = *self.last.entry(e).or_insert(now);
            if now.saturating_duration_since(since) >= grace {
                out.push(e);
            }
        }
        out
    }

    /// Whether `extent` stayed idle since `since` (not touched after it).
    pub(super) fn idle_since(&self, extent: ExtentId, since: Instant) -> bool {
        self.last.get(&extent).is_some_and(|t| *t <= since)
    }

    /// Forgets extents no longer listed (followers, which never sweep).
    pub(super) fn prune(&mut self, listed: &[(ExtentId, u64)]) {
        let listed: BTreeSet<ExtentId> = listed.iter().map(|(e, _)| *e).collect();
        self.last.retain(|e, _| listed.contains(e));
    }
}

/// What one sweep of one partition deletes, and its figures.
#[derive(Debug, Default, PartialEq, Eq)]
pub(super) struct Plan {
    /// Candidates no meta partition references, with their lengths.
    pub(super) delete: Vec<(ExtentId, u64)>,
    pub(super) report: SweepReport,
}

/// The sweep's decision for one partition. `listed`: its normal extents and their lengths;
/// `candidates`: those idle for the grace; `referenced`: the extents some meta partition
/// references, or `Err` if one could not answer (then nothing is deleted, and nothing is
/// counted as referenced or not).
pub(super) fn decide(
    partition: PartitionId,
    listed: &[(ExtentId, u64)],
    candidates: &[ExtentId],
    referenced: Result<&BTreeSet<ExtentId>, &str>,
) -> Plan {
    let mut plan = Plan {
        report: SweepReport {
            partition,
            ..SweepReport::default()
        },
        ..Plan::default()
    };
    let referenced = match referenced {
        Ok(r) => r,
        Err(e) => {
            plan.report.error = Some(e.to_string());
            return plan;
        }
    };
    let candidates: BTreeSet<ExtentId> = candidates.iter().copied().collect();
    let r = &mut plan.report;
    for &(e, len) in listed.iter().filter(|(e, _)| e.is_normal()) {
        if referenced.contains(&e) {
            r.referenced += 1;
            r.referenced_bytes += len;
        } else {
            r.unreferenced += 1;
            r.unreferenced_bytes += len;
            if candidates.contains(&e) {
                plan.delete.push((e, len));
            }
        }
    }
    plan
}

/// A partition's listing at the start of a sweep.
struct Listed {
    part: Arc<Part>,
    term: u64,
    at: Instant,
    extents: Vec<(ExtentId, u64)>,
    candidates: Vec<ExtentId>,
}

impl DataNode {
    /// Records activity on a normal extent of `part` (a create, a write, an overwrite).
    pub(super) fn gc_touch(part: &Part, extent: ExtentId) {
        if extent.is_normal() {
            lock(&part.gc).touch(extent, Instant::now());
        }
    }

    /// Sweeps the partitions this node leads (`only`: one of them) with `grace`, and reports
    /// the figures to the master. One sweep runs at a time on a node.
    pub async fn sweep(&self, only: Option<PartitionId>, grace: Duration) -> Vec<SweepReport> {
        let _one = self.inner.gc_running.lock().await;
        let parts: Vec<Arc<Part>> = lock(&self.inner.parts)
            .values()
            .filter(|p| only.is_none_or(|id| p.id == id))
            .cloned()
            .collect();
        // Step 1: list, per volume.
        let mut volumes: BTreeMap<String, Vec<Listed>> = BTreeMap::new();
        for part in parts {
            let extents: Vec<(ExtentId, u64)> = part
                .store
                .extents()
                .into_iter()
                .filter(|(e, _)| e.is_normal())
                .collect();
            let term = match self.leader_term(&part).await {
                Ok(Some(term)) if !part.store.is_failed() => term,
                _ => {
                    lock(&part.gc).prune(&extents);
                    continue;
                }
            };
            let Some(spec) = self.inner.registry.get(part.id) else {
                continue;
            };
            let at = Instant::now();
            let candidates = lock(&part.gc).candidates(&extents, at, grace);
            volumes.entry(spec.volume).or_default().push(Listed {
                part,
                term,
                at,
                extents,
                candidates,
            });
        }
        let mut reports = Vec::new();
        for (volume, listed) in volumes {
            // Step 2: ask every meta partition of the volume about every listed extent.
            let asked: Vec<(PartitionId, ExtentId)> = listed
                .iter()
                .flat_map(|l| l.extents.iter().map(|(e, _)| (l.part.id, *e)))
                .collect();
            let referenced = self.referenced(&volume, &asked).await;
            if let Err(e) = &referenced {
                tracing::warn!(volume, error = %e, "garbage collection: a meta partition did not answer; deleting nothing");
            }
            // Step 3: delete what none references.
            for l in listed {
                let mine = referenced.as_ref().map(|all| {
                    all.iter()
                        .filter(|(p, _)| *p == l.part.id)
                        .map(|(_, e)| *e)
                        .collect::<BTreeSet<ExtentId>>()
                });
                let plan = decide(
                    l.part.id,
                    &l.extents,
                    &l.candidates,
                    mine.as_ref().map_err(|e| e.as_str()),
                );
                reports.push(self.carry_out(&l, grace, plan).await);
            }
        }
        if let Some(m) = &self.inner.config.metrics {
            m.gc_sweeps.inc();
            let unreferenced: u64 = lock(&self.inner.parts)
                .values()
                .filter_map(|p| lock(&p.last_sweep).clone())
                .map(|r| r.unreferenced_bytes.saturating_sub(r.freed_bytes))
                .sum();
            m.gc_unreferenced_bytes
                .set(i64::try_from(unreferenced).unwrap_or(i64::MAX));
        }
        self.report_gc(&reports).await;
        reports
    }

    /// The extents of `asked` some meta partition of `volume` references, or why one could not
    /// answer.
    async fn referenced(
        &self,
        volume: &str,
        asked: &[(PartitionId, ExtentId)],
    ) -> Result<BTreeSet<(PartitionId, ExtentId)>, String> {
        if asked.is_empty() {
            return Ok(BTreeSet::new());
        }
        let client = self.inner.client.clone();
        let master = MasterClient::new(client.clone(), self.inner.config.masters.clone());
        let vol = NetVolume::connect(client, master, volume)
            .await
            .map_err(|e| format!("volume {volume}: {e}"))?;
        let mut found = BTreeSet::new();
        for range in vol.partitions().iter() {
            for chunk in asked.chunks(QUERY_CHUNK) {
                let q = Query::Referenced {
                    extents: chunk.to_vec(),
                };
                match vol.read(range.id, q).await {
                    Ok(Ok(Reply::Referenced(r))) => found.extend(r),
                    Ok(Ok(other)) => {
                        return Err(format!(
                            "meta partition {}: unexpected answer {other:?}",
                            range.id
                        ));
                    }
                    Ok(Err(e)) => return Err(format!("meta partition {}: {e}", range.id)),
                    Err(e) => return Err(format!("meta partition {}: {e}", range.id)),
                }
            }
        }
        Ok(found)
    }

    /// Deletes what `plan` says, if this replica still leads in the listing's term and the
    /// extents stayed idle; returns the sweep's figures.
    async fn carry_out(&self, l: &Listed, grace: Duration, mut plan: Plan) -> SweepReport {
        let part = &l.part;
        let idle_before = l.at.checked_sub(grace);
        let delete: Vec<(ExtentId, u64)> = {
            let act = lock(&part.gc);
            plan.delete
                .iter()
                .filter(|(e, _)| idle_before.is_some_and(|t| act.idle_since(*e, t)))
                .copied()
                .collect()
        };
        if !delete.is_empty() {
            match self.leader_term(part).await {
                Ok(Some(term)) if term == l.term => {
                    for chunk in delete.chunks(RELEASE_CHUNK) {
                        let ranges = chunk.iter().map(|(e, _)| (*e, 0, u64::MAX)).collect();
                        match self.propose(part, &DataCommand::Release { ranges }).await {
                            Ok(Ok(_)) => {
                                let mut tracks = lock(&part.tracks);
                                for (e, len) in chunk {
                                    tracks.remove(e);
                                    plan.report.freed += 1;
                                    plan.report.freed_bytes += len;
                                }
                            }
                            Ok(Err(e)) => {
                                plan.report.error = Some(e.to_string());
                                break;
                            }
                            Err(e) => {
                                plan.report.error = Some(e.message);
                                break;
                            }
                        }
                    }
                }
                _ => plan.report.error = Some("no longer the partition's leader".into()),
            }
        }
        let r = &mut plan.report;
        r.finished_ms = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
        if let Some(m) = &self.inner.config.metrics {
            m.gc_freed_extents.inc_by(r.freed);
            m.gc_freed_bytes.inc_by(r.freed_bytes);
        }
        if r.freed > 0 || r.error.is_some() {
            tracing::info!(
                partition = %part.id,
                referenced = r.referenced,
                unreferenced = r.unreferenced,
                freed = r.freed,
                freed_bytes = r.freed_bytes,
                error = r.error.as_deref().unwrap_or(""),
                "garbage collection swept the partition"
            );
        }
        *lock(&part.last_sweep) = Some(r.clone());
        plan.report
    }

    /// Sends the figures to the master leader (kept in its memory for `nacre vol info`).
    async fn report_gc(&self, reports: &[SweepReport]) {
        let masters = &self.inner.config.masters;
        if masters.is_empty() || reports.is_empty() {
            return;
        }
        let mc = MasterClient::new(self.inner.client.clone(), masters.clone());
        let req = ReportGcRequest {
            reports: reports.to_vec(),
        };
        if let Err(e) = mc.call::<ReportGc>(&req).await {
            tracing::debug!(error = %e, "cannot report garbage collection figures to the master");
        }
    }

    /// Sweeps every `gc_period` with `gc_grace` (never below [`MIN_GC_GRACE`]); the first sweep
    /// one period after start. A period of 0 turns the background sweep off.
    pub(super) async fn gc_forever(&self) {
        let period = self.inner.config.gc_period;
        if period.is_zero() {
            return std::future::pending().await;
        }
        let grace = self.inner.config.gc_grace.max(MIN_GC_GRACE);
        let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + period, period);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            self.sweep(None, grace).await;
        }
    }

    /// The `Sweep` op: a sweep now with the caller's grace.
    pub(super) async fn sweep_now(
        &self,
        only: Option<PartitionId>,
        grace: Duration,
    ) -> Result<Vec<SweepReport>, DataError> {
        Ok(self.sweep(only, grace).await)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const P: PartitionId = PartitionId(9);

    fn e(id: u64) -> ExtentId {
        ExtentId(id)
    }

    #[test]
    fn an_extent_is_a_candidate_only_after_the_grace_without_activity() {
        let t0 = Instant::now();
        let grace = Duration::from_secs(60);
        let mut a = Activity::default();
        let listed = vec![(e(3), 10), (e(1024), 100), (e(1025), 200)];
        // First listed: active from now, whatever happened before.
        assert!(a.candidates(&listed, t0, grace).is_empty());
        a.touch(e(1025), t0 + Duration::from_secs(30));
        // Tiny extents (ids below 1024) are never candidates; 1025 was written 30 s later.
        assert_eq!(
            a.candidates(&listed, t0 + Duration::from_secs(60), grace),
            vec![e(1024)]
        );
        assert_eq!(
            a.candidates(&listed, t0 + Duration::from_secs(90), grace),
            vec![e(1024), e(1025)]
        );
        // A touch never moves the time back.
        a.touch(e(1024), t0);
        assert!(a.idle_since(e(1024), t0));
        assert!(!a.idle_since(e(1025), t0));
        // An extent gone from the listing is forgotten: if it came back, it would start anew.
        let later = t0 + Duration::from_secs(200);
        assert_eq!(a.candidates(&listed[..2], later, grace), vec![e(1024)]);
        assert!(a.candidates(&listed, later, grace).contains(&e(1024)));
        assert!(!a.candidates(&listed, later, grace).contains(&e(1025)));
    }

    #[test]
    fn an_extent_touched_during_the_sweep_is_not_idle() {
        let t0 = Instant::now();
        let mut a = Activity::default();
        a.touch(e(1024), t0);
        let listing = t0 + Duration::from_secs(100);
        assert_eq!(
            a.candidates(&[(e(1024), 1)], listing, Duration::from_secs(60)),
            vec![e(1024)]
        );
        // A write while the meta partitions are asked: the deletion re-checks.
        a.touch(e(1024), listing + Duration::from_millis(5));
        assert!(!a.idle_since(e(1024), listing - Duration::from_secs(60)));
    }

    #[test]
    fn only_idle_unreferenced_extents_are_deleted() {
        let listed = vec![(e(1024), 100), (e(1025), 200), (e(1026), 300), (e(5), 7)];
        let candidates = vec![e(1024), e(1025)];
        let referenced: BTreeSet<ExtentId> = [e(1025)].into();
        let plan = decide(P, &listed, &candidates, Ok(&referenced));
        assert_eq!(plan.delete, vec![(e(1024), 100)]);
        let r = &plan.report;
        assert_eq!((r.referenced, r.referenced_bytes), (1, 200));
        // 1026 is unreferenced but too young: counted, kept.
        assert_eq!((r.unreferenced, r.unreferenced_bytes), (2, 400));
        assert_eq!(r.error, None);
    }

    #[test]
    fn nothing_is_deleted_when_a_meta_partition_did_not_answer() {
        let listed = vec![(e(1024), 100)];
        let plan = decide(P, &listed, &[e(1024)], Err("meta partition 3: timeout"));
        assert!(plan.delete.is_empty());
        assert_eq!(
            plan.report.error.as_deref(),
            Some("meta partition 3: timeout")
        );
        assert_eq!(plan.report.unreferenced, 0);
    }
}
