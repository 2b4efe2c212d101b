//! Write-behind of small files' data (docs/ARCHITECTURE.md, "Write-behind of small files").
//!
//! **What goes behind.** With write-behind a run stays in memory up to [`BEHIND_RUN_MAX`]
//! (512 KiB) before it is streamed to a normal extent. A `close` (`flush`) or `release` of a
//! file whose run was not streamed does not commit it: the bytes stay in the file's run, the
//! file joins the *dirty list* and the call returns. A file with a stream, a hidden (unlinked
//! while open) file and `fsync` take the synchronous path.
//!
//! **Rounds.** One flusher task per client sends the list in rounds, oldest first, with up to
//! [`ROUNDS_MAX`] rounds in flight. A round starts when 128 KiB is dirty, when the oldest dirty
//! file has waited `flush_delay`, or when someone syncs; it takes up to [`ROUND_MAX`] bytes. It
//! locks the round's files (their calls wait for it), cuts their runs into pieces of at most
//! 128 KiB and packs the pieces into packets of up to [`MAX_TINY_WRITE`] bytes,
//! writes each packet as **one replicated append into a shared tiny extent**, and queues each
//! file's extent key behind the client's other metadata changes
//! ([`MetaFs::append_extents_behind`](crate::MetaFs)), so that a partition records many files'
//! keys in one batch, after the creates that made them. Times set explicitly while the run was
//! open (`tar` sets mtime before `close`) are queued again after the keys, which would
//! otherwise stamp the commit's time over them.
//!
//! **Memory.** Dirty bytes are bounded by `dirty_max`: a close that finds more waits until the
//! flusher has written enough (backpressure; nothing is dropped for want of room).
//!
//! **Durability.** What a crash of the client may lose: data closed but neither fsynced nor
//! synced (its directory fsynced, or unmount), at most `flush_delay` plus the rounds ahead of
//! it. `fsync` of a file commits that file itself and waits for every metadata change queued
//! before; `fsync` of any directory ([`Inner::sync_data`]) and unmount wait until every file
//! dirty before the call is written and its key applied. A packet that cannot be written is
//! retried in later rounds for [`RETRY_FOR`]; then the file's bytes are dropped, logged, and
//! the file's next `flush`/`fsync`/`close` and the next directory fsync report the failure.
//!
//! **Files sharing an extent.** A key covers exactly its file's bytes within the packet; a
//! removed file's range is punched exactly (neighbours' bytes in a shared block are kept), so
//! no file ever reads another's bytes.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use nacre_api::data::MAX_PACKET;
use nacre_api::meta::ExtentKey;
use nacre_types::sync::lock;
use tokio::task::JoinSet;

use super::frames::Unit;
use super::{FileState, Inner, OpenFile};
use crate::meta::{FsError, FsResult};

/// Longest run kept in memory (and written behind at close) before it is streamed to a normal
/// extent, when small files are written behind.
pub(super) const BEHIND_RUN_MAX: usize = 4 * MAX_PACKET;
/// Most bytes one round takes (its packets are written at once).
pub(super) const ROUND_MAX: usize = 16 * MAX_PACKET;
/// Most rounds in flight at once: while one round's keys commit, the next one's packets go out.
pub(super) const ROUNDS_MAX: usize = 4;
/// How long a file's bytes are retried before they are given up: far longer than any fault the
/// cluster rides out lasts (a close acknowledged them; meanwhile `dirty_max` holds writers back).
pub(super) const RETRY_FOR: Duration = Duration::from_secs(600);
/// The pause after a round in which a packet failed.
const RETRY_PAUSE: Duration = Duration::from_millis(200);

/// The dirty list of one client.
#[derive(Debug)]
pub(super) struct DataBehind {
    delay: Duration,
    max: u64,
    st: Mutex<Dirty>,
    /// Wakes the flusher: a packet's worth is dirty, or someone syncs.
    wake: tokio::sync::Notify,
    /// Woken after every round and whenever dirty bytes are committed.
    progress: tokio::sync::Notify,
}

/// One dirty file: its mark (order of becoming dirty), when it became dirty, the file.
type Entry = (u64, Instant, Arc<OpenFile>);

