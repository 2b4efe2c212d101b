//! The write path: appends, overwrites in place and block repairs. Every block a write touches gets
//! its new CRC before any IO (a block overwritten in part is patched from the bytes it replaces, or
//! re-read and verified first), then the data is written, then the block records, and only then
//! does memory change. A failed write marks the blocks it touched unchecked: the old CRCs no longer
//! vouch for bytes that may have landed in part.

use std::time::Instant;

use nacre_types::{ExtentId, crc32c, crc32c_append};

use super::cache::{Files, Open};
use super::format::{RECORD, Record, record_at};
use super::{Block, Extent, ExtentStore, Kind, State, StoreError, crc, kind, lock, read, write};

/// Appends of at least this many bytes to a normal extent are written with
/// [`DiskFile::write_direct_at`].
///
/// [`DiskFile::write_direct_at`]: crate::io::DiskFile::write_direct_at
const DIRECT_FROM: usize = 32 << 10;

/// A gap (tiny extents) up to this size is written as zeros with the data, in one write.
const INLINE_GAP: u64 = 64 * 1024;

impl ExtentStore {
    /// Writes `data` at `offset`. Normal extents: `offset <= len` (appending or overwriting in place;
    /// past the end is `OutOfRange`). Tiny extents also accept any `offset >= len` (the gap reads as
    /// zeros). Extends the length when it writes past it and updates the block CRCs; a partially
    /// overwritten block gets its CRC patched from the bytes the write replaces if this process
    /// computed that CRC ([`Block::checked`]), else it is re-read and must verify first (else
    /// `Corrupt`, nothing written). Not durable until [`ExtentStore::sync`].
    pub fn write(&self, id: ExtentId, offset: u64, data: &[u8]) -> Result<(), StoreError> {
        self.write_hinted(id, offset, data, false)
    }

    /// Writes like [`ExtentStore::write`], except that an append of at least 32 KiB to a normal
    /// extent goes to the disk without passing through the OS's page cache
    /// ([`DiskFile::write_direct_at`]) where the disk can. The bytes are no more durable before
    /// [`ExtentStore::sync`] than `write`'s, but their copy into the cache, its write-back and its
    /// dropping after the sync (`drop_synced`) are spared: less CPU per byte for a node with many
    /// streams to append. A stream whose writes wait for each other (one extent's appends are
    /// written in order) may go slower, since each write then waits for the device.
    ///
    /// [`DiskFile::write_direct_at`]: crate::io::DiskFile::write_direct_at
    pub fn write_uncached(&self, id: ExtentId, offset: u64, data: &[u8]) -> Result<(), StoreError> {
        self.write_hinted(id, offset, data, true)
    }

    fn write_hinted(
        &self,
        id: ExtentId,
        offset: u64,
        data: &[u8],
        direct: bool,
    ) -> Result<(), StoreError> {
        let _gate = self.enter()?;
        self.changing(|| {
            let ext = self.writable(id)?;
            let mut st = write(&ext.state);
            if st.deleted {
                return Err(StoreError::NotFound(id));
            }
            if offset > st.len && !Self::is_tiny(id) {
                return Err(StoreError::OutOfRange {
                    extent: id,
                    offset,
                    len: data.len() as u64,
                    extent_len: st.len,
                });
            }
            let f = self.files_to_change(id, &mut st)?;
            self.write_locked(&ext, &f, &mut st, offset, data, direct)
                .map_err(|e| match e {
                    StoreError::Io(io) if io.kind() == std::io::ErrorKind::StorageFull => {
                        StoreError::NoSpace
                    }
                    e => e,
                })?;
            drop(st);
            self.mark_dirty(&ext);
            Ok(())
        })
    }

    /// A hint that `[offset, offset + len)` of extent `id` will soon be overwritten: starts reading
    /// the blocks the write covers only in part (their CRCs need their other bytes) into the page
    /// cache without waiting (only the bytes the write replaces, where it will patch the block's
    /// CRC from them), so the write finds them there (`StoreOptions::drop_synced` dropped
    /// them once they were synced). Every replica's state machine calls it as an overwrite reaches
    /// its Raft log (`DataSm::prefetch`), which hides the read behind the log's fsync. Never fails:
    /// a hint that cannot be given is skipped.
    pub fn prefetch(&self, id: ExtentId, offset: u64, len: u64) {
        let Ok(_gate) = self.enter() else { return };
        let Ok(Some(ext)) = self.find(id) else { return };
        let bs = self.bs;
        let (ranges, f) = {
            let st = read(&ext.state);
            let end = offset.saturating_add(len).min(st.len);
            if st.deleted || offset >= end {
                return;
            }
            let (first, last) = (offset / bs, (end - 1) / bs);
            // What the write will read of a block it covers in part: the bytes it replaces, if it
            // can patch the block's CRC from them, else the whole block.
            let needed = |b: u64| {
                let (start, blen) = (b * bs, (st.len - b * bs).min(bs));
                if offset <= start && end >= start + blen {
                    return None;
                }
                let blk = st.blocks.get(b as usize)?;
                let stop = offset.saturating_add(len).min(start + bs);
                Some(if blk.checked && !blk.bad && stop <= start + blen {
                    let from = offset.max(start);
                    (from, end.min(start + blen) - from)
                } else {
                    (start, blen)
                })
            };
            let mut ranges = Vec::with_capacity(2);
            ranges.extend(needed(first));
            if last != first {
                ranges.extend(needed(last));
            }
            if ranges.is_empty() {
                return;
            }
            // Under the state lock, as `files` asks: a delete cannot slip in between.
            let Ok(f) = self.files(id, Open::Existing) else {
                return;
            };
            (ranges, f)
        };
        for (start, blen) in ranges {
            let _ = f.data.will_need(start, blen);
        }
    }

