//! Where an append's cached write runs: on the messenger worker that received the packet, or on
//! tokio's blocking pool.
//!
//! A cached `pwrite` of a 128 KiB packet copies it into the page cache (tens of microseconds),
//! while sending it to the blocking pool and back costs two thread hand-offs, each a wake-up of a
//! sleeping thread, often on the other core (DESIGN.md §3: "keep a request on the worker that read
//! it unless its dispatch is heavy"). But a cached write is not always quick: once the system has
//! more dirty pages than the kernel lets it keep, the kernel makes the writer wait for write-back
//! (dirty-page throttling, for seconds when the disk is behind), and on a worker that wait holds up
//! every call the node serves. So the worker writes inline only while that cannot happen:
//!
//! - the system's dirty and under-write-back bytes are below the kernel's background write-back
//!   threshold (`/proc/meminfo` and `/proc/sys/vm/dirty_background_*`, sampled at most every
//!   [`SAMPLE_EVERY`]); the kernel throttles no writer below it (it starts only halfway between it
//!   and the hard limit). Under cgroup v2 the same holds for each memory cgroup above the process
//!   with a memory limit (`memory.stat`, `memory.max`): a container's writers are throttled
//!   against its own limit too. And
//! - no inline write took [`SLOW_WRITE`] or more lately: whatever made one wait (a journal
//!   commit, memory reclaim) sends the next writes to the pool for [`PAUSE`], twice as long each
//!   time a slow write comes soon after the last pause ended (at most [`MAX_PAUSE`]).
//!
//! A system whose figures cannot be read gets every write on the pool, as before this existed.

use std::fmt;
use std::io;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

/// How often the system's dirty bytes are read again (a few microseconds of `/proc` each time).
pub const SAMPLE_EVERY: Duration = Duration::from_millis(50);

/// An inline write this slow sends the next ones to the pool. A 128 KiB copy into the page cache
/// takes well under a millisecond; a write that had to wait for the disk takes far longer.
pub const SLOW_WRITE: Duration = Duration::from_millis(2);

/// How long writes go to the pool after a slow inline write.
pub const PAUSE: Duration = Duration::from_secs(1);

/// The longest pause, after slow writes in a row.
pub const MAX_PAUSE: Duration = Duration::from_secs(64);

/// Dirty page-cache bytes of a writeback domain (the system, or a memory cgroup) and where the
/// kernel begins to write them back.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DirtyState {
    /// Bytes dirty or under write-back (`Dirty` + `Writeback` in `/proc/meminfo`).
    pub dirty: u64,
    /// The background write-back threshold in bytes; below it no writer is throttled.
    pub background: u64,
}

impl DirtyState {
    /// Whether a cached write can run without being throttled.
    pub fn calm(&self) -> bool {
        self.dirty < self.background
    }

    /// Of two domains, the one nearer its threshold (a write is throttled by either).
    pub fn tighter(self, other: DirtyState) -> DirtyState {
        // dirty / background compared without division: a / b > c / d ⇔ a·d > c·b.
        let (a, b) = (u128::from(self.dirty), u128::from(self.background));
        let (c, d) = (u128::from(other.dirty), u128::from(other.background));
        if c * b > a * d { other } else { self }
    }
}

/// Reads the system's [`DirtyState`].
pub trait DirtyProbe: Send + Sync + fmt::Debug {
    fn sample(&self) -> io::Result<DirtyState>;
}

/// [`DirtyProbe`] of the running Linux kernel.
#[derive(Debug, Default)]
pub struct ProcDirty;

