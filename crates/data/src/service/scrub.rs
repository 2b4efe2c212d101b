//! The background scrub: every replica reads all its extents' blocks at a throttled rate and
//! checks them against their CRCs, so bit rot on a replica nobody reads (a follower, a cold file)
//! is found and repaired from a healthy replica before a fail-over needs that copy.
//!
//! A pass walks the hosted partitions' extents in `SCRUB_CHUNK` reads through the store (which
//! verifies every block it reads, under the extent's lock, so appends and overwrites in flight
//! are never mistaken for damage). A block that fails is fetched from another replica and
//! installed (`repair_block_from_followers`, the read-time repair), then its chunk is read
//! again. Extents deleted or shortened during the pass are skipped.

use std::sync::Arc;
use std::time::{Duration, Instant};

use nacre_types::ExtentId;
use nacre_types::sync::lock;

use super::{DataNode, Part, off_worker};
use crate::store::StoreError;

/// Bytes read per step of a pass.
const SCRUB_CHUNK: u32 = 1 << 20;
/// Repairs tried on a bad block before the pass moves on past it (to the next pass).
const REPAIRS_PER_CHUNK: usize = 3;

/// What one pass did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ScrubReport {
    /// Extents read to their end.
    pub extents: u64,
    /// Bytes read and verified.
    pub bytes: u64,
    /// Blocks whose bytes did not match their CRC.
    pub bad_blocks: u64,
    /// Of those, blocks replaced by a healthy replica's copy.
    pub repaired: u64,
}

impl DataNode {
    /// Scrubs every hosted partition once, reading at most `rate` bytes per second (`u64::MAX`:
    /// as fast as the disk goes).
    pub async fn scrub(&self, rate: u64) -> ScrubReport {
        let parts: Vec<Arc<Part>> = lock(&self.inner.parts).values().cloned().collect();
        let mut report = ScrubReport::default();
        let mut pace = Pace::new(rate);
        for part in &parts {
            if part.store.is_failed() {
                continue;
            }
            for (extent, len) in part.store.extents() {
                if self
                    .scrub_extent(part, extent, len, &mut pace, &mut report)
                    .await
                {
                    report.extents += 1;
                }
            }
        }
        if let Some(m) = &self.inner.config.metrics {
            m.scrub_passes.inc();
        }
        report
    }

    /// Runs a pass every `scrub_period` (start to start; at once after a pass that took longer)
    /// at `scrub_rate`, never with a rate or period of 0. The first starts one period after the
    /// node.
    pub(super) async fn scrub_forever(&self) {
        let (rate, period) = (self.inner.config.scrub_rate, self.inner.config.scrub_period);
        if rate == 0 || period.is_zero() {
            return std::future::pending().await;
        }
        let mut next = tokio::time::Instant::now() + period;
        loop {
            tokio::time::sleep_until(next).await;
            let started = Instant::now();
            next = (next + period).max(tokio::time::Instant::now());
            let r = self.scrub(rate).await;
            tracing::info!(
                extents = r.extents,
                bytes = r.bytes,
                bad_blocks = r.bad_blocks,
                repaired = r.repaired,
                secs = started.elapsed().as_secs_f64(),
                "scrub pass done"
            );
        }
    }

    /// Reads `extent` (`len` bytes when the pass began) chunk by chunk; false if it went away.
    async fn scrub_extent(
        &self,
        part: &Part,
        extent: ExtentId,
        len: u64,
        pace: &mut Pace,
        report: &mut ScrubReport,
    ) -> bool {
        let mut off = 0;
        // The block being repaired, and the repairs tried on it.
        let mut failing: Option<(u64, usize)> = None;
        while off < len {
            let n = (len - off).min(u64::from(SCRUB_CHUNK)) as u32;
            pace.take(u64::from(n)).await;
            let store = part.store.clone();
            let read = off_worker(move || Ok(store.read(extent, off, n))).await;
            match read {
                Ok(Ok(_)) => {
                    report.bytes += u64::from(n);
                    if let Some(m) = &self.inner.config.metrics {
                        m.scrub_bytes.inc_by(u64::from(n));
                    }
                    off += u64::from(n);
                }
                Ok(Err(StoreError::Corrupt { block, .. })) => {
                    let tries = match failing {
                        Some((b, tries)) if b == block => tries,
                        _ => {
                            report.bad_blocks += 1;
                            if let Some(m) = &self.inner.config.metrics {
                                m.scrub_bad_blocks.inc();
                            }
                            tracing::error!(partition = %part.id, %extent, block, "scrub: checksum mismatch; repairing from a replica");
                            0
                        }
                    };
                    // The same block failing again after a repair is not a new bad block;
                    // after `REPAIRS_PER_CHUNK` repairs it is left to the next pass.
                    if tries >= REPAIRS_PER_CHUNK {
                        tracing::error!(partition = %part.id, %extent, block, repairs = tries, "scrub: no replica could repair the block");
                        let bs = u64::from(part.store.block_size());
                        off = off.max((block + 1) * bs);
                        failing = None;
                        continue;
                    }
                    failing = Some((block, tries + 1));
                    let repaired = match part.ec {
                        Some(ec) => self.repair_block_from_shards(part, ec, extent, block).await,
                        None => self.repair_block_from_followers(part, extent, block).await,
                    };
                    match repaired {
                        Ok(()) => {
                            report.repaired += 1;
                            if let Some(m) = &self.inner.config.metrics {
                                m.scrub_repaired.inc();
                            }
                        }
                        // Another replica may be catching up: tried again.
                        Err(e) => {
                            tracing::debug!(partition = %part.id, %extent, block, error = %e, "scrub: repair failed; trying again");
                        }
                    }
                }
                // Deleted, shortened or the store failed meanwhile: the next pass sees it anew.
                Ok(Err(_)) | Err(_) => return false,
            }
        }
        true
    }
}

/// Spreads reads so that they average at most `rate` bytes per second.
struct Pace {
    rate: u64,
    start: Instant,
    taken: u64,
}

impl Pace {
    fn new(rate: u64) -> Self {
        Self {
            rate,
            start: Instant::now(),
            taken: 0,
        }
    }

    /// Waits until `n` more bytes fit the rate.
    async fn take(&mut self, n: u64) {
        if self.rate == u64::MAX || self.rate == 0 {
            return;
        }
        let due = Duration::from_secs_f64(self.taken as f64 / self.rate as f64);
        self.taken += n;
        if let Some(wait) = due.checked_sub(self.start.elapsed()) {
            tokio::time::sleep(wait).await;
        }
    }
}
