//! Bundles: calls spread over several connections to one peer reach its handler in order, once,
//! through resets of single connections and a peer's garbage on one of them.
#![allow(clippy::unwrap_used)] // test helpers outside #[test] fns

mod common;

use std::collections::HashMap;
use std::io::{Read, Write};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use nacre_msgr::mem::MemNetwork;
use nacre_msgr::{
    CallOptions, Messenger, MsgrConfig, Payload, Reply, Request, TcpTransport, Transport,
};
use nacre_proto::msg::sys::{BundleJoin, BundleJoinOp};
use nacre_proto::msg::{RemoteError, Rpc, encode_body};

use nacre_proto::{Decoder, Frame, FrameLimits, Kind, Op};
use tokio::sync::oneshot;

use common::{Setup, teardown};

const CALL: Op = Op(0x0401);

/// The order in which call numbers reached the handler.
type Seen = Arc<Mutex<Vec<u64>>>;

fn handler(
    seen: Seen,
) -> impl Fn(Request) -> nacre_msgr::BoxFuture<'static, Result<Reply, RemoteError>> + Send + Sync {
    move |req: Request| {
        let k = u64::from_le_bytes(req.data.bytes[..8].try_into().unwrap());
        seen.lock().unwrap().push(k);
        let data = req.data.bytes.clone();
        Box::pin(async move {
            Ok(Reply {
                body: Bytes::new(),
                data: Payload::new(data),
            })
        })
    }
}

async fn setup(
    server_t: Arc<dyn Transport>,
    client_t: Arc<dyn Transport>,
    bind: &str,
    seen: Seen,
) -> Setup {
    let server = MsgrConfig {
        workers: 3,
        ..MsgrConfig::default()
    };
    let client = MsgrConfig {
        workers: 2,
        bundle_conns: 4,
        ..MsgrConfig::default()
    };
    common::setup(
        (server_t, client_t),
        bind,
        (server, client),
        Arc::new(handler(seen)),
    )
    .await
}

fn payload(k: u64) -> Payload {
    let mut b = BytesMut::new();
    b.extend_from_slice(&k.to_le_bytes());
    // Some large enough to take several writes, so connections overtake each other.
    let pad = if k % 9 == 4 { 256 << 10 } else { 100 };
    b.resize(8 + pad, 0x3c);
    Payload::new(b.freeze())
}

/// Makes `n` bundled calls, each started (and so numbered) after the one before, with up to 64 in
/// flight; every call must succeed with its own reply. Returns the client connections open at the
/// end.
async fn ordered_calls(s: &Setup, n: u64) -> usize {
    let client = s.client.client();
    let opts = CallOptions {
        bundled: true,
        timeout: Some(Duration::from_secs(30)),
        ..CallOptions::default()
    };
    let mut inflight = tokio::task::JoinSet::new();
    for k in 0..n {
        let (client, addr) = (client.clone(), s.addr.clone());
        inflight.spawn(async move {
            let f = client
                .call_raw(&addr, CALL, Bytes::new(), payload(k), opts)
                .await
                .unwrap_or_else(|e| panic!("call {k}: {e}"));
            assert_eq!(&f.data[..8], &k.to_le_bytes(), "a reply to another call");
        });
        // The test's runtime has one thread and runs tasks in the order they were spawned: each
        // call takes its number before the next is spawned and polled.
        tokio::task::yield_now().await;
        if inflight.len() >= 64 {
            inflight.join_next().await.unwrap().unwrap();
        }
    }
    while let Some(r) = inflight.join_next().await {
        r.unwrap();
    }
    // Counted while `client` (whose connections close with it) is alive.
    s.client
        .connections()
        .iter()
        .filter(|c| c.side == "client")
        .count()
}

