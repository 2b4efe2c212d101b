//! The master service: the cluster map in a Raft group of 1 or 3 masters, served over the messenger.
//!
//! Every change goes through Raft as one [`Command`], so a command (say, creating a volume with all its
//! partitions) is applied on every master or on none. Reads of the map go through ReadIndex on the
//! leader. A master that is not the leader answers `NotLeader` with the leader's address, and
//! [`MasterClient`] follows it.

use std::collections::BTreeMap;
use std::time::Duration;

use nacre_msgr::{CallOptions, Client, MsgrError, Payload, Router};
use nacre_proto::Op;
use nacre_proto::msg::{RemoteError, Rpc};
use nacre_raft::{GroupId, RaftError, RaftHandle, StateMachine};
use nacre_types::ErrorCode;
use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::map::{ClusterMap, Command, MapError, Outcome};

/// The Raft group holding the cluster map.
pub const MASTER_GROUP: GroupId = 1;

/// The cluster map as a replicated state machine. Commands and results are postcard-encoded.
#[derive(Debug, Default)]
pub struct MasterSm {
    pub map: ClusterMap,
}

impl StateMachine for MasterSm {
    fn apply(&mut self, _index: u64, command: &[u8]) -> Vec<u8> {
        let result: Result<Outcome, MapError> = match postcard::from_bytes::<Command>(command) {
            Ok(cmd) => self.map.apply(&cmd),
            Err(e) => Err(MapError::Invalid(format!("undecodable command: {e}"))),
        };
        postcard::to_allocvec(&result).expect("command results are postcard-serializable")
    }

    fn snapshot(&self) -> Vec<u8> {
        self.map.snapshot()
    }

    fn restore(&mut self, snapshot: &[u8]) -> Result<(), String> {
        self.map = ClusterMap::restore(snapshot).map_err(|e| e.to_string())?;
        Ok(())
    }
}

/// Why a master request failed.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum MasterError {
    #[error(transparent)]
    Map(#[from] MapError),
    /// This master is not the leader; `leader` is the leader's address if known.
    #[error("not the master leader (leader: {})", leader.as_deref().unwrap_or("unknown"))]
    NotLeader { leader: Option<String> },
    #[error("master unavailable: {0}")]
    Unavailable(String),
}

/// Executes a command on the master leader (op `0x0101`).
#[derive(Debug)]
pub struct Execute;

impl Rpc for Execute {
    const OP: Op = Op(0x0101);
    const NAME: &'static str = "master_execute";
    type Request = Command;
    type Response = Result<Outcome, MapError>;
}

/// Reads the whole cluster map from the master leader (op `0x0102`).
#[derive(Debug)]
pub struct GetMap;

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct GetMapRequest {}

impl Rpc for GetMap {
    const OP: Op = Op(0x0102);
    const NAME: &'static str = "master_get_map";
    type Request = GetMapRequest;
    type Response = ClusterMap;
}

/// One master: its raft handle and the addresses of all masters (for leader hints).
#[derive(Clone, Debug)]
pub struct Master {
    raft: RaftHandle<MasterSm>,
    /// Master node id → messenger address.
    masters: BTreeMap<u64, String>,
}

impl Master {
    pub fn new(raft: RaftHandle<MasterSm>, masters: BTreeMap<u64, String>) -> Self {
        Self { raft, masters }
    }

    fn not_leader(&self, leader: u64) -> MasterError {
        MasterError::NotLeader {
            leader: self.masters.get(&leader).cloned(),
        }
    }

    /// Applies `cmd` through Raft (this master must lead).
    pub async fn execute(&self, cmd: &Command) -> Result<Outcome, MasterError> {
        let bytes =
            postcard::to_allocvec(cmd).map_err(|e| MasterError::Unavailable(e.to_string()))?;
        match self.raft.propose(MASTER_GROUP, bytes).await {
            Ok(result) => postcard::from_bytes::<Result<Outcome, MapError>>(&result)
                .map_err(|e| MasterError::Unavailable(format!("bad result: {e}")))?
                .map_err(MasterError::from),
            Err(RaftError::NotLeader { leader, .. }) => Err(self.not_leader(leader)),
            Err(e) => Err(MasterError::Unavailable(e.to_string())),
        }
    }

    /// The current map, read linearizably on the leader.
    pub async fn map(&self) -> Result<ClusterMap, MasterError> {
        match self
            .raft
            .read(MASTER_GROUP, |sm: &MasterSm| sm.map.clone())
            .await
        {
            Ok(m) => Ok(m),
            Err(RaftError::NotLeader { leader, .. }) => Err(self.not_leader(leader)),
            Err(e) => Err(MasterError::Unavailable(e.to_string())),
        }
    }

