//! The data path of the SDK: extents on data partitions, reached through their leaders
//! ([`NetVolume::call`] routes and retries), and [`SeqWriter`], which streams a file's bytes as
//! pipelined 128 KiB appends and moves to another partition when one turns read-only.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use bytes::Bytes;
use nacre_api::data::{
    Append, AppendRaft, AppendRequest, CreateExtent, CreateExtentRequest, DataError, MAX_PACKET,
    Overwrite, OverwriteRequest, Read, ReadRequest, Release, ReleaseRequest, WriteShard,
    WriteShardRequest, WriteTiny, WriteTinyRequest, Written,
};
use nacre_api::meta::ExtentKey;
use nacre_msgr::Payload;
use nacre_proto::msg::Rpc;
use nacre_types::{ExtentId, PartitionId};
use thiserror::Error;
use tokio::task::JoinHandle;

use crate::meta::CallError;
use crate::net::NetVolume;

/// Largest extent a writer fills before it starts another (CFS uses 128 MiB too).
pub const MAX_EXTENT: u64 = 128 << 20;

/// Why a data operation failed.
#[derive(Clone, Debug, Error, PartialEq, Eq)]
pub enum DataCallError {
    /// The data node answered with an error.
    #[error(transparent)]
    Data(#[from] DataError),
    /// No leader could be reached or the outcome is unknown.
    #[error(transparent)]
    Call(#[from] CallError),
    #[error("volume has no writable data partition")]
    NoWritablePartition,
    #[error("data node returned {got} bytes, {want} were asked for")]
    ShortRead { want: u32, got: usize },
    /// A stream whose earlier call failed or was cancelled half way; its offsets are not known.
    #[error("the write stream is broken by an earlier failed or cancelled call")]
    BrokenStream,
    /// A compressed block's frame failed its checks (CRC, header, length): the bytes are not
    /// returned.
    #[error("compressed block at {partition}/{extent}+{offset} is corrupt: {why}")]
    BadFrame {
        partition: PartitionId,
        extent: ExtentId,
        offset: u64,
        why: String,
    },
}

impl DataCallError {
    /// The partition will not take this write; another one may. A disk error on the leader
    /// (`Io`: its store failed and reopens) leaves the partition read-only there.
    pub fn try_elsewhere(&self) -> bool {
        matches!(
            self,
            Self::Data(DataError::ReadOnly(_) | DataError::OutOfRange { .. } | DataError::Io(_))
                | Self::Call(_)
        )
    }
}

impl NetVolume {
    /// A writable data partition, spreading callers round robin from `hint`; `skip` lists
    /// partitions that just failed.
    pub fn pick_writable(&self, hint: usize, skip: &[PartitionId]) -> Option<PartitionId> {
        let parts = self.data_partitions();
        let n = parts.len();
        (0..n)
            .map(|i| parts[(hint + i) % n])
            .find(|p| p.writable && !skip.contains(&p.id))
            .map(|p| p.id)
    }

    /// Calls a data op on `partition`'s leader and unwraps the data node's answer.
    async fn data_call<R, T>(
        &self,
        partition: PartitionId,
        req: &R::Request,
        data: Payload,
        idempotent: bool,
    ) -> Result<(T, Payload), DataCallError>
    where
        R: Rpc<Response = Result<T, DataError>>,
    {
        let (r, payload) = self.call::<R>(partition, req, data, idempotent).await?;
        Ok((r?, payload))
    }

    pub async fn create_extent(&self, partition: PartitionId) -> Result<ExtentId, DataCallError> {
        let req = CreateExtentRequest { partition };
        Ok(self
            .data_call::<CreateExtent, _>(partition, &req, Payload::none(), false)
            .await?
            .0)
    }

    /// Appends `data` (at most 128 KiB) at `offset`, the extent's end, durable on every replica
    /// when this returns.
    pub async fn append(
        &self,
        partition: PartitionId,
        extent: ExtentId,
        offset: u64,
        data: Bytes,
    ) -> Result<Written, DataCallError> {
        self.append_with(partition, extent, offset, Payload::new(data), true)
            .await
    }

    /// [`NetVolume::append`]; without `sync` the packet is only written on every replica when this
    /// returns, and becomes durable (and committed) with the extent's next synced packet
    /// ([`AppendRequest::sync`]). `data` may carry its CRC already ([`Payload::with_crc`]).
    pub async fn append_with(
        &self,
        partition: PartitionId,
        extent: ExtentId,
        offset: u64,
        data: Payload,
        sync: bool,
    ) -> Result<Written, DataCallError> {
        let req = AppendRequest {
            partition,
            extent,
            offset,
            sync,
        };
        Ok(self
            .data_call::<Append, _>(partition, &req, data, false)
            .await?
            .0)
    }

    /// Appends through the partition's Raft group instead of primary-backup (for benchmarks).
    pub async fn append_raft(
        &self,
        partition: PartitionId,
        extent: ExtentId,
        offset: u64,
        data: Bytes,
    ) -> Result<Written, DataCallError> {
        let req = AppendRequest {
            partition,
            extent,
            offset,
            sync: true,
        };
        Ok(self
            .data_call::<AppendRaft, _>(partition, &req, Payload::new(data), false)
            .await?
            .0)
    }

    /// Stores a small file (at most 128 KiB) in a tiny extent of `partition`.
    pub async fn write_tiny(
        &self,
        partition: PartitionId,
        data: Bytes,
    ) -> Result<Written, DataCallError> {
        let req = WriteTinyRequest { partition };
        Ok(self
            .data_call::<WriteTiny, _>(partition, &req, Payload::new(data), false)
            .await?
            .0)
    }

    /// Overwrites committed bytes in place (through the partition's Raft group). Rewriting the same
    /// bytes is harmless, so it is retried like a read.
    pub async fn overwrite(
        &self,
        partition: PartitionId,
        extent: ExtentId,
        offset: u64,
        data: Bytes,
    ) -> Result<(), DataCallError> {
        let req = OverwriteRequest {
            partition,
            extent,
            offset,
        };
        self.data_call::<Overwrite, _>(partition, &req, Payload::new(data), true)
            .await?;
        Ok(())
    }

    /// Reads committed bytes of an extent.
    pub async fn read_extent(
        &self,
        partition: PartitionId,
        extent: ExtentId,
        offset: u64,
        len: u32,
    ) -> Result<Bytes, DataCallError> {
        let req = ReadRequest {
            partition,
            extent,
            offset,
            len,
        };
        let ((), data) = self
            .data_call::<Read, _>(partition, &req, Payload::none(), true)
            .await?;
        whole(data, len)
    }

    /// Releases extent ranges (a normal extent from 0 to its end: deleted; other ranges punched
    /// out). Idempotent. On an erasure-coded partition every replica releases its shards of
    /// them, and all must.
    pub async fn release(
        &self,
        partition: PartitionId,
        ranges: Vec<(ExtentId, u64, u64)>,
    ) -> Result<(), DataCallError> {
        let req = ReleaseRequest { partition, ranges };
        if self.partition_ec(partition).is_some() {
            // In the background (the meta partitions' to-free lists), one replica after the
            // other.
            for addr in self.replica_addrs(partition) {
                self.replica_call::<Release, _>(&addr, &req, Payload::none())
                    .await?;
            }
            return Ok(());
        }
        self.data_call::<Release, _>(partition, &req, Payload::none(), true)
            .await?;
        Ok(())
    }

    /// Calls a data op on one replica (of an erasure-coded partition, where each replica serves
    /// its own shards), within the call timeout. A replica that does not answer is suspect for
    /// a while ([`NetVolume::is_suspect`]).
    async fn replica_call<R, T>(
        &self,
        addr: &str,
        req: &R::Request,
        data: Payload,
    ) -> Result<(T, Payload), DataCallError>
    where
        R: Rpc<Response = Result<T, DataError>>,
    {
        let opts = nacre_msgr::CallOptions {
            timeout: Some(self.timeout),
            ..nacre_msgr::CallOptions::default()
        };
        match self.client().call_with::<R>(addr, req, data, opts).await {
            Ok((r, payload)) => {
                self.mark_answered(addr);
                Ok((r?, payload))
            }
            Err(e) => {
                let lost = !matches!(e, nacre_msgr::MsgrError::Remote { .. });
                if lost {
                    self.mark_suspect(addr);
                }
                Err(DataCallError::Call(CallError::Unknown(e.to_string())))
            }
        }
    }

    /// Writes shard `i` of stripes placed at `offset` of tiny extent `extent` (where replica 0
    /// holds shard 0) on replica `addr` of erasure-coded `partition`; durable there when this
    /// returns.
    pub async fn write_shard(
        &self,
        partition: PartitionId,
        addr: &str,
        extent: ExtentId,
        offset: u64,
        data: Bytes,
    ) -> Result<Written, DataCallError> {
        let req = WriteShardRequest {
            partition,
            extent,
            offset,
        };
        Ok(self
            .replica_call::<WriteShard, _>(addr, &req, Payload::new(data))
            .await?
            .0)
    }

    /// Places stripes: shard 0 of each, concatenated (at most `MAX_TINY_WRITE` bytes), into a
    /// tiny extent on replica 0 of erasure-coded `partition` (`addr`), which picks where; every
    /// other shard then goes to the same place on its replica ([`NetVolume::write_shard`]).
    /// Only replica 0 places stripes, so this never goes to another replica.
    pub async fn write_shard_0(
        &self,
        partition: PartitionId,
        addr: &str,
        data: Bytes,
    ) -> Result<Written, DataCallError> {
        let req = WriteTinyRequest { partition };
        Ok(self
            .replica_call::<WriteTiny, _>(addr, &req, Payload::new(data))
            .await?
            .0)
    }

    /// Reads `len` shard bytes at `offset` of tiny extent `extent` on replica `addr` of
    /// erasure-coded `partition`.
    pub async fn read_shard(
        &self,
        partition: PartitionId,
        addr: &str,
        extent: ExtentId,
        offset: u64,
        len: u32,
    ) -> Result<Bytes, DataCallError> {
        let req = ReadRequest {
            partition,
            extent,
            offset,
            len,
        };
        let ((), data) = self
            .replica_call::<Read, _>(addr, &req, Payload::none())
            .await?;
        whole(data, len)
    }
}

/// The bytes of a read's answer, which must be the `len` asked for.
fn whole(data: Payload, len: u32) -> Result<Bytes, DataCallError> {
    if data.bytes.len() != len as usize {
        return Err(DataCallError::ShortRead {
            want: len,
            got: data.bytes.len(),
        });
    }
    Ok(data.bytes)
}

/// Most packets a [`SeqWriter`] sends between two synced ones (1 MiB): it keeps their bytes until
/// the synced one is acknowledged.
pub const SYNC_EVERY: usize = 8;

/// A packet's bytes and place.
struct Piece {
    file_offset: u64,
    data: Bytes,
    partition: PartitionId,
    extent: ExtentId,
    extent_offset: u64,
}

/// A packet on its way; its reply carries the CRC-32C of its bytes, computed once on the task that
/// sends it (beside the caller's next write, not before it), sent as the frame's data CRC and
/// folded into the extent key's CRC without another pass ([`nacre_types::crc32c_combine`]).
struct Packet {
    piece: Piece,
    sync: bool,
    reply: JoinHandle<Result<(Written, u32), DataCallError>>,
}

/// Writes one file's bytes sequentially: 128 KiB appends with up to `inflight` outstanding, new
/// extents as needed, and a move to another partition (rewriting every packet not yet durable)
/// when one fails. The durable pieces come back as extent keys.
///
/// Replicas sync once per [`SYNC_EVERY`] packets, not per packet: the newest packet is held back
/// until more bytes come (it goes out unsynced) or until `flush` (it goes out synced, and makes
/// every earlier one durable); so is one that ends an extent. Unsynced packets are kept until a
/// synced one covers them.
///
/// A `write` or `flush` that fails, or whose future is dropped before it finishes, breaks the
/// stream: every later call returns [`DataCallError::BrokenStream`] (its bytes may be in flight or
/// lost, so no later byte can be placed after them). Callers that must survive cancellation run the
/// stream on a task of its own.
pub struct SeqWriter {
    vol: Arc<NetVolume>,
    inflight: usize,
    /// Current extent and the offset of its next packet.
    cur: Option<(PartitionId, ExtentId, u64)>,
    file_offset: u64,
    /// The newest piece, not sent yet.
    held: Option<Piece>,
    /// Bytes to cut into packets, in file order from `file_offset`: a write's, and in front of
    /// them what a failed packet made to rewrite (a queue, so that a failure during a rewrite
    /// does not nest another one on the stack).
    todo: VecDeque<Bytes>,
    /// Packets sent since the last synced one.
    since_sync: usize,
    pending: VecDeque<Packet>,
    /// Acknowledged but not durable yet (sent unsynced), oldest first, with their CRCs.
    unsynced: VecDeque<(Piece, u32)>,
    keys: Vec<ExtentKey>,
    /// Partitions that failed a write of this file.
    failed: Vec<PartitionId>,
    /// Moves to another partition without a pause, left in this stall (then `ride`).
    moves_left: u32,
    /// Waiting for a writable partition, since the last packet that went through.
    ride: RideOut,
    /// A call is under way, or one failed or was cancelled (see the type's docs).
    busy: bool,
}

impl std::fmt::Debug for SeqWriter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SeqWriter")
            .field("cur", &self.cur)
            .field("file_offset", &self.file_offset)
            .field("pending", &self.pending.len())
            .field("unsynced", &self.unsynced.len())
            .finish()
    }
}

