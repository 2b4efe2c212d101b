//! The data path of open files: handles and the per-inode [`OpenFile`], runs of sequential
//! writes and how they are committed (tiny extent or [`SeqWriter`] stream, then the extent keys),
//! writes and reads of committed bytes, and hiding open files that are unlinked.

use nacre_api::meta::extents::overlay_all;
use nacre_api::shards::StripeAt;
use nacre_func::EcSpec;

use super::frames::FRAMED_RUN_MAX;
use super::*;

impl Inner {
    pub(super) fn handle(&self, fh: Fh) -> FsResult<Handle> {
        lock(&self.handles)
            .get(&fh)
            .cloned()
            .ok_or(FsError::BadHandle(fh.0))
    }

    pub(super) fn open_file(&self, ino: Ino) -> Option<Arc<OpenFile>> {
        lock(&self.files).get(&ino).cloned()
    }

    /// Forgets `f` when no handle has it open and it has no bytes written behind.
    pub(super) fn forget_if_closed(&self, f: &Arc<OpenFile>) {
        let mut files = lock(&self.files);
        let idle = files.get(&f.ino).is_some_and(|g| {
            Arc::ptr_eq(g, f)
                && f.opens.load(Ordering::SeqCst) == 0
                && !f.dirty.load(Ordering::SeqCst)
        });
        if idle {
            files.remove(&f.ino);
        }
    }

    /// The file `parent/name` when this client knows it but has no handle on it (it has bytes
    /// written behind, or is being flushed).
    pub(super) async fn closed_file(
        &self,
        parent: Ino,
        name: &[u8],
    ) -> FsResult<Option<Arc<OpenFile>>> {
        if self.behind.is_none() || lock(&self.files).is_empty() {
            return Ok(None);
        }
        let d = match self.meta.lookup_dentry(parent, name).await {
            Ok(d) => d,
            Err(FsError::Meta(MetaError::NotFound)) => return Ok(None),
            Err(e) => return Err(e),
        };
        Ok(self
            .open_file(d.ino)
            .filter(|f| f.opens.load(Ordering::SeqCst) == 0))
    }

    /// Opens a handle on the file `attr` describes; `keys`, when the caller read them with
    /// `attr`, are its committed extent keys.
    pub(super) async fn open_attr(
        &self,
        attr: &Attr,
        flags: OpenFlags,
        keys: Option<Vec<ExtentKey>>,
    ) -> FsResult<Fh> {
        let file = {
            let mut files = lock(&self.files);
            let f = files.entry(attr.ino).or_insert_with(|| {
                Arc::new(OpenFile {
                    ino: attr.ino,
                    opens: AtomicU64::new(0),
                    hidden: Mutex::new(None),
                    dirty: AtomicBool::new(false),
                    behind_bytes: AtomicU64::new(0),
                    next_turn: AtomicU64::new(0),
                    serving: tokio::sync::watch::Sender::new(0),
                    state: tokio::sync::Mutex::new(FileState {
                        size: attr.size,
                        extents: None,
                        run: None,
                        idle_stream: None,
                        ahead: None,
                        last_read_end: 0,
                        error: None,
                        times: None,
                        failing: None,
                        times_stale: false,
                        pieces: Default::default(),
                        pieces_bytes: 0,
                    }),
                })
            });
            f.opens.fetch_add(1, Ordering::SeqCst);
            f.clone()
        };
        {
            // Refreshed on open: another client may have changed the file.
            let mut st = file.state.lock().await;
            // A file whose bytes are written behind keeps this client's view: its keys may not
            // have reached its partition yet.
            if st.run.is_none() && !file.dirty.load(Ordering::SeqCst) {
                st.size = attr.size;
                st.extents = keys;
                st.ahead = None;
            }
        }
        let fh = Fh(self.next_fh.fetch_add(1, Ordering::Relaxed));
        lock(&self.handles).insert(fh, Handle { file, flags });
        Ok(fh)
    }