    /// Milliseconds since the Unix epoch on this master's clock (only the leader stamps commands).
    pub fn now_ms() -> u64 {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64)
    }

    /// Runs the leader's periodic duties until `shutdown` resolves: every `interval`, if this master
    /// leads, nodes silent for more than `node_timeout` are marked down (and nodes heard from again
    /// up). Followers do nothing, so a new leader takes over the duty after a failover.
    pub async fn run_duties(
        &self,
        interval: Duration,
        node_timeout: Duration,
        shutdown: impl std::future::Future<Output = ()>,
    ) {
        let mut shutdown = std::pin::pin!(shutdown);
        let mut tick = tokio::time::interval(interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
        loop {
            tokio::select! {
                _ = &mut shutdown => return,
                _ = tick.tick() => {}
            }
            if self.raft.leader(MASTER_GROUP).await.ok() != Some(self.raft.id()) {
                continue;
            }
            let cmd = Command::CheckLiveness {
                now_ms: Self::now_ms(),
                timeout_ms: node_timeout.as_millis() as u64,
            };
            if let Err(e) = self.execute(&cmd).await {
                tracing::debug!(error = %e, "liveness check not applied");
            }
        }
    }

    /// The master's ops (its raft traffic is served by the raft handle's own router).
    pub fn router(&self) -> Router {
        let (a, b) = (self.clone(), self.clone());
        Router::new()
            .route::<Execute, _, _>(move |cmd, _inc| {
                let m = a.clone();
                async move {
                    match m.execute(&cmd).await {
                        Ok(o) => Ok((Ok(o), Payload::none())),
                        Err(MasterError::Map(e)) => Ok((Err(e), Payload::none())),
                        Err(e) => Err(remote(e)),
                    }
                }
            })
            .route::<GetMap, _, _>(move |_req, _inc| {
                let m = b.clone();
                async move {
                    m.map()
                        .await
                        .map(|map| (map, Payload::none()))
                        .map_err(remote)
                }
            })
    }
}

fn remote(e: MasterError) -> RemoteError {
    match e {
        MasterError::NotLeader { leader } => RemoteError {
            leader_hint: leader,
            ..RemoteError::new(ErrorCode::NotLeader, "not the master leader")
        },
        MasterError::Unavailable(m) => RemoteError::new(ErrorCode::Unavailable, m),
        MasterError::Map(e) => RemoteError::new(ErrorCode::InvalidArgument, e.to_string()),
    }
}

/// Talks to whichever master leads: follows `NotLeader` hints and otherwise tries the masters in turn,
/// backing off while no leader is known, for at most `retry_for`.
#[derive(Clone, Debug)]
pub struct MasterClient {
    client: Client,
    masters: Vec<String>,
    /// Time allowed for one call to one master.
    timeout: Duration,
    /// Time allowed to find the leader, across masters and elections.
    retry_for: Duration,
}

impl MasterClient {
    pub fn new(client: Client, masters: Vec<String>) -> Self {
        Self {
            client,
            masters,
            timeout: Duration::from_secs(3),
            retry_for: Duration::from_secs(10),
        }
    }

    async fn call<R: Rpc>(&self, req: &R::Request) -> Result<R::Response, MasterError> {
        if self.masters.is_empty() {
            return Err(MasterError::Unavailable(
                "no master address configured".into(),
            ));
        }
        let mut target = 0usize;
        let mut last;
        // Bounded by time rather than attempts: long enough to ride out a master election.
        let deadline = tokio::time::Instant::now() + self.retry_for;
        loop {
            let addr = &self.masters[target % self.masters.len()];
            let opts = CallOptions {
                timeout: Some(self.timeout),
                ..Default::default()
            };
            let followed_hint = match self
                .client
                .call_with::<R>(addr, req, Payload::none(), opts)
                .await
            {
                Ok((resp, _)) => return Ok(resp),
                Err(MsgrError::Remote { error, .. }) if error.code() == ErrorCode::NotLeader => {
                    last = format!("{addr}: not the leader");
                    match error
                        .leader_hint
                        .as_ref()
                        .and_then(|h| self.masters.iter().position(|m| m == h))
                    {
                        Some(i) if i != target % self.masters.len() => {
                            target = i;
                            true
                        }
                        _ => {
                            target += 1;
                            false
                        }
                    }
                }
                Err(e) => {
                    last = e.to_string();
                    target += 1;
                    false
                }
            };
            if tokio::time::Instant::now() >= deadline {
                return Err(MasterError::Unavailable(last));
            }
            if !followed_hint {
                // No leader known yet (an election is running, or a master is down): back off.
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }

    /// Executes a command on the leader.
    pub async fn execute(&self, cmd: &Command) -> Result<Outcome, MasterError> {
        self.call::<Execute>(cmd).await?.map_err(MasterError::from)
    }

    /// Reads the map from the leader.
    pub async fn map(&self) -> Result<ClusterMap, MasterError> {
        self.call::<GetMap>(&GetMapRequest {}).await
    }
}
