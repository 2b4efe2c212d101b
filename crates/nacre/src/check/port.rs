//! Free ports for servers that a test or the check harness starts as separate processes.
//!
//! Such a server is told its address before it starts, so the port is picked, released, and bound
//! again by the child. A port the kernel hands out for `bind(…:0)` comes from the ephemeral range,
//! where any outgoing connection on the machine may take it in that window (CI saw exactly that:
//! `Address already in use`). Ports below the ephemeral range are only ever taken by an explicit
//! bind, so picking there leaves only other explicit binds to race with.
//!
//! Shared with the integration tests through `#[path]`, so it uses std only.

use std::net::TcpListener;
use std::sync::atomic::{AtomicU32, Ordering};

/// Lowest port handed out: clear of the well-known and most registered service ports.
const FLOOR: u32 = 20_000;

/// Where the kernel's ephemeral range starts (Linux default when the sysctl cannot be read).
fn ephemeral_start() -> u32 {
    std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse().ok())
        .unwrap_or(32_768)
}

/// Returns a port on `ip` that is free now and outside the ephemeral range when the range leaves
/// room below it; otherwise one the kernel picks. Successive calls in one process never return the
/// same port from the range, and processes start at different places in it.
pub fn free_port(ip: &str) -> std::io::Result<u16> {
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let top = ephemeral_start().min(u32::from(u16::MAX));
    if top > FLOOR + 1_000 {
        let span = top - FLOOR;
        let start = (std::process::id().wrapping_mul(7_919)) % span;
        for _ in 0..span.min(4_096) {
            let k = NEXT.fetch_add(1, Ordering::Relaxed);
            let port = FLOOR + (start + k) % span;
            let Ok(port) = u16::try_from(port) else {
                continue;
            };
            if TcpListener::bind((ip, port)).is_ok() {
                return Ok(port);
            }
        }
    }
    Ok(TcpListener::bind((ip, 0))?.local_addr()?.port())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ports_are_distinct_bindable_and_below_the_ephemeral_range() {
        let top = ephemeral_start();
        let below = top > FLOOR + 1_000;
        // Each port is bound again at once and held, so a port handed out twice, or one that was
        // not free, fails the bind. Outside the ephemeral range only an explicit bind elsewhere
        // on the machine could take it in between; inside it (no room below the range) any
        // outgoing connection could, so the bind is checked only in the first case.
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
}