    /// Commits the run of `f` (if any): its keys go to the meta node. On failure the run's bytes
    /// are lost; the error is returned and kept for the next flush to report.
    pub(super) async fn flush_file(&self, f: &OpenFile, st: &mut FileState) -> FsResult<()> {
        let mut r = self.commit_run(f, st).await;
        if r.is_ok() && st.times_stale {
            r = self.meta.append_extents(f.ino, Vec::new()).await.map(drop);
            st.times_stale = r.is_err();
        }
        if let Err(e) = &r {
            st.error = Some(e.to_string());
        }
        r
    }

    /// [`Self::flush_file`] for `flush`, `fsync` and `release`: also reports an earlier failure
    /// (once).
    pub(super) async fn flush_reporting(&self, f: &OpenFile, st: &mut FileState) -> FsResult<()> {
        let r = self.flush_file(f, st).await;
        match (r, st.error.take()) {
            (Err(e), _) => Err(e),
            (Ok(()), Some(earlier)) => Err(FsError::WriteFailed(earlier)),
            (Ok(()), None) => Ok(()),
        }
    }

    pub(super) async fn commit_run(&self, f: &OpenFile, st: &mut FileState) -> FsResult<()> {
        self.commit_pieces(f, st).await?;
        let Some(mut run) = st.run.take() else {
            return Ok(());
        };
        self.uncount(f);
        let len = run.end() - run.start;
        if len == 0 {
            st.idle_stream = run.stream.map(|s| (run.start + run.sent, s));
            return Ok(());
        }
        let end = run.end();
        let (keys, stream) = if self.compressed() {
            let data = run.buf.freeze();
            (
                self.write_units(f.ino.0 as usize, run.start, data).await?,
                None,
            )
        } else if run.stream.is_none() && run.buf.len() <= self.cfg.tiny_max {
            (
                vec![self.write_tiny(run.start, run.buf.freeze()).await?],
                None,
            )
        } else {
            let mut s = match run.stream.take() {
                Some(s) => s,
                None => SeqWriter::new(self.vol.clone(), run.start, self.cfg.inflight),
            };
            if !run.buf.is_empty() {
                run.first_sent.get_or_insert_with(std::time::Instant::now);
            }
            s.write(run.buf.split().freeze()).await.map_err(fs_err)?;
            s.flush().await.map_err(fs_err)?;
            commit::may_commit(&run, std::time::Instant::now(), self.cfg.commit_within)?;
            (s.take_keys(), Some(s))
        };
        let attr = self.meta.append_extents(f.ino, keys.clone()).await?;
        st.times_stale = false;
        st.size = attr.size.max(end);
        record_keys(st, keys);
        st.idle_stream = stream.map(|s| (end, s));
        if let Some(set) = st.times.take() {
            self.meta.setattr(f.ino, set).await?;
        }
        Ok(())
    }

    /// One small piece of a file in a tiny extent (moving on from partitions that refuse it).
    pub(super) async fn write_tiny(&self, file_offset: u64, data: Bytes) -> FsResult<ExtentKey> {
        let (partition, w) = self.place_tiny(file_offset as usize, data.clone()).await?;
        Ok(ExtentKey {
            file_offset,
            partition,
            extent: w.extent,
            extent_offset: w.offset,
            size: data.len() as u32,
            crc: nacre_types::crc32c(&data),
            framed: None,
        })
    }

    /// Writes `data` (at most one packet) into a tiny extent of a writable partition, the
    /// first one chosen by `spread`, moving on from partitions that refuse it.
    pub(super) async fn place_tiny(
        &self,
        spread: usize,
        data: Bytes,
    ) -> FsResult<(PartitionId, Written)> {
        self.place(spread, |p| self.vol.write_tiny(p, data.clone()))
            .await
    }

