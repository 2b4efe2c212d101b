use std::io::IoSlice;
use std::pin::Pin;
use std::task::Context;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::time::{Instant, timeout};

use super::*;
use crate::transport::Stream;

fn mem(d: DetachedStream) -> MemStream {
    match d {
        DetachedStream::Mem(s) => s,
        other => panic!("expected a memory stream, got {other:?}"),
    }
}

/// Binds a listener on `server`, connects from `client`, and returns (client end, server end).
async fn connected(
    net: &MemNetwork,
    client: &str,
    server: &str,
) -> (MemStream, MemStream, Box<dyn Listener>) {
    let mut l = net
        .transport(server)
        .bind(&format!("{server}:0"))
        .await
        .unwrap();
    let addr = l.local_addr().unwrap();
    let c = mem(net.transport(client).connect(&addr).await.unwrap());
    let (s, peer) = l.accept().await.unwrap();
    assert_eq!(peer, c.local_addr());
    (c, mem(s), l)
}

fn kind<T: fmt::Debug>(r: io::Result<T>) -> io::ErrorKind {
    r.expect_err("expected an error").kind()
}

#[test]
fn mem_stream_is_send_unpin_debug_static() {
    fn check<T: Send + Unpin + fmt::Debug + 'static>() {}
    check::<MemStream>();
    check::<MemNetwork>();
    check::<MemTransport>();
    let _: Box<dyn Transport> = Box::new(MemNetwork::new(0).transport("a"));
}

#[tokio::test]
async fn echo_round_trip_over_connect_and_accept() {
    let net = MemNetwork::new(1);
    let mut l = net.transport("b").bind("b:7000").await.unwrap();
    assert_eq!(l.local_addr().unwrap(), "b:7000");
    let echo = tokio::spawn(async move {
        let (s, _) = l.accept().await.unwrap();
        let mut s = s.attach().unwrap();
        let mut buf = [0u8; 5];
        s.read_exact(&mut buf).await.unwrap();
        s.write_all(&buf).await.unwrap();
    });
    let mut c = net
        .transport("a")
        .connect("b:7000")
        .await
        .unwrap()
        .attach()
        .unwrap();
    c.write_all(b"hello").await.unwrap();
    let mut buf = [0u8; 5];
    c.read_exact(&mut buf).await.unwrap();
    assert_eq!(&buf, b"hello");
    echo.await.unwrap();
    assert!(matches!(&c, Stream::Mem(s) if s.peer_addr() == "b:7000"));
}

#[tokio::test]
async fn large_transfer_applies_backpressure_and_keeps_data_intact() {
    let net = MemNetwork::new(2);
    let (mut c, mut s, _l) = connected(&net, "a", "b").await;
    let data: Vec<u8> = (0..10 * 1024 * 1024u32)
        .map(|i| (i % 251) as u8 ^ (i >> 16) as u8)
        .collect();

    // The first write fills the pipe and no more.
    let n = c.write(&data).await.unwrap();
    assert_eq!(n, PIPE_CAPACITY);
    let mut cx = Context::from_waker(Waker::noop());
    assert!(Pin::new(&mut c).poll_write(&mut cx, b"x").is_pending());

    let rest = data[n..].to_vec();
    let writer = tokio::spawn(async move {
        c.write_all(&rest).await.unwrap();
        c.shutdown().await.unwrap();
        c
    });
    let mut got = Vec::new();
    s.read_to_end(&mut got).await.unwrap();
    assert_eq!(got.len(), data.len());
    assert!(got == data, "transferred bytes differ");
    assert_eq!(net.bytes_delivered("a", "b"), data.len() as u64);
    drop(writer.await.unwrap());
}

#[tokio::test]
async fn vectored_writes_gather_all_slices() {
    let (mut a, mut b) = MemStream::pair();
    assert!(a.is_write_vectored());
    let n = a
        .write_vectored(&[IoSlice::new(b"ab"), IoSlice::new(b""), IoSlice::new(b"cd")])
        .await
        .unwrap();
    assert_eq!(n, 4);
    let mut buf = [0u8; 4];
    b.read_exact(&mut buf).await.unwrap();
    assert_eq!(&buf, b"abcd");
}

