//! What every meta and data node shares (docs/design.md §5): the agent that registers the node with
//! the master, heartbeats and reconciles the partitions it hosts with the master's assignment
//! ([`agent`]); what a node keeps on disk about itself ([`registry`]); and the node lifecycle — a
//! raft store started under the id the master assigned, and the loop of periodic duties ([`node`]).

pub mod agent;
pub mod node;
pub mod registry;

pub use agent::{AgentConfig, PartitionHost, node_router, reconcile, run_agent};
pub use nacre_msgr::BoxFuture;
pub use node::{NodeDuties, NodeRaft, NodeRaftError, run_node};
pub use registry::{SpecRegistry, read_node_id, write_node_id};
