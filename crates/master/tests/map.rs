//! The cluster map as a state machine: volumes, placement, liveness, meta-partition splits.
#![allow(clippy::unwrap_used)] // test helpers outside #[test] fns

use nacre_api::master::{Compression, FuncAt};
use nacre_master::map::{
    ClusterMap, Command, FuncLoad, Function, MapError, NodeStatus, OPEN_END, Outcome,
    PartitionKind, PartitionReport, PartitionStatus, Role, VolumeFuncs,
};
use nacre_types::NodeId;
use proptest::prelude::*;

fn cluster(meta: usize, data: usize, zones: usize) -> ClusterMap {
    let mut m = ClusterMap::default();
    for (role, n) in [(Role::Meta, meta), (Role::Data, data)] {
        for i in 0..n {
            m.apply(&Command::RegisterNode {
                addr: format!("{role:?}-{i}:7000"),
                role,
                zone: format!("z{}", i % zones.max(1)),
                capacity: 1 << 30,
                now_ms: 0,
            })
            .unwrap();
        }
    }
    m.apply(&Command::CreateTenant {
        name: "t1".into(),
        access_key: "AK1".into(),
        secret_key: "0123456789abcdef".into(),
    })
    .unwrap();
    m
}

fn heartbeat(m: &mut ClusterMap, node: NodeId, now_ms: u64, partitions: Vec<PartitionReport>) {
    m.apply(&Command::Heartbeat {
        node,
        used: 0,
        now_ms,
        partitions,
    })
    .unwrap();
}

fn create(m: &mut ClusterMap, name: &str, metas: u32, datas: u32) -> Result<Outcome, MapError> {
    m.apply(&Command::CreateVolume {
        name: name.into(),
        owner: "t1".into(),
        replicas: 3,
        capacity: 1 << 40,
        meta_partitions: metas,
        data_partitions: datas,
        inode_step: 1000,
        funcs: Default::default(),
    })
}

fn check_ranges(m: &ClusterMap, volume: &str) {
    let v = &m.volumes[volume];
    let mut start = 1;
    for (i, id) in v.meta_partitions.iter().enumerate() {
        let p = &m.meta_partitions[id];
        assert_eq!(
            p.start, start,
            "partition {i} starts where the previous ends"
        );
        assert!(p.end > p.start);
        start = p.end;
    }
    assert_eq!(start, OPEN_END, "the last partition is open-ended");
}

#[test]
fn a_volume_starts_with_consecutive_meta_ranges_and_spread_data_partitions() {
    let mut m = cluster(3, 6, 1);
    let e0 = m.epoch;
    create(&mut m, "vol-a", 3, 6).unwrap();
    assert_eq!(m.epoch, e0 + 1);
    check_ranges(&m, "vol-a");
    let v = &m.volumes["vol-a"];
    assert_eq!(v.meta_partitions.len(), 3);
    assert_eq!(v.data_partitions.len(), 6);
    let mut hosted = std::collections::BTreeMap::<NodeId, usize>::new();
    for id in &v.data_partitions {
        let p = &m.data_partitions[id];
        let mut r = p.replicas.clone();
        r.sort();
        r.dedup();
        assert_eq!(r.len(), 3, "replicas on distinct nodes");
        for n in &p.replicas {
            assert_eq!(m.nodes[n].role, Role::Data);
            *hosted.entry(*n).or_default() += 1;
        }
    }
    // 18 replicas over 6 equally empty data nodes: 3 each.
    assert!(hosted.values().all(|&c| c == 3), "{hosted:?}");
}

#[test]
fn bad_requests_fail_clearly_and_change_nothing() {
    let mut m = cluster(3, 2, 1);
    let before = m.clone();
    assert!(matches!(
        create(&mut m, "Bad_Name", 1, 1),
        Err(MapError::InvalidName(_))
    ));
    let e = create(&mut m, "vol", 1, 1).unwrap_err();
    assert_eq!(
        e.to_string(),
        "cannot place Data partition: need 3 nodes for 3 replicas, only 2 are up"
    );
    assert_eq!(
        m, before,
        "a failed command leaves the map and its epoch unchanged"
    );
    let mut m = cluster(3, 3, 1);
    create(&mut m, "vol", 1, 1).unwrap();
    assert_eq!(
        create(&mut m, "vol", 1, 1),
        Err(MapError::VolumeExists("vol".into()))
    );
    assert_eq!(
        m.apply(&Command::DeleteVolume {
            name: "nope".into()
        }),
        Err(MapError::NoSuchVolume("nope".into()))
    );
}

