//! The master's messages: what nodes, clients and admins send to the master (`0x010x`), and what
//! the master sends to nodes (`0x011x`).

use std::collections::BTreeMap;

use nacre_proto::Op;
use nacre_proto::msg::Rpc;
use nacre_types::{NodeId, PartitionId};
use serde::{Deserialize, Serialize};

use crate::map::{
    ClusterMap, Command, MapError, Outcome, PartitionReport, PartitionSpec, Role, VolumeView,
};

/// Executes an admin command on the master leader (op `0x0101`).
#[derive(Debug)]
pub struct Execute;

impl Rpc for Execute {
    const OP: Op = Op(0x0101);
    const NAME: &'static str = "master_execute";
    type Request = Command;
    type Response = Result<Outcome, MapError>;
}

/// Reads the whole cluster map from the master leader (op `0x0102`).
#[derive(Debug)]
pub struct GetMap;

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct GetMapRequest {}

impl Rpc for GetMap {
    const OP: Op = Op(0x0102);
    const NAME: &'static str = "master_get_map";
    type Request = GetMapRequest;
    type Response = ClusterMap;
}

/// A client's view of one volume (op `0x0103`).
#[derive(Debug)]
pub struct GetVolume;

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct GetVolumeRequest {
    pub name: String,
}

impl Rpc for GetVolume {
    const OP: Op = Op(0x0103);
    const NAME: &'static str = "master_get_volume";
    type Request = GetVolumeRequest;
    type Response = Result<VolumeView, MapError>;
}

/// A node announces itself (op `0x0104`); the answer is its id (kept across restarts at the same
/// address).
#[derive(Debug)]
pub struct Register;

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct RegisterRequest {
    pub addr: String,
    pub role: Role,
    pub zone: String,
    pub capacity: u64,
}

impl Rpc for Register {
    const OP: Op = Op(0x0104);
    const NAME: &'static str = "master_register";
    type Request = RegisterRequest;
    type Response = Result<NodeId, MapError>;
}

/// A node's periodic report (op `0x0105`); the answer lists every partition it should host.
#[derive(Debug)]
pub struct Heartbeat;

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct HeartbeatRequest {
    pub node: NodeId,
    pub used: u64,
    pub partitions: Vec<PartitionReport>,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct HeartbeatReply {
    /// Map epoch the assignment was computed at.
    pub epoch: u64,
    pub assigned: Vec<PartitionSpec>,
}

impl Rpc for Heartbeat {
    const OP: Op = Op(0x0105);
    const NAME: &'static str = "master_heartbeat";
    type Request = HeartbeatRequest;
    type Response = Result<HeartbeatReply, MapError>;
}

/// The master leader's own state (op `0x0106`): who leads, and the work it has not finished.
#[derive(Debug)]
pub struct Status;

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct StatusRequest {}

/// A partition replica the leader asked a node to create and that has not reported it yet.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PendingReplica {
    pub partition: PartitionId,
    pub node: NodeId,
    pub addr: String,
    pub attempts: u32,
    /// Why the last attempt failed; empty while the node has accepted and not yet reported.
    pub last_error: String,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct MasterStatus {
    /// Raft id of the leader answering.
    pub leader: u64,
    /// Every master: raft id → messenger address.
    pub masters: BTreeMap<u64, String>,
    pub pending: Vec<PendingReplica>,
    /// Background duties that failed in their last run (e.g. no room for new data partitions).
    pub duty_errors: Vec<String>,
}

impl Rpc for Status {
    const OP: Op = Op(0x0106);
    const NAME: &'static str = "master_status";
    type Request = StatusRequest;
    type Response = MasterStatus;
}

/// The master asks a node to host (or update) a partition replica (op `0x0110`). Idempotent.
#[derive(Debug)]
pub struct CreatePartition;

impl Rpc for CreatePartition {
    const OP: Op = Op(0x0110);
    const NAME: &'static str = "node_create_partition";
    type Request = PartitionSpec;
    /// `Err` carries the node's reason (e.g. out of disk).
    type Response = Result<(), String>;
}
