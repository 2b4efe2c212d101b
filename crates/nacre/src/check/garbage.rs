//! Bad input on every port (issue 8: "malformed frames, oversized lengths and random bytes sent to
//! every port get a clean error and leave the node serving").
//!
//! Every case is raw bytes on a fresh TCP connection. A clean outcome is an error answer (an
//! error frame, a 4xx) or the server closing the connection, within a deadline. A hang counts as a
//! problem although nothing is lost: a peer that pins a connection and its buffers with a few
//! bytes can exhaust a node. The node's liveness probe runs after every case, so a node that stops
//! serving is blamed on the case that broke it.

use std::fmt;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use fastrand::Rng;
use nacre_msgr::{CallOptions, Client, Payload};
use nacre_proto::msg::raft::RaftBatchRpc;
use nacre_proto::msg::sys::{Echo, Ping, PingRequest};
use nacre_proto::msg::{RemoteError, Rpc, decode_body, encode_body};
use nacre_proto::{Decoder, Frame, FrameLimits, HEADER_LEN, Kind, Op};
use nacre_types::{ErrorCode, crc32c};
use serde::Serialize;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::task::JoinSet;

/// Time one case (connect, send, answer) may take before it counts as a hang.
pub const DEADLINE: Duration = Duration::from_secs(5);
/// Connections opened at once by the flood cases.
const FLOOD: usize = 200;
/// Request id of the ping sent behind a frame the server must drop without answering.
const PING_ID: u64 = 7;

/// Which protocol a port speaks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum PortKind {
    Msgr,
    Http,
}

/// What one port did with the bad inputs.
#[derive(Clone, Debug, Serialize)]
pub struct GarbageReport {
    pub port: String,
    pub kind: PortKind,
    /// Bad inputs sent (a flood of connections is one case).
    pub cases: usize,
    /// Cases answered with an error or a close in time.
    pub clean: usize,
    /// One line per unclean case, and one if the node stopped answering its liveness probe.
    pub problems: Vec<String>,
    /// The node did not answer its liveness probe before the first bad input (the cases ran
    /// anyway; their problems say nothing about bad input then).
    pub down_before: bool,
}

impl fmt::Display for GarbageReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (port, kind, clean, cases) = (&self.port, self.kind, self.clean, self.cases);
        write!(f, "{kind:?} {port}: {clean} of {cases} bad inputs clean")?;
        if let Some(first) = self.problems.first() {
            write!(f, "; {} problems, first: {first}", self.problems.len())?;
        }
        Ok(())
    }
}

/// Sends a fixed set of bad inputs to a messenger port, each on a fresh connection, and checks
/// that each gets an error frame or a close within [`DEADLINE`], and that `addr` answers a ping
/// after each.
pub async fn hammer_msgr(client: &Client, addr: &str, seed: u64) -> GarbageReport {
    hammer_msgr_within(client, addr, seed, DEADLINE).await
}

/// [`hammer_msgr`] with another deadline per case (tests use a short one).
pub async fn hammer_msgr_within(
    client: &Client,
    addr: &str,
    seed: u64,
    deadline: Duration,
) -> GarbageReport {
    let opts = CallOptions {
        timeout: Some(deadline),
        ..CallOptions::default()
    };
    // The call's timeout covers connecting too.
    let alive = async || {
        let ping = client.call_with::<Ping>(addr, &PingRequest {}, Payload::none(), opts);
        ping.await.map(|_| ()).map_err(Problem::Ping)
    };
    let cases = msgr_cases(&mut Rng::with_seed(seed));
    hammer(addr, PortKind::Msgr, cases, deadline, alive).await
}

/// The same for an HTTP port: each bad request must get a 4xx or a close within [`DEADLINE`], never
/// a 5xx or a success, and `GET /metrics` must answer 200 after each.
pub async fn hammer_http(addr: &str, seed: u64) -> GarbageReport {
    hammer_http_within(addr, seed, DEADLINE).await
}

/// [`hammer_http`] with another deadline per case.
pub async fn hammer_http_within(addr: &str, seed: u64, deadline: Duration) -> GarbageReport {
    let probe = Case::new("GET /metrics", get(""), Expect::Http200);
    let alive = async || {
        let answer = tokio::time::timeout(deadline, attempt(addr, &probe)).await;
        answer.unwrap_or(Err(Problem::NoAnswerWithin(deadline)))
    };
    let cases = http_cases(&mut Rng::with_seed(seed));
    hammer(addr, PortKind::Http, cases, deadline, alive).await
}

