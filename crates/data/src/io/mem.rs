//! [`MemDisk`], a test double: an in-memory disk that keeps, beside every file's content, the
//! content as of its last `sync_data` and the changes since, and the names as of the last
//! `sync_dir`, so that a test can take a **crash image** (only what was synced, or any torn subset
//! of the rest), lose unsynced writes in place, corrupt a file, and count open handles. Its
//! behaviour is the weakest the [`Disk`] contract allows.

use std::collections::BTreeMap;
use std::io;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};

use nacre_types::sync::{lock, read, write};

use super::{Disk, DiskFile, check_name};

/// An in-memory disk that also keeps its **crash image**: for every file the content as of its last
/// `sync_data` plus the writes since (so a crash can keep any subset of them), and the names as of the
/// last `sync_dir`. Clones share the same files, so a test can keep a handle to inspect, corrupt or
/// crash the disk a store is using. It also counts its open handles ([`MemDisk::open_files`]), so a
/// test can check a bound on open files.
#[derive(Clone, Debug, Default)]
pub struct MemDisk {
    dir: Arc<Mutex<MemDir>>,
    handles: Arc<Handles>,
}

/// Open [`MemFile`]s of a [`MemDisk`] (and of its clones).
#[derive(Debug, Default)]
struct Handles {
    now: AtomicUsize,
    peak: AtomicUsize,
}

impl Handles {
    fn opened(&self) {
        let now = self.now.fetch_add(1, Ordering::SeqCst) + 1;
        self.peak.fetch_max(now, Ordering::SeqCst);
    }
}

#[derive(Debug, Default)]
struct MemDir {
    /// Names now.
    live: BTreeMap<String, Arc<MemInode>>,
    /// Names as of the last `sync_dir`.
    durable: BTreeMap<String, Arc<MemInode>>,
}

#[derive(Debug, Default)]
struct MemInode {
    state: RwLock<InodeState>,
}

#[derive(Clone, Debug, Default)]
struct InodeState {
    data: Vec<u8>,
    /// Content as of the last `sync_data`.
    synced: Vec<u8>,
    /// Changes since `synced`, in order.
    pending: Vec<Change>,
}

#[derive(Clone, Debug)]
enum Change {
    Write { off: u64, data: Vec<u8> },
    SetLen(u64),
    Punch { off: u64, len: u64 },
}

impl InodeState {
    /// The content a crash (or a failed writeback) may leave: the synced content, plus (given a
    /// generator) each later change dropped, applied or torn.
    fn survivor(&self, rng: Option<&mut Rng>) -> Vec<u8> {
        let mut data = self.synced.clone();
        let Some(rng) = rng else {
            return data;
        };
        for change in &self.pending {
            match rng.below(4) {
                0 => {}
                1 | 2 => change.apply(&mut data),
                _ => match change {
                    Change::Write { off, data: bytes } if bytes.len() > SECTOR => {
                        for (i, sector) in bytes.chunks(SECTOR).enumerate() {
                            if rng.below(2) == 0 {
                                write_into(&mut data, off + (i * SECTOR) as u64, sector);
                            }
                        }
                    }
                    Change::Write { off, data: bytes } => {
                        let keep = to_usize(rng.below(bytes.len() as u64 + 1));
                        write_into(&mut data, *off, &bytes[..keep]);
                    }
                    // Length changes and punches are metadata: all or nothing.
                    other => other.apply(&mut data),
                },
            }
        }
        data
    }
}

/// Sector size used to tear large unsynced writes in a crash image.
const SECTOR: usize = 512;

impl Change {
    fn apply(&self, data: &mut Vec<u8>) {
        match self {
            Change::Write { off, data: bytes } => write_into(data, *off, bytes),
            Change::SetLen(len) => data.resize(to_usize(*len), 0),
            Change::Punch { off, len } => {
                let start = to_usize(*off).min(data.len());
                let end = to_usize(off.saturating_add(*len)).min(data.len());
                data[start..end].fill(0);
            }
        }
    }
}

fn to_usize(v: u64) -> usize {
    usize::try_from(v).unwrap_or(usize::MAX)
}

