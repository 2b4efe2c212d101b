//! The cluster map: a pure state machine replicated by the master's Raft group.
//!
//! Every change is a [`Command`] applied in log order on every master; the map never reads a clock or
//! makes a random choice, so all masters compute the same map. Times come inside commands (the leader
//! stamps them), placement is a pure function of the map, and every change bumps the epoch that clients
//! use to notice a stale view.

use std::collections::BTreeMap;

pub use nacre_api::master::{
    ClusterSpace, FIRST_INODE, FULL_PPM, FuncInstance, FuncLoad, FuncView, MapError, OPEN_END,
    PartitionKind, PartitionReport, PartitionSpec, PartitionStatus, PartitionView, Replica, Role,
    Volume, VolumeFuncs, VolumeView,
};
pub use nacre_func::{EcSpec, Function};
use nacre_types::{NodeId, PartitionId, VolumeId};
use serde::{Deserialize, Serialize};

use crate::placement::{Candidate, place};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum NodeStatus {
    Up,
    /// Silent past the heartbeat timeout; its partitions are read-only.
    Down,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Node {
    pub id: NodeId,
    pub addr: String,
    pub role: Role,
    pub zone: String,
    /// Memory (meta) or disk (data) capacity in bytes.
    pub capacity: u64,
    pub used: u64,
    pub last_heartbeat_ms: u64,
    pub status: NodeStatus,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MetaPartition {
    pub id: PartitionId,
    pub volume: VolumeId,
    /// Inode range `[start, end)`; `end == OPEN_END` for the last partition.
    pub start: u64,
    pub end: u64,
    pub replicas: Vec<NodeId>,
    pub leader: Option<NodeId>,
    pub status: PartitionStatus,
    pub inode_count: u64,
    pub max_inode: u64,
    /// Memory the leader reports for the partition, in bytes.
    pub memory: u64,
    /// Operations per second the leader reports.
    pub ops_per_s: u64,
    /// Replicas whose node reported hosting the partition; the others still have to create it.
    pub ready: Vec<NodeId>,
    /// Map epoch at which the partition was created.
    pub created_epoch: u64,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DataPartition {
    pub id: PartitionId,
    pub volume: VolumeId,
    pub replicas: Vec<NodeId>,
    pub leader: Option<NodeId>,
    pub status: PartitionStatus,
    pub used: u64,
    /// The leader reported the partition full: it stays read-only even with every replica up.
    pub full: bool,
    /// Operations and bytes written per second, as its leader reports them.
    pub ops_per_s: u64,
    pub bytes_per_s: u64,
    pub ready: Vec<NodeId>,
    pub created_epoch: u64,
}

/// What a function server offers and its latest load; the server itself is a node of role
/// [`Role::Func`] in [`ClusterMap::nodes`] (address, zone, liveness).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct FuncService {
    pub functions: Vec<Function>,
    /// Calls it admits at once.
    pub capacity: u32,
    pub load: FuncLoad,
}

/// A tenant: owns volumes and signs requests with its access key.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Tenant {
    pub name: String,
    pub access_key: String,
    pub secret_key: String,
}

/// A change to the map.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Command {
    RegisterNode {
        addr: String,
        role: Role,
        zone: String,
        capacity: u64,
        now_ms: u64,
    },
    /// A node's periodic report: usage and the partitions it hosts.
    Heartbeat {
        node: NodeId,
        used: u64,
        now_ms: u64,
        partitions: Vec<PartitionReport>,
    },
    /// Marks nodes silent for longer than `timeout_ms` down (and their partitions RO), and nodes
    /// heard from again up.
    CheckLiveness {
        now_ms: u64,
        timeout_ms: u64,
    },
    CreateVolume {
        name: String,
        owner: String,
        replicas: u8,
        capacity: u64,
        meta_partitions: u32,
        data_partitions: u32,
        /// Inodes per initial meta partition (all but the last, which is open-ended).
        inode_step: u64,
        funcs: VolumeFuncs,
    },
    DeleteVolume {
        name: String,
    },
    AddDataPartitions {
        volume: String,
        count: u32,
    },
    /// Closes the volume's last meta partition at `max_inode + step` and opens `[end, ∞)` on newly
    /// placed nodes.
    SplitMetaPartition {
        volume: String,
        step: u64,
    },
    CreateTenant {
        name: String,
        access_key: String,
        secret_key: String,
    },
    DeleteTenant {
        name: String,
    },
    // Appended below the commands above: variants are numbered in order in the Raft log.
    /// A function server registers (or registers again, keeping its id): a node of role
    /// [`Role::Func`] and what it offers.
    RegisterFunc {
        addr: String,
        zone: String,
        functions: Vec<Function>,
        capacity: u32,
        now_ms: u64,
    },
    /// A function server's periodic report: liveness and load.
    FuncHeartbeat {
        node: NodeId,
        load: FuncLoad,
        now_ms: u64,
    },
    /// Moves replica `old` (a node that is down) of an erasure-coded data partition to `new`, an
    /// up data node not hosting it, which rebuilds its shards from the other replicas.
    ReplaceReplica {
        partition: PartitionId,
        old: NodeId,
        new: NodeId,
    },
}

