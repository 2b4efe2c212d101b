//! The reliability harness's fault schedules, bounded: each runs `nacre check run` (ten server
//! processes, the verifying workload, faults, the checker) for a short while and requires that no
//! acknowledged operation was lost. The 30-minute soak is the same command with
//! `--schedule all --duration 30m` (docs/reliability.md).
#![allow(clippy::unwrap_used)]

use std::process::Command;
use std::sync::Mutex;

mod common;
use common::BIN;

/// One cluster at a time: ten processes on a 2-core machine.
static ONE: Mutex<()> = Mutex::new(());

/// The run's directory, kept when the test fails: the servers' logs and data are in it.
struct KeepOnFailure(Option<tempfile::TempDir>);

impl KeepOnFailure {
    fn path(&self) -> &std::path::Path {
        self.0.as_ref().map(|d| d.path()).unwrap()
    }
}

impl Drop for KeepOnFailure {
    fn drop(&mut self) {
        if std::thread::panicking()
            && let Some(d) = self.0.take()
        {
            eprintln!(
                "kept the run's directory (logs, data): {}",
                d.keep().display()
            );
        }
    }
}

/// Runs one schedule and returns its JSON summary, after checking the invariants every schedule
/// shares.
fn schedule(name: &str, secs: u32) -> serde_json::Value {
    schedule_with(name, secs, &[])
}

/// [`schedule`] with more arguments to `nacre check run`.
fn schedule_with(name: &str, secs: u32, more: &[&str]) -> serde_json::Value {
    let _one = ONE.lock().unwrap_or_else(|e| e.into_inner());
    let dir = KeepOnFailure(Some(tempfile::tempdir().unwrap()));
    let out = Command::new(BIN)
        .args([
            "check",
            "run",
            "--schedule",
            name,
            "--duration",
            &format!("{secs}s"),
            "--interval",
            "4s",
            "--clients",
            "3",
            "--seed",
            "7",
            "--json",
            "--keep",
            "--dir",
        ])
        .arg(dir.path().join("c"))
        .args(more)
        .env("NACRE_LOG", "warn")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    let summary: serde_json::Value = stdout
        .lines()
        .rev()
        .find_map(|l| serde_json::from_str(l).ok())
        .unwrap_or_else(|| panic!("no JSON summary from {name}:\n{stdout}\n{stderr}"));
    let pretty = serde_json::to_string_pretty(&summary).unwrap();
    assert!(
        out.status.success(),
        "schedule {name} failed:\n{pretty}\n{stderr}"
    );
    let report = &summary["report"];
    assert_eq!(report["lost_ops"], 0, "{pretty}");
    assert_eq!(report["findings"].as_array().unwrap().len(), 0, "{pretty}");
    assert_eq!(summary["clients_gave_up"], 0, "{pretty}");
    assert!(
        summary["ops_acked"].as_u64().unwrap() > 20,
        "too little work done: {pretty}"
    );
    assert!(
        summary["healed_within_ms"].is_u64(),
        "the cluster did not become writable again: {pretty}"
    );
    // The garbage collector left no extent no meta partition references, and every sweep ran.
    assert_eq!(summary["gc"]["unreferenced_left"], 0, "{pretty}");
    assert_eq!(
        summary["gc"]["errors"].as_array().unwrap().len(),
        0,
        "{pretty}"
    );
    summary
}

fn faults(s: &serde_json::Value, kind: &str) -> usize {
    s["faults"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|f| f["kind"] == kind)
        .count()
}

#[test]
fn kill_data_nodes() {
    let s = schedule("kill-data", 16);
    assert!(faults(&s, "kill-data") >= 2, "{s}");
}

/// Clients that write behind as a mount does (names in their directories, small files' data
/// after close) lose nothing a call acknowledged while data and meta nodes die under them.
#[test]
fn kill_data_and_meta_nodes_under_write_behind() {
    let s = schedule_with("kill-data", 12, &["--write-behind"]);
    assert!(faults(&s, "kill-data") >= 2, "{s}");
    let s = schedule_with("kill-meta", 12, &["--write-behind"]);
    assert!(faults(&s, "kill-meta") >= 2, "{s}");
}

