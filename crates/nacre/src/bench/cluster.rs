//! A cluster started inside the benchmark process: one master and the asked number of meta and
//! data nodes, each a [`Node`] on its own loopback port with its data in a temporary directory.

use nacre_master::MasterAdmin as _;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use nacre_client::MasterClient;
use nacre_master::map::{Command as MapCommand, VolumeFuncs};

use crate::node::{MasterSection, MsgrSection, Node, NodeConfig, RoleName};

/// A started local cluster.
pub struct LocalCluster {
    nodes: Vec<Node>,
    /// Meta and data nodes (they register with the master).
    registering: usize,
    pub master: String,
    _dir: tempfile::TempDir,
}

impl LocalCluster {
    /// Starts a master, `meta` meta nodes and `data` data nodes.
    pub async fn start(meta: usize, data: usize) -> anyhow::Result<Self> {
        Self::start_with_funcs(meta, data, 0).await
    }

    /// Starts a master, `meta` meta nodes, `data` data nodes and `funcs` function servers.
    pub async fn start_with_funcs(meta: usize, data: usize, funcs: usize) -> anyhow::Result<Self> {
        let one_worker = MsgrSection {
            workers: 1,
            ..MsgrSection::default()
        };
        Self::start_with(meta, data, funcs, &one_worker).await
    }

    /// [`LocalCluster::start_with_funcs`], the data nodes with messenger settings `data_msgr`
    /// (the other nodes have one worker each).
    pub async fn start_with(
        meta: usize,
        data: usize,
        funcs: usize,
        data_msgr: &MsgrSection,
    ) -> anyhow::Result<Self> {
        let dir =
            tempfile::tempdir_in(bench_dir()).context("cannot create a temporary directory")?;
        let master = Node::start(&NodeConfig {
            name: "bench-master".into(),
            role: RoleName::Master,
            listen: "127.0.0.1:0".into(),
            http_listen: String::new(),
            data_dir: dir.path().join("master"),
            master: MasterSection {
                // Data partitions are created with the volume (or not at all without data nodes).
                min_writable_data_partitions: 0,
                ..MasterSection::default()
            },
            ..NodeConfig::default()
        })
        .await?;
        let addr = master.addr.clone();
        let mut nodes = vec![master];
        let roles = std::iter::repeat_n(RoleName::Meta, meta)
            .chain(std::iter::repeat_n(RoleName::Data, data))
            .chain(std::iter::repeat_n(RoleName::Func, funcs));
        for (i, role) in roles.enumerate() {
            let name = format!("bench-{role:?}-{i}").to_lowercase();
            nodes.push(
                Node::start(&NodeConfig {
                    data_dir: dir.path().join(&name),
                    name,
                    role,
                    listen: "127.0.0.1:0".into(),
                    http_listen: String::new(),
                    masters: vec![addr.clone()],
                    heartbeat_ms: 200,
                    msgr: if role == RoleName::Data {
                        data_msgr.clone()
                    } else {
                        MsgrSection {
                            workers: 1,
                            ..MsgrSection::default()
                        }
                    },
                    ..NodeConfig::default()
                })
                .await?,
            );
        }
        Ok(Self {
            nodes,
            registering: meta + data + funcs,
            master: addr,
            _dir: dir,
        })
    }

    /// Waits until every node registered, then creates a tenant and volume `name` (3 replicas) and
    /// waits until all its partitions are ready.
    pub async fn create_volume(
        &self,
        mc: &MasterClient,
        name: &str,
        meta_partitions: u32,
        data_partitions: u32,
    ) -> anyhow::Result<()> {
        self.create_volume_with(
            mc,
            name,
            meta_partitions,
            data_partitions,
            VolumeFuncs::default(),
        )
        .await
    }

    /// [`Self::create_volume`] with the volume's storage functions.
    pub async fn create_volume_with(
        &self,
        mc: &MasterClient,
        name: &str,
        meta_partitions: u32,
        data_partitions: u32,
        funcs: VolumeFuncs,
    ) -> anyhow::Result<()> {
        let deadline = Instant::now() + Duration::from_secs(60);
        while mc.cluster_map().await?.nodes.len() < self.registering {
            anyhow::ensure!(Instant::now() < deadline, "nodes did not register in 60 s");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        // The tenant is made by the first volume; later ones find it.
        if !mc.cluster_map().await?.tenants.contains_key("bench") {
            mc.execute(&MapCommand::CreateTenant {
                name: "bench".into(),
                access_key: "BENCH".into(),
                secret_key: "bench-secret-0123456789".into(),
            })
            .await?;
        }
        mc.execute(&MapCommand::CreateVolume {
            name: name.into(),
            owner: "bench".into(),
            replicas: 3,
            capacity: 0,
            meta_partitions,
            data_partitions,
            inode_step: 1 << 24,
            funcs,
        })
        .await?;
        wait_ready(mc, name).await
    }

    pub async fn stop(self) -> anyhow::Result<()> {
        for n in self.nodes.into_iter().rev() {
            n.stop().await?;
        }
        Ok(())
    }
}

/// Where benchmark clusters keep their data: `NACRE_BENCH_DIR`, else the system's temp directory.
pub fn bench_dir() -> std::path::PathBuf {
    std::env::var_os("NACRE_BENCH_DIR").map_or_else(std::env::temp_dir, Into::into)
}

/// Waits (bounded) until every partition of the volume has all replicas and a leader.
async fn wait_ready(mc: &MasterClient, volume: &str) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let map = mc.cluster_map().await?;
        let ready = map.volumes.get(volume).is_some_and(|v| {
            v.meta_partitions.iter().all(|p| {
                map.meta_partitions
                    .get(p)
                    .is_some_and(|p| p.leader.is_some() && p.ready.len() == p.replicas.len())
            }) && v.data_partitions.iter().all(|p| {
                map.data_partitions
                    .get(p)
                    .is_some_and(|p| p.leader.is_some() && p.ready.len() == p.replicas.len())
            })
        });
        if ready {
            return Ok(());
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "the benchmark volume's partitions did not become ready in 60 s"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
