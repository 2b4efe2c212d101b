//! The func role (docs/design.md §1, §9): a stateless server that applies storage functions for
//! callers over the messenger, and its registration with the master.
//!
//! - [`FuncServer`] serves [`nacre_api::func::Apply`] with [`nacre_func::apply`], the same code a
//!   caller runs inline. Functions are CPU-bound, so they run on blocking threads, at most
//!   `workers` at once; at most `max_inflight` calls are admitted (running or waiting for a
//!   worker), and a call beyond that is refused at once with `Unavailable` — the caller tries
//!   another instance — rather than queued without bound. Calls, bytes, errors, refusals and busy
//!   time are counted in [`FuncMetrics`] (`nacre_func_*`).
//! - [`run_func_agent`] registers the server with the master (address, functions, capacity) and
//!   heartbeats with its load (calls outstanding, calls/s); the master marks a silent instance
//!   down like any node, and callers (`nacre_client::FuncClient`) use the instances it lists up.
//!
//! This crate sits above `nacre-client` (the agent speaks to the master through
//! `MasterClient`) rather than inside `nacre-func`: the client runs functions inline and so
//! depends on `nacre-func`, and `nacre-api` carries `nacre-func`'s vocabulary, so a server inside
//! `nacre-func` would make a dependency cycle. Meta and data nodes' agent
//! (`nacre_cluster::run_agent`) reconciles hosted partitions, which a function server has none of,
//! so the func role has its own small loop.

mod agent;
mod metrics;
mod server;

pub use agent::{FuncAgentConfig, run_func_agent};
pub use metrics::FuncMetrics;
pub use server::{FuncServer, FuncServerConfig, LoadSample};
