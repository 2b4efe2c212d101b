//! The `kill-client` schedule: kill -9 of the client itself. A process of its own
//! (`nacre check client`, [`client`]) runs the client a mount runs, small files written behind,
//! over a seeded workload of small files in a directory of its own, and journals every call
//! ([`journal`]). The harness lets it run for a random time, kills it, and reads its directory
//! back through a fresh client ([`check`]): what an fsync or a directory fsync covered must be
//! there exactly; what none covered may be lost, or cut to a prefix, but never be another file's
//! bytes, another version's, or bytes nobody wrote ([`judge`]). Then a new incarnation starts in
//! a new directory. At the end of the run every incarnation's directory is checked again: what
//! was synced must not decay under the node faults that followed.

pub mod check;
pub mod client;
pub mod content;
pub mod journal;
pub mod judge;
#[cfg(test)]
mod tests;

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use nacre_client::{Caller, FileSystem, NetFs};
use nacre_msgr::Client;
use serde::Serialize;
use tokio::io::{AsyncBufReadExt as _, BufReader};
use tokio::sync::watch;

use self::check::{Checked, Digest, Outcomes, check_dir};
use self::journal::{Op, Record};
use self::judge::{Expectations, JournalStats, Violation, What};
use super::workload::{not_found, until_stopped};
use super::{Fault, connect, fault};

/// The volume directory the incarnations work in (`/kill-client/iN`).
const ROOT: &str = "kill-client";
/// Files changed between their two checks that the report names.
const SHOWN_CHANGES: usize = 20;
/// Journal lines shown for a file with a violation.
const EXCERPT_LINES: usize = 40;

/// What the loop needs from the run.
#[derive(Debug)]
pub struct Ctx {
    /// The `nacre` binary.
    pub exe: PathBuf,
    pub masters: Vec<String>,
    /// The run's directory: journals go to `kill-client/`, the clients' logs to `logs/`.
    pub dir: PathBuf,
    /// `NACRE_LOG` of the client processes.
    pub log: String,
    /// A client lives a random time between a tenth and half of this.
    pub interval: Duration,
    pub seed: u64,
    /// When the run's faults started (faults are timed from it).
    pub start: Instant,
    /// For the checking clients.
    pub client: Client,
}

/// The figures of the schedule.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Report {
    /// Client processes started.
    pub incarnations: u64,
    /// Killed by the harness while running.
    pub kills: u64,
    /// Ended by themselves: a call failed (see `failures`), or the process exited.
    pub exited: u64,
    /// Never said they were ready (could not connect or make their directory).
    pub not_ready: u64,
    /// All journals together.
    pub journal: JournalStats,
    /// Checks of a directory right after its client died.
    pub checks: u64,
    /// Files those checks looked for (absent and deferred ones included), and bytes read.
    pub files_checked: u64,
    pub bytes_read: u64,
    /// In which allowed state the checks found the files.
    pub outcomes: Outcomes,
    /// Files that could not be read right after a kill (checked at the end instead).
    pub deferred: u64,
    /// Files judged again at the end of the run.
    pub rechecked_files: u64,
    /// Files whose content at the end differs from what the first check saw (allowed: a
    /// request of the dead client may still have been applied after it).
    pub changed_since_check: u64,
    /// The first few of those: path, then and now.
    pub changes: Vec<String>,
    /// The calls that ended incarnations by failing.
    pub failures: Vec<String>,
    pub violations: Vec<Violation>,
    /// For each path with a violation: its journal lines (its calls, and the syncs); shown as
    /// the run's `history`.
    #[serde(skip)]
    pub journals: BTreeMap<String, Vec<String>>,
}

/// One incarnation, as the final check needs it.
#[derive(Debug)]
struct Incarnation {
    inc: u32,
    exp: Expectations,
    journal: String,
    seen: BTreeMap<u32, Digest>,
}

