//! nacre meta partitions (docs/design.md §6): the inode and dentry trees of one inode range as a pure
//! state machine ([`partition::MetaPartition`]), replicated by one Raft group per partition on the
//! meta nodes. The partition's vocabulary — attributes, commands, queries, errors and the RPCs —
//! is `nacre_api::meta`, where clients find it without linking this crate.

pub mod partition;
pub mod service;

pub use partition::MetaPartition;
pub use service::{MetaNode, MetaNodeConfig, MetaSm};
