//! One connection of the in-memory network: two bounded pipes, one per direction, each carrying
//! its direction's faults ([`LinkFaults`]), and the [`MemStream`] ends that read and write them.

use std::collections::VecDeque;
use std::fmt;
use std::io::{self, IoSlice};
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use bytes::{Buf, BytesMut};
use nacre_types::sync::lock;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::{Instant, Sleep};

use super::{NetInner, PIPE_CAPACITY, SEGMENT_TARGET, pipe_rng, reset_error};

/// Faults on one direction between two hosts. The all-default value means a healthy link and is never
/// stored in the table.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub(super) struct LinkFaults {
    pub(super) partitioned: bool,
    pub(super) blackhole: bool,
    pub(super) delay: Duration,
    /// Always within `[0, 1]`.
    pub(super) reset_probability: f64,
}

impl LinkFaults {
    pub(super) fn is_healthy(&self) -> bool {
        *self == Self::default()
    }
}

/// A run of bytes written with the same readability time.
#[derive(Debug)]
pub(super) struct Segment {
    /// `None`: readable now. Within a pipe, `ready_at` never decreases from front to back.
    pub(super) ready_at: Option<Instant>,
    /// Never empty while the segment is queued.
    pub(super) data: BytesMut,
}

/// One direction of a connection.
#[derive(Debug)]
pub(super) struct Pipe {
    pub(super) segments: VecDeque<Segment>,
    /// Sum of the segments' lengths; at most `PIPE_CAPACITY` (a single write never pushes past it).
    pub(super) len: usize,
    /// The writing end shut down or was dropped: the reader gets EOF once `segments` is empty.
    pub(super) write_closed: bool,
    /// The reading end was dropped: writes fail with `BrokenPipe`, and nothing is buffered.
    pub(super) read_closed: bool,
    /// The connection was reset: everything fails with `ConnectionReset`, and nothing is buffered.
    pub(super) reset: bool,
    /// The faults of this pipe's direction, kept in step with the network's link table under its lock.
    pub(super) faults: LinkFaults,
    pub(super) rng: fastrand::Rng,
    pub(super) read_waker: Option<Waker>,
    pub(super) write_waker: Option<Waker>,
}

impl Pipe {
    pub(super) fn new(faults: LinkFaults, rng: fastrand::Rng) -> Self {
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

    pub(super) fn discard(&mut self) {
        self.segments.clear();
        self.len = 0;
    }

    /// Appends the first `n` bytes of `bufs`.
    pub(super) fn push(&mut self, bufs: &[IoSlice<'_>], n: usize) {
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

pub(super) fn register(slot: &mut Option<Waker>, cx: &Context<'_>) {
    match slot {
        Some(w) if w.will_wake(cx.waker()) => {}
        _ => *slot = Some(cx.waker().clone()),
    }
}

/// The state both ends of one connection share. `pipes[0]` carries bytes from the connecting end
/// (side 0) to the accepting end (side 1); `pipes[1]` the other way.
#[derive(Debug)]
pub(super) struct Conn {
    pub(super) id: u64,
    /// Weak so that live streams do not keep a dropped network's registry alive for nothing.
    pub(super) net: Weak<NetInner>,
    pub(super) pipes: [Mutex<Pipe>; 2],
    /// Bytes read out of each pipe, shared with the network's per-host-pair counters.
    pub(super) delivered: [Arc<AtomicU64>; 2],
}

impl Conn {
    /// Marks both directions reset and collects the wakers to call once no lock is held.
    pub(super) fn reset(&self, wakers: &mut Vec<Waker>) {
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
    pub(super) fn deregister(&self) {
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
    pub(super) conn: Arc<Conn>,
    /// 0 for the connecting end, 1 for the accepting end; this end writes `pipes[side]` and reads
    /// `pipes[1 - side]`.
    pub(super) side: usize,
    pub(super) local_addr: String,
    pub(super) peer_addr: String,
    /// Wakes a reader waiting for delayed bytes. Recreated on every poll that needs it, because the
    /// stream may have moved to another runtime since the last one.
    pub(super) sleep: Option<Pin<Box<Sleep>>>,
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
    pub(super) fn new(conn: Arc<Conn>, side: usize, local_addr: String, peer_addr: String) -> Self {
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

    pub(super) fn write_pipe(&self) -> &Mutex<Pipe> {
        &self.conn.pipes[self.side]
    }

    pub(super) fn read_pipe(&self) -> &Mutex<Pipe> {
        &self.conn.pipes[1 - self.side]
    }

    pub(super) fn reset_connection(&self) {
        let mut wakers = Vec::new();
        self.conn.reset(&mut wakers);
        wakers.into_iter().for_each(Waker::wake);
        self.conn.deregister();
    }

    pub(super) fn poll_write_slices(
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
pub(super) type Backlog = (MemStream, String);
