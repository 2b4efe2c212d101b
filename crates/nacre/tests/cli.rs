//! The `nacre` binary as a user runs it: config file plus environment overrides, ping, metrics,
//! clean stop on SIGTERM.
#![allow(clippy::unwrap_used)] // test helpers outside #[test] fns

use std::io::{BufRead, BufReader, Read, Write};
use std::process::{Child, Command, Stdio};

const BIN: &str = env!("CARGO_BIN_EXE_nacre");

/// Kills the child on drop so a failing test leaves no process behind.
struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Runs a command to completion, fails the test with its stderr if it fails, returns its stdout.
fn run_ok(cmd: &mut Command) -> String {
    let out = cmd.output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

fn http_get(addr: &str, path: &str) -> String {
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    out
}

const SCHED_BATCH: u32 = 3;

/// The scheduling policy of each thread of process `pid` (field 41 of `/proc/PID/task/TID/stat`).
fn thread_policies(pid: u32) -> Vec<u32> {
    let mut out = Vec::new();
    for t in std::fs::read_dir(format!("/proc/{pid}/task")).unwrap() {
        let stat = std::fs::read_to_string(t.unwrap().path().join("stat")).unwrap();
        // Fields after the command name (in parentheses, which may hold spaces) start at field 3.
        let rest = &stat[stat.rfind(')').unwrap() + 1..];
        out.push(
            rest.split_whitespace()
                .nth(41 - 3)
                .unwrap()
                .parse()
                .unwrap(),
        );
    }
    out
}

#[test]
fn sched_normal_leaves_threads_on_the_default_policy() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("node.toml");
    std::fs::write(&cfg, "listen = \"127.0.0.1:0\"\n[msgr]\nworkers = 1\n").unwrap();
    let mut child = Proc(
        Command::new(BIN)
            .args(["server", "--sched", "normal", "--config"])
            .arg(&cfg)
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    // The first line says it listens: its runtime and messenger threads exist by then.
    let mut lines = BufReader::new(child.0.stdout.take().unwrap()).lines();
    assert!(lines.next().unwrap().unwrap().contains("listening on"));
    let policies = thread_policies(child.0.id());
    assert!(policies.len() > 2, "{policies:?}");
    assert!(policies.iter().all(|&p| p == 0), "{policies:?}");
}

#[test]
fn server_runs_from_config_with_env_overrides_and_stops_on_sigterm() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("node.toml");
    std::fs::write(
        &cfg,
        "name = \"from-file\"\nlisten = \"127.0.0.1:0\"\nhttp_listen = \"127.0.0.1:0\"\n[msgr]\nworkers = 1\n",
    )
    .unwrap();

    // --print-config shows the file merged with NACRE_* overrides.
    let text = run_ok(
        Command::new(BIN)
            .args(["server", "--print-config", "--config"])
            .arg(&cfg)
            .env("NACRE_NAME", "from-env")
            .env("NACRE_MSGR__WORKERS", "3")
            .env("NACRE_SPARE_BYTES", "0"),
    );
    assert!(text.contains("name = \"from-env\""), "{text}");
    assert!(text.contains("workers = 3"), "{text}");
    assert!(text.contains("spare_bytes = 0\n"), "{text}");
    assert!(text.contains("spare_keep_secs = 60\n"), "{text}");
    assert!(text.contains("direct_streams = 8\n"), "{text}");

    let mut child = Proc(
        Command::new(BIN)
            .args(["server", "--config"])
            .arg(&cfg)
            .env("NACRE_NAME", "from-env")
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let mut lines = BufReader::new(child.0.stdout.take().unwrap()).lines();
    let first = lines.next().unwrap().unwrap();
    let addr = first.rsplit(' ').next().unwrap().to_string();
    let second = lines.next().unwrap().unwrap();
    let metrics = second
        .trim_start_matches("http: http://")
        .trim_end_matches("/metrics")
        .to_string();

    let ping = Command::new(BIN)
        .args(["ping", &addr, "-n", "2"])
        .output()
        .unwrap();
    let ping_out = String::from_utf8_lossy(&ping.stdout);
    assert!(ping.status.success(), "{ping_out}");
    assert!(ping_out.contains("from-env"), "{ping_out}");
    let echo = Command::new(BIN)
        .args(["ping", &addr, "-n", "1", "--size", "64k"])
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&echo.stdout).contains("65536 bytes echoed"));

    let m = http_get(&metrics, "/metrics");
    assert!(m.starts_with("HTTP/1.1 200"), "{m}");
    assert!(
        m.contains("nacre_msgr_frames_total{worker=\"0\",dir=\"in\"}"),
        "{m}"
    );
    // The data node's gauges are registered on every node (zero where none runs).
    assert!(m.contains("\nnacre_data_spare_bytes 0\n"), "{m}");
    assert!(http_get(&metrics, "/health").contains("ok"));

    // Every thread runs under SCHED_BATCH (the default `--sched`), runtime and messenger included.
    let policies = thread_policies(child.0.id());
    assert!(policies.len() > 2, "{policies:?}");
    assert!(policies.iter().all(|&p| p == SCHED_BATCH), "{policies:?}");

    let st = Command::new("kill")
        .args(["-TERM", &child.0.id().to_string()])
        .status()
        .unwrap();
    assert!(st.success());
    let status = child.0.wait().unwrap();
    assert!(status.success(), "server exited with {status}");
}