static NEXT_HINT: AtomicUsize = AtomicUsize::new(0);

/// Moves to another partition a stream makes at once after failures, before it waits between
/// moves ([`RideOut`]).
const MOVES: u32 = 8;

/// How long a write waits for a writable partition when every one refuses it or none is listed
/// (a data node died and its partitions turned read-only; the master adds partitions or the node
/// comes back): long enough to ride out a node's restart, so the application sees no error.
pub const RIDE_OUT: std::time::Duration = std::time::Duration::from_secs(20);

/// A write's wait for a writable partition (see [`RIDE_OUT`]): pauses that grow from 50 ms to
/// 1 s between view refreshes, counted from the first refusal since the last success.
#[derive(Debug, Default)]
pub struct RideOut {
    since: Option<tokio::time::Instant>,
    pause: std::time::Duration,
}

impl RideOut {
    /// Another refusal: refreshes the view after a pause; false once `RIDE_OUT` has passed.
    pub async fn wait(&mut self, vol: &NetVolume) -> bool {
        let now = tokio::time::Instant::now();
        let since = *self.since.get_or_insert(now);
        if now.duration_since(since) >= RIDE_OUT {
            return false;
        }
        self.pause = (self.pause * 2).clamp(
            std::time::Duration::from_millis(50),
            std::time::Duration::from_secs(1),
        );
        tokio::time::sleep(self.pause.min(RIDE_OUT - now.duration_since(since))).await;
        let _ = vol.refresh().await;
        true
    }

