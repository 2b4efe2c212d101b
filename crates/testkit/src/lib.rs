//! Helpers the workspace's tests share, so each test crate does not write its own:
//!
//! - **Bounded waits.** Tests wait for a condition, never for a length of time: [`until_changed`]
//!   re-checks each time a watch channel changes (a map epoch, a count of applied entries), and
//!   [`eventually`] polls where no event exists. Both give up after a bound and say so, so a
//!   test that cannot reach its state fails instead of hanging.
//! - **Deterministic bytes** ([`pattern`]): incompressible, and the same for the same seed.

use std::future::Future;
use std::time::Duration;

use tokio::sync::watch;
use tokio::time::Instant;

/// Runs `check` now and again each time `changes` changes, until it returns `Some`; `None` once
/// `within` has passed (or the channel's sender is gone) without it.
pub async fn until_changed<W, T, F, Fut>(
    changes: &mut watch::Receiver<W>,
    within: Duration,
    mut check: F,
) -> Option<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let deadline = Instant::now() + within;
    loop {
        changes.mark_unchanged();
        if let Some(t) = check().await {
            return Some(t);
        }
        match tokio::time::timeout_at(deadline, changes.changed()).await {
            Ok(Ok(())) => {}
            Ok(Err(_)) | Err(_) => return None,
        }
    }
}

/// Runs `check` every `poll` until it returns `Some`; `None` once `within` has passed without it.
/// For conditions no event announces; prefer [`until_changed`] where one does.
pub async fn eventually<T, F, Fut>(within: Duration, poll: Duration, mut check: F) -> Option<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let deadline = Instant::now() + within;
    loop {
        if let Some(t) = check().await {
            return Some(t);
        }
        if Instant::now() >= deadline {
            return None;
        }
        tokio::time::sleep(poll).await;
    }
}

/// `len` incompressible bytes, the same for the same `seed`.
pub fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut v = vec![0u8; len];
    fastrand::Rng::with_seed(seed).fill(&mut v);
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn patterns_repeat_per_seed() {
        assert_eq!(pattern(7, 1000), pattern(7, 1000));
        assert_ne!(pattern(7, 1000), pattern(8, 1000));
        assert_eq!(pattern(7, 10), pattern(7, 1000)[..10]);
    }

    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn waits_end_on_the_condition_or_the_bound() {
        let (tx, mut rx) = watch::channel(0u64);
        let probe = rx.clone();
        let waiter = tokio::spawn(async move {
            let got = until_changed(&mut rx, Duration::from_secs(5), || {
                let v = *probe.borrow();
                async move { (v >= 3).then_some(v) }
            })
            .await;
            (got, rx)
        });
        for i in 1..=3 {
            tx.send_replace(i);
            tokio::task::yield_now().await;
        }
        let (got, mut rx) = waiter.await.expect("the waiter runs");
        assert_eq!(got, Some(3));
        // Nothing changes: the bound ends the wait.
        let never = until_changed(&mut rx, Duration::from_secs(1), || async { None::<()> }).await;
        assert_eq!(never, None);

        let mut n = 0;
        let polled = eventually(Duration::from_secs(1), Duration::from_millis(10), || {
            n += 1;
            let done = n == 4;
            async move { done.then_some(n) }
        })
        .await;
        assert_eq!(polled, Some(4));
        let gave_up = eventually(
            Duration::from_millis(50),
            Duration::from_millis(10),
            || async { None::<()> },
        )
        .await;
        assert_eq!(gave_up, None);
    }
}