/// The dirty list's state. Invariant: `files` is sorted by mark, and a file dirty since mark
/// `m` is, until its bytes are written, on `files` with a mark of at most `m` or in a round whose
/// lowest mark (in `flying`) is at most `m`; so a sync that waits for every mark up to a target
/// waits for every file dirty when it began ([`Dirty::written_to`]).
#[derive(Debug)]
struct Dirty<F = Arc<OpenFile>> {
    files: VecDeque<(u64, Instant, F)>,
    /// Dirty bytes of every file (each file's share is `OpenFile::behind_bytes`).
    bytes: u64,
    /// The last mark handed out.
    marks: u64,
    /// The lowest mark of each round being written.
    flying: Vec<u64>,
    /// Someone waits for every file marked up to this: no lingering.
    urgent_to: u64,
    /// The flusher task is alive.
    running: bool,
    /// The first file whose bytes were given up since the last directory fsync.
    failed: Option<String>,
}

impl<F> Default for Dirty<F> {
    fn default() -> Self {
        Self {
            files: VecDeque::new(),
            bytes: 0,
            marks: 0,
            flying: Vec::new(),
            urgent_to: 0,
            running: false,
            failed: None,
        }
    }
}

impl<F> Dirty<F> {
    /// Whether every file dirty at mark `target` is written: no round that holds one is in
    /// flight and none is on the list.
    fn written_to(&self, target: u64) -> bool {
        self.flying.iter().all(|&m| m > target) && self.files.front().is_none_or(|e| e.0 > target)
    }

    /// Puts a round's files back on the list to be written again (a packet failed, or the file
    /// was closed again with new bytes while its round was in flight), each with the mark it had,
    /// in mark order: a sync that began meanwhile waits for them.
    fn put_back(&mut self, entries: Vec<(u64, Instant, F)>) {
        for e in entries {
            let at = self.files.partition_point(|x| x.0 < e.0);
            self.files.insert(at, e);
        }
    }

    /// Marks a file dirty now (the caller just set its `dirty` flag).
    fn push(&mut self, f: F) {
        self.marks += 1;
        let mark = self.marks;
        self.files.push_back((mark, Instant::now(), f));
    }

    /// Notes the first failure a directory fsync must report.
    fn fail(&mut self, msg: String) {
        self.failed.get_or_insert(msg);
    }
}

impl DataBehind {
    pub(super) fn new(delay: Duration, max: u64) -> Self {
        Self {
            delay,
            max,
            st: Mutex::default(),
            wake: tokio::sync::Notify::new(),
            progress: tokio::sync::Notify::new(),
        }
    }

    /// Waits until `ready` holds (checked under the lock).
    async fn wait_until(&self, mut ready: impl FnMut(&Dirty) -> bool) {
        loop {
            let notified = self.progress.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if ready(&lock(&self.st)) {
                return;
            }
            notified.await;
        }
    }

    /// Dirty bytes that start a round at once: a packet's worth, or what makes closes wait.
    fn full(&self) -> u64 {
        self.max.min(MAX_PACKET as u64)
    }

    /// Forgets `f`'s dirty bytes (its run was committed or dropped).
    fn uncount(&self, f: &OpenFile) {
        let n = f.behind_bytes.swap(0, Ordering::SeqCst);
        if n > 0 {
            let mut d = lock(&self.st);
            d.bytes = d.bytes.saturating_sub(n);
            drop(d);
            self.progress.notify_waiters();
        }
    }
}

impl Inner {
    /// How long a run grows in memory before it is streamed: one packet, or [`BEHIND_RUN_MAX`]
    /// with write-behind (such a run goes behind at close, in packet-sized pieces).
    pub(super) fn stream_after(&self) -> usize {
        if self.behind.is_some() {
            BEHIND_RUN_MAX.max(self.cfg.tiny_max)
        } else {
            self.cfg.tiny_max
        }
    }