fn assert_in_order_once(seen: &Seen, n: u64) {
    let seen = seen.lock().unwrap();
    let want: Vec<u64> = (0..n).collect();
    if *seen != want {
        let mut counts: HashMap<u64, u32> = HashMap::new();
        for k in seen.iter() {
            *counts.entry(*k).or_default() += 1;
        }
        let twice = counts.values().filter(|&&c| c > 1).count();
        let first_out = seen.windows(2).position(|w| w[1] != w[0] + 1);
        panic!(
            "{} calls handled ({twice} twice); first out of order at position {first_out:?}",
            seen.len()
        );
    }
}

#[tokio::test]
async fn bundled_calls_over_four_connections_reach_the_handler_in_order() {
    let seen = Seen::default();
    let t: Arc<dyn Transport> = Arc::new(TcpTransport);
    let s = setup(Arc::clone(&t), t, "127.0.0.1:0", Arc::clone(&seen)).await;
    let opened = ordered_calls(&s, 3000).await;
    assert_in_order_once(&seen, 3000);
    assert_eq!(opened, 4, "the bundle's connections");
    teardown(s).await;
}

#[tokio::test]
async fn resets_of_single_connections_lose_nothing_and_handle_nothing_twice() {
    let seen = Seen::default();
    let net = MemNetwork::new(11);
    // One write in 400 from the client resets its connection: calls on it go again on others.
    net.set_reset_probability("b", "a", 1.0 / 400.0);
    let s = setup(
        Arc::new(net.transport("a")),
        Arc::new(net.transport("b")),
        "a:0",
        Arc::clone(&seen),
    )
    .await;
    ordered_calls(&s, 2000).await;
    assert_in_order_once(&seen, 2000);
    teardown(s).await;
}

/// A raw connection of a bundle: writes frames, reads whatever comes back.
struct Raw(std::net::TcpStream);

impl Raw {
    fn connect(addr: &str) -> Self {
        let s = std::net::TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        Self(s)
    }

    fn send(&mut self, f: &Frame) {
        self.0.write_all(&f.header.encode()).unwrap();
        self.0.write_all(&f.body).unwrap();
        self.0.write_all(&f.data).unwrap();
    }

    fn join(&mut self, bundle: u64) {
        let j = BundleJoin {
            bundle,
            low: 1,
            skip: 0,
        };
        self.send(&Frame::new(
            Kind::OneWay,
            BundleJoinOp::OP,
            0,
            encode_body(&j),
            Bytes::new(),
        ));
    }

    fn call(&mut self, id: u64, seq: u64, k: u64) {
        let mut f = Frame::new(Kind::Request, CALL, id, Bytes::new(), payload(k).bytes);
        f.header.seq = seq;
        self.send(&f);
    }

