//! The RPC client: a pool of connections per peer, request ids, deadlines, in-flight budgets.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use nacre_proto::msg::sys::{BundleJoin, BundleJoinOp};
use nacre_proto::msg::{RemoteError, Rpc, decode_body, encode_body};
use nacre_proto::{Flags, Frame, Kind, Op};
use nacre_types::sync::lock;
use prometheus_client::metrics::gauge::Gauge;
use tokio::sync::{Semaphore, mpsc, oneshot};
use tokio::time::Instant;

use crate::Shared;
use crate::balance::ConnInfo;
use crate::conn::{self, Conn, Direct, Lane, Outgoing, Permits};
use crate::error::MsgrError;
use crate::handler::Payload;

/// Per-call options.
#[derive(Clone, Copy, Debug, Default)]
pub struct CallOptions {
    /// Time allowed for the whole call (connect, queueing, round trip). Default: the messenger's
    /// `default_deadline`.
    pub timeout: Option<Duration>,
    /// Frame flags (e.g. background priority).
    pub flags: Flags,
    /// Send over the peer's bundle (`msgr.bundle_conns` > 1): calls marked so reach the peer's
    /// handler in the order they were made, spread over several connections, and a call whose
    /// connection resets is sent again on another (crate::bundle).
    pub bundled: bool,
}

/// Sends requests to peers by address. Cheap to clone; clones share connections and budgets.
#[derive(Clone, Debug)]
pub struct Client {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    shared: Arc<Shared>,
    peers: Mutex<HashMap<Arc<str>, Arc<Peer>>>,
    /// Bundled peers: their own connections, which start with a bundle join.
    bundles: Mutex<HashMap<Arc<str>, Arc<Peer>>>,
    total_reqs: Arc<Semaphore>,
    total_bytes: Arc<Semaphore>,
    next_id: AtomicU64,
    inflight: Gauge,
}

#[derive(Debug)]
struct Peer {
    addr: Arc<str>,
    slots: Box<[Slot]>,
    next: AtomicUsize,
    bundle: Option<BundleTx>,
}

impl Peer {
    fn new(addr: Arc<str>, n: usize, bundle: Option<BundleTx>) -> Self {
        Self {
            addr,
            slots: (0..n).map(|_| Slot::default()).collect(),
            next: AtomicUsize::new(0),
            bundle,
        }
    }
}

/// A bundled call in flight. When it ends without an answer (an error, or its caller dropped it),
/// the peer is told not to wait for it: otherwise every later call would wait the receiver's gap
/// timeout for it.
struct Pending<'a> {
    peer: &'a Peer,
    seq: u64,
    answered: bool,
}

impl Drop for Pending<'_> {
    fn drop(&mut self) {
        let Some(b) = &self.peer.bundle else { return };
        lock(&b.pending).remove(&self.seq);
        if self.answered {
            return;
        }
        for slot in self.peer.slots.iter() {
            if let Some(c) = live(slot)
                && c.oneway(b.join_frame(self.seq), Permits::default())
            {
                break;
            }
        }
    }
}

/// The sending end of a bundle.
#[derive(Debug)]
struct BundleTx {
    id: u64,
    next_seq: AtomicU64,
    /// Calls sent and not yet answered or given up.
    pending: Mutex<std::collections::BTreeSet<u64>>,
}

impl BundleTx {
    /// The lowest sequence number still waited for.
    fn low(&self) -> u64 {
        lock(&self.pending)
            .first()
            .copied()
            .unwrap_or_else(|| self.next_seq.load(Ordering::SeqCst))
    }

    /// The frame that opens a connection of the bundle, or says that call `skip` was given up.
    fn join_frame(&self, skip: u64) -> Frame {
        let j = BundleJoin {
            bundle: self.id,
            low: self.low(),
            skip,
        };
        Frame::new(
            Kind::OneWay,
            BundleJoinOp::OP,
            0,
            encode_body(&j),
            Bytes::new(),
        )
    }
}

#[derive(Debug, Default)]
struct Slot {
    live: Mutex<Option<ConnHandle>>,
    /// Serializes connection attempts so concurrent callers do not open one connection each.
    connecting: tokio::sync::Mutex<()>,
}

#[derive(Clone)]
struct ConnHandle {
    tx: mpsc::UnboundedSender<Outgoing>,
    /// Where callers write frames themselves when nothing is queued before them.
    lane: Arc<Lane>,
    reqs: Arc<Semaphore>,
    bytes: Arc<Semaphore>,
}

