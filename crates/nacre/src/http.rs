//! The HTTP endpoint every nacre process exposes: Prometheus metrics and a liveness probe (masters
//! add the admin API, see `admin.rs`).

use std::future::Future;
use std::sync::Arc;

use std::time::Duration;

use axum::Router;
use axum::extract::{Request, State};
use axum::http::{StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use prometheus_client::registry::Registry;
use tokio::net::TcpListener;

/// Content type of the OpenMetrics text exposition format.
pub const OPENMETRICS_CONTENT_TYPE: &str =
    "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// `GET /metrics` and `GET /health`.
///
/// Has no fallback of its own (unknown paths get axum's empty 404), so it can be
/// merged with other routers.
pub fn router(registry: Arc<Registry>) -> Router {
    Router::new()
        .route("/metrics", get(metrics))
        .route("/health", get(health))
        .with_state(registry)
}

/// Serves `app` on `listener` until `shutdown` completes, then waits for open connections to
/// finish.
pub async fn serve(
    listener: TcpListener,
    app: Router,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    if let Ok(addr) = listener.local_addr() {
        tracing::info!(%addr, "serving http");
    }
    let app = app.layer(axum::middleware::from_fn(guard));
    axum::serve(listener, app)
        .with_graceful_shutdown(shutdown)
        .await
}

/// Largest request body any route takes (axum's own limit for JSON bodies).
pub const MAX_BODY: u64 = 2 << 20;

/// Time a request may take, body included.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);

/// Refuses a declared body over [`MAX_BODY`] before reading any of it (413), and ends a request
/// whose body does not arrive within [`REQUEST_TIMEOUT`] (408). axum's body limit counts bytes as
/// they come, so a request that promised a terabyte and sent two bytes held its connection open
/// for good.
async fn guard(req: Request, next: Next) -> Response {
    let declared = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .map(|v| v.trim().parse::<u64>());
    match declared {
        Some(Ok(len)) if len > MAX_BODY => {
            return (
                StatusCode::PAYLOAD_TOO_LARGE,
                format!("request body of {len} bytes is over the limit of {MAX_BODY}\n"),
            )
                .into_response();
        }
        Some(Err(_)) => {
            return (StatusCode::BAD_REQUEST, "bad Content-Length\n").into_response();
        }
        _ => {}
    }
    match tokio::time::timeout(REQUEST_TIMEOUT, next.run(req)).await {
        Ok(r) => r,
        Err(_) => (
            StatusCode::REQUEST_TIMEOUT,
            format!("request not complete within {REQUEST_TIMEOUT:?}\n"),
        )
            .into_response(),
    }
}

async fn metrics(State(registry): State<Arc<Registry>>) -> Response {
    let mut body = String::new();
    match prometheus_client::encoding::text::encode(&mut body, &registry) {
        Ok(()) => ([(header::CONTENT_TYPE, OPENMETRICS_CONTENT_TYPE)], body).into_response(),
        Err(err) => {
            tracing::warn!(%err, "cannot encode metrics");
            (
                StatusCode::INTERNAL_SERVER_ERROR,
                format!("cannot encode metrics: {err}\n"),
            )
                .into_response()
        }
    }
}

async fn health() -> &'static str {
    "ok"
}

#[cfg(test)]
mod tests {
    use std::net::SocketAddr;
    use std::time::Duration;

    use prometheus_client::collector::Collector;
    use prometheus_client::encoding::DescriptorEncoder;
    use prometheus_client::metrics::counter::Counter;
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    use tokio::net::TcpStream;
    use tokio::sync::oneshot;
    use tokio::task::JoinHandle;

    use super::*;

    struct Reply {
        status_line: String,
        headers: Vec<(String, String)>,
        body: String,
    }

    impl Reply {
        fn header(&self, name: &str) -> Option<&str> {
            self.headers
                .iter()
                .find(|(k, _)| k.eq_ignore_ascii_case(name))
                .map(|(_, v)| v.as_str())
        }
    }

