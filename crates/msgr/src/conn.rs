//! The connection driver: one future per connection, on one worker, that reads, decodes, dispatches and
//! writes without helper tasks.
//!
//! Invariants:
//! - Every request a client hands to a driver gets exactly one answer on its oneshot: the response, an
//!   error frame, or `Reset` when the connection ends first (including requests still queued when the
//!   driver stops).
//! - A server-side request holds its in-flight budget (per connection and total) from the moment it is
//!   decoded until its reply is queued; while the budget is exhausted the driver stops reading, which is
//!   how backpressure reaches the sender through TCP.
//! - Frames are written in the order they are queued; a partially written frame is always finished
//!   before the next one starts.
//! - A caller may write its frame to a client connection's socket itself, from its own thread,
//!   instead of handing it to the driver ([`Lane`]): only under the lane's lock, only when nothing
//!   is queued before it (in the write queue or on its way there through the channel), and a
//!   request only once its answer's slot is booked and the driver's deadline timer will fire no
//!   later than its deadline. Waking the driver's thread for every frame cost more than the
//!   write itself; the driver still reads every answer, and writes what a caller could not.

use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::io::{self, IoSlice, Write};
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll};

use bytes::{Bytes, BytesMut};
use nacre_proto::msg::sys::{BundleJoin, BundleJoinOp};
use nacre_proto::msg::{RemoteError, Rpc, decode_body, encode_body};
use nacre_proto::{Decoder, Frame, FrameError, FrameLimits, HEADER_LEN, Kind};
use nacre_types::ErrorCode;
use prometheus_client::metrics::gauge::Gauge;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWrite};
use tokio::sync::{AcquireError, OwnedSemaphorePermit, Semaphore, mpsc, oneshot};
use tokio::time::{Instant, Sleep};

use crate::Shared;
use crate::balance::ConnInfo;
use crate::bundle::{BundleRx, Bundles};
use crate::error::MsgrError;
use crate::handler::{Handler, Payload, Reply, Request};
use crate::metrics::{MsgrMetrics, OpName, WorkerCounters};
use crate::transport::{BoxFuture, DetachedStream, Stream};

/// Iterations of the driver loop before it yields to other connections on the worker.
const BUDGET: usize = 32;
/// Read buffer growth step.
const READ_CHUNK: usize = 64 * 1024;
/// Slices per vectored write (each frame is up to three).
const MAX_IOV: usize = 64;
/// Stop pulling new outgoing messages while this much is queued but unwritten.
const WRITE_QUEUE_HIGH: usize = 8 << 20;

pub(crate) type ReplyTx = oneshot::Sender<Result<Frame, MsgrError>>;

/// Budget held by a request; released when dropped.
#[derive(Debug, Default)]
pub(crate) struct Permits {
    pub(crate) _reqs: Option<OwnedSemaphorePermit>,
    pub(crate) _bytes: Option<OwnedSemaphorePermit>,
}

/// Messages from callers and spawned handlers to a driver.
#[derive(Debug)]
pub(crate) enum Outgoing {
    /// Client: send a request and deliver its answer, or `Timeout` at `deadline`.
    Request {
        frame: Frame,
        reply: ReplyTx,
        deadline: Instant,
        timeout: Duration,
    },
    /// Send a one-way frame; the permits are released once it is written.
    OneWay { frame: Frame, permits: Permits },
    /// Server: a spawned handler finished.
    Done(Done),
    /// A caller wrote part of a frame itself and queued the rest: write it.
    Kick,
    /// Stop reading, finish in-flight work, close.
    Close,
    /// Move to worker `n` (the balancer, or a test): the driver detaches its socket at its next
    /// poll and continues on that worker with everything it had (buffers, queue, pending calls).
    Migrate(usize),
}

/// A finished server-side request.
#[derive(Debug)]
pub(crate) struct Done {
    kind: Kind,
    op: nacre_proto::Op,
    /// The op's metric label and when the request was handed to its handler.
    name: OpName,
    started: std::time::Instant,
    request_id: u64,
    cost: u64,
    permits: Permits,
    result: Result<Reply, RemoteError>,
}

struct Queued {
    header: [u8; HEADER_LEN],
    body: Bytes,
    data: Bytes,
    _permits: Permits,
}

impl Queued {
    fn new(frame: Frame, permits: Permits) -> Self {
        Self {
            header: frame.header.encode(),
            body: frame.body,
            data: frame.data,
            _permits: permits,
        }
    }

    fn len(&self) -> usize {
        HEADER_LEN + self.body.len() + self.data.len()
    }
}

/// Server-side state of a connection.
pub(crate) struct ServerSide {
    pub(crate) handler: Arc<dyn Handler>,
    pub(crate) total_reqs: Arc<Semaphore>,
    pub(crate) total_bytes: Arc<Semaphore>,
    pub(crate) max_conn_reqs: u32,
    pub(crate) max_conn_bytes: u64,
    pub(crate) inflight_gauge: Gauge,
    pub(crate) tx: mpsc::UnboundedSender<Outgoing>,
    /// Run handlers on the next worker rather than on the connection's own.
    pub(crate) dual: bool,
    /// Dropped when the connection ends (the accept loop's record of it).
    pub(crate) _guard: Option<Box<dyn std::any::Any + Send>>,
    /// The server's bundles, and the one this connection joined.
    bundles: Arc<Bundles>,
    bundle: Option<Arc<BundleRx>>,
    inflight_reqs: u32,
    inflight_bytes: u64,
    /// A decoded frame waiting for budget.
    stalled: Option<Frame>,
    waiting: Option<BoxFuture<'static, Result<Permits, AcquireError>>>,
}

