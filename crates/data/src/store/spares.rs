//! Spares: deleted extents' data files kept for new extents to take (`StoreOptions::recycle`,
//! docs/data-store.md, "Recycling"). One pool may serve every store of a node: a store takes a
//! spare of its own directory by renaming it, one of another store's directory by moving it
//! there ([`Disk::adopt`], a rename across directories of one file system). A spare is garbage
//! until it is taken (its name marks it deleted), so moving it needs no durability: a crash
//! leaves it under one name or the other, and the store that finds it at open removes it.

use std::sync::{Arc, Mutex};
use std::time::Instant;

use crate::io::Disk;

use super::lock;

/// A deleted extent's data file kept for a new extent.
#[derive(Debug)]
pub struct Spare {
    /// The disk (a store's directory) it is in.
    pub disk: Arc<dyn Disk>,
    /// Its name there (`<id>.data.deleted`).
    pub name: String,
    pub bytes: u64,
    /// When its extent was deleted.
    pub since: Instant,
}

/// The spares of one store ([`super::ExtentStore::open`]) or of every store of a node
/// ([`super::ExtentStore::open_with_spares`]), in the order they came.
#[derive(Debug, Default)]
pub struct SparePool {
    spares: Mutex<Vec<Spare>>,
}

impl SparePool {
    pub fn new() -> Arc<Self> {
        Arc::new(Self::default())
    }

    /// Each spare's bytes and when its extent was deleted, oldest first.
    pub fn list(&self) -> Vec<(u64, Instant)> {
        lock(&self.spares)
            .iter()
            .map(|s| (s.bytes, s.since))
            .collect()
    }

    /// Takes the spares whose extents were deleted at or before `until` out of the pool; the
    /// caller removes their files (`Disk::remove` on their disk).
    pub fn retire(&self, until: Instant) -> Vec<Spare> {
        let mut spares = lock(&self.spares);
        let (go, keep): (Vec<Spare>, Vec<Spare>) = std::mem::take(&mut *spares)
            .into_iter()
            .partition(|s| s.since <= until);
        *spares = keep;
        go
    }

    /// Adds a spare (a store's delete, or a caller giving back one it could not remove).
    pub fn give(&self, spare: Spare) {
        lock(&self.spares).push(spare);
    }

    /// The newest spare a store on `disk` can take: one of its own directory, or, if `disk` has
    /// a location, one of any directory that has one.
    pub(super) fn take_for(&self, disk: &Arc<dyn Disk>) -> Option<Spare> {
        let mut spares = lock(&self.spares);
        let movable = disk.location().is_some();
        let i = spares.iter().rposition(|s| {
            Arc::ptr_eq(&s.disk, disk) || (movable && s.disk.location().is_some())
        })?;
        Some(spares.remove(i))
    }

    /// Drops the spares of `disk` (its store reopened or closed: what it finds at open it removes).
    pub(super) fn forget(&self, disk: &Arc<dyn Disk>) {
        lock(&self.spares).retain(|s| !Arc::ptr_eq(&s.disk, disk));
    }
}