    /// Replaces block `index` wholesale with `data` (a healthy replica's copy: `block_size` bytes, or
    /// fewer for the last block), creating the extent if missing and recomputing the CRC. The block
    /// may be the next one past the end (the extent grows), or for a tiny extent any block past it.
    /// A shorter last block shrinks the extent (durably, as [`ExtentStore::truncate`]). Never reads
    /// the old bytes, so it fixes a corrupt block. Not durable until [`ExtentStore::sync`].
    pub fn repair_block(&self, id: ExtentId, index: u64, data: &[u8]) -> Result<(), StoreError> {
        let _gate = self.enter()?;
        self.changing(|| {
            let k = kind(id)?;
            let bs = self.bs;
            if data.is_empty() || data.len() as u64 > bs {
                return Err(StoreError::Invalid(format!(
                    "{id}: a repaired block has 1..={bs} bytes, not {}",
                    data.len()
                )));
            }
            let start = index
                .checked_mul(bs)
                .filter(|s| s + bs <= self.max_len)
                .ok_or_else(|| StoreError::Invalid(format!("{id}: block {index} is too far")))?;
            let ext = self.register(id);
            let mut st = write(&ext.state);
            if st.deleted {
                return Err(StoreError::NotFound(id));
            }
            if k == Kind::Normal && start > st.len {
                return Err(StoreError::OutOfRange {
                    extent: id,
                    offset: start,
                    len: data.len() as u64,
                    extent_len: st.len,
                });
            }
            let end = start + data.len() as u64;
            if st.len > start + bs && data.len() as u64 != bs {
                return Err(StoreError::Invalid(format!(
                    "{id}: block {index} is not the last one and needs {bs} bytes, not {}",
                    data.len()
                )));
            }
            let f = self.files_to_change(id, &mut st)?;
            if start < st.len && end < st.len && st.len <= start + bs {
                // The last block, shorter on the healthy replica.
                self.truncate_locked(&f, &mut st, end)?;
            }
            self.write_locked(&ext, &f, &mut st, start, data, false)?;
            drop(st);
            self.mark_dirty(&ext);
            Ok(())
        })
    }

    /// The CRC of a checked block after `piece` replaces its bytes at `at`, from the bytes it
    /// replaces ([`crc::patch`]); `None` when that is not known to be right and the whole block must
    /// be read and verified: the block is not [`Block::checked`] (or bad), the write runs past the
    /// block's end `end`, or the file is shorter than the block.
    fn patched_crc(
        &self,
        f: &Files,
        old: Block,
        at: u64,
        piece: &[u8],
        end: u64,
    ) -> Result<Option<u32>, StoreError> {
        let stop = at + piece.len() as u64;
        if !old.checked || old.bad || stop > end {
            return Ok(None);
        }
        let mut was = vec![0u8; piece.len()];
        if f.data.read_at(&mut was, at)? < was.len() {
            return Ok(None);
        }
        Ok(Some(crc::patch(old.crc, &was, piece, end - stop)))
    }

