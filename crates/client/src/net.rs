//! [`NetVolume`]: the meta and data partitions of a volume over the messenger, with the volume view
//! and the partition leaders cached.
//!
//! A call goes to the cached leader, else to the replicas in order. `NotLeader` with a hint goes to
//! the hinted node; an unknown partition or an unreachable node moves on to the next replica and,
//! once every replica was tried, refreshes the view from the master. Everything is bounded by
//! `retry_for`. Errors are classified for the workflows: a refused connection or a not-leader answer
//! means the command was **not applied**; a timeout or reset after sending means **unknown**.
//!
//! **Exactly-once metadata writes.** Every meta write is sent as a [`Command::Once`]: call number
//! `seq` of this volume handle's session (a random client id), with `done_below` the lowest call
//! still waiting. The partition applies a call once and answers every copy with the first
//! outcome, so a write whose outcome is unknown (a reset, a timeout, a leader that lost its term
//! with the entry in flight) is sent again, with the same number, until an answer comes or
//! `retry_for` runs out. Only then is the outcome reported unknown.
//!
//! **Fail-over.** A call that may be sent again (reads, overwrites, meta writes) waits
//! [`FIRST_ATTEMPT`] for its first answer, then tries the next replica while the first attempt
//! stays in flight (a *hedge*: whichever answers with success first is taken), and waits twice as
//! long on every timeout after that, up to `timeout`. A leader cut off costs about its peers'
//! peer timeout and one campaign (0.9 s), a leader slow under load nothing but a spare request.
//! A node that timed out or refused a connection is *suspect* for [`SUSPECT_FOR`] (longer than
//! an election), or until it answers: calls skip it, and hints that point to it, while another
//! replica is not suspect, so they find the new leader as soon as it is elected.

use std::collections::{BTreeSet, HashMap};
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use bytes::Bytes;
use tokio::time::Instant;

use crate::master::MasterClient;
use nacre_api::master::{MasterError, PartitionKind, PartitionStatus, VolumeFuncs, VolumeView};
use nacre_api::meta::rpc::{MetaRead, MetaWrite, ReadRequest, WriteRequest};
use nacre_api::meta::{Command, MetaError, Query, Reply};
use nacre_msgr::{CallOptions, Client, MsgrError, Payload};
use nacre_proto::msg::{Rpc, encode_body};
use nacre_types::sync::{self, lock};
use nacre_types::{ErrorCode, PartitionId};

use crate::meta::{CallError, MetaRange, MetaTransport};

/// A data partition as the client sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DataPartitionInfo {
    pub id: PartitionId,
    /// Takes appends and new extents (every replica up, not full).
    pub writable: bool,
    /// The code of an erasure-coded partition: replica `i` holds shard `i` of its stripes.
    pub ec: Option<nacre_func::EcSpec>,
}

#[derive(Debug, Default)]
struct View {
    epoch: u64,
    funcs: VolumeFuncs,
    ranges: Arc<[MetaRange]>,
    data: Arc<[DataPartitionInfo]>,
    replicas: HashMap<PartitionId, Vec<String>>,
}

/// Routes the meta and data ops of one volume.
#[derive(Debug)]
pub struct NetVolume {
    client: Client,
    master: MasterClient,
    volume: String,
    view: RwLock<View>,
    leaders: Mutex<HashMap<PartitionId, String>>,
    /// Time allowed for one call to one node.
    pub timeout: Duration,
    /// Time allowed for one operation across replicas, elections and view refreshes.
    pub retry_for: Duration,
    /// Append packets this client has in flight, across all its files (see [`APPEND_WINDOW`]).
    append_slots: Arc<tokio::sync::Semaphore>,
    /// This handle's call session with the meta partitions (see the module doc).
    calls: Calls,
    /// Sends meta writes as [`Command::Once`] (true, the default). False sends them bare, so a
    /// retried call may apply twice: only for measuring what exactly-once costs
    /// (`nacre bench meta --calls`).
    pub exactly_once: bool,
    /// Nodes that timed out or refused a connection, until when they are skipped.
    suspects: Mutex<HashMap<String, Instant>>,
}

