//! The send timeout at the socket: a client that takes none of what the
//! gateway writes to it for the timeout loses its connection, like nginx's
//! `send_timeout`. Without it, a client that sends a request and never
//! reads the answer would hold its connection (and the upstream's) for
//! ever once the socket buffers are full. Flow-control stalls inside
//! HTTP/2, where the socket stays writable, are timed by
//! [`Activity::stalled_for`](crate::gateway::activity::Activity::stalled_for).

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use crate::gateway::wait_timer::WaitTimer;

/// A client connection whose writes fail with [`io::ErrorKind::TimedOut`]
/// once one has waited on the client for the timeout without any write
/// making progress. Only the time a write waits counts: a client that is
/// slow to send its next request is the header read timeout's business.
pub struct SendTimeout<S> {
    inner: S,
    timer: WaitTimer,
}

impl<S> SendTimeout<S> {
    /// `inner`, whose writes may wait on the client at most `timeout` each.
    pub fn new(inner: S, timeout: Duration) -> SendTimeout<S> {
        SendTimeout {
            inner,
            timer: WaitTimer::new(
                timeout,
                "the client took none of its response",
                "--send-timeout-ms",
            ),
        }
    }

    /// Passes on a write's `result`, timing it if it waits.
    fn timed<T>(
        &mut self,
        cx: &mut Context<'_>,
        result: Poll<io::Result<T>>,
    ) -> Poll<io::Result<T>> {
        if result.is_ready() {
            self.timer.progressed();
            return result;
        }
        if !self.timer.expired(cx) {
            return Poll::Pending;
        }
        Poll::Ready(Err(io::Error::new(
            io::ErrorKind::TimedOut,
            self.timer.error(),
        )))
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for SendTimeout<S> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_read(cx, buf)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for SendTimeout<S> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let result = Pin::new(&mut this.inner).poll_write(cx, buf);
        this.timed(cx, result)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let result = Pin::new(&mut this.inner).poll_write_vectored(cx, bufs);
        this.timed(cx, result)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let result = Pin::new(&mut this.inner).poll_flush(cx);
        this.timed(cx, result)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let result = Pin::new(&mut this.inner).poll_shutdown(cx);
        this.timed(cx, result)
    }
}

#[cfg(test)]
mod tests {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::time::Instant;

    use super::*;

    const TIMEOUT: Duration = Duration::from_secs(60);

    #[tokio::test(start_paused = true)]
    async fn a_write_the_client_never_takes_fails_at_the_timeout() {
        let (gateway, _client) = tokio::io::duplex(1024);
        let mut gateway = SendTimeout::new(gateway, TIMEOUT);
        let started = Instant::now();
        let write = gateway.write_all(&[1u8; 4096]);
        let error = tokio::time::timeout(10 * TIMEOUT, write)
            .await
            .expect("the write ended")
            .expect_err("a write the client never takes");
        assert_eq!(error.kind(), io::ErrorKind::TimedOut);
        assert!(error.to_string().contains("60000 ms"), "{error}");
        assert_eq!(started.elapsed(), TIMEOUT);
    }

    /// The timeout is per wait: a client that takes something before each
    /// timeout runs out gets everything, however long the whole takes.
    #[tokio::test(start_paused = true)]
    async fn a_client_that_reads_before_each_timeout_gets_everything() {
        let (gateway, mut client) = tokio::io::duplex(1024);
        let mut gateway = SendTimeout::new(gateway, TIMEOUT);
        let reader = tokio::spawn(async move {
            let mut received = Vec::new();
            let mut buf = [0u8; 1024];
            loop {
                tokio::time::sleep(TIMEOUT - Duration::from_millis(1)).await;
                match client.read(&mut buf).await.expect("read") {
                    0 => return received,
                    n => received.extend_from_slice(&buf[..n]),
                }
            }
        });
        let started = Instant::now();
        let sent = vec![7u8; 8 * 1024];
        gateway
            .write_all(&sent)
            .await
            .expect("every wait was shorter than the timeout");
        gateway.shutdown().await.expect("shutdown");
        drop(gateway);
        assert_eq!(reader.await.expect("reader"), sent);
        assert!(started.elapsed() > 7 * TIMEOUT, "{:?}", started.elapsed());
    }
}