impl ServerSide {
    /// `totals`: the server's budgets of requests and request bytes in flight.
    pub(crate) fn new(
        handler: Arc<dyn Handler>,
        (total_reqs, total_bytes): (Arc<Semaphore>, Arc<Semaphore>),
        cfg: &crate::MsgrConfig,
        inflight_gauge: Gauge,
        tx: mpsc::UnboundedSender<Outgoing>,
        guard: Box<dyn std::any::Any + Send>,
        bundles: Arc<Bundles>,
    ) -> Self {
        Self {
            handler,
            total_reqs,
            total_bytes,
            max_conn_reqs: cfg.max_inflight_per_conn,
            max_conn_bytes: u64::from(cfg.max_inflight_bytes_per_conn),
            inflight_gauge,
            tx,
            dual: cfg.dual,
            _guard: Some(guard),
            bundles,
            bundle: None,
            inflight_reqs: 0,
            inflight_bytes: 0,
            stalled: None,
            waiting: None,
        }
    }
}

/// Requests of a client connection waiting for their answers, with their deadlines.
#[derive(Default)]
struct Book {
    pending: HashMap<u64, (ReplyTx, Duration)>,
    /// (deadline, request id), sorted by deadline; answered entries are dropped lazily from the front.
    deadlines: VecDeque<(Instant, u64)>,
}

impl Book {
    fn insert(&mut self, id: u64, reply: ReplyTx, deadline: Instant, timeout: Duration) {
        self.pending.insert(id, (reply, timeout));
        // Calls on a connection mostly share one timeout, so this is almost always a push_back.
        let at = self.deadlines.partition_point(|(d, _)| *d <= deadline);
        self.deadlines.insert(at, (deadline, id));
    }

    fn take(&mut self, id: u64) -> Option<ReplyTx> {
        let tx = self.pending.remove(&id).map(|(tx, _)| tx);
        self.pop_answered();
        tx
    }

    /// Drops answered entries from the front, so the queue holds about the requests in flight.
    fn pop_answered(&mut self) {
        while let Some((_, front)) = self.deadlines.front() {
            if self.pending.contains_key(front) {
                break;
            }
            self.deadlines.pop_front();
        }
    }

    /// Takes every request whose deadline is not after `now`.
    fn expired(&mut self, now: Instant) -> Vec<(ReplyTx, Duration)> {
        let mut out = Vec::new();
        while let Some(&(deadline, id)) = self.deadlines.front() {
            if deadline > now {
                break;
            }
            self.deadlines.pop_front();
            if let Some(entry) = self.pending.remove(&id) {
                out.push(entry);
            }
        }
        self.pop_answered();
        out
    }
}

/// What a connection's callers share with its driver: the write queue and, on a client connection,
/// the requests waiting for answers. See the module's invariants for when a caller writes itself.
pub(crate) struct Lane {
    state: Mutex<LaneState>,
    pub(crate) info: Arc<ConnInfo>,
}

struct LaneState {
    /// The counters of the worker the connection is on.
    counters: WorkerCounters,
    /// A second descriptor of the socket, for callers' own writes; `None` when the transport has
    /// none (memory) or the connection is gone.
    sock: Option<std::net::TcpStream>,
    wq: VecDeque<Queued>,
    wq_bytes: usize,
    /// Bytes of the front of `wq` already written.
    woff: usize,
    book: Book,
    /// When the driver's deadline timer fires next (client side; `None` until it is first armed).
    timer_at: Option<Instant>,
    /// Callers' frames sent through the channel and not yet in `wq`: none may be overtaken.
    queued: usize,
    /// No more direct writes.
    closing: bool,
}

/// What became of a frame a caller wrote itself.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Direct {
    /// All of it is on the socket.
    Written,
    /// The socket took part of it (or none); the rest is queued and the driver must be kicked.
    Kick,
}

impl Lane {
    pub(crate) fn new(
        sock: Option<std::net::TcpStream>,
        counters: WorkerCounters,
        info: Arc<ConnInfo>,
    ) -> Arc<Self> {
        Arc::new(Self {
            state: Mutex::new(LaneState {
                counters,
                sock,
                wq: VecDeque::new(),
                wq_bytes: 0,
                woff: 0,
                book: Book::default(),
                timer_at: None,
                queued: 0,
                closing: false,
            }),
            info,
        })
    }

