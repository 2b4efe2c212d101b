//! A data node's settings ([`DataNodeConfig`]) and the disk wrapper tests inject faults with
//! ([`WrapDisk`]).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use nacre_api::master::FULL_PPM;
use nacre_raft::StoreConfig;

use super::DataMetrics;
use crate::io::Disk;
use crate::store::StoreOptions;

/// Settings of a data node.
#[derive(Clone, Debug)]
pub struct DataNodeConfig {
    pub dir: PathBuf,
    pub raft: StoreConfig,
    pub store: StoreOptions,
    /// How often reports are refreshed, read-only partitions re-checked and repairs run.
    pub report_interval: Duration,
    /// How long the leader waits for a follower's answer to a packet before it checks that the
    /// follower is alive at all (a ping). One that answers the ping is slow, not gone (a saturated
    /// disk), and is waited for up to `replicate_stall_limit`; one that does not fails the packet
    /// and turns the partition read-only.
    pub replicate_timeout: Duration,
    /// Longest wait for a live but slow follower, or for an earlier packet of the same extent.
    pub replicate_stall_limit: Duration,
    /// How often a leader re-checks its partitions that are read-only or have extents that lag
    /// (each partition on its own, one re-check at a time): a follower back from a restart is
    /// found within about this long, and the partition takes appends again.
    pub recheck_interval: Duration,
    /// How long a new leader's alignment or a re-check waits for a follower's listing (all
    /// followers are asked at once): one that does not answer within it keeps the partition
    /// read-only until a re-check hears from it.
    pub recheck_timeout: Duration,
    /// Bytes per second a repair may copy (per node), so foreground IO keeps the bandwidth.
    pub repair_rate: u64,
    /// Bytes per second the background scrub reads (per node; `service::scrub`). 0: no scrub.
    pub scrub_rate: u64,
    /// Share of the data disk in use (parts per million, as anyone but root sees it) at which
    /// the node takes no new bytes (`service::room`); [`FULL_PPM`], the master's threshold for
    /// placing partitions, by default.
    pub full_ppm: u64,
    /// Time between the starts of two scrub passes (the first starts one period after the
    /// node): every block is read at least once a period while a pass takes less than one.
    /// Zero: no scrub.
    pub scrub_period: Duration,
    /// Most bytes of deleted extents' data files a node keeps for new extents to take
    /// (`StoreOptions::recycle`: their appends then reuse allocated blocks, and no blocks are
    /// freed while writes run), over all its partitions; never more than a quarter of the file
    /// system's free space. The oldest go first.
    pub spare_bytes: u64,
    /// How long a spare is kept at most; also how long an extent living in a longer recycled file
    /// may go without growing before the rest of the file is cut (`ExtentStore::cut_tails`).
    pub spare_keep: Duration,
    /// While at least this many extents have appends in flight on the node, appends bypass the
    /// page cache (`ExtentStore::write_uncached`): with many streams the node runs out of CPU
    /// before disk, and a direct write costs less of it; with few, each stream waits on its own
    /// writes and the cache's quicker ones serve it better. 0: never.
    pub direct_streams: u32,
    /// Time between two garbage-collection sweeps of the partitions the node leads
    /// (`service::gc`; the first one period after start). 0: no background sweep.
    pub gc_period: Duration,
    /// How long a normal extent must go without a write before a background sweep may delete it
    /// (if no meta partition references it). Never below `nacre_api::data::MIN_GC_GRACE`: a
    /// shorter one is raised to it.
    pub gc_grace: Duration,
    /// The masters' addresses: the sweep asks them for its volumes' meta partitions and reports
    /// its figures to them. Empty: no sweep can ask (nothing is collected).
    pub masters: Vec<String>,
    /// Gauges the node keeps up to date (registered by the caller); `None`: none.
    pub metrics: Option<DataMetrics>,
    /// Wraps each partition's disk (its directory, the `FileDisk`) before its store opens it:
    /// tests inject faults with it. `None`: the `FileDisk` itself.
    pub wrap_disk: Option<WrapDisk>,
}

impl DataNodeConfig {
    pub fn new(dir: PathBuf) -> Self {
        let mut raft = StoreConfig::default().with_read_lease();
        // Overwrites carry data: keep the log short behind the snapshots, in entries and in
        // bytes (2,000 overwrites of up to a packet each kept 700 MiB of log per node in the
        // soak), since a restarted node applies its groups' logs again from their snapshots on
        // its Raft loop before that loop opens its next partition (64 MiB a group kept a node's
        // last partitions from opening for 6 s). A snapshot costs a sync of the store, off the
        // loop.
        raft.node.compact_after = 2_000;
        raft.node.compact_after_bytes = 8 << 20;
        // A leader's appends leave before its own log write, so a lone overwrite waits for one
        // sync instead of the leader's then a follower's (docs/benchmarks.md, "Data partitions
        // send their appends early").
        raft.early_appends = true;
        // Log writes on a thread of their own: acknowledgements, commits and replies do not
        // wait behind another round's sync (docs/benchmarks.md, "Log writes off the Raft
        // thread"). Meta nodes keep writing on their Raft thread: the metadata phases measured
        // lower with it.
        raft.async_log = true;
        // The Raft loop shares the messenger's worker with the request handlers that propose and
        // the connections that carry its messages: fewer thread wake-ups per overwrite
        // (docs/benchmarks.md, "Overwrites patch the block CRC; the Raft loop on the messenger's worker"). Its applies are short
        // (one `pwrite` and a CRC patch) and their reads are prefetched.
        raft.on_msgr_worker = true;
        Self {
            dir,
            raft,
            // A CRC per 32 KiB: a 4 KiB overwrite or read touches 32 KiB, not 128 KiB (1.5x the 4 KiB
            // overwrites/s measured), for 8 bytes of memory per block (256 MiB per TiB of data).
            store: StoreOptions {
                block_size: 32 << 10,
                ..StoreOptions::default()
            },
            report_interval: Duration::from_millis(500),
            replicate_timeout: Duration::from_secs(5),
            replicate_stall_limit: Duration::from_secs(60),
            // A listing is a few hundred bytes per extent from memory; a re-check of a partition
            // whose followers all answer costs one round trip each.
            recheck_interval: Duration::from_millis(200),
            // A listing comes from memory in milliseconds; a follower cut off costs a new
            // leader this much of its fail-over (its partitions' appends wait for the alignment).
            recheck_timeout: Duration::from_millis(500),
            repair_rate: 64 << 20,
            // A TiB a day takes 12 MiB/s; this disk reads well over 1 GiB/s.
            scrub_rate: 16 << 20,
            full_ppm: FULL_PPM,
            scrub_period: Duration::from_secs(24 * 3600),
            // docs/benchmarks.md, "Recycling deleted extents' files".
            spare_bytes: 1 << 30,
            spare_keep: Duration::from_secs(60),
            // docs/benchmarks.md, "Appends past the page cache".
            direct_streams: 8,
            gc_period: Duration::from_secs(600),
            gc_grace: Duration::from_secs(3600),
            masters: Vec::new(),
            metrics: None,
            wrap_disk: None,
        }
    }
}

/// Given a partition's directory and disk, the disk its store uses.
pub type WrapDiskFn = dyn Fn(&Path, Arc<dyn Disk>) -> Arc<dyn Disk> + Send + Sync;

/// A function wrapping a partition's disk ([`DataNodeConfig::wrap_disk`]).
#[derive(Clone)]
pub struct WrapDisk(pub Arc<WrapDiskFn>);

impl std::fmt::Debug for WrapDisk {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("WrapDisk")
    }
}
