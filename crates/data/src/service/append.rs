//! Primary-backup appends on the leader (CFS §2.3): per-extent tracks, the inbox that batches
//! pipelined packets of an extent, and tiny writes.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use nacre_msgr::Payload;
use nacre_types::ExtentId;
use nacre_types::sync::lock;
use tokio::sync::watch;

use super::TINY_ALIGN;
use super::{DataNode, Part, off_worker};
use crate::repl::Event;
use crate::repl::extent::plan_batch;
use crate::repl::extent::tiny_offset;
use crate::sm::store_error;
use crate::store::{ExtentStore, StoreError};
use nacre_api::data::*;

/// Per-extent append state.
#[derive(Debug)]
pub(super) struct Track {
    /// Serializes the check-write-advance step of appends to this extent.
    pub(super) write: Mutex<()>,
    /// Leader: append packets waiting for their local write ([`DataNode::write_batches`]).
    pub(super) inbox: Mutex<Inbox>,
    /// Where the next packet must start (the end of the last one written locally).
    pub(super) next: watch::Sender<u64>,
    /// Every byte below is written on every replica (maybe not durable yet): packets of the
    /// extent are acknowledged in offset order through it.
    pub(super) replicated: watch::Sender<u64>,
    /// Every byte below is durable on every replica.
    pub(super) committed: watch::Sender<u64>,
    /// Appends to this extent under way here ([`Streams`]).
    pub(super) appending: AtomicUsize,
}

impl Track {
    pub(super) fn new(next: u64, committed: u64) -> Arc<Self> {
        Arc::new(Self {
            write: Mutex::new(()),
            inbox: Mutex::new(Inbox::default()),
            next: watch::Sender::new(next),
            replicated: watch::Sender::new(committed),
            committed: watch::Sender::new(committed),
            appending: AtomicUsize::new(0),
        })
    }

    pub(super) fn committed(&self) -> u64 {
        *self.committed.borrow()
    }

    /// Holds the extent's write lock ([`Track::write`]).
    pub(super) fn lock_write(&self) -> std::sync::MutexGuard<'_, ()> {
        lock(&self.write)
    }

    /// Raises the committed length (and so the replicated one) to `upto`.
    pub(super) fn commit(&self, upto: u64) {
        grow(&self.replicated, upto);
        grow(&self.committed, upto);
    }
}

/// A leader's append packets of one extent that wait to be written, by offset, and whether a task
/// writes them ([`DataNode::write_batches`]).
#[derive(Debug, Default)]
pub(super) struct Inbox {
    pub(super) waiting: BTreeMap<u64, Arrived>,
    pub(super) writing: bool,
}

/// An append packet that reached the leader.
#[derive(Debug)]
pub(super) struct Arrived {
    pub(super) data: Payload,
    pub(super) sync: bool,
    /// The packet's result once written here and sent to every follower.
    pub(super) done: tokio::sync::oneshot::Sender<Result<(), DataError>>,
}

/// Most bytes a leader writes and forwards as one batch: consecutive packets of an extent that
/// arrived while the previous batch was being written. Four packets: larger batches write and send
/// fewer, bigger pieces, but a follower starts writing a batch only once all of it has arrived
/// (1 MiB and 256 KiB both measured slower; docs/benchmarks.md, "Appends batched on the leader").
pub const MAX_BATCH: usize = 512 << 10;

/// The extents of a node with appends under way (as leader or follower): how many streams the
/// node is writing at once (`DataNodeConfig::direct_streams`).
#[derive(Debug, Default)]
pub(super) struct Streams(AtomicUsize);

impl Streams {
    /// Counts an append to `track` until the guard drops.
    pub(super) fn enter(&self, track: Arc<Track>) -> Appending<'_> {
        if track.appending.fetch_add(1, Ordering::Relaxed) == 0 {
            self.0.fetch_add(1, Ordering::Relaxed);
        }
        Appending {
            streams: self,
            track,
        }
    }

    pub(super) fn now(&self) -> usize {
        self.0.load(Ordering::Relaxed)
    }
}

