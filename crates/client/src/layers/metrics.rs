//! [`Metrics`]: per-operation calls, errors and latency, and bytes read and written, for
//! Prometheus.
//!
//! Families (one label, `op`, from [`Op::name`]):
//! `nacre_fs_ops_total`, `nacre_fs_errors_total`, `nacre_fs_op_seconds` (histogram), and the
//! unlabelled `nacre_fs_read_bytes_total` and `nacre_fs_written_bytes_total`. Every error counts,
//! including the expected ones (a `lookup` of a missing name is an error here).
//!
//! Label lookups happen once, in [`Metrics::new`]; a call costs two atomic adds and a histogram
//! observation.

use std::collections::BTreeMap;
use std::future::Future;
use std::time::Instant;

use bytes::Bytes;
use nacre_api::meta::{Attr, FileType, SetAttr, XattrMode};
use nacre_types::Ino;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::{Registry, Unit};

use crate::fs::{Caller, DirEntryPlus, Falloc, Fh, FileSystem, OpenFlags, StatFs};
use crate::meta::{Entry, FsResult};

/// A [`FileSystem`] operation, as the metrics name it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Op {
    Lookup,
    Getattr,
    Setattr,
    Create,
    Mkdir,
    Symlink,
    Mknod,
    Link,
    Unlink,
    Rmdir,
    Rename,
    Readlink,
    Readdir,
    Open,
    Read,
    Write,
    Fallocate,
    Flush,
    Fsync,
    Release,
    Statfs,
    Getxattr,
    Setxattr,
    Listxattr,
    Removexattr,
}

impl Op {
    pub const ALL: [Op; 25] = [
        Op::Lookup,
        Op::Getattr,
        Op::Setattr,
        Op::Create,
        Op::Mkdir,
        Op::Symlink,
        Op::Mknod,
        Op::Link,
        Op::Unlink,
        Op::Rmdir,
        Op::Rename,
        Op::Readlink,
        Op::Readdir,
        Op::Open,
        Op::Read,
        Op::Write,
        Op::Fallocate,
        Op::Flush,
        Op::Fsync,
        Op::Release,
        Op::Statfs,
        Op::Getxattr,
        Op::Setxattr,
        Op::Listxattr,
        Op::Removexattr,
    ];

    /// The `op` label: the method's name.
    pub fn name(self) -> &'static str {
        match self {
            Op::Lookup => "lookup",
            Op::Getattr => "getattr",
            Op::Setattr => "setattr",
            Op::Create => "create",
            Op::Mkdir => "mkdir",
            Op::Symlink => "symlink",
            Op::Mknod => "mknod",
            Op::Link => "link",
            Op::Unlink => "unlink",
            Op::Rmdir => "rmdir",
            Op::Rename => "rename",
            Op::Readlink => "readlink",
            Op::Readdir => "readdir",
            Op::Open => "open",
            Op::Read => "read",
            Op::Write => "write",
            Op::Fallocate => "fallocate",
            Op::Flush => "flush",
            Op::Fsync => "fsync",
            Op::Release => "release",
            Op::Statfs => "statfs",
            Op::Getxattr => "getxattr",
            Op::Setxattr => "setxattr",
            Op::Listxattr => "listxattr",
            Op::Removexattr => "removexattr",
        }
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OpLabel {
    op: &'static str,
}

/// The metrics of one operation, resolved once.
#[derive(Clone, Debug)]
struct OpMetrics {
    calls: Counter,
    errors: Counter,
    seconds: Histogram,
}

/// Counts what passes through to `inner`.
#[derive(Debug)]
pub struct Metrics<F> {
    inner: F,
    ops: Vec<OpMetrics>,
    read_bytes: Counter,
    written_bytes: Counter,
}

fn latency_histogram() -> Histogram {
    // 10 µs .. ~10 s.
    Histogram::new(exponential_buckets(1e-5, 2.0, 21))
}

impl<F: FileSystem> Metrics<F> {
    /// Wraps `inner` and registers the `nacre_fs_*` families in `registry` (register one
    /// `Metrics` per registry, or give each its own sub-registry with a label).
    pub fn new(inner: F, registry: &mut Registry) -> Self {
        let calls = Family::<OpLabel, Counter>::default();
        let errors = Family::<OpLabel, Counter>::default();
        let seconds = Family::<OpLabel, Histogram, fn() -> Histogram>::new_with_constructor(
            latency_histogram,
        );
        let read_bytes = Counter::default();
        let written_bytes = Counter::default();
        let r = registry.sub_registry_with_prefix("nacre_fs");
        r.register("ops", "File system calls, per operation", calls.clone());
        r.register(
            "errors",
            "File system calls that returned an error, per operation",
            errors.clone(),
        );
        r.register_with_unit(
            "op",
            "Latency of file system calls, per operation",
            Unit::Seconds,
            seconds.clone(),
        );
        r.register_with_unit(
            "read",
            "Bytes returned by read calls",
            Unit::Bytes,
            read_bytes.clone(),
        );
        r.register_with_unit(
            "written",
            "Bytes taken by write calls",
            Unit::Bytes,
            written_bytes.clone(),
        );
        let ops = Op::ALL
            .iter()
            .map(|op| {
                let l = OpLabel { op: op.name() };
                OpMetrics {
                    calls: calls.get_or_create_owned(&l),
                    errors: errors.get_or_create_owned(&l),
                    seconds: seconds.get_or_create_owned(&l),
                }
            })
            .collect();
        Self {
            inner,
            ops,
            read_bytes,
            written_bytes,
        }
    }

