//! Block frames: round trips, the frame's validation errors, and that no damaged frame decodes to
//! wrong data or panics.

#![allow(clippy::unwrap_used)] // helpers and proptest bodies outside #[test] fns

use nacre_func::{
    BlockHeader, Codec, CodecId, FLAG_RAW, FuncError, HEADER_LEN, MAX_BLOCK_LEN, MIN_SAVING_SHIFT,
    checksum, compress_block, decompress_block, read_header,
};
use proptest::prelude::*;

const CODECS: [Codec; 6] = [
    Codec::None,
    Codec::Zstd { level: 1 },
    Codec::Zstd { level: 3 },
    Codec::Zstd { level: -5 },
    Codec::Zstd { level: 19 },
    Codec::Lz4,
];

const WORDS: [&str; 16] = [
    "the ",
    "extent ",
    "partition ",
    "leader ",
    "replica ",
    "raft ",
    "inode ",
    "of ",
    "a ",
    "\n",
    "write ",
    "read ",
    "42 ",
    "node-7 ",
    "volume ",
    "stripe ",
];

/// Text-like bytes: words from a small vocabulary, compressible by every codec.
fn text(choices: &[usize]) -> Vec<u8> {
    choices
        .iter()
        .flat_map(|&i| WORDS[i % WORDS.len()].bytes())
        .collect()
}

fn codec() -> impl Strategy<Value = Codec> {
    prop::sample::select(CODECS.to_vec())
}

/// Random bytes, text-like bytes, or runs of one byte; up to `max` bytes.
fn block(max: usize) -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        prop::collection::vec(any::<u8>(), 0..max),
        prop::collection::vec(any::<usize>(), 0..max / 6).prop_map(|c| text(&c)),
        (any::<u8>(), 0..max).prop_map(|(b, n)| vec![b; n]),
        Just(Vec::new()),
    ]
}

/// Rewrites the header's CRC after a test changed its fields, so that the later checks are reached.
fn resign(frame: &mut [u8]) {
    let crc = checksum(&frame[..20]);
    frame[20..24].copy_from_slice(&crc.to_le_bytes());
}

fn frame(codec: Codec, data: &[u8]) -> Vec<u8> {
    compress_block(codec, data).unwrap().to_vec()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 128, ..ProptestConfig::default() })]

    #[test]
    fn round_trip(codec in codec(), data in block(64 << 10)) {
        let f = compress_block(codec, &data).unwrap();
        let h = read_header(&f).unwrap();
        prop_assert_eq!(h.codec, codec.id());
        prop_assert_eq!(h.len as usize, data.len());
        prop_assert_eq!(h.crc, crc32c::crc32c(&data));
        if h.raw {
            prop_assert_eq!(&f[HEADER_LEN..], &data[..]);
        } else {
            // Kept compressed only when it saves the threshold's share.
            let saving = (data.len() >> MIN_SAVING_SHIFT).max(1);
            prop_assert!(h.stored_len as usize + saving <= data.len());
        }
        prop_assert_eq!(decompress_block(&f).unwrap(), &data[..]);
    }

    /// Any single byte changed anywhere: an error, or, only inside a compressed payload, the very
    /// same bytes (another encoding of the block). Never other bytes, never a panic.
    #[test]
    fn a_flipped_byte_never_yields_wrong_data(
        codec in codec(),
        data in block(1536),
        mask in 1u8..=255,
    ) {
        let f = frame(codec, &data);
        let raw = read_header(&f).unwrap().raw;
        for i in 0..f.len() {
            let mut bad = f.clone();
            bad[i] ^= mask;
            match decompress_block(&bad) {
                Err(_) => {}
                Ok(out) => {
                    prop_assert!(i >= HEADER_LEN && !raw, "flip at {} of a raw frame or header decoded", i);
                    prop_assert_eq!(&out[..], &data[..], "flip at {} decoded to other bytes", i);
                }
            }
        }
    }

    #[test]
    fn truncated_or_extended_frames_are_errors(codec in codec(), data in block(1536), extra in any::<u8>()) {
        let f = frame(codec, &data);
        for cut in 0..f.len() {
            prop_assert!(decompress_block(&f[..cut]).is_err(), "prefix of {} bytes decoded", cut);
        }
        let mut longer = f.clone();
        longer.push(extra);
        prop_assert!(
            matches!(decompress_block(&longer), Err(FuncError::FrameLength { .. })),
            "a frame with a trailing byte decoded"
        );
    }

    #[test]
    fn garbage_never_panics(bytes in prop::collection::vec(any::<u8>(), 0..4096)) {
        let _ = decompress_block(&bytes);
        let mut framed = b"NCB\x01".to_vec();
        framed.extend_from_slice(&bytes);
        let _ = decompress_block(&framed);
    }

    /// A well-formed, correctly signed header over a random payload: the codecs' own decoders see
    /// arbitrary input. Must be an error (the data CRC cannot match by chance here: it is chosen
    /// to differ from the decoded bytes' CRC only if decoding succeeds, so any Ok is checked).
    #[test]
    fn signed_headers_over_random_payloads_never_panic(
        codec in 0u8..3,
        raw in any::<bool>(),
        len in 0u32..8192,
        crc in any::<u32>(),
        payload in prop::collection::vec(any::<u8>(), 0..4096),
    ) {
        let mut f = vec![0u8; HEADER_LEN];
        f[..4].copy_from_slice(b"NCB\x01");
        f[4] = codec;
        f[5] = if raw { FLAG_RAW } else { 0 };
        f[8..12].copy_from_slice(&len.to_le_bytes());
        f[12..16].copy_from_slice(&(payload.len() as u32).to_le_bytes());
        f[16..20].copy_from_slice(&crc.to_le_bytes());
        resign(&mut f);
        f.extend_from_slice(&payload);
        if let Ok(out) = decompress_block(&f) {
            prop_assert_eq!(out.len() as u32, len);
            prop_assert_eq!(checksum(&out), crc);
        }
    }
}

