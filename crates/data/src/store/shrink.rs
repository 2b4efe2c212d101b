//! The changes that drop bytes, durable when they return: `truncate` (shrinks an extent) and
//! `punch` (zeroes a range of a tiny extent and frees its space). Both fsync under the extent's
//! lock, in an order that leaves every block verifiable after a crash at any point (see each).

use nacre_types::{ExtentId, crc32c};

use super::cache::Files;
use super::format::{RECORD, Record, record_at};
use super::{Block, ExtentStore, State, StoreError, kind, write};

impl ExtentStore {
    /// Shrinks an extent to `len` (drops an unacknowledged tail); `len` past the end is `Invalid`.
    /// Durable when it returns (it fsyncs: a crash must not bring the dropped bytes back).
    pub fn truncate(&self, id: ExtentId, len: u64) -> Result<(), StoreError> {
        let _gate = self.enter()?;
        self.changing(|| {
            let Some(ext) = self.find(id)? else {
                return if len == 0 {
                    Ok(())
                } else {
                    Err(StoreError::Invalid(format!(
                        "{id}: cannot truncate an empty extent to {len}"
                    )))
                };
            };
            let mut st = write(&ext.state);
            if st.deleted {
                return Err(StoreError::NotFound(id));
            }
            if len > st.len {
                return Err(StoreError::Invalid(format!(
                    "{id}: cannot truncate to {len}, past its length {}",
                    st.len
                )));
            }
            if len < st.len {
                let f = self.files_to_change(id, &mut st)?;
                self.truncate_locked(&f, &mut st, len)?;
            }
            drop(st);
            self.mark_dirty(&ext);
            Ok(())
        })
    }

    /// Punches `[offset, offset + len)` out of a tiny extent: the range reads as zeros, its space is
    /// freed (whole file-system blocks), the size does not change. Recomputes the CRCs of the blocks it
    /// touches; a block it covers only in part must verify first (else `Corrupt`, nothing changed).
    ///
    /// Durable when it returns. The new block records keep the old CRC as an alternative and are
    /// fsynced (with a commit header) before the data changes, then the data is fsynced: a crash at
    /// any point leaves every block verifiable, punched or not (unless it tears a 32-byte record
    /// write, which a disk with atomic sector writes never does).
    pub fn punch(&self, id: ExtentId, offset: u64, len: u64) -> Result<(), StoreError> {
        let _gate = self.enter()?;
        self.changing(|| {
            kind(id)?;
            let out_of_range = |extent_len| StoreError::OutOfRange {
                extent: id,
                offset,
                len,
                extent_len,
            };
            let end = offset.checked_add(len).ok_or_else(|| out_of_range(0))?;
            let Some(ext) = self.find(id)? else {
                return if end == 0 {
                    Ok(())
                } else {
                    Err(out_of_range(0))
                };
            };
            let mut st = write(&ext.state);
            if st.deleted {
                return Err(StoreError::NotFound(id));
            }
            if end > st.len {
                return Err(out_of_range(st.len));
            }
            if len == 0 {
                return Ok(());
            }
            let f = self.files_to_change(id, &mut st)?;
            let bs = self.bs;
            let first = offset / bs;
            let last = (end - 1) / bs;
            let mut blocks = Vec::with_capacity((last - first + 1) as usize);
            let mut records = Vec::with_capacity(blocks.capacity() * RECORD as usize);
            for b in first..=last {
                let start = b * bs;
                let blen = (st.len - start).min(bs);
                let (ps, pe) = (offset.max(start), end.min(start + blen));
                let old = st.blocks[b as usize];
                let (crc, alt) = if ps == start && pe == start + blen {
                    (self.zeros_crc(blen), (!old.bad).then_some(old.crc))
                } else {
                    let mut buf = vec![0u8; blen as usize];
                    let verified = self.read_block(&f, &mut buf, start, old)?;
                    buf[(ps - start) as usize..(pe - start) as usize].fill(0);
                    let crc = crc32c(&buf);
                    // An unverified block is accepted only if punching makes it match its CRC.
                    if !verified && crc != old.crc {
                        return Err(self.corrupt(id, b));
                    }
                    (crc, verified.then_some(old.crc))
                };
                let rec = Record {
                    len: blen as u32,
                    crc,
                    alt,
                    epoch: st.hdr.seq,
                };
                records.extend_from_slice(&rec.encode());
                blocks.push((Block::good(crc), alt.is_some(), blen));
            }
            let tail_crc = match (st.len % bs, blocks.last()) {
                (0, _) => 0,
                (_, Some((blk, _, _))) if last + 1 == st.blocks.len() as u64 => blk.crc,
                _ => st.blocks.last().map_or(0, |b| b.crc),
            };
            f.crc.write_at(&records, record_at(first))?;
            let len_now = st.len;
            let generation = self.write_header(&f, &mut st, len_now, tail_crc)?;
            self.fsync_file(&*f.crc)?;
            f.data.punch_hole(offset, len)?;
            self.fsync_file(&*f.data)?;
            if self.opts.sync {
                Self::header_durable(&mut st, generation);
            }
            for (i, &(block, alt, blen)) in blocks.iter().enumerate() {
                let b = first + i as u64;
                st.blocks[b as usize] = block;
                if alt {
                    // The punch is durable: drop the alternative (unsynced, best effort; a record
                    // that keeps it costs only a read at recovery).
                    let rec = Record::new(blen as u32, block.crc, st.hdr.seq);
                    f.crc.write_at(&rec.encode(), record_at(b))?;
                }
            }
            drop(st);
            self.mark_dirty(&ext);
            Ok(())
        })
    }