/// What a command produced.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Outcome {
    Done,
    NodeRegistered(NodeId),
    VolumeCreated(VolumeId),
    PartitionsCreated(Vec<PartitionId>),
    /// Answer to a heartbeat: every partition the node should host.
    Assigned {
        /// The map's epoch once the heartbeat was applied.
        epoch: u64,
        partitions: Vec<PartitionSpec>,
    },
}

/// The cluster map.
///
/// Serialized as the master's Raft snapshot and in `GetMap` answers. Fields are only ever
/// appended: the last ones may be missing from bytes written by a master built before them. With
/// no `funcs` the decoder starts with none (function servers register again at their next
/// heartbeat); with no `volume_funcs` every volume stores its data as written, as it did then.
/// `volume_funcs` is written without the erasure code (as it was before codes existed), each
/// volume's code in the `volume_ec` field after it; with none, no volume is erasure-coded.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ClusterMap {
    /// Bumped by every change.
    pub epoch: u64,
    pub nodes: BTreeMap<NodeId, Node>,
    pub volumes: BTreeMap<String, Volume>,
    pub meta_partitions: BTreeMap<PartitionId, MetaPartition>,
    pub data_partitions: BTreeMap<PartitionId, DataPartition>,
    pub tenants: BTreeMap<String, Tenant>,
    next_node: u64,
    next_volume: u64,
    next_partition: u64,
    /// What each function server (a node of role [`Role::Func`]) offers, and its load.
    pub funcs: BTreeMap<NodeId, FuncService>,
    /// The storage functions of each volume that has any, by volume name.
    pub volume_funcs: BTreeMap<String, VolumeFuncs>,
}

impl<'de> Deserialize<'de> for ClusterMap {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Fields;
        impl<'de> serde::de::Visitor<'de> for Fields {
            type Value = ClusterMap;

            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a cluster map")
            }

            fn visit_seq<A: serde::de::SeqAccess<'de>>(
                self,
                mut seq: A,
            ) -> Result<Self::Value, A::Error> {
                let missing = |i| serde::de::Error::invalid_length(i, &"at least 9 fields");
                let mut map = ClusterMap {
                    epoch: seq.next_element()?.ok_or_else(|| missing(0))?,
                    nodes: seq.next_element()?.ok_or_else(|| missing(1))?,
                    volumes: seq.next_element()?.ok_or_else(|| missing(2))?,
                    meta_partitions: seq.next_element()?.ok_or_else(|| missing(3))?,
                    data_partitions: seq.next_element()?.ok_or_else(|| missing(4))?,
                    tenants: seq.next_element()?.ok_or_else(|| missing(5))?,
                    next_node: seq.next_element()?.ok_or_else(|| missing(6))?,
                    next_volume: seq.next_element()?.ok_or_else(|| missing(7))?,
                    next_partition: seq.next_element()?.ok_or_else(|| missing(8))?,
                    // The bytes end here when a master built before function servers wrote
                    // them: postcard reports the end of its input as an error.
                    funcs: seq.next_element().ok().flatten().unwrap_or_default(),
                    volume_funcs: BTreeMap::new(),
                };
                let funcs: BTreeMap<String, FuncsV1> =
                    seq.next_element().ok().flatten().unwrap_or_default();
                let mut ec: BTreeMap<String, EcSpec> =
                    seq.next_element().ok().flatten().unwrap_or_default();
                map.volume_funcs = funcs
                    .into_iter()
                    .map(|(name, f)| {
                        let ec = ec.remove(&name);
                        (name, f.with_ec(ec))
                    })
                    .collect();
                Ok(map)
            }
        }
        const FIELDS: &[&str] = &[
            "epoch",
            "nodes",
            "volumes",
            "meta_partitions",
            "data_partitions",
            "tenants",
            "next_node",
            "next_volume",
            "next_partition",
            "funcs",
            "volume_funcs",
            "volume_ec",
        ];
        d.deserialize_struct("ClusterMap", FIELDS, Fields)
    }
}

impl Serialize for ClusterMap {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeStruct;
        let funcs: BTreeMap<&String, FuncsV1> = self
            .volume_funcs
            .iter()
            .map(|(n, f)| (n, FuncsV1::from(f)))
            .collect();
        let ec: BTreeMap<&String, EcSpec> = self
            .volume_funcs
            .iter()
            .filter_map(|(n, f)| Some((n, f.ec?)))
            .collect();
        let mut st = s.serialize_struct("ClusterMap", 12)?;
        st.serialize_field("epoch", &self.epoch)?;
        st.serialize_field("nodes", &self.nodes)?;
        st.serialize_field("volumes", &self.volumes)?;
        st.serialize_field("meta_partitions", &self.meta_partitions)?;
        st.serialize_field("data_partitions", &self.data_partitions)?;
        st.serialize_field("tenants", &self.tenants)?;
        st.serialize_field("next_node", &self.next_node)?;
        st.serialize_field("next_volume", &self.next_volume)?;
        st.serialize_field("next_partition", &self.next_partition)?;
        st.serialize_field("funcs", &self.funcs)?;
        st.serialize_field("volume_funcs", &funcs)?;
        st.serialize_field("volume_ec", &ec)?;
        st.end()
    }
}