    pub fn inner(&self) -> &F {
        &self.inner
    }

    /// Calls and errors so far, per operation (every operation is listed).
    pub fn snapshot(&self) -> BTreeMap<&'static str, (u64, u64)> {
        Op::ALL
            .iter()
            .zip(&self.ops)
            .map(|(op, m)| (op.name(), (m.calls.get(), m.errors.get())))
            .collect()
    }

    /// Bytes returned by `read` and taken by `write` so far.
    pub fn bytes(&self) -> (u64, u64) {
        (self.read_bytes.get(), self.written_bytes.get())
    }

    async fn track<T>(&self, op: Op, call: impl Future<Output = FsResult<T>>) -> FsResult<T> {
        let start = Instant::now();
        let r = call.await;
        let m = &self.ops[op as usize];
        m.calls.inc();
        if r.is_err() {
            m.errors.inc();
        }
        m.seconds.observe(start.elapsed().as_secs_f64());
        r
    }
}

impl<F: FileSystem> FileSystem for Metrics<F> {
    async fn lookup(&self, parent: Ino, name: &[u8]) -> FsResult<Attr> {
        self.track(Op::Lookup, self.inner.lookup(parent, name))
            .await
    }

    async fn getattr(&self, ino: Ino) -> FsResult<Attr> {
        self.track(Op::Getattr, self.inner.getattr(ino)).await
    }

    async fn setattr(&self, ino: Ino, set: SetAttr) -> FsResult<Attr> {
        self.track(Op::Setattr, self.inner.setattr(ino, set)).await
    }

    async fn create(
        &self,
        parent: Ino,
        name: &[u8],
        mode: u32,
        caller: Caller,
        flags: OpenFlags,
    ) -> FsResult<(Entry, Fh)> {
        self.track(
            Op::Create,
            self.inner.create(parent, name, mode, caller, flags),
        )
        .await
    }

    async fn mkdir(&self, parent: Ino, name: &[u8], mode: u32, caller: Caller) -> FsResult<Entry> {
        self.track(Op::Mkdir, self.inner.mkdir(parent, name, mode, caller))
            .await
    }

    async fn symlink(
        &self,
        parent: Ino,
        name: &[u8],
        target: &[u8],
        caller: Caller,
    ) -> FsResult<Entry> {
        self.track(
            Op::Symlink,
            self.inner.symlink(parent, name, target, caller),
        )
        .await
    }

    async fn mknod(
        &self,
        parent: Ino,
        name: &[u8],
        kind: FileType,
        mode: u32,
        rdev: u32,
        caller: Caller,
    ) -> FsResult<Entry> {
        self.track(
            Op::Mknod,
            self.inner.mknod(parent, name, kind, mode, rdev, caller),
        )
        .await
    }

    async fn link(&self, ino: Ino, new_parent: Ino, new_name: &[u8]) -> FsResult<Entry> {
        self.track(Op::Link, self.inner.link(ino, new_parent, new_name))
            .await
    }

