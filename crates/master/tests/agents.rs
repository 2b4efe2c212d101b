//! Node agents against three masters over the in-memory network: nodes register and heartbeat, the
//! leader has the replicas it places created on them (retrying failures, and saying why in its
//! status), keeps enough writable data partitions, splits full meta partitions, and nodes drop the
//! partitions of deleted volumes.
#![allow(clippy::unwrap_used)] // test helpers outside #[test] fns

mod common;

use nacre_master::MasterAdmin as _;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use common::*;
use nacre_api::master::RegisterRequest;
use nacre_client::MasterClient;
use nacre_cluster::{
    AgentConfig, BoxFuture, HostError, PartitionHost, SpecRegistry, node_router, run_agent,
};
use nacre_master::MasterConfig;
use nacre_master::map::{
    ClusterMap, Command, OPEN_END, PartitionReport, PartitionSpec, PartitionStatus, Role,
};
use nacre_msgr::mem::MemNetwork;
use nacre_msgr::{Messenger, MsgrConfig};
use nacre_types::{NodeId, PartitionId};
use tokio::sync::watch;

/// A registry whose creates can be made to fail and whose reports can claim leadership, fullness
/// and inode counts, as a real meta or data node would.
struct TestHost {
    inner: SpecRegistry,
    id: watch::Receiver<Option<NodeId>>,
    fail: AtomicBool,
    inodes: AtomicU64,
    full: AtomicBool,
    /// Counts refused creates and removals, for waiting on them.
    refused: watch::Sender<u64>,
    removed: watch::Sender<u64>,
}

impl PartitionHost for TestHost {
    fn hosted(&self) -> Vec<PartitionSpec> {
        self.inner.hosted()
    }
    fn reports(&self) -> Vec<PartitionReport> {
        let me = *self.id.borrow();
        self.inner
            .hosted()
            .iter()
            .map(|s| PartitionReport {
                id: s.id,
                leader: Some(s.replicas[0].node) == me,
                inode_count: self.inodes.load(Ordering::Relaxed),
                max_inode: self.inodes.load(Ordering::Relaxed),
                full: self.full.load(Ordering::Relaxed),
                ..PartitionReport::default()
            })
            .collect()
    }
    fn used(&self) -> u64 {
        0
    }
    fn ensure(&self, spec: PartitionSpec) -> BoxFuture<'_, Result<(), HostError>> {
        if self.fail.load(Ordering::Relaxed) {
            self.refused.send_modify(|n| *n += 1);
            let id = spec.id;
            return Box::pin(async move { Err(HostError::partition(id, "disk on fire")) });
        }
        self.inner.ensure(spec)
    }
    fn remove(&self, id: PartitionId) -> BoxFuture<'_, Result<(), HostError>> {
        Box::pin(async move {
            let r = self.inner.remove(id).await;
            self.removed.send_modify(|n| *n += 1);
            r
        })
    }
}

struct NodeProc {
    host: Arc<TestHost>,
    msgr: Messenger,
    stop: watch::Sender<bool>,
}

async fn start_node(net: &MemNetwork, name: &str, role: Role, masters: Vec<String>) -> NodeProc {
    let msgr = Messenger::new(name, MsgrConfig::default(), Arc::new(net.transport(name))).unwrap();
    let listener = msgr.transport().bind(&format!("{name}:0")).await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (id_tx, id_rx) = watch::channel(None);
    let host = Arc::new(TestHost {
        inner: SpecRegistry::in_memory(role),
        id: id_rx,
        fail: AtomicBool::new(false),
        inodes: AtomicU64::new(0),
        full: AtomicBool::new(false),
        refused: watch::channel(0).0,
        removed: watch::channel(0).0,
    });
    let (stop, _) = watch::channel(false);
    let mut rx = stop.subscribe();
    tokio::spawn(
        msgr.serve(listener, Arc::new(node_router(host.clone())), async move {
            let _ = rx.wait_for(|s| *s).await;
        }),
    );
    let mc = MasterClient::new(msgr.client(), masters);
    let config = AgentConfig {
        register: RegisterRequest {
            addr,
            role,
            zone: "z".into(),
            capacity: 1 << 30,
        },
        heartbeat_interval: Duration::from_millis(50),
    };
    let mut rx = stop.subscribe();
    tokio::spawn(run_agent(mc, config, host.clone(), id_tx, async move {
        let _ = rx.wait_for(|s| *s).await;
    }));
    NodeProc { host, msgr, stop }
}

fn hosted_ids(n: &NodeProc) -> Vec<PartitionId> {
    n.host.hosted().iter().map(|s| s.id).collect()
}