    fn lock(&self) -> MutexGuard<'_, LaneState> {
        nacre_types::sync::lock(&self.state)
    }

    /// Books `reply` and writes the request from this thread, or hands both back when the driver
    /// must take them (see the module's invariants).
    pub(crate) fn try_request(
        &self,
        frame: Frame,
        reply: ReplyTx,
        deadline: Instant,
        timeout: Duration,
    ) -> Result<Direct, (Frame, ReplyTx)> {
        let mut st = self.lock();
        if !st.may_write() || st.timer_at.is_none_or(|t| t > deadline) {
            return Err((frame, reply));
        }
        st.book
            .insert(frame.header.request_id, reply, deadline, timeout);
        Ok(st.write(&self.info, Queued::new(frame, Permits::default())))
    }

    /// Writes a one-way frame from this thread, or hands it back.
    #[expect(
        clippy::result_large_err,
        reason = "hands the message back by value, once"
    )]
    pub(crate) fn try_oneway(
        &self,
        frame: Frame,
        permits: Permits,
    ) -> Result<Direct, (Frame, Permits)> {
        let mut st = self.lock();
        if !st.may_write() {
            return Err((frame, permits));
        }
        Ok(st.write(&self.info, Queued::new(frame, permits)))
    }

    /// Counts a caller's frame about to go through the driver's channel (`undo` if it did not).
    pub(crate) fn queue_one(&self, undo: bool) {
        let mut st = self.lock();
        st.queued = if undo {
            st.queued.saturating_sub(1)
        } else {
            st.queued + 1
        };
    }
}

impl LaneState {
    fn may_write(&self) -> bool {
        self.sock.is_some() && !self.closing && self.queued == 0 && self.wq.is_empty()
    }

    /// Writes `q` to the socket as far as it goes without blocking; queues the rest.
    fn write(&mut self, info: &ConnInfo, q: Queued) -> Direct {
        let written = match &self.sock {
            Some(sock) => {
                let mut sock: &std::net::TcpStream = sock;
                let iov = [
                    IoSlice::new(&q.header),
                    IoSlice::new(&q.body),
                    IoSlice::new(&q.data),
                ];
                loop {
                    match sock.write_vectored(&iov) {
                        Ok(n) => break n,
                        Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                        // WouldBlock, or an error the driver meets again on its next write.
                        Err(_) => break 0,
                    }
                }
            }
            None => 0,
        };
        self.counters.bytes_out.inc_by(written as u64);
        info.count_bytes(written as u64);
        if written == q.len() {
            self.counters.frames_out.inc();
            self.counters.direct.inc();
            info.count_frame();
            return Direct::Written;
        }
        self.woff = written;
        self.push(q);
        Direct::Kick
    }

    fn push(&mut self, q: Queued) {
        self.wq_bytes += q.len();
        self.wq.push_back(q);
    }

    fn advance_written(&mut self, info: &ConnInfo, mut written: usize) {
        self.counters.bytes_out.inc_by(written as u64);
        info.count_bytes(written as u64);
        while written > 0 {
            let Some(front) = self.wq.front() else { break };
            let rest = front.len() - self.woff;
            if written >= rest {
                written -= rest;
                self.woff = 0;
                self.wq_bytes -= front.len();
                self.wq.pop_front();
                self.counters.frames_out.inc();
                info.count_frame();
            } else {
                self.woff += written;
                written = 0;
            }
        }
    }
}

/// The driver's half of a client connection: the deadline timer.
///
/// Deadlines are enforced here rather than by a timer per call: one timer per connection, armed at
/// the earliest deadline and moved only when it fires, so a call costs no timer-wheel operation.
/// Once armed it stays armed (at the next deadline, or one timeout ahead while nothing waits), so a
/// caller writing its request itself rarely finds it unarmed and has to go through the driver.
#[derive(Default)]
struct ClientSide {
    timer: Option<Pin<Box<Sleep>>>,
    /// The timeout of the latest request the driver took.
    timeout: Duration,
}

impl ClientSide {
    /// Arms the timer for `deadline` if it would fire later (or not at all).
    fn arm(&mut self, st: &mut LaneState, deadline: Instant) {
        if st.timer_at.is_some_and(|t| t <= deadline) {
            return;
        }
        match &mut self.timer {
            Some(t) => t.as_mut().reset(deadline),
            None => self.timer = Some(Box::pin(tokio::time::sleep_until(deadline))),
        }
        st.timer_at = Some(deadline);
    }

    /// Drops the timer before the connection leaves its worker (a timer belongs to one runtime).
    fn detach(&mut self, st: &mut LaneState) {
        self.timer = None;
        st.timer_at = None;
    }

    /// Arms the timer on the connection's new worker for the earliest pending deadline.
    fn rearm(&mut self, st: &mut LaneState) {
        st.book.pop_answered();
        if let Some(&(deadline, _)) = st.book.deadlines.front() {
            self.arm(st, deadline);
        }
    }

    /// Fails every request past its deadline once the timer fires; re-arms.
    fn poll_expired(&mut self, cx: &mut Context<'_>, lane: &Lane, peer: &str) -> bool {
        let fired = self
            .timer
            .as_mut()
            .is_some_and(|t| t.as_mut().poll(cx).is_ready());
        if !fired {
            return false;
        }
        let now = Instant::now();
        let expired = {
            let mut st = lane.lock();
            let expired = st.book.expired(now);
            let next = match st.book.deadlines.front() {
                Some(&(next, _)) => next,
                None => now + self.timeout.max(Duration::from_millis(1)),
            };
            if let Some(timer) = self.timer.as_mut() {
                timer.as_mut().reset(next);
                // Register the waker for the new deadline.
                let _ = timer.as_mut().poll(cx);
            }
            st.timer_at = Some(next);
            expired
        };
        for (tx, after) in expired {
            let _ = tx.send(Err(MsgrError::Timeout {
                peer: peer.to_string(),
                op: "call",
                after,
            }));
        }
        true
    }
}

