//! [`FuncServer`]: serves `func_apply` calls on a bounded set of blocking threads.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use nacre_api::func::{Apply, CallRequest, OutputLayout, join_input, split_output};
use nacre_api::master::FuncLoad;
use nacre_func::{FuncError, Function};
use nacre_msgr::{Incoming, Payload, Router};
use nacre_proto::msg::RemoteError;
use nacre_types::ErrorCode;
use prometheus_client::metrics::gauge::Gauge;
use tokio::sync::Semaphore;

use crate::metrics::FuncMetrics;

/// How a function server runs calls.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FuncServerConfig {
    /// Calls running at once, each on a blocking thread (functions are CPU-bound: more than the
    /// cores only adds switching).
    pub workers: usize,
    /// Calls admitted at once, running or waiting for a worker; the next one is refused with
    /// `Unavailable`. What the server registers as its capacity.
    pub max_inflight: usize,
    /// The functions served; a call of another is refused with `Unavailable`.
    pub functions: Vec<Function>,
}

impl Default for FuncServerConfig {
    fn default() -> Self {
        Self {
            workers: std::thread::available_parallelism().map_or(2, |n| n.get()),
            max_inflight: 64,
            functions: Function::ALL.to_vec(),
        }
    }
}

#[derive(Debug)]
struct Inner {
    config: FuncServerConfig,
    /// Calls admitted (`max_inflight` permits).
    admitted: Arc<Semaphore>,
    /// Calls running (`workers` permits).
    running: Arc<Semaphore>,
    metrics: FuncMetrics,
    /// Calls answered and their input bytes, for the heartbeat's rates.
    calls: AtomicU64,
    bytes_in: AtomicU64,
}

/// A function server. Cheap to clone; clones share the bounds and the counters.
#[derive(Clone, Debug)]
pub struct FuncServer {
    inner: Arc<Inner>,
}

impl FuncServer {
    pub fn new(config: FuncServerConfig, metrics: FuncMetrics) -> Self {
        let max_inflight = config.max_inflight.max(1);
        let workers = config.workers.max(1);
        Self {
            inner: Arc::new(Inner {
                admitted: Arc::new(Semaphore::new(max_inflight)),
                running: Arc::new(Semaphore::new(workers)),
                config: FuncServerConfig {
                    workers,
                    max_inflight,
                    ..config
                },
                metrics,
                calls: AtomicU64::new(0),
                bytes_in: AtomicU64::new(0),
            }),
        }
    }

    pub fn config(&self) -> &FuncServerConfig {
        &self.inner.config
    }

    /// Calls admitted and not yet answered.
    pub fn outstanding(&self) -> u32 {
        let free = self.inner.admitted.available_permits();
        (self.inner.config.max_inflight.saturating_sub(free)) as u32
    }

    /// Calls answered since the server started (function errors included, refusals not).
    pub fn calls(&self) -> u64 {
        self.inner.calls.load(Ordering::Relaxed)
    }

    /// Calls refused because `max_inflight` were in flight.
    pub fn refused(&self) -> u64 {
        self.inner.metrics.refused.get()
    }

    /// Input bytes of those calls.
    pub fn bytes_in(&self) -> u64 {
        self.inner.bytes_in.load(Ordering::Relaxed)
    }

    /// The load a heartbeat reports, with rates over the interval since `since`, which it
    /// advances.
    pub fn load(&self, since: &mut LoadSample) -> FuncLoad {
        let now = Instant::now();
        let (calls, bytes) = (self.calls(), self.bytes_in());
        let secs = now.duration_since(since.at).as_secs_f64();
        let rate = |d: u64| {
            if secs > 0.0 {
                (d as f64 / secs).round() as u64
            } else {
                0
            }
        };
        let load = FuncLoad {
            outstanding: self.outstanding(),
            calls_per_s: rate(calls.saturating_sub(since.calls)),
            bytes_per_s: rate(bytes.saturating_sub(since.bytes_in)),
        };
        *since = LoadSample {
            at: now,
            calls,
            bytes_in: bytes,
        };
        load
    }