#[tokio::test]
async fn shutdown_gives_eof_after_buffered_data_and_keeps_other_direction() {
    let net = MemNetwork::new(3);
    let (mut c, mut s, _l) = connected(&net, "a", "b").await;
    c.write_all(b"abc").await.unwrap();
    c.shutdown().await.unwrap();
    assert_eq!(kind(c.write(b"late").await), io::ErrorKind::BrokenPipe);
    let mut got = Vec::new();
    s.read_to_end(&mut got).await.unwrap();
    assert_eq!(got, b"abc");
    // Half-close: the other direction still works.
    s.write_all(b"back").await.unwrap();
    let mut buf = [0u8; 4];
    c.read_exact(&mut buf).await.unwrap();
    assert_eq!(&buf, b"back");
}

#[tokio::test]
async fn drop_gives_peer_eof_on_read_and_broken_pipe_on_write() {
    let net = MemNetwork::new(4);
    let (mut c, mut s, _l) = connected(&net, "a", "b").await;
    assert_eq!(net.connections("a", "b"), 1);
    c.write_all(b"xyz").await.unwrap();
    drop(c);
    assert_eq!(net.connections("a", "b"), 0);
    let mut got = Vec::new();
    s.read_to_end(&mut got).await.unwrap();
    assert_eq!(got, b"xyz");
    assert_eq!(
        kind(s.write_all(b"anyone?").await),
        io::ErrorKind::BrokenPipe
    );
}

#[tokio::test]
async fn drop_wakes_a_peer_blocked_on_read() {
    let (a, mut b) = MemStream::pair();
    let reader = tokio::spawn(async move { b.read(&mut [0u8; 8]).await.unwrap() });
    tokio::task::yield_now().await;
    drop(a);
    assert_eq!(reader.await.unwrap(), 0);
}

#[tokio::test]
async fn partition_resets_existing_connections_and_refuses_new_until_healed() {
    let net = MemNetwork::new(5);
    let (mut c, mut s, mut lb) = connected(&net, "a", "b").await;
    let la = net.transport("a").bind("a:1").await.unwrap();
    c.write_all(b"before").await.unwrap();

    net.partition("a", "b");
    assert_eq!(net.connections("a", "b"), 0);
    assert_eq!(
        kind(s.read(&mut [0u8; 8]).await),
        io::ErrorKind::ConnectionReset
    );
    assert_eq!(
        kind(c.read(&mut [0u8; 8]).await),
        io::ErrorKind::ConnectionReset
    );
    assert_eq!(kind(c.write(b"x").await), io::ErrorKind::ConnectionReset);
    assert_eq!(kind(s.write(b"x").await), io::ErrorKind::ConnectionReset);
    let b_addr = lb.local_addr().unwrap();
    let a_addr = la.local_addr().unwrap();
    assert_eq!(
        kind(net.transport("a").connect(&b_addr).await),
        io::ErrorKind::TimedOut
    );
    assert_eq!(
        kind(net.transport("b").connect(&a_addr).await),
        io::ErrorKind::TimedOut
    );

    net.heal("a", "b");
    let mut c2 = mem(net.transport("a").connect(&b_addr).await.unwrap());
    let mut s2 = mem(lb.accept().await.unwrap().0);
    c2.write_all(b"after").await.unwrap();
    let mut buf = [0u8; 5];
    s2.read_exact(&mut buf).await.unwrap();
    assert_eq!(&buf, b"after");
    // The reset connection stays dead.
    assert_eq!(kind(c.write(b"x").await), io::ErrorKind::ConnectionReset);
}

#[tokio::test]
async fn partition_wakes_a_blocked_reader() {
    let net = MemNetwork::new(6);
    let (_c, mut s, _l) = connected(&net, "a", "b").await;
    let reader = tokio::spawn(async move { s.read(&mut [0u8; 8]).await });
    tokio::task::yield_now().await;
    net.partition("b", "a");
    assert_eq!(kind(reader.await.unwrap()), io::ErrorKind::ConnectionReset);
}

