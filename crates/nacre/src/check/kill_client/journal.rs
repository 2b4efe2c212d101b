//! The killed client's journal: one line per record, written by the client process with one
//! `write(2)` each (the process dies, not the machine, so what it wrote is in the file). Before a
//! call it writes what it is about to do (`start`), after the call returned what it did
//! (`done`), and when a call failed, `fail` (the incarnation then ends):
//!
//! ```text
//! journal 1 inc 3
//! start write 12 1 5000     file f12, version 1 (a create), 5,000 bytes
//! done write 12 1 5000      created, written and closed
//! start write 7 3 100       f7 opened with O_TRUNC and written: its version 3
//! start fsync 12
//! done fsync 12             f12's current version is durable
//! start unlink 7
//! start sync
//! done sync                 fsync of the directory: everything before is durable
//! fail sync: timed out
//! ```
//!
//! A last line without its newline was cut by the kill and is ignored.

use std::fmt;
use std::io::{self, Write as _};
use std::path::Path;

/// Version of the journal's format (its first line).
const FORMAT: u32 = 1;

/// One call of the client.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    /// File `file` opened (created for version 1, else opened with `O_TRUNC`), `len` bytes of
    /// its version `version` written, then closed.
    Write {
        file: u32,
        version: u32,
        len: u64,
    },
    Unlink {
        file: u32,
    },
    /// `fsync` of the file: its current version.
    Fsync {
        file: u32,
    },
    /// `fsync` of the client's directory: everything before it.
    Sync,
}

/// One line of the journal.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Record {
    /// The first line: the format and the incarnation.
    Header { inc: u32 },
    /// The client is about to call.
    Start(Op),
    /// The call returned Ok.
    Done(Op),
    /// The call in progress failed; nothing follows.
    Fail(String),
}

impl fmt::Display for Op {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Write { file, version, len } => write!(f, "write {file} {version} {len}"),
            Self::Unlink { file } => write!(f, "unlink {file}"),
            Self::Fsync { file } => write!(f, "fsync {file}"),
            Self::Sync => write!(f, "sync"),
        }
    }
}

impl fmt::Display for Record {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Header { inc } => write!(f, "journal {FORMAT} inc {inc}"),
            Self::Start(op) => write!(f, "start {op}"),
            Self::Done(op) => write!(f, "done {op}"),
            // One line, whatever the error says.
            Self::Fail(why) => write!(f, "fail {}", why.replace('\n', " ")),
        }
    }
}

impl Op {
    /// The file the call is about (`None`: the directory).
    pub fn file(&self) -> Option<u32> {
        match *self {
            Self::Write { file, .. } | Self::Unlink { file } | Self::Fsync { file } => Some(file),
            Self::Sync => None,
        }
    }
}

/// Why a journal could not be read.
#[derive(Debug, thiserror::Error)]
pub enum JournalError {
    #[error("cannot read the journal: {0}")]
    Io(#[from] io::Error),
    #[error("journal line {line}: cannot parse {text:?}")]
    Bad { line: usize, text: String },
    #[error("journal line {line}: {why}")]
    Inconsistent { line: usize, why: String },
}

/// Appends records to a journal file.
#[derive(Debug)]
pub struct Writer {
    out: std::fs::File,
}

impl Writer {
    /// Creates (truncates) the journal at `path`.
    pub fn create(path: &Path) -> io::Result<Self> {
        Ok(Self {
            out: std::fs::File::create(path)?,
        })
    }

    /// Writes one record with one `write(2)`: a kill leaves whole lines and at most one cut
    /// last line.
    pub fn put(&mut self, r: &Record) -> io::Result<()> {
        let line = format!("{r}\n");
        self.out.write_all(line.as_bytes())?;
        self.out.flush()
    }
}

fn parse_op(words: &[&str]) -> Option<Op> {
    let num = |i: usize| words.get(i).and_then(|w| w.parse::<u64>().ok());
    let small = |i: usize| num(i).and_then(|n| u32::try_from(n).ok());
    let op = match *words.first()? {
        "write" if words.len() == 4 => Op::Write {
            file: small(1)?,
            version: small(2)?,
            len: num(3)?,
        },
        "unlink" if words.len() == 2 => Op::Unlink { file: small(1)? },
        "fsync" if words.len() == 2 => Op::Fsync { file: small(1)? },
        "sync" if words.len() == 1 => Op::Sync,
        _ => return None,
    };
    Some(op)
}

fn parse_line(text: &str) -> Option<Record> {
    if let Some(why) = text.strip_prefix("fail ") {
        return Some(Record::Fail(why.to_string()));
    }
    let words: Vec<&str> = text.split_ascii_whitespace().collect();
    match words.split_first()? {
        (&"journal", [format, "inc", inc]) if format.parse() == Ok(FORMAT) => {
            Some(Record::Header {
                inc: inc.parse().ok()?,
            })
        }
        (&"start", rest) => parse_op(rest).map(Record::Start),
        (&"done", rest) => parse_op(rest).map(Record::Done),
        _ => None,
    }
}

/// The records of a journal's text, with their line numbers (from 1). The last line is ignored
/// when it has no newline (cut by the kill).
pub fn parse(text: &str) -> Result<Vec<(usize, Record)>, JournalError> {
    let whole = match text.rfind('\n') {
        Some(i) => &text[..=i],
        None => "",
    };
    whole
        .lines()
        .enumerate()
        .map(|(i, l)| {
            parse_line(l).map(|r| (i + 1, r)).ok_or(JournalError::Bad {
                line: i + 1,
                text: l.to_string(),
            })
        })
        .collect()
}
