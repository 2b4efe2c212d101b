//! [`LogStore`] on tikv's `raft-engine`: one append-only log for every group of a node, with group
//! commit (concurrent synced writes share one `fdatasync`) and per-group in-memory indexes.
//!
//! Layout per group (raft-engine "region" = our group id): the entries, plus three keys —
//! `hs` (the `HardState`), `cs` (the `ConfState`), `tr` (the truncation point: index and term,
//! 16 bytes little-endian; written with the group's first write, so it also marks that the group
//! exists) and `sn` (the last saved state-machine snapshot, data included — fine for metadata-sized
//! state; large state machines will want snapshot files beside the log). Installing a snapshot cleans the group and writes the keys again in the
//! same batch, so a crash leaves either the old log or the new one.
//!
//! **One engine per thread.** raft-engine 0.4 caches the last entry block it read in a thread-local
//! keyed by file position only, not by engine. A thread that reads from two engines (two nodes in one
//! process, or two tests on one thread) can be served another engine's block: raft-engine then panics
//! on an index mismatch or, worse, returns the wrong entry. Every engine must therefore be read from
//! threads that read no other engine — in nacre, the node's raft store thread. Reopening an engine on
//! the same thread after a clean close is safe (file positions are not reused).

use std::io::{Seek, SeekFrom, Write};
use std::path::Path;
use std::sync::Arc;

use raft::eraftpb::{ConfState, Entry, HardState, Snapshot};
use raft_engine::env::{DefaultFileSystem, FileSystem, Permission, WriteExt};
use raft_engine::{Command, Config, Engine, LogBatch, MessageExt, ReadableSize};

use crate::log::{GroupId, GroupState, LogError, LogStore, LogWrite, validate};
use crate::mem_log::check_range;

const KEY_HARD_STATE: &[u8] = b"hs";
const KEY_CONF_STATE: &[u8] = b"cs";
const KEY_TRUNCATED: &[u8] = b"tr";
const KEY_SNAPSHOT: &[u8] = b"sn";

#[derive(Clone, Debug)]
struct EntryExt;

impl MessageExt for EntryExt {
    type Entry = Entry;

    fn index(e: &Entry) -> u64 {
        e.index
    }
}

/// What a batch under construction has done to one group so far.
struct Pending {
    group: GroupId,
    bounds: (u64, u64),
    truncated: (u64, u64),
    hard_state: Option<HardState>,
    /// Terms of the entries this batch appends: (index of the first, terms in order).
    appended: Option<(u64, Vec<u64>)>,
    /// A snapshot this batch saves.
    saved: Option<Snapshot>,
}

/// The raft-engine backed log of a node.
pub struct EngineLogStore {
    engine: Engine<ZeroFilled>,
}

type Inner = DefaultFileSystem;

/// raft-engine's file system with one change: room ahead in a log file is made by writing zeros
/// instead of `fallocate`. Blocks that `fallocate` reserves are "unwritten" until data lands in
/// them, and turning them into written blocks is a change ext4 journals, so every synced append
/// into them waited for a journal commit (`perf trace` of 4 KiB overwrites at one in flight:
/// `fdatasync` 0.56-0.63 ms on average, against 0.13 ms for an `fdatasync` after overwriting
/// written blocks on the same disk). Written zeros cost one commit per allocation step (2 MiB in
/// raft-engine 0.4) instead of one per append; what a reader sees is the same: zeros up to the new
/// size. Recycled files (`enable_log_recycle`) were already written in full and never get here.
struct ZeroFilled(Inner);

impl FileSystem for ZeroFilled {
    type Handle = <Inner as FileSystem>::Handle;
    type Reader = <Inner as FileSystem>::Reader;
    type Writer = ZeroFilling<<Inner as FileSystem>::Writer>;

    fn create<P: AsRef<Path>>(&self, path: P) -> std::io::Result<Self::Handle> {
        self.0.create(path)
    }

    fn open<P: AsRef<Path>>(&self, path: P, perm: Permission) -> std::io::Result<Self::Handle> {
        self.0.open(path, perm)
    }

    fn delete<P: AsRef<Path>>(&self, path: P) -> std::io::Result<()> {
        self.0.delete(path)
    }

