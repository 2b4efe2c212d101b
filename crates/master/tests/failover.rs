//! Three masters over the in-memory network: the map survives the loss of the leader, and a volume
//! being created while the leader dies is either fully created or not at all.
#![allow(clippy::unwrap_used)] // test helpers outside #[test] fns

mod common;

use nacre_master::MasterAdmin as _;
use std::time::Duration;

use common::*;
use nacre_master::map::{Command, MapError, NodeStatus, Outcome, Role};
use nacre_master::{Master, MasterConfig, MasterError};
use nacre_msgr::mem::MemNetwork;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_masters_keep_the_map_and_serve_after_the_leader_dies() {
    let net = MemNetwork::new(11);
    let (mut nodes, addrs) = masters(&net, MasterConfig::default()).await;
    let (client_msgr, mc) = client(&net, "cli", addrs);
    register_nodes(&mc).await;
    create_tenant(&mc).await;
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
    let map = mc.cluster_map().await.unwrap();
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

    shutdown(&mut nodes).await;
    tokio::task::spawn_blocking(move || client_msgr.shutdown())
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_leader_marks_silent_nodes_down_and_returning_nodes_up() {
    let net = MemNetwork::new(12);
    let config = MasterConfig {
        duty_interval: Duration::from_millis(50),
        node_timeout: Duration::from_millis(300),
        default_tenant: false,
        ..MasterConfig::default()
    };
    let (mut nodes, addrs) = masters(&net, config).await;
    let (stop_duties, duties_stopped) = tokio::sync::watch::channel(false);
    for n in nodes.values() {
        let m = n.master.clone();
        let mut rx = duties_stopped.clone();
        tokio::spawn(async move {
            m.run_duties(async move {
                let _ = rx.wait_for(|s| *s).await;
            })
            .await;
        });
    }
    let (client_msgr, mc) = client(&net, "cli", addrs);
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
    let mut epochs = nodes[&1].epochs.clone();
    let limit = Duration::from_secs(10);
    let down = wait_map(&mc, &mut epochs, limit, |m| {
        m.nodes[&id].status == NodeStatus::Down
    })
    .await;
    assert!(down.is_some(), "a silent node was not marked down");
    mc.heartbeat(id, 0, vec![]).await.unwrap();
    let up = wait_map(&mc, &mut epochs, limit, |m| {
        m.nodes[&id].status == NodeStatus::Up
    })
    .await;
    assert!(up.is_some(), "a node heard from again was not marked up");
    let _ = stop_duties.send(true);
    shutdown(&mut nodes).await;
    tokio::task::spawn_blocking(move || client_msgr.shutdown())
        .await
        .unwrap();
}