/// How an incarnation ended.
#[derive(Debug)]
enum Ended {
    Killed { after: Duration },
    Exited(String),
    NotReady(String),
}

/// The loop: incarnations started, killed and checked one after the other.
#[derive(Debug)]
pub struct Crashes {
    ctx: Ctx,
    pub report: Report,
    pub(super) faults: Vec<Fault>,
    done: Vec<Incarnation>,
    rng: fastrand::Rng,
}

impl Crashes {
    pub fn new(ctx: Ctx) -> Self {
        let rng = fastrand::Rng::with_seed(ctx.seed ^ 0xC11E_47D1);
        Self {
            ctx,
            report: Report::default(),
            faults: Vec::new(),
            done: Vec::new(),
            rng,
        }
    }

    fn base(inc: u32) -> String {
        format!("/{ROOT}/i{inc}")
    }

    fn journal_path(&self, inc: u32) -> PathBuf {
        self.ctx.dir.join(ROOT).join(format!("i{inc}.journal"))
    }

    /// A client of its own for checking (nothing cached from an earlier check); retried, as
    /// the masters may be between leaders.
    async fn checker(&self) -> anyhow::Result<NetFs> {
        let mut tries = 0;
        loop {
            match connect(self.ctx.client.clone(), &self.ctx.masters).await {
                Ok(vol) => return Ok(NetFs::new(vol)),
                Err(e) if tries >= 30 => return Err(e),
                Err(_) => tries += 1,
            }
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
    }

    /// Runs incarnations until `stop` turns true; the one running then is killed and checked
    /// too.
    pub async fn run(&mut self, mut stop: watch::Receiver<bool>) -> anyhow::Result<()> {
        std::fs::create_dir_all(self.ctx.dir.join(ROOT))?;
        let fs = self.checker().await?;
        ensure_root(&fs).await?;
        let mut inc = 0u32;
        while !*stop.borrow() {
            inc += 1;
            let i = self.ctx.interval;
            let life = i / 10 + i.mul_f64(0.4 * self.rng.f64());
            let ended = self.incarnation(inc, life, &mut stop).await?;
            let node = format!("client-i{inc}");
            let (kind, detail) = match &ended {
                Ended::Killed { after } => {
                    self.report.kills += 1;
                    ("kill-client", format!("after {} ms", after.as_millis()))
                }
                Ended::Exited(why) => {
                    self.report.exited += 1;
                    ("client-exited", why.clone())
                }
                Ended::NotReady(why) => {
                    self.report.not_ready += 1;
                    ("client-not-ready", why.clone())
                }
            };
            self.faults.push(fault(self.ctx.start, kind, &node, detail));
            self.check(inc).await?;
        }
        Ok(())
    }

    /// Starts incarnation `inc`, waits until it is ready, lets it run for `life` and kills it.
    async fn incarnation(
        &mut self,
        inc: u32,
        life: Duration,
        stop: &mut watch::Receiver<bool>,
    ) -> anyhow::Result<Ended> {
        self.report.incarnations += 1;
        let c = &self.ctx;
        let log_path = c.dir.join("logs").join(format!("client-i{inc}.log"));
        let log = std::fs::File::create(&log_path)
            .with_context(|| format!("cannot create {}", log_path.display()))?;
        let mut child = tokio::process::Command::new(&c.exe)
            .args(["check", "client", "--master", &c.masters.join(",")])
            .args(["--path", &Self::base(inc)])
            .args(["--incarnation", &inc.to_string()])
            .arg("--journal")
            .arg(self.journal_path(inc))
            .args(["--seed", &(c.seed ^ u64::from(inc)).to_string()])
            .env("NACRE_LOG", &c.log)
            // The client exits when its standard input closes: it never outlives the harness.
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(log)
            .kill_on_drop(true)
            .spawn()
            .context("cannot start the client")?;
        // Held until the client is dead: `wait` would close it, and the client exit.
        let _stdin = child.stdin.take();
        let stdout = child.stdout.take().context("the client has no stdout")?;
        let mut lines = BufReader::new(stdout).lines();
        let ready = async {
            while let Some(l) = lines.next_line().await? {
                if l == "ready" {
                    return Ok(true);
                }
            }
            std::io::Result::Ok(false)
        };
        let ready = tokio::select! {
            r = tokio::time::timeout(client::READY_WITHIN, ready) => match r {
                Ok(Ok(true)) => None,
                Ok(Ok(false)) => Some("exited before it was ready".to_string()),
                Ok(Err(e)) => Some(format!("reading its output: {e}")),
                Err(_) => Some(format!("not ready within {:?}", client::READY_WITHIN)),
            },
            () = until_stopped(stop) => Some("the run stopped".to_string()),
        };
        if let Some(why) = ready {
            let _ = child.start_kill();
            let status = child.wait().await?;
            return Ok(Ended::NotReady(format!("{why} ({status})")));
        }
        let t0 = Instant::now();
        let exited = tokio::select! {
            s = child.wait() => Some(s?),
            () = tokio::time::sleep(life) => None,
            () = until_stopped(stop) => None,
        };
        if let Some(status) = exited {
            return Ok(Ended::Exited(status.to_string()));
        }
        child.start_kill()?;
        child.wait().await?;
        Ok(Ended::Killed {
            after: t0.elapsed(),
        })
    }

    /// Reads incarnation `inc`'s journal and checks its directory.
    async fn check(&mut self, inc: u32) -> anyhow::Result<()> {
        let journal = match std::fs::read_to_string(self.journal_path(inc)) {
            Ok(t) => t,
            // Not ready: no journal, and nothing may be in its directory.
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => format!("{}\n", header(inc)),
            Err(e) => return Err(e).context("cannot read a journal"),
        };
        let exp = match journal::parse(&journal).and_then(|r| Expectations::from_records(&r)) {
            Ok(exp) => exp,
            Err(e) => {
                let path = self.journal_path(inc).display().to_string();
                self.violation(
                    Violation {
                        path,
                        what: What::Unreadable,
                        offset: None,
                        detail: e.to_string(),
                    },
                    &journal,
                    None,
                );
                return Ok(());
            }
        };
        if let Some(why) = &exp.failed {
            self.report.failures.push(format!("i{inc}: {why}"));
        }
        add_stats(&mut self.report.journal, &exp.stats);
        let fs = self.checker().await?;
        let base = Self::base(inc);
        let got = check_dir(&fs, &base, &names(inc), &exp).await;
        self.report.checks += 1;
        self.report.files_checked += got.seen.len() as u64 + got.unreadable.len() as u64;
        self.report.bytes_read += got.bytes_read;
        self.report.outcomes.add(&got.outcomes);
        self.report.deferred += got.unreadable.len() as u64;
        let Checked {
            violations, seen, ..
        } = got;
        for v in violations {
            self.violation(v, &journal, None);
        }
        self.done.push(Incarnation {
            inc,
            exp,
            journal,
            seen,
        });
        Ok(())
    }

    fn violation(&mut self, v: Violation, journal: &str, file: Option<u32>) {
        let file = file.or_else(|| {
            v.path
                .rsplit('/')
                .next()
                .and_then(|n| n.strip_prefix('f'))
                .and_then(|n| n.parse().ok())
        });
        let lines = excerpt(journal, file);
        self.report.journals.insert(v.path.clone(), lines);
        self.report.violations.push(v);
    }

    /// Checks every incarnation's directory again through `fs` (after the faults stopped):
    /// everything must still be allowed, and what was synced still there. A violation the
    /// first check reported already is not repeated.
    pub async fn recheck<F: FileSystem + Sync>(&mut self, fs: &F) {
        let reported: BTreeSet<(String, What)> = self
            .report
            .violations
            .iter()
            .map(|v| (v.path.clone(), v.what))
            .collect();
        let done = std::mem::take(&mut self.done);
        for i in &done {
            let got = check_dir(fs, &Self::base(i.inc), &names(i.inc), &i.exp).await;
            self.report.rechecked_files += got.seen.len() as u64;
            for (f, now) in &got.seen {
                let Some(was) = i.seen.get(f).filter(|was| *was != now) else {
                    continue;
                };
                self.report.changed_since_check += 1;
                if self.report.changes.len() < SHOWN_CHANGES {
                    let path = format!("{}/f{f}", Self::base(i.inc));
                    self.report
                        .changes
                        .push(format!("{path}: {was} then, {now} now"));
                }
            }
            for v in got.violations {
                if !reported.contains(&(v.path.clone(), v.what)) {
                    self.violation(v, &i.journal, None);
                }
            }
            for (path, error) in got.unreadable {
                let v = Violation {
                    path,
                    what: What::Unreadable,
                    offset: None,
                    detail: error,
                };
                self.violation(v, &i.journal, None);
            }
        }
        self.done = done;
    }
}

fn header(inc: u32) -> Record {
    Record::Header { inc }
}

fn names(inc: u32) -> Vec<String> {
    vec![ROOT.to_string(), format!("i{inc}")]
}

fn add_stats(to: &mut JournalStats, s: &JournalStats) {
    to.started += s.started;
    to.done += s.done;
    to.writes += s.writes;
    to.bytes_written += s.bytes_written;
    to.unlinks += s.unlinks;
    to.fsyncs += s.fsyncs;
    to.syncs += s.syncs;
}

/// The journal's lines about `file`, each followed by the first `done sync` after it (the one
/// that covered it), and the journal's last line (the call in progress at the kill); the last
/// [`EXCERPT_LINES`] of them, numbered.
fn excerpt(journal: &str, file: Option<u32>) -> Vec<String> {
    let parsed = |l: &str| {
        journal::parse(&format!("{l}\n"))
            .ok()
            .and_then(|r| r.into_iter().next())
            .map(|(_, r)| r)
    };
    let lines: Vec<&str> = journal.lines().collect();
    let mut keep = BTreeSet::new();
    let mut want_sync = false;
    for (i, l) in lines.iter().enumerate() {
        match parsed(l) {
            Some(Record::Done(Op::Sync)) if want_sync => {
                keep.insert(i);
                want_sync = false;
            }
            Some(Record::Start(op) | Record::Done(op)) if file.is_some() && op.file() == file => {
                keep.insert(i);
                want_sync = true;
            }
            Some(Record::Header { .. } | Record::Fail(_)) | None => {
                keep.insert(i);
            }
            _ => {}
        }
    }
    keep.insert(lines.len().saturating_sub(1));
    let out: Vec<String> = keep
        .into_iter()
        .filter_map(|i| lines.get(i).map(|l| format!("{}: {l}", i + 1)))
        .collect();
    out[out.len().saturating_sub(EXCERPT_LINES)..].to_vec()
}

/// Makes `/kill-client` (retried: the cluster may be between faults).
async fn ensure_root<F: FileSystem + Sync>(fs: &F) -> anyhow::Result<()> {
    let mut last = String::new();
    for i in 0..50 {
        if i > 0 {
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        let root = nacre_api::meta::ROOT_INO;
        match fs.lookup(root, ROOT.as_bytes()).await {
            Ok(_) => return Ok(()),
            Err(e) if not_found(&e) => {}
            Err(e) => {
                last = e.to_string();
                continue;
            }
        }
        match fs
            .mkdir(root, ROOT.as_bytes(), 0o755, Caller::default())
            .await
        {
            Ok(_) => return Ok(()),
            Err(e) => last = e.to_string(),
        }
    }
    anyhow::bail!("cannot make /{ROOT}: {last}")
}