enum Side {
    Client(ClientSide),
    Server(Box<ServerSide>),
}

/// One connection's state: everything but its socket, so that it can move to another worker with
/// the socket detached. Dropping it (e.g. when the worker stops) fails every outstanding request
/// with `Reset`.
pub(crate) struct Conn {
    shared: Arc<Shared>,
    /// The worker it runs on.
    worker: usize,
    peer: Arc<str>,
    limits: FrameLimits,
    decoder: Decoder,
    rbuf: BytesMut,
    lane: Arc<Lane>,
    rx: mpsc::UnboundedReceiver<Outgoing>,
    side: Side,
    counters: WorkerCounters,
    metrics: MsgrMetrics,
    /// No more reading; exit once in-flight work is written.
    closing: bool,
    /// Why the connection is going away, reported to outstanding callers.
    close_reason: Option<String>,
    /// A move under way: the connection is served here until the target worker is running.
    moving: Option<Moving>,
    /// When the connection left its previous worker.
    moved_at: Option<std::time::Instant>,
}

/// How a driver's poll loop ended.
enum Exit {
    Closed,
    Migrate(Moving),
}

/// A connection about to move: the task waiting for it on the target worker says when it runs,
/// and takes the connection then. Until that signal the connection is served where it is, so the
/// pause is one hand-over between two running workers, not the wait for a busy one to get round to
/// a new task.
struct Moving {
    to: usize,
    ready: oneshot::Receiver<()>,
    hand: oneshot::Sender<(Conn, DetachedStream)>,
}

/// Spawns the task on worker `to` that will take the connection.
fn prepare_move(shared: &Shared, to: usize) -> Moving {
    let (ready_tx, ready) = oneshot::channel();
    let (hand, taken) = oneshot::channel::<(Conn, DetachedStream)>();
    shared.workers.get(to).spawn(async move {
        if ready_tx.send(()).is_ok()
            && let Ok((conn, stream)) = taken.await
        {
            run(conn, stream).await;
        }
    });
    Moving { to, ready, hand }
}

/// A connection attached to its worker: the future that worker runs.
struct Driver {
    io: Stream,
    conn: Conn,
}

impl Future for Driver {
    type Output = Exit;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Exit> {
        let this = &mut *self;
        let t0 = std::time::Instant::now();
        let r = this.conn.drive(&mut this.io, cx);
        let ns = u64::try_from(t0.elapsed().as_nanos()).unwrap_or(u64::MAX);
        this.conn
            .lane
            .info
            .busy_ns
            .fetch_add(ns, std::sync::atomic::Ordering::Relaxed);
        r
    }
}

/// Runs `conn` on its worker over `stream` until it closes or moves on.
pub(crate) fn spawn(conn: Conn, stream: DetachedStream) {
    let shared = Arc::clone(&conn.shared);
    shared.workers.get(conn.worker).spawn(run(conn, stream));
}

async fn run(mut conn: Conn, stream: DetachedStream) {
    let io = match stream.attach() {
        Ok(io) => io,
        Err(e) => {
            // Dropping `conn` fails its callers with `Reset`.
            tracing::warn!(peer = %conn.peer, error = %e, "cannot attach connection");
            conn.begin_close(&format!("cannot attach: {e}"));
            return;
        }
    };
    conn.attached();
    let mut driver = Driver { io, conn };
    if let Exit::Migrate(m) = (&mut driver).await {
        let Driver { io, mut conn } = driver;
        match io.detach() {
            Ok(stream) => {
                conn.move_to(m.to);
                // If the target's task is gone (its worker stopped), dropping the connection
                // fails its callers.
                let _ = m.hand.send((conn, stream));
            }
            Err(e) => {
                tracing::warn!(peer = %conn.peer, error = %e, "cannot detach connection to move it");
                conn.begin_close(&format!("cannot detach: {e}"));
            }
        }
    }
}

impl Conn {
    /// A client connection on worker `worker`; its callers write through `lane` too.
    pub(crate) fn client(
        shared: Arc<Shared>,
        worker: usize,
        peer: Arc<str>,
        rx: mpsc::UnboundedReceiver<Outgoing>,
        lane: Arc<Lane>,
    ) -> Self {
        Self::new(
            shared,
            worker,
            peer,
            rx,
            Side::Client(ClientSide::default()),
            lane,
        )
    }

    /// A server connection on worker `worker`.
    pub(crate) fn server(
        shared: Arc<Shared>,
        worker: usize,
        peer: Arc<str>,
        rx: mpsc::UnboundedReceiver<Outgoing>,
        server: ServerSide,
        info: Arc<ConnInfo>,
    ) -> Self {
        let counters = shared.workers.get(worker).counters.clone();
        Self::new(
            shared,
            worker,
            peer,
            rx,
            Side::Server(Box::new(server)),
            Lane::new(None, counters, info),
        )
    }