/// Runs every case with the liveness probe `alive` after each.
async fn hammer(
    addr: &str,
    kind: PortKind,
    cases: Vec<Case>,
    deadline: Duration,
    alive: impl AsyncFn() -> Result<(), Problem>,
) -> GarbageReport {
    let (port, count) = (addr.to_string(), cases.len());
    let mut problems = Vec::new();
    // A node already down is reported as such, not blamed on the first case; the cases still run.
    let mut serving = true;
    if let Err(e) = alive().await {
        serving = false;
        problems.push(format!("not serving before any bad input: {e}"));
    }
    let down_before = !serving;
    let mut clean = 0;
    for c in &cases {
        let name = &c.name;
        match tokio::time::timeout(deadline, run_case(addr, c)).await {
            Ok(Ok(())) => clean += 1,
            Ok(Err(e)) => problems.push(format!("{name}: {e}")),
            Err(_) => problems.push(format!("{name}: no answer in {deadline:?} (hang)")),
        }
        if serving && let Err(e) = alive().await {
            serving = false;
            problems.push(format!("stopped serving after {name}: {e}"));
        }
    }
    GarbageReport {
        port,
        kind,
        cases: count,
        clean,
        problems,
        down_before,
    }
}

/// One bad input.
#[derive(Clone, Debug)]
struct Case {
    name: String,
    bytes: Bytes,
    expect: Expect,
    /// Close our sending side after the bytes: for inputs a server rightly waits to see more of.
    eof: bool,
    /// Connections sending `bytes` at once.
    conns: usize,
}

/// What a clean outcome is, besides a close.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Expect {
    /// Nothing: hang up at once.
    Nothing,
    /// An error frame whose code is not `Internal` (the protocol's 5xx).
    Error,
    /// The response to the ping ([`PING_ID`]) behind frames the server must drop silently.
    Ping,
    Http4xx,
    /// The liveness probe.
    Http200,
}

impl Case {
    fn new(name: impl Into<String>, bytes: impl Into<Bytes>, expect: Expect) -> Self {
        let (name, bytes) = (name.into(), bytes.into());
        Self {
            name,
            bytes,
            expect,
            eof: false,
            conns: 1,
        }
    }

    fn eof(self) -> Self {
        Self { eof: true, ..self }
    }

    fn times(self, conns: usize) -> Self {
        Self { conns, ..self }
    }
}

