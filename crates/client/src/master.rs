//! [`MasterClient`]: talks to whichever master leads. The admin calls that need the master's own
//! types (the whole cluster map, map commands) are `nacre_master::MasterAdmin`, over
//! [`MasterClient::call`].

use std::time::Duration;

use nacre_msgr::{CallOptions, Client, MsgrError, Payload};
use nacre_proto::msg::Rpc;
use nacre_types::{ErrorCode, NodeId};

use nacre_api::master::{
    ClusterSpace, FuncHeartbeat, FuncHeartbeatRequest, FuncLoad, FuncView, GetFuncs,
    GetFuncsRequest, GetSpace, GetSpaceRequest, GetVolume, GetVolumeRequest, Heartbeat,
    HeartbeatReply, HeartbeatRequest, MasterError, MasterStatus, PartitionReport, Register,
    RegisterFunc, RegisterFuncRequest, RegisterRequest, Status, StatusRequest, VolumeView,
};

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

    /// Changes how long one call may look for the leader (default 10 s).
    pub fn with_retry_for(mut self, retry_for: Duration) -> Self {
        self.retry_for = retry_for;
        self
    }

    /// The messenger client calls go through.
    pub fn client(&self) -> &Client {
        &self.client
    }

    /// The master addresses this client knows.
    pub fn masters(&self) -> &[String] {
        &self.masters
    }

    /// Sends one call to the leader, following `NotLeader` hints and riding out elections for at
    /// most `retry_for`.
    pub async fn call<R: Rpc>(&self, req: &R::Request) -> Result<R::Response, MasterError> {
        if self.masters.is_empty() {
            return Err(MasterError::Unavailable(
                "no master address configured".into(),
            ));
        }
        let mut target = 0usize;
        let mut last;
        // Bounded by time rather than attempts: long enough to ride out a master election.
        let deadline = tokio::time::Instant::now() + self.retry_for;
        // A leader that stopped answering costs about an election: the first wait is short,
        // and hints back to a master that timed out are not followed while another has not.
        let mut wait = crate::net::FIRST_ATTEMPT.min(self.timeout);
        // When each master timed out, for `SUSPECT_FOR`.
        let mut suspect: Vec<Option<tokio::time::Instant>> = vec![None; self.masters.len()];
        loop {
            let now = tokio::time::Instant::now();
            for s in &mut suspect {
                if s.is_some_and(|at| now >= at + crate::net::SUSPECT_FOR) {
                    *s = None;
                }
            }
            let timed_out: Vec<bool> = suspect.iter().map(Option::is_some).collect();
            if !timed_out.iter().all(|t| *t) {
                while timed_out[target % self.masters.len()] {
                    target += 1;
                }
            }
            let addr = &self.masters[target % self.masters.len()];
            let opts = CallOptions {
                timeout: Some(wait),
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
                        .filter(|&i| !timed_out[i] || timed_out.iter().all(|t| *t))
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
                    if matches!(e, MsgrError::Timeout { .. }) {
                        suspect[target % self.masters.len()] = Some(tokio::time::Instant::now());
                        wait = (wait * 2).min(self.timeout);
                    }
                    last = format!("{addr}: {e}");
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

    /// A client's view of one volume.
    pub async fn volume(&self, name: &str) -> Result<VolumeView, MasterError> {
        self.call::<GetVolume>(&GetVolumeRequest { name: name.into() })
            .await?
            .map_err(MasterError::from)
    }

    /// Registers a node; returns its id.
    pub async fn register(&self, req: &RegisterRequest) -> Result<NodeId, MasterError> {
        self.call::<Register>(req).await?.map_err(MasterError::from)
    }

    /// Sends a heartbeat; returns the node's assignment.
    pub async fn heartbeat(
        &self,
        node: NodeId,
        used: u64,
        partitions: Vec<PartitionReport>,
    ) -> Result<HeartbeatReply, MasterError> {
        let req = HeartbeatRequest {
            node,
            used,
            partitions,
        };
        self.call::<Heartbeat>(&req)
            .await?
            .map_err(MasterError::from)
    }

    /// Capacity and used bytes summed over the data nodes.
    pub async fn space(&self) -> Result<ClusterSpace, MasterError> {
        self.call::<GetSpace>(&GetSpaceRequest {}).await
    }

    /// The leader's status.
    pub async fn status(&self) -> Result<MasterStatus, MasterError> {
        self.call::<Status>(&StatusRequest {}).await
    }

    /// Registers a function server; returns its id.
    pub async fn register_func(&self, req: &RegisterFuncRequest) -> Result<NodeId, MasterError> {
        self.call::<RegisterFunc>(req)
            .await?
            .map_err(MasterError::from)
    }

    /// Sends a function server's heartbeat.
    pub async fn func_heartbeat(&self, node: NodeId, load: FuncLoad) -> Result<(), MasterError> {
        self.call::<FuncHeartbeat>(&FuncHeartbeatRequest { node, load })
            .await?
            .map_err(MasterError::from)
    }

    /// The function servers that are up.
    pub async fn funcs(&self) -> Result<FuncView, MasterError> {
        self.call::<GetFuncs>(&GetFuncsRequest {}).await
    }
}