    fn new(
        shared: Arc<Shared>,
        worker: usize,
        peer: Arc<str>,
        rx: mpsc::UnboundedReceiver<Outgoing>,
        side: Side,
        lane: Arc<Lane>,
    ) -> Self {
        let counters = lane.lock().counters.clone();
        counters.connections.inc();
        shared.conns.insert(&lane.info);
        let limits = shared.config.limits();
        let metrics = shared.metrics.clone();
        Self {
            shared,
            worker,
            peer,
            limits,
            decoder: Decoder::new(limits),
            rbuf: BytesMut::with_capacity(READ_CHUNK),
            lane,
            rx,
            side,
            counters,
            metrics,
            closing: false,
            close_reason: None,
            moving: None,
            moved_at: None,
        }
    }

    /// Moves the connection's accounting to worker `to` (its socket is detached).
    fn move_to(&mut self, to: usize) {
        let to = to % self.shared.workers.len();
        let counters = self.shared.workers.get(to).counters.clone();
        self.counters.connections.dec();
        counters.connections.inc();
        self.counters = counters.clone();
        {
            let mut st = self.lane.lock();
            st.counters = counters;
            if let Side::Client(c) = &mut self.side {
                c.detach(&mut st);
            }
        }
        self.worker = to;
        let info = &self.lane.info;
        info.worker.store(to, std::sync::atomic::Ordering::Relaxed);
        info.migrations
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.moved_at = Some(std::time::Instant::now());
    }

    /// Called on the connection's worker once its socket is attached there.
    fn attached(&mut self) {
        if let Some(at) = self.moved_at.take() {
            self.metrics.migrated(at.elapsed());
        }
        if let Side::Client(c) = &mut self.side {
            c.rearm(&mut self.lane.lock());
        }
    }

    fn push(&mut self, frame: Frame, permits: Permits) {
        self.lane.lock().push(Queued::new(frame, permits));
    }

    fn on_outgoing(&mut self, msg: Outgoing) {
        match msg {
            Outgoing::Request {
                frame,
                reply,
                deadline,
                timeout,
            } => match &mut self.side {
                Side::Client(c) if !self.closing => {
                    let mut st = self.lane.lock();
                    st.queued = st.queued.saturating_sub(1);
                    st.book
                        .insert(frame.header.request_id, reply, deadline, timeout);
                    c.timeout = timeout;
                    c.arm(&mut st, deadline);
                    st.push(Queued::new(frame, Permits::default()));
                }
                _ => {
                    self.lane.queue_one(true);
                    let _ = reply.send(Err(self.reset_error()));
                }
            },
            Outgoing::OneWay { frame, permits } => {
                let mut st = self.lane.lock();
                st.queued = st.queued.saturating_sub(1);
                st.push(Queued::new(frame, permits));
            }
            Outgoing::Kick => {}
            Outgoing::Done(done) => self.on_done(done),
            Outgoing::Close => self.begin_close("closed by local shutdown"),
            Outgoing::Migrate(to) => {
                let valid = to < self.shared.workers.len() && to != self.worker;
                if valid && !self.closing && self.moving.is_none() {
                    self.moving = Some(prepare_move(&self.shared, to));
                }
            }
        }
    }

    fn begin_close(&mut self, reason: &str) {
        self.closing = true;
        self.lane.lock().closing = true;
        if self.close_reason.is_none() {
            self.close_reason = Some(reason.to_string());
        }
    }

    fn reset_error(&self) -> MsgrError {
        MsgrError::Reset {
            peer: self.peer.to_string(),
            reason: self
                .close_reason
                .clone()
                .unwrap_or_else(|| "connection closed".into()),
        }
    }

    /// Queues the reply of a finished server-side request and returns its budget.
    fn on_done(&mut self, done: Done) {
        let Side::Server(server) = &mut self.side else {
            return;
        };
        server.inflight_reqs -= 1;
        server.inflight_bytes -= done.cost;
        server.inflight_gauge.dec();
        let result = match &done.result {
            Ok(_) => "ok",
            Err(e) => ErrorCode::from_u32(e.code).name(),
        };
        self.metrics
            .served(done.name, done.started.elapsed().as_secs_f64(), result);
        if done.kind != Kind::Request {
            if let Err(e) = done.result {
                tracing::debug!(peer = %self.peer, op = %done.op, error = %e, "one-way handler failed");
            }
            return;
        }
        let mut frame = match done.result {
            Ok(reply) => {
                let crc = reply.data.crc();
                Frame::with_data_crc(
                    Kind::Response,
                    done.op,
                    done.request_id,
                    reply.body,
                    reply.data.bytes,
                    crc,
                )
            }
            Err(e) => error_frame(done.op, done.request_id, &e),
        };
        if frame.encoded_len() - HEADER_LEN > self.limits.max_frame as usize {
            let e = RemoteError::new(
                ErrorCode::Internal,
                format!(
                    "reply of {} bytes exceeds the frame limit of {} bytes",
                    frame.encoded_len() - HEADER_LEN,
                    self.limits.max_frame
                ),
            );
            frame = error_frame(done.op, done.request_id, &e);
        }
        self.push(frame, done.permits);
    }

