//! The nacre master (resource manager): the cluster map as a pure state machine, utilization-based
//! placement, volumes and their partitions, the master service replicated by Raft, the client that
//! follows its leader, and the node-side agent that registers and heartbeats.

pub mod admin;
pub mod agent;
pub mod client;
pub mod map;
pub mod placement;
pub mod rpc;
pub mod service;

pub use client::MasterClient;
pub use map::{ClusterMap, Command, MapError, Outcome};
pub use placement::{Candidate, PlacementError, place};
pub use service::{MASTER_GROUP, Master, MasterConfig, MasterError, MasterSm};
