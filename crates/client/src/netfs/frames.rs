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
use nacre_api::shards::StripeAt;
use nacre_func::{Codec, EcSpec, Stripe};
use nacre_types::PartitionId;
use tokio::task::JoinSet;

use super::Inner;
use crate::func::{FuncClient, FuncClientConfig, FuncPolicy};
use crate::meta::{FsError, FsResult};
use crate::net::NetVolume;

/// How long a run grows on a compressed volume before its whole blocks are committed (such a
/// volume has no streams: every frame goes into packed extents).
pub(super) const FRAMED_RUN_MAX: usize = 2 << 20;

/// A volume's storage functions and the client that runs them.
#[derive(Debug)]
pub(super) struct Framer {
    pub(super) compression: Option<Compression>,
    /// The volume's erasure code: each unit is one stripe ([`nacre_api::shards`]).
    pub(super) ec: Option<EcSpec>,
    pub(super) funcs: FuncClient,
}

impl Framer {
    /// The framer of `vol`'s functions, if it has any: they run where the volume says, through
    /// a client of their own.
    pub(super) fn of(vol: &NetVolume) -> Option<Self> {
        let funcs = vol.funcs();
        if funcs.compress.is_none() && funcs.ec.is_none() {
            return None;
        }
        let config = FuncClientConfig {
            at: funcs.at,
            policy: FuncPolicy {
                fallback_inline: funcs.fallback_inline,
            },
            ..FuncClientConfig::default()
        };
        Some(Self {
            compression: funcs.compress,
            ec: funcs.ec,
            funcs: FuncClient::new(vol.master().clone(), config),
        })
    }

