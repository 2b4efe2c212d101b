//! Reads a killed client's directory back through a fresh client and judges every file against
//! what the incarnation's journal allows ([`judge`]).

use std::collections::BTreeMap;

use nacre_client::FileSystem;
use nacre_types::{Ino, crc32c};
use serde::Serialize;

use super::content::RECORD;
use super::judge::{Expectations, History, Outcome, Seen, State, Violation, What, judge};
use crate::check::workload::{list_all, not_found, read_file, resolve, retry, timed};

/// How many files were found in each allowed state.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Outcomes {
    /// As the last covering fsync or sync left them, nothing started since.
    pub synced: u64,
    /// As the last call started left them.
    pub newest: u64,
    /// In an earlier allowed state: unsynced changes lost with the client.
    pub lost: u64,
    /// Empty, where a version written since the last cover has bytes.
    pub empty: u64,
    /// A strict, non-empty prefix of a version written since the last cover.
    pub partial: u64,
}

impl Outcomes {
    fn count(&mut self, o: Outcome) {
        *match o {
            Outcome::Synced => &mut self.synced,
            Outcome::Newest => &mut self.newest,
            Outcome::Lost => &mut self.lost,
            Outcome::Empty => &mut self.empty,
            Outcome::Partial => &mut self.partial,
        } += 1;
    }

    pub fn add(&mut self, o: &Self) {
        self.synced += o.synced;
        self.newest += o.newest;
        self.lost += o.lost;
        self.empty += o.empty;
        self.partial += o.partial;
    }
}

/// What one file looked like: absent, or its size and CRC-32C (to tell whether it changed
/// between two checks).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Digest {
    Absent,
    File { size: u64, crc: u32 },
}

impl std::fmt::Display for Digest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Absent => write!(f, "absent"),
            Self::File { size, crc } => write!(f, "{size} bytes (crc32c {crc:08x})"),
        }
    }
}

/// The result of checking one incarnation's directory.
#[derive(Clone, Debug, Default)]
pub struct Checked {
    pub outcomes: Outcomes,
    pub violations: Vec<Violation>,
    /// Paths that could not be read (after retries), with the error.
    pub unreadable: Vec<(String, String)>,
    pub files_read: u64,
    pub bytes_read: u64,
    /// What each file of the journal looked like (files that could be read).
    pub seen: BTreeMap<u32, Digest>,
}

/// The file number of a name the client makes (`f12`).
fn file_of(name: &[u8]) -> Option<u32> {
    let digits = name.strip_prefix(b"f")?;
    if digits.is_empty() || digits.len() > 9 || !digits.iter().all(u8::is_ascii_digit) {
        return None;
    }
    std::str::from_utf8(digits).ok()?.parse().ok()
}

/// The most bytes any allowed state of `h` has, and a record more: a longer file shows whose
/// bytes follow.
fn cap(h: &History) -> u64 {
    let fixed = match h.fixed {
        State::Version { len, .. } => len,
        State::Absent => 0,
    };
    let since = h.since.iter().map(|&(_, len)| len).max().unwrap_or(0);
    fixed.max(since) + RECORD
}

/// Checks directory `names` (volume path components; shown as `base`) against `exp`.
pub async fn check_dir<F: FileSystem + Sync>(
    fs: &F,
    base: &str,
    names: &[String],
    exp: &Expectations,
) -> Checked {
    let mut out = Checked::default();
    let listed = retry(|| async move {
        let d = resolve(fs, names).await?;
        list_all(fs, d.ino).await
    })
    .await;
    // Name → (inode, size) of what is there.
    let mut present: BTreeMap<Vec<u8>, (Ino, u64)> = BTreeMap::new();
    match listed {
        Ok(entries) => {
            for e in entries {
                let size = e.attr.map_or(0, |a| a.size);
                present.insert(e.entry.name, (e.entry.ino, size));
            }
        }
        // The client died before it made its directory: nothing may be there.
        Err(e) if not_found(&e) => {}
        Err(e) => {
            out.unreadable.push((base.to_string(), e.to_string()));
            return out;
        }
    }
    for (&file, h) in &exp.files {
        let name = format!("f{file}");
        let path = format!("{base}/{name}");
        let seen = match present.remove(name.as_bytes()) {
            None => Seen::Absent,
            Some((ino, _)) => {
                let cap = cap(h);
                let read = retry(move || async move {
                    let attr = timed(fs.getattr(ino)).await?;
                    Ok((attr.size, read_file(fs, ino, cap).await?))
                })
                .await;
                match read {
                    Ok((size, data)) => {
                        out.files_read += 1;
                        out.bytes_read += data.len() as u64;
                        Seen::File { size, data }
                    }
                    Err(e) => {
                        out.unreadable.push((path, e.to_string()));
                        continue;
                    }
                }
            }
        };
        out.seen.insert(
            file,
            match &seen {
                Seen::Absent => Digest::Absent,
                Seen::File { size, data } => Digest::File {
                    size: *size,
                    crc: crc32c(data),
                },
            },
        );
        match judge(exp.inc, file, h, &path, &seen) {
            Ok(o) => out.outcomes.count(o),
            Err(v) => out.violations.push(v),
        }
    }
    for (name, (_, size)) in present {
        let path = format!("{base}/{}", String::from_utf8_lossy(&name));
        let detail = match file_of(&name) {
            Some(f) => format!("{size} bytes; f{f} is not in the journal"),
            None => format!("{size} bytes; the client makes no such name"),
        };
        out.violations.push(Violation {
            path,
            what: What::Unexpected,
            offset: None,
            detail,
        });
    }
    out
}
