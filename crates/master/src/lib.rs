//! The nacre master (resource manager): the cluster map as a pure state machine, utilization-based
//! placement, volumes and their partitions.
//!
//! In progress: the map and placement are here; the master service (Raft-replicated through
//! `nacre-raft`, node registration over the messenger, the admin API) builds on them.

pub mod map;
pub mod placement;
pub mod service;

pub use map::{ClusterMap, Command, MapError, Outcome};
pub use placement::{Candidate, PlacementError, place};
pub use service::{MASTER_GROUP, Master, MasterClient, MasterError, MasterSm};