#[test]
fn checksum_is_crc32c() {
    for data in [&b""[..], b"a", b"123456789", &[0xa5u8; 4097][..]] {
        assert_eq!(checksum(data), crc32c::crc32c(data));
    }
    // The CRC-32C check value.
    assert_eq!(checksum(b"123456789"), 0xe306_9283);
}

#[test]
fn compressible_blocks_are_compressed_and_incompressible_ones_stored_raw() {
    let text = text(&(0..20_000).map(|i| i * 7 + i / 3).collect::<Vec<_>>());
    for codec in [Codec::Zstd { level: 1 }, Codec::Lz4] {
        let h = read_header(&frame(codec, &text)).unwrap();
        assert!(
            !h.raw && (h.stored_len as usize) < text.len() / 2,
            "{codec:?}: {h:?}"
        );
    }
    // An LCG's high bytes: no codec shrinks them.
    let mut x = 0x1234_5678_9abc_def0u64;
    let noise: Vec<u8> = (0..65536)
        .map(|_| {
            x = x
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            (x >> 56) as u8
        })
        .collect();
    for codec in CODECS {
        let f = frame(codec, &noise);
        let h = read_header(&f).unwrap();
        assert!(h.raw, "{codec:?}");
        assert_eq!(h.codec, codec.id());
        assert_eq!(f.len(), HEADER_LEN + noise.len());
    }
    // Codec none is always raw, even for compressible data.
    assert!(read_header(&frame(Codec::None, &text)).unwrap().raw);
}

#[test]
fn header_layout_is_as_documented() {
    let f = frame(Codec::Lz4, &[7u8; 1000]);
    assert_eq!(&f[0..3], b"NCB");
    assert_eq!(f[3], 1);
    assert_eq!(f[4], CodecId::Lz4 as u8);
    assert_eq!(f[5], 0);
    assert_eq!(&f[6..8], &[0, 0]);
    assert_eq!(u32::from_le_bytes(f[8..12].try_into().unwrap()), 1000);
    let stored = u32::from_le_bytes(f[12..16].try_into().unwrap());
    assert_eq!(f.len(), HEADER_LEN + stored as usize);
    assert_eq!(
        u32::from_le_bytes(f[16..20].try_into().unwrap()),
        checksum(&[7u8; 1000])
    );
    assert_eq!(
        u32::from_le_bytes(f[20..24].try_into().unwrap()),
        checksum(&f[..20])
    );
}

// ---- each validation error, reached with every earlier check satisfied ----

fn lz4_frame() -> Vec<u8> {
    frame(Codec::Lz4, &[b'x'; 300])
}

fn raw_frame() -> Vec<u8> {
    frame(Codec::None, b"hello, raw block")
}