    /// A write went through: the next refusal starts a new wait.
    pub fn reset(&mut self) {
        *self = Self::default();
    }
}

impl SeqWriter {
    /// A writer starting at `file_offset`.
    pub fn new(vol: Arc<NetVolume>, file_offset: u64, inflight: usize) -> Self {
        Self {
            vol,
            inflight: inflight.max(1),
            cur: None,
            file_offset,
            held: None,
            todo: VecDeque::new(),
            since_sync: 0,
            pending: VecDeque::new(),
            unsynced: VecDeque::new(),
            keys: Vec::new(),
            failed: Vec::new(),
            moves_left: MOVES,
            ride: RideOut::default(),
            busy: false,
        }
    }

    /// Marks a call under way; fails if an earlier one never finished well.
    fn enter(&mut self) -> Result<(), DataCallError> {
        if self.busy {
            return Err(DataCallError::BrokenStream);
        }
        self.busy = true;
        Ok(())
    }

    /// Ends a call: only a success leaves the stream usable.
    fn leave<T>(&mut self, r: Result<T, DataCallError>) -> Result<T, DataCallError> {
        if r.is_ok() {
            self.busy = false;
        }
        r
    }

    async fn next_extent(&mut self) -> Result<(PartitionId, ExtentId, u64), DataCallError> {
        loop {
            let hint = NEXT_HINT.fetch_add(1, Ordering::Relaxed);
            let Some(p) = self.vol.pick_writable(hint, &self.failed) else {
                // Every partition refused or none is writable: the view may be stale (new
                // partitions added, a node back), or the cluster is recovering; wait for it.
                if !self.ride.wait(&self.vol).await {
                    return Err(DataCallError::NoWritablePartition);
                }
                self.failed.clear();
                continue;
            };
            match self.vol.create_extent(p).await {
                Ok(e) => return Ok((p, e, 0)),
                Err(e) if e.try_elsewhere() => self.failed.push(p),
                Err(e) => return Err(e),
            }
        }
    }

