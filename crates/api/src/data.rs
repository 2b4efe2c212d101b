//! Data node ops (`0x03xx`). Bulk bytes travel in the frame's data segment (CRC-checked by the
//! messenger), never in the postcard body.

use nacre_proto::Op;
use nacre_proto::msg::Rpc;
use nacre_types::{ExtentId, PartitionId};
use serde::{Deserialize, Serialize};

/// Why a data operation failed, as the client sees it. Not-leader and unknown-partition answers are
/// error frames (with a leader hint), as for meta partitions.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
pub enum DataError {
    /// The partition takes no appends (a replica failed, it is being repaired, or it is full):
    /// write the rest of the file to another partition.
    #[error("data partition is read-only: {0}")]
    ReadOnly(String),
    #[error("extent {0} not found")]
    NotFound(ExtentId),
    /// The range lies (partly) past the extent's committed length, or an append's offset is not the
    /// extent's end.
    #[error("extent {extent}: {offset}+{len} is outside its committed length {committed}")]
    OutOfRange {
        extent: ExtentId,
        offset: u64,
        len: u64,
        committed: u64,
    },
    /// No healthy replica holds a verified copy of the block.
    #[error("extent {extent} block {block}: checksum mismatch on every replica reached")]
    Corrupt { extent: ExtentId, block: u64 },
    #[error("invalid request: {0}")]
    Invalid(String),
    /// The local disk failed (the partition is now read-only on this node).
    #[error("disk error: {0}")]
    Io(String),
    /// A follower refused a replicated packet sent under an older Raft term than it knows: the
    /// sender is no longer the leader. (Appended last: variants are numbered in order on the
    /// wire.)
    #[error("sent under term {sent}, but the replica knows term {current}: a newer leader exists")]
    StaleTerm { sent: u64, current: u64 },
}

/// Creates a normal extent (through the partition's Raft group, so ids are never reused). Op
/// `0x0301`, served by the leader.
#[derive(Debug)]
pub struct CreateExtent;

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct CreateExtentRequest {
    pub partition: PartitionId,
}

impl Rpc for CreateExtent {
    const OP: Op = Op(0x0301);
    const NAME: &'static str = "data_create_extent";
    type Request = CreateExtentRequest;
    type Response = Result<ExtentId, DataError>;
}

/// Appends the data segment (at most [`MAX_PACKET`] bytes) to a normal extent at `offset`, which must
/// be the extent's end as of the previous packet (op `0x0302`, served by the leader). Several packets
/// of one extent may be in flight; the leader applies them in offset order.
#[derive(Debug)]
pub struct Append;

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct AppendRequest {
    pub partition: PartitionId,
    pub extent: ExtentId,
    pub offset: u64,
    /// Whether every replica syncs before the reply. A packet with `sync` is acknowledged once
    /// durable on every replica, together with every earlier packet of the extent, and the reply's
    /// committed length covers it. A packet without is acknowledged once written (not yet durable)
    /// on every replica and commits nothing: the writer keeps its bytes until a later `sync`
    /// packet of the extent is acknowledged, and writes them again elsewhere if that one fails. A
    /// stream of packets pays one sync round per replica per `sync` packet instead of per packet.
    pub sync: bool,
}

/// What an acknowledged write reports.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Written {
    pub extent: ExtentId,
    /// Where the bytes landed.
    pub offset: u64,
    /// The extent's committed length: every byte below it is durable on every replica.
    pub committed: u64,
}

impl Rpc for Append {
    const OP: Op = Op(0x0302);
    const NAME: &'static str = "data_append";
    type Request = AppendRequest;
    type Response = Result<Written, DataError>;
}

/// Stores small files (the data segment, at most [`MAX_TINY_WRITE`] bytes) in one of the partition's
/// tiny extents; the leader picks the extent and offset (op `0x0303`).
#[derive(Debug)]
pub struct WriteTiny;

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct WriteTinyRequest {
    pub partition: PartitionId,
}

