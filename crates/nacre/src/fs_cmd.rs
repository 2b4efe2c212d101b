//! `nacre fs …`: a volume's files without FUSE — ls, stat, put, get, rm, mkdir, cat — through the
//! client SDK (`MetaCache<NetFs>`). Paths are volume paths (`/a/b/c`), resolved by lookups from
//! the root.

use std::fmt::Display;
use std::io::{IsTerminal as _, Write as _};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::anyhow;
use bytes::Bytes;
use clap::{Args, Subcommand};
use comfy_table::Table;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use nacre_api::meta::{Attr, FileType, MetaError, ROOT_INO, SetAttr};
use nacre_client::MasterClient;
use nacre_client::{
    Caller, DirEntryPlus, FileSystem, FsError, FsResult, MetaCache, NetFs, NetVolume, OpenFlags,
};
use nacre_msgr::{Messenger, MsgrConfig, TcpTransport};
use nacre_types::Ino;

/// Bytes per read and write call.
const CHUNK: usize = 1 << 20;
/// Transfers at least this large show a progress bar (when stderr is a terminal).
const PROGRESS_MIN: u64 = 8 << 20;
/// Entries per readdir call.
const PAGE: u32 = 1024;

#[derive(Debug, Args)]
pub struct FsArgs {
    /// Master addresses (`host:port`, comma-separated). Defaults to the masters of the `nacre up`
    /// cluster in ./.nacre.
    #[arg(long, global = true, env = "NACRE_MASTERS", value_delimiter = ',')]
    master: Vec<String>,
    /// The volume.
    #[arg(long, global = true, default_value = "default")]
    volume: String,
    /// JSON output: ls prints one object per entry, stat one object, put and get a summary.
    #[arg(long, global = true)]
    json: bool,
    #[command(subcommand)]
    cmd: FsCmd,
}

#[derive(Debug, Subcommand)]
enum FsCmd {
    /// List a directory (or show one file).
    Ls {
        /// Long listing: mode, links, owner, size, modification time.
        #[arg(short = 'l')]
        long: bool,
        #[arg(default_value = "/")]
        path: String,
    },
    /// Every attribute of a file or directory.
    Stat { path: String },
    /// Copy a local file into the volume (into REMOTE/NAME if REMOTE is a directory); an existing
    /// file is overwritten.
    Put {
        local: PathBuf,
        remote: String,
        /// Create missing parent directories.
        #[arg(short = 'p', long)]
        parents: bool,
    },
    /// Copy a file out of the volume (`-`: to stdout; into LOCAL/NAME if LOCAL is a directory).
    Get { remote: String, local: PathBuf },
    /// Remove a file, or with -r a directory and everything below it.
    Rm {
        #[arg(short = 'r', long)]
        recursive: bool,
        path: String,
    },
    /// Create a directory.
    Mkdir {
        /// Create missing parents; no error if it exists.
        #[arg(short = 'p', long)]
        parents: bool,
        path: String,
    },
    /// Print a file to stdout.
    Cat { path: String },
}

/// Runs a `nacre fs` command to completion.
pub fn run(a: FsArgs) -> anyhow::Result<()> {
    // Like the admin commands: end quietly when the output pipe closes (`nacre fs cat f | head`).
    crate::default_sigpipe();
    let masters = crate::admin::resolve_masters(&a.master)?;
    crate::runtime()?.block_on(async move {
        let cfg = MsgrConfig {
            workers: 1,
            connect_timeout: Duration::from_secs(2),
            ..MsgrConfig::default()
        };
        let msgr = Messenger::new("fs-cli", cfg, Arc::new(TcpTransport))?;
        let r = async {
            let mc = MasterClient::new(msgr.client(), masters);
            let vol = NetVolume::connect(msgr.client(), mc, &a.volume)
                .await
                .map_err(|e| anyhow!("cannot open volume {}: {e}", a.volume))?;
            let fs = MetaCache::new(NetFs::new(Arc::new(vol)));
            dispatch(&fs, a.cmd, a.json).await
        }
        .await;
        let m = msgr.clone();
        tokio::task::spawn_blocking(move || m.shutdown()).await?;
        r
    })
}

/// The error every command reports: `nacre fs get /x: no such file or directory`.
fn fail(op: &str, path: impl Display, e: impl Display) -> anyhow::Error {
    anyhow!("nacre fs {op} {path}: {e}")
}