    /// The write path: computes the new CRC of every block the write changes (re-reading a block it
    /// overwrites only in part), writes the data, then the records, then updates memory.
    /// `direct`: see [`ExtentStore::write_uncached`].
    fn write_locked(
        &self,
        ext: &Extent,
        f: &Files,
        st: &mut State,
        offset: u64,
        data: &[u8],
        direct: bool,
    ) -> Result<(), StoreError> {
        if data.is_empty() {
            return Ok(());
        }
        let bs = self.bs;
        let end = offset
            .checked_add(data.len() as u64)
            .filter(|&e| e <= self.max_len)
            .ok_or_else(|| {
                StoreError::Invalid(format!(
                    "{}: a write may not end past {} bytes",
                    ext.id, self.max_len
                ))
            })?;
        let old_len = st.len;
        let new_len = old_len.max(end);
        // A gap (tiny extents) changes blocks from the old end on.
        let first = offset.min(old_len) / bs;
        let last = (end - 1) / bs;
        let mut blocks = Vec::with_capacity((last - first + 1) as usize);
        let mut records = Vec::with_capacity(blocks.capacity() * RECORD as usize);
        for b in first..=last {
            let start = b * bs;
            let new_blen = (new_len - start).min(bs);
            let old_blen = old_len.saturating_sub(start).min(bs);
            // The part of the write inside this block.
            let (ws, we) = (offset.max(start), end.min(start + new_blen));
            let piece: &[u8] = if ws < we {
                &data[(ws - offset) as usize..(we - offset) as usize]
            } else {
                &[]
            };
            let block = if old_blen == 0 {
                // A new block: zeros (a gap) up to the piece, which runs to the block's end.
                let zeros = new_blen - piece.len() as u64;
                if zeros == bs {
                    Block::good(self.zero_block_crc)
                } else {
                    Block::good(crc32c_append(crc::zeros(0, zeros), piece))
                }
            } else if ws == start && we == start + new_blen {
                Block::good(crc32c(piece))
            } else {
                let old = st.blocks[b as usize];
                if ws >= start + old_blen {
                    // Appending to the last block, maybe after a gap: extend its CRC, no read. A bad
                    // block stays bad.
                    let gap = new_blen - old_blen - piece.len() as u64;
                    Block {
                        crc: crc32c_append(crc::zeros(old.crc, gap), piece),
                        ..old
                    }
                } else if let Some(crc) = self.patched_crc(f, old, ws, piece, start + old_blen)? {
                    Block::good(crc)
                } else {
                    let mut buf = vec![0u8; new_blen as usize];
                    let verified = self.read_block(f, &mut buf[..old_blen as usize], start, old)?;
                    buf[(ws - start) as usize..(we - start) as usize].copy_from_slice(piece);
                    let crc = crc32c(&buf);
                    // Never bless bytes that failed their CRC, unless this write makes the block
                    // match its record: the replay of a write that a crash tore.
                    if !verified && crc != old.crc {
                        return Err(self.corrupt(ext.id, b));
                    }
                    Block::good(crc)
                }
            };
            let rec = Record::new(new_blen as u32, block.crc, st.hdr.seq);
            records.extend_from_slice(&rec.encode());
            blocks.push(block);
        }

        let direct = direct && data.len() >= DIRECT_FROM && !Self::is_tiny(ext.id);
        let mut went_direct = false;
        let mut io = || -> Result<(), StoreError> {
            if offset > old_len {
                let gap = offset - old_len;
                if gap <= INLINE_GAP {
                    let mut buf = Vec::with_capacity(gap as usize + data.len());
                    buf.resize(gap as usize, 0);
                    buf.extend_from_slice(data);
                    f.data.write_at(&buf, old_len)?;
                } else {
                    // Cut whatever lies past the end, so the gap is a hole of zeros.
                    f.data.set_len(old_len)?;
                    f.data.write_at(data, offset)?;
                }
            } else if offset == old_len && direct {
                went_direct = f.data.write_direct_at(data, offset)?;
            } else {
                f.data.write_at(data, offset)?;
            }
            f.crc.write_at(&records, record_at(first))?;
            Ok(())
        };
        if let Err(e) = io() {
            // Part of the bytes may have landed (a transient error such as ENOSPC leaves the store
            // running): the old CRCs no longer vouch for them, so later overwrites verify the blocks.
            for blk in st.blocks.iter_mut().skip(first as usize).take(blocks.len()) {
                blk.checked = false;
            }
            return Err(e);
        }

        for (i, block) in blocks.into_iter().enumerate() {
            let b = first as usize + i;
            if b < st.blocks.len() {
                st.blocks[b] = block;
            } else {
                st.blocks.push(block);
            }
        }
        st.len = new_len;
        if st.file_len > new_len {
            st.grown = Instant::now();
        } else {
            if st.file_len > old_len {
                // Grown over the whole recycled file: no tail left to cut.
                lock(&self.trash).tails.remove(&ext.id);
            }
            st.file_len = new_len;
        }
        if went_direct {
            // Nothing of the append is in the page cache: no write-back to start for it, nothing
            // to drop after the round's sync (unless cached bytes before it still wait for both).
            if st.kicked == old_len {
                st.kicked = new_len;
            }
            if st.uncached == old_len {
                st.uncached = new_len;
            }
        }
        self.start_writeback(ext.id, f, st, offset >= old_len);
        Ok(())
    }

    /// After a write: once `writeback_after` bytes were appended to a normal extent since the last
    /// kick, starts their write-back. Tiny extents are synced right after each write anyway, and
    /// in-place writes are few and small. A failed hint is ignored (the round's fsync reports
    /// write-back errors).
    fn start_writeback(&self, id: ExtentId, f: &Files, st: &mut State, appended: bool) {
        let every = u64::from(self.opts.writeback_after);
        if every == 0 || !self.opts.sync || !appended || Self::is_tiny(id) {
            return;
        }
        // A truncate may have cut below the mark.
        let from = st.kicked.min(st.len);
        if st.len - from >= every {
            let _ = f.data.start_writeback(from, st.len - from);
            st.kicked = st.len;
        } else {
            st.kicked = from;
        }
    }
}
