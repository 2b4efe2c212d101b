//! Commit headers and the group commit (docs/data-store.md, "Commit protocol"). A caller of `sync`
//! waits for a round that started after its call; whoever finds no round running runs the next for
//! everybody: a header for each dirty extent's length, then fsyncs (per file, or one `syncfs` for a
//! large round), then the directory. Header slots alternate, and a slot is written again only after
//! an fsync confirmed the other (`header_durable`). The `commit` mutex is never held across IO.

use std::sync::atomic::Ordering;
use std::sync::{Arc, PoisonError};

use super::cache::{self, Files, Open};
use super::format::{Header, SLOT};
use super::{Extent, ExtentStore, State, StoreError, SyncStats, lock, write};

/// Page granularity of [`StoreOptions::drop_synced`]: the page holding the previous mark is asked
/// again (it may have been partial then; the OS keeps pages only partly inside a range).
///
/// [`StoreOptions::drop_synced`]: super::StoreOptions::drop_synced
const DROP_ALIGN: u64 = 4096;

#[derive(Debug, Default)]
pub(super) struct Commit {
    /// Rounds started; rounds are serialized, so a round `r` starts only after `r - 1` finished.
    started: u64,
    finished: u64,
    /// The last round that succeeded. A round that fails transiently (out of descriptors) puts what
    /// it did not sync back into the dirty set, so every write before round `r` started is durable
    /// once `last_ok >= r`.
    last_ok: u64,
    running: bool,
    calls: u64,
}

impl ExtentStore {
    /// Makes every write before this call durable: data, CRC records, created and removed files.
    ///
    /// Group commit: a caller waits for a round that started after its call; whoever finds no round
    /// running runs the next one for everybody, fsyncing every file written since the previous round
    /// began. After an IO error in a round (or in any change) the store returns `Failed` for
    /// everything until reopened.
    pub fn sync(&self) -> Result<(), StoreError> {
        let _gate = self.enter()?;
        self.sync_entered()
    }

    /// [`ExtentStore::sync`] for writes made at `epoch` ([`ExtentStore::epoch`], taken before
    /// them): fails with `Failed` if the store was reopened since, since that may have lost them.
    pub fn sync_since(&self, epoch: u64) -> Result<(), StoreError> {
        let _gate = self.enter()?;
        // Under the gate: no reopen can come between this check and the round.
        if self.epoch() != epoch {
            return Err(StoreError::Failed);
        }
        self.sync_entered()
    }

    /// The group commit of [`ExtentStore::sync`], under the gate.
    fn sync_entered(&self) -> Result<(), StoreError> {
        if !self.opts.sync {
            return Ok(());
        }
        let mut c = lock(&self.commit);
        c.calls += 1;
        // The running round (if any) may have taken the dirty set before our writes: wait for the next.
        let target = c.started + 1;
        loop {
            self.check()?;
            if c.last_ok >= target {
                return Ok(());
            }
            if c.finished >= target {
                // Every round since our call ran out of descriptors (the only transient error a
                // round has); our writes wait in the dirty set for a later one.
                return Err(StoreError::TooManyOpenFiles);
            }
            if c.running {
                c = self
                    .round_done
                    .wait(c)
                    .unwrap_or_else(PoisonError::into_inner);
                continue;
            }
            c.running = true;
            c.started += 1;
            let round = c.started;
            drop(c);
            let result = self.round();
            c = lock(&self.commit);
            c.running = false;
            c.finished = round;
            match result {
                Ok(()) => c.last_ok = round,
                Err(e) if e.is_transient() => {}
                Err(e) => {
                    self.fail(&e);
                    self.round_done.notify_all();
                    return Err(e);
                }
            }
            self.round_done.notify_all();
        }
    }

    /// Group commit counters.
    pub fn sync_stats(&self) -> SyncStats {
        let c = lock(&self.commit);
        SyncStats {
            calls: c.calls,
            rounds: c.finished,
        }
    }

