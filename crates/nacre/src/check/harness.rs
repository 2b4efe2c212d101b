//! The harness's cluster: three masters, three meta nodes and four data nodes, one `nacre server`
//! process each with its own data directory, and the faults it can inflict on them.
//!
//! Every node keeps its address for the life of the harness (the master knows nodes by address, so
//! a restarted process is the same node). With `netns`, every node runs in a network namespace of
//! its own, joined to a bridge on the host by a veth pair: cutting the host end isolates that node
//! from everyone (a network partition), and healing brings the link back. Without it (not root, or
//! no `ip`), nodes listen on 127.0.0.1 and an isolation is a SIGSTOP freeze instead.
//!
//! Dropping the harness kills every process it started (by PID), unmounts what it mounted and
//! deletes its namespaces and bridge, also when a run fails half way.

use nacre_master::MasterAdmin as _;
use std::collections::HashSet;
use std::fs::{File, OpenOptions};
use std::io::{self, Seek, Write};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use nacre_client::MasterClient;
use nacre_master::map::{NodeStatus, Role as MapRole};
use rustix::process::{Pid, Signal, kill_process};
use serde::Serialize;

use super::flips::Flip;
use super::port::free_port;
use nacre_types::{ExtentId, PartitionId};

/// Seconds between the starts of the data nodes' scrub passes in a harness cluster (a deployment's
/// default is a day).
pub const SCRUB_PERIOD_SECS: u64 = 10;
/// Bytes per second the data nodes' scrub reads in the harness: a pass over the 2 GiB a node holds
/// after a 30-minute soak takes under a minute, and four nodes scrubbing back to back leave this
/// 2-core host's disk room for the nodes' own work (Raft rounds stall for seconds at 128 MiB/s).
pub const SCRUB_RATE: u64 = 48 << 20;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    Master,
    Meta,
    Data,
}

impl Role {
    fn name(self) -> &'static str {
        match self {
            Self::Master => "master",
            Self::Meta => "meta",
            Self::Data => "data",
        }
    }
}

/// How the harness is built.
#[derive(Clone, Debug)]
pub struct HarnessConfig {
    /// Data directories, logs and the PID file go here.
    pub dir: PathBuf,
    /// The `nacre` binary the nodes run.
    pub exe: PathBuf,
    /// Put every node in a network namespace of its own (needs root and `ip`).
    pub netns: bool,
    /// Put data node 0's directory on a loop-mounted ext4 file system of this many MiB (needs root,
    /// `mkfs.ext4` and a loop device), so that it can be filled.
    pub small_disk_mib: Option<u64>,
    /// `NACRE_LOG` of the nodes.
    pub log: String,
}

/// One node process.
#[derive(Debug)]
pub struct Node {
    pub role: Role,
    pub name: String,
    pub addr: String,
    pub http: String,
    pub dir: PathBuf,
    envs: Vec<(String, String)>,
    netns: Option<Netns>,
    child: Option<Child>,
    isolated: bool,
}

#[derive(Clone, Debug)]
struct Netns {
    ns: String,
    host_if: String,
}

impl Node {
    pub fn isolated(&self) -> bool {
        self.isolated
    }

    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Started and not exited (a process that stopped by itself, e.g. on a dead disk, is not).
    pub fn alive(&mut self) -> bool {
        self.child
            .as_mut()
            .is_some_and(|c| matches!(c.try_wait(), Ok(None)))
    }

    /// How the process ended, if it was started and has exited by itself.
    fn exited(&mut self) -> Option<std::process::ExitStatus> {
        self.child
            .as_mut()
            .and_then(|c| c.try_wait().ok().flatten())
    }
}

/// The running cluster.
#[derive(Debug)]
pub struct Harness {
    pub nodes: Vec<Node>,
    cfg: HarnessConfig,
    bridge: Option<String>,
    namespaces: Vec<String>,
    loop_mount: Option<PathBuf>,
    /// What an isolation does in this harness: "netns" or "sigstop".
    pub isolation: &'static str,
    /// Blocks already corrupted on some replica: never corrupt the same block twice.
    corrupted: HashSet<(String, String, u64)>,
    /// Every byte flipped, in order (`flips`).
    pub flips: Vec<Flip>,
}