    /// Queues `data` (any length) after what was written so far.
    pub async fn write(&mut self, data: Bytes) -> Result<(), DataCallError> {
        self.enter()?;
        let r = self.write_inner(data).await;
        self.leave(r)
    }

    async fn write_inner(&mut self, data: Bytes) -> Result<(), DataCallError> {
        self.todo.push_back(data);
        self.write_todo().await
    }

    /// Cuts what `todo` holds into packets, front first, until it is empty. A failed packet puts
    /// every byte not durable back at the front ([`Self::settle_one`]); this loop rewrites them.
    async fn write_todo(&mut self) -> Result<(), DataCallError> {
        loop {
            while self.todo.front().is_some_and(Bytes::is_empty) {
                self.todo.pop_front();
            }
            if self.todo.is_empty() {
                return Ok(());
            }
            // More bytes to write: the held packet goes out, synced only every SYNC_EVERY
            // packets. (A failure while it waits for room puts the stream back in `todo`, and
            // may hold back another piece: look again.)
            if let Some(prev) = self.held.take() {
                let sync = self.since_sync + 1 >= SYNC_EVERY;
                self.send(prev, sync).await?;
                continue;
            }
            let (p, e, off) = match self.cur {
                Some(c) if c.2 < MAX_EXTENT => c,
                _ => self.next_extent().await?,
            };
            let room = (MAX_EXTENT - off).min(MAX_PACKET as u64) as usize;
            let Some(front) = self.todo.front_mut() else {
                continue;
            };
            let data = front.split_to(room.min(front.len()));
            let len = data.len() as u64;
            let piece = Piece {
                file_offset: self.file_offset,
                data,
                partition: p,
                extent: e,
                extent_offset: off,
            };
            self.file_offset += len;
            self.cur = Some((p, e, off + len));
            if off + len >= MAX_EXTENT {
                // Nothing later in this extent could make it durable.
                self.send(piece, true).await?;
            } else {
                self.held = Some(piece);
            }
        }
    }