/// An append counted in [`Streams`].
pub(super) struct Appending<'a> {
    streams: &'a Streams,
    track: Arc<Track>,
}

impl Drop for Appending<'_> {
    fn drop(&mut self) {
        // Every decrement follows its own increment, so neither count goes below zero.
        if self.track.appending.fetch_sub(1, Ordering::Relaxed) == 1 {
            self.streams.0.fetch_sub(1, Ordering::Relaxed);
        }
    }
}

/// Raises a watched length to `upto` (never lowers it).
pub(super) fn grow(len: &watch::Sender<u64>, upto: u64) {
    len.send_if_modified(|c| {
        let grew = upto > *c;
        *c = (*c).max(upto);
        grew
    });
}

impl DataNode {
    /// Bytes written to a partition through this node as leader, for stats.
    pub(super) fn count(&self, part: &Part, bytes: usize) {
        part.ops.fetch_add(1, Ordering::Relaxed);
        part.bytes.fetch_add(bytes as u64, Ordering::Relaxed);
    }

    /// Whether appends now bypass the page cache (`DataNodeConfig::direct_streams`).
    pub(super) fn uncached(&self) -> bool {
        let from = self.inner.config.direct_streams;
        from > 0 && self.inner.streams.now() >= from as usize
    }

    /// Syncs writes made since the store's `epoch` (taken before them): fails if a reopen came
    /// between, since it may have lost them.
    pub(super) async fn sync_store(store: &Arc<ExtentStore>, epoch: u64) -> Result<(), DataError> {
        let store = store.clone();
        off_worker(move || store.sync_since(epoch).map_err(store_error)).await
    }

    /// The append state of an extent on the leader. An extent this replica does not know may have
    /// been created through Raft under a previous leader and not be applied here yet: wait until
    /// everything committed is applied, then look again.
    pub(super) async fn leader_track(
        &self,
        part: &Part,
        extent: ExtentId,
    ) -> Result<Arc<Track>, DataError> {
        match part.track(extent) {
            Err(DataError::NotFound(_)) if !ExtentStore::is_tiny(extent) => {
                let raft = self.raft().map_err(DataError::Io)?;
                raft.read(part.id.0, |_| ())
                    .await
                    .map_err(|e| DataError::Io(e.to_string()))?;
                part.track(extent)
            }
            other => other,
        }
    }

    pub(super) async fn append(
        &self,
        part: &Arc<Part>,
        req: AppendRequest,
        data: Payload,
    ) -> Result<Written, DataError> {
        if ExtentStore::is_tiny(req.extent) {
            return Err(DataError::Invalid(format!(
                "{} is a tiny extent: write small files with WriteTiny",
                req.extent
            )));
        }
        check_packet(&data)?;
        if let Some(why) = part.refuses_appends(req.extent) {
            return Err(DataError::ReadOnly(why));
        }
        let track = self.leader_track(part, req.extent).await?;
        let len = data.bytes.len() as u64;
        let (extent, offset) = (req.extent, req.offset);
        let out_of_range = |track: &Track| DataError::OutOfRange {
            extent,
            offset,
            len,
            committed: track.committed(),
        };
        let _appending = self.inner.streams.enter(track.clone());
        // Packets of one extent may arrive out of order: each waits in the inbox until the bytes
        // before it are written here, and is written with the packets then waiting after it.
        let (done, mut written) = tokio::sync::oneshot::channel();
        let start = {
            let mut inbox = lock(&track.inbox);
            // A stale retry (its bytes written already, or a copy of it waiting).
            if offset < *track.next.borrow() || inbox.waiting.contains_key(&offset) {
                return Err(out_of_range(&track));
            }
            inbox.waiting.insert(
                offset,
                Arrived {
                    data,
                    sync: req.sync,
                    done,
                },
            );
            !std::mem::replace(&mut inbox.writing, true)
        };
        if start {
            let (node, part, track) = (self.clone(), part.clone(), track.clone());
            tokio::spawn(async move { node.write_batches(&part, &track, extent).await });
        }
        let stall = self.inner.config.replicate_stall_limit;
        let out = match tokio::time::timeout(stall, &mut written).await {
            Ok(out) => out,
            Err(_) => {
                // Still waiting for the bytes before it: give up. Taken into a batch meanwhile:
                // its result is on the way.
                let gave_up = lock(&track.inbox).waiting.remove(&offset).is_some();
                if gave_up {
                    return Err(out_of_range(&track));
                }
                written.await
            }
        };
        out.unwrap_or_else(|_| Err(DataError::Io("the extent's writer stopped".into())))?;
        // Acknowledge in offset order: the previous packet must be on every replica first. Then a
        // synced packet commits everything below its end, since each replica wrote the earlier
        // packets before this one and synced after it.
        let mut r = track.replicated.subscribe();
        let prev = tokio::time::timeout(
            self.inner.config.replicate_stall_limit,
            r.wait_for(|r| *r >= req.offset),
        )
        .await
        .is_ok_and(|r| r.is_ok());
        if !prev {
            return Err(DataError::ReadOnly(
                "an earlier packet of this extent did not reach every replica".into(),
            ));
        }
        grow(&track.replicated, req.offset + len);
        if req.sync {
            track.commit(req.offset + len);
        }
        self.count(part, len as usize);
        Ok(Written {
            extent: req.extent,
            offset: req.offset,
            committed: track.committed(),
        })
    }

