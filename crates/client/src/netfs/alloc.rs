//! `fallocate` of an open file ([`Falloc`]). nacre allocates lazily: data nodes take space when
//! bytes are written, so no mode reserves any. Mode 0 and `KeepSize` check that the volume has
//! at least as many bytes free as they ask for past the end of the file (one request to the
//! master; skipped when it cannot answer) and answer `NoSpace` otherwise; mode 0 then grows
//! the size. Punching a hole (`PunchHole`, `ZeroRange`) is one `Fallocate` command on the meta
//! node: the range leaves the file's extent keys, so it reads as zeros, and the bytes no key
//! refers to any more are freed on the data nodes, as truncated ones are.

use super::*;
use crate::fs::Falloc;

impl Inner {
    pub(super) async fn fallocate(
        &self,
        fh: Fh,
        mode: Falloc,
        offset: u64,
        len: u64,
    ) -> FsResult<()> {
        let h = self.handle(fh)?;
        if !h.flags.write {
            return Err(FsError::NotOpenFor("writing"));
        }
        let Some(end) = offset.checked_add(len).filter(|_| len > 0) else {
            return Err(FsError::Meta(MetaError::Invalid(format!(
                "fallocate of {len} bytes at {offset}"
            ))));
        };
        let f = h.file;
        let mut st = f.state.lock().await;
        // The run's keys must be committed before the meta node cuts or extends them.
        self.flush_file(&f, &mut st).await?;
        if matches!(mode, Falloc::Allocate | Falloc::KeepSize) {
            let attr = self.meta.getattr(f.ino).await?;
            match attr.kind {
                FileType::File => {}
                FileType::Dir => return Err(FsError::Meta(MetaError::IsDir)),
                _ => {
                    return Err(FsError::Meta(MetaError::Invalid(
                        "fallocate of a non-regular file".into(),
                    )));
                }
            }
            let wanted = end.saturating_sub(attr.size.max(st.size));
            if wanted > 0
                && let Ok((total, used)) = self.vol.space().await
            {
                let free = total.saturating_sub(used);
                if free < wanted {
                    return Err(FsError::NoSpace { wanted, free });
                }
            }
            if mode == Falloc::KeepSize {
                // Nothing to record.
                return Ok(());
            }
        }
        let r = self
            .meta
            .fallocate(f.ino, (offset, len), mode.punches(), mode.keeps_size())
            .await;
        // Whatever the outcome (an unknown one may have been applied), the cached keys and
        // bytes may be stale, and a stream kept to continue an extent may now point into freed
        // bytes.
        st.extents = None;
        st.ahead = None;
        st.idle_stream = None;
        st.size = r?.size;
        Ok(())
    }
}
