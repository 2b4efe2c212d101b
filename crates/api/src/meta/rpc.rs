//! Meta node ops (`0x02xx`): a command or a query addressed to one meta partition.

use nacre_proto::Op;
use nacre_proto::msg::Rpc;
use nacre_types::PartitionId;
use serde::{Deserialize, Serialize};

use super::{Command, MetaError, Query, Reply};

/// Applies a command through the partition's Raft group (served by its leader; op `0x0201`).
#[derive(Debug)]
pub struct MetaWrite;

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct WriteRequest {
    pub partition: PartitionId,
    pub cmd: Command,
}

impl Rpc for MetaWrite {
    const OP: Op = Op(0x0201);
    const NAME: &'static str = "meta_write";
    type Request = WriteRequest;
    /// The partition's answer; not-leader, unknown partition and timeouts are error frames.
    type Response = Result<Reply, MetaError>;
}

/// Reads a partition linearizably on its leader (op `0x0202`).
#[derive(Debug)]
pub struct MetaRead;

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ReadRequest {
    pub partition: PartitionId,
    pub query: Query,
}

impl Rpc for MetaRead {
    const OP: Op = Op(0x0202);
    const NAME: &'static str = "meta_read";
    type Request = ReadRequest;
    type Response = Result<Reply, MetaError>;
}
