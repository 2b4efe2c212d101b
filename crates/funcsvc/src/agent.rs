//! The function server's side of the master protocol: register, then heartbeat with its load.

use std::future::Future;
use std::time::Duration;

use nacre_api::master::{MapError, MasterError, RegisterFuncRequest};
use nacre_client::MasterClient;
use nacre_types::NodeId;
use tokio::sync::watch;

use crate::server::{FuncServer, LoadSample};

/// How a function server presents itself to the master.
#[derive(Clone, Debug)]
pub struct FuncAgentConfig {
    pub register: RegisterFuncRequest,
    pub heartbeat_interval: Duration,
}

/// Registers the server and heartbeats with its load until `shutdown` resolves; registers again
/// when the master no longer knows it (a master restored from an older snapshot). The node's id,
/// once registered, is published on `id`.
pub async fn run_func_agent(
    master: MasterClient,
    config: FuncAgentConfig,
    server: FuncServer,
    id: watch::Sender<Option<NodeId>>,
    shutdown: impl Future<Output = ()>,
) {
    let mut shutdown = std::pin::pin!(shutdown);
    let mut tick = tokio::time::interval(config.heartbeat_interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    let mut since = LoadSample::start();
    loop {
        tokio::select! {
            _ = &mut shutdown => return,
            _ = tick.tick() => {}
        }
        let current = *id.borrow();
        match current {
            None => match master.register_func(&config.register).await {
                Ok(node) => {
                    tracing::info!(%node, addr = %config.register.addr, "function server registered with the master");
                    id.send_replace(Some(node));
                    // Report the load at once rather than one interval later.
                    tick.reset_immediately();
                }
                Err(e) => tracing::warn!(error = %e, "cannot register with the master"),
            },
            Some(node) => match master.func_heartbeat(node, server.load(&mut since)).await {
                Ok(()) => {}
                Err(MasterError::Map(MapError::UnknownNode(_))) => {
                    tracing::warn!(%node, "the master does not know this function server; registering again");
                    id.send_replace(None);
                    tick.reset_immediately();
                }
                Err(e) => tracing::warn!(error = %e, "heartbeat failed"),
            },
        }
    }
}
