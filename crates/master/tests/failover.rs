//! Three masters over the in-memory network: the map survives the loss of the leader, and a volume
//! being created while the leader dies is either fully created or not at all.
#![allow(clippy::unwrap_used)] // test helpers outside #[test] fns

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use nacre_master::map::{Command, MapError, Role};
use nacre_master::{MASTER_GROUP, Master, MasterClient, MasterError, MasterSm};
use nacre_msgr::mem::MemNetwork;
use nacre_msgr::{Messenger, MsgrConfig};
use nacre_raft::store::start;
use nacre_raft::{LogStore, MemLogStore, NodeConfig, RaftHandle, StoreConfig};

struct MasterNode {
    raft: RaftHandle<MasterSm>,
    master: Master,
    msgr: Messenger,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
}

async fn masters(net: &MemNetwork) -> (BTreeMap<u64, MasterNode>, Vec<String>) {
    let config = StoreConfig {
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
        let raft = start::<MasterSm>(id, config.clone(), log, peers, m.client()).unwrap();
        raft.add_group(MASTER_GROUP, &[1, 2, 3], MasterSm::default())
            .await
            .unwrap();
        let master = Master::new(raft.clone(), addrs.clone());
        let router = raft.router().merge(master.router());
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        tokio::spawn(m.serve(l, Arc::new(router), async {
            let _ = stopped.await;
        }));
        nodes.insert(
            id,
            MasterNode {
                raft,
                master,
                msgr: m,
                stop: Some(stop),
            },
        );
    }
    (nodes, addrs.into_values().collect())
}

fn volume(name: &str) -> Command {
    Command::CreateVolume {
        name: name.into(),
        owner: "t".into(),
        replicas: 3,
        capacity: 1 << 40,
        meta_partitions: 2,
        data_partitions: 4,
        inode_step: 1 << 20,
    }
}

async fn kill(nodes: &mut BTreeMap<u64, MasterNode>, net: &MemNetwork, id: u64) {
    let n = nodes.get_mut(&id).unwrap();
    net.isolate(&format!("m{id}"));
    n.raft.stop().await.unwrap();
    if let Some(s) = n.stop.take() {
        let _ = s.send(());
    }
}

async fn leader(nodes: &BTreeMap<u64, MasterNode>) -> u64 {
    for n in nodes.values() {
        if let Ok(st) = n.raft.status().await
            && st.leaders == 1
        {
            return n.raft.id();
        }
    }
    0
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_masters_keep_the_map_and_serve_after_the_leader_dies() {
    let net = MemNetwork::new(11);
    let (mut nodes, addrs) = masters(&net).await;
    let client_msgr =
        Messenger::new("cli", MsgrConfig::default(), Arc::new(net.transport("cli"))).unwrap();
    let mc = MasterClient::new(client_msgr.client(), addrs);
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
            now_ms: 0,
        })
        .await
        .unwrap();
    }
    mc.execute(&volume("before")).await.unwrap();
    assert_eq!(
        mc.execute(&volume("before")).await,
        Err(MasterError::Map(MapError::VolumeExists("before".into())))
    );

    // Kill the leader while a volume is being created.
    let l = leader(&nodes).await;
    assert_ne!(l, 0);
    let racing = {
        let mc = mc.clone();
        tokio::spawn(async move { mc.execute(&volume("racing")).await })
    };
    kill(&mut nodes, &net, l).await;
    let raced = racing.await.unwrap();

    // The survivors elect a new leader; the map is intact and changes still commit.
    mc.execute(&volume("after")).await.unwrap();
    let map = mc.map().await.unwrap();
    for name in ["before", "after"] {
        let v = &map.volumes[name];
        assert_eq!(
            (v.meta_partitions.len(), v.data_partitions.len()),
            (2, 4),
            "{name}"
        );
    }
    // The racing volume exists completely or not at all, whatever its caller was told.
    match map.volumes.get("racing") {
        Some(v) => {
            assert_eq!((v.meta_partitions.len(), v.data_partitions.len()), (2, 4));
            for p in v.meta_partitions.iter() {
                assert!(map.meta_partitions.contains_key(p));
            }
            for p in v.data_partitions.iter() {
                assert!(map.data_partitions.contains_key(p));
            }
        }
        None => assert!(raced.is_err(), "acknowledged but missing: {raced:?}"),
    }
    let created: usize = map.volumes.values().map(|v| v.data_partitions.len()).sum();
    assert_eq!(
        created,
        map.data_partitions.len(),
        "no partition without its volume"
    );

    for n in nodes.values_mut() {
        if let Some(s) = n.stop.take() {
            let _ = s.send(());
        }
        let m = n.msgr.clone();
        tokio::task::spawn_blocking(move || m.shutdown())
            .await
            .unwrap();
    }
    tokio::task::spawn_blocking(move || client_msgr.shutdown())
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_leader_marks_silent_nodes_down_and_returning_nodes_up() {
    use nacre_master::map::{NodeStatus, Outcome};
    let net = MemNetwork::new(12);
    let (mut nodes, addrs) = masters(&net).await;
    let (stop_duties, duties_stopped) = tokio::sync::watch::channel(false);
    for n in nodes.values() {
        let m = n.master.clone();
        let mut rx = duties_stopped.clone();
        tokio::spawn(async move {
            m.run_duties(
                Duration::from_millis(50),
                Duration::from_millis(300),
                async move {
                    let _ = rx.wait_for(|s| *s).await;
                },
            )
            .await;
        });
    }
    let client_msgr =
        Messenger::new("cli", MsgrConfig::default(), Arc::new(net.transport("cli"))).unwrap();
    let mc = MasterClient::new(client_msgr.client(), addrs);
    let Outcome::NodeRegistered(id) = mc
        .execute(&Command::RegisterNode {
            addr: "data0:1".into(),
            role: Role::Data,
            zone: "z".into(),
            capacity: 1 << 30,
            now_ms: Master::now_ms(),
        })
        .await
        .unwrap()
    else {
        panic!("expected a node id");
    };
    // Bounded waits on the replicated map, polling at the duty interval.
    let wait_for = |want: NodeStatus| {
        let mc = mc.clone();
        async move {
            for _ in 0..200 {
                if mc.map().await.unwrap().nodes[&id].status == want {
                    return true;
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            false
        }
    };
    assert!(
        wait_for(NodeStatus::Down).await,
        "a silent node was not marked down"
    );
    mc.execute(&Command::Heartbeat {
        node: id,
        used: 0,
        now_ms: Master::now_ms(),
    })
    .await
    .unwrap();
    assert!(
        wait_for(NodeStatus::Up).await,
        "a node heard from again was not marked up"
    );
    let _ = stop_duties.send(true);
    for n in nodes.values_mut() {
        if let Some(s) = n.stop.take() {
            let _ = s.send(());
        }
        let m = n.msgr.clone();
        tokio::task::spawn_blocking(move || m.shutdown())
            .await
            .unwrap();
    }
    tokio::task::spawn_blocking(move || client_msgr.shutdown())
        .await
        .unwrap();
}