#[test]
fn adding_a_node_moves_nothing() {
    let mut m = cluster(3, 3, 1);
    create(&mut m, "vol", 2, 4).unwrap();
    let (metas, datas) = (m.meta_partitions.clone(), m.data_partitions.clone());
    m.apply(&Command::RegisterNode {
        addr: "new:1".into(),
        role: Role::Data,
        zone: "z0".into(),
        capacity: 1 << 30,
        now_ms: 1,
    })
    .unwrap();
    assert_eq!(m.meta_partitions, metas);
    assert_eq!(m.data_partitions, datas);
    // New partitions prefer the empty node.
    let Outcome::PartitionsCreated(ids) = m
        .apply(&Command::AddDataPartitions {
            volume: "vol".into(),
            count: 1,
        })
        .unwrap()
    else {
        panic!("expected partitions");
    };
    let new_node = m.nodes.values().find(|n| n.addr == "new:1").unwrap().id;
    assert!(m.data_partitions[&ids[0]].replicas.contains(&new_node));
}

#[test]
fn replicas_go_to_distinct_zones_when_there_are_enough() {
    let mut m = cluster(3, 6, 3);
    create(&mut m, "vol", 1, 8).unwrap();
    for p in m.data_partitions.values() {
        let mut zones: Vec<&str> = p
            .replicas
            .iter()
            .map(|n| m.nodes[n].zone.as_str())
            .collect();
        zones.sort_unstable();
        zones.dedup();
        assert_eq!(zones.len(), 3);
    }
}

#[test]
fn a_silent_node_is_marked_down_and_its_partitions_read_only_until_it_returns() {
    let mut m = cluster(3, 3, 1);
    create(&mut m, "vol", 1, 2).unwrap();
    let victim = m.nodes.values().find(|n| n.role == Role::Data).unwrap().id;
    for n in m.nodes.keys().copied().collect::<Vec<_>>() {
        if n != victim {
            heartbeat(&mut m, n, 10_000, vec![]);
        }
    }
    m.apply(&Command::CheckLiveness {
        now_ms: 10_000,
        timeout_ms: 5_000,
    })
    .unwrap();
    assert_eq!(m.nodes[&victim].status, NodeStatus::Down);
    assert!(
        m.data_partitions
            .values()
            .all(|p| p.status == PartitionStatus::Ro)
    );
    assert!(
        m.meta_partitions
            .values()
            .all(|p| p.status == PartitionStatus::Rw)
    );
    heartbeat(&mut m, victim, 11_000, vec![]);
    m.apply(&Command::CheckLiveness {
        now_ms: 11_000,
        timeout_ms: 5_000,
    })
    .unwrap();
    assert!(
        m.data_partitions
            .values()
            .all(|p| p.status == PartitionStatus::Rw)
    );
}

#[test]
fn the_map_survives_a_snapshot_round_trip() {
    let mut m = cluster(3, 3, 1);
    create(&mut m, "vol", 2, 3).unwrap();
    assert_eq!(ClusterMap::restore(&m.snapshot()).unwrap(), m);
    assert!(ClusterMap::restore(&[0xff, 0xff, 0xff]).is_err());
}

