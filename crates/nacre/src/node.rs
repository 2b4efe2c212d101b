//! A nacre process: messenger, system ops, metrics endpoint. Roles plug in here as they arrive.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use nacre_msgr::{AssignKind, Messenger, MsgrConfig, Payload, Router, TcpTransport};
use nacre_proto::msg::sys::{Echo, EchoResponse, Ping, PingResponse};
use prometheus_client::registry::Registry;
use serde::{Deserialize, Serialize};
use tokio::sync::watch;
use tokio::task::JoinHandle;

/// Configuration of one `nacre server` process (TOML, with `NACRE_*` overrides).
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct NodeConfig {
    /// Name reported by `ping` and used in logs and thread names.
    pub name: String,
    /// Messenger listen address (`host:port`; port 0 picks a free one).
    pub listen: String,
    /// Prometheus `/metrics` listen address; empty disables the endpoint.
    pub metrics_listen: String,
    pub msgr: MsgrSection,
}

impl Default for NodeConfig {
    fn default() -> Self {
        Self {
            name: "nacre".into(),
            listen: "127.0.0.1:7100".into(),
            metrics_listen: "127.0.0.1:9100".into(),
            msgr: MsgrSection::default(),
        }
    }
}

/// The `[msgr]` table: messenger tuning.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct MsgrSection {
    pub workers: usize,
    /// `round-robin` or `least-connections`.
    pub assign: String,
    pub max_frame: u32,
    pub conns_per_peer: usize,
    pub max_inflight_per_conn: u32,
    pub max_inflight_bytes_per_conn: u32,
    pub max_inflight_total: u32,
    pub max_inflight_bytes_total: u32,
    pub connect_timeout_ms: u64,
    pub default_deadline_ms: u64,
}

impl Default for MsgrSection {
    fn default() -> Self {
        let d = MsgrConfig::default();
        Self {
            workers: d.workers,
            assign: d.assign.to_string(),
            max_frame: d.max_frame,
            conns_per_peer: d.conns_per_peer,
            max_inflight_per_conn: d.max_inflight_per_conn,
            max_inflight_bytes_per_conn: d.max_inflight_bytes_per_conn,
            max_inflight_total: d.max_inflight_total,
            max_inflight_bytes_total: d.max_inflight_bytes_total,
            connect_timeout_ms: d.connect_timeout.as_millis() as u64,
            default_deadline_ms: d.default_deadline.as_millis() as u64,
        }
    }
}

impl MsgrSection {
    pub fn to_config(&self) -> anyhow::Result<MsgrConfig> {
        let assign: AssignKind = self
            .assign
            .parse()
            .map_err(|e: String| anyhow::anyhow!("msgr.assign: {e}"))?;
        let c = MsgrConfig {
            workers: self.workers,
            assign,
            max_frame: self.max_frame,
            conns_per_peer: self.conns_per_peer,
            max_inflight_per_conn: self.max_inflight_per_conn,
            max_inflight_bytes_per_conn: self.max_inflight_bytes_per_conn,
            max_inflight_total: self.max_inflight_total,
            max_inflight_bytes_total: self.max_inflight_bytes_total,
            connect_timeout: Duration::from_millis(self.connect_timeout_ms),
            default_deadline: Duration::from_millis(self.default_deadline_ms),
        };
        c.validate().map_err(|e| anyhow::anyhow!(e))?;
        Ok(c)
    }
}

/// A started node.
#[derive(Debug)]
pub struct Node {
    pub name: String,
    pub addr: String,
    pub metrics_addr: Option<String>,
    msgr: Messenger,
    stop: watch::Sender<bool>,
    tasks: Vec<JoinHandle<anyhow::Result<()>>>,
}

/// The ops every process serves, whatever its roles.
pub fn system_router(name: &str) -> Router {
    let name = name.to_string();
    Router::new()
        .route::<Ping, _, _>(move |_req, _inc| {
            let name = name.clone();
            async move {
                Ok((
                    PingResponse {
                        name,
                        version: env!("CARGO_PKG_VERSION").to_string(),
                    },
                    Payload::none(),
                ))
            }
        })
        .route::<Echo, _, _>(|_req, inc| async move { Ok((EchoResponse {}, inc.data)) })
}

impl Node {
    /// Binds the listeners and starts serving. Call from inside a tokio runtime.
    pub async fn start(cfg: &NodeConfig) -> anyhow::Result<Self> {
        let msgr = Messenger::new(&cfg.name, cfg.msgr.to_config()?, Arc::new(TcpTransport))?;
        let mut registry = Registry::default();
        msgr.register_metrics(&mut registry);
        let registry = Arc::new(registry);
        let (stop, _) = watch::channel(false);
        let mut tasks = Vec::new();

        let l = tokio::net::TcpListener::bind(&cfg.listen)
            .await
            .with_context(|| format!("cannot listen on {} (listen)", cfg.listen))?;
        let listener = TcpTransport::listener(l);
        let addr = listener.local_addr()?;
        let mut rx = stop.subscribe();
        let serve = msgr.serve(listener, Arc::new(system_router(&cfg.name)), async move {
            let _ = rx.wait_for(|s| *s).await;
        });
        tasks.push(tokio::spawn(async move { Ok(serve.await?) }));

        let metrics_addr = if cfg.metrics_listen.is_empty() {
            None
        } else {
            let l = tokio::net::TcpListener::bind(&cfg.metrics_listen)
                .await
                .with_context(|| {
                    format!("cannot listen on {} (metrics_listen)", cfg.metrics_listen)
                })?;
            let maddr = l.local_addr()?.to_string();
            let mut rx = stop.subscribe();
            tasks.push(tokio::spawn(async move {
                crate::http::serve(l, registry, async move {
                    let _ = rx.wait_for(|s| *s).await;
                })
                .await?;
                Ok(())
            }));
            Some(maddr)
        };
        tracing::info!(name = %cfg.name, %addr, metrics = ?metrics_addr, "node started");
        Ok(Self {
            name: cfg.name.clone(),
            addr,
            metrics_addr,
            msgr,
            stop,
            tasks,
        })
    }

    /// Stops serving, lets connections finish, and stops the messenger's workers.
    pub async fn stop(self) -> anyhow::Result<()> {
        let _ = self.stop.send(true);
        for t in self.tasks {
            t.await??;
        }
        let msgr = self.msgr;
        tokio::task::spawn_blocking(move || msgr.shutdown()).await?;
        tracing::info!(name = %self.name, "node stopped");
        Ok(())
    }
}