/// [`VolumeFuncs`] as the map's `volume_funcs` field keeps it: without the erasure code.
#[derive(Serialize, Deserialize)]
struct FuncsV1 {
    compress: Option<nacre_api::master::Compression>,
    at: nacre_api::master::FuncAt,
    fallback_inline: bool,
}

impl From<&VolumeFuncs> for FuncsV1 {
    fn from(f: &VolumeFuncs) -> Self {
        FuncsV1 {
            compress: f.compress,
            at: f.at,
            fallback_inline: f.fallback_inline,
        }
    }
}

impl FuncsV1 {
    fn with_ec(self, ec: Option<EcSpec>) -> VolumeFuncs {
        VolumeFuncs {
            compress: self.compress,
            at: self.at,
            fallback_inline: self.fallback_inline,
            ec,
        }
    }
}

fn valid_name(name: &str) -> bool {
    let b = name.as_bytes();
    !b.is_empty()
        && b.len() <= 63
        && b[0].is_ascii_lowercase()
        && b.iter()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'-')
}

impl ClusterMap {
    /// Applies a command. A failed command changes nothing (not even the epoch). The epoch counts
    /// changes of the map's shape (nodes, statuses, volumes, partitions, leaders); a heartbeat that only
    /// refreshes usage figures, or a liveness check that finds everyone as they were, leaves it alone,
    /// so clients' cached views stay current.
    pub fn apply(&mut self, cmd: &Command) -> Result<Outcome, MapError> {
        match cmd {
            // Validated before any change, so they apply in place: the frequent heartbeat does not
            // copy the map.
            Command::Heartbeat {
                node,
                used,
                now_ms,
                partitions,
            } => {
                if !self.nodes.contains_key(node) {
                    return Err(MapError::UnknownNode(*node));
                }
                if self.heartbeat(*node, *used, *now_ms, partitions) {
                    self.epoch += 1;
                }
                Ok(Outcome::Assigned {
                    epoch: self.epoch,
                    partitions: self.assigned(*node),
                })
            }
            Command::CheckLiveness { now_ms, timeout_ms } => {
                if self.check_liveness(*now_ms, *timeout_ms) {
                    self.epoch += 1;
                }
                Ok(Outcome::Done)
            }
            // Load and liveness only: never changes the map's shape.
            Command::FuncHeartbeat { node, load, now_ms } => {
                self.func_heartbeat(*node, *load, *now_ms)?;
                Ok(Outcome::Done)
            }
            _ => {
                // Multi-step commands (placing many partitions) may fail half way: work on a copy.
                let mut next = self.clone();
                let out = next.apply_in_place(cmd)?;
                next.epoch += 1;
                *self = next;
                Ok(out)
            }
        }
    }

    /// Marks nodes silent for longer than `timeout_ms` down and the others up; returns whether any
    /// status changed.
    fn check_liveness(&mut self, now_ms: u64, timeout_ms: u64) -> bool {
        let mut changed = false;
        for n in self.nodes.values_mut() {
            let silent = now_ms.saturating_sub(n.last_heartbeat_ms) > timeout_ms;
            let status = if silent {
                NodeStatus::Down
            } else {
                NodeStatus::Up
            };
            changed |= n.status != status;
            n.status = status;
        }
        if changed {
            self.refresh_partition_status();
        }
        changed
    }

    /// Applies a heartbeat; returns whether the map's shape changed.
    fn heartbeat(
        &mut self,
        node: NodeId,
        used: u64,
        now_ms: u64,
        reports: &[PartitionReport],
    ) -> bool {
        let mut changed = false;
        let coded = self.coded_volumes();
        if let Some(n) = self.nodes.get_mut(&node) {
            n.used = used;
            n.last_heartbeat_ms = now_ms.max(n.last_heartbeat_ms);
        }
        for r in reports {
            if let Some(p) = self.meta_partitions.get_mut(&r.id) {
                if !p.replicas.contains(&node) {
                    continue;
                }
                if !p.ready.contains(&node) {
                    p.ready.push(node);
                    changed = true;
                }
                if r.leader {
                    changed |= p.leader != Some(node);
                    p.leader = Some(node);
                    p.inode_count = r.inode_count;
                    p.max_inode = r.max_inode;
                    p.memory = r.used;
                    p.ops_per_s = r.ops_per_s;
                }
            } else if let Some(p) = self.data_partitions.get_mut(&r.id) {
                if !p.replicas.contains(&node) {
                    continue;
                }
                if !p.ready.contains(&node) {
                    p.ready.push(node);
                    changed = true;
                }
                // Every replica of an erasure-coded partition leads a group of its own; replica
                // 0 stands for the partition (it places the stripes). Another replica that is
                // full refuses its shards, and writers move on to another partition.
                if coded.contains(&p.volume) && p.replicas.first() != Some(&node) {
                    continue;
                }
                if r.leader {
                    changed |= p.leader != Some(node) || p.full != r.full;
                    p.leader = Some(node);
                    p.used = r.used;
                    p.full = r.full;
                    p.ops_per_s = r.ops_per_s;
                    p.bytes_per_s = r.bytes_per_s;
                }
            }
        }
        if changed {
            self.refresh_partition_status();
        }
        changed
    }

