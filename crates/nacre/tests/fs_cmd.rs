//! `nacre fs …` against a `nacre up` cluster, as a user runs them: mkdir, put, ls, stat, get, cat,
//! rm, and clear errors.
#![allow(clippy::unwrap_used)] // test helpers outside #[test] fns

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Output, Stdio};
use std::sync::mpsc;
use std::time::Duration;

const BIN: &str = env!("CARGO_BIN_EXE_nacre");

/// Kills the child on drop so a failing test leaves no process behind.
struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts `nacre up` with its state in `dir/.nacre` and waits (bounded) until it says it is up.
fn start_up(dir: &Path) -> Proc {
    let log = std::fs::File::create(dir.join("up.log")).unwrap();
    let mut child = Proc(
        Command::new(BIN)
            .args(["up", "--dir", ".nacre"])
            .current_dir(dir)
            .stdout(Stdio::piped())
            .stderr(log)
            .spawn()
            .unwrap(),
    );
    let stdout = child.0.stdout.take().unwrap();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let deadline = std::time::Instant::now() + Duration::from_secs(90);
    loop {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        match rx.recv_timeout(left) {
            Ok(line) if line.starts_with("nacre is up") => break,
            Ok(_) => {}
            Err(e) => panic!(
                "nacre up did not come up ({e}); its log:\n{}",
                std::fs::read_to_string(dir.join("up.log")).unwrap_or_default()
            ),
        }
    }
    assert!(dir.join(".nacre/up.json").exists());
    child
}

/// Runs `nacre ARGS` in `dir`.
fn nacre(dir: &Path, args: &[&str]) -> Output {
    Command::new(BIN)
        .args(args)
        .current_dir(dir)
        .env_remove("NACRE_MASTERS")
        .output()
        .unwrap()
}

