//! Op codes, typed bodies and the messages every nacre process understands.
//!
//! Op codes are grouped by subsystem so that a packet capture says at once who is talking:
//! `0x00xx` messenger/system, `0x01xx` master, `0x02xx` meta, `0x03xx` data, `0x04xx` raft, `0x05xx` func.

use std::fmt;

use bytes::Bytes;
use nacre_types::ErrorCode;
use serde::{Deserialize, Serialize, de::DeserializeOwned};
use thiserror::Error;

/// An operation code carried in every frame header.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize,
)]
pub struct Op(pub u16);

impl fmt::Display for Op {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "op {:#06x}", self.0)
    }
}

/// A request/response pair: its op code and body types. The raw data segment is passed beside the body.
pub trait Rpc {
    const OP: Op;
    const NAME: &'static str;
    type Request: Serialize + DeserializeOwned + Send + 'static;
    type Response: Serialize + DeserializeOwned + Send + 'static;
}

/// A body that could not be decoded.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
#[error("cannot decode body of {what}: {reason}")]
pub struct DecodeError {
    pub what: &'static str,
    pub reason: String,
}

/// Encodes a body with postcard.
pub fn encode_body<T: Serialize + ?Sized>(value: &T) -> Bytes {
    // Serializing plain data into a Vec cannot fail: postcard errors only on unsupported types
    // (e.g. maps with unknown length), which our message types do not use.
    match postcard::to_allocvec(value) {
        Ok(v) => Bytes::from(v),
        Err(e) => panic!("message type is not postcard-serializable: {e}"),
    }
}

/// Decodes a postcard body; trailing bytes are tolerated so that newer peers may append fields.
pub fn decode_body<T: DeserializeOwned>(what: &'static str, body: &[u8]) -> Result<T, DecodeError> {
    postcard::from_bytes(body).map_err(|e| DecodeError {
        what,
        reason: e.to_string(),
    })
}

/// Body of an error frame.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RemoteError {
    pub code: u32,
    pub message: String,
    /// For `NotLeader`: the address of the node the sender believes to be leader.
    pub leader_hint: Option<String>,
}

impl RemoteError {
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        Self {
            code: code.as_u32(),
            message: message.into(),
            leader_hint: None,
        }
    }

    pub fn code(&self) -> ErrorCode {
        ErrorCode::from_u32(self.code)
    }
}

impl fmt::Display for RemoteError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.code(), self.message)?;
        if let Some(h) = &self.leader_hint {
            write!(f, " (leader hint {h})")?;
        }
        Ok(())
    }
}

/// Messenger-level ops served by every process.
pub mod sys {
    use super::*;

    /// Liveness and identity probe.
    #[derive(Debug)]
    pub struct Ping;

    #[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
    pub struct PingRequest {}

    #[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
    pub struct PingResponse {
        /// The responder's name (role and id, e.g. `data-3`).
        pub name: String,
        /// The responder's build version.
        pub version: String,
    }

    impl Rpc for Ping {
        const OP: Op = Op(0x0001);
        const NAME: &'static str = "ping";
        type Request = PingRequest;
        type Response = PingResponse;
    }

    /// Returns the request's data segment unchanged (benchmarks and health checks).
    #[derive(Debug)]
    pub struct Echo;

    #[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
    pub struct EchoRequest {}

    #[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
    pub struct EchoResponse {}

    impl Rpc for Echo {
        const OP: Op = Op(0x0002);
        const NAME: &'static str = "echo";
        type Request = EchoRequest;
        type Response = EchoResponse;
    }

    /// The messenger's state: workers, live connections, the balancer's moves (`nacre node info`).
    #[derive(Debug)]
    pub struct MsgrInfo;

    #[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
    pub struct MsgrInfoRequest {}

    #[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
    pub struct MsgrInfoResponse {
        pub name: String,
        /// The balancer's policy (`off`, `busy`, `bytes`, `frames`).
        pub balance: String,
        pub dual: bool,
        /// Connections moved between workers since the process started.
        pub migrations: u64,
        pub workers: Vec<WorkerInfo>,
        pub connections: Vec<ConnectionInfo>,
    }

    #[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
    pub struct WorkerInfo {
        pub index: u32,
        pub connections: u64,
        pub bytes: u64,
        pub frames: u64,
        /// Time spent running since the process started.
        pub busy_ms: u64,
    }

    #[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
    pub struct ConnectionInfo {
        pub id: u64,
        /// `client` (opened by the node) or `server` (accepted).
        pub side: String,
        pub peer: String,
        pub worker: u32,
        pub busy_ms: u64,
        pub bytes: u64,
        pub frames: u64,
        pub migrations: u64,
    }

    /// Opens every connection of a bundle (one-way; the receiving messenger handles it itself).
    #[derive(Debug)]
    pub struct BundleJoinOp;

    #[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
    pub struct BundleJoin {
        /// The bundle's id, chosen at random by its sender.
        pub bundle: u64,
        /// The sender waits for no call below this sequence number: the receiver may move past
        /// any it has not seen.
        pub low: u64,
        /// A call the sender gave up (0: none): the receiver does not wait for it.
        pub skip: u64,
    }

    impl Rpc for BundleJoinOp {
        const OP: Op = Op(0x0004);
        const NAME: &'static str = "bundle_join";
        type Request = BundleJoin;
        type Response = ();
    }

    impl Rpc for MsgrInfo {
        const OP: Op = Op(0x0003);
        const NAME: &'static str = "msgr_info";
        type Request = MsgrInfoRequest;
        type Response = MsgrInfoResponse;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn remote_error_round_trips_and_keeps_unknown_codes() {
        let mut e = RemoteError::new(ErrorCode::NotLeader, "not leader");
        e.leader_hint = Some("127.0.0.1:9000".into());
        let back: RemoteError = decode_body("error", &encode_body(&e)).unwrap();
        assert_eq!(back, e);
        assert_eq!(back.code(), ErrorCode::NotLeader);
        let odd = RemoteError {
            code: 999,
            message: String::new(),
            leader_hint: None,
        };
        assert_eq!(odd.code(), ErrorCode::Unknown(999));
    }

    #[test]
    fn garbage_body_is_a_decode_error() {
        let r: Result<RemoteError, _> = decode_body("error", &[0xff, 0xff, 0xff, 0xff, 0xff, 0xff]);
        assert!(r.is_err());
    }
}

/// Raft traffic between nodes.
pub mod raft {
    use super::*;

    /// All Raft messages from one node to another since the last flush, in one frame (one-way).
    /// An empty batch is the node-level keepalive that tells a peer this node is up.
    #[derive(Debug)]
    pub struct RaftBatchRpc;

    #[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
    pub struct RaftBatch {
        /// The sending node.
        pub from: u64,
        pub msgs: Vec<RaftEnvelope>,
    }

    /// One raft-rs message (protobuf-encoded `eraftpb::Message`) for one group.
    #[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
    pub struct RaftEnvelope {
        pub group: u64,
        pub msg: Bytes,
    }

    impl Rpc for RaftBatchRpc {
        const OP: Op = Op(0x0401);
        const NAME: &'static str = "raft_batch";
        type Request = RaftBatch;
        type Response = ();
    }
}
