//! The admin API: what `nacre cluster|node|func|vol|partition|tenant` and the HTTP/JSON API show
//! and do.
//!
//! Both front ends call these functions and print (or serve) the same serializable answers, so the
//! CLI's `--json` output and the HTTP API agree field for field.

use nacre_types::{NodeId, PartitionId, VolumeId};
use serde::{Deserialize, Serialize};

use nacre_api::data::{Sweep, SweepReport, SweepRequest};
use nacre_api::master::{
    Compression, FuncAt, FuncLoad, GetGc, GetGcRequest, MapError, MasterError, OPEN_END,
    PartitionStatus, PendingReplica, Role, VolumeFuncs,
};
use nacre_api::meta::Usage;
use nacre_client::{MasterClient, MetaFs, NetVolume};
use nacre_func::Function;
use nacre_msgr::{CallOptions, Payload};

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

/// A function server as listed.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct FuncInfo {
    pub id: NodeId,
    pub addr: String,
    pub zone: String,
    pub status: NodeStatus,
    pub functions: Vec<Function>,
    /// Calls it admits at once.
    pub capacity: u32,
    /// As of its last heartbeat: calls outstanding, calls/s and input bytes/s.
    pub load: FuncLoad,
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
    /// The storage functions of its file data (`VolumeFuncs`), as text: `-` when none.
    pub functions: String,
    /// Its erasure code, if its file data is erasure-coded.
    pub ec: Option<nacre_func::EcSpec>,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct PartitionInfo {
    pub id: PartitionId,
    pub volume: String,
    /// `meta`, `data`, or `data, ec K+M`.
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
    /// The garbage collector's figures for the volume's data partitions.
    pub gc: VolumeGc,
    /// What its files hold and take (`None` when a meta partition did not answer; then
    /// `usage_error` says why).
    pub usage: Option<Usage>,
    pub usage_error: Option<String>,
}

/// What the last garbage-collection sweep of each of a volume's data partitions found: bytes of
/// normal extents (as the leader holds them) that a meta partition references, and that none
/// does (before the sweep deleted the idle ones among them). Kept by the master leader in memory,
/// so a new leader shows nothing until each partition's next sweep.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct VolumeGc {
    pub referenced_bytes: u64,
    pub unreferenced_bytes: u64,
    /// Of those, freed by the sweeps.
    pub freed_bytes: u64,
    /// Data partitions with no sweep figures yet.
    pub unswept: usize,
    /// The last sweep of each partition that has one.
    pub sweeps: Vec<SweepReport>,
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
    /// Block compression of file data: `zstd`, `zstd:LEVEL` or `lz4` (none when absent).
    pub compress: Option<String>,
    /// Where clients run the volume's functions: `inline` or `service`.
    pub func_at: FuncAt,
    /// With `service`: a write that finds no function server runs the function in the client
    /// instead of failing.
    pub fallback_inline: bool,
    /// Erasure coding of file data, `K+M` (e.g. `4+2`); replicated when absent.
    pub ec: Option<String>,
}

impl CreateVolume {
    /// The volume's functions, as the map records them.
    pub fn funcs(&self) -> Result<VolumeFuncs, MapError> {
        let compress = self
            .compress
            .as_deref()
            .map(str::parse::<Compression>)
            .transpose()
            .map_err(MapError::Invalid)?;
        let ec = self
            .ec
            .as_deref()
            .map(nacre_api::master::parse_ec)
            .transpose()
            .map_err(MapError::Invalid)?;
        Ok(VolumeFuncs {
            compress,
            at: self.func_at,
            fallback_inline: self.fallback_inline,
            ec,
        })
    }
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
            compress: None,
            func_at: FuncAt::Inline,
            fallback_inline: true,
            ec: None,
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

/// How many times [`Admin::sweep`] tries a partition.
pub const SWEEP_ATTEMPTS: u32 = 5;

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

