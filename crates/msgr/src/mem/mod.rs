//! An in-memory network for deterministic one-process cluster tests.
//!
//! A [`MemNetwork`] is a registry of listeners keyed by `host:port` plus a table of link faults between
//! hosts. Each simulated node gets a [`MemTransport`] for its host name; connections are pairs of
//! [`MemStream`]s joined by two bounded byte pipes (one per direction, [`PIPE_CAPACITY`] each), so a
//! reader that falls behind really does stall its writer.
//!
//! # Fault model
//!
//! Faults are set between *hosts* (not addresses) and take effect at once, on existing connections and
//! on new connects alike. "From" is the host that writes (or connects); "to" is the host that reads (or
//! listens).
//!
//! * [`MemNetwork::partition`] (symmetric): every open connection between the two hosts is reset (reads
//!   and writes at both ends fail with [`io::ErrorKind::ConnectionReset`], buffered bytes are lost), and
//!   new connects either way fail at once with [`io::ErrorKind::TimedOut`] — what TCP reports when its
//!   SYNs go unanswered, without making the test wait for it. [`MemNetwork::isolate`] partitions a host
//!   from every other host the network knows.
//! * [`MemNetwork::blackhole`] (directional): writes from `from` to `to` succeed but the bytes vanish,
//!   and connects from `from` to `to` stay pending forever (the caller's own deadline must end them).
//!   Connects the other way still complete: the handshake is not modelled. Healing does not complete
//!   a connect already pending.
//! * [`MemNetwork::set_delay`] (directional): each write becomes readable only once the delay has passed
//!   since it was written. Order is preserved: a write never overtakes an earlier one, even if the delay
//!   is lowered meanwhile. Connects, shutdowns behind no data and resets are not delayed.
//! * [`MemNetwork::set_reset_probability`] (directional): each write resets the connection with the
//!   given probability, drawn from a per-direction generator (`fastrand`) seeded from the network seed
//!   and the connection's sequence number, so a test that connects in a fixed order sees the same resets on
//!   every run.
//! * [`MemNetwork::heal`], [`MemNetwork::heal_host`] and [`MemNetwork::heal_all`] clear faults. Connections
//!   reset by a partition stay dead; callers reconnect.
//!
//! Timing uses [`tokio::time`], so tests can run under `tokio::time::pause()`. A stream holds no runtime
//! resources between polls except an optional timer it recreates on every poll that needs one, which is
//! why it can move between threads and runtimes mid-connection.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::io;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::task::Waker;
use std::time::Duration;

use nacre_types::sync::lock;
use tokio::sync::mpsc;

use crate::transport::{BoxFuture, DetachedStream, Listener, Transport};

/// Bytes one direction of a connection buffers (including bytes still in flight under a delay) before
/// its writer gets `Pending`.
pub const PIPE_CAPACITY: usize = 4 * 1024 * 1024;

/// Writes are appended to the last buffered segment while it is smaller than this, so small writes do
/// not each cost a segment, and a reader that keeps pace frees memory segment by segment.
const SEGMENT_TARGET: usize = 64 * 1024;

/// The longest delay [`MemNetwork::set_delay`] applies: effectively forever, yet far enough from
/// `Instant`'s limits that adding it to the current time cannot overflow.
pub const MAX_DELAY: Duration = Duration::from_secs(30 * 365 * 24 * 3600);

/// Ports handed out for `host:0` binds.
const LISTEN_PORTS: (u16, u16) = (10_000, 32_767);
/// Ports given to the connecting end of a connection (only used in addresses; never bound).
const EPHEMERAL_PORTS: (u16, u16) = (32_768, 60_999);

fn reset_error() -> io::Error {
    io::Error::new(io::ErrorKind::ConnectionReset, "memory connection reset")
}

fn parse_addr(addr: &str) -> io::Result<(&str, u16)> {
    let invalid = || {
        io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("invalid memory address {addr:?}: expected host:port"),
        )
    };
    let (host, port) = addr.rsplit_once(':').ok_or_else(invalid)?;
    if host.is_empty() {
        return Err(invalid());
    }
    let port = port.parse::<u16>().map_err(|_| invalid())?;
    Ok((host, port))
}