    /// Writes a run of stripes' shards (`shards[i]`: shard `i` of each, concatenated) to the
    /// replicas of a writable erasure-coded partition, the first one chosen by `spread`, moving
    /// on from partitions that refuse them: shard 0 by replica 0, which places them in a tiny
    /// extent, then every other shard at the same place on its replica, at once. Acknowledged
    /// once every replica has its shard on disk.
    pub(super) async fn place_stripes(
        &self,
        spread: usize,
        shards: Vec<Bytes>,
    ) -> FsResult<(PartitionId, Written)> {
        self.place(spread, |p| self.write_stripes(p, &shards)).await
    }

    /// Runs `write` on a writable partition, the first one chosen by `spread`, moving on from
    /// partitions that refuse it; when every one refused or none is writable, waits for one (a
    /// node back, partitions added), up to `RIDE_OUT`.
    async fn place<F, Fut>(&self, spread: usize, write: F) -> FsResult<(PartitionId, Written)>
    where
        F: Fn(PartitionId) -> Fut,
        Fut: std::future::Future<Output = Result<Written, DataCallError>>,
    {
        let mut failed: Vec<PartitionId> = Vec::new();
        let mut last = DataCallError::NoWritablePartition;
        let mut ride = crate::data::RideOut::default();
        for attempt in 0usize.. {
            let Some(p) = self
                .vol
                .pick_writable(attempt.wrapping_add(spread), &failed)
            else {
                if !ride.wait(&self.vol).await {
                    break;
                }
                failed.clear();
                continue;
            };
            match write(p).await {
                Ok(w) => return Ok((p, w)),
                Err(e) if e.try_elsewhere() => {
                    failed.push(p);
                    last = e;
                }
                Err(e) => return Err(fs_err(e)),
            }
        }
        Err(fs_err(last))
    }

    async fn write_stripes(
        &self,
        p: PartitionId,
        shards: &[Bytes],
    ) -> Result<Written, DataCallError> {
        let addrs = self.vol.replica_addrs(p);
        if addrs.len() != shards.len() {
            return Err(DataCallError::Data(nacre_api::data::DataError::ReadOnly(
                format!(
                    "the view lists {} replicas of partition {p} for {} shards",
                    addrs.len(),
                    shards.len()
                ),
            )));
        }
        // A replica that did not answer lately would hold the packet for the call's timeout:
        // another partition takes it at once.
        if let Some(a) = addrs.iter().find(|a| self.vol.is_suspect(a)) {
            return Err(DataCallError::Data(nacre_api::data::DataError::ReadOnly(
                format!("its replica {a} did not answer lately"),
            )));
        }
        let w = self
            .vol
            .write_shard_0(p, &addrs[0], shards[0].clone())
            .await?;
        let mut writes = JoinSet::new();
        for (addr, shard) in addrs.iter().zip(shards).skip(1) {
            let (vol, addr, shard) = (self.vol.clone(), addr.clone(), shard.clone());
            writes.spawn(async move { vol.write_shard(p, &addr, w.extent, w.offset, shard).await });
        }
        while let Some(r) = writes.join_next().await {
            r.map_err(|e| DataCallError::Call(CallError::Unknown(e.to_string())))??;
        }
        Ok(w)
    }

