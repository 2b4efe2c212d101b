//! What a killed client's files may hold, from its journal ([`Expectations`]), and the judgement
//! of what a fresh client reads back ([`judge`]).
//!
//! For each file the journal gives the state the last *covering* call made durable — a `done
//! fsync` of the file (its current version) or a `done sync` (every file's state then) — and
//! what was started on it since, up to the call in progress when the client died:
//!
//! - nothing since: exactly the fixed state (a version, or absent after an unlink; absent also
//!   when no call ever covered it and nothing was started, which does not happen for a file in
//!   the journal);
//! - something since: the fixed state (absent when never covered), or absent if an unlink was
//!   started since, or any prefix, the empty one included, of a version whose write was started
//!   since.
//!
//! Anything else is a [`Violation`], classified by what the bytes are where they leave every
//! allowed state (the records of `content` say whose they are).

use std::collections::BTreeMap;

use serde::Serialize;

use super::content::{self, Found, RECORD, VersionId};

/// The longest version a journal may name: the checker holds versions in memory (the client
/// writes at most 256 KiB).
pub const MAX_LEN: u64 = 16 << 20;
use super::journal::{JournalError, Op, Record};

/// A file's state.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum State {
    Absent,
    Version { version: u32, len: u64 },
}

/// One file's history in the journal, as far as the checker needs it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct History {
    /// What the last covering fsync or sync made durable (absent before any).
    pub fixed: State,
    /// Whether a covering call ever returned for it.
    pub covered: bool,
    /// Versions (number, length) whose write started since the fix.
    pub since: Vec<(u32, u64)>,
    /// An unlink started since the fix.
    pub unlinked_since: bool,
    /// The state after the last call started on the file.
    pub current: State,
}

impl History {
    /// Whether anything was started on the file since the last covering call.
    pub fn touched(&self) -> bool {
        self.unlinked_since || !self.since.is_empty()
    }
}

/// What the journal says, in counts.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct JournalStats {
    pub started: u64,
    /// Calls that returned Ok.
    pub done: u64,
    pub writes: u64,
    pub bytes_written: u64,
    pub unlinks: u64,
    pub fsyncs: u64,
    pub syncs: u64,
}

/// Everything the checker needs from one incarnation's journal.
#[derive(Clone, Debug)]
pub struct Expectations {
    pub inc: u32,
    pub files: BTreeMap<u32, History>,
    pub stats: JournalStats,
    /// The error of the call that ended the incarnation, if one did.
    pub failed: Option<String>,
}

impl Expectations {
    /// Replays the records of one journal. Refuses a journal that contradicts itself (a `done`
    /// for a call not in progress, a version out of order, a call on a file that is absent): the
    /// client or the journal is broken, and nothing could be concluded.
    pub fn from_records(records: &[(usize, Record)]) -> Result<Self, JournalError> {
        let bad = |line: usize, why: String| JournalError::Inconsistent { line, why };
        let mut it = records.iter();
        let inc = match it.next() {
            Some((_, Record::Header { inc })) => *inc,
            Some((line, r)) => return Err(bad(*line, format!("{r} before the header"))),
            None => return Err(bad(0, "no header".into())),
        };
        let mut e = Self {
            inc,
            files: BTreeMap::new(),
            stats: JournalStats::default(),
            failed: None,
        };
        // Calls in progress: a write's fsync is inside the write.
        let mut open: Vec<Op> = Vec::new();
        for (line, r) in it {
            let line = *line;
            if e.failed.is_some() {
                return Err(bad(line, format!("{r} after a failure")));
            }
            match r {
                Record::Header { .. } => return Err(bad(line, "a second header".into())),
                Record::Fail(why) => e.failed = Some(why.clone()),
                Record::Start(op) => {
                    e.start(op).map_err(|why| bad(line, why))?;
                    open.push(*op);
                }
                Record::Done(op) => {
                    if open.pop() != Some(*op) {
                        return Err(bad(line, format!("done {op} is not the call in progress")));
                    }
                    e.done(op).map_err(|why| bad(line, why))?;
                }
            }
        }
        Ok(e)
    }

