//! FUSE end to end: `nacre up --mount` as a child process, driven through the kernel with std::fs
//! and real programs (SQLite, git, tar). Skipped (with a message) without /dev/fuse or root.
//!
//! The tests run one at a time (each starts a 7-node cluster on a 2-core machine).
#![allow(clippy::unwrap_used)]

use std::fs::{self, OpenOptions};
use std::io::{BufRead, BufReader, Read, Seek, SeekFrom, Write};
use std::os::unix::fs::MetadataExt as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Mutex, mpsc};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_nacre");

/// One test at a time: a cluster per test is already most of this machine.
static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

/// Why FUSE tests cannot run here, if they cannot.
fn no_fuse() -> Option<String> {
    if !rustix::process::geteuid().is_root() {
        return Some("not root".into());
    }
    match OpenOptions::new().read(true).write(true).open("/dev/fuse") {
        Ok(_) => None,
        Err(e) => Some(format!("cannot open /dev/fuse: {e}")),
    }
}

macro_rules! require_fuse {
    () => {
        if let Some(why) = no_fuse() {
            eprintln!("skipped: {why}");
            return;
        }
    };
}

fn have(program: &str, probe: &[&str]) -> bool {
    Command::new(program)
        .args(probe)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// A child process whose stdout and stderr lines the test reads; killed on drop.
struct Proc {
    child: Child,
    lines: mpsc::Receiver<String>,
    seen: Vec<String>,
}

impl Proc {
    fn spawn(cmd: &mut Command) -> Self {
        let mut child = cmd
            .env("NACRE_LOG", "info,raft_engine=warn")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let (tx, lines) = mpsc::channel();
        let out = child.stdout.take().unwrap();
        let err = child.stderr.take().unwrap();
        for stream in [Box::new(out) as Box<dyn Read + Send>, Box::new(err)] {
            let tx = tx.clone();
            std::thread::spawn(move || {
                for line in BufReader::new(stream).lines() {
                    let Ok(line) = line else { break };
                    if tx.send(line).is_err() {
                        break;
                    }
                }
            });
        }
        Self {
            child,
            lines,
            seen: Vec::new(),
        }
    }

    fn wait_line(&mut self, needle: &str, timeout: Duration) {
        if self.seen.iter().any(|l| l.contains(needle)) {
            return;
        }
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) => {
                    let hit = line.contains(needle);
                    self.seen.push(line);
                    if hit {
                        return;
                    }
                }
                Err(_) => panic!(
                    "no line with {needle:?} within {timeout:?}; output:\n{}",
                    self.seen.join("\n")
                ),
            }
        }
    }

    /// Waits for the exit (the caller made it exit) and checks it succeeded.
    fn exited_ok(&mut self) {
        let status = self.child.wait().unwrap();
        // The reader threads end with the process's pipes.
        while let Ok(l) = self.lines.recv_timeout(Duration::from_secs(10)) {
            self.seen.push(l);
        }
        assert!(
            status.success(),
            "exit {status}; output:\n{}",
            self.seen.join("\n")
        );
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `nacre up --dir DIR --mount DIR/mnt`; on drop unmounted (`umount -l`), then killed.
struct Up {
    proc: Proc,
    dir: PathBuf,
    mnt: PathBuf,
    /// Killed on purpose: its stale mount is left for the next `nacre up` to detach.
    crashed: bool,
}

impl Up {
    fn start(dir: &Path) -> Self {
        Self::start_with(dir, &[])
    }

    /// `start` with more arguments for `nacre up`.
    fn start_with(dir: &Path, args: &[&str]) -> Self {
        let mnt = dir.join("mnt");
        let mut proc = Proc::spawn(
            Command::new(BIN)
                .args(["up", "--dir"])
                .arg(dir)
                .arg("--mount")
                .arg(&mnt)
                .args(args),
        );
        proc.wait_line("mounted volume", Duration::from_secs(120));
        Self {
            proc,
            dir: dir.to_path_buf(),
            mnt,
            crashed: false,
        }
    }

    /// SIGKILL: no unmount, no clean stop; the mount point is left "not connected".
    fn crash(mut self) {
        self.proc.child.kill().unwrap();
        self.proc.child.wait().unwrap();
        assert_eq!(
            // (Not a stat: cached attributes are still answered for their TTL.)
            errno_of(fs::read_dir(&self.mnt)),
            libc::ENOTCONN,
            "a dead FUSE server's mount point"
        );
        self.crashed = true;
    }

    /// `nacre down` (SIGTERM, waits until the process is gone), then checks it unmounted.
    /// Returns the output of `nacre up`.
    fn down(mut self) -> Vec<String> {
        let out = Command::new(BIN)
            .args(["down", "--dir"])
            .arg(&self.dir)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "nacre down: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        self.proc.exited_ok();
        assert!(
            self.proc.seen.iter().any(|l| l == "unmounted"),
            "{}",
            self.proc.seen.join("\n")
        );
        assert!(!is_mounted(&self.mnt), "still mounted after nacre down");
        std::mem::take(&mut self.proc.seen)
    }
}

impl Drop for Up {
    fn drop(&mut self) {
        if !self.crashed && is_mounted(&self.mnt) {
            let _ = Command::new("umount").arg("-l").arg(&self.mnt).status();
        }
    }
}

fn is_mounted(dir: &Path) -> bool {
    let dir = dir.canonicalize().unwrap_or_else(|_| dir.to_path_buf());
    fs::read_to_string("/proc/self/mountinfo")
        .unwrap_or_default()
        .lines()
        .any(|l| l.split(' ').nth(4) == Some(dir.to_str().unwrap_or("")))
}

fn errno_of(r: std::io::Result<impl Sized>) -> i32 {
    match r {
        Ok(_) => 0,
        Err(e) => e.raw_os_error().unwrap_or(-1),
    }
}

/// Writes `size` bytes of pseudo-random data in 1 MiB writes; returns their CRC-32C.
fn write_big(path: &Path, size: u64) -> u32 {
    let mut f = fs::File::create(path).unwrap();
    // Deterministic pseudo-random bytes, so data is not compressible or repetitive.
    let mut rng = fastrand::Rng::with_seed(0x9e37_79b9_7f4a_7c15);
    let mut buf = vec![0u8; 1 << 20];
    let mut crc = 0u32;
    let mut left = size;
    while left > 0 {
        let n = left.min(buf.len() as u64) as usize;
        rng.fill(&mut buf[..n]);
        f.write_all(&buf[..n]).unwrap();
        crc = nacre_types::crc32c_append(crc, &buf[..n]);
        left -= n as u64;
    }
    f.sync_all().unwrap();
    crc
}

fn crc_of(path: &Path) -> (u64, u32) {
    let mut f = fs::File::open(path).unwrap();
    let mut buf = vec![0u8; 1 << 20];
    let (mut len, mut crc) = (0u64, 0u32);
    loop {
        let n = f.read(&mut buf).unwrap();
        if n == 0 {
            return (len, crc);
        }
        crc = nacre_types::crc32c_append(crc, &buf[..n]);
        len += n as u64;
    }
}

fn timed<T>(what: &str, f: impl FnOnce() -> T) -> T {
    let t = Instant::now();
    let r = f();
    eprintln!("{what}: {:.2} s", t.elapsed().as_secs_f64());
    r
}

fn run(cmd: &mut Command) -> String {
    let out = cmd.output().unwrap();
    assert!(
        out.status.success(),
        "{cmd:?} failed: {}\n{}{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn posix_semantics_and_restart() {
    require_fuse!();
    let _serial = serial();
    let tmp = tempfile::tempdir().unwrap();
    // Whatever happens below, no mount (live or stale) outlives the test.
    let _cleanup = Unmount(tmp.path().join("mnt"));
    let up = timed("nacre up --mount", || Up::start(tmp.path()));
    let m = up.mnt.clone();

    // Create, read, append, overwrite in the middle, truncate.
    let a = m.join("a.txt");
    fs::write(&a, b"hello").unwrap();
    assert_eq!(fs::read(&a).unwrap(), b"hello");
    {
        let mut f = OpenOptions::new().append(true).open(&a).unwrap();
        f.write_all(b" wor").unwrap();
        f.write_all(b"ld").unwrap();
    }
    OpenOptions::new()
        .append(true)
        .open(&a)
        .unwrap()
        .write_all(b"!")
        .unwrap();
    assert_eq!(fs::read(&a).unwrap(), b"hello world!");
    {
        let mut f = OpenOptions::new().write(true).open(&a).unwrap();
        f.seek(SeekFrom::Start(2)).unwrap();
        f.write_all(b"XY").unwrap();
    }
    assert_eq!(fs::read(&a).unwrap(), b"heXYo world!");
    {
        // Read and write through one handle.
        let mut f = OpenOptions::new().read(true).write(true).open(&a).unwrap();
        f.seek(SeekFrom::Start(6)).unwrap();
        f.write_all(b"W").unwrap();
        f.seek(SeekFrom::Start(0)).unwrap();
        let mut s = String::new();
        f.read_to_string(&mut s).unwrap();
        assert_eq!(s, "heXYo World!");
    }
    let f = OpenOptions::new().write(true).open(&a).unwrap();
    f.set_len(4).unwrap();
    assert_eq!(fs::read(&a).unwrap(), b"heXY");
    f.set_len(8).unwrap();
    drop(f);
    assert_eq!(fs::read(&a).unwrap(), b"heXY\0\0\0\0");
    assert_eq!(fs::metadata(&a).unwrap().len(), 8);
    fs::write(&a, b"replaced").unwrap(); // O_TRUNC
    assert_eq!(fs::read(&a).unwrap(), b"replaced");
    {
        // O_TRUNC while another handle holds bytes not flushed yet: they are truncated too.
        let t = m.join("trunc.txt");
        let mut w = fs::File::create(&t).unwrap();
        w.write_all(&[b'q'; 5000]).unwrap();
        drop(
            OpenOptions::new()
                .write(true)
                .truncate(true)
                .open(&t)
                .unwrap(),
        );
        drop(w);
        assert_eq!(fs::metadata(&t).unwrap().len(), 0);
        fs::remove_file(&t).unwrap();
    }
    // Exclusive create of an existing file.
    assert_eq!(
        errno_of(OpenOptions::new().write(true).create_new(true).open(&a)),
        libc::EEXIST
    );
    assert_eq!(errno_of(fs::read(m.join("missing"))), libc::ENOENT);
    // Permissions and times.
    use std::os::unix::fs::PermissionsExt as _;
    fs::set_permissions(&a, fs::Permissions::from_mode(0o640)).unwrap();
    assert_eq!(fs::metadata(&a).unwrap().mode() & 0o7777, 0o640);
    let t = std::time::UNIX_EPOCH + Duration::new(1_600_000_000, 123_456_789);
    fs::File::options()
        .write(true)
        .open(&a)
        .unwrap()
        .set_modified(t)
        .unwrap();
    assert_eq!(fs::metadata(&a).unwrap().modified().unwrap(), t);
    {
        // Set-user-ID and set-group-ID bits: cleared by a write or open(O_TRUNC) from a user
        // without CAP_FSETID (the file system's job under FUSE_HANDLE_KILLPRIV_V2) and by chown.
        use std::os::unix::process::CommandExt as _;
        let s = m.join("setid");
        let mode = |p: &Path| fs::metadata(p).unwrap().mode() & 0o7777;
        let nobody = |script: &str| {
            let out = Command::new("sh")
                .args(["-c", script])
                .current_dir(&m)
                .uid(65534)
                .gid(65534)
                .output()
                .unwrap();
            assert!(out.status.success(), "{script}: {out:?}");
        };
        fs::write(&s, b"abc").unwrap();
        fs::set_permissions(&s, fs::Permissions::from_mode(0o6777)).unwrap();
        nobody("printf d >> setid");
        assert_eq!((mode(&s), fs::read(&s).unwrap()), (0o777, b"abcd".to_vec()));
        fs::set_permissions(&s, fs::Permissions::from_mode(0o4777)).unwrap();
        nobody(": > setid");
        assert_eq!((mode(&s), fs::metadata(&s).unwrap().len()), (0o777, 0));
        // Also when the file is empty already (nothing to truncate).
        fs::set_permissions(&s, fs::Permissions::from_mode(0o4777)).unwrap();
        nobody(": > setid");
        assert_eq!(mode(&s), 0o777);
        fs::set_permissions(&s, fs::Permissions::from_mode(0o6755)).unwrap();
        std::os::unix::fs::chown(&s, Some(1), None).unwrap();
        assert_eq!(mode(&s), 0o755);
        fs::remove_file(&s).unwrap();
    }

    // Directories, renames.
    fs::create_dir(m.join("d1")).unwrap();
    fs::create_dir_all(m.join("d2/sub")).unwrap();
    assert_eq!(errno_of(fs::create_dir(m.join("d1"))), libc::EEXIST);
    fs::rename(&a, m.join("b.txt")).unwrap();
    assert_eq!(errno_of(fs::metadata(&a)), libc::ENOENT);
    fs::rename(m.join("b.txt"), m.join("d2/sub/c.txt")).unwrap();
    assert_eq!(fs::read(m.join("d2/sub/c.txt")).unwrap(), b"replaced");
    fs::write(m.join("d1/old"), b"old").unwrap();
    fs::rename(m.join("d2/sub/c.txt"), m.join("d1/old")).unwrap();
    assert_eq!(fs::read(m.join("d1/old")).unwrap(), b"replaced");
    assert_eq!(errno_of(fs::metadata(m.join("d2/sub/c.txt"))), libc::ENOENT);
    // Directory rename across parents.
    fs::rename(m.join("d2/sub"), m.join("d1/sub")).unwrap();
    assert!(fs::metadata(m.join("d1/sub")).unwrap().is_dir());
    // mv -n must not replace (RENAME_NOREPLACE, or a check by mv).
    fs::write(m.join("d1/keep"), b"keep").unwrap();
    fs::write(m.join("d1/other"), b"other").unwrap();
    let _ = Command::new("mv")
        .arg("-n")
        .arg(m.join("d1/other"))
        .arg(m.join("d1/keep"))
        .status();
    assert_eq!(fs::read(m.join("d1/keep")).unwrap(), b"keep");

    // Hard links and symlinks.
    fs::hard_link(m.join("d1/old"), m.join("d2/link")).unwrap();
    assert_eq!(fs::metadata(m.join("d1/old")).unwrap().nlink(), 2);
    assert_eq!(
        fs::metadata(m.join("d1/old")).unwrap().ino(),
        fs::metadata(m.join("d2/link")).unwrap().ino()
    );
    fs::remove_file(m.join("d1/old")).unwrap();
    assert_eq!(fs::read(m.join("d2/link")).unwrap(), b"replaced");
    assert_eq!(fs::metadata(m.join("d2/link")).unwrap().nlink(), 1);
    std::os::unix::fs::symlink("../d2/link", m.join("d1/sym")).unwrap();
    assert_eq!(
        fs::read_link(m.join("d1/sym")).unwrap(),
        Path::new("../d2/link")
    );
    assert!(fs::symlink_metadata(m.join("d1/sym")).unwrap().is_symlink());
    assert_eq!(fs::read(m.join("d1/sym")).unwrap(), b"replaced");

    // rmdir: not empty, then empty.
    assert_eq!(errno_of(fs::remove_dir(m.join("d1"))), libc::ENOTEMPTY);
    fs::remove_dir(m.join("d1/sub")).unwrap();
    assert_eq!(errno_of(fs::remove_dir(m.join("d2/link"))), libc::ENOTDIR);

    // A directory of 3,000 entries, listed in full (several readdir calls and pages).
    let big = m.join("many");
    fs::create_dir(&big).unwrap();
    let mut want: Vec<String> = (0..3000).map(|i| format!("entry-{i:05}")).collect();
    timed("create 3000 files", || {
        for n in &want {
            fs::File::create(big.join(n)).unwrap();
        }
    });
    let mut got: Vec<String> = fs::read_dir(&big)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    got.sort();
    want.sort();
    assert_eq!(got.len(), 3000);
    assert_eq!(got, want);
    let ls = run(Command::new("ls").arg("-a").arg(&big));
    assert_eq!(ls.lines().count(), 3002);
    assert_eq!(ls.lines().take(2).collect::<Vec<_>>(), [".", ".."]);
    let ls_l = run(Command::new("ls").arg("-l").arg(&big));
    assert_eq!(ls_l.lines().count(), 3001); // "total", then one line per entry

    // Extended attributes (through python3's os.*xattr; skipped without python3).
    if have("python3", &["-c", "import os; os.setxattr"]) {
        let script = r#"
import errno, os, sys
p = sys.argv[1]
os.setxattr(p, "user.a", b"1")
os.setxattr(p, "user.b", b"x" * 300)
assert os.getxattr(p, "user.b") == b"x" * 300
assert sorted(os.listxattr(p)) == ["user.a", "user.b"], os.listxattr(p)
try:
    os.setxattr(p, "user.a", b"2", os.XATTR_CREATE); sys.exit("XATTR_CREATE replaced")
except OSError as e:
    assert e.errno == errno.EEXIST, e
try:
    os.setxattr(p, "user.c", b"2", os.XATTR_REPLACE); sys.exit("XATTR_REPLACE created")
except OSError as e:
    assert e.errno == errno.ENODATA, e
os.removexattr(p, "user.a")
try:
    os.getxattr(p, "user.a"); sys.exit("removed attribute still there")
except OSError as e:
    assert e.errno == errno.ENODATA, e
assert os.listxattr(p) == ["user.b"]
print("xattrs ok")
"#;
        let out = run(Command::new("python3")
            .args(["-c", script])
            .arg(m.join("d2/link")));
        assert!(out.contains("xattrs ok"), "{out}");
    } else {
        eprintln!("xattrs skipped: no python3");
    }

    // statfs.
    let df = run(Command::new("df").arg("-P").arg(&m));
    assert!(df.contains("nacre:default"), "{df}");

    // 64 MiB written and read back.
    let big_file = m.join("big.bin");
    let size = 64 << 20;
    let crc = timed("write 64 MiB", || write_big(&big_file, size));
    assert_eq!(timed("read 64 MiB", || crc_of(&big_file)), (size, crc));

    // Restart: everything is still there.
    timed("nacre down", || up.down());
    let up = timed("nacre up again", || Up::start(tmp.path()));
    let m = up.mnt.clone();
    assert_eq!(fs::read(m.join("d2/link")).unwrap(), b"replaced");
    assert_eq!(fs::read(m.join("d1/sym")).unwrap(), b"replaced");
    assert_eq!(fs::read(m.join("d1/keep")).unwrap(), b"keep");
    assert_eq!(fs::read_dir(m.join("many")).unwrap().count(), 3000);
    assert_eq!(
        timed("read 64 MiB after restart", || crc_of(&m.join("big.bin"))),
        (size, crc)
    );

    // `nacre mount` of the same volume (masters from DIR/up.json), ended by `umount`.
    let m2 = tmp.path().join("mnt2");
    let mut mount = Proc::spawn(
        Command::new(BIN)
            .args(["mount", "default"])
            .arg(&m2)
            .arg("--up-dir")
            .arg(tmp.path()),
    );
    mount.wait_line("mounted volume", Duration::from_secs(60));
    let _unmount_m2 = Unmount(m2.clone());
    assert_eq!(fs::read(m2.join("d1/keep")).unwrap(), b"keep");
    // Another client sees a closed file's bytes once they are sent: at once after an fsync
    // (without one, within the flush delay: small files are written behind).
    {
        let mut f = fs::File::create(m2.join("from-second-mount")).unwrap();
        f.write_all(b"2").unwrap();
        f.sync_all().unwrap();
    }
    assert_eq!(fs::read(m.join("from-second-mount")).unwrap(), b"2");
    run(Command::new("umount").arg(&m2));
    mount.wait_line("unmounted from outside", Duration::from_secs(30));
    mount.exited_ok();
    assert!(!is_mounted(&m2));

    // A crash (SIGKILL) leaves a stale mount and unsynced logs; the next start detaches the
    // mount, recovers, and finds everything.
    timed("crash", || up.crash());
    let up = timed("nacre up after a crash", || Up::start(tmp.path()));
    assert!(
        up.proc
            .seen
            .iter()
            .any(|l| l.contains("detaching a stale FUSE mount")),
        "{}",
        up.proc.seen.join("\n")
    );
    let m = up.mnt.clone();
    assert_eq!(fs::read(m.join("from-second-mount")).unwrap(), b"2");
    assert_eq!(fs::read_dir(m.join("many")).unwrap().count(), 3000);

    // Stopping with a file still open: the mount is detached lazily.
    let open = fs::File::open(m.join("d1/keep")).unwrap();
    let out = timed("nacre down with a file open", || up.down());
    assert!(
        out.iter().any(|l| l.contains("detaching lazily")),
        "{}",
        out.join("\n")
    );
    drop(open);
}

/// Detaches a mount on drop (if still mounted).
struct Unmount(PathBuf);

impl Drop for Unmount {
    fn drop(&mut self) {
        if is_mounted(&self.0) {
            let _ = Command::new("umount").arg("-l").arg(&self.0).status();
        }
    }
}

#[test]
fn big_file_1gib() {
    require_fuse!();
    let _serial = serial();
    let tmp = tempfile::tempdir().unwrap();
    let up = timed("nacre up --mount", || Up::start(tmp.path()));
    let p = up.mnt.join("gig.bin");
    let size = 1 << 30;
    let crc = timed("write 1 GiB", || write_big(&p, size));
    assert_eq!(timed("read 1 GiB", || crc_of(&p)), (size, crc));
    timed("nacre down", || up.down());
}

#[test]
fn sqlite_on_mount() {
    require_fuse!();
    if !have("python3", &["-c", "import sqlite3"]) {
        eprintln!("skipped: no python3 with the sqlite3 module");
        return;
    }
    let _serial = serial();
    let tmp = tempfile::tempdir().unwrap();
    let up = timed("nacre up --mount", || Up::start(tmp.path()));
    let script = r#"
import sqlite3, sys
path = sys.argv[1]
db = sqlite3.connect(path)
db.execute("create table t (id integer primary key, k text unique, v blob)")
for tx in range(10):
    with db:
        db.executemany(
            "insert into t (k, v) values (?, ?)",
            [(f"key-{tx}-{i}", bytes([i % 251]) * (50 + i % 200)) for i in range(1000)],
        )
with db:
    db.execute("delete from t where id % 7 = 0")
    db.execute("update t set v = x'00' where id % 5 = 0")
n = db.execute("select count(*) from t").fetchone()[0]
ok = db.execute("pragma integrity_check").fetchone()[0]
db.close()
db = sqlite3.connect(path)
m = db.execute("select count(*) from t").fetchone()[0]
ok2 = db.execute("pragma integrity_check").fetchone()[0]
print(n, m, ok, ok2)
"#;
    let db = up.mnt.join("test.db");
    let out = timed("sqlite 10,000 inserts", || {
        run(Command::new("python3").args(["-c", script]).arg(&db))
    });
    let expect_rows = 10_000 - 10_000 / 7;
    assert_eq!(out.trim(), format!("{expect_rows} {expect_rows} ok ok"));
    timed("nacre down", || up.down());
}

#[test]
fn git_on_mount() {
    require_fuse!();
    if !have("git", &["--version"]) {
        eprintln!("skipped: no git");
        return;
    }
    let _serial = serial();
    let tmp = tempfile::tempdir().unwrap();
    let up = timed("nacre up --mount", || Up::start(tmp.path()));
    let repo = up.mnt.join("repo");
    fs::create_dir(&repo).unwrap();
    let git = |args: &[&str]| {
        run(Command::new("git")
            .args(["-c", "user.name=t", "-c", "user.email=t@example.invalid"])
            .args(["-c", "init.defaultBranch=main", "-c", "gc.auto=0"])
            .args(args)
            .current_dir(&repo))
    };
    git(&["init", "-q"]);
    let mut rng = fastrand::Rng::with_seed(7);
    for d in 0..10 {
        fs::create_dir(repo.join(format!("dir{d}"))).unwrap();
        for f in 0..20 {
            let mut buf = vec![0u8; 100 + (d * 20 + f) * 37];
            rng.fill(&mut buf);
            fs::write(repo.join(format!("dir{d}/f{f}.bin")), &buf).unwrap();
        }
    }
    fs::write(repo.join("README"), "hello\n").unwrap();
    timed("git add + commit", || {
        git(&["add", "-A"]);
        git(&["commit", "-q", "-m", "first"]);
    });
    fs::write(repo.join("README"), "hello again\n").unwrap();
    fs::remove_file(repo.join("dir3/f3.bin")).unwrap();
    fs::rename(repo.join("dir4"), repo.join("dir4-moved")).unwrap();
    git(&["add", "-A"]);
    git(&["commit", "-q", "-m", "second"]);
    timed("git fsck", || git(&["fsck", "--full", "--strict"]));
    assert_eq!(git(&["status", "--porcelain"]), "");
    assert_eq!(git(&["rev-list", "--count", "HEAD"]).trim(), "2");
    // Packing rewrites every object through new files and renames.
    timed("git gc", || git(&["gc", "-q", "--prune=now"]));
    git(&["fsck", "--full", "--strict"]);
    git(&["checkout", "-q", "HEAD~1"]);
    assert_eq!(fs::read_to_string(repo.join("README")).unwrap(), "hello\n");
    assert!(repo.join("dir3/f3.bin").exists());
    timed("nacre down", || up.down());
}

#[test]
fn untar_many_small_files() {
    require_fuse!();
    if !have("tar", &["--version"]) || !have("diff", &["--version"]) {
        eprintln!("skipped: no tar or diff");
        return;
    }
    let _serial = serial();
    let tmp = tempfile::tempdir().unwrap();
    // The tree: 100 directories of 101 files (0 to 4 KiB), a few symlinks: unpacked, compared,
    // synced, and compared again after a crash and a restart.
    let src = tmp.path().join("src");
    let mut rng = fastrand::Rng::with_seed(11);
    for d in 0..100 {
        let dir = src.join(format!("d{d:03}"));
        fs::create_dir_all(&dir).unwrap();
        for f in 0..101 {
            let mut buf = vec![0u8; (d * 101 + f) * 97 % 4097];
            rng.fill(&mut buf);
            fs::write(dir.join(format!("f{f:03}")), &buf).unwrap();
        }
        std::os::unix::fs::symlink("f000", dir.join("link")).unwrap();
    }
    let tar = tmp.path().join("tree.tar");
    run(Command::new("tar")
        .arg("-cf")
        .arg(&tar)
        .arg("-C")
        .arg(&src)
        .arg("."));
    let up = timed("nacre up --mount", || {
        Up::start(&tmp.path().join("cluster"))
    });
    let dst = up.mnt.join("tree");
    fs::create_dir(&dst).unwrap();
    timed("untar 10,100 files", || {
        run(Command::new("tar").arg("-xf").arg(&tar).arg("-C").arg(&dst))
    });
    let diff = |dst: &Path| {
        run(Command::new("diff")
            .arg("-r")
            .arg("--no-dereference")
            .arg(&src)
            .arg(dst))
    };
    timed("diff -r", || diff(&dst));
    // `sync DIR` (an fsync of the directory) makes every file written behind durable: a crash
    // of the whole cluster and its client right after loses none.
    timed("sync", || run(Command::new("sync").arg(&dst)));
    timed("crash", || up.crash());
    let up = timed("nacre up after a crash", || {
        Up::start(&tmp.path().join("cluster"))
    });
    timed("diff -r after the crash", || diff(&up.mnt.join("tree")));
    timed("nacre down", || up.down());
}

// Behaviours these checks once found wrong in NetFs (each fixed): a renamed-over file stays
// readable through its open handle; the size after an append is never stale while another call
// holds the file's state; an unlinked open file has no links; O_TRUNC also drops bytes another
// handle has not flushed.

/// Runs python3 scripts on one fresh mount; each script's last output line must be "ok".
fn python_on_mount(scripts: &[&str]) {
    if !have("python3", &["--version"]) {
        eprintln!("skipped: no python3");
        return;
    }
    let _serial = serial();
    let tmp = tempfile::tempdir().unwrap();
    let up = Up::start(tmp.path());
    for (i, script) in scripts.iter().enumerate() {
        let dir = up.mnt.join(format!("case{i}"));
        std::fs::create_dir(&dir).unwrap();
        let out = run(Command::new("python3").args(["-c", script]).arg(&dir));
        assert_eq!(out.lines().last(), Some("ok"), "case {i}: {out}");
    }
    // The mount's client serves its metrics (the Metrics layer over MetaCache over NetFs).
    let mut up = up;
    up.proc
        .wait_line("client metrics http://", Duration::from_secs(10));
    let addr = up
        .proc
        .seen
        .iter()
        .find_map(|l| l.split("client metrics http://").nth(1))
        .and_then(|rest| rest.split('/').next())
        .unwrap()
        .to_string();
    let mut conn = std::net::TcpStream::connect(&addr).unwrap();
    std::io::Write::write_all(
        &mut conn,
        b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
    )
    .unwrap();
    let mut metrics = String::new();
    std::io::Read::read_to_string(&mut conn, &mut metrics).unwrap();
    let writes = metrics
        .lines()
        .find(|l| l.starts_with("nacre_fs_ops_total{op=\"write\"}"))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse::<f64>().ok())
        .unwrap_or(0.0);
    assert!(writes > 0.0, "no writes counted:\n{metrics}");
    up.down();
}

#[test]
fn every_file_type_can_be_made_renamed_linked_and_removed() {
    require_fuse!();
    python_on_mount(&[r#"
import os, sys, stat, socket
d = sys.argv[1]
os.umask(0o022)
kinds = {}

# A regular file by mknod, written through the mount.
os.mknod(d + "/reg", 0o644 | stat.S_IFREG)
with open(d + "/reg", "wb") as f:
    f.write(b"regular")
kinds["reg"] = stat.S_ISREG

# A FIFO: the kernel carries the bytes; the mount holds the name.
os.mkfifo(d + "/fifo", 0o640)
r = os.open(d + "/fifo", os.O_RDONLY | os.O_NONBLOCK)
w = os.open(d + "/fifo", os.O_WRONLY)
os.write(w, b"through the pipe")
assert os.read(r, 100) == b"through the pipe"
os.close(r); os.close(w)
kinds["fifo"] = stat.S_ISFIFO

# A UNIX socket bound on the mount, and a connection through its name.
srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
srv.bind(d + "/sock"); srv.listen(1)
cli = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
cli.connect(d + "/sock")
conn, _ = srv.accept()
cli.sendall(b"hi")
assert conn.recv(2) == b"hi"
for x in (conn, cli, srv): x.close()
kinds["sock"] = stat.S_ISSOCK

# Devices keep their numbers (making one needs CAP_MKNOD; the kernel checks it).
if os.geteuid() == 0:
    os.mknod(d + "/chr", 0o600 | stat.S_IFCHR, os.makedev(1, 3))
    os.mknod(d + "/blk", 0o600 | stat.S_IFBLK, os.makedev(7, 12))
    for n, maj, mnr in (("chr", 1, 3), ("blk", 7, 12)):
        st = os.lstat(d + "/" + n)
        assert (os.major(st.st_rdev), os.minor(st.st_rdev)) == (maj, mnr), (n, st)
    kinds["chr"] = stat.S_ISCHR
    kinds["blk"] = stat.S_ISBLK
else:
    try:
        os.mknod(d + "/chr", 0o600 | stat.S_IFCHR, os.makedev(1, 3))
        raise AssertionError("an unprivileged mknod of a device succeeded")
    except PermissionError:
        pass

uid, gid = os.getuid(), os.getgid()
for n, is_kind in kinds.items():
    st = os.lstat(d + "/" + n)
    assert is_kind(st.st_mode), (n, oct(st.st_mode))
    assert (st.st_uid, st.st_gid) == (uid, gid), (n, st)
    assert st.st_nlink == 1, (n, st)
assert stat.S_IMODE(os.lstat(d + "/fifo").st_mode) == 0o640
listed = {e.name: e.stat(follow_symlinks=False).st_mode for e in os.scandir(d)}
for n, is_kind in kinds.items():
    assert is_kind(listed[n]), (n, listed)

# Rename, link, chmod and remove each.
for n, is_kind in kinds.items():
    os.rename(d + "/" + n, d + "/" + n + ".2")
    os.link(d + "/" + n + ".2", d + "/" + n + ".3")
    assert os.lstat(d + "/" + n + ".3").st_nlink == 2
    os.chmod(d + "/" + n + ".3", 0o600)
    assert stat.S_IMODE(os.lstat(d + "/" + n + ".2").st_mode) == 0o600
    assert is_kind(os.lstat(d + "/" + n + ".2").st_mode)
    os.unlink(d + "/" + n + ".2")
    assert os.lstat(d + "/" + n + ".3").st_nlink == 1
    os.unlink(d + "/" + n + ".3")
assert os.listdir(d) == [], os.listdir(d)

# The same by an unprivileged user in a directory it owns; where a local file system refuses
# (a device, or changing a directory it may not write), so does the mount, with EPERM or EACCES.
if os.geteuid() == 0:
    u = d + "/user"
    os.mkdir(u, 0o755)
    os.chown(u, 65534, 65534)
    os.mkfifo(d + "/rootfifo", 0o644)
    pid = os.fork()
    if pid == 0:
        try:
            os.setgid(65534)
            os.setuid(65534)
            os.mkfifo(u + "/fifo", 0o600)
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.bind(u + "/sock")
            s.close()
            with open(u + "/reg", "wb") as f:
                f.write(b"mine")
            try:
                os.mknod(u + "/chr", 0o600 | stat.S_IFCHR, os.makedev(1, 3))
                raise AssertionError("an unprivileged mknod of a device succeeded")
            except PermissionError:
                pass
            for n in ("fifo", "sock", "reg"):
                assert os.lstat(u + "/" + n).st_uid == 65534, n
                os.rename(u + "/" + n, u + "/" + n + ".2")
                os.link(u + "/" + n + ".2", u + "/" + n + ".3")
                os.chmod(u + "/" + n + ".3", 0o644)
                os.unlink(u + "/" + n + ".2")
                os.unlink(u + "/" + n + ".3")
            refused = [
                lambda: os.mkfifo(d + "/nope"),
                lambda: os.unlink(d + "/rootfifo"),
                lambda: os.rename(d + "/rootfifo", u + "/x"),
                lambda: os.chmod(d + "/rootfifo", 0o666),
            ]
            for i, f in enumerate(refused):
                try:
                    f()
                    raise AssertionError("allowed: %d" % i)
                except PermissionError:
                    pass
            assert os.listdir(u) == [], os.listdir(u)
            os._exit(0)
        except BaseException as e:
            print("as nobody:", repr(e), flush=True)
            os._exit(1)
    _, status = os.waitpid(pid, 0)
    assert status == 0, status
    os.unlink(d + "/rootfifo")
    os.rmdir(u)
print("ok")
"#]);
}

#[test]
fn times_before_1970_keep_their_nanoseconds_and_mmap_writes_move_mtime() {
    require_fuse!();
    python_on_mount(&[
        r#"
import os, sys
d = sys.argv[1]
T1960 = -315_619_199_876_543_211  # 1960-01-01T00:00:00.123456789Z

# A file and a directory dated 1960, to the nanosecond, as `touch -d` or `tar x` date them.
open(d + "/old", "wb").write(b"x")
os.mkdir(d + "/olddir")
for p in (d + "/old", d + "/olddir"):
    os.utime(p, ns=(T1960 - 1, T1960))
    st = os.stat(p)
    assert (st.st_atime_ns, st.st_mtime_ns) == (T1960 - 1, T1960), (p, st)
listed = {e.name: e.stat().st_mtime_ns for e in os.scandir(d)}
assert listed == {"old": T1960, "olddir": T1960}, listed
print("ok")
"#,
        r#"
import os, sys, mmap
d = sys.argv[1]
T1960 = -315_619_199_876_543_211

# Writes through a shared mapping move mtime and ctime: after msync while mapped, and after
# munmap and close without msync; into allocated bytes (overwrites) and into a hole.
for i, (sparse, sync) in enumerate([(False, True), (False, False), (True, True), (True, False)]):
    p = d + "/mapped%d" % i
    with open(p, "wb") as f:
        if sparse:
            f.truncate(1 << 20)
        else:
            f.write(b"\0" * (1 << 20))
    os.utime(p, ns=(T1960, T1960))
    before = os.stat(p)
    assert before.st_mtime_ns == T1960, before
    fd = os.open(p, os.O_RDWR)
    m = mmap.mmap(fd, 1 << 20)
    m[70000:70005] = b"hello"
    if sync:
        m.flush()
        st = os.stat(p)
        assert st.st_mtime_ns > before.st_ctime_ns, ("mtime after msync", i, before, st)
        assert st.st_ctime_ns > before.st_ctime_ns, ("ctime after msync", i, before, st)
    m.close()
    os.close(fd)
    after = os.stat(p)
    assert after.st_mtime_ns > before.st_ctime_ns, ("mtime after close", i, before, after)
    assert after.st_ctime_ns > before.st_ctime_ns, ("ctime after close", i, before, after)
    assert after.st_size == 1 << 20, after
    with open(p, "rb") as f:
        f.seek(70000)
        assert f.read(5) == b"hello"
print("ok")
"#,
    ]);
}

#[test]
fn open_files_survive_rename_unlink_and_concurrent_appends() {
    require_fuse!();
    python_on_mount(&[
        r#"
import os, sys
d = sys.argv[1]
open(d + "/new", "wb").write(b"new"); open(d + "/old", "wb").write(b"old")
fd = os.open(d + "/old", os.O_RDONLY)
os.rename(d + "/new", d + "/old")
assert os.pread(fd, 10, 0) == b"old"
print("ok")
"#,
        r#"
import os, sys, threading
p = sys.argv[1] + "/f"
fd = os.open(p, os.O_RDWR | os.O_CREAT, 0o644)
os.write(fd, b"x" * 1_000_000); os.fsync(fd)
stop = False
def reader():
    r = os.open(p, os.O_RDONLY); k = 0
    while not stop:
        os.pread(r, 65536, (k * 65536) % 900_000); k += 1
t = threading.Thread(target=reader); t.start()
a = os.open(p, os.O_WRONLY | os.O_APPEND)
stale = 0
for i in range(300):
    os.write(a, b"y" * 4096)
    stale += os.fstat(a).st_size < 1_000_000 + 4096 * (i + 1)
stop = True; t.join()
assert stale == 0, f"{stale} of 300 fstat calls saw a stale size"
print("ok")
"#,
        r#"
import os, sys
p = sys.argv[1] + "/f"
fd = os.open(p, os.O_RDWR | os.O_CREAT, 0o644)
os.write(fd, b"abc")
os.unlink(p)
assert os.fstat(fd).st_nlink == 0, os.fstat(fd)
print("ok")
"#,
        r#"
import os, sys
p = sys.argv[1] + "/f"
fa = os.open(p, os.O_RDWR | os.O_CREAT, 0o644)
os.write(fa, b"z" * 5000)
os.close(os.open(p, os.O_WRONLY | os.O_TRUNC))
os.close(fa)
assert os.stat(p).st_size == 0, os.stat(p)
print("ok")
"#,
    ]);
}

#[test]
fn fallocate_allocates_punches_and_zeroes_ranges() {
    require_fuse!();
    python_on_mount(&[r#"
import ctypes, errno, os, sys
d = sys.argv[1]
libc = ctypes.CDLL(None, use_errno=True)
libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong]
KEEP, PUNCH, COLLAPSE, ZERO, INSERT = 0x01, 0x02, 0x08, 0x10, 0x20
K = 1024

def falloc(fd, mode, off, n):
    if libc.fallocate(fd, mode, off, n) != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))

def refused(want, fd, mode, off, n):
    try:
        falloc(fd, mode, off, n)
    except OSError as e:
        assert e.errno in (want if isinstance(want, tuple) else (want,)), (mode, off, n, e)
    else:
        raise AssertionError(f"mode {mode:#x} {off}+{n} succeeded")

p = d + "/f"
body = bytes(range(256)) * K  # 256 KiB: a stream, then a tiny extent for the tail below
with open(p, "wb") as f:
    f.write(body)
fd = os.open(p, os.O_RDWR)
want = bytearray(body)

def check(what):
    assert os.fstat(fd).st_size == len(want), (what, os.fstat(fd).st_size, len(want))
    # Past the kernel's page cache: what the file system has.
    r = os.open(p, os.O_RDONLY)
    os.posix_fadvise(r, 0, 0, os.POSIX_FADV_DONTNEED)
    got = b""
    while chunk := os.pread(r, 1 << 20, len(got)):
        got += chunk
    os.close(r)
    assert got == want, (what, next(i for i in range(len(got)) if got[i] != want[i]))

# Mode 0 (posix_fallocate) grows the file with zeros; within the size it changes nothing.
os.posix_fallocate(fd, 200 * K, 100 * K)
want += bytes(300 * K - len(want))
check("mode 0")
os.posix_fallocate(fd, 10, 100)
check("mode 0 within")
# KEEP_SIZE alone: nothing changes, even past the end.
falloc(fd, KEEP, 0, 1 << 20)
check("keep size")
# A hole in the middle of the written data; its neighbours stay.
falloc(fd, PUNCH | KEEP, 1000, 5000)
want[1000:6000] = bytes(5000)
check("punch")
# A hole across the end: the size stays.
falloc(fd, PUNCH | KEEP, 250 * K, 100 * K)
want[250 * K :] = bytes(50 * K)
check("punch past the end")
# Zeroing inside, and across the end with and without KEEP_SIZE.
falloc(fd, ZERO | KEEP, 64 * K, 3)
want[64 * K : 64 * K + 3] = bytes(3)
check("zero range")
falloc(fd, ZERO | KEEP, 290 * K, 100 * K)
want[290 * K :] = bytes(10 * K)
check("zero range, keep size")
falloc(fd, ZERO, 100 * K, 300 * K)
want[100 * K :] = bytes(200 * K)
want += bytes(100 * K)
check("zero range, grow")
# Writes into a punched range land; fsync reports no error.
os.pwrite(fd, b"hello", 2000)
falloc(fd, PUNCH | KEEP, 2002, 1)
want[2000:2005] = b"he\0lo"
os.fsync(fd)
check("write into a hole")
# Appends after a punch of the tail of the last write.
os.pwrite(fd, b"t" * 300 * K, len(want))
want += b"t" * 300 * K
falloc(fd, PUNCH | KEEP, len(want) - 10 * K, 5 * K)
want[len(want) - 10 * K : len(want) - 5 * K] = bytes(5 * K)
os.pwrite(fd, b"more", len(want))
want += b"more"
check("append after a punch")

# What Linux refuses, nacre refuses the same way.
size = len(want)
refused(errno.EOPNOTSUPP, fd, COLLAPSE, 0, 4096)
refused(errno.EOPNOTSUPP, fd, INSERT, 0, 4096)
refused(errno.EOPNOTSUPP, fd, PUNCH, 0, 4096)
# EINVAL before Linux 6.13.
refused((errno.EOPNOTSUPP, errno.EINVAL), fd, PUNCH | ZERO | KEEP, 0, 4096)
refused(errno.EINVAL, fd, 0, 0, 0)
refused(errno.EINVAL, fd, 0, -1, 10)
# More than the volume has free: ENOSPC, and nothing changes.
refused(errno.ENOSPC, fd, 0, 0, 1 << 55)
check("refused")
os.close(fd)
ro = os.open(p, os.O_RDONLY)
refused(errno.EBADF, ro, PUNCH | KEEP, 0, 1)
os.close(ro)
print("ok")
"#]);
}

#[test]
fn a_name_another_client_made_after_a_cached_miss_is_opened_not_refused() {
    require_fuse!();
    let _serial = serial();
    let tmp = tempfile::tempdir().unwrap();
    let _cleanup = Unmount(tmp.path().join(".nacre/mnt"));
    // Long TTLs, so that the cache's answer is certainly still held below.
    let up = Up::start_with(
        &tmp.path().join(".nacre"),
        &["--entry-ttl", "60", "--attr-ttl", "60"],
    );
    let d = up.mnt.join("d");
    fs::create_dir(&d).unwrap();
    assert_eq!(errno_of(fs::metadata(d.join("f"))), libc::ENOENT);
    // Another client (`nacre fs`, finding the cluster in ./.nacre) makes d/f.
    let local = tmp.path().join("local");
    fs::write(&local, b"theirs").unwrap();
    run(Command::new(BIN)
        .current_dir(tmp.path())
        .args(["fs", "put"])
        .arg(&local)
        .arg("/d/f"));
    // This mount made d and still answers, within its TTL, that f is missing …
    assert_eq!(errno_of(fs::metadata(d.join("f"))), libc::ENOENT);
    // … but O_CREAT without O_EXCL opens the file that is there, and O_EXCL is refused.
    let mut f = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(d.join("f"))
        .unwrap();
    let mut got = String::new();
    std::io::Read::read_to_string(&mut f, &mut got).unwrap();
    assert_eq!(got, "theirs");
    drop(f);
    let excl = fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(d.join("f"));
    assert_eq!(errno_of(excl), libc::EEXIST);
    up.down();
}
