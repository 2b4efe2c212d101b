//! nacre meta partitions (docs/design.md §6): the inode and dentry trees of one inode range as a pure
//! state machine ([`partition::MetaPartition`]), replicated by one Raft group per partition on the
//! meta nodes.

pub mod partition;
pub mod service;

/// The partition's vocabulary (attributes, commands, queries, errors) and its RPCs live in
/// `nacre-api`, where clients find them without linking this crate.
pub use nacre_api::meta as ops;
pub use nacre_api::meta::rpc;

pub use ops::{
    Attr, Command, Dentry, DirEntry, ExtentKey, FileType, MetaError, PartitionStats, Query,
    ROOT_INO, Reply, SetAttr, XattrMode, without_suidgid,
};
pub use partition::MetaPartition;
pub use service::{MetaNode, MetaNodeConfig, MetaSm};
