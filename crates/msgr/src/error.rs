//! Messenger errors.

use std::time::Duration;

use nacre_proto::FrameError;
use nacre_proto::msg::{DecodeError, RemoteError};
use nacre_types::ErrorCode;
use thiserror::Error;

/// Why a call did not get a response.
#[derive(Debug, Error, Clone)]
#[non_exhaustive]
pub enum MsgrError {
    /// The deadline passed before the response arrived. The request may or may not have been served.
    #[error("{op} to {peer} timed out after {after:?}")]
    Timeout {
        peer: String,
        op: &'static str,
        after: Duration,
    },
    /// Could not open a connection to the peer. `refused`: nothing listens at its address (the
    /// process is gone), as opposed to a connect that timed out or failed otherwise.
    #[error("cannot connect to {peer}: {reason}")]
    Connect {
        peer: String,
        reason: String,
        refused: bool,
    },
    /// The connection closed or broke while the request was outstanding. The request may or may not
    /// have been served.
    #[error("connection to {peer} reset: {reason}")]
    Reset { peer: String, reason: String },
    /// The peer answered with an error frame.
    #[error("{peer} replied: {error}")]
    Remote { peer: String, error: RemoteError },
    /// The peer sent a frame that does not decode.
    #[error("bad frame from {peer}: {source}")]
    Frame { peer: String, source: FrameError },
    /// A response body did not decode as the expected type.
    #[error("bad response from {peer}: {source}")]
    Decode { peer: String, source: DecodeError },
    /// The request is larger than the configured frame limit; it was not sent.
    #[error("request of {len} bytes exceeds the frame limit of {max} bytes")]
    TooLarge { len: usize, max: u32 },
    /// The messenger is shutting down.
    #[error("messenger is shut down")]
    Shutdown,
}

impl MsgrError {
    /// The remote error code, if the peer answered with an error.
    pub fn remote_code(&self) -> Option<ErrorCode> {
        match self {
            Self::Remote { error, .. } => Some(error.code()),
            _ => None,
        }
    }

    /// Whether the request is known not to have been served, so it is safe to send again even if it is
    /// not idempotent.
    pub fn not_sent(&self) -> bool {
        matches!(
            self,
            Self::Connect { .. } | Self::TooLarge { .. } | Self::Shutdown
        )
    }

    /// Label for the errors counter.
    pub(crate) fn kind_label(&self) -> &'static str {
        match self {
            Self::Timeout { .. } => "timeout",
            Self::Connect { .. } => "connect",
            Self::Reset { .. } => "reset",
            Self::Remote { .. } => "remote",
            Self::Frame { .. } => "frame",
            Self::Decode { .. } => "decode",
            Self::TooLarge { .. } => "too_large",
            Self::Shutdown => "shutdown",
        }
    }
}
