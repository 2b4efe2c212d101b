//! A whole cluster of `RaftNode`s in one thread, for scenario tests: messages are delivered by the
//! test (so faults are exact), logs are `MemLogStore`s that can lose unsynced writes on a crash.
#![allow(dead_code)] // each test file uses part of it

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use nacre_raft::{
    GroupId, LogStore, MemLogStore, NodeConfig, ProposalId, RaftError, RaftNode, RestoreError,
    StateMachine,
};

/// A key-value map; a command is `key=value`, the response the previous value.
#[derive(Debug, Default)]
pub struct Kv {
    pub map: BTreeMap<String, String>,
    pub applied: Vec<u64>,
    /// Commands handed to `prefetch` and not applied yet.
    pub prefetched: std::sync::Mutex<Vec<Vec<u8>>>,
    /// Commands applied without a `prefetch` before.
    pub unprefetched: Vec<Vec<u8>>,
}

impl StateMachine for Kv {
    fn prefetch(&self, command: &[u8]) {
        if let Ok(mut p) = self.prefetched.lock() {
            p.push(command.to_vec());
        }
    }

    fn apply(&mut self, index: u64, command: &[u8]) -> Vec<u8> {
        self.applied.push(index);
        if let Ok(mut p) = self.prefetched.lock() {
            match p.iter().position(|c| c == command) {
                Some(i) => {
                    p.remove(i);
                }
                None => self.unprefetched.push(command.to_vec()),
            }
        }
        let text = String::from_utf8_lossy(command);
        let (k, v) = text.split_once('=').unwrap_or((&text, ""));
        self.map
            .insert(k.to_string(), v.to_string())
            .unwrap_or_default()
            .into_bytes()
    }

    fn snapshot(&self) -> Vec<u8> {
        self.map
            .iter()
            .map(|(k, v)| format!("{k}={v}\n"))
            .collect::<String>()
            .into_bytes()
    }

    fn restore(&mut self, snapshot: &[u8]) -> Result<(), RestoreError> {
        let text =
            std::str::from_utf8(snapshot).map_err(|e| RestoreError::Decode(e.to_string()))?;
        self.map = text
            .lines()
            .filter_map(|l| l.split_once('='))
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        Ok(())
    }
}

pub struct Cluster {
    pub config: NodeConfig,
    pub nodes: BTreeMap<u64, Option<RaftNode<Kv>>>,
    pub logs: BTreeMap<u64, Arc<MemLogStore>>,
    /// Nodes cut off from every other node.
    pub isolated: BTreeSet<u64>,
    pub results: BTreeMap<(u64, ProposalId), Result<Vec<u8>, RaftError>>,
    /// For each read that became ready: the state machine's map at that moment.
    pub read_values: BTreeMap<(u64, ProposalId), BTreeMap<String, String>>,
    /// Logical time: Ready rounds run so far (orders invocations and responses in histories).
    pub step: u64,
    /// When each proposal or read finished, in `step`s.
    pub finished_at: BTreeMap<(u64, ProposalId), u64>,
    pub groups: Vec<GroupId>,
    /// Messages sent so far (delivered or not).
    pub messages: u64,
}

impl Cluster {
    pub fn new(n: u64, groups: &[GroupId], config: NodeConfig) -> Self {
        let mut c = Cluster {
            config,
            nodes: BTreeMap::new(),
            logs: BTreeMap::new(),
            isolated: BTreeSet::new(),
            results: BTreeMap::new(),
            read_values: BTreeMap::new(),
            step: 0,
            finished_at: BTreeMap::new(),
            groups: groups.to_vec(),
            messages: 0,
        };
        for id in 1..=n {
            c.logs.insert(id, Arc::new(MemLogStore::new()));
        }
        for id in 1..=n {
            c.start(id);
        }
        c
    }

    pub fn voters(&self) -> Vec<u64> {
        self.logs.keys().copied().collect()
    }

    /// (Re)starts node `id` from whatever its log holds. Outcomes recorded for its previous
    /// incarnation are forgotten: proposal ids start again from 1.
    pub fn start(&mut self, id: u64) {
        self.results.retain(|k, _| k.0 != id);
        self.finished_at.retain(|k, _| k.0 != id);
        self.read_values.retain(|k, _| k.0 != id);
        let log: Arc<dyn LogStore> = self.logs[&id].clone();
        let mut node = RaftNode::new(id, self.config.clone(), log);
        let voters = self.voters();
        for &g in &self.groups {
            node.add_group(g, &voters, Kv::default()).unwrap();
        }
        self.nodes.insert(id, Some(node));
        for other in self.live() {
            if other != id {
                self.node(other).set_peer_alive(id, true);
            }
        }
    }

