//! The master's vocabulary: what nodes and clients send to the master (`0x010x`), what the master
//! sends to nodes (`0x011x`), the client's view of a volume and its partitions, and the function
//! servers' registration and the callers' view of them. The master's own state (the cluster map
//! and its commands) lives in `nacre-master`.

use std::collections::BTreeMap;

use nacre_func::{EcSpec, Function};
use nacre_proto::Op;
use nacre_proto::msg::Rpc;
use nacre_types::{NodeId, PartitionId, VolumeId};
use serde::{Deserialize, Serialize};
use thiserror::Error;

/// First inode number of a volume (1 is the root directory).
pub const FIRST_INODE: u64 = 1;

/// The open end of the last meta partition's inode range.
pub const OPEN_END: u64 = u64::MAX;

/// A data node using at least this share of its disk (parts per million) is full: the master
/// places no new data partitions on it and the node takes no new bytes.
pub const FULL_PPM: u64 = 990_000;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Role {
    Master,
    Meta,
    Data,
    /// A function server (appended last: variants are numbered in order on the wire and in the
    /// master's snapshot).
    Func,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum PartitionStatus {
    /// Writable.
    Rw,
    /// Read-only: a replica is down (or the partition is full); repaired partitions return to RW.
    Ro,
}

/// What kind of partition a node is asked to host.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum PartitionKind {
    /// A meta partition owning inodes `[start, end)`.
    Meta {
        start: u64,
        end: u64,
    },
    Data,
    /// A data partition of an erasure-coded volume: replica `i` holds shard `i` of every stripe
    /// (`k` data shards, then `m` parity), each replica in a Raft group of its own
    /// (docs/ARCHITECTURE.md, "Erasure-coded volumes"). Appended last: variants are numbered in
    /// order on the wire.
    Shards {
        k: u8,
        m: u8,
    },
}

impl PartitionKind {
    /// Whether this is a data partition, replicated or erasure-coded.
    pub fn is_data(&self) -> bool {
        matches!(self, PartitionKind::Data | PartitionKind::Shards { .. })
    }

    /// The code of an erasure-coded data partition.
    pub fn ec(&self) -> Option<EcSpec> {
        match *self {
            PartitionKind::Shards { k, m } => Some(EcSpec { k, m }),
            _ => None,
        }
    }
}

/// One replica of a partition: the node and where to reach it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Replica {
    pub node: NodeId,
    pub addr: String,
}

/// Everything a node needs to host one replica of a partition.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PartitionSpec {
    pub id: PartitionId,
    pub volume: String,
    pub kind: PartitionKind,
    /// In order; for data partitions replica 0 leads appends.
    pub replicas: Vec<Replica>,
    /// Map epoch at which the partition was created (a node never drops a partition on the word of an
    /// older map).
    pub created_epoch: u64,
}

/// What a node says about one partition it hosts, in every heartbeat.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PartitionReport {
    pub id: PartitionId,
    /// This replica leads the partition.
    pub leader: bool,
    /// Meta partitions: inodes in use and the highest inode allocated.
    pub inode_count: u64,
    pub max_inode: u64,
    /// Bytes: memory for meta partitions, disk for data partitions.
    pub used: u64,
    /// The partition takes no more writes (data partition at its size limit).
    pub full: bool,
    /// Operations served per second on this replica (the leader's figure is the partition's).
    pub ops_per_s: u64,
    /// Bytes written per second through this replica as leader (data partitions).
    pub bytes_per_s: u64,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Volume {
    pub id: VolumeId,
    pub name: String,
    pub owner: String,
    pub replicas: u8,
    pub capacity: u64,
    /// In inode-range order; the last one is open-ended.
    pub meta_partitions: Vec<PartitionId>,
    pub data_partitions: Vec<PartitionId>,
}

/// What a client needs to use a volume: its partitions, where their replicas are, who leads.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct VolumeView {
    /// The map epoch this view was taken at.
    pub epoch: u64,
    pub volume: Volume,
    pub meta_partitions: Vec<PartitionView>,
    pub data_partitions: Vec<PartitionView>,
    /// The storage functions its file data passes through.
    pub funcs: VolumeFuncs,
}

