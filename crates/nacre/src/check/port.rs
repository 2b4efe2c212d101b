//! Free ports for servers that a test or the check harness starts as separate processes.
//!
//! Such a server is told its address before it starts, so the port is picked, released, and bound
//! again by the child. A port the kernel hands out for `bind(…:0)` comes from the ephemeral range,
//! where any outgoing connection on the machine may take it in that window (CI saw exactly that:
//! `Address already in use`). Ports below the ephemeral range are only ever taken by an explicit
//! bind, so picking there leaves only other explicit binds to race with.
//!
//! A process forked while a probe socket is open (another test thread spawning a child) holds a
//! copy of it until the child execs, so a port just handed out can be in use for that moment.
//! Its test therefore lives in `port_tests.rs`, in the binary's unit tests, where no test forks,
//! and not in the integration tests that share this file.
//!
//! Shared with the integration tests through `#[path]`, so it uses std only.

use std::net::TcpListener;
use std::sync::atomic::{AtomicU32, Ordering};

/// Lowest port handed out: clear of the well-known and most registered service ports.
pub(super) const FLOOR: u32 = 20_000;

/// Where the kernel's ephemeral range starts (Linux default when the sysctl cannot be read).
pub(super) fn ephemeral_start() -> u32 {
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
