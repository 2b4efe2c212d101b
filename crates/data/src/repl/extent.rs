//! Per-extent rules of primary-backup appends (docs/ARCHITECTURE.md, "Replication is
//! scenario-aware"): which waiting packets the primary writes and forwards as one batch, and how a
//! backup takes a batch. Pure: the shell (`service::append`, `service::forward`) applies them
//! under the extent's write lock to the lengths it keeps.
//!
//! Three lengths describe an extent on the primary: where the next packet must start (the end of
//! the last one written here), what every replica has written (packets are acknowledged in offset
//! order through it), and the committed offset (durable on every replica). A packet is
//! acknowledged only once the bytes before it are on every replica, and a synced packet commits
//! everything below its end, since each replica wrote the earlier packets before it and synced
//! after it.

/// Which of the packets waiting on the primary (offset, length), in offset order, go next.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Batch {
    /// Offsets of stale packets (below where the next packet must start: a retry of one written
    /// already): refused.
    pub stale: Vec<u64>,
    /// Offsets of the packets of the batch, which starts where the next packet must start.
    pub take: Vec<u64>,
}

/// Takes from `waiting` (offset, length, in offset order) the packets that continue the extent
/// from `next`, up to a gap or `max` bytes (a batch takes at least one packet), and names the
/// stale ones below `next`.
pub fn plan_batch(next: u64, waiting: impl IntoIterator<Item = (u64, usize)>, max: usize) -> Batch {
    let mut batch = Batch::default();
    let (mut at, mut bytes) = (next, 0);
    for (offset, len) in waiting {
        if offset < next {
            batch.stale.push(offset);
            continue;
        }
        if offset != at || (bytes > 0 && bytes + len > max) {
            break;
        }
        batch.take.push(offset);
        at += len as u64;
        bytes += len;
    }
    batch
}

/// How a backup takes a batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Take {
    /// Write it where it starts.
    Write,
    /// Cut the extent to the batch's offset first: the bytes past it are an unacknowledged tail of
    /// an earlier leader.
    CutThenWrite,
}

/// Why a backup refuses a batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Refused {
    /// It starts below the committed offset: cutting there would drop acknowledged bytes.
    #[error("batch at {offset} starts below the committed offset {committed}")]
    BelowCommitted { offset: u64, committed: u64 },
    /// It starts past the end of the backup's copy (the bytes before it are missing here).
    #[error("batch at {offset} starts past this replica's {have} bytes")]
    PastEnd { offset: u64, have: u64 },
}

/// Why a backup refuses a batch whatever its offset.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("sent under term {sent}, but this replica knows term {known}")]
pub struct StaleTerm {
    pub sent: u64,
    pub known: u64,
}

/// Whether a backup that knows its group's Raft term `known` takes a batch sent under `sent`.
/// A leader deposed by an election it has not heard of yet still forwards packets; a backup that
/// took part in that election (or heard of it) refuses them, so the deposed leader cannot
/// acknowledge a write (Raft's own rule for messages of an older term, §5.1). A newer term is
/// taken: the backup has not heard of the election yet, and its winner is the leader. `sent` 0
/// names no term (a leader built before packets carried one) and is taken.
pub fn check_term(sent: u64, known: u64) -> Result<(), StaleTerm> {
    if sent != 0 && sent < known {
        return Err(StaleTerm { sent, known });
    }
    Ok(())
}

/// Where the primary puts a tiny write (tiny extents take their writes on `align` boundaries,
/// past everything): past where its track says the next write goes, past the committed offset and
/// past the `held` bytes of its own copy. The track alone is not enough: one made at a leader
/// change from lengths read earlier can be behind a replica's write that ended since, and a tiny
/// write there would overwrite acknowledged bytes of other files.
pub fn tiny_offset(next: u64, committed: u64, held: u64, align: u64) -> u64 {
    next.max(committed).max(held).next_multiple_of(align)
}

/// How a backup holding `have` bytes of an extent, whose committed offset is `committed`, takes a
/// batch at `offset`. A tiny extent's writes land where the primary put them (their offsets are
/// aligned, so they may leave a gap).
pub fn follower_take(have: u64, committed: u64, offset: u64, tiny: bool) -> Result<Take, Refused> {
    if offset < have {
        if offset < committed {
            return Err(Refused::BelowCommitted { offset, committed });
        }
        return Ok(Take::CutThenWrite);
    }
    if offset > have && !tiny {
        return Err(Refused::PastEnd { offset, have });
    }
    Ok(Take::Write)
}

/// The lengths of an extent's track built from its length on disk, `len`, when it has none (a
/// restart, a reopen, an extent not seen since): (where the next packet starts, committed offset).
/// The leader's length counts as committed (alignment made the tracks it knew; an extent it did
/// not know was created through Raft and not written since). A follower's does not: it may end in
/// an unacknowledged tail of an earlier leader, which the next packet at the committed offset must
/// be able to cut; the leader's packets tell it what is committed.
pub fn track_from_disk(len: u64, leading: bool) -> (u64, u64) {
    (len, if leading { len } else { 0 })
}