impl std::fmt::Debug for ConnHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConnHandle")
            .field("closed", &self.tx.is_closed())
            .finish_non_exhaustive()
    }
}

impl ConnHandle {
    /// Sends a request: written from this thread when the connection allows it, else through
    /// the driver. `false` when the connection is gone.
    fn request(
        &self,
        frame: Frame,
        reply: oneshot::Sender<Result<Frame, MsgrError>>,
        deadline: Instant,
        timeout: Duration,
    ) -> bool {
        match self.lane.try_request(frame, reply, deadline, timeout) {
            Ok(direct) => self.kick(direct),
            Err((frame, reply)) => self.through_driver(Outgoing::Request {
                frame,
                reply,
                deadline,
                timeout,
            }),
        }
    }

    /// Sends a one-way frame like [`ConnHandle::request`].
    fn oneway(&self, frame: Frame, permits: Permits) -> bool {
        match self.lane.try_oneway(frame, permits) {
            Ok(direct) => self.kick(direct),
            Err((frame, permits)) => self.through_driver(Outgoing::OneWay { frame, permits }),
        }
    }

    fn kick(&self, direct: Direct) -> bool {
        if direct == Direct::Kick {
            let _ = self.tx.send(Outgoing::Kick);
        }
        true
    }

    fn through_driver(&self, msg: Outgoing) -> bool {
        self.lane.queue_one(false);
        let sent = self.tx.send(msg).is_ok();
        if !sent {
            self.lane.queue_one(true);
        }
        sent
    }
}

impl Client {
    pub(crate) fn new(shared: Arc<Shared>) -> Self {
        let cfg = &shared.config;
        let inner = Inner {
            total_reqs: Arc::new(Semaphore::new(cfg.max_inflight_total as usize)),
            total_bytes: Arc::new(Semaphore::new(cfg.max_inflight_bytes_total as usize)),
            next_id: AtomicU64::new(1),
            inflight: shared.metrics.inflight("client"),
            peers: Mutex::new(HashMap::new()),
            bundles: Mutex::new(HashMap::new()),
            shared,
        };
        Self {
            inner: Arc::new(inner),
        }
    }

    /// Calls `R` on `addr` and decodes the response.
    pub async fn call<R: Rpc>(
        &self,
        addr: &str,
        req: &R::Request,
        data: Payload,
    ) -> Result<(R::Response, Payload), MsgrError> {
        self.call_with::<R>(addr, req, data, CallOptions::default())
            .await
    }

    /// [`Client::call`] with options.
    pub async fn call_with<R: Rpc>(
        &self,
        addr: &str,
        req: &R::Request,
        data: Payload,
        opts: CallOptions,
    ) -> Result<(R::Response, Payload), MsgrError> {
        self.call_body::<R>(addr, encode_body(req), data, opts)
            .await
    }

    /// [`Client::call_with`] with the request's body already encoded: a caller that sends one
    /// request to several nodes, or again, encodes it once.
    pub async fn call_body<R: Rpc>(
        &self,
        addr: &str,
        body: Bytes,
        data: Payload,
        opts: CallOptions,
    ) -> Result<(R::Response, Payload), MsgrError> {
        let frame = self.call_raw(addr, R::OP, body, data, opts).await?;
        let resp = decode_body(R::NAME, &frame.body).map_err(|source| {
            self.inner.shared.metrics.error("decode");
            MsgrError::Decode {
                peer: addr.to_string(),
                source,
            }
        })?;
        let crc = frame.header.data_crc;
        Ok((resp, Payload::with_crc(frame.data, crc)))
    }

    /// Sends a request frame and waits for its response frame. An error frame becomes
    /// [`MsgrError::Remote`].
    pub async fn call_raw(
        &self,
        addr: &str,
        op: Op,
        body: Bytes,
        data: Payload,
        opts: CallOptions,
    ) -> Result<Frame, MsgrError> {
        let inner = &*self.inner;
        let timeout = opts.timeout.unwrap_or(inner.shared.config.default_deadline);
        let deadline = Instant::now() + timeout;
        let mut frame = self.frame(Kind::Request, op, body, data)?;
        frame.header.flags = opts.flags;
        let cost = self.cost(&frame);
        inner.inflight.inc();
        let result = if opts.bundled && inner.shared.config.bundle_conns > 1 {
            self.send_bundled(addr, frame, cost, deadline, timeout)
                .await
        } else {
            let (peer, slot) = self.pick(addr);
            self.send_on(&peer, slot, frame, cost, deadline, timeout)
                .await
        };
        inner.inflight.dec();
        let frame = result.inspect_err(|e| inner.shared.metrics.error(e.kind_label()))?;
        if frame.header.kind == Kind::Error {
            inner.shared.metrics.error("remote");
            let error = decode_body::<RemoteError>("error", &frame.body).unwrap_or_else(|e| {
                RemoteError::new(nacre_types::ErrorCode::Internal, e.to_string())
            });
            return Err(MsgrError::Remote {
                peer: addr.to_string(),
                error,
            });
        }
        Ok(frame)
    }

