//! Reads: whole blocks are read and verified against their CRCs (only the asked range is
//! returned), so a read never returns bytes its block's record does not vouch for; plus the
//! extent's length and per-block CRCs for comparing replicas.

use bytes::Bytes;
use nacre_types::{ExtentId, crc32c};

use super::cache::Open;
use super::{ExtentStore, StoreError, read};

impl ExtentStore {
    /// Reads `len` bytes at `offset`, verifying every block it touches against its CRC (whole blocks
    /// are read and checked; only the asked range is returned). Past the end is `OutOfRange`.
    pub fn read(&self, id: ExtentId, offset: u64, len: u32) -> Result<Bytes, StoreError> {
        let _gate = self.enter()?;
        let out_of_range = |extent_len| StoreError::OutOfRange {
            extent: id,
            offset,
            len: u64::from(len),
            extent_len,
        };
        let end = offset
            .checked_add(u64::from(len))
            .ok_or_else(|| out_of_range(0))?;
        let Some(ext) = self.find(id)? else {
            return if end == 0 {
                Ok(Bytes::new())
            } else {
                Err(out_of_range(0))
            };
        };
        let st = read(&ext.state);
        if st.deleted {
            return Err(StoreError::NotFound(id));
        }
        if end > st.len {
            return Err(out_of_range(st.len));
        }
        if len == 0 {
            return Ok(Bytes::new());
        }
        let bs = self.bs;
        let first = offset / bs;
        let last = (end - 1) / bs;
        let start = first * bs;
        let stop = st.len.min((last + 1) * bs);
        let f = self.files(id, Open::Existing)?;
        let mut buf = vec![0u8; (stop - start) as usize];
        let got = f.data.read_at(&mut buf, start)?;
        drop(f);
        for (i, chunk) in buf.chunks(bs as usize).enumerate() {
            let b = first + i as u64;
            let blk = st.blocks[b as usize];
            let complete = got >= i * bs as usize + chunk.len();
            if blk.bad || !complete || crc32c(chunk) != blk.crc {
                return Err(StoreError::Corrupt {
                    extent: id,
                    block: b,
                    offset: b * bs,
                });
            }
        }
        drop(st);
        Ok(Bytes::from(buf).slice((offset - start) as usize..(end - start) as usize))
    }

    /// Length of an extent (0 for a tiny extent not written yet).
    pub fn len(&self, id: ExtentId) -> Result<u64, StoreError> {
        let _gate = self.enter()?;
        let Some(ext) = self.find(id)? else {
            return Ok(0);
        };
        let st = read(&ext.state);
        if st.deleted {
            return Err(StoreError::NotFound(id));
        }
        Ok(st.len)
    }

    /// The per-block CRCs, for comparing replicas during repair. A block known bad reports the
    /// complement of its expected CRC, so that it never matches a healthy replica's.
    pub fn block_crcs(&self, id: ExtentId) -> Result<Vec<u32>, StoreError> {
        let _gate = self.enter()?;
        let Some(ext) = self.find(id)? else {
            return Ok(Vec::new());
        };
        let st = read(&ext.state);
        if st.deleted {
            return Err(StoreError::NotFound(id));
        }
        Ok(st
            .blocks
            .iter()
            .map(|b| if b.bad { !b.crc } else { b.crc })
            .collect())
    }
}