impl DirtyProbe for ProcDirty {
    fn sample(&self) -> io::Result<DirtyState> {
        let meminfo = std::fs::read_to_string("/proc/meminfo")?;
        let vm = |name: &str| -> io::Result<u64> {
            let path = format!("/proc/sys/vm/{name}");
            let text = std::fs::read_to_string(&path)?;
            text.trim()
                .parse()
                .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, format!("{path}: {e}")))
        };
        let (bg_bytes, bg_ratio) = (vm("dirty_background_bytes")?, vm("dirty_background_ratio")?);
        let bad = |e: String| io::Error::new(io::ErrorKind::InvalidData, e);
        let mut state = dirty_state(&meminfo, bg_bytes, bg_ratio).map_err(bad)?;
        for dir in limited_cgroups()? {
            let file = |name: &str| std::fs::read_to_string(dir.join(name));
            let (stat, max, current) = (
                file("memory.stat")?,
                file("memory.max")?,
                file("memory.current")?,
            );
            if let Some(m) = memcg_state(&stat, &max, &current, bg_bytes, bg_ratio).map_err(bad)? {
                state = state.tighter(m);
            }
        }
        Ok(state)
    }
}

/// The memory cgroups (v2) of this process and its ancestors that have a memory limit, nearest
/// first; none under cgroup v1 (which throttles writers against the system's figures only) or
/// without a cgroup v2 mount.
fn limited_cgroups() -> io::Result<Vec<std::path::PathBuf>> {
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo")?;
    let cgroup = std::fs::read_to_string("/proc/self/cgroup")?;
    let (Some(root), Some(path)) = (cgroup2_mount(&mountinfo), cgroup2_path(&cgroup)) else {
        return Ok(Vec::new());
    };
    let mut dir = std::path::PathBuf::from(root);
    dir.extend(path.split('/').filter(|c| !c.is_empty()));
    let mut out = Vec::new();
    for d in dir.ancestors() {
        if !d.starts_with(root) {
            break;
        }
        match std::fs::read_to_string(d.join("memory.max")) {
            Ok(max) if max.trim() != "max" => out.push(d.to_path_buf()),
            _ => {}
        }
    }
    Ok(out)
}

/// Where the cgroup v2 hierarchy is mounted, from `/proc/self/mountinfo`.
fn cgroup2_mount(mountinfo: &str) -> Option<&str> {
    mountinfo.lines().find_map(|l| {
        // "id parent major:minor root mount-point options ... - fstype source super-options"
        let (left, right) = l.split_once(" - ")?;
        (right.split_whitespace().next()? == "cgroup2").then_some(())?;
        left.split_whitespace().nth(4)
    })
}

/// This process's cgroup v2 path, from `/proc/self/cgroup` (the `0::` line).
fn cgroup2_path(cgroup: &str) -> Option<&str> {
    cgroup.lines().find_map(|l| l.strip_prefix("0::"))
}

/// The [`DirtyState`] of a memory cgroup from its `memory.stat`, `memory.max` and
/// `memory.current`; `None` without a limit. As the kernel computes a cgroup's writeback domain:
/// the memory its dirty pages may take is its file pages plus its room below the limit, and the
/// threshold the same ratio of it (a byte threshold is used as is: conservative, since the kernel
/// scales it down to the cgroup's share).
pub fn memcg_state(
    stat: &str,
    max: &str,
    current: &str,
    bg_bytes: u64,
    bg_ratio: u64,
) -> Result<Option<DirtyState>, String> {
    let max = max.trim();
    if max == "max" {
        return Ok(None);
    }
    let num = |what: &str, v: &str| -> Result<u64, String> {
        v.trim()
            .parse()
            .map_err(|_| format!("memory cgroup: bad {what}: {v:?}"))
    };
    let (max, current) = (num("memory.max", max)?, num("memory.current", current)?);
    let field = |name: &str| -> Result<u64, String> {
        let v = stat
            .lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(' '))
            .ok_or_else(|| format!("memory.stat has no {name}"))?;
        num(name, v)
    };
    let dirty = field("file_dirty")?.saturating_add(field("file_writeback")?);
    let avail = field("file")?.saturating_add(max.saturating_sub(current));
    let background = if bg_bytes > 0 {
        bg_bytes
    } else {
        avail / 100 * bg_ratio.min(100)
    };
    Ok(Some(DirtyState { dirty, background }))
}

