//! `nacre bench …`: benchmarks that print a table, or JSON lines with `--json`.

pub mod cluster;
pub mod data;
pub mod fs;
pub mod func;
pub mod meta;
pub mod msgr;
pub mod raft;
pub mod report;
pub mod skew;