    /// Records a function server's load and heartbeat time; `UnknownNode` when `node` is not a
    /// registered function server (it registers again).
    fn func_heartbeat(
        &mut self,
        node: NodeId,
        load: FuncLoad,
        now_ms: u64,
    ) -> Result<(), MapError> {
        let (Some(n), Some(f)) = (self.nodes.get_mut(&node), self.funcs.get_mut(&node)) else {
            return Err(MapError::UnknownNode(node));
        };
        n.last_heartbeat_ms = now_ms.max(n.last_heartbeat_ms);
        f.load = load;
        Ok(())
    }

    /// Registers a node, or refreshes the one registered from the same address with the same
    /// role: it keeps its id and is up again.
    fn register(
        &mut self,
        addr: &str,
        role: Role,
        zone: &str,
        capacity: u64,
        now_ms: u64,
    ) -> NodeId {
        if let Some(n) = self
            .nodes
            .values_mut()
            .find(|n| n.addr == addr && n.role == role)
        {
            n.zone = zone.to_string();
            n.capacity = capacity;
            n.last_heartbeat_ms = now_ms;
            n.status = NodeStatus::Up;
            let id = n.id;
            // A node back from the dead: its partitions are writable again now, not at the next
            // change that happens to refresh the statuses.
            self.refresh_partition_status();
            return id;
        }
        self.next_node += 1;
        let id = NodeId(self.next_node);
        self.nodes.insert(
            id,
            Node {
                id,
                addr: addr.to_string(),
                role,
                zone: zone.to_string(),
                capacity,
                used: 0,
                last_heartbeat_ms: now_ms,
                status: NodeStatus::Up,
            },
        );
        id
    }