    /// Sends a packet, then waits while the window is full (the stream's state is whole by then:
    /// a failure there rewrites everything not durable, this packet included).
    async fn send(&mut self, piece: Piece, sync: bool) -> Result<(), DataCallError> {
        // In order within this stream, so a packet never waits for a slot behind a later one.
        let slot = self.vol.append_slot().await;
        let vol = self.vol.clone();
        let (partition, extent, offset, d) = (
            piece.partition,
            piece.extent,
            piece.extent_offset,
            piece.data.clone(),
        );
        let reply = tokio::spawn(async move {
            let crc = nacre_types::crc32c(&d);
            let r = vol
                .append_with(partition, extent, offset, Payload::with_crc(d, crc), sync)
                .await;
            drop(slot);
            r.map(|w| (w, crc))
        });
        self.since_sync = if sync { 0 } else { self.since_sync + 1 };
        self.pending.push_back(Packet { piece, sync, reply });
        while self.pending.len() >= self.inflight {
            self.settle_one().await?;
        }
        Ok(())
    }

    /// Waits for the oldest packet; on failure moves the rest of the stream elsewhere.
    async fn settle_one(&mut self) -> Result<(), DataCallError> {
        let Some(mut pkt) = self.pending.pop_front() else {
            return Ok(());
        };
        let out = match (&mut pkt.reply).await {
            Ok(r) => r,
            Err(e) => Err(DataCallError::Call(CallError::Unknown(e.to_string()))),
        };
        match out {
            Ok((_, crc)) if !pkt.sync => {
                self.went_through();
                self.unsynced.push_back((pkt.piece, crc));
                Ok(())
            }
            Ok((_, crc)) => {
                self.went_through();
                // Durable now, and so is every earlier packet of the extent.
                while let Some((earlier, c)) = self.unsynced.pop_front() {
                    self.record(&earlier, c);
                }
                self.record(&pkt.piece, crc);
                Ok(())
            }
            Err(e)
                if e.try_elsewhere()
                    && (self.moves_left > 0 || self.ride.wait(&self.vol).await) =>
            {
                self.moves_left = self.moves_left.saturating_sub(1);
                let failed = pkt.piece.partition;
                tracing::debug!(partition = %failed, error = %e, "append failed; moving on");
                self.failed.push(failed);
                // Everything not durable is rewritten, acknowledged or not: the extent's committed
                // length cannot pass the failed packet, and what was only written may be lost.
                let mut redo: Vec<Piece> = self.unsynced.drain(..).map(|(p, _)| p).collect();
                redo.push(pkt.piece);
                for later in self.pending.drain(..) {
                    later.reply.abort();
                    redo.push(later.piece);
                }
                redo.extend(self.held.take());
                self.cur = None;
                self.since_sync = 0;
                self.file_offset = redo[0].file_offset;
                // Rewritten by the caller's loop (`write_todo`), before the bytes it had left.
                for piece in redo.into_iter().rev() {
                    self.todo.push_front(piece.data);
                }
                Ok(())
            }
            Err(e) => Err(e),
        }
    }

