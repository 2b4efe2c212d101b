//! Recovery of one extent when the store opens (docs/data-store.md, "Recovery").
//!
//! Inputs: the data file, the two header slots and the block records. Output: the extent's length and
//! the CRC of every block, with the files cut to that length. What recovery relies on:
//! - **The trusted header.** Header writes alternate between the two slots and a slot is written
//!   again only after an fsync confirmed the other, so the older of two valid headers (or the only
//!   valid one when the other slot is torn) describes a completed sync: its `len` bytes were durable
//!   and the partial last block of that length has CRC `tail_crc`.
//! - **The candidate header.** The newer of two valid headers (or the only one when the other slot
//!   was never written) may come from a sync that did not complete. It is used only if every block
//!   it adds over the trusted one verifies (a block the trusted header covers whole was durable
//!   under both, so its state tells nothing of that sync); otherwise recovery falls back to the
//!   trusted one.
//! - Below the chosen header's length blocks are kept even if they fail (they read as `Corrupt` and
//!   are repaired from a replica): they were durable and only an in-place change can have broken them.
//!   Above it, blocks are kept while they verify and the first one that does not ends the extent
//!   (a torn append).

use std::io;

use nacre_types::{ExtentId, crc32c};

use super::format::{Header, RECORD, RECORDS_AT, Record, Slot, record_at};
use super::{Block, Cursor, MAX_EXTENT_BLOCKS, StoreError};
use crate::io::DiskFile;

/// One recovered extent.
#[derive(Debug)]
pub(super) struct Recovered {
    /// What the extent's writes had reached as found: the data file's length, but no further than
    /// the blocks its crc file has records for. Bytes past those were never vouched for (a write
    /// whose records did not land, or a recycled file's old bytes) and are cut without counting.
    pub found_len: u64,
    pub len: u64,
    pub blocks: Vec<Block>,
    pub cursor: Cursor,
    /// Blocks kept although they fail their CRC.
    pub bad: Vec<u64>,
}

pub(super) fn recover(
    id: ExtentId,
    data: &dyn DiskFile,
    crc: &dyn DiskFile,
    block_size: u32,
    sync: bool,
) -> Result<Recovered, StoreError> {
    let bs = u64::from(block_size);
    let data_len = data.len()?;
    let crc_len = crc.len()?;
    // Records past the largest possible extent are ignored (and cut below).
    let mut raw =
        vec![0u8; usize::try_from(crc_len.min(record_at(MAX_EXTENT_BLOCKS))).unwrap_or(0)];
    let n = crc.read_at(&mut raw, 0)?;
    raw.truncate(n);

    let slot_bytes = |i: usize| &raw[(64 * i).min(raw.len())..(64 * (i + 1)).min(raw.len())];
    let slots = [Header::decode(slot_bytes(0)), Header::decode(slot_bytes(1))];
    for s in slots {
        match s {
            Slot::Unsupported(v) => {
                return Err(StoreError::Invalid(format!(
                    "{id}: crc file format version {v} is not supported"
                )));
            }
            Slot::Valid(h) if h.block_size != block_size => {
                return Err(StoreError::Invalid(format!(
                    "{id}: written with block size {}, the store uses {block_size}",
                    h.block_size
                )));
            }
            _ => {}
        }
    }
    let records: Vec<Record> = raw
        .get(RECORDS_AT as usize..)
        .map(|r| {
            r.chunks_exact(RECORD as usize)
                .map(Record::decode)
                .collect()
        })
        .unwrap_or_default();

    // (slot, header)
    let (candidate, trusted) = match slots {
        [Slot::Valid(a), Slot::Valid(b)] if a.seq >= b.seq => (Some((0, a)), Some((1, b))),
        [Slot::Valid(a), Slot::Valid(b)] => (Some((1, b)), Some((0, a))),
        [Slot::Valid(a), Slot::Torn] => (None, Some((0, a))),
        [Slot::Torn, Slot::Valid(b)] => (None, Some((1, b))),
        [Slot::Valid(a), _] => (Some((0, a)), None),
        [_, Slot::Valid(b)] => (Some((1, b)), None),
        _ => (None, None),
    };
    let max_seq = [candidate, trusted]
        .iter()
        .flatten()
        .map(|(_, h)| h.seq)
        .max();

    let ctx = Ctx {
        data,
        data_len,
        records: &records,
        bs,
    };
    // Blocks below the trusted length were durable: load their CRCs without reading them.
    let verify_from = trusted.map_or(0, |(_, h)| h.len / bs);
    let mut chosen = None;
    let mut walk = None;
    if let Some((slot, h)) = candidate {
        let w = ctx.walk(h, &[h.tail_crc], verify_from)?;
        if w.clean {
            chosen = Some(slot);
            walk = Some(w);
        }
    }
    let walk = match walk {
        Some(w) => w,
        None => {
            chosen = trusted.map(|(slot, _)| slot);
            let h = trusted.map_or(
                Header {
                    block_size,
                    tail_crc: 0,
                    seq: 0,
                    len: 0,
                },
                |(_, h)| h,
            );
            let mut tails = vec![h.tail_crc];
            // A punch rewrites the last block in place and durably, leaving the trusted header's
            // `tail_crc` stale; the newer header of the same length has the new one. Either CRC
            // describes content the store wrote, so accepting both serves nothing unverified.
            if let Some((_, c)) = candidate.filter(|(_, c)| c.len == h.len) {
                tails.push(c.tail_crc);
            }
            ctx.walk(h, &tails, verify_from)?
        }
    };
    // The next header goes to the slot not chosen, keeping the chosen one as the fallback.
    let cursor = Cursor {
        slot: match chosen {
            Some(s) => 1 - s,
            None => candidate.map_or(0, |(s, _)| s),
        },
        seq: max_seq.map_or(1, |s| s.saturating_add(1)),
        generation: 0,
        lens: slots.map(|s| match s {
            Slot::Valid(h) => h.len,
            _ => u64::MAX,
        }),
    };

    let nblocks = walk.blocks.len() as u64;
    let mut cut = false;
    if walk.len < data_len {
        data.set_len(walk.len)?;
        cut = true;
    }
    if crc_len > record_at(nblocks) {
        crc.set_len(record_at(nblocks))?;
        cut = true;
    }
    // Make the cut durable before new appends can refill the dropped range: otherwise a later crash
    // could bring back old blocks behind new ones.
    if cut && sync {
        data.sync_data()?;
        crc.sync_data()?;
    }
    // The end of the last block the crc file has a record for (all of it if that record is torn).
    let recorded = records.last().map_or(0, |r| {
        let full = records.len() as u64 * bs;
        match u64::from(r.len) {
            n @ 1.. if n <= bs => full - bs + n,
            _ => full,
        }
    });
    Ok(Recovered {
        found_len: data_len.min(recorded.max(walk.len)),
        len: walk.len,
        blocks: walk.blocks,
        cursor,
        bad: walk.bad,
    })
}