fn edit(mut f: Vec<u8>, change: impl FnOnce(&mut Vec<u8>)) -> Result<bytes::Bytes, FuncError> {
    change(&mut f);
    resign(&mut f);
    decompress_block(&f)
}

#[test]
fn truncated_header() {
    assert_eq!(decompress_block(&[]), Err(FuncError::Truncated { len: 0 }));
    assert_eq!(
        decompress_block(&lz4_frame()[..23]),
        Err(FuncError::Truncated { len: 23 })
    );
}

#[test]
fn bad_magic() {
    let mut f = lz4_frame();
    f[0] = b'X';
    assert_eq!(
        decompress_block(&f),
        Err(FuncError::BadMagic { found: *b"XCB" })
    );
}

#[test]
fn unsupported_version() {
    let mut f = lz4_frame();
    f[3] = 2;
    assert_eq!(
        decompress_block(&f),
        Err(FuncError::UnsupportedVersion { version: 2 })
    );
}

#[test]
fn header_checksum() {
    for field in 4..24 {
        let mut f = lz4_frame();
        f[field] ^= 0x10;
        assert!(
            matches!(decompress_block(&f), Err(FuncError::HeaderChecksum { .. })),
            "byte {field}"
        );
    }
}

#[test]
fn unknown_codec() {
    assert_eq!(
        edit(lz4_frame(), |f| f[4] = 3),
        Err(FuncError::UnknownCodec { id: 3 })
    );
}

#[test]
fn unknown_flags() {
    assert_eq!(
        edit(lz4_frame(), |f| f[5] = 0x82),
        Err(FuncError::UnknownFlags { flags: 0x82 })
    );
}

#[test]
fn reserved_not_zero() {
    assert_eq!(
        edit(lz4_frame(), |f| f[7] = 1),
        Err(FuncError::ReservedNotZero)
    );
}

#[test]
fn lengths_above_the_cap() {
    let big = MAX_BLOCK_LEN + 1;
    assert_eq!(
        edit(lz4_frame(), |f| f[8..12]
            .copy_from_slice(&big.to_le_bytes())),
        Err(FuncError::BlockTooLarge {
            len: u64::from(big),
            max: MAX_BLOCK_LEN
        })
    );
    assert_eq!(
        edit(lz4_frame(), |f| f[12..16]
            .copy_from_slice(&u32::MAX.to_le_bytes())),
        Err(FuncError::BlockTooLarge {
            len: u64::from(u32::MAX),
            max: MAX_BLOCK_LEN
        })
    );
    let block = vec![0u8; MAX_BLOCK_LEN as usize + 1];
    assert_eq!(
        compress_block(Codec::Lz4, &block),
        Err(FuncError::BlockTooLarge {
            len: u64::from(big),
            max: MAX_BLOCK_LEN
        })
    );
    // Exactly the cap is fine.
    let f = compress_block(Codec::Zstd { level: 1 }, &block[1..]).unwrap();
    assert_eq!(decompress_block(&f).unwrap().len(), MAX_BLOCK_LEN as usize);
}

#[test]
fn frame_length() {
    let f = lz4_frame();
    let n = f.len() as u64;
    assert_eq!(
        decompress_block(&f[..f.len() - 1]),
        Err(FuncError::FrameLength {
            expected: n,
            actual: n - 1
        })
    );
    let mut longer = f.clone();
    longer.extend_from_slice(&[0, 0]);
    assert_eq!(
        decompress_block(&longer),
        Err(FuncError::FrameLength {
            expected: n,
            actual: n + 2
        })
    );
}

#[test]
fn raw_length() {
    // A raw frame claiming a longer block than it stores.
    assert_eq!(
        edit(raw_frame(), |f| f[8..12]
            .copy_from_slice(&17u32.to_le_bytes())),
        Err(FuncError::RawLength {
            stored: 16,
            len: 17
        })
    );
}

#[test]
fn not_compressed() {
    // The raw flag cleared on a raw zstd-tried frame: a "compressed" payload as long as the block.
    let f = frame(Codec::Zstd { level: 1 }, b"hello, raw block");
    assert!(read_header(&f).unwrap().raw);
    assert_eq!(
        edit(f, |f| f[5] = 0),
        Err(FuncError::NotCompressed {
            stored: 16,
            len: 16
        })
    );
}

#[test]
fn none_not_raw() {
    assert_eq!(edit(raw_frame(), |f| f[5] = 0), Err(FuncError::NoneNotRaw));
}

