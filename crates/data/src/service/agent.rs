//! The node's duties: the duty round (alignment, re-checks, repairs, spares, reports), and how a
//! data partition is opened, updated and closed ([`PartitionRole`]; the rest of the node lifecycle
//! is `nacre-cluster`'s).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Instant;

use nacre_api::master::{PartitionReport, PartitionSpec, Role};
use nacre_cluster::{BoxFuture, HostError, NodeRaft, PartitionRole, SpecRegistry, Updated};
use nacre_types::PartitionId;
use nacre_types::sync::lock;

use super::Counters;
use super::{DataNode, Part, off_worker, room};
use crate::repl::Event;
use crate::sm::{DataSm, store_error};

impl DataNode {
    /// Bounds what the node's spares keep (`spare_bytes`, a quarter of the free space,
    /// `spare_keep`): the newest stay, the rest are removed (off the worker), and the gauges are
    /// refreshed.
    pub(super) async fn retire_spares(&self, parts: &[Arc<Part>]) {
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
        let parts: Vec<Arc<Part>> = lock(&self.inner.parts).values().cloned().collect();
        self.measure_room();
        let full = self.disk_full();
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
                    if full && part.degraded().is_none() {
                        part.fail(Event::LocalWriteRefused {
                            why: room::FULL.into(),
                        });
                    }
                    // Also every `recheck_interval` on their own (`recheck_forever`); one at a
                    // time.
                    if part.needs_recheck() {
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

    pub(super) async fn refresh_reports(&self, parts: &[Arc<Part>]) {
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
        let (secs, before) = match lock(&self.inner.last_report).replace((now, counts.clone())) {
            Some((t, b)) => (now.duration_since(t).as_secs_f64(), b),
            None => (0.0, BTreeMap::new()),
        };
        let mut reports = Vec::new();
        let me = self.raft().map(|r| r.id()).ok();
        for p in parts {
            // A replica rebuilding its shards is reported once it holds them: the partition
            // stays read-only meanwhile.
            if p.is_rebuilding() {
                continue;
            }
            // The leader the group published (no round trip to the Raft loop, which may be in a
            // log write: a change of writability is reported at once).
            let leader = match (&p.gate, me) {
                (Some(gate), Some(me)) => gate.leader_term().0 == me,
                _ => matches!(self.leader_term(p).await, Ok(Some(_))),
            };
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
        *lock(&self.inner.reports) = reports;
    }
}

impl PartitionRole for DataNode {
    type Sm = DataSm;
    const ROLE: Role = Role::Data;

    fn node_raft(&self) -> &NodeRaft<DataSm> {
        &self.inner.raft
    }

    fn registry(&self) -> &SpecRegistry {
        &self.inner.registry
    }

    fn open(&self, spec: &PartitionSpec) -> BoxFuture<'_, Result<(), HostError>> {
        let spec = spec.clone();
        Box::pin(async move {
            self.open_partition(&spec)
                .await
                .map_err(|e| HostError::partition(spec.id, e))
        })
    }

    fn update(&self, spec: &PartitionSpec) -> BoxFuture<'_, Result<Updated, HostError>> {
        // Opening an open partition updates its replica list (and opens one that failed to open
        // at start).
        let spec = spec.clone();
        Box::pin(async move {
            self.open_partition(&spec)
                .await
                .map_err(|e| HostError::partition(spec.id, e))?;
            Ok(Updated::Now)
        })
    }

    fn close(&self, id: PartitionId) -> BoxFuture<'_, Result<(), HostError>> {
        Box::pin(async move {
            lock(&self.inner.parts).remove(&id);
            let dir = self.part_dir(id);
            let context = dir.display().to_string();
            tokio::task::spawn_blocking(move || match std::fs::remove_dir_all(&dir) {
                Ok(()) => Ok(()),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
                Err(e) => Err(e),
            })
            .await
            .map_err(|e| HostError::partition(id, e))?
            .map_err(|e| HostError::Io { context, source: e })
        })
    }

    fn reports(&self) -> Vec<PartitionReport> {
        lock(&self.inner.reports).clone()
    }

    /// What the partitions' stores take, or what the data directory's file system has in use
    /// for anyone but root when that is more (`room`): a disk that other files fill is as full
    /// for new partitions as one the stores fill.
    fn used(&self) -> u64 {
        let stores: u64 = lock(&self.inner.parts).values().map(|p| p.used()).sum();
        stores.max(self.measure_room().unwrap_or(0))
    }

    fn tick(&self) -> BoxFuture<'_, ()> {
        Box::pin(self.maintain())
    }

    fn report_now(&self) -> Option<Arc<tokio::sync::Notify>> {
        Some(self.inner.report_now.clone())
    }

    /// All at once: each partition's store recovers on the blocking pool while the others do
    /// (opened one after the other, a restarted node with five partitions answered for its last
    /// one more than 2 s after it started).
    fn open_all(
        &self,
        specs: Vec<PartitionSpec>,
    ) -> BoxFuture<'_, Vec<(PartitionId, Result<(), HostError>)>> {
        Box::pin(async move {
            let opens: Vec<BoxFuture<'_, (PartitionId, Result<(), HostError>)>> = specs
                .into_iter()
                .map(|spec| -> BoxFuture<'_, _> {
                    Box::pin(async move {
                        let r = self
                            .open_partition(&spec)
                            .await
                            .map_err(|e| HostError::partition(spec.id, e));
                        (spec.id, r)
                    })
                })
                .collect();
            join_all(opens).await
        })
    }
}

/// Polls `futs` together on this task until every one is done; their outputs in order.
pub(super) async fn join_all<T>(futs: Vec<BoxFuture<'_, T>>) -> Vec<T> {
    let mut futs: Vec<Option<BoxFuture<'_, T>>> = futs.into_iter().map(Some).collect();
    let mut out: Vec<Option<T>> = futs.iter().map(|_| None).collect();
    std::future::poll_fn(|cx| {
        let mut pending = false;
        for (slot, done) in futs.iter_mut().zip(out.iter_mut()) {
            if let Some(f) = slot {
                match f.as_mut().poll(cx) {
                    std::task::Poll::Ready(v) => {
                        *done = Some(v);
                        *slot = None;
                    }
                    std::task::Poll::Pending => pending = true,
                }
            }
        }
        if pending {
            std::task::Poll::Pending
        } else {
            std::task::Poll::Ready(())
        }
    })
    .await;
    out.into_iter().flatten().collect()
}
