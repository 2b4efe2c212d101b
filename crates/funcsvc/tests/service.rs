//! A master and function servers in one process over loopback TCP (the real messenger): servers
//! register and are listed; a `FuncClient` spreads calls over them by least outstanding, rides out
//! the loss of one under a stream of calls with every result byte-identical to an inline run,
//! takes up a server added at run time, and falls back inline (or fails clearly, by policy) once
//! none is left; a corrupt frame sent to `Decompress` comes back as the function's error.
#![allow(clippy::unwrap_used)] // test helpers outside #[test] fns

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use nacre_api::master::RegisterFuncRequest;
use nacre_client::{FuncAt, FuncCallError, FuncClient, FuncClientConfig, FuncPolicy, MasterClient};
use nacre_func::{Call, Codec, EcSpec, Function, Input, Output, apply};
use nacre_funcsvc::{FuncAgentConfig, FuncMetrics, FuncServer, FuncServerConfig, run_func_agent};
use nacre_master::{MASTER_GROUP, Master, MasterConfig, MasterSm};
use nacre_msgr::{Messenger, MsgrConfig, TcpTransport};
use nacre_raft::{LogStore, MemLogStore, StoreConfig};
use nacre_types::NodeId;
use tokio::sync::watch;

/// Bound of every wait on a condition.
const WITHIN: Duration = Duration::from_secs(20);

struct MasterProc {
    msgr: Messenger,
    addr: String,
    epochs: watch::Receiver<u64>,
    stop: watch::Sender<bool>,
}

async fn start_master() -> MasterProc {
    let msgr = Messenger::new("master", MsgrConfig::default(), Arc::new(TcpTransport)).unwrap();
    let l = TcpTransport::listener(tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap());
    let addr = l.local_addr().unwrap();
    let log: Arc<dyn LogStore> = Arc::new(MemLogStore::new());
    let store = StoreConfig {
        tick_interval: Duration::from_millis(20),
        ..StoreConfig::default()
    };
    let raft = nacre_raft::store::start::<MasterSm>(1, store, log, BTreeMap::new(), msgr.client())
        .unwrap();
    let sm = MasterSm::default();
    let epochs = sm.epochs();
    raft.add_group(MASTER_GROUP, &[1], sm).await.unwrap();
    let master = Master::new(
        raft.clone(),
        BTreeMap::from([(1, addr.clone())]),
        msgr.client(),
        MasterConfig::default(),
    );
    let (stop, _) = watch::channel(false);
    let router = raft.router().merge(master.router());
    let mut rx = stop.subscribe();
    tokio::spawn(msgr.serve(l, Arc::new(router), async move {
        let _ = rx.wait_for(|s| *s).await;
    }));
    MasterProc {
        msgr,
        addr,
        epochs,
        stop,
    }
}

struct FuncProc {
    addr: String,
    server: FuncServer,
    msgr: Messenger,
    stop: watch::Sender<bool>,
    serving: tokio::task::JoinHandle<std::io::Result<()>>,
    agent: tokio::task::JoinHandle<()>,
}

impl FuncProc {
    /// Stops serving (calls in flight are answered, then connections close) and heartbeating.
    async fn stop(self) {
        let _ = self.stop.send(true);
        self.serving.await.unwrap().unwrap();
        self.agent.await.unwrap();
        let m = self.msgr.clone();
        tokio::task::spawn_blocking(move || m.shutdown())
            .await
            .unwrap();
    }
}

async fn start_func(name: &str, master: &str) -> FuncProc {
    start_func_bounded(name, master, FuncServerConfig::default().max_inflight).await
}