    /// Writes a commit header for length `len` into the cursor's slot; returns its generation.
    pub(super) fn write_header(
        &self,
        f: &Files,
        st: &mut State,
        len: u64,
        tail_crc: u32,
    ) -> Result<u64, StoreError> {
        let h = Header {
            block_size: self.opts.block_size,
            tail_crc,
            seq: st.hdr.seq,
            len,
        };
        st.hdr.seq = st.hdr.seq.saturating_add(1);
        st.hdr.generation += 1;
        st.hdr.lens[st.hdr.slot as usize] = len;
        f.crc.write_at(&h.encode(), st.hdr.slot * SLOT)?;
        Ok(st.hdr.generation)
    }

    /// An fsync that started after header `generation` was written completed: if no header was written
    /// since, that slot now holds the durable header and the next one goes to the other slot.
    pub(super) fn header_durable(st: &mut State, generation: u64) {
        if st.hdr.generation == generation {
            st.hdr.slot = 1 - st.hdr.slot;
        }
    }

    /// One group-commit round: for every extent written since the last round, a commit header for
    /// its current length, then fsync of its data and crc files (reopening them if the cache closed
    /// them since the write: an fsync through any descriptor flushes the file); then the directory if
    /// files came or went. An IO error fails the store (what reached the disk is unknown). Running
    /// out of descriptors does not: nothing was written for the extents not synced yet, so they go
    /// back into the dirty set (with the directory) for the next round.
    fn round(&self) -> Result<(), StoreError> {
        let extents = {
            let mut d = lock(&self.dirty);
            for e in d.extents.values() {
                e.dirty.store(false, Ordering::SeqCst);
            }
            std::mem::take(&mut d.extents)
        };
        let extents: Vec<Arc<Extent>> = extents.into_values().collect();
        let mut again = Vec::new();
        let mut done = 0;
        let result = self.sync_extents(&extents, &mut done, &mut again);
        // Taken after the extents: the files this round made for extents registered without them
        // are in the directory it syncs (so is whatever came or went since the round began).
        let dir = std::mem::take(&mut lock(&self.dirty).dir);
        let result = result.and_then(|()| {
            if dir {
                self.disk.sync_dir().map_err(cache::open_error)?;
            }
            Ok(())
        });
        if result.is_err() {
            // Only a transient error leaves the store working; put back what this round did not
            // finish (harmless after other errors: the store refuses work anyway).
            if dir {
                lock(&self.dirty).dir = true;
            }
            again.extend(extents[done..].iter().cloned());
        }
        for ext in &again {
            self.mark_dirty(ext);
        }
        result
    }

    /// The extents' part of a round; `done` counts the extents finished (synced or skipped). A
    /// round of at least [`StoreOptions::sync_fs_from`] extents writes every header, then syncs the
    /// whole file system once ([`Disk::sync_fs`]), falling back to the files one by one if it
    /// cannot; a smaller round syncs each extent's data and crc files in turn. An extent's files are
    /// held only while it is being prepared or synced, so rounds keep the open-file bound.
    ///
    /// [`StoreOptions::sync_fs_from`]: super::StoreOptions::sync_fs_from
    /// [`Disk::sync_fs`]: crate::io::Disk::sync_fs
    fn sync_extents(
        &self,
        extents: &[Arc<Extent>],
        done: &mut usize,
        again: &mut Vec<Arc<Extent>>,
    ) -> Result<(), StoreError> {
        let whole = self.opts.sync_fs_from > 0 && extents.len() >= self.opts.sync_fs_from as usize;
        if !whole {
            for ext in extents {
                let p = self.prepare_sync(ext)?;
                // From here on the extent is not put back if the round fails: only an IO error can
                // follow, and that fails the store.
                *done += 1;
                if let Some(p) = p {
                    sync_files(&p.files)?;
                    self.synced(ext, p, again);
                }
            }
            return Ok(());
        }
        let mut ready = Vec::with_capacity(extents.len());
        let mut prepared = Ok(());
        for ext in extents {
            match self.prepare_sync(ext) {
                Ok(Some(p)) => {
                    // Closing them before the sync below is fine: it covers closed files too.
                    p.files.syncing();
                    ready.push((ext, p.generation, p.synced));
                }
                Ok(None) => {}
                Err(e) => {
                    // The ones prepared before still get synced; the rest go back (`done`).
                    prepared = Err(e);
                    break;
                }
            }
            *done += 1;
        }
        // A failed `syncfs` falls back to the files' own fsyncs: they report any write-back error
        // of these files, and one of another file on the file system does not fail this store.
        let all = !ready.is_empty() && matches!(self.disk.sync_fs(), Ok(true));
        let mut ready = ready.into_iter();
        while let Some((ext, generation, synced)) = ready.next() {
            let files = if all {
                // Dropping pages needs the files; only if still open.
                self.cache.cached(ext.id)
            } else {
                // Reopened if the cache closed them: an fsync through any descriptor flushes.
                let f = match self.files(ext.id, Open::Existing) {
                    Ok(f) => f,
                    Err(e) => {
                        // Out of descriptors: these wait for the next round.
                        again.push(ext.clone());
                        again.extend(ready.map(|(ext, _, _)| ext.clone()));
                        return Err(e);
                    }
                };
                sync_files(&f)?;
                Some(f)
            };
            match files {
                Some(files) => self.synced(
                    ext,
                    Prepared {
                        files,
                        generation,
                        synced,
                    },
                    again,
                ),
                None => self.header_synced(ext, generation, again),
            }
        }
        prepared
    }