/// The generator of one direction of connection `conn_id`: a stream of its own for each (network
/// seed, connection, direction), each value hashed through the generator before the next is mixed
/// in, so that neighbouring connections do not draw shifted copies of one sequence.
fn pipe_rng(seed: u64, conn_id: u64, direction: u64) -> fastrand::Rng {
    let a = fastrand::Rng::with_seed(seed).u64(..);
    let stream = conn_id.wrapping_mul(2).wrapping_add(direction);
    fastrand::Rng::with_seed(fastrand::Rng::with_seed(a ^ stream).u64(..))
}

mod stream;
#[cfg(test)]
mod tests;

pub use stream::MemStream;
use stream::{Backlog, Conn, LinkFaults, Pipe};

#[derive(Debug)]
struct ListenerEntry {
    id: u64,
    backlog: mpsc::UnboundedSender<Backlog>,
}

#[derive(Debug)]
struct ConnRecord {
    /// Host of the connecting end.
    client: String,
    /// Host of the listening end.
    server: String,
    conn: Weak<Conn>,
}

/// Work to do after the network lock is released: waking tasks, and dropping connection handles (which
/// may be the last ones) where no lock can be re-entered.
#[derive(Default)]
struct Deferred {
    wakers: Vec<Waker>,
    conns: Vec<Arc<Conn>>,
}

#[derive(Debug)]
struct NetState {
    /// Every host a transport was made for; [`MemNetwork::isolate`] partitions from these.
    hosts: BTreeSet<String>,
    listeners: BTreeMap<String, ListenerEntry>,
    next_listen_port: BTreeMap<String, u16>,
    next_ephemeral_port: BTreeMap<String, u16>,
    /// Keyed by (from, to). Only unhealthy links are stored.
    links: BTreeMap<(String, String), LinkFaults>,
    /// Open connections: neither end dropped and not reset. Ordered by id so fault changes visit
    /// connections (and wake tasks) in a deterministic order.
    conns: BTreeMap<u64, ConnRecord>,
    /// Keyed by (from, to): bytes read by `to` that `from` wrote.
    delivered: BTreeMap<(String, String), Arc<AtomicU64>>,
    next_id: u64,
}

fn next_port(counters: &mut BTreeMap<String, u16>, host: &str, (lo, hi): (u16, u16)) -> u16 {
    let next = counters.entry(host.to_owned()).or_insert(lo);
    let port = *next;
    *next = if port >= hi { lo } else { port + 1 };
    port
}

impl NetState {
    fn link(&self, from: &str, to: &str) -> LinkFaults {
        self.links
            .get(&(from.to_owned(), to.to_owned()))
            .copied()
            .unwrap_or_default()
    }

    fn counter(&mut self, from: &str, to: &str) -> Arc<AtomicU64> {
        Arc::clone(
            self.delivered
                .entry((from.to_owned(), to.to_owned()))
                .or_default(),
        )
    }

    /// Changes the faults from `from` to `to` and applies them to every open connection at once.
    fn update_link(
        &mut self,
        from: &str,
        to: &str,
        deferred: &mut Deferred,
        change: impl FnOnce(&mut LinkFaults),
    ) {
        let key = (from.to_owned(), to.to_owned());
        let mut faults = self.links.get(&key).copied().unwrap_or_default();
        change(&mut faults);
        if faults.is_healthy() {
            self.links.remove(&key);
        } else {
            self.links.insert(key, faults);
        }
        if faults.partitioned {
            let doomed: Vec<u64> = self
                .conns
                .iter()
                .filter(|(_, r)| {
                    (r.client == from && r.server == to) || (r.client == to && r.server == from)
                })
                .map(|(&id, _)| id)
                .collect();
            for id in doomed {
                if let Some(conn) = self.conns.remove(&id).and_then(|r| r.conn.upgrade()) {
                    conn.reset(&mut deferred.wakers);
                    deferred.conns.push(conn);
                }
            }
        }
        for r in self.conns.values() {
            let Some(conn) = r.conn.upgrade() else {
                continue;
            };
            let directions = [
                (r.client == from && r.server == to, 0),
                (r.server == from && r.client == to, 1),
            ];
            for (matches, pipe) in directions {
                if matches {
                    let mut p = lock(&conn.pipes[pipe]);
                    p.faults = faults;
                    // A writer parked on a full pipe may now be blackholed; let it re-check.
                    deferred.wakers.extend(p.write_waker.take());
                }
            }
            deferred.conns.push(conn);
        }
    }