    /// Writes queued frames until the socket would block. Returns whether anything was written.
    fn poll_write_queue(&mut self, io: &mut Stream, cx: &mut Context<'_>) -> io::Result<bool> {
        let mut progress = false;
        let mut st = self.lane.lock();
        while !st.wq.is_empty() {
            let mut iov = [IoSlice::new(&[]); MAX_IOV];
            let mut n = 0;
            let mut skip = st.woff;
            'fill: for q in &st.wq {
                for part in [&q.header[..], &q.body[..], &q.data[..]] {
                    if skip >= part.len() {
                        skip -= part.len();
                        continue;
                    }
                    if n == MAX_IOV {
                        break 'fill;
                    }
                    iov[n] = IoSlice::new(&part[skip..]);
                    skip = 0;
                    n += 1;
                }
            }
            match Pin::new(&mut *io).poll_write_vectored(cx, &iov[..n]) {
                Poll::Ready(Ok(0)) => return Err(io::ErrorKind::WriteZero.into()),
                Poll::Ready(Ok(written)) => {
                    progress = true;
                    st.advance_written(&self.lane.info, written);
                }
                Poll::Ready(Err(e)) if e.kind() == io::ErrorKind::Interrupted => {}
                Poll::Ready(Err(e)) => return Err(e),
                Poll::Pending => break,
            }
        }
        Ok(progress)
    }

    /// Whether the driver may decode and admit another frame now.
    fn may_admit(&self) -> bool {
        match &self.side {
            Side::Client(_) => true,
            Side::Server(s) => s.stalled.is_none() && !self.closing,
        }
    }

    /// Reads once and handles every whole frame buffered. Returns whether anything happened, or the
    /// reason to close the connection.
    fn poll_read(&mut self, io: &mut Stream, cx: &mut Context<'_>) -> Result<bool, Closed> {
        let mut progress = self.retry_stalled(cx);
        if !self.may_admit() {
            return Ok(progress);
        }
        if self.rbuf.capacity() - self.rbuf.len() < READ_CHUNK / 4 {
            self.rbuf.reserve(READ_CHUNK);
        }
        let read = {
            let fut = std::pin::pin!(io.read_buf(&mut self.rbuf));
            fut.poll(cx)
        };
        match read {
            Poll::Pending => {}
            Poll::Ready(Ok(0)) => return Err(Closed::Eof),
            Poll::Ready(Ok(n)) => {
                progress = true;
                self.counters.bytes_in.inc_by(n as u64);
                self.lane.info.count_bytes(n as u64);
            }
            Poll::Ready(Err(e)) if e.kind() == io::ErrorKind::Interrupted => progress = true,
            Poll::Ready(Err(e)) => return Err(Closed::Io(e)),
        }
        while self.may_admit() {
            match self.decoder.decode(&mut self.rbuf) {
                Ok(Some(frame)) => {
                    progress = true;
                    self.counters.frames_in.inc();
                    self.lane.info.count_frame();
                    self.on_frame(frame, cx);
                }
                Ok(None) => break,
                Err(e) => return Err(Closed::Frame(e)),
            }
        }
        Ok(progress)
    }

    fn on_frame(&mut self, frame: Frame, cx: &mut Context<'_>) {
        match &mut self.side {
            Side::Client(_) => match frame.header.kind {
                Kind::Response | Kind::Error => {
                    // A missing entry is a request that timed out; its late answer is dropped.
                    let tx = self.lane.lock().book.take(frame.header.request_id);
                    if let Some(tx) = tx {
                        let _ = tx.send(Ok(frame));
                    }
                }
                Kind::Request | Kind::OneWay => {
                    self.metrics.error("unexpected_frame");
                    tracing::debug!(peer = %self.peer, op = %frame.header.op, "server sent a request on a client connection; dropped");
                }
            },
            Side::Server(s) => match frame.header.kind {
                Kind::OneWay if frame.header.op == BundleJoinOp::OP => {
                    match decode_body::<BundleJoin>(BundleJoinOp::NAME, &frame.body) {
                        Ok(j) => {
                            let rx = s.bundles.join(j, self.worker);
                            // A bundle's calls are handed over in order from one connection to
                            // the next: on one worker that costs no thread wake-up.
                            let home = rx.home();
                            s.bundle = Some(rx);
                            if home != self.worker && self.moving.is_none() {
                                self.moving = Some(prepare_move(&self.shared, home));
                            }
                        }
                        Err(e) => {
                            self.metrics.error("decode");
                            tracing::debug!(peer = %self.peer, error = %e, "bad bundle join; ignored");
                        }
                    }
                }
                Kind::Request | Kind::OneWay => self.admit(frame, cx),
                Kind::Response | Kind::Error => {
                    self.metrics.error("unexpected_frame");
                    tracing::debug!(peer = %self.peer, op = %frame.header.op, "client sent a response on a server connection; dropped");
                }
            },
        }
    }

    /// Takes budget for a request and dispatches it, or parks it until budget is available.
    fn admit(&mut self, frame: Frame, cx: &mut Context<'_>) {
        let Side::Server(s) = &mut self.side else {
            return;
        };
        let cost = frame_cost(&frame, s.max_conn_bytes);
        let conn_full = s.inflight_reqs >= s.max_conn_reqs
            || (s.inflight_reqs > 0 && s.inflight_bytes + cost > s.max_conn_bytes);
        if conn_full {
            // Replies coming back through `rx` wake the driver and `retry_stalled` tries again.
            s.stalled = Some(frame);
            return;
        }
        let cost32 = u32::try_from(cost).unwrap_or(u32::MAX);
        let reqs = Arc::clone(&s.total_reqs).try_acquire_owned();
        let bytes = Arc::clone(&s.total_bytes).try_acquire_many_owned(cost32);
        match (reqs, bytes) {
            (Ok(r), Ok(b)) => {
                let permits = Permits {
                    _reqs: Some(r),
                    _bytes: Some(b),
                };
                self.dispatch(frame, cost, permits, cx);
            }
            _ => {
                let (reqs, bytes) = (Arc::clone(&s.total_reqs), Arc::clone(&s.total_bytes));
                s.waiting = Some(Box::pin(async move {
                    let r = reqs.acquire_owned().await?;
                    let b = bytes.acquire_many_owned(cost32).await?;
                    Ok(Permits {
                        _reqs: Some(r),
                        _bytes: Some(b),
                    })
                }));
                s.stalled = Some(frame);
            }
        }
    }

    fn retry_stalled(&mut self, cx: &mut Context<'_>) -> bool {
        let Side::Server(s) = &mut self.side else {
            return false;
        };
        let Some(frame) = s.stalled.take() else {
            return false;
        };
        match s.waiting.as_mut().map(|w| w.as_mut().poll(cx)) {
            None => {
                self.admit(frame, cx);
                matches!(&self.side, Side::Server(s) if s.stalled.is_none())
            }
            Some(Poll::Pending) => {
                s.stalled = Some(frame);
                false
            }
            Some(Poll::Ready(Ok(permits))) => {
                s.waiting = None;
                let cost = frame_cost(&frame, s.max_conn_bytes);
                self.dispatch(frame, cost, permits, cx);
                true
            }
            Some(Poll::Ready(Err(_))) => {
                // The semaphores are closed only when the server stops.
                s.waiting = None;
                self.begin_close("server stopped");
                true
            }
        }
    }

    /// Runs the handler; a reply that is ready at once is queued without a task switch.
    fn dispatch(&mut self, frame: Frame, cost: u64, permits: Permits, cx: &mut Context<'_>) {
        let Side::Server(s) = &mut self.side else {
            return;
        };
        let h = frame.header;
        s.inflight_reqs += 1;
        s.inflight_bytes += cost;
        s.inflight_gauge.inc();
        let req = Request {
            kind: h.kind,
            op: h.op,
            flags: h.flags,
            peer: Arc::clone(&self.peer),
            body: frame.body,
            data: Payload::with_crc(frame.data, h.data_crc),
        };
        let name = match s.handler.op_name(h.op) {
            Some(n) => OpName::Named(n),
            None => OpName::Number(h.op.0),
        };
        let started = std::time::Instant::now();
        let mut fut = match &s.bundle {
            // Calls of a bundle reach the handler in their sequence order, once.
            Some(b) if h.seq != 0 => b.deliver(h.seq, Arc::clone(&s.handler), req),
            _ => s.handler.call(req),
        };
        let mut done = Done {
            kind: h.kind,
            op: h.op,
            name,
            started,
            request_id: h.request_id,
            cost,
            permits,
            result: Ok(Reply::default()),
        };
        let workers = &self.shared.workers;
        if s.dual && workers.len() > 1 {
            // Decoding stays here; the handler runs on the next worker and its reply comes back
            // through the channel.
            let tx = s.tx.clone();
            workers.get(self.worker + 1).spawn(async move {
                done.result = fut.await;
                let _ = tx.send(Outgoing::Done(done));
            });
            return;
        }
        match fut.as_mut().poll(cx) {
            Poll::Ready(result) => {
                done.result = result;
                self.on_done(done);
            }
            Poll::Pending => {
                let tx = s.tx.clone();
                tokio::spawn(async move {
                    done.result = fut.await;
                    let _ = tx.send(Outgoing::Done(done));
                });
            }
        }
    }

    /// Whether a closing connection has nothing left to do.
    fn drained(&self) -> bool {
        let st = self.lane.lock();
        let idle = match &self.side {
            Side::Client(_) => st.book.pending.is_empty(),
            Side::Server(s) => s.inflight_reqs == 0,
        };
        self.closing && idle && st.wq.is_empty()
    }

    fn handle_closed(&mut self, closed: Closed) -> bool {
        match closed {
            Closed::Eof => {
                self.begin_close("closed by peer");
                // A client has nobody to answer its pending requests any more.
                matches!(self.side, Side::Client(_))
            }
            Closed::Io(e) => {
                self.metrics.error("reset");
                self.begin_close(&e.to_string());
                true
            }
            Closed::Frame(e) => {
                self.metrics.error("frame");
                // One line a second: a scan or a broken peer sends bad frames on every
                // connection it opens (the count is in the errors metric).
                if let Some(suppressed) = BAD_FRAME_LOG.admit_now() {
                    tracing::warn!(peer = %self.peer, error = %e, suppressed, "closing connection after a bad frame");
                }
                self.begin_close(&format!("bad frame: {e}"));
                if matches!(self.side, Side::Server(_)) {
                    // Tell the peer why before closing; framing is lost, so nothing else is read.
                    let e = RemoteError::new(ErrorCode::BadRequest, format!("bad frame: {e}"));
                    self.push(error_frame(nacre_proto::Op(0), 0, &e), Permits::default());
                    return false;
                }
                true
            }
        }
    }
}

