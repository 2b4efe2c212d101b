//! The vocabulary every side of nacre speaks (docs/design.md §2): the messages of the meta
//! partitions ([`meta`]), the data partitions ([`data`]) and the master ([`master`]) — their request
//! and response bodies, op codes, typed errors, file attributes and volume views.
//!
//! The crate is pure: no runtime, no sockets, no files. Clients and front ends (the SDK, FUSE)
//! depend on it and on the messenger, never on a server crate; servers depend on it for the
//! messages they serve. Op codes are grouped per subsystem: `0x01xx` master, `0x02xx` meta,
//! `0x03xx` data.

pub mod data;
pub mod master;
pub mod meta;