impl Rpc for WriteTiny {
    const OP: Op = Op(0x0303);
    const NAME: &'static str = "data_write_tiny";
    type Request = WriteTinyRequest;
    type Response = Result<Written, DataError>;
}

/// Overwrites bytes inside the committed part of an extent, through the partition's Raft group
/// (op `0x0304`).
#[derive(Debug)]
pub struct Overwrite;

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct OverwriteRequest {
    pub partition: PartitionId,
    pub extent: ExtentId,
    pub offset: u64,
}

impl Rpc for Overwrite {
    const OP: Op = Op(0x0304);
    const NAME: &'static str = "data_overwrite";
    type Request = OverwriteRequest;
    type Response = Result<(), DataError>;
}

/// Reads committed bytes of an extent on the leader; the bytes come back in the data segment
/// (op `0x0305`).
#[derive(Debug)]
pub struct Read;

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ReadRequest {
    pub partition: PartitionId,
    pub extent: ExtentId,
    pub offset: u64,
    pub len: u32,
}

impl Rpc for Read {
    const OP: Op = Op(0x0305);
    const NAME: &'static str = "data_read";
    type Request = ReadRequest;
    type Response = Result<(), DataError>;
}

/// Appends like [`Append`], but through the partition's Raft group instead of primary-backup (op
/// `0x0307`). Not used by clients: it exists to measure what scenario-aware replication buys.
#[derive(Debug)]
pub struct AppendRaft;

impl Rpc for AppendRaft {
    const OP: Op = Op(0x0307);
    const NAME: &'static str = "data_append_raft";
    type Request = AppendRequest;
    type Response = Result<Written, DataError>;
}

/// Releases extent ranges the meta node no longer references: a normal extent released from 0 to
/// (at least) its end is deleted; any other range is hole-punched (op `0x0306`, through Raft).
/// Idempotent.
#[derive(Debug)]
pub struct Release;

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ReleaseRequest {
    pub partition: PartitionId,
    /// `(extent, offset, len)`; `(extent, 0, u64::MAX)` deletes a normal extent.
    pub ranges: Vec<(ExtentId, u64, u64)>,
}

impl Rpc for Release {
    const OP: Op = Op(0x0306);
    const NAME: &'static str = "data_release";
    type Request = ReleaseRequest;
    type Response = Result<(), DataError>;
}

/// Leader → follower: the same bytes at the same place (op `0x0310`): one append packet, or
/// several consecutive ones of an extent as one batch (at most `service::MAX_BATCH` bytes), or a
/// tiny write. `committed` is the extent's
/// committed length before this packet: a follower may drop a longer, unacknowledged tail down to
/// `offset` but never below `committed`. With `sync` the follower syncs (everything it wrote
/// before too) before it replies.
#[derive(Debug)]
pub struct Replicate;

#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct ReplicateRequest {
    pub partition: PartitionId,
    pub extent: ExtentId,
    pub offset: u64,
    pub committed: u64,
    pub sync: bool,
    /// The Raft term under which the sender leads the partition: a follower that knows a newer
    /// one refuses the packet ([`DataError::StaleTerm`]). 0 names no term. Appended last, so a
    /// request without it (from a sender built before it existed) decodes with 0, and a
    /// receiver built before it ignores it (bodies may carry trailing bytes).
    pub term: u64,
}

impl<'de> Deserialize<'de> for ReplicateRequest {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Fields;
        impl<'de> serde::de::Visitor<'de> for Fields {
            type Value = ReplicateRequest;

            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a replicate request")
            }

            fn visit_seq<A: serde::de::SeqAccess<'de>>(
                self,
                mut seq: A,
            ) -> Result<Self::Value, A::Error> {
                let missing = |i| serde::de::Error::invalid_length(i, &"6 fields");
                Ok(ReplicateRequest {
                    partition: seq.next_element()?.ok_or_else(|| missing(0))?,
                    extent: seq.next_element()?.ok_or_else(|| missing(1))?,
                    offset: seq.next_element()?.ok_or_else(|| missing(2))?,
                    committed: seq.next_element()?.ok_or_else(|| missing(3))?,
                    sync: seq.next_element()?.ok_or_else(|| missing(4))?,
                    // The body ends here when the sender predates the term: postcard reports
                    // the end of its input as an error, which names no term.
                    term: seq.next_element().ok().flatten().unwrap_or(0),
                })
            }
        }
        const FIELDS: &[&str] = &["partition", "extent", "offset", "committed", "sync", "term"];
        d.deserialize_struct("ReplicateRequest", FIELDS, Fields)
    }
}

