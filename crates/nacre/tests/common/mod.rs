//! Helpers shared by the multi-process tests: server processes that are killed on drop, with their
//! log lines readable by the test.
#![allow(dead_code, clippy::unwrap_used)]

pub mod cluster;

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

pub const BIN: &str = env!("CARGO_BIN_EXE_nacre");

/// A server process; killed on drop. Its stderr (the log) is read by a thread into `log`.
pub struct Proc {
    child: Child,
    log: mpsc::Receiver<String>,
    seen: Vec<String>,
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Proc {
    pub fn spawn(envs: &[(&str, String)]) -> Self {
        let mut cmd = Command::new(BIN);
        cmd.arg("server")
            .env("NACRE_LOG", "info")
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        // The tests' own knobs (NACRE_TEST_SEED, …) are not server settings: a server refuses
        // unknown NACRE_* variables.
        for (k, _) in std::env::vars_os() {
            if k.to_string_lossy().starts_with("NACRE_TEST_") {
                cmd.env_remove(k);
            }
        }
        for (k, v) in envs {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn().unwrap();
        let stderr = child.stderr.take().unwrap();
        let (tx, log) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        Self {
            child,
            log,
            seen: Vec::new(),
        }
    }

    /// Waits until the log has a line containing `needle` (including lines already seen).
    pub fn wait_log(&mut self, needle: &str, timeout: Duration) {
        if self.seen.iter().any(|l| l.contains(needle)) {
            return;
        }
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.log.recv_timeout(left) {
                Ok(line) => {
                    let hit = line.contains(needle);
                    self.seen.push(line);
                    if hit {
                        return;
                    }
                }
                Err(_) => panic!(
                    "no log line with {needle:?} within {timeout:?}; log:\n{}",
                    self.seen.join("\n")
                ),
            }
        }
    }

    /// Stops the process (SIGSTOP): it holds its connections and answers nothing, as a node cut
    /// off the network does, until [`Proc::resume`].
    pub fn pause(&self) {
        self.signal("-STOP");
    }

    /// Lets a paused process run again (SIGCONT).
    pub fn resume(&self) {
        self.signal("-CONT");
    }

    fn signal(&self, sig: &str) {
        let ok = Command::new("kill")
            .args([sig, &self.child.id().to_string()])
            .status()
            .unwrap()
            .success();
        assert!(ok, "kill {sig} {} failed", self.child.id());
    }

    pub fn kill(&mut self) {
        self.child.kill().unwrap();
        self.child.wait().unwrap();
    }
}

#[path = "../../src/check/port.rs"]
mod port;

/// A free loopback port below the ephemeral range (see `src/check/port.rs`).
pub fn free_port() -> u16 {
    port::free_port("127.0.0.1").unwrap()
}
