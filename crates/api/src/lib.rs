//! The vocabulary every side of nacre speaks (docs/design.md §2): the messages of the meta
//! partitions ([`meta`]), the data partitions ([`data`]), the master ([`master`]) and the function
//! servers ([`func`]) — their request and response bodies, op codes, typed errors, file attributes
//! and volume views.
//!
//! The crate is pure: no runtime, no sockets, no files. Clients and front ends (the SDK, FUSE)
//! depend on it and on the messenger, never on a server crate; servers depend on it for the
//! messages they serve. Op codes are grouped per subsystem: `0x01xx` master, `0x02xx` meta,
//! `0x03xx` data, `0x05xx` func.
//!
//! Storage function calls carry a `nacre_func::Call` and answer a `nacre_func::FuncError`: one
//! vocabulary for inline and remote callers, with no twin types to convert between. `nacre-func`
//! is a dependency here *without* its `codecs` feature, so this crate stays pure and light: it
//! builds none of the codecs' C code (zstd, Reed-Solomon SIMD), and neither does anything that
//! speaks the protocol without running a function. What runs functions — the function server,
//! and the client SDK, which runs them inline by policy — turns the feature on.

pub mod data;
pub mod func;
pub mod master;
pub mod meta;
pub mod shards;