    fn heal_where(&mut self, deferred: &mut Deferred, pred: impl Fn(&str, &str) -> bool) {
        let keys: Vec<(String, String)> = self
            .links
            .keys()
            .filter(|(f, t)| pred(f, t))
            .cloned()
            .collect();
        for (from, to) in keys {
            self.update_link(&from, &to, deferred, |f| *f = LinkFaults::default());
        }
    }
}

struct NetInner {
    seed: u64,
    state: Mutex<NetState>,
}

/// A simulated network of named hosts. Cheap to clone; clones share the same network.
#[derive(Clone)]
pub struct MemNetwork {
    inner: Arc<NetInner>,
}

impl fmt::Debug for MemNetwork {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let st = lock(&self.inner.state);
        f.debug_struct("MemNetwork")
            .field("seed", &self.inner.seed)
            .field("hosts", &st.hosts)
            .field("listeners", &st.listeners.keys().collect::<Vec<_>>())
            .field("connections", &st.conns.len())
            .field("links", &st.links)
            .finish()
    }
}

enum ConnectPlan {
    Unreachable,
    Blackholed,
    Refused,
    Ready {
        client: MemStream,
        server: MemStream,
        backlog: mpsc::UnboundedSender<Backlog>,
    },
}

impl MemNetwork {
    /// A network with no hosts and no faults; `seed` fixes the outcomes of
    /// [`set_reset_probability`](Self::set_reset_probability).
    pub fn new(seed: u64) -> Self {
        Self {
            inner: Arc::new(NetInner {
                seed,
                state: Mutex::new(NetState {
                    hosts: BTreeSet::new(),
                    listeners: BTreeMap::new(),
                    next_listen_port: BTreeMap::new(),
                    next_ephemeral_port: BTreeMap::new(),
                    links: BTreeMap::new(),
                    conns: BTreeMap::new(),
                    delivered: BTreeMap::new(),
                    next_id: 1,
                }),
            }),
        }
    }

    /// The transport of the node named `host`: it binds only `host:port` addresses, and its
    /// connections originate from `host`.
    pub fn transport(&self, host: &str) -> MemTransport {
        lock(&self.inner.state).hosts.insert(host.to_owned());
        MemTransport {
            net: self.clone(),
            host: host.to_owned(),
        }
    }

    /// Runs `f` under the network lock, then wakes tasks and drops connection handles outside it.
    fn with_state<R>(&self, f: impl FnOnce(&mut NetState, &mut Deferred) -> R) -> R {
        let mut deferred = Deferred::default();
        let r = {
            let mut st = lock(&self.inner.state);
            f(&mut st, &mut deferred)
        };
        deferred.wakers.into_iter().for_each(Waker::wake);
        drop(deferred.conns);
        r
    }

    /// Cuts `a` and `b` apart in both directions: open connections between them are reset, and new
    /// connects either way fail with [`io::ErrorKind::TimedOut`] until healed.
    pub fn partition(&self, a: &str, b: &str) {
        self.with_state(|st, d| {
            st.update_link(a, b, d, |f| f.partitioned = true);
            st.update_link(b, a, d, |f| f.partitioned = true);
        });
    }

    /// Partitions `host` from every other host that has a transport (hosts whose transport is made
    /// later are not cut off).
    pub fn isolate(&self, host: &str) {
        self.with_state(|st, d| {
            let others: Vec<String> = st.hosts.iter().filter(|h| *h != host).cloned().collect();
            for other in others {
                st.update_link(host, &other, d, |f| f.partitioned = true);
                st.update_link(&other, host, d, |f| f.partitioned = true);
            }
        });
    }

    /// Silently drops everything `from` writes to `to` (writes still succeed), and leaves connects from
    /// `from` to `to` pending forever; healing does not complete a connect that is already pending.
    pub fn blackhole(&self, from: &str, to: &str) {
        self.with_state(|st, d| st.update_link(from, to, d, |f| f.blackhole = true));
    }

    /// Makes each later write from `from` to `to` readable only `delay` after it is written.
    /// `Duration::ZERO` removes the delay; delays beyond [`MAX_DELAY`] are capped to it.
    pub fn set_delay(&self, from: &str, to: &str, delay: Duration) {
        let delay = delay.min(MAX_DELAY);
        self.with_state(|st, d| st.update_link(from, to, d, |f| f.delay = delay));
    }

