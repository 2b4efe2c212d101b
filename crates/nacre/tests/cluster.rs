//! A real cluster of `nacre server` processes: three masters, three meta and three data nodes.
//! Volumes are created through the CLI after a master is killed, and the map survives the restart
//! of every master.
#![allow(clippy::unwrap_used)] // test helpers outside #[test] fns

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

mod common;
use common::{BIN, Proc, free_port};

struct Masters {
    addrs: Vec<String>,
    /// HTTP (admin API) address of master 1.
    http: String,
    dirs: Vec<PathBuf>,
    procs: Vec<Option<Proc>>,
}

impl Masters {
    fn peers(&self) -> String {
        let list: Vec<String> = self
            .addrs
            .iter()
            .enumerate()
            .map(|(i, a)| format!("\"{}={a}\"", i + 1))
            .collect();
        format!("[{}]", list.join(","))
    }

    fn start(&mut self, i: usize) {
        let p = Proc::spawn(&[
            ("NACRE_ROLE", "master".into()),
            ("NACRE_NAME", format!("master-{}", i + 1)),
            ("NACRE_LISTEN", self.addrs[i].clone()),
            (
                "NACRE_HTTP_LISTEN",
                if i == 0 {
                    self.http.clone()
                } else {
                    String::new()
                },
            ),
            ("NACRE_DATA_DIR", self.dirs[i].display().to_string()),
            ("NACRE_MASTER__ID", (i + 1).to_string()),
            ("NACRE_MASTER__PEERS", self.peers()),
            ("NACRE_MASTER__TICK_MS", "50".into()),
            ("NACRE_MASTER__DUTY_INTERVAL_MS", "200".into()),
            ("NACRE_MASTER__DEFAULT_TENANT", "false".into()),
            ("NACRE_MSGR__WORKERS", "1".into()),
        ]);
        self.procs[i] = Some(p);
    }

    fn list(&self) -> String {
        self.addrs.join(",")
    }
}