fn write_into(data: &mut Vec<u8>, off: u64, bytes: &[u8]) {
    let off = to_usize(off);
    let end = off.saturating_add(bytes.len());
    if data.len() < end {
        data.resize(end, 0);
    }
    data[off..end].copy_from_slice(bytes);
}

/// splitmix64: a tiny deterministic generator for crash images.
#[derive(Debug)]
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: u64) -> u64 {
        if n == 0 { 0 } else { self.next() % n }
    }
}

impl MemDisk {
    pub fn new() -> Self {
        Self::default()
    }

    /// The disk after a power failure now, keeping only what was synced: the names as of the last
    /// `sync_dir`, each file as of its last `sync_data`.
    pub fn crash(&self) -> MemDisk {
        self.crash_image(None)
    }

    /// Like [`MemDisk::crash`], but each unsynced change of a surviving file may also have landed, in
    /// whole or torn (a prefix of a small write, any subset of the 512-byte sectors of a large one),
    /// chosen deterministically from `seed`. Changes may land out of order.
    pub fn crash_torn(&self, seed: u64) -> MemDisk {
        self.crash_image(Some(Rng(seed)))
    }

    fn crash_image(&self, mut rng: Option<Rng>) -> MemDisk {
        let dir = lock(&self.dir);
        let mut files = BTreeMap::new();
        for (name, inode) in &dir.durable {
            let st = read(&inode.state);
            let data = st.survivor(rng.as_mut());
            let inode = Arc::new(MemInode {
                state: RwLock::new(InodeState {
                    synced: data.clone(),
                    data,
                    pending: Vec::new(),
                }),
            });
            files.insert(name.clone(), inode);
        }
        MemDisk {
            dir: Arc::new(Mutex::new(MemDir {
                live: files.clone(),
                durable: files,
            })),
            handles: Arc::default(),
        }
    }

    /// What a failed writeback may leave behind, in place: every file (by its current names)
    /// becomes its content as of its last `sync_data` plus a subset of the changes since, each
    /// whole or torn, chosen from `seed` as in [`MemDisk::crash_torn`]; that is now its synced
    /// content. Names and open handles stay. Models the kernel dropping dirty pages whose writeback
    /// failed (or having written part of them) without a crash, so that a store can be reopened on
    /// the same disk.
    pub fn lose_unsynced(&self, seed: u64) {
        let mut rng = Rng(seed);
        let dir = lock(&self.dir);
        let mut seen = std::collections::BTreeSet::new();
        for inode in dir.live.values() {
            // A file renamed over another may show under one name only, but never twice.
            if !seen.insert(Arc::as_ptr(inode)) {
                continue;
            }
            let mut st = write(&inode.state);
            let data = st.survivor(Some(&mut rng));
            st.synced = data.clone();
            st.data = data;
            st.pending.clear();
        }
    }

    /// Handles opened through this disk (or its clones) and not dropped yet.
    pub fn open_files(&self) -> usize {
        self.handles.now.load(Ordering::SeqCst)
    }

    /// The most handles that were open at once.
    pub fn peak_open_files(&self) -> usize {
        self.handles.peak.load(Ordering::SeqCst)
    }

    /// A file's current content, if the name exists.
    pub fn read_file(&self, name: &str) -> Option<Vec<u8>> {
        let dir = lock(&self.dir);
        let inode = dir.live.get(name)?;
        let st = read(&inode.state);
        Some(st.data.clone())
    }

    /// Creates or replaces a file with `data`, already durable (name and content).
    pub fn put_file(&self, name: &str, data: &[u8]) -> io::Result<()> {
        check_name(name)?;
        let inode = Arc::new(MemInode {
            state: RwLock::new(InodeState {
                data: data.to_vec(),
                synced: data.to_vec(),
                pending: Vec::new(),
            }),
        });
        let mut dir = lock(&self.dir);
        dir.live.insert(name.to_owned(), inode.clone());
        dir.durable.insert(name.to_owned(), inode);
        Ok(())
    }

