//! Running a call on the caller's thread until it first waits, and as a task only after that.
//!
//! `tokio::spawn` schedules the new task at once: from a thread outside the runtime (a FUSE
//! thread) that wakes a runtime thread, which polls the call, sees it send its request and wait,
//! and sleeps again. On these machines a wake-up of another thread costs tens of microseconds,
//! about what a whole 4 KiB round trip costs in software. [`run_detached`] instead polls the call
//! right away on the calling thread, so it sends its request from there; only when what it waits
//! for wakes it (a reply came) does it become a task on the runtime, and is polled there. A call
//! that never waits (an answer from a cache, a write into a buffer) never touches the runtime.
//!
//! The call still runs to the end on its own, whatever happens to the caller: that is the cancel
//! safety [`crate::NetFs`] promises.
//!
//! On a thread that opted in ([`resume_calls_here`]: a mount's messenger workers, which read every
//! reply its calls wait for), the call becomes a task of *that* thread's runtime instead: it goes
//! on right there once the worker has delivered the reply, rather than after a wake-up of a
//! thread of `rt` (measured in docs/benchmarks.md, "Calls go on where their reply is read"). Only
//! threads whose runtime outlives the calls may opt in: a task whose runtime stops is dropped.

use std::cell::Cell;
use std::future::Future;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Wake, Waker};

use tokio::runtime::Handle;

type Call = Pin<Box<dyn Future<Output = ()> + Send>>;

thread_local! {
    /// Calls woken on this thread become tasks of its runtime (see the module doc).
    static RESUME_HERE: Cell<bool> = const { Cell::new(false) };
}

/// Makes calls that this thread wakes go on as tasks of this thread's runtime rather than of the
/// one [`run_detached`] was given. Call it on a runtime thread that outlives every call it may
/// wake (a mount's messenger workers, which live as long as the mount).
pub fn resume_calls_here() {
    RESUME_HERE.with(|r| r.set(true));
}

/// Where a call woken on this thread goes on: this thread's runtime if it opted in, else `rt`.
fn resume(rt: &Handle, call: Call) {
    if RESUME_HERE.with(Cell::get)
        && let Ok(here) = Handle::try_current()
    {
        here.spawn(call);
    } else {
        rt.spawn(call);
    }
}

enum State {
    /// Being polled on the calling thread; `woken` if a wake arrived meanwhile.
    Inline { woken: bool },
    /// Waiting for its first wake-up.
    Parked(Call),
    /// Handed to the runtime, which polls it with the task's own waker from now on.
    Spawned,
}

/// The waker of a call while it runs on its caller's thread: the first wake spawns it.
struct Lazy {
    state: Mutex<State>,
    rt: Handle,
}

impl Lazy {
    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        nacre_types::sync::lock(&self.state)
    }
}

impl Wake for Lazy {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        let mut state = self.state();
        match std::mem::replace(&mut *state, State::Spawned) {
            State::Inline { .. } => *state = State::Inline { woken: true },
            State::Parked(call) => {
                drop(state);
                resume(&self.rt, call);
            }
            State::Spawned => {}
        }
    }
}