    /// Leaves `f`'s run to the flusher when it can go behind (see the module docs); `false`
    /// when the caller must commit it now.
    pub(super) fn defer(&self, f: &Arc<OpenFile>, st: &FileState) -> bool {
        let Some(b) = &self.behind else {
            return false;
        };
        let Some(run) = &st.run else {
            return false;
        };
        if run.stream.is_some()
            || run.sent > 0
            || run.buf.is_empty()
            || run.buf.len() > self.stream_after()
            || st.error.is_some()
            || !st.pieces.is_empty()
            || lock(&f.hidden).is_some()
        {
            return false;
        }
        let Some(me) = self.me.upgrade() else {
            return false;
        };
        let n = run.buf.len() as u64;
        let old = f.behind_bytes.swap(n, Ordering::SeqCst);
        let mut d = lock(&b.st);
        d.bytes = d.bytes.saturating_sub(old) + n;
        if !f.dirty.swap(true, Ordering::SeqCst) {
            d.push(f.clone());
        }
        if !d.running {
            d.running = true;
            tokio::spawn(flusher(me));
        }
        let full = d.bytes >= b.full();
        drop(d);
        if full {
            b.wake.notify_one();
        }
        true
    }

    /// Waits while more than `dirty_max` bytes are dirty (called without any file's lock).
    pub(super) async fn wait_room(&self) {
        if let Some(b) = &self.behind {
            b.wait_until(|d| d.bytes <= b.max).await;
        }
    }

    /// Forgets `f`'s dirty bytes: its run was just taken by a synchronous commit.
    pub(super) fn uncount(&self, f: &OpenFile) {
        if let Some(b) = &self.behind {
            b.uncount(f);
        }
    }

    /// Drops `f`'s run unwritten: the file is deleted.
    pub(super) fn discard(&self, f: &OpenFile, st: &mut FileState) {
        st.run = None;
        st.times = None;
        st.extents = None;
        st.ahead = None;
        self.uncount(f);
    }

    /// Waits until every file dirty before the call is written and its keys queued; reports a
    /// file given up since the last call. The caller then settles the metadata queue.
    pub(super) async fn sync_data(&self) -> FsResult<()> {
        let Some(b) = &self.behind else {
            return Ok(());
        };
        let target = {
            let mut d = lock(&b.st);
            d.urgent_to = d.urgent_to.max(d.marks);
            d.marks
        };
        b.wake.notify_one();
        b.wait_until(|d| d.written_to(target)).await;
        match lock(&b.st).failed.take() {
            Some(e) => Err(FsError::WriteFailed(e)),
            None => Ok(()),
        }
    }