    /// Sends call `frame` over the bundle to `addr` with the bundle's next sequence number; when
    /// its connection resets (or cannot be opened) sends it again on the next, at most twice
    /// around the bundle.
    async fn send_bundled(
        &self,
        addr: &str,
        mut frame: Frame,
        cost: u32,
        deadline: Instant,
        timeout: Duration,
    ) -> Result<Frame, MsgrError> {
        let peer = self.bundle_peer(addr);
        let Some(b) = &peer.bundle else {
            return Err(MsgrError::Shutdown);
        };
        let seq = {
            // Numbered and recorded as pending at once, so `low` never passes a call in flight.
            let mut pending = lock(&b.pending);
            let seq = b.next_seq.fetch_add(1, Ordering::SeqCst);
            pending.insert(seq);
            seq
        };
        frame.header.seq = seq;
        let mut guard = Pending {
            peer: &peer,
            seq,
            answered: false,
        };
        let n = peer.slots.len();
        let start = peer.next.fetch_add(1, Ordering::Relaxed);
        let mut last = None;
        for attempt in 0..2 * n {
            let slot = (start + attempt) % n;
            match self
                .send_on(&peer, slot, frame.clone(), cost, deadline, timeout)
                .await
            {
                Err(e @ (MsgrError::Reset { .. } | MsgrError::Connect { .. })) => last = Some(e),
                out => {
                    guard.answered = out.is_ok();
                    return out;
                }
            }
        }
        Err(last.unwrap_or(MsgrError::Shutdown))
    }

    /// The bundle to `addr` (created on first use).
    fn bundle_peer(&self, addr: &str) -> Arc<Peer> {
        let inner = &*self.inner;
        let mut bundles = lock(&inner.bundles);
        if let Some(p) = bundles.get(addr) {
            return Arc::clone(p);
        }
        let addr: Arc<str> = addr.into();
        let tx = BundleTx {
            id: fastrand::u64(..),
            next_seq: AtomicU64::new(1),
            pending: Mutex::new(std::collections::BTreeSet::new()),
        };
        let p = Arc::new(Peer::new(
            Arc::clone(&addr),
            inner.shared.config.bundle_conns,
            Some(tx),
        ));
        bundles.insert(addr, Arc::clone(&p));
        p
    }

    /// Sends a request on connection `slot` of `peer` and waits for its answer. Without
    /// contention this arms no timer: the connection enforces the deadline once the request is
    /// queued on it.
    async fn send_on(
        &self,
        peer: &Peer,
        slot: usize,
        frame: Frame,
        cost: u32,
        deadline: Instant,
        timeout: Duration,
    ) -> Result<Frame, MsgrError> {
        let inner = &*self.inner;
        let addr = &*peer.addr;
        let timed_out = || MsgrError::Timeout {
            peer: addr.to_string(),
            op: "call",
            after: timeout,
        };
        let conn = match live(&peer.slots[slot]) {
            Some(c) => c,
            None => tokio::time::timeout_at(deadline, self.conn(peer, slot, deadline))
                .await
                .map_err(|_| timed_out())??,
        };
        let budgets = [
            (&*inner.total_reqs, 1),
            (&*inner.total_bytes, cost),
            (&*conn.reqs, 1),
            (&*conn.bytes, cost),
        ];
        let _permits = match try_acquire_all(&budgets) {
            Some(p) => p,
            None => tokio::time::timeout_at(deadline, acquire_all(&budgets))
                .await
                .map_err(|_| timed_out())??,
        };
        let (tx, rx) = oneshot::channel();
        if !conn.request(frame, tx, deadline, timeout) {
            return Err(MsgrError::Reset {
                peer: addr.to_string(),
                reason: "connection closed".into(),
            });
        }
        rx.await.map_err(|_| MsgrError::Reset {
            peer: addr.to_string(),
            reason: "connection dropped".into(),
        })?
    }

