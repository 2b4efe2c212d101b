//! The accept loop.

use std::collections::HashMap;
use std::future::Future;
use std::io;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use nacre_types::sync::lock;
use tokio::sync::{Notify, Semaphore, mpsc};

use crate::Shared;
use crate::balance::ConnInfo;
use crate::bundle::Bundles;
use crate::conn::{self, Conn, Outgoing, ServerSide};
use crate::handler::Handler;
use crate::transport::Listener;

/// How long a stopping server waits for connections to answer their in-flight requests.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(5);

#[derive(Default)]
struct Registry {
    conns: Mutex<HashMap<u64, mpsc::UnboundedSender<Outgoing>>>,
    changed: Notify,
}

/// A connection's entry in the accept loop's registry, removed when the connection ends.
struct Registered {
    registry: Arc<Registry>,
    id: u64,
}

impl Drop for Registered {
    fn drop(&mut self) {
        lock(&self.registry.conns).remove(&self.id);
        self.registry.changed.notify_waiters();
    }
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
    let bundles = Arc::new(Bundles::default());
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
        let id = shared.conns.next_id();
        let (tx, rx) = mpsc::unbounded_channel();
        lock(&registry.conns).insert(id, tx.clone());
        let worker = shared.workers.assign().index();
        let peer: Arc<str> = peer.into();
        let info = ConnInfo::new(id, "server", Arc::clone(&peer), worker, tx.downgrade());
        let registered = Registered {
            registry: Arc::clone(&registry),
            id,
        };
        let side = ServerSide::new(
            Arc::clone(&handler),
            (Arc::clone(&total_reqs), Arc::clone(&total_bytes)),
            cfg,
            shared.metrics.inflight("server"),
            tx,
            Box::new(registered),
            Arc::clone(&bundles),
        );
        let conn = Conn::server(Arc::clone(&shared), worker, peer, rx, side, info);
        conn::spawn(conn, stream);
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