    /// One request on its own connection; `Connection: close` makes the server end
    /// the connection after the response, so reading to EOF reads exactly one reply.
    async fn request(addr: SocketAddr, method: &str, path: &str) -> Reply {
        let mut stream = TcpStream::connect(addr).await.expect("connect");
        let req = format!("{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
        stream.write_all(req.as_bytes()).await.expect("write");
        let mut raw = Vec::new();
        stream.read_to_end(&mut raw).await.expect("read");
        let raw = String::from_utf8(raw).expect("utf-8 reply");
        let (head, body) = raw.split_once("\r\n\r\n").expect("end of headers");
        let mut lines = head.split("\r\n");
        let status_line = lines.next().expect("status line").to_owned();
        let headers = lines
            .map(|line| {
                let (k, v) = line.split_once(':').expect("header line");
                (k.trim().to_owned(), v.trim().to_owned())
            })
            .collect();
        Reply {
            status_line,
            headers,
            body: body.to_owned(),
        }
    }

    async fn start(
        registry: Registry,
    ) -> (
        SocketAddr,
        oneshot::Sender<()>,
        JoinHandle<std::io::Result<()>>,
    ) {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("local addr");
        let (stop, stopped) = oneshot::channel::<()>();
        let server = tokio::spawn(serve(listener, router(Arc::new(registry)), async {
            let _ = stopped.await;
        }));
        (addr, stop, server)
    }

    async fn shut_down(stop: oneshot::Sender<()>, server: JoinHandle<std::io::Result<()>>) {
        stop.send(()).expect("server still running");
        // The timeout only bounds a hang; the join is the synchronization.
        tokio::time::timeout(Duration::from_secs(10), server)
            .await
            .expect("serve returns after shutdown")
            .expect("serve task")
            .expect("serve result");
    }

    #[tokio::test]
    async fn serves_metrics_health_and_404_then_shuts_down() {
        let mut registry = Registry::default();
        let requests = Counter::<u64>::default();
        registry.register("requests", "Requests handled", requests.clone());
        requests.inc_by(3);
        let (addr, stop, server) = start(registry).await;

        let reply = request(addr, "GET", "/metrics").await;
        assert_eq!(reply.status_line, "HTTP/1.1 200 OK");
        assert_eq!(reply.header("content-type"), Some(OPENMETRICS_CONTENT_TYPE));
        assert!(
            reply.body.lines().any(|line| line == "requests_total 3"),
            "{}",
            reply.body
        );
        assert!(reply.body.ends_with("# EOF\n"), "{}", reply.body);

        let reply = request(addr, "GET", "/health").await;
        assert_eq!(reply.status_line, "HTTP/1.1 200 OK");
        assert_eq!(reply.body, "ok");

        let reply = request(addr, "GET", "/nope").await;
        assert_eq!(reply.status_line, "HTTP/1.1 404 Not Found");

        // Counters read at encode time, not at registration.
        requests.inc();
        let reply = request(addr, "GET", "/metrics").await;
        assert!(
            reply.body.lines().any(|line| line == "requests_total 4"),
            "{}",
            reply.body
        );

        shut_down(stop, server).await;
        assert!(TcpStream::connect(addr).await.is_err(), "listener closed");
    }

    #[derive(Debug)]
    struct Broken;

    impl Collector for Broken {
        fn encode(&self, _: DescriptorEncoder<'_>) -> Result<(), std::fmt::Error> {
            Err(std::fmt::Error)
        }
    }

    #[tokio::test]
    async fn encoding_error_is_500() {
        let mut registry = Registry::default();
        registry.register_collector(Box::new(Broken));
        let (addr, stop, server) = start(registry).await;

        let reply = request(addr, "GET", "/metrics").await;
        assert_eq!(reply.status_line, "HTTP/1.1 500 Internal Server Error");
        assert!(
            reply.body.contains("cannot encode metrics"),
            "{}",
            reply.body
        );

        shut_down(stop, server).await;
    }

    /// A request that promises more body than any route takes gets 413 at once, even on a JSON
    /// route (whose extractor would otherwise wait for the bytes forever).
    #[tokio::test]
    async fn an_oversized_declared_body_is_refused_before_it_is_read() {
        async fn echo(axum::Json(v): axum::Json<serde_json::Value>) -> String {
            v.to_string()
        }
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("local addr");
        let (stop, stopped) = oneshot::channel::<()>();
        let app = Router::new().route("/j", axum::routing::post(echo));
        let server = tokio::spawn(serve(listener, app, async {
            let _ = stopped.await;
        }));
        for (len, want) in [
            ("1000000000000", "HTTP/1.1 413 Payload Too Large"),
            ("99999999999999999999999", "HTTP/1.1 400 Bad Request"),
        ] {
            let mut stream = TcpStream::connect(addr).await.expect("connect");
            let req = format!(
                "POST /j HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len}\r\n\r\n{{\""
            );
            stream.write_all(req.as_bytes()).await.expect("write");
            let mut raw = vec![0u8; 512];
            let n = tokio::time::timeout(Duration::from_secs(10), stream.read(&mut raw))
                .await
                .expect("an answer, not a hang")
                .expect("read");
            let raw = String::from_utf8_lossy(&raw[..n]);
            assert!(raw.starts_with(want), "{len}: {raw}");
        }
        shut_down(stop, server).await;
    }
}
