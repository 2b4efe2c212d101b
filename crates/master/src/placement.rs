//! Utilization-based placement (CFS §2.4): new replicas go to the least-used nodes, on distinct nodes,
//! and on distinct zones when there are enough zones. Existing data never moves when nodes are added.
//!
//! The choice minimizes the total utilization of the chosen nodes. With the zone rule this is a
//! minimum-weight basis of a partition matroid, so choosing greedily (least used first, skipping a
//! zone already used) is optimal; a property test checks it against brute force.

use nacre_api::master::PlacementError;
use nacre_types::NodeId;

/// A node that may receive a replica.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Candidate {
    pub id: NodeId,
    pub zone: String,
    /// Used fraction of the resource that matters for the role (memory for meta nodes, disk for data
    /// nodes), in parts per million.
    pub used_ppm: u64,
    /// Partitions the node hosts; breaks ties so that equally empty nodes share new partitions.
    pub partitions: u64,
}

impl Candidate {
    fn key(&self) -> (u64, u64, NodeId) {
        (self.used_ppm, self.partitions, self.id)
    }
}

/// Chooses `replicas` distinct nodes. When the candidates span at least `replicas` zones, the chosen
/// nodes are in distinct zones too.
pub fn place(candidates: &[Candidate], replicas: usize) -> Result<Vec<NodeId>, PlacementError> {
    if candidates.len() < replicas {
        return Err(PlacementError::NotEnoughNodes {
            needed: replicas,
            available: candidates.len(),
        });
    }
    let mut sorted: Vec<&Candidate> = candidates.iter().collect();
    sorted.sort_by_key(|c| c.key());
    let zones = distinct_zones(candidates);
    let mut chosen: Vec<&Candidate> = Vec::with_capacity(replicas);
    for c in sorted {
        if chosen.len() == replicas {
            break;
        }
        if zones >= replicas && chosen.iter().any(|x| x.zone == c.zone) {
            continue;
        }
        chosen.push(c);
    }
    Ok(chosen.into_iter().map(|c| c.id).collect())
}

pub(crate) fn distinct_zones(candidates: &[Candidate]) -> usize {
    let mut z: Vec<&str> = candidates.iter().map(|c| c.zone.as_str()).collect();
    z.sort_unstable();
    z.dedup();
    z.len()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn brute_force_min_sum(c: &[Candidate], k: usize) -> u64 {
        let zones = distinct_zones(c);
        let n = c.len();
        let mut best = u64::MAX;
        for mask in 0u32..(1 << n) {
            if mask.count_ones() as usize != k {
                continue;
            }
            let pick: Vec<&Candidate> = (0..n)
                .filter(|i| mask & (1 << i) != 0)
                .map(|i| &c[i])
                .collect();
            if zones >= k {
                let mut z: Vec<&str> = pick.iter().map(|p| p.zone.as_str()).collect();
                z.sort_unstable();
                z.dedup();
                if z.len() != k {
                    continue;
                }
            }
            best = best.min(pick.iter().map(|p| p.used_ppm).sum());
        }
        best
    }

    fn arb_candidates() -> impl Strategy<Value = Vec<Candidate>> {
        proptest::collection::vec((0u64..1000, 0u64..4, 0u64..5), 1..10).prop_map(|v| {
            v.into_iter()
                .enumerate()
                .map(|(i, (used, zone, parts))| Candidate {
                    id: NodeId(i as u64 + 1),
                    zone: format!("z{zone}"),
                    used_ppm: used,
                    partitions: parts,
                })
                .collect()
        })
    }

    proptest! {
        #[test]
        fn placement_is_as_good_as_brute_force(c in arb_candidates(), k in 1usize..4) {
            match place(&c, k) {
                Err(PlacementError::NotEnoughNodes { .. }) => prop_assert!(c.len() < k),
                Ok(ids) => {
                    prop_assert_eq!(ids.len(), k);
                    let mut uniq = ids.clone();
                    uniq.sort();
                    uniq.dedup();
                    prop_assert_eq!(uniq.len(), k, "distinct nodes");
                    let picked: Vec<&Candidate> =
                        ids.iter().map(|id| c.iter().find(|x| x.id == *id).unwrap()).collect();
                    if distinct_zones(&c) >= k {
                        let mut z: Vec<&str> = picked.iter().map(|p| p.zone.as_str()).collect();
                        z.sort_unstable();
                        z.dedup();
                        prop_assert_eq!(z.len(), k, "distinct zones");
                    }
                    let sum: u64 = picked.iter().map(|p| p.used_ppm).sum();
                    prop_assert_eq!(sum, brute_force_min_sum(&c, k));
                }
            }
        }
    }

    #[test]
    fn too_few_nodes_is_a_clear_error() {
        let c = vec![Candidate {
            id: NodeId(1),
            zone: "a".into(),
            used_ppm: 0,
            partitions: 0,
        }];
        let e = place(&c, 3).unwrap_err();
        assert_eq!(e.to_string(), "need 3 nodes for 3 replicas, only 1 are up");
    }
}