/// Runs `call` to its end: on this thread as far as it gets without waiting, then as a task on
/// `rt` once something wakes it. A panic during the first poll is caught (and logged) like a
/// task's would be: the call is dropped, so whoever waits on its result sees it go away.
pub fn run_detached<F>(rt: &Handle, call: F)
where
    F: Future<Output = ()> + Send + 'static,
{
    let lazy = Arc::new(Lazy {
        state: Mutex::new(State::Inline { woken: false }),
        rt: rt.clone(),
    });
    let waker = Waker::from(lazy.clone());
    let mut call: Call = Box::pin(call);
    let polled = {
        let _runtime = rt.enter();
        catch_unwind(AssertUnwindSafe(|| {
            call.as_mut().poll(&mut Context::from_waker(&waker))
        }))
    };
    match polled {
        Ok(Poll::Ready(())) => {}
        Ok(Poll::Pending) => {
            let mut state = lazy.state();
            if matches!(*state, State::Inline { woken: true }) {
                *state = State::Spawned;
                drop(state);
                resume(rt, call);
            } else {
                *state = State::Parked(call);
            }
        }
        Err(_) => tracing::error!("a file system call panicked; it is dropped"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::thread::ThreadId;

    fn runtime() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .expect("runtime")
    }

    #[test]
    fn a_call_that_does_not_wait_finishes_on_the_calling_thread() {
        let rt = runtime();
        let (tx, rx) = std::sync::mpsc::channel::<ThreadId>();
        run_detached(rt.handle(), async move {
            let _ = tx.send(std::thread::current().id());
        });
        assert_eq!(rx.try_recv(), Ok(std::thread::current().id()));
    }

    #[test]
    fn a_call_that_waits_sends_from_here_and_finishes_on_the_runtime() {
        let rt = runtime();
        let (go_tx, go_rx) = tokio::sync::oneshot::channel::<()>();
        let (sent_tx, sent_rx) = std::sync::mpsc::channel::<ThreadId>();
        let (done_tx, done_rx) = std::sync::mpsc::channel::<ThreadId>();
        run_detached(rt.handle(), async move {
            let _ = sent_tx.send(std::thread::current().id());
            let _ = go_rx.await;
            let _ = done_tx.send(std::thread::current().id());
        });
        assert_eq!(sent_rx.try_recv(), Ok(std::thread::current().id()));
        assert!(done_rx.try_recv().is_err(), "it waits for its wake-up");
        let _ = go_tx.send(());
        let on = done_rx
            .recv_timeout(std::time::Duration::from_secs(10))
            .expect("the call finishes once woken");
        assert_ne!(on, std::thread::current().id());
    }

    #[test]
    fn a_call_woken_on_a_thread_that_opted_in_goes_on_there() {
        let rt = runtime();
        for opt_in in [true, false] {
            let (go_tx, go_rx) = tokio::sync::oneshot::channel::<()>();
            let (done_tx, done_rx) = tokio::sync::oneshot::channel::<ThreadId>();
            run_detached(rt.handle(), async move {
                let _ = go_rx.await;
                let _ = done_tx.send(std::thread::current().id());
            });
            // The waking thread has a runtime of its own, as a messenger worker does.
            let waker = std::thread::spawn(move || {
                let local = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .expect("runtime");
                local.block_on(async move {
                    if opt_in {
                        resume_calls_here();
                    }
                    let _ = go_tx.send(());
                    let on = tokio::time::timeout(std::time::Duration::from_secs(10), done_rx)
                        .await
                        .expect("the call finishes once woken")
                        .expect("the call reports its thread");
                    (std::thread::current().id(), on)
                })
            });
            let (waker, on) = waker.join().expect("the waking thread");
            assert_eq!(on == waker, opt_in, "opted in: {opt_in}");
        }
    }

    #[test]
    fn a_wake_during_the_first_poll_is_not_lost() {
        let rt = runtime();
        let polls = Arc::new(AtomicUsize::new(0));
        let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
        let p = polls.clone();
        run_detached(
            rt.handle(),
            std::future::poll_fn(move |cx| {
                if p.fetch_add(1, Ordering::SeqCst) == 0 {
                    // Woken before the first poll returns, as when a reply beats the poll.
                    cx.waker().wake_by_ref();
                    return Poll::Pending;
                }
                let _ = done_tx.send(());
                Poll::Ready(())
            }),
        );
        done_rx
            .recv_timeout(std::time::Duration::from_secs(10))
            .expect("spawned after the early wake");
        assert_eq!(polls.load(Ordering::SeqCst), 2);
    }

    #[test]
    fn a_panic_in_the_first_poll_drops_the_call() {
        let rt = runtime();
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        run_detached(rt.handle(), async move {
            let _keep = tx;
            panic!("boom");
        });
        assert!(rx.blocking_recv().is_err());
    }
}
