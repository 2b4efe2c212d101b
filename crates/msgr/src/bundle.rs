//! Bundles: several connections from one client to one peer that carry one ordered stream of
//! calls, for bandwidth (replication traffic) without giving up order.
//!
//! The sender ([`crate::Client`] with `bundle_conns` > 1 and a call marked `bundled`) numbers each
//! call of a bundle (`seq`, in the frame header, from 1) and spreads the calls over the bundle's
//! connections. Every connection of a bundle starts with a [`BundleJoin`] frame naming the bundle
//! and the lowest sequence number the sender still waits for. When a connection resets, the calls
//! that were on it are sent again, with the same sequence numbers, on the others.
//!
//! The receiver ([`BundleRx`], one per bundle, shared by its connections) hands calls to the
//! handler strictly in sequence order: a call that arrives early waits for its turn. A call that
//! arrives again (a resend after a reset) is not handled twice: it gets the first one's reply,
//! from a window of recent replies. A call whose predecessor never arrives within [`GAP_TIMEOUT`]
//! (its sender gave up) lets the bundle move past the gap; the missing call, should it still
//! arrive, is refused rather than handled out of order.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use nacre_proto::msg::RemoteError;
use nacre_proto::msg::sys::BundleJoin;
use nacre_types::ErrorCode;
use nacre_types::sync::lock;
use tokio::sync::oneshot;

use crate::handler::{Handler, Reply, Request};
use crate::transport::BoxFuture;

/// How long a call that arrived early waits for its predecessors before the bundle moves past them.
pub(crate) const GAP_TIMEOUT: Duration = Duration::from_secs(10);

/// Replies remembered per bundle for calls that arrive again.
const REMEMBERED: usize = 4096;

type Outcome = Result<Reply, RemoteError>;

/// The receiving end of one bundle.
#[derive(Debug)]
pub(crate) struct BundleRx {
    state: Mutex<RxState>,
    /// The worker of the connection that created it, where every connection of the bundle goes.
    home: usize,
}

#[derive(Debug)]
struct RxState {
    /// The next sequence number to hand to the handler.
    next: u64,
    /// Calls that arrived early (maybe more than once), waiting for their turn.
    waiting: BTreeMap<u64, Vec<oneshot::Sender<()>>>,
    /// Calls handed to the handler and not finished: who else waits for their reply.
    running: HashMap<u64, Vec<oneshot::Sender<Outcome>>>,
    /// Replies of recent calls.
    done: BTreeMap<u64, Outcome>,
    /// Calls ahead of `next` that their sender gave up: not waited for.
    skipped: std::collections::BTreeSet<u64>,
}

impl BundleRx {
    fn new(low: u64, home: usize) -> Self {
        Self {
            home,
            state: Mutex::new(RxState {
                next: low.max(1),
                waiting: BTreeMap::new(),
                running: HashMap::new(),
                done: BTreeMap::new(),
                skipped: std::collections::BTreeSet::new(),
            }),
        }
    }

    /// The worker the bundle's connections run on.
    pub(crate) fn home(&self) -> usize {
        self.home
    }

    /// A (re)joining connection: the sender waits for nothing below `low`, nor for `skip`.
    fn joined(&self, j: BundleJoin) {
        let mut st = lock(&self.state);
        if j.skip >= st.next {
            st.skipped.insert(j.skip);
        }
        if j.low > st.next {
            st.next = j.low;
        }
        st.wake();
    }