    fn rename<P: AsRef<Path>>(&self, src_path: P, dst_path: P) -> std::io::Result<()> {
        self.0.rename(src_path, dst_path)
    }

    fn new_reader(&self, handle: Arc<Self::Handle>) -> std::io::Result<Self::Reader> {
        self.0.new_reader(handle)
    }

    fn new_writer(&self, handle: Arc<Self::Handle>) -> std::io::Result<Self::Writer> {
        Ok(ZeroFilling(self.0.new_writer(handle)?))
    }
}

/// A log file writer whose `allocate` writes zeros ([`ZeroFilled`]).
struct ZeroFilling<W>(W);

/// Zeros written per call while allocating.
static ZEROS: [u8; 64 << 10] = [0; 64 << 10];

impl<W: Write> Write for ZeroFilling<W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.write(buf)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.0.flush()
    }
}

impl<W: Seek> Seek for ZeroFilling<W> {
    fn seek(&mut self, pos: SeekFrom) -> std::io::Result<u64> {
        self.0.seek(pos)
    }
}

impl<W: Write + Seek + WriteExt> WriteExt for ZeroFilling<W> {
    fn truncate(&mut self, offset: usize) -> std::io::Result<()> {
        self.0.truncate(offset)
    }

    /// Writes zeros over `[offset, offset + size)`, leaving the write position where it was. On
    /// a full disk the zeros that did get written are cut off again: a failed `fallocate` takes no
    /// space, and raft-engine goes on to write the entries themselves (it only warns when an
    /// allocation fails), which must find the room the zeros would otherwise have taken.
    fn allocate(&mut self, offset: usize, size: usize) -> std::io::Result<()> {
        let at = self.0.stream_position()?;
        self.0.seek(SeekFrom::Start(offset as u64))?;
        let mut left = size;
        let mut written = Ok(());
        while left > 0 {
            let n = left.min(ZEROS.len());
            if let Err(e) = self.0.write_all(&ZEROS[..n]) {
                written = Err(e);
                break;
            }
            left -= n;
        }
        let undone = match written {
            Ok(()) => Ok(()),
            Err(_) => self.0.truncate(offset),
        };
        self.0.seek(SeekFrom::Start(at))?;
        undone?;
        written
    }
}

impl std::fmt::Debug for EngineLogStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EngineLogStore")
            .field("dir", &self.engine.path())
            .finish()
    }
}

/// Size of one log file, in MiB.
const LOG_FILE_MIB: u64 = 4;

fn io(e: raft_engine::Error) -> LogError {
    LogError::Io(e.to_string())
}

impl EngineLogStore {
    /// Opens (or creates) the log in `dir`, replaying it: the state is as of the last write that
    /// reached the disk.
    pub fn open(dir: &Path) -> Result<Self, LogError> {
        let cfg = Config {
            dir: dir.to_string_lossy().into_owned(),
            // Entries are small metadata commands or data that does not compress (overwrites):
            // compressing batches costs CPU for nothing.
            batch_compression_threshold: ReadableSize(0),
            // Reclaim compacted files early (the default waits for 10 GB of log).
            target_file_size: ReadableSize::mb(LOG_FILE_MIB),
            purge_threshold: ReadableSize::mb(128),
            // Write into files whose blocks were written before: a synced append to a fresh file
            // also changes the file system's metadata (its allocated-but-unwritten blocks become
            // written, which ext4 journals), so every fdatasync waits for a journal commit and
            // concurrent ones queue behind each other. Compacted files are kept for reuse (at most
            // 1.5 x purge_threshold of them) and, at open, three files of zeros are written when
            // there are none. 4 KiB commands, 3 replicas, one in flight (`nacre bench raft`, 15 s):
            // p50 1.0-1.08 ms instead of 1.2 ms; 0.88 ms against 1.25 ms once past the first
            // file, the only one of a new log that starts fresh. New files get zeros written
            // ahead instead of `fallocate` ([`ZeroFilled`]) for the same reason.
            enable_log_recycle: true,
            prefill_for_recycle: true,
            prefill_limit: Some(ReadableSize::mb(2 * LOG_FILE_MIB)),
            ..Config::default()
        };
        Ok(Self {
            engine: Engine::open_with_file_system(cfg, Arc::new(ZeroFilled(DefaultFileSystem)))
                .map_err(io)?,
        })
    }

