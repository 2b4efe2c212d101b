//! The primary forwards each append batch to every backup; a backup takes it, cutting an
//! unacknowledged tail of an earlier leader, never below the committed offset.

use std::time::Duration;

use nacre_msgr::{CallOptions, Client, MsgrError, Payload};
use nacre_proto::msg::sys::{Ping, PingRequest};
use nacre_types::ExtentId;
use nacre_types::sync::lock;

use super::append::{MAX_BATCH, Track};
use super::{DataNode, Part, off_worker};
use crate::repl::Event;
use crate::repl::extent::{Refused, StaleTerm, Take, check_term, follower_take};
use crate::sm::store_error;
use crate::store::ExtentStore;
use nacre_api::data::*;

impl DataNode {
    /// Sends a packet to every follower and, with `sync`, syncs it locally (written at store
    /// `epoch`) and has every follower sync it; all must succeed. The packet names the term
    /// under which this replica aligned as leader. What a failure means is the core's to decide
    /// ([`crate::repl`]): a follower that knows a newer term deposes this leader, one whose copy
    /// does not continue where the packet starts makes the extent lag, anything else (a follower
    /// gone, a failed disk) degrades the partition.
    #[expect(clippy::too_many_arguments, reason = "one packet's placement")]
    pub(super) async fn replicate(
        &self,
        part: &Part,
        extent: ExtentId,
        offset: u64,
        epoch: u64,
        committed: u64,
        data: &Payload,
        sync: bool,
    ) -> Result<(), DataError> {
        let me = self.raft().map_err(DataError::Io)?.id();
        let Some(term) = lock(&part.repl).aligned_term() else {
            return Err(DataError::ReadOnly(
                "this replica is not aligned as the partition's leader".into(),
            ));
        };
        let req = ReplicateRequest {
            partition: part.id,
            extent,
            offset,
            committed,
            sync,
            term,
        };
        let (check_after, limit) = (
            self.inner.config.replicate_timeout,
            self.inner.config.replicate_stall_limit,
        );
        let mut sends = tokio::task::JoinSet::new();
        for r in part.followers(me) {
            let client = self.inner.client.clone();
            let req = req.clone();
            let data = Payload::with_crc(data.bytes.clone(), data.crc());
            sends.spawn(async move {
                replicate_to(&client, &r.addr, &req, data, check_after, limit)
                    .await
                    .map_err(|e| (r.addr, e))
            });
        }
        let local = async {
            if sync {
                Self::sync_store(&part.store, epoch).await
            } else {
                Ok(())
            }
        };
        let (local, remote) = tokio::join!(local, sends.join_all());
        let failed: Vec<(String, Failure)> = remote.into_iter().filter_map(Result::err).collect();
        if failed.is_empty() && local.is_ok() {
            return Ok(());
        }
        let describe = |f: &[(String, Failure)]| {
            f.iter()
                .map(|(addr, e)| format!("{addr}: {e}"))
                .collect::<Vec<_>>()
                .join("; ")
        };
        if let Some(newer) = failed.iter().find_map(|(_, f)| match f {
            Failure::Refused(DataError::StaleTerm { current, .. }) => Some(*current),
            _ => None,
        }) {
            part.fail(Event::Deposed { term, newer });
            return Err(DataError::ReadOnly(format!(
                "this node no longer leads the partition: {}",
                describe(&failed)
            )));
        }
        let only_short_copies = local.is_ok()
            && failed
                .iter()
                .all(|(_, f)| matches!(f, Failure::Refused(DataError::OutOfRange { .. })));
        if only_short_copies {
            let why = format!("a follower cannot take it: {}", describe(&failed));
            part.fail(Event::ExtentRefused {
                extent,
                why: why.clone(),
            });
            return Err(DataError::ReadOnly(format!("extent {extent}: {why}")));
        }
        let mut why = describe(&failed);
        if let Err(e) = local {
            if !why.is_empty() {
                why.push_str("; ");
            }
            why.push_str(&format!("local disk: {e}"));
        }
        let why = format!("replication failed: {why}");
        part.fail(Event::ReplicationFailed { why: why.clone() });
        Err(DataError::ReadOnly(why))
    }