    /// Shrinks to `len < st.len`, durably: the new end record and a header saying `len` are fsynced
    /// before the files are cut, and the cut is fsynced before new writes can refill the range.
    pub(super) fn truncate_locked(
        &self,
        f: &Files,
        st: &mut State,
        len: u64,
    ) -> Result<(), StoreError> {
        let bs = self.bs;
        let k = len / bs;
        let p = len % bs;
        let tail = if p == 0 {
            None
        } else {
            let old = st.blocks[k as usize];
            let old_blen = (st.len - k * bs).min(bs);
            let mut buf = vec![0u8; old_blen as usize];
            let verified = self.read_block(f, &mut buf, k * bs, old)?;
            let crc = crc32c(&buf[..p as usize]);
            // A block that failed keeps a CRC that cannot match, so recovery does not bless it.
            Some(if verified {
                Block::good(crc)
            } else {
                Block::rotten(!crc)
            })
        };
        // No record is rewritten (a torn one could spoil a durable block): the header's `tail_crc`
        // verifies the new last block, and records past `len` are older than the header, which
        // recovery ignores.
        let tail_crc = tail.map_or(0, |b| b.crc);
        let generation = self.write_header(f, st, len, tail_crc)?;
        self.fsync_file(&*f.data)?;
        self.fsync_file(&*f.crc)?;
        let nblocks = len.div_ceil(bs);
        st.len = len;
        st.blocks.truncate(nblocks as usize);
        if let Some(b) = tail {
            st.blocks[k as usize] = b;
        }
        if self.opts.sync {
            Self::header_durable(st, generation);
        }
        f.data.set_len(len)?;
        st.file_len = len;
        f.crc.set_len(record_at(nblocks))?;
        // The other slot still says the old, longer length; recovery may fall back to it (when a
        // later in-place write is torn) and must not find the dropped bytes promised there.
        let generation = self.write_header(f, st, len, tail_crc)?;
        self.fsync_file(&*f.data)?;
        self.fsync_file(&*f.crc)?;
        if self.opts.sync {
            Self::header_durable(st, generation);
        }
        Ok(())
    }
}