proptest! {
    #[test]
    fn splits_keep_meta_ranges_disjoint_and_covering(
        steps in proptest::collection::vec((0u64..5000, 1u64..2000), 1..30)
    ) {
        let mut m = cluster(4, 3, 1);
        create(&mut m, "vol", 2, 1).unwrap();
        for (grow, step) in steps {
            let last = *m.volumes["vol"].meta_partitions.last().unwrap();
            let p = m.meta_partitions[&last].clone();
            heartbeat(&mut m, p.replicas[0], 0, vec![PartitionReport {
                id: last,
                leader: true,
                inode_count: grow,
                max_inode: p.start + grow,
                ..PartitionReport::default()
            }]);
            m.apply(&Command::SplitMetaPartition { volume: "vol".into(), step }).unwrap();
            check_ranges(&m, "vol");
        }
    }
}

#[test]
fn tenants_own_volumes_and_cannot_be_deleted_while_they_do() {
    let mut m = cluster(3, 3, 1);
    let no_owner = m.apply(&Command::CreateVolume {
        name: "vol".into(),
        owner: "ghost".into(),
        replicas: 3,
        capacity: 1,
        meta_partitions: 1,
        data_partitions: 1,
        inode_step: 1,
        funcs: Default::default(),
    });
    assert_eq!(no_owner, Err(MapError::NoSuchTenant("ghost".into())));
    create(&mut m, "vol", 1, 1).unwrap();
    let e = m
        .apply(&Command::DeleteTenant { name: "t1".into() })
        .unwrap_err();
    assert_eq!(e.to_string(), "tenant \"t1\" still owns volumes: vol");
    let dup_key = m.apply(&Command::CreateTenant {
        name: "t2".into(),
        access_key: "AK1".into(),
        secret_key: "0123456789abcdef".into(),
    });
    assert!(matches!(dup_key, Err(MapError::Invalid(_))));
    m.apply(&Command::DeleteVolume { name: "vol".into() })
        .unwrap();
    m.apply(&Command::DeleteTenant { name: "t1".into() })
        .unwrap();
    assert!(m.tenants.is_empty());
}

#[test]
fn heartbeats_confirm_replicas_report_leaders_and_return_assignments() {
    let mut m = cluster(3, 3, 1);
    create(&mut m, "vol", 2, 2).unwrap();
    assert_eq!(m.pending_replicas().len(), 4 * 3, "nothing confirmed yet");
    let node = m.meta_partitions.values().next().unwrap().replicas[0];
    let Outcome::Assigned {
        partitions: specs, ..
    } = m
        .apply(&Command::Heartbeat {
            node,
            used: 0,
            now_ms: 1,
            partitions: vec![],
        })
        .unwrap()
    else {
        panic!("a heartbeat returns the node's assignments");
    };
    assert_eq!(specs.len(), 2, "each meta node hosts both meta partitions");
    assert!(matches!(
        specs[0].kind,
        PartitionKind::Meta { start: 1, .. }
    ));
    assert_eq!(specs[0].volume, "vol");
    assert_eq!(specs[0].replicas.len(), 3);

    // Usage-only heartbeats do not bump the epoch; a new leader or replica does.
    let e = m.epoch;
    heartbeat(&mut m, node, 2, vec![]);
    assert_eq!(m.epoch, e);
    let reports = specs
        .iter()
        .map(|s| PartitionReport {
            id: s.id,
            leader: true,
            inode_count: 7,
            max_inode: 9,
            ..PartitionReport::default()
        })
        .collect();
    heartbeat(&mut m, node, 3, reports);
    assert_eq!(m.epoch, e + 1);
    assert_eq!(m.pending_replicas().len(), 4 * 3 - 2);
    let view = m.volume_view("vol").unwrap();
    assert_eq!(view.epoch, m.epoch);
    assert!(view.meta_partitions.iter().all(|p| p.leader == Some(node)));
    assert_eq!(m.meta_partitions.values().next().unwrap().max_inode, 9);
    assert!(matches!(
        m.volume_view("nope"),
        Err(MapError::NoSuchVolume(_))
    ));

    // A full data partition turns read-only.
    let dp = m.data_partitions.values().next().unwrap().clone();
    heartbeat(
        &mut m,
        dp.replicas[0],
        4,
        vec![PartitionReport {
            id: dp.id,
            leader: true,
            full: true,
            ..PartitionReport::default()
        }],
    );
    assert_eq!(m.data_partitions[&dp.id].status, PartitionStatus::Ro);
}

