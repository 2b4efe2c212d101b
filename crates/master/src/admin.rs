//! The admin API: what `nacre cluster|node|vol|partition|tenant` and the HTTP/JSON API show and do.
//!
//! Both front ends call these functions and print (or serve) the same serializable answers, so the
//! CLI's `--json` output and the HTTP API agree field for field.

use nacre_types::{NodeId, PartitionId, VolumeId};
use serde::{Deserialize, Serialize};

use nacre_api::master::{MapError, MasterError, OPEN_END, PartitionStatus, PendingReplica, Role};
use nacre_client::MasterClient;

use crate::map::{ClusterMap, Command, NodeStatus, Outcome, Tenant};
use crate::rpc::MasterAdmin;
use crate::service::Master;

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct MasterInfo {
    pub id: u64,
    pub addr: String,
    pub leader: bool,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ClusterStatus {
    pub epoch: u64,
    pub masters: Vec<MasterInfo>,
    pub nodes_up: usize,
    pub nodes_down: usize,
    pub volumes: usize,
    pub meta_partitions: usize,
    pub data_partitions: usize,
    pub data_partitions_rw: usize,
    /// Replicas placed on nodes that have not reported them yet, with the last error.
    pub pending: Vec<PendingReplica>,
    pub duty_errors: Vec<String>,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct NodeInfo {
    pub id: NodeId,
    pub addr: String,
    pub role: Role,
    pub zone: String,
    pub status: NodeStatus,
    pub capacity: u64,
    pub used: u64,
    pub partitions: usize,
    /// Milliseconds since the last heartbeat, by the leader's clock.
    pub last_heartbeat_ms_ago: u64,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct VolumeInfo {
    pub id: VolumeId,
    pub name: String,
    pub owner: String,
    pub replicas: u8,
    /// Bytes; 0 means unlimited.
    pub capacity: u64,
    pub meta_partitions: usize,
    pub data_partitions: usize,
    pub data_partitions_rw: usize,
    pub inodes: u64,
    pub used: u64,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct PartitionInfo {
    pub id: PartitionId,
    pub volume: String,
    /// `meta` or `data`.
    pub kind: String,
    /// Inode range of a meta partition; `end` is absent for the open-ended last one.
    pub start: Option<u64>,
    pub end: Option<u64>,
    pub replicas: Vec<NodeId>,
    pub leader: Option<NodeId>,
    pub status: PartitionStatus,
    /// Replicas whose node has not reported the partition yet.
    pub pending: Vec<NodeId>,
    pub inodes: u64,
    pub used: u64,
    /// Operations per second its leader reports.
    pub ops_per_s: u64,
    /// Bytes written per second, as its leader reports (data partitions).
    pub bytes_per_s: u64,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct VolumeDetail {
    pub volume: VolumeInfo,
    pub partitions: Vec<PartitionInfo>,
}

/// A request to create a volume; omitted fields take the defaults below.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CreateVolume {
    pub name: String,
    pub owner: String,
    pub replicas: u8,
    pub capacity: u64,
    pub meta_partitions: u32,
    pub data_partitions: u32,
    pub inode_step: u64,
}

impl Default for CreateVolume {
    fn default() -> Self {
        Self {
            name: String::new(),
            owner: "default".into(),
            replicas: 3,
            capacity: 0,
            meta_partitions: 3,
            data_partitions: 10,
            inode_step: 1 << 24,
        }
    }
}

/// A tenant as listed (without its secret).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct TenantInfo {
    pub name: String,
    pub access_key: String,
    pub volumes: Vec<String>,
}

/// The admin operations, over a [`MasterClient`].
#[derive(Clone, Debug)]
pub struct Admin {
    mc: MasterClient,
}

impl Admin {
    pub fn new(mc: MasterClient) -> Self {
        Self { mc }
    }

    pub async fn status(&self) -> Result<ClusterStatus, MasterError> {
        let st = self.mc.status().await?;
        let map = self.mc.cluster_map().await?;
        let up = map
            .nodes
            .values()
            .filter(|n| n.status == NodeStatus::Up)
            .count();
        Ok(ClusterStatus {
            epoch: map.epoch,
            masters: st
                .masters
                .iter()
                .map(|(id, addr)| MasterInfo {
                    id: *id,
                    addr: addr.clone(),
                    leader: *id == st.leader,
                })
                .collect(),
            nodes_up: up,
            nodes_down: map.nodes.len() - up,
            volumes: map.volumes.len(),
            meta_partitions: map.meta_partitions.len(),
            data_partitions: map.data_partitions.len(),
            data_partitions_rw: map
                .data_partitions
                .values()
                .filter(|p| p.status == PartitionStatus::Rw)
                .count(),
            pending: st.pending,
            duty_errors: st.duty_errors,
        })
    }

    pub async fn nodes(&self) -> Result<Vec<NodeInfo>, MasterError> {
        let map = self.mc.cluster_map().await?;
        let now = Master::now_ms();
        Ok(map
            .nodes
            .values()
            .map(|n| NodeInfo {
                id: n.id,
                addr: n.addr.clone(),
                role: n.role,
                zone: n.zone.clone(),
                status: n.status,
                capacity: n.capacity,
                used: n.used,
                partitions: map.assigned(n.id).len(),
                last_heartbeat_ms_ago: now.saturating_sub(n.last_heartbeat_ms),
            })
            .collect())
    }

    pub async fn volumes(&self) -> Result<Vec<VolumeInfo>, MasterError> {
        let map = self.mc.cluster_map().await?;
        Ok(map
            .volumes
            .keys()
            .filter_map(|name| volume_info(&map, name))
            .collect())
    }

    pub async fn volume(&self, name: &str) -> Result<VolumeDetail, MasterError> {
        let map = self.mc.cluster_map().await?;
        let volume =
            volume_info(&map, name).ok_or_else(|| MapError::NoSuchVolume(name.to_string()))?;
        Ok(VolumeDetail {
            volume,
            partitions: partitions(&map, Some(name)),
        })
    }

    pub async fn create_volume(&self, req: &CreateVolume) -> Result<VolumeInfo, MasterError> {
        self.mc
            .execute(&Command::CreateVolume {
                name: req.name.clone(),
                owner: req.owner.clone(),
                replicas: req.replicas,
                capacity: req.capacity,
                meta_partitions: req.meta_partitions,
                data_partitions: req.data_partitions,
                inode_step: req.inode_step,
            })
            .await?;
        let map = self.mc.cluster_map().await?;
        volume_info(&map, &req.name)
            .ok_or_else(|| MasterError::Map(MapError::NoSuchVolume(req.name.clone())))
    }

    pub async fn delete_volume(&self, name: &str) -> Result<(), MasterError> {
        self.mc
            .execute(&Command::DeleteVolume { name: name.into() })
            .await
            .map(|_| ())
    }

    pub async fn partitions(
        &self,
        volume: Option<&str>,
    ) -> Result<Vec<PartitionInfo>, MasterError> {
        let map = self.mc.cluster_map().await?;
        if let Some(v) = volume
            && !map.volumes.contains_key(v)
        {
            return Err(MapError::NoSuchVolume(v.to_string()).into());
        }
        Ok(partitions(&map, volume))
    }

    pub async fn tenants(&self) -> Result<Vec<TenantInfo>, MasterError> {
        let map = self.mc.cluster_map().await?;
        Ok(map
            .tenants
            .values()
            .map(|t| TenantInfo {
                name: t.name.clone(),
                access_key: t.access_key.clone(),
                volumes: map
                    .volumes
                    .values()
                    .filter(|v| v.owner == t.name)
                    .map(|v| v.name.clone())
                    .collect(),
            })
            .collect())
    }

    /// Creates a tenant with fresh keys; the answer is the only place its secret is shown.
    pub async fn create_tenant(&self, name: &str) -> Result<Tenant, MasterError> {
        let random = |n| {
            crate::service::random_hex(n)
                .map_err(|e| MasterError::Unavailable(format!("no randomness: {e}")))
        };
        let tenant = Tenant {
            name: name.into(),
            access_key: format!("NACRE{}", random(10)?.to_uppercase()),
            secret_key: random(20)?,
        };
        self.mc
            .execute(&Command::CreateTenant {
                name: tenant.name.clone(),
                access_key: tenant.access_key.clone(),
                secret_key: tenant.secret_key.clone(),
            })
            .await?;
        Ok(tenant)
    }

    pub async fn delete_tenant(&self, name: &str) -> Result<(), MasterError> {
        self.mc
            .execute(&Command::DeleteTenant { name: name.into() })
            .await
            .map(|_| ())
    }

    /// Runs any command (for scripts and tests).
    pub async fn execute(&self, cmd: &Command) -> Result<Outcome, MasterError> {
        self.mc.execute(cmd).await
    }
}

fn volume_info(map: &ClusterMap, name: &str) -> Option<VolumeInfo> {
    let v = map.volumes.get(name)?;
    let data = v
        .data_partitions
        .iter()
        .filter_map(|p| map.data_partitions.get(p));
    Some(VolumeInfo {
        id: v.id,
        name: v.name.clone(),
        owner: v.owner.clone(),
        replicas: v.replicas,
        capacity: v.capacity,
        meta_partitions: v.meta_partitions.len(),
        data_partitions: v.data_partitions.len(),
        data_partitions_rw: data
            .clone()
            .filter(|p| p.status == PartitionStatus::Rw)
            .count(),
        inodes: v
            .meta_partitions
            .iter()
            .filter_map(|p| map.meta_partitions.get(p))
            .map(|p| p.inode_count)
            .sum(),
        used: data.map(|p| p.used).sum(),
    })
}

fn partitions(map: &ClusterMap, volume: Option<&str>) -> Vec<PartitionInfo> {
    let name_of = |id: VolumeId| {
        map.volumes
            .values()
            .find(|v| v.id == id)
            .map(|v| v.name.clone())
            .unwrap_or_default()
    };
    let wanted =
        |id: VolumeId| volume.is_none_or(|v| map.volumes.get(v).is_some_and(|v| v.id == id));
    let pending = |replicas: &[NodeId], ready: &[NodeId]| {
        replicas
            .iter()
            .filter(|r| !ready.contains(r))
            .copied()
            .collect::<Vec<_>>()
    };
    let meta = map
        .meta_partitions
        .values()
        .filter(|p| wanted(p.volume))
        .map(|p| PartitionInfo {
            id: p.id,
            volume: name_of(p.volume),
            kind: "meta".into(),
            start: Some(p.start),
            end: (p.end != OPEN_END).then_some(p.end),
            replicas: p.replicas.clone(),
            leader: p.leader,
            status: p.status,
            pending: pending(&p.replicas, &p.ready),
            inodes: p.inode_count,
            used: p.memory,
            ops_per_s: p.ops_per_s,
            bytes_per_s: 0,
        });
    let data = map
        .data_partitions
        .values()
        .filter(|p| wanted(p.volume))
        .map(|p| PartitionInfo {
            id: p.id,
            volume: name_of(p.volume),
            kind: "data".into(),
            start: None,
            end: None,
            replicas: p.replicas.clone(),
            leader: p.leader,
            status: p.status,
            pending: pending(&p.replicas, &p.ready),
            inodes: 0,
            used: p.used,
            ops_per_s: p.ops_per_s,
            bytes_per_s: p.bytes_per_s,
        });
    meta.chain(data).collect()
}
