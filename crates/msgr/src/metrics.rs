//! Messenger metrics for Prometheus.
//!
//! Hot-path counters are resolved once per worker (label lookups happen at start, not per frame), and
//! each worker only touches its own counters, so counting costs an uncontended atomic add.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct WorkerDir {
    worker: String,
    /// `in` or `out`.
    dir: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct WorkerLabel {
    worker: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct KindLabel {
    kind: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct SideLabel {
    side: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct OpLabel {
    /// The op's name where the handler knows it (`Router`), else its number.
    op: OpName,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct OpResult {
    op: OpName,
    /// `ok`, or the error code's name.
    result: &'static str,
}

/// An op's label value: a route's name, or the number of an op no route names.
#[derive(Clone, Debug, Hash, PartialEq, Eq)]
pub(crate) enum OpName {
    Named(&'static str),
    Number(u16),
}

impl prometheus_client::encoding::EncodeLabelValue for OpName {
    fn encode(
        &self,
        encoder: &mut prometheus_client::encoding::LabelValueEncoder<'_>,
    ) -> Result<(), std::fmt::Error> {
        use std::fmt::Write as _;
        match self {
            OpName::Named(n) => encoder.write_str(n),
            OpName::Number(n) => write!(encoder, "{n}"),
        }
    }
}

/// Migration pauses kept for [`crate::Messenger::recent_migration_pauses`].
const RECENT_PAUSES: usize = 4096;

type Histograms = Family<OpLabel, Histogram, fn() -> Histogram>;

/// Buckets of [`MsgrMetrics`]'s service-time histograms: 25 µs doubling to about 1.6 s (17).
fn service_histogram() -> Histogram {
    Histogram::new(exponential_buckets(25e-6, 2.0, 17))
}

/// All messenger metric families of one messenger.
#[derive(Clone, Debug)]
pub struct MsgrMetrics {
    frames: Family<WorkerDir, Counter>,
    bytes: Family<WorkerDir, Counter>,
    connections: Family<WorkerLabel, Gauge>,
    direct: Family<WorkerLabel, Counter>,
    errors: Family<KindLabel, Counter>,
    inflight: Family<SideLabel, Gauge>,
    served: Histograms,
    results: Family<OpResult, Counter>,
    migrations: Counter,
    migration_pause: Histogram,
    /// Woken at every migration.
    migrated: std::sync::Arc<tokio::sync::Notify>,
    /// The latest pauses (nanoseconds), for benchmarks' percentiles.
    recent_pauses: std::sync::Arc<std::sync::Mutex<std::collections::VecDeque<u64>>>,
    spread: Gauge<f64, std::sync::atomic::AtomicU64>,
}

impl Default for MsgrMetrics {
    fn default() -> Self {
        Self {
            frames: Family::default(),
            bytes: Family::default(),
            connections: Family::default(),
            direct: Family::default(),
            errors: Family::default(),
            inflight: Family::default(),
            served: Family::new_with_constructor(service_histogram),
            results: Family::default(),
            migrations: Counter::default(),
            // 1 µs doubling to about 65 ms.
            migration_pause: Histogram::new(exponential_buckets(1e-6, 2.0, 17)),
            recent_pauses: Default::default(),
            migrated: Default::default(),
            spread: Gauge::default(),
        }
    }
}

/// The counters one worker updates.
#[derive(Clone, Debug, Default)]
pub(crate) struct WorkerCounters {
    pub frames_in: Counter,
    pub frames_out: Counter,
    pub bytes_in: Counter,
    pub bytes_out: Counter,
    pub connections: Gauge,
    /// Frames of this worker's connections written whole by their callers (also in `frames_out`).
    pub direct: Counter,
}

impl MsgrMetrics {
    /// Registers every family under `nacre_msgr_*`.
    pub fn register(&self, registry: &mut Registry) {
        let r = registry.sub_registry_with_prefix("nacre_msgr");
        r.register(
            "frames",
            "Frames read (dir=in) and written (dir=out), per worker",
            self.frames.clone(),
        );
        r.register(
            "bytes",
            "Bytes read and written on connections, per worker (the worker's load)",
            self.bytes.clone(),
        );
        r.register(
            "connections",
            "Open connections owned by each worker",
            self.connections.clone(),
        );
        r.register(
            "direct_frames",
            "Frames written whole to the socket by the calling thread, without waking the \
             connection's worker (also counted in frames, dir=out)",
            self.direct.clone(),
        );
        r.register(
            "errors",
            "Errors by kind (connect, reset, timeout, remote, frame, decode, accept, ...)",
            self.errors.clone(),
        );
        r.register(
            "server_seconds",
            "Time from a request (or one-way message) being read to its handler finishing, per op: \
             what the server adds to a caller's latency, queueing for in-flight budget excluded",
            self.served.clone(),
        );
        r.register(
            "server_requests",
            "Requests and one-way messages served, per op and result (ok, or the error code)",
            self.results.clone(),
        );
        r.register(
            "migrations",
            "Connections moved between workers by the balancer (or on request)",
            self.migrations.clone(),
        );
        r.register(
            "migration_pause_seconds",
            "Time a moving connection is not served: from leaving its worker to running on the next",
            self.migration_pause.clone(),
        );
        r.register(
            "worker_load_spread",
            "Standard deviation of the workers' load over the balancer's last interval, as a \
             fraction of the busiest worker's load (what the balancer's threshold compares)",
            self.spread.clone(),
        );
        r.register(
            "inflight_requests",
            "Requests in flight (side=client: awaiting a reply; side=server: being served)",
            self.inflight.clone(),
        );
    }

    pub(crate) fn worker(&self, index: usize) -> WorkerCounters {
        let wd = |dir| WorkerDir {
            worker: index.to_string(),
            dir,
        };
        WorkerCounters {
            frames_in: self.frames.get_or_create_owned(&wd("in")),
            frames_out: self.frames.get_or_create_owned(&wd("out")),
            bytes_in: self.bytes.get_or_create_owned(&wd("in")),
            bytes_out: self.bytes.get_or_create_owned(&wd("out")),
            connections: self.connections.get_or_create_owned(&WorkerLabel {
                worker: index.to_string(),
            }),
            direct: self.direct.get_or_create_owned(&WorkerLabel {
                worker: index.to_string(),
            }),
        }
    }

    pub(crate) fn migrated(&self, pause: std::time::Duration) {
        self.migrations.inc();
        self.migration_pause.observe(pause.as_secs_f64());
        let mut recent = nacre_types::sync::lock(&self.recent_pauses);
        if recent.len() == RECENT_PAUSES {
            recent.pop_front();
        }
        recent.push_back(u64::try_from(pause.as_nanos()).unwrap_or(u64::MAX));
        drop(recent);
        self.migrated.notify_waiters();
    }

    /// Returns once at least `n` migrations happened.
    pub(crate) async fn wait_migrations(&self, n: u64) {
        loop {
            let migrated = self.migrated.notified();
            if self.migrations() >= n {
                return;
            }
            migrated.await;
        }
    }

    pub(crate) fn recent_pauses(&self) -> Vec<std::time::Duration> {
        nacre_types::sync::lock(&self.recent_pauses)
            .iter()
            .map(|&ns| std::time::Duration::from_nanos(ns))
            .collect()
    }

    pub(crate) fn migrations(&self) -> u64 {
        self.migrations.get()
    }

    pub(crate) fn set_spread(&self, v: f64) {
        self.spread.set(v);
    }

    pub(crate) fn error(&self, kind: &'static str) {
        self.errors.get_or_create(&KindLabel { kind }).inc();
    }

    /// Records a served request: its service time and its result.
    pub(crate) fn served(&self, op: OpName, secs: f64, result: &'static str) {
        self.served
            .get_or_create(&OpLabel { op: op.clone() })
            .observe(secs);
        self.results.get_or_create(&OpResult { op, result }).inc();
    }

    pub(crate) fn inflight(&self, side: &'static str) -> Gauge {
        self.inflight.get_or_create_owned(&SideLabel { side })
    }
}
