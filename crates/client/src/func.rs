//! [`FuncClient`]: runs storage functions (docs/design.md §9) inline, on a blocking thread, or on
//! the function servers the master lists.
//!
//! A service call goes through a bounded queue (at most `max_outstanding` calls in flight through
//! one client; further callers wait for a slot) to the instance with the fewest calls this client
//! has outstanding on it, among the instances the current map lists as up and offering the
//! function (ties go round-robin). An instance that fails a call — refused connection, reset,
//! timeout, an `Unavailable` answer (it is at its in-flight bound or stopping), a reply that does
//! not decode — is *suspect* for `suspect_for`: calls skip it, and the failed call is sent to the
//! next instance. Calls are pure, so sending one again never applies anything twice. When no
//! instance is left, [`FuncPolicy::fallback_inline`] decides: run the call here, or fail with
//! [`FuncCallError::NoInstance`], which names every instance tried and why it failed.
//!
//! A [`FuncError`] is the function's answer (the input is corrupt, a parameter is out of range):
//! every instance would give the same one, so it is returned at once, never retried.
//!
//! The instance list is fetched from the master at the first call and refreshed in the background
//! once older than `refresh_every`, so an instance added at run time takes calls as soon as the
//! refreshed map lists it; [`FuncClient::refresh`] refreshes it now.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use nacre_api::func::{Apply, CallRequest, join_output, split_input};
use nacre_api::master::{FuncView, MasterError};
use nacre_func::{Call, Codec, EcSpec, FuncError, Function, Input, Output, Shard, Stripe};
use nacre_msgr::{CallOptions, MsgrError, Payload};
use nacre_types::sync::lock;
use nacre_types::{ErrorCode, NodeId};
use thiserror::Error;
use tokio::sync::Semaphore;
use tokio::time::Instant;

use crate::master::MasterClient;

/// The first pause of a call whose instances are all busy; it doubles up to [`BUSY_PAUSE_MAX`].
const BUSY_PAUSE_MIN: Duration = Duration::from_millis(1);
const BUSY_PAUSE_MAX: Duration = Duration::from_millis(20);

/// Where a [`FuncClient`] runs calls.
pub use nacre_api::master::FuncAt;

/// What a service call does when no instance is left to try.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FuncPolicy {
    /// Run the call inline instead of failing.
    pub fallback_inline: bool,
}

/// How a [`FuncClient`] runs calls.
#[derive(Clone, Debug)]
pub struct FuncClientConfig {
    pub at: FuncAt,
    pub policy: FuncPolicy,
    /// Calls in flight through this client at once, inline or remote; further callers wait.
    pub max_outstanding: usize,
    /// Time allowed for one attempt on one instance.
    pub call_timeout: Duration,
    /// How long an instance that failed a call is skipped.
    pub suspect_for: Duration,
    /// The instance list is refreshed from the master once older than this.
    pub refresh_every: Duration,
}

impl Default for FuncClientConfig {
    fn default() -> Self {
        Self {
            at: FuncAt::Service,
            policy: FuncPolicy {
                fallback_inline: true,
            },
            max_outstanding: 256,
            call_timeout: Duration::from_secs(5),
            suspect_for: crate::net::SUSPECT_FOR,
            // Half the function servers' default heartbeat interval.
            refresh_every: Duration::from_secs(1),
        }
    }
}