fn assigned_ids(map: &ClusterMap, n: &NodeProc) -> Vec<PartitionId> {
    let id = *n.host.id.borrow();
    id.map(|id| map.assigned(id).iter().map(|s| s.id).collect())
        .unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nodes_host_what_the_master_places_and_the_leader_keeps_volumes_healthy() {
    let net = MemNetwork::new(21);
    let config = MasterConfig {
        duty_interval: Duration::from_millis(50),
        node_timeout: Duration::from_secs(5),
        min_writable_data_partitions: 2,
        data_partitions_step: 2,
        meta_split_inodes: 1000,
        meta_split_step: 500,
        max_create_backoff: Duration::from_millis(200),
        ..MasterConfig::default()
    };
    let (mut masters_, addrs) = masters(&net, config).await;
    let (stop_duties, duties_stopped) = watch::channel(false);
    for n in masters_.values() {
        let m = n.master.clone();
        let mut rx = duties_stopped.clone();
        tokio::spawn(async move {
            m.run_duties(async move {
                let _ = rx.wait_for(|s| *s).await;
            })
            .await;
        });
    }
    let mut nodes = Vec::new();
    for i in 0..3 {
        nodes.push(start_node(&net, &format!("meta{i}"), Role::Meta, addrs.clone()).await);
        nodes.push(start_node(&net, &format!("data{i}"), Role::Data, addrs.clone()).await);
    }
    // One data node refuses to create partitions for now.
    let broken = &nodes[1];
    broken.host.fail.store(true, Ordering::Relaxed);

    let (cli, mc) = client(&net, "cli", addrs);
    let mut epochs = masters_[&1].epochs.clone();
    let limit = Duration::from_secs(20);
    let ready = wait_map(&mc, &mut epochs, limit, |m| {
        m.nodes.len() == 6 && m.tenants.contains_key("default")
    })
    .await;
    assert!(ready.is_some(), "nodes registered and default tenant made");

    mc.execute(&Command::CreateVolume {
        name: "vol".into(),
        owner: "default".into(),
        replicas: 3,
        capacity: 1 << 40,
        meta_partitions: 2,
        data_partitions: 0,
        inode_step: 1000,
        funcs: Default::default(),
    })
    .await
    .unwrap();

    // The leader adds data partitions (none were asked for; at least 2 must be writable).
    let map = wait_map(&mc, &mut epochs, limit, |m| {
        m.volumes["vol"].data_partitions.len() >= 2
    })
    .await
    .expect("data partitions added");
    // The broken node's replicas stay pending, and the status says why.
    let broken_id = broken.host.id.borrow().unwrap();
    // Each refusal (from the leader's retries or the node's own reconciliation) is a moment to
    // look at the leader's status again.
    let mut refused = broken.host.refused.subscribe();
    let found = tokio::time::timeout(limit, async {
        loop {
            let st = mc.status().await.unwrap();
            if let Some(p) = st
                .pending
                .iter()
                .find(|p| p.node == broken_id && !p.last_error.is_empty())
            {
                return p.last_error.clone();
            }
            refused.changed().await.unwrap();
        }
    })
    .await
    .expect("the leader reports why a replica is pending");
    assert!(found.contains("disk on fire"), "pending reason: {found:?}");
    assert!(map.pending_replicas().iter().any(|(_, n)| *n == broken_id));

    // Repaired, the node gets its replicas; every node hosts exactly what it is assigned.
    broken.host.fail.store(false, Ordering::Relaxed);
    let map = wait_map(&mc, &mut epochs, limit, |m| m.pending_replicas().is_empty())
        .await
        .expect("all replicas created");
    for n in &nodes {
        let mut want = assigned_ids(&map, n);
        let mut got = hosted_ids(n);
        want.sort();
        got.sort();
        assert_eq!(got, want);
    }
    assert!(mc.status().await.unwrap().pending.is_empty());
    let view = mc.volume("vol").await.unwrap();
    assert!(view.meta_partitions.iter().all(|p| p.leader.is_some()));

    // Full data partitions turn read-only and the leader adds writable ones.
    let before = map.volumes["vol"].data_partitions.clone();
    for n in &nodes {
        n.host.full.store(true, Ordering::Relaxed);
    }
    let map = wait_map(&mc, &mut epochs, limit, |m| {
        before
            .iter()
            .all(|p| m.data_partitions[p].status == PartitionStatus::Ro)
            && m.volumes["vol"].data_partitions.len() >= before.len() + 2
    })
    .await
    .expect("full partitions replaced");
    assert!(map.volumes["vol"].data_partitions.len() > before.len());
    for n in &nodes {
        n.host.full.store(false, Ordering::Relaxed);
    }

    // The last meta partition passes the split threshold: it is closed and a new one opened.
    for n in &nodes {
        n.host.inodes.store(5000, Ordering::Relaxed);
    }
    let map = wait_map(&mc, &mut epochs, limit, |m| {
        m.volumes["vol"].meta_partitions.len() >= 3
    })
    .await
    .expect("meta partition split");
    for n in &nodes {
        n.host.inodes.store(0, Ordering::Relaxed);
    }
    let v = &map.volumes["vol"];
    let mut start = 1;
    for id in &v.meta_partitions {
        let p = &map.meta_partitions[id];
        assert_eq!(p.start, start);
        start = p.end;
    }
    assert_eq!(start, OPEN_END);
    let second = &map.meta_partitions[&v.meta_partitions[1]];
    assert_eq!(second.end, 5000 + 500, "closed at max inode + step");

    // Deleting the volume empties the nodes.
    mc.execute(&Command::DeleteVolume { name: "vol".into() })
        .await
        .unwrap();
    // Nodes learn of the deletion from their next heartbeat reply.
    for n in &nodes {
        let mut removed = n.host.removed.subscribe();
        let emptied = tokio::time::timeout(limit, async {
            while !n.host.hosted().is_empty() {
                removed.changed().await.unwrap();
            }
        })
        .await;
        assert!(
            emptied.is_ok(),
            "a node still hosts partitions of a deleted volume"
        );
    }

    let _ = stop_duties.send(true);
    for n in nodes {
        let _ = n.stop.send(true);
        tokio::task::spawn_blocking(move || n.msgr.shutdown())
            .await
            .unwrap();
    }
    shutdown(&mut masters_).await;
    tokio::task::spawn_blocking(move || cli.shutdown())
        .await
        .unwrap();
}
