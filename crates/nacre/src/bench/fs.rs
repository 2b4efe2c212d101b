//! `nacre bench fs`: the work people do on a mounted file system, timed on any directory, so a
//! nacre mount, a ceph-fuse mount and a local disk are measured the same way, one after another.
//!
//! Everything runs in a fresh subdirectory of `--dir`, removed at the end. Each timed phase ends
//! with its data durable: an `fsync` of the phase's directory (on a nacre mount this waits for every
//! earlier change of names and attributes, ARCHITECTURE.md "Write-behind under directory
//! delegations") and a `syncfs` of its file system, both inside the timing. Files are written with
//! plain system calls (`std::fs`); where the workload *is* a tool (`tar`, `cp`, `rm`, `git`) that
//! tool runs. The phases:
//!
//! | workload | one operation |
//! | --- | --- |
//! | `create` | create + write N KiB + close, per `--sizes`, one writer, one directory |
//! | `create-parallel` | the same at `--parallel-size` by `--writers` threads, each in its own directory |
//! | `untar` | `tar x` of an archive of `--tree` (made once, outside `--dir`), per entry |
//! | `cp` | `cp -r` of the unpacked tree, per entry |
//! | `rm` | `rm -rf` of the copied tree (or the unpacked one), per entry |
//! | `git-clone` | `git clone --no-hardlinks` of a local repository, per checked-out file |
//! | `git-checkout` | `git checkout` to the commit `--git-back` before HEAD and back, per changed file |
//! | `rename` | rename of one of `--storm` files within one directory |
//! | `unlink` | unlink of one of `--storm` 4 KiB files |
//! | `holes` | 4 KiB `pwrite` into a sparse `--sparse-size` file, every block once, seeded random order |
//! | `holes-mmap` | the same through a shared `mmap`, `msync` every 256 writes |
//! | `overwrite` | 4 KiB `pwrite` over allocated blocks of a `--sparse-size` file, random order |
//!
//! `holes` and `holes-mmap` also report the rates of the first and the last tenth of the writes
//! (`first_tenth_writes_per_s`, `last_tenth_writes_per_s`); the last tenth includes the final
//! `fsync`. Every block is read back and compared afterwards (not timed).
//!
//! The unpacked tree is compared with its source, and the copy with the unpacked tree, by
//! `diff -r --no-dereference` (not timed); any difference fails the benchmark.

use std::fmt;
use std::fs::{self, File};
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, Barrier};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use anyhow::{Context as _, bail, ensure};
use comfy_table::{Cell, CellAlignment, Table, presets::UTF8_FULL_CONDENSED};
use serde_json::{Map, Value, json};

use crate::bench::report::human_size;

/// The workloads, in the order they run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Workload {
    Create,
    CreateParallel,
    Untar,
    Cp,
    Rm,
    GitClone,
    GitCheckout,
    Rename,
    Unlink,
    Holes,
    HolesMmap,
    Overwrite,
}

impl Workload {
    pub const ALL: [Workload; 12] = [
        Workload::Create,
        Workload::CreateParallel,
        Workload::Untar,
        Workload::Cp,
        Workload::Rm,
        Workload::GitClone,
        Workload::GitCheckout,
        Workload::Rename,
        Workload::Unlink,
        Workload::Holes,
        Workload::HolesMmap,
        Workload::Overwrite,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Workload::Create => "create",
            Workload::CreateParallel => "create-parallel",
            Workload::Untar => "untar",
            Workload::Cp => "cp",
            Workload::Rm => "rm",
            Workload::GitClone => "git-clone",
            Workload::GitCheckout => "git-checkout",
            Workload::Rename => "rename",
            Workload::Unlink => "unlink",
            Workload::Holes => "holes",
            Workload::HolesMmap => "holes-mmap",
            Workload::Overwrite => "overwrite",
        }
    }

    /// Parses a comma-separated list (`all` selects every workload), sorted into running order.
    pub fn parse_list(names: &[String]) -> anyhow::Result<Vec<Workload>> {
        let mut out = Vec::new();
        for n in names.iter().map(|n| n.trim()).filter(|n| !n.is_empty()) {
            if n == "all" {
                out.extend(Self::ALL);
                continue;
            }
            match Self::ALL.iter().find(|w| w.name() == n) {
                Some(w) => out.push(*w),
                None => bail!(
                    "unknown workload {n:?}; choose from all, {}",
                    Self::ALL.map(Workload::name).join(", ")
                ),
            }
        }
        out.sort();
        out.dedup();
        ensure!(!out.is_empty(), "no workload selected");
        Ok(out)
    }

    /// The external programs the workload runs.
    fn tools(self) -> &'static [&'static str] {
        match self {
            Workload::Untar | Workload::Cp | Workload::Rm => &["tar", "cp", "rm", "diff"],
            Workload::GitClone | Workload::GitCheckout => &["git"],
            _ => &[],
        }
    }
}