    /// The committed extent keys of `f`.
    pub(super) async fn extents<'a>(
        &self,
        f: &OpenFile,
        st: &'a mut FileState,
    ) -> FsResult<&'a [ExtentKey]> {
        if st.extents.is_none() {
            if f.dirty.load(Ordering::SeqCst) {
                // Its keys may still be queued: they reach the partition first.
                self.meta.settle().await?;
            }
            let (attr, keys) = self.meta.extents(f.ino).await?;
            let run_end = st.run.as_ref().map_or(0, Run::end);
            st.size = attr.size.max(run_end);
            st.extents = Some(keys);
        }
        Ok(st.extents.as_deref().unwrap_or(&[]))
    }

    /// Writes `data` at `off` into the committed part of the file: in place where a normal extent
    /// holds the bytes, copy-on-write elsewhere (holes, tiny extents).
    pub(super) async fn write_committed(
        &self,
        f: &OpenFile,
        st: &mut FileState,
        off: u64,
        data: Bytes,
    ) -> FsResult<()> {
        let end = off + data.len() as u64;
        let keys: Vec<ExtentKey> = overlapping(self.extents(f, st).await?, off, end).to_vec();
        // (file offset, partition, extent, extent offset, bytes) to write in place
        let mut pieces = Vec::new();
        let mut cow: Vec<(u64, u64)> = Vec::new(); // file ranges to rewrite
        let mut pos = off;
        for k in &keys {
            let from = k.file_offset.max(off);
            let to = k.end().min(end);
            if from > pos {
                cow.push((pos, from));
            }
            // A tiny extent's range may be shared; a compressed block is rewritten whole.
            if k.extent.is_tiny() || k.framed.is_some() {
                cow.push((from, to));
            } else {
                let mut at = from;
                while at < to {
                    let n = (to - at).min(MAX_PACKET as u64);
                    let piece = data.slice((at - off) as usize..(at - off + n) as usize);
                    let eo = k.extent_offset + (at - k.file_offset);
                    pieces.push((at, k.partition, k.extent, eo, piece));
                    at += n;
                }
            }
            pos = to;
        }
        if pos < end {
            cow.push((pos, end));
        }
        if cow.is_empty() && pieces.len() == 1 {
            // The common small overwrite: one call, without a task of its own.
            if let Some((at, p, e, eo, piece)) = pieces.pop() {
                match self.vol.overwrite(p, e, eo, piece.clone()).await {
                    Ok(()) => {
                        st.times_stale = true;
                        return Ok(());
                    }
                    // The partition cannot take it (a replica's disk is full, it turned
                    // read-only): the bytes go elsewhere, copy-on-write.
                    Err(err) if err.try_elsewhere() => {
                        tracing::debug!(partition = %p, error = %err, "overwrite moved elsewhere");
                        cow.push((at, at + piece.len() as u64));
                    }
                    Err(err) => return Err(fs_err(err)),
                }
            }
        }
        let mut in_place = JoinSet::new();
        for (at, p, e, eo, piece) in pieces {
            let vol = self.vol.clone();
            in_place.spawn(async move {
                let len = piece.len() as u64;
                (at, len, vol.overwrite(p, e, eo, piece).await)
            });
        }
        let mut first_err = None;
        while let Some(r) = in_place.join_next().await {
            match r {
                Ok((_, _, Ok(()))) => {}
                Ok((at, len, Err(err))) if err.try_elsewhere() => {
                    tracing::debug!(error = %err, "overwrite moved elsewhere");
                    cow.push((at, at + len));
                }
                Ok((_, _, Err(err))) => {
                    first_err.get_or_insert(fs_err(err));
                }
                Err(e) => {
                    first_err.get_or_insert(FsError::WriteFailed(e.to_string()));
                }
            }
        }
        if let Some(e) = first_err {
            return Err(e);
        }
        let mut new_keys = Vec::new();
        // When the first piece went to a normal extent: its key must be committed in time.
        let mut streamed: Option<std::time::Instant> = None;
        for (from, to) in cow {
            let piece = data.slice((from - off) as usize..(to - off) as usize);
            if self.compressed() {
                new_keys.extend(self.write_units(f.ino.0 as usize, from, piece).await?);
            } else if piece.len() <= self.cfg.tiny_max {
                new_keys.push(self.write_tiny(from, piece).await?);
            } else {
                streamed.get_or_insert_with(std::time::Instant::now);
                let mut s = SeqWriter::new(self.vol.clone(), from, self.cfg.inflight);
                s.write(piece).await.map_err(fs_err)?;
                new_keys.extend(s.finish().await.map_err(fs_err)?);
            }
        }
        // Pieces moved elsewhere join the holes' ranges out of file order.
        new_keys.sort_by_key(|k| k.file_offset);
        if new_keys.is_empty() {
            st.times_stale = true;
        } else {
            if let Some(at) = streamed {
                commit::within(at, std::time::Instant::now(), self.cfg.commit_within)?;
            }
            let attr = self.meta.append_extents(f.ino, new_keys.clone()).await?;
            st.times_stale = false;
            st.size = st.size.max(attr.size);
            record_keys(st, new_keys);
        }
        Ok(())
    }

    /// Bytes `[off, off + len)` of the committed file (holes as zeros; `len` already clipped).
    pub(super) async fn read_committed(
        &self,
        f: &OpenFile,
        st: &mut FileState,
        off: u64,
        len: u64,
    ) -> FsResult<Bytes> {
        let end = off + len;
        let piece_max = u64::from(self.cfg.read_piece);
        let mut reads = JoinSet::new();
        for k in overlapping(self.extents(f, st).await?, off, end) {
            let from = k.file_offset.max(off);
            let to = k.end().min(end);
            if k.framed.is_some() {
                let (vol, k, dst) = (self.vol.clone(), *k, from - off);
                reads.spawn(async move {
                    let piece = read_framed(&vol, &k, from, to, piece_max).await;
                    (dst, piece)
                });
                continue;
            }
            let mut at = from;
            while at < to {
                let n = (to - at).min(piece_max);
                let vol = self.vol.clone();
                let (p, e, eo) = (
                    k.partition,
                    k.extent,
                    k.extent_offset + (at - k.file_offset),
                );
                let dst = at - off;
                reads.spawn(async move { (dst, vol.read_extent(p, e, eo, n as u32).await) });
                at += n;
            }
        }
        let mut out = vec![0u8; len as usize];
        while let Some(r) = reads.join_next().await {
            let (dst, bytes) =
                r.map_err(|e| FsError::Unavailable(CallError::Unknown(e.to_string())))?;
            let bytes = bytes.map_err(fs_err)?;
            out[dst as usize..dst as usize + bytes.len()].copy_from_slice(&bytes);
        }
        Ok(Bytes::from(out))
    }

    /// Attributes as this client sees them: a file it has open is at least as long as its open
    /// state says (bytes written but not committed yet, or committed after the meta node was
    /// asked), and a hidden (unlinked while open) file has one link less.
    pub(super) async fn overlay(&self, mut attr: Attr) -> Attr {
        if let Some(f) = self.open_file(attr.ino) {
            let st = f.state.lock().await;
            attr.size = attr.size.max(st.size);
            if lock(&f.hidden).is_some() {
                attr.nlink = attr.nlink.saturating_sub(1);
            }
        }
        attr
    }

    /// Renames `parent/name`, a file this client has open, to a hidden name (see the module docs);
    /// not when it is `keep`. Returns the parent's attributes after the rename (when learnt) if
    /// it hid the file, `None` if there was nothing to hide.
    pub(super) async fn hide_if_open(
        &self,
        parent: Ino,
        name: &[u8],
        keep: Option<Ino>,
    ) -> FsResult<Option<Vec<Attr>>> {
        if lock(&self.files).is_empty() {
            return Ok(None);
        }
        let d = match self.meta.lookup_dentry(parent, name).await {
            Ok(d) => d,
            Err(FsError::Meta(MetaError::NotFound)) => return Ok(None),
            Err(e) => return Err(e),
        };
        self.hide_step(HideStep::LookedUp).await;
        let Some(f) = self.open_file(d.ino) else {
            return Ok(None);
        };
        if d.kind != FileType::File || keep == Some(d.ino) {
            return Ok(None);
        }
        if f.opens.load(Ordering::SeqCst) == 0 {
            // Closed, with bytes written behind: a file that `rename` replaces gets them first
            // (an unlink drops them instead, see `unlink`).
            if keep.is_some() {
                let mut st = f.state.lock().await;
                self.flush_file(&f, &mut st).await?;
            }
            return Ok(None);
        }
        let mut hidden = HIDDEN_PREFIX.to_vec();
        hidden.extend_from_slice(d.ino.0.to_string().as_bytes());
        let dirs = self.meta.rename(parent, name, parent, &hidden).await?;
        self.hide_step(HideStep::Renamed).await;
        *lock(&f.hidden) = Some((parent, hidden));
        // The last handle may have been released since the check above, and its release found
        // no hidden name to remove. `release` leaves `files` before it takes `hidden`, and this
        // sets `hidden` before it looks at `files`, so exactly one of the two removes the name.
        let still_open = lock(&self.files)
            .get(&d.ino)
            .is_some_and(|g| Arc::ptr_eq(g, &f) && f.opens.load(Ordering::SeqCst) > 0);
        if !still_open {
            let left = lock(&f.hidden).take();
            if let Some((parent, name)) = left {
                return Ok(Some(self.meta.unlink(parent, &name).await?));
            }
        }
        Ok(Some(dirs))
    }

    pub(super) async fn hide_step(&self, step: HideStep) {
        let hook = lock(&self.hide_hook.0).clone();
        if let Some(hook) = hook {
            hook(step).await;
        }
    }
}