#[test]
fn bad_config_is_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("node.toml");
    std::fs::write(&cfg, "listen = \"127.0.0.1:0\"\nlisten_typo = 1\n").unwrap();
    let out = Command::new(BIN)
        .args(["server", "--config"])
        .arg(&cfg)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("listen_typo"), "{err}");

    let out = Command::new(BIN)
        .args(["server", "--print-config"])
        .env("NACRE_MSGR__ASSIGN", "fastest")
        .output()
        .unwrap();
    // Printing does not validate; starting does.
    assert!(out.status.success());
    let out = Command::new(BIN)
        .args(["server"])
        .env("NACRE_MSGR__ASSIGN", "fastest")
        .env("NACRE_LISTEN", "127.0.0.1:0")
        .env("NACRE_HTTP_LISTEN", "")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("unknown connection assignment policy"),
        "{err}"
    );
}

#[test]
fn bench_msgr_prints_json_rows_with_units() {
    let text = run_ok(Command::new(BIN).args([
        "bench",
        "msgr",
        "--sizes",
        "4k",
        "--inflight",
        "1,4",
        "--secs",
        "0.1",
        "--warmup-secs",
        "0",
        "--json",
    ]));
    let rows: Vec<serde_json::Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(rows.len(), 4, "{text}");
    for r in &rows {
        assert_eq!(r["bench"], "msgr");
        assert_eq!(r["size"], 4096);
        for k in ["ops_per_s", "mib_per_s", "p50_us", "p99_us"] {
            assert!(r[k].as_f64().unwrap() > 0.0, "{k} in {r}");
        }
    }
    assert!(rows.iter().any(|r| r["impl"] == "raw-tcp"));
    assert!(
        rows.iter()
            .any(|r| r["impl"] == "nacre" && r["vs_baseline"].is_number())
    );
}