/// The leader's duty of adding data partitions, with four data nodes and one of them dead: new
/// partitions go to the three live ones. With one of those full as well, a three-replica partition
/// has no room, and the command fails and changes nothing. A dead node that registers again
/// makes its partitions read-write at once, not at some later change of the map.
#[test]
fn new_data_partitions_avoid_dead_and_full_nodes() {
    let mut m = cluster(3, 4, 1);
    create(&mut m, "vol", 1, 4).unwrap();
    let data: Vec<NodeId> = m
        .nodes
        .values()
        .filter(|n| n.role == Role::Data)
        .map(|n| n.id)
        .collect();
    let dead = data[0];
    for n in m.nodes.keys().copied().collect::<Vec<_>>() {
        if n != dead {
            heartbeat(&mut m, n, 10_000, vec![]);
        }
    }
    m.apply(&Command::CheckLiveness {
        now_ms: 10_000,
        timeout_ms: 5_000,
    })
    .unwrap();
    assert_eq!(m.nodes[&dead].status, NodeStatus::Down);
    let on_dead: Vec<_> = m
        .data_partitions
        .values()
        .filter(|p| p.replicas.contains(&dead))
        .map(|p| p.id)
        .collect();
    assert!(!on_dead.is_empty());
    assert!(
        on_dead
            .iter()
            .all(|p| m.data_partitions[p].status == PartitionStatus::Ro)
    );

    let Outcome::PartitionsCreated(ids) = m
        .apply(&Command::AddDataPartitions {
            volume: "vol".into(),
            count: 2,
        })
        .unwrap()
    else {
        panic!("partitions expected");
    };
    for id in &ids {
        let p = &m.data_partitions[id];
        assert_eq!(p.replicas.len(), 3);
        assert!(!p.replicas.contains(&dead), "placed on the dead node");
        assert_eq!(p.status, PartitionStatus::Rw);
    }

    // A live node fills its disk: no three nodes left to place on.
    m.apply(&Command::Heartbeat {
        node: data[1],
        used: 1 << 30,
        now_ms: 10_500,
        partitions: vec![],
    })
    .unwrap();
    let epoch = m.epoch;
    let parts = m.data_partitions.len();
    let err = m
        .apply(&Command::AddDataPartitions {
            volume: "vol".into(),
            count: 1,
        })
        .unwrap_err();
    assert!(matches!(err, MapError::Placement { .. }), "{err:?}");
    assert_eq!((m.epoch, m.data_partitions.len()), (epoch, parts));

    // The dead node registers again (a restart): its partitions are read-write at once.
    let addr = m.nodes[&dead].addr.clone();
    m.apply(&Command::RegisterNode {
        addr,
        role: Role::Data,
        zone: "z0".into(),
        capacity: 1 << 30,
        now_ms: 11_000,
    })
    .unwrap();
    assert!(
        on_dead
            .iter()
            .all(|p| m.data_partitions[p].status == PartitionStatus::Rw)
    );
}

// ---- function servers ----

fn register_func(m: &mut ClusterMap, addr: &str, now_ms: u64) -> NodeId {
    match m
        .apply(&Command::RegisterFunc {
            addr: addr.into(),
            zone: "z0".into(),
            functions: vec![Function::Decompress, Function::Compress, Function::Compress],
            capacity: 64,
            now_ms,
        })
        .unwrap()
    {
        Outcome::NodeRegistered(id) => id,
        other => panic!("unexpected outcome {other:?}"),
    }
}

fn func_heartbeat(m: &mut ClusterMap, node: NodeId, outstanding: u32, now_ms: u64) {
    m.apply(&Command::FuncHeartbeat {
        node,
        load: FuncLoad {
            outstanding,
            calls_per_s: 100 * u64::from(outstanding),
            bytes_per_s: 0,
        },
        now_ms,
    })
    .unwrap();
}

fn listed(m: &ClusterMap) -> Vec<NodeId> {
    m.func_view().instances.iter().map(|i| i.node).collect()
}

