//! Throughput of the storage functions, in bytes of the original block or stripe per second on one
//! core: `cargo bench -p nacre-func`.
//!
//! Compression runs on a text-like buffer (words from a small vocabulary, about 3:1 for zstd-1)
//! and on incompressible noise, at 64 KiB and 1 MiB. With `NACRE_FUNC_BENCH_CORPUS=DIR` the
//! buffers are also written to `DIR/{text,noise}-{64k,1m}.bin`, so that the C tools can be
//! measured on the same bytes (`zstd -b1 DIR/text-1m.bin`, `lz4 -b1 DIR/text-1m.bin`). Erasure
//! coding runs on 1 MiB of noise; reconstruct loses the first m data shards, the costliest case.

use std::hint::black_box;

use bytes::Bytes;
use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use nacre_func::{
    Codec, EcSpec, checksum, compress_block, decompress_block, ec_encode, ec_encode_bytes,
    ec_reconstruct, ec_reconstruct_verified,
};

const SIZES: [(usize, &str); 2] = [(64 << 10, "64k"), (1 << 20, "1m")];
const MIB: usize = 1 << 20;

struct Lcg(u64);

impl Lcg {
    fn next(&mut self) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        self.0 >> 33
    }
}

/// Log-like text: words drawn from a vocabulary with a skewed distribution, numbers, newlines.
fn text(len: usize) -> Vec<u8> {
    const WORDS: [&str; 40] = [
        "the",
        "a",
        "of",
        "extent",
        "partition",
        "leader",
        "replica",
        "raft",
        "inode",
        "write",
        "read",
        "volume",
        "stripe",
        "shard",
        "node",
        "client",
        "commit",
        "apply",
        "term",
        "index",
        "append",
        "snapshot",
        "election",
        "timeout",
        "heartbeat",
        "master",
        "meta",
        "data",
        "block",
        "compress",
        "flush",
        "fsync",
        "open",
        "close",
        "error",
        "ok",
        "in",
        "to",
        "and",
        "with",
    ];
    let mut rng = Lcg(7);
    let mut out = Vec::with_capacity(len + 32);
    while out.len() < len {
        let r = rng.next();
        // Squaring skews the choice towards the first words, as in natural text.
        let x = r % 1000;
        let w = (x * x * WORDS.len() as u64 / 1_000_000) as usize;
        out.extend_from_slice(WORDS[w].as_bytes());
        match (r >> 10) % 8 {
            0 => out.push(b'\n'),
            1 => out.extend_from_slice(format!(" {} ", (r >> 13) % 100_000).as_bytes()),
            2 => out.extend_from_slice(format!(" {:x} ", (r >> 13) & 0xff_ffff).as_bytes()),
            _ => out.push(b' '),
        }
    }
    out.truncate(len);
    out
}

fn noise(len: usize) -> Vec<u8> {
    let mut rng = Lcg(11);
    (0..len).map(|_| rng.next() as u8).collect()
}

fn compression(c: &mut Criterion) {
    let codecs = [
        ("zstd1", Codec::Zstd { level: 1 }),
        ("zstd3", Codec::Zstd { level: 3 }),
        ("lz4", Codec::Lz4),
    ];
    let dump = std::env::var_os("NACRE_FUNC_BENCH_CORPUS");
    for (size, size_name) in SIZES {
        for (corpus, data) in [("text", text(size)), ("noise", noise(size))] {
            if let Some(dir) = &dump {
                let path = std::path::Path::new(dir).join(format!("{corpus}-{size_name}.bin"));
                std::fs::write(&path, &data).expect("write the bench corpus");
            }
            let mut g = c.benchmark_group(format!("compress/{corpus}"));
            g.throughput(Throughput::Bytes(size as u64));
            for (name, codec) in codecs {
                let frame = compress_block(codec, &data).expect("compress");
                eprintln!(
                    "{corpus}-{size_name} {name}: {} -> {} bytes ({:.2}:1)",
                    data.len(),
                    frame.len(),
                    data.len() as f64 / frame.len() as f64
                );
                g.bench_function(BenchmarkId::new(name, size_name), |b| {
                    b.iter(|| compress_block(codec, black_box(&data)).expect("compress"))
                });
            }
            g.finish();
            let mut g = c.benchmark_group(format!("decompress/{corpus}"));
            g.throughput(Throughput::Bytes(size as u64));
            for (name, codec) in codecs {
                let frame = compress_block(codec, &data).expect("compress");
                g.bench_function(BenchmarkId::new(name, size_name), |b| {
                    b.iter(|| decompress_block(black_box(&frame)).expect("decompress"))
                });
            }
            g.finish();
        }
    }
}

fn erasure(c: &mut Criterion) {
    let data = noise(MIB);
    let specs = [(2u8, 1u8), (4, 2), (8, 3)];
    let mut g = c.benchmark_group("ec_encode");
    g.throughput(Throughput::Bytes(MIB as u64));
    for (k, m) in specs {
        let spec = EcSpec::new(k, m).expect("spec");
        g.bench_function(BenchmarkId::new(format!("{k}+{m}"), "1m"), |b| {
            b.iter(|| ec_encode(spec, black_box(&data)).expect("encode"))
        });
        let shared = Bytes::from(data.clone());
        g.bench_function(BenchmarkId::new(format!("{k}+{m}/bytes"), "1m"), |b| {
            b.iter(|| ec_encode_bytes(spec, black_box(shared.clone())).expect("encode"))
        });
    }
    g.finish();

    // The worst case: the first m *data* shards lost, so m shards are computed.
    let mut g = c.benchmark_group("ec_reconstruct");
    g.throughput(Throughput::Bytes(MIB as u64));
    for (k, m) in specs {
        let spec = EcSpec::new(k, m).expect("spec");
        let stripe = ec_encode(spec, &data).expect("encode");
        let slots: Vec<Option<Bytes>> = stripe
            .shards
            .iter()
            .enumerate()
            .map(|(i, s)| (i >= usize::from(m)).then(|| s.data.clone()))
            .collect();
        g.bench_function(BenchmarkId::new(format!("{k}+{m}"), "1m"), |b| {
            b.iter(|| {
                ec_reconstruct(spec, black_box(slots.clone()), stripe.len).expect("reconstruct")
            })
        });
        let verified: Vec<_> = stripe
            .clone()
            .into_slots()
            .into_iter()
            .enumerate()
            .map(|(i, s)| s.filter(|_| i >= usize::from(m)))
            .collect();
        g.bench_function(BenchmarkId::new(format!("{k}+{m}/verified"), "1m"), |b| {
            b.iter(|| {
                ec_reconstruct_verified(spec, black_box(verified.clone()), stripe.len)
                    .expect("reconstruct")
            })
        });
    }
    g.finish();

    let mut g = c.benchmark_group("checksum");
    g.throughput(Throughput::Bytes(MIB as u64));
    g.bench_function("1m", |b| b.iter(|| checksum(black_box(&data))));
    g.finish();
}

criterion_group!(benches, compression, erasure);
criterion_main!(benches);
