use std::collections::HashMap;

use bytes::Bytes;
use nacre_msgr::Payload;
use nacre_types::ExtentId;

use super::append::{Arrived, Lent, MAX_BATCH, Track, join_packets, take_batch};
use crate::repl::{holding_all, holds, merge_lengths};
use nacre_api::data::{DataError, MAX_PACKET};

fn lens(v: &[(u64, u64)]) -> HashMap<ExtentId, u64> {
    v.iter().map(|(e, l)| (ExtentId(*e), *l)).collect()
}

/// The leader hands over only to a replica holding every committed byte; extents with
/// nothing committed do not count.
#[test]
fn a_leader_lacking_bytes_picks_a_replica_that_holds_them_all() {
    let committed = [(ExtentId(1), 100), (ExtentId(2), 50), (ExtentId(3), 0)];
    let short = (2, lens(&[(1, 100), (2, 49)]));
    let missing = (3, lens(&[(1, 100)]));
    let whole = (4, lens(&[(1, 120), (2, 50)]));
    assert_eq!(
        holding_all(&committed, &[short.clone(), missing.clone()]),
        None
    );
    assert_eq!(
        holding_all(&committed, &[short, missing, whole.clone()]),
        Some(4)
    );
    assert!(holds(&whole.1, &committed));
    assert!(holds(&lens(&[]), &[(ExtentId(3), 0)]));
}

fn arrive(
    track: &Track,
    offset: u64,
    len: usize,
) -> tokio::sync::oneshot::Receiver<Result<(), DataError>> {
    let (done, rx) = tokio::sync::oneshot::channel();
    let data = Payload::new(Bytes::from(vec![offset as u8; len]));
    let mut inbox = track.inbox.lock().unwrap();
    inbox.waiting.insert(
        offset,
        Arrived {
            data,
            sync: false,
            done,
        },
    );
    inbox.writing = true;
    rx
}

/// A batch takes the packets that continue the extent from where the leader wrote up to, in
/// offset order, up to a gap or [`MAX_BATCH`] bytes; packets below that point are refused;
/// with nothing to take, the writer stops.
#[test]
fn a_batch_takes_the_packets_that_continue_the_extent() {
    let e = ExtentId(1024);
    let track = Track::new(100, 100);
    let mut stale = arrive(&track, 50, 10);
    let _a = arrive(&track, 100, 10);
    let _b = arrive(&track, 110, 20);
    let _gap = arrive(&track, 140, 5);
    let (at, batch) = take_batch(&track, e).unwrap();
    assert_eq!(at, 100);
    let lens: Vec<usize> = batch.iter().map(|a| a.data.bytes.len()).collect();
    assert_eq!(lens, [10, 20]);
    assert!(matches!(
        stale.try_recv(),
        Ok(Err(DataError::OutOfRange { offset: 50, .. }))
    ));
    // Written: the packet after the gap waits for the bytes before it.
    track.next.send_replace(130);
    assert!(take_batch(&track, e).is_none());
    assert!(!track.inbox.lock().unwrap().writing);
    assert!(track.inbox.lock().unwrap().waiting.contains_key(&140));

    let track = Track::new(0, 0);
    let mut rxs = Vec::new();
    for k in 0..=(MAX_BATCH / MAX_PACKET) as u64 {
        rxs.push(arrive(&track, k * MAX_PACKET as u64, MAX_PACKET));
    }
    let (at, batch) = take_batch(&track, e).unwrap();
    assert_eq!((at, batch.len()), (0, MAX_BATCH / MAX_PACKET));
    track.next.send_replace(MAX_BATCH as u64);
    let (at, batch) = take_batch(&track, e).unwrap();
    assert_eq!((at, batch.len()), (MAX_BATCH as u64, 1));
}

/// A batch's data is its packets' bytes in order, with the CRC of the whole.
#[test]
fn a_batch_joins_its_packets_with_their_combined_crc() {
    let track = Track::new(0, 0);
    let _rx: Vec<_> = [(0, 3000), (3000, 5), (3005, 70_000)]
        .into_iter()
        .map(|(o, l)| arrive(&track, o, l))
        .collect();
    let (_, batch) = take_batch(&track, ExtentId(1024)).unwrap();
    let joined = join_packets(&batch);
    let mut want = Vec::new();
    for a in &batch {
        want.extend_from_slice(&a.data.bytes);
    }
    assert_eq!(joined.bytes, want);
    assert_eq!(joined.crc(), nacre_types::crc32c(&want));
    let one = join_packets(&batch[..1]);
    assert_eq!(
        one.bytes.as_ptr(),
        batch[0].data.bytes.as_ptr(),
        "one packet: no copy"
    );
}

/// A new leader keeps the shortest copy and the longest committed length; an extent only a
/// follower lists is tracked (created and not applied here yet) unless this leader applied
/// its release, which that follower has not yet.
#[test]
fn alignment_skips_extents_this_leader_saw_released() {
    let (kept, new, gone) = (ExtentId(1024), ExtentId(1030), ExtentId(1025));
    let local = [(kept, 9000)];
    let known = lens(&[(1024, 8000)]);
    let f = vec![(kept, 8500, 8500), (gone, 7000, 6000)];
    let g = vec![(kept, 9000, 8000), (gone, 7000, 6000), (new, 100, 100)];
    let merged = merge_lengths(&local, &known, &[f, g], |e| e == gone);
    let want: HashMap<ExtentId, (u64, u64)> = [(kept, (8500, 8500)), (new, (0, 100))]
        .into_iter()
        .collect();
    assert_eq!(merged, want);
    // Not released here: a follower's committed bytes the leader lacks.
    let merged = merge_lengths(&local, &known, &[vec![(gone, 7000, 6000)]], |_| false);
    assert_eq!(merged.get(&gone), Some(&(0, 6000)));
    assert_eq!(merged.get(&kept), Some(&(0, 8000)));
}

/// A tiny extent lent to a write goes back to the pool when the write ends, however it ends
/// (a handler dropped mid-write by its caller included).
#[test]
fn a_lent_tiny_extent_returns_to_the_pool() {
    let pool = std::sync::Mutex::new(vec![ExtentId(1), ExtentId(2)]);
    let taken = pool.lock().unwrap().pop().unwrap();
    let write = async {
        let _lent = Lent {
            pool: &pool,
            extent: taken,
        };
        std::future::pending::<()>().await;
    };
    // Polled once, then dropped mid-write.
    let mut write = Box::pin(write);
    let waker = std::task::Waker::noop();
    assert!(
        write
            .as_mut()
            .poll(&mut std::task::Context::from_waker(waker))
            .is_pending()
    );
    assert_eq!(pool.lock().unwrap().len(), 1);
    drop(write);
    assert_eq!(*pool.lock().unwrap(), vec![ExtentId(1), ExtentId(2)]);
}
