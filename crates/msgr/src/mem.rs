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

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::fmt;
use std::future::Future;
use std::io::{self, IoSlice};
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use bytes::{Buf, BytesMut};
use nacre_types::sync::lock;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::mpsc;
use tokio::time::{Instant, Sleep};

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

/// Faults on one direction between two hosts. The all-default value means a healthy link and is never
/// stored in the table.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
struct LinkFaults {
    partitioned: bool,
    blackhole: bool,
    delay: Duration,
    /// Always within `[0, 1]`.
    reset_probability: f64,
}

impl LinkFaults {
    fn is_healthy(&self) -> bool {
        *self == Self::default()
    }
}

/// A run of bytes written with the same readability time.
#[derive(Debug)]
struct Segment {
    /// `None`: readable now. Within a pipe, `ready_at` never decreases from front to back.
    ready_at: Option<Instant>,
    /// Never empty while the segment is queued.
    data: BytesMut,
}

/// One direction of a connection.
#[derive(Debug)]
struct Pipe {
    segments: VecDeque<Segment>,
    /// Sum of the segments' lengths; at most `PIPE_CAPACITY` (a single write never pushes past it).
    len: usize,
    /// The writing end shut down or was dropped: the reader gets EOF once `segments` is empty.
    write_closed: bool,
    /// The reading end was dropped: writes fail with `BrokenPipe`, and nothing is buffered.
    read_closed: bool,
    /// The connection was reset: everything fails with `ConnectionReset`, and nothing is buffered.
    reset: bool,
    /// The faults of this pipe's direction, kept in step with the network's link table under its lock.
    faults: LinkFaults,
    rng: fastrand::Rng,
    read_waker: Option<Waker>,
    write_waker: Option<Waker>,
}

impl Pipe {
    fn new(faults: LinkFaults, rng: fastrand::Rng) -> Self {
        Self {
            segments: VecDeque::new(),
            len: 0,
            write_closed: false,
            read_closed: false,
            reset: false,
            faults,
            rng,
            read_waker: None,
            write_waker: None,
        }
    }

    fn discard(&mut self) {
        self.segments.clear();
        self.len = 0;
    }

    /// Appends the first `n` bytes of `bufs`.
    fn push(&mut self, bufs: &[IoSlice<'_>], n: usize) {
        let back_ready = self.segments.back().and_then(|s| s.ready_at);
        let ready_at = if self.faults.delay.is_zero() {
            // Inherit the last deadline so undelayed bytes cannot overtake delayed ones.
            back_ready
        } else {
            let t = Instant::now() + self.faults.delay;
            Some(back_ready.map_or(t, |b| b.max(t)))
        };
        let reuse = self
            .segments
            .back()
            .is_some_and(|s| s.ready_at == ready_at && s.data.len() < SEGMENT_TARGET);
        if !reuse {
            self.segments.push_back(Segment {
                ready_at,
                data: BytesMut::with_capacity(n.min(SEGMENT_TARGET)),
            });
        }
        if let Some(seg) = self.segments.back_mut() {
            let mut left = n;
            for b in bufs {
                let k = b.len().min(left);
                seg.data.extend_from_slice(&b[..k]);
                left -= k;
                if left == 0 {
                    break;
                }
            }
        }
        self.len += n;
    }
}

fn register(slot: &mut Option<Waker>, cx: &Context<'_>) {
    match slot {
        Some(w) if w.will_wake(cx.waker()) => {}
        _ => *slot = Some(cx.waker().clone()),
    }
}

/// The state both ends of one connection share. `pipes[0]` carries bytes from the connecting end
/// (side 0) to the accepting end (side 1); `pipes[1]` the other way.
#[derive(Debug)]
struct Conn {
    id: u64,
    /// Weak so that live streams do not keep a dropped network's registry alive for nothing.
    net: Weak<NetInner>,
    pipes: [Mutex<Pipe>; 2],
    /// Bytes read out of each pipe, shared with the network's per-host-pair counters.
    delivered: [Arc<AtomicU64>; 2],
}

impl Conn {
    /// Marks both directions reset and collects the wakers to call once no lock is held.
    fn reset(&self, wakers: &mut Vec<Waker>) {
        for pipe in &self.pipes {
            let mut p = lock(pipe);
            p.reset = true;
            p.discard();
            wakers.extend(p.read_waker.take());
            wakers.extend(p.write_waker.take());
        }
    }

