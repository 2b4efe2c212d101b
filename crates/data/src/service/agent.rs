//! The node's duties for the master's agent ([`NodeDuties`], [`PartitionHost`]): the duty round
//! (alignment, re-checks, repairs, spares, reports) and hosting partitions.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Instant;

use nacre_api::master::{PartitionKind, PartitionReport, PartitionSpec};
use nacre_cluster::{BoxFuture, NodeDuties, PartitionHost};
use nacre_raft::RaftError;
use nacre_types::{NodeId, PartitionId};

use super::Counters;
use super::{DataNode, Part, err_str, off_worker};
use crate::sm::store_error;

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