#[tokio::test]
async fn isolate_cuts_a_host_from_all_others_until_heal_host() {
    let net = MemNetwork::new(7);
    let (ta, tb, tc) = (net.transport("a"), net.transport("b"), net.transport("c"));
    let _la = ta.bind("a:1").await.unwrap();
    let _lb = tb.bind("b:1").await.unwrap();
    let _lc = tc.bind("c:1").await.unwrap();
    let (_c, mut s, _l) = connected(&net, "c", "a").await;

    net.isolate("a");
    assert_eq!(
        kind(s.read(&mut [0u8; 1]).await),
        io::ErrorKind::ConnectionReset
    );
    assert_eq!(kind(ta.connect("b:1").await), io::ErrorKind::TimedOut);
    assert_eq!(kind(tc.connect("a:1").await), io::ErrorKind::TimedOut);
    tb.connect("c:1").await.unwrap();
    // A host can still reach itself.
    ta.connect("a:1").await.unwrap();

    net.heal_host("a");
    ta.connect("b:1").await.unwrap();
    tc.connect("a:1").await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn blackhole_discards_writes_and_leaves_connects_pending() {
    let net = MemNetwork::new(8);
    let (mut c, mut s, l) = connected(&net, "a", "b").await;
    let _la = net.transport("a").bind("a:1").await.unwrap();

    net.blackhole("a", "b");
    c.write_all(b"lost").await.unwrap();
    assert!(
        timeout(Duration::from_secs(60), s.read(&mut [0u8; 8]))
            .await
            .is_err()
    );
    assert_eq!(net.bytes_delivered("a", "b"), 0);
    assert_eq!(net.connections("a", "b"), 1);
    // The reverse direction is untouched.
    s.write_all(b"pong").await.unwrap();
    let mut buf = [0u8; 4];
    c.read_exact(&mut buf).await.unwrap();
    assert_eq!(&buf, b"pong");
    let addr = l.local_addr().unwrap();
    assert!(
        timeout(Duration::from_secs(60), net.transport("a").connect(&addr))
            .await
            .is_err()
    );
    net.transport("b").connect("a:1").await.unwrap();

    net.heal("a", "b");
    c.write_all(b"found").await.unwrap();
    let mut buf = [0u8; 5];
    s.read_exact(&mut buf).await.unwrap();
    assert_eq!(&buf, b"found");
    net.transport("a").connect(&addr).await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn blackhole_never_blocks_writes_even_when_the_pipe_is_full() {
    let net = MemNetwork::new(9);
    let (mut c, _s, _l) = connected(&net, "a", "b").await;
    let big = vec![7u8; PIPE_CAPACITY];
    c.write_all(&big).await.unwrap();
    let blocked = tokio::spawn(async move {
        c.write_all(b"more").await.unwrap();
        c
    });
    tokio::task::yield_now().await;
    assert!(!blocked.is_finished());
    net.blackhole("a", "b");
    let mut c = blocked.await.unwrap();
    c.write_all(&big).await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn delay_defers_readability_by_exactly_the_delay() {
    let net = MemNetwork::new(10);
    let (mut c, mut s, _l) = connected(&net, "a", "b").await;
    let delay = Duration::from_millis(250);
    net.set_delay("a", "b", delay);

    let start = Instant::now();
    c.write_all(b"hi").await.unwrap();
    let mut buf = [0u8; 2];
    assert!(
        timeout(delay - Duration::from_millis(1), s.read(&mut buf))
            .await
            .is_err()
    );
    s.read_exact(&mut buf).await.unwrap();
    assert_eq!(&buf, b"hi");
    assert_eq!(start.elapsed(), delay);

    // The other direction is not delayed.
    let t = Instant::now();
    s.write_all(b"ok").await.unwrap();
    c.read_exact(&mut buf).await.unwrap();
    assert_eq!(t.elapsed(), Duration::ZERO);
}

#[tokio::test(start_paused = true)]
async fn huge_delay_is_capped_instead_of_overflowing() {
    let net = MemNetwork::new(19);
    let (mut c, mut s, _l) = connected(&net, "a", "b").await;
    net.set_delay("a", "b", Duration::MAX);
    c.write_all(b"never").await.unwrap();
    assert!(
        timeout(Duration::from_secs(3600), s.read(&mut [0u8; 5]))
            .await
            .is_err()
    );
}

#[tokio::test(start_paused = true)]
async fn delay_preserves_order_when_lowered() {
    let net = MemNetwork::new(11);
    let (mut c, mut s, _l) = connected(&net, "a", "b").await;
    let start = Instant::now();
    net.set_delay("a", "b", Duration::from_millis(100));
    c.write_all(b"first ").await.unwrap();
    net.set_delay("a", "b", Duration::ZERO);
    c.write_all(b"second").await.unwrap();
    c.shutdown().await.unwrap();
    let mut got = Vec::new();
    s.read_to_end(&mut got).await.unwrap();
    assert_eq!(got, b"first second");
    assert_eq!(start.elapsed(), Duration::from_millis(100));
}

#[tokio::test]
async fn reset_probability_one_resets_and_zero_never_does() {
    let net = MemNetwork::new(12);
    let (mut c, mut s, _l) = connected(&net, "a", "b").await;
    net.set_reset_probability("a", "b", 0.0);
    for _ in 0..1000 {
        c.write_all(b"ok").await.unwrap();
        s.read_exact(&mut [0u8; 2]).await.unwrap();
    }
    net.set_reset_probability("a", "b", 1.0);
    // Only the a -> b direction is affected.
    s.write_all(b"fine").await.unwrap();
    assert_eq!(kind(c.write(b"x").await), io::ErrorKind::ConnectionReset);
    assert_eq!(
        kind(s.read(&mut [0u8; 1]).await),
        io::ErrorKind::ConnectionReset
    );
    assert_eq!(
        kind(c.read(&mut [0u8; 1]).await),
        io::ErrorKind::ConnectionReset
    );
    assert_eq!(net.connections("a", "b"), 0);
}

#[tokio::test]
async fn reset_probability_is_deterministic_for_a_seed() {
    async fn writes_until_reset(seed: u64) -> Vec<usize> {
        let net = MemNetwork::new(seed);
        net.set_reset_probability("a", "b", 0.1);
        let mut out = Vec::new();
        let _l = net.transport("b").bind("b:1").await.unwrap();
        for _ in 0..5 {
            let mut c = mem(net.transport("a").connect("b:1").await.unwrap());
            let mut n = 0;
            while c.write(b"x").await.is_ok() {
                n += 1;
            }
            out.push(n);
        }
        out
    }
    let first = writes_until_reset(42).await;
    assert_eq!(first, writes_until_reset(42).await);
    assert_ne!(first, writes_until_reset(43).await);
}

#[tokio::test]
async fn bind_and_connect_errors() {
    let net = MemNetwork::new(13);
    let tb = net.transport("b");
    let l = tb.bind("b:7000").await.unwrap();
    assert_eq!(kind(tb.bind("b:7000").await), io::ErrorKind::AddrInUse);
    assert_eq!(kind(tb.bind("c:7000").await), io::ErrorKind::InvalidInput);
    assert_eq!(
        kind(tb.bind("b:notaport").await),
        io::ErrorKind::InvalidInput
    );
    assert_eq!(kind(tb.bind("b7000").await), io::ErrorKind::InvalidInput);
    let ta = net.transport("a");
    assert_eq!(
        kind(ta.connect("b:7001").await),
        io::ErrorKind::ConnectionRefused
    );
    assert_eq!(
        kind(ta.connect("nowhere:1").await),
        io::ErrorKind::ConnectionRefused
    );

    // Dropping the listener unbinds the address.
    drop(l);
    assert_eq!(
        kind(ta.connect("b:7000").await),
        io::ErrorKind::ConnectionRefused
    );
    tb.bind("b:7000").await.unwrap();
}

#[tokio::test]
async fn port_zero_allocates_distinct_free_ports() {
    let net = MemNetwork::new(14);
    let tb = net.transport("b");
    let _fixed = tb.bind(&format!("b:{}", LISTEN_PORTS.0)).await.unwrap();
    let l1 = tb.bind("b:0").await.unwrap();
    let l2 = tb.bind("b:0").await.unwrap();
    let (a1, a2) = (l1.local_addr().unwrap(), l2.local_addr().unwrap());
    assert_ne!(a1, a2);
    for a in [&a1, &a2] {
        let (host, port) = parse_addr(a).unwrap();
        assert_eq!(host, "b");
        assert_ne!(port, 0);
        assert_ne!(port, LISTEN_PORTS.0);
    }
}

#[tokio::test]
async fn dropping_a_listener_closes_its_unaccepted_connections() {
    let net = MemNetwork::new(15);
    let l = net.transport("b").bind("b:1").await.unwrap();
    let mut c = mem(net.transport("a").connect("b:1").await.unwrap());
    assert_eq!(net.connections("a", "b"), 1);
    drop(l);
    assert_eq!(net.connections("a", "b"), 0);
    assert_eq!(c.read(&mut [0u8; 1]).await.unwrap(), 0);
    assert_eq!(kind(c.write(b"x").await), io::ErrorKind::BrokenPipe);
}

#[tokio::test]
async fn counters_track_bytes_delivered_and_open_connections() {
    let net = MemNetwork::new(16);
    let (mut c1, mut s1, mut l) = connected(&net, "a", "b").await;
    let addr = l.local_addr().unwrap();
    let c2 = mem(net.transport("a").connect(&addr).await.unwrap());
    let _s2 = l.accept().await.unwrap();
    assert_eq!(net.connections("a", "b"), 2);
    assert_eq!(net.connections("b", "a"), 0);

    c1.write_all(b"12345").await.unwrap();
    s1.write_all(b"678").await.unwrap();
    // Buffered is not delivered.
    assert_eq!(net.bytes_delivered("a", "b"), 0);
    s1.read_exact(&mut [0u8; 5]).await.unwrap();
    c1.read_exact(&mut [0u8; 3]).await.unwrap();
    assert_eq!(net.bytes_delivered("a", "b"), 5);
    assert_eq!(net.bytes_delivered("b", "a"), 3);

    drop(c2);
    assert_eq!(net.connections("a", "b"), 1);
}

#[test]
fn stream_moved_to_another_runtime_mid_connection_still_works() {
    let rt_a = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let net = MemNetwork::new(17);
    let (client, mut server, listener) = rt_a.block_on(async {
        let (mut c, s, l) = connected(&net, "a", "b").await;
        c.write_all(b"in flight").await.unwrap();
        // Leave a stale waker from this runtime behind.
        let mut cx = Context::from_waker(Waker::noop());
        assert!(
            Pin::new(&mut c)
                .poll_read(&mut cx, &mut ReadBuf::new(&mut [0u8; 4]))
                .is_pending()
        );
        (DetachedStream::Mem(c), s, l)
    });

    let other = std::thread::spawn(move || {
        let rt_b = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt_b.block_on(async move {
            let mut c = client.attach().unwrap();
            c.write_all(b"ping").await.unwrap();
            let mut buf = [0u8; 4];
            c.read_exact(&mut buf).await.unwrap();
            assert_eq!(&buf, b"pong");
            c.detach().unwrap()
        })
    });

    rt_a.block_on(async {
        let mut buf = [0u8; 13];
        server.read_exact(&mut buf).await.unwrap();
        assert_eq!(&buf, b"in flightping");
        server.write_all(b"pong").await.unwrap();
    });
    let mut client = mem(other.join().unwrap());
    rt_a.block_on(async {
        client.write_all(b"home").await.unwrap();
        let mut buf = [0u8; 4];
        server.read_exact(&mut buf).await.unwrap();
        assert_eq!(&buf, b"home");
    });
    drop(listener);
}

#[test]
fn delayed_read_moved_to_a_new_runtime_recreates_its_timer() {
    let net = MemNetwork::new(18);
    let paused_rt = || {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .start_paused(true)
            .build()
            .unwrap()
    };
    let rt_a = paused_rt();
    let (client, mut server, listener) = rt_a.block_on(async {
        let (mut c, mut s, l) = connected(&net, "a", "b").await;
        net.set_delay("a", "b", Duration::from_secs(1));
        c.write_all(b"late").await.unwrap();
        // Polls the read (arming a timer in this runtime) but gives up before the delay.
        assert!(
            timeout(Duration::from_millis(10), s.read(&mut [0u8; 4]))
                .await
                .is_err()
        );
        (c, s, l)
    });
    drop(rt_a);

    std::thread::spawn(move || {
        paused_rt().block_on(async move {
            let mut buf = [0u8; 4];
            server.read_exact(&mut buf).await.unwrap();
            assert_eq!(&buf, b"late");
        });
    })
    .join()
    .unwrap();
    drop((client, listener));
}

#[tokio::test]
async fn pair_is_connected_both_ways() {
    let (mut a, mut b) = MemStream::pair();
    a.write_all(b"to b").await.unwrap();
    b.write_all(b"to a").await.unwrap();
    let mut buf = [0u8; 4];
    b.read_exact(&mut buf).await.unwrap();
    assert_eq!(&buf, b"to b");
    a.read_exact(&mut buf).await.unwrap();
    assert_eq!(&buf, b"to a");
    assert_eq!(a.peer_addr(), b.local_addr());
}