    /// The messenger ops it serves.
    pub fn router(&self) -> Router {
        let me = self.clone();
        Router::new().route::<Apply, _, _>(move |req, inc| {
            let me = me.clone();
            async move { me.apply(req, inc).await }
        })
    }

    async fn apply(
        &self,
        req: CallRequest,
        inc: Incoming,
    ) -> Result<(Result<OutputLayout, FuncError>, Payload), RemoteError> {
        let inner = &self.inner;
        let function = req.call.function();
        if !inner.config.functions.contains(&function) {
            inner.metrics.refused();
            return Err(RemoteError::new(
                ErrorCode::Unavailable,
                format!("{function} is not offered by this function server"),
            ));
        }
        let Ok(admitted) = inner.admitted.clone().try_acquire_owned() else {
            inner.metrics.refused();
            return Err(RemoteError::new(
                ErrorCode::Busy,
                format!(
                    "function server busy: {} calls in flight",
                    inner.config.max_inflight
                ),
            ));
        };
        let inflight = Inflight::new(inner.metrics.inflight().clone());
        let input_len = inc.data.len() as u64;
        let input = join_input(req.input, inc.data.bytes)
            .map_err(|e| RemoteError::new(ErrorCode::BadRequest, e.to_string()))?;
        let running =
            inner.running.clone().acquire_owned().await.map_err(|_| {
                RemoteError::new(ErrorCode::Unavailable, "function server is stopping")
            })?;
        let call = req.call;
        let inner = inner.clone();
        // The permits and the count go with the work: a caller that hangs up does not free a
        // worker or an admission while its function still runs.
        tokio::task::spawn_blocking(move || {
            let (_admitted, _running, _inflight) = (admitted, running, inflight);
            let start = Instant::now();
            let out = nacre_func::apply(&call, input);
            let secs = start.elapsed().as_secs_f64();
            inner.calls.fetch_add(1, Ordering::Relaxed);
            inner.bytes_in.fetch_add(input_len, Ordering::Relaxed);
            match out {
                Ok(out) => {
                    let (layout, data) = split_output(&out);
                    let out_len = data.len() as u64;
                    inner.metrics.ran(function, input_len, out_len, false, secs);
                    (Ok(layout), Payload::new(data))
                }
                Err(e) => {
                    inner.metrics.ran(function, input_len, 0, true, secs);
                    (Err(e), Payload::none())
                }
            }
        })
        .await
        .map_err(|e| {
            RemoteError::new(
                ErrorCode::Internal,
                format!("{function} did not complete: {e}"),
            )
        })
    }
}

/// Counts a call in the in-flight gauge while it lives.
struct Inflight(Gauge);

impl Inflight {
    fn new(g: Gauge) -> Self {
        g.inc();
        Self(g)
    }
}

impl Drop for Inflight {
    fn drop(&mut self) {
        self.0.dec();
    }
}

/// Where the rates of the previous heartbeat ended.
#[derive(Clone, Copy, Debug)]
pub struct LoadSample {
    at: Instant,
    calls: u64,
    bytes_in: u64,
}