impl fmt::Display for Workload {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Where the archive's files come from.
#[derive(Clone, Debug)]
pub enum TreeSource {
    /// An existing directory (e.g. /usr/share/doc).
    Dir(PathBuf),
    /// A tree of this many files of mixed sizes (1 KiB to 256 KiB), generated in a temporary
    /// directory outside `--dir`.
    Generated { files: usize },
}

#[derive(Clone, Debug)]
pub struct Params {
    pub dir: PathBuf,
    pub label: String,
    pub workloads: Vec<Workload>,
    /// File sizes of `create`.
    pub sizes: Vec<usize>,
    /// Files per writer in `create` and `create-parallel`.
    pub files: usize,
    pub writers: usize,
    pub parallel_size: usize,
    pub tree: TreeSource,
    /// Files of the rename and unlink storms.
    pub storm: usize,
    pub git_repo: PathBuf,
    /// How many commits back `git-checkout` goes (fewer if the repository has fewer).
    pub git_back: usize,
    /// 4 KiB files created, synced and removed before the first phase, not timed (a fresh mount's
    /// first writes open extents and connections).
    pub warmup_files: usize,
    /// Size of the files of `holes`, `holes-mmap` and `overwrite` (a multiple of 4 KiB).
    pub sparse_size: u64,
    /// Writes of `overwrite` (at most one per block).
    pub overwrites: u64,
}

/// One measured phase.
#[derive(Clone, Debug)]
pub struct FsRow {
    pub implementation: String,
    pub workload: Workload,
    /// What one operation is: `files`, `entries` or `ops`; the JSON figures are named after it.
    pub unit: &'static str,
    pub count: u64,
    /// Bytes of file data written, where the workload writes data.
    pub bytes: Option<u64>,
    pub secs: f64,
    /// The workload's parameters (`file_size`, `writers`, `commits_apart`, …).
    pub params: Vec<(&'static str, Value)>,
}

impl FsRow {
    pub fn rate(&self) -> f64 {
        self.count as f64 / self.secs.max(1e-9)
    }

    pub fn mib_per_s(&self) -> Option<f64> {
        self.bytes
            .map(|b| b as f64 / (1 << 20) as f64 / self.secs.max(1e-9))
    }

    /// One JSON object: `bench`, `impl`, `workload`, the parameters, the count under the name of
    /// its unit (`files`, `entries`, `ops`), `secs`, `<unit>_per_s` and `mib_per_s` where data is
    /// written.
    pub fn to_json(&self) -> Value {
        let mut m = Map::new();
        m.insert("bench".into(), json!("fs"));
        m.insert("impl".into(), json!(self.implementation));
        m.insert("workload".into(), json!(self.workload.name()));
        for (k, v) in &self.params {
            m.insert((*k).into(), v.clone());
        }
        m.insert(self.unit.into(), json!(self.count));
        if let Some(b) = self.bytes {
            m.insert("bytes".into(), json!(b));
        }
        m.insert("secs".into(), json!(round3(self.secs)));
        m.insert(format!("{}_per_s", self.unit), json!(round3(self.rate())));
        if let Some(r) = self.mib_per_s() {
            m.insert("mib_per_s".into(), json!(round3(r)));
        }
        Value::Object(m)
    }
}

fn round3(x: f64) -> f64 {
    (x * 1000.0).round() / 1000.0
}

pub fn print_table(rows: &[FsRow]) {
    let mut t = Table::new();
    t.load_preset(UTF8_FULL_CONDENSED);
    t.set_header([
        "impl",
        "workload",
        "parameters",
        "count",
        "secs",
        "rate",
        "MiB/s",
    ]);
    for r in rows {
        let right = |s: String| Cell::new(s).set_alignment(CellAlignment::Right);
        let params = r
            .params
            .iter()
            .map(|(k, v)| match (k, v.as_u64()) {
                (&"file_size", Some(n)) => format!("{k}={}", human_size(n as usize)),
                _ => format!(
                    "{k}={}",
                    v.as_str().map(str::to_string).unwrap_or(v.to_string())
                ),
            })
            .collect::<Vec<_>>()
            .join(" ");
        t.add_row(vec![
            Cell::new(&r.implementation),
            Cell::new(r.workload.name()),
            Cell::new(params),
            right(format!("{} {}", r.count, r.unit)),
            right(format!("{:.2}", r.secs)),
            right(format!("{:.0} {}/s", r.rate(), r.unit)),
            right(r.mib_per_s().map(|m| format!("{m:.1}")).unwrap_or_default()),
        ]);
    }
    println!("{t}");
}

/// Runs the selected workloads in a fresh subdirectory of `p.dir`; `on_row` sees each row as it
/// is measured. The subdirectory is removed at the end, also after a failure.
pub fn run(p: &Params, mut on_row: impl FnMut(&FsRow)) -> anyhow::Result<Vec<FsRow>> {
    let meta = fs::metadata(&p.dir).with_context(|| format!("--dir {}", p.dir.display()))?;
    ensure!(
        meta.is_dir(),
        "--dir {} is not a directory",
        p.dir.display()
    );
    ensure!(
        p.files > 0 && p.storm > 0 && p.writers > 0,
        "--files, --storm and --writers must be at least 1"
    );
    ensure!(
        p.sparse_size >= 10 * BLOCK && p.sparse_size.is_multiple_of(BLOCK),
        "--sparse-size must be a multiple of 4 KiB and at least 40 KiB"
    );
    for w in &p.workloads {
        for tool in w.tools() {
            check_tool(tool, *w)?;
        }
    }
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    let root = p
        .dir
        .join(format!("nacre-bench-fs-{}-{nanos:09}", std::process::id()));
    fs::create_dir(&root).with_context(|| format!("cannot create {}", root.display()))?;
    let guard = RemoveOnDrop(root.clone());
    let mut b = Bench {
        p,
        root: &root,
        rows: Vec::new(),
        on_row: &mut on_row,
    };
    b.all()?;
    let rows = std::mem::take(&mut b.rows);
    drop(guard);
    ensure!(
        !root.exists(),
        "could not remove the benchmark's directory {}",
        root.display()
    );
    Ok(rows)
}

/// Removes the benchmark's directory, also when a phase failed.
struct RemoveOnDrop(PathBuf);

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        if let Err(e) = fs::remove_dir_all(&self.0) {
            eprintln!("cannot remove {}: {e}", self.0.display());
        }
    }
}