    /// The leader's writer of an extent's appends, one task per extent while packets wait
    /// (started by the packet that found none running). It takes the packets waiting in the inbox
    /// that continue the extent, up to [`MAX_BATCH`] bytes, writes them here with one write, and
    /// sends them to every follower as one message, while it goes on with the next batch. Each
    /// packet gets the batch's result. Packets a refused batch leaves behind can never be written
    /// in order: they get the same answer.
    pub(super) async fn write_batches(
        &self,
        part: &Arc<Part>,
        track: &Arc<Track>,
        extent: ExtentId,
    ) {
        loop {
            let Some((offset, batch)) = take_batch(track, extent) else {
                return;
            };
            let sync = batch.iter().any(|a| a.sync);
            let data = join_packets(&batch);
            tracing::trace!(%extent, offset, packets = batch.len(), bytes = data.bytes.len(), "append batch");
            if let Some(m) = &self.inner.config.metrics {
                m.append_batches.inc();
                m.append_batched.inc_by(batch.len() as u64);
            }
            let len = data.bytes.len() as u64;
            let uncached = self.uncached();
            let epoch = part.store.epoch();
            // Written here before it goes to the followers: a packet this replica refuses (out of
            // order, a stale retry) must never reach them, since a follower cuts an unacknowledged
            // tail to make room for it.
            let written = {
                let (track, store, bytes) = (track.clone(), part.store.clone(), data.bytes.clone());
                off_worker(move || {
                    let _w = track.lock_write();
                    let committed = track.committed();
                    if *track.next.borrow() != offset {
                        return Err(DataError::OutOfRange {
                            extent,
                            offset,
                            len,
                            committed,
                        });
                    }
                    if uncached {
                        store.write_uncached(extent, offset, &bytes)
                    } else {
                        store.write(extent, offset, &bytes)
                    }
                    .map_err(write_error)?;
                    track.next.send_replace(offset + len);
                    Ok(committed)
                })
                .await
                .inspect_err(|e| degrade_if_full(part, e))
            };
            match written {
                Ok(committed) => {
                    let (node, part) = (self.clone(), part.clone());
                    tokio::spawn(async move {
                        let out = node
                            .replicate(&part, extent, offset, epoch, committed, &data, sync)
                            .await;
                        for a in batch {
                            let _ = a.done.send(out.clone());
                        }
                    });
                }
                Err(e) => {
                    let left = std::mem::take(&mut lock(&track.inbox).waiting);
                    for a in batch.into_iter().chain(left.into_values()) {
                        let _ = a.done.send(Err(e.clone()));
                    }
                }
            }
        }
    }

