//! Raft stores on their own threads, talking through the messenger over the in-memory network.
#![allow(clippy::unwrap_used)] // test helpers outside #[test] fns

mod common;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::Kv;
use nacre_msgr::mem::MemNetwork;
use nacre_msgr::{Messenger, MsgrConfig};
use nacre_raft::store::start;
use nacre_raft::{GroupId, LogStore, MemLogStore, NodeConfig, RaftError, RaftHandle, StoreConfig};

struct Node {
    addr: String,
    handle: RaftHandle<Kv>,
    msgr: Messenger,
    stop: tokio::sync::oneshot::Sender<()>,
}

/// Three stores with in-memory logs on hosts `{prefix}1..3`.
async fn cluster(net: &MemNetwork, prefix: &str, config: &StoreConfig) -> BTreeMap<u64, Node> {
    cluster_with(net, prefix, config, |_| Arc::new(MemLogStore::new()), true).await
}

/// Three stores on hosts `{prefix}1..3` whose logs come from `log(id)`; with `know_peers` false they
/// start knowing no peer (as a meta node does before its first partition).
async fn cluster_with(
    net: &MemNetwork,
    prefix: &str,
    config: &StoreConfig,
    log: impl Fn(u64) -> Arc<dyn LogStore>,
    know_peers: bool,
) -> BTreeMap<u64, Node> {
    let n = 3;
    let mut listeners = BTreeMap::new();
    let mut msgrs = BTreeMap::new();
    for id in 1..=n {
        let host = format!("{prefix}{id}");
        let cfg = MsgrConfig {
            workers: 1,
            ..MsgrConfig::default()
        };
        let m = Messenger::new(&host, cfg, Arc::new(net.transport(&host))).unwrap();
        let l = m.transport().bind(&format!("{host}:0")).await.unwrap();
        listeners.insert(id, l);
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
            .filter(|(p, _)| know_peers && **p != id)
            .map(|(p, a)| (*p, a.clone()))
            .collect();
        let handle = start::<Kv>(id, config.clone(), log(id), peers, m.client()).unwrap();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        tokio::spawn(m.serve(l, Arc::new(handle.router()), async {
            let _ = stopped.await;
        }));
        nodes.insert(
            id,
            Node {
                addr: addrs[&id].clone(),
                handle,
                msgr: m,
                stop,
            },
        );
    }
    nodes
}

/// Fires whenever one of `handles` applies log entries (a new leader's no-op included): what a
/// caller waits for between attempts instead of sleeping.
fn progress<'a>(handles: impl IntoIterator<Item = &'a RaftHandle<Kv>>) -> Arc<tokio::sync::Notify> {
    let notify = Arc::new(tokio::sync::Notify::new());
    for h in handles {
        let (mut rx, n) = (h.applied(), notify.clone());
        tokio::spawn(async move {
            while rx.changed().await.is_ok() {
                n.notify_one();
            }
        });
    }
    notify
}

/// Proposes on whichever node leads, following NotLeader hints, until `deadline`.
async fn propose(
    nodes: &BTreeMap<u64, Node>,
    group: GroupId,
    cmd: &str,
    deadline: Instant,
) -> Result<Vec<u8>, RaftError> {
    let moved = progress(nodes.values().map(|n| &n.handle));
    let mut target = *nodes.keys().next().unwrap();
    loop {
        match nodes[&target]
            .handle
            .propose(group, cmd.as_bytes().to_vec())
            .await
        {
            Err(RaftError::NotLeader { leader, .. }) if Instant::now() < deadline => {
                if leader != 0 && leader != target && nodes.contains_key(&leader) {
                    target = leader;
                    continue;
                }
                target = target % nodes.len() as u64 + 1;
                // No leader known yet: wait until some store applies something (an election's
                // no-op), bounded by the deadline.
                let _ = tokio::time::timeout_at(deadline.into(), moved.notified()).await;
            }
            r => return r,
        }
    }
}