#[test]
fn function_servers_register_heartbeat_and_are_listed_while_up() {
    let mut m = cluster(3, 3, 1);
    let e0 = m.epoch;
    let f1 = register_func(&mut m, "f1:7000", 0);
    let f2 = register_func(&mut m, "f2:7000", 0);
    assert_eq!(m.epoch, e0 + 2, "a registration changes the map's shape");
    assert_eq!(m.nodes[&f1].role, Role::Func);
    assert_eq!(listed(&m), [f1, f2]);
    let view = m.func_view();
    assert_eq!(view.epoch, m.epoch);
    assert_eq!(view.instances[0].addr, "f1:7000");
    assert_eq!(
        view.instances[0].functions,
        [Function::Compress, Function::Decompress],
        "sorted, without duplicates"
    );
    assert_eq!(view.instances[0].capacity, 64);

    // Heartbeats carry the load and leave the epoch alone.
    let e = m.epoch;
    func_heartbeat(&mut m, f1, 3, 5_000);
    func_heartbeat(&mut m, f2, 1, 5_000);
    assert_eq!(m.epoch, e);
    let view = m.func_view();
    assert_eq!(view.instances[0].load.outstanding, 3);
    assert_eq!(view.instances[0].load.calls_per_s, 300);
    assert_eq!(m.nodes[&f1].last_heartbeat_ms, 5_000);

    // f2 falls silent: down, no longer listed, and the epoch says so.
    func_heartbeat(&mut m, f1, 0, 12_000);
    m.apply(&Command::CheckLiveness {
        now_ms: 16_000,
        timeout_ms: 10_000,
    })
    .unwrap();
    assert_eq!(m.nodes[&f2].status, NodeStatus::Down);
    assert_eq!(m.nodes[&f1].status, NodeStatus::Up);
    assert_eq!(listed(&m), [f1]);
    assert_eq!(m.func_view().epoch, e + 1);
    assert_eq!(
        m.func_instances().count(),
        2,
        "still known, for `nacre func ls`"
    );

    // Heard from again: up at the next check. Restarted: same id, up at once, load kept.
    func_heartbeat(&mut m, f2, 2, 17_000);
    assert_eq!(listed(&m), [f1]);
    m.apply(&Command::CheckLiveness {
        now_ms: 17_500,
        timeout_ms: 10_000,
    })
    .unwrap();
    assert_eq!(listed(&m), [f1, f2]);
    m.apply(&Command::CheckLiveness {
        now_ms: 40_000,
        timeout_ms: 10_000,
    })
    .unwrap();
    assert!(listed(&m).is_empty());
    assert_eq!(register_func(&mut m, "f2:7000", 40_000), f2);
    assert_eq!(listed(&m), [f2]);
    assert_eq!(m.func_view().instances[0].load.outstanding, 2);
}

#[test]
fn bad_function_server_requests_fail_and_change_nothing() {
    let mut m = cluster(3, 3, 1);
    let f = register_func(&mut m, "f:7000", 0);
    let meta = *m.nodes.keys().next().unwrap();
    let before = m.clone();
    for node in [NodeId(999), meta] {
        let err = m
            .apply(&Command::FuncHeartbeat {
                node,
                load: FuncLoad::default(),
                now_ms: 1,
            })
            .unwrap_err();
        assert_eq!(
            err,
            MapError::UnknownNode(node),
            "the server registers again"
        );
    }
    let bad = [
        Command::RegisterNode {
            addr: "x:1".into(),
            role: Role::Func,
            zone: "z".into(),
            capacity: 1,
            now_ms: 0,
        },
        Command::RegisterFunc {
            addr: "x:1".into(),
            zone: "z".into(),
            functions: vec![],
            capacity: 8,
            now_ms: 0,
        },
        Command::RegisterFunc {
            addr: "x:1".into(),
            zone: "z".into(),
            functions: vec![Function::Checksum],
            capacity: 0,
            now_ms: 0,
        },
    ];
    for cmd in &bad {
        assert!(matches!(m.apply(cmd), Err(MapError::Invalid(_))), "{cmd:?}");
    }
    assert_eq!(m, before);
    // A meta node's heartbeat path knows nothing of function servers.
    assert_eq!(m.nodes[&f].role, Role::Func);
}