    pub(super) async fn write_tiny(
        &self,
        part: &Part,
        data: Payload,
    ) -> Result<Written, DataError> {
        check_size(&data, MAX_TINY_WRITE)?;
        if part.ec.is_some() && part.shard != 0 {
            return Err(DataError::Invalid(format!(
                "this replica holds shard {} of erasure-coded partition {}: stripes are placed \
                 by the replica of shard 0",
                part.shard, part.id
            )));
        }
        if let Some(why) = part.degraded() {
            return Err(DataError::ReadOnly(why));
        }
        let _permit = part
            .tiny_free
            .acquire()
            .await
            .map_err(|_| DataError::Io("partition closing".into()))?;
        // The most recently returned free tiny extent that does not lag on a follower (one that
        // lags takes no writes until the follower holds its committed bytes, see `repl`).
        let extent = {
            let lagging = lock(&part.repl).lagging_extents().clone();
            let mut pool = lock(&part.tiny_pool);
            let Some(i) = pool.iter().rposition(|e| !lagging.contains(e)) else {
                return Err(DataError::ReadOnly(
                    "every free tiny extent lags on a follower until it is repaired".into(),
                ));
            };
            pool.remove(i)
        };
        // Back to the pool however the call ends, also when its caller goes away mid-write.
        let _lent = Lent {
            pool: &part.tiny_pool,
            extent,
        };
        self.write_tiny_into(part, extent, &data).await
    }

    pub(super) async fn write_tiny_into(
        &self,
        part: &Part,
        extent: ExtentId,
        data: &Payload,
    ) -> Result<Written, DataError> {
        let track = tiny_track(part, extent)?;
        let len = data.bytes.len() as u64;
        let epoch = part.store.epoch();
        let (offset, committed_before) = {
            let (track, store, bytes) = (track.clone(), part.store.clone(), data.bytes.clone());
            off_worker(move || {
                let _w = track.lock_write();
                let held = store.len(extent).map_err(store_error)?;
                let offset = tiny_offset(*track.next.borrow(), track.committed(), held, TINY_ALIGN);
                store.write(extent, offset, &bytes).map_err(write_error)?;
                track.next.send_replace(offset + len);
                Ok((offset, track.committed()))
            })
            .await
            .inspect_err(|e| degrade_if_full(part, e))?
        };
        self.replicate(part, extent, offset, epoch, committed_before, data, true)
            .await?;
        track.commit(offset + len);
        self.count(part, data.bytes.len());
        Ok(Written {
            extent,
            offset,
            committed: track.committed(),
        })
    }
}

impl DataNode {
    /// Writes a shard of an erasure-coded partition's stripes at `offset` of tiny extent
    /// `extent`, where replica 0 placed shard 0 of the same stripes, and syncs it. This replica
    /// is the only one of its group, so nothing is forwarded.
    pub(super) async fn write_shard(
        &self,
        part: &Part,
        extent: ExtentId,
        offset: u64,
        data: Payload,
    ) -> Result<Written, DataError> {
        check_size(&data, MAX_TINY_WRITE)?;
        if part.ec.is_none() {
            return Err(DataError::Invalid(format!(
                "partition {} is not erasure-coded: it takes no shards",
                part.id
            )));
        }
        if !ExtentStore::is_tiny(extent) {
            return Err(DataError::Invalid(format!(
                "{extent} is not a tiny extent: shards go into tiny extents"
            )));
        }
        let len = data.bytes.len() as u64;
        let end = offset.checked_add(len).ok_or_else(|| {
            DataError::Invalid(format!("shard at {offset} of {len} bytes overflows"))
        })?;
        if let Some(why) = part.degraded() {
            return Err(DataError::ReadOnly(why));
        }
        let track = tiny_track(part, extent)?;
        let epoch = part.store.epoch();
        let committed_before = {
            let (track, store, bytes) = (track.clone(), part.store.clone(), data.bytes.clone());
            off_worker(move || {
                let _w = track.lock_write();
                store.write(extent, offset, &bytes).map_err(write_error)?;
                grow(&track.next, end);
                Ok(track.committed())
            })
            .await
            .inspect_err(|e| degrade_if_full(part, e))?
        };
        self.replicate(part, extent, offset, epoch, committed_before, &data, true)
            .await?;
        track.commit(end);
        self.count(part, data.bytes.len());
        Ok(Written {
            extent,
            offset,
            committed: track.committed(),
        })
    }
}

