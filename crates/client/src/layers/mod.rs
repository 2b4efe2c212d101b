//! Layers over a [`FileSystem`](crate::FileSystem) (docs/design.md §8): each wraps another file system
//! and is one itself, so a client is a stack such as `Metrics<MetaCache<NetFs>>`.
//!
//! - [`Metrics`] counts calls, errors, latency and bytes per operation (Prometheus).
//! - [`MetaCache`] answers `getattr` and `lookup` from a bounded, short-lived cache of attributes
//!   and dentries, and invalidates what every mutation passing through it may change.

pub mod cache;
pub mod metrics;

pub use cache::{CacheStats, MetaCache, MetaCacheConfig};
pub use metrics::{Metrics, Op};