struct Bench<'a, F: FnMut(&FsRow)> {
    p: &'a Params,
    root: &'a Path,
    rows: Vec<FsRow>,
    on_row: &'a mut F,
}

impl<F: FnMut(&FsRow)> Bench<'_, F> {
    fn wants(&self, w: Workload) -> bool {
        self.p.workloads.contains(&w)
    }

    fn push(
        &mut self,
        workload: Workload,
        unit: &'static str,
        count: u64,
        bytes: Option<u64>,
        secs: f64,
        params: Vec<(&'static str, Value)>,
    ) {
        let row = FsRow {
            implementation: self.p.label.clone(),
            workload,
            unit,
            count,
            bytes,
            secs,
            params,
        };
        (self.on_row)(&row);
        self.rows.push(row);
    }

    fn all(&mut self) -> anyhow::Result<()> {
        if self.p.warmup_files > 0 {
            let dir = self.root.join("warmup");
            fs::create_dir(&dir).with_context(|| format!("mkdir {}", dir.display()))?;
            write_files(&dir, self.p.warmup_files, &[0xa5; 4096])?;
            sync(&dir)?;
            remove_tree(&dir)?;
        }
        if self.wants(Workload::Create) {
            for &size in &self.p.sizes.clone() {
                self.create(Workload::Create, size, 1)?;
            }
        }
        if self.wants(Workload::CreateParallel) {
            self.create(
                Workload::CreateParallel,
                self.p.parallel_size,
                self.p.writers,
            )?;
        }
        if self.wants(Workload::Untar) || self.wants(Workload::Cp) || self.wants(Workload::Rm) {
            self.tree()?;
        }
        if self.wants(Workload::GitClone) || self.wants(Workload::GitCheckout) {
            self.git()?;
        }
        if self.wants(Workload::Rename) {
            self.rename()?;
        }
        if self.wants(Workload::Unlink) {
            self.unlink()?;
        }
        for w in [Workload::Holes, Workload::HolesMmap, Workload::Overwrite] {
            if self.wants(w) {
                self.sparse(w)?;
            }
        }
        Ok(())
    }

    /// `writers` threads each create `files` files of `size` bytes in their own directory.
    fn create(&mut self, w: Workload, size: usize, writers: usize) -> anyhow::Result<()> {
        let dir = self.root.join(format!("{}-{}", w.name(), human_size(size)));
        fs::create_dir(&dir).with_context(|| format!("mkdir {}", dir.display()))?;
        let dirs: Vec<PathBuf> = (0..writers).map(|i| dir.join(format!("w{i}"))).collect();
        for d in &dirs {
            fs::create_dir(d).with_context(|| format!("mkdir {}", d.display()))?;
        }
        sync(&dir)?;
        let data: Arc<Vec<u8>> = Arc::new((0..size).map(|_| fastrand::u8(..)).collect());
        let files = self.p.files;
        let start = Barrier::new(writers + 1);
        let secs = std::thread::scope(|s| -> anyhow::Result<f64> {
            let handles: Vec<_> = dirs
                .iter()
                .map(|d| {
                    let (data, start) = (data.clone(), &start);
                    s.spawn(move || {
                        start.wait();
                        write_files(d, files, &data)
                    })
                })
                .collect();
            start.wait();
            let t = Instant::now();
            for h in handles {
                h.join()
                    .map_err(|_| anyhow::anyhow!("a writer thread panicked"))??;
            }
            sync(&dir)?;
            Ok(t.elapsed().as_secs_f64())
        })?;
        let n = (files * writers) as u64;
        self.push(
            w,
            "files",
            n,
            Some(n * size as u64),
            secs,
            vec![("file_size", json!(size)), ("writers", json!(writers))],
        );
        remove_tree(&dir)
    }

    /// untar, then cp -r of the unpacked tree, then rm -rf.
    fn tree(&mut self) -> anyhow::Result<()> {
        let scratch = tempfile::Builder::new()
            .prefix("nacre-bench-fs-src")
            .tempdir()
            .context("cannot create a temporary directory for the archive")?;
        let src = match &self.p.tree {
            TreeSource::Dir(d) => {
                ensure!(
                    d.is_dir(),
                    "--tree {} is not a directory (pass another with --tree, or --gen-tree N)",
                    d.display()
                );
                d.clone()
            }
            TreeSource::Generated { files } => {
                let d = scratch.path().join("tree");
                generate_tree(&d, *files)?;
                d
            }
        };
        let src = src
            .canonicalize()
            .with_context(|| format!("--tree {}", src.display()))?;
        let (parent, name) = match (src.parent(), src.file_name()) {
            (Some(p), Some(n)) => (p.to_path_buf(), n.to_os_string()),
            _ => bail!("--tree {} cannot be the root directory", src.display()),
        };
        let archive = scratch.path().join("tree.tar");
        run_tool(
            Command::new("tar")
                .arg("-C")
                .arg(&parent)
                .arg("-cf")
                .arg(&archive)
                .arg(&name),
        )?;

        let untar = self.root.join("untar");
        fs::create_dir(&untar).with_context(|| format!("mkdir {}", untar.display()))?;
        sync(&untar)?;
        let t = Instant::now();
        run_tool(
            Command::new("tar")
                .arg("-C")
                .arg(&untar)
                .arg("-xf")
                .arg(&archive),
        )?;
        sync(&untar)?;
        let secs = t.elapsed().as_secs_f64();
        let unpacked = untar.join(&name);
        let (entries, bytes) = count_tree(&unpacked)?;
        same_trees(&src, &unpacked)?;
        if self.wants(Workload::Untar) {
            let archive_bytes = fs::metadata(&archive).map(|m| m.len()).unwrap_or(0);
            self.push(
                Workload::Untar,
                "entries",
                entries,
                Some(bytes),
                secs,
                vec![("archive_bytes", json!(archive_bytes))],
            );
        }
        drop(scratch);

        let mut victim = untar.clone();
        if self.wants(Workload::Cp) {
            let copy = self.root.join("copy");
            let t = Instant::now();
            run_tool(Command::new("cp").arg("-r").arg(&unpacked).arg(&copy))?;
            sync(self.root)?;
            let secs = t.elapsed().as_secs_f64();
            same_trees(&unpacked, &copy)?;
            self.push(Workload::Cp, "entries", entries, Some(bytes), secs, vec![]);
            remove_tree(&untar)?;
            victim = copy;
        }
        if self.wants(Workload::Rm) {
            let (n, _) = count_tree(&victim)?;
            let t = Instant::now();
            run_tool(Command::new("rm").arg("-rf").arg(&victim))?;
            sync(self.root)?;
            let secs = t.elapsed().as_secs_f64();
            ensure!(!victim.exists(), "rm -rf left {}", victim.display());
            self.push(Workload::Rm, "entries", n, None, secs, vec![]);
        } else {
            remove_tree(&victim)?;
        }
        Ok(())
    }

    /// `git clone` of a local repository, then `git checkout` to an older commit and back.
    fn git(&mut self) -> anyhow::Result<()> {
        let repo = run_tool(
            Command::new("git")
                .arg("-C")
                .arg(&self.p.git_repo)
                .args(["rev-parse", "--show-toplevel"]),
        )
        .with_context(|| {
            format!(
                "--git-repo {} is not a git repository",
                self.p.git_repo.display()
            )
        })?;
        let repo = PathBuf::from(repo.trim());
        let clone = self.root.join("clone");
        let t = Instant::now();
        run_tool(
            Command::new("git")
                .args(["clone", "-q", "--no-hardlinks"])
                .arg(&repo)
                .arg(&clone),
        )?;
        sync(&clone)?;
        let secs = t.elapsed().as_secs_f64();
        let git = |args: &[&str]| run_tool(Command::new("git").arg("-C").arg(&clone).args(args));
        let files = git(&["ls-files"])?.lines().count() as u64;
        if self.wants(Workload::GitClone) {
            self.push(Workload::GitClone, "files", files, None, secs, vec![]);
        }

        if self.wants(Workload::GitCheckout) {
            let commits: usize = git(&["rev-list", "--count", "HEAD"])?
                .trim()
                .parse()
                .context("git rev-list --count HEAD")?;
            let back = self.p.git_back.min(commits.saturating_sub(1));
            ensure!(
                back > 0,
                "git-checkout needs a repository with at least two commits ({} has {commits})",
                repo.display()
            );
            let head = git(&["rev-parse", "HEAD"])?.trim().to_string();
            let old = git(&["rev-parse", &format!("HEAD~{back}")])?
                .trim()
                .to_string();
            let changed = git(&["diff", "--name-only", &old, &head])?.lines().count() as u64;
            let t = Instant::now();
            git(&["checkout", "-q", "--detach", &old])?;
            git(&["checkout", "-q", "--detach", &head])?;
            sync(&clone)?;
            let secs = t.elapsed().as_secs_f64();
            ensure!(
                git(&["status", "--porcelain"])?.trim().is_empty(),
                "git checkout left the work tree of {} modified",
                clone.display()
            );
            self.push(
                Workload::GitCheckout,
                "files",
                2 * changed,
                None,
                secs,
                vec![("commits_apart", json!(back))],
            );
        }
        remove_tree(&clone)
    }

    /// Renames `storm` empty files within one directory.
    fn rename(&mut self) -> anyhow::Result<()> {
        let dir = self.root.join("rename");
        fs::create_dir(&dir).with_context(|| format!("mkdir {}", dir.display()))?;
        write_files(&dir, self.p.storm, &[])?;
        sync(&dir)?;
        let t = Instant::now();
        for i in 0..self.p.storm {
            let (from, to) = (dir.join(file_name(i)), dir.join(format!("r{i:07}")));
            fs::rename(&from, &to)
                .with_context(|| format!("rename {} to {}", from.display(), to.display()))?;
        }
        sync(&dir)?;
        let secs = t.elapsed().as_secs_f64();
        self.push(
            Workload::Rename,
            "ops",
            self.p.storm as u64,
            None,
            secs,
            vec![],
        );
        remove_tree(&dir)
    }

    /// Unlinks `storm` 4 KiB files in one directory.
    fn unlink(&mut self) -> anyhow::Result<()> {
        let dir = self.root.join("unlink");
        fs::create_dir(&dir).with_context(|| format!("mkdir {}", dir.display()))?;
        write_files(&dir, self.p.storm, &[0x5a; 4096])?;
        sync(&dir)?;
        let t = Instant::now();
        for i in 0..self.p.storm {
            let f = dir.join(file_name(i));
            fs::remove_file(&f).with_context(|| format!("unlink {}", f.display()))?;
        }
        sync(&dir)?;
        let secs = t.elapsed().as_secs_f64();
        self.push(
            Workload::Unlink,
            "ops",
            self.p.storm as u64,
            None,
            secs,
            vec![("file_size", json!(4096))],
        );
        remove_tree(&dir)
    }
}