#[test]
fn corrupt_payload() {
    // An lz4 block whose first match offset points before the start of the output.
    let mut f = vec![0u8; HEADER_LEN];
    f[..4].copy_from_slice(b"NCB\x01");
    f[4] = CodecId::Lz4 as u8;
    let payload = [0x0fu8, 0xff, 0xff];
    f[8..12].copy_from_slice(&100u32.to_le_bytes());
    f[12..16].copy_from_slice(&(payload.len() as u32).to_le_bytes());
    resign(&mut f);
    f.extend_from_slice(&payload);
    assert!(matches!(
        decompress_block(&f),
        Err(FuncError::Corrupt {
            codec: CodecId::Lz4,
            ..
        })
    ));

    let z = frame(Codec::Zstd { level: 1 }, &[b'z'; 300]);
    let r = edit(z, |f| {
        let n = f.len();
        f[n - 3..].copy_from_slice(&[0xff, 0xff, 0xff]);
    });
    assert!(
        matches!(
            r,
            Err(FuncError::Corrupt {
                codec: CodecId::Zstd,
                ..
            })
        ),
        "{r:?}"
    );
}

#[test]
fn decompressed_length() {
    // Valid payloads of 300 bytes under headers claiming 301.
    let lz = lz4_frame();
    assert_eq!(
        edit(lz, |f| f[8..12].copy_from_slice(&301u32.to_le_bytes())),
        Err(FuncError::DecompressedLength {
            codec: CodecId::Lz4,
            expected: 301,
            actual: 300
        })
    );
    // zstd records the content size in its own frame and refuses the mismatch itself, or
    // decodes 300: an error either way.
    let z = frame(Codec::Zstd { level: 1 }, &[b'z'; 300]);
    let r = edit(z, |f| f[8..12].copy_from_slice(&301u32.to_le_bytes()));
    assert!(
        matches!(
            r,
            Err(FuncError::DecompressedLength {
                codec: CodecId::Zstd,
                ..
            } | FuncError::Corrupt {
                codec: CodecId::Zstd,
                ..
            })
        ),
        "{r:?}"
    );
    // A header claiming fewer bytes than the payload holds: the decoder stops at the capacity.
    let r = edit(lz4_frame(), |f| {
        f[8..12].copy_from_slice(&299u32.to_le_bytes())
    });
    assert!(
        matches!(
            r,
            Err(FuncError::Corrupt {
                codec: CodecId::Lz4,
                ..
            })
        ),
        "{r:?}"
    );
}

#[test]
fn data_checksum() {
    for f in [
        lz4_frame(),
        raw_frame(),
        frame(Codec::Zstd { level: 3 }, &[b'q'; 500]),
    ] {
        let r = edit(f, |f| f[16] ^= 1);
        assert!(matches!(r, Err(FuncError::DataChecksum { .. })), "{r:?}");
    }
    // A raw payload byte changed: only the data CRC can tell.
    let mut f = raw_frame();
    f[HEADER_LEN] ^= 1;
    assert!(matches!(
        decompress_block(&f),
        Err(FuncError::DataChecksum { .. })
    ));
}

#[test]
fn bad_level() {
    let r = compress_block(Codec::Zstd { level: 1000 }, b"x");
    assert!(
        matches!(r, Err(FuncError::BadLevel { level: 1000, .. })),
        "{r:?}"
    );
    assert!(Codec::Zstd { level: i32::MIN }.validate().is_err());
    assert!(Codec::Zstd { level: 0 }.validate().is_ok());
}

#[test]
fn read_header_reports_the_fields() {
    let f = lz4_frame();
    let h = read_header(&f).unwrap();
    assert_eq!(
        h,
        BlockHeader {
            codec: CodecId::Lz4,
            raw: false,
            len: 300,
            stored_len: (f.len() - HEADER_LEN) as u32,
            crc: checksum(&[b'x'; 300]),
        }
    );
}

#[test]
fn errors_read_clearly() {
    assert_eq!(
        FuncError::FrameLength {
            expected: 40,
            actual: 39
        }
        .to_string(),
        "block frame is 39 bytes but its header says 40"
    );
    assert_eq!(
        FuncError::Corrupt {
            codec: CodecId::Zstd,
            reason: "bad".into()
        }
        .to_string(),
        "zstd payload is corrupt: bad"
    );
}