async fn dispatch<F: FileSystem>(fs: &F, cmd: FsCmd, json: bool) -> anyhow::Result<()> {
    match cmd {
        FsCmd::Ls { long, path } => ls(fs, &path, long, json)
            .await
            .map_err(|e| fail("ls", &path, e)),
        FsCmd::Stat { path } => {
            let a = resolve(fs, &path)
                .await
                .map_err(|e| fail("stat", &path, e))?;
            stat(fs, &path, &a, json).await;
            Ok(())
        }
        FsCmd::Put {
            local,
            remote,
            parents,
        } => put(fs, &local, &remote, parents, json).await,
        FsCmd::Get { remote, local } => get(fs, &remote, &local, json).await,
        FsCmd::Rm { recursive, path } => rm(fs, &path, recursive)
            .await
            .map_err(|e| fail("rm", &path, e)),
        FsCmd::Mkdir { parents, path } => {
            let made: anyhow::Result<()> = async {
                if parents {
                    mkdir_p(fs, &components(&path)).await?;
                } else {
                    let (parent, name) = parent_and_name(fs, &path).await?;
                    fs.mkdir(parent.ino, name.as_bytes(), 0o755, caller())
                        .await?;
                }
                Ok(())
            }
            .await;
            made.map_err(|e| fail("mkdir", &path, e))
        }
        FsCmd::Cat { path } => {
            let mut out = std::io::stdout().lock();
            copy_out(fs, &path, &mut out, false).await?;
            out.flush().map_err(|e| fail("cat", &path, e))
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Paths.

/// The names of a volume path, `.` dropped and `..` applied (`/` and `` are the root).
fn components(path: &str) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for c in path.split('/') {
        match c {
            "" | "." => {}
            ".." => {
                out.pop();
            }
            c => out.push(c.to_string()),
        }
    }
    out
}

fn not_dir() -> FsError {
    FsError::Meta(MetaError::NotDir)
}

/// The attributes of the inode at `names`.
async fn resolve_names<F: FileSystem>(fs: &F, names: &[String]) -> FsResult<Attr> {
    let mut cur = fs.getattr(ROOT_INO).await?;
    for n in names {
        if cur.kind != FileType::Dir {
            return Err(not_dir());
        }
        cur = fs.lookup(cur.ino, n.as_bytes()).await?;
    }
    Ok(cur)
}

async fn resolve<F: FileSystem>(fs: &F, path: &str) -> FsResult<Attr> {
    resolve_names(fs, &components(path)).await
}

/// The directory holding `path` and the last name of `path` (which must not be the root).
async fn parent_and_name<F: FileSystem>(fs: &F, path: &str) -> anyhow::Result<(Attr, String)> {
    let mut names = components(path);
    let Some(name) = names.pop() else {
        return Err(anyhow!("{path}: the root has no parent"));
    };
    let parent = resolve_names(fs, &names).await?;
    if parent.kind != FileType::Dir {
        return Err(not_dir().into());
    }
    Ok((parent, name))
}

/// Creates every missing directory of `names`; returns the last one.
async fn mkdir_p<F: FileSystem>(fs: &F, names: &[String]) -> FsResult<Attr> {
    let mut cur = fs.getattr(ROOT_INO).await?;
    for n in names {
        if cur.kind != FileType::Dir {
            return Err(not_dir());
        }
        cur = match fs.lookup(cur.ino, n.as_bytes()).await {
            Ok(a) => a,
            Err(FsError::Meta(MetaError::NotFound)) => {
                match fs.mkdir(cur.ino, n.as_bytes(), 0o755, caller()).await {
                    Ok(e) => e.attr,
                    // Made meanwhile by someone else.
                    Err(FsError::Meta(MetaError::Exists)) => {
                        fs.lookup(cur.ino, n.as_bytes()).await?
                    }
                    Err(e) => return Err(e),
                }
            }
            Err(e) => return Err(e),
        };
    }
    if cur.kind != FileType::Dir {
        return Err(not_dir());
    }
    Ok(cur)
}

/// Every entry of `dir`, page by page.
async fn list_all<F: FileSystem>(fs: &F, dir: Ino) -> FsResult<Vec<DirEntryPlus>> {
    let mut all: Vec<DirEntryPlus> = Vec::new();
    loop {
        let after = all.last().map(|e| e.entry.name.clone());
        let page = fs.readdir(dir, after, PAGE).await?;
        let done = page.len() < PAGE as usize;
        all.extend(page);
        if done {
            return Ok(all);
        }
    }
}

/// Who creates files: this process's user.
#[allow(unsafe_code)]
fn caller() -> Caller {
    // SAFETY: getuid and getgid cannot fail and touch no memory.
    unsafe {
        Caller {
            uid: libc::getuid(),
            gid: libc::getgid(),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// ls, stat.

fn kind_name(k: FileType) -> &'static str {
    match k {
        FileType::File => "file",
        FileType::Dir => "dir",
        FileType::Symlink => "symlink",
        FileType::Fifo => "fifo",
        FileType::Socket => "socket",
        FileType::CharDev => "chardev",
        FileType::BlockDev => "blockdev",
    }
}

/// `drwxr-xr-x`, as ls shows it.
fn mode_string(kind: FileType, mode: u32) -> String {
    let mut s = String::with_capacity(10);
    s.push(match kind {
        FileType::File => '-',
        FileType::Dir => 'd',
        FileType::Symlink => 'l',
        FileType::Fifo => 'p',
        FileType::Socket => 's',
        FileType::CharDev => 'c',
        FileType::BlockDev => 'b',
    });
    let special = [(0o4000, 's', 'S'), (0o2000, 's', 'S'), (0o1000, 't', 'T')];
    for (i, (bit, on, off)) in special.into_iter().enumerate() {
        let shift = 6 - 3 * i;
        let rwx = (mode >> shift) & 7;
        s.push(if rwx & 4 != 0 { 'r' } else { '-' });
        s.push(if rwx & 2 != 0 { 'w' } else { '-' });
        s.push(match (mode & bit != 0, rwx & 1 != 0) {
            (true, true) => on,
            (true, false) => off,
            (false, true) => 'x',
            (false, false) => '-',
        });
    }
    s
}

/// Signed nanoseconds since the Unix epoch as `YYYY-MM-DD HH:MM:SS` (UTC), with `.nnnnnnnnn` if
/// `nanos`.
fn time_string(ns: i64, nanos: bool) -> String {
    let secs = ns.div_euclid(1_000_000_000);
    let (days, rem) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    // Howard Hinnant's civil_from_days.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    let mut s = format!(
        "{y:04}-{m:02}-{d:02} {:02}:{:02}:{:02}",
        rem / 3600,
        rem / 60 % 60,
        rem % 60
    );
    if nanos {
        s.push_str(&format!(".{:09}", ns.rem_euclid(1_000_000_000)));
    }
    s
}

fn attr_json(a: &Attr) -> serde_json::Value {
    serde_json::json!({
        "ino": a.ino.0,
        "kind": kind_name(a.kind),
        "mode": format!("{:04o}", a.mode),
        "nlink": a.nlink,
        "uid": a.uid,
        "gid": a.gid,
        "size": a.size,
        "rdev": a.rdev,
        "atime": a.atime,
        "mtime": a.mtime,
        "ctime": a.ctime,
        "generation": a.generation,
    })
}

async fn ls<F: FileSystem>(fs: &F, path: &str, long: bool, json: bool) -> FsResult<()> {
    let a = resolve(fs, path).await?;
    let entries: Vec<(String, Option<Attr>)> = if a.kind == FileType::Dir {
        list_all(fs, a.ino)
            .await?
            .into_iter()
            .map(|e| (String::from_utf8_lossy(&e.entry.name).into_owned(), e.attr))
            .collect()
    } else {
        let name = components(path).pop().unwrap_or_else(|| "/".into());
        vec![(name, Some(a))]
    };
    let mut out = std::io::stdout().lock();
    if json {
        for (name, attr) in &entries {
            let mut v = attr
                .as_ref()
                .map_or_else(|| serde_json::json!({}), attr_json);
            v["name"] = name.clone().into();
            let _ = writeln!(out, "{v}");
        }
        return Ok(());
    }
    if !long {
        for (name, _) in &entries {
            let _ = writeln!(out, "{name}");
        }
        return Ok(());
    }
    let mut t = Table::new();
    t.load_preset(comfy_table::presets::NOTHING);
    t.set_header(["mode", "nlink", "uid", "gid", "size", "mtime", "name"]);
    for (name, attr) in &entries {
        let Some(a) = attr else {
            // Removed between listing and reading it.
            t.add_row(vec!["?", "?", "?", "?", "?", "?", name.as_str()]);
            continue;
        };
        let mut shown = name.clone();
        if a.kind == FileType::Symlink
            && let Ok(target) = fs.readlink(a.ino).await
        {
            shown = format!("{name} -> {}", String::from_utf8_lossy(&target));
        }
        t.add_row(vec![
            mode_string(a.kind, a.mode),
            a.nlink.to_string(),
            a.uid.to_string(),
            a.gid.to_string(),
            a.size.to_string(),
            time_string(a.mtime, false),
            shown,
        ]);
    }
    // Without borders, as ls prints it: no padding at the ends of the lines.
    for line in t.lines() {
        let line = line.strip_prefix(' ').unwrap_or(&line).trim_end();
        let _ = writeln!(out, "{line}");
    }
    Ok(())
}

async fn stat<F: FileSystem>(fs: &F, path: &str, a: &Attr, json: bool) {
    let target = if a.kind == FileType::Symlink {
        fs.readlink(a.ino).await.ok()
    } else {
        None
    };
    if json {
        let mut v = attr_json(a);
        v["path"] = path.into();
        if let Some(t) = &target {
            v["target"] = String::from_utf8_lossy(t).into_owned().into();
        }
        println!("{}", serde_json::to_string_pretty(&v).unwrap_or_default());
        return;
    }
    println!("  path: {path}");
    if let Some(t) = &target {
        println!("target: {}", String::from_utf8_lossy(t));
    }
    println!(" inode: {}  generation: {}", a.ino.0, a.generation);
    println!("  type: {}", kind_name(a.kind));
    println!("  mode: {:04o} ({})", a.mode, mode_string(a.kind, a.mode));
    println!(" links: {}", a.nlink);
    println!(" owner: uid {}  gid {}", a.uid, a.gid);
    println!("  size: {}", a.size);
    if a.rdev != 0 {
        println!("  rdev: {}", a.rdev);
    }
    println!(" atime: {} UTC", time_string(a.atime, true));
    println!(" mtime: {} UTC", time_string(a.mtime, true));
    println!(" ctime: {} UTC", time_string(a.ctime, true));
}

// ---------------------------------------------------------------------------------------------
// put, get, cat.

/// A progress bar on stderr for a transfer of `len` bytes, if stderr is a terminal and the
/// transfer is large; else a hidden one.
fn progress(len: u64, what: &str) -> ProgressBar {
    if len < PROGRESS_MIN || !std::io::stderr().is_terminal() {
        return ProgressBar::hidden();
    }
    let style = ProgressStyle::with_template(
        "{msg} [{bar:30}] {bytes}/{total_bytes} {bytes_per_sec} eta {eta}",
    )
    .map(|s| s.progress_chars("=> "))
    .unwrap_or_else(|_| ProgressStyle::default_bar());
    ProgressBar::with_draw_target(Some(len), ProgressDrawTarget::stderr())
        .with_style(style)
        .with_message(what.to_string())
}

fn summary(op: &str, from: &str, to: &str, bytes: u64, took: Duration, json: bool) -> String {
    let secs = took.as_secs_f64();
    let mib_s = if secs > 0.0 {
        bytes as f64 / (1 << 20) as f64 / secs
    } else {
        0.0
    };
    if json {
        serde_json::json!({
            "op": op, "from": from, "to": to, "bytes": bytes, "secs": secs, "mib_per_s": mib_s,
        })
        .to_string()
    } else {
        format!("{op} {from} -> {to}: {bytes} bytes in {secs:.2} s ({mib_s:.1} MiB/s)")
    }
}

/// Fills `buf` from `r` as far as it goes (short only at the end of the input).
fn read_full(r: &mut impl std::io::Read, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match r.read(&mut buf[n..]) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(n)
}

async fn put<F: FileSystem>(
    fs: &F,
    local: &Path,
    remote: &str,
    parents: bool,
    json: bool,
) -> anyhow::Result<()> {
    use std::os::unix::fs::PermissionsExt as _;
    let err_local = |e: &dyn Display| fail("put", local.display(), e);
    let mut file = std::fs::File::open(local).map_err(|e| err_local(&e))?;
    let meta = file.metadata().map_err(|e| err_local(&e))?;
    if meta.is_dir() {
        return Err(err_local(&"is a directory"));
    }
    let mode = meta.permissions().mode() & 0o7777;
    let base = local
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .ok_or_else(|| err_local(&"no file name"))?;

    let err = |e: &dyn Display| fail("put", remote, e);
    // Where it goes: REMOTE itself, or REMOTE/BASE when REMOTE is (or says it is) a directory.
    let mut names = components(remote);
    let into_dir = remote.ends_with('/') || names.is_empty() || {
        match resolve_names(fs, &names).await {
            Ok(a) => a.kind == FileType::Dir,
            Err(FsError::Meta(MetaError::NotFound)) => false,
            Err(e) => return Err(err(&e)),
        }
    };
    if into_dir {
        names.push(base);
    }
    let Some(name) = names.pop() else {
        return Err(err(&"no file name"));
    };
    let dir = if parents {
        mkdir_p(fs, &names).await
    } else {
        resolve_names(fs, &names).await
    }
    .map_err(|e| err(&e))?;
    if dir.kind != FileType::Dir {
        return Err(err(&not_dir()));
    }
    let shown = {
        let mut p = names.join("/");
        p.insert(0, '/');
        if !names.is_empty() {
            p.push('/');
        }
        p + &name
    };
    let fh = match fs.lookup(dir.ino, name.as_bytes()).await {
        Ok(a) if a.kind == FileType::Dir => return Err(err(&MetaError::IsDir)),
        Ok(a) => {
            let flags = OpenFlags {
                truncate: true,
                ..OpenFlags::WRITE
            };
            let fh = fs.open(a.ino, flags).await.map_err(|e| err(&e))?;
            if a.mode != mode {
                let set = SetAttr {
                    mode: Some(mode),
                    ..SetAttr::default()
                };
                fs.setattr(a.ino, set).await.map_err(|e| err(&e))?;
            }
            fh
        }
        Err(FsError::Meta(MetaError::NotFound)) => {
            fs.create(dir.ino, name.as_bytes(), mode, caller(), OpenFlags::WRITE)
                .await
                .map_err(|e| err(&e))?
                .1
        }
        Err(e) => return Err(err(&e)),
    };

    let started = Instant::now();
    let bar = progress(meta.len(), &shown);
    let mut off = 0u64;
    let written: anyhow::Result<()> = async {
        loop {
            let mut chunk = vec![0u8; CHUNK];
            let n = read_full(&mut file, &mut chunk).map_err(|e| err_local(&e))?;
            if n == 0 {
                return Ok(());
            }
            chunk.truncate(n);
            let mut data = Bytes::from(chunk);
            while !data.is_empty() {
                let k = fs.write(fh, off, data.clone()).await.map_err(|e| err(&e))?;
                if k == 0 {
                    return Err(err(&"the file system took no bytes"));
                }
                off += u64::from(k);
                data = data.slice(k as usize..);
            }
            bar.set_position(off);
        }
    }
    .await;
    // Release commits what was written; its error matters as much as a write's.
    let released = fs.release(fh).await.map_err(|e| err(&e));
    bar.finish_and_clear();
    written?;
    released?;
    println!(
        "{}",
        summary(
            "put",
            &local.display().to_string(),
            &shown,
            off,
            started.elapsed(),
            json
        )
    );
    Ok(())
}

/// Copies the file at `remote` into `out`; returns the bytes copied.
async fn copy_out<F: FileSystem>(
    fs: &F,
    remote: &str,
    out: &mut impl std::io::Write,
    show_progress: bool,
) -> anyhow::Result<u64> {
    let op = if show_progress { "get" } else { "cat" };
    let err = |e: &dyn Display| fail(op, remote, e);
    let a = resolve(fs, remote).await.map_err(|e| err(&e))?;
    if a.kind == FileType::Dir {
        return Err(err(&MetaError::IsDir));
    }
    let fh = fs.open(a.ino, OpenFlags::READ).await.map_err(|e| err(&e))?;
    let bar = if show_progress {
        progress(a.size, remote)
    } else {
        ProgressBar::hidden()
    };
    let mut off = 0u64;
    let copied: anyhow::Result<()> = async {
        loop {
            let b = fs.read(fh, off, CHUNK as u32).await.map_err(|e| err(&e))?;
            if b.is_empty() {
                return Ok(());
            }
            out.write_all(&b).map_err(|e| err(&e))?;
            off += b.len() as u64;
            bar.set_position(off);
        }
    }
    .await;
    let _ = fs.release(fh).await;
    bar.finish_and_clear();
    copied?;
    Ok(off)
}

async fn get<F: FileSystem>(fs: &F, remote: &str, local: &Path, json: bool) -> anyhow::Result<()> {
    let started = Instant::now();
    if local == Path::new("-") {
        let mut out = std::io::stdout().lock();
        copy_out(fs, remote, &mut out, true).await?;
        return out.flush().map_err(|e| fail("get", remote, e));
    }
    let mut dest = local.to_path_buf();
    if dest.is_dir() {
        let name = components(remote)
            .pop()
            .ok_or_else(|| fail("get", remote, "is a directory"))?;
        dest.push(name);
    }
    let err_local = |e: &dyn Display| fail("get", dest.display(), e);
    // Into a temporary file beside the destination, renamed over it when complete: a failed
    // copy leaves no half file.
    let dir = dest
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let mut tmp = tempfile::Builder::new()
        .prefix(".nacre-get-")
        .tempfile_in(dir)
        .map_err(|e| err_local(&e))?;
    let n = {
        let mut w = std::io::BufWriter::with_capacity(CHUNK, tmp.as_file_mut());
        let n = copy_out(fs, remote, &mut w, true).await?;
        w.flush().map_err(|e| err_local(&e))?;
        n
    };
    tmp.persist(&dest).map_err(|e| err_local(&e.error))?;
    println!(
        "{}",
        summary(
            "get",
            remote,
            &dest.display().to_string(),
            n,
            started.elapsed(),
            json
        )
    );
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// rm.

async fn rm<F: FileSystem>(fs: &F, path: &str, recursive: bool) -> anyhow::Result<()> {
    let (parent, name) = parent_and_name(fs, path)
        .await
        .map_err(|e| anyhow!("{e}"))?;
    let a = fs.lookup(parent.ino, name.as_bytes()).await?;
    if a.kind != FileType::Dir {
        fs.unlink(parent.ino, name.as_bytes()).await?;
        return Ok(());
    }
    if !recursive {
        return Err(anyhow!(
            "is a directory (rm -r removes it and everything below)"
        ));
    }
    // Depth first without recursion: a frame is a directory to empty, then remove.
    struct Frame {
        parent: Ino,
        name: Vec<u8>,
        ino: Ino,
        emptied: bool,
    }
    let mut stack = vec![Frame {
        parent: parent.ino,
        name: name.into_bytes(),
        ino: a.ino,
        emptied: false,
    }];
    while let Some(top) = stack.last_mut() {
        if top.emptied {
            fs.rmdir(top.parent, &top.name).await?;
            stack.pop();
            continue;
        }
        top.emptied = true;
        let dir = top.ino;
        for e in list_all(fs, dir).await? {
            if e.entry.kind == FileType::Dir {
                stack.push(Frame {
                    parent: dir,
                    name: e.entry.name,
                    ino: e.entry.ino,
                    emptied: false,
                });
            } else {
                fs.unlink(dir, &e.entry.name).await?;
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_are_split_and_normalized() {
        assert!(components("/").is_empty());
        assert!(components("").is_empty());
        assert_eq!(components("/a//b/./c/"), ["a", "b", "c"]);
        assert_eq!(components("a/b/../c"), ["a", "c"]);
        assert!(components("/../..").is_empty());
    }

    #[test]
    fn modes_and_times_print_like_ls() {
        assert_eq!(mode_string(FileType::Dir, 0o755), "drwxr-xr-x");
        assert_eq!(mode_string(FileType::File, 0o4644), "-rwSr--r--");
        assert_eq!(mode_string(FileType::Dir, 0o1777), "drwxrwxrwt");
        assert_eq!(mode_string(FileType::Symlink, 0o777), "lrwxrwxrwx");
        assert_eq!(time_string(0, false), "1970-01-01 00:00:00");
        // 2024-02-29 12:34:56.000000789 UTC
        assert_eq!(
            time_string(1_709_210_096_000_000_789, true),
            "2024-02-29 12:34:56.000000789"
        );
        assert_eq!(
            time_string(-315_619_199_876_543_211, true),
            "1960-01-01 00:00:00.123456789"
        );
        assert_eq!(time_string(-1, true), "1969-12-31 23:59:59.999999999");
    }
}
