//! RPC behaviour over real TCP on loopback: multiplexing, errors, deadlines, backpressure, shutdown.
#![allow(clippy::unwrap_used)] // test helpers outside #[test] fns

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use bytes::Bytes;
use nacre_msgr::{
    CallOptions, Handler, Messenger, MsgrConfig, MsgrError, Payload, Reply, Request, Router,
    TcpTransport,
};
use nacre_proto::msg::sys::{Echo, EchoRequest, EchoResponse, Ping, PingRequest, PingResponse};
use nacre_proto::msg::{RemoteError, decode_body};
use nacre_proto::{FrameLimits, HEADER_LEN, Op};
use nacre_types::ErrorCode;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::{Notify, Semaphore, oneshot};

struct Server {
    addr: String,
    stop: Option<oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<std::io::Result<()>>,
    msgr: Messenger,
}

impl Server {
    async fn start(config: MsgrConfig, handler: Arc<dyn Handler>) -> Self {
        let msgr = Messenger::new("test-srv", config, Arc::new(TcpTransport)).unwrap();
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let listener = TcpTransport::listener(l);
        let addr = listener.local_addr().unwrap();
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(msgr.serve(listener, handler, async {
            let _ = stopped.await;
        }));
        Self {
            addr,
            stop: Some(stop),
            task,
            msgr,
        }
    }

    async fn stop(mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        (&mut self.task).await.unwrap().unwrap();
        let m = self.msgr.clone();
        tokio::task::spawn_blocking(move || m.shutdown())
            .await
            .unwrap();
    }
}

fn echo_router() -> Router {
    Router::new()
        .route::<Echo, _, _>(|_req, inc| async move { Ok((EchoResponse {}, inc.data)) })
        .route::<Ping, _, _>(|_req, _inc| async move {
            Ok((
                PingResponse {
                    name: "test".into(),
                    version: "0".into(),
                },
                Payload::none(),
            ))
        })
}

fn client_msgr() -> Messenger {
    Messenger::new("test-cli", MsgrConfig::default(), Arc::new(TcpTransport)).unwrap()
}

