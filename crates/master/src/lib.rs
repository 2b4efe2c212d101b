//! The nacre master (resource manager): the cluster map as a pure state machine, utilization-based
//! placement, volumes and their partitions, the master service replicated by Raft, and the admin
//! operations the CLI and the HTTP API share. The messages nodes and clients send the master are in
//! `nacre_api::master`; the client that follows the leader is `nacre_client::MasterClient`; the
//! node-side agent is `nacre-cluster`.

pub mod admin;
pub mod map;
pub mod placement;
pub mod rpc;
pub mod service;

pub use map::{ClusterMap, Command, Outcome};
pub use nacre_api::master::{MapError, MasterError, PlacementError};
pub use placement::{Candidate, place};
pub use rpc::MasterAdmin;
pub use service::{MASTER_GROUP, Master, MasterConfig, MasterSm};