    /// Flips the lowest bit of the byte at `offset`, in the current and the synced content (bit rot on
    /// the medium).
    pub fn corrupt(&self, name: &str, offset: u64) -> io::Result<()> {
        let dir = lock(&self.dir);
        let inode = dir
            .live
            .get(name)
            .ok_or_else(|| io::Error::new(io::ErrorKind::NotFound, name.to_owned()))?;
        let mut st = write(&inode.state);
        let off = to_usize(offset);
        if off >= st.data.len() {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("{name}: offset {offset} is past the end"),
            ));
        }
        st.data[off] ^= 1;
        if let Some(b) = st.synced.get_mut(off) {
            *b ^= 1;
        }
        Ok(())
    }
}

impl MemDisk {
    fn handle(&self, inode: Arc<MemInode>) -> Arc<dyn DiskFile> {
        self.handles.opened();
        Arc::new(MemFile {
            inode,
            handles: self.handles.clone(),
        })
    }
}

impl Disk for MemDisk {
    fn open(&self, name: &str) -> io::Result<Arc<dyn DiskFile>> {
        check_name(name)?;
        let inode = lock(&self.dir)
            .live
            .entry(name.to_owned())
            .or_default()
            .clone();
        Ok(self.handle(inode))
    }

    fn open_existing(&self, name: &str) -> io::Result<Arc<dyn DiskFile>> {
        check_name(name)?;
        let inode = lock(&self.dir)
            .live
            .get(name)
            .cloned()
            .ok_or_else(|| io::Error::new(io::ErrorKind::NotFound, name.to_owned()))?;
        Ok(self.handle(inode))
    }

    fn list(&self) -> io::Result<Vec<String>> {
        Ok(lock(&self.dir).live.keys().cloned().collect())
    }

    fn remove(&self, name: &str) -> io::Result<()> {
        check_name(name)?;
        lock(&self.dir).live.remove(name);
        Ok(())
    }

    fn rename(&self, from: &str, to: &str) -> io::Result<()> {
        check_name(from)?;
        check_name(to)?;
        let mut dir = lock(&self.dir);
        let inode = dir
            .live
            .remove(from)
            .ok_or_else(|| io::Error::new(io::ErrorKind::NotFound, from.to_owned()))?;
        dir.live.insert(to.to_owned(), inode);
        Ok(())
    }

    fn sync_dir(&self) -> io::Result<()> {
        let mut dir = lock(&self.dir);
        dir.durable = dir.live.clone();
        Ok(())
    }

    /// Every file's writes and the names become durable, as `syncfs` makes them.
    fn sync_fs(&self) -> io::Result<bool> {
        let mut dir = lock(&self.dir);
        for inode in dir.live.values() {
            let mut st = write(&inode.state);
            st.synced = st.data.clone();
            st.pending.clear();
        }
        dir.durable = dir.live.clone();
        Ok(true)
    }

    /// Sum of the file lengths (a hole counts: this disk does not track allocation).
    fn used(&self) -> io::Result<u64> {
        let dir = lock(&self.dir);
        Ok(dir
            .live
            .values()
            .map(|i| read(&i.state).data.len() as u64)
            .sum())
    }
}

#[derive(Debug)]
struct MemFile {
    inode: Arc<MemInode>,
    handles: Arc<Handles>,
}

impl Drop for MemFile {
    fn drop(&mut self) {
        self.handles.now.fetch_sub(1, Ordering::SeqCst);
    }
}

impl MemFile {
    fn change(&self, change: Change) {
        let mut st = write(&self.inode.state);
        change.apply(&mut st.data);
        st.pending.push(change);
    }
}

impl DiskFile for MemFile {
    fn read_at(&self, buf: &mut [u8], off: u64) -> io::Result<usize> {
        let st = read(&self.inode.state);
        let start = to_usize(off).min(st.data.len());
        let n = buf.len().min(st.data.len() - start);
        buf[..n].copy_from_slice(&st.data[start..start + n]);
        Ok(n)
    }

