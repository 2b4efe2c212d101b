//! nacre data partitions (docs/design.md §7): the extent store ([`store::ExtentStore`], synchronous IO
//! behind the [`io::Disk`] trait), scenario-aware replication (primary-backup appends, whose
//! decisions are the pure state machine [`repl::Replication`]; Raft overwrites) and the data node
//! service.

pub mod io;
pub mod repl;
pub mod service;
pub mod sm;
pub mod store;

pub use service::{DataMetrics, DataNode, DataNodeConfig, ScrubReport};