    /// Every registered function server, up or down.
    pub async fn funcs(&self) -> Result<Vec<FuncInfo>, MasterError> {
        let map = self.mc.cluster_map().await?;
        let now = Master::now_ms();
        Ok(map
            .func_instances()
            .map(|(n, f)| FuncInfo {
                id: n.id,
                addr: f.addr,
                zone: f.zone,
                status: n.status,
                functions: f.functions,
                capacity: f.capacity,
                load: f.load,
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
        let sweeps = self.mc.call::<GetGc>(&GetGcRequest {}).await?;
        let data = map
            .volumes
            .get(name)
            .map(|v| v.data_partitions.clone())
            .unwrap_or_default();
        let (usage, usage_error) = match self.usage(name).await {
            Ok(u) => (Some(u), None),
            Err(e) => (None, Some(e)),
        };
        Ok(VolumeDetail {
            volume,
            partitions: partitions(&map, Some(name)),
            gc: volume_gc(&data, sweeps),
            usage,
            usage_error,
        })
    }

    /// What `volume`'s files hold and take, from each of its meta partitions.
    pub async fn usage(&self, volume: &str) -> Result<Usage, String> {
        let vol = NetVolume::connect(self.mc.client().clone(), self.mc.clone(), volume)
            .await
            .map_err(|e| e.to_string())?;
        MetaFs::new(std::sync::Arc::new(vol))
            .usage()
            .await
            .map_err(|e| e.to_string())
    }

    /// Runs a garbage-collection sweep now, with `grace`, on every data partition of `volume`
    /// (on its leader, `Sweep`). A partition whose leader is unknown, moved, or could not finish
    /// (a meta partition not answering) is tried again with a fresh map, up to
    /// [`SWEEP_ATTEMPTS`] times; then its report carries the last error. A grace below
    /// `MIN_GC_GRACE` is safe only while no client writes to the volume.
    pub async fn sweep(
        &self,
        volume: &str,
        grace: std::time::Duration,
    ) -> Result<Vec<SweepReport>, MasterError> {
        let mut map = self.mc.cluster_map().await?;
        let ids = map
            .volumes
            .get(volume)
            .ok_or_else(|| MapError::NoSuchVolume(volume.to_string()))?
            .data_partitions
            .clone();
        let mut out = Vec::new();
        for id in ids {
            let mut attempt = 1;
            loop {
                let last = match self.sweep_one(&map, id, grace).await {
                    Ok(reports) if reports.iter().all(|r| r.error.is_none()) => {
                        out.extend(reports);
                        break;
                    }
                    Ok(reports) => reports
                        .into_iter()
                        .find(|r| r.error.is_some())
                        .and_then(|r| r.error)
                        .unwrap_or_default(),
                    Err(e) => e,
                };
                if attempt >= SWEEP_ATTEMPTS {
                    out.push(SweepReport {
                        partition: id,
                        error: Some(last),
                        ..SweepReport::default()
                    });
                    break;
                }
                attempt += 1;
                tokio::time::sleep(std::time::Duration::from_millis(500)).await;
                map = self.mc.cluster_map().await?;
            }
        }
        Ok(out)
    }

    /// One `Sweep` of partition `id` on the leader `map` names.
    async fn sweep_one(
        &self,
        map: &ClusterMap,
        id: PartitionId,
        grace: std::time::Duration,
    ) -> Result<Vec<SweepReport>, String> {
        let addr = map
            .data_partitions
            .get(&id)
            .and_then(|p| p.leader)
            .and_then(|l| map.nodes.get(&l))
            .map(|n| n.addr.clone())
            .ok_or_else(|| "no leader known".to_string())?;
        let req = SweepRequest {
            partition: Some(id),
            grace_ms: u64::try_from(grace.as_millis()).unwrap_or(u64::MAX),
        };
        let opts = CallOptions {
            timeout: Some(std::time::Duration::from_secs(120)),
            ..CallOptions::default()
        };
        match self
            .mc
            .client()
            .call_with::<Sweep>(&addr, &req, Payload::none(), opts)
            .await
        {
            Ok((Ok(reports), _)) if !reports.is_empty() => Ok(reports),
            Ok((Ok(_), _)) => Err(format!("{addr} does not lead it")),
            Ok((Err(e), _)) => Err(format!("{addr}: {e}")),
            Err(e) => Err(format!("{addr}: {e}")),
        }
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
                funcs: req.funcs()?,
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

/// The sweep figures of the data partitions `data` (a volume's), summed.
fn volume_gc(data: &[PartitionId], sweeps: Vec<SweepReport>) -> VolumeGc {
    let sweeps: Vec<SweepReport> = sweeps
        .into_iter()
        .filter(|r| data.contains(&r.partition))
        .collect();
    VolumeGc {
        referenced_bytes: sweeps.iter().map(|r| r.referenced_bytes).sum(),
        unreferenced_bytes: sweeps.iter().map(|r| r.unreferenced_bytes).sum(),
        freed_bytes: sweeps.iter().map(|r| r.freed_bytes).sum(),
        unswept: data.len().saturating_sub(sweeps.len()),
        sweeps,
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
        functions: functions_text(&map.volume_funcs.get(name).copied().unwrap_or_default()),
        ec: map.ec_of(name),
    })
}

/// `zstd:1 in 64 KiB blocks, ec 4+2, service (inline when none is up)`, or `-` for none.
pub fn functions_text(f: &VolumeFuncs) -> String {
    let mut parts: Vec<String> = Vec::new();
    if let Some(c) = &f.compress {
        parts.push(c.to_string());
    }
    if let Some(ec) = &f.ec {
        parts.push(format!("ec {}+{}", ec.k, ec.m));
    }
    if parts.is_empty() {
        return "-".into();
    }
    let at = match f.at {
        FuncAt::Service if f.fallback_inline => "service (inline when none is up)".to_string(),
        at => at.to_string(),
    };
    format!("{}, {at}", parts.join(", "))
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
            kind: match map.ec_of(&name_of(p.volume)) {
                Some(ec) => format!("data, ec {}+{}", ec.k, ec.m),
                None => "data".into(),
            },
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