    /// Handles call `seq` of the bundle in its turn; answers a call seen before with its reply.
    pub(crate) fn deliver(
        self: &Arc<Self>,
        seq: u64,
        handler: Arc<dyn Handler>,
        req: Request,
    ) -> BoxFuture<'static, Outcome> {
        let this = Arc::clone(self);
        Box::pin(async move {
            let deadline = tokio::time::Instant::now() + GAP_TIMEOUT;
            let fut = loop {
                let step = {
                    let mut st = lock(&this.state);
                    if seq < st.next {
                        // Seen before (a resend), or passed over.
                        Step::Again(st.again(seq))
                    } else if seq == st.next {
                        // Its turn: handed to the handler now, and the next may follow.
                        st.next = seq + 1;
                        st.running.insert(seq, Vec::new());
                        st.wake();
                        Step::Go(handler.call(req.clone()))
                    } else {
                        let (tx, rx) = oneshot::channel();
                        st.waiting.entry(seq).or_default().push(tx);
                        Step::Wait(rx)
                    }
                };
                match step {
                    Step::Again(again) => return again.await_outcome().await,
                    Step::Go(fut) => break fut,
                    Step::Wait(rx) => {
                        if tokio::time::timeout_at(deadline, rx).await.is_err() {
                            let mut st = lock(&this.state);
                            if seq > st.next {
                                tracing::warn!(
                                    seq,
                                    missing = st.next,
                                    "a bundle moves past calls that did not arrive within {GAP_TIMEOUT:?}"
                                );
                                st.next = seq;
                            }
                        }
                    }
                }
            };
            let out = fut.await;
            let waiters = {
                let mut st = lock(&this.state);
                st.done.insert(seq, out.clone());
                while st.done.len() > REMEMBERED {
                    st.done.pop_first();
                }
                st.running.remove(&seq).unwrap_or_default()
            };
            for tx in waiters {
                let _ = tx.send(out.clone());
            }
            out
        })
    }
}

/// What a call finds when it looks at the bundle.
enum Step {
    Again(Again),
    Go(BoxFuture<'static, Outcome>),
    Wait(oneshot::Receiver<()>),
}

/// What a call seen before gets.
enum Again {
    Now(Outcome),
    Later(oneshot::Receiver<Outcome>),
}

impl Again {
    async fn await_outcome(self) -> Outcome {
        match self {
            Self::Now(o) => o,
            Self::Later(rx) => rx.await.unwrap_or_else(|_| {
                Err(RemoteError::new(
                    ErrorCode::Unavailable,
                    "the first copy of this call was dropped unanswered".to_string(),
                ))
            }),
        }
    }
}

impl RxState {
    /// Wakes the call whose turn it is (every copy of it), if it is waiting; and any waiting
    /// below it, passed over by a rejoin, to be answered.
    fn wake(&mut self) {
        while self.skipped.remove(&self.next) {
            self.next += 1;
        }
        while self.skipped.first().is_some_and(|&s| s < self.next) {
            self.skipped.pop_first();
        }
        while let Some(e) = self.waiting.first_entry() {
            if *e.key() > self.next {
                break;
            }
            for tx in e.remove() {
                let _ = tx.send(());
            }
        }
    }

    /// A call below `next`: its reply, a promise of it, or a refusal.
    fn again(&mut self, seq: u64) -> Again {
        if let Some(o) = self.done.get(&seq) {
            return Again::Now(o.clone());
        }
        if let Some(waiters) = self.running.get_mut(&seq) {
            let (tx, rx) = oneshot::channel();
            waiters.push(tx);
            return Again::Later(rx);
        }
        Again::Now(Err(RemoteError::new(
            ErrorCode::Unavailable,
            format!(
                "bundle call {seq} arrived after the bundle moved past it (or its reply is no longer remembered)"
            ),
        )))
    }
}

/// The bundles a server's connections belong to, by id. A bundle lives while one of its
/// connections does.
#[derive(Debug, Default)]
pub(crate) struct Bundles {
    map: Mutex<HashMap<u64, Weak<BundleRx>>>,
}

impl Bundles {
    /// The bundle a joining connection belongs to.
    pub(crate) fn join(&self, j: BundleJoin, worker: usize) -> Arc<BundleRx> {
        let mut map = lock(&self.map);
        if let Some(rx) = map.get(&j.bundle).and_then(Weak::upgrade) {
            rx.joined(j);
            return rx;
        }
        map.retain(|_, w| w.strong_count() > 0);
        let rx = Arc::new(BundleRx::new(j.low, worker));
        map.insert(j.bundle, Arc::downgrade(&rx));
        rx
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicU64, Ordering};

    use bytes::Bytes;
    use nacre_proto::{Flags, Kind, Op};

    use super::*;
    use crate::handler::Payload;

