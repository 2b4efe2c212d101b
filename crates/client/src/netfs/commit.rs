//! Bounds on how long a run streamed to a normal extent stays uncommitted, so that the data
//! partitions' garbage collector never deletes an extent whose key is still to come
//! (docs/ARCHITECTURE.md, "Garbage collection").
//!
//! - **The rule.** A key for bytes streamed to a normal extent is committed at most
//!   [`NetFsConfig::commit_within`] (`KEY_COMMIT_WITHIN`, 15 min, half the collector's least
//!   grace) after the run's first packet was sent; a commit that would come later fails with
//!   `FsError::WriteFailed` and commits nothing (the run's bytes are reported lost, like any
//!   failed commit). The run's first packet is the oldest write its keys cover: packets a stream
//!   writes again elsewhere after a failure go out later. A copy-on-write rewrite of committed
//!   bytes that streams to a new extent (`write_committed`) is bound alike.
//! - **The committer.** So that an open file whose writer is slow or idle does not reach that
//!   bound, a task of the client commits every run whose first packet is older than
//!   [`NetFsConfig::commit_every`] (30 s): it takes a turn on the file (after the calls issued
//!   before it, as an `fsync` would) and flushes it; a failure is kept for the file's next
//!   `flush`, `fsync` or `close` to report. It runs while some open file has a streamed run.
//!
//! [`NetFsConfig::commit_within`]: super::NetFsConfig::commit_within
//! [`NetFsConfig::commit_every`]: super::NetFsConfig::commit_every

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use nacre_types::sync::lock;

use super::{Inner, OpenFile, Run, Turn};
use crate::meta::{FsError, FsResult};

/// Whether a commit of `run`'s streamed keys at `now` keeps the rule: its first packet was sent
/// no longer than `within` ago. A run that streamed nothing has no such key.
pub(super) fn may_commit(run: &Run, now: Instant, within: Duration) -> FsResult<()> {
    match run.first_sent {
        Some(at) => self::within(at, now, within),
        None => Ok(()),
    }
}

/// Whether a commit at `now` of keys whose first packet was sent at `sent` keeps the rule (a
/// copy-on-write rewrite streamed to a new extent is bound by it too).
pub(super) fn within(sent: Instant, now: Instant, within: Duration) -> FsResult<()> {
    let age = now.saturating_duration_since(sent);
    if age <= within {
        return Ok(());
    }
    Err(FsError::WriteFailed(format!(
        "the first packet of these bytes was sent {:.1} s ago, past the {} s within which its \
         key must be committed (the data nodes may collect the extent); nothing committed",
        age.as_secs_f64(),
        within.as_secs()
    )))
}

/// Whether the committer should commit `run` at `now`.
pub(super) fn due(run: &Run, now: Instant, every: Duration) -> bool {
    run.first_sent
        .is_some_and(|at| now.saturating_duration_since(at) >= every)
}

impl Inner {
    /// Starts the committer if it is not running (called when a run sends its first packet).
    pub(super) fn wake_committer(&self) {
        if self.committer.swap(true, Ordering::SeqCst) {
            return;
        }
        let me = self.me.clone();
        let every = self.cfg.commit_every;
        tokio::spawn(async move {
            loop {
                tokio::time::sleep((every / 2).max(Duration::from_millis(10))).await;
                let Some(inner) = me.upgrade() else { return };
                if !inner.commit_due().await {
                    // No streamed run left: stop (the next first packet starts it again). A run
                    // that started meanwhile set the flag after our check or finds it cleared.
                    inner.committer.store(false, Ordering::SeqCst);
                    if !inner.any_streamed() || inner.committer.swap(true, Ordering::SeqCst) {
                        return;
                    }
                }
            }
        });
    }

    /// Whether some open file has a streamed run (without waiting for any file's lock: a busy
    /// file counts).
    fn any_streamed(&self) -> bool {
        let files: Vec<Arc<OpenFile>> = lock(&self.files).values().cloned().collect();
        files.iter().any(|f| match f.state.try_lock() {
            Ok(st) => st.run.as_ref().is_some_and(|r| r.first_sent.is_some()),
            Err(_) => true,
        })
    }

    /// Commits the files whose streamed runs are due; returns whether any streamed run was seen.
    async fn commit_due(&self) -> bool {
        let files: Vec<Arc<OpenFile>> = lock(&self.files).values().cloned().collect();
        let mut seen = false;
        for f in files {
            let is_due = match f.state.try_lock() {
                Ok(st) => match &st.run {
                    Some(r) if r.first_sent.is_some() => {
                        seen = true;
                        due(r, Instant::now(), self.cfg.commit_every)
                    }
                    _ => false,
                },
                // Busy: a call is under way on it; look again next time.
                Err(_) => {
                    seen = true;
                    false
                }
            };
            if !is_due {
                continue;
            }
            let turn = Turn::take(f.clone());
            turn.wait().await;
            let mut st = f.state.lock().await;
            let still = st
                .run
                .as_ref()
                .is_some_and(|r| due(r, Instant::now(), self.cfg.commit_every));
            if still && let Err(e) = self.flush_file(&f, &mut st).await {
                // Kept in `st.error` by `flush_file` for the next flush to report.
                tracing::debug!(ino = %f.ino, error = %e, "background commit of a streamed run failed");
            }
            drop(st);
            drop(turn);
        }
        seen
    }
}

#[cfg(test)]
mod tests {
    use bytes::BytesMut;

    use super::*;

    fn run(first_sent: Option<Instant>) -> Run {
        Run {
            start: 0,
            sent: 0,
            buf: BytesMut::new(),
            stream: None,
            first_sent,
        }
    }

    #[test]
    fn a_commit_past_the_bound_fails_and_one_within_it_goes() {
        let t0 = Instant::now();
        let within = Duration::from_secs(900);
        assert!(may_commit(&run(None), t0 + within * 2, within).is_ok());
        assert!(may_commit(&run(Some(t0)), t0 + within, within).is_ok());
        assert!(matches!(
            may_commit(
                &run(Some(t0)),
                t0 + within + Duration::from_millis(1),
                within
            ),
            Err(FsError::WriteFailed(_))
        ));
    }

    #[test]
    fn a_run_is_due_once_its_first_packet_is_old_enough() {
        let t0 = Instant::now();
        let every = Duration::from_secs(30);
        assert!(!due(&run(None), t0 + every * 10, every));
        assert!(!due(&run(Some(t0)), t0 + every / 2, every));
        assert!(due(&run(Some(t0)), t0 + every, every));
    }
}
