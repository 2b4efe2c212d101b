//! A master and three meta nodes in one process over the in-memory network, raft logs on
//! raft-engine in a temp dir: the client's metadata ops are replicated, and every create that was
//! acknowledged survives the crash of a partition leader in the middle of a create storm.
#![allow(clippy::unwrap_used)] // test helpers outside #[test] fns

use nacre_master::MasterAdmin as _;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use nacre_api::master::{RegisterRequest, Role};
use nacre_api::meta::ROOT_INO;
use nacre_client::MasterClient;
use nacre_client::{FsError, MetaFs, MetaTransport, NetVolume, NewInode};
use nacre_cluster::{AgentConfig, node_router, run_agent};
use nacre_master::{ClusterMap, Command, MASTER_GROUP, Master, MasterConfig, MasterSm};
use nacre_meta::{MetaNode, MetaNodeConfig};
use nacre_msgr::mem::MemNetwork;
use nacre_msgr::{Messenger, MsgrConfig};
use nacre_raft::{LogStore, MemLogStore, StoreConfig};
use nacre_types::{Ino, NodeId};
use tokio::sync::watch;

struct MetaProc {
    host: String,
    addr: String,
    node: MetaNode,
    msgr: Messenger,
    stop: watch::Sender<bool>,
    runner: tokio::task::JoinHandle<()>,
}

impl MetaProc {
    /// Stops everything and waits until the raft store (and its log) is closed.
    async fn shut(self) {
        let _ = self.stop.send(true);
        self.runner.await.unwrap();
        drop(self.node);
        let msgr = self.msgr.clone();
        tokio::task::spawn_blocking(move || msgr.shutdown())
            .await
            .unwrap();
    }
}

fn fast_raft() -> StoreConfig {
    StoreConfig {
        tick_interval: Duration::from_millis(20),
        ..StoreConfig::default()
    }
}

