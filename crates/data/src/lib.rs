//! nacre data partitions (DESIGN.md §7): the extent store ([`store::ExtentStore`], synchronous IO
//! behind the [`io::Disk`] trait), scenario-aware replication (primary-backup appends, Raft
//! overwrites) and the data node service.

pub mod io;
pub mod repl;
pub mod rpc;
pub mod service;
pub mod sm;
pub mod store;

pub use rpc::DataError;
pub use service::{DataMetrics, DataNode, DataNodeConfig};