impl Inner {
    /// Appends `data` at `off`, which is the end of the run or (with no run) at or past the end
    /// of the committed file.
    pub(super) async fn extend_run(
        &self,
        f: &OpenFile,
        st: &mut FileState,
        off: u64,
        data: Bytes,
    ) -> FsResult<()> {
        if st.run.is_none() {
            // Continue the stream of an earlier run when the file goes on where it stopped.
            let stream = match st.idle_stream.take() {
                Some((at, s)) if at == off => Some(s),
                _ => None,
            };
            st.run = Some(Run {
                start: off,
                sent: 0,
                buf: BytesMut::new(),
                stream,
                first_sent: None,
            });
        }
        let Some(run) = st.run.as_mut() else {
            return Ok(());
        };
        run.buf.extend_from_slice(&data);
        if !st.pieces.is_empty() {
            st.pieces_bytes -= pieces::cut(&mut st.pieces, off, off + data.len() as u64);
            for b in pieces::take_following(&mut st.pieces, run.end()) {
                st.pieces_bytes -= b.len();
                run.buf.extend_from_slice(&b);
            }
        }
        let end = run.end();
        st.size = st.size.max(end);
        if let Some(fr) = &self.framer {
            // No streams: a run that reaches `FRAMED_RUN_MAX` commits its whole blocks.
            let block = fr.block();
            let whole = (end / block * block).saturating_sub(run.start) as usize;
            if run.buf.len() < FRAMED_RUN_MAX || whole == 0 {
                return Ok(());
            }
            let (start, out) = (run.start, run.buf.split_to(whole).freeze());
            run.start += whole as u64;
            let r = async {
                let keys = self.write_units(f.ino.0 as usize, start, out).await?;
                self.meta.append_extents(f.ino, keys.clone()).await?;
                Ok::<_, FsError>(keys)
            };
            match r.await {
                Ok(keys) => {
                    st.times_stale = false;
                    record_keys(st, keys);
                    return Ok(());
                }
                Err(e) => {
                    // As a failed stream: the run's bytes are lost; reported now and at the
                    // next flush.
                    st.run = None;
                    st.extents = None;
                    st.error = Some(e.to_string());
                    return Err(e);
                }
            }
        }
        if run.buf.len() >= MAX_PACKET
            && (run.stream.is_some() || run.end() - run.start > self.stream_after() as u64)
        {
            let whole = run.buf.len() / MAX_PACKET * MAX_PACKET;
            let out = run.buf.split_to(whole).freeze();
            let stream = run.stream.get_or_insert_with(|| {
                SeqWriter::new(self.vol.clone(), run.start + run.sent, self.cfg.inflight)
            });
            run.sent += out.len() as u64;
            if run.first_sent.is_none() {
                run.first_sent = Some(std::time::Instant::now());
                self.wake_committer();
            }
            if let Err(e) = stream.write(out).await {
                // The run's bytes are lost: drop it, report the error now and at the next flush.
                st.run = None;
                st.extents = None;
                st.error = Some(e.to_string());
                return Err(fs_err(e));
            }
        }
        Ok(())
    }
}

