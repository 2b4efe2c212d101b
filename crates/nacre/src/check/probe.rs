//! Fail-over probes: one write at a time to each target (the master's map, a directory on each
//! meta partition, an extent on each data partition) while faults run, timing how long each target
//! stays unwritable.

use super::*;

/// What the probes write to: the master's map, a directory on each meta partition, an extent on
/// each data partition.
#[derive(Clone, Debug)]
pub(super) enum Target {
    Master,
    Meta(PartitionId, Ino),
    Data(PartitionId, ExtentId),
}

impl std::fmt::Display for Target {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Master => write!(f, "master"),
            Self::Meta(p, _) => write!(f, "meta partition {p}"),
            Self::Data(p, _) => write!(f, "data partition {p}"),
        }
    }
}

/// Writes to one target at a time, for fail-over times.
#[derive(Clone)]
pub(super) struct Prober {
    pub(super) mc: MasterClient,
    pub(super) vol: Arc<NetVolume>,
    pub(super) fs: Arc<NetFs>,
    pub(super) n: Arc<std::sync::atomic::AtomicU64>,
}

/// How long a probe keeps trying before it reports no fail-over at all.
pub(super) const PROBE_LIMIT: Duration = Duration::from_secs(60);

impl Prober {
    pub(super) async fn once(&self, t: &Target) -> bool {
        let n = self.n.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        match t {
            Target::Master => self
                .mc
                .execute(&MapCommand::CreateTenant {
                    name: format!("probe-{}-{n}", std::process::id()),
                    access_key: format!("PROBE{}X{n}", std::process::id()),
                    secret_key: "0123456789abcdef".into(),
                })
                .await
                .is_ok(),
            Target::Meta(_, ino) => {
                let set = SetAttr {
                    mode: Some(0o755 | (n as u32 & 0o20)),
                    ..SetAttr::default()
                };
                self.fs.setattr(*ino, set).await.is_ok()
            }
            Target::Data(p, e) => {
                let data = bytes::Bytes::from(vec![(n & 0xFF) as u8; 4096]);
                self.vol.overwrite(*p, *e, 0, data).await.is_ok()
            }
        }
    }

    /// Starts a fail-over probe of each target in `led` (the partitions a node that just failed
    /// led), timed from `t0`.
    pub(super) fn spawn_probes(
        &self,
        probes: &mut tokio::task::JoinSet<Failover>,
        led: Vec<Target>,
        kind: &'static str,
        node: &str,
        t0: Instant,
    ) {
        for t in led {
            let (p, node) = (self.clone(), node.to_string());
            probes.spawn(async move {
                let ms = p
                    .failover(t.clone(), t0)
                    .await
                    .map(|d| d.as_millis() as u64);
                Failover {
                    kind,
                    node,
                    target: t.to_string(),
                    ms,
                }
            });
        }
    }

    /// Starts a write every 100 ms (each may take long while leaders change) until one succeeds;
    /// the time from `since` to that success.
    pub(super) async fn failover(&self, t: Target, since: Instant) -> Option<Duration> {
        let mut set = tokio::task::JoinSet::new();
        let mut tick = tokio::time::interval(Duration::from_millis(100));
        loop {
            tokio::select! {
                _ = tick.tick() => {
                    if since.elapsed() > PROBE_LIMIT {
                        return None;
                    }
                    let (p, t) = (self.clone(), t.clone());
                    set.spawn(async move {
                        tokio::time::timeout(Duration::from_secs(10), p.once(&t)).await == Ok(true)
                    });
                }
                Some(Ok(true)) = set.join_next(), if !set.is_empty() => {
                    return Some(since.elapsed());
                }
            }
        }
    }
}

/// Probe targets: one directory per meta partition (directories under the root are spread over
/// the partitions) and one 4 KiB extent per data partition.
pub(super) async fn probe_targets(fs: &NetFs, vol: &NetVolume) -> anyhow::Result<Vec<Target>> {
    let mut targets = vec![Target::Master];
    let metas: Vec<PartitionId> = fs
        .meta()
        .transport()
        .partitions()
        .iter()
        .map(|p| p.id)
        .collect();
    let mut covered = Vec::new();
    for j in 0..metas.len() * 4 {
        if covered.len() == metas.len() {
            break;
        }
        let name = format!("probe-{j}");
        let attr = fs
            .mkdir(
                nacre_api::meta::ROOT_INO,
                name.as_bytes(),
                0o755,
                Default::default(),
            )
            .await
            .map_err(|e| anyhow::anyhow!("cannot make {name}: {e}"))?
            .attr;
        let p = fs.meta().partition_of(attr.ino)?;
        if !covered.contains(&p) {
            covered.push(p);
            targets.push(Target::Meta(p, attr.ino));
        }
    }
    // An erasure-coded partition's replicas each lead a group of their own: there is no
    // leader to fail over.
    for p in vol.data_partitions().iter().filter(|p| p.ec.is_none()) {
        let e = vol.create_extent(p.id).await?;
        vol.append(p.id, e, 0, bytes::Bytes::from(vec![0u8; 4096]))
            .await?;
        targets.push(Target::Data(p.id, e));
    }
    Ok(targets)
}

/// The targets node `addr` leads, by the master's view.
pub(super) async fn led_by(mc: &MasterClient, addr: &str, targets: &[Target]) -> Vec<Target> {
    let (Ok(map), Ok(v)) = (mc.cluster_map().await, mc.volume(VOLUME).await) else {
        return Vec::new();
    };
    let Some(id) = map
        .nodes
        .iter()
        .find(|(_, n)| n.addr == addr)
        .map(|(id, _)| *id)
    else {
        return Vec::new();
    };
    let led: Vec<PartitionId> = v
        .meta_partitions
        .iter()
        .chain(&v.data_partitions)
        .filter(|p| p.leader == Some(id))
        .map(|p| p.spec.id)
        .collect();
    targets
        .iter()
        .filter(|t| match t {
            Target::Master => false,
            Target::Meta(p, _) | Target::Data(p, _) => led.contains(p),
        })
        .cloned()
        .collect()
}

/// The node index of the master leader.
pub(super) async fn master_leader(mc: &MasterClient, h: &Harness) -> Option<usize> {
    let st = mc.status().await.ok()?;
    let addr = st.masters.get(&st.leader)?;
    h.nodes.iter().position(|n| &n.addr == addr)
}
