//! Messenger configuration. Every option is a switch so that benchmarks can compare them in one run.

use std::time::Duration;

use nacre_proto::FrameLimits;

use crate::balance::BalanceConfig;
use crate::policy::AssignKind;

/// Messenger settings. `Default` is what a production node runs with.
#[derive(Clone, Debug, PartialEq)]
pub struct MsgrConfig {
    /// Worker event loops (one thread with a `current_thread` runtime each).
    pub workers: usize,
    /// How new connections (accepted or opened) are assigned to workers.
    pub assign: AssignKind,
    /// Whether and how live connections move between workers.
    pub balance: BalanceConfig,
    /// Dual workers: a server connection's requests are decoded on its worker and handled on the
    /// next one, so reading overlaps with handling.
    pub dual: bool,
    /// Bound on body + data of one frame, both directions.
    pub max_frame: u32,
    /// Connections opened to one peer by a client; calls are spread over them.
    pub conns_per_peer: usize,
    /// Connections of a bundle: calls marked `bundled` go over this many connections per peer and
    /// still reach it in order (`crate::bundle`). 1: bundled calls take the ordinary path.
    pub bundle_conns: usize,
    /// Requests in flight on one connection (client: awaiting a reply; server: being served).
    pub max_inflight_per_conn: u32,
    /// Request bytes in flight on one connection.
    pub max_inflight_bytes_per_conn: u32,
    /// Requests in flight over all connections of one client or one server.
    pub max_inflight_total: u32,
    /// Request bytes in flight over all connections of one client or one server.
    pub max_inflight_bytes_total: u32,
    /// Time allowed to open a connection.
    pub connect_timeout: Duration,
    /// Deadline of a call that does not set its own.
    pub default_deadline: Duration,
}

impl Default for MsgrConfig {
    fn default() -> Self {
        Self {
            workers: 2,
            assign: AssignKind::RoundRobin,
            balance: BalanceConfig::default(),
            dual: false,
            max_frame: nacre_proto::DEFAULT_MAX_FRAME,
            conns_per_peer: 1,
            bundle_conns: 1,
            max_inflight_per_conn: 1024,
            max_inflight_bytes_per_conn: 64 << 20,
            max_inflight_total: 16 * 1024,
            max_inflight_bytes_total: 512 << 20,
            connect_timeout: Duration::from_secs(3),
            default_deadline: Duration::from_secs(10),
        }
    }
}

impl MsgrConfig {
    pub(crate) fn limits(&self) -> FrameLimits {
        FrameLimits {
            max_frame: self.max_frame,
        }
    }

    /// Checks values that would make the messenger unusable.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.workers == 0 {
            return Err(ConfigError::NoWorkers);
        }
        let b = &self.balance;
        if b.interval.is_zero() || !(b.threshold > 0.0 && b.threshold <= 1.0) || b.max_moves == 0 {
            return Err(ConfigError::Balance);
        }
        if self.conns_per_peer == 0 || self.bundle_conns == 0 {
            return Err(ConfigError::NoConnsPerPeer);
        }
        if self.max_inflight_per_conn == 0 || self.max_inflight_total == 0 {
            return Err(ConfigError::NoInflightRequests);
        }
        if self.max_inflight_bytes_per_conn < self.max_frame
            || self.max_inflight_bytes_total < self.max_frame
        {
            return Err(ConfigError::InflightBytesBelowFrame {
                max_frame: self.max_frame,
            });
        }
        Ok(())
    }
}

/// A [`MsgrConfig`] value that would make the messenger unusable ([`MsgrConfig::validate`]).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    #[error("msgr.workers must be at least 1")]
    NoWorkers,
    #[error(
        "msgr balancer: the interval must be above zero, the threshold in (0, 1] and max_moves at least 1"
    )]
    Balance,
    #[error("msgr.conns_per_peer and msgr.bundle_conns must be at least 1")]
    NoConnsPerPeer,
    #[error("msgr in-flight request limits must be at least 1")]
    NoInflightRequests,
    #[error("msgr in-flight byte limits must be at least max_frame ({max_frame} bytes)")]
    InflightBytesBelowFrame { max_frame: u32 },
}
