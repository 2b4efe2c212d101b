//! Repair: a follower pulls the committed bytes it lacks (and suspect blocks) from the leader,
//! throttled; a leader repairs a bad block from a follower at read time; a failed store is reopened.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use bytes::Bytes;
use nacre_msgr::{CallOptions, Payload};
use nacre_raft::RaftError;
use nacre_types::sync::lock;
use nacre_types::{ExtentId, PartitionId};

use super::{DataNode, Part, err_str};
use crate::repl::{Action, Event, RepairStep, repair_steps};
use crate::sm::{DataSm, store_error};
use crate::store::StoreError;
use nacre_api::data::*;

impl DataNode {
    /// A store that failed an IO refuses all work until reopened (docs/data-store.md, "Failure").
    /// Reopening recovers from what is on disk, which may lack what was not synced before the
    /// failure, and this replica also missed the Raft entries it could not apply meanwhile: only
    /// another replica's copy fills that in. So a leader first hands leadership to a follower (it
    /// repairs nothing itself, and must not serve reads from such a copy); a follower, or a lone
    /// replica, reopens the store, forgets its append tracks (as a restart does) and has every
    /// extent compared with the leader's at its next repair. One attempt per call; returns whether
    /// the store works now.
    pub(super) async fn revive_store(
        &self,
        part: &Part,
        lead: &Result<Option<u64>, RaftError>,
    ) -> bool {
        let (Ok(leading), Ok(raft)) = (lead.as_ref().map(Option::is_some), self.raft()) else {
            return false;
        };
        let followers = part.followers(raft.id());
        let mut reopen = false;
        for action in part.step(Event::StoreFailed {
            leading,
            followers: followers.iter().map(|r| r.node.0).collect(),
        }) {
            match action {
                Action::TransferLeader { to, .. } => {
                    let r = raft.transfer_leader(part.id.0, to).await;
                    tracing::warn!(partition = %part.id, to, result = ?r, "extent store failed; handing leadership over before reopening it");
                }
                Action::Reopen => reopen = true,
                other => part.note(&other),
            }
        }
        if !reopen {
            return false;
        }
        // A repair in flight would mix what it read before the reopen with what it writes after.
        let Ok(_repair) = part.repairing.try_lock() else {
            return false;
        };
        // Another duty round (they may overlap) brought it back meanwhile: the tracks are in use.
        if !part.store.is_failed() {
            return true;
        }
        // Forgotten while the store still refuses work, so no track is built from the old lengths;
        // a packet that took one earlier fails its `sync_since`.
        lock(&part.tracks).clear();
        let store = part.store.clone();
        match tokio::task::spawn_blocking(move || store.reopen()).await {
            Ok(Ok(())) => {
                part.shared.suspect_all.store(true, Ordering::Release);
                for action in part.step(Event::StoreReopened) {
                    part.note(&action);
                }
                tracing::info!(
                    partition = %part.id,
                    trimmed = ?part.store.recovery_report(),
                    bad_blocks = part.store.recovery_bad_blocks().len(),
                    "extent store reopened; every extent will be compared with the leader's"
                );
                true
            }
            Ok(Err(e)) => {
                tracing::warn!(partition = %part.id, error = %e, "extent store failed and cannot be reopened yet");
                false
            }
            Err(e) => {
                tracing::warn!(partition = %part.id, error = %e, "extent store reopen did not finish");
                false
            }
        }
    }

    /// Waits for the repair budget to allow `bytes` more.
    pub(super) async fn throttle(&self, bytes: u64) {
        let rate = self.inner.config.repair_rate.max(1) as f64;
        let wait = {
            let mut b = self.inner.repair_tokens.lock().await;
            let now = Instant::now();
            let refill = now.duration_since(b.1).as_secs_f64() * rate;
            b.0 = (b.0 + refill).min(rate);
            b.1 = now;
            b.0 -= bytes as f64;
            if b.0 < 0.0 {
                Duration::from_secs_f64(-b.0 / rate)
            } else {
                Duration::ZERO
            }
        };
        if !wait.is_zero() {
            tokio::time::sleep(wait).await;
        }
    }