/// The [`DirtyState`] described by `/proc/meminfo`'s text and the `vm.dirty_background_bytes` and
/// `vm.dirty_background_ratio` settings. As the kernel computes it: a byte threshold when one is
/// set, else the ratio (percent) of the memory that may hold dirty pages (free pages and file
/// pages).
pub fn dirty_state(meminfo: &str, bg_bytes: u64, bg_ratio: u64) -> Result<DirtyState, String> {
    let field = |name: &str| -> Result<u64, String> {
        let line = meminfo
            .lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))
            .ok_or_else(|| format!("/proc/meminfo has no {name}"))?;
        let mut words = line.split_whitespace();
        let n: u64 = words
            .next()
            .and_then(|w| w.parse().ok())
            .ok_or_else(|| format!("/proc/meminfo: bad {name}: {line:?}"))?;
        match words.next() {
            Some("kB") => Ok(n.saturating_mul(1024)),
            None => Ok(n),
            Some(unit) => Err(format!("/proc/meminfo: {name} in unknown unit {unit:?}")),
        }
    };
    let dirty = field("Dirty")?.saturating_add(field("Writeback")?);
    let background = if bg_bytes > 0 {
        bg_bytes
    } else {
        let dirtyable = field("MemFree")?
            .saturating_add(field("Active(file)")?)
            .saturating_add(field("Inactive(file)")?);
        dirtyable / 100 * bg_ratio.min(100)
    };
    Ok(DirtyState { dirty, background })
}

/// The decision's state, driven by the caller's clock (time since an origin): pure, so tests
/// drive it step by step.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Gate {
    /// When the dirty state was last sampled.
    sampled_at: Option<Duration>,
    /// The last sample's verdict (false when it could not be read).
    calm: bool,
    /// Writes go to the pool until then (after a slow inline write).
    paused_until: Duration,
    /// The last pause's length (zero before the first).
    pause: Duration,
}

impl Gate {
    /// Whether a cached write may run inline at `now`; `sample` reads the dirty state when the
    /// last reading is older than [`SAMPLE_EVERY`].
    pub fn allows(
        &mut self,
        now: Duration,
        sample: impl FnOnce() -> io::Result<DirtyState>,
    ) -> bool {
        if now < self.paused_until {
            return false;
        }
        if self
            .sampled_at
            .is_none_or(|t| now.saturating_sub(t) >= SAMPLE_EVERY)
        {
            self.sampled_at = Some(now);
            self.calm = sample().is_ok_and(|s| s.calm());
        }
        self.calm
    }

    /// Records an inline write that finished at `now` after `took`; true if it was slow. The
    /// gate then stays shut for [`PAUSE`], or for twice the last pause if this one ended less
    /// than its own length ago (at most [`MAX_PAUSE`]).
    pub fn took(&mut self, now: Duration, took: Duration) -> bool {
        if took < SLOW_WRITE {
            return false;
        }
        if now < self.paused_until {
            // Started before the pause (several writes in flight): the pause covers it.
            return true;
        }
        self.pause = if now < self.paused_until + self.pause {
            (self.pause * 2).min(MAX_PAUSE)
        } else {
            PAUSE
        };
        self.paused_until = now + self.pause;
        true
    }
}

/// A data node's [`Gate`] on the real clock.
#[derive(Debug)]
pub struct InlineWrites {
    /// `None`: every write goes to the pool.
    probe: Option<Arc<dyn DirtyProbe>>,
    origin: Instant,
    gate: Mutex<Gate>,
}

impl InlineWrites {
    pub fn new(probe: Option<Arc<dyn DirtyProbe>>) -> Self {
        Self {
            probe,
            origin: Instant::now(),
            gate: Mutex::new(Gate::default()),
        }
    }

    /// Whether a cached write may run inline now.
    pub fn allows(&self) -> bool {
        let Some(probe) = &self.probe else {
            return false;
        };
        let now = self.origin.elapsed();
        self.gate
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .allows(now, || probe.sample())
    }