    fn start(&mut self, op: &Op) -> Result<(), String> {
        self.stats.started += 1;
        match *op {
            Op::Write { file, version, len } => {
                if len > MAX_LEN {
                    return Err(format!(
                        "f{file} v{version} has {len} bytes (at most {MAX_LEN})"
                    ));
                }
                self.stats.writes += 1;
                self.stats.bytes_written += len;
                let h = match self.files.get_mut(&file) {
                    None if version == 1 => self.files.entry(file).or_insert(History {
                        fixed: State::Absent,
                        covered: false,
                        since: Vec::new(),
                        unlinked_since: false,
                        current: State::Absent,
                    }),
                    None => return Err(format!("f{file} starts at version {version}")),
                    Some(h) => match h.current {
                        State::Version { version: v, .. } if version == v + 1 => h,
                        _ => return Err(format!("f{file} v{version} does not follow {h:?}")),
                    },
                };
                h.since.push((version, len));
                h.current = State::Version { version, len };
            }
            Op::Unlink { file } => {
                self.stats.unlinks += 1;
                let h = self.existing(file)?;
                h.unlinked_since = true;
                h.current = State::Absent;
            }
            Op::Fsync { file } => {
                self.existing(file)?;
            }
            Op::Sync => {}
        }
        Ok(())
    }

    fn existing(&mut self, file: u32) -> Result<&mut History, String> {
        match self.files.get_mut(&file) {
            Some(h) if h.current != State::Absent => Ok(h),
            _ => Err(format!("f{file} does not exist")),
        }
    }

    fn done(&mut self, op: &Op) -> Result<(), String> {
        self.stats.done += 1;
        let fix = |h: &mut History| {
            h.fixed = h.current;
            h.covered = true;
            h.since.clear();
            h.unlinked_since = false;
        };
        match *op {
            Op::Fsync { file } => {
                self.stats.fsyncs += 1;
                fix(self.existing(file)?);
            }
            Op::Sync => {
                self.stats.syncs += 1;
                self.files.values_mut().for_each(fix);
            }
            Op::Write { .. } | Op::Unlink { .. } => {}
        }
        Ok(())
    }
}

/// What the checker read at a file's name.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Seen {
    Absent,
    /// `size` from its attributes, `data` read until a short read.
    File {
        size: u64,
        data: Vec<u8>,
    },
}

/// An allowed state, and which one.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    /// Nothing since the last covering call, and exactly what it fixed.
    Synced,
    /// The state of the last call started (its version whole, or absent after an unlink).
    Newest,
    /// An earlier allowed state: changes no fsync covered were lost.
    Lost,
    /// Empty, where a version written since has bytes (its name made, its data not).
    Empty,
    /// A strict, non-empty prefix of a version written since.
    Partial,
}

/// How a file breaks what its journal allows.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum What {
    /// A synced file (or a version fsynced) is not there.
    SyncedLost,
    /// Fewer bytes than the synced version has.
    Short,
    /// Bytes of another version of this file (an older synced one, a removed one's tail).
    Stale,
    /// Bytes of another file (one sharing an extent, say) or of another incarnation.
    Foreign,
    /// Bytes of this version at the wrong offset.
    Misplaced,
    /// Zeros, or bytes that are no record at all: never written by anyone.
    NeverWritten,
    /// The size differs from the bytes a read returns.
    SizeMismatch,
    /// A file whose unlink was synced is back.
    Resurrected,
    /// A name the journal never wrote.
    Unexpected,
    /// Could not be read at the final check.
    Unreadable,
}

impl What {
    /// Whether the violation takes back something an fsync or sync acknowledged.
    pub fn loses_synced(self) -> bool {
        matches!(self, Self::SyncedLost | Self::Short | Self::Stale)
    }
}

/// A file of a killed client's incarnation that holds none of the states its journal allows.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Violation {
    pub path: String,
    pub what: What,
    /// The first offset where the bytes leave every allowed state.
    pub offset: Option<u64>,
    pub detail: String,
}

impl std::fmt::Display for Violation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let what = serde_json::to_value(self.what)
            .ok()
            .and_then(|v| v.as_str().map(str::to_string))
            .unwrap_or_default();
        write!(f, "after a client kill: {}: {what}", self.path)?;
        if let Some(o) = self.offset {
            write!(f, " at offset {o}")?;
        }
        write!(f, ": {}", self.detail)
    }
}

fn describe(s: State) -> String {
    match s {
        State::Absent => "absent".into(),
        State::Version { version, len } => format!("v{version} ({len} bytes)"),
    }
}