    /// Queues a one-way frame for `addr`. Returns once it is queued on a connection (not when it is
    /// delivered); waits for in-flight byte budget first, so a slow peer slows the sender down.
    pub async fn send_oneway(
        &self,
        addr: &str,
        op: Op,
        body: Bytes,
        data: Payload,
    ) -> Result<(), MsgrError> {
        let inner = &*self.inner;
        let deadline = Instant::now() + inner.shared.config.default_deadline;
        let frame = self.frame(Kind::OneWay, op, body, data)?;
        let cost = self.cost(&frame);
        let sent = tokio::time::timeout_at(deadline, async {
            let (peer, slot) = self.pick(addr);
            let conn = self.conn(&peer, slot, deadline).await?;
            let reqs = Arc::clone(&inner.total_reqs)
                .acquire_owned()
                .await
                .map_err(|_| MsgrError::Shutdown)?;
            let bytes = Arc::clone(&inner.total_bytes)
                .acquire_many_owned(cost)
                .await
                .map_err(|_| MsgrError::Shutdown)?;
            let permits = Permits {
                _reqs: Some(reqs),
                _bytes: Some(bytes),
            };
            if conn.oneway(frame, permits) {
                Ok(())
            } else {
                Err(MsgrError::Reset {
                    peer: addr.to_string(),
                    reason: "connection closed".into(),
                })
            }
        })
        .await
        .unwrap_or_else(|_| {
            Err(MsgrError::Timeout {
                peer: addr.to_string(),
                op: "send",
                after: inner.shared.config.default_deadline,
            })
        });
        sent.inspect_err(|e| inner.shared.metrics.error(e.kind_label()))
    }

    /// Runs `fut` on one of the messenger's workers (the next by its assignment policy): for a loop
    /// whose work arrives from, and goes back to, tasks on the workers, so that handing it over
    /// wakes no other thread (docs/design.md §3: keep work on the worker that read it).
    pub fn spawn<F>(&self, fut: F) -> tokio::task::JoinHandle<F::Output>
    where
        F: std::future::Future + Send + 'static,
        F::Output: Send + 'static,
    {
        self.inner.shared.workers.assign().spawn(fut)
    }

    /// [`Client::send_oneway`] of a frame without data, without waiting: queues it when a
    /// connection to `addr` is open and the in-flight budgets have room now, else hands `body`
    /// back (the caller may then wait in `send_oneway`). For callers on a thread that must not
    /// wait on other tasks to send (a Raft loop about to block on its log write).
    pub fn try_send_oneway(&self, addr: &str, op: Op, body: Bytes) -> Result<(), Bytes> {
        let inner = &*self.inner;
        let (peer, slot) = self.pick(addr);
        let Some(conn) = live(&peer.slots[slot]) else {
            return Err(body);
        };
        let Ok(frame) = self.frame(Kind::OneWay, op, body.clone(), Payload::none()) else {
            return Err(body);
        };
        let cost = self.cost(&frame);
        let Ok(reqs) = Arc::clone(&inner.total_reqs).try_acquire_owned() else {
            return Err(body);
        };
        let Ok(bytes) = Arc::clone(&inner.total_bytes).try_acquire_many_owned(cost) else {
            return Err(body);
        };
        let permits = Permits {
            _reqs: Some(reqs),
            _bytes: Some(bytes),
        };
        if conn.oneway(frame, permits) {
            Ok(())
        } else {
            Err(body)
        }
    }

    fn frame(&self, kind: Kind, op: Op, body: Bytes, data: Payload) -> Result<Frame, MsgrError> {
        let len = body.len() + data.len();
        let max = self.inner.shared.config.max_frame;
        if len > max as usize {
            self.inner.shared.metrics.error("too_large");
            return Err(MsgrError::TooLarge { len, max });
        }
        let id = match kind {
            Kind::OneWay => 0,
            _ => self.inner.next_id.fetch_add(1, Ordering::Relaxed),
        };
        let crc = data.crc();
        Ok(Frame::with_data_crc(kind, op, id, body, data.bytes, crc))
    }

    /// In-flight byte cost, capped at the smallest budget so a single large frame always fits.
    fn cost(&self, frame: &Frame) -> u32 {
        let cfg = &self.inner.shared.config;
        let len = u32::try_from(frame.body.len() + frame.data.len()).unwrap_or(u32::MAX);
        len.min(cfg.max_inflight_bytes_per_conn)
            .min(cfg.max_inflight_bytes_total)
    }