/// Stops the nodes' servers and messengers.
async fn shutdown(nodes: BTreeMap<u64, Node>) {
    for n in nodes.into_values() {
        let _ = n.stop.send(());
        let m = n.msgr.clone();
        tokio::task::spawn_blocking(move || m.shutdown())
            .await
            .unwrap();
    }
}

/// Adds group `group` with voters 1..=3 on every node.
async fn add_group_everywhere(nodes: &BTreeMap<u64, Node>, group: GroupId) {
    for n in nodes.values() {
        n.handle
            .add_group(group, &[1, 2, 3], Kv::default())
            .await
            .unwrap();
    }
}

fn fast() -> StoreConfig {
    StoreConfig {
        node: NodeConfig::default(),
        tick_interval: Duration::from_millis(10),
        ..StoreConfig::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stores_elect_replicate_and_serve_linearizable_reads_over_the_messenger() {
    let net = MemNetwork::new(3);
    let nodes = cluster(&net, "n", &fast()).await;
    add_group_everywhere(&nodes, 1).await;
    add_group_everywhere(&nodes, 2).await;
    let deadline = Instant::now() + Duration::from_secs(20);
    for i in 0..50 {
        propose(&nodes, 1, &format!("k{i}={i}"), deadline)
            .await
            .unwrap();
    }
    propose(&nodes, 2, "other=1", deadline).await.unwrap();
    // A read on the leader sees every acknowledged write.
    let mut seen = None;
    for n in nodes.values() {
        if let Ok(len) = n.handle.read(1, |kv: &Kv| kv.map.len()).await {
            seen = Some(len);
        }
    }
    assert_eq!(seen, Some(50));
    shutdown(nodes).await;
}

/// `log_sync_seconds` times every synced log write, on the Raft thread and on the log writer
/// thread: a committed command was synced on a quorum, so the shared histogram counts at least two
/// writes per command.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn synced_log_writes_are_timed() {
    for async_log in [false, true] {
        let net = MemNetwork::new(23);
        let hist = prometheus_client::metrics::histogram::Histogram::new([1e-3, 1.0]);
        let config = StoreConfig {
            async_log,
            log_sync_seconds: Some(hist.clone()),
            ..fast()
        };
        let nodes = cluster(&net, "ls", &config).await;
        add_group_everywhere(&nodes, 1).await;
        let deadline = Instant::now() + Duration::from_secs(20);
        for i in 0..10 {
            propose(&nodes, 1, &format!("k{i}={i}"), deadline)
                .await
                .unwrap();
        }
        let mut reg = prometheus_client::registry::Registry::default();
        reg.register("log_sync_seconds", "test", hist);
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &reg).unwrap();
        let count: u64 = text
            .lines()
            .find_map(|l| l.strip_prefix("log_sync_seconds_count "))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or_else(|| panic!("no count in\n{text}"));
        assert!(
            count >= 20,
            "async_log {async_log}: {count} synced writes timed\n{text}"
        );
        shutdown(nodes).await;
    }
}

