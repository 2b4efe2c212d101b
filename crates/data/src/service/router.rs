//! The messenger ops of a data node: one named handler per op. Ops a client sends go to the
//! partition's leader (each handler checks [`DataNode::lead`]); `Replicate`, `ListExtents`,
//! `BlockCrcs` and `FetchBlocks` are replica-to-replica and answered by any replica.

use std::collections::HashMap;
use std::sync::atomic::Ordering;

use nacre_msgr::{Incoming, Payload, Router};
use nacre_proto::msg::RemoteError;
use nacre_proto::msg::raft::RaftBatchRpc;
use nacre_types::ExtentId;
use nacre_types::sync::lock;

use super::DataMetrics;
use super::append::Track;
use super::{DataNode, unavailable};
use crate::sm::{DataCommand, store_error};
use crate::store::ExtentStore;
use nacre_api::data::*;

/// A handler's answer: the op's response and the data segment sent with it.
type Reply<T> = Result<(T, Payload), RemoteError>;

impl DataNode {
    /// The gauges of [`super::DataNodeConfig::metrics`], if any.
    pub fn metrics(&self) -> Option<&DataMetrics> {
        self.inner.config.metrics.as_ref()
    }

    /// The messenger ops of a data node: its raft traffic and the data ops. The agent's ops are
    /// separate (`nacre_cluster::node_router`).
    pub fn router(&self) -> Router {
        let raft_in = self.clone();
        Router::new()
            .route::<RaftBatchRpc, _, _>(move |batch, _inc| {
                if let Some(raft) = raft_in.inner.raft.get() {
                    raft.deliver(batch);
                }
                async { Ok(((), Payload::none())) }
            })
            .route::<CreateExtent, _, _>(handler(self, create_extent))
            .route::<Append, _, _>(handler(self, append))
            .route::<AppendRaft, _, _>(handler(self, append_raft))
            .route::<WriteTiny, _, _>(handler(self, write_tiny))
            .route::<WriteShard, _, _>(handler(self, write_shard))
            .route::<Overwrite, _, _>(handler(self, overwrite))
            .route::<Read, _, _>(handler(self, read))
            .route::<Release, _, _>(handler(self, release))
            .route::<Replicate, _, _>(handler(self, replicate))
            .route::<ListExtents, _, _>(handler(self, list_extents))
            .route::<BlockCrcs, _, _>(handler(self, block_crcs))
            .route::<FetchBlocks, _, _>(handler(self, fetch_blocks))
            .route::<Sweep, _, _>(handler(self, sweep))
    }
}

/// A route's function: `f` called with (a clone of) the node.
fn handler<Req, Fut, F>(
    node: &DataNode,
    f: F,
) -> impl Fn(Req, Incoming) -> Fut + Send + Sync + 'static
where
    Req: 'static,
    Fut: 'static,
    F: Fn(DataNode, Req, Incoming) -> Fut + Send + Sync + 'static,
{
    let node = node.clone();
    move |req, inc| f(node.clone(), req, inc)
}

async fn create_extent(
    node: DataNode,
    req: CreateExtentRequest,
    _inc: Incoming,
) -> Reply<Result<ExtentId, DataError>> {
    let part = node.hosted_part(req.partition)?;
    node.lead(&part).await?;
    if let Some(why) = part.degraded() {
        return Ok((Err(DataError::ReadOnly(why)), Payload::none()));
    }
    let out = node.propose(&part, &DataCommand::CreateExtent).await?;
    let out =
        out.and_then(|id| id.ok_or_else(|| DataError::Io("create returned no extent".into())));
    if let Ok(id) = out {
        DataNode::gc_touch(&part, id);
        lock(&part.tracks)
            .entry(id)
            .or_insert_with(|| Track::new(0, 0));
    }
    Ok((out, Payload::none()))
}

async fn append(
    node: DataNode,
    req: AppendRequest,
    inc: Incoming,
) -> Reply<Result<Written, DataError>> {
    let part = node.hosted_part(req.partition)?;
    node.lead(&part).await?;
    let (extent, offset) = (req.extent, req.offset);
    DataNode::gc_touch(&part, extent);
    let out = node.append(&part, req, inc.data).await;
    if let Err(e) = &out {
        tracing::debug!(partition = %part.id, %extent, offset, error = %e, "append refused");
    }
    Ok((out, Payload::none()))
}

async fn append_raft(
    node: DataNode,
    req: AppendRequest,
    inc: Incoming,
) -> Reply<Result<Written, DataError>> {
    let part = node.hosted_part(req.partition)?;
    node.lead(&part).await?;
    DataNode::gc_touch(&part, req.extent);
    let out = node.append_raft(&part, req, inc.data).await?;
    Ok((out, Payload::none()))
}

async fn write_tiny(
    node: DataNode,
    req: WriteTinyRequest,
    inc: Incoming,
) -> Reply<Result<Written, DataError>> {
    let part = node.hosted_part(req.partition)?;
    node.lead(&part).await?;
    Ok((node.write_tiny(&part, inc.data).await, Payload::none()))
}

