//! The accept loop: every connection gets a deadline for each request head
//! (an idle keep-alive connection included), one for its body and one for
//! each write, so idle or slow sockets cannot pile up, and a small send
//! buffer, so a client that reads nothing is found within seconds; on shutdown no new
//! connection is taken, generations are cancelled (their streams still end
//! with a final chunk), open connections are asked to finish, and after a
//! grace period the loop returns whatever is still open.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use anyhow::{Context as _, Result};
use axum::extract::{Request, State};
use axum::http::StatusCode;
use axum::middleware::Next;
use axum::response::Response;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::Sleep;

use super::{error_for_path, router, ApiError, AppState, MAX_BODY_BYTES};
use crate::note;

/// How long a connection may take over each part of its life.
#[derive(Clone, Copy, Debug)]
pub struct Timeouts {
    /// To send a request head, counted from when the server is ready for it
    /// (so also how long an idle keep-alive connection stays open).
    pub header: Duration,
    /// To send a request body.
    pub body: Duration,
    /// For the client to take any byte of a response; also how far a
    /// generation's client may fall behind it in all (see `delivery.rs`)
    /// before the generation is cancelled and frees its turn.
    pub write: Duration,
    /// After a shutdown signal, how long open connections may take to finish.
    pub shutdown_grace: Duration,
}

impl Default for Timeouts {
    fn default() -> Self {
        Timeouts {
            header: Duration::from_secs(30),
            body: Duration::from_secs(60),
            write: Duration::from_secs(60),
            shutdown_grace: Duration::from_secs(10),
        }
    }
}

impl Timeouts {
    /// The timeouts from the command line's seconds (header, body, write,
    /// shutdown grace), each a positive number.
    pub fn from_secs(header: f64, body: f64, write: f64, shutdown_grace: f64) -> Result<Timeouts> {
        let secs = |flag: &str, value: f64| {
            Duration::try_from_secs_f64(value)
                .ok()
                .filter(|d| !d.is_zero())
                .with_context(|| format!("--{flag} {value} is not a positive number of seconds"))
        };
        Ok(Timeouts {
            header: secs("header-timeout-secs", header)?,
            body: secs("body-timeout-secs", body)?,
            write: secs("write-timeout-secs", write)?,
            shutdown_grace: secs("shutdown-grace-secs", shutdown_grace)?,
        })
    }
}

/// Serves `app` on `listener` until `shutdown` resolves, then shuts down as
/// the module's comment says.
pub async fn serve_on(
    listener: tokio::net::TcpListener,
    app: Arc<AppState>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<()> {
    let bound = listener.local_addr().context("reading the address the server is bound to")?;
    let timeouts = app.options.timeouts;
    app.residency.spawn_expiry();
    let service = TowerToHyperService::new(router(app.clone(), bound));
    let (stop_sender, stop) = tokio::sync::watch::channel(false);
    let mut connections = tokio::task::JoinSet::new();
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            accepted = listener.accept() => {
                let stream = match accepted {
                    Ok((stream, _)) => stream,
                    Err(e) => {
                        // Out of descriptors, say: wait for connections to close.
                        note!("accepting a connection failed: {e}");
                        tokio::time::sleep(Duration::from_millis(100)).await;
                        continue;
                    }
                };
                bound_send_buffer(&stream);
                let (service, mut stop) = (service.clone(), stop.clone());
                connections.spawn(async move {
                    let io = TokioIo::new(WriteDeadline::new(stream, timeouts.write));
                    let connection = hyper::server::conn::http1::Builder::new()
                        .timer(TokioTimer::new())
                        .header_read_timeout(timeouts.header)
                        .serve_connection(io, service);
                    tokio::pin!(connection);
                    tokio::select! {
                        _ = connection.as_mut() => {}
                        _ = stop.changed() => {
                            connection.as_mut().graceful_shutdown();
                            let _ = connection.await;
                        }
                    }
                });
            }
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
            () = &mut shutdown => break,
        }
    }
    drop(listener);
    app.stop_generations();
    let _ = stop_sender.send(true);
    let all_closed = async { while connections.join_next().await.is_some() {} };
    if tokio::time::timeout(timeouts.shutdown_grace, all_closed).await.is_err() {
        note!("shutdown: {} connection(s) still open after {:?}; closing them", connections.len(), timeouts.shutdown_grace);
        connections.abort_all();
    }
    Ok(())
}