/// The block of `holes`, `holes-mmap` and `overwrite`.
const BLOCK: u64 = 4096;
/// `holes-mmap` calls `msync` after this many writes.
const MSYNC_EVERY: u64 = 256;

impl<F: FnMut(&FsRow)> Bench<'_, F> {
    /// 4 KiB writes in a seeded random order into one file: into its holes (`holes`, by `pwrite`;
    /// `holes-mmap`, through a shared mapping) or over its allocated blocks (`overwrite`). Ends
    /// with `fsync` of the file and the directory sync, inside the timing.
    fn sparse(&mut self, w: Workload) -> anyhow::Result<()> {
        use std::os::unix::fs::FileExt as _;
        let path = self.root.join(w.name());
        let size = self.p.sparse_size;
        let blocks = size / BLOCK;
        let f = fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(&path)
            .with_context(|| format!("create {}", path.display()))?;
        if w == Workload::Overwrite {
            let chunk = vec![0x3cu8; 1 << 20];
            let mut off = 0;
            while off < size {
                let n = chunk.len().min((size - off) as usize);
                f.write_all_at(&chunk[..n], off)
                    .with_context(|| format!("write {}", path.display()))?;
                off += n as u64;
            }
            f.sync_all()
                .with_context(|| format!("fsync {}", path.display()))?;
        } else {
            f.set_len(size)
                .with_context(|| format!("truncate {}", path.display()))?;
        }
        sync(self.root)?;
        let mut order: Vec<u64> = (0..blocks).collect();
        fastrand::Rng::with_seed(0x5eed).shuffle(&mut order);
        if w == Workload::Overwrite {
            order.truncate(self.p.overwrites.clamp(1, blocks) as usize);
        }
        let writes = order.len() as u64;
        let tenth = writes / 10;
        let map = match w {
            Workload::HolesMmap => Some(Mapping::new(&f, size as usize)?),
            _ => None,
        };
        let mut block = [0u8; BLOCK as usize];
        let mut marks = Vec::with_capacity(2);
        let t = Instant::now();
        for (i, &b) in order.iter().enumerate() {
            let i = i as u64;
            // When the first tenth ends and the last begins.
            if i == tenth || i == 9 * tenth {
                marks.push(t.elapsed().as_secs_f64());
            }
            stamp(&mut block, b);
            let off = b * BLOCK;
            match &map {
                Some(m) => {
                    m.write(off as usize, &block);
                    if (i + 1).is_multiple_of(MSYNC_EVERY) {
                        m.sync().context("msync")?;
                    }
                }
                None => f
                    .write_all_at(&block, off)
                    .with_context(|| format!("write {}", path.display()))?,
            }
        }
        if let Some(m) = &map {
            m.sync().context("msync")?;
        }
        f.sync_all()
            .with_context(|| format!("fsync {}", path.display()))?;
        sync(self.root)?;
        let secs = t.elapsed().as_secs_f64();
        drop(map);
        let (first_end, last_start) = match marks[..] {
            [a, b] => (a, b),
            _ => (secs, 0.0),
        };
        let first = tenth as f64 / first_end.max(1e-9);
        let last = (writes - 9 * tenth) as f64 / (secs - last_start).max(1e-9);
        verify_blocks(&f, &path, blocks, w == Workload::Overwrite, &order)?;
        let mut params = vec![("file_size", json!(size)), ("block_size", json!(BLOCK))];
        if w != Workload::Overwrite {
            params.push(("first_tenth_writes_per_s", json!(round3(first))));
            params.push(("last_tenth_writes_per_s", json!(round3(last))));
        }
        self.push(w, "writes", writes, Some(writes * BLOCK), secs, params);
        drop(f);
        fs::remove_file(&path).with_context(|| format!("remove {}", path.display()))?;
        sync(self.root)
    }
}

