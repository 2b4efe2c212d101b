//! The checker: after the run, reads every client's directories back (with retries, since faults
//! may still be healing) and judges each file against the model: a certain file must match
//! exactly, an uncertain one must match one of its worlds; anything else is a finding.

use std::collections::BTreeMap;
use std::future::Future;

use nacre_api::meta::{Attr, ROOT_INO};
use nacre_client::{DirEntryPlus, FileSystem, FsResult};
use nacre_types::Ino;

use super::model::{ClientModel, Expect, World};
use super::{
    Finding, PAGE, Report, SUBDIRS, VERIFY_GAP, VERIFY_TRIES, not_found, read_file, timed, unknown,
};

/// What the checker found at a path.
#[derive(Debug)]
pub(super) enum Seen {
    Absent,
    File { size: u64, data: Vec<u8> },
}

/// Why `seen` is not what `want` allows (`None`: absent); `None` if it is.
pub(super) fn judge(path: &str, want: Option<&Expect>, seen: &Seen) -> Option<Finding> {
    let path = path.to_string();
    match (want, seen) {
        (None, Seen::Absent) => None,
        (None, Seen::File { size, .. }) => Some(Finding::Unexpected { path, size: *size }),
        (Some(w), Seen::Absent) => Some(Finding::Missing {
            path,
            acked_size: w.a.len,
        }),
        (Some(w), Seen::File { size, data }) => {
            w.mismatch(*size, data)
                .map(|(offset, differing_bytes)| Finding::Wrong {
                    path,
                    offset,
                    differing_bytes,
                    expected_size: w.a.len,
                    actual_size: *size,
                })
        }
    }
}

/// Retries transient errors; "not found" is an answer.
pub(in crate::check) async fn retry<T, Fut: Future<Output = FsResult<T>>>(
    mut f: impl FnMut() -> Fut,
) -> FsResult<T> {
    let mut last = unknown("not tried");
    for i in 0..VERIFY_TRIES {
        if i > 0 {
            tokio::time::sleep(VERIFY_GAP).await;
        }
        match f().await {
            Ok(v) => return Ok(v),
            Err(e) if not_found(&e) => return Err(e),
            Err(e) => last = e,
        }
    }
    Err(last)
}

pub(in crate::check) async fn resolve<F: FileSystem>(fs: &F, names: &[String]) -> FsResult<Attr> {
    let mut cur = timed(fs.getattr(ROOT_INO)).await?;
    for n in names {
        cur = timed(fs.lookup(cur.ino, n.as_bytes())).await?;
    }
    Ok(cur)
}

pub(in crate::check) async fn list_all<F: FileSystem>(
    fs: &F,
    dir: Ino,
) -> FsResult<Vec<DirEntryPlus>> {
    let mut all: Vec<DirEntryPlus> = Vec::new();
    loop {
        let after = all.last().map(|e| e.entry.name.clone());
        let page = timed(fs.readdir(dir, after, PAGE)).await?;
        let done = page.len() < PAGE as usize;
        all.extend(page);
        if done {
            return Ok(all);
        }
    }
}

pub(super) struct Check<'f, F> {
    pub(super) fs: &'f F,
    pub(super) report: Report,
    /// Full path → ops lost with it.
    pub(super) lost: BTreeMap<String, u64>,
}

