//! The nacre client SDK (docs/design.md §8): the volume view and partition routing, the CFS metadata
//! workflows over meta partitions, the data path, the [`FileSystem`] trait with the network
//! file system ([`NetFs`]) at the bottom of every stack of layers, and storage function calls,
//! inline or on the function servers ([`FuncClient`]).

pub mod data;
pub mod fs;
pub mod func;
pub mod layers;
pub mod master;
pub mod meta;
pub mod net;
pub mod netfs;
pub mod task;

pub use data::{DataCallError, SeqWriter};
pub use fs::{Caller, DirEntryPlus, Falloc, Fh, FileSystem, OpenFlags, StatFs};
pub use func::{FuncAt, FuncCallError, FuncClient, FuncClientConfig, FuncPolicy, InstanceState};
pub use layers::{MetaCache, MetaCacheConfig, Metrics};
pub use master::MasterClient;
pub use meta::{CallError, Entry, FsError, FsResult, MetaFs, MetaRange, MetaTransport, NewInode};
pub use net::{DataPartitionInfo, NetVolume};
pub use netfs::{HideHook, HideStep, NetFs, NetFsConfig};

/// A client's number for the partitions' sessions (never 0), different in every process and
/// every call. A random number without a random number crate: the standard library seeds every
/// `RandomState` from the operating system.
pub(crate) fn random_client_id() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    h.write_u128(u128::from(std::process::id()) ^ now);
    h.finish().max(1)
}