fn pattern(len: usize, seed: u8) -> Bytes {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn echo_returns_data_unchanged_for_every_size() {
    let srv = Server::start(MsgrConfig::default(), Arc::new(echo_router())).await;
    let cm = client_msgr();
    let client = cm.client();
    for len in [0, 1, 4096, 65536, 1 << 20, 8 << 20] {
        let data = pattern(len, 7);
        let (_, got) = client
            .call::<Echo>(&srv.addr, &EchoRequest {}, Payload::new(data.clone()))
            .await
            .unwrap();
        assert_eq!(got.bytes, data, "len {len}");
        assert_eq!(
            got.crc,
            Some(nacre_types::crc32c(&data))
                .filter(|_| len > 0)
                .or(Some(0))
        );
    }
    let (pong, _) = client
        .call::<Ping>(&srv.addr, &PingRequest {}, Payload::none())
        .await
        .unwrap();
    assert_eq!(pong.name, "test");
    srv.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_calls_are_matched_to_their_own_responses() {
    let srv = Server::start(MsgrConfig::default(), Arc::new(echo_router())).await;
    let cm = client_msgr();
    let client = cm.client();
    let mut tasks = Vec::new();
    for i in 0..500u32 {
        let client = client.clone();
        let addr = srv.addr.clone();
        tasks.push(tokio::spawn(async move {
            let data = Bytes::from(i.to_le_bytes().repeat(1 + (i as usize % 300)));
            let (_, got) = client
                .call::<Echo>(&addr, &EchoRequest {}, Payload::new(data.clone()))
                .await
                .unwrap();
            assert_eq!(got.bytes, data);
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    srv.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_op_and_bad_body_are_typed_remote_errors() {
    let srv = Server::start(MsgrConfig::default(), Arc::new(echo_router())).await;
    let cm = client_msgr();
    let client = cm.client();
    let err = client
        .call_raw(
            &srv.addr,
            Op(0x7777),
            Bytes::new(),
            Payload::none(),
            CallOptions::default(),
        )
        .await
        .unwrap_err();
    assert_eq!(err.remote_code(), Some(ErrorCode::UnknownOp), "{err}");
    let router = Router::new().route::<Ping, _, _>(|_r, _i| async move {
        Err::<(PingResponse, Payload), _>(RemoteError::new(ErrorCode::NotLeader, "ask elsewhere"))
    });
    let srv2 = Server::start(MsgrConfig::default(), Arc::new(router)).await;
    let err = client
        .call::<Ping>(&srv2.addr, &PingRequest {}, Payload::none())
        .await
        .unwrap_err();
    match &err {
        MsgrError::Remote { error, .. } => {
            assert_eq!(error.code(), ErrorCode::NotLeader);
            assert_eq!(error.message, "ask elsewhere");
        }
        other => panic!("expected a remote error, got {other}"),
    }
    srv.stop().await;
    srv2.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn body_that_does_not_decode_is_bad_request() {
    // PingResponse has a String field: an invalid length prefix cannot decode.
    #[derive(Debug)]
    struct Strict;
    impl nacre_proto::Rpc for Strict {
        const OP: Op = Op(0x00f0);
        const NAME: &'static str = "strict";
        type Request = PingResponse;
        type Response = PingResponse;
    }
    let router =
        Router::new().route::<Strict, _, _>(|r, _i| async move { Ok((r, Payload::none())) });
    let srv = Server::start(MsgrConfig::default(), Arc::new(router)).await;
    let cm = client_msgr();
    let err = cm
        .client()
        .call_raw(
            &srv.addr,
            Op(0x00f0),
            Bytes::from_static(&[0xff, 0xff, 0xff, 0xff, 0x0f]),
            Payload::none(),
            CallOptions::default(),
        )
        .await
        .unwrap_err();
    assert_eq!(err.remote_code(), Some(ErrorCode::BadRequest), "{err}");
    srv.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_past_its_deadline_times_out_and_the_connection_stays_usable() {
    let gate = Arc::new(Notify::new());
    let g = Arc::clone(&gate);
    let router = Router::new()
        .route::<Ping, _, _>(move |_r, _i| {
            let g = Arc::clone(&g);
            async move {
                g.notified().await;
                Err::<(PingResponse, Payload), _>(RemoteError::new(ErrorCode::Internal, "late"))
            }
        })
        .route::<Echo, _, _>(|_r, inc| async move { Ok((EchoResponse {}, inc.data)) });
    let srv = Server::start(MsgrConfig::default(), Arc::new(router)).await;
    let cm = client_msgr();
    let client = cm.client();
    let opts = CallOptions {
        timeout: Some(Duration::from_millis(50)),
        ..Default::default()
    };
    let err = client
        .call_with::<Ping>(&srv.addr, &PingRequest {}, Payload::none(), opts)
        .await
        .unwrap_err();
    assert!(matches!(err, MsgrError::Timeout { .. }), "{err}");
    // The late answer is dropped; the next call on the same connection gets its own answer.
    gate.notify_waiters();
    let (_, d) = client
        .call::<Echo>(
            &srv.addr,
            &EchoRequest {},
            Payload::new(Bytes::from_static(b"x")),
        )
        .await
        .unwrap();
    assert_eq!(&d.bytes[..], b"x");
    srv.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_connection_and_oversized_request_are_typed_errors() {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap().to_string();
    drop(l);
    let cm = client_msgr();
    let client = cm.client();
    let err = client
        .call::<Ping>(&addr, &PingRequest {}, Payload::none())
        .await
        .unwrap_err();
    assert!(matches!(err, MsgrError::Connect { .. }), "{err}");
    assert!(err.not_sent());
    let big = Bytes::from(vec![0u8; nacre_proto::DEFAULT_MAX_FRAME as usize + 1]);
    let err = client
        .call::<Echo>(&addr, &EchoRequest {}, Payload::new(big))
        .await
        .unwrap_err();
    assert!(matches!(err, MsgrError::TooLarge { .. }), "{err}");
}

/// Counts handlers running at once; each waits for a permit from `gate`.
struct Gated {
    gate: Arc<Semaphore>,
    running: Arc<AtomicUsize>,
    max: Arc<AtomicUsize>,
    arrived: Arc<Notify>,
}

impl Handler for Gated {
    fn call(&self, req: Request) -> nacre_msgr::BoxFuture<'static, Result<Reply, RemoteError>> {
        let (gate, running, max, arrived) = (
            Arc::clone(&self.gate),
            Arc::clone(&self.running),
            Arc::clone(&self.max),
            Arc::clone(&self.arrived),
        );
        Box::pin(async move {
            let now = running.fetch_add(1, Ordering::SeqCst) + 1;
            max.fetch_max(now, Ordering::SeqCst);
            arrived.notify_one();
            gate.acquire()
                .await
                .map_err(|_| RemoteError::new(ErrorCode::Internal, "closed"))?
                .forget();
            running.fetch_sub(1, Ordering::SeqCst);
            Ok(Reply {
                body: Bytes::new(),
                data: req.data,
            })
        })
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_admits_at_most_the_configured_requests_per_connection() {
    let config = MsgrConfig {
        max_inflight_per_conn: 4,
        ..MsgrConfig::default()
    };
    let h = Gated {
        gate: Arc::new(Semaphore::new(0)),
        running: Arc::default(),
        max: Arc::default(),
        arrived: Arc::default(),
    };
    let (gate, running, max, arrived) = (
        Arc::clone(&h.gate),
        Arc::clone(&h.running),
        Arc::clone(&h.max),
        Arc::clone(&h.arrived),
    );
    let srv = Server::start(config, Arc::new(h)).await;
    let cm = client_msgr();
    let client = cm.client();
    let mut calls = Vec::new();
    for _ in 0..20 {
        let (c, a) = (client.clone(), srv.addr.clone());
        calls.push(tokio::spawn(async move {
            c.call_raw(
                &a,
                Op(9),
                Bytes::new(),
                Payload::none(),
                CallOptions::default(),
            )
            .await
        }));
    }
    while running.load(Ordering::SeqCst) < 4 {
        arrived.notified().await;
    }
    assert_eq!(max.load(Ordering::SeqCst), 4);
    // Release one at a time; the server never runs more than four.
    for _ in 0..20 {
        gate.add_permits(1);
    }
    for c in calls {
        c.await.unwrap().unwrap();
    }
    assert_eq!(max.load(Ordering::SeqCst), 4);
    srv.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_answers_inflight_requests_then_stops() {
    let h = Gated {
        gate: Arc::new(Semaphore::new(0)),
        running: Arc::default(),
        max: Arc::default(),
        arrived: Arc::default(),
    };
    let (gate, running, arrived) = (
        Arc::clone(&h.gate),
        Arc::clone(&h.running),
        Arc::clone(&h.arrived),
    );
    let mut srv = Server::start(MsgrConfig::default(), Arc::new(h)).await;
    let addr = srv.addr.clone();
    let cm = client_msgr();
    let client = cm.client();
    let (c, a) = (client.clone(), srv.addr.clone());
    let call = tokio::spawn(async move {
        c.call_raw(
            &a,
            Op(9),
            Bytes::new(),
            Payload::new(Bytes::from_static(b"late")),
            CallOptions::default(),
        )
        .await
    });
    while running.load(Ordering::SeqCst) < 1 {
        arrived.notified().await;
    }
    let _ = srv.stop.take().unwrap().send(());
    gate.add_permits(1);
    let frame = call.await.unwrap().unwrap();
    assert_eq!(&frame.data[..], b"late");
    srv.stop().await;
    // The listener is closed: nothing new is accepted (the old connection may not have noticed the
    // close yet, in which case the call is reset instead).
    let err = client
        .call_raw(
            &addr,
            Op(9),
            Bytes::new(),
            Payload::none(),
            CallOptions::default(),
        )
        .await
        .unwrap_err();
    assert!(
        matches!(err, MsgrError::Connect { .. } | MsgrError::Reset { .. }),
        "{err}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_server_fails_pending_calls_with_reset() {
    let h = Gated {
        gate: Arc::new(Semaphore::new(0)),
        running: Arc::default(),
        max: Arc::default(),
        arrived: Arc::default(),
    };
    let (running, arrived) = (Arc::clone(&h.running), Arc::clone(&h.arrived));
    let srv = Server::start(MsgrConfig::default(), Arc::new(h)).await;
    let cm = client_msgr();
    let client = cm.client();
    let (c, a) = (client.clone(), srv.addr.clone());
    let call = tokio::spawn(async move {
        c.call_raw(
            &a,
            Op(9),
            Bytes::new(),
            Payload::none(),
            CallOptions::default(),
        )
        .await
    });
    while running.load(Ordering::SeqCst) < 1 {
        arrived.notified().await;
    }
    // Stopping the server's workers drops its connections like a crash would.
    let m = srv.msgr.clone();
    tokio::task::spawn_blocking(move || m.shutdown())
        .await
        .unwrap();
    let err = call.await.unwrap().unwrap_err();
    assert!(matches!(err, MsgrError::Reset { .. }), "{err}");
    srv.task.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_on_the_wire_gets_an_error_frame_and_the_server_keeps_serving() {
    let srv = Server::start(MsgrConfig::default(), Arc::new(echo_router())).await;
    for garbage in [
        b"GET / HTTP/1.1\r\nHost: x\r\n\r\n________________________".to_vec(),
        vec![0u8; 100],
        {
            // A valid header announcing a frame far over the limit.
            let mut f = nacre_proto::Frame::new(
                nacre_proto::Kind::Request,
                Op(2),
                1,
                Bytes::new(),
                Bytes::new(),
            );
            f.header.data_len = u32::MAX;
            f.header.encode().to_vec()
        },
    ] {
        let mut s = tokio::net::TcpStream::connect(&srv.addr).await.unwrap();
        s.write_all(&garbage).await.unwrap();
        let mut reply = Vec::new();
        s.read_to_end(&mut reply).await.unwrap();
        let frame = nacre_proto::decode_exact(&reply, FrameLimits::default()).unwrap();
        assert_eq!(frame.header.kind, nacre_proto::Kind::Error);
        let e: RemoteError = decode_body("error", &frame.body).unwrap();
        assert_eq!(e.code(), ErrorCode::BadRequest);
        assert!(e.message.contains("bad frame"), "{}", e.message);
        assert!(reply.len() > HEADER_LEN);
    }
    let cm = client_msgr();
    let (_, d) = cm
        .client()
        .call::<Echo>(
            &srv.addr,
            &EchoRequest {},
            Payload::new(Bytes::from_static(b"ok")),
        )
        .await
        .unwrap();
    assert_eq!(&d.bytes[..], b"ok");
    srv.stop().await;
}

/// One-way frames keep their order whether the sender wrote them itself, wrote part of one and
/// left the rest to the worker, or queued them behind such a rest.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_way_messages_arrive_in_order() {
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<Bytes>();
    let handler =
        move |req: Request| -> nacre_msgr::BoxFuture<'static, Result<Reply, RemoteError>> {
            let _ = tx.send(req.data.bytes);
            Box::pin(async { Ok(Reply::default()) })
        };
    let srv = Server::start(MsgrConfig::default(), Arc::new(handler)).await;
    let cm = client_msgr();
    let client = cm.client();
    let msg = |i: u32| {
        let len = if i % 7 == 3 { 3 << 20 } else { 16 };
        pattern(len, i as u8)
    };
    for i in 0..100u32 {
        client
            .send_oneway(&srv.addr, Op(0x0400), Bytes::new(), Payload::new(msg(i)))
            .await
            .unwrap();
    }
    for i in 0..100u32 {
        assert_eq!(rx.recv().await.unwrap(), msg(i), "message {i}");
    }
    assert!(
        direct_frames(&cm) > 0,
        "small frames on an idle connection go direct"
    );
    srv.stop().await;
}

/// Frames the calling task wrote to the socket itself (the `direct_frames` metric).
fn direct_frames(m: &Messenger) -> u64 {
    let mut reg = prometheus_client::registry::Registry::default();
    m.register_metrics(&mut reg);
    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, &reg).unwrap();
    text.lines()
        .filter(|l| l.starts_with("nacre_msgr_direct_frames_total{"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
        .sum()
}

/// Once a connection is open and its deadline timer armed, callers write their requests to the
/// socket themselves; what the socket does not take at once (large frames, many writers) the
/// connection's worker finishes, and every answer still reaches its own caller.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn callers_write_their_own_frames_and_the_worker_finishes_what_does_not_fit() {
    let srv = Server::start(MsgrConfig::default(), Arc::new(echo_router())).await;
    let cm = client_msgr();
    let client = cm.client();
    for i in 0..20u8 {
        let data = pattern(100, i);
        let (_, got) = client
            .call::<Echo>(&srv.addr, &EchoRequest {}, Payload::new(data.clone()))
            .await
            .unwrap();
        assert_eq!(got.bytes, data);
    }
    // The first call arms the connection's timer through the worker; the others go direct.
    assert_eq!(direct_frames(&cm), 19);
    let mut tasks = Vec::new();
    for i in 0..24u32 {
        let (client, addr) = (client.clone(), srv.addr.clone());
        tasks.push(tokio::spawn(async move {
            let len = if i % 6 == 0 {
                3 << 20
            } else {
                1 + i as usize * 37
            };
            for round in 0..5u8 {
                let data = pattern(len, round.wrapping_add(i as u8));
                let (_, got) = client
                    .call::<Echo>(&addr, &EchoRequest {}, Payload::new(data.clone()))
                    .await
                    .unwrap();
                assert_eq!(got.bytes, data, "call {i} round {round}");
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    srv.stop().await;
}

/// `try_send_oneway` never waits: with no connection open it hands the body back; on an open
/// connection it queues at once, in order with what `send_oneway` queued before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn try_send_oneway_queues_only_on_an_open_connection() {
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<Bytes>();
    let handler =
        move |req: Request| -> nacre_msgr::BoxFuture<'static, Result<Reply, RemoteError>> {
            let _ = tx.send(req.body);
            Box::pin(async { Ok(Reply::default()) })
        };
    let srv = Server::start(MsgrConfig::default(), Arc::new(handler)).await;
    let cm = client_msgr();
    let client = cm.client();
    let first = Bytes::from_static(b"first");
    assert_eq!(
        client.try_send_oneway(&srv.addr, Op(0x0400), first.clone()),
        Err(first.clone()),
        "no connection yet"
    );
    client
        .send_oneway(&srv.addr, Op(0x0400), first.clone(), Payload::none())
        .await
        .unwrap();
    for i in 0..50u32 {
        let body = Bytes::from(i.to_le_bytes().to_vec());
        client.try_send_oneway(&srv.addr, Op(0x0400), body).unwrap();
    }
    assert_eq!(rx.recv().await.unwrap(), first);
    for i in 0..50u32 {
        assert_eq!(
            rx.recv().await.unwrap(),
            Bytes::from(i.to_le_bytes().to_vec())
        );
    }
    srv.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_count_frames_and_bytes_per_worker() {
    let srv = Server::start(MsgrConfig::default(), Arc::new(echo_router())).await;
    let cm = client_msgr();
    let client = cm.client();
    for _ in 0..10 {
        client
            .call::<Echo>(&srv.addr, &EchoRequest {}, Payload::new(pattern(1000, 1)))
            .await
            .unwrap();
    }
    // The client counts a request before it can read its response, so its figures are exact; the
    // server may not have counted its last write yet when the client sees the reply.
    let loads = cm.workers().loads();
    assert_eq!(loads.iter().map(|l| l.frames).sum::<u64>(), 20);
    assert!(loads.iter().map(|l| l.bytes).sum::<u64>() >= 20 * 1000);
    let mut reg = prometheus_client::registry::Registry::default();
    srv.msgr.register_metrics(&mut reg);
    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, &reg).unwrap();
    assert!(text.contains("nacre_msgr_frames_total{worker=\""), "{text}");
    assert!(text.contains("nacre_msgr_connections{worker=\""), "{text}");
    srv.stop().await;
}

/// Every served request is timed and counted per op (named by the router) and result; an op no
/// route serves is labelled by number, its result by the error code.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_time_and_count_served_requests_per_op() {
    let router = Router::new()
        .route::<Echo, _, _>(|_req, inc| async move { Ok((EchoResponse {}, inc.data)) });
    let srv = Server::start(MsgrConfig::default(), Arc::new(router)).await;
    let cm = client_msgr();
    let client = cm.client();
    for _ in 0..3 {
        client
            .call::<Echo>(&srv.addr, &EchoRequest {}, Payload::new(pattern(100, 1)))
            .await
            .unwrap();
    }
    let err = client
        .call::<Ping>(&srv.addr, &PingRequest {}, Payload::none())
        .await
        .unwrap_err();
    assert!(
        matches!(err, MsgrError::Remote { ref error, .. } if error.code == ErrorCode::UnknownOp.as_u32()),
        "{err}"
    );
    // The server records a request before it writes the reply, so the figures are exact here.
    let mut reg = prometheus_client::registry::Registry::default();
    srv.msgr.register_metrics(&mut reg);
    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, &reg).unwrap();
    let ping = <Ping as nacre_proto::msg::Rpc>::OP.0;
    for line in [
        "nacre_msgr_server_seconds_count{op=\"echo\"} 3".to_string(),
        "nacre_msgr_server_requests_total{op=\"echo\",result=\"ok\"} 3".to_string(),
        format!("nacre_msgr_server_seconds_count{{op=\"{ping}\"}} 1"),
        format!("nacre_msgr_server_requests_total{{op=\"{ping}\",result=\"unknown_op\"}} 1"),
    ] {
        assert!(text.lines().any(|l| l == line), "no {line:?} in\n{text}");
    }
    srv.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shorter_deadline_queued_behind_a_longer_one_still_fires_first() {
    let gate = Arc::new(Semaphore::new(0));
    let g = Arc::clone(&gate);
    let router = Router::new().route::<Ping, _, _>(move |_r, _i| {
        let g = Arc::clone(&g);
        async move {
            let _ = g.acquire().await;
            Err::<(PingResponse, Payload), _>(RemoteError::new(ErrorCode::Internal, "late"))
        }
    });
    let srv = Server::start(MsgrConfig::default(), Arc::new(router)).await;
    let cm = client_msgr();
    let client = cm.client();
    let call = |secs: f64| {
        let (c, a) = (client.clone(), srv.addr.clone());
        tokio::spawn(async move {
            let opts = CallOptions {
                timeout: Some(Duration::from_secs_f64(secs)),
                ..Default::default()
            };
            let t = std::time::Instant::now();
            let r = c
                .call_with::<Ping>(&a, &PingRequest {}, Payload::none(), opts)
                .await;
            (r, t.elapsed())
        })
    };
    let long = call(30.0);
    let short = call(0.05);
    let (r, took) = short.await.unwrap();
    assert!(matches!(r, Err(MsgrError::Timeout { .. })), "{r:?}");
    // Far below the long call's 30 s deadline: the connection's timer moved to the earlier one.
    assert!(took < Duration::from_secs(15), "short call took {took:?}");
    gate.add_permits(2);
    let (r, _) = long.await.unwrap();
    assert_eq!(r.unwrap_err().remote_code(), Some(ErrorCode::Internal));
    srv.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn least_connections_policy_spreads_connections_over_workers() {
    let config = MsgrConfig {
        workers: 2,
        assign: nacre_msgr::AssignKind::LeastConnections,
        ..MsgrConfig::default()
    };
    let srv = Server::start(config, Arc::new(echo_router())).await;
    let cfg = MsgrConfig {
        conns_per_peer: 4,
        ..MsgrConfig::default()
    };
    let cm = Messenger::new("test-cli", cfg, Arc::new(TcpTransport)).unwrap();
    let client = cm.client();
    for _ in 0..8 {
        client
            .call::<Ping>(&srv.addr, &PingRequest {}, Payload::none())
            .await
            .unwrap();
    }
    let per_worker: Vec<u64> = srv
        .msgr
        .workers()
        .loads()
        .iter()
        .map(|l| l.connections)
        .collect();
    assert_eq!(per_worker, vec![2, 2]);
    srv.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_byte_budget_bounds_requests_in_flight_on_a_connection() {
    let h = Gated {
        gate: Arc::new(Semaphore::new(0)),
        running: Arc::default(),
        max: Arc::default(),
        arrived: Arc::default(),
    };
    let (gate, running, max, arrived) = (
        Arc::clone(&h.gate),
        Arc::clone(&h.running),
        Arc::clone(&h.max),
        Arc::clone(&h.arrived),
    );
    let srv = Server::start(MsgrConfig::default(), Arc::new(h)).await;
    // Two 64 KiB requests fit in the client's per-connection byte budget; a third must wait.
    let cfg = MsgrConfig {
        max_frame: 64 << 10,
        max_inflight_bytes_per_conn: 128 << 10,
        max_inflight_bytes_total: 1 << 20,
        ..MsgrConfig::default()
    };
    let cm = Messenger::new("test-cli", cfg, Arc::new(TcpTransport)).unwrap();
    let client = cm.client();
    let data = Bytes::from(vec![7u8; 64 << 10]);
    let mut calls = Vec::new();
    for _ in 0..10 {
        let (c, a, d) = (client.clone(), srv.addr.clone(), data.clone());
        calls.push(tokio::spawn(async move {
            c.call_raw(
                &a,
                Op(9),
                Bytes::new(),
                Payload::new(d),
                CallOptions::default(),
            )
            .await
        }));
    }
    while running.load(Ordering::SeqCst) < 2 {
        arrived.notified().await;
    }
    gate.add_permits(10);
    for c in calls {
        assert_eq!(c.await.unwrap().unwrap().data.len(), 64 << 10);
    }
    assert_eq!(max.load(Ordering::SeqCst), 2);
    srv.stop().await;
}
