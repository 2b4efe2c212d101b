//! How long a restarted data node's partitions stay unwritable: from the node's restart, through
//! its first word to the master (its registration), until every data partition with a replica on
//! it is writable again, as the master's view shows it (read-write, with a leader) and as a write
//! shows it (a new extent and an append to it succeed on the partition's leader).

use std::collections::BTreeMap;
use std::sync::Mutex;

use nacre_types::sync::lock;

use super::*;

/// The longest a data partition should stay unwritable after its restarted node reported to the
/// master (docs/reliability.md, "Writable after a restart"). A reported figure, not a reason to
/// fail the run: on a loaded 2-core host the restarted node's partitions open in 0.3–2 s, so the
/// slowest partition of a restart passes it now and then.
pub(super) const WRITABLE_WITHIN: Duration = Duration::from_secs(2);

/// How long the measurement waits before it gives up on a figure.
const LIMIT: Duration = Duration::from_secs(60);

/// One data node restart, measured.
#[derive(Clone, Debug, Serialize)]
pub(super) struct Recovery {
    pub(super) node: String,
    /// When the node restarted, since the run's start.
    pub(super) at_ms: u64,
    /// The data partitions with a replica on the node.
    pub(super) partitions: usize,
    /// From the restart (the process started) to the master's first sign of the node.
    pub(super) reported_ms: Option<u64>,
    /// From that sign to every one of the partitions read-write with a leader in the master's
    /// view (0: already so when the node reported).
    pub(super) view_ms: Option<u64>,
    /// From that sign to a successful write (a new extent and an append) on every one of them.
    pub(super) write_ms: Option<u64>,
    /// The partition that took longest (by either figure), with its two figures.
    pub(super) slowest: Option<String>,
}

impl Recovery {
    /// The slower of the two figures (None: one never came).
    pub(super) fn worst_ms(&self) -> Option<u64> {
        Some(self.view_ms?.max(self.write_ms?))
    }

    /// Whether every partition was writable within [`WRITABLE_WITHIN`] of the report (printed).
    pub(super) fn within_limit(&self) -> bool {
        self.worst_ms()
            .is_some_and(|ms| ms <= WRITABLE_WITHIN.as_millis() as u64)
    }
}

/// Now, in the master's clock (the same host's wall clock), in ms since the Unix epoch.
fn wall_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// Measures the restart of data node `node` (address `addr`), started at `restarted` (an instant
/// and the wall clock's ms then), until every partition on it was writable or `next_fault`
/// changes (the schedule's next fault). Writes to each partition every 100 ms.
pub(super) async fn measure(
    mc: MasterClient,
    vol: Arc<NetVolume>,
    node: String,
    addr: String,
    restarted: (Instant, u64),
    run_start: Instant,
    mut next_fault: watch::Receiver<u64>,
) -> Recovery {
    next_fault.borrow_and_update();
    let (t0, wall0) = restarted;
    let mut out = Recovery {
        node,
        at_ms: t0.saturating_duration_since(run_start).as_millis() as u64,
        partitions: 0,
        reported_ms: None,
        view_ms: None,
        write_ms: None,
        slowest: None,
    };
    // The node's id and its partitions, then the master's first sign of it since the restart.
    let mut reported: Option<Instant> = None;
    let mut parts: Vec<PartitionId> = Vec::new();
    while reported.is_none() && t0.elapsed() < LIMIT {
        if let (Ok(map), Ok(v)) = (mc.cluster_map().await, mc.volume(VOLUME).await)
            && let Some(n) = map.nodes.values().find(|n| n.addr == addr)
        {
            parts = v
                .data_partitions
                .iter()
                .filter(|p| p.spec.replicas.iter().any(|r| r.node == n.id))
                .map(|p| p.spec.id)
                .collect();
            if n.last_heartbeat_ms >= wall0 {
                reported = Some(Instant::now());
            }
        }
        if reported.is_none() {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    let Some(at) = reported else {
        return out;
    };
    out.partitions = parts.len();
    out.reported_ms = Some(at.duration_since(t0).as_millis() as u64);
    let since = |t: Instant| t.saturating_duration_since(at).as_millis() as u64;
    // Each partition is timed until it is first writable: a later fault (the next node killed)
    // may take it down again, which is that fault's to account for. The measurement ends at the
    // next fault: a partition not writable by then counts as never (over the limit). The master
    // is asked every 100 ms (every restart measured at once asks it).
    let view = Mutex::new(BTreeMap::<PartitionId, u64>::new());
    let writes = Mutex::new(BTreeMap::<PartitionId, u64>::new());
    let watch_view = async {
        while at.elapsed() < LIMIT && lock(&view).len() < parts.len() {
            if let Ok(v) = mc.volume(VOLUME).await {
                let now = since(Instant::now());
                let mut seen = lock(&view);
                for p in &v.data_partitions {
                    if parts.contains(&p.spec.id)
                        && p.status == PartitionStatus::Rw
                        && p.leader.is_some()
                    {
                        seen.entry(p.spec.id).or_insert(now);
                    }
                }
            }
            if lock(&view).len() < parts.len() {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    };
    let write_all = async {
        let mut set = tokio::task::JoinSet::new();
        for p in parts.clone() {
            let vol = vol.clone();
            set.spawn(async move { (p, first_write(&vol, p, at).await) });
        }
        while let Some(r) = set.join_next().await {
            if let Ok((p, Some(t))) = r {
                lock(&writes).insert(p, since(t));
            }
        }
    };
    tokio::select! {
        _ = async { tokio::join!(watch_view, write_all) } => {}
        _ = next_fault.changed() => {}
    }
    let (view, writes) = (lock(&view).clone(), lock(&writes).clone());
    let worst = |m: &BTreeMap<PartitionId, u64>| {
        (m.len() == parts.len()).then(|| m.values().copied().max().unwrap_or(0))
    };
    out.view_ms = worst(&view);
    out.write_ms = worst(&writes);
    out.slowest = parts
        .iter()
        .map(|p| {
            let v = view.get(p).copied();
            let w = writes.get(p).copied();
            let key = v.unwrap_or(u64::MAX).max(w.unwrap_or(u64::MAX));
            (key, *p, v, w)
        })
        .max_by_key(|(key, ..)| *key)
        .map(|(_, p, v, w)| {
            let ms = |x: Option<u64>| x.map_or("never".to_string(), |x| format!("{x} ms"));
            format!("{p}: {} / {}", ms(v), ms(w))
        });
    out
}

/// Writes to `partition` every 100 ms (a new extent and a 4 KiB append to it, each attempt
/// bounded) until one succeeds; when it did.
async fn first_write(vol: &NetVolume, partition: PartitionId, since: Instant) -> Option<Instant> {
    let data = bytes::Bytes::from(vec![0x5A; 4096]);
    while since.elapsed() < LIMIT {
        let attempt = async {
            let e = vol.create_extent(partition).await.ok()?;
            vol.append(partition, e, 0, data.clone()).await.ok()
        };
        let tried = Instant::now();
        if let Ok(Some(_)) = tokio::time::timeout(Duration::from_secs(1), attempt).await {
            return Some(Instant::now());
        }
        if let Some(rest) = Duration::from_millis(100).checked_sub(tried.elapsed()) {
            tokio::time::sleep(rest).await;
        }
    }
    None
}

/// Now, for [`measure`]'s `restarted`.
pub(super) fn now() -> (Instant, u64) {
    (Instant::now(), wall_ms())
}