enum Closed {
    Eof,
    Io(io::Error),
    Frame(FrameError),
}

/// The in-flight byte cost of a frame, capped so that one frame larger than the budget still passes.
fn frame_cost(frame: &Frame, cap: u64) -> u64 {
    ((frame.body.len() + frame.data.len()) as u64).min(cap)
}

fn error_frame(op: nacre_proto::Op, request_id: u64, e: &RemoteError) -> Frame {
    Frame::new(Kind::Error, op, request_id, encode_body(e), Bytes::new())
}

impl Conn {
    /// One poll of the connection: moves messages, timers, writes and reads along until nothing
    /// more can happen now, the connection is done, or it is to move to another worker.
    fn drive(&mut self, io: &mut Stream, cx: &mut Context<'_>) -> Poll<Exit> {
        let this = self;
        // A source that returned Pending during this call has registered the waker; polling it again
        // before anything changed would only repeat the registration.
        let mut rx_waiting = false;
        let mut timer_waiting = false;
        let mut read_waiting = false;
        for _ in 0..BUDGET {
            let mut progress = false;
            while !rx_waiting && this.lane.lock().wq_bytes < WRITE_QUEUE_HIGH {
                match this.rx.poll_recv(cx) {
                    Poll::Ready(Some(msg)) => {
                        progress = true;
                        this.on_outgoing(msg);
                    }
                    Poll::Ready(None) => {
                        // Every handle is gone: nobody can send more requests.
                        this.begin_close("client dropped");
                        rx_waiting = true;
                    }
                    Poll::Pending => rx_waiting = true,
                }
            }
            if let Some(m) = &mut this.moving {
                match Pin::new(&mut m.ready).poll(cx) {
                    Poll::Ready(Ok(())) => {
                        if let Some(m) = this.moving.take() {
                            return Poll::Ready(Exit::Migrate(m));
                        }
                    }
                    // The target worker is stopping: stay.
                    Poll::Ready(Err(_)) => this.moving = None,
                    Poll::Pending => {}
                }
            }
            if progress {
                // A finished request may have returned the budget a stalled frame waits for.
                read_waiting = false;
            }
            if !timer_waiting {
                let fired = match &mut this.side {
                    Side::Client(c) => c.poll_expired(cx, &this.lane, &this.peer),
                    Side::Server(_) => false,
                };
                if fired {
                    progress = true;
                } else {
                    timer_waiting = true;
                }
            }
            match this.poll_write_queue(io, cx) {
                Ok(p) => progress |= p,
                Err(e) => {
                    this.metrics.error("reset");
                    this.begin_close(&e.to_string());
                    return Poll::Ready(Exit::Closed);
                }
            }
            if !read_waiting {
                match this.poll_read(io, cx) {
                    Ok(true) => progress = true,
                    Ok(false) => read_waiting = true,
                    Err(closed) => {
                        progress = true;
                        if this.handle_closed(closed) {
                            return Poll::Ready(Exit::Closed);
                        }
                    }
                }
            }
            if this.drained() {
                let _ = Pin::new(&mut *io).poll_shutdown(cx);
                return Poll::Ready(Exit::Closed);
            }
            if !progress {
                return Poll::Pending;
            }
        }
        cx.waker().wake_by_ref();
        Poll::Pending
    }
}

impl Drop for Conn {
    fn drop(&mut self) {
        self.counters.connections.dec();
        self.shared.conns.remove(self.lane.info.id);
        let err = self.reset_error();
        // Close first, so that a caller woken by the errors below finds the handle closed and
        // reconnects instead of queueing onto this dead connection.
        self.rx.close();
        let pending = {
            let mut st = self.lane.lock();
            st.closing = true;
            // The second descriptor closes too, so the socket closes with the driver's.
            st.sock = None;
            st.wq.clear();
            st.wq_bytes = 0;
            st.woff = 0;
            std::mem::take(&mut st.book.pending)
        };
        for (_, (tx, _)) in pending {
            let _ = tx.send(Err(err.clone()));
        }
        // Requests still queued to this driver get the same answer.
        while let Ok(msg) = self.rx.try_recv() {
            if let Outgoing::Request { reply, .. } = msg {
                let _ = reply.send(Err(err.clone()));
            }
        }
        if let Side::Server(s) = &self.side {
            s.inflight_gauge.dec_by(i64::from(s.inflight_reqs));
        }
    }
}

static BAD_FRAME_LOG: nacre_types::OncePerSecond = nacre_types::OncePerSecond::new();