async fn start_master(
    net: &MemNetwork,
) -> (Messenger, String, watch::Receiver<u64>, watch::Sender<bool>) {
    let msgr = Messenger::new(
        "master",
        MsgrConfig::default(),
        Arc::new(net.transport("master")),
    )
    .unwrap();
    let l = msgr.transport().bind("master:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let log: Arc<dyn LogStore> = Arc::new(MemLogStore::new());
    let raft =
        nacre_raft::store::start::<MasterSm>(1, fast_raft(), log, BTreeMap::new(), msgr.client())
            .unwrap();
    let sm = MasterSm::default();
    let epochs = sm.epochs();
    raft.add_group(MASTER_GROUP, &[1], sm).await.unwrap();
    let config = MasterConfig {
        duty_interval: Duration::from_millis(50),
        min_writable_data_partitions: 0,
        default_tenant: false,
        max_create_backoff: Duration::from_millis(200),
        ..MasterConfig::default()
    };
    let master = Master::new(
        raft.clone(),
        BTreeMap::from([(1, addr.clone())]),
        msgr.client(),
        config,
    );
    let (stop, _) = watch::channel(false);
    let router = raft.router().merge(master.router());
    let mut rx = stop.subscribe();
    tokio::spawn(msgr.serve(l, Arc::new(router), async move {
        let _ = rx.wait_for(|s| *s).await;
    }));
    let mut rx = stop.subscribe();
    tokio::spawn(async move {
        master
            .run_duties(async move {
                let _ = rx.wait_for(|s| *s).await;
            })
            .await;
    });
    (msgr, addr, epochs, stop)
}

async fn start_meta(
    net: &MemNetwork,
    i: usize,
    dir: &std::path::Path,
    master: &str,
    at: Option<&str>,
) -> MetaProc {
    let host = format!("meta{i}");
    let msgr =
        Messenger::new(&host, MsgrConfig::default(), Arc::new(net.transport(&host))).unwrap();
    let bind = at.map_or_else(|| format!("{host}:0"), str::to_string);
    let l = msgr.transport().bind(&bind).await.unwrap();
    let addr = l.local_addr().unwrap();
    let cfg = MetaNodeConfig {
        dir: dir.join(&host),
        raft: fast_raft().with_read_lease(),
        report_interval: Duration::from_millis(50),
        orphan_grace: Duration::ZERO,
        masters: vec![master.to_string()],
    };
    let node = MetaNode::open(&cfg, msgr.client()).unwrap();
    let (stop, _) = watch::channel(false);
    let router = node.router().merge(node_router(Arc::new(node.clone())));
    let mut rx = stop.subscribe();
    tokio::spawn(msgr.serve(l, Arc::new(router), async move {
        let _ = rx.wait_for(|s| *s).await;
    }));
    let (id_tx, id_rx) = watch::channel::<Option<NodeId>>(None);
    let agent = AgentConfig {
        register: RegisterRequest {
            addr: addr.clone(),
            role: Role::Meta,
            zone: "z".into(),
            capacity: 1 << 30,
        },
        heartbeat_interval: Duration::from_millis(50),
    };
    let mc = MasterClient::new(msgr.client(), vec![master.to_string()]);
    let mut rx = stop.subscribe();
    tokio::spawn(run_agent(
        mc,
        agent,
        Arc::new(node.clone()),
        id_tx,
        async move {
            let _ = rx.wait_for(|s| *s).await;
        },
    ));
    let (run, mut rx) = (node.clone(), stop.subscribe());
    let runner = tokio::spawn(async move {
        run.run(id_rx, Duration::from_millis(50), async move {
            let _ = rx.wait_for(|s| *s).await;
        })
        .await;
    });
    MetaProc {
        host,
        addr,
        node,
        msgr,
        stop,
        runner,
    }
}

async fn wait_map(
    mc: &MasterClient,
    epochs: &mut watch::Receiver<u64>,
    pred: impl FnMut(&ClusterMap) -> bool,
) -> ClusterMap {
    // The check's future calls `pred` after an await: it borrows it through a cell.
    let pred = &std::cell::RefCell::new(pred);
    nacre_testkit::until_changed(epochs, Duration::from_secs(30), move || {
        let map = mc.cluster_map();
        async move {
            let map = map.await.unwrap();
            (pred.borrow_mut())(&map).then_some(map)
        }
    })
    .await
    .expect("cluster did not reach the expected state")
}

struct TestCluster {
    master_msgr: Messenger,
    master_addr: String,
    master_stop: watch::Sender<bool>,
    metas: Vec<MetaProc>,
    cli: Messenger,
    mc: MasterClient,
    /// The map once every replica of the volume exists and every meta partition has a leader.
    map: ClusterMap,
}

/// Stops the master and every meta node (waiting until their logs are closed) and both messengers.
async fn stop_all(
    master_stop: watch::Sender<bool>,
    metas: Vec<MetaProc>,
    cli: Messenger,
    master_msgr: Messenger,
) {
    let _ = master_stop.send(true);
    for m in metas {
        m.shut().await;
    }
    tokio::task::spawn_blocking(move || cli.shutdown())
        .await
        .unwrap();
    tokio::task::spawn_blocking(move || master_msgr.shutdown())
        .await
        .unwrap();
}

/// A master, three meta nodes, and a volume `vol` with `meta_partitions` partitions × 3 replicas.
async fn cluster_with_volume(
    net: &MemNetwork,
    dir: &std::path::Path,
    meta_partitions: u32,
) -> TestCluster {
    let (master_msgr, master_addr, mut epochs, master_stop) = start_master(net).await;
    let mut metas = Vec::new();
    for i in 0..3 {
        metas.push(start_meta(net, i, dir, &master_addr, None).await);
    }
    let cli = Messenger::new("cli", MsgrConfig::default(), Arc::new(net.transport("cli"))).unwrap();
    let mc = MasterClient::new(cli.client(), vec![master_addr.clone()]);
    wait_map(&mc, &mut epochs, |m| m.nodes.len() == 3).await;
    mc.execute(&Command::CreateTenant {
        name: "t".into(),
        access_key: "AK".into(),
        secret_key: "0123456789abcdef".into(),
    })
    .await
    .unwrap();
    mc.execute(&Command::CreateVolume {
        name: "vol".into(),
        owner: "t".into(),
        replicas: 3,
        capacity: 0,
        meta_partitions,
        data_partitions: 0,
        inode_step: 1000,
        funcs: Default::default(),
    })
    .await
    .unwrap();
    let map = wait_map(&mc, &mut epochs, |m| {
        m.pending_replicas().is_empty() && m.meta_partitions.values().all(|p| p.leader.is_some())
    })
    .await;
    TestCluster {
        master_msgr,
        master_addr,
        master_stop,
        metas,
        cli,
        mc,
        map,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acknowledged_creates_survive_a_partition_leader_crash() {
    let dir = tempfile::tempdir().unwrap();
    let net = MemNetwork::new(31);
    let TestCluster {
        master_msgr,
        master_addr,
        master_stop,
        mut metas,
        cli,
        mc,
        map,
    } = cluster_with_volume(&net, dir.path(), 2).await;

    let meta = NetVolume::connect(cli.client(), mc.clone(), "vol")
        .await
        .unwrap();
    let fs = Arc::new(MetaFs::new(meta));
    let d = fs
        .create(ROOT_INO, b"d", &NewInode::dir(0o755, 0, 0))
        .await
        .unwrap();
    assert_eq!(fs.lookup(ROOT_INO, b"d").await.unwrap().ino, d.attr.ino);

    // A storm of creates from 8 tasks; the leader of the root's partition dies in the middle.
    let root_part = map.volumes["vol"].meta_partitions[0];
    let victim_node = map.meta_partitions[&root_part].leader.unwrap();
    let victim_addr = map.nodes[&victim_node].addr.clone();
    let (half_tx, mut half_rx) = watch::channel(0usize);
    let mut tasks = Vec::new();
    for t in 0..8 {
        let (fs, half_tx) = (fs.clone(), half_tx.clone());
        tasks.push(tokio::spawn(async move {
            let mut acked: Vec<(Ino, Vec<u8>, Ino)> = Vec::new();
            let mut failed = 0;
            for i in 0..40 {
                let parent = if i % 2 == 0 { ROOT_INO } else { d.attr.ino };
                let name = format!("f-{t}-{i}").into_bytes();
                match fs.create(parent, &name, &NewInode::file(0o644, 0, 0)).await {
                    Ok(a) => acked.push((parent, name, a.attr.ino)),
                    Err(FsError::Unavailable(_)) => failed += 1,
                    Err(e) => panic!("create {name:?}: {e}"),
                }
                half_tx.send_modify(|n| *n += 1);
            }
            (acked, failed)
        }));
    }
    half_rx.wait_for(|n| *n >= 8 * 40 / 3).await.unwrap();
    let victim = metas
        .iter()
        .position(|m| victim_addr.starts_with(&m.host))
        .unwrap();
    net.isolate(&metas[victim].host);
    let _ = metas[victim].stop.send(true);

    let mut acked = Vec::new();
    let mut failed = 0;
    for t in tasks {
        let (a, f) = t.await.unwrap();
        acked.extend(a);
        failed += f;
    }
    // Calls whose outcome the crash left unknown are sent again to the new leader and apply
    // once: no create fails, none is told `Exists`.
    assert_eq!(failed, 0, "{} acked, {failed} failed", acked.len());
    for (parent, name, ino) in &acked {
        let a = fs.lookup(*parent, name).await.unwrap_or_else(|e| {
            panic!(
                "acknowledged create of {:?} lost: {e}",
                String::from_utf8_lossy(name)
            )
        });
        assert_eq!(a.ino, *ino);
    }
    let listed = fs.readdir(ROOT_INO, None, 0).await.unwrap().len()
        + fs.readdir(d.attr.ino, None, 0).await.unwrap().len();
    assert!(
        listed > acked.len(),
        "the directory d and every acknowledged file are listed"
    );

    // The crashed node restarts from its disk (same address) and catches up; then another node
    // dies, so every partition's quorum needs the restarted one: all acknowledged files are there.
    let old = metas.remove(victim);
    let (host, addr) = (old.host.clone(), old.addr.clone());
    old.shut().await;
    net.heal_host(&host);
    let back = start_meta(
        &net,
        victim_index(&host),
        dir.path(),
        &master_addr,
        Some(&addr),
    )
    .await;
    metas.insert(victim, back);
    // Wait (bounded) until the restarted replica has applied everything: it allocated up to `want`.
    let want: u64 = acked.iter().map(|(_, _, ino)| ino.0).max().unwrap();
    let restarted = metas[victim].node.clone();
    let mut applied = restarted.applied().expect("the node id was on disk");
    let caught_up = tokio::time::timeout(Duration::from_secs(30), async {
        loop {
            applied.borrow_and_update();
            if restarted.applied_max_inode().await >= want {
                return;
            }
            applied.changed().await.unwrap();
        }
    })
    .await
    .is_ok();
    assert!(caught_up, "the restarted meta node did not catch up");
    let other = (0..metas.len()).find(|&i| i != victim).unwrap();
    net.isolate(&metas[other].host);
    let _ = metas[other].stop.send(true);
    for (parent, name, ino) in &acked {
        let a = fs.lookup(*parent, name).await.unwrap_or_else(|e| {
            panic!(
                "{:?} lost after the restart: {e}",
                String::from_utf8_lossy(name)
            )
        });
        assert_eq!(a.ino, *ino);
    }

    stop_all(master_stop, metas, cli, master_msgr).await;
}

/// A rename whose answer is lost (the leader's reply resets the connection, again and again) is
/// sent again with the same call number until an answer gets through: it applies once and the
/// caller learns that it succeeded, not that the source is gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_whose_answers_are_lost_applies_once_and_succeeds() {
    let dir = tempfile::tempdir().unwrap();
    let net = MemNetwork::new(41);
    let TestCluster {
        master_msgr,
        master_addr,
        master_stop,
        metas,
        cli,
        mc,
        map,
    } = cluster_with_volume(&net, dir.path(), 1).await;
    let vol = NetVolume::connect(cli.client(), mc.clone(), "vol")
        .await
        .unwrap();
    let fs = Arc::new(MetaFs::new(vol));
    let a = fs
        .create(ROOT_INO, b"a", &NewInode::file(0o644, 0, 0))
        .await
        .unwrap();
    let leader_addr = leader_of(&map, ROOT_INO);
    let leader = metas
        .iter()
        .find(|m| leader_addr.starts_with(&m.host))
        .unwrap();
    let mut applied = leader.node.applied().expect("the node id is known");
    net.set_reset_probability(&leader.host, "cli", 1.0);
    let part = fs.partition_of(ROOT_INO).unwrap();
    let rename = nacre_api::meta::Command::Rename {
        src_parent: ROOT_INO,
        src_name: b"a".to_vec(),
        dst_parent: ROOT_INO,
        dst_name: b"b".to_vec(),
    };
    let renaming = tokio::spawn({
        let fs = fs.clone();
        async move { fs.transport().write(part, rename).await }
    });
    // The rename is applied on the leader while none of its answers reach the client: another
    // client sees it.
    let other = Messenger::new(
        "cli2",
        MsgrConfig::default(),
        Arc::new(net.transport("cli2")),
    )
    .unwrap();
    let mc2 = MasterClient::new(other.client(), vec![master_addr.clone()]);
    let fs2 = MetaFs::new(
        NetVolume::connect(other.client(), mc2, "vol")
            .await
            .unwrap(),
    );
    let seen = tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            applied.borrow_and_update();
            if fs2.lookup(ROOT_INO, b"b").await.is_ok() {
                return;
            }
            applied.changed().await.unwrap();
        }
    })
    .await;
    assert!(seen.is_ok(), "the rename was not applied");
    assert!(!renaming.is_finished(), "no answer got through yet");
    net.heal(&leader.host, "cli");
    let answer = renaming.await.unwrap().expect("an answer");
    assert!(
        matches!(answer, Ok(nacre_api::meta::Reply::Renamed { .. })),
        "a rename that applied succeeds: {answer:?}"
    );
    assert_eq!(fs.lookup(ROOT_INO, b"b").await.unwrap().ino, a.attr.ino);
    assert!(matches!(
        fs.lookup(ROOT_INO, b"a").await,
        Err(FsError::Meta(nacre_api::meta::MetaError::NotFound))
    ));
    drop(fs2);
    tokio::task::spawn_blocking(move || other.shutdown())
        .await
        .unwrap();
    stop_all(master_stop, metas, cli, master_msgr).await;
}