    /// A packet went through: the next failure starts a new stall.
    fn went_through(&mut self) {
        self.moves_left = MOVES;
        self.ride.reset();
    }

    /// Adds a durable packet to the keys, extending the last key when it continues it.
    fn record(&mut self, pkt: &Piece, crc: u32) {
        let len = pkt.data.len() as u64;
        if let Some(last) = self.keys.last_mut()
            && last.partition == pkt.partition
            && last.extent == pkt.extent
            && last.end() == pkt.file_offset
            && last.extent_offset + u64::from(last.size) == pkt.extent_offset
            && u64::from(last.size) + len <= u64::from(u32::MAX)
        {
            last.crc = nacre_types::crc32c_combine(last.crc, crc, len);
            last.size += len as u32;
            return;
        }
        self.keys.push(ExtentKey {
            file_offset: pkt.file_offset,
            partition: pkt.partition,
            extent: pkt.extent,
            extent_offset: pkt.extent_offset,
            size: len as u32,
            crc,
            framed: None,
        });
    }

    /// Waits until every byte written so far is durable on every replica.
    pub async fn flush(&mut self) -> Result<(), DataCallError> {
        self.enter()?;
        let r = self.settle_all().await;
        self.leave(r)
    }

    async fn settle_all(&mut self) -> Result<(), DataCallError> {
        loop {
            // A failed packet puts bytes back to write; their rewrite holds back a new last piece.
            self.write_todo().await?;
            if let Some(last) = self.held.take() {
                self.send(last, true).await?;
                // Sending waits while the window is full, and a packet that fails meanwhile puts
                // every byte not durable (this packet's too) back in `todo`, emptying the window:
                // look at `todo` again before taking an empty window for the end.
                continue;
            }
            if self.pending.is_empty() {
                break;
            }
            self.settle_one().await?;
        }
        debug_assert!(
            self.unsynced.is_empty() && self.todo.iter().all(Bytes::is_empty),
            "every byte was written and the last packet sent was synced"
        );
        Ok(())
    }

    /// The keys of the packets acknowledged so far (since the last call); the stream goes on.
    pub fn take_keys(&mut self) -> Vec<ExtentKey> {
        std::mem::take(&mut self.keys)
    }

    /// Waits for every packet and returns the extent keys of everything written.
    pub async fn finish(mut self) -> Result<Vec<ExtentKey>, DataCallError> {
        self.flush().await?;
        Ok(self.keys)
    }
}