/// How long a call that may be sent again waits for a node's first answer before it also tries
/// the next replica. The Raft stores find a peer cut off after 0.8 s of silence and its groups'
/// lowest live voter campaigns at once, so the next replica can answer as leader about then; the
/// first attempt still runs (see the module doc), so a slow leader is not given up.
pub const FIRST_ATTEMPT: Duration = Duration::from_millis(500);

/// How long a node that timed out or refused a connection is skipped: longer than the Raft
/// stores' peer timeout and a campaign (0.9 s), so a dead leader is not asked again before the
/// others elected a new one.
pub const SUSPECT_FOR: Duration = Duration::from_millis(1500);

/// The numbers of one client's meta calls ([`Command::Once`]).
#[derive(Debug)]
struct Calls {
    client: u64,
    st: Mutex<CallNumbers>,
}

#[derive(Debug, Default)]
struct CallNumbers {
    next: u64,
    /// Calls sent and not yet answered (nor given up).
    waiting: BTreeSet<u64>,
}

impl Calls {
    fn new() -> Self {
        Self {
            client: crate::random_client_id(),
            st: Mutex::default(),
        }
    }

    /// A new call's number, and the lowest call still waiting (this one included).
    fn begin(&self) -> Waiting<'_> {
        let mut st = lock(&self.st);
        let seq = st.next;
        st.next += 1;
        st.waiting.insert(seq);
        let done_below = st.waiting.first().copied().unwrap_or(seq);
        Waiting {
            calls: self,
            seq,
            done_below,
        }
    }
}

/// A call waiting for its answer; no longer waiting when dropped (answered, given up or cancelled).
struct Waiting<'a> {
    calls: &'a Calls,
    seq: u64,
    done_below: u64,
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        lock(&self.calls.st).waiting.remove(&self.seq);
    }
}

/// Most append packets (128 KiB each) one client keeps in flight across all its writers. Beyond
/// what the data nodes can absorb, more in flight only queues on the servers, where waits of
/// seconds time replication out and turn partitions read-only; queued here, writers just wait.
pub const APPEND_WINDOW: usize = 32;

impl NetVolume {
    /// Fetches the volume's view from the master.
    pub async fn connect(
        client: Client,
        master: MasterClient,
        volume: &str,
    ) -> Result<Self, MasterError> {
        let m = Self {
            client,
            master,
            volume: volume.to_string(),
            view: RwLock::default(),
            leaders: Mutex::default(),
            timeout: Duration::from_secs(3),
            retry_for: Duration::from_secs(15),
            append_slots: Arc::new(tokio::sync::Semaphore::new(APPEND_WINDOW)),
            calls: Calls::new(),
            exactly_once: true,
            suspects: Mutex::default(),
        };
        m.refresh().await?;
        Ok(m)
    }

    /// A slot for one append packet in flight (held until its reply).
    pub async fn append_slot(&self) -> tokio::sync::OwnedSemaphorePermit {
        // The semaphore is never closed.
        match self.append_slots.clone().acquire_owned().await {
            Ok(p) => p,
            Err(_) => unreachable!("the append window is never closed"),
        }
    }