struct Ctx<'a> {
    data: &'a dyn DiskFile,
    data_len: u64,
    records: &'a [Record],
    bs: u64,
}

#[derive(Debug, Default)]
struct Walk {
    len: u64,
    blocks: Vec<Block>,
    bad: Vec<u64>,
    /// No block that was read failed (and no data the header promised is missing).
    clean: bool,
}

impl Walk {
    fn push(&mut self, index: u64, len: u64, block: Block) {
        if block.bad {
            self.bad.push(index);
        }
        self.blocks.push(block);
        self.len += len;
    }
}

/// The record's length and matching CRC if it verifies `data` (the bytes present in the block).
fn check(rec: Option<Record>, data: &[u8]) -> Option<(u64, u32)> {
    let r = rec?;
    let len = r.len as usize;
    if len == 0 || len > data.len() {
        return None;
    }
    let c = crc32c(&data[..len]);
    (c == r.crc || r.alt == Some(c)).then_some((len as u64, c))
}

impl Ctx<'_> {
    /// Decides the extent's blocks given a header `h`: `h.len` bytes were durable and the partial
    /// last block of that length has one of the CRCs `tails`. Past `h.len` only records written
    /// after `h` count (`epoch > h.seq`): older ones are leftovers of a truncate.
    fn walk(&self, h: Header, tails: &[u32], verify_from: u64) -> io::Result<Walk> {
        let (bs, floor) = (self.bs, h.len);
        let newer = |r: &Record| r.epoch > h.seq;
        let mut w = Walk {
            clean: true,
            ..Walk::default()
        };
        let mut buf = vec![0u8; bs as usize];
        for i in 0..MAX_EXTENT_BLOCKS {
            let start = i * bs;
            let avail = self.data_len.saturating_sub(start).min(bs);
            let rec = self.records.get(i as usize).copied();
            if start + bs <= floor {
                // A full block the header says was durable.
                if avail < bs {
                    w.clean = false;
                    break;
                }
                if i < verify_from
                    && let Some(r) = rec
                    && u64::from(r.len) == bs
                    && r.alt.is_none()
                {
                    w.push(i, bs, Block::recorded(r.crc));
                    continue;
                }
                let got = self.data.read_at(&mut buf, start)?;
                match check(rec, &buf[..got]) {
                    Some((len, crc)) if len == bs => w.push(i, bs, Block::recorded(crc)),
                    _ => {
                        // Kept: durable bytes that only an in-place change (or damage) broke. Below
                        // the trusted length that says nothing of whether the header's sync
                        // completed (the block was durable under either header).
                        let crc = rec
                            .filter(|r| u64::from(r.len) == bs)
                            .map_or(!crc32c(&buf[..got]), |r| r.crc);
                        w.push(i, bs, Block::rotten(crc));
                        w.clean &= i < verify_from;
                    }
                }
            } else if start < floor {
                // The partial last block of the header's length.
                let want = floor - start;
                if avail < want {
                    w.clean = false;
                    break;
                }
                let got = self.data.read_at(&mut buf[..avail as usize], start)?;
                match check(rec, &buf[..got]) {
                    Some((len, crc))
                        if len == want || (len > want && rec.is_some_and(|r| newer(&r))) =>
                    {
                        w.push(i, len, Block::recorded(crc));
                        if len < bs {
                            break;
                        }
                        continue;
                    }
                    _ => {}
                }
                let crc = crc32c(&buf[..(want as usize).min(got)]);
                let tail_ok = got as u64 >= want && tails.contains(&crc);
                let expected = if tail_ok {
                    crc
                } else {
                    tails.first().copied().unwrap_or(!crc)
                };
                w.push(
                    i,
                    want,
                    if tail_ok {
                        Block::recorded(expected)
                    } else {
                        Block::rotten(expected)
                    },
                );
                w.clean &= tail_ok;
                break;
            } else {
                // Past every durable byte: keep what was written after the header and verifies, up
                // to the first block that does not.
                if avail == 0 || !rec.is_some_and(|r| newer(&r)) {
                    break;
                }
                let got = self.data.read_at(&mut buf[..avail as usize], start)?;
                match check(rec, &buf[..got]) {
                    Some((len, crc)) => {
                        w.push(i, len, Block::recorded(crc));
                        if len < bs {
                            break;
                        }
                    }
                    None => break,
                }
            }
        }
        Ok(w)
    }
}
