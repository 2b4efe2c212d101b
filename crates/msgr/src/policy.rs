//! Which worker a new connection goes to.
//!
//! A policy sees a snapshot of every worker's load and picks one. Round-robin is Ceph's baseline; the
//! connection balancer of a later issue adds policies that also *move* live connections, using the same
//! load snapshot and [`crate::transport::Stream::detach`].

use std::fmt;
use std::str::FromStr;
use std::sync::atomic::{AtomicUsize, Ordering};

/// Load of one worker as seen by a policy.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct WorkerLoad {
    /// Connections currently owned by the worker.
    pub connections: u64,
    /// Bytes read and written by the worker since it started.
    pub bytes: u64,
    /// Frames read and written by the worker since it started.
    pub frames: u64,
}

/// Picks a worker for a new connection.
pub trait AssignPolicy: Send + Sync + fmt::Debug {
    /// Index into `loads` of the worker that gets the connection. `loads` is never empty.
    fn assign(&self, loads: &[WorkerLoad]) -> usize;
}

/// Named policies, selectable from configuration.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum AssignKind {
    /// Next worker in turn, whatever its load.
    #[default]
    RoundRobin,
    /// The worker with the fewest connections (ties: lowest index).
    LeastConnections,
}

impl AssignKind {
    pub fn build(self) -> Box<dyn AssignPolicy> {
        match self {
            Self::RoundRobin => Box::new(RoundRobin::default()),
            Self::LeastConnections => Box::new(LeastConnections),
        }
    }
}

impl FromStr for AssignKind {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "round-robin" => Ok(Self::RoundRobin),
            "least-connections" => Ok(Self::LeastConnections),
            other => Err(format!(
                "unknown connection assignment policy {other:?} (expected round-robin or least-connections)"
            )),
        }
    }
}

impl fmt::Display for AssignKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::RoundRobin => "round-robin",
            Self::LeastConnections => "least-connections",
        })
    }
}

/// Ceph's default: connections are dealt to workers in turn.
#[derive(Debug, Default)]
pub struct RoundRobin {
    next: AtomicUsize,
}

impl AssignPolicy for RoundRobin {
    fn assign(&self, loads: &[WorkerLoad]) -> usize {
        self.next.fetch_add(1, Ordering::Relaxed) % loads.len()
    }
}

/// Fewest live connections first.
#[derive(Debug, Default)]
pub struct LeastConnections;

impl AssignPolicy for LeastConnections {
    fn assign(&self, loads: &[WorkerLoad]) -> usize {
        loads
            .iter()
            .enumerate()
            .min_by_key(|(i, l)| (l.connections, *i))
            .map_or(0, |(i, _)| i)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_robin_deals_in_turn() {
        let p = RoundRobin::default();
        let loads = [WorkerLoad::default(); 3];
        let picks: Vec<_> = (0..6).map(|_| p.assign(&loads)).collect();
        assert_eq!(picks, [0, 1, 2, 0, 1, 2]);
    }

    #[test]
    fn least_connections_picks_emptiest_lowest_index() {
        let mut loads = [WorkerLoad::default(); 3];
        loads[0].connections = 2;
        loads[1].connections = 1;
        loads[2].connections = 1;
        assert_eq!(LeastConnections.assign(&loads), 1);
    }

    #[test]
    fn names_parse_and_print() {
        for k in [AssignKind::RoundRobin, AssignKind::LeastConnections] {
            assert_eq!(k.to_string().parse::<AssignKind>(), Ok(k));
        }
        assert!("fastest".parse::<AssignKind>().is_err());
    }
}