    /// Reads frames until one answers `id`; `None` when the connection closes first.
    fn answer(&mut self, id: u64) -> Option<Frame> {
        let mut dec = Decoder::new(FrameLimits {
            max_frame: 16 << 20,
        });
        let mut buf = BytesMut::new();
        let mut chunk = [0u8; 65536];
        loop {
            while let Some(f) = dec.decode(&mut buf).unwrap() {
                if f.header.request_id == id {
                    return Some(f);
                }
            }
            match self.0.read(&mut chunk) {
                Ok(0) | Err(_) => return None,
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_on_one_connection_of_a_bundle_closes_that_connection_only() {
    let seen = Seen::default();
    let t: Arc<dyn Transport> = Arc::new(TcpTransport);
    let s = setup(Arc::clone(&t), t, "127.0.0.1:0", Arc::clone(&seen)).await;
    let addr = s.addr.clone();
    tokio::task::spawn_blocking(move || {
        let mut a = Raw::connect(&addr);
        let mut b = Raw::connect(&addr);
        // A bundle lives while one of its connections does: `b` joins, and is known to have
        // joined (an unnumbered call behind the join is answered), before `a` comes and goes.
        b.join(42);
        b.call(10, 0, 7);
        assert_eq!(&b.answer(10).unwrap().data[..8], &7u64.to_le_bytes());
        a.join(42);
        a.call(1, 1, 100);
        assert_eq!(&a.answer(1).unwrap().data[..8], &100u64.to_le_bytes());
        // Garbage on `a`: the server tells it why and closes it.
        a.0.write_all(&[0xffu8; 64]).unwrap();
        let err = a.answer(0).unwrap();
        assert_eq!(err.header.kind, Kind::Error);
        assert!(
            a.answer(u64::MAX).is_none(),
            "the bad connection stays open"
        );
        // The bundle carries on over `b`, from where it was.
        b.call(2, 2, 101);
        assert_eq!(&b.answer(2).unwrap().data[..8], &101u64.to_le_bytes());
        // A resend of an answered call gets its reply again, and is not handled twice.
        b.call(3, 1, 100);
        assert_eq!(&b.answer(3).unwrap().data[..8], &100u64.to_le_bytes());
    })
    .await
    .unwrap();
    assert_eq!(*seen.lock().unwrap(), [7, 100, 101]);
    teardown(s).await;
}

/// A bundled call its caller drops before it is sent (here: while it waits for in-flight budget)
/// leaves a gap in the sequence; the client tells the peer, and the calls after it go through at
/// once rather than after the receiver's gap timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_dropped_before_it_is_sent_does_not_hold_up_the_bundle() {
    let release = Arc::new(tokio::sync::Notify::new());
    let seen = Seen::default();
    let handler = {
        let (release, seen) = (Arc::clone(&release), Arc::clone(&seen));
        move |req: Request| -> nacre_msgr::BoxFuture<'static, Result<Reply, RemoteError>> {
            let k = u64::from_le_bytes(req.data.bytes[..8].try_into().unwrap());
            seen.lock().unwrap().push(k);
            let release = Arc::clone(&release);
            Box::pin(async move {
                if k == 0 {
                    release.notified().await;
                }
                Ok(Reply::default())
            })
        }
    };
    let server = Messenger::new("srv", MsgrConfig::default(), Arc::new(TcpTransport)).unwrap();
    let client_msgr = Messenger::new(
        "cli",
        MsgrConfig {
            bundle_conns: 2,
            max_inflight_total: 1,
            ..MsgrConfig::default()
        },
        Arc::new(TcpTransport),
    )
    .unwrap();
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let listener = TcpTransport::listener(l);
    let addr = listener.local_addr().unwrap();
    let (stop, stopped) = oneshot::channel::<()>();
    tokio::spawn(server.serve(listener, Arc::new(handler), async {
        let _ = stopped.await;
    }));
    let client = client_msgr.client();
    let opts = CallOptions {
        bundled: true,
        ..CallOptions::default()
    };
    let first = {
        let (client, addr) = (client.clone(), addr.clone());
        tokio::spawn(async move {
            client
                .call_raw(&addr, CALL, Bytes::new(), payload(0), opts)
                .await
        })
    };
    while seen.lock().unwrap().is_empty() {
        tokio::task::yield_now().await;
    }
    // The only in-flight slot is taken: this call waits for budget, and is dropped there.
    let dropped = tokio::time::timeout(
        Duration::from_millis(50),
        client.call_raw(&addr, CALL, Bytes::new(), payload(1), opts),
    )
    .await;
    assert!(
        dropped.is_err(),
        "the call should still be waiting for budget"
    );
    release.notify_one();
    first.await.unwrap().unwrap();
    let started = std::time::Instant::now();
    client
        .call_raw(&addr, CALL, Bytes::new(), payload(2), opts)
        .await
        .unwrap();
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "the call after the gap waited {:?}",
        started.elapsed()
    );
    assert_eq!(*seen.lock().unwrap(), [0, 2]);
    let _ = stop.send(());
    tokio::task::spawn_blocking(move || {
        client_msgr.shutdown();
        server.shutdown();
    })
    .await
    .unwrap();
}