/// Writes block `b`'s number into every 512 bytes of `block`, so a block in the wrong place or
/// missing shows.
fn stamp(block: &mut [u8; BLOCK as usize], b: u64) {
    for (i, sector) in block.chunks_mut(512).enumerate() {
        sector[..8].copy_from_slice(&b.to_le_bytes());
        sector[8] = i as u8;
        sector[9..].fill(b as u8);
    }
}

/// Reads the file back: each written block carries its stamp; the rest of an overwritten file
/// its first contents.
fn verify_blocks(
    f: &File,
    path: &Path,
    blocks: u64,
    overwrite: bool,
    written: &[u64],
) -> anyhow::Result<()> {
    use std::os::unix::fs::FileExt as _;
    let mut is_written = vec![false; blocks as usize];
    for &b in written {
        is_written[b as usize] = true;
    }
    let (mut want, mut got) = ([0u8; BLOCK as usize], vec![0u8; 1 << 20]);
    let per = got.len() as u64 / BLOCK;
    for first in (0..blocks).step_by(per as usize) {
        let n = per.min(blocks - first);
        let buf = &mut got[..(n * BLOCK) as usize];
        f.read_exact_at(buf, first * BLOCK)
            .with_context(|| format!("read {}", path.display()))?;
        for (k, have) in buf.chunks(BLOCK as usize).enumerate() {
            let b = first + k as u64;
            if is_written[b as usize] {
                stamp(&mut want, b);
            } else {
                want.fill(if overwrite { 0x3c } else { 0 });
            }
            ensure!(
                have == want,
                "{}: block {b} reads back wrong",
                path.display()
            );
        }
    }
    Ok(())
}