    /// Makes each later write from `from` to `to` reset its connection with probability `p` (clamped
    /// to `[0, 1]`; NaN counts as 0). The failing write returns [`io::ErrorKind::ConnectionReset`] and
    /// delivers nothing.
    pub fn set_reset_probability(&self, from: &str, to: &str, p: f64) {
        let p = if p.is_nan() { 0.0 } else { p.clamp(0.0, 1.0) };
        self.with_state(|st, d| st.update_link(from, to, d, |f| f.reset_probability = p));
    }

    /// Clears every fault between `a` and `b`, both directions.
    pub fn heal(&self, a: &str, b: &str) {
        self.with_state(|st, d| {
            st.heal_where(d, |f, t| (f == a && t == b) || (f == b && t == a));
        });
    }

    /// Clears every fault to or from `host` (undoes [`isolate`](Self::isolate)).
    pub fn heal_host(&self, host: &str) {
        self.with_state(|st, d| st.heal_where(d, |f, t| f == host || t == host));
    }

    /// Clears every fault in the network.
    pub fn heal_all(&self) {
        self.with_state(|st, d| st.heal_where(d, |_, _| true));
    }

    /// Bytes written by `from` that `to` has read (on connections in either orientation). Bytes
    /// blackholed, still buffered, or lost to a reset are not counted.
    pub fn bytes_delivered(&self, from: &str, to: &str) -> u64 {
        lock(&self.inner.state)
            .delivered
            .get(&(from.to_owned(), to.to_owned()))
            .map_or(0, |c| c.load(Ordering::Relaxed))
    }

    /// Connections `from` opened to a listener on `to` that are still open: accepted or waiting in the
    /// backlog, not reset, and neither end dropped.
    pub fn connections(&self, from: &str, to: &str) -> usize {
        lock(&self.inner.state)
            .conns
            .values()
            .filter(|r| r.client == from && r.server == to)
            .count()
    }

    fn bind(&self, host: &str, addr: &str) -> io::Result<MemListener> {
        let (bind_host, port) = parse_addr(addr)?;
        if bind_host != host {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("transport of host {host:?} cannot bind {addr:?}"),
            ));
        }
        let (tx, rx) = mpsc::unbounded_channel();
        let mut st = lock(&self.inner.state);
        let port = if port != 0 {
            port
        } else {
            let span = usize::from(LISTEN_PORTS.1 - LISTEN_PORTS.0) + 1;
            let mut free = None;
            for _ in 0..span {
                let p = next_port(&mut st.next_listen_port, host, LISTEN_PORTS);
                if !st.listeners.contains_key(&format!("{host}:{p}")) {
                    free = Some(p);
                    break;
                }
            }
            free.ok_or_else(|| {
                io::Error::new(
                    io::ErrorKind::AddrNotAvailable,
                    format!("no free memory port on host {host:?}"),
                )
            })?
        };
        let addr = format!("{host}:{port}");
        if st.listeners.contains_key(&addr) {
            return Err(io::Error::new(
                io::ErrorKind::AddrInUse,
                format!("memory address {addr} already in use"),
            ));
        }
        let id = st.next_id;
        st.next_id += 1;
        st.listeners
            .insert(addr.clone(), ListenerEntry { id, backlog: tx });
        drop(st);
        Ok(MemListener {
            net: self.clone(),
            addr,
            id,
            backlog: rx,
        })
    }

    async fn connect(&self, from: &str, addr: &str) -> io::Result<MemStream> {
        let (to, port) = parse_addr(addr)?;
        let target = format!("{to}:{port}");
        let plan = self.with_state(|st, _| {
            let up = st.link(from, to);
            let down = st.link(to, from);
            if up.partitioned || down.partitioned {
                return ConnectPlan::Unreachable;
            }
            if up.blackhole {
                return ConnectPlan::Blackholed;
            }
            let Some(backlog) = st.listeners.get(&target).map(|l| l.backlog.clone()) else {
                return ConnectPlan::Refused;
            };
            let id = st.next_id;
            st.next_id += 1;
            let client_addr = format!(
                "{from}:{}",
                next_port(&mut st.next_ephemeral_port, from, EPHEMERAL_PORTS)
            );
            let seed = self.inner.seed;
            let conn = Arc::new(Conn {
                id,
                net: Arc::downgrade(&self.inner),
                pipes: [
                    Mutex::new(Pipe::new(up, pipe_rng(seed, id, 0))),
                    Mutex::new(Pipe::new(down, pipe_rng(seed, id, 1))),
                ],
                delivered: [st.counter(from, to), st.counter(to, from)],
            });
            st.conns.insert(
                id,
                ConnRecord {
                    client: from.to_owned(),
                    server: to.to_owned(),
                    conn: Arc::downgrade(&conn),
                },
            );
            ConnectPlan::Ready {
                client: MemStream::new(Arc::clone(&conn), 0, client_addr.clone(), target.clone()),
                server: MemStream::new(conn, 1, target.clone(), client_addr),
                backlog,
            }
        });
        let refused = || {
            io::Error::new(
                io::ErrorKind::ConnectionRefused,
                format!("nothing listens on memory address {target}"),
            )
        };
        match plan {
            ConnectPlan::Unreachable => Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!("{from} is partitioned from {to}"),
            )),
            ConnectPlan::Blackholed => std::future::pending().await,
            ConnectPlan::Refused => Err(refused()),
            ConnectPlan::Ready {
                client,
                server,
                backlog,
            } => {
                let peer = client.local_addr.clone();
                // Fails only if the listener closed since the lookup; the returned pair is dropped here,
                // outside the network lock, and deregisters itself.
                match backlog.send((server, peer)) {
                    Ok(()) => Ok(client),
                    Err(_) => Err(refused()),
                }
            }
        }
    }
}