    /// Records an inline write that took `took`; true if it was slow.
    pub fn took(&self, took: Duration) -> bool {
        let now = self.origin.elapsed();
        self.gate
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .took(now, took)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MEMINFO: &str = "MemTotal:       24589540 kB\n\
        MemFree:         1000000 kB\n\
        MemAvailable:   20000000 kB\n\
        Active(anon):     100000 kB\n\
        Active(file):    2000000 kB\n\
        Inactive(file):  7000000 kB\n\
        Dirty:             40000 kB\n\
        Writeback:          2000 kB\n\
        HugePages_Total:       0\n";

    #[test]
    fn the_threshold_is_the_ratio_of_dirtyable_memory_unless_bytes_are_set() {
        let s = dirty_state(MEMINFO, 0, 10).unwrap();
        assert_eq!(s.dirty, 42_000 * 1024);
        // 10 % of free + file pages (10,000,000 kB).
        assert_eq!(s.background, 1_000_000 * 1024);
        assert!(s.calm());
        let s = dirty_state(MEMINFO, 4 << 20, 10).unwrap();
        assert_eq!(s.background, 4 << 20);
        assert!(!s.calm(), "42,000 kB dirty is past a 4 MiB threshold");
    }

    #[test]
    fn a_meminfo_without_the_fields_is_an_error() {
        let err = dirty_state("MemTotal: 1 kB\n", 0, 10).unwrap_err();
        assert!(err.contains("Dirty"), "{err}");
        let err = dirty_state(&MEMINFO.replace("40000 kB", "forty kB"), 0, 10).unwrap_err();
        assert!(err.contains("bad Dirty"), "{err}");
        let err = dirty_state(&MEMINFO.replace("40000 kB", "40000 MB"), 0, 10).unwrap_err();
        assert!(err.contains("unknown unit"), "{err}");
    }

    fn state(dirty: u64) -> io::Result<DirtyState> {
        Ok(DirtyState {
            dirty,
            background: 100,
        })
    }

    #[test]
    fn the_gate_follows_the_dirty_bytes_sampled_at_most_every_interval() {
        let mut g = Gate::default();
        let ms = Duration::from_millis;
        assert!(g.allows(ms(0), || state(10)));
        // Not sampled again within the interval: the earlier verdict holds.
        assert!(g.allows(ms(49), || panic!("sampled too soon")));
        assert!(!g.allows(ms(50), || state(100)));
        assert!(!g.allows(ms(60), || panic!("sampled too soon")));
        assert!(g.allows(ms(100), || state(99)));
        // A sample that cannot be read shuts it.
        assert!(!g.allows(ms(150), || Err(io::Error::other("no /proc"))));
    }

    #[test]
    fn a_slow_write_shuts_the_gate_for_the_pause() {
        let mut g = Gate::default();
        let ms = Duration::from_millis;
        assert!(g.allows(ms(0), || state(0)));
        assert!(!g.took(ms(1), SLOW_WRITE - ms(1)));
        assert!(g.allows(ms(2), || state(0)));
        assert!(g.took(ms(10), SLOW_WRITE));
        assert!(!g.allows(ms(10), || state(0)));
        assert!(!g.allows(ms(10) + PAUSE - ms(1), || state(0)));
        assert!(g.allows(ms(10) + PAUSE, || state(0)));
    }

    #[test]
    fn slow_writes_in_a_row_double_the_pause() {
        let mut g = Gate::default();
        let s = Duration::from_secs;
        let ms = Duration::from_millis;
        assert!(g.took(s(0), SLOW_WRITE));
        assert!(!g.allows(ms(999), || state(0)));
        // A write that started before the pause ends during it: no longer pause.
        assert!(g.took(ms(500), SLOW_WRITE));
        assert!(g.allows(s(1), || state(0)));
        // Slow again soon after: twice as long, then four times.
        assert!(g.took(ms(1500), SLOW_WRITE));
        assert!(!g.allows(ms(3499), || state(0)));
        assert!(g.allows(ms(3500), || state(0)));
        assert!(g.took(s(4), SLOW_WRITE));
        assert!(!g.allows(ms(7999), || state(0)));
        // Slow again long after: back to the first pause.
        assert!(g.allows(s(8), || state(0)));
        assert!(g.took(s(20), SLOW_WRITE));
        assert!(!g.allows(ms(20_999), || state(0)));
        assert!(g.allows(s(21), || state(0)));
        // Never longer than the longest.
        let mut g = Gate::default();
        let mut t = s(0);
        for _ in 0..20 {
            assert!(g.took(t, SLOW_WRITE));
            t = g.paused_until;
        }
        assert_eq!(g.pause, MAX_PAUSE);
    }

    #[test]
    fn the_tighter_domain_is_the_one_nearer_its_threshold() {
        let system = DirtyState {
            dirty: 100,
            background: 1000,
        };
        let cgroup = DirtyState {
            dirty: 50,
            background: 60,
        };
        assert_eq!(system.tighter(cgroup), cgroup);
        assert_eq!(cgroup.tighter(system), cgroup);
    }

    const STAT: &str = "anon 1000\nfile 1000000\nkernel 10\nfile_mapped 0\nfile_dirty 5000\n\
        file_writeback 100\nfile_thp 0\n";

    #[test]
    fn a_memory_cgroups_threshold_is_the_ratio_of_its_file_pages_and_room() {
        // File pages 1,000,000 plus 500,000 below the limit: 10 % is 150,000.
        let s = memcg_state(STAT, "2000000\n", "1500000\n", 0, 10)
            .unwrap()
            .unwrap();
        assert_eq!(
            s,
            DirtyState {
                dirty: 5100,
                background: 150_000
            }
        );
        assert!(s.calm());
        // Over its limit: only its file pages count.
        let s = memcg_state(STAT, "1000000", "1200000", 0, 1)
            .unwrap()
            .unwrap();
        assert_eq!(s.background, 10_000);
        let s = memcg_state(STAT, "1000000", "1200000", 4096, 10)
            .unwrap()
            .unwrap();
        assert_eq!(s.background, 4096);
        assert!(!s.calm());
        assert_eq!(memcg_state(STAT, "max\n", "5", 0, 10), Ok(None));
        let err = memcg_state("file 1\n", "10", "5", 0, 10).unwrap_err();
        assert!(err.contains("file_dirty"), "{err}");
        let err = memcg_state(STAT, "lots", "5", 0, 10).unwrap_err();
        assert!(err.contains("memory.max"), "{err}");
    }

    #[test]
    fn the_cgroup_v2_mount_and_path_are_found() {
        let hybrid = "30 25 0:26 / /sys/fs/cgroup rw - tmpfs tmpfs rw,mode=755\n\
            31 30 0:27 / /sys/fs/cgroup/unified rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n\
            32 30 0:28 / /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory\n";
        assert_eq!(cgroup2_mount(hybrid), Some("/sys/fs/cgroup/unified"));
        assert_eq!(
            cgroup2_mount("28 1 0:25 / /sys/fs/cgroup rw shared:4 - cgroup2 cgroup2 rw\n"),
            Some("/sys/fs/cgroup")
        );
        assert_eq!(cgroup2_mount("22 1 8:1 / / rw - ext4 /dev/vda rw\n"), None);
        let cg = "4:memory:/a/b\n0::/kubepods/pod1/c1\n";
        assert_eq!(cgroup2_path(cg), Some("/kubepods/pod1/c1"));
        assert_eq!(cgroup2_path("4:memory:/a\n"), None);
    }

    #[test]
    fn without_a_probe_nothing_runs_inline() {
        assert!(!InlineWrites::new(None).allows());
    }

    #[derive(Debug)]
    struct Fixed(u64);

    impl DirtyProbe for Fixed {
        fn sample(&self) -> io::Result<DirtyState> {
            state(self.0)
        }
    }

    #[test]
    fn the_probe_decides_on_the_real_clock() {
        assert!(InlineWrites::new(Some(Arc::new(Fixed(1)))).allows());
        let busy = InlineWrites::new(Some(Arc::new(Fixed(1000))));
        assert!(!busy.allows());
        assert!(busy.took(SLOW_WRITE));
        assert!(!busy.took(Duration::ZERO));
    }

    #[test]
    fn this_systems_figures_can_be_read() {
        // Linux only: the node runs there.
        let s = ProcDirty.sample().expect("cannot read /proc");
        assert!(s.background > 0, "{s:?}");
    }
}