    fn join(bundles: &Bundles, bundle: u64, low: u64) -> Arc<BundleRx> {
        bundles.join(
            BundleJoin {
                bundle,
                low,
                skip: 0,
            },
            0,
        )
    }

    fn req(seq: u64) -> Request {
        Request {
            kind: Kind::Request,
            op: Op(9),
            flags: Flags::default(),
            peer: "p".into(),
            body: Bytes::copy_from_slice(&seq.to_le_bytes()),
            data: Payload::none(),
        }
    }

    /// Records the order calls reach it; answers each with its sequence number.
    fn recorder(order: Arc<Mutex<Vec<u64>>>, calls: Arc<AtomicU64>) -> Arc<dyn Handler> {
        Arc::new(move |r: Request| -> BoxFuture<'static, Outcome> {
            let seq = u64::from_le_bytes(r.body[..8].try_into().unwrap_or_default());
            order.lock().unwrap_or_else(|e| e.into_inner()).push(seq);
            calls.fetch_add(1, Ordering::Relaxed);
            Box::pin(async move {
                Ok(Reply {
                    body: Bytes::copy_from_slice(&seq.to_le_bytes()),
                    data: Payload::none(),
                })
            })
        })
    }

    #[tokio::test]
    async fn calls_reach_the_handler_in_sequence_order_and_once() {
        let bundles = Bundles::default();
        let rx = join(&bundles, 7, 1);
        let order = Arc::new(Mutex::new(Vec::new()));
        let calls = Arc::new(AtomicU64::new(0));
        let h = recorder(Arc::clone(&order), Arc::clone(&calls));
        // Arrival order 3, 1, 2 (and 2 again, a resend), on any connection of the bundle.
        let f3 = tokio::spawn(rx.deliver(3, Arc::clone(&h), req(3)));
        let f1 = tokio::spawn(rx.deliver(1, Arc::clone(&h), req(1)));
        let f2 = tokio::spawn(rx.deliver(2, Arc::clone(&h), req(2)));
        for (f, want) in [(f1, 1u64), (f2, 2), (f3, 3)] {
            let out = f.await.unwrap().unwrap();
            assert_eq!(out.body, Bytes::copy_from_slice(&want.to_le_bytes()));
        }
        let again = rx.deliver(2, Arc::clone(&h), req(2)).await.unwrap();
        assert_eq!(again.body, Bytes::copy_from_slice(&2u64.to_le_bytes()));
        assert_eq!(*order.lock().unwrap(), [1, 2, 3]);
        assert_eq!(calls.load(Ordering::Relaxed), 3);
        // Another connection joining the same bundle shares its state.
        let same = join(&bundles, 7, 3);
        assert!(Arc::ptr_eq(&rx, &same));
    }

    #[tokio::test(start_paused = true)]
    async fn a_gap_the_sender_gave_up_is_passed_and_the_late_call_refused() {
        let bundles = Bundles::default();
        let rx = join(&bundles, 1, 1);
        let order = Arc::new(Mutex::new(Vec::new()));
        let h = recorder(Arc::clone(&order), Arc::new(AtomicU64::new(0)));
        // Call 1 never arrives: call 2 waits GAP_TIMEOUT, then goes.
        let out = rx.deliver(2, Arc::clone(&h), req(2)).await.unwrap();
        assert_eq!(out.body, Bytes::copy_from_slice(&2u64.to_le_bytes()));
        let late = rx.deliver(1, Arc::clone(&h), req(1)).await;
        assert_eq!(late.unwrap_err().code(), ErrorCode::Unavailable);
        assert_eq!(*order.lock().unwrap(), [2]);
    }

    #[tokio::test]
    async fn a_rejoin_past_a_gap_moves_the_bundle_on() {
        let bundles = Bundles::default();
        let rx = join(&bundles, 1, 1);
        let order = Arc::new(Mutex::new(Vec::new()));
        let h = recorder(Arc::clone(&order), Arc::new(AtomicU64::new(0)));
        let f5 = tokio::spawn(rx.deliver(5, Arc::clone(&h), req(5)));
        // The sender waits for nothing below 5 any more.
        join(&bundles, 1, 5);
        f5.await.unwrap().unwrap();
        assert_eq!(*order.lock().unwrap(), [5]);
    }
}