#[test]
fn function_servers_host_no_partitions() {
    let mut m = cluster(3, 3, 1);
    let funcs: Vec<NodeId> = (0..4)
        .map(|i| register_func(&mut m, &format!("f{i}:7000"), 0))
        .collect();
    create(&mut m, "vol", 3, 6).unwrap();
    for f in &funcs {
        assert!(m.assigned(*f).is_empty());
    }
}

#[test]
fn a_map_with_function_servers_survives_a_snapshot_and_an_older_snapshot_decodes() {
    let mut m = cluster(3, 3, 1);
    create(&mut m, "vol", 2, 3).unwrap();
    // Written by a master built before function servers (and volume functions and codes):
    // the same fields, without the three trailing (empty) maps; or before volume functions;
    // or before codes only.
    let older = m.snapshot();
    assert!(older.ends_with(&[0, 0, 0]), "an empty map is one zero byte");
    for cut in 1..=3 {
        assert_eq!(ClusterMap::restore(&older[..older.len() - cut]).unwrap(), m);
    }

    let f = register_func(&mut m, "f:7000", 0);
    func_heartbeat(&mut m, f, 5, 1);
    let back = ClusterMap::restore(&m.snapshot()).unwrap();
    assert_eq!(back, m);
    assert_eq!(back.func_view().instances.len(), 1);
    // Cut inside the fields every master writes: refused.
    assert!(ClusterMap::restore(&older[..older.len() / 2]).is_err());
}

#[test]
fn a_volume_keeps_its_functions_in_its_view_and_snapshots() {
    let mut m = cluster(3, 3, 1);
    let zstd = VolumeFuncs {
        compress: Some("zstd:3".parse().unwrap()),
        at: FuncAt::Service,
        fallback_inline: false,
        ec: None,
    };
    let cmd = |name: &str, funcs: VolumeFuncs| Command::CreateVolume {
        name: name.into(),
        owner: "t1".into(),
        replicas: 3,
        capacity: 0,
        meta_partitions: 1,
        data_partitions: 2,
        inode_step: 1000,
        funcs,
    };
    m.apply(&cmd("packed", zstd)).unwrap();
    create(&mut m, "plain", 1, 2).unwrap();
    assert_eq!(m.volume_view("packed").unwrap().funcs, zstd);
    assert_eq!(
        m.volume_view("plain").unwrap().funcs,
        VolumeFuncs::default()
    );
    assert_eq!(
        m.volume_funcs.len(),
        1,
        "a volume without functions takes no entry"
    );
    assert_eq!(ClusterMap::restore(&m.snapshot()).unwrap(), m);

    let before = m.clone();
    let bad_block = VolumeFuncs {
        compress: Some(Compression {
            codec: nacre_func::Codec::Lz4,
            block: 3 << 10,
        }),
        ..zstd
    };
    assert!(matches!(
        m.apply(&cmd("bad", bad_block)),
        Err(MapError::Invalid(_))
    ));
    assert_eq!(m, before);

    m.apply(&Command::DeleteVolume {
        name: "packed".into(),
    })
    .unwrap();
    assert!(m.volume_funcs.is_empty());
}

#[test]
fn compression_names_parse_into_codecs_and_bad_ones_say_why() {
    let c: Compression = "zstd".parse().unwrap();
    assert_eq!(c.codec, nacre_func::Codec::Zstd { level: 1 });
    assert_eq!(c.block, Compression::BLOCK);
    assert_eq!(
        "lz4".parse::<Compression>().unwrap().codec,
        nacre_func::Codec::Lz4
    );
    assert_eq!(c.to_string(), "zstd:1 in 64 KiB blocks");
    for (bad, why) in [
        ("gzip", "not a codec"),
        ("zstd:x", "not a number"),
        ("zstd:40", "outside"),
        ("none", "not a codec"),
    ] {
        let e = bad.parse::<Compression>().unwrap_err();
        assert!(e.contains(why), "{bad}: {e}");
    }
}

