//! A new replica of an erasure-coded partition rebuilds its shards from the others
//! (docs/ARCHITECTURE.md, "Erasure-coded volumes").
//!
//! Every replica of such a partition holds its shard of each stripe at the same place of the
//! same tiny extent, and the code is linear byte by byte: byte `x` of shard `i` is a function of
//! byte `x` of the `k` data shards, whatever stripe it belongs to. Ranges no stripe uses read as
//! zeros everywhere, and zeros encode to zeros. So a replica rebuilds its copy of a tiny extent
//! without knowing where stripes start: it reads the same range from `k` other replicas and
//! decodes its own shard of it, chunk by chunk, up to the longest copy.
//!
//! A replica created in a new directory (a partition just placed, or one moved here off a lost
//! node) starts with a `REBUILD` marker in its directory, which goes only once every tiny extent
//! is rebuilt and synced; a restart with the marker rebuilds again. While it rebuilds, the
//! replica refuses reads and writes and is left out of its node's reports, so the master keeps
//! the partition read-only and readers reconstruct its shards from the others.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use nacre_api::data::{DataError, ExtentList, ListExtents, ListExtentsRequest, Read, ReadRequest};
use nacre_func::{EcSpec, Shard};
use nacre_msgr::{CallOptions, Payload};
use nacre_types::ExtentId;
use nacre_types::sync::lock;

use super::append::{Track, write_error};
use super::{DataNode, Part, off_worker};
use crate::store::{ExtentStore, TINY_EXTENTS};

/// The marker of a replica that has not rebuilt its shards yet, in its partition's directory.
pub(super) const MARKER: &str = "REBUILD";

/// Bytes of each tiny extent rebuilt at a time.
const CHUNK: u64 = 1 << 20;

/// How calls to another replica are made: at background priority, within 10 s.
const OPTS: CallOptions = CallOptions {
    timeout: Some(Duration::from_secs(10)),
    flags: nacre_proto::Flags::BACKGROUND,
    bundled: false,
};

impl DataNode {
    /// Rebuilds `part`'s shards until done (another replica that does not answer is asked
    /// again, with pauses growing to 5 s), then removes the marker and reports the partition.
    pub(super) async fn rebuild(&self, part: Arc<Part>, ec: EcSpec) {
        let mut pause = Duration::from_millis(100);
        loop {
            if self.part(part.id).is_none_or(|p| !Arc::ptr_eq(&p, &part)) {
                return;
            }
            match self.rebuild_once(&part, ec).await {
                Ok(bytes) => {
                    part.rebuilding.store(false, Ordering::SeqCst);
                    tracing::info!(partition = %part.id, shard = part.shard, bytes, "shards rebuilt");
                    part.writability.notify_one();
                    return;
                }
                Err(e) => {
                    tracing::info!(partition = %part.id, error = %e, "rebuild of shards waits");
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(Duration::from_secs(5));
                }
            }
        }
    }

    /// One attempt: lists every other replica's tiny extents, rebuilds each extent up to its
    /// longest copy, syncs, and removes the marker. Returns the bytes rebuilt.
    async fn rebuild_once(&self, part: &Arc<Part>, ec: EcSpec) -> Result<u64, DataError> {
        let sources = self.shard_sources(part, ec).await?;
        let mut rebuilt = 0;
        for id in 1..=TINY_EXTENTS {
            let extent = ExtentId(id);
            let end = sources.iter().map(|s| s.len_of(extent)).max().unwrap_or(0);
            let mut at = 0;
            while at < end {
                let n = (end - at).min(CHUNK);
                let mine = self.decode_range(part, ec, &sources, extent, at, n).await?;
                let store = part.store.clone();
                off_worker(move || store.write(extent, at, &mine).map_err(write_error)).await?;
                rebuilt += n;
                at += n;
            }
            if end > 0 {
                let track = lock(&part.tracks)
                    .entry(extent)
                    .or_insert_with(|| Track::new(end, end))
                    .clone();
                super::append::grow(&track.next, end);
                track.commit(end);
            }
        }
        let (store, dir) = (part.store.clone(), self.part_dir(part.id));
        off_worker(move || {
            store.sync().map_err(write_error)?;
            match std::fs::remove_file(dir.join(MARKER)) {
                Ok(()) => Ok(()),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
                Err(e) => Err(DataError::Io(format!("removing the rebuild marker: {e}"))),
            }
        })
        .await?;
        Ok(rebuilt)
    }

