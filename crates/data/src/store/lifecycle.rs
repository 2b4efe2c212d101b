//! An extent's life: registered without files (`create`), born with its files on its first change
//! or the next round (in a deleted extent's recycled data file where there is a spare), deleted
//! (its files renamed out of the extent namespace: given to the spare pool or queued for removal),
//! and the slow parts kept off the hot path (`remove_deleted`, `cut_tails`). Invariant: a deleted
//! extent's files leave the namespace before its entry leaves the map, so a new extent of the same
//! id never gets them.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Instant;

use nacre_types::ExtentId;

use super::cache::{Changing, Files, Open};
use super::format::{crc_name, data_name, trash_name};
use super::spares::Spare;
use super::{Extent, ExtentStore, Kind, State, StoreError, kind, lock, write};
use crate::io::DiskFile;

impl ExtentStore {
    /// Creates an empty extent; idempotent (an existing extent is left unchanged). Only registers
    /// it: its files are made by its first write, or by the next [`ExtentStore::sync`] round if that
    /// comes first, so a create costs no file-system work where it is called (a data partition's
    /// Raft apply, on a messenger worker). Durable after the next [`ExtentStore::sync`].
    pub fn create(&self, id: ExtentId) -> Result<(), StoreError> {
        let _gate = self.enter()?;
        self.changing(|| {
            kind(id)?;
            self.register(id);
            Ok(())
        })
    }

    /// Deletes a normal extent (removes its files); idempotent. Durable after the next sync.
    pub fn delete(&self, id: ExtentId) -> Result<(), StoreError> {
        let _gate = self.enter()?;
        self.changing(|| {
            if kind(id)? == Kind::Tiny {
                return Err(StoreError::Invalid(format!(
                    "{id} is a tiny extent: release its ranges with punch"
                )));
            }
            let Some(ext) = self.lookup(id) else {
                return Ok(());
            };
            let bytes = {
                let mut st = write(&ext.state);
                st.deleted = true;
                // Under the state lock: a call that reopens (or makes) files checks `deleted`
                // under it first.
                self.cache.forget(id);
                st.file_len.max(st.len)
            };
            lock(&self.dirty).dir = true;
            // Removing a large file is slow (its blocks are freed then: tens of ms for a full
            // extent under load), renaming it is not: the files are renamed out of the extent
            // namespace here (the caller is a Raft apply, on a messenger worker that serves every
            // partition's packets) and removed later by `remove_deleted`. They go before the
            // entry: until it leaves the map, a call that registers the id finds the deleted
            // extent, so it cannot make files that these renames then take.
            let mut renamed = Vec::with_capacity(2);
            let mut result = Ok(());
            for name in [data_name(id), crc_name(id)] {
                let trash = trash_name(&name);
                match self.disk.rename(&name, &trash) {
                    Ok(()) => renamed.push(trash),
                    // An extent that never had files (created, never changed, no round since).
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                    Err(e) => {
                        result = Err(e);
                        break;
                    }
                }
            }
            write(&self.extents).remove(&id);
            let mut trash = lock(&self.trash);
            trash.tails.remove(&id);
            for name in renamed {
                if self.opts.recycle && bytes > 0 && name == trash_name(&data_name(id)) {
                    self.spares.give(Spare {
                        disk: self.disk.clone(),
                        name,
                        bytes,
                        since: Instant::now(),
                    });
                } else {
                    trash.remove.push(name);
                }
            }
            drop(trash);
            result?;
            Ok(())
        })
    }

    /// Removes the files of extents deleted since the last call (renamed by
    /// [`ExtentStore::delete`], or found at open): a file system frees a file's blocks when it is
    /// removed, which takes tens of milliseconds for a full extent under load, so `delete` leaves
    /// it to this call and the data service makes it on the blocking pool every tick. Returns how
    /// many files it removed. A failure keeps the rest for the next call and does not fail the
    /// store (no extent's state depends on these files); a crash before it loses nothing, since
    /// the next open finds the renamed files again.
    pub fn remove_deleted(&self) -> Result<usize, StoreError> {
        let names = std::mem::take(&mut lock(&self.trash).remove);
        for (i, name) in names.iter().enumerate() {
            if let Err(e) = self.disk.remove(name) {
                lock(&self.trash).remove.extend(names[i..].iter().cloned());
                return Err(StoreError::Io(e));
            }
        }
        Ok(names.len())
    }

    /// Files of deleted extents waiting for [`ExtentStore::remove_deleted`].
    pub fn deleted_files(&self) -> usize {
        lock(&self.trash).remove.len()
    }

    /// The spares of this store's pool ([`StoreOptions::recycle`]; a node's pool holds every
    /// store's): each one's bytes and when its extent was deleted, oldest first.
    ///
    /// [`StoreOptions::recycle`]: super::StoreOptions::recycle
    pub fn spares(&self) -> Vec<(u64, Instant)> {
        self.spares.list()
    }

    /// Retires the spares of this store's pool whose extents were deleted at or before `until`
    /// ([`SparePool::retire`]): those of this store go to [`ExtentStore::remove_deleted`], others
    /// are removed here. Returns their bytes. Keeping spares keeps their space taken: the pool's
    /// owner bounds it (the data service keeps at most `spare_bytes` per node, for at most
    /// `spare_keep`).
    ///
    /// [`SparePool::retire`]: super::SparePool::retire
    pub fn retire_spares(&self, until: Instant) -> u64 {
        let mut bytes = 0;
        for s in self.spares.retire(until) {
            bytes += s.bytes;
            if Arc::ptr_eq(&s.disk, &self.disk) {
                lock(&self.trash).remove.push(s.name);
            } else if let Err(e) = s.disk.remove(&s.name) {
                tracing::warn!(file = s.name, error = %e, "cannot remove a spare");
            }
        }
        bytes
    }