impl<F: FileSystem + Sync> Check<'_, F> {
    pub(super) fn push(&mut self, f: Finding, ops: u64) {
        if let Finding::Missing { path, .. } | Finding::Wrong { path, .. } = &f {
            self.lost.insert(path.clone(), 1 + ops);
        }
        self.report.findings.push(f);
    }

    pub(super) async fn client(&mut self, base: &str, dir: &[String], model: ClientModel) {
        let fs = self.fs;
        // What is there: relative path → (inode, size).
        let mut present: BTreeMap<String, (Ino, u64)> = BTreeMap::new();
        let mut blind: Vec<String> = Vec::new();
        for sub in SUBDIRS {
            let mut names = dir.to_vec();
            names.push(sub.to_string());
            let names = &names;
            let listed = retry(move || async move {
                let d = resolve(fs, names).await?;
                list_all(fs, d.ino).await
            });
            match listed.await {
                Ok(entries) => {
                    for e in entries {
                        let name = String::from_utf8_lossy(&e.entry.name);
                        let size = e.attr.map_or(0, |a| a.size);
                        present.insert(format!("{sub}/{name}"), (e.entry.ino, size));
                    }
                }
                // Never made (the client gave up): nothing is there.
                Err(e) if not_found(&e) => {}
                Err(e) => {
                    blind.push(format!("{sub}/"));
                    let path = format!("{base}/{sub}");
                    self.push(
                        Finding::Unreadable {
                            path,
                            error: e.to_string(),
                        },
                        0,
                    );
                }
            }
        }
        let mut groups: Vec<Vec<World>> = model
            .files
            .iter()
            .map(|(p, f)| vec![World::at(p, Some(Expect::exact(f)))])
            .collect();
        groups.extend(model.uncertain);
        'groups: for worlds in groups {
            let mut paths: Vec<String> = worlds
                .iter()
                .flat_map(|w| w.paths.iter().map(|(p, _)| p.clone()))
                .collect();
            paths.sort();
            paths.dedup();
            // Taken out of `present` first: what is left at the end is unexpected.
            let found: Vec<_> = paths.into_iter().map(|p| (present.remove(&p), p)).collect();
            if found
                .iter()
                .any(|(_, p)| blind.iter().any(|b| p.starts_with(b)))
            {
                continue;
            }
            let mut seen = BTreeMap::new();
            for (there, p) in found {
                let Some((ino, _)) = there else {
                    seen.insert(p, Seen::Absent);
                    continue;
                };
                let cap = worlds
                    .iter()
                    .filter_map(|w| w.expect(&p))
                    .map(Expect::max_len)
                    .max()
                    .unwrap_or(0)
                    + 1;
                let read = retry(move || async move {
                    let attr = timed(fs.getattr(ino)).await?;
                    Ok((attr.size, read_file(fs, ino, cap).await?))
                });
                match read.await {
                    Ok((size, data)) => {
                        self.report.files_checked += 1;
                        self.report.bytes_checked += data.len() as u64;
                        seen.insert(p, Seen::File { size, data });
                    }
                    Err(e) => {
                        let path = format!("{base}/{p}");
                        self.push(
                            Finding::Unreadable {
                                path,
                                error: e.to_string(),
                            },
                            0,
                        );
                        continue 'groups;
                    }
                }
            }
            self.judge_group(base, &worlds, &seen);
        }
        for (p, (_, size)) in present {
            let path = format!("{base}/{p}");
            self.push(Finding::Unexpected { path, size }, 0);
        }
    }

    /// Accepts `seen` if some world allows it (reporting a failed operation that only worlds
    /// where it applied allow); else reports the world it is closest to.
    fn judge_group(&mut self, base: &str, worlds: &[World], seen: &BTreeMap<String, Seen>) {
        let allows = |w: &World| {
            seen.iter()
                .all(|(p, s)| judge(&format!("{base}/{p}"), w.expect(p), s).is_none())
        };
        let allowing: Vec<&World> = worlds.iter().filter(|w| allows(w)).collect();
        if let Some(first) = allowing.first() {
            if let Some(n) = &first.note {
                self.push(n.clone(), 0);
            }
            if let Some(applied) = allowing
                .iter()
                .map(|w| w.applied.as_ref())
                .collect::<Option<Vec<_>>>()
                .and_then(|a| a.first().copied())
            {
                self.push(applied.clone(), 0);
            }
            return;
        }
        let mut best: Option<Vec<(Finding, u64)>> = None;
        for w in worlds {
            let misses: Vec<(Finding, u64)> = seen
                .iter()
                .filter_map(|(p, s)| {
                    let e = w.expect(p);
                    judge(&format!("{base}/{p}"), e, s).map(|f| (f, e.map_or(0, |e| e.ops)))
                })
                .collect();
            if best.as_ref().is_none_or(|b| misses.len() < b.len()) {
                best = Some(misses);
            }
        }
        for (f, ops) in best.unwrap_or_default() {
            self.push(f, ops);
        }
    }
}