/// A shared, writable mapping of a whole file.
struct Mapping {
    ptr: std::ptr::NonNull<libc::c_void>,
    len: usize,
}

#[allow(unsafe_code)]
impl Mapping {
    fn new(f: &File, len: usize) -> anyhow::Result<Self> {
        use std::os::fd::AsRawFd as _;
        // SAFETY: a fresh mapping of an open file descriptor; the kernel picks the address.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                f.as_raw_fd(),
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error()).context("mmap");
        }
        let ptr = std::ptr::NonNull::new(ptr).context("mmap returned null")?;
        Ok(Self { ptr, len })
    }

    /// Copies `data` to `off` of the mapping.
    fn write(&self, off: usize, data: &[u8]) {
        assert!(off + data.len() <= self.len, "write past the mapping");
        // SAFETY: in bounds (checked above) of a live mapping that only this thread writes.
        unsafe {
            std::ptr::copy_nonoverlapping(
                data.as_ptr(),
                self.ptr.as_ptr().cast::<u8>().add(off),
                data.len(),
            );
        }
    }

    /// `msync(MS_SYNC)` of the whole mapping.
    fn sync(&self) -> std::io::Result<()> {
        // SAFETY: the whole live mapping.
        if unsafe { libc::msync(self.ptr.as_ptr(), self.len, libc::MS_SYNC) } == 0 {
            Ok(())
        } else {
            Err(std::io::Error::last_os_error())
        }
    }
}