    /// Re-reads the volume view from the master; leader hints it carries seed the leader cache.
    pub async fn refresh(&self) -> Result<(), MasterError> {
        let v: VolumeView = self.master.volume(&self.volume).await?;
        let mut view = View {
            epoch: v.epoch,
            funcs: v.funcs,
            ..View::default()
        };
        let mut ranges = Vec::new();
        let mut data = Vec::new();
        let mut leaders = Vec::new();
        for p in v.meta_partitions.iter().chain(&v.data_partitions) {
            let writable = p.status == PartitionStatus::Rw;
            match p.spec.kind {
                PartitionKind::Meta { start, end } => ranges.push(MetaRange {
                    id: p.spec.id,
                    start,
                    end,
                    writable,
                }),
                PartitionKind::Data | PartitionKind::Shards { .. } => {
                    data.push(DataPartitionInfo {
                        id: p.spec.id,
                        writable,
                        ec: p.spec.kind.ec(),
                    })
                }
            }
            let addrs: Vec<String> = p.spec.replicas.iter().map(|r| r.addr.clone()).collect();
            if let Some(l) = p.leader
                && let Some(r) = p.spec.replicas.iter().find(|r| r.node == l)
            {
                leaders.push((p.spec.id, r.addr.clone()));
            }
            view.replicas.insert(p.spec.id, addrs);
        }
        view.ranges = ranges.into();
        view.data = data.into();
        *sync::write(&self.view) = view;
        let mut l = lock(&self.leaders);
        for (p, a) in leaders {
            l.entry(p).or_insert(a);
        }
        drop(l);
        Ok(())
    }

    /// The epoch of the cached view.
    pub fn epoch(&self) -> u64 {
        sync::read(&self.view).epoch
    }

    /// The storage functions of the volume's file data.
    pub fn funcs(&self) -> VolumeFuncs {
        sync::read(&self.view).funcs
    }

    /// The master client the view comes from.
    pub fn master(&self) -> &MasterClient {
        &self.master
    }

    /// The addresses of partition `p`'s replicas, in the map's order (for an erasure-coded
    /// partition, replica `i` holds shard `i`).
    pub fn replica_addrs(&self, p: PartitionId) -> Vec<String> {
        self.replicas(p)
    }

    /// The code of data partition `p`, if it is erasure-coded.
    pub fn partition_ec(&self, p: PartitionId) -> Option<nacre_func::EcSpec> {
        sync::read(&self.view)
            .data
            .iter()
            .find(|d| d.id == p)
            .and_then(|d| d.ec)
    }

    fn replicas(&self, p: PartitionId) -> Vec<String> {
        sync::read(&self.view)
            .replicas
            .get(&p)
            .cloned()
            .unwrap_or_default()
    }

    fn cached_leader(&self, p: PartitionId) -> Option<String> {
        lock(&self.leaders).get(&p).cloned()
    }

    fn set_leader(&self, p: PartitionId, addr: &str) {
        lock(&self.leaders).insert(p, addr.to_string());
    }

    /// The volume's data partitions (shared: asked on every new extent).
    pub fn data_partitions(&self) -> Arc<[DataPartitionInfo]> {
        sync::read(&self.view).data.clone()
    }

    /// The messenger client calls go through.
    pub fn client(&self) -> &Client {
        &self.client
    }

    /// Marks `addr` suspect (it did not answer): see [`SUSPECT_FOR`].
    pub fn mark_suspect(&self, addr: &str) {
        self.suspect(addr);
    }

    /// `addr` answered: no longer suspect.
    pub fn mark_answered(&self, addr: &str) {
        self.cleared(addr);
    }

    /// Whether `addr` did not answer within the last [`SUSPECT_FOR`].
    pub fn is_suspect(&self, addr: &str) -> bool {
        let mut s = lock(&self.suspects);
        if s.is_empty() {
            return false;
        }
        let now = Instant::now();
        s.retain(|_, until| *until > now);
        s.contains_key(addr)
    }

    fn suspect(&self, addr: &str) {
        lock(&self.suspects).insert(addr.to_string(), Instant::now() + SUSPECT_FOR);
    }

    fn cleared(&self, addr: &str) {
        let mut s = lock(&self.suspects);
        if !s.is_empty() {
            s.remove(addr);
        }
    }

    /// Whether calls should skip `addr`, given the partition's `replicas`: it is suspect and
    /// some replica is not.
    fn skip(&self, addr: &str, replicas: &[String]) -> bool {
        let mut s = lock(&self.suspects);
        if s.is_empty() {
            return false;
        }
        let now = Instant::now();
        s.retain(|_, until| *until > now);
        s.contains_key(addr) && replicas.iter().any(|r| !s.contains_key(r))
    }

