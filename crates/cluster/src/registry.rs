//! What a node keeps on disk about itself: the partitions it was asked to host
//! ([`SpecRegistry`]) and the id the master gave it (`DIR/node-id`).

use std::path::{Path, PathBuf};
use std::sync::Mutex;

use nacre_api::master::{PartitionKind, PartitionReport, PartitionSpec, Role};
use nacre_msgr::BoxFuture;
use nacre_types::sync::lock;
use nacre_types::{NodeId, PartitionId};

use crate::agent::PartitionHost;
use crate::host::{HostError, role_name};

/// A durable record of the partitions a node was asked to host: one file, replaced atomically
/// (write, fsync, rename, fsync the directory). The meta and data roles keep their partitions'
/// state beside it; this is what tells them, after a restart, which partitions to open.
#[derive(Debug)]
pub struct SpecRegistry {
    path: Option<PathBuf>,
    specs: Mutex<Vec<PartitionSpec>>,
    role: Role,
}

impl SpecRegistry {
    /// Opens (or creates) the registry in `dir`.
    pub fn open(dir: &Path, role: Role) -> std::io::Result<Self> {
        std::fs::create_dir_all(dir)?;
        let path = dir.join("partitions.bin");
        let specs = match std::fs::read(&path) {
            Ok(bytes) => postcard::from_bytes(&bytes).map_err(|e| {
                std::io::Error::new(
                    std::io::ErrorKind::InvalidData,
                    format!("{}: corrupt partition registry: {e}", path.display()),
                )
            })?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
            Err(e) => return Err(e),
        };
        Ok(Self {
            path: Some(path),
            specs: Mutex::new(specs),
            role,
        })
    }

    /// A registry that lives in memory only (tests).
    pub fn in_memory(role: Role) -> Self {
        Self {
            path: None,
            specs: Mutex::default(),
            role,
        }
    }

    /// Every recorded spec, in id order.
    pub fn specs(&self) -> Vec<PartitionSpec> {
        lock(&self.specs).clone()
    }

    /// The recorded spec of partition `id`.
    pub fn get(&self, id: PartitionId) -> Option<PartitionSpec> {
        lock(&self.specs).iter().find(|s| s.id == id).cloned()
    }

    /// Records `spec`, replacing the record of the same partition. Durable when this returns.
    pub fn record(&self, spec: PartitionSpec) -> Result<(), HostError> {
        self.change(|specs| {
            specs.retain(|s| s.id != spec.id);
            specs.push(spec);
            specs.sort_by_key(|s| s.id);
        })
    }

    /// Drops the record of partition `id`. Durable when this returns.
    pub fn forget(&self, id: PartitionId) -> Result<(), HostError> {
        self.change(|specs| specs.retain(|s| s.id != id))
    }

    fn persist(&self, specs: &[PartitionSpec]) -> Result<(), HostError> {
        let Some(path) = &self.path else {
            return Ok(());
        };
        let tmp = path.with_extension("tmp");
        let write = || -> std::io::Result<()> {
            use std::io::Write as _;
            let bytes = postcard::to_allocvec(specs).map_err(std::io::Error::other)?;
            let mut f = std::fs::File::create(&tmp)?;
            f.write_all(&bytes)?;
            f.sync_all()?;
            std::fs::rename(&tmp, path)?;
            if let Some(dir) = path.parent() {
                std::fs::File::open(dir)?.sync_all()?;
            }
            Ok(())
        };
        write().map_err(|e| HostError::io(path.display(), e))
    }

    /// Applies `f` to a copy of the records and makes the result durable before it is seen.
    fn change(&self, f: impl FnOnce(&mut Vec<PartitionSpec>)) -> Result<(), HostError> {
        let mut specs = lock(&self.specs);
        let mut next = specs.clone();
        f(&mut next);
        if next != *specs {
            self.persist(&next)?;
            *specs = next;
        }
        Ok(())
    }
}

/// A registry alone is a host that keeps records only (tests of the agent protocol).
impl PartitionHost for SpecRegistry {
    fn hosted(&self) -> Vec<PartitionSpec> {
        self.specs()
    }

    fn reports(&self) -> Vec<PartitionReport> {
        self.specs()
            .iter()
            .map(|s| PartitionReport {
                id: s.id,
                ..PartitionReport::default()
            })
            .collect()
    }

    fn used(&self) -> u64 {
        0
    }

    fn ensure(&self, spec: PartitionSpec) -> BoxFuture<'_, Result<(), HostError>> {
        let r = match (&spec.kind, self.role) {
            (PartitionKind::Meta { .. }, Role::Meta) => self.record(spec),
            (kind, Role::Data) if kind.is_data() => self.record(spec),
            (kind, role) => Err(HostError::WrongKind {
                role: role_name(role),
                kind: if kind.is_data() { "data" } else { "meta" },
                id: spec.id,
            }),
        };
        Box::pin(async move { r })
    }

    fn remove(&self, id: PartitionId) -> BoxFuture<'_, Result<(), HostError>> {
        let r = self.forget(id);
        Box::pin(async move { r })
    }
}

/// The node id persisted in `DIR/node-id` by an earlier run, if any.
pub fn read_node_id(dir: &Path) -> std::io::Result<Option<NodeId>> {
    match std::fs::read_to_string(dir.join("node-id")) {
        Ok(s) => s
            .trim()
            .parse::<u64>()
            .map(|n| Some(NodeId(n)))
            .map_err(|e| {
                std::io::Error::new(
                    std::io::ErrorKind::InvalidData,
                    format!("{}: bad node id: {e}", dir.join("node-id").display()),
                )
            }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e),
    }
}

/// Persists the node id in `DIR/node-id` (temp file, fsync, rename, fsync dir).
pub fn write_node_id(dir: &Path, id: NodeId) -> std::io::Result<()> {
    use std::io::Write as _;
    std::fs::create_dir_all(dir)?;
    let tmp = dir.join("node-id.tmp");
    let mut f = std::fs::File::create(&tmp)?;
    writeln!(f, "{}", id.0)?;
    f.sync_all()?;
    std::fs::rename(&tmp, dir.join("node-id"))?;
    std::fs::File::open(dir)?.sync_all()
}