    /// Writes one round of dirty files; returns those to write again.
    async fn flush_round(self: &Arc<Self>, round: Vec<Entry>) -> RoundEnd {
        let Some(b) = &self.behind else {
            return RoundEnd::default();
        };
        // The round's files are locked in list order; every other call locks one file at a
        // time, so this cannot deadlock.
        let mut guards = Vec::with_capacity(round.len());
        for (_, _, f) in &round {
            guards.push(f.state.lock().await);
        }
        // Runs that grew a stream since they were deferred are committed as usual.
        let limit = self.stream_after();
        let mut small = Vec::new();
        for (i, st) in guards.iter_mut().enumerate() {
            let f = &round[i].2;
            let fits = st
                .run
                .as_ref()
                .map(|r| r.stream.is_none() && r.sent == 0 && r.buf.len() <= limit);
            match fits {
                None => {}
                Some(true) if st.run.as_ref().is_some_and(|r| !r.buf.is_empty()) => small.push(i),
                Some(_) => {
                    if let Err(e) = self.flush_file(f, st).await {
                        tracing::warn!(ino = %f.ino, error = %e, "a file's bytes written behind were not committed");
                        let msg = format!("bytes of inode {} written behind were lost: {e}", f.ino);
                        lock(&b.st).fail(msg);
                    }
                }
            }
        }
        // Every file's keys, or the first failure of its units or of one of its packets.
        let mut keys: Vec<Result<Vec<ExtentKey>, String>> =
            (0..round.len()).map(|_| Ok(Vec::new())).collect();
        // Each run as units (raw pieces, or compressed blocks), packed whole in list order.
        let mut units: Vec<(usize, Unit)> = Vec::new();
        for &i in &small {
            let Some(run) = guards[i].run.as_ref() else {
                continue;
            };
            match self
                .units(run.start, Bytes::copy_from_slice(&run.buf))
                .await
            {
                Ok(us) => units.extend(us.into_iter().map(|u| (i, u))),
                Err(e) => keys[i] = Err(e.to_string()),
            }
        }
        let spread = lock(&b.st).marks as usize;
        for (members, placed) in self.place_packed(spread, &units).await {
            match placed {
                Ok(ks) => {
                    for (&(i, _), key) in members.iter().zip(ks) {
                        if let Ok(v) = &mut keys[i] {
                            v.push(key);
                        }
                    }
                }
                Err(e) => {
                    for &(i, _) in &members {
                        if keys[i].is_ok() {
                            keys[i] = Err(e.to_string());
                        }
                    }
                }
            }
        }
        let mut end = RoundEnd::default();
        let mut done = vec![true; round.len()];
        let mut marks = Vec::new();
        for &i in &small {
            let f = &round[i].2;
            let st = &mut *guards[i];
            match std::mem::replace(&mut keys[i], Ok(Vec::new())) {
                Ok(ks) => {
                    if st.run.take().is_none() || ks.is_empty() {
                        continue;
                    }
                    super::files::record_keys(st, ks.clone());
                    st.ahead = None;
                    st.failing = None;
                    // The keys' commit stamps mtime and ctime.
                    st.times_stale = false;
                    let times = st.times.take();
                    match self.meta.append_extents_behind(f.ino, ks, times).await {
                        Ok(mark) => marks.extend(mark),
                        Err(e) => {
                            tracing::warn!(ino = %f.ino, error = %e, "a file's extent keys were not queued");
                            let msg =
                                format!("keys of inode {} written behind were lost: {e}", f.ino);
                            lock(&b.st).fail(msg);
                            st.error = Some(e.to_string());
                        }
                    }
                    b.uncount(f);
                }
                Err(e) => {
                    let since = *st.failing.get_or_insert_with(Instant::now);
                    if since.elapsed() < RETRY_FOR {
                        tracing::debug!(ino = %f.ino, error = %e, "a packet written behind failed; retrying");
                        done[i] = false;
                        continue;
                    }
                    tracing::error!(ino = %f.ino, error = %e, "bytes written behind were given up");
                    let msg = format!("bytes of inode {} written behind were lost: {e}", f.ino);
                    st.error = Some(msg.clone());
                    lock(&b.st).fail(msg);
                    self.discard(f, st);
                }
            }
        }
        drop(guards);
        // A file stays known (and its size with it) until its keys are applied: a getattr that
        // read the partition before they were queued still finds the file here afterwards.
        self.meta.applied(&marks).await;
        for (i, entry) in round.iter().enumerate() {
            if !done[i] {
                end.retry.push(entry.clone());
                continue;
            }
            let f = &entry.2;
            let st = f.state.lock().await;
            if st.run.is_some() && f.behind_bytes.load(Ordering::SeqCst) > 0 {
                // Closed again with new bytes while the round was in flight: dirty all along,
                // so it keeps its mark (a sync that began meanwhile must wait for it).
                end.again.push(entry.clone());
                continue;
            }
            f.dirty.store(false, Ordering::SeqCst);
            drop(st);
            self.forget_if_closed(f);
        }
        end
    }
}

/// The files a round gives back to the list.
#[derive(Debug, Default)]
struct RoundEnd {
    /// Whose packet failed (retried after [`RETRY_PAUSE`]).
    retry: Vec<Entry>,
    /// Closed again with new bytes while the round was in flight.
    again: Vec<Entry>,
}