/// The keys of `keys` (sorted, disjoint) that overlap `[from, to)`: found by binary search, so
/// that a write or read costs the same in a file of a million keys as in one of ten.
/// The file bytes `[from, to)` of framed key `k`: its block's frame read whole (in pieces of at
/// most `piece_max`), checked against the key's CRC, decompressed (which checks the block's own
/// checksum), and cut to the range.
async fn read_framed(
    vol: &Arc<NetVolume>,
    k: &ExtentKey,
    from: u64,
    to: u64,
    piece_max: u64,
) -> Result<Bytes, DataCallError> {
    let Some(framed) = k.framed else {
        return Err(bad_frame(k, "not a framed key".into()));
    };
    let stored = u64::from(framed.stored.get());
    let frame = match vol.partition_ec(k.partition) {
        Some(ec) => read_stripe(vol, ec, k, stored).await?,
        None => {
            let mut frame = BytesMut::with_capacity(stored as usize);
            let mut at = 0;
            while at < stored {
                let n = (stored - at).min(piece_max.max(1));
                let got = vol
                    .read_extent(k.partition, k.extent, k.extent_offset + at, n as u32)
                    .await?;
                frame.extend_from_slice(&got);
                at += n;
            }
            frame.freeze()
        }
    };
    if k.crc != 0 && nacre_types::crc32c(&frame) != k.crc {
        return Err(bad_frame(
            k,
            "the frame's CRC does not match its key's".into(),
        ));
    }
    let block =
        nacre_func::block::decompress_block(&frame).map_err(|e| bad_frame(k, e.to_string()))?;
    let start = u64::from(framed.skip) + (from - k.file_offset);
    let end = start + (to - from);
    if end > block.len() as u64 {
        return Err(bad_frame(
            k,
            format!("the key reaches byte {end} of a {}-byte block", block.len()),
        ));
    }
    Ok(block.slice(start as usize..end as usize))
}

