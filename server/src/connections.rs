//! Admission of gRPC connections: a cap on how many are open at once, and a deadline for the
//! HTTP/2 client preface.
//!
//! Invariants:
//!
//! - Every connection handed to the gRPC server holds one permit of the [`ConnectionGate`]
//!   until its socket is dropped, so at most `--max-connections` are open; a connection
//!   accepted over the cap is closed at once and counted
//!   (`inferencecache_grpc_connections_refused_total`), never queued.
//! - A connection that has not delivered the 24-byte HTTP/2 client preface within
//!   [`PREFACE_TIMEOUT`] of its accept (TLS handshake included) fails its next read with
//!   `TimedOut`, which makes the HTTP/2 server close it. A peer can therefore hold a socket
//!   without speaking HTTP/2 for at most that long.
//!
//! The accept loop never stops on an accept error (a full descriptor table, a peer that reset
//! before the accept): it waits a little and accepts again.

use crate::metrics::Metrics;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::{Instant, Sleep};
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::server::Connected;
use tracing::debug;

/// How long a new connection may take to deliver the HTTP/2 client preface.
pub const PREFACE_TIMEOUT: Duration = Duration::from_secs(10);

/// Default `--max-connections`: above the 10,000 connections the fault tests hold at once
/// (in waves of 2,000), below a typical descriptor limit of 65,536.
pub const DEFAULT_MAX_CONNECTIONS: u64 = 16_384;

/// `PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n` (RFC 9113 §3.4).
const PREFACE_LEN: usize = 24;

/// Pause after a failed accept (e.g. `EMFILE`) before the next one.
const ACCEPT_RETRY: Duration = Duration::from_millis(10);

/// Hands out connection permits and counts refusals.
#[derive(Clone)]
pub struct ConnectionGate {
    /// `None`: no cap (`--max-connections 0`).
    permits: Option<Arc<Semaphore>>,
    metrics: Arc<Metrics>,
}

/// The right of one accepted connection to be served: a permit and its preface deadline.
pub struct Admission {
    /// Returned to the gate when the admission drops, before the open gauge goes down.
    permit: Option<OwnedSemaphorePermit>,
    metrics: Arc<Metrics>,
    deadline: Instant,
}

impl ConnectionGate {
    /// A gate for at most `max` concurrent connections (`0` = no cap).
    pub fn new(max: u64, metrics: Arc<Metrics>) -> Self {
        let permits = (max > 0).then(|| {
            Arc::new(Semaphore::new(
                usize::try_from(max)
                    .unwrap_or(usize::MAX)
                    .min(Semaphore::MAX_PERMITS),
            ))
        });
        Self { permits, metrics }
    }

    /// Admits a connection accepted now, or counts it refused (`None`: the caller drops it).
    pub fn admit(&self) -> Option<Admission> {
        let permit = match &self.permits {
            Some(permits) => match permits.clone().try_acquire_owned() {
                Ok(p) => Some(p),
                Err(_) => {
                    self.metrics
                        .grpc_connections_refused
                        .fetch_add(1, Ordering::Relaxed);
                    return None;
                }
            },
            None => None,
        };
        self.metrics
            .grpc_connections_open
            .fetch_add(1, Ordering::Relaxed);
        Some(Admission {
            permit,
            metrics: self.metrics.clone(),
            deadline: Instant::now() + PREFACE_TIMEOUT,
        })
    }
}

impl Admission {
    /// When the preface must have arrived (also the TLS handshake's deadline).
    pub fn deadline(&self) -> Instant {
        self.deadline
    }

    /// Wraps the connection's stream (plain TCP, or TLS after the handshake).
    pub fn wrap<IO>(self, io: IO) -> Admitted<IO> {
        let deadline = Box::pin(tokio::time::sleep_until(self.deadline));
        Admitted {
            io,
            preface: Some(Preface {
                missing: PREFACE_LEN,
                deadline,
            }),
            _admission: self,
        }
    }
}

impl Drop for Admission {
    fn drop(&mut self) {
        // The permit first: whoever reads the gauge lower may rely on the room being free.
        drop(self.permit.take());
        self.metrics
            .grpc_connections_open
            .fetch_sub(1, Ordering::Relaxed);
    }
}

struct Preface {
    missing: usize,
    deadline: Pin<Box<Sleep>>,
}

/// A served connection's stream: the admission travels with it, and reads fail once the
/// preface deadline has passed without the preface.
pub struct Admitted<IO> {
    io: IO,
    preface: Option<Preface>,
    _admission: Admission,
}

impl<IO: AsyncRead + Unpin> AsyncRead for Admitted<IO> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        let read = Pin::new(&mut this.io).poll_read(cx, buf);
        let Some(preface) = &mut this.preface else {
            return read;
        };
        match read {
            Poll::Ready(Ok(())) => {
                let got = buf.filled().len() - before;
                preface.missing = preface.missing.saturating_sub(got);
                if preface.missing == 0 {
                    this.preface = None;
                }
                Poll::Ready(Ok(()))
            }
            Poll::Pending => match preface.deadline.as_mut().poll(cx) {
                // The server is waiting for bytes that did not come in time.
                Poll::Ready(()) => Poll::Ready(Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "no HTTP/2 client preface within the preface timeout",
                ))),
                Poll::Pending => Poll::Pending,
            },
            other => other,
        }
    }
}

impl<IO: AsyncWrite + Unpin> AsyncWrite for Admitted<IO> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().io).poll_write(cx, buf)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }
}

impl<IO: Connected> Connected for Admitted<IO> {
    type ConnectInfo = IO::ConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.io.connect_info()
    }
}

/// Accepts plaintext gRPC connections from `listener` through `gate` until the returned stream
/// is dropped (the server stops accepting).
pub fn incoming(
    listener: TcpListener,
    gate: ConnectionGate,
) -> ReceiverStream<Result<Admitted<TcpStream>, io::Error>> {
    let (tx, rx) = tokio::sync::mpsc::channel(128);
    tokio::spawn(async move {
        loop {
            let tcp = tokio::select! {
                accepted = listener.accept() => match accepted {
                    Ok((tcp, _)) => tcp,
                    Err(err) => {
                        debug!(err = %err, "grpc_accept_error");
                        tokio::time::sleep(ACCEPT_RETRY).await;
                        continue;
                    }
                },
                _ = tx.closed() => return,
            };
            let Some(admission) = gate.admit() else {
                continue;
            };
            let _ = tcp.set_nodelay(true);
            if tx.send(Ok(admission.wrap(tcp))).await.is_err() {
                return;
            }
        }
    });
    ReceiverStream::new(rx)
}