/// Runs `nacre ARGS` in `dir`; fails the test with its stderr if it fails; returns its stdout.
fn ok(dir: &Path, args: &[&str]) -> String {
    let out = nacre(dir, args);
    assert!(
        out.status.success(),
        "nacre {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// Runs `nacre ARGS` in `dir`, which must fail; returns its stderr.
fn fails(dir: &Path, args: &[&str]) -> String {
    let out = nacre(dir, args);
    assert!(
        !out.status.success(),
        "nacre {args:?} succeeded: {}",
        String::from_utf8_lossy(&out.stdout)
    );
    String::from_utf8(out.stderr).unwrap()
}

fn random_bytes(n: usize, mut seed: u64) -> Vec<u8> {
    (0..n)
        .map(|_| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed as u8
        })
        .collect()
}

#[test]
fn fs_commands_copy_list_and_remove_files_in_a_volume() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let _up = start_up(dir);
    let out = nacre(dir, &["vol", "create", "default", "--wait", "30"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() || err.contains("exists"),
        "vol create default: {err}"
    );

    let big = random_bytes(3 << 20, 0x9e37_79b9_7f4a_7c15);
    let small = b"ten bytes!".to_vec();
    std::fs::write(dir.join("big.bin"), &big).unwrap();
    std::fs::write(dir.join("small.txt"), &small).unwrap();
    for f in ["big.bin", "small.txt"] {
        use std::os::unix::fs::PermissionsExt as _;
        let perm = std::fs::Permissions::from_mode(0o644);
        std::fs::set_permissions(dir.join(f), perm).unwrap();
    }

    // mkdir -p is idempotent; plain mkdir of an existing directory is an error.
    ok(dir, &["fs", "mkdir", "-p", "/a/b"]);
    ok(dir, &["fs", "mkdir", "-p", "/a/b"]);
    let err = fails(dir, &["fs", "mkdir", "/a/b"]);
    assert!(err.contains("nacre fs mkdir /a/b: file exists"), "{err}");
    ok(dir, &["fs", "mkdir", "/a/c"]);

    // put: to a path, into a directory, and with -p.
    let out = ok(dir, &["fs", "put", "big.bin", "/a/b/big.bin"]);
    assert!(
        out.contains("3145728 bytes") && out.contains("MiB/s"),
        "{out}"
    );
    ok(dir, &["fs", "put", "small.txt", "/a/b/"]);
    ok(dir, &["fs", "put", "-p", "small.txt", "/x/y/z.txt"]);
    let err = fails(dir, &["fs", "put", "small.txt", "/nope/z.txt"]);
    assert!(
        err.contains("nacre fs put /nope/z.txt: no such file or directory"),
        "{err}"
    );

    // ls, ls -l, ls --json
    assert_eq!(ok(dir, &["fs", "ls", "/a/b"]), "big.bin\nsmall.txt\n");
    assert_eq!(ok(dir, &["fs", "ls"]), "a\nx\n");
    let long = ok(dir, &["fs", "ls", "-l", "/a"]);
    assert!(
        long.lines()
            .any(|l| l.contains("drwxr-xr-x") && l.ends_with(" b")),
        "{long}"
    );
    let rows: Vec<serde_json::Value> = ok(dir, &["fs", "ls", "--json", "/a/b"])
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(rows.len(), 2);
    assert_eq!(rows[0]["name"], "big.bin");
    assert_eq!(rows[0]["size"], 3 << 20);
    assert_eq!(rows[1]["name"], "small.txt");
    assert_eq!(rows[1]["size"], 10);
    assert_eq!(rows[1]["kind"], "file");

    // stat
    let st: serde_json::Value =
        serde_json::from_str(&ok(dir, &["fs", "stat", "--json", "/a/b/big.bin"])).unwrap();
    assert_eq!(st["size"], 3 << 20);
    assert_eq!(st["kind"], "file");
    assert_eq!(st["nlink"], 1);
    assert_eq!(st["mode"], "0644");
    assert_eq!(st["path"], "/a/b/big.bin");
    let text = ok(dir, &["fs", "stat", "/a"]);
    assert!(
        text.contains("type: dir") && text.contains("links: 4"),
        "{text}"
    );

    // get, get to stdout, cat
    let out = ok(dir, &["fs", "get", "/a/b/big.bin", "copy.bin"]);
    assert!(out.contains("3145728 bytes"), "{out}");
    assert!(std::fs::read(dir.join("copy.bin")).unwrap() == big);
    std::fs::create_dir(dir.join("into")).unwrap();
    ok(dir, &["fs", "get", "/x/y/z.txt", "into"]);
    assert_eq!(std::fs::read(dir.join("into/z.txt")).unwrap(), small);
    let out = nacre(dir, &["fs", "get", "/a/b/small.txt", "-"]);
    assert!(out.status.success());
    assert_eq!(out.stdout, small);
    assert_eq!(ok(dir, &["fs", "cat", "/a/b/small.txt"]).as_bytes(), small);

    // put over an existing file replaces it
    ok(dir, &["fs", "put", "small.txt", "/a/b/big.bin"]);
    assert_eq!(ok(dir, &["fs", "cat", "/a/b/big.bin"]).as_bytes(), small);

    // errors: clear, non-zero, and no half-written local file
    let err = fails(dir, &["fs", "get", "/missing", "out.bin"]);
    assert!(
        err.contains("nacre fs get /missing: no such file or directory"),
        "{err}"
    );
    assert!(!dir.join("out.bin").exists());
    let err = fails(dir, &["fs", "cat", "/a"]);
    assert!(err.contains("nacre fs cat /a: is a directory"), "{err}");
    let err = fails(dir, &["fs", "ls", "/a/b/small.txt/x"]);
    assert!(err.contains("not a directory"), "{err}");
    let err = fails(dir, &["fs", "--volume", "nope", "ls"]);
    assert!(err.contains("cannot open volume nope"), "{err}");

    // rm: files, and directories only with -r
    ok(dir, &["fs", "rm", "/a/b/small.txt"]);
    assert_eq!(ok(dir, &["fs", "ls", "/a/b"]), "big.bin\n");
    let err = fails(dir, &["fs", "rm", "/a"]);
    assert!(err.contains("nacre fs rm /a: is a directory"), "{err}");
    ok(dir, &["fs", "rm", "-r", "/a"]);
    ok(dir, &["fs", "rm", "-r", "/x"]);
    assert_eq!(ok(dir, &["fs", "ls", "/"]), "");
    let err = fails(dir, &["fs", "stat", "/a"]);
    assert!(
        err.contains("nacre fs stat /a: no such file or directory"),
        "{err}"
    );
}