/// With the log written on a thread of its own, every replica (leader and followers) still has
/// each command prefetched before it applies it: the read-ahead moved behind the round's log
/// write, not away.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_log_writer_threads_every_replica_prefetches_each_command_before_applying_it() {
    let net = MemNetwork::new(17);
    let config = StoreConfig {
        async_log: true,
        ..fast()
    };
    let nodes = cluster(&net, "pf", &config).await;
    add_group_everywhere(&nodes, 1).await;
    let deadline = Instant::now() + Duration::from_secs(20);
    for i in 0..30 {
        propose(&nodes, 1, &format!("k{i}={i}"), deadline)
            .await
            .unwrap();
    }
    let moved = progress(nodes.values().map(|n| &n.handle));
    for (id, n) in &nodes {
        loop {
            let (len, unprefetched) = n
                .handle
                .local_read(1, |kv: &Kv, _| (kv.map.len(), kv.unprefetched.clone()))
                .await
                .unwrap();
            if len == 30 {
                assert!(
                    unprefetched.is_empty(),
                    "node {id} applied commands it never prefetched: {unprefetched:?}"
                );
                break;
            }
            assert!(Instant::now() < deadline, "node {id} applied {len} of 30");
            let _ = tokio::time::timeout_at(deadline.into(), moved.notified()).await;
        }
    }
    shutdown(nodes).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_isolated_leader_is_replaced_and_the_cluster_keeps_committing() {
    isolated_leader_is_replaced(&fast()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_log_writer_threads_an_isolated_leader_is_replaced() {
    let config = StoreConfig {
        async_log: true,
        early_appends: true,
        ..fast()
    };
    isolated_leader_is_replaced(&config).await;
}

async fn isolated_leader_is_replaced(config: &StoreConfig) {
    let net = MemNetwork::new(4);
    let nodes = cluster(&net, "n", config).await;
    add_group_everywhere(&nodes, 1).await;
    let deadline = Instant::now() + Duration::from_secs(20);
    propose(&nodes, 1, "a=1", deadline).await.unwrap();
    let mut leader = 0;
    for (id, n) in &nodes {
        if n.handle.status().await.unwrap().leaders == 1 {
            leader = *id;
        }
    }
    assert_ne!(leader, 0);
    net.isolate(&format!("n{leader}"));
    let rest: BTreeMap<u64, &Node> = nodes
        .iter()
        .filter(|(id, _)| **id != leader)
        .map(|(id, n)| (*id, n))
        .collect();
    // The majority elects a new leader and commits.
    let moved = progress(rest.values().map(|n| &n.handle));
    let mut committed = false;
    while !committed && Instant::now() < deadline {
        for n in rest.values() {
            if n.handle.propose(1, b"b=2".to_vec()).await.is_ok() {
                committed = true;
                break;
            }
        }
        if !committed {
            // Wait for the election to move (its no-op gets applied), bounded by the deadline.
            let _ = tokio::time::timeout_at(deadline.into(), moved.notified()).await;
        }
    }
    assert!(
        committed,
        "the majority did not commit after the leader was isolated"
    );
    net.heal_host(&format!("n{leader}"));
    shutdown(nodes).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stores_on_raft_engine_restart_with_every_acknowledged_write() {
    restart_with_every_acknowledged_write(&fast()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stores_writing_their_logs_on_a_thread_of_their_own_restart_with_every_acknowledged_write()
{
    let config = StoreConfig {
        async_log: true,
        ..fast()
    };
    restart_with_every_acknowledged_write(&config).await;
}

async fn restart_with_every_acknowledged_write(config: &StoreConfig) {
    let dirs: Vec<tempfile::TempDir> = (0..3).map(|_| tempfile::tempdir().unwrap()).collect();
    let net = MemNetwork::new(5);
    for round in 0..2 {
        let nodes = cluster_with(
            &net,
            &format!("r{round}n"),
            config,
            |id| {
                let log: Arc<dyn LogStore> = Arc::new(
                    nacre_raft::EngineLogStore::open(dirs[id as usize - 1].path()).unwrap(),
                );
                log
            },
            true,
        )
        .await;
        add_group_everywhere(&nodes, 1).await;
        let deadline = Instant::now() + Duration::from_secs(20);
        for i in 0..20 {
            propose(&nodes, 1, &format!("r{round}k{i}=1"), deadline)
                .await
                .unwrap();
        }
        let mut seen = None;
        while seen.is_none() && Instant::now() < deadline {
            for n in nodes.values() {
                if let Ok(len) = n.handle.read(1, |kv: &Kv| kv.map.len()).await {
                    seen = Some(len);
                }
            }
        }
        // The second round sees the first round's writes after restarting from the logs.
        assert_eq!(seen, Some(20 * (round + 1)), "round {round}");
        for n in nodes.into_values() {
            n.handle.stop().await.unwrap();
            let _ = n.stop.send(());
            let m = n.msgr.clone();
            tokio::task::spawn_blocking(move || m.shutdown())
                .await
                .unwrap();
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn peers_added_later_groups_removed_and_local_reads() {
    let net = MemNetwork::new(41);
    let config = fast();
    let nodes = cluster_with(&net, "lp", &config, |_| Arc::new(MemLogStore::new()), false).await;
    let addrs: BTreeMap<u64, String> = nodes.iter().map(|(id, n)| (*id, n.addr.clone())).collect();
    for n in nodes.values() {
        n.handle.add_peers(addrs.clone()).unwrap();
        n.handle
            .add_group(7, &[1, 2, 3], Kv::default())
            .await
            .unwrap();
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    propose(&nodes, 7, "k=v", deadline).await.unwrap();

    // Every replica applies it; a local read shows it (waiting on each store's applied count).
    for n in nodes.values() {
        let mut applied = n.handle.applied();
        let seen = tokio::time::timeout_at(deadline.into(), async {
            loop {
                applied.borrow_and_update();
                let v = n
                    .handle
                    .local_read(7, |kv: &Kv, _leader| kv.map.get("k").cloned())
                    .await
                    .unwrap();
                if v.as_deref() == Some("v") {
                    return;
                }
                applied.changed().await.unwrap();
            }
        })
        .await;
        assert!(
            seen.is_ok(),
            "replica {} never applied the entry",
            n.handle.id()
        );
    }
    let leaders: usize = {
        let mut c = 0;
        for n in nodes.values() {
            if n.handle.local_read(7, |_: &Kv, l| l).await.unwrap() {
                c += 1;
            }
        }
        c
    };
    assert_eq!(leaders, 1);

    for n in nodes.values() {
        n.handle.remove_group(7).await.unwrap();
        assert!(matches!(
            n.handle.propose(7, b"x=y".to_vec()).await,
            Err(RaftError::UnknownGroup(7))
        ));
        assert!(matches!(
            n.handle.remove_group(7).await,
            Err(RaftError::UnknownGroup(7))
        ));
    }
    for (_, n) in nodes {
        let _ = n.stop.send(());
        tokio::task::spawn_blocking(move || n.msgr.shutdown())
            .await
            .unwrap();
    }
}

/// Entries carrying `marker` seen by the logs of one cluster: the first log to write one (the
/// leader's) holds its write until another log has written it too, for at most `patience`.
struct Rendezvous {
    marker: &'static [u8],
    patience: Duration,
    /// Node ids whose log wrote the marker, and whether the first writer's wait ended in time.
    state: std::sync::Mutex<(Vec<u64>, Option<bool>)>,
    cv: std::sync::Condvar,
}

/// Called with a log's node id before each of its writes.
type WriteHook = Arc<dyn Fn(u64, &nacre_raft::LogWrite) + Send + Sync>;

/// A log that calls `hook` with its node id before each write.
struct HookedLog {
    id: u64,
    inner: MemLogStore,
    hook: WriteHook,
}

impl LogStore for HookedLog {
    fn write(&self, write: &nacre_raft::LogWrite, sync: bool) -> Result<(), nacre_raft::LogError> {
        (self.hook)(self.id, write);
        self.inner.write(write, sync)
    }

    fn state(
        &self,
        group: GroupId,
    ) -> Result<Option<nacre_raft::GroupState>, nacre_raft::LogError> {
        self.inner.state(group)
    }

    fn entries(
        &self,
        group: GroupId,
        low: u64,
        high: u64,
        max_size: Option<u64>,
    ) -> Result<Vec<nacre_raft::eraftpb::Entry>, nacre_raft::LogError> {
        self.inner.entries(group, low, high, max_size)
    }

    fn first_index(&self, group: GroupId) -> Result<u64, nacre_raft::LogError> {
        self.inner.first_index(group)
    }

    fn last_index(&self, group: GroupId) -> Result<u64, nacre_raft::LogError> {
        self.inner.last_index(group)
    }

    fn saved_snapshot(
        &self,
        group: GroupId,
    ) -> Result<Option<nacre_raft::eraftpb::Snapshot>, nacre_raft::LogError> {
        self.inner.saved_snapshot(group)
    }

    fn groups(&self) -> Vec<GroupId> {
        self.inner.groups()
    }
}

/// Whether a write carries an entry whose data holds `marker`.
fn carries(write: &nacre_raft::LogWrite, marker: &[u8]) -> bool {
    write.groups.iter().any(|g| {
        g.entries
            .iter()
            .any(|e| e.data.windows(marker.len()).any(|w| w == marker))
    })
}

impl Rendezvous {
    fn before_write(&self, id: u64, write: &nacre_raft::LogWrite) {
        if !carries(write, self.marker) {
            return;
        }
        let mut st = self.state.lock().unwrap();
        let first = st.0.is_empty();
        st.0.push(id);
        self.cv.notify_all();
        if first {
            let (mut st, waited) = self
                .cv
                .wait_timeout_while(st, self.patience, |s| s.0.len() < 2)
                .unwrap();
            st.1 = Some(!waited.timed_out());
        }
    }
}

/// Logs on `hook`.
fn hooked(
    hook: impl Fn(u64, &nacre_raft::LogWrite) + Send + Sync + 'static,
) -> impl Fn(u64) -> Arc<dyn LogStore> {
    let hook: WriteHook = Arc::new(hook);
    move |id| -> Arc<dyn LogStore> {
        Arc::new(HookedLog {
            id,
            inner: MemLogStore::new(),
            hook: hook.clone(),
        })
    }
}

/// With `early_appends`, a leader's new entries go out to the followers before it writes them to
/// its own log, so the three writes overlap. The leader's log here will not finish its write of the marked entry
/// until a follower's log has written it: that happens only if the appends left while the
/// leader's loop was blocked in the write (a frame queued for the loop's own sender task would
/// wait until the write returned).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_sends_its_appends_before_its_log_write_returns() {
    let net = MemNetwork::new(3);
    let meet = Arc::new(Rendezvous {
        marker: b"marked=",
        patience: Duration::from_secs(5),
        state: std::sync::Mutex::new((Vec::new(), None)),
        cv: std::sync::Condvar::new(),
    });
    let m = meet.clone();
    let log = hooked(move |id, w| m.before_write(id, w));
    let config = StoreConfig {
        early_appends: true,
        ..fast()
    };
    let nodes = cluster_with(&net, "w", &config, log, true).await;
    add_group_everywhere(&nodes, 1).await;
    let deadline = Instant::now() + Duration::from_secs(20);
    // Connections up and the leader settled.
    for i in 0..5 {
        propose(&nodes, 1, &format!("warm{i}=1"), deadline)
            .await
            .unwrap();
    }
    propose(&nodes, 1, "marked=1", deadline).await.unwrap();
    let (writers, met) = meet.state.lock().unwrap().clone();
    assert!(writers.len() >= 2, "marked entry written by {writers:?}");
    assert_eq!(
        met,
        Some(true),
        "the first log to write the entry ({}) waited {:?} for a follower's log to write it",
        writers[0],
        meet.patience
    );
    shutdown(nodes).await;
}

/// Holds every log write of an entry carrying `marker` until the test opens the gate (or
/// `patience` runs out, which the test sees).
struct Gate {
    marker: &'static [u8],
    patience: Duration,
    /// (ids of the logs holding a write, open, whether a hold ran out of patience)
    state: std::sync::Mutex<(Vec<u64>, bool, bool)>,
    cv: std::sync::Condvar,
}

impl Gate {
    fn before_write(&self, id: u64, write: &nacre_raft::LogWrite) {
        if !carries(write, self.marker) {
            return;
        }
        let mut st = self.state.lock().unwrap();
        st.0.push(id);
        self.cv.notify_all();
        let (mut st, waited) = self
            .cv
            .wait_timeout_while(st, self.patience, |s| !s.1)
            .unwrap();
        if waited.timed_out() {
            st.2 = true;
        }
    }
}

/// With `async_log`, a store whose log write is stuck still steps messages and answers: the
/// write is the writer thread's, not the Raft thread's. The proposal then completes once the
/// writes are let through, and a restart is not needed for anything written.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_answers_while_its_log_writer_is_held_in_a_write() {
    let net = MemNetwork::new(6);
    let gate = Arc::new(Gate {
        marker: b"held=",
        patience: Duration::from_secs(5),
        state: std::sync::Mutex::new((Vec::new(), false, false)),
        cv: std::sync::Condvar::new(),
    });
    let g = gate.clone();
    let log = hooked(move |id, w| g.before_write(id, w));
    let config = StoreConfig {
        async_log: true,
        early_appends: true,
        ..fast()
    };
    let nodes = Arc::new(cluster_with(&net, "g", &config, log, true).await);
    add_group_everywhere(&nodes, 1).await;
    let deadline = Instant::now() + Duration::from_secs(20);
    for i in 0..5 {
        propose(&nodes, 1, &format!("warm{i}=1"), deadline)
            .await
            .unwrap();
    }
    let ns = nodes.clone();
    let held = tokio::spawn(async move { propose(&ns, 1, "held=1", deadline).await });
    // Wait (bounded) until some log is holding the write.
    let gw = gate.clone();
    let holder = tokio::task::spawn_blocking(move || {
        let st = gw.state.lock().unwrap();
        let (st, _) = gw
            .cv
            .wait_timeout_while(st, Duration::from_secs(5), |s| s.0.is_empty())
            .unwrap();
        st.0.first().copied()
    })
    .await
    .unwrap()
    .expect("no log wrote the held entry");
    let status = tokio::time::timeout(Duration::from_secs(2), nodes[&holder].handle.status()).await;
    assert!(
        matches!(status, Ok(Ok(_))),
        "node {holder} did not answer while its log write was held"
    );
    {
        let mut st = gate.state.lock().unwrap();
        st.1 = true;
        gate.cv.notify_all();
    }
    held.await.unwrap().unwrap();
    assert!(
        !gate.state.lock().unwrap().2,
        "a held write ran out of patience"
    );
    let nodes = Arc::into_inner(nodes).unwrap();
    shutdown(nodes).await;
}

/// A peer cut off is reported down by every store that stops hearing from it, after
/// `peer_timeout_ticks` of silence, and up again with its first message after the heal.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_peer_is_reported_down_and_up_again() {
    let net = MemNetwork::new(9);
    let config = fast();
    let nodes = cluster(&net, "n", &config).await;
    add_group_everywhere(&nodes, 1).await;
    let mut down = nodes[&2].handle.peers_down();
    assert!(down.borrow().is_empty());
    let started = Instant::now();
    net.isolate("n1");
    let limit = Duration::from_secs(10);
    tokio::time::timeout(limit, down.wait_for(|d| d.contains(&1)))
        .await
        .expect("the isolated peer was never reported down")
        .unwrap();
    // Silence counts from the last message heard, which may be up to a tick before the cut.
    let ticks = u32::try_from(config.peer_timeout_ticks).unwrap();
    assert!(
        started.elapsed() >= config.tick_interval * (ticks - 1),
        "reported down before its peer timeout: {:?}",
        started.elapsed()
    );
    assert!(!nodes[&3].handle.peers_down().borrow().contains(&2));
    net.heal_host("n1");
    tokio::time::timeout(limit, down.wait_for(|d| !d.contains(&1)))
        .await
        .expect("the healed peer was never reported up")
        .unwrap();
    shutdown(nodes).await;
}