    /// A follower stores a packet its leader forwarded.
    pub(super) async fn take_replica(
        &self,
        part: &Part,
        req: ReplicateRequest,
        data: Payload,
    ) -> Result<(), DataError> {
        if data.bytes.is_empty() || data.bytes.len() > MAX_BATCH {
            return Err(DataError::Invalid(format!(
                "a replicated batch of {} bytes; 1 to {MAX_BATCH}",
                data.bytes.len()
            )));
        }
        // A full disk takes no new bytes (`room`): the leader turns the partition read-only.
        if self.disk_full() {
            return Err(DataError::ReadOnly(super::room::FULL.into()));
        }
        // A packet from a leader that a newer election deposed is refused before anything else.
        let known = match &part.gate {
            Some(gate) => gate.leader_term().1,
            None => {
                let raft = self.raft().map_err(DataError::Io)?;
                raft.leader_term(part.id.0)
                    .await
                    .map_err(|e| DataError::Io(e.to_string()))?
                    .1
            }
        };
        if let Err(StaleTerm { sent, known }) = check_term(req.term, known) {
            return Err(DataError::StaleTerm {
                sent,
                current: known,
            });
        }
        let epoch = part.store.epoch();
        let tiny = ExtentStore::is_tiny(req.extent);
        let track = match part.track_with(req.extent, false) {
            Ok(t) => t,
            // Created through Raft but not applied here yet (or a tiny extent's first write).
            Err(DataError::NotFound(_)) => {
                if !tiny {
                    part.store.create(req.extent).map_err(store_error)?;
                }
                let t = Track::new(0, 0);
                lock(&part.tracks).entry(req.extent).or_insert(t).clone()
            }
            Err(e) => return Err(e),
        };
        track.commit(req.committed);
        let _appending = (!tiny).then(|| self.inner.streams.enter(track.clone()));
        let uncached = self.uncached();
        let len = data.bytes.len() as u64;
        if !tiny {
            let mut next = track.next.subscribe();
            let _ = tokio::time::timeout(
                self.inner.config.replicate_timeout / 2,
                next.wait_for(|n| *n >= req.offset),
            )
            .await;
        }
        let (store, bytes) = (part.store.clone(), data.bytes.clone());
        off_worker(move || {
            let _w = track.lock_write();
            let have = *track.next.borrow();
            let out_of_range = |committed| DataError::OutOfRange {
                extent: req.extent,
                offset: req.offset,
                len,
                committed,
            };
            match follower_take(have, track.committed(), req.offset, tiny) {
                // A longer, unacknowledged tail from an earlier leader: drop it.
                Ok(Take::CutThenWrite) => store
                    .truncate(req.extent, req.offset)
                    .map_err(store_error)?,
                Ok(Take::Write) => {}
                Err(Refused::BelowCommitted { committed, .. }) => {
                    return Err(out_of_range(committed));
                }
                Err(Refused::PastEnd { have, .. }) => return Err(out_of_range(have)),
            }
            if uncached {
                store.write_uncached(req.extent, req.offset, &bytes)
            } else {
                store.write(req.extent, req.offset, &bytes)
            }
            .map_err(store_error)?;
            track.next.send_replace(req.offset + len);
            Ok(())
        })
        .await?;
        if req.sync {
            Self::sync_store(&part.store, epoch).await
        } else {
            Ok(())
        }
    }
}

/// Why a follower did not take a packet.
#[derive(Debug)]
pub(super) enum Failure {
    /// It answered with a refusal.
    Refused(DataError),
    /// No answer: it is gone, or silent past the limits.
    Lost(String),
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Refused(e) => e.fmt(f),
            Self::Lost(why) => f.write_str(why),
        }
    }
}

/// Sends one packet to a follower. Past `check_after` without an answer, and every `check_after`
/// after that, the follower is pinged: a live one is waited for (up to `limit`), a silent one fails
/// the packet. A saturated disk makes fsyncs take seconds; that is no reason to drop a replica.
pub(super) async fn replicate_to(
    client: &Client,
    addr: &str,
    req: &ReplicateRequest,
    data: Payload,
    check_after: Duration,
    limit: Duration,
) -> Result<(), Failure> {
    let opts = CallOptions {
        timeout: Some(limit),
        // Over the follower's bundle when `msgr.bundle_conns` > 1: packets spread over its
        // connections and still reach it in order.
        bundled: true,
        ..CallOptions::default()
    };
    let call = client.call_with::<Replicate>(addr, req, data, opts);
    tokio::pin!(call);
    let done = |out: Result<(Result<(), DataError>, Payload), MsgrError>| match out {
        Ok((Ok(()), _)) => Ok(()),
        Ok((Err(e), _)) => Err(Failure::Refused(e)),
        Err(e) => Err(Failure::Lost(e.to_string())),
    };
    loop {
        tokio::select! {
            out = &mut call => return done(out),
            () = tokio::time::sleep(check_after) => {}
        }
        tokio::select! {
            out = &mut call => return done(out),
            alive = alive(client, addr, check_after) => if !alive {
                return Err(Failure::Lost(format!(
                    "no answer within {check_after:?}, and none to a ping"
                )));
            }
        }
    }
}

/// Whether `addr` answers at all: any answer, even an error, means its process and link are up.
pub(super) async fn alive(client: &Client, addr: &str, within: Duration) -> bool {
    let opts = CallOptions {
        timeout: Some(within),
        ..CallOptions::default()
    };
    match client
        .call_with::<Ping>(addr, &PingRequest {}, Payload::none(), opts)
        .await
    {
        Ok(_) | Err(MsgrError::Remote { .. }) => true,
        Err(_) => false,
    }
}
