//! nacre meta partitions (DESIGN.md §6): the inode and dentry trees of one inode range as a pure
//! state machine ([`partition::MetaPartition`]), replicated by one Raft group per partition on the
//! meta nodes.

pub mod ops;
pub mod partition;
pub mod rpc;
pub mod service;

pub use ops::{
    Attr, Command, Dentry, DirEntry, ExtentKey, FileType, MetaError, PartitionStats, Query,
    ROOT_INO, Reply, SetAttr, XattrMode, without_suidgid,
};
pub use partition::MetaPartition;
pub use service::{MetaNode, MetaNodeConfig, MetaSm};
