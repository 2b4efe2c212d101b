//! A data node's own gauges and counters ([`DataMetrics`]).

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

/// A data node's own gauges, refreshed every duty round (`DataNodeConfig::metrics`).
#[derive(Clone, Debug, Default)]
pub struct DataMetrics {
    pub(super) spare_bytes: Gauge,
    pub(super) spare_files: Gauge,
    pub(super) recycled: Gauge,
    pub(super) append_batches: Counter,
    pub(super) append_batched: Counter,
    pub(super) scrub_passes: Counter,
    pub(super) scrub_bytes: Counter,
    pub(super) scrub_bad_blocks: Counter,
    pub(super) scrub_repaired: Counter,
    pub(super) gc_sweeps: Counter,
    pub(super) gc_freed_extents: Counter,
    pub(super) gc_freed_bytes: Counter,
    pub(super) gc_unreferenced_bytes: Gauge,
}

impl DataMetrics {
    /// Registers the gauges (`nacre_data_*`).
    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            "nacre_data_spare_bytes",
            "Bytes of deleted extents' data files kept for new extents to take (at most \
             spare_bytes per node, a quarter of the free space, each for spare_keep)",
            self.spare_bytes.clone(),
        );
        registry.register(
            "nacre_data_spare_files",
            "Deleted extents' data files kept for new extents to take",
            self.spare_files.clone(),
        );
        registry.register(
            "nacre_data_recycled_extents",
            "New extents that took a deleted extent's data file, since the hosted partitions' \
             stores opened",
            self.recycled.clone(),
        );
        registry.register(
            "nacre_data_append_batches",
            "Batches of append packets this node wrote and forwarded as leader (consecutive \
             packets of an extent that waited while the batch before them was written)",
            self.append_batches.clone(),
        );
        registry.register(
            "nacre_data_append_batched_packets",
            "Append packets in those batches",
            self.append_batched.clone(),
        );
        registry.register(
            "nacre_data_scrub_passes",
            "Background scrub passes finished over every hosted partition",
            self.scrub_passes.clone(),
        );
        registry.register(
            "nacre_data_scrub_bytes",
            "Bytes the background scrub read and verified against their block CRCs",
            self.scrub_bytes.clone(),
        );
        registry.register(
            "nacre_data_scrub_bad_blocks",
            "Blocks the background scrub found not matching their CRC",
            self.scrub_bad_blocks.clone(),
        );
        registry.register(
            "nacre_data_scrub_repaired_blocks",
            "Of those, blocks replaced by a healthy replica's copy",
            self.scrub_repaired.clone(),
        );
        registry.register(
            "nacre_data_gc_sweeps",
            "Garbage-collection sweeps this node ran over the partitions it leads",
            self.gc_sweeps.clone(),
        );
        registry.register(
            "nacre_data_gc_freed_extents",
            "Normal extents no meta partition referenced, idle for the grace, deleted by a sweep",
            self.gc_freed_extents.clone(),
        );
        registry.register(
            "nacre_data_gc_freed_bytes",
            "Bytes of those extents",
            self.gc_freed_bytes.clone(),
        );
        registry.register(
            "nacre_data_gc_unreferenced_bytes",
            "Bytes of normal extents no meta partition referenced at the last sweep of each \
             partition this node led, and that the sweep kept (written within the grace)",
            self.gc_unreferenced_bytes.clone(),
        );
    }

    /// `nacre_data_spare_bytes` as of the last duty round.
    pub fn spare_bytes(&self) -> i64 {
        self.spare_bytes.get()
    }

    /// `nacre_data_spare_files` as of the last duty round.
    pub fn spare_files(&self) -> i64 {
        self.spare_files.get()
    }

    /// `nacre_data_recycled_extents` as of the last duty round.
    pub fn recycled(&self) -> i64 {
        self.recycled.get()
    }
}