/// What the kernel may hold of a response its client has not taken. Linux
/// lets a send buffer grow to 4 MB, some 30,000 streamed tokens: a client
/// that reads nothing would hold the generation turn that long before any
/// write waited, and the write timeout began. 32 KiB (Linux doubles it) is
/// still far more than a token stream needs in flight.
const SEND_BUFFER_BYTES: i32 = 32 << 10;

/// Bounds a connection's send buffer to [`SEND_BUFFER_BYTES`].
fn bound_send_buffer(stream: &tokio::net::TcpStream) {
    #[cfg(unix)]
    {
        use std::os::fd::AsRawFd;
        let size: libc::c_int = SEND_BUFFER_BYTES;
        let len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
        // SAFETY: setsockopt reads one int through a pointer valid for the
        // call, on a descriptor the stream owns.
        let set = unsafe {
            libc::setsockopt(stream.as_raw_fd(), libc::SOL_SOCKET, libc::SO_SNDBUF, std::ptr::addr_of!(size).cast(), len)
        };
        if set != 0 {
            note!("bounding a connection's send buffer failed: {}", std::io::Error::last_os_error());
        }
    }
    #[cfg(not(unix))]
    let _ = stream;
}

/// Reads the whole request body within the body timeout (and the size
/// limit), so a slow body cannot hold a connection open.
pub(super) async fn read_body_within(State(timeout): State<Duration>, req: Request, next: Next) -> Response {
    let path = req.uri().path().to_string();
    let (parts, body) = req.into_parts();
    match tokio::time::timeout(timeout, axum::body::to_bytes(body, MAX_BODY_BYTES)).await {
        Ok(Ok(bytes)) => next.run(Request::from_parts(parts, axum::body::Body::from(bytes))).await,
        Ok(Err(e)) if over_the_limit(&e) => error_for_path(
            &path,
            ApiError::new(StatusCode::PAYLOAD_TOO_LARGE, format!("the request body is over {MAX_BODY_BYTES} bytes, the most this server reads")),
        ),
        // A body that breaks off or is badly chunked.
        Ok(Err(e)) => error_for_path(&path, ApiError::bad_request(format!("reading the request body: {e}: send a whole body"))),
        Err(_) => error_for_path(
            &path,
            ApiError::new(StatusCode::REQUEST_TIMEOUT, format!("the request body did not arrive within {timeout:?}")),
        ),
    }
}

/// Whether reading a body failed for its size (not for being malformed).
fn over_the_limit(e: &axum::Error) -> bool {
    let mut cause: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(c) = cause {
        if c.is::<http_body_util::LengthLimitError>() {
            return true;
        }
        cause = c.source();
    }
    false
}

/// A connection whose writes fail once one has waited longer than `limit`
/// for the client to take bytes.
struct WriteDeadline<T> {
    inner: T,
    limit: Duration,
    /// Set while a write is pending.
    deadline: Option<Pin<Box<Sleep>>>,
}

impl<T> WriteDeadline<T> {
    fn new(inner: T, limit: Duration) -> Self {
        WriteDeadline { inner, limit, deadline: None }
    }

    /// `Pending` from the inner write: an error once the deadline has passed.
    fn pending<R>(&mut self, cx: &mut Context<'_>) -> Poll<std::io::Result<R>> {
        let limit = self.limit;
        let deadline = self.deadline.get_or_insert_with(|| Box::pin(tokio::time::sleep(limit)));
        match deadline.as_mut().poll(cx) {
            Poll::Ready(()) => {
                Poll::Ready(Err(std::io::Error::new(std::io::ErrorKind::TimedOut, "the client took no bytes in time")))
            }
            Poll::Pending => Poll::Pending,
        }
    }

    fn done<R>(&mut self, result: Poll<std::io::Result<R>>, cx: &mut Context<'_>) -> Poll<std::io::Result<R>> {
        match result {
            Poll::Pending => self.pending(cx),
            ready => {
                self.deadline = None;
                ready
            }
        }
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for WriteDeadline<T> {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for WriteDeadline<T> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, bytes: &[u8]) -> Poll<std::io::Result<usize>> {
        let result = Pin::new(&mut self.inner).poll_write(cx, bytes);
        self.done(result, cx)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        let result = Pin::new(&mut self.inner).poll_flush(cx);
        self.done(result, cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        let result = Pin::new(&mut self.inner).poll_shutdown(cx);
        self.done(result, cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        let result = Pin::new(&mut self.inner).poll_write_vectored(cx, bufs);
        self.done(result, cx)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
}
