//! How file bytes become stored bytes: *units* and packed writes (docs/ARCHITECTURE.md,
//! "Compressed volumes").
//!
//! A unit is a range of a file and the bytes stored for it: the bytes themselves (at most a
//! packet), or on a compressed volume one block's frame. Blocks are aligned in the file at the
//! volume's block size, so a range is cut at block boundaries and each piece is compressed on its
//! own (a range shorter than a block makes a shorter frame). Units are packed whole, in order,
//! into packets of at most [`MAX_TINY_WRITE`] bytes, each written as one replicated append into a
//! shared tiny extent; each unit's key names exactly its stored bytes in the packet, with their
//! CRC (a frame's CRC is over the frame, which a reader checks before decompressing it).

use std::num::NonZeroU32;

use bytes::{Bytes, BytesMut};
use nacre_api::data::{MAX_PACKET, MAX_TINY_WRITE, Written};
use nacre_api::master::Compression;
use nacre_api::meta::{ExtentKey, Framed};
use nacre_types::PartitionId;
use tokio::task::JoinSet;

use super::Inner;
use crate::func::{FuncClient, FuncClientConfig, FuncPolicy};
use crate::meta::{FsError, FsResult};
use crate::net::NetVolume;

/// How long a run grows on a compressed volume before its whole blocks are committed (such a
/// volume has no streams: every frame goes into packed extents).
pub(super) const FRAMED_RUN_MAX: usize = 2 << 20;

/// A volume's compression and the client that runs it.
#[derive(Debug)]
pub(super) struct Framer {
    pub(super) compression: Compression,
    pub(super) funcs: FuncClient,
}

impl Framer {
    /// The framer of `vol`'s compression, if it has one: its functions run where the volume
    /// says, through a client of their own.
    pub(super) fn of(vol: &NetVolume) -> Option<Self> {
        let funcs = vol.funcs();
        let compression = funcs.compress?;
        let config = FuncClientConfig {
            at: funcs.at,
            policy: FuncPolicy {
                fallback_inline: funcs.fallback_inline,
            },
            ..FuncClientConfig::default()
        };
        Some(Self {
            compression,
            funcs: FuncClient::new(vol.master().clone(), config),
        })
    }
}

/// A range of a file and the bytes stored for it.
#[derive(Clone, Debug)]
pub(super) struct Unit {
    pub(super) file_offset: u64,
    /// File bytes the unit stands for.
    pub(super) len: u32,
    /// What is stored: the bytes, or their block's frame.
    pub(super) stored: Bytes,
    pub(super) framed: bool,
}

impl Unit {
    /// Its key, the unit stored at `pos` in a packet written at `w` in `partition`.
    pub(super) fn key(&self, partition: PartitionId, w: &Written, pos: u64) -> ExtentKey {
        ExtentKey {
            file_offset: self.file_offset,
            partition,
            extent: w.extent,
            extent_offset: w.offset + pos,
            size: self.len,
            crc: nacre_types::crc32c(&self.stored),
            framed: self
                .framed
                .then(|| NonZeroU32::new(self.stored.len() as u32))
                .flatten()
                .map(|stored| Framed { stored, skip: 0 }),
        }
    }
}

/// `[from, to)` cut at multiples of `step` (and at least every `step` bytes).
pub(super) fn cuts(from: u64, to: u64, step: u64) -> impl Iterator<Item = (u64, u64)> {
    let mut at = from;
    std::iter::from_fn(move || {
        if at >= to {
            return None;
        }
        let end = ((at / step + 1) * step).min(to);
        let piece = (at, end);
        at = end;
        Some(piece)
    })
}

/// A packet's bytes and its members: (the caller's tag, the unit's index, its offset in the
/// packet).
pub(super) type Packet<T> = (BytesMut, Vec<(T, usize, u64)>);

/// Packs units, in order and whole, into packets of at most [`MAX_TINY_WRITE`] bytes.
pub(super) fn pack<T: Copy>(units: &[(T, Unit)]) -> Vec<Packet<T>> {
    let mut packets: Vec<Packet<T>> = Vec::new();
    for (i, (tag, u)) in units.iter().enumerate() {
        let len = u.stored.len();
        if packets
            .last()
            .is_none_or(|(p, _)| p.len() + len > MAX_TINY_WRITE)
        {
            packets.push((BytesMut::with_capacity(MAX_TINY_WRITE), Vec::new()));
        }
        if let Some((p, members)) = packets.last_mut() {
            members.push((*tag, i, p.len() as u64));
            p.extend_from_slice(&u.stored);
        }
    }
    packets
}

impl Inner {
    /// Whether this volume's file data is stored in compressed frames.
    pub(super) fn compressed(&self) -> bool {
        self.framer.is_some()
    }