/// The `stored` bytes of the stripe key `k` names on erasure-coded partition `k.partition`:
/// its data shards, each from its replica (those past `stored` are zero padding and not read).
/// When one cannot be read (its replica is down or suspect, or its block fails its checksum),
/// or has not answered within [`FIRST_ATTEMPT`](crate::net::FIRST_ATTEMPT) (a replica cut off answers nothing until the
/// call times out; it is then suspect, and later reads skip it for a while), the other shards are
/// read too, and the stripe is reconstructed in the client from the first `k` that arrive.
///
/// Fewer than `k` shards readable (a node restarting while another is slow) is ridden out: the
/// stripe is read again, with growing pauses, for the volume's `retry_for` (15 s), before the
/// read fails.
async fn read_stripe(
    vol: &Arc<NetVolume>,
    ec: EcSpec,
    k: &ExtentKey,
    stored: u64,
) -> Result<Bytes, DataCallError> {
    let until = tokio::time::Instant::now() + vol.retry_for;
    let mut pause = std::time::Duration::from_millis(100);
    loop {
        match read_stripe_once(vol, ec, k, stored).await {
            Err(Short(e)) if tokio::time::Instant::now() + pause < until => {
                tracing::debug!(partition = %k.partition, extent = %k.extent, error = %e, "too few shards readable; reading the stripe again");
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(std::time::Duration::from_secs(1));
            }
            Err(Short(e) | Final(e)) => return Err(e),
            Ok(b) => return Ok(b),
        }
    }
}

/// Why a stripe could not be read: too few shards could be (`Short`, worth another try), or
/// what was read does not decode (`Final`).
enum StripeError {
    Short(DataCallError),
    Final(DataCallError),
}
use StripeError::{Final, Short};