#[test]
fn up_starts_a_cluster_the_admin_commands_find() {
    let dir = tempfile::tempdir().unwrap();
    let mut child = Proc(
        Command::new(BIN)
            .arg("up")
            .current_dir(dir.path())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let mut lines = BufReader::new(child.0.stdout.take().unwrap()).lines();
    let first = lines.next().unwrap().unwrap();
    assert!(first.starts_with("nacre is up"), "{first}");
    // Nobody reads its output from here on (a terminal closed, a pipe's reader gone): the
    // cluster keeps running, and the "stopping…" it prints at SIGTERM does not kill it half way.
    drop(lines);
    let admin = |args: &[&str]| run_ok(Command::new(BIN).args(args).current_dir(dir.path()));
    let out = admin(&["vol", "create", "demo", "--wait", "20"]);
    assert!(out.contains("volume demo created"), "{out}");
    assert!(!out.contains("warning"), "{out}");
    let info: serde_json::Value =
        serde_json::from_str(&admin(&["vol", "info", "demo", "--json"])).unwrap();
    assert_eq!(info["volume"]["owner"], "default");
    assert_eq!(info["partitions"].as_array().unwrap().len(), 13);
    // A sweep of the new volume (nothing to collect) on each of its 10 data partitions; `vol
    // info` then shows every partition swept.
    let swept: serde_json::Value = serde_json::from_str(&admin(&[
        "vol",
        "gc",
        "demo",
        "--grace-secs",
        "0",
        "--json",
    ]))
    .unwrap();
    let swept = swept.as_array().unwrap();
    assert_eq!(swept.len(), 10, "{swept:?}");
    assert!(swept.iter().all(|r| r["error"].is_null()), "{swept:?}");
    let info: serde_json::Value =
        serde_json::from_str(&admin(&["vol", "info", "demo", "--json"])).unwrap();
    assert_eq!(info["gc"]["unswept"], 0, "{info}");
    assert_eq!(info["gc"]["unreferenced_bytes"], 0, "{info}");
    let nodes = admin(&["node", "list"]);
    assert_eq!(nodes.matches(" up ").count(), 7, "{nodes}");
    // A node's messenger, asked directly: its workers and the connections the cluster opened.
    let listed: serde_json::Value =
        serde_json::from_str(&admin(&["node", "list", "--json"])).unwrap();
    let data = listed
        .as_array()
        .unwrap()
        .iter()
        .find(|n| n["role"] == "Data")
        .unwrap();
    let addr = data["addr"].as_str().unwrap();
    let info: serde_json::Value =
        serde_json::from_str(&admin(&["node", "info", addr, "--json"])).unwrap();
    assert_eq!(info["balance"], "off", "{info}");
    assert!(!info["workers"].as_array().unwrap().is_empty(), "{info}");
    let conns = info["connections"].as_array().unwrap();
    assert!(conns.iter().any(|c| c["side"] == "server"), "{info}");
    let table = admin(&["node", "info", addr]);
    assert!(
        table.contains("balancer off") && table.contains("peer"),
        "{table}"
    );
    // The function server `up` starts by default.
    let funcs: serde_json::Value = serde_json::from_str(&admin(&["func", "ls", "--json"])).unwrap();
    let funcs = funcs.as_array().unwrap();
    assert_eq!(funcs.len(), 1, "{funcs:?}");
    assert_eq!(funcs[0]["status"], "Up");
    assert_eq!(funcs[0]["capacity"], 64);
    let table = admin(&["func", "ls"]);
    assert!(table.contains(" up ") && table.contains("all"), "{table}");

    let st = Command::new("kill")
        .args(["-TERM", &child.0.id().to_string()])
        .status()
        .unwrap();
    assert!(st.success());
    assert!(child.0.wait().unwrap().success());
    assert!(!dir.path().join(".nacre/up.json").exists());
}

#[test]
fn bench_meta_runs_every_mdtest_phase_against_a_local_cluster() {
    let text = run_ok(Command::new(BIN).args([
        "bench",
        "meta",
        "--clients",
        "2",
        "--items",
        "5",
        "--branch",
        "2",
        "--depth",
        "1",
        "--json",
    ]));
    let rows: Vec<serde_json::Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let phases: Vec<&str> = rows.iter().map(|r| r["phase"].as_str().unwrap()).collect();
    assert_eq!(
        phases,
        [
            "TreeCreation",
            "DirCreation",
            "DirStat",
            "DirRemoval",
            "FileCreation",
            "FileStat",
            "FileRemoval",
            "TreeRemoval"
        ]
    );
    for r in &rows {
        assert_eq!(
            (r["bench"].as_str(), r["impl"].as_str()),
            (Some("meta"), Some("nacre"))
        );
        assert!(r["ops_per_s"].as_f64().unwrap() > 0.0, "{r}");
    }
    // 2 clients × 5 items; each tree has 2 directories below the client's root.
    assert_eq!(rows[1]["ops"], 10);
    assert_eq!(rows[0]["ops"], 4);

    let mem: serde_json::Value = serde_json::from_str(&run_ok(
        Command::new(BIN).args(["bench", "meta", "--memory", "2000", "--json"]),
    ))
    .unwrap();
    let per_file = mem["bytes_per_file"].as_f64().unwrap();
    assert!(per_file > 50.0 && per_file < 400.0, "{mem}");
}
