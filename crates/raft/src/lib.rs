//! Replication for nacre: many Raft groups per node on tikv's `raft` (RawNode) with one shared log.
//!
//! This crate is built bottom-up. Present today:
//! - [`LogStore`]: the durable log of every group on a node, written in atomic multi-group batches so
//!   one `fdatasync` covers every group that has something to persist (group commit), with an
//!   in-memory implementation that can simulate crashes ([`MemLogStore`]) and one on `raft-engine`
//!   ([`EngineLogStore`]).
//!
//! - [`RaftNode`]: the synchronous raft store of one node — every group it hosts advanced by one tick
//!   and one `Ready` round that persists all groups with a single log write, applies committed entries
//!   to each group's [`StateMachine`] and reports proposal outcomes; snapshots and log compaction.
//!
//! Still to come: the driver that runs a `RaftNode` on its own thread over the messenger (per-peer
//! message batching, hibernation of idle groups), linearizable reads, leader transfer and membership
//! change exposed to the master, and the benchmark.

mod engine_log;
mod log;
mod mem_log;
mod node;
mod storage;
pub mod store;
mod timed_log;

pub use engine_log::EngineLogStore;
pub use log::{GroupId, GroupState, GroupWrite, LogError, LogStore, LogWrite};
pub use mem_log::MemLogStore;
pub use node::{
    Barrier, BarrierError, EarlyOutput, INIT_INDEX, INIT_TERM, LogJob, NodeConfig, PendingBarrier,
    ProposalId, RaftError, RaftNode, ReadGate, ReadyOutput, RestoreError, StateMachine, Written,
};
pub use storage::GroupStorage;
pub use store::{RaftHandle, StoreConfig, StoreStatus};

/// The Raft protocol types (entries, hard state, conf state, messages) of tikv `raft`.
pub use raft::eraftpb;