    /// After an extent's files were synced: drops the synced pages (`drop_synced`), lets go of the
    /// files, marks the header durable.
    fn synced(&self, ext: &Arc<Extent>, p: Prepared, again: &mut Vec<Arc<Extent>>) {
        if self.opts.drop_synced && !Self::is_tiny(ext.id) {
            // Best effort: failing to drop costs memory, not data. Tiny extents keep their pages:
            // small files are read back soon after they are written (`cp -r`, a checkout, a
            // build).
            let _ = p.files.data.drop_range(p.synced.0, p.synced.1);
        }
        drop(p.files);
        self.header_synced(ext, p.generation, again);
    }

    fn header_synced(&self, ext: &Arc<Extent>, generation: u64, again: &mut Vec<Arc<Extent>>) {
        let mut st = write(&ext.state);
        Self::header_durable(&mut st, generation);
        // Recovery reads every block between the two headers' lengths (the newer header's round
        // may not have completed). Writing the same length into the other slot next round bounds
        // that to the last block once the extent goes idle; an extent still being written gets a
        // new header every round anyway.
        if st.hdr.lens[0] != st.hdr.lens[1] {
            again.push(ext.clone());
        }
    }

    /// Writes the header of a round for `ext`'s current length; returns its files, the header's
    /// generation and the range the round makes durable past what earlier rounds dropped (from the
    /// page holding the old mark: that page may have been partial then). `None`: deleted.
    fn prepare_sync(&self, ext: &Extent) -> Result<Option<Prepared>, StoreError> {
        let mut st = write(&ext.state);
        if st.deleted {
            return Ok(None);
        }
        let f = self.born_files(ext.id, &mut st)?;
        let len = st.len;
        let tail_crc = match (len % self.bs, st.blocks.last()) {
            (0, _) | (_, None) => 0,
            (_, Some(b)) => b.crc,
        };
        let generation = self.write_header(&f, &mut st, len, tail_crc)?;
        let from = st.uncached.min(len) / DROP_ALIGN * DROP_ALIGN;
        st.uncached = len;
        Ok(Some(Prepared {
            files: f,
            generation,
            synced: (from, len - from),
        }))
    }
}

/// An extent's data and crc files, fsynced (marked synced first, so closing them after needs none).
fn sync_files(f: &Files) -> std::io::Result<()> {
    f.syncing();
    f.data.sync_data()?;
    f.crc.sync_data()
}

/// An extent a round wrote a header for ([`ExtentStore::prepare_sync`]).
struct Prepared {
    files: Arc<Files>,
    generation: u64,
    /// `(offset, len)` of what the round makes durable past what earlier rounds dropped.
    synced: (u64, u64),
}