async fn read_stripe_once(
    vol: &Arc<NetVolume>,
    ec: EcSpec,
    k: &ExtentKey,
    stored: u64,
) -> Result<Bytes, StripeError> {
    let at = StripeAt::of_key(ec, k.extent_offset, stored);
    let addrs = vol.replica_addrs(k.partition);
    let (data, total) = (usize::from(ec.k), ec.total());
    if addrs.len() != total {
        return Err(Final(bad_frame(
            k,
            format!("the view lists {} replicas for {total} shards", addrs.len()),
        )));
    }
    let len = at.shard_len as u32;
    let mut slots: Vec<Option<Bytes>> = vec![None; total];
    let mut asked = vec![false; total];
    let mut reads = JoinSet::new();
    let read = |reads: &mut JoinSet<_>, asked: &mut [bool], i: usize| {
        asked[i] = true;
        let (vol, addr, (p, e)) = (vol.clone(), addrs[i].clone(), (k.partition, k.extent));
        reads.spawn(async move { (i, vol.read_shard(p, &addr, e, at.base, len).await) });
    };
    let mut degraded = false;
    for (i, slot) in slots.iter_mut().enumerate().take(data) {
        if i as u64 * at.shard_len >= stored {
            *slot = Some(Bytes::from(vec![0u8; len as usize]));
        } else if vol.is_suspect(&addrs[i]) {
            degraded = true;
        } else {
            read(&mut reads, &mut asked, i);
        }
    }
    let hedge = tokio::time::sleep(crate::net::FIRST_ATTEMPT);
    tokio::pin!(hedge);
    let mut last = None;
    loop {
        let have_data = slots[..data].iter().all(Option::is_some);
        let present = slots.iter().filter(|s| s.is_some()).count();
        if have_data || (degraded && present >= data) {
            break;
        }
        if degraded {
            for i in 0..total {
                if !asked[i] && slots[i].is_none() {
                    read(&mut reads, &mut asked, i);
                }
            }
        }
        tokio::select! {
            r = reads.join_next() => match r {
                None => break,
                Some(Ok((i, Ok(b)))) => slots[i] = Some(b),
                Some(Ok((_, Err(e)))) => {
                    last = Some(e);
                    degraded = true;
                }
                Some(Err(e)) => {
                    last = Some(DataCallError::Call(CallError::Unknown(e.to_string())));
                    degraded = true;
                }
            },
            () = &mut hedge, if !degraded => {
                // Replicas that have not answered a read in that long are most likely down or
                // cut off: later reads go around them at once, for a while.
                for i in 0..data {
                    if asked[i] && slots[i].is_none() {
                        vol.mark_suspect(&addrs[i]);
                    }
                }
                degraded = true;
            }
        }
    }
    if slots[..data].iter().all(Option::is_some) {
        let mut frame = BytesMut::with_capacity(stored as usize);
        for s in slots[..data].iter().flatten() {
            frame.extend_from_slice(s);
        }
        frame.truncate(stored as usize);
        return Ok(frame.freeze());
    }
    let present = slots.iter().filter(|s| s.is_some()).count();
    if present < data {
        return Err(Short(last.unwrap_or(DataCallError::NoWritablePartition)));
    }
    tracing::debug!(
        partition = %k.partition, extent = %k.extent, base = at.base, present,
        "a stripe read degraded, reconstructing it"
    );
    nacre_func::ec_reconstruct(ec, slots, stored).map_err(|e| Final(bad_frame(k, e.to_string())))
}

fn bad_frame(k: &ExtentKey, why: String) -> DataCallError {
    DataCallError::BadFrame {
        partition: k.partition,
        extent: k.extent,
        offset: k.extent_offset,
        why,
    }
}

pub(super) fn overlapping(keys: &[ExtentKey], from: u64, to: u64) -> &[ExtentKey] {
    let first = keys.partition_point(|k| k.end() <= from);
    let last = keys.partition_point(|k| k.file_offset < to).max(first);
    &keys[first..last]
}

/// Keeps the cached keys of a file in step with keys just committed, as the meta partition
/// records them ([`overlay_all`]), rather than fetching them all again.
pub(super) fn record_keys(st: &mut FileState, keys: Vec<ExtentKey>) {
    if let Some(cached) = st.extents.as_mut() {
        overlay_all(cached, &keys, &mut Vec::new());
    }
}