async fn write_shard(
    node: DataNode,
    req: WriteShardRequest,
    inc: Incoming,
) -> Reply<Result<Written, DataError>> {
    let part = node.hosted_part(req.partition)?;
    node.lead(&part).await?;
    Ok((
        node.write_shard(&part, req.extent, req.offset, inc.data)
            .await,
        Payload::none(),
    ))
}

async fn overwrite(
    node: DataNode,
    req: OverwriteRequest,
    inc: Incoming,
) -> Reply<Result<(), DataError>> {
    let part = node.hosted_part(req.partition)?;
    node.lead(&part).await?;
    DataNode::gc_touch(&part, req.extent);
    let out = node.overwrite(&part, req, inc.data).await?;
    Ok((out, Payload::none()))
}

async fn read(node: DataNode, req: ReadRequest, _inc: Incoming) -> Reply<Result<(), DataError>> {
    let part = node.hosted_part(req.partition)?;
    node.lead(&part).await?;
    // Every overwrite committed before the read is applied here before it is served: at once while
    // the read gate is open (this leader holds its lease and has applied everything committed),
    // else through a read round on the Raft thread.
    let open = part
        .gate
        .as_ref()
        .is_some_and(|g| g.open_at(std::time::Instant::now()));
    if !open {
        let raft = node.raft().map_err(unavailable)?;
        raft.read(part.id.0, |_| ())
            .await
            .map_err(|e| node.remote(&part, e))?;
    }
    part.ops.fetch_add(1, Ordering::Relaxed);
    match node.read(&part, &req).await {
        Ok(b) => Ok((Ok(()), Payload::new(b))),
        Err(e) => Ok((Err(e), Payload::none())),
    }
}

async fn release(
    node: DataNode,
    req: ReleaseRequest,
    _inc: Incoming,
) -> Reply<Result<(), DataError>> {
    let part = node.hosted_part(req.partition)?;
    node.lead(&part).await?;
    let ranges = match part.ec {
        Some(ec) => nacre_api::shards::shard_ranges(ec, &req.ranges),
        None => req.ranges.clone(),
    };
    let out = node
        .propose(&part, &DataCommand::Release { ranges })
        .await?;
    if out.is_ok() {
        let mut t = lock(&part.tracks);
        for (e, _, _) in &req.ranges {
            if !ExtentStore::is_tiny(*e) {
                t.remove(e);
            }
        }
    }
    Ok((out.map(|_| ()), Payload::none()))
}

async fn replicate(
    node: DataNode,
    req: ReplicateRequest,
    inc: Incoming,
) -> Reply<Result<(), DataError>> {
    let part = node.hosted_part(req.partition)?;
    let (extent, offset) = (req.extent, req.offset);
    DataNode::gc_touch(&part, extent);
    let out = node.take_replica(&part, req, inc.data).await;
    if let Err(e) = &out {
        tracing::debug!(partition = %part.id, %extent, offset, error = %e, "replica refused a packet");
    }
    Ok((out, Payload::none()))
}

async fn list_extents(
    node: DataNode,
    req: ListExtentsRequest,
    _inc: Incoming,
) -> Reply<Result<ExtentList, DataError>> {
    let part = node.hosted_part(req.partition)?;
    // A full follower cannot take its leader's appends: it does not answer as a healthy replica
    // (`room`). A leader answers its followers' repairs all the same.
    if node.disk_full() && !matches!(node.leader_term(&part).await, Ok(Some(_))) {
        let e = DataError::ReadOnly(super::room::FULL.into());
        return Ok((Err(e), Payload::none()));
    }
    let applied = part.shared.applied();
    let known: HashMap<ExtentId, u64> = lock(&part.tracks)
        .iter()
        .map(|(e, t)| (*e, t.committed()))
        .collect();
    let extents = part
        .store
        .extents()
        .into_iter()
        .map(|(e, len)| (e, len, known.get(&e).copied().unwrap_or(0)))
        .collect();
    Ok((Ok(ExtentList { extents, applied }), Payload::none()))
}

async fn block_crcs(
    node: DataNode,
    req: BlockCrcsRequest,
    _inc: Incoming,
) -> Reply<Result<(u32, Vec<u32>, u64), DataError>> {
    let part = node.hosted_part(req.partition)?;
    let applied = part.shared.applied();
    let out = part
        .store
        .block_crcs(req.extent)
        .map(|c| (part.store.block_size(), c, applied))
        .map_err(store_error);
    Ok((out, Payload::none()))
}

async fn fetch_blocks(
    node: DataNode,
    req: FetchBlocksRequest,
    _inc: Incoming,
) -> Reply<Result<u64, DataError>> {
    let part = node.hosted_part(req.partition)?;
    match node.fetch_local(&part, &req) {
        Ok((applied, data)) => Ok((Ok(applied), Payload::new(data))),
        Err(e) => Ok((Err(e), Payload::none())),
    }
}

async fn sweep(
    node: DataNode,
    req: SweepRequest,
    _inc: Incoming,
) -> Reply<Result<Vec<SweepReport>, DataError>> {
    let grace = std::time::Duration::from_millis(req.grace_ms);
    Ok((node.sweep_now(req.partition, grace).await, Payload::none()))
}
