//! A multi-process test cluster: 1 master, 3 meta and 3 data nodes as `nacre server` processes on
//! fixed loopback ports (so a restarted node keeps its identity), and a volume on it.

use nacre_master::MasterAdmin as _;
use std::path::Path;
use std::time::{Duration, Instant};

use std::sync::Arc;

use nacre_client::MasterClient;
use nacre_client::NetVolume;
use nacre_master::map::{Command as MapCommand, PartitionStatus, VolumeFuncs};
use nacre_msgr::{Messenger, MsgrConfig, TcpTransport};

use super::{Proc, free_port};

pub fn start_master(addr: &str, dir: &Path) -> Proc {
    start_master_with(addr, dir, &[])
}

/// [`start_master`] with more settings (`NACRE_*` variables), which override its own.
pub fn start_master_with(addr: &str, dir: &Path, more: &[(&str, String)]) -> Proc {
    let mut envs = vec![
        ("NACRE_ROLE", "master".into()),
        ("NACRE_NAME", "master".into()),
        ("NACRE_LISTEN", addr.into()),
        ("NACRE_HTTP_LISTEN", String::new()),
        ("NACRE_DATA_DIR", dir.join("master").display().to_string()),
        ("NACRE_MASTER__TICK_MS", "50".into()),
        ("NACRE_MASTER__DUTY_INTERVAL_MS", "200".into()),
        // No partitions beyond the volume's: the test knows every one.
        ("NACRE_MASTER__MIN_WRITABLE_DATA_PARTITIONS", "0".into()),
        ("NACRE_MASTER__DEFAULT_TENANT", "false".into()),
        ("NACRE_MSGR__WORKERS", "1".into()),
    ];
    envs.retain(|(k, _)| !more.iter().any(|(m, _)| m == k));
    envs.extend(more.iter().cloned());
    Proc::spawn(&envs)
}

pub fn start_node(role: &str, i: usize, addr: &str, master: &str, dir: &Path) -> Proc {
    Proc::spawn(&[
        ("NACRE_ROLE", role.into()),
        ("NACRE_NAME", format!("{role}-{i}")),
        ("NACRE_LISTEN", addr.into()),
        ("NACRE_HTTP_LISTEN", String::new()),
        (
            "NACRE_DATA_DIR",
            dir.join(format!("{role}-{i}")).display().to_string(),
        ),
        ("NACRE_MASTERS", format!("[\"{master}\"]")),
        ("NACRE_HEARTBEAT_MS", "200".into()),
        ("NACRE_MSGR__WORKERS", "1".into()),
    ])
}