    fn truncated(&self, group: GroupId) -> Result<(u64, u64), LogError> {
        match self.engine.get(group, KEY_TRUNCATED) {
            None => Ok((0, 0)),
            Some(v) => {
                let raw: [u8; 16] = v.as_slice().try_into().map_err(|_| LogError::Corrupt {
                    group,
                    reason: format!("truncation record of {} bytes, expected 16", v.len()),
                })?;
                let (i, t) = raw.split_at(8);
                let word = |b: &[u8]| {
                    let mut w = [0u8; 8];
                    w.copy_from_slice(b);
                    u64::from_le_bytes(w)
                };
                Ok((word(i), word(t)))
            }
        }
    }

    fn bounds(&self, group: GroupId) -> Result<(u64, u64), LogError> {
        let (ti, _) = self.truncated(group)?;
        let last = self.engine.last_index(group).unwrap_or(ti).max(ti);
        Ok((ti + 1, last))
    }

    /// Term of `index` as it will be once the batch under construction is applied.
    fn term_in_batch(&self, p: &Pending, index: u64) -> Result<u64, LogError> {
        if let Some((first, terms)) = &p.appended
            && index >= *first
            && let Some(t) = terms.get((index - first) as usize)
        {
            return Ok(*t);
        }
        if index == p.truncated.0 {
            return Ok(p.truncated.1);
        }
        let e = self
            .engine
            .get_entry::<EntryExt>(p.group, index)
            .map_err(io)?
            .ok_or(LogError::Unavailable {
                group: p.group,
                index,
                last: p.bounds.1,
            })?;
        Ok(e.term)
    }

    fn put_truncated(
        batch: &mut LogBatch,
        group: GroupId,
        index: u64,
        term: u64,
    ) -> Result<(), LogError> {
        let mut v = Vec::with_capacity(16);
        v.extend_from_slice(&index.to_le_bytes());
        v.extend_from_slice(&term.to_le_bytes());
        batch.put(group, KEY_TRUNCATED.to_vec(), v).map_err(io)
    }
}

impl LogStore for EngineLogStore {
    fn purge(&self) -> Result<Vec<GroupId>, LogError> {
        self.engine.purge_expired_files().map_err(io)
    }