/// A client process writing small files behind as a mount does, killed with -9 every second or
/// two while a data and a meta node die too: what an fsync or a directory fsync acknowledged is
/// there after each kill and at the end, and no file shows another's bytes or bytes nobody wrote
/// (`src/check/kill_client/`).
#[test]
fn kill_the_client() {
    let s = schedule("kill-client", 16);
    assert!(faults(&s, "kill-client") >= 5, "{s}");
    assert!(faults(&s, "kill-data") >= 1, "{s}");
    assert!(faults(&s, "kill-meta") >= 1, "{s}");
    let k = &s["kill_client"];
    assert_eq!(k["violations"].as_array().unwrap().len(), 0, "{s}");
    assert_eq!(k["checks"], k["incarnations"], "{s}");
    let n = |v: &serde_json::Value| v.as_u64().unwrap();
    assert!(
        n(&k["journal"]["fsyncs"]) + n(&k["journal"]["syncs"]) >= 10,
        "{s}"
    );
    // Synced files were there to lose, and were checked again at the end.
    assert!(n(&k["outcomes"]["synced"]) >= 20, "{s}");
    assert!(
        n(&k["rechecked_files"]) >= n(&k["outcomes"]["synced"]),
        "{s}"
    );
}

#[test]
fn kill_meta_nodes() {
    let s = schedule("kill-meta", 16);
    assert!(faults(&s, "kill-meta") >= 2, "{s}");
}

#[test]
fn kill_the_master_leader() {
    let s = schedule("kill-master", 16);
    assert!(faults(&s, "kill-master") >= 2, "{s}");
    // Every kill of the leader is followed by a successful write to the map.
    assert!(
        s["failovers"].as_array().unwrap().len() >= 2,
        "no fail-over measured: {s}"
    );
}

#[test]
fn network_partitions() {
    let s = schedule("partition", 16);
    assert!(faults(&s, "partition") >= 2, "{s}");
}

#[test]
fn corrupted_blocks() {
    let s = schedule("corrupt", 12);
    assert!(faults(&s, "corrupt") >= 3, "{s}");
}

/// On an erasure-coded volume (2+1): data nodes killed under the workload (reads of their shards
/// reconstructed from the others), and flipped bytes in shards found by the scrub and rebuilt
/// from the other replicas.
#[test]
fn an_erasure_coded_volume_under_kills_and_flipped_bytes() {
    let s = schedule_with("kill-data", 12, &["--ec", "2+1"]);
    assert!(faults(&s, "kill-data") >= 2, "{s}");
    assert_eq!(s["erasure_code"], "2+1", "{s}");
    let s = schedule_with("corrupt", 12, &["--ec", "2+1"]);
    assert!(faults(&s, "corrupt") >= 3, "{s}");
}

#[test]
fn bad_input_on_every_port() {
    let s = schedule("garbage", 8);
    assert!(faults(&s, "garbage") >= 1, "{s}");
    assert_eq!(s["garbage_problems"].as_array().unwrap().len(), 0, "{s}");
    // Every node was serving, so none was skipped.
    let skipped = s["faults"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|f| f["kind"] == "garbage" && f["detail"] != "")
        .count();
    assert_eq!(skipped, 0, "{s}");
}

#[test]
fn a_full_disk() {
    let mkfs = Command::new("mkfs.ext4")
        .arg("-V")
        .output()
        .is_ok_and(|o| o.status.success());
    if !rustix::process::geteuid().is_root()
        || !mkfs
        || !std::path::Path::new("/dev/loop-control").exists()
    {
        eprintln!("skipped: the full-disk schedule needs root, mkfs.ext4 and a loop device");
        return;
    }
    let s = schedule("full-disk", 16);
    assert_eq!(faults(&s, "full-disk"), 1, "{s}");
    assert_eq!(faults(&s, "free-disk"), 1, "{s}");
}