/// A function server that admits at most `max_inflight` calls at once.
async fn start_func_bounded(name: &str, master: &str, max_inflight: usize) -> FuncProc {
    let msgr = Messenger::new(
        name,
        MsgrConfig {
            workers: 1,
            ..MsgrConfig::default()
        },
        Arc::new(TcpTransport),
    )
    .unwrap();
    let l = TcpTransport::listener(tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap());
    let addr = l.local_addr().unwrap();
    let server = FuncServer::new(
        FuncServerConfig {
            workers: 2,
            max_inflight,
            ..FuncServerConfig::default()
        },
        FuncMetrics::default(),
    );
    let (stop, _) = watch::channel(false);
    let mut rx = stop.subscribe();
    let serving = tokio::spawn(msgr.serve(l, Arc::new(server.router()), async move {
        let _ = rx.wait_for(|s| *s).await;
    }));
    let agent_cfg = FuncAgentConfig {
        register: RegisterFuncRequest {
            addr: addr.clone(),
            zone: "z".into(),
            functions: server.config().functions.clone(),
            capacity: server.config().max_inflight as u32,
        },
        heartbeat_interval: Duration::from_millis(100),
    };
    let mc = MasterClient::new(msgr.client(), vec![master.to_string()]);
    let (id, _) = watch::channel::<Option<NodeId>>(None);
    let mut rx = stop.subscribe();
    let agent = tokio::spawn(run_func_agent(
        mc,
        agent_cfg,
        server.clone(),
        id,
        async move {
            let _ = rx.wait_for(|s| *s).await;
        },
    ));
    FuncProc {
        addr,
        server,
        msgr,
        stop,
        serving,
        agent,
    }
}

/// Waits until the master lists exactly the function servers at `addrs` as up.
async fn listed(mc: &MasterClient, epochs: &mut watch::Receiver<u64>, addrs: &[&str]) {
    let mut want: Vec<String> = addrs.iter().map(|a| a.to_string()).collect();
    want.sort();
    let got = nacre_testkit::until_changed(epochs, WITHIN, || async {
        let view = mc.funcs().await.ok()?;
        let mut have: Vec<String> = view.instances.iter().map(|i| i.addr.clone()).collect();
        have.sort();
        (have == want).then_some(())
    })
    .await;
    assert!(got.is_some(), "the master did not list {want:?}");
}

fn client_msgr(name: &str) -> Messenger {
    Messenger::new(
        name,
        MsgrConfig {
            workers: 1,
            connect_timeout: Duration::from_millis(500),
            ..MsgrConfig::default()
        },
        Arc::new(TcpTransport),
    )
    .unwrap()
}

fn func_client(mc: &MasterClient, fallback_inline: bool) -> FuncClient {
    FuncClient::new(
        mc.clone(),
        FuncClientConfig {
            at: FuncAt::Service,
            policy: FuncPolicy { fallback_inline },
            max_outstanding: 8,
            call_timeout: Duration::from_secs(5),
            // Longer than the test: a stopped server stays skipped.
            suspect_for: Duration::from_secs(60),
            // Refreshed only when a test says so.
            refresh_every: Duration::from_secs(3600),
        },
    )
}

/// Compressible bytes, different for each `i`.
fn block(i: u64) -> Bytes {
    let mut v = format!("block {i}: storage functions as services; ").repeat(200);
    v.push_str(&String::from_utf8_lossy(&nacre_testkit::pattern(i, 64)));
    Bytes::from(v)
}

/// The calls of the stream, cycling through compression, erasure coding and checksums.
fn call_of(i: u64) -> Call {
    match i % 4 {
        0 => Call::Compress {
            codec: Codec::Zstd { level: 1 },
        },
        1 => Call::Compress { codec: Codec::Lz4 },
        2 => Call::EcEncode {
            spec: EcSpec { k: 4, m: 2 },
        },
        _ => Call::Checksum,
    }
}