    /// The other replicas of `part` that list their tiny extents; at least `k` of them.
    async fn shard_sources(&self, part: &Part, ec: EcSpec) -> Result<Vec<Source>, DataError> {
        let members = lock(&part.members).clone();
        if members.len() != ec.total() {
            return Err(DataError::Invalid(format!(
                "{} replicas listed for {} shards",
                members.len(),
                ec.total()
            )));
        }
        let mut sources = Vec::new();
        for (index, r) in members.into_iter().enumerate() {
            if index == part.shard {
                continue;
            }
            let req = ListExtentsRequest { partition: part.id };
            let call =
                self.inner
                    .client
                    .call_with::<ListExtents>(&r.addr, &req, Payload::none(), OPTS);
            if let Ok((Ok(ExtentList { extents, .. }), _)) = call.await {
                let lens = extents
                    .into_iter()
                    .filter(|(e, _, _)| ExtentStore::is_tiny(*e))
                    .map(|(e, len, _)| (e, len))
                    .collect();
                sources.push(Source {
                    index,
                    addr: r.addr,
                    lens,
                });
            }
        }
        let k = usize::from(ec.k);
        if sources.len() < k {
            return Err(DataError::ReadOnly(format!(
                "{} of the other replicas answered, {k} are needed",
                sources.len()
            )));
        }
        Ok(sources)
    }

    /// This replica's shard bytes `[at, at + n)` of tiny extent `extent`, decoded from the
    /// same range on `k` of `sources` (past a copy's end its bytes are zeros: no stripe reached
    /// there on it).
    async fn decode_range(
        &self,
        part: &Part,
        ec: EcSpec,
        sources: &[Source],
        extent: ExtentId,
        at: u64,
        n: u64,
    ) -> Result<Vec<u8>, DataError> {
        let k = usize::from(ec.k);
        let mut slots: Vec<Option<Shard>> = vec![None; ec.total()];
        let mut present = 0;
        for s in sources {
            if present == k {
                break;
            }
            let has = s.len_of(extent).saturating_sub(at).min(n);
            let mut bytes = if has == 0 {
                Vec::new()
            } else {
                let req = ReadRequest {
                    partition: part.id,
                    extent,
                    offset: at,
                    len: has as u32,
                };
                let call =
                    self.inner
                        .client
                        .call_with::<Read>(&s.addr, &req, Payload::none(), OPTS);
                match call.await {
                    Ok((Ok(()), data)) if data.bytes.len() as u64 == has => data.bytes.to_vec(),
                    _ => continue,
                }
            };
            bytes.resize(n as usize, 0);
            slots[s.index] = Some(Shard::new(bytes.into()));
            present += 1;
        }
        if present < k {
            return Err(DataError::ReadOnly(format!(
                "{extent} at {at}: {present} replicas served their shards, {k} are needed"
            )));
        }
        Ok(nacre_func::ec_rebuild(ec, slots)
            .map_err(|e| DataError::Io(format!("decoding {extent} at {at}: {e}")))?
            .shards
            .swap_remove(part.shard)
            .data
            .to_vec())
    }

    /// Repairs block `block` of tiny extent `extent` of an erasure-coded replica (found bad by
    /// the scrub) from the other replicas' shards of the same bytes.
    pub(super) async fn repair_block_from_shards(
        &self,
        part: &Part,
        ec: EcSpec,
        extent: ExtentId,
        block: u64,
    ) -> Result<(), DataError> {
        let bs = u64::from(part.store.block_size());
        let start = block.saturating_mul(bs);
        let len = part.store.len(extent).map_err(crate::sm::store_error)?;
        let n = len.saturating_sub(start).min(bs);
        if n == 0 {
            return Ok(());
        }
        let sources = self.shard_sources(part, ec).await?;
        let data = self
            .decode_range(part, ec, &sources, extent, start, n)
            .await?;
        match self
            .install_blocks(part, extent, block, data.into(), u64::MAX, true)
            .await
        {
            Ok(true) => {
                tracing::info!(partition = %part.id, %extent, block, "block of a shard rebuilt from the others");
                Ok(())
            }
            Ok(false) => Err(DataError::ReadOnly(format!(
                "{extent} block {block} changed while it was rebuilt"
            ))),
            Err(e) => Err(DataError::Io(e)),
        }
    }
}

/// Another replica of the partition, and its tiny extents' lengths.
struct Source {
    index: usize,
    addr: String,
    lens: Vec<(ExtentId, u64)>,
}

impl Source {
    fn len_of(&self, extent: ExtentId) -> u64 {
        self.lens
            .iter()
            .find(|(e, _)| *e == extent)
            .map_or(0, |(_, l)| *l)
    }
}