#[test]
fn an_erasure_coded_volume_places_a_shard_per_replica_and_replica_0_stands_for_it() {
    let mut m = cluster(3, 5, 1);
    let ec = nacre_api::master::parse_ec("3+2").unwrap();
    let funcs = VolumeFuncs {
        ec: Some(ec),
        ..VolumeFuncs::default()
    };
    m.apply(&Command::CreateVolume {
        name: "coded".into(),
        owner: "t1".into(),
        replicas: 3,
        capacity: 0,
        meta_partitions: 1,
        data_partitions: 2,
        inode_step: 1000,
        funcs,
    })
    .unwrap();
    let view = m.volume_view("coded").unwrap();
    assert_eq!(view.funcs.ec, Some(ec));
    for p in &view.data_partitions {
        assert_eq!(p.spec.kind, PartitionKind::Shards { k: 3, m: 2 });
        let mut nodes: Vec<_> = p.spec.replicas.iter().map(|r| r.node).collect();
        assert_eq!(nodes.len(), 5, "one replica per shard");
        nodes.sort();
        nodes.dedup();
        assert_eq!(nodes.len(), 5, "on distinct nodes");
    }
    for p in &view.meta_partitions {
        assert_eq!(p.spec.replicas.len(), 3, "metadata stays replicated");
    }

    // Every replica leads a group of its own; only replica 0's report names the leader.
    let p = &view.data_partitions[0];
    let (first, second) = (p.spec.replicas[0].node, p.spec.replicas[1].node);
    let report = |full| PartitionReport {
        id: p.spec.id,
        leader: true,
        full,
        ..PartitionReport::default()
    };
    heartbeat(&mut m, second, 1, vec![report(true)]);
    let part = &m.data_partitions[&p.spec.id];
    assert_eq!(part.leader, None);
    assert!(!part.full, "another replica's report does not make it full");
    heartbeat(&mut m, first, 2, vec![report(false)]);
    assert_eq!(m.data_partitions[&p.spec.id].leader, Some(first));
    let epoch = m.epoch;
    heartbeat(&mut m, second, 3, vec![report(false)]);
    assert_eq!(m.epoch, epoch, "the other replicas' reports change nothing");

    // New partitions are coded alike; the code survives a snapshot.
    let Outcome::PartitionsCreated(ids) = m
        .apply(&Command::AddDataPartitions {
            volume: "coded".into(),
            count: 1,
        })
        .unwrap()
    else {
        panic!("no partitions created");
    };
    assert_eq!(m.data_partitions[&ids[0]].replicas.len(), 5);
    let back = ClusterMap::restore(&m.snapshot()).unwrap();
    assert_eq!(back, m);
    assert_eq!(back.ec_of("coded"), Some(ec));

    // Fewer data nodes than shards: refused, nothing changes.
    let mut small = cluster(3, 4, 1);
    let before = small.clone();
    let r = small.apply(&Command::CreateVolume {
        name: "wide".into(),
        owner: "t1".into(),
        replicas: 3,
        capacity: 0,
        meta_partitions: 1,
        data_partitions: 1,
        inode_step: 1000,
        funcs,
    });
    assert!(matches!(r, Err(MapError::Placement { .. })), "{r:?}");
    assert_eq!(small, before);
}

#[test]
fn erasure_codes_parse_and_bad_ones_say_why() {
    use nacre_api::master::parse_ec;
    let ec = parse_ec("4+2").unwrap();
    assert_eq!((ec.k, ec.m), (4, 2));
    for (bad, why) in [
        ("4", "not an erasure code"),
        ("4+x", "not an erasure code"),
        ("0+2", "at least 1"),
        ("4+0", "at least 1"),
        ("30+3", "at most 32"),
    ] {
        let e = parse_ec(bad).unwrap_err();
        assert!(e.contains(why), "{bad}: {e}");
    }
}