    fn write_at(&self, data: &[u8], off: u64) -> io::Result<()> {
        off.checked_add(data.len() as u64)
            .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "write past u64::MAX"))?;
        self.change(Change::Write {
            off,
            data: data.to_vec(),
        });
        Ok(())
    }

    fn len(&self) -> io::Result<u64> {
        let st = read(&self.inode.state);
        Ok(st.data.len() as u64)
    }

    fn set_len(&self, len: u64) -> io::Result<()> {
        self.change(Change::SetLen(len));
        Ok(())
    }

    fn sync_data(&self) -> io::Result<()> {
        let mut st = write(&self.inode.state);
        st.synced = st.data.clone();
        st.pending.clear();
        Ok(())
    }

    fn punch_hole(&self, off: u64, len: u64) -> io::Result<()> {
        self.change(Change::Punch { off, len });
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mem_crash_keeps_only_synced_content_and_names() {
        let disk = MemDisk::new();
        let a = disk.open("a").unwrap();
        a.write_at(b"hello", 0).unwrap();
        a.sync_data().unwrap();
        disk.sync_dir().unwrap();
        a.write_at(b"HELLO world", 0).unwrap();
        let b = disk.open("b").unwrap();
        b.write_at(b"x", 0).unwrap();
        b.sync_data().unwrap();

        let img = disk.crash();
        assert_eq!(img.read_file("a").unwrap(), b"hello");
        assert!(img.read_file("b").is_none(), "b's name was never synced");

        disk.remove("a").unwrap();
        let img = disk.crash();
        assert_eq!(img.read_file("a").unwrap(), b"hello", "unsynced remove");
        // The open handle still works after the remove.
        assert_eq!(a.len().unwrap(), 11);
    }

    #[test]
    fn torn_crash_images_stay_between_synced_and_current() {
        let disk = MemDisk::new();
        let f = disk.open("f").unwrap();
        f.write_at(&[1; 100], 0).unwrap();
        f.sync_data().unwrap();
        disk.sync_dir().unwrap();
        f.write_at(&[2; 2000], 50).unwrap();
        let mut saw_torn = false;
        for seed in 0..64 {
            let img = disk.crash_torn(seed).read_file("f").unwrap();
            assert!((100..=2050).contains(&img.len()));
            assert!(img[..50].iter().all(|&b| b == 1));
            assert!(img[50..].iter().all(|&b| b == 1 || b == 2 || b == 0));
            saw_torn |= img.len() == 2050 && img.contains(&0);
        }
        assert!(saw_torn, "some image tears the large write");
    }

    #[test]
    fn mem_disk_counts_open_handles() {
        let disk = MemDisk::new();
        assert!(
            disk.open_existing("a").is_err(),
            "open_existing never creates"
        );
        let a = disk.open("a").unwrap();
        let a2 = disk.clone().open_existing("a").unwrap();
        assert_eq!(disk.open_files(), 2);
        drop(a);
        assert_eq!(disk.open_files(), 1);
        a2.write_at(b"x", 0).unwrap();
        drop(a2);
        assert_eq!((disk.open_files(), disk.peak_open_files()), (0, 2));
        assert_eq!(disk.read_file("a").unwrap(), b"x", "closing loses nothing");
    }

    /// What a failed writeback leaves, in place: the synced content plus any subset of the later
    /// changes (whole or torn); names and handles stay.
    #[test]
    fn lose_unsynced_keeps_synced_content_and_names() {
        let mut saw = std::collections::BTreeSet::new();
        for seed in 0..64 {
            let disk = MemDisk::new();
            let a = disk.open("a").unwrap();
            a.write_at(&[1; 100], 0).unwrap();
            a.sync_data().unwrap();
            a.write_at(&[2; 2000], 50).unwrap();
            let b = disk.open("b").unwrap(); // its name and content were never synced
            b.write_at(b"unsynced", 0).unwrap();
            disk.lose_unsynced(seed);
            let got = disk.read_file("a").unwrap();
            assert!((100..=2050).contains(&got.len()));
            assert!(got[..50].iter().all(|&x| x == 1));
            assert!(got[50..].iter().all(|&x| x == 1 || x == 2 || x == 0));
            saw.insert(got.len());
            assert_eq!(a.len().unwrap(), got.len() as u64, "the handle works");
            let b_got = disk.read_file("b").unwrap();
            assert!(b"unsynced".starts_with(&b_got[..]) || b_got.iter().all(|&x| x == 0));
            assert_eq!(disk.list().unwrap().len(), 2, "names stay");
            disk.sync_dir().unwrap();
            assert_eq!(disk.crash().read_file("a").unwrap(), got, "now durable");
        }
        assert!(
            saw.len() > 1,
            "some seeds drop the write, some keep it: {saw:?}"
        );
    }
}
