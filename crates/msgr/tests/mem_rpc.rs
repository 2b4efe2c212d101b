//! The messenger over the in-memory transport: the same RPC code, with faults injected between hosts.
#![allow(clippy::unwrap_used)] // test helpers outside #[test] fns

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use nacre_msgr::mem::MemNetwork;
use nacre_msgr::{CallOptions, Messenger, MsgrConfig, MsgrError, Payload, Router};
use nacre_proto::msg::sys::{Echo, EchoRequest, EchoResponse};

struct Cluster {
    net: MemNetwork,
    server: Messenger,
    client: Messenger,
    addr: String,
    stop: tokio::sync::oneshot::Sender<()>,
}

async fn cluster() -> Cluster {
    let net = MemNetwork::new(7);
    let cfg = MsgrConfig {
        workers: 1,
        connect_timeout: Duration::from_millis(200),
        ..MsgrConfig::default()
    };
    let server = Messenger::new("a", cfg.clone(), Arc::new(net.transport("a"))).unwrap();
    let client = Messenger::new("b", cfg, Arc::new(net.transport("b"))).unwrap();
    let listener = server.transport().bind("a:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let router =
        Router::new().route::<Echo, _, _>(|_r, inc| async move { Ok((EchoResponse {}, inc.data)) });
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(server.serve(listener, Arc::new(router), async {
        let _ = stopped.await;
    }));
    Cluster {
        net,
        server,
        client,
        addr,
        stop,
    }
}

async fn echo(c: &nacre_msgr::Client, addr: &str, timeout: Duration) -> Result<Bytes, MsgrError> {
    let opts = CallOptions {
        timeout: Some(timeout),
        ..Default::default()
    };
    c.call_with::<Echo>(
        addr,
        &EchoRequest {},
        Payload::new(Bytes::from_static(b"hello")),
        opts,
    )
    .await
    .map(|(_, d)| d.bytes)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn partition_fails_calls_and_heal_restores_them() {
    let c = cluster().await;
    let client = c.client.client();
    let t = Duration::from_secs(5);
    assert_eq!(&echo(&client, &c.addr, t).await.unwrap()[..], b"hello");
    assert!(c.net.bytes_delivered("b", "a") > 0);

    c.net.partition("a", "b");
    // The open connection is reset; reconnecting is refused while the partition lasts.
    let err = echo(&client, &c.addr, t).await.unwrap_err();
    assert!(
        matches!(err, MsgrError::Reset { .. } | MsgrError::Connect { .. }),
        "{err}"
    );
    let err = echo(&client, &c.addr, t).await.unwrap_err();
    assert!(matches!(err, MsgrError::Connect { .. }), "{err}");

    c.net.heal("a", "b");
    assert_eq!(&echo(&client, &c.addr, t).await.unwrap()[..], b"hello");
    let _ = c.stop.send(());
    let (s, cl) = (c.server.clone(), c.client.clone());
    tokio::task::spawn_blocking(move || {
        cl.shutdown();
        s.shutdown();
    })
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blackholed_link_times_out_at_the_deadline() {
    let c = cluster().await;
    let client = c.client.client();
    assert!(echo(&client, &c.addr, Duration::from_secs(5)).await.is_ok());
    c.net.blackhole("b", "a");
    let err = echo(&client, &c.addr, Duration::from_millis(100))
        .await
        .unwrap_err();
    assert!(matches!(err, MsgrError::Timeout { .. }), "{err}");
    let _ = c.stop.send(());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_are_spread_over_conns_per_peer_connections() {
    let net = MemNetwork::new(1);
    let server = Messenger::new("a", MsgrConfig::default(), Arc::new(net.transport("a"))).unwrap();
    let cfg = MsgrConfig {
        conns_per_peer: 3,
        ..MsgrConfig::default()
    };
    let client = Messenger::new("b", cfg, Arc::new(net.transport("b"))).unwrap();
    let listener = server.transport().bind("a:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let router =
        Router::new().route::<Echo, _, _>(|_r, inc| async move { Ok((EchoResponse {}, inc.data)) });
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let serving = tokio::spawn(server.serve(listener, Arc::new(router), async {
        let _ = stopped.await;
    }));
    let c = client.client();
    for _ in 0..9 {
        echo(&c, &addr, Duration::from_secs(5)).await.unwrap();
    }
    assert_eq!(net.connections("b", "a"), 3);
    let _ = stop.send(());
    serving.await.unwrap().unwrap();
}