    fn apply_in_place(&mut self, cmd: &Command) -> Result<Outcome, MapError> {
        match cmd {
            Command::RegisterNode {
                addr,
                role,
                zone,
                capacity,
                now_ms,
            } => {
                if *role == Role::Func {
                    return Err(MapError::Invalid(
                        "function servers register with RegisterFunc".into(),
                    ));
                }
                Ok(Outcome::NodeRegistered(
                    self.register(addr, *role, zone, *capacity, *now_ms),
                ))
            }
            Command::RegisterFunc {
                addr,
                zone,
                functions,
                capacity,
                now_ms,
            } => {
                if addr.is_empty() || functions.is_empty() || *capacity == 0 {
                    return Err(MapError::Invalid(
                        "a function server needs an address, at least one function and a \
                         capacity of at least 1"
                            .into(),
                    ));
                }
                let id = self.register(addr, Role::Func, zone, 0, *now_ms);
                let mut functions = functions.clone();
                functions.sort_unstable();
                functions.dedup();
                let load = self.funcs.get(&id).map(|f| f.load).unwrap_or_default();
                self.funcs.insert(
                    id,
                    FuncService {
                        functions,
                        capacity: *capacity,
                        load,
                    },
                );
                Ok(Outcome::NodeRegistered(id))
            }
            Command::FuncHeartbeat { node, load, now_ms } => {
                self.func_heartbeat(*node, *load, *now_ms)?;
                Ok(Outcome::Done)
            }
            Command::ReplaceReplica {
                partition,
                old,
                new,
            } => {
                let p = self
                    .data_partitions
                    .get(partition)
                    .ok_or(MapError::UnknownPartition(*partition))?;
                if self.ec_of(&self.volume_name(p.volume)).is_none() {
                    return Err(MapError::Invalid(format!(
                        "{partition} is replicated: only a replica of an erasure-coded \
                         partition can move"
                    )));
                }
                let Some(i) = p.replicas.iter().position(|n| n == old) else {
                    return Err(MapError::Invalid(format!(
                        "{old} holds no replica of {partition}"
                    )));
                };
                let is = |n: &NodeId, status| {
                    self.nodes
                        .get(n)
                        .is_some_and(|n| n.role == Role::Data && n.status == status)
                };
                if !is(old, NodeStatus::Down) {
                    return Err(MapError::Invalid(format!(
                        "{old} is not down: its replica of {partition} stays"
                    )));
                }
                if !is(new, NodeStatus::Up) || p.replicas.contains(new) {
                    return Err(MapError::Invalid(format!(
                        "{new} is not an up data node without a replica of {partition}"
                    )));
                }
                let epoch = self.epoch + 1;
                if let Some(p) = self.data_partitions.get_mut(partition) {
                    p.replicas[i] = *new;
                    p.ready.retain(|n| n != old);
                    if p.leader == Some(*old) {
                        p.leader = None;
                    }
                    // The new replica is created at this epoch: a node's older answers never
                    // drop it.
                    p.created_epoch = epoch;
                }
                self.refresh_partition_status();
                Ok(Outcome::Done)
            }
            Command::Heartbeat {
                node,
                used,
                now_ms,
                partitions,
            } => {
                if !self.nodes.contains_key(node) {
                    return Err(MapError::UnknownNode(*node));
                }
                self.heartbeat(*node, *used, *now_ms, partitions);
                // Only reached through the copy-and-bump path: the epoch it will have.
                Ok(Outcome::Assigned {
                    epoch: self.epoch + 1,
                    partitions: self.assigned(*node),
                })
            }
            Command::CheckLiveness { now_ms, timeout_ms } => {
                self.check_liveness(*now_ms, *timeout_ms);
                Ok(Outcome::Done)
            }
            Command::CreateVolume {
                name,
                owner,
                replicas,
                capacity,
                meta_partitions,
                data_partitions,
                inode_step,
                funcs,
            } => {
                if !valid_name(name) {
                    return Err(MapError::InvalidName(name.clone()));
                }
                if self.volumes.contains_key(name) {
                    return Err(MapError::VolumeExists(name.clone()));
                }
                if !self.tenants.contains_key(owner) {
                    return Err(MapError::NoSuchTenant(owner.clone()));
                }
                if *replicas == 0 || *meta_partitions == 0 || *inode_step == 0 {
                    return Err(MapError::Invalid(
                        "replicas, meta partitions and inode step must be at least 1".into(),
                    ));
                }
                if let Some(c) = &funcs.compress {
                    c.validate().map_err(MapError::Invalid)?;
                }
                if let Some(ec) = funcs.ec {
                    nacre_api::master::parse_ec(&format!("{}+{}", ec.k, ec.m))
                        .map_err(MapError::Invalid)?;
                }
                self.next_volume += 1;
                let vid = VolumeId(self.next_volume);
                let mut vol = Volume {
                    id: vid,
                    name: name.clone(),
                    owner: owner.clone(),
                    replicas: *replicas,
                    capacity: *capacity,
                    meta_partitions: Vec::new(),
                    data_partitions: Vec::new(),
                };
                let mut start = FIRST_INODE;
                for i in 0..*meta_partitions {
                    let end = if i + 1 == *meta_partitions {
                        OPEN_END
                    } else {
                        start + inode_step
                    };
                    let id = self.new_meta_partition(vid, start, end, *replicas)?;
                    vol.meta_partitions.push(id);
                    start = end;
                }
                // An erasure-coded volume's data partitions hold a shard per replica.
                let data_replicas = funcs.ec.map_or(*replicas, |ec| ec.k + ec.m);
                for _ in 0..*data_partitions {
                    let id = self.new_data_partition(vid, data_replicas, funcs.ec.is_some())?;
                    vol.data_partitions.push(id);
                }
                self.volumes.insert(name.clone(), vol);
                if *funcs != VolumeFuncs::default() {
                    self.volume_funcs.insert(name.clone(), *funcs);
                }
                Ok(Outcome::VolumeCreated(vid))
            }
            Command::DeleteVolume { name } => {
                let vol = self
                    .volumes
                    .remove(name)
                    .ok_or_else(|| MapError::NoSuchVolume(name.clone()))?;
                self.volume_funcs.remove(name);
                for p in &vol.meta_partitions {
                    self.meta_partitions.remove(p);
                }
                for p in &vol.data_partitions {
                    self.data_partitions.remove(p);
                }
                Ok(Outcome::Done)
            }
            Command::AddDataPartitions { volume, count } => {
                let (vid, replicas) = self.volume_ref(volume)?;
                let ec = self.ec_of(volume);
                let replicas = ec.map_or(replicas, |ec| ec.k + ec.m);
                let mut ids = Vec::new();
                for _ in 0..*count {
                    ids.push(self.new_data_partition(vid, replicas, ec.is_some())?);
                }
                if let Some(v) = self.volumes.get_mut(volume) {
                    v.data_partitions.extend(&ids);
                }
                Ok(Outcome::PartitionsCreated(ids))
            }
            Command::SplitMetaPartition { volume, step } => {
                let (vid, replicas) = self.volume_ref(volume)?;
                let last = *self
                    .volumes
                    .get(volume)
                    .and_then(|v| v.meta_partitions.last())
                    .ok_or_else(|| {
                        MapError::Invalid(format!("volume {volume} has no meta partition"))
                    })?;
                let mp = self
                    .meta_partitions
                    .get(&last)
                    .ok_or(MapError::UnknownPartition(last))?;
                let end = mp.max_inode.max(mp.start).saturating_add((*step).max(1));
                if end == OPEN_END {
                    return Err(MapError::Invalid("inode space exhausted".into()));
                }
                let id = self.new_meta_partition(vid, end, OPEN_END, replicas)?;
                if let Some(mp) = self.meta_partitions.get_mut(&last) {
                    mp.end = end;
                }
                if let Some(v) = self.volumes.get_mut(volume) {
                    v.meta_partitions.push(id);
                }
                Ok(Outcome::PartitionsCreated(vec![id]))
            }
            Command::CreateTenant {
                name,
                access_key,
                secret_key,
            } => {
                if !valid_name(name) {
                    return Err(MapError::InvalidTenant(name.clone()));
                }
                if self.tenants.contains_key(name) {
                    return Err(MapError::TenantExists(name.clone()));
                }
                if access_key.is_empty()
                    || secret_key.len() < 16
                    || self.tenants.values().any(|t| t.access_key == *access_key)
                {
                    return Err(MapError::Invalid(
                        "a tenant needs a unique access key and a secret of at least 16 bytes"
                            .into(),
                    ));
                }
                self.tenants.insert(
                    name.clone(),
                    Tenant {
                        name: name.clone(),
                        access_key: access_key.clone(),
                        secret_key: secret_key.clone(),
                    },
                );
                Ok(Outcome::Done)
            }
            Command::DeleteTenant { name } => {
                if !self.tenants.contains_key(name) {
                    return Err(MapError::NoSuchTenant(name.clone()));
                }
                let owned: Vec<&str> = self
                    .volumes
                    .values()
                    .filter(|v| v.owner == *name)
                    .map(|v| v.name.as_str())
                    .collect();
                if !owned.is_empty() {
                    return Err(MapError::TenantInUse(name.clone(), owned.join(", ")));
                }
                self.tenants.remove(name);
                Ok(Outcome::Done)
            }
        }
    }