/// Judges what was read at file `file`'s name against its history: which allowed state it is,
/// or how it is none.
pub fn judge(
    inc: u32,
    file: u32,
    h: &History,
    path: &str,
    seen: &Seen,
) -> Result<Outcome, Violation> {
    let violation = |what, offset, detail| Violation {
        path: path.to_string(),
        what,
        offset,
        detail,
    };
    let touched = h.touched();
    let (size, data) = match seen {
        Seen::Absent => {
            return if !touched && h.fixed == State::Absent {
                Ok(Outcome::Synced)
            } else if touched && h.current == State::Absent {
                Ok(Outcome::Newest)
            } else if touched && (h.fixed == State::Absent || h.unlinked_since) {
                Ok(Outcome::Lost)
            } else {
                Err(violation(
                    What::SyncedLost,
                    None,
                    format!("absent; {} was synced", describe(h.fixed)),
                ))
            };
        }
        Seen::File { size, data } => (*size, data.as_slice()),
    };
    let id = |version| VersionId { inc, file, version };
    let is = |version, from: u64, len: u64| content::bytes(id(version), from, len) == data;
    let n = data.len() as u64;
    let mut outcome = None;
    if let State::Version { version, len } = h.fixed
        && n == len
        && is(version, 0, len)
    {
        outcome = Some(if touched {
            Outcome::Lost
        } else {
            Outcome::Synced
        });
    }
    if outcome.is_none() {
        outcome = h
            .since
            .iter()
            .rev()
            .find(|&&(v, len)| n <= len && is(v, 0, n))
            .map(|&(v, len)| match h.current {
                _ if n == 0 && len > 0 => Outcome::Empty,
                _ if n < len => Outcome::Partial,
                State::Version { version, .. } if version == v => Outcome::Newest,
                _ => Outcome::Lost,
            });
    }
    if let Some(o) = outcome {
        return if size == n {
            Ok(o)
        } else {
            Err(violation(
                What::SizeMismatch,
                Some(size.min(n)),
                format!("size {size}, but {n} bytes read; they are an allowed state"),
            ))
        };
    }
    if !touched && h.fixed == State::Absent {
        return Err(violation(
            What::Resurrected,
            None,
            format!("{n} bytes; its unlink was synced"),
        ));
    }
    // The candidate closest to what was read: the one it agrees with longest.
    let mut candidates: Vec<(u32, u64)> = h.since.clone();
    if let State::Version { version, len } = h.fixed {
        candidates.push((version, len));
    }
    let agree = |v: u32, len: u64| -> u64 {
        let want = content::bytes(id(v), 0, len.min(n));
        want.iter().zip(data).take_while(|(a, b)| a == b).count() as u64
    };
    let Some((v, len, p)) = candidates
        .iter()
        .map(|&(v, len)| (v, len, agree(v, len)))
        .max_by_key(|c| c.2)
    else {
        return Err(violation(
            What::Unexpected,
            Some(0),
            "no state allows it".into(),
        ));
    };
    let allowed = allowed(h);
    if p == n {
        // What was read is a prefix of the candidate, only a prefix is not allowed: the fixed
        // version cut short.
        return Err(violation(
            What::Short,
            Some(n),
            format!("{n} bytes of v{v} ({len} bytes); allowed: {allowed}"),
        ));
    }
    // A record from elsewhere is reported from its start (its first bytes may agree by chance).
    let record = p - p % RECORD;
    let (what, whose, at) = match content::identify(data, p) {
        Found::Zeros => (What::NeverWritten, "zeros".to_string(), p),
        Found::Unknown => (
            What::NeverWritten,
            "bytes that are no record".to_string(),
            p,
        ),
        Found::Record { id: other, off } if other.inc != inc || other.file != file => (
            What::Foreign,
            format!("bytes of {other} offset {off}"),
            record,
        ),
        Found::Record { id: other, off } if off != record => (
            What::Misplaced,
            format!("bytes of {other} offset {off}"),
            record,
        ),
        Found::Record { id: other, .. } if other.version != v => {
            (What::Stale, format!("bytes of {other}"), record)
        }
        Found::Record { id: other, off } => (
            What::Misplaced,
            format!("bytes of {other} offset {off}, past its length {len}"),
            record,
        ),
    };
    Err(violation(
        what,
        Some(at),
        format!("{whose} ({n} bytes read, closest to v{v} of {len} bytes); allowed: {allowed}"),
    ))
}

/// The allowed states, for a report.
pub fn allowed(h: &History) -> String {
    let mut out = vec![describe(h.fixed)];
    if h.touched() {
        if h.unlinked_since && h.fixed != State::Absent {
            out.push("absent".into());
        }
        out.extend(
            h.since
                .iter()
                .map(|(v, len)| format!("a prefix of v{v} ({len} bytes)")),
        );
    }
    out.join(" or ")
}