    fn write(&self, write: &LogWrite, sync: bool) -> Result<(), LogError> {
        let mut batch = LogBatch::default();
        // A group may appear more than once in a batch: earlier writes move its bounds and may set a
        // hard state that a later snapshot install in the same batch must keep.
        let mut seen: Vec<Pending> = Vec::new();
        for w in &write.groups {
            let g = w.group;
            if w.is_empty() {
                continue;
            }
            let idx = match seen.iter().position(|p| p.group == g) {
                Some(i) => i,
                None => {
                    if self.engine.get(g, KEY_TRUNCATED).is_none() {
                        // The truncation record marks the group as existing from its first write.
                        Self::put_truncated(&mut batch, g, 0, 0)?;
                    }
                    seen.push(Pending {
                        group: g,
                        bounds: self.bounds(g)?,
                        truncated: self.truncated(g)?,
                        hard_state: None,
                        appended: None,
                        saved: None,
                    });
                    seen.len() - 1
                }
            };
            let p = &mut seen[idx];
            if let Some(m) = &w.snapshot {
                batch.add_command(g, Command::Clean);
                p.truncated = (m.index, m.term);
                p.bounds = (m.index + 1, m.index);
                p.appended = None;
                Self::put_truncated(&mut batch, g, m.index, m.term)?;
                batch
                    .put_message(g, KEY_CONF_STATE.to_vec(), m.get_conf_state())
                    .map_err(io)?;
                // `Clean` dropped the hard state too: write it again unless this write sets it.
                let hs = match p.hard_state.clone() {
                    Some(hs) => Some(hs),
                    None => self
                        .engine
                        .get_message::<HardState>(g, KEY_HARD_STATE)
                        .map_err(io)?,
                };
                if let (Some(hs), None) = (hs, &w.hard_state) {
                    batch
                        .put_message(g, KEY_HARD_STATE.to_vec(), &hs)
                        .map_err(io)?;
                }
                // ... and the saved state-machine snapshot, unless this write replaces it.
                let saved = match (&w.save_snapshot, &p.saved) {
                    (Some(_), _) => None,
                    (None, Some(s)) => Some(s.clone()),
                    (None, None) => self
                        .engine
                        .get_message::<Snapshot>(g, KEY_SNAPSHOT)
                        .map_err(io)?,
                };
                if let Some(s) = saved {
                    batch
                        .put_message(g, KEY_SNAPSHOT.to_vec(), &s)
                        .map_err(io)?;
                }
            }
            validate(w, p.bounds.0, p.bounds.1)?;
            if let Some(e) = w.entries.first() {
                batch.add_entries::<EntryExt>(g, &w.entries).map_err(io)?;
                p.bounds.1 = e.index + w.entries.len() as u64 - 1;
                let terms = w.entries.iter().map(|e| e.term);
                match &mut p.appended {
                    Some((first, old)) if e.index >= *first => {
                        old.truncate((e.index - *first) as usize);
                        old.extend(terms);
                    }
                    _ => p.appended = Some((e.index, terms.collect())),
                }
            }
            if let Some(hs) = &w.hard_state {
                batch
                    .put_message(g, KEY_HARD_STATE.to_vec(), hs)
                    .map_err(io)?;
                p.hard_state = Some(hs.clone());
            }
            if let Some(cs) = &w.conf_state {
                batch
                    .put_message(g, KEY_CONF_STATE.to_vec(), cs)
                    .map_err(io)?;
            }
            if let Some(c) = w.compact_to
                && c > p.bounds.0
            {
                let term = self.term_in_batch(p, c - 1)?;
                batch.add_command(g, Command::Compact { index: c });
                Self::put_truncated(&mut batch, g, c - 1, term)?;
                p.truncated = (c - 1, term);
                p.bounds.0 = c;
            }
            if let Some(snap) = &w.save_snapshot {
                batch
                    .put_message(g, KEY_SNAPSHOT.to_vec(), snap)
                    .map_err(io)?;
                p.saved = Some(snap.clone());
            }
        }
        if batch.is_empty() {
            return Ok(());
        }
        self.engine.write(&mut batch, sync).map_err(io)?;
        Ok(())
    }

    fn state(&self, group: GroupId) -> Result<Option<GroupState>, LogError> {
        let hs = self
            .engine
            .get_message::<HardState>(group, KEY_HARD_STATE)
            .map_err(io)?;
        let cs = self
            .engine
            .get_message::<ConfState>(group, KEY_CONF_STATE)
            .map_err(io)?;
        if self.engine.get(group, KEY_TRUNCATED).is_none() {
            return Ok(None);
        }
        let (truncated_index, truncated_term) = self.truncated(group)?;
        Ok(Some(GroupState {
            hard_state: hs.unwrap_or_default(),
            conf_state: cs.unwrap_or_default(),
            truncated_index,
            truncated_term,
        }))
    }

    fn entries(
        &self,
        group: GroupId,
        low: u64,
        high: u64,
        max_size: Option<u64>,
    ) -> Result<Vec<Entry>, LogError> {
        let (first, last) = self.bounds(group)?;
        check_range(group, low, high, first, last)?;
        let mut out = Vec::with_capacity((high - low).min(1024) as usize);
        if low == high {
            return Ok(out);
        }
        let max = max_size.map(|m| usize::try_from(m).unwrap_or(usize::MAX));
        self.engine
            .fetch_entries_to::<EntryExt>(group, low, high, max, &mut out)
            .map_err(io)?;
        if out.is_empty() {
            // raft-engine returns nothing rather than one entry when the first is over the limit.
            self.engine
                .fetch_entries_to::<EntryExt>(group, low, low + 1, None, &mut out)
                .map_err(io)?;
        }
        if out.first().is_some_and(|e| e.index != low) {
            return Err(LogError::Corrupt {
                group,
                reason: format!("asked for entry {low}, got {}", out[0].index),
            });
        }
        Ok(out)
    }

    fn first_index(&self, group: GroupId) -> Result<u64, LogError> {
        Ok(self.bounds(group)?.0)
    }

    fn last_index(&self, group: GroupId) -> Result<u64, LogError> {
        Ok(self.bounds(group)?.1)
    }