/// Why a call produced no output.
#[derive(Clone, Debug, Error, PartialEq, Eq)]
pub enum FuncCallError {
    /// The function refused its input (corrupt frame or shard, bad parameter): the answer of
    /// every instance, and of an inline run.
    #[error(transparent)]
    Func(#[from] FuncError),
    /// No function server could run the call, and the policy does not allow running it inline.
    #[error("no function server could run {function}: {}", tried_text(.tried))]
    NoInstance {
        function: Function,
        /// Each instance tried (address) and why it failed; empty when none was listed.
        tried: Vec<(String, String)>,
    },
    /// The instance list could not be fetched (and the policy does not allow running inline).
    #[error("cannot list the function servers: {0}")]
    Master(#[from] MasterError),
    /// The inline run did not complete (its thread panicked or the runtime is shutting down).
    #[error("inline {function} did not complete: {reason}")]
    Inline { function: Function, reason: String },
    /// The output is not the kind the call produces (a helper such as
    /// [`FuncClient::compress`] got something else: a broken server).
    #[error("{function} returned an unexpected kind of output")]
    UnexpectedOutput { function: Function },
}

fn tried_text(tried: &[(String, String)]) -> String {
    if tried.is_empty() {
        return "no instance is up".into();
    }
    tried
        .iter()
        .map(|(addr, why)| format!("{addr}: {why}"))
        .collect::<Vec<_>>()
        .join("; ")
}

/// One function server as this client tracks it.
#[derive(Clone, Debug)]
struct Instance {
    node: NodeId,
    addr: String,
    functions: Vec<Function>,
    /// Calls this client has outstanding on it.
    outstanding: usize,
    suspect_until: Option<Instant>,
}

#[derive(Debug, Default)]
struct Instances {
    list: Vec<Instance>,
    epoch: u64,
    refreshed: Option<Instant>,
    /// Where the round-robin among equally loaded instances starts next.
    next: usize,
}

/// An instance as [`FuncClient::instances`] shows it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InstanceState {
    pub node: NodeId,
    pub addr: String,
    /// Calls this client has outstanding on it.
    pub outstanding: usize,
    pub suspect: bool,
}

#[derive(Debug)]
struct Inner {
    config: FuncClientConfig,
    master: Option<MasterClient>,
    queue: Semaphore,
    instances: Mutex<Instances>,
    refreshing: AtomicBool,
}

/// Runs storage function calls inline or on function servers. Cheap to clone; clones share the
/// queue and the instance list.
#[derive(Clone, Debug)]
pub struct FuncClient {
    inner: Arc<Inner>,
}

impl FuncClient {
    /// A client that calls the function servers `master` lists (or runs calls inline, by
    /// `config.at`), over `master`'s messenger client.
    pub fn new(master: MasterClient, config: FuncClientConfig) -> Self {
        Self::build(Some(master), config)
    }

    /// A client that runs every call inline.
    pub fn inline(max_outstanding: usize) -> Self {
        let config = FuncClientConfig {
            at: FuncAt::Inline,
            max_outstanding,
            ..FuncClientConfig::default()
        };
        Self::build(None, config)
    }

    fn build(master: Option<MasterClient>, config: FuncClientConfig) -> Self {
        Self {
            inner: Arc::new(Inner {
                queue: Semaphore::new(config.max_outstanding.max(1)),
                config,
                master,
                instances: Mutex::default(),
                refreshing: AtomicBool::new(false),
            }),
        }
    }

    pub fn config(&self) -> &FuncClientConfig {
        &self.inner.config
    }

    /// Runs `call` on `input`, where the configuration says.
    pub async fn call(&self, call: Call, input: Input) -> Result<Output, FuncCallError> {
        // The semaphore is never closed.
        let _slot = self.inner.queue.acquire().await;
        match (&self.inner.master, self.inner.config.at) {
            (Some(master), FuncAt::Service) => self.remote(master, call, input).await,
            _ => inline(call, input).await,
        }
    }

    /// Compresses `block` into a frame.
    pub async fn compress(&self, codec: Codec, block: Bytes) -> Result<Bytes, FuncCallError> {
        let call = Call::Compress { codec };
        match self.call(call, Input::Bytes(block)).await? {
            Output::Bytes(b) => Ok(b),
            _ => Err(unexpected(call)),
        }
    }

    /// Decompresses a frame, verified against its checksum.
    pub async fn decompress(&self, frame: Bytes) -> Result<Bytes, FuncCallError> {
        let call = Call::Decompress;
        match self.call(call, Input::Bytes(frame)).await? {
            Output::Bytes(b) => Ok(b),
            _ => Err(unexpected(call)),
        }
    }

    /// Encodes `data` into a stripe of `spec.k + spec.m` shards.
    pub async fn ec_encode(&self, spec: EcSpec, data: Bytes) -> Result<Stripe, FuncCallError> {
        let call = Call::EcEncode { spec };
        match self.call(call, Input::Bytes(data)).await? {
            Output::Stripe(s) => Ok(s),
            _ => Err(unexpected(call)),
        }
    }

    /// The `len` original bytes of a stripe from its shard slots (`None`: missing); corrupt
    /// shards count as missing.
    pub async fn ec_reconstruct(
        &self,
        spec: EcSpec,
        len: u64,
        slots: Vec<Option<Shard>>,
    ) -> Result<Bytes, FuncCallError> {
        let call = Call::EcReconstruct { spec, len };
        match self.call(call, Input::Shards(slots)).await? {
            Output::Bytes(b) => Ok(b),
            _ => Err(unexpected(call)),
        }
    }

    /// Fetches the instance list from the master now. Suspect marks and outstanding counts of
    /// instances still listed are kept.
    pub async fn refresh(&self) -> Result<(), FuncCallError> {
        let Some(master) = &self.inner.master else {
            return Ok(());
        };
        let view = master.funcs().await?;
        self.install(view);
        Ok(())
    }