    async fn unlink(&self, parent: Ino, name: &[u8]) -> FsResult<Vec<Attr>> {
        self.track(Op::Unlink, self.inner.unlink(parent, name))
            .await
    }

    async fn rmdir(&self, parent: Ino, name: &[u8]) -> FsResult<Vec<Attr>> {
        self.track(Op::Rmdir, self.inner.rmdir(parent, name)).await
    }

    async fn rename(
        &self,
        parent: Ino,
        name: &[u8],
        new_parent: Ino,
        new_name: &[u8],
    ) -> FsResult<Vec<Attr>> {
        self.track(
            Op::Rename,
            self.inner.rename(parent, name, new_parent, new_name),
        )
        .await
    }

    async fn readlink(&self, ino: Ino) -> FsResult<Vec<u8>> {
        self.track(Op::Readlink, self.inner.readlink(ino)).await
    }

    async fn readdir(
        &self,
        dir: Ino,
        after: Option<Vec<u8>>,
        limit: u32,
    ) -> FsResult<Vec<DirEntryPlus>> {
        self.track(Op::Readdir, self.inner.readdir(dir, after, limit))
            .await
    }

    async fn open(&self, ino: Ino, flags: OpenFlags) -> FsResult<Fh> {
        self.track(Op::Open, self.inner.open(ino, flags)).await
    }

    async fn read(&self, fh: Fh, offset: u64, len: u32) -> FsResult<Bytes> {
        let r = self.track(Op::Read, self.inner.read(fh, offset, len)).await;
        if let Ok(b) = &r {
            self.read_bytes.inc_by(b.len() as u64);
        }
        r
    }

    async fn write(&self, fh: Fh, offset: u64, data: Bytes) -> FsResult<u32> {
        let r = self
            .track(Op::Write, self.inner.write(fh, offset, data))
            .await;
        if let Ok(n) = &r {
            self.written_bytes.inc_by(u64::from(*n));
        }
        r
    }

    async fn fallocate(&self, fh: Fh, mode: Falloc, offset: u64, len: u64) -> FsResult<()> {
        self.track(Op::Fallocate, self.inner.fallocate(fh, mode, offset, len))
            .await
    }

    async fn flush(&self, fh: Fh) -> FsResult<()> {
        self.track(Op::Flush, self.inner.flush(fh)).await
    }

    async fn fsync(&self, fh: Fh) -> FsResult<()> {
        self.track(Op::Fsync, self.inner.fsync(fh)).await
    }

    async fn release(&self, fh: Fh) -> FsResult<()> {
        self.track(Op::Release, self.inner.release(fh)).await
    }

    async fn sync_dir(&self, dir: Ino) -> FsResult<()> {
        self.track(Op::Fsync, self.inner.sync_dir(dir)).await
    }

    async fn statfs(&self) -> FsResult<StatFs> {
        self.track(Op::Statfs, self.inner.statfs()).await
    }

    async fn getxattr(&self, ino: Ino, name: &[u8]) -> FsResult<Vec<u8>> {
        self.track(Op::Getxattr, self.inner.getxattr(ino, name))
            .await
    }

    async fn setxattr(&self, ino: Ino, name: &[u8], value: &[u8], mode: XattrMode) -> FsResult<()> {
        self.track(Op::Setxattr, self.inner.setxattr(ino, name, value, mode))
            .await
    }

    async fn listxattr(&self, ino: Ino) -> FsResult<Vec<Vec<u8>>> {
        self.track(Op::Listxattr, self.inner.listxattr(ino)).await
    }

    async fn removexattr(&self, ino: Ino, name: &[u8]) -> FsResult<()> {
        self.track(Op::Removexattr, self.inner.removexattr(ino, name))
            .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ops_index_their_own_metrics() {
        // `Metrics::track` indexes `ops` by `op as usize`, built in `Op::ALL` order.
        for (i, op) in Op::ALL.iter().enumerate() {
            assert_eq!(*op as usize, i, "{op:?}");
        }
        let names: std::collections::BTreeSet<_> = Op::ALL.iter().map(|o| o.name()).collect();
        assert_eq!(names.len(), Op::ALL.len());
    }
}