    /// Kills node `id`: its process state is gone and its log loses unsynced writes.
    pub fn crash(&mut self, id: u64) {
        self.nodes.insert(id, None);
        self.logs[&id].crash();
        // The driver's node-level heartbeats would notice; tell the survivors.
        for other in self.live() {
            self.node(other).set_peer_alive(id, false);
        }
    }

    /// Cuts `id` off from every other node; node-level liveness on both sides notices.
    pub fn isolate(&mut self, id: u64) {
        self.isolated.insert(id);
        for other in self.live() {
            if other != id {
                self.node(other).set_peer_alive(id, false);
                if self.nodes[&id].is_some() {
                    self.node(id).set_peer_alive(other, false);
                }
            }
        }
    }

    /// Ends every isolation.
    pub fn heal(&mut self) {
        self.isolated.clear();
        let live = self.live();
        for &a in &live {
            for &b in &live {
                if a != b {
                    self.node(a).set_peer_alive(b, true);
                }
            }
        }
    }

    pub fn node(&mut self, id: u64) -> &mut RaftNode<Kv> {
        self.nodes.get_mut(&id).unwrap().as_mut().unwrap()
    }

    pub fn live(&self) -> Vec<u64> {
        self.nodes
            .iter()
            .filter(|(_, n)| n.is_some())
            .map(|(id, _)| *id)
            .collect()
    }

    pub fn connected(&self, a: u64, b: u64) -> bool {
        a == b || (!self.isolated.contains(&a) && !self.isolated.contains(&b))
    }

    /// Runs Ready rounds and delivers messages until nothing moves (bounded).
    pub fn pump(&mut self) {
        for _ in 0..10_000 {
            let mut moved = false;
            self.step += 1;
            for id in self.live() {
                let out = self.node(id).process_ready().unwrap();
                for (pid, r) in out.finished {
                    self.results.insert((id, pid), r);
                    self.finished_at.insert((id, pid), self.step);
                }
                for (g, rid) in out.reads {
                    let map = self.map(id, g);
                    self.read_values.insert((id, rid), map);
                    self.finished_at.insert((id, rid), self.step);
                }
                for (g, m) in out.messages {
                    moved = true;
                    self.messages += 1;
                    let to = m.to;
                    if self.connected(id, to)
                        && let Some(Some(n)) = self.nodes.get_mut(&to)
                    {
                        let _ = n.step(g, m);
                    }
                }
            }
            if !moved {
                return;
            }
        }
        panic!("cluster did not quiesce");
    }

    pub fn tick(&mut self, n: usize) {
        for _ in 0..n {
            for id in self.live() {
                self.node(id).tick();
            }
            self.pump();
        }
    }

    /// Ticks until the leaders' next heartbeat, which tells followers the commit index (with
    /// `skip_bcast_commit`, the default, no message of its own does).
    pub fn heartbeat(&mut self) {
        self.tick(self.config.heartbeat_tick);
    }

    /// The leader of `g` among connected live nodes, ticking until there is exactly one (bounded).
    pub fn leader(&mut self, g: GroupId) -> u64 {
        for _ in 0..500 {
            let leaders: Vec<u64> = self
                .live()
                .into_iter()
                .filter(|id| !self.isolated.contains(id))
                .filter(|&id| self.nodes[&id].as_ref().unwrap().is_leader(g))
                .collect();
            if leaders.len() == 1 {
                return leaders[0];
            }
            self.tick(1);
        }
        panic!("no single leader for group {g}");
    }

    pub fn propose(&mut self, node: u64, g: GroupId, cmd: &str) -> Result<ProposalId, RaftError> {
        self.node(node).propose(g, cmd.as_bytes().to_vec())
    }

    pub fn map(&self, node: u64, g: GroupId) -> BTreeMap<String, String> {
        self.nodes[&node]
            .as_ref()
            .unwrap()
            .state_machine(g)
            .unwrap()
            .map
            .clone()
    }
}