/// Runs a command; its failure is an error naming it.
fn run(program: &str, args: &[&str]) -> anyhow::Result<()> {
    let out = Command::new(program)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("cannot run {program}"))?;
    if !out.status.success() {
        bail!(
            "{program} {} failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

/// Whether network namespaces can be made here: root and a working `ip netns`.
pub fn netns_available() -> bool {
    rustix::process::geteuid().is_root()
        && Command::new("ip")
            .args(["netns", "list"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
}

/// Whether a loop-mounted small disk can be made here.
pub fn small_disk_available() -> bool {
    rustix::process::geteuid().is_root()
        && Path::new("/dev/loop-control").exists()
        && Command::new("mkfs.ext4")
            .arg("-V")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
}

impl Harness {
    /// Lays out the nodes (namespaces, disks, addresses) and starts every process.
    pub fn start(cfg: HarnessConfig) -> anyhow::Result<Self> {
        std::fs::create_dir_all(cfg.dir.join("logs"))
            .with_context(|| format!("cannot create {}", cfg.dir.display()))?;
        let roles: Vec<(Role, usize)> = (0..3)
            .map(|i| (Role::Master, i))
            .chain((0..3).map(|i| (Role::Meta, i)))
            .chain((0..4).map(|i| (Role::Data, i)))
            .collect();
        let mut h = Self {
            nodes: Vec::new(),
            cfg: cfg.clone(),
            bridge: None,
            namespaces: Vec::new(),
            loop_mount: None,
            isolation: if cfg.netns { "netns" } else { "sigstop" },
            corrupted: HashSet::new(),
            flips: Vec::new(),
        };
        // Names unique to this run: two harnesses may run at once on one host.
        let tag = std::process::id() % 100_000;
        let subnet = format!("10.{}.{}", 100 + (tag / 256) % 150, tag % 256);
        if cfg.netns {
            let br = format!("nk{tag}br");
            run("ip", &["link", "add", &br, "type", "bridge"])?;
            h.bridge = Some(br.clone());
            run(
                "ip",
                &["addr", "add", &format!("{subnet}.1/24"), "dev", &br],
            )?;
            run("ip", &["link", "set", &br, "up"])?;
        }
        for (k, &(role, i)) in roles.iter().enumerate() {
            let name = format!("{}-{i}", role.name());
            let dir = cfg.dir.join(&name);
            std::fs::create_dir_all(&dir)?;
            let (ip, netns) = if cfg.netns {
                let ip = format!("{subnet}.{}", k + 2);
                (ip.clone(), Some(h.make_netns(tag, k, &ip)?))
            } else {
                ("127.0.0.1".to_string(), None)
            };
            let (addr, http) = if netns.is_some() {
                (format!("{ip}:7000"), format!("{ip}:7001"))
            } else {
                let addr = || -> anyhow::Result<String> {
                    Ok(format!(
                        "{ip}:{}",
                        free_port(&ip).context("cannot find a free port")?
                    ))
                };
                (addr()?, addr()?)
            };
            if role == Role::Data
                && i == 0
                && let Some(mib) = cfg.small_disk_mib
            {
                h.small_disk(&dir, mib)?;
            }
            h.nodes.push(Node {
                role,
                name,
                addr,
                http,
                dir,
                envs: Vec::new(),
                netns,
                child: None,
                isolated: false,
            });
        }
        let masters: Vec<String> = h.masters();
        let peers: Vec<String> = masters
            .iter()
            .enumerate()
            .map(|(i, a)| format!("\"{}={a}\"", i + 1))
            .collect();
        let peers = format!("[{}]", peers.join(","));
        let quoted: Vec<String> = masters.iter().map(|m| format!("\"{m}\"")).collect();
        let masters_list = format!("[{}]", quoted.join(","));
        for (k, n) in h.nodes.iter_mut().enumerate() {
            let (_, i) = roles[k];
            let mut envs = vec![
                ("NACRE_ROLE", n.role.name().to_string()),
                ("NACRE_NAME", n.name.clone()),
                ("NACRE_LISTEN", n.addr.clone()),
                ("NACRE_HTTP_LISTEN", n.http.clone()),
                ("NACRE_DATA_DIR", n.dir.display().to_string()),
                ("NACRE_LOG", cfg.log.clone()),
            ];
            if n.role == Role::Master {
                envs.push(("NACRE_MASTER__ID", (i + 1).to_string()));
                envs.push(("NACRE_MASTER__PEERS", peers.clone()));
                envs.push(("NACRE_MASTER__DEFAULT_TENANT", "false".into()));
            } else {
                envs.push(("NACRE_MASTERS", masters_list.clone()));
            }
            if n.role == Role::Data {
                // The background scrub runs often enough, and fast enough, to meet the blocks
                // the `corrupt` schedule flips within a run (`flips`).
                envs.push(("NACRE_SCRUB_PERIOD_SECS", SCRUB_PERIOD_SECS.to_string()));
                envs.push(("NACRE_SCRUB_RATE", SCRUB_RATE.to_string()));
            }
            n.envs = envs.into_iter().map(|(k, v)| (k.to_string(), v)).collect();
        }
        for k in 0..h.nodes.len() {
            h.spawn(k)?;
        }
        Ok(h)
    }

    fn make_netns(&mut self, tag: u32, k: usize, ip: &str) -> anyhow::Result<Netns> {
        let ns = format!("nk{tag}n{k}");
        let (host_if, ns_if) = (format!("nk{tag}h{k}"), format!("nk{tag}v{k}"));
        let br = self.bridge.clone().unwrap_or_default();
        run("ip", &["netns", "add", &ns])?;
        let made = Netns {
            ns: ns.clone(),
            host_if: host_if.clone(),
        };
        // Recorded before the rest, so that drop deletes it if a later step fails.
        self.namespaces.push(ns.clone());
        let steps: Vec<Vec<&str>> = vec![
            vec![
                "link", "add", &host_if, "type", "veth", "peer", "name", &ns_if,
            ],
            vec!["link", "set", &ns_if, "netns", &ns],
            vec!["link", "set", &host_if, "master", &br],
            vec!["link", "set", &host_if, "up"],
        ];
        for s in steps {
            run("ip", &s)?;
        }
        let cidr = format!("{ip}/24");
        for s in [
            vec![
                "netns", "exec", &ns, "ip", "addr", "add", &cidr, "dev", &ns_if,
            ],
            vec!["netns", "exec", &ns, "ip", "link", "set", &ns_if, "up"],
            vec!["netns", "exec", &ns, "ip", "link", "set", "lo", "up"],
        ] {
            run("ip", &s)?;
        }
        Ok(made)
    }

    fn small_disk(&mut self, dir: &Path, mib: u64) -> anyhow::Result<()> {
        let img = self.cfg.dir.join("small-disk.img");
        File::create(&img)?.set_len(mib << 20)?;
        let img_s = img.display().to_string();
        run("mkfs.ext4", &["-q", "-F", &img_s])?;
        run("mount", &["-o", "loop", &img_s, &dir.display().to_string()])?;
        self.loop_mount = Some(dir.to_path_buf());
        Ok(())
    }

    /// The masters' messenger addresses.
    pub fn masters(&self) -> Vec<String> {
        self.nodes
            .iter()
            .filter(|n| n.role == Role::Master)
            .map(|n| n.addr.clone())
            .collect()
    }

    /// Indexes of the nodes of a role.
    pub fn of(&self, role: Role) -> Vec<usize> {
        (0..self.nodes.len())
            .filter(|&k| self.nodes[k].role == role)
            .collect()
    }

    /// What a supervisor (systemd, Kubernetes) does: starts again every node process that exited
    /// by itself (fail-stop on a dead disk or log). Returns each one's name and exit status.
    pub fn restart_exited(&mut self) -> anyhow::Result<Vec<(String, String)>> {
        let mut out = Vec::new();
        for k in 0..self.nodes.len() {
            if let Some(status) = self.nodes[k].exited() {
                self.spawn(k)?;
                out.push((self.nodes[k].name.clone(), status.to_string()));
            }
        }
        Ok(out)
    }

    /// Starts node `k`'s process (its log is appended to `logs/NAME.log`).
    pub fn spawn(&mut self, k: usize) -> anyhow::Result<()> {
        let exe = self.cfg.exe.clone();
        let log_path = self.log_path(k);
        let n = &mut self.nodes[k];
        // A process that exited by itself (fail-stop on a dead disk) is started again too.
        if let Some(c) = &mut n.child {
            match c.try_wait() {
                Ok(None) => return Ok(()),
                _ => n.child = None,
            }
        }
        let log = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log_path)?;
        let mut cmd = match &n.netns {
            Some(ns) => {
                let mut c = Command::new("ip");
                c.args(["netns", "exec", &ns.ns]).arg(&exe);
                c
            }
            None => Command::new(&exe),
        };
        cmd.arg("server")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log);
        for (k, v) in &n.envs {
            cmd.env(k, v);
        }
        let child = cmd
            .spawn()
            .with_context(|| format!("cannot start {}", n.name))?;
        n.child = Some(child);
        self.write_pids();
        Ok(())
    }

    /// kill -9 of node `k` (reaped at once).
    pub fn kill(&mut self, k: usize) {
        if let Some(mut c) = self.nodes[k].child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
        self.nodes[k].isolated = false;
        self.write_pids();
    }

    /// PIDs of the running processes in `pids` (for an operator cleaning up after a crash of the
    /// harness itself: `kill $(cat pids)`).
    fn write_pids(&self) {
        let pids: Vec<String> = self
            .nodes
            .iter()
            .filter_map(|n| n.pid().map(|p| p.to_string()))
            .collect();
        let _ = std::fs::write(self.cfg.dir.join("pids"), pids.join("\n") + "\n");
    }

    /// Cuts node `k` off the network (or freezes it).
    pub fn isolate(&mut self, k: usize) -> anyhow::Result<()> {
        let n = &mut self.nodes[k];
        match &n.netns {
            Some(ns) => run("ip", &["link", "set", &ns.host_if, "down"])?,
            None => signal(n, Signal::STOP)?,
        }
        n.isolated = true;
        Ok(())
    }

    /// Undoes [`Self::isolate`].
    pub fn heal(&mut self, k: usize) -> anyhow::Result<()> {
        let n = &mut self.nodes[k];
        if !n.isolated {
            return Ok(());
        }
        match &n.netns {
            Some(ns) => run("ip", &["link", "set", &ns.host_if, "up"])?,
            None => signal(n, Signal::CONT)?,
        }
        n.isolated = false;
        Ok(())
    }

    /// Fills the small disk (data node 0's directory) to the last byte with a filler file, its
    /// blocks allocated with `fallocate` (no gigabytes to write and sync on a shared host), the
    /// last ones written. Returns the filler's size.
    pub fn fill_disk(&self) -> anyhow::Result<u64> {
        let Some(dir) = &self.loop_mount else {
            bail!("this harness has no small disk");
        };
        let mut f = File::create(dir.join("filler"))?;
        let st = rustix::fs::statvfs(dir)?;
        // Root (the harness) may use the blocks reserved for it, too.
        let mut want = st.f_bfree.saturating_mul(st.f_frsize);
        let mut filled = 0u64;
        while want >= 1 << 20 {
            match rustix::fs::fallocate(&f, rustix::fs::FallocateFlags::empty(), filled, want) {
                Ok(()) => filled += want,
                Err(_) => want /= 2,
            }
        }
        // Whatever is left, a block at a time.
        f.seek(io::SeekFrom::Start(filled))?;
        let small = vec![0xA5u8; 4096];
        while let Ok(n) = f.write(&small) {
            if n == 0 {
                break;
            }
            filled += n as u64;
        }
        let _ = f.sync_all();
        Ok(filled)
    }

    /// Frees the small disk again.
    pub fn free_disk(&self) -> io::Result<()> {
        match &self.loop_mount {
            Some(dir) => match std::fs::remove_file(dir.join("filler")) {
                Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
                r => r,
            },
            None => Ok(()),
        }
    }

    /// Flips one byte of a block of some extent file on data node `k`, never a block corrupted
    /// before on any node (so a healthy replica of every block remains). Returns what it hit.
    pub fn corrupt(&mut self, k: usize, rng: &mut fastrand::Rng) -> anyhow::Result<Option<String>> {
        let root = self.nodes[k].dir.join("extents");
        let mut files = Vec::new();
        for part in std::fs::read_dir(&root).into_iter().flatten().flatten() {
            for f in std::fs::read_dir(part.path())
                .into_iter()
                .flatten()
                .flatten()
            {
                let p = f.path();
                if p.extension().is_some_and(|e| e == "data")
                    && let Ok(m) = f.metadata()
                    && m.len() > 0
                {
                    files.push((p, m.len()));
                }
            }
        }
        if files.is_empty() {
            return Ok(None);
        }
        for _ in 0..16 {
            let (path, len) = &files[rng.usize(..files.len())];
            let block_size = block_size(&path.with_extension("crc")).unwrap_or(4096);
            let offset = rng.u64(..*len);
            let part = path
                .parent()
                .and_then(Path::file_name)
                .map(|s| s.to_string_lossy().into_owned())
                .unwrap_or_default();
            let file = path
                .file_name()
                .map(|s| s.to_string_lossy().into_owned())
                .unwrap_or_default();
            let key = (part, file, offset / block_size);
            if self.corrupted.contains(&key) {
                continue;
            }
            let (Ok(partition), Some(Ok(extent))) = (
                key.0.parse::<u64>(),
                path.file_stem().map(|s| s.to_string_lossy().parse::<u64>()),
            ) else {
                continue;
            };
            let flip = Flip {
                node: k,
                partition: PartitionId(partition),
                extent: ExtentId(extent),
                block: key.2,
            };
            self.corrupted.insert(key);
            let f = OpenOptions::new().read(true).write(true).open(path)?;
            let mut b = [0u8; 1];
            f.read_exact_at(&mut b, offset)?;
            b[0] ^= 0xFF;
            f.write_all_at(&b, offset)?;
            self.flips.push(flip);
            return Ok(Some(format!("{} byte {offset}", path.display())));
        }
        Ok(None)
    }

    /// Waits (bounded) until the masters have a leader and every meta and data node is registered
    /// and up.
    pub async fn wait_healthy(&self, mc: &MasterClient, within: Duration) -> anyhow::Result<()> {
        let want_meta = self.of(Role::Meta).len();
        let want_data = self.of(Role::Data).len();
        let deadline = Instant::now() + within;
        loop {
            let last = match mc.cluster_map().await {
                Ok(map) => {
                    let up = |r: MapRole| {
                        map.nodes
                            .values()
                            .filter(|n| n.role == r && n.status == NodeStatus::Up)
                            .count()
                    };
                    let (meta, data) = (up(MapRole::Meta), up(MapRole::Data));
                    if meta >= want_meta && data >= want_data {
                        return Ok(());
                    }
                    format!("{meta}/{want_meta} meta and {data}/{want_data} data nodes up")
                }
                Err(e) => e.to_string(),
            };
            if Instant::now() > deadline {
                bail!("cluster not healthy within {within:?}: {last}");
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// The harness's directory.
    pub fn dir(&self) -> &Path {
        &self.cfg.dir
    }

    /// The `nacre` binary the nodes run.
    pub fn exe(&self) -> &Path {
        &self.cfg.exe
    }

    /// Whether data node 0 runs on a small disk that [`Self::fill_disk`] can fill.
    pub fn has_small_disk(&self) -> bool {
        self.loop_mount.is_some()
    }

    /// Lines of node `k`'s log (all its runs) that contain `needle`.
    pub fn log_matches(&self, k: usize, needle: &str) -> usize {
        std::fs::read_to_string(self.log_path(k))
            .map(|s| s.lines().filter(|l| l.contains(needle)).count())
            .unwrap_or(0)
    }

    fn log_path(&self, k: usize) -> PathBuf {
        self.cfg
            .dir
            .join("logs")
            .join(format!("{}.log", self.nodes[k].name))
    }
}

fn signal(n: &Node, sig: Signal) -> anyhow::Result<()> {
    let pid = n
        .pid()
        .and_then(|p| Pid::from_raw(p as i32))
        .with_context(|| format!("{} is not running", n.name))?;
    kill_process(pid, sig).with_context(|| format!("cannot signal {}", n.name))?;
    Ok(())
}

/// The block size in an extent's `.crc` header (slot 0, offset 8), if readable.
fn block_size(crc: &Path) -> Option<u64> {
    let mut b = [0u8; 4];
    File::open(crc).ok()?.read_exact_at(&mut b, 8).ok()?;
    let bs = u64::from(u32::from_le_bytes(b));
    (bs > 0).then_some(bs)
}

impl Drop for Harness {
    fn drop(&mut self) {
        for n in &mut self.nodes {
            if n.isolated
                && n.netns.is_none()
                && let Some(c) = &n.child
                && let Some(pid) = Pid::from_raw(c.id() as i32)
            {
                let _ = kill_process(pid, Signal::CONT);
            }
            if let Some(mut c) = n.child.take() {
                let _ = c.kill();
                let _ = c.wait();
            }
        }
        if let Some(dir) = self.loop_mount.take() {
            let d = dir.display().to_string();
            if run("umount", &[&d]).is_err() {
                let _ = run("umount", &["-l", &d]);
            }
        }
        for ns in self.namespaces.drain(..) {
            let _ = run("ip", &["netns", "del", &ns]);
        }
        if let Some(br) = self.bridge.take() {
            let _ = run("ip", &["link", "del", &br]);
        }
        let _ = std::fs::remove_file(self.cfg.dir.join("pids"));
    }
}