    /// Removes the connection from the network's table of open connections. Must not be called with the
    /// network lock held.
    fn deregister(&self) {
        if let Some(net) = self.net.upgrade() {
            let removed = lock(&net.state).conns.remove(&self.id);
            drop(removed);
        }
    }
}

/// One end of an in-memory connection.
///
/// Belongs to no runtime: it can be sent to another thread or runtime at any point, even with a read
/// pending (the next poll registers the new task's waker). Dropping it closes both directions: the peer
/// reads what was already written and then EOF, and its writes fail with `BrokenPipe`.
pub struct MemStream {
    conn: Arc<Conn>,
    /// 0 for the connecting end, 1 for the accepting end; this end writes `pipes[side]` and reads
    /// `pipes[1 - side]`.
    side: usize,
    local_addr: String,
    peer_addr: String,
    /// Wakes a reader waiting for delayed bytes. Recreated on every poll that needs it, because the
    /// stream may have moved to another runtime since the last one.
    sleep: Option<Pin<Box<Sleep>>>,
}

impl fmt::Debug for MemStream {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemStream")
            .field("conn", &self.conn.id)
            .field("local_addr", &self.local_addr)
            .field("peer_addr", &self.peer_addr)
            .finish_non_exhaustive()
    }
}

impl MemStream {
    fn new(conn: Arc<Conn>, side: usize, local_addr: String, peer_addr: String) -> Self {
        Self {
            conn,
            side,
            local_addr,
            peer_addr,
            sleep: None,
        }
    }

    /// A connected pair outside any network: no faults, no counters. Handy for framing tests.
    pub fn pair() -> (Self, Self) {
        let conn = Arc::new(Conn {
            id: 0,
            net: Weak::new(),
            pipes: [
                Mutex::new(Pipe::new(LinkFaults::default(), pipe_rng(0, 0, 0))),
                Mutex::new(Pipe::new(LinkFaults::default(), pipe_rng(0, 0, 1))),
            ],
            delivered: [Arc::default(), Arc::default()],
        });
        let a = "pair:1".to_owned();
        let b = "pair:2".to_owned();
        (
            Self::new(Arc::clone(&conn), 0, a.clone(), b.clone()),
            Self::new(conn, 1, b, a),
        )
    }

    /// This end's address (`host:port`).
    pub fn local_addr(&self) -> &str {
        &self.local_addr
    }

    /// The other end's address (`host:port`).
    pub fn peer_addr(&self) -> &str {
        &self.peer_addr
    }

    fn write_pipe(&self) -> &Mutex<Pipe> {
        &self.conn.pipes[self.side]
    }

    fn read_pipe(&self) -> &Mutex<Pipe> {
        &self.conn.pipes[1 - self.side]
    }

    fn reset_connection(&self) {
        let mut wakers = Vec::new();
        self.conn.reset(&mut wakers);
        wakers.into_iter().for_each(Waker::wake);
        self.conn.deregister();
    }