/// Sends the dirty list in rounds, up to [`ROUNDS_MAX`] at once, until it is empty.
async fn flusher(inner: Arc<Inner>) {
    let Some(b) = &inner.behind else { return };
    let mut rounds: JoinSet<RoundEnd> = JoinSet::new();
    // The lowest mark and the files of each round, by task.
    let mut taken: HashMap<tokio::task::Id, (u64, Vec<Entry>)> = HashMap::new();
    loop {
        // Start a round when one is due and there is room for it.
        let due = {
            let mut d = lock(&b.st);
            match d.files.front() {
                None if rounds.is_empty() => {
                    d.running = false;
                    return;
                }
                None => None,
                Some(&(mark, at, _)) => {
                    let due = at + b.delay;
                    let go = d.bytes >= b.full() || d.urgent_to >= mark || Instant::now() >= due;
                    if go && rounds.len() < ROUNDS_MAX {
                        let round = take_round(&mut d);
                        let low = round.first().map_or(0, |e| e.0);
                        d.flying.push(low);
                        drop(d);
                        let (me, files) = (inner.clone(), round.clone());
                        let task = rounds.spawn(async move { me.flush_round(round).await });
                        taken.insert(task.id(), (low, files));
                        continue;
                    }
                    (!go).then_some(due)
                }
            }
        };
        let done = if rounds.is_empty() {
            if let Some(due) = due {
                let _ = tokio::time::timeout_at(due.into(), b.wake.notified()).await;
            }
            continue;
        } else if rounds.len() < ROUNDS_MAX {
            // Room for a round: wait for the next one to come due or a round to end.
            let wait = async {
                match due {
                    Some(due) => {
                        let _ = tokio::time::timeout_at(due.into(), b.wake.notified()).await;
                    }
                    None => b.wake.notified().await,
                }
            };
            tokio::select! {
                r = rounds.join_next_with_id() => r,
                () = wait => continue,
            }
        } else {
            rounds.join_next_with_id().await
        };
        let Some(done) = done else { continue };
        let id = match &done {
            Ok((id, _)) => *id,
            Err(e) => e.id(),
        };
        let (low, files) = taken.remove(&id).unwrap_or_default();
        let end = done.map_or_else(
            |e| {
                // Its files go back on the list as they are (still marked dirty).
                tracing::error!(error = %e, "a write-behind round ended without an answer");
                RoundEnd {
                    retry: files,
                    again: Vec::new(),
                }
            },
            |(_, end)| end,
        );
        let failed = !end.retry.is_empty();
        {
            let mut d = lock(&b.st);
            d.put_back(end.retry);
            d.put_back(end.again);
            if let Some(k) = d.flying.iter().position(|&m| m == low) {
                d.flying.swap_remove(k);
            }
        }
        b.progress.notify_waiters();
        if failed {
            tokio::time::sleep(RETRY_PAUSE).await;
        }
    }
}

/// Takes the next round off the dirty list: files oldest first, up to [`ROUND_MAX`] bytes (at
/// least one file).
fn take_round(d: &mut Dirty) -> Vec<Entry> {
    let mut taken = 0usize;
    let mut round = Vec::new();
    while let Some(e) = d.files.front() {
        let n = e.2.behind_bytes.load(Ordering::SeqCst) as usize;
        if !round.is_empty() && taken + n > ROUND_MAX {
            break;
        }
        taken += n;
        if let Some(e) = d.files.pop_front() {
            round.push(e);
        }
    }
    round
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Takes the whole list as one round, as the flusher does.
    fn take_all(d: &mut Dirty<u32>) -> Vec<(u64, Instant, u32)> {
        let round: Vec<_> = d.files.drain(..).collect();
        if let Some(e) = round.first() {
            d.flying.push(e.0);
        }
        round
    }

    fn end(d: &mut Dirty<u32>, round: &[(u64, Instant, u32)], again: Vec<(u64, Instant, u32)>) {
        d.put_back(again);
        let low = round.first().map_or(0, |e| e.0);
        if let Some(k) = d.flying.iter().position(|&m| m == low) {
            d.flying.swap_remove(k);
        }
    }

    #[test]
    fn a_file_closed_again_while_its_round_flies_holds_back_a_sync_begun_meanwhile() {
        let mut d = Dirty::<u32>::default();
        d.push(7);
        let round = take_all(&mut d);
        // Closed again with new bytes while the round is in flight, then the directory is synced.
        let target = d.marks;
        assert!(!d.written_to(target));
        end(&mut d, &round, round.clone());
        assert!(
            !d.written_to(target),
            "the sync would return before the file's new bytes are written"
        );
        let round = take_all(&mut d);
        assert_eq!(round.iter().map(|e| e.2).collect::<Vec<_>>(), [7]);
        end(&mut d, &round, Vec::new());
        assert!(d.written_to(target));
    }

    #[test]
    fn files_put_back_keep_the_list_in_mark_order() {
        let mut d = Dirty::<u32>::default();
        for f in 1..=4 {
            d.push(f);
        }
        let first = take_all(&mut d);
        d.push(5);
        d.push(6);
        // Marks 1..4 in flight, 5 and 6 on the list; 3 and 1 come back.
        end(&mut d, &first, vec![first[2], first[0]]);
        let marks: Vec<u64> = d.files.iter().map(|e| e.0).collect();
        assert_eq!(marks, [1, 3, 5, 6]);
        assert!(!d.written_to(1));
        assert!(d.written_to(0));
    }
}