    /// The instances this client knows, in node id order.
    pub fn instances(&self) -> Vec<InstanceState> {
        let now = Instant::now();
        lock(&self.inner.instances)
            .list
            .iter()
            .map(|i| InstanceState {
                node: i.node,
                addr: i.addr.clone(),
                outstanding: i.outstanding,
                suspect: i.suspect_until.is_some_and(|t| t > now),
            })
            .collect()
    }

    fn install(&self, view: FuncView) {
        let mut st = lock(&self.inner.instances);
        // A late answer must not replace a newer list.
        if st.refreshed.is_some() && view.epoch < st.epoch {
            return;
        }
        let old = std::mem::take(&mut st.list);
        st.list = view
            .instances
            .into_iter()
            .map(|v| {
                let kept = old.iter().find(|o| o.node == v.node && o.addr == v.addr);
                Instance {
                    node: v.node,
                    functions: v.functions,
                    outstanding: kept.map_or(0, |o| o.outstanding),
                    suspect_until: kept.and_then(|o| o.suspect_until),
                    addr: v.addr,
                }
            })
            .collect();
        st.epoch = view.epoch;
        st.refreshed = Some(Instant::now());
    }

    /// Fetches the list when there is none yet (waiting for it), or refreshes it in the
    /// background once it is older than `refresh_every`.
    async fn ensure_listed(&self) -> Result<(), FuncCallError> {
        let refreshed = lock(&self.inner.instances).refreshed;
        match refreshed {
            None => self.refresh().await,
            Some(at) if at.elapsed() >= self.inner.config.refresh_every => {
                if !self.inner.refreshing.swap(true, Ordering::AcqRel) {
                    let me = self.clone();
                    tokio::spawn(async move {
                        if let Err(e) = me.refresh().await {
                            tracing::debug!(error = %e, "function servers not refreshed");
                        }
                        me.inner.refreshing.store(false, Ordering::Release);
                    });
                }
                Ok(())
            }
            Some(_) => Ok(()),
        }
    }

    /// The least loaded instance offering `function` that is neither suspect nor in `tried`,
    /// with one call more counted on it.
    fn pick(&self, function: Function, tried: &[NodeId]) -> Option<(NodeId, String)> {
        let now = Instant::now();
        let mut st = lock(&self.inner.instances);
        let n = st.list.len();
        let start = st.next;
        let best = (0..n)
            .map(|k| (start + k) % n)
            .filter(|&i| {
                let inst = &st.list[i];
                inst.functions.contains(&function)
                    && !tried.contains(&inst.node)
                    && inst.suspect_until.is_none_or(|t| t <= now)
            })
            .min_by_key(|&i| st.list[i].outstanding)?;
        st.next = best + 1;
        let inst = &mut st.list[best];
        inst.outstanding += 1;
        Some((inst.node, inst.addr.clone()))
    }

    /// Counts the end of a call on `node`, and marks it suspect if it failed the call.
    fn done(&self, node: NodeId, failed: bool) {
        let mut st = lock(&self.inner.instances);
        if let Some(inst) = st.list.iter_mut().find(|i| i.node == node) {
            inst.outstanding = inst.outstanding.saturating_sub(1);
            if failed {
                inst.suspect_until = Some(Instant::now() + self.inner.config.suspect_for);
            }
        }
    }