    fn poll_write_slices(
        &mut self,
        cx: &mut Context<'_>,
        bufs: &[IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let total = bufs.iter().map(|b| b.len()).sum::<usize>();
        let mut pipe = lock(self.write_pipe());
        if pipe.reset {
            return Poll::Ready(Err(reset_error()));
        }
        if pipe.write_closed {
            return Poll::Ready(Err(io::Error::new(
                io::ErrorKind::BrokenPipe,
                "write after shutdown",
            )));
        }
        if pipe.read_closed {
            return Poll::Ready(Err(io::Error::new(
                io::ErrorKind::BrokenPipe,
                "peer closed the memory connection",
            )));
        }
        if total == 0 {
            return Poll::Ready(Ok(0));
        }
        if !pipe.faults.blackhole && pipe.len >= PIPE_CAPACITY {
            register(&mut pipe.write_waker, cx);
            return Poll::Pending;
        }
        // Drawn only for writes that go ahead, so the sequence of outcomes depends on the writes the
        // test makes, not on how often a full pipe was polled.
        let p = pipe.faults.reset_probability;
        if p > 0.0 && pipe.rng.f64() < p {
            drop(pipe);
            self.reset_connection();
            return Poll::Ready(Err(reset_error()));
        }
        if pipe.faults.blackhole {
            return Poll::Ready(Ok(total));
        }
        let n = total.min(PIPE_CAPACITY - pipe.len);
        pipe.push(bufs, n);
        let waker = pipe.read_waker.take();
        drop(pipe);
        if let Some(w) = waker {
            w.wake();
        }
        Poll::Ready(Ok(n))
    }
}

impl Drop for MemStream {
    fn drop(&mut self) {
        let mut wakers = Vec::new();
        {
            let mut p = lock(self.write_pipe());
            p.write_closed = true;
            wakers.extend(p.read_waker.take());
        }
        {
            let mut p = lock(self.read_pipe());
            p.read_closed = true;
            p.discard();
            wakers.extend(p.write_waker.take());
        }
        wakers.into_iter().for_each(Waker::wake);
        self.conn.deregister();
    }
}

impl AsyncRead for MemStream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        loop {
            let deadline = {
                let mut pipe = lock(this.read_pipe());
                if pipe.reset {
                    return Poll::Ready(Err(reset_error()));
                }
                if buf.remaining() == 0 {
                    return Poll::Ready(Ok(()));
                }
                let mut now = None;
                let mut deadline = None;
                let mut copied = 0;
                while buf.remaining() > 0 {
                    let Some(seg) = pipe.segments.front_mut() else {
                        break;
                    };
                    if let Some(t) = seg.ready_at
                        && t > *now.get_or_insert_with(Instant::now)
                    {
                        deadline = Some(t);
                        break;
                    }
                    let k = buf.remaining().min(seg.data.len());
                    buf.put_slice(&seg.data[..k]);
                    seg.data.advance(k);
                    copied += k;
                    if seg.data.is_empty() {
                        pipe.segments.pop_front();
                    }
                }
                if copied > 0 {
                    pipe.len -= copied;
                    let waker = pipe.write_waker.take();
                    drop(pipe);
                    this.conn.delivered[1 - this.side].fetch_add(copied as u64, Ordering::Relaxed);
                    this.sleep = None;
                    if let Some(w) = waker {
                        w.wake();
                    }
                    return Poll::Ready(Ok(()));
                }
                // Registered even when a timer will wake us, so a reset or close is seen at once.
                register(&mut pipe.read_waker, cx);
                match deadline {
                    Some(t) => t,
                    None if pipe.write_closed => return Poll::Ready(Ok(())),
                    None => return Poll::Pending,
                }
            };
            if tokio::runtime::Handle::try_current().is_err() {
                return Poll::Ready(Err(io::Error::other(
                    "a MemStream with delayed bytes must be polled inside a tokio runtime",
                )));
            }
            let sleep = this
                .sleep
                .insert(Box::pin(tokio::time::sleep_until(deadline)));
            if sleep.as_mut().poll(cx).is_pending() {
                return Poll::Pending;
            }
        }
    }
}

impl AsyncWrite for MemStream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        self.get_mut().poll_write_slices(cx, &[IoSlice::new(buf)])
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        self.get_mut().poll_write_slices(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        true
    }

    fn poll_flush(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    /// Half-closes: the peer reads the buffered bytes, then EOF. Idempotent, and succeeds on a reset
    /// connection (there is nothing left to close).
    fn poll_shutdown(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let waker = {
            let mut p = lock(self.write_pipe());
            p.write_closed = true;
            p.read_waker.take()
        };
        if let Some(w) = waker {
            w.wake();
        }
        Poll::Ready(Ok(()))
    }
}

/// A connection waiting in a listener's backlog, with the connecting end's address.
type Backlog = (MemStream, String);

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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::Stream;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::time::timeout;

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
}
