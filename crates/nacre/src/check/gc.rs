//! The garbage collector at the end of a run (docs/reliability.md, "Garbage collection"): once
//! the workload and the killed client have stopped, every data partition of the volume is swept
//! with a short grace, and a last sweep counts the normal extents no meta partition references
//! that are still on the leaders' disks. That count must be 0, and the checker, which reads every
//! acknowledged byte back afterwards, shows that the sweep deleted nothing a file uses.

use std::time::Duration;

use nacre_api::data::SweepReport;
use nacre_client::MasterClient;
use nacre_master::admin::Admin;
use serde::Serialize;

use super::VOLUME;

/// The workload's clients commit the keys of a streamed run within this of its first packet
/// (`NetFsConfig::commit_within`; a later commit fails, and the operation counts as failed).
/// Longer than a stream's usual wait for a writable partition after a data node's kill (its
/// restart and re-check take a few seconds), so the run's shortened time does not fail writes
/// that a deployment's 15 minutes would take.
pub const CLIENT_COMMIT_WITHIN: Duration = Duration::from_secs(10);
/// ... and commit an open file's streamed run by themselves this long after its first packet.
pub const CLIENT_COMMIT_EVERY: Duration = Duration::from_secs(1);

/// The grace of the end-of-run sweep, and how long the run waits after listing before it. The
/// workload has stopped, but a call it timed out may still run detached (a flush retrying on
/// another partition) and commit a key: within `CLIENT_COMMIT_WITHIN` of its first packet, and
/// applied within the 15 s a meta call retries. The grace covers both, as `MIN_GC_GRACE` covers
/// `KEY_COMMIT_WITHIN` and a commit's flight in a cluster.
pub const GC_GRACE: Duration = Duration::from_secs(30);

/// What the end-of-run sweeps found.
#[derive(Debug, Default, Serialize)]
pub struct GcOutcome {
    /// Normal extents (bytes) a meta partition references.
    pub referenced: u64,
    pub referenced_bytes: u64,
    /// Normal extents no meta partition referenced, deleted by the sweep.
    pub freed: u64,
    pub freed_bytes: u64,
    /// Normal extents no meta partition references left on the leaders after it (must be 0).
    pub unreferenced_left: u64,
    pub unreferenced_left_bytes: u64,
    /// Partitions a sweep could not finish (no leader, a meta partition not answering, a
    /// failed delete): the run fails.
    pub errors: Vec<String>,
}

impl GcOutcome {
    /// Whether the run passes this check.
    pub fn ok(&self) -> bool {
        self.unreferenced_left == 0 && self.errors.is_empty()
    }
}

/// Sweeps the volume: one pass that only lists (so every extent is known to its leader), a
/// wait of [`GC_GRACE`], a pass with that grace that deletes, and one that counts what is left.
pub async fn sweep_at_end(mc: &MasterClient) -> anyhow::Result<GcOutcome> {
    let admin = Admin::new(mc.clone());
    // A grace no extent can have reached: lists and deletes nothing.
    let never = Duration::from_secs(365 * 24 * 3600);
    let mut out = GcOutcome::default();
    let errors = |rs: &[SweepReport], out: &mut GcOutcome, pass: &str| {
        for r in rs {
            if let Some(e) = &r.error {
                out.errors
                    .push(format!("{pass} sweep of {}: {e}", r.partition));
            }
        }
    };
    let listed = admin.sweep(VOLUME, never).await?;
    errors(&listed, &mut out, "listing");
    tokio::time::sleep(GC_GRACE).await;
    let swept = admin.sweep(VOLUME, GC_GRACE).await?;
    errors(&swept, &mut out, "deleting");
    out.freed = swept.iter().map(|r| r.freed).sum();
    out.freed_bytes = swept.iter().map(|r| r.freed_bytes).sum();
    let left = admin.sweep(VOLUME, never).await?;
    errors(&left, &mut out, "counting");
    out.referenced = left.iter().map(|r| r.referenced).sum();
    out.referenced_bytes = left.iter().map(|r| r.referenced_bytes).sum();
    out.unreferenced_left = left.iter().map(|r| r.unreferenced).sum();
    out.unreferenced_left_bytes = left.iter().map(|r| r.unreferenced_bytes).sum();
    Ok(out)
}