/// The storage functions a volume's file data passes through, and where they run; set when the
/// volume is created.
///
/// `ec` is the last field and may be missing from bytes written before it (a `CreateVolume` in
/// a master's Raft log, where these funcs end the command): it then decodes as `None`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct VolumeFuncs {
    /// Compression of file data in blocks (`None`: stored as written).
    pub compress: Option<Compression>,
    /// Where the clients run the functions.
    pub at: FuncAt,
    /// A service call that finds no function server left runs in the client instead of failing
    /// the write.
    pub fallback_inline: bool,
    /// Erasure coding of file data (`None`: replicated): every data partition holds one shard
    /// of each stripe per replica ([`PartitionKind::Shards`]).
    pub ec: Option<EcSpec>,
}

impl<'de> Deserialize<'de> for VolumeFuncs {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Fields;
        impl<'de> serde::de::Visitor<'de> for Fields {
            type Value = VolumeFuncs;

            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a volume's storage functions")
            }

            fn visit_seq<A: serde::de::SeqAccess<'de>>(
                self,
                mut seq: A,
            ) -> Result<Self::Value, A::Error> {
                let missing = |i| serde::de::Error::invalid_length(i, &"at least 3 fields");
                Ok(VolumeFuncs {
                    compress: seq.next_element()?.ok_or_else(|| missing(0))?,
                    at: seq.next_element()?.ok_or_else(|| missing(1))?,
                    fallback_inline: seq.next_element()?.ok_or_else(|| missing(2))?,
                    // Postcard reports the end of its input as an error.
                    ec: seq
                        .next_element::<Option<EcSpec>>()
                        .ok()
                        .flatten()
                        .flatten(),
                })
            }
        }
        const FIELDS: &[&str] = &["compress", "at", "fallback_inline", "ec"];
        d.deserialize_struct("VolumeFuncs", FIELDS, Fields)
    }
}

/// Parses an erasure code as `K+M` (e.g. `4+2`): `K` data shards and `M` parity shards, at
/// most [`MAX_EC_SHARDS`] in all.
pub fn parse_ec(s: &str) -> Result<EcSpec, String> {
    let bad = || format!("{s:?} is not an erasure code: use K+M, e.g. 4+2");
    let (k, m) = s.split_once('+').ok_or_else(bad)?;
    let (k, m): (u8, u8) = (
        k.trim().parse().map_err(|_| bad())?,
        m.trim().parse().map_err(|_| bad())?,
    );
    if k == 0 || m == 0 || usize::from(k) + usize::from(m) > MAX_EC_SHARDS {
        return Err(format!(
            "erasure code {k}+{m}: K and M must be at least 1 and K+M at most {MAX_EC_SHARDS}"
        ));
    }
    Ok(EcSpec { k, m })
}

/// Most shards a stripe of an erasure-coded volume has: one data node each.
pub const MAX_EC_SHARDS: usize = 32;

/// Where a storage function runs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum FuncAt {
    /// In the process that needs it (the client), on a blocking thread.
    #[default]
    Inline,
    /// On the function servers the master lists.
    Service,
}

impl std::fmt::Display for FuncAt {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            FuncAt::Inline => "inline",
            FuncAt::Service => "service",
        })
    }
}

impl std::str::FromStr for FuncAt {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "inline" => Ok(FuncAt::Inline),
            "service" => Ok(FuncAt::Service),
            _ => Err(format!(
                "{s:?} is not a place to run functions: use inline or service"
            )),
        }
    }
}

/// Block compression of a volume's file data: each block of `block` bytes (aligned in the file)
/// is stored as one frame, compressed with `codec`, or raw when that saves too little.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Compression {
    pub codec: nacre_func::Codec,
    pub block: u32,
}