#[allow(unsafe_code)]
impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `new`, unmapped once.
        unsafe {
            libc::munmap(self.ptr.as_ptr(), self.len);
        }
    }
}

fn file_name(i: usize) -> String {
    format!("f{i:07}")
}

/// Creates `n` files in `dir`, each written with `data` and closed; a failed close is an error.
fn write_files(dir: &Path, n: usize, data: &[u8]) -> anyhow::Result<()> {
    for i in 0..n {
        let path = dir.join(file_name(i));
        let mut f = File::create(&path).with_context(|| format!("create {}", path.display()))?;
        if !data.is_empty() {
            f.write_all(data)
                .with_context(|| format!("write {}", path.display()))?;
        }
        close(f).with_context(|| format!("close {}", path.display()))?;
    }
    Ok(())
}

/// `close(2)` with its result: on a network file system the close may report a failed write,
/// which dropping a `File` ignores.
#[allow(unsafe_code)]
fn close(f: File) -> std::io::Result<()> {
    use std::os::fd::IntoRawFd as _;
    let fd = f.into_raw_fd();
    // SAFETY: `fd` was just released by its `File`, so it is open and owned by nobody else.
    if unsafe { libc::close(fd) } == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// Makes everything written under `dir` durable: `fsync` of the directory (a nacre mount waits for
/// every earlier name change there) and `syncfs` of its file system.
pub fn sync(dir: &Path) -> anyhow::Result<()> {
    let f = File::open(dir).with_context(|| format!("open {}", dir.display()))?;
    f.sync_all()
        .with_context(|| format!("fsync {}", dir.display()))?;
    rustix::fs::syncfs(&f).with_context(|| format!("syncfs {}", dir.display()))?;
    Ok(())
}

/// Removes a phase's files, not timed, and syncs their removal so that the next phase's sync
/// does not pay for it (a nacre mount removes names behind the call).
fn remove_tree(dir: &Path) -> anyhow::Result<()> {
    fs::remove_dir_all(dir).with_context(|| format!("remove {}", dir.display()))?;
    match dir.parent() {
        Some(parent) => sync(parent),
        None => Ok(()),
    }
}

/// Entries (the root included) and bytes of regular files under `root`, symbolic links not
/// followed.
pub fn count_tree(root: &Path) -> anyhow::Result<(u64, u64)> {
    let (mut entries, mut bytes) = (0u64, 0u64);
    let mut stack = vec![root.to_path_buf()];
    while let Some(p) = stack.pop() {
        let m = fs::symlink_metadata(&p).with_context(|| format!("stat {}", p.display()))?;
        entries += 1;
        if m.is_file() {
            bytes += m.len();
        } else if m.is_dir() {
            for e in fs::read_dir(&p).with_context(|| format!("read {}", p.display()))? {
                stack.push(e.with_context(|| format!("read {}", p.display()))?.path());
            }
        }
    }
    Ok((entries, bytes))
}

/// Fails unless `diff -r --no-dereference` finds the two trees identical.
fn same_trees(a: &Path, b: &Path) -> anyhow::Result<()> {
    let out = Command::new("diff")
        .args(["-r", "--no-dereference"])
        .arg(a)
        .arg(b)
        .output()
        .context("cannot run diff")?;
    if !out.status.success() {
        let text = String::from_utf8_lossy(&out.stdout);
        let first: Vec<&str> = text.lines().take(10).collect();
        bail!(
            "{} and {} differ (diff -r exit {}):\n{}\n{}",
            a.display(),
            b.display(),
            out.status,
            first.join("\n"),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

/// `files` files of 1 KiB–256 KiB (mostly small, as in a source tree) in directories of 50, with a
/// few symbolic links.
fn generate_tree(root: &Path, files: usize) -> anyhow::Result<()> {
    let mut rng = fastrand::Rng::with_seed(41);
    let mut buf = vec![0u8; 256 << 10];
    rng.fill(&mut buf);
    for i in 0..files {
        let dir = root.join(format!("d{:03}/s{}", i / 50, (i / 10) % 5));
        if i % 10 == 0 {
            fs::create_dir_all(&dir).with_context(|| format!("mkdir {}", dir.display()))?;
        }
        let size = match rng.u32(..100) {
            0..70 => rng.usize(1 << 10..8 << 10),
            70..95 => rng.usize(8 << 10..64 << 10),
            _ => rng.usize(64 << 10..=256 << 10),
        };
        let start = rng.usize(..=buf.len() - size);
        let path = dir.join(format!("f{i}.txt"));
        fs::write(&path, &buf[start..start + size])
            .with_context(|| format!("write {}", path.display()))?;
        if i % 100 == 1 {
            let link = dir.join(format!("l{i}"));
            std::os::unix::fs::symlink(format!("f{i}.txt"), &link)
                .with_context(|| format!("symlink {}", link.display()))?;
        }
    }
    Ok(())
}

fn check_tool(tool: &str, w: Workload) -> anyhow::Result<()> {
    match Command::new(tool).arg("--version").output() {
        Ok(_) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => bail!(
            "workload {w} runs `{tool}`, which is not on PATH: install it or leave {w} out of --workloads"
        ),
        Err(e) => bail!("workload {w}: cannot run `{tool}`: {e}"),
    }
}

/// Runs a command to completion; its stdout, or an error with its stderr.
fn run_tool(cmd: &mut Command) -> anyhow::Result<String> {
    let desc = format!("{cmd:?}");
    let out = cmd.output().with_context(|| format!("cannot run {desc}"))?;
    if !out.status.success() {
        bail!(
            "{desc} failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    String::from_utf8(out.stdout).with_context(|| format!("{desc} printed non-UTF-8 output"))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A repository of `n` commits, each changing a few files.
    fn tiny_repo(dir: &Path, n: usize) -> anyhow::Result<()> {
        let git = |args: &[&str]| {
            run_tool(
                Command::new("git")
                    .arg("-C")
                    .arg(dir)
                    .args(["-c", "user.name=bench", "-c", "user.email=bench@localhost"])
                    .args(args),
            )
        };
        git(&["init", "-q"])?;
        for c in 0..n {
            for f in 0..3 {
                fs::write(
                    dir.join(format!("file{f}")),
                    format!("commit {c} file {f}\n"),
                )?;
            }
            fs::write(dir.join(format!("new{c}")), "x")?;
            git(&["add", "-A"])?;
            git(&["commit", "-q", "-m", &format!("commit {c}")])?;
        }
        Ok(())
    }

    #[test]
    fn every_workload_gives_a_row() -> anyhow::Result<()> {
        let started = Instant::now();
        let target = tempfile::tempdir()?;
        let repo = tempfile::tempdir()?;
        tiny_repo(repo.path(), 4)?;
        let p = Params {
            dir: target.path().to_path_buf(),
            label: "test".into(),
            workloads: Workload::parse_list(&["all".into()])?,
            sizes: vec![1 << 10, 4 << 10],
            files: 5,
            writers: 2,
            parallel_size: 4 << 10,
            tree: TreeSource::Generated { files: 40 },
            storm: 20,
            git_repo: repo.path().to_path_buf(),
            git_back: 200,
            warmup_files: 3,
            sparse_size: 64 << 10,
            overwrites: 8,
        };
        let rows = run(&p, |_| {})?;
        for w in Workload::ALL {
            assert!(
                rows.iter().any(|r| r.workload == w),
                "no row for {w}: {rows:?}"
            );
        }
        assert_eq!(rows.len(), Workload::ALL.len() + 1, "two create sizes");
        let untar = rows
            .iter()
            .find(|r| r.workload == Workload::Untar)
            .map(FsRow::to_json);
        // 40 files, 1 link, the directories d000/s0 … s3, d000 and the root.
        assert_eq!(
            untar.as_ref().and_then(|v| v["entries"].as_u64()),
            Some(40 + 1 + 4 + 1 + 1)
        );
        let checkout = rows.iter().find(|r| r.workload == Workload::GitCheckout);
        // Three commits back: file0..2 and new1..3 change, both ways.
        assert_eq!(checkout.map(|r| r.count), Some(12));
        for r in &rows {
            let v = r.to_json();
            assert_eq!(v["bench"], "fs");
            assert!(
                v[format!("{}_per_s", r.unit)]
                    .as_f64()
                    .is_some_and(|x| x > 0.0)
            );
        }
        assert_eq!(fs::read_dir(target.path())?.count(), 0, "left files behind");
        assert!(started.elapsed().as_secs() < 20);
        Ok(())
    }

    #[test]
    fn workload_lists_parse() {
        let names = |s: &str| s.split(',').map(String::from).collect::<Vec<_>>();
        assert_eq!(
            Workload::parse_list(&names("unlink,create")).ok(),
            Some(vec![Workload::Create, Workload::Unlink])
        );
        assert!(Workload::parse_list(&names("create,bogus")).is_err());
        assert!(Workload::parse_list(&names("")).is_err());
    }
}
