//! Call sessions (`Command::Once`): the results of each client's calls that it may still send
//! again, so that a call applies once however often it arrives. Like the batch sessions
//! (`delegations`), a call session holds while `now` is within `SESSION_NS` of its last call,
//! decided by comparing times, and the ended ones are forgotten from the front of a time index.
//! Invariant: `call_times` lists exactly `(at, client)` of every call session; no session is of
//! client 0; no session keeps a result below its `done_below`.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use nacre_api::meta::{Command, MetaError, Reply};

use super::MetaPartition;
use super::delegations::session_live;

/// Most results one call session keeps: a client has far fewer calls in flight. Past it the
/// oldest are dropped (a copy of a dropped call then applies again), so that a client which
/// never raises `done_below` cannot grow the partition without bound.
pub const MAX_KEPT_RESULTS: usize = 4096;

/// One client's call session.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub(super) struct Calls {
    /// The time of its last call (leader time, ns).
    pub(super) at: u64,
    /// The client holds the answers to every call below this.
    pub(super) done_below: u64,
    /// Call number → its result, for the calls at or above `done_below`.
    pub(super) results: BTreeMap<u64, Result<Reply, MetaError>>,
}

impl MetaPartition {
    /// `Command::Once`: the result of `cmd` as call `seq` of `client`, applied unless a copy of
    /// the call was before. Never fails: the call's own failure is its outcome.
    pub(super) fn once(
        &mut self,
        now: u64,
        client: u64,
        seq: u64,
        done_below: u64,
        cmd: &Command,
    ) -> Reply {
        if let Some(c) = self.calls.get(&client)
            && session_live(c.at, now)
        {
            if let Some(r) = c.results.get(&seq) {
                return Reply::Outcome(Box::new(r.clone()));
            }
            if seq < c.done_below {
                return Reply::Outcome(Box::new(Err(MetaError::Invalid(format!(
                    "call {seq} of client {client:#x} was answered before"
                )))));
            }
        }
        let result = self.dispatch(now, cmd);
        let mut c = match self.calls.remove(&client) {
            Some(c) => {
                self.call_times.remove(&(c.at, client));
                if session_live(c.at, now) {
                    c
                } else {
                    Calls::default()
                }
            }
            None => Calls::default(),
        };
        // Never backwards: after a leader change `now` may be behind the last call's time.
        c.at = c.at.max(now);
        c.done_below = c.done_below.max(done_below);
        c.results.insert(seq, result.clone());
        c.results = c.results.split_off(&c.done_below);
        while c.results.len() > MAX_KEPT_RESULTS {
            c.results.pop_first();
        }
        self.call_times.insert((c.at, client));
        self.calls.insert(client, c);
        Reply::Outcome(Box::new(result))
    }

    /// Forgets the call sessions that ended by `now`.
    pub(super) fn expire_calls(&mut self, now: u64) {
        while let Some(&(at, client)) = self.call_times.first()
            && !session_live(at, now)
        {
            self.call_times.pop_first();
            self.calls.remove(&client);
        }
    }

    /// Results kept for clients' calls, across all sessions.
    pub(super) fn kept_results(&self) -> usize {
        self.calls.values().map(|c| c.results.len()).sum()
    }
}
