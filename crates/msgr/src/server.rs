//! The accept loop.

use std::collections::HashMap;
use std::future::Future;
use std::io;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use nacre_types::sync::lock;
use tokio::sync::{Notify, Semaphore, mpsc};

use crate::Shared;
use crate::conn::{Conn, Outgoing, ServerSide};
use crate::handler::Handler;
use crate::transport::Listener;

/// How long a stopping server waits for connections to answer their in-flight requests.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(5);

#[derive(Default)]
struct Registry {
    conns: Mutex<HashMap<u64, mpsc::UnboundedSender<Outgoing>>>,
    changed: Notify,
}

pub(crate) async fn serve<F>(
    shared: Arc<Shared>,
    mut listener: Box<dyn Listener>,
    handler: Arc<dyn Handler>,
    shutdown: F,
) -> io::Result<()>
where
    F: Future<Output = ()> + Send + 'static,
{
    let cfg = &shared.config;
    let total_reqs = Arc::new(Semaphore::new(cfg.max_inflight_total as usize));
    let total_bytes = Arc::new(Semaphore::new(cfg.max_inflight_bytes_total as usize));
    let registry = Arc::new(Registry::default());
    let next_id = AtomicU64::new(1);
    let local = listener.local_addr().unwrap_or_default();
    tracing::debug!(name = %shared.name, addr = %local, "serving");
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        let accepted = tokio::select! {
            _ = &mut shutdown => break,
            r = listener.accept() => r,
        };
        let (stream, peer) = match accepted {
            Ok(a) => a,
            Err(e) => {
                shared.metrics.error("accept");
                tracing::warn!(addr = %local, error = %e, "accept failed");
                // Out of descriptors and similar conditions persist for a while; do not spin.
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let id = next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = mpsc::unbounded_channel();
        lock(&registry.conns).insert(id, tx.clone());
        let worker = shared.workers.assign();
        let side = ServerSide::new(
            Arc::clone(&handler),
            Arc::clone(&total_reqs),
            Arc::clone(&total_bytes),
            cfg.max_inflight_per_conn,
            u64::from(cfg.max_inflight_bytes_per_conn),
            shared.metrics.inflight("server"),
            tx,
        );
        let counters = worker.counters.clone();
        let metrics = shared.metrics.clone();
        let limits = cfg.limits();
        let registry2 = Arc::clone(&registry);
        worker.spawn(async move {
            match stream.attach() {
                Ok(io) => {
                    let conn = Conn::server(io, peer.into(), limits, rx, side, counters, metrics);
                    conn.await;
                }
                Err(e) => tracing::warn!(error = %e, "cannot attach accepted connection"),
            }
            lock(&registry2.conns).remove(&id);
            registry2.changed.notify_waiters();
        });
    }
    drop(listener);
    // Graceful close: every connection stops reading, answers what it has, and exits.
    for tx in lock(&registry.conns).values() {
        let _ = tx.send(Outgoing::Close);
    }
    let drained = tokio::time::timeout(DRAIN_TIMEOUT, async {
        loop {
            let changed = registry.changed.notified();
            if lock(&registry.conns).is_empty() {
                return;
            }
            changed.await;
        }
    })
    .await;
    if drained.is_err() {
        tracing::warn!(addr = %local, "connections still busy after {DRAIN_TIMEOUT:?}; leaving them to the workers");
    }
    total_reqs.close();
    total_bytes.close();
    Ok(())
}
