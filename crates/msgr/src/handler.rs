//! What a server does with requests: the [`Handler`] trait and a typed [`Router`].

use std::collections::HashMap;
use std::fmt;
use std::future::Future;
use std::sync::Arc;

use bytes::Bytes;
use nacre_proto::msg::{RemoteError, Rpc, decode_body, encode_body};
use nacre_proto::{Flags, Kind, Op};
use nacre_types::{ErrorCode, crc32c};

use crate::transport::BoxFuture;

/// A raw data segment and, when known, its CRC-32C.
///
/// Received data always carries its verified CRC; passing it on unchanged (an echo, a replica forward)
/// reuses that CRC instead of computing it again.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Payload {
    pub bytes: Bytes,
    pub crc: Option<u32>,
}

impl Payload {
    /// No data segment.
    pub fn none() -> Self {
        Self::default()
    }

    /// Data whose CRC the messenger computes when sending.
    pub fn new(bytes: Bytes) -> Self {
        Self { bytes, crc: None }
    }

    /// Data with a CRC the caller vouches for (a wrong one makes the receiver reject the frame).
    pub fn with_crc(bytes: Bytes, crc: u32) -> Self {
        Self {
            bytes,
            crc: Some(crc),
        }
    }

    /// The CRC, computing it if unknown.
    pub fn crc(&self) -> u32 {
        match self.crc {
            Some(c) => c,
            None if self.bytes.is_empty() => 0,
            None => crc32c(&self.bytes),
        }
    }

    pub fn len(&self) -> usize {
        self.bytes.len()
    }

    pub fn is_empty(&self) -> bool {
        self.bytes.is_empty()
    }
}

/// A request (or one-way message) as the server sees it.
#[derive(Clone, Debug)]
pub struct Request {
    pub kind: Kind,
    pub op: Op,
    pub flags: Flags,
    /// The peer's address as the transport reports it.
    pub peer: Arc<str>,
    pub body: Bytes,
    pub data: Payload,
}

/// A successful reply.
#[derive(Clone, Debug, Default)]
pub struct Reply {
    pub body: Bytes,
    pub data: Payload,
}

/// Serves requests. For one-way messages the result is discarded (errors are only logged).
///
/// The returned future is polled once on the connection's worker; if it completes at once, the reply
/// is written without a task switch, otherwise it is spawned on the same worker.
pub trait Handler: Send + Sync + 'static {
    fn call(&self, req: Request) -> BoxFuture<'static, Result<Reply, RemoteError>>;

    /// The op's name, for metrics (`nacre_msgr_server_seconds{op=...}`); `None` labels it by number.
    fn op_name(&self, op: Op) -> Option<&'static str> {
        let _ = op;
        None
    }
}

impl<F> Handler for F
where
    F: Fn(Request) -> BoxFuture<'static, Result<Reply, RemoteError>> + Send + Sync + 'static,
{
    fn call(&self, req: Request) -> BoxFuture<'static, Result<Reply, RemoteError>> {
        self(req)
    }
}

type Route = Box<dyn Fn(Request) -> BoxFuture<'static, Result<Reply, RemoteError>> + Send + Sync>;

/// Dispatches by op code to typed handlers; unknown ops get `UnknownOp`, undecodable bodies
/// `BadRequest`.
#[derive(Default)]
pub struct Router {
    routes: HashMap<Op, (&'static str, Route)>,
}

impl fmt::Debug for Router {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut names: Vec<_> = self.routes.values().map(|(n, _)| *n).collect();
        names.sort_unstable();
        f.debug_struct("Router").field("routes", &names).finish()
    }
}

/// What a typed handler receives besides its decoded body.
#[derive(Clone, Debug)]
pub struct Incoming {
    pub peer: Arc<str>,
    pub flags: Flags,
    pub data: Payload,
}

impl Router {
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds a handler for `R`. Registering the same op twice is a programming error and panics.
    pub fn route<R, F, Fut>(mut self, f: F) -> Self
    where
        R: Rpc,
        F: Fn(R::Request, Incoming) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<(R::Response, Payload), RemoteError>> + Send + 'static,
    {
        let f = Arc::new(f);
        let route: Route = Box::new(move |req: Request| {
            let f = Arc::clone(&f);
            Box::pin(async move {
                let body: R::Request = decode_body(R::NAME, &req.body)
                    .map_err(|e| RemoteError::new(ErrorCode::BadRequest, e.to_string()))?;
                let incoming = Incoming {
                    peer: req.peer,
                    flags: req.flags,
                    data: req.data,
                };
                let (resp, data) = f(body, incoming).await?;
                Ok(Reply {
                    body: encode_body(&resp),
                    data,
                })
            })
        });
        let prev = self.routes.insert(R::OP, (R::NAME, route));
        assert!(prev.is_none(), "op {} registered twice", R::OP);
        self
    }
}

impl Router {
    /// Combines two routers (e.g. a role's ops and its raft traffic). An op served by both is a
    /// programming error and panics.
    pub fn merge(mut self, other: Router) -> Self {
        for (op, route) in other.routes {
            let prev = self.routes.insert(op, route);
            assert!(prev.is_none(), "op {op} registered twice");
        }
        self
    }
}

impl Handler for Router {
    fn op_name(&self, op: Op) -> Option<&'static str> {
        self.routes.get(&op).map(|(name, _)| *name)
    }

    fn call(&self, req: Request) -> BoxFuture<'static, Result<Reply, RemoteError>> {
        match self.routes.get(&req.op) {
            Some((_, route)) => route(req),
            None => {
                let op = req.op;
                Box::pin(async move {
                    Err(RemoteError::new(
                        ErrorCode::UnknownOp,
                        format!("no handler for {op}"),
                    ))
                })
            }
        }
    }
}