    /// A follower brings its copy up to the leader's committed lengths (and, for suspect extents,
    /// to the leader's block contents).
    pub(super) async fn repair(&self, part: &Part) -> Result<(), String> {
        let Ok(_one) = part.repairing.try_lock() else {
            return Ok(());
        };
        // Copied bytes would take the room kept for the logs (`room`).
        if self.disk_full() {
            return Err(super::room::FULL.into());
        }
        let raft = self.raft()?;
        let leader = raft.leader(part.id.0).await.map_err(err_str)?;
        if leader == 0 || leader == raft.id() {
            return Ok(());
        }
        let addr = part
            .addr_of(leader)
            .ok_or_else(|| format!("leader node-{leader} is not a known replica"))?;
        let list = self
            .list_extents(&addr, part.id, self.inner.config.replicate_timeout)
            .await?;
        let all = part.shared.suspect_all.load(Ordering::Acquire);
        let suspects: std::collections::BTreeSet<ExtentId> = lock(&part.shared.suspect).clone();
        let bs = u64::from(part.store.block_size());
        for (extent, _len, committed) in list.extents {
            let have = match part.store.len(extent) {
                Ok(l) => l,
                Err(StoreError::NotFound(_)) => 0,
                Err(e) => return Err(e.to_string()),
            };
            let suspect = all || suspects.contains(&extent);
            for step in repair_steps(have, committed, suspect, bs) {
                match step {
                    RepairStep::Compare { upto } => {
                        self.compare_blocks(part, &addr, extent, upto).await?;
                        lock(&part.shared.suspect).remove(&extent);
                    }
                    RepairStep::Copy { first, count } => {
                        self.copy_blocks(part, &addr, extent, first, count).await?;
                    }
                }
            }
            if have < committed {
                // A packet may be waiting for these bytes (`take_replica`): its track must see them.
                let track = lock(&part.tracks).get(&extent).cloned();
                if let (Some(t), Ok(len)) = (track, part.store.len(extent)) {
                    t.next.send_if_modified(|n| {
                        let grew = len > *n;
                        *n = (*n).max(len);
                        grew
                    });
                }
                tracing::info!(partition = %part.id, %extent, from = have, to = committed, "extent repaired");
            }
        }
        if all {
            part.shared.suspect_all.store(false, Ordering::Release);
        }
        Ok(())
    }

    /// Fetches blocks whose CRC differs from the leader's, below `upto`.
    pub(super) async fn compare_blocks(
        &self,
        part: &Part,
        addr: &str,
        extent: ExtentId,
        upto: u64,
    ) -> Result<(), String> {
        let (r, _) = self
            .inner
            .client
            .call::<BlockCrcs>(
                addr,
                &BlockCrcsRequest {
                    partition: part.id,
                    extent,
                },
                Payload::none(),
            )
            .await
            .map_err(err_str)?;
        let (bs, theirs, _) = r.map_err(err_str)?;
        if bs != part.store.block_size() {
            return Err(format!(
                "block sizes differ: {bs} there, {} here",
                part.store.block_size()
            ));
        }
        let mine = part.store.block_crcs(extent).unwrap_or_default();
        let blocks = upto.div_ceil(u64::from(bs));
        for b in 0..blocks {
            let i = b as usize;
            if mine.get(i) != theirs.get(i) {
                self.copy_blocks(part, addr, extent, b, 1).await?;
            }
        }
        Ok(())
    }

    /// Copies whole blocks from a replica, writing each only when it reflects every overwrite
    /// applied here (see [`DataNode::install_blocks`]).
    pub(super) async fn copy_blocks(
        &self,
        part: &Part,
        addr: &str,
        extent: ExtentId,
        first: u64,
        count: u32,
    ) -> Result<(), String> {
        for _attempt in 0..5 {
            let (data, applied) = self
                .fetch_blocks(addr, part.id, extent, first, count, true)
                .await?;
            self.throttle(data.len() as u64).await;
            if self
                .install_blocks(part, extent, first, data, applied, false)
                .await?
            {
                return Ok(());
            }
        }
        Err(format!(
            "extent {extent} blocks {first}+{count}: the source stayed behind this replica's \
             overwrites"
        ))
    }

