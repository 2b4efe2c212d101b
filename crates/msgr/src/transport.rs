//! How bytes move between peers: the [`Transport`] trait, its TCP implementation, and the stream types
//! the connection driver runs on.
//!
//! A connection exists in two forms. A [`DetachedStream`] belongs to no runtime and can be sent to any
//! worker thread; [`DetachedStream::attach`] registers it with the current worker's runtime and gives a
//! [`Stream`] the driver reads and writes. [`Stream::detach`] reverses that, which is what lets a later
//! balancer migrate a live connection from one worker to another without closing it.

use std::fmt;
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use crate::mem::MemStream;

/// A boxed, sendable future (the transport trait is object safe so tests can swap implementations).
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// Opens connections and listeners. Implementations: [`TcpTransport`] and [`crate::mem::MemTransport`].
pub trait Transport: Send + Sync + fmt::Debug + 'static {
    /// Binds a listener. `addr` is `host:port`; port 0 picks a free port.
    fn bind<'a>(&'a self, addr: &'a str) -> BoxFuture<'a, io::Result<Box<dyn Listener>>>;
    /// Connects to a listener's address.
    fn connect<'a>(&'a self, addr: &'a str) -> BoxFuture<'a, io::Result<DetachedStream>>;
}

/// A bound listener. The server's accept loop owns it.
pub trait Listener: Send + fmt::Debug {
    /// The address peers connect to (with the real port when bound to port 0).
    fn local_addr(&self) -> io::Result<String>;
    /// Waits for the next connection; returns it with the peer's address.
    fn accept(&mut self) -> BoxFuture<'_, io::Result<(DetachedStream, String)>>;
}

/// A connection not attached to any runtime; `Send`, so it can move between worker threads.
#[derive(Debug)]
#[non_exhaustive]
pub enum DetachedStream {
    Tcp(std::net::TcpStream),
    Mem(MemStream),
}

impl DetachedStream {
    /// Registers the connection with the runtime of the calling thread.
    pub fn attach(self) -> io::Result<Stream> {
        match self {
            Self::Tcp(s) => {
                s.set_nonblocking(true)?;
                Ok(Stream::Tcp(tokio::net::TcpStream::from_std(s)?))
            }
            Self::Mem(s) => Ok(Stream::Mem(s)),
        }
    }

    /// A second, non-blocking descriptor of a TCP connection for writes from other threads
    /// (`None` for other transports, or when the descriptor cannot be duplicated). Sets the
    /// connection non-blocking: the two descriptors share that flag.
    pub fn writer(&self) -> Option<std::net::TcpStream> {
        match self {
            Self::Tcp(s) => {
                let w = s.try_clone().ok()?;
                w.set_nonblocking(true).ok()?;
                Some(w)
            }
            Self::Mem(_) => None,
        }
    }
}

/// A connection attached to the current worker's runtime.
#[derive(Debug)]
#[non_exhaustive]
pub enum Stream {
    Tcp(tokio::net::TcpStream),
    Mem(MemStream),
}

impl Stream {
    /// Deregisters the connection so it can be attached on another worker. Buffered bytes stay in the
    /// kernel (TCP) or in the pipe (memory); the caller keeps its own read buffer.
    pub fn detach(self) -> io::Result<DetachedStream> {
        match self {
            Self::Tcp(s) => Ok(DetachedStream::Tcp(s.into_std()?)),
            Self::Mem(s) => Ok(DetachedStream::Mem(s)),
        }
    }
}

impl AsyncRead for Stream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Self::Tcp(s) => Pin::new(s).poll_read(cx, buf),
            Self::Mem(s) => Pin::new(s).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for Stream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Self::Tcp(s) => Pin::new(s).poll_write(cx, buf),
            Self::Mem(s) => Pin::new(s).poll_write(cx, buf),
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Self::Tcp(s) => Pin::new(s).poll_write_vectored(cx, bufs),
            Self::Mem(s) => Pin::new(s).poll_write_vectored(cx, bufs),
        }
    }

    fn is_write_vectored(&self) -> bool {
        match self {
            Self::Tcp(s) => s.is_write_vectored(),
            Self::Mem(s) => s.is_write_vectored(),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Self::Tcp(s) => Pin::new(s).poll_flush(cx),
            Self::Mem(s) => Pin::new(s).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Self::Tcp(s) => Pin::new(s).poll_shutdown(cx),
            Self::Mem(s) => Pin::new(s).poll_shutdown(cx),
        }
    }
}

/// TCP over the operating system's sockets. Sets `TCP_NODELAY` on every connection: the messenger does
/// its own batching, and Nagle's delay would dominate small round trips.
#[derive(Clone, Copy, Debug, Default)]
pub struct TcpTransport;

impl TcpTransport {
    /// Wraps a listener bound by the caller (tests bind `127.0.0.1:0` and pass it in).
    pub fn listener(listener: tokio::net::TcpListener) -> Box<dyn Listener> {
        Box::new(TcpListener(listener))
    }

    /// Wraps a blocking std listener; must be called inside a tokio runtime.
    pub fn listener_from_std(listener: std::net::TcpListener) -> io::Result<Box<dyn Listener>> {
        listener.set_nonblocking(true)?;
        Ok(Self::listener(tokio::net::TcpListener::from_std(listener)?))
    }
}

impl Transport for TcpTransport {
    fn bind<'a>(&'a self, addr: &'a str) -> BoxFuture<'a, io::Result<Box<dyn Listener>>> {
        Box::pin(async move {
            let l = tokio::net::TcpListener::bind(addr).await?;
            Ok(Self::listener(l))
        })
    }

    fn connect<'a>(&'a self, addr: &'a str) -> BoxFuture<'a, io::Result<DetachedStream>> {
        Box::pin(async move {
            let s = tokio::net::TcpStream::connect(addr).await?;
            s.set_nodelay(true)?;
            Ok(DetachedStream::Tcp(s.into_std()?))
        })
    }
}

#[derive(Debug)]
struct TcpListener(tokio::net::TcpListener);

impl Listener for TcpListener {
    fn local_addr(&self) -> io::Result<String> {
        Ok(self.0.local_addr()?.to_string())
    }

    fn accept(&mut self) -> BoxFuture<'_, io::Result<(DetachedStream, String)>> {
        Box::pin(async move {
            let (s, peer) = self.0.accept().await?;
            s.set_nodelay(true)?;
            Ok((DetachedStream::Tcp(s.into_std()?), peer.to_string()))
        })
    }
}