    /// New extents that took a spare's file since the store opened.
    pub fn recycled(&self) -> u64 {
        self.recycled.load(Ordering::Relaxed)
    }

    /// Extents living in a recycled file longer than they are ([`ExtentStore::cut_tails`]).
    pub fn tails(&self) -> usize {
        lock(&self.trash).tails.len()
    }

    /// Cuts the data file of every extent that lives in a recycled file longer than itself and has
    /// not grown since `idle_since` to the extent's length (freeing the old bytes, slow for a large
    /// file: call it off the hot path). Returns how many it cut. The cut changes nothing the store
    /// describes (no byte below the length), so it needs no fsync (a crash before it lands leaves
    /// the old bytes, which recovery cuts) and a failure does not fail the store: the extent keeps
    /// its tail for the next call.
    pub fn cut_tails(&self, idle_since: Instant) -> Result<usize, StoreError> {
        let _gate = self.enter()?;
        let ids: Vec<ExtentId> = lock(&self.trash).tails.iter().copied().collect();
        let mut cut = 0;
        for id in ids {
            let Some(ext) = self.lookup(id) else {
                lock(&self.trash).tails.remove(&id);
                continue;
            };
            let mut st = write(&ext.state);
            if st.deleted || st.file_len <= st.len {
                lock(&self.trash).tails.remove(&id);
                continue;
            }
            if st.grown > idle_since {
                continue;
            }
            let f = self.files(id, Open::Existing)?;
            f.data.set_len(st.len)?;
            st.file_len = st.len;
            lock(&self.trash).tails.remove(&id);
            cut += 1;
        }
        Ok(cut)
    }

    /// Registers an empty extent without making its files ([`ExtentStore::create`]): they are made
    /// by the first call that changes it, or by the next sync round, whichever comes first
    /// ([`ExtentStore::files_to_change`]). Returns the extent already registered, if any.
    pub(super) fn register(&self, id: ExtentId) -> Arc<Extent> {
        let mut all = write(&self.extents);
        if let Some(e) = all.get(&id) {
            return e.clone();
        }
        let ext = Arc::new(Extent::new(id, State::unborn()));
        all.insert(id, ext.clone());
        drop(all);
        // The round that takes it makes its files (if no write did before) and syncs the directory.
        self.mark_dirty(&ext);
        ext
    }

    /// The files of `id`, whose state `st` is (write-locked by the caller, not deleted): opened if
    /// the cache closed them, made first if the extent has none yet. Making them empties leftovers
    /// of a delete whose rename failed, so they cannot show through, and has the next round sync
    /// the directory.
    pub(super) fn born_files(
        &self,
        id: ExtentId,
        st: &mut State,
    ) -> Result<Arc<Files>, StoreError> {
        if st.born {
            return self.files(id, Open::Existing);
        }
        let recycled = self.recycle(id);
        let files = self.files(id, Open::Create)?;
        // The crc file always starts empty: no record may vouch for a recycled file's old bytes.
        let fresh: &[&Arc<dyn DiskFile>] = if recycled.is_some() {
            &[&files.crc]
        } else {
            &[&files.data, &files.crc]
        };
        for f in fresh {
            if f.len()? != 0 {
                f.set_len(0)?;
                files.changed();
            }
        }
        st.born = true;
        if let Some(bytes) = recycled {
            st.file_len = bytes;
            st.grown = Instant::now();
            lock(&self.trash).tails.insert(id);
        }
        lock(&self.dirty).dir = true;
        Ok(files)
    }

    /// Makes the newest spare this store can take ([`SparePool`]) the data file of normal extent
    /// `id` (renamed, or moved from another store's directory; [`StoreOptions::recycle`]); returns
    /// its bytes. `None` if there was none, or the move failed: a spare of this store then goes to
    /// removal, another store's back to the pool (its own store can still rename it).
    ///
    /// [`SparePool`]: super::SparePool
    /// [`StoreOptions::recycle`]: super::StoreOptions::recycle
    fn recycle(&self, id: ExtentId) -> Option<u64> {
        if !self.opts.recycle || Self::is_tiny(id) {
            return None;
        }
        let spare = self.spares.take_for(&self.disk)?;
        let own = Arc::ptr_eq(&spare.disk, &self.disk);
        let moved = match spare.disk.location() {
            _ if own => self.disk.rename(&spare.name, &data_name(id)),
            Some(from) => self.disk.adopt(from, &spare.name, &data_name(id)),
            None => Err(std::io::Error::new(
                std::io::ErrorKind::Unsupported,
                "the spare's disk has no location",
            )),
        };
        match moved {
            Ok(()) => {
                self.recycled.fetch_add(1, Ordering::Relaxed);
                Some(spare.bytes)
            }
            // Removed meanwhile (its store reopened).
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
            Err(e) => {
                tracing::warn!(file = spare.name, error = %e, "cannot recycle a deleted extent's file");
                if own {
                    lock(&self.trash).remove.push(spare.name);
                } else {
                    // Another directory (on another file system, say): it stays its store's.
                    self.spares.give(spare);
                }
                None
            }
        }
    }

    /// [`ExtentStore::born_files`] for a change: marked changed when the returned guard drops.
    pub(super) fn files_to_change(
        &self,
        id: ExtentId,
        st: &mut State,
    ) -> Result<Changing, StoreError> {
        self.born_files(id, st).map(Changing)
    }
}
