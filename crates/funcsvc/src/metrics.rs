//! A function server's metrics (`nacre_func_*`), per function.

use nacre_func::Function;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use std::sync::atomic::AtomicU64;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct FunctionLabel {
    function: &'static str,
}

fn label(f: Function) -> FunctionLabel {
    FunctionLabel {
        function: match f {
            Function::Compress => "compress",
            Function::Decompress => "decompress",
            Function::EcEncode => "ec_encode",
            Function::EcReconstruct => "ec_reconstruct",
            Function::EcRebuild => "ec_rebuild",
            Function::Checksum => "checksum",
        },
    }
}

/// What a function server counts. Cheap to clone; clones share the counters.
#[derive(Clone, Debug, Default)]
pub struct FuncMetrics {
    calls: Family<FunctionLabel, Counter>,
    errors: Family<FunctionLabel, Counter>,
    bytes_in: Family<FunctionLabel, Counter>,
    bytes_out: Family<FunctionLabel, Counter>,
    busy: Family<FunctionLabel, Counter<f64, AtomicU64>>,
    pub(crate) refused: Counter,
    inflight: Gauge,
}

impl FuncMetrics {
    /// Registers the metrics (`nacre_func_*`).
    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            "nacre_func_calls",
            "Calls a function ran, by function (answers with a function error included)",
            self.calls.clone(),
        );
        registry.register(
            "nacre_func_errors",
            "Calls whose function refused its input (a corrupt frame or shard, a bad parameter)",
            self.errors.clone(),
        );
        registry.register(
            "nacre_func_in_bytes",
            "Input bytes of the calls run",
            self.bytes_in.clone(),
        );
        registry.register(
            "nacre_func_out_bytes",
            "Output bytes of the calls run",
            self.bytes_out.clone(),
        );
        registry.register(
            "nacre_func_busy_seconds",
            "Time workers spent running functions",
            self.busy.clone(),
        );
        registry.register(
            "nacre_func_refused_calls",
            "Calls refused with Unavailable: the in-flight bound was reached (or the function is \
             not offered here)",
            self.refused.clone(),
        );
        registry.register(
            "nacre_func_inflight_calls",
            "Calls admitted and not yet answered (running or waiting for a worker)",
            self.inflight.clone(),
        );
    }

    pub(crate) fn ran(&self, f: Function, input: u64, output: u64, failed: bool, secs: f64) {
        let l = label(f);
        self.calls.get_or_create(&l).inc();
        if failed {
            self.errors.get_or_create(&l).inc();
        }
        self.bytes_in.get_or_create(&l).inc_by(input);
        self.bytes_out.get_or_create(&l).inc_by(output);
        self.busy.get_or_create(&l).inc_by(secs);
    }

    pub(crate) fn refused(&self) {
        self.refused.inc();
    }

    pub(crate) fn inflight(&self) -> &Gauge {
        &self.inflight
    }
}
