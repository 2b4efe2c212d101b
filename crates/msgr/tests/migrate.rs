//! Live connections moving between workers: by hand at random under load, and by the balancer.
#![allow(clippy::unwrap_used)] // test helpers outside #[test] fns

mod common;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::{BufMut, Bytes, BytesMut};
use nacre_msgr::mem::MemNetwork;
use nacre_msgr::{
    BalanceConfig, BalanceKind, CallOptions, Messenger, MsgrConfig, Payload, Reply, Request,
    TcpTransport, Transport,
};
use nacre_proto::msg::RemoteError;
use nacre_proto::{Kind, Op};

use common::{Setup, teardown};

const ONE_WAY: Op = Op(0x0400);
const CALL: Op = Op(0x0401);

/// What the server saw: one-way sequence numbers per stream in arrival order, and how many times
/// each request id was handled.
#[derive(Default)]
struct Seen {
    streams: Mutex<HashMap<u64, Vec<u64>>>,
    calls: Mutex<HashMap<u64, u32>>,
}

fn two_u64(data: &[u8]) -> (u64, u64) {
    let a = u64::from_le_bytes(data[..8].try_into().unwrap());
    let b = u64::from_le_bytes(data[8..16].try_into().unwrap());
    (a, b)
}

fn message(a: u64, b: u64, pad: usize) -> Bytes {
    let mut m = BytesMut::with_capacity(16 + pad);
    m.put_u64_le(a);
    m.put_u64_le(b);
    m.put_bytes(0x5a, pad);
    m.freeze()
}

fn handler(
    seen: Arc<Seen>,
) -> impl Fn(Request) -> nacre_msgr::BoxFuture<'static, Result<Reply, RemoteError>> + Send + Sync {
    move |req: Request| {
        let (a, b) = two_u64(&req.data.bytes);
        if req.kind == Kind::OneWay {
            seen.streams.lock().unwrap().entry(a).or_default().push(b);
            return Box::pin(async { Ok(Reply::default()) });
        }
        *seen.calls.lock().unwrap().entry(b).or_default() += 1;
        let data = req.data.bytes.clone();
        Box::pin(async move {
            // Every third request finishes later, from a task of its own: its reply comes back
            // to the driver through the channel, possibly after the driver moved.
            if b % 3 == 0 {
                tokio::task::yield_now().await;
            }
            Ok(Reply {
                body: Bytes::new(),
                data: Payload::new(data),
            })
        })
    }
}

/// Four clients (a connection each) send ordered one-way streams and concurrent calls while both
/// ends' connections are moved between three workers at random. Every call is handled once and
/// answered with its own reply; every stream arrives whole and in order.
async fn setup(
    server_t: Arc<dyn Transport>,
    client_t: Arc<dyn Transport>,
    bind: &str,
    cfg: MsgrConfig,
    seen: Arc<Seen>,
) -> Setup {
    common::setup(
        (server_t, client_t),
        bind,
        (cfg.clone(), cfg),
        Arc::new(handler(seen)),
    )
    .await
}

