//! Room on the data directory's disk. A node whose file system is at least `full_ppm` used
//! ([`FULL_PPM`] by default, the master's threshold; as anyone but root sees it: its size less
//! `f_bavail`, so files that are not the stores' count too) is **full**: it reports that much used to the master, which places no new partitions on
//! it; the partitions it leads turn read-only (appends go to other partitions) and stay so while it
//! is full; as a follower it refuses its leader's listings, so a leader's re-check keeps the
//! partition read-only instead of finding every follower answering and taking appends that the
//! full replica then refuses. Bytes are refused before the disk runs out, so the stores do not
//! meet `ENOSPC` in a write or, worse, in an fsync of delayed allocations (which fails the store).
//! Once under the threshold, the next re-check gives the partitions back.

use std::sync::atomic::{AtomicBool, Ordering};

#[cfg(doc)]
use nacre_api::master::FULL_PPM;

use super::DataNode;

/// Whether the node's disk was full when last measured.
#[derive(Debug, Default)]
pub(super) struct Room {
    full: AtomicBool,
}

impl DataNode {
    /// Measures the data directory's file system: its bytes in use as anyone but root sees them
    /// (`None` if it cannot be measured), and whether the node is full, logged when that changes.
    pub(super) fn measure_room(&self) -> Option<u64> {
        let v = match rustix::fs::statvfs(&self.inner.config.dir) {
            Ok(v) => v,
            Err(e) => {
                tracing::debug!(error = %e, "cannot measure the data directory's free space");
                return None;
            }
        };
        let size = v.f_blocks.saturating_mul(v.f_frsize);
        let avail = v.f_bavail.saturating_mul(v.f_frsize);
        let used = size.saturating_sub(avail);
        let full = is_full(size, used, self.inner.config.full_ppm);
        if self.inner.room.full.swap(full, Ordering::SeqCst) != full {
            if full {
                tracing::warn!(
                    free = avail,
                    size,
                    "the data disk is full: this node takes no new bytes"
                );
            } else {
                tracing::info!(free = avail, size, "the data disk has room again");
            }
        }
        Some(used)
    }

    /// Whether the disk was full when last measured ([`DataNode::measure_room`]).
    pub(super) fn disk_full(&self) -> bool {
        self.inner.room.full.load(Ordering::SeqCst)
    }
}

/// Why a full node refuses: the same words for a leader's read-only partitions and a follower's
/// refused listing.
pub(super) const FULL: &str = "the data node's disk is full";

/// Whether `used` of `size` bytes reaches `full_ppm` parts per million (never for an unknown size).
fn is_full(size: u64, used: u64, full_ppm: u64) -> bool {
    size > 0 && u128::from(used) * 1_000_000 >= u128::from(size) * u128::from(full_ppm)
}

#[cfg(test)]
mod tests {
    use super::is_full;
    use nacre_api::master::FULL_PPM;

    #[test]
    fn full_at_the_threshold() {
        let gib = 1 << 30;
        assert!(!is_full(gib, gib / 100 * 98, FULL_PPM));
        assert!(is_full(gib, gib - gib / 100, FULL_PPM));
        assert!(is_full(gib, gib, FULL_PPM));
        assert!(!is_full(0, 0, FULL_PPM), "an unknown size is not full");
        assert!(is_full(gib, 0, 0), "0 ppm: always full");
        assert!(is_full(u64::MAX, u64::MAX, FULL_PPM), "no overflow");
    }
}