/// Every node's heartbeat at `now_ms`, reporting every partition it holds (`but` is silent).
fn heartbeat_all(m: &mut ClusterMap, now_ms: u64, but: Option<NodeId>) {
    for n in m.nodes.keys().copied().collect::<Vec<_>>() {
        if Some(n) == but {
            continue;
        }
        let reports = m
            .assigned(n)
            .into_iter()
            .map(|spec| PartitionReport {
                id: spec.id,
                leader: true,
                ..PartitionReport::default()
            })
            .collect();
        heartbeat(m, n, now_ms, reports);
    }
}

#[test]
fn a_dead_node_s_shards_move_to_another_node_which_reports_them_once_rebuilt() {
    let mut m = cluster(3, 4, 1);
    m.apply(&Command::CreateVolume {
        name: "coded".into(),
        owner: "t1".into(),
        replicas: 3,
        capacity: 0,
        meta_partitions: 1,
        data_partitions: 3,
        inode_step: 1000,
        funcs: VolumeFuncs {
            ec: Some(nacre_api::master::parse_ec("2+1").unwrap()),
            ..VolumeFuncs::default()
        },
    })
    .unwrap();
    let coded = |m: &ClusterMap| -> Vec<_> { m.data_partitions.values().cloned().collect() };
    assert!(
        coded(&m).iter().all(|p| p.status == PartitionStatus::Ro),
        "read-only until every replica reported"
    );
    assert_eq!(
        m.writable_data_partitions("coded"),
        3,
        "partitions being created count as writable: the duty adds no more"
    );
    heartbeat_all(&mut m, 1_000, None);
    assert!(coded(&m).iter().all(|p| p.status == PartitionStatus::Rw));
    // Replica 0 places every stripe: the partitions take turns among their nodes for it.
    let mut firsts: Vec<_> = coded(&m).iter().map(|p| p.replicas[0]).collect();
    firsts.sort();
    firsts.dedup();
    assert!(firsts.len() > 1, "every partition places on {firsts:?}");

    // A data node holding a replica goes silent, is marked down, and stays down.
    let victim = coded(&m)[0].replicas[1];
    heartbeat_all(&mut m, 10_000, Some(victim));
    m.apply(&Command::CheckLiveness {
        now_ms: 10_000,
        timeout_ms: 5_000,
    })
    .unwrap();
    assert!(
        m.rebuild_plan(10_000, 60_000, 3_000).is_empty(),
        "not down long enough"
    );
    heartbeat_all(&mut m, 61_500, Some(victim));
    let plan = m.rebuild_plan(61_500, 60_000, 3_000);
    let held: Vec<_> = coded(&m)
        .iter()
        .filter(|p| p.replicas.contains(&victim))
        .map(|p| p.id)
        .collect();
    assert_eq!(plan.len(), held.len(), "one move per replica: {plan:?}");
    for cmd in &plan {
        m.apply(cmd).unwrap();
    }
    for p in coded(&m) {
        assert!(!p.replicas.contains(&victim));
        let mut nodes = p.replicas.clone();
        nodes.sort();
        nodes.dedup();
        assert_eq!(nodes.len(), 3, "still on distinct nodes");
        if held.contains(&p.id) {
            assert_eq!(
                p.status,
                PartitionStatus::Ro,
                "the new replica is rebuilding"
            );
        }
    }
    assert_eq!(m.writable_data_partitions("coded"), 3);
    // A move applied twice, or off a node that is up, is refused.
    assert!(m.apply(&plan[0]).is_err());
    // The new replicas report once rebuilt: writable again.
    heartbeat_all(&mut m, 62_000, Some(victim));
    assert!(coded(&m).iter().all(|p| p.status == PartitionStatus::Rw));
    assert!(m.rebuild_plan(62_000, 60_000, 3_000).is_empty());
    // Replicated partitions never move (their Raft groups keep their members).
    let plain = {
        create(&mut m, "plain", 1, 1).unwrap();
        m.volumes["plain"].data_partitions[0]
    };
    let (old, new) = (m.data_partitions[&plain].replicas[0], victim);
    assert!(matches!(
        m.apply(&Command::ReplaceReplica {
            partition: plain,
            old,
            new
        }),
        Err(MapError::Invalid(_))
    ));
}