    /// The block size file ranges are cut at: the compression's, else the default.
    pub(super) fn block(&self) -> u64 {
        u64::from(self.compression.map_or(Compression::BLOCK, |c| c.block))
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
    /// Whether this volume's file data is stored in frames (compressed, erasure-coded or
    /// both): no streams, no writes in place.
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
        let Some(codec) = fr.compression.map(|c| c.codec) else {
            // Erasure-coded only: raw frames, made here (a copy and a checksum).
            return cuts(file_offset, end, fr.block())
                .map(|(from, to)| {
                    let block = &data[(from - file_offset) as usize..(to - file_offset) as usize];
                    let frame = nacre_func::compress_block(Codec::None, block)
                        .map_err(|e| FsError::Func(e.into()))?;
                    Ok(Unit {
                        file_offset: from,
                        len: (to - from) as u32,
                        stored: frame,
                        framed: true,
                    })
                })
                .collect();
        };
        let mut calls = JoinSet::new();
        for (k, (from, to)) in cuts(file_offset, end, fr.block()).enumerate() {
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
        let mut keys = Vec::with_capacity(tagged.len());
        for (_, placed) in self.place_packed(spread, &tagged).await {
            keys.extend(placed?);
        }
        keys.sort_unstable_by_key(|k| k.file_offset);
        Ok(keys)
    }

    /// Writes `units` packed into tiny extents, the packets at once (the first placed by
    /// `spread`): per packet, its members (tag, index in `units`) and their keys in the same
    /// order, or why the packet failed. On an erasure-coded volume each unit is one stripe and
    /// a packet is a run of stripes.
    pub(super) async fn place_packed<T: Copy>(
        &self,
        spread: usize,
        units: &[(T, Unit)],
    ) -> Vec<PlacedPacket<T>> {
        if let Some(ec) = self.framer.as_ref().and_then(|f| f.ec) {
            return self.place_striped(ec, spread, units).await;
        }
        let mut packets = pack(units);
        let Some(me) = self.me.upgrade() else {
            return packets
                .into_iter()
                .map(|(_, m)| (members(&m), Err(closing())))
                .collect();
        };
        let mut writes = JoinSet::new();
        for (k, (bytes, _)) in packets.iter_mut().enumerate() {
            let (me, data) = (me.clone(), bytes.split().freeze());
            writes.spawn(async move { (k, me.place_tiny(spread + k, data).await) });
        }
        let mut placed: Vec<Option<FsResult<(PartitionId, Written)>>> =
            (0..packets.len()).map(|_| None).collect();
        while let Some(r) = writes.join_next().await {
            if let Ok((k, r)) = r {
                placed[k] = Some(r);
            }
        }
        packets
            .iter()
            .zip(placed)
            .map(|((_, m), placed)| {
                let keys = match placed {
                    Some(Ok((partition, w))) => Ok(m
                        .iter()
                        .map(|&(_, i, pos)| units[i].1.key(partition, &w, pos))
                        .collect()),
                    Some(Err(e)) => Err(e),
                    None => Err(FsError::WriteFailed(
                        "the packet's write task failed".into(),
                    )),
                };
                (members(m), keys)
            })
            .collect()
    }

    /// [`Inner::place_packed`] on an erasure-coded volume: each unit is encoded into a stripe
    /// (inline or on the function servers), stripes are packed whole, in order, while their
    /// shards fit a tiny write, and each packet's shards go to one partition's replicas at one
    /// place ([`Inner::place_stripes`]).
    async fn place_striped<T: Copy>(
        &self,
        ec: EcSpec,
        spread: usize,
        units: &[(T, Unit)],
    ) -> Vec<PlacedPacket<T>> {
        let Some((fr, me)) = self.framer.as_ref().zip(self.me.upgrade()) else {
            let all = units
                .iter()
                .enumerate()
                .map(|(i, (t, _))| (*t, i))
                .collect();
            return vec![(all, Err(closing()))];
        };
        let mut calls = JoinSet::new();
        for (i, (_, u)) in units.iter().enumerate() {
            let (funcs, data) = (fr.funcs.clone(), u.stored.clone());
            calls.spawn(async move { (i, funcs.ec_encode(ec, data).await) });
        }
        let mut stripes: Vec<Option<FsResult<Stripe>>> = (0..units.len()).map(|_| None).collect();
        while let Some(r) = calls.join_next().await {
            if let Ok((i, r)) = r {
                stripes[i] = Some(r.map_err(FsError::from));
            }
        }
        // Runs of stripes whose shards fit one tiny write; a unit that could not be encoded
        // fails alone.
        let mut out: Vec<PlacedPacket<T>> = Vec::new();
        let mut packets: Vec<(Vec<usize>, Vec<BytesMut>, Vec<u64>)> = Vec::new();
        for (i, s) in stripes.iter_mut().enumerate() {
            let stripe = match s.take() {
                Some(Ok(stripe)) => stripe,
                Some(Err(e)) => {
                    out.push((vec![(units[i].0, i)], Err(e)));
                    continue;
                }
                None => {
                    let e = FsError::Func(crate::func::FuncCallError::Inline {
                        function: nacre_func::Function::EcEncode,
                        reason: "the encoding task ended without an answer".into(),
                    });
                    out.push((vec![(units[i].0, i)], Err(e)));
                    continue;
                }
            };
            let len = stripe.shards.first().map_or(0, |sh| sh.data.len());
            if packets
                .last()
                .is_none_or(|(_, bufs, _)| bufs[0].len() + len > MAX_TINY_WRITE)
            {
                let bufs = (0..ec.total()).map(|_| BytesMut::new()).collect();
                packets.push((Vec::new(), bufs, Vec::new()));
            }
            if let Some((members, bufs, at)) = packets.last_mut() {
                members.push(i);
                at.push(bufs[0].len() as u64);
                for (buf, shard) in bufs.iter_mut().zip(&stripe.shards) {
                    buf.extend_from_slice(&shard.data);
                }
            }
        }
        let mut writes = JoinSet::new();
        for (k, (_, bufs, _)) in packets.iter_mut().enumerate() {
            let shards: Vec<Bytes> = bufs.iter_mut().map(|b| b.split().freeze()).collect();
            let me = me.clone();
            writes.spawn(async move { (k, me.place_stripes(spread + k, shards).await) });
        }
        let mut placed: Vec<Option<FsResult<(PartitionId, Written)>>> =
            (0..packets.len()).map(|_| None).collect();
        while let Some(r) = writes.join_next().await {
            if let Ok((k, r)) = r {
                placed[k] = Some(r);
            }
        }
        for ((m, _, at), placed) in packets.into_iter().zip(placed) {
            let keys = match placed {
                Some(Ok((partition, w))) => Ok(m
                    .iter()
                    .zip(&at)
                    .map(|(&i, &rel)| {
                        let mut key = units[i].1.key(partition, &w, 0);
                        key.extent_offset = StripeAt::key_offset(ec, w.offset + rel);
                        key
                    })
                    .collect()),
                Some(Err(e)) => Err(e),
                None => Err(FsError::WriteFailed(
                    "the packet's write task failed".into(),
                )),
            };
            out.push((m.iter().map(|&i| (units[i].0, i)).collect(), keys));
        }
        out
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

/// A placed packet: its members (tag, index among the units) and their keys in the same order,
/// or why it failed.
pub(super) type PlacedPacket<T> = (Vec<(T, usize)>, FsResult<Vec<ExtentKey>>);

fn members<T: Copy>(m: &[(T, usize, u64)]) -> Vec<(T, usize)> {
    m.iter().map(|&(t, i, _)| (t, i)).collect()
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