impl LoadSample {
    /// A sample at zero calls, now: the first heartbeat's rates cover the server's whole life.
    pub fn start() -> Self {
        Self {
            at: Instant::now(),
            calls: 0,
            bytes_in: 0,
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;
    use bytes::Bytes;
    use nacre_api::func::{InputLayout, join_output};
    use nacre_func::{Call, Codec, Input, Output, apply};
    use nacre_proto::Flags;

    fn incoming(data: Bytes) -> Incoming {
        Incoming {
            peer: Arc::from("test"),
            flags: Flags::default(),
            data: Payload::new(data),
        }
    }

    fn compress() -> CallRequest {
        CallRequest {
            call: Call::Compress { codec: Codec::Lz4 },
            input: InputLayout::Bytes,
        }
    }

    fn server(config: FuncServerConfig) -> (FuncServer, FuncMetrics) {
        let metrics = FuncMetrics::default();
        (FuncServer::new(config, metrics.clone()), metrics)
    }

    #[tokio::test(flavor = "current_thread")]
    async fn a_call_runs_the_inline_code_and_is_counted() {
        let (s, metrics) = server(FuncServerConfig::default());
        let data = Bytes::from("abc".repeat(1000));
        let (out, payload) = s.apply(compress(), incoming(data.clone())).await.unwrap();
        let out = join_output(out.unwrap(), payload.bytes).unwrap();
        assert_eq!(
            out,
            apply(&Call::Compress { codec: Codec::Lz4 }, Input::Bytes(data)).unwrap()
        );
        // A corrupt frame: the function's error, as an answer.
        let bad = CallRequest {
            call: Call::Decompress,
            input: InputLayout::Bytes,
        };
        let (out, payload) = s
            .apply(bad, incoming(Bytes::from_static(b"not a frame")))
            .await
            .unwrap();
        assert!(matches!(out, Err(FuncError::Truncated { .. })));
        assert!(payload.is_empty());
        assert_eq!((s.calls(), s.outstanding()), (2, 0));
        let mut reg = prometheus_client::registry::Registry::default();
        metrics.register(&mut reg);
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &reg).unwrap();
        for line in [
            "nacre_func_calls_total{function=\"compress\"} 1",
            "nacre_func_calls_total{function=\"decompress\"} 1",
            "nacre_func_errors_total{function=\"decompress\"} 1",
            "nacre_func_in_bytes_total{function=\"compress\"} 3000",
            "nacre_func_inflight_calls 0",
        ] {
            assert!(text.contains(line), "{line} missing from\n{text}");
        }
        let mut since = LoadSample::start();
        let load = s.load(&mut since);
        assert_eq!(load.outstanding, 0);
        assert!(load.calls_per_s > 0 && load.bytes_per_s > 0, "{load:?}");
        assert_eq!(
            s.load(&mut since).calls_per_s,
            0,
            "no call since the last sample"
        );
    }

    #[tokio::test(flavor = "current_thread")]
    async fn beyond_its_bound_a_server_refuses_at_once() {
        let (s, metrics) = server(FuncServerConfig {
            max_inflight: 2,
            ..FuncServerConfig::default()
        });
        let held = s
            .inner
            .admitted
            .clone()
            .acquire_many_owned(2)
            .await
            .unwrap();
        assert_eq!(s.outstanding(), 2);
        let err = s
            .apply(compress(), incoming(Bytes::new()))
            .await
            .unwrap_err();
        assert_eq!(err.code(), ErrorCode::Busy);
        assert!(err.message.contains("busy"), "{err}");
        assert_eq!(metrics.refused.get(), 1);
        drop(held);
        assert!(s.apply(compress(), incoming(Bytes::new())).await.is_ok());
    }

    #[tokio::test(flavor = "current_thread")]
    async fn a_function_not_offered_or_a_bad_layout_is_refused() {
        let (s, _) = server(FuncServerConfig {
            functions: vec![Function::Checksum],
            ..FuncServerConfig::default()
        });
        let err = s
            .apply(compress(), incoming(Bytes::new()))
            .await
            .unwrap_err();
        assert_eq!(err.code(), ErrorCode::Unavailable);
        let bad = CallRequest {
            call: Call::Checksum,
            input: InputLayout::Shards(vec![Some(nacre_api::func::ShardMeta { len: 9, crc: 0 })]),
        };
        let err = s
            .apply(bad, incoming(Bytes::from_static(b"abc")))
            .await
            .unwrap_err();
        assert_eq!(err.code(), ErrorCode::BadRequest);
        let (out, _) = s
            .apply(
                CallRequest {
                    call: Call::Checksum,
                    input: InputLayout::Bytes,
                },
                incoming(Bytes::from_static(b"abc")),
            )
            .await
            .unwrap();
        assert_eq!(
            join_output(out.unwrap(), Bytes::new()).unwrap(),
            Output::Checksum(nacre_func::checksum(b"abc"))
        );
    }
}