    /// The units of file bytes `data` at `file_offset`: raw pieces of at most a packet, or on a
    /// compressed volume one frame per block piece (compressed at once, inline or on the
    /// function servers as the volume says).
    pub(super) async fn units(&self, file_offset: u64, data: Bytes) -> FsResult<Vec<Unit>> {
        let end = file_offset + data.len() as u64;
        let Some(fr) = &self.framer else {
            return Ok(cuts(file_offset, end, MAX_PACKET as u64)
                .map(|(from, to)| Unit {
                    file_offset: from,
                    len: (to - from) as u32,
                    stored: data.slice((from - file_offset) as usize..(to - file_offset) as usize),
                    framed: false,
                })
                .collect());
        };
        let codec = fr.compression.codec;
        let mut calls = JoinSet::new();
        for (k, (from, to)) in cuts(file_offset, end, u64::from(fr.compression.block)).enumerate() {
            let block = data.slice((from - file_offset) as usize..(to - file_offset) as usize);
            let funcs = fr.funcs.clone();
            calls.spawn(async move { (k, from, to, funcs.compress(codec, block).await) });
        }
        let mut units = Vec::with_capacity(calls.len());
        while let Some(r) = calls.join_next().await {
            let (k, from, to, frame) = r.map_err(|e| FsError::WriteFailed(e.to_string()))?;
            units.push((
                k,
                Unit {
                    file_offset: from,
                    len: (to - from) as u32,
                    stored: frame?,
                    framed: true,
                },
            ));
        }
        units.sort_unstable_by_key(|(k, _)| *k);
        Ok(units.into_iter().map(|(_, u)| u).collect())
    }

    /// Writes `units` packed into tiny extents (the packets at once, the first placed by
    /// `spread`) and returns their keys in file order.
    pub(super) async fn place_units(
        &self,
        spread: usize,
        units: Vec<Unit>,
    ) -> FsResult<Vec<ExtentKey>> {
        let tagged: Vec<((), Unit)> = units.into_iter().map(|u| ((), u)).collect();
        let mut packets = pack(&tagged);
        let me = self.me.upgrade().ok_or_else(closing)?;
        let mut writes = JoinSet::new();
        for (k, (bytes, _)) in packets.iter_mut().enumerate() {
            let (me, data) = (me.clone(), bytes.split().freeze());
            writes.spawn(async move { (k, me.place_tiny(spread + k, data).await) });
        }
        let mut keys = Vec::with_capacity(tagged.len());
        let mut failed = None;
        while let Some(r) = writes.join_next().await {
            match r {
                Ok((k, Ok((partition, w)))) => {
                    for &((), i, pos) in &packets[k].1 {
                        keys.push(tagged[i].1.key(partition, &w, pos));
                    }
                }
                Ok((_, Err(e))) => {
                    failed.get_or_insert(e);
                }
                Err(e) => {
                    failed.get_or_insert(FsError::WriteFailed(e.to_string()));
                }
            }
        }
        if let Some(e) = failed {
            return Err(e);
        }
        keys.sort_unstable_by_key(|k| k.file_offset);
        Ok(keys)
    }

    /// File bytes `data` at `file_offset` written into tiny extents: their keys in file order.
    pub(super) async fn write_units(
        &self,
        spread: usize,
        file_offset: u64,
        data: Bytes,
    ) -> FsResult<Vec<ExtentKey>> {
        let units = self.units(file_offset, data).await?;
        self.place_units(spread, units).await
    }
}

fn closing() -> FsError {
    FsError::Unavailable(crate::meta::CallError::Unknown(
        "the file system is closing".into(),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_are_cut_at_block_boundaries_of_the_file() {
        let c: Vec<_> = cuts(100, 300, 128).collect();
        assert_eq!(c, [(100, 128), (128, 256), (256, 300)]);
        assert_eq!(
            cuts(0, 256, 128).collect::<Vec<_>>(),
            [(0, 128), (128, 256)]
        );
        assert_eq!(cuts(5, 5, 128).count(), 0);
    }

    #[test]
    fn units_are_packed_whole_and_in_order() {
        let unit = |off: u64, n: usize| Unit {
            file_offset: off,
            len: n as u32,
            stored: Bytes::from(vec![off as u8; n]),
            framed: false,
        };
        let big = MAX_TINY_WRITE / 2 + 1;
        let units = vec![(0u8, unit(0, big)), (1, unit(1, 10)), (2, unit(2, big))];
        let packets = pack(&units);
        assert_eq!(
            packets.len(),
            2,
            "the third does not fit beside the first two"
        );
        assert_eq!(packets[0].1, [(0, 0, 0), (1, 1, big as u64)]);
        assert_eq!(packets[1].1, [(2, 2, 0)]);
        assert_eq!(packets[0].0.len(), big + 10);
        assert_eq!(&packets[0].0[big..], &[1u8; 10][..]);
    }
}