fn victim_index(host: &str) -> usize {
    host.trim_start_matches("meta").parse().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn partition_leaders_evict_orphans_that_clients_left_behind() {
    use nacre_api::meta::{Command as MetaCommand, Query, Reply};
    use nacre_client::MetaTransport as _;
    let dir = tempfile::tempdir().unwrap();
    let net = MemNetwork::new(32);
    let TestCluster {
        master_msgr,
        master_stop,
        metas,
        cli,
        mc,
        map,
        ..
    } = cluster_with_volume(&net, dir.path(), 1).await;
    let pid = map.volumes["vol"].meta_partitions[0];
    let fs = MetaFs::new(
        NetVolume::connect(cli.client(), mc.clone(), "vol")
            .await
            .unwrap(),
    );
    let f = fs
        .create(ROOT_INO, b"f", &NewInode::file(0o644, 0, 0))
        .await
        .unwrap();
    // A client that died between unlink's steps: the name is gone, nlink reached 0, no eviction.
    let t = fs.transport();
    let delete = MetaCommand::DeleteDentry {
        parent: ROOT_INO,
        name: b"f".to_vec(),
        expect: Some(f.attr.ino),
    };
    t.write(pid, delete).await.unwrap().unwrap();
    t.write(pid, MetaCommand::UnlinkInode { ino: f.attr.ino })
        .await
        .unwrap()
        .unwrap();
    // The partition leader's sweep (grace 0 here) evicts it; every replica applies the eviction, so
    // wait on one node's applied count (bounded).
    let mut applied = metas[0].node.applied().unwrap();
    let evicted = tokio::time::timeout(Duration::from_secs(30), async {
        loop {
            applied.borrow_and_update();
            match t
                .read(pid, Query::Orphans { limit: 0 })
                .await
                .unwrap()
                .unwrap()
            {
                Reply::Inos(v) if v.is_empty() => return,
                _ => applied.changed().await.unwrap(),
            }
        }
    })
    .await
    .is_ok();
    assert!(evicted, "the orphan was not evicted");
    match t.read(pid, Query::Stats).await.unwrap().unwrap() {
        Reply::Stats(s) => assert_eq!((s.inodes, s.orphans), (1, 0), "only the root is left"),
        other => panic!("{other:?}"),
    }

    stop_all(master_stop, metas, cli, master_msgr).await;
}

/// The partition of `ino` in the volume's map, and the address of its leader.
fn leader_of(map: &ClusterMap, ino: Ino) -> String {
    let (_, p) = map
        .meta_partitions
        .iter()
        .find(|(_, p)| p.start <= ino.0 && ino.0 < p.end)
        .unwrap();
    map.nodes[&p.leader.unwrap()].addr.clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn changes_written_behind_survive_a_partition_leader_crash() {
    let dir = tempfile::tempdir().unwrap();
    let net = MemNetwork::new(37);
    let TestCluster {
        master_msgr,
        master_stop,
        metas,
        cli,
        mc,
        map,
        ..
    } = cluster_with_volume(&net, dir.path(), 2).await;
    let vol = NetVolume::connect(cli.client(), mc.clone(), "vol")
        .await
        .unwrap();
    let fs = Arc::new(MetaFs::with_write_behind(vol));
    let d = fs
        .create(ROOT_INO, b"d", &NewInode::dir(0o755, 0, 0))
        .await
        .unwrap();
    // Made next to its parent on its own behalf: delegated to this client.
    let e = fs
        .create(d.attr.ino, b"e", &NewInode::dir(0o755, 0, 0))
        .await
        .unwrap()
        .attr
        .ino;

    // 8 tasks make files and directories in `e` (answered at once, applied behind); the leader
    // of e's partition dies in the middle.
    let victim_addr = leader_of(&map, e);
    let (half_tx, mut half_rx) = watch::channel(0usize);
    let mut tasks = Vec::new();
    for t in 0..8 {
        let (fs, half_tx) = (fs.clone(), half_tx.clone());
        tasks.push(tokio::spawn(async move {
            let mut acked: Vec<(Ino, Vec<u8>, Ino)> = Vec::new();
            for i in 0..40 {
                let name = format!("f-{t}-{i}").into_bytes();
                let new = if i % 8 == 0 {
                    NewInode::dir(0o755, 0, 0)
                } else {
                    NewInode::file(0o644, 0, 0)
                };
                match fs.create(e, &name, &new).await {
                    Ok(a) => acked.push((e, name, a.attr.ino)),
                    Err(FsError::Unavailable(_)) => {}
                    Err(err) => panic!("create {name:?}: {err}"),
                }
                half_tx.send_modify(|n| *n += 1);
            }
            acked
        }));
    }
    half_rx.wait_for(|n| *n >= 8 * 40 / 3).await.unwrap();
    let victim = metas
        .iter()
        .position(|m| victim_addr.starts_with(&m.host))
        .unwrap();
    net.isolate(&metas[victim].host);
    let _ = metas[victim].stop.send(true);
    let mut acked = Vec::new();
    for t in tasks {
        acked.extend(t.await.unwrap());
    }
    assert!(
        acked.len() > 8 * 40 / 2,
        "{} creates acknowledged",
        acked.len()
    );
    fs.settle()
        .await
        .expect("every change written behind is applied");

    // Another client finds every acknowledged name, pointing to the inode it was answered with.
    let vol2 = NetVolume::connect(cli.client(), mc.clone(), "vol")
        .await
        .unwrap();
    let other = MetaFs::new(vol2);
    for (parent, name, ino) in &acked {
        let a = other.lookup(*parent, name).await.unwrap_or_else(|err| {
            panic!(
                "acknowledged create of {:?} lost: {err}",
                String::from_utf8_lossy(name)
            )
        });
        assert_eq!(a.ino, *ino);
    }
    // Creates that failed with an unknown outcome (made the synchronous way) may be there too.
    assert!(other.readdir(e, None, 0).await.unwrap().len() >= acked.len());

    net.heal_host(&metas[victim].host);
    stop_all(master_stop, metas, cli, master_msgr).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delegated_directory_is_given_back_to_another_client_that_changes_it() {
    let dir = tempfile::tempdir().unwrap();
    let net = MemNetwork::new(41);
    let TestCluster {
        master_msgr,
        master_stop,
        metas,
        cli,
        mc,
        ..
    } = cluster_with_volume(&net, dir.path(), 1).await;
    let connect = || NetVolume::connect(cli.client(), mc.clone(), "vol");
    let a = MetaFs::with_write_behind(connect().await.unwrap());
    let mut registry = prometheus_client::registry::Registry::default();
    a.register_metrics(&mut registry);
    let b = MetaFs::new(connect().await.unwrap());
    let file = NewInode::file(0o644, 0, 0);
    let dir_ = NewInode::dir(0o755, 0, 0);
    let d = a.create(ROOT_INO, b"d", &dir_).await.unwrap().attr.ino;
    let e = a.create(d, b"e", &dir_).await.unwrap().attr.ino;
    // Made behind: nobody else can find `e` before this.
    a.settle().await.unwrap();

    // Behind: a file, a directory with a file in it, both removed again, another file.
    a.create(e, b"keep", &file).await.unwrap();
    let sub = a.create(e, b"sub", &dir_).await.unwrap().attr.ino;
    a.create(sub, b"f", &file).await.unwrap();
    assert_eq!(
        a.rmdir(e, b"sub").await,
        Err(FsError::Meta(nacre_api::meta::MetaError::NotEmpty)),
        "known not empty without asking"
    );
    a.unlink(sub, b"f").await.unwrap();
    a.rmdir(e, b"sub").await.unwrap();
    // Answered without the cluster: made while the client is cut off, applied once it is back.
    net.isolate("cli");
    a.create(e, b"x", &file).await.unwrap();
    net.heal_host("cli");
    assert_eq!(
        a.create(e, b"x", &file).await.map(|_| ()),
        Err(FsError::Meta(nacre_api::meta::MetaError::Exists))
    );
    assert_eq!(
        a.lookup_dentry(e, b"nothing").await,
        Err(FsError::Meta(nacre_api::meta::MetaError::NotFound))
    );

    // The other client's change waits for the delegation to be given back (asked for through the
    // partition; far sooner than the delegation would run out), after a's queued changes.
    let started = std::time::Instant::now();
    assert_eq!(
        b.create(e, b"x", &file).await.map(|_| ()),
        Err(FsError::Meta(nacre_api::meta::MetaError::Exists)),
        "a's name, applied before the directory was given back"
    );
    b.create(e, b"y", &file).await.unwrap();
    let waited = started.elapsed();
    assert!(
        waited < Duration::from_nanos(nacre_api::meta::DELEGATION_NS / 2),
        "waited {waited:?}"
    );
    let mut names: Vec<Vec<u8>> = b
        .readdir(e, None, 0)
        .await
        .unwrap()
        .into_iter()
        .map(|x| x.name)
        .collect();
    names.sort();
    assert_eq!(names, vec![b"keep".to_vec(), b"x".to_vec(), b"y".to_vec()]);
    // a no longer answers for `e` by itself: it finds b's name.
    assert_eq!(
        a.create(e, b"y", &file).await.map(|_| ()),
        Err(FsError::Meta(nacre_api::meta::MetaError::Exists))
    );
    a.unlink(e, b"y").await.unwrap();
    a.settle().await.unwrap();
    assert_eq!(
        b.lookup(e, b"y").await.map(|_| ()),
        Err(FsError::Meta(nacre_api::meta::MetaError::NotFound))
    );
    // What the queue did, as Prometheus sees it: `e`, keep, sub, f, its unlink, sub's rmdir and x
    // went behind, and `e` was given back; everything is answered, nothing failed.
    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
    let value = |name: &str| -> u64 {
        text.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
            .unwrap_or_else(|| panic!("no {name} in {text}"))
    };
    assert!(value("nacre_fs_behind_queued_total") >= 8, "{text}");
    assert!(value("nacre_fs_behind_batches_total") >= 1, "{text}");
    assert!(value("nacre_fs_behind_released_total") >= 1, "{text}");
    assert_eq!(value("nacre_fs_behind_failed_total"), 0, "{text}");
    assert_eq!(value("nacre_fs_behind_pending"), 0, "{text}");

    // An owned directory's attributes are its holder's to answer for, so only the holder may
    // set them: another client's chmod waits for it to be given back, and the holder then asks
    // the partition.
    let g = a.create(ROOT_INO, b"g", &dir_).await.unwrap().attr;
    let h = a.create(g.ino, b"h", &dir_).await.unwrap().attr;
    let mode = nacre_api::meta::SetAttr {
        mode: Some(0o700),
        ..nacre_api::meta::SetAttr::default()
    };
    b.setattr(g.ino, mode).await.unwrap();
    assert_eq!(a.getattr(g.ino).await.unwrap().mode & 0o777, 0o700);
    assert_eq!(a.getattr(h.ino).await.unwrap().mode & 0o777, 0o755);
    // ... and answers lookups and getattrs of it without the cluster (the last step here: the
    // cut resets b's connections too).
    let k = a.create(h.ino, b"k", &dir_).await.unwrap().attr;
    let l = a.create(k.ino, b"l", &dir_).await.unwrap().attr;
    net.isolate("cli");
    assert_eq!(a.lookup(k.ino, b"l").await.map(|x| x.ino), Ok(l.ino));
    let seen = a.getattr(k.ino).await.unwrap();
    assert_eq!((seen.nlink, seen.mode & 0o777), (3, 0o755));
    net.heal_host("cli");

    stop_all(master_stop, metas, cli, master_msgr).await;
}

/// A leader whose answers take longer than the client's first wait is not given up: the call
/// tries the other replicas meanwhile (they name the slow leader, which is suspect), and the
/// first attempt's answer is taken when it comes. Without the hedge the call would wait out the
/// leader's suspicion (`SUSPECT_FOR`) and send again, more than twice the delay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_leader_answers_the_call_it_was_first_sent() {
    let dir = tempfile::tempdir().unwrap();
    let net = MemNetwork::new(43);
    let TestCluster {
        master_msgr,
        master_stop,
        metas,
        cli,
        mc,
        map,
        ..
    } = cluster_with_volume(&net, dir.path(), 1).await;
    let vol = NetVolume::connect(cli.client(), mc.clone(), "vol")
        .await
        .unwrap();
    let fs = MetaFs::new(vol);
    // The leader is known to the client before it turns slow.
    fs.create(ROOT_INO, b"a", &NewInode::file(0o644, 0, 0))
        .await
        .unwrap();
    let leader_addr = leader_of(&map, ROOT_INO);
    let leader = metas
        .iter()
        .find(|m| leader_addr.starts_with(&m.host))
        .unwrap();
    let delay = Duration::from_millis(1200);
    assert!(delay > nacre_client::net::FIRST_ATTEMPT);
    net.set_delay(&leader.host, "cli", delay);
    let started = tokio::time::Instant::now();
    fs.create(ROOT_INO, b"b", &NewInode::file(0o644, 0, 0))
        .await
        .unwrap();
    let took = started.elapsed();
    net.heal_all();
    assert!(took >= delay, "answered before the leader could: {took:?}");
    assert!(
        took < delay + nacre_client::net::SUSPECT_FOR,
        "the slow leader's answer waited for its suspicion to end: {took:?}"
    );
    assert!(fs.lookup(ROOT_INO, b"b").await.is_ok());
    stop_all(master_stop, metas, cli, master_msgr).await;
}