/// The [`Transport`] of one host on a [`MemNetwork`].
#[derive(Clone, Debug)]
pub struct MemTransport {
    net: MemNetwork,
    host: String,
}

impl MemTransport {
    /// The host this transport binds and connects as.
    pub fn host(&self) -> &str {
        &self.host
    }

    /// The network this transport belongs to.
    pub fn network(&self) -> &MemNetwork {
        &self.net
    }
}

impl Transport for MemTransport {
    fn bind<'a>(&'a self, addr: &'a str) -> BoxFuture<'a, io::Result<Box<dyn Listener>>> {
        Box::pin(async move {
            let l = self.net.bind(&self.host, addr)?;
            Ok(Box::new(l) as Box<dyn Listener>)
        })
    }

    fn connect<'a>(&'a self, addr: &'a str) -> BoxFuture<'a, io::Result<DetachedStream>> {
        Box::pin(async move {
            self.net
                .connect(&self.host, addr)
                .await
                .map(DetachedStream::Mem)
        })
    }
}

/// A bound memory address. Dropping it unbinds the address and closes connections still in its
/// backlog (their connecting ends read EOF).
struct MemListener {
    net: MemNetwork,
    addr: String,
    id: u64,
    backlog: mpsc::UnboundedReceiver<Backlog>,
}

impl fmt::Debug for MemListener {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemListener")
            .field("addr", &self.addr)
            .finish_non_exhaustive()
    }
}

impl Listener for MemListener {
    fn local_addr(&self) -> io::Result<String> {
        Ok(self.addr.clone())
    }

    fn accept(&mut self) -> BoxFuture<'_, io::Result<(DetachedStream, String)>> {
        Box::pin(async move {
            match self.backlog.recv().await {
                Some((stream, peer)) => Ok((DetachedStream::Mem(stream), peer)),
                None => Err(io::Error::new(
                    io::ErrorKind::NotConnected,
                    "memory listener closed",
                )),
            }
        })
    }
}

impl Drop for MemListener {
    fn drop(&mut self) {
        // Closing first makes racing connects fail with ConnectionRefused instead of queueing.
        self.backlog.close();
        let entry = {
            let mut st = lock(&self.net.inner.state);
            match st.listeners.get(&self.addr) {
                Some(e) if e.id == self.id => st.listeners.remove(&self.addr),
                _ => None,
            }
        };
        drop(entry);
        // Queued streams deregister from the network when dropped, so this runs without its lock.
        while let Ok(queued) = self.backlog.try_recv() {
            drop(queued);
        }
    }
}