/// Waits (bounded) until every data partition of `vol` is read-write with a leader.
pub async fn wait_writable(mc: &MasterClient, volume: &str, within: Duration) {
    let deadline = Instant::now() + within;
    loop {
        let v = mc.volume(volume).await.unwrap();
        if !v.data_partitions.is_empty()
            && v.data_partitions
                .iter()
                .all(|p| p.status == PartitionStatus::Rw && p.leader.is_some())
        {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "data partitions not writable within {within:?}: {:?}",
            v.data_partitions
                .iter()
                .map(|p| (p.spec.id, p.status, p.leader))
                .collect::<Vec<_>>()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Processes of a test cluster; killed on drop.
pub struct Cluster {
    pub master: Proc,
    pub metas: Vec<Proc>,
    pub datas: Vec<Option<Proc>>,
    pub data_addrs: Vec<String>,
    pub master_addr: String,
}

/// One cluster at a time: each is 7 processes on a 2-core machine.
pub static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

pub fn start_cluster(dir: &Path) -> Cluster {
    let master_addr = format!("127.0.0.1:{}", free_port());
    let master = start_master(&master_addr, dir);
    let mut metas: Vec<Proc> = (0..3)
        .map(|i| {
            let a = format!("127.0.0.1:{}", free_port());
            start_node("meta", i, &a, &master_addr, dir)
        })
        .collect();
    let data_addrs: Vec<String> = (0..3)
        .map(|_| format!("127.0.0.1:{}", free_port()))
        .collect();
    let mut datas: Vec<Option<Proc>> = (0..3)
        .map(|i| Some(start_node("data", i, &data_addrs[i], &master_addr, dir)))
        .collect();
    for p in metas.iter_mut().chain(datas.iter_mut().flatten()) {
        p.wait_log("registered with the master", Duration::from_secs(30));
    }
    Cluster {
        master,
        metas,
        datas,
        data_addrs,
        master_addr,
    }
}

pub fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

/// The test's client: a messenger and a master client for the cluster at `master_addr`, with
/// volume `v` created and writable ([`create_volume`]).
pub async fn client_with_volume(master_addr: &str) -> (Messenger, MasterClient) {
    let msgr =
        Messenger::new("test-client", MsgrConfig::default(), Arc::new(TcpTransport)).unwrap();
    let mc = MasterClient::new(msgr.client(), vec![master_addr.to_string()]);
    create_volume(&mc).await;
    (msgr, mc)
}

/// Volume `v` through the test's client.
pub async fn open_volume(msgr: &Messenger, mc: &MasterClient) -> Arc<NetVolume> {
    open_named(msgr, mc, "v").await
}

/// Volume `name` through the test's client.
pub async fn open_named(msgr: &Messenger, mc: &MasterClient, name: &str) -> Arc<NetVolume> {
    Arc::new(
        NetVolume::connect(msgr.client(), mc.clone(), name)
            .await
            .unwrap(),
    )
}

/// Shuts the test's client down (off the runtime: the shutdown blocks).
pub async fn shut_down(msgr: &Messenger) {
    let m = msgr.clone();
    tokio::task::spawn_blocking(move || m.shutdown())
        .await
        .unwrap();
}

/// Creates volume `v` (1 meta partition, 2 data partitions, 3 replicas) and waits until it is
/// writable.
pub async fn create_volume(mc: &MasterClient) {
    // Every node registered, so the master leads: these are answered at once.
    mc.execute(&MapCommand::CreateTenant {
        name: "t".into(),
        access_key: "AK".into(),
        secret_key: "0123456789abcdef".into(),
    })
    .await
    .unwrap();
    create_named(mc, "v", VolumeFuncs::default()).await;
}

/// Creates volume `name` of tenant `t` (made by [`create_volume`]) like `v`, with `funcs`, and
/// waits until it is writable.
pub async fn create_named(mc: &MasterClient, name: &str, funcs: VolumeFuncs) {
    mc.execute(&MapCommand::CreateVolume {
        name: name.into(),
        owner: "t".into(),
        replicas: 3,
        capacity: 0,
        meta_partitions: 1,
        data_partitions: 2,
        inode_step: 1 << 20,
        funcs,
    })
    .await
    .unwrap();
    wait_writable(mc, name, Duration::from_secs(30)).await;
}

/// Every byte of file `ino` through `fs`.
pub async fn read_file(fs: &nacre_client::NetFs, ino: nacre_types::Ino) -> Vec<u8> {
    use nacre_client::{FileSystem, OpenFlags};
    let fh = fs.open(ino, OpenFlags::READ).await.unwrap();
    let mut out = Vec::new();
    loop {
        let b = fs.read(fh, out.len() as u64, 1 << 20).await.unwrap();
        if b.is_empty() {
            break;
        }
        out.extend_from_slice(&b);
    }
    fs.release(fh).await.unwrap();
    out
}

/// `got` is `want`, or how they differ.
pub fn same(got: &[u8], want: &[u8]) -> Result<(), String> {
    if got.len() != want.len() {
        return Err(format!("{} bytes, want {}", got.len(), want.len()));
    }
    match got.iter().zip(want).position(|(a, b)| a != b) {
        Some(i) => Err(format!("first difference at byte {i}")),
        None => Ok(()),
    }
}