impl Compression {
    /// The default block: large enough for the codecs to find repeats, small enough that a
    /// frame fits one packet with its header.
    pub const BLOCK: u32 = 64 << 10;
    /// The smallest block a volume may use.
    pub const MIN_BLOCK: u32 = 4 << 10;

    /// Checks the block size (a power of two from 4 KiB to [`Self::BLOCK`]) and the codec's
    /// parameters.
    pub fn validate(&self) -> Result<(), String> {
        if !self.block.is_power_of_two() || !(Self::MIN_BLOCK..=Self::BLOCK).contains(&self.block) {
            return Err(format!(
                "compression block {} is not a power of two from {} to {}",
                self.block,
                Self::MIN_BLOCK,
                Self::BLOCK
            ));
        }
        match self.codec {
            nacre_func::Codec::Zstd { level } if !(-7..=22).contains(&level) => {
                Err(format!("zstd level {level} is outside -7..=22"))
            }
            nacre_func::Codec::None => Err("compression needs a codec (zstd or lz4)".into()),
            _ => Ok(()),
        }
    }
}

impl std::fmt::Display for Compression {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.codec {
            nacre_func::Codec::Zstd { level } => write!(f, "zstd:{level}")?,
            nacre_func::Codec::Lz4 => f.write_str("lz4")?,
            nacre_func::Codec::None => f.write_str("none")?,
        }
        write!(f, " in {} KiB blocks", self.block >> 10)
    }
}

impl std::str::FromStr for Compression {
    type Err = String;

    /// `zstd`, `zstd:LEVEL` (default level 1) or `lz4`, in blocks of [`Self::BLOCK`].
    fn from_str(s: &str) -> Result<Self, String> {
        let codec = match s.split_once(':') {
            None if s == "lz4" => nacre_func::Codec::Lz4,
            None if s == "zstd" => nacre_func::Codec::Zstd { level: 1 },
            Some(("zstd", level)) => nacre_func::Codec::Zstd {
                level: level
                    .parse()
                    .map_err(|_| format!("zstd level {level:?} is not a number"))?,
            },
            _ => return Err(format!("{s:?} is not a codec: use zstd, zstd:LEVEL or lz4")),
        };
        let c = Compression {
            codec,
            block: Self::BLOCK,
        };
        c.validate()?;
        Ok(c)
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PartitionView {
    pub spec: PartitionSpec,
    pub leader: Option<NodeId>,
    pub status: PartitionStatus,
}

#[derive(Debug, Error, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum MapError {
    #[error(
        "invalid volume name {0:?}: use 1-63 characters from a-z, 0-9, '-', starting with a letter"
    )]
    InvalidName(String),
    #[error("volume {0:?} already exists")]
    VolumeExists(String),
    #[error("no volume named {0:?}")]
    NoSuchVolume(String),
    #[error("unknown node {0}")]
    UnknownNode(NodeId),
    #[error("unknown partition {0}")]
    UnknownPartition(PartitionId),
    #[error("cannot place {role:?} partition: {source}")]
    Placement { role: Role, source: PlacementError },
    #[error("invalid request: {0}")]
    Invalid(String),
    #[error(
        "invalid tenant name {0:?}: use 1-63 characters from a-z, 0-9, '-', starting with a letter"
    )]
    InvalidTenant(String),
    #[error("tenant {0:?} already exists")]
    TenantExists(String),
    #[error("no tenant named {0:?} (create it with `nacre tenant create`)")]
    NoSuchTenant(String),
    #[error("tenant {0:?} still owns volumes: {1}")]
    TenantInUse(String, String),
}

/// Why replicas cannot be placed.
#[derive(Debug, Error, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum PlacementError {
    #[error("need {needed} nodes for {needed} replicas, only {available} are up")]
    NotEnoughNodes { needed: usize, available: usize },
}

