//! nacre meta partitions (DESIGN.md §6): the inode and dentry trees of one inode range as a pure
//! state machine ([`partition::MetaPartition`]), replicated by one Raft group per partition on the
//! meta nodes.

pub mod ops;
pub mod partition;

pub use ops::{
    Attr, Command, Dentry, DirEntry, ExtentKey, FileType, MetaError, PartitionStats, Query, Reply,
    ROOT_INO, SetAttr, XattrMode,
};
pub use partition::MetaPartition;