/// Runs the CLI against the masters; returns (success, stdout, stderr).
fn cli(masters: &str, args: &[&str]) -> (bool, String, String) {
    let out = Command::new(BIN)
        .args(args)
        .env("NACRE_MASTERS", masters)
        .env("NACRE_LOG", "warn")
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn cli_json(masters: &str, args: &[&str]) -> serde_json::Value {
    let mut args = args.to_vec();
    args.push("--json");
    let (ok, out, err) = cli(masters, &args);
    assert!(ok, "nacre {args:?} failed: {err}");
    serde_json::from_str(&out).unwrap()
}

fn leader_index(masters: &str) -> usize {
    let st = cli_json(masters, &["cluster", "status"]);
    let m = st["masters"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["leader"] == true)
        .unwrap();
    m["id"].as_u64().unwrap() as usize - 1
}

fn create_volume(masters: &str, name: &str) -> serde_json::Value {
    cli_json(
        masters,
        &[
            "vol",
            "create",
            name,
            "--owner",
            "team-a",
            "--meta-partitions",
            "2",
            "--data-partitions",
            "3",
            "--wait",
            "20",
        ],
    )
}

fn no_pending(masters: &str, volume: &str) -> bool {
    let ps = cli_json(masters, &["partition", "list", "--volume", volume]);
    let ps = ps.as_array().unwrap();
    ps.len() >= 5
        && ps
            .iter()
            .all(|p| p["pending"].as_array().unwrap().is_empty())
}

fn start_node(role: &str, i: usize, masters: &str, dir: &Path) -> Proc {
    let list: Vec<String> = masters.split(',').map(|m| format!("\"{m}\"")).collect();
    Proc::spawn(&[
        ("NACRE_ROLE", role.into()),
        ("NACRE_NAME", format!("{role}-{i}")),
        ("NACRE_LISTEN", "127.0.0.1:0".into()),
        ("NACRE_HTTP_LISTEN", String::new()),
        (
            "NACRE_DATA_DIR",
            dir.join(format!("{role}-{i}")).display().to_string(),
        ),
        ("NACRE_MASTERS", format!("[{}]", list.join(","))),
        ("NACRE_HEARTBEAT_MS", "200".into()),
        ("NACRE_MSGR__WORKERS", "1".into()),
    ])
}

#[test]
fn volumes_are_created_after_a_master_dies_and_survive_restarting_all_masters() {
    let dir = tempfile::tempdir().unwrap();
    let mut masters = Masters {
        addrs: (0..3)
            .map(|_| format!("127.0.0.1:{}", free_port()))
            .collect(),
        http: format!("127.0.0.1:{}", free_port()),
        dirs: (0..3)
            .map(|i| dir.path().join(format!("master-{i}")))
            .collect(),
        procs: vec![None, None, None],
    };
    for i in 0..3 {
        masters.start(i);
    }
    let list = masters.list();
    let mut nodes = Vec::new();
    for role in ["meta", "data"] {
        for i in 0..3 {
            nodes.push(start_node(role, i, &list, dir.path()));
        }
    }
    for n in &mut nodes {
        n.wait_log("registered with the master", Duration::from_secs(30));
    }

    // Clear errors for bad requests.
    let (ok, _, err) = cli(&list, &["vol", "create", "Bad_Name", "--owner", "x"]);
    assert!(!ok);
    assert!(err.contains("invalid volume name"), "{err}");
    let (ok, _, err) = cli(&list, &["vol", "create", "v0", "--owner", "nobody"]);
    assert!(!ok);
    assert!(err.contains("no tenant named \"nobody\""), "{err}");
    let (ok, _, err) = cli(
        &list,
        &["vol", "create", "v0", "--owner", "x", "--replicas", "5"],
    );
    assert!(!ok);
    assert!(
        err.contains("no tenant") || err.contains("need 5 nodes"),
        "{err}"
    );
    let t = cli_json(&list, &["tenant", "create", "team-a"]);
    assert!(t["access_key"].as_str().unwrap().starts_with("NACRE"));
    let (ok, _, err) = cli(
        &list,
        &[
            "vol",
            "create",
            "v0",
            "--owner",
            "team-a",
            "--replicas",
            "5",
        ],
    );
    assert!(!ok);
    assert!(
        err.contains("need 5 nodes for 5 replicas, only 3 are up"),
        "{err}"
    );

    let v = create_volume(&list, "before");
    assert_eq!(v["meta_partitions"], 2);
    assert!(no_pending(&list, "before"), "replicas created on the nodes");
    let (ok, _, err) = cli(&list, &["vol", "create", "before", "--owner", "team-a"]);
    assert!(!ok);
    assert!(err.contains("already exists"), "{err}");

    // Kill the leader: the survivors serve the CLI, and the new volume's replicas get created.
    let l = leader_index(&list);
    masters.procs[l].as_mut().unwrap().kill();
    let v = create_volume(&list, "after-leader-died");
    assert_eq!(v["data_partitions"], 3);
    assert!(no_pending(&list, "after-leader-died"));

    // Bring it back, kill a follower instead: still fine.
    masters.start(l);
    let l2 = leader_index(&list);
    let follower = (0..3).find(|&i| i != l2).unwrap();
    masters.procs[follower].as_mut().unwrap().kill();
    create_volume(&list, "after-follower-died");
    masters.start(follower);

    // Restart every master: the map comes back from their logs.
    for i in 0..3 {
        masters.procs[i].as_mut().unwrap().kill();
    }
    for i in 0..3 {
        masters.start(i);
    }
    let vols = cli_json(&list, &["vol", "list"]);
    let mut names: Vec<&str> = vols
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v["name"].as_str().unwrap())
        .collect();
    names.sort_unstable();
    assert_eq!(
        names,
        ["after-follower-died", "after-leader-died", "before"]
    );
    let nodes_json = cli_json(&list, &["node", "list"]);
    assert_eq!(nodes_json.as_array().unwrap().len(), 6);

    // Deleting a volume and its tenant; the table forms print.
    let (ok, out, err) = cli(&list, &["vol", "info", "before"]);
    assert!(ok, "{err}");
    assert!(out.contains("[1, 16777217)"), "{out}");
    let (ok, _, err) = cli(&list, &["vol", "delete", "before"]);
    assert!(ok, "{err}");
    let (ok, out, _) = cli(&list, &["cluster", "status"]);
    assert!(ok);
    assert!(out.contains("leader"), "{out}");

    // The HTTP/JSON admin API on a master (any master answers; it forwards to the leader).
    let h = &masters.http;
    let (code, body) = http(h, "GET", "/api/v1/status", "");
    assert_eq!(code, 200, "{body}");
    assert_eq!(body["masters"].as_array().unwrap().len(), 3);
    let req = r#"{"name":"http-vol","owner":"team-a","meta_partitions":1,"data_partitions":2}"#;
    let (code, body) = http(h, "POST", "/api/v1/volumes", req);
    assert_eq!(code, 201, "{body}");
    assert_eq!(body["name"], "http-vol");
    let (code, body) = http(h, "POST", "/api/v1/volumes", req);
    assert_eq!(code, 409, "{body}");
    assert!(body["error"].as_str().unwrap().contains("already exists"));
    let (code, _) = http(h, "POST", "/api/v1/volumes", r#"{"name":"Bad Name"}"#);
    assert_eq!(code, 400);
    let (code, _) = http(h, "GET", "/api/v1/volumes/nope", "");
    assert_eq!(code, 404);
    let (code, body) = http(h, "GET", "/api/v1/volumes/http-vol", "");
    assert_eq!(code, 200);
    assert_eq!(body["partitions"].as_array().unwrap().len(), 3);
    let (code, _) = http(h, "DELETE", "/api/v1/volumes/http-vol", "");
    assert_eq!(code, 204);
    let (code, body) = http(h, "GET", "/api/v1/nodes", "");
    assert_eq!(code, 200);
    assert_eq!(body.as_array().unwrap().len(), 6);
}

/// One HTTP/1.1 request; returns the status code and the JSON body (null if none).
fn http(addr: &str, method: &str, path: &str, body: &str) -> (u16, serde_json::Value) {
    use std::io::{Read as _, Write as _};
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    let code = out[9..12].parse().unwrap();
    let json = out
        .split_once("\r\n\r\n")
        .map(|(_, b)| serde_json::from_str(b).unwrap_or(serde_json::Value::Null))
        .unwrap_or(serde_json::Value::Null);
    (code, json)
}
