//! Fuzzes extent store recovery (crates/data, docs/data-store.md).
//!
//! The first input byte picks how the disk is made:
//! - even: **raw files**: a few files named in the store's scheme (`<id>.data`, `<id>.crc`) with
//!   arbitrary contents, as `[name index][length u16 le][bytes]...`;
//! - odd: **damaged real store**: the input drives store operations (so headers and records are
//!   well formed), the disk crashes with torn unsynced writes, then input bytes flip bits in its files.
//!
//! Opening must never panic (errors are fine). If it opens, reading every block of every extent
//! must not panic, a block that reads must match its CRC, and the store must keep working (append,
//! sync, reopen).
#![no_main]

use std::sync::Arc;

use libfuzzer_sys::fuzz_target;
use nacre_data::io::MemDisk;
use nacre_data::store::{ExtentStore, StoreOptions};
use nacre_types::{ExtentId, crc32c};

/// Small blocks: many blocks per byte of input.
const BS: u32 = 64;
const IDS: [u64; 4] = [1, 2, 1024, 1025];
const NAMES: [&str; 8] = [
    "1.data",
    "1.crc",
    "2.data",
    "2.crc",
    "1024.data",
    "1024.crc",
    "1025.data",
    "1025.crc",
];

fn opts() -> StoreOptions {
    StoreOptions {
        block_size: BS,
        sync: true,
        ..StoreOptions::default()
    }
}

/// Reads input bytes front to back; runs dry as zeros.
struct Input<'a>(&'a [u8]);

impl Input<'_> {
    fn byte(&mut self) -> u8 {
        match self.0.split_first() {
            Some((&b, rest)) => {
                self.0 = rest;
                b
            }
            None => 0,
        }
    }

    fn u16(&mut self) -> u16 {
        u16::from_le_bytes([self.byte(), self.byte()])
    }

    fn bytes(&mut self, n: usize) -> &[u8] {
        let (head, rest) = self.0.split_at(n.min(self.0.len()));
        self.0 = rest;
        head
    }

    fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

fn raw_files(input: &mut Input<'_>) -> MemDisk {
    let disk = MemDisk::new();
    while !input.is_empty() {
        let name = NAMES[usize::from(input.byte()) % NAMES.len()];
        let len = usize::from(input.u16());
        let data = input.bytes(len).to_vec();
        disk.put_file(name, &data).expect("valid name");
    }
    disk
}

fn damaged_store(input: &mut Input<'_>) -> MemDisk {
    let disk = MemDisk::new();
    let store = ExtentStore::open(Arc::new(disk.clone()), opts()).expect("an empty store opens");
    let ops = input.byte() % 32;
    for _ in 0..ops {
        let (kind, target, param) = (input.byte(), input.byte(), input.u16());
        let id = ExtentId(IDS[usize::from(target) % IDS.len()]);
        let len = store.len(id).unwrap_or(0);
        let at = u64::from(param) % (len + 1);
        let data = vec![kind; usize::from(target % 200) + 1];
        // Errors (an absent extent, a range out of bounds) are part of the game.
        let _ = match kind % 8 {
            0 => store.create(id),
            1 | 2 => store.write(id, len, &data),
            3 => store.write(id, at, &data),
            4 => store.write(id, len + u64::from(param % 300), &data),
            5 => store.truncate(id, at),
            6 => store.punch(id, at, u64::from(target) % (len - at + 1)),
            _ => store.sync(),
        };
    }
    let seed = u64::from(input.u16());
    let image = disk.crash_torn(seed);
    while !input.is_empty() {
        let name = NAMES[usize::from(input.byte()) % NAMES.len()];
        let offset = u64::from(input.u16());
        let flips = input.byte() % 8;
        for _ in 0..=flips {
            // Past the end is an error; fine.
            let _ = image.corrupt(name, offset);
        }
    }
    image
}

fuzz_target!(|data: &[u8]| {
    let mut input = Input(data);
    let disk = if input.byte() % 2 == 0 {
        raw_files(&mut input)
    } else {
        damaged_store(&mut input)
    };
    let Ok(store) = ExtentStore::open(Arc::new(disk.clone()), opts()) else {
        return;
    };
    let bs = u64::from(BS);
    for (id, len) in store.extents() {
        let crcs = store.block_crcs(id).expect("a listed extent has CRCs");
        assert_eq!(crcs.len() as u64, len.div_ceil(bs), "{id}");
        if let Ok(len32) = u32::try_from(len) {
            let _ = store.read(id, 0, len32);
        }
        for (b, crc) in crcs.iter().enumerate() {
            let start = b as u64 * bs;
            let n = (len - start).min(bs) as u32;
            if let Ok(bytes) = store.read(id, start, n) {
                assert_eq!(
                    crc32c(&bytes),
                    *crc,
                    "{id} block {b} read but does not match"
                );
            }
        }
        let _ = store.write(id, len, b"more");
    }
    let _ = store.sync();
    drop(store);
    let _ = ExtentStore::open(Arc::new(disk), opts());
});