    /// The peer entry for `addr` (created on first use) and the slot the next call uses.
    fn pick(&self, addr: &str) -> (Arc<Peer>, usize) {
        let inner = &*self.inner;
        let peer = {
            let mut peers = lock(&inner.peers);
            match peers.get(addr) {
                Some(p) => Arc::clone(p),
                None => {
                    let addr: Arc<str> = addr.into();
                    let n = inner.shared.config.conns_per_peer;
                    let p = Arc::new(Peer::new(Arc::clone(&addr), n, None));
                    peers.insert(addr, Arc::clone(&p));
                    p
                }
            }
        };
        let i = peer.next.fetch_add(1, Ordering::Relaxed) % peer.slots.len();
        (peer, i)
    }

    /// The live connection of slot `i` of `peer`, opening it if needed.
    async fn conn(
        &self,
        peer: &Peer,
        i: usize,
        deadline: Instant,
    ) -> Result<ConnHandle, MsgrError> {
        let slot = &peer.slots[i];
        if let Some(h) = live(slot) {
            return Ok(h);
        }
        let _connecting = slot.connecting.lock().await;
        if let Some(h) = live(slot) {
            return Ok(h);
        }
        let h = self.open(&peer.addr, deadline).await?;
        if let Some(b) = &peer.bundle {
            // The first frame on the connection, before any caller can see it.
            h.oneway(b.join_frame(0), Permits::default());
        }
        *lock(&slot.live) = Some(h.clone());
        Ok(h)
    }

    async fn open(&self, addr: &Arc<str>, deadline: Instant) -> Result<ConnHandle, MsgrError> {
        let shared = &self.inner.shared;
        let cfg = &shared.config;
        let connect_deadline = deadline.min(Instant::now() + cfg.connect_timeout);
        let stream = tokio::time::timeout_at(connect_deadline, shared.transport.connect(addr))
            .await
            .map_err(|_| MsgrError::Connect {
                peer: addr.to_string(),
                reason: format!("timed out after {:?}", cfg.connect_timeout),
                refused: false,
            })?
            .map_err(|e| MsgrError::Connect {
                peer: addr.to_string(),
                reason: e.to_string(),
                refused: e.kind() == std::io::ErrorKind::ConnectionRefused,
            })?;
        // Callers write to the socket through a second descriptor of it (see `Lane`); it is
        // non-blocking from here on, before the driver attaches it.
        let worker = shared.workers.assign();
        let sock = stream.writer();
        let (tx, rx) = mpsc::unbounded_channel();
        let info = ConnInfo::new(
            shared.conns.next_id(),
            "client",
            Arc::clone(addr),
            worker.index(),
            tx.downgrade(),
        );
        let lane = Lane::new(sock, worker.counters.clone(), info);
        let handle = ConnHandle {
            tx,
            lane: Arc::clone(&lane),
            reqs: Arc::new(Semaphore::new(cfg.max_inflight_per_conn as usize)),
            bytes: Arc::new(Semaphore::new(cfg.max_inflight_bytes_per_conn as usize)),
        };
        let conn = Conn::client(
            Arc::clone(shared),
            worker.index(),
            Arc::clone(addr),
            rx,
            lane,
        );
        conn::spawn(conn, stream);
        Ok(handle)
    }
}

fn live(slot: &Slot) -> Option<ConnHandle> {
    lock(&slot.live)
        .as_ref()
        .filter(|h| !h.tx.is_closed())
        .cloned()
}

type Budgets<'a> = [(&'a Semaphore, u32); 4];
type Held<'a> = Vec<tokio::sync::SemaphorePermit<'a>>;

/// Takes every budget at once if all are available now.
fn try_acquire_all<'a>(budgets: &Budgets<'a>) -> Option<Held<'a>> {
    budgets
        .iter()
        .map(|(sem, n)| sem.try_acquire_many(*n).ok())
        .collect()
}

/// Waits for every budget, in a fixed order so that concurrent callers cannot deadlock.
async fn acquire_all<'a>(budgets: &Budgets<'a>) -> Result<Held<'a>, MsgrError> {
    let mut held = Vec::with_capacity(budgets.len());
    for (sem, n) in budgets {
        held.push(
            sem.acquire_many(*n)
                .await
                .map_err(|_| MsgrError::Shutdown)?,
        );
    }
    Ok(held)
}