    async fn remote(
        &self,
        master: &MasterClient,
        call: Call,
        input: Input,
    ) -> Result<Output, FuncCallError> {
        let function = call.function();
        let policy = self.inner.config.policy;
        if let Err(e) = self.ensure_listed().await {
            if policy.fallback_inline {
                tracing::debug!(error = %e, %function, "no function server list; running inline");
                return inline(call, input).await;
            }
            return Err(e);
        }
        let (layout, data) = split_input(&input);
        let req = CallRequest {
            call,
            input: layout,
        };
        let opts = CallOptions {
            timeout: Some(self.inner.config.call_timeout),
            ..Default::default()
        };
        let mut tried: Vec<NodeId> = Vec::new();
        let mut why: Vec<(String, String)> = Vec::new();
        // Instances that answered `Busy` this round: up, at their bound; tried again after a
        // pause while the call's time lasts.
        let mut busy: Vec<(NodeId, String)> = Vec::new();
        let until = Instant::now() + self.inner.config.call_timeout;
        let mut pause = BUSY_PAUSE_MIN;
        loop {
            while let Some((node, addr)) = self.pick(function, &tried) {
                tried.push(node);
                let sent = master
                    .client()
                    .call_with::<Apply>(&addr, &req, Payload::new(data.clone()), opts)
                    .await;
                let failure = match sent {
                    Ok((Ok(layout), payload)) => match join_output(layout, payload.bytes) {
                        Ok(out) if output_fits(function, &out) => {
                            self.done(node, false);
                            return Ok(out);
                        }
                        Ok(_) => "the output is not what the function produces".to_string(),
                        Err(e) => e.to_string(),
                    },
                    Ok((Err(e), _)) => {
                        self.done(node, false);
                        return Err(FuncCallError::Func(e));
                    }
                    Err(MsgrError::Remote { error, .. })
                        if ErrorCode::from_u32(error.code) == ErrorCode::Busy =>
                    {
                        self.done(node, false);
                        busy.push((node, addr));
                        continue;
                    }
                    Err(e @ (MsgrError::TooLarge { .. } | MsgrError::Shutdown)) => {
                        // No instance can take it (too large for a frame), or this process's
                        // messenger is stopping: not the instance's fault.
                        self.done(node, false);
                        why.push((addr, e.to_string()));
                        busy.clear();
                        break;
                    }
                    Err(e) => e.to_string(),
                };
                tracing::debug!(%addr, %function, error = %failure, "function server failed a call; trying another");
                self.done(node, true);
                why.push((addr, failure));
            }
            if busy.is_empty() || Instant::now() + pause > until {
                break;
            }
            // Every instance left is busy: wait for room on them, then try them again.
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(BUSY_PAUSE_MAX);
            tried.retain(|n| !busy.iter().any(|(b, _)| b == n));
            busy.clear();
        }
        why.extend(
            busy.into_iter()
                .map(|(_, addr)| (addr, "busy for the whole call timeout".to_string())),
        );
        if policy.fallback_inline {
            return inline(call, input).await;
        }
        Err(FuncCallError::NoInstance {
            function,
            tried: why,
        })
    }
}

/// Runs a call on a blocking thread: functions are CPU-bound and would stall the runtime's
/// other tasks.
async fn inline(call: Call, input: Input) -> Result<Output, FuncCallError> {
    let function = call.function();
    tokio::task::spawn_blocking(move || nacre_func::apply(&call, input))
        .await
        .map_err(|e| FuncCallError::Inline {
            function,
            reason: e.to_string(),
        })?
        .map_err(FuncCallError::Func)
}

/// Whether `out` is the kind of output `function` produces.
fn output_fits(function: Function, out: &Output) -> bool {
    matches!(
        (function, out),
        (
            Function::Compress | Function::Decompress | Function::EcReconstruct,
            Output::Bytes(_)
        ) | (Function::EcEncode, Output::Stripe(_))
            | (Function::EcRebuild, Output::Rebuilt(_))
            | (Function::Checksum, Output::Checksum(_))
    )
}

fn unexpected(call: Call) -> FuncCallError {
    FuncCallError::UnexpectedOutput {
        function: call.function(),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[tokio::test(flavor = "current_thread")]
    async fn an_inline_client_runs_the_functions_here() {
        let fc = FuncClient::inline(2);
        let block = Bytes::from("inline ".repeat(500));
        let frame = fc
            .compress(Codec::Zstd { level: 1 }, block.clone())
            .await
            .unwrap();
        assert!(frame.len() < block.len());
        assert_eq!(fc.decompress(frame.clone()).await.unwrap(), block);
        let mut bad = frame.to_vec();
        bad[3] ^= 1;
        let err = fc.decompress(Bytes::from(bad)).await.unwrap_err();
        assert!(matches!(err, FuncCallError::Func(_)), "{err}");

        let spec = EcSpec::new(2, 1).unwrap();
        let stripe = fc.ec_encode(spec, block.clone()).await.unwrap();
        let mut slots = stripe.clone().into_slots();
        slots[0] = None;
        assert_eq!(
            fc.ec_reconstruct(spec, stripe.len, slots).await.unwrap(),
            block
        );
        assert!(fc.instances().is_empty());
        fc.refresh().await.unwrap();
    }

    #[test]
    fn outputs_are_checked_against_the_function() {
        let b = Output::Bytes(Bytes::new());
        assert!(output_fits(Function::Compress, &b));
        assert!(output_fits(Function::EcReconstruct, &b));
        assert!(!output_fits(Function::EcEncode, &b));
        assert!(!output_fits(Function::Checksum, &b));
        assert!(output_fits(Function::Checksum, &Output::Checksum(1)));
    }
}
