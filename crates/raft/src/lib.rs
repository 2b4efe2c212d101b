//! Replication for nacre: many Raft groups per node on tikv's `raft` (RawNode) with one shared log.
//!
//! This crate is built bottom-up. Present today:
//! - [`LogStore`]: the durable log of every group on a node, written in atomic multi-group batches so
//!   one `fdatasync` covers every group that has something to persist (group commit), with an
//!   in-memory implementation that can simulate crashes ([`MemLogStore`]) and one on `raft-engine`
//!   ([`EngineLogStore`]).
//!
//! The raft store itself (one tick wheel, one `Ready` loop for all groups, per-peer message batching,
//! hibernation, state machines, reads, membership change, snapshots) builds on these.

mod engine_log;
mod log;
mod mem_log;

pub use engine_log::EngineLogStore;
pub use log::{GroupId, GroupState, GroupWrite, LogError, LogStore, LogWrite};
pub use mem_log::MemLogStore;

/// The Raft protocol types (entries, hard state, conf state, messages) of tikv `raft`.
pub use raft::eraftpb;