async fn random_migrations_lose_nothing(s: &Setup, seen: &Seen, calls_per_client: u64) {
    const CLIENTS: u64 = 4;
    const STREAM: u64 = 600;
    let done = Arc::new(AtomicBool::new(false));
    let mover = {
        let (server, client, done) = (s.server.clone(), s.client.clone(), Arc::clone(&done));
        tokio::spawn(async move {
            let mut rng = fastrand::Rng::with_seed(44);
            let mut moved = 0u64;
            while !done.load(Ordering::Relaxed) {
                let m = if rng.bool() { &server } else { &client };
                let conns = m.connections();
                if !conns.is_empty() {
                    let c = &conns[rng.usize(..conns.len())];
                    if m.migrate(c.id, rng.usize(..3)) {
                        moved += 1;
                    }
                }
                // Lets the load run between moves; correctness does not depend on when they land.
                for _ in 0..4 {
                    tokio::task::yield_now().await;
                }
            }
            moved
        })
    };
    let mut tasks = Vec::new();
    for c in 0..CLIENTS {
        let client = s.client.client();
        let addr = s.addr.clone();
        tasks.push(tokio::spawn(async move {
            let streamer = {
                let (client, addr) = (client.clone(), addr.clone());
                tokio::spawn(async move {
                    for seq in 0..STREAM {
                        // Some large enough to be written in pieces.
                        let pad = if seq % 10 == 7 { 300_000 } else { 64 };
                        client
                            .send_oneway(
                                &addr,
                                ONE_WAY,
                                Bytes::new(),
                                Payload::new(message(c, seq, pad)),
                            )
                            .await
                            .unwrap();
                    }
                })
            };
            let mut inflight = tokio::task::JoinSet::new();
            for i in 0..calls_per_client {
                let id = c * 1_000_000 + i;
                let (client, addr) = (client.clone(), addr.clone());
                inflight.spawn(async move {
                    let opts = CallOptions {
                        timeout: Some(Duration::from_secs(20)),
                        ..Default::default()
                    };
                    let pad = if i % 10 == 5 { 200_000 } else { 100 };
                    let frame = client
                        .call_raw(
                            &addr,
                            CALL,
                            Bytes::new(),
                            Payload::new(message(c, id, pad)),
                            opts,
                        )
                        .await
                        .unwrap();
                    assert_eq!(two_u64(&frame.data), (c, id), "a reply to another request");
                    assert_eq!(frame.data.len(), 16 + pad);
                });
                if inflight.len() >= 16 {
                    inflight.join_next().await.unwrap().unwrap();
                }
            }
            while let Some(r) = inflight.join_next().await {
                r.unwrap();
            }
            streamer.await.unwrap();
            // A call behind the stream on the same connection: once answered, every one-way
            // frame before it was handled.
            client
                .call_raw(
                    &addr,
                    CALL,
                    Bytes::new(),
                    Payload::new(message(c, c * 1_000_000 + 999_999, 0)),
                    CallOptions::default(),
                )
                .await
                .unwrap();
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    done.store(true, Ordering::Relaxed);
    let moved = mover.await.unwrap();
    assert!(moved >= 10, "only {moved} migrations were asked for");
    assert!(
        s.server.migrations() + s.client.migrations() >= 10,
        "connections moved {} + {} times",
        s.server.migrations(),
        s.client.migrations()
    );
    let calls = seen.calls.lock().unwrap();
    assert_eq!(calls.len() as u64, CLIENTS * (calls_per_client + 1));
    assert!(
        calls.values().all(|&n| n == 1),
        "a request was handled twice"
    );
    let streams = seen.streams.lock().unwrap();
    for c in 0..CLIENTS {
        let got = &streams[&c];
        let want: Vec<u64> = (0..STREAM).collect();
        assert!(
            got == &want,
            "stream {c} arrived as {} frames out of order or with gaps",
            got.len()
        );
    }
}

fn three_workers() -> MsgrConfig {
    MsgrConfig {
        workers: 3,
        ..MsgrConfig::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_migrations_over_tcp_deliver_every_frame_once_and_in_order() {
    let seen = Arc::new(Seen::default());
    let t: Arc<dyn Transport> = Arc::new(TcpTransport);
    let s = setup(
        Arc::clone(&t),
        t,
        "127.0.0.1:0",
        three_workers(),
        Arc::clone(&seen),
    )
    .await;
    random_migrations_lose_nothing(&s, &seen, 1500).await;
    teardown(s).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_migrations_with_dual_workers_deliver_every_frame_once_and_in_order() {
    let seen = Arc::new(Seen::default());
    let t: Arc<dyn Transport> = Arc::new(TcpTransport);
    let cfg = MsgrConfig {
        dual: true,
        ..three_workers()
    };
    let s = setup(Arc::clone(&t), t, "127.0.0.1:0", cfg, Arc::clone(&seen)).await;
    random_migrations_lose_nothing(&s, &seen, 1000).await;
    teardown(s).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_migrations_over_memory_deliver_every_frame_once_and_in_order() {
    let seen = Arc::new(Seen::default());
    let net = MemNetwork::new(3);
    let s = setup(
        Arc::new(net.transport("a")),
        Arc::new(net.transport("b")),
        "a:0",
        three_workers(),
        Arc::clone(&seen),
    )
    .await;
    random_migrations_lose_nothing(&s, &seen, 1000).await;
    teardown(s).await;
}

/// Two busy connections that start on one worker: the balancer moves one of them to the idle
/// worker, and the calls on it carry on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_balancer_moves_a_busy_connection_off_an_overloaded_worker() {
    let seen = Arc::new(Seen::default());
    let t: Arc<dyn Transport> = Arc::new(TcpTransport);
    let cfg = MsgrConfig {
        workers: 2,
        balance: BalanceConfig {
            policy: BalanceKind::Busy,
            interval: Duration::from_millis(50),
            min_busy: 0.05,
            ..BalanceConfig::default()
        },
        ..MsgrConfig::default()
    };
    let s = setup(Arc::clone(&t), t, "127.0.0.1:0", cfg, Arc::clone(&seen)).await;
    // Round-robin assignment: connections 1 and 3 land on worker 0, connection 2 on worker 1.
    let clients: Vec<_> = (0..3).map(|_| s.client.client()).collect();
    for (i, c) in clients.iter().enumerate() {
        c.call_raw(
            &s.addr,
            CALL,
            Bytes::new(),
            Payload::new(message(9, 3_000_000 + i as u64 * 3 + 1, 0)),
            CallOptions::default(),
        )
        .await
        .unwrap();
    }
    let on = |m: &Messenger| -> Vec<usize> { m.connections().iter().map(|c| c.worker).collect() };
    assert_eq!(on(&s.server), [0, 1, 0]);
    let stop = Arc::new(AtomicBool::new(false));
    let mut load = Vec::new();
    for (n, c) in [&clients[0], &clients[2]].into_iter().enumerate() {
        for k in 0..8u64 {
            let (c, addr, stop) = (c.clone(), s.addr.clone(), Arc::clone(&stop));
            load.push(tokio::spawn(async move {
                let mut i = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    let id = 4_000_000 + (n as u64) * 1_000_000 + k * 100_000 + i * 3 + 1;
                    c.call_raw(
                        &addr,
                        CALL,
                        Bytes::new(),
                        Payload::new(message(9, id, 32 << 10)),
                        CallOptions::default(),
                    )
                    .await
                    .unwrap();
                    i += 1;
                }
            }));
        }
    }
    // The balancer's decision, within a bound.
    let _ = tokio::time::timeout(Duration::from_secs(20), s.server.wait_migrations(1)).await;
    stop.store(true, Ordering::Relaxed);
    for l in load {
        l.await.unwrap();
    }
    assert!(s.server.migrations() >= 1, "the balancer moved nothing");
    let busy: Vec<usize> = s
        .server
        .connections()
        .iter()
        .filter(|c| c.id != s.server.connections()[1].id)
        .map(|c| c.worker)
        .collect();
    assert!(
        busy.contains(&0) && busy.contains(&1),
        "busy connections on workers {busy:?}"
    );
    teardown(s).await;
}