    fn saved_snapshot(&self, group: GroupId) -> Result<Option<Snapshot>, LogError> {
        self.engine
            .get_message::<Snapshot>(group, KEY_SNAPSHOT)
            .map_err(io)
    }

    fn groups(&self) -> Vec<GroupId> {
        let mut v = self.engine.raft_groups();
        v.sort_unstable();
        v
    }
}

#[cfg(test)]
mod tests {
    use std::io::{Read, Seek, SeekFrom, Write};
    use std::sync::Arc;

    use raft_engine::env::{DefaultFileSystem, FileSystem, Handle, WriteExt};

    use super::{ZeroFilled, ZeroFilling};

    /// `allocate` writes zeros over the range (even over bytes that were there: `fallocate` would
    /// keep those), extends the file to its end and leaves the write position alone.
    #[test]
    fn allocating_writes_zeros_and_keeps_the_position() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("0000000000000001.raftlog");
        std::fs::write(&path, vec![0xffu8; 200 << 10]).unwrap();
        let fs = ZeroFilled(DefaultFileSystem);
        let handle = Arc::new(
            fs.open(&path, raft_engine::env::Permission::ReadWrite)
                .unwrap(),
        );
        let mut w = fs.new_writer(handle.clone()).unwrap();
        w.seek(SeekFrom::Start(3)).unwrap();
        w.write_all(b"abc").unwrap();
        w.allocate(6, 300 << 10).unwrap();
        assert_eq!(w.stream_position().unwrap(), 6);
        w.write_all(b"def").unwrap();
        handle.sync().unwrap();
        assert_eq!(handle.file_size().unwrap(), 6 + (300 << 10));

        let mut got = Vec::new();
        let mut r = fs.new_reader(handle).unwrap();
        r.seek(SeekFrom::Start(0)).unwrap();
        r.read_to_end(&mut got).unwrap();
        assert_eq!(got.len(), 6 + (300 << 10));
        assert_eq!(&got[..9], b"\xff\xff\xffabcdef");
        assert!(
            got[9..].iter().all(|&b| b == 0),
            "allocated bytes are zeros"
        );
    }

    /// A file on a disk with `room` bytes: writes past it fail like `ENOSPC`.
    struct Tight {
        data: Vec<u8>,
        pos: usize,
        room: usize,
    }

    impl Write for Tight {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            let n = buf.len().min(self.room.saturating_sub(self.pos));
            if n == 0 && !buf.is_empty() {
                return Err(std::io::Error::from_raw_os_error(28));
            }
            let end = self.pos + n;
            if self.data.len() < end {
                self.data.resize(end, 0);
            }
            self.data[self.pos..end].copy_from_slice(&buf[..n]);
            self.pos = end;
            Ok(n)
        }

        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    impl Seek for Tight {
        fn seek(&mut self, pos: SeekFrom) -> std::io::Result<u64> {
            match pos {
                SeekFrom::Start(p) => self.pos = p as usize,
                SeekFrom::Current(d) => self.pos = self.pos.saturating_add_signed(d as isize),
                SeekFrom::End(d) => self.pos = self.data.len().saturating_add_signed(d as isize),
            }
            Ok(self.pos as u64)
        }
    }

    impl WriteExt for Tight {
        fn truncate(&mut self, offset: usize) -> std::io::Result<()> {
            self.data.truncate(offset);
            Ok(())
        }

        fn allocate(&mut self, _offset: usize, _size: usize) -> std::io::Result<()> {
            unreachable!("ZeroFilling allocates by writing")
        }
    }

    /// On a full disk the allocation fails and gives back what its zeros took, so the entries
    /// written next still fit; the write position is where it was.
    #[test]
    fn a_failed_allocation_leaves_the_room_it_found() {
        let tight = Tight {
            data: b"header".to_vec(),
            pos: 6,
            room: 100 << 10,
        };
        let mut w = ZeroFilling(tight);
        let e = w.allocate(6, 2 << 20).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(28));
        assert_eq!(w.0.data, b"header");
        assert_eq!(w.stream_position().unwrap(), 6);
        w.write_all(&[7u8; 90 << 10]).unwrap();
        assert_eq!(w.0.data.len(), 6 + (90 << 10));
    }
}