    /// Calls `R` on partition `p`'s leader (see the module doc for the retry rules); `data` is the
    /// frame's data segment, sent again on every attempt. An `idempotent` call is sent again
    /// after a timeout or reset; if none of its attempts answered, its outcome is `Unknown` when
    /// one may have been served.
    pub async fn call<R: Rpc>(
        &self,
        p: PartitionId,
        req: &R::Request,
        data: Payload,
        idempotent: bool,
    ) -> Result<(R::Response, Payload), CallError> {
        let deadline = Instant::now() + self.retry_for;
        let mut target = self.cached_leader(p);
        let mut tried = 0usize;
        let mut refreshed = false;
        let mut maybe_served = false;
        let mut wait = if idempotent {
            FIRST_ATTEMPT.min(self.timeout)
        } else {
            self.timeout
        };
        let mut last = String::new();
        let body = encode_body(req);
        let mut straggler: Option<Straggler<R::Response>> = None;
        let give_up = |last: String, maybe_served: bool| {
            if maybe_served {
                CallError::Unknown(last)
            } else {
                CallError::NotApplied(last)
            }
        };
        loop {
            let replicas = self.replicas(p);
            let addr = match target.take() {
                Some(a) => a,
                None if replicas.is_empty() => {
                    if refreshed {
                        return Err(give_up(
                            format!("partition {p} is not in volume {}", self.volume),
                            maybe_served,
                        ));
                    }
                    refreshed = true;
                    let _ = self.refresh().await;
                    continue;
                }
                None => replicas[tried % replicas.len()].clone(),
            };
            let mut hinted = false;
            if !self.skip(&addr, &replicas) {
                let left = deadline.saturating_duration_since(Instant::now());
                let payload = Payload {
                    bytes: data.bytes.clone(),
                    crc: data.crc,
                };
                let (answered, out) = if idempotent {
                    self.hedged::<R>(&addr, &body, payload, wait.min(left), left, &mut straggler)
                        .await
                } else {
                    let opts = CallOptions {
                        timeout: Some(wait.min(left)),
                        ..Default::default()
                    };
                    let out = self
                        .client
                        .call_body::<R>(&addr, body.clone(), payload, opts);
                    (addr.clone(), out.await)
                };
                match out {
                    Ok(out) => {
                        self.cleared(&answered);
                        self.set_leader(p, &answered);
                        return Ok(out);
                    }
                    Err(MsgrError::Remote { error, .. }) => match error.code() {
                        ErrorCode::NotLeader => {
                            self.cleared(&addr);
                            last = format!("{addr}: not the leader of {p}");
                            if let Some(h) = error
                                .leader_hint
                                .filter(|h| *h != addr && !self.skip(h, &replicas))
                            {
                                target = Some(h);
                                hinted = true;
                            }
                        }
                        ErrorCode::DeadlineExceeded if !idempotent => {
                            return Err(CallError::Unknown(format!("{addr}: {}", error.message)));
                        }
                        _ => {
                            // Served and failed, or (a leader that lost its term) proposed and
                            // perhaps committed by the next one.
                            maybe_served = true;
                            last = format!("{addr}: {}", error.message);
                        }
                    },
                    Err(e @ (MsgrError::Timeout { .. } | MsgrError::Reset { .. }))
                        if !idempotent =>
                    {
                        self.suspect(&addr);
                        return Err(CallError::Unknown(e.to_string()));
                    }
                    Err(e) => {
                        if matches!(e, MsgrError::Timeout { .. }) {
                            wait = (wait * 2).min(self.timeout);
                        }
                        if matches!(e, MsgrError::Timeout { .. } | MsgrError::Connect { .. }) {
                            self.suspect(&addr);
                        }
                        maybe_served |= !e.not_sent();
                        last = e.to_string();
                    }
                }
            }
            if !hinted {
                tried += 1;
                lock(&self.leaders).remove(&p);
                if tried.is_multiple_of(replicas.len().max(1)) {
                    // Every replica refused: an election is running, or the view is stale.
                    if !refreshed {
                        refreshed = true;
                        let _ = self.refresh().await;
                    }
                    if Instant::now() >= deadline {
                        return Err(give_up(last, maybe_served));
                    }
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
            if Instant::now() >= deadline {
                return Err(give_up(last, maybe_served));
            }
        }
    }
}

/// An attempt still in flight after the caller stopped waiting for it: the node it went to and its
/// answer to come.
type Straggler<T> = Pin<Box<dyn Future<Output = (String, Result<(T, Payload), MsgrError>)> + Send>>;

impl NetVolume {
    /// Sends one attempt of a call that may be sent again to `addr`, allowing it `limit` (what is
    /// left of the operation's time) but waiting only `wait` for it: past that it is kept running
    /// as the `straggler` (if none is) and this returns a timeout, so the caller tries the next
    /// replica while a slow leader can still answer. The straggler's answer, if it comes first
    /// and is a success, is the attempt's; its failures are dropped (the call goes on without
    /// it). Returns the node that answered and its answer.
    async fn hedged<R: Rpc>(
        &self,
        addr: &str,
        body: &Bytes,
        data: Payload,
        wait: Duration,
        limit: Duration,
        straggler: &mut Option<Straggler<R::Response>>,
    ) -> (String, Result<(R::Response, Payload), MsgrError>) {
        let client = self.client.clone();
        let (to, body) = (addr.to_string(), body.clone());
        let opts = CallOptions {
            timeout: Some(limit),
            ..Default::default()
        };
        let mut call: Straggler<R::Response> = Box::pin(async move {
            let out = client.call_body::<R>(&to, body, data, opts).await;
            (to, out)
        });
        let hedge = tokio::time::sleep(wait);
        tokio::pin!(hedge);
        loop {
            let earlier = async {
                match straggler.as_mut() {
                    Some(f) => f.await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                out = &mut call => return out,
                (from, out) = earlier => {
                    *straggler = None;
                    if out.is_ok() {
                        return (from, out);
                    }
                }
                () = &mut hedge => {
                    if straggler.is_none() {
                        *straggler = Some(call);
                    }
                    let late = MsgrError::Timeout {
                        peer: addr.to_string(),
                        op: R::NAME,
                        after: wait,
                    };
                    return (addr.to_string(), Err(late));
                }
            }
        }
    }

    /// Capacity and used bytes of the cluster's data nodes, divided by the replica count (3):
    /// what `statfs` reports.
    pub async fn space(&self) -> Result<(u64, u64), MasterError> {
        let space = self.master.space().await?;
        Ok((space.capacity / 3, space.used / 3))
    }
}

impl MetaTransport for NetVolume {
    fn partitions(&self) -> Arc<[MetaRange]> {
        sync::read(&self.view).ranges.clone()
    }

    async fn write(
        &self,
        partition: PartitionId,
        cmd: Command,
    ) -> Result<Result<Reply, MetaError>, CallError> {
        if !self.exactly_once {
            let req = WriteRequest { partition, cmd };
            return Ok(self
                .call::<MetaWrite>(partition, &req, Payload::none(), false)
                .await?
                .0);
        }
        let call = self.calls.begin();
        let cmd = Command::Once {
            client: self.calls.client,
            seq: call.seq,
            done_below: call.done_below,
            cmd: Box::new(cmd),
        };
        let req = WriteRequest { partition, cmd };
        let reply = self
            .call::<MetaWrite>(partition, &req, Payload::none(), true)
            .await?
            .0;
        drop(call);
        Ok(match reply {
            Ok(Reply::Outcome(r)) => *r,
            Ok(other) => Err(MetaError::Invalid(format!(
                "a call answered {other:?}, not its outcome"
            ))),
            Err(e) => Err(e),
        })
    }

    async fn read(
        &self,
        partition: PartitionId,
        query: Query,
    ) -> Result<Result<Reply, MetaError>, CallError> {
        let req = ReadRequest { partition, query };
        Ok(self
            .call::<MetaRead>(partition, &req, Payload::none(), true)
            .await?
            .0)
    }
}
