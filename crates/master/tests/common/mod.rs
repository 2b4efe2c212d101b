//! A 3-master cluster over the in-memory network, with node agents, for the master's tests.
#![allow(dead_code, clippy::unwrap_used)] // shared by several test binaries

use nacre_master::MasterAdmin as _;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use nacre_client::MasterClient;
use nacre_master::map::{ClusterMap, Command, Role};
use nacre_master::{MASTER_GROUP, Master, MasterConfig, MasterSm};
use nacre_msgr::mem::MemNetwork;
use nacre_msgr::{Messenger, MsgrConfig};
use nacre_raft::store::start;
use nacre_raft::{LogStore, MemLogStore, NodeConfig, RaftHandle, StoreConfig};
use tokio::sync::watch;

pub struct MasterNode {
    pub epochs: watch::Receiver<u64>,
    pub raft: RaftHandle<MasterSm>,
    pub master: Master,
    pub msgr: Messenger,
    pub stop: Option<tokio::sync::oneshot::Sender<()>>,
}

pub async fn masters(
    net: &MemNetwork,
    config: MasterConfig,
) -> (BTreeMap<u64, MasterNode>, Vec<String>) {
    let store_config = StoreConfig {
        node: NodeConfig::default(),
        tick_interval: Duration::from_millis(10),
        ..StoreConfig::default()
    };
    let mut listeners = BTreeMap::new();
    let mut msgrs = BTreeMap::new();
    for id in 1..=3u64 {
        let host = format!("m{id}");
        let cfg = MsgrConfig {
            workers: 1,
            connect_timeout: Duration::from_millis(200),
            ..MsgrConfig::default()
        };
        let m = Messenger::new(&host, cfg, Arc::new(net.transport(&host))).unwrap();
        listeners.insert(id, m.transport().bind(&format!("{host}:0")).await.unwrap());
        msgrs.insert(id, m);
    }
    let addrs: BTreeMap<u64, String> = listeners
        .iter()
        .map(|(id, l)| (*id, l.local_addr().unwrap()))
        .collect();
    let mut nodes = BTreeMap::new();
    for (id, l) in listeners {
        let m = msgrs.remove(&id).unwrap();
        let peers = addrs
            .iter()
            .filter(|(p, _)| **p != id)
            .map(|(p, a)| (*p, a.clone()))
            .collect();
        let log: Arc<dyn LogStore> = Arc::new(MemLogStore::new());
        let raft = start::<MasterSm>(id, store_config.clone(), log, peers, m.client()).unwrap();
        let sm = MasterSm::default();
        let epochs = sm.epochs();
        raft.add_group(MASTER_GROUP, &[1, 2, 3], sm).await.unwrap();
        let master = Master::new(raft.clone(), addrs.clone(), m.client(), config.clone());
        let router = raft.router().merge(master.router());
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        tokio::spawn(m.serve(l, Arc::new(router), async {
            let _ = stopped.await;
        }));
        nodes.insert(
            id,
            MasterNode {
                epochs,
                raft,
                master,
                msgr: m,
                stop: Some(stop),
            },
        );
    }
    (nodes, addrs.into_values().collect())
}

pub fn volume(name: &str) -> Command {
    Command::CreateVolume {
        name: name.into(),
        owner: "t".into(),
        replicas: 3,
        capacity: 1 << 40,
        meta_partitions: 2,
        data_partitions: 4,
        inode_step: 1 << 20,
        funcs: Default::default(),
    }
}

pub async fn kill(nodes: &mut BTreeMap<u64, MasterNode>, net: &MemNetwork, id: u64) {
    let n = nodes.get_mut(&id).unwrap();
    net.isolate(&format!("m{id}"));
    n.raft.stop().await.unwrap();
    if let Some(s) = n.stop.take() {
        let _ = s.send(());
    }
}

pub async fn leader(nodes: &BTreeMap<u64, MasterNode>) -> u64 {
    for n in nodes.values() {
        if let Ok(st) = n.raft.status().await
            && st.leaders == 1
        {
            return n.raft.id();
        }
    }
    0
}

/// Registers the three meta and three data nodes a 3-replica volume needs (addresses only: no
/// process behind them).
pub async fn register_nodes(mc: &MasterClient) {
    for (role, i) in [
        (Role::Meta, 0),
        (Role::Meta, 1),
        (Role::Meta, 2),
        (Role::Data, 0),
        (Role::Data, 1),
        (Role::Data, 2),
    ] {
        mc.execute(&Command::RegisterNode {
            addr: format!("{role:?}{i}:1"),
            role,
            zone: "z".into(),
            capacity: 1 << 30,
            now_ms: Master::now_ms(),
        })
        .await
        .unwrap();
    }
}

pub async fn create_tenant(mc: &MasterClient) {
    mc.execute(&Command::CreateTenant {
        name: "t".into(),
        access_key: "AKT".into(),
        secret_key: "0123456789abcdef".into(),
    })
    .await
    .unwrap();
}

/// Waits until `pred` holds on the map read from the leader, re-reading whenever `epochs` (one
/// master's epoch watch) changes; gives up after `timeout`.
pub async fn wait_map(
    mc: &MasterClient,
    epochs: &mut watch::Receiver<u64>,
    timeout: Duration,
    pred: impl FnMut(&ClusterMap) -> bool,
) -> Option<ClusterMap> {
    // The check's future calls `pred` after an await: it borrows it through a cell.
    let pred = &std::cell::RefCell::new(pred);
    nacre_testkit::until_changed(epochs, timeout, move || {
        let map = mc.cluster_map();
        async move {
            let map = map.await.unwrap();
            (pred.borrow_mut())(&map).then_some(map)
        }
    })
    .await
}

/// Stops every master's messenger.
pub async fn shutdown(nodes: &mut BTreeMap<u64, MasterNode>) {
    for n in nodes.values_mut() {
        if let Some(s) = n.stop.take() {
            let _ = s.send(());
        }
        let m = n.msgr.clone();
        tokio::task::spawn_blocking(move || m.shutdown())
            .await
            .unwrap();
    }
}

pub fn client(net: &MemNetwork, name: &str, addrs: Vec<String>) -> (Messenger, MasterClient) {
    let m = Messenger::new(name, MsgrConfig::default(), Arc::new(net.transport(name))).unwrap();
    let mc = MasterClient::new(m.client(), addrs);
    (m, mc)
}