    fn volume_ref(&self, name: &str) -> Result<(VolumeId, u8), MapError> {
        self.volumes
            .get(name)
            .map(|v| (v.id, v.replicas))
            .ok_or_else(|| MapError::NoSuchVolume(name.to_string()))
    }

    /// Up nodes of `role` as placement candidates, with the partitions they already host.
    fn candidates(&self, role: Role) -> Vec<Candidate> {
        let mut hosted: BTreeMap<NodeId, u64> = BTreeMap::new();
        let replicas = match role {
            Role::Meta => self
                .meta_partitions
                .values()
                .flat_map(|p| p.replicas.iter())
                .copied()
                .collect::<Vec<_>>(),
            Role::Data => self
                .data_partitions
                .values()
                .flat_map(|p| p.replicas.iter())
                .copied()
                .collect(),
            Role::Master | Role::Func => Vec::new(),
        };
        for r in replicas {
            *hosted.entry(r).or_default() += 1;
        }
        let used_ppm = |n: &Node| {
            if n.capacity == 0 {
                1_000_000
            } else {
                (u128::from(n.used) * 1_000_000 / u128::from(n.capacity)) as u64
            }
        };
        self.nodes
            .values()
            .filter(|n| n.role == role && n.status == NodeStatus::Up)
            // A full data node would refuse the new partition's appends: it would be born
            // read-only. (A node of unknown capacity is not known to be full.)
            .filter(|n| role != Role::Data || n.capacity == 0 || used_ppm(n) < FULL_PPM)
            .map(|n| Candidate {
                id: n.id,
                zone: n.zone.clone(),
                used_ppm: used_ppm(n),
                partitions: hosted.get(&n.id).copied().unwrap_or(0),
            })
            .collect()
    }

    /// Places `replicas` replicas of a new partition of `role` and allocates its id.
    fn place_new(
        &mut self,
        role: Role,
        replicas: u8,
    ) -> Result<(PartitionId, Vec<NodeId>), MapError> {
        let nodes = place(&self.candidates(role), usize::from(replicas))
            .map_err(|source| MapError::Placement { role, source })?;
        self.next_partition += 1;
        Ok((PartitionId(self.next_partition), nodes))
    }

    fn new_meta_partition(
        &mut self,
        volume: VolumeId,
        start: u64,
        end: u64,
        replicas: u8,
    ) -> Result<PartitionId, MapError> {
        let (id, nodes) = self.place_new(Role::Meta, replicas)?;
        self.meta_partitions.insert(
            id,
            MetaPartition {
                id,
                volume,
                start,
                end,
                replicas: nodes,
                leader: None,
                status: PartitionStatus::Rw,
                inode_count: 0,
                max_inode: 0,
                memory: 0,
                ops_per_s: 0,
                ready: Vec::new(),
                created_epoch: self.epoch + 1,
            },
        );
        Ok(id)
    }

    fn new_data_partition(
        &mut self,
        volume: VolumeId,
        replicas: u8,
        coded: bool,
    ) -> Result<PartitionId, MapError> {
        let (id, mut nodes) = self.place_new(Role::Data, replicas)?;
        if coded && !nodes.is_empty() {
            // Replica 0 places every stripe of an erasure-coded partition: the partitions of a
            // volume take turns among their nodes for it (placement lists the emptiest first).
            let n = nodes.len();
            nodes.rotate_left((id.0 % n as u64) as usize);
        }
        self.data_partitions.insert(
            id,
            DataPartition {
                id,
                volume,
                replicas: nodes,
                leader: None,
                // An erasure-coded partition is writable once every replica reported it.
                status: if coded {
                    PartitionStatus::Ro
                } else {
                    PartitionStatus::Rw
                },
                used: 0,
                full: false,
                ops_per_s: 0,
                bytes_per_s: 0,
                ready: Vec::new(),
                created_epoch: self.epoch + 1,
            },
        );
        Ok(id)
    }