/// What was wrong with a port's answer to a bad input, or to its liveness probe.
#[derive(Debug, thiserror::Error)]
enum Problem {
    #[error("ping failed: {0}")]
    Ping(#[source] nacre_msgr::MsgrError),
    #[error("no answer within {0:?}")]
    NoAnswerWithin(Duration),
    #[error("task failed: {0}")]
    Task(#[from] tokio::task::JoinError),
    /// Some of a case's connections (`failed` of `conns`) had a problem; `first` is the first.
    #[error("{failed} of {conns} connections: {first}")]
    Connections {
        failed: usize,
        conns: usize,
        first: Box<Problem>,
    },
    #[error("cannot connect: {0}")]
    Connect(#[source] std::io::Error),
    #[error("closed without an answer")]
    NoAnswer,
    #[error("server error {0}")]
    ServerError(u16),
    #[error("answered {0}")]
    Answered(u16),
    #[error("answer is not a valid frame: {0}")]
    BadFrame(#[source] nacre_proto::FrameError),
    #[error("closed after {0} bytes of a frame")]
    ClosedMidFrame(usize),
    #[error("internal error: {0}")]
    Internal(RemoteError),
    /// An error frame whose body is not an error.
    #[error("error frame: {0}")]
    BadErrorFrame(#[source] nacre_proto::msg::DecodeError),
    #[error("answered with a {kind:?} frame ({op}, id {id})")]
    Unexpected { kind: Kind, op: Op, id: u64 },
    #[error("not an HTTP status line: {0:?}")]
    NotHttp(String),
}

/// Runs a case on one connection, or on `conns` at once.
async fn run_case(addr: &str, c: &Case) -> Result<(), Problem> {
    if c.conns == 1 {
        return attempt(addr, c).await;
    }
    let mut set = JoinSet::new();
    for _ in 0..c.conns {
        let (addr, c) = (addr.to_string(), c.clone());
        set.spawn(async move { attempt(&addr, &c).await });
    }
    let (mut failed, mut first) = (0, None);
    while let Some(joined) = set.join_next().await {
        if let Err(e) = joined.unwrap_or_else(|e| Err(e.into())) {
            failed += 1;
            first.get_or_insert(e);
        }
    }
    match first {
        None => Ok(()),
        Some(e) => Err(Problem::Connections {
            failed,
            conns: c.conns,
            first: Box::new(e),
        }),
    }
}

async fn attempt(addr: &str, c: &Case) -> Result<(), Problem> {
    let connect = TcpStream::connect(addr).await;
    let mut s = connect.map_err(Problem::Connect)?;
    // A failed write means the server already hung up, which the read below sees as a close.
    let _ = s.write_all(&c.bytes).await;
    if c.eof {
        let _ = s.shutdown().await;
    }
    let status = match c.expect {
        Expect::Nothing => return Ok(()),
        Expect::Error | Expect::Ping => return frame_answer(&mut s, c.expect).await,
        Expect::Http4xx | Expect::Http200 => http_status(&mut s).await?,
    };
    match (status, c.expect) {
        (None, Expect::Http4xx) | (Some(400..500), Expect::Http4xx) => Ok(()),
        (Some(200), Expect::Http200) => Ok(()),
        (None, _) => Err(Problem::NoAnswer),
        (Some(status @ 500..), _) => Err(Problem::ServerError(status)),
        (Some(status), _) => Err(Problem::Answered(status)),
    }
}

/// Reads the server's first frame and judges it; a close (or reset) before any byte is clean.
async fn frame_answer(s: &mut TcpStream, expect: Expect) -> Result<(), Problem> {
    let (mut buf, mut decoder) = (BytesMut::new(), Decoder::new(FrameLimits::default()));
    let f = loop {
        match decoder.decode(&mut buf) {
            Ok(Some(f)) => break f,
            Ok(None) => {}
            Err(e) => return Err(Problem::BadFrame(e)),
        }
        match s.read_buf(&mut buf).await {
            // A reset is a close too: the server may hang up with our bytes still unread.
            Ok(0) | Err(_) if buf.is_empty() => return Ok(()),
            Ok(0) | Err(_) => return Err(Problem::ClosedMidFrame(buf.len())),
            Ok(_) => {}
        }
    };
    let (kind, op, id) = (f.header.kind, f.header.op, f.header.request_id);
    match kind {
        Kind::Error => match decode_body::<RemoteError>("error", &f.body) {
            Ok(e) if e.code() == ErrorCode::Internal => Err(Problem::Internal(e)),
            Ok(_) => Ok(()),
            Err(e) => Err(Problem::BadErrorFrame(e)),
        },
        Kind::Response if expect == Expect::Ping && id == PING_ID => Ok(()),
        _ => Err(Problem::Unexpected { kind, op, id }),
    }
}

/// The status code of an HTTP answer, or `None` if the server closes (or resets) without one.
async fn http_status(s: &mut TcpStream) -> Result<Option<u16>, Problem> {
    let mut buf = Vec::new();
    // The status line is all we need; stop at its end, a close or an absurd length.
    while !buf.contains(&b'\n') && buf.len() < 4096 {
        match s.read_buf(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(_) => {}
        }
    }
    if buf.is_empty() {
        return Ok(None);
    }
    let line = String::from_utf8_lossy(&buf[..buf.len().min(80)]);
    // "HTTP/1.1 404 Not Found"
    match line.get(9..12).map(str::parse) {
        Some(Ok(status)) if line.starts_with("HTTP/1.") => Ok(Some(status)),
        _ => Err(Problem::NotHttp(line.into_owned())),
    }
}

/// `n` bytes from `rng`, seeded from the run's seed so that a failing run can be replayed.
fn random_bytes(rng: &mut Rng, n: usize) -> Vec<u8> {
    let mut v = vec![0; n];
    rng.fill(&mut v);
    v
}

fn frame(kind: Kind, op: Op, id: u64, body: Vec<u8>, data: Vec<u8>) -> Vec<u8> {
    Frame::new(kind, op, id, body.into(), data.into()).to_bytes()
}

/// A valid header (CRC included) announcing `body_len` + `data_len` bytes that never follow.
fn header(op: Op, body_len: u32, data_len: u32) -> [u8; HEADER_LEN] {
    let mut h = Frame::new(Kind::Request, op, 1, Bytes::new(), Bytes::new()).header;
    (h.body_len, h.data_len) = (body_len, data_len);
    h.encode()
}

/// A valid ping header with byte `at` set to `value`; the header CRC is recomputed unless `at` is
/// part of it, so only that field is wrong.
fn bad_header(at: usize, value: u8) -> Vec<u8> {
    let mut h = header(Ping::OP, 0, 0);
    h[at] = value;
    if at < 44 {
        let crc = crc32c(&h[..44]);
        h[44..].copy_from_slice(&crc.to_le_bytes());
    }
    h.to_vec()
}

fn ping() -> Vec<u8> {
    let body = encode_body(&PingRequest {}).to_vec();
    frame(Kind::Request, Ping::OP, PING_ID, body, vec![])
}

/// A frame for `R`'s op whose body is random bytes that `R::Request` does not decode, checked with
/// the receiver's own decoder, so a real node never runs the handler (and never writes) on them.
fn garbage<R: Rpc>(rng: &mut Rng, kind: Kind) -> Vec<u8> {
    let body = (0..64)
        .map(|_| random_bytes(rng, 24))
        .find(|b| decode_body::<R::Request>(R::NAME, b).is_err())
        // Ten 0xff bytes are an overlong varint, which no message type decodes.
        .unwrap_or_else(|| vec![0xff; 24]);
    frame(kind, R::OP, 1, body, vec![])
}

#[rustfmt::skip] // one case a line
fn msgr_cases(rng: &mut Rng) -> Vec<Case> {
    let mut v = Vec::new();
    // Less than a header: the server rightly waits for more, so end it by closing our side.
    for len in [0, 1, 47] {
        let name = format!("{len} random bytes, then close");
        v.push(Case::new(name, random_bytes(rng, len), Expect::Error).eof());
    }
    let echo = frame(Kind::Request, Echo::OP, 1, random_bytes(rng, 16), random_bytes(rng, 1000));
    let truncated = echo[..HEADER_LEN + 500].to_vec();
    v.push(Case::new("truncated frame, then close", truncated, Expect::Error).eof());
    let (mut body_crc, mut data_crc) = (echo.clone(), echo);
    body_crc[HEADER_LEN] ^= 1;
    data_crc[HEADER_LEN + 16] ^= 1;
    let (mut b48, mut b4k) = (random_bytes(rng, HEADER_LEN), random_bytes(rng, 4096));
    b48[0] |= 0x80; // never "NACR"
    b4k[0] |= 0x80;
    let curl = b"GET / HTTP/1.1\r\nHost: nacre\r\nUser-Agent: curl/8.5.0\r\nAccept: */*\r\n\r\n";
    let mut oneway = garbage::<RaftBatchRpc>(rng, Kind::OneWay);
    oneway.extend(ping());
    let mut stray = frame(Kind::Response, Ping::OP, 99, vec![], vec![]);
    stray.extend(ping());
    let errors = [
        ("48 random bytes", b48),
        ("4096 random bytes", b4k),
        ("an HTTP request", curl.to_vec()),
        ("bad magic", bad_header(0, b'X')),
        ("protocol version 2", bad_header(4, 2)),
        ("unknown frame kind", bad_header(5, 9)),
        ("reserved bits set", bad_header(10, 1)),
        ("header CRC wrong", bad_header(44, !header(Ping::OP, 0, 0)[44])),
        // Nothing follows these headers, so only a server that rejects them at once (before
        // reserving the announced bytes) answers in time.
        ("data length u32::MAX", header(Echo::OP, 0, u32::MAX).to_vec()),
        ("body length 1 GiB", header(Echo::OP, 1 << 30, 0).to_vec()),
        ("body + data past u32", header(Echo::OP, u32::MAX, u32::MAX).to_vec()),
        ("body CRC mismatch", body_crc),
        ("data CRC mismatch", data_crc),
        ("unknown op", frame(Kind::Request, Op(0xfffe), 1, vec![], vec![])),
        ("garbage data append", garbage::<nacre_api::data::Append>(rng, Kind::Request)),
        ("garbage meta write", garbage::<nacre_api::meta::rpc::MetaWrite>(rng, Kind::Request)),
        ("garbage master command", garbage::<nacre_master::rpc::Execute>(rng, Kind::Request)),
    ];
    v.extend(errors.into_iter().map(|(name, b)| Case::new(name, b, Expect::Error)));
    // Frames nobody answers: the server drops them and must keep serving the same connection.
    v.push(Case::new("garbage one-way raft batch, then a ping", oneway, Expect::Ping));
    v.push(Case::new("a response sent to a server, then a ping", stray, Expect::Ping));
    let name = format!("{FLOOD} connections opened and closed");
    v.push(Case::new(name, vec![], Expect::Nothing).times(FLOOD));
    let name = format!("{FLOOD} connections at once with a bad magic");
    v.push(Case::new(name, bad_header(0, b'X'), Expect::Error).times(FLOOD));
    v
}

fn get(headers: &str) -> Vec<u8> {
    let close = "Host: nacre\r\nConnection: close\r\n";
    format!("GET /metrics HTTP/1.1\r\n{close}{headers}\r\n").into_bytes()
}

/// A JSON POST to the master's admin API (other nodes answer 404).
fn post(path: &str, headers: &str, body: &[u8]) -> Vec<u8> {
    let json = "Host: nacre\r\nContent-Type: application/json\r\n";
    let mut b = format!("POST /api/v1/{path} HTTP/1.1\r\n{json}{headers}\r\n").into_bytes();
    b.extend_from_slice(body);
    b
}

#[rustfmt::skip] // one case a line
fn http_cases(rng: &mut Rng) -> Vec<Case> {
    let mut v = Vec::new();
    // Random bytes may be a valid request prefix the server waits to see the rest of.
    for len in [0, 1, 64, 4096] {
        let name = format!("{len} random bytes, then close");
        v.push(Case::new(name, random_bytes(rng, len), Expect::Http4xx).eof());
    }
    let cut = get("");
    let cut = cut[..cut.len() - 2].to_vec();
    v.push(Case::new("headers cut short, then close", cut, Expect::Http4xx).eof());
    let cl = |len: &dyn fmt::Display| format!("Content-Length: {len}\r\n");
    let random = random_bytes(rng, 256);
    let errors = [
        ("a messenger frame", ping()),
        ("request line without a version", b"GET /metrics\r\n\r\n".to_vec()),
        ("HTTP version 9.9", b"GET /metrics HTTP/9.9\r\n\r\n".to_vec()),
        ("NUL in the method", b"G\0T /metrics HTTP/1.1\r\n\r\n".to_vec()),
        ("header without a colon", get("Bogus header\r\n")),
        ("1 MiB header", get(&format!("X-Big: {}\r\n", "a".repeat(1 << 20)))),
        ("1000 headers", get(&"X-Many: 1\r\n".repeat(1000))),
        ("100 kB path", format!("GET /{} HTTP/1.1\r\n\r\n", "p".repeat(100_000)).into()),
        ("Content-Length 1 TB, short body", post("volumes", &cl(&1_000_000_000_000u64), b"{\"")),
        ("Content-Length past u64", post("volumes", &cl(&"99999999999999999999"), b"{}")),
        ("two Content-Lengths", post("volumes", &(cl(&2) + &cl(&3)), b"{}")),
        ("bad chunk size", post("volumes", "Transfer-Encoding: chunked\r\n", b"zz\r\n{}\r\n0\r\n")),
        ("truncated JSON", post("volumes", &cl(&9), b"{\"name\": ")),
        ("JSON of the wrong shape", post("volumes", &cl(&3), b"[1]")),
        ("random bytes as JSON", post("tenants", &cl(&random.len()), &random)),
    ];
    v.extend(errors.into_iter().map(|(name, b)| Case::new(name, b, Expect::Http4xx)));
    let name = format!("{FLOOD} connections at once with a bad request line");
    v.push(Case::new(name, &b"GET\r\n\r\n"[..], Expect::Http4xx).times(FLOOD));
    v
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;
    use std::sync::Arc;

    use axum::Json;
    use axum::http::StatusCode;
    use axum::routing::post;
    use nacre_msgr::{Messenger, MsgrConfig, Router, TcpTransport};
    use nacre_proto::msg::sys::PingResponse;
    use prometheus_client::registry::Registry;
    use tokio::net::{TcpListener, TcpSocket};
    use tokio::sync::oneshot;

    use super::*;

    /// Bounds a whole test; the deadlines inside are what it checks.
    const BOUND: Duration = Duration::from_secs(60);

    /// Loopback port 0 with room for a whole flood: tokio's `bind` queues 128 connections, and the
    /// rest of a burst of 200 waits a second for SYN retransmits, longer than the short deadlines.
    fn listen() -> (TcpListener, String) {
        let s = TcpSocket::new_v4().unwrap();
        s.bind("127.0.0.1:0".parse().unwrap()).unwrap();
        let l = s.listen(1024).unwrap();
        let addr = l.local_addr().unwrap().to_string();
        (l, addr)
    }

    fn messenger(name: &str) -> Messenger {
        Messenger::new(name, MsgrConfig::default(), Arc::new(TcpTransport)).unwrap()
    }

    async fn stop(m: Messenger) {
        let stopped = tokio::task::spawn_blocking(move || m.shutdown());
        stopped.await.unwrap();
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_messenger_server_handles_every_bad_input_cleanly() {
        let (l, addr) = listen();
        let router = Router::new()
            .route::<Ping, _, _>(|_req, _inc| async {
                let (name, version) = ("test".into(), "0".into());
                Ok((PingResponse { name, version }, Payload::none()))
            })
            // Reached only if a garbage body decoded, which the report flags as an internal error.
            .route::<nacre_api::data::Append, _, _>(|_req, _inc| async {
                Err(RemoteError::new(ErrorCode::Internal, "garbage decoded"))
            });
        let (srv, cli) = (messenger("garbage-srv"), messenger("garbage-cli"));
        let (tx, rx) = oneshot::channel::<()>();
        let stopped = async {
            let _ = rx.await;
        };
        let server = tokio::spawn(srv.serve(TcpTransport::listener(l), Arc::new(router), stopped));
        let report = tokio::time::timeout(BOUND, hammer_msgr(&cli.client(), &addr, 42))
            .await
            .unwrap();
        assert!(report.problems.is_empty(), "{report:#?}");
        assert_eq!(report.clean, report.cases);
        assert!(report.cases >= 20, "{report}");
        tx.send(()).unwrap();
        server.await.unwrap().unwrap();
        stop(cli).await;
        stop(srv).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_server_that_never_answers_is_reported_as_hanging() {
        let (l, addr) = listen();
        // Accepts and holds every connection without reading, writing or closing.
        let silent = tokio::spawn(async move {
            let mut held = Vec::new();
            while let Ok((s, _)) = l.accept().await {
                held.push(s);
            }
        });
        let cli = messenger("garbage-cli");
        let client = cli.client();
        let run = hammer_msgr_within(&client, &addr, 1, Duration::from_millis(100));
        let report = tokio::time::timeout(BOUND, run).await.unwrap();
        assert!(report.problems[0].contains("not serving"), "{report:#?}");
        let hangs = report.problems.iter().filter(|p| p.contains("(hang)"));
        let (clean, cases) = (report.clean, report.cases);
        // Every case hangs but, if it connects in time, the flood that waits for nothing.
        assert!(clean <= 1 && hangs.count() + clean == cases, "{report:#?}");
        silent.abort();
        stop(cli).await;
    }

    /// Serves the metrics router every node runs, plus `extra`, and hammers it.
    async fn hammer_router(extra: axum::Router, deadline: Duration) -> GarbageReport {
        let (l, addr) = listen();
        let app = crate::http::router(Arc::new(Registry::default())).merge(extra);
        let server = tokio::spawn(crate::http::serve(l, app, std::future::pending()));
        let run = hammer_http_within(&addr, 42, deadline);
        let report = tokio::time::timeout(BOUND, run).await.unwrap();
        // Not a graceful stop: that waits for open connections, which a hanging case leaves.
        server.abort();
        report
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_metrics_endpoint_handles_every_bad_input_cleanly() {
        let report = hammer_router(axum::Router::new(), DEADLINE).await;
        assert!(report.problems.is_empty(), "{report:#?}");
        assert_eq!(report.clean, report.cases);
    }

    /// The master's admin API decodes JSON bodies with axum's `Json`, whose 2 MB limit counts bytes
    /// as they arrive: without `http::serve`'s guard, a request that announces a terabyte and sends
    /// two bytes was never answered (this test found it).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn json_endpoints_answer_a_promised_body_that_never_comes() {
        async fn create(_: Json<HashMap<String, u64>>) -> StatusCode {
            StatusCode::CREATED
        }
        let json = axum::Router::new()
            .route("/api/v1/volumes", post(create))
            .route("/api/v1/tenants", post(create));
        let report = hammer_router(json, Duration::from_secs(1)).await;
        assert!(report.problems.is_empty(), "{report:#?}");
        assert_eq!(report.clean, report.cases);
    }
}
