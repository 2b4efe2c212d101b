//! A server and a client messenger for the integration tests, on any transport.
#![allow(clippy::unwrap_used, dead_code)] // test helpers; not every test binary uses each

use std::sync::Arc;

use nacre_msgr::{Handler, Messenger, MsgrConfig, Transport};
use tokio::sync::oneshot;

/// A serving server messenger and a client messenger.
pub struct Setup {
    pub server: Messenger,
    pub client: Messenger,
    /// The server's address.
    pub addr: String,
    stop: oneshot::Sender<()>,
}

/// Starts `handler` on a server messenger bound to `bind`, and a client messenger.
pub async fn setup(
    (server_t, client_t): (Arc<dyn Transport>, Arc<dyn Transport>),
    bind: &str,
    (server_cfg, client_cfg): (MsgrConfig, MsgrConfig),
    handler: Arc<dyn Handler>,
) -> Setup {
    let server = Messenger::new("srv", server_cfg, server_t).unwrap();
    let client = Messenger::new("cli", client_cfg, client_t).unwrap();
    let listener = server.transport().bind(bind).await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (stop, stopped) = oneshot::channel::<()>();
    tokio::spawn(server.serve(listener, handler, async {
        let _ = stopped.await;
    }));
    Setup {
        server,
        client,
        addr,
        stop,
    }
}

/// Stops the server and both messengers.
pub async fn teardown(s: Setup) {
    let _ = s.stop.send(());
    tokio::task::spawn_blocking(move || {
        s.client.shutdown();
        s.server.shutdown();
    })
    .await
    .unwrap();
}
