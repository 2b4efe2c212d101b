//! What a client knows: its certain files ([`FileModel`]) and, for each operation whose outcome
//! is unknown, the *worlds* it allows ([`World`], [`Expect`]); and the acknowledgement log, one
//! JSON line per acknowledged operation. Invariant: an uncertain path is in exactly one group of
//! worlds and in no certain entry, and is never touched again.

use std::collections::BTreeMap;
use std::io;

use serde::Serialize;

use super::Finding;
use super::content::Content;

#[derive(Clone, Debug, Default)]
pub(super) struct FileModel {
    pub(super) content: Content,
    /// Acknowledged operations on this file (what losing it takes back).
    pub(super) ops: u64,
}

/// What a world allows at one path: content `a`, or with `b` (the outcome of a failed operation)
/// a length between theirs and each byte `a`'s or `b`'s.
#[derive(Clone, Debug)]
pub(super) struct Expect {
    pub(super) a: Content,
    pub(super) b: Option<Content>,
    pub(super) ops: u64,
}

impl Expect {
    pub(super) fn exact(f: &FileModel) -> Self {
        Self {
            a: f.content.clone(),
            b: None,
            ops: f.ops,
        }
    }

    pub(super) fn max_len(&self) -> u64 {
        self.a.len.max(self.b.as_ref().map_or(0, |b| b.len))
    }

    /// Where `data` (of a file whose size says `size`) leaves what this allows: the first bad
    /// offset and how many bytes are bad; `None` if allowed.
    pub(super) fn mismatch(&self, size: u64, data: &[u8]) -> Option<(u64, u64)> {
        let a = self.a.bytes();
        let b = self.b.as_ref().map(Content::bytes);
        let b_len = b.as_ref().map_or(a.len(), Vec::len) as u64;
        let lo = (a.len() as u64).min(b_len);
        let mut first: Option<u64> = None;
        let mut bad = 0u64;
        // Block by block: equal blocks (the common case) cost a memcmp.
        const BLOCK: usize = 4096;
        let same = |x: &[u8], at: usize, blk: &[u8]| x.get(at..at + blk.len()) == Some(blk);
        for (k, blk) in data.chunks(BLOCK).enumerate() {
            let at = k * BLOCK;
            if same(&a, at, blk) || b.as_ref().is_some_and(|b| same(b, at, blk)) {
                continue;
            }
            for (i, c) in (at..).zip(blk) {
                if a.get(i) != Some(c) && b.as_ref().and_then(|b| b.get(i)) != Some(c) {
                    first.get_or_insert(i as u64);
                    bad += 1;
                }
            }
        }
        let n = data.len() as u64;
        let mut flag = |at: u64, count: u64| {
            first = Some(first.map_or(at, |f| f.min(at)));
            bad += count;
        };
        if n < lo {
            flag(n, lo - n);
        }
        // A size the bytes read do not bear out (a short read, or a size past what was read).
        if size != n {
            flag(size.min(n), size.abs_diff(n));
        }
        first.map(|f| (f, bad))
    }
}

/// One allowed outcome of an operation: the state of each of its paths (`None`: absent).
#[derive(Clone, Debug)]
pub(super) struct World {
    pub(super) paths: Vec<(String, Option<Expect>)>,
    /// Allowed, but worth reporting when it is what happened.
    pub(super) note: Option<Finding>,
    /// The failed operation was applied in this world: reported (as the finding) when no world
    /// in which it was not applied allows what is there.
    pub(super) applied: Option<Finding>,
}

impl World {
    pub(super) fn at(path: &str, e: Option<Expect>) -> Self {
        Self {
            paths: vec![(path.to_string(), e)],
            note: None,
            applied: None,
        }
    }

    pub(super) fn two(p: &str, e: Option<Expect>, q: &str, f: Option<Expect>) -> Self {
        Self {
            paths: vec![(p.to_string(), e), (q.to_string(), f)],
            note: None,
            applied: None,
        }
    }

    /// This world, as the one where the failed operation was applied.
    pub(super) fn applied(mut self, failure: &Option<Finding>) -> Self {
        self.applied.clone_from(failure);
        self
    }

    pub(super) fn expect(&self, path: &str) -> Option<&Expect> {
        self.paths
            .iter()
            .find(|(p, _)| p == path)
            .and_then(|(_, e)| e.as_ref())
    }
}

/// One client's knowledge. Paths are relative to the client's directory (`a/f12`).
#[derive(Clone, Debug, Default)]
pub(super) struct ClientModel {
    /// Files whose state is certain.
    pub(super) files: BTreeMap<String, FileModel>,
    /// For each failed operation, its worlds; their paths are in no other entry.
    pub(super) uncertain: Vec<Vec<World>>,
    pub(super) next_name: u64,
}

#[derive(Debug)]
pub(super) struct AckLog {
    pub(super) out: io::BufWriter<std::fs::File>,
    pub(super) lines: u64,
    /// The first write error (the log stops there; `flush_log` reports it).
    pub(super) error: Option<io::Error>,
}

#[derive(Serialize)]
pub(super) struct AckLine<'a> {
    pub(super) t_ms: u64,
    pub(super) client: usize,
    pub(super) op: &'a str,
    pub(super) path: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) from: Option<&'a str>,
    pub(super) offset: Option<u64>,
    pub(super) len: Option<u64>,
    pub(super) size: Option<u64>,
    pub(super) crc32c: Option<u32>,
}