async fn stop_all(funcs: Vec<FuncProc>, client: Messenger, master: MasterProc) {
    for f in funcs {
        f.stop().await;
    }
    tokio::task::spawn_blocking(move || client.shutdown())
        .await
        .unwrap();
    let _ = master.stop.send(true);
    let m = master.msgr.clone();
    tokio::task::spawn_blocking(move || m.shutdown())
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_spread_fail_over_and_fall_back_inline() {
    let mut master = start_master().await;
    let cm = client_msgr("client");
    let mc = MasterClient::new(cm.client(), vec![master.addr.clone()]);
    let a = start_func("func-a", &master.addr).await;
    let b = start_func("func-b", &master.addr).await;
    listed(&mc, &mut master.epochs, &[&a.addr, &b.addr]).await;

    let fc = func_client(&mc, true);
    let strict = func_client(&mc, false);

    // Sequential calls find both instances idle: the tie goes round-robin, half to each.
    for i in 0..10 {
        let out = fc.compress(Codec::Lz4, block(i)).await.unwrap();
        assert_eq!(fc.decompress(out).await.unwrap(), block(i));
    }
    assert_eq!((a.server.calls(), b.server.calls()), (10, 10));

    // Concurrent calls go to the instance with fewer outstanding.
    let mut set = tokio::task::JoinSet::new();
    for i in 0..16 {
        let fc = fc.clone();
        set.spawn(async move {
            fc.call(call_of(i), Input::Bytes(block(i)))
                .await
                .map(|o| (i, o))
        });
    }
    while let Some(r) = set.join_next().await {
        let (i, out) = r.unwrap().unwrap();
        assert_eq!(out, apply(&call_of(i), Input::Bytes(block(i))).unwrap());
    }
    assert!(
        a.server.calls() > 10 && b.server.calls() > 10,
        "both took concurrent calls"
    );

    // A stream of calls from four tasks; one instance stops in the middle of it.
    let (progress_tx, mut progress) = watch::channel(0u64);
    let progress_tx = Arc::new(progress_tx);
    let mut streams = tokio::task::JoinSet::new();
    for s in 0..4u64 {
        let (fc, progress_tx) = (fc.clone(), progress_tx.clone());
        streams.spawn(async move {
            for n in 0..40u64 {
                let i = 1000 + s * 100 + n;
                let out = fc.call(call_of(i), Input::Bytes(block(i))).await;
                let out = out.map_err(|e| format!("call {i} failed: {e}"))?;
                let want = apply(&call_of(i), Input::Bytes(block(i))).unwrap();
                if out != want {
                    return Err(format!("call {i}: the output differs from an inline run"));
                }
                progress_tx.send_modify(|p| *p += 1);
            }
            Ok::<(), String>(())
        });
    }
    let half_way = nacre_testkit::until_changed(&mut progress, WITHIN, || async {
        (*progress_tx.borrow() >= 40).then_some(())
    })
    .await;
    assert!(half_way.is_some(), "the stream made no progress");
    let before_stop = b.server.calls();
    let a_addr = a.addr.clone();
    a.stop().await;
    while let Some(r) = streams.join_next().await {
        r.unwrap().unwrap();
    }
    assert_eq!(*progress_tx.borrow(), 160, "no call failed");
    // And calls made once it is certainly gone (the stream may have ended first).
    for i in 2000..2010 {
        let out = fc.call(call_of(i), Input::Bytes(block(i))).await.unwrap();
        assert_eq!(out, apply(&call_of(i), Input::Bytes(block(i))).unwrap());
    }
    assert!(b.server.calls() > before_stop, "the survivor took the rest");
    let a_state = fc
        .instances()
        .into_iter()
        .find(|i| i.addr == a_addr)
        .unwrap();
    assert!(a_state.suspect, "the stopped instance is skipped");
    assert_eq!(a_state.outstanding, 0);

    // An instance added at run time takes calls once the refreshed map lists it.
    let c = start_func("func-c", &master.addr).await;
    listed(&mc, &mut master.epochs, &[&a_addr, &b.addr, &c.addr]).await;
    fc.refresh().await.unwrap();
    for i in 0..4 {
        fc.call(Call::Checksum, Input::Bytes(block(i)))
            .await
            .unwrap();
    }
    assert!(c.server.calls() >= 2, "the new instance takes its share");

    // A corrupt frame is the function's error, from the server, never data.
    let mut frame = fc
        .compress(Codec::Zstd { level: 3 }, block(7))
        .await
        .unwrap()
        .to_vec();
    let last = frame.len() - 1;
    frame[last] ^= 0x40;
    let served = b.server.calls() + c.server.calls();
    let err = fc.decompress(Bytes::from(frame.clone())).await.unwrap_err();
    assert!(matches!(err, FuncCallError::Func(_)), "{err}");
    assert_eq!(
        b.server.calls() + c.server.calls(),
        served + 1,
        "served remotely"
    );
    assert_eq!(
        err.to_string(),
        apply(&Call::Decompress, Input::Bytes(Bytes::from(frame)))
            .unwrap_err()
            .to_string(),
        "the same error as inline"
    );

    // Every instance gone: inline by policy, or a clear error naming what was tried.
    strict.refresh().await.unwrap();
    let (b_addr, c_addr) = (b.addr.clone(), c.addr.clone());
    b.stop().await;
    c.stop().await;
    let i = 77;
    let out = fc.call(call_of(i), Input::Bytes(block(i))).await.unwrap();
    assert_eq!(out, apply(&call_of(i), Input::Bytes(block(i))).unwrap());
    let err = strict
        .call(call_of(i), Input::Bytes(block(i)))
        .await
        .unwrap_err();
    match &err {
        FuncCallError::NoInstance { function, tried } => {
            assert_eq!(*function, Function::Compress);
            let tried: Vec<&str> = tried.iter().map(|(a, _)| a.as_str()).collect();
            for addr in [&b_addr, &c_addr] {
                assert!(tried.contains(&addr.as_str()), "{err}");
            }
        }
        other => panic!("expected NoInstance, got {other}"),
    }
    assert!(
        err.to_string()
            .starts_with("no function server could run compress: ")
    );

    stop_all(Vec::new(), cm, master).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_instance_listed_runs_inline_or_fails_by_policy() {
    let master = start_master().await;
    let cm = client_msgr("client");
    let mc = MasterClient::new(cm.client(), vec![master.addr.clone()]);
    let data = block(3);
    let out = func_client(&mc, true)
        .ec_encode(EcSpec { k: 2, m: 1 }, data.clone())
        .await
        .unwrap();
    assert_eq!(
        Output::Stripe(out),
        apply(
            &Call::EcEncode {
                spec: EcSpec { k: 2, m: 1 }
            },
            Input::Bytes(data.clone())
        )
        .unwrap()
    );
    let err = func_client(&mc, false)
        .ec_encode(EcSpec { k: 2, m: 1 }, data)
        .await
        .unwrap_err();
    assert_eq!(
        err.to_string(),
        "no function server could run ec_encode: no instance is up"
    );
    stop_all(Vec::new(), cm, master).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn callers_of_a_busy_server_wait_for_room_instead_of_failing() {
    let mut master = start_master().await;
    let cm = client_msgr("client");
    let mc = MasterClient::new(cm.client(), vec![master.addr.clone()]);
    let f = start_func_bounded("func-one", &master.addr, 1).await;
    listed(&mc, &mut master.epochs, &[&f.addr]).await;
    // Eight calls in flight against a server that admits one, with no inline fallback.
    let strict = func_client(&mc, false);
    let mut set = tokio::task::JoinSet::new();
    for i in 0..64 {
        let fc = strict.clone();
        set.spawn(async move {
            fc.call(call_of(i), Input::Bytes(block(i)))
                .await
                .map(|o| (i, o))
        });
    }
    while let Some(r) = set.join_next().await {
        let (i, out) = r.unwrap().unwrap();
        assert_eq!(out, apply(&call_of(i), Input::Bytes(block(i))).unwrap());
    }
    assert_eq!(f.server.calls(), 64, "every call ran on the server");
    assert!(
        f.server.refused() > 0,
        "the server's bound was never reached"
    );
    assert!(
        strict.instances().iter().all(|i| !i.suspect),
        "a busy server is not suspect"
    );
    stop_all(vec![f], cm, master).await;
}