    /// A partition is RW exactly when all its replicas are up; an erasure-coded one also needs
    /// every replica to have reported it (a moved replica reports once it has rebuilt its
    /// shards).
    fn refresh_partition_status(&mut self) {
        let coded = self.coded_volumes();
        let nodes = &self.nodes;
        let status = |replicas: &[NodeId], full: bool| {
            let up = |r: &NodeId| nodes.get(r).is_some_and(|n| n.status == NodeStatus::Up);
            if !full && replicas.iter().all(up) {
                PartitionStatus::Rw
            } else {
                PartitionStatus::Ro
            }
        };
        for p in self.meta_partitions.values_mut() {
            p.status = status(&p.replicas, false);
        }
        for p in self.data_partitions.values_mut() {
            let unready =
                coded.contains(&p.volume) && p.replicas.iter().any(|r| !p.ready.contains(r));
            p.status = status(&p.replicas, p.full || unready);
        }
    }

    /// The moves of erasure-coded partitions' replicas off data nodes down for at least
    /// `after_ms` (silent since their last heartbeat), each to the up data node (heard from
    /// within the last `silence_ms`, not full) hosting fewest partitions among those without a
    /// replica of the partition, in a zone the partition does not use yet when there is one.
    pub fn rebuild_plan(&self, now_ms: u64, after_ms: u64, silence_ms: u64) -> Vec<Command> {
        let gone = |n: &NodeId| {
            self.nodes.get(n).is_some_and(|n| {
                n.status == NodeStatus::Down
                    && now_ms.saturating_sub(n.last_heartbeat_ms) >= after_ms
            })
        };
        let mut hosted: BTreeMap<NodeId, usize> = BTreeMap::new();
        let candidates: Vec<Candidate> = self
            .candidates(Role::Data)
            .into_iter()
            .filter(|c| {
                self.nodes
                    .get(&c.id)
                    .is_some_and(|n| now_ms.saturating_sub(n.last_heartbeat_ms) <= silence_ms)
            })
            .collect();
        for c in &candidates {
            hosted.insert(c.id, c.partitions as usize);
        }
        let mut cmds = Vec::new();
        for p in self.data_partitions.values() {
            if self.ec_of(&self.volume_name(p.volume)).is_none() {
                continue;
            }
            let mut replicas = p.replicas.clone();
            for old in p.replicas.iter().filter(|n| gone(n)) {
                let zones: Vec<&str> = replicas
                    .iter()
                    .filter_map(|r| self.nodes.get(r))
                    .map(|n| n.zone.as_str())
                    .collect();
                let Some(new) = candidates
                    .iter()
                    .filter(|c| !replicas.contains(&c.id))
                    .min_by_key(|c| {
                        (
                            zones.contains(&c.zone.as_str()),
                            hosted.get(&c.id).copied().unwrap_or(0),
                            c.used_ppm,
                            c.id,
                        )
                    })
                    .map(|c| c.id)
                else {
                    continue;
                };
                *hosted.entry(new).or_default() += 1;
                if let Some(r) = replicas.iter_mut().find(|r| *r == old) {
                    *r = new;
                }
                cmds.push(Command::ReplaceReplica {
                    partition: p.id,
                    old: *old,
                    new,
                });
            }
        }
        cmds
    }

    fn replicas(&self, ids: &[NodeId]) -> Vec<Replica> {
        ids.iter()
            .map(|id| Replica {
                node: *id,
                addr: self
                    .nodes
                    .get(id)
                    .map(|n| n.addr.clone())
                    .unwrap_or_default(),
            })
            .collect()
    }

    fn volume_name(&self, id: VolumeId) -> String {
        self.volumes
            .values()
            .find(|v| v.id == id)
            .map(|v| v.name.clone())
            .unwrap_or_default()
    }

    /// The spec of a meta or data partition, if it exists.
    pub fn spec(&self, id: PartitionId) -> Option<PartitionSpec> {
        if let Some(p) = self.meta_partitions.get(&id) {
            return Some(PartitionSpec {
                id,
                volume: self.volume_name(p.volume),
                kind: PartitionKind::Meta {
                    start: p.start,
                    end: p.end,
                },
                replicas: self.replicas(&p.replicas),
                created_epoch: p.created_epoch,
            });
        }
        self.data_partitions.get(&id).map(|p| {
            let volume = self.volume_name(p.volume);
            let kind = match self.ec_of(&volume) {
                Some(ec) => PartitionKind::Shards { k: ec.k, m: ec.m },
                None => PartitionKind::Data,
            };
            PartitionSpec {
                id,
                volume,
                kind,
                replicas: self.replicas(&p.replicas),
                created_epoch: p.created_epoch,
            }
        })
    }