    pub(super) async fn fetch_blocks(
        &self,
        addr: &str,
        partition: PartitionId,
        extent: ExtentId,
        first: u64,
        count: u32,
        background: bool,
    ) -> Result<(Bytes, u64), String> {
        let mut opts = CallOptions {
            timeout: Some(self.inner.config.replicate_timeout),
            ..CallOptions::default()
        };
        if background {
            opts.flags = nacre_proto::Flags::BACKGROUND;
        }
        let (r, data) = self
            .inner
            .client
            .call_with::<FetchBlocks>(
                addr,
                &FetchBlocksRequest {
                    partition,
                    extent,
                    first,
                    count,
                },
                Payload::none(),
                opts,
            )
            .await
            .map_err(err_str)?;
        let applied = r.map_err(err_str)?;
        Ok((data.bytes, applied))
    }

    /// Writes blocks fetched from a replica whose partition had applied `applied` entries when it
    /// read them. Runs on the raft loop (between applies), and only if this replica has applied no
    /// entry past `applied`: then any overwrite the blocks lack is still to be applied here, in
    /// order, on top of them. Returns false (nothing written) otherwise.
    ///
    /// With `same_len` (a repair of blocks this replica has, from a follower) the bytes must
    /// cover at least the blocks' current length here, and only that much is written, else
    /// false: a follower behind on appends has a shorter copy (or none), which would cut
    /// acknowledged bytes off this one; one ahead (a packet it wrote before this leader did)
    /// holds the same bytes up to this copy's end.
    pub(super) async fn install_blocks(
        &self,
        part: &Part,
        extent: ExtentId,
        first: u64,
        mut data: Bytes,
        applied: u64,
        same_len: bool,
    ) -> Result<bool, String> {
        let raft = self.raft()?;
        let bs = part.store.block_size() as usize;
        let r = raft
            .local_read(part.id.0, move |sm: &DataSm, _| {
                if sm.shared.applied() > applied {
                    return Ok(false);
                }
                if same_len {
                    let start = first.saturating_mul(bs as u64);
                    let len = sm.store.len(extent).map_err(err_str)?;
                    let want = len
                        .saturating_sub(start)
                        .min(data.len().div_ceil(bs) as u64 * bs as u64);
                    if want == 0 || (data.len() as u64) < want {
                        return Ok(false);
                    }
                    data.truncate(want as usize);
                }
                for (i, chunk) in data.chunks(bs).enumerate() {
                    sm.store
                        .repair_block(extent, first + i as u64, chunk)
                        .map_err(err_str)?;
                }
                Ok(true)
            })
            .await
            .map_err(err_str)?;
        if matches!(r, Ok(true)) {
            let store = part.store.clone();
            tokio::task::spawn_blocking(move || store.sync())
                .await
                .map_err(err_str)?
                .map_err(err_str)?;
        }
        r
    }

    pub(super) async fn repair_block_from_followers(
        &self,
        part: &Part,
        extent: ExtentId,
        block: u64,
    ) -> Result<(), DataError> {
        let me = self.raft().map_err(DataError::Io)?.id();
        for r in part.followers(me) {
            match self
                .fetch_blocks(&r.addr, part.id, extent, block, 1, false)
                .await
            {
                Ok((data, applied)) => {
                    match self
                        .install_blocks(part, extent, block, data, applied, true)
                        .await
                    {
                        Ok(true) => {
                            tracing::info!(partition = %part.id, %extent, block, from = %r.addr, "block repaired");
                            return Ok(());
                        }
                        Ok(false) => continue,
                        Err(e) => return Err(DataError::Io(e)),
                    }
                }
                Err(e) => {
                    tracing::warn!(partition = %part.id, %extent, block, from = %r.addr, error = %e, "replica cannot supply the block");
                }
            }
        }
        Err(DataError::Corrupt { extent, block })
    }

    pub(super) fn fetch_local(
        &self,
        part: &Part,
        req: &FetchBlocksRequest,
    ) -> Result<(u64, Bytes), DataError> {
        // The applied index first: the bytes read after it reflect at least that much.
        let applied = part.shared.applied();
        let bs = u64::from(part.store.block_size());
        let len = part.store.len(req.extent).map_err(store_error)?;
        let start = req.first.saturating_mul(bs);
        if start >= len {
            return Ok((applied, Bytes::new()));
        }
        let end = start
            .saturating_add(u64::from(req.count.min(64)) * bs)
            .min(len);
        let data = part
            .store
            .read(req.extent, start, (end - start) as u32)
            .map_err(store_error)?;
        Ok((applied, data))
    }
}
