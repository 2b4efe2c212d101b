//! Tests of [`super::port`], kept out of `port.rs` (see its module docs).

use std::net::TcpListener;

use super::port::{FLOOR, ephemeral_start, free_port};

#[test]
fn ports_are_distinct_bindable_and_below_the_ephemeral_range() {
    let top = ephemeral_start();
    let below = top > FLOOR + 1_000;
    // Each port is bound again at once and held, so a port handed out twice, or one that was not
    // free, fails the bind. Inside the ephemeral range (no room below it) any outgoing connection
    // could take the port in between, so the bind is checked only outside it.
    let mut held = Vec::new();
    let mut ports = Vec::new();
    for _ in 0..50 {
        let p = free_port("127.0.0.1").expect("a free port");
        if below {
            assert!(u32::from(p) >= FLOOR && u32::from(p) < top, "{p}");
            held.push(TcpListener::bind(("127.0.0.1", p)).expect("the port is free"));
        }
        ports.push(p);
    }
    let mut sorted = ports.clone();
    sorted.sort_unstable();
    sorted.dedup();
    assert_eq!(sorted.len(), ports.len(), "a port was handed out twice");
}