impl Rpc for Replicate {
    const OP: Op = Op(0x0310);
    const NAME: &'static str = "data_replicate";
    type Request = ReplicateRequest;
    type Response = Result<(), DataError>;
}

/// Replica ↔ replica during repair: the extents a replica holds and their lengths (op `0x0311`).
#[derive(Debug)]
pub struct ListExtents;

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ListExtentsRequest {
    pub partition: PartitionId,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct ExtentList {
    /// `(extent, local length, committed length as known to this replica)`.
    pub extents: Vec<(ExtentId, u64, u64)>,
    /// Raft entries applied by this replica's partition (overwrites included up to here).
    pub applied: u64,
}

impl Rpc for ListExtents {
    const OP: Op = Op(0x0311);
    const NAME: &'static str = "data_list_extents";
    type Request = ListExtentsRequest;
    type Response = Result<ExtentList, DataError>;
}

/// Replica ↔ replica during repair: block CRCs of one extent (op `0x0312`).
#[derive(Debug)]
pub struct BlockCrcs;

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct BlockCrcsRequest {
    pub partition: PartitionId,
    pub extent: ExtentId,
}

impl Rpc for BlockCrcs {
    const OP: Op = Op(0x0312);
    const NAME: &'static str = "data_block_crcs";
    type Request = BlockCrcsRequest;
    /// `(block size, CRCs, applied index)`.
    type Response = Result<(u32, Vec<u32>, u64), DataError>;
}

/// Replica ↔ replica: verified bytes of whole blocks `[first, first + count)`, served from the local
/// copy without the committed-length check (op `0x0313`). The reply carries the replica's applied
/// Raft index so the receiver can tell whether it reflects every overwrite it knows of.
#[derive(Debug)]
pub struct FetchBlocks;

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct FetchBlocksRequest {
    pub partition: PartitionId,
    pub extent: ExtentId,
    pub first: u64,
    pub count: u32,
}

impl Rpc for FetchBlocks {
    const OP: Op = Op(0x0313);
    const NAME: &'static str = "data_fetch_blocks";
    type Request = FetchBlocksRequest;
    /// The applied index of the sender; the bytes are in the data segment.
    type Response = Result<u64, DataError>;
}

/// Writes one shard of an erasure-coded partition's stripes (the data segment, at most
/// [`MAX_TINY_WRITE`] bytes) into tiny extent `extent` at `offset`, where replica 0 placed shard
/// 0 of the same stripes with a [`WriteTiny`]; durable on this replica when acknowledged (op
/// `0x0315`, served by the replica that holds the shard; docs/ARCHITECTURE.md, "Erasure-coded
/// volumes").
#[derive(Debug)]
pub struct WriteShard;

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct WriteShardRequest {
    pub partition: PartitionId,
    pub extent: ExtentId,
    pub offset: u64,
}

impl Rpc for WriteShard {
    const OP: Op = Op(0x0315);
    const NAME: &'static str = "data_write_shard";
    type Request = WriteShardRequest;
    type Response = Result<Written, DataError>;
}

/// Runs a garbage-collection sweep now on the data partitions this node leads (op `0x0314`):
/// every normal extent idle for at least `grace_ms` that no meta partition of the partition's
/// volume references is deleted through the partition's Raft group (docs/ARCHITECTURE.md,
/// "Garbage collection"). A grace below [`MIN_GC_GRACE`] is safe only while no client of the
/// volume writes (the reliability harness runs it after its workload stopped).
#[derive(Debug)]
pub struct Sweep;

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct SweepRequest {
    /// One partition, or `None` for every partition the node leads.
    pub partition: Option<PartitionId>,
    pub grace_ms: u64,
}

/// What one sweep of one data partition found and did.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SweepReport {
    pub partition: PartitionId,
    /// When the sweep ended, in ms since the Unix epoch (the data node's clock).
    pub finished_ms: u64,
    /// Normal extents (and their bytes) some meta partition references.
    pub referenced: u64,
    pub referenced_bytes: u64,
    /// Normal extents no meta partition references (freed or not: see below).
    pub unreferenced: u64,
    pub unreferenced_bytes: u64,
    /// Of those, the ones deleted by this sweep.
    pub freed: u64,
    pub freed_bytes: u64,
    /// Why the sweep deleted nothing, if it could not ask every meta partition (or could not
    /// delete): unreferenced extents are then counted but kept.
    pub error: Option<String>,
}

