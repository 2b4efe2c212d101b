//! The nacre client SDK (DESIGN.md §8): the volume view and partition routing, and the CFS
//! metadata workflows over meta partitions. The data path and the `FileSystem` trait join it with
//! the data node and client issues.

pub mod data;
pub mod meta;
pub mod net;

pub use data::{DataCallError, SeqWriter};
pub use meta::{CallError, FsError, FsResult, MetaFs, MetaRange, MetaTransport, NewInode};
pub use net::{DataPartitionInfo, NetVolume};