/// Why a master request failed.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum MasterError {
    #[error(transparent)]
    Map(#[from] MapError),
    /// This master is not the leader; `leader` is the leader's address if known.
    #[error("not the master leader (leader: {})", leader.as_deref().unwrap_or("unknown"))]
    NotLeader { leader: Option<String> },
    #[error("master unavailable: {0}")]
    Unavailable(String),
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

/// The data nodes' capacity and used bytes, summed over every data node (op `0x0107`): what a
/// client's `statfs` reports, divided by the replica count.
#[derive(Debug)]
pub struct GetSpace;

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct GetSpaceRequest {}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClusterSpace {
    /// Bytes of disk on every data node.
    pub capacity: u64,
    /// Bytes used on them.
    pub used: u64,
}

impl Rpc for GetSpace {
    const OP: Op = Op(0x0107);
    const NAME: &'static str = "master_get_space";
    type Request = GetSpaceRequest;
    type Response = ClusterSpace;
}

/// A data node reports the figures of its last garbage-collection sweeps (op `0x0108`): the
/// master leader keeps the latest per partition in memory (not in the map) for `nacre vol info`.
#[derive(Debug)]
pub struct ReportGc;

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct ReportGcRequest {
    pub reports: Vec<crate::data::SweepReport>,
}

impl Rpc for ReportGc {
    const OP: Op = Op(0x0108);
    const NAME: &'static str = "master_report_gc";
    type Request = ReportGcRequest;
    type Response = ();
}

/// The latest sweep figures the master leader holds, per data partition (op `0x0109`).
#[derive(Debug)]
pub struct GetGc;

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct GetGcRequest {}

impl Rpc for GetGc {
    const OP: Op = Op(0x0109);
    const NAME: &'static str = "master_get_gc";
    type Request = GetGcRequest;
    type Response = Vec<crate::data::SweepReport>;
}

/// What a function server reports about its work in every heartbeat.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct FuncLoad {
    /// Calls admitted and not yet answered (running or waiting for a worker).
    pub outstanding: u32,
    /// Calls answered per second since the previous heartbeat.
    pub calls_per_s: u64,
    /// Input bytes per second since the previous heartbeat.
    pub bytes_per_s: u64,
}

/// A function server announces itself (op `0x010a`); the answer is its node id, kept across
/// restarts at the same address. Registering again replaces the functions and capacity.
#[derive(Debug)]
pub struct RegisterFunc;

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RegisterFuncRequest {
    pub addr: String,
    pub zone: String,
    /// The functions it serves.
    pub functions: Vec<Function>,
    /// Calls it admits at once; beyond them it answers `Unavailable`.
    pub capacity: u32,
}

impl Rpc for RegisterFunc {
    const OP: Op = Op(0x010a);
    const NAME: &'static str = "master_register_func";
    type Request = RegisterFuncRequest;
    type Response = Result<NodeId, MapError>;
}

/// A function server's periodic report (op `0x010b`). `UnknownNode` tells the server to register
/// again.
#[derive(Debug)]
pub struct FuncHeartbeat;

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FuncHeartbeatRequest {
    pub node: NodeId,
    pub load: FuncLoad,
}

impl Rpc for FuncHeartbeat {
    const OP: Op = Op(0x010b);
    const NAME: &'static str = "master_func_heartbeat";
    type Request = FuncHeartbeatRequest;
    type Response = Result<(), MapError>;
}

/// The function servers a caller may use (op `0x010c`): every instance the map has up.
#[derive(Debug)]
pub struct GetFuncs;

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct GetFuncsRequest {}

/// The function servers that are up, at a map epoch (an instance registering or changing status
/// bumps it; load figures do not).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct FuncView {
    pub epoch: u64,
    /// In node id order.
    pub instances: Vec<FuncInstance>,
}

/// One function server as callers and `nacre func ls` see it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FuncInstance {
    pub node: NodeId,
    pub addr: String,
    pub zone: String,
    pub functions: Vec<Function>,
    /// Calls it admits at once.
    pub capacity: u32,
    /// As of its last heartbeat.
    pub load: FuncLoad,
}

impl Rpc for GetFuncs {
    const OP: Op = Op(0x010c);
    const NAME: &'static str = "master_get_funcs";
    type Request = GetFuncsRequest;
    type Response = FuncView;
}