    /// Data partitions of volume `name` that take writes, or will once created: a new
    /// erasure-coded partition is read-only until every replica reported it, and counts as
    /// writable meanwhile while its nodes are up (else the duty keeping writable partitions
    /// would add more every round).
    pub fn writable_data_partitions(&self, name: &str) -> u32 {
        let Some(v) = self.volumes.get(name) else {
            return 0;
        };
        let up = |n: &NodeId| {
            self.nodes
                .get(n)
                .is_some_and(|n| n.status == NodeStatus::Up)
        };
        v.data_partitions
            .iter()
            .filter_map(|p| self.data_partitions.get(p))
            .filter(|p| {
                p.status == PartitionStatus::Rw
                    || (!p.full && p.ready.len() < p.replicas.len() && p.replicas.iter().all(up))
            })
            .count() as u32
    }

    /// The volumes whose data is erasure-coded.
    fn coded_volumes(&self) -> Vec<VolumeId> {
        self.volumes
            .values()
            .filter(|v| self.ec_of(&v.name).is_some())
            .map(|v| v.id)
            .collect()
    }

    /// The erasure code of volume `name`, if its data is erasure-coded.
    pub fn ec_of(&self, name: &str) -> Option<EcSpec> {
        self.volume_funcs.get(name).and_then(|f| f.ec)
    }

    /// Every partition `node` should host.
    pub fn assigned(&self, node: NodeId) -> Vec<PartitionSpec> {
        let meta = self
            .meta_partitions
            .values()
            .filter(|p| p.replicas.contains(&node))
            .map(|p| p.id);
        let data = self
            .data_partitions
            .values()
            .filter(|p| p.replicas.contains(&node))
            .map(|p| p.id);
        meta.chain(data).filter_map(|id| self.spec(id)).collect()
    }

    /// Replicas that have not yet reported hosting their partition: (partition, node).
    pub fn pending_replicas(&self) -> Vec<(PartitionId, NodeId)> {
        let pending = |id: PartitionId, replicas: &[NodeId], ready: &[NodeId]| {
            replicas
                .iter()
                .filter(|r| !ready.contains(r))
                .map(|r| (id, *r))
                .collect::<Vec<_>>()
        };
        let meta =
            (self.meta_partitions.values()).flat_map(|p| pending(p.id, &p.replicas, &p.ready));
        let data =
            (self.data_partitions.values()).flat_map(|p| pending(p.id, &p.replicas, &p.ready));
        meta.chain(data).collect()
    }

    /// The client's view of a volume.
    /// Capacity and used bytes summed over the data nodes.
    pub fn data_space(&self) -> ClusterSpace {
        self.nodes.values().filter(|n| n.role == Role::Data).fold(
            ClusterSpace::default(),
            |s, n| ClusterSpace {
                capacity: s.capacity + n.capacity,
                used: s.used + n.used,
            },
        )
    }

    pub fn volume_view(&self, name: &str) -> Result<VolumeView, MapError> {
        let volume = self
            .volumes
            .get(name)
            .ok_or_else(|| MapError::NoSuchVolume(name.to_string()))?;
        let view = |id: &PartitionId| {
            let spec = self.spec(*id)?;
            let (leader, status) = match self.meta_partitions.get(id) {
                Some(p) => (p.leader, p.status),
                None => {
                    let p = self.data_partitions.get(id)?;
                    (p.leader, p.status)
                }
            };
            Some(PartitionView {
                spec,
                leader,
                status,
            })
        };
        Ok(VolumeView {
            epoch: self.epoch,
            volume: volume.clone(),
            meta_partitions: volume.meta_partitions.iter().filter_map(view).collect(),
            data_partitions: volume.data_partitions.iter().filter_map(view).collect(),
            funcs: self.volume_funcs.get(name).copied().unwrap_or_default(),
        })
    }

    /// The function servers that are up, for callers.
    pub fn func_view(&self) -> FuncView {
        FuncView {
            epoch: self.epoch,
            instances: self
                .func_instances()
                .filter(|(n, _)| n.status == NodeStatus::Up)
                .map(|(_, i)| i)
                .collect(),
        }
    }

    /// Every registered function server, up or down, in node id order.
    pub fn func_instances(&self) -> impl Iterator<Item = (&Node, FuncInstance)> {
        self.funcs.iter().filter_map(|(id, f)| {
            let n = self.nodes.get(id)?;
            Some((
                n,
                FuncInstance {
                    node: *id,
                    addr: n.addr.clone(),
                    zone: n.zone.clone(),
                    functions: f.functions.clone(),
                    capacity: f.capacity,
                    load: f.load,
                },
            ))
        })
    }

    /// The map as bytes, for a Raft snapshot.
    pub fn snapshot(&self) -> Vec<u8> {
        // Plain structs, vectors and ordered maps always serialize; failing here is a bug.
        postcard::to_allocvec(self).expect("the cluster map is postcard-serializable")
    }

    /// Restores a map from [`ClusterMap::snapshot`] bytes.
    pub fn restore(bytes: &[u8]) -> Result<Self, MapError> {
        postcard::from_bytes(bytes).map_err(|e| MapError::Invalid(format!("bad map snapshot: {e}")))
    }
}
