//! Writes a small seed corpus for the fuzz targets (fuzz/corpus is git-ignored; seeds are generated, never
//! committed). Run from anywhere:
//!
//! ```text
//! cargo run --release --manifest-path fuzz/Cargo.toml --example gen_seeds [CORPUS_DIR]
//! ```
//!
//! CORPUS_DIR defaults to `fuzz/corpus`; seeds go to `CORPUS_DIR/<target>/seed-*`. Existing files with the
//! same names are overwritten, others are left alone.

use std::path::PathBuf;

use bytes::Bytes;
use nacre_proto::msg::RemoteError;
use nacre_proto::msg::sys::{EchoRequest, PingRequest, PingResponse};
use nacre_proto::{Flags, Frame, Kind, Op, encode_body};

fn frames() -> Vec<Frame> {
    let ping = PingResponse {
        name: "data-3".into(),
        version: "0.1.0".into(),
    };
    let error = RemoteError {
        code: 6,
        message: "not leader".into(),
        leader_hint: Some("127.0.0.1:9000".into()),
    };
    let mut flagged = Frame::new(
        Kind::OneWay,
        Op(0x0401),
        0,
        Bytes::from_static(b"raft"),
        Bytes::from_static(b"entries"),
    );
    flagged.header.flags = Flags::BACKGROUND;
    flagged.header.seq = 9;
    vec![
        Frame::new(
            Kind::Request,
            Op(0x0001),
            1,
            encode_body(&PingRequest {}),
            Bytes::new(),
        ),
        Frame::new(
            Kind::Response,
            Op(0x0001),
            1,
            encode_body(&ping),
            Bytes::new(),
        ),
        Frame::new(
            Kind::Request,
            Op(0x0002),
            2,
            encode_body(&EchoRequest {}),
            Bytes::from_static(b"echo this data segment"),
        ),
        Frame::new(
            Kind::Error,
            Op(0x0002),
            3,
            encode_body(&error),
            Bytes::new(),
        ),
        Frame::new(Kind::OneWay, Op(0), 0, Bytes::new(), Bytes::new()),
        flagged,
    ]
}

fn main() -> std::io::Result<()> {
    let root = std::env::args_os()
        .nth(1)
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("corpus"));

    // frame_decode: first byte = streaming chunk size (0 = all at once), then the wire bytes.
    let dir = root.join("frame_decode");
    std::fs::create_dir_all(&dir)?;
    let frames = frames();
    let mut n = 0;
    for (i, f) in frames.iter().enumerate() {
        for selector in [0u8, 1, 7] {
            let mut seed = vec![selector];
            seed.extend_from_slice(&f.to_bytes());
            std::fs::write(dir.join(format!("seed-{n:02}")), &seed)?;
            n += 1;
        }
        // Two frames back to back.
        let next = &frames[(i + 1) % frames.len()];
        let mut seed = vec![13u8];
        seed.extend_from_slice(&f.to_bytes());
        seed.extend_from_slice(&next.to_bytes());
        std::fs::write(dir.join(format!("seed-{n:02}")), &seed)?;
        n += 1;
    }

    // body_decode: postcard bodies.
    let dir = root.join("body_decode");
    std::fs::create_dir_all(&dir)?;
    let bodies = [
        encode_body(&RemoteError {
            code: 6,
            message: "not leader".into(),
            leader_hint: Some("127.0.0.1:9000".into()),
        }),
        encode_body(&RemoteError {
            code: 999,
            message: String::new(),
            leader_hint: None,
        }),
        encode_body(&PingResponse {
            name: "meta-1".into(),
            version: "0.1.0".into(),
        }),
    ];
    for (i, b) in bodies.iter().enumerate() {
        std::fs::write(dir.join(format!("seed-{i:02}")), b)?;
    }
    eprintln!(
        "wrote {n} frame_decode and {} body_decode seeds under {}",
        bodies.len(),
        root.display()
    );
    Ok(())
}
