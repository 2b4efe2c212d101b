//! Operations that go through the partition's Raft group: overwrites, Raft appends, and reads
//! (served by the leader, never past the committed offset).

use bytes::Bytes;
use nacre_msgr::Payload;
use nacre_proto::msg::RemoteError;
use nacre_types::{ErrorCode, ExtentId};

use super::append::check_packet;
use super::{DataNode, Part, unavailable};
use crate::sm::{DataCommand, store_error};
use crate::store::StoreError;
use nacre_api::data::*;

/// Most reads of a request that finds a bad block, each after a repair or a pause.
const READ_REPAIRS: usize = 10;
/// How long a read waits for a replica that can repair a bad block.
const READ_REPAIR_FOR: std::time::Duration = std::time::Duration::from_secs(5);

impl DataNode {
    pub(super) async fn overwrite(
        &self,
        part: &Part,
        req: OverwriteRequest,
        data: Payload,
    ) -> Result<Result<(), DataError>, RemoteError> {
        if let Err(e) = check_packet(&data) {
            return Ok(Err(e));
        }
        let len = data.bytes.len() as u64;
        let committed = match self.leader_track(part, req.extent).await {
            Ok(t) => t.committed(),
            Err(e) => return Ok(Err(e)),
        };
        if req.offset.saturating_add(len) > committed {
            return Ok(Err(DataError::OutOfRange {
                extent: req.extent,
                offset: req.offset,
                len,
                committed,
            }));
        }
        let cmd = DataCommand::Overwrite {
            extent: req.extent,
            offset: req.offset,
            data: data.bytes.clone(),
        };
        let out = self.propose(part, &cmd).await?;
        if out.is_ok() {
            self.count(part, data.bytes.len());
        }
        Ok(out.map(|_| ()))
    }

    pub(super) async fn append_raft(
        &self,
        part: &Part,
        req: AppendRequest,
        data: Payload,
    ) -> Result<Result<Written, DataError>, RemoteError> {
        if let Err(e) = check_packet(&data) {
            return Ok(Err(e));
        }
        let track = match self.leader_track(part, req.extent).await {
            Ok(t) => t,
            Err(e) => return Ok(Err(e)),
        };
        let len = data.bytes.len() as u64;
        let cmd = DataCommand::Append {
            extent: req.extent,
            offset: req.offset,
            data: data.bytes.clone(),
        };
        let out = self.propose(part, &cmd).await?;
        Ok(out.map(|_| {
            track.next.send_if_modified(|n| {
                let grew = req.offset + len > *n;
                *n = (*n).max(req.offset + len);
                grew
            });
            track.commit(req.offset + len);
            self.count(part, data.bytes.len());
            Written {
                extent: req.extent,
                offset: req.offset,
                committed: track.committed(),
            }
        }))
    }

    pub(super) async fn propose(
        &self,
        part: &Part,
        cmd: &DataCommand,
    ) -> Result<Result<Option<ExtentId>, DataError>, RemoteError> {
        let raft = self.raft().map_err(unavailable)?;
        let bytes = postcard::to_allocvec(cmd)
            .map_err(|e| RemoteError::new(ErrorCode::BadRequest, e.to_string()))?;
        let out = raft
            .propose(part.id.0, bytes)
            .await
            .map_err(|e| self.remote(part, e))?;
        postcard::from_bytes::<Result<Option<ExtentId>, DataError>>(&out)
            .map_err(|e| unavailable(format!("bad result: {e}")))
    }

    /// Reads committed bytes on the leader, verifying block CRCs; a bad block is fetched from a
    /// follower, rewritten here and the read retried (`READ_REPAIRS` times at most, for
    /// `READ_REPAIR_FOR`).
    pub(super) async fn read(&self, part: &Part, req: &ReadRequest) -> Result<Bytes, DataError> {
        if part.is_rebuilding() {
            return Err(DataError::ReadOnly(super::REBUILDING.into()));
        }
        let committed = self.leader_track(part, req.extent).await?.committed();
        let end = req.offset.saturating_add(u64::from(req.len));
        if end > committed {
            return Err(DataError::OutOfRange {
                extent: req.extent,
                offset: req.offset,
                len: u64::from(req.len),
                committed,
            });
        }
        // A replica that could supply the block may be restarting or catching up: the repair is
        // tried again, with a growing pause, for `READ_REPAIR_FOR` before the read fails.
        let deadline = std::time::Instant::now() + READ_REPAIR_FOR;
        let mut pause = std::time::Duration::from_millis(50);
        for _ in 0..READ_REPAIRS {
            match part.store.read(req.extent, req.offset, req.len) {
                Ok(b) => return Ok(b),
                // A replica of an erasure-coded partition is alone in its group: the reader
                // rebuilds the shard from the others.
                Err(StoreError::Corrupt { block, .. }) if part.ec.is_some() => {
                    tracing::error!(
                        partition = %part.id, extent = %req.extent, block,
                        "checksum mismatch on read of a shard"
                    );
                    return Err(DataError::Corrupt {
                        extent: req.extent,
                        block,
                    });
                }
                Err(StoreError::Corrupt { block, .. }) => {
                    tracing::error!(
                        partition = %part.id, extent = %req.extent, block,
                        "checksum mismatch on read; repairing from a replica"
                    );
                    match self
                        .repair_block_from_followers(part, req.extent, block)
                        .await
                    {
                        Ok(()) => {}
                        Err(e) if std::time::Instant::now() + pause >= deadline => return Err(e),
                        Err(_) => {
                            tokio::time::sleep(pause).await;
                            pause = (pause * 2).min(std::time::Duration::from_secs(1));
                        }
                    }
                }
                Err(e) => return Err(store_error(e)),
            }
        }
        Err(DataError::Corrupt {
            extent: req.extent,
            block: req.offset / u64::from(part.store.block_size()),
        })
    }
}
