//! The nacre messenger: framed RPC over pluggable transports, on worker event loops.
//!
//! A [`Messenger`] owns N worker threads (one `current_thread` tokio runtime each). Connections — both
//! accepted by [`Messenger::serve`] and opened by a [`Client`] — are assigned to workers by an
//! [`AssignPolicy`] and live on their worker for their whole life (until a balancer moves them).
//!
//! ```no_run
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! use std::sync::Arc;
//! use nacre_msgr::{Messenger, MsgrConfig, Payload, Router, TcpTransport};
//! use nacre_proto::msg::sys::{Echo, EchoResponse};
//!
//! let msgr = Messenger::new("demo", MsgrConfig::default(), Arc::new(TcpTransport))?;
//! let listener = TcpTransport::listener(tokio::net::TcpListener::bind("127.0.0.1:0").await?);
//! let addr = listener.local_addr()?;
//! let router = Router::new().route::<Echo, _, _>(|_req, incoming| async move {
//!     Ok((EchoResponse {}, incoming.data))
//! });
//! let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
//! let server = tokio::spawn(msgr.serve(listener, Arc::new(router), async { let _ = stopped.await; }));
//! let client = msgr.client();
//! let (_resp, data) = client
//!     .call::<Echo>(&addr, &Default::default(), Payload::new(bytes::Bytes::from_static(b"hi")))
//!     .await?;
//! assert_eq!(&data.bytes[..], b"hi");
//! let _ = stop.send(());
//! server.await??;
//! # Ok(()) }
//! ```

mod balance;
mod bundle;
mod client;
mod config;
mod conn;
mod error;
mod handler;
pub mod mem;
mod metrics;
pub mod policy;
mod server;
pub mod transport;
mod worker;

use std::future::Future;
use std::io;
use std::sync::Arc;

use prometheus_client::registry::Registry;

pub use balance::{BalanceConfig, BalanceKind, ConnLoad, ConnStat, Move, plan, spread};
pub use client::{CallOptions, Client};
pub use config::{ConfigError, MsgrConfig};
pub use error::MsgrError;
pub use handler::{Handler, Incoming, Payload, Reply, Request, Router};
pub use metrics::MsgrMetrics;
pub use policy::{AssignKind, AssignPolicy, WorkerLoad};
pub use transport::{BoxFuture, DetachedStream, Listener, Stream, TcpTransport, Transport};
pub use worker::{Worker, WorkerStat, Workers};

pub(crate) struct Shared {
    pub(crate) name: String,
    pub(crate) config: MsgrConfig,
    pub(crate) workers: Workers,
    pub(crate) transport: Arc<dyn Transport>,
    pub(crate) metrics: MsgrMetrics,
    /// Every live connection (for the balancer and for inspection).
    pub(crate) conns: balance::ConnTable,
    balancer: std::sync::Mutex<Option<balance::Balancer>>,
}

impl std::fmt::Debug for Shared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Messenger")
            .field("name", &self.name)
            .field("workers", &self.workers.len())
            .field("transport", &self.transport)
            .finish_non_exhaustive()
    }
}

/// A messenger: worker threads, a transport, metrics. Cheap to clone.
#[derive(Clone, Debug)]
pub struct Messenger {
    shared: Arc<Shared>,
}

impl Messenger {
    /// Starts the worker threads. `name` prefixes thread names (e.g. `meta-2`).
    pub fn new(name: &str, config: MsgrConfig, transport: Arc<dyn Transport>) -> io::Result<Self> {
        config.validate().map_err(io::Error::other)?;
        let metrics = MsgrMetrics::default();
        let workers = Workers::start(name, config.workers, config.assign.build(), &metrics)?;
        let balance = config.balance.clone();
        let shared = Arc::new(Shared {
            name: name.to_string(),
            config,
            workers,
            transport,
            metrics,
            conns: balance::ConnTable::default(),
            balancer: std::sync::Mutex::new(None),
        });
        if balance.policy != BalanceKind::Off && shared.workers.len() > 1 {
            let b = balance::Balancer::start(name, Arc::downgrade(&shared), balance)?;
            *nacre_types::sync::lock(&shared.balancer) = Some(b);
        }
        Ok(Self { shared })
    }

    /// The configuration this messenger runs with.
    pub fn config(&self) -> &MsgrConfig {
        &self.shared.config
    }

    /// The transport, for binding listeners.
    pub fn transport(&self) -> &Arc<dyn Transport> {
        &self.shared.transport
    }

    /// The worker pool (to run latency-sensitive work next to its connections).
    pub fn workers(&self) -> &Workers {
        &self.shared.workers
    }

    /// Registers the messenger's metrics in `registry`.
    pub fn register_metrics(&self, registry: &mut Registry) {
        self.shared.metrics.register(registry);
    }

    /// A client whose connections live on this messenger's workers. Clients share nothing with each
    /// other but the workers: each has its own connections and in-flight budget.
    pub fn client(&self) -> Client {
        Client::new(Arc::clone(&self.shared))
    }

    /// Serves `handler` on every connection `listener` accepts until `shutdown` completes, then closes
    /// connections gracefully (in-flight requests are answered) and returns.
    pub fn serve<F>(
        &self,
        listener: Box<dyn Listener>,
        handler: Arc<dyn Handler>,
        shutdown: F,
    ) -> impl Future<Output = io::Result<()>> + Send + 'static
    where
        F: Future<Output = ()> + Send + 'static,
    {
        server::serve(Arc::clone(&self.shared), listener, handler, shutdown)
    }

    /// Every live connection: where it runs and what it has cost.
    pub fn connections(&self) -> Vec<ConnStat> {
        let mut all: Vec<ConnStat> = self.shared.conns.all().iter().map(|c| c.stat()).collect();
        all.sort_by_key(|c| c.id);
        all
    }

    /// Each worker's connections, traffic and busy time.
    pub fn worker_stats(&self) -> Vec<WorkerStat> {
        self.shared.workers.stats()
    }

    /// Connections moved between workers since the messenger started.
    pub fn migrations(&self) -> u64 {
        self.shared.metrics.migrations()
    }

    /// Returns once the messenger has moved connections between workers `n` times in all.
    pub async fn wait_migrations(&self, n: u64) {
        self.shared.metrics.wait_migrations(n).await;
    }

    /// How long the latest migrations (up to 4,096) left their connection unserved.
    pub fn recent_migration_pauses(&self) -> Vec<std::time::Duration> {
        self.shared.metrics.recent_pauses()
    }

    /// Asks connection `id` to move to worker `to` (what the balancer does). It moves at its
    /// driver's next poll; `false` when no such connection or worker exists.
    pub fn migrate(&self, id: u64, to: usize) -> bool {
        to < self.shared.workers.len() && self.shared.conns.migrate(id, to)
    }

    /// Stops the balancer and the worker threads and waits for them; connections still open are
    /// dropped. Must not be called from inside a worker.
    pub fn shutdown(&self) {
        let balancer = nacre_types::sync::lock(&self.shared.balancer).take();
        if let Some(mut b) = balancer {
            b.stop();
        }
        self.shared.workers.shutdown();
    }
}