impl Rpc for Sweep {
    const OP: Op = Op(0x0314);
    const NAME: &'static str = "data_sweep";
    type Request = SweepRequest;
    type Response = Result<Vec<SweepReport>, DataError>;
}

/// The longest a client lets pass between sending the first write of a normal extent that no
/// key it committed covers yet and committing that write's key: a commit that would come later
/// fails instead (the bytes are reported lost, never silently dropped). Half of
/// [`MIN_GC_GRACE`]: the other half bounds how long a key commit already sent may take to be
/// applied (docs/ARCHITECTURE.md, "Garbage collection").
pub const KEY_COMMIT_WITHIN: std::time::Duration = std::time::Duration::from_secs(15 * 60);

/// The shortest grace a data node's background collector runs with: an extent is deleted only
/// after this long without a write, so a key commit allowed by [`KEY_COMMIT_WITHIN`] is applied
/// before any sweep that could delete its extent asks the meta partitions.
pub const MIN_GC_GRACE: std::time::Duration = std::time::Duration::from_secs(30 * 60);

/// Largest data segment of an append or overwrite.
pub const MAX_PACKET: usize = 128 * 1024;
/// Largest data segment of a tiny write: a packet of many small files written behind, synced
/// once on every replica.
pub const MAX_TINY_WRITE: usize = 512 * 1024;

#[cfg(test)]
mod tests {
    use super::*;
    use nacre_proto::msg::{decode_body, encode_body};

    fn request(term: u64) -> ReplicateRequest {
        ReplicateRequest {
            partition: PartitionId(7),
            extent: ExtentId(1030),
            offset: 1 << 20,
            committed: 4096,
            sync: true,
            term,
        }
    }

    /// The request as a sender built before the term existed encodes it.
    #[derive(Serialize, Deserialize, Debug, PartialEq)]
    struct Before {
        partition: PartitionId,
        extent: ExtentId,
        offset: u64,
        committed: u64,
        sync: bool,
    }

    #[test]
    fn a_replicate_request_keeps_its_term_and_decodes_without_one() {
        let r = request(9);
        let got: ReplicateRequest = decode_body("replicate", &encode_body(&r)).unwrap();
        assert_eq!(got, r);
        // From an older sender: no term.
        let old = Before {
            partition: r.partition,
            extent: r.extent,
            offset: r.offset,
            committed: r.committed,
            sync: r.sync,
        };
        let got: ReplicateRequest = decode_body("replicate", &encode_body(&old)).unwrap();
        assert_eq!(got, request(0));
        // To an older receiver: the term is a trailing field it ignores.
        let got: Before = decode_body("replicate", &encode_body(&r)).unwrap();
        assert_eq!(got, old);
        // A body cut inside the fields every sender writes is refused.
        let body = encode_body(&old);
        assert!(decode_body::<ReplicateRequest>("replicate", &body[..body.len() - 1]).is_err());
    }

    #[test]
    fn a_stale_term_error_survives_the_wire() {
        let e: Result<(), DataError> = Err(DataError::StaleTerm {
            sent: 3,
            current: 4,
        });
        let got: Result<(), DataError> = decode_body("reply", &encode_body(&e)).unwrap();
        assert_eq!(got, e);
    }
}