/// The track of tiny extent `extent`, a new one when the extent has no file yet.
fn tiny_track(part: &Part, extent: ExtentId) -> Result<Arc<Track>, DataError> {
    match part.track(extent) {
        Ok(t) => Ok(t),
        Err(DataError::NotFound(_)) => Ok(lock(&part.tracks)
            .entry(extent)
            .or_insert_with(|| Track::new(0, 0))
            .clone()),
        Err(e) => Err(e),
    }
}

/// A tiny extent taken from its partition's pool, returned when dropped.
pub(super) struct Lent<'a> {
    pub(super) pool: &'a Mutex<Vec<ExtentId>>,
    pub(super) extent: ExtentId,
}

impl Drop for Lent<'_> {
    fn drop(&mut self) {
        lock(self.pool).push(self.extent);
    }
}

/// What a client is told when this replica's store cannot take an append or a tiny write: a disk
/// error here is not the client's, and another partition can take the bytes (read-only: write
/// elsewhere). The partition turns read-only until the store works again.
pub(super) fn write_error(e: StoreError) -> DataError {
    match e {
        StoreError::Failed | StoreError::Io(_) => {
            DataError::ReadOnly(format!("this replica's extent store cannot write: {e}"))
        }
        other => store_error(other),
    }
}

/// A leader whose own disk is full takes no appends: read-only until a re-check finds room.
pub(super) fn degrade_if_full(part: &Part, e: &DataError) {
    if let DataError::ReadOnly(why) = e {
        part.fail(Event::LocalWriteRefused { why: why.clone() });
    }
}

/// Takes from the inbox the packets that continue the extent from where the leader wrote up to, as
/// one batch of at most [`MAX_BATCH`] bytes, with its offset; refuses the stale ones (below that
/// point). None, and the writer stops: nothing to write yet.
pub(super) fn take_batch(track: &Track, extent: ExtentId) -> Option<(u64, Vec<Arrived>)> {
    let mut inbox = lock(&track.inbox);
    let start = *track.next.borrow();
    let plan = plan_batch(
        start,
        inbox
            .waiting
            .iter()
            .map(|(offset, a)| (*offset, a.data.bytes.len())),
        MAX_BATCH,
    );
    for offset in plan.stale {
        if let Some(a) = inbox.waiting.remove(&offset) {
            let _ = a.done.send(Err(DataError::OutOfRange {
                extent,
                offset,
                len: a.data.bytes.len() as u64,
                committed: track.committed(),
            }));
        }
    }
    let batch: Vec<Arrived> = plan
        .take
        .iter()
        .filter_map(|offset| inbox.waiting.remove(offset))
        .collect();
    if batch.is_empty() {
        inbox.writing = false;
        return None;
    }
    Some((start, batch))
}

/// The packets of a batch as one data segment, with its CRC combined from theirs.
pub(super) fn join_packets(batch: &[Arrived]) -> Payload {
    if let [one] = batch {
        return Payload::with_crc(one.data.bytes.clone(), one.data.crc());
    }
    let total = batch.iter().map(|a| a.data.bytes.len()).sum();
    let mut all = bytes::BytesMut::with_capacity(total);
    let mut crc = 0;
    for a in batch {
        all.extend_from_slice(&a.data.bytes);
        crc = nacre_types::crc32c_combine(crc, a.data.crc(), a.data.bytes.len() as u64);
    }
    Payload::with_crc(all.freeze(), crc)
}

pub(super) fn check_packet(data: &Payload) -> Result<(), DataError> {
    check_size(data, MAX_PACKET)
}

/// Refuses an empty data segment or one over `max` bytes.
pub(super) fn check_size(data: &Payload, max: usize) -> Result<(), DataError> {
    if data.bytes.is_empty() {
        return Err(DataError::Invalid("empty packet".into()));
    }
    if data.bytes.len() > max {
        return Err(DataError::Invalid(format!(
            "packet of {} bytes; at most {max}",
            data.bytes.len()
        )));
    }
    Ok(())
}
