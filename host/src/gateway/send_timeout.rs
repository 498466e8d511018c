//! The send timeout at the socket: a client that takes none of what the
//! gateway writes to it for the timeout loses its connection, like nginx's
//! `send_timeout`. Without it, a client that sends a request and never
//! reads the answer would hold its connection (and the upstream's) for
//! ever once the socket buffers are full. Flow-control stalls inside
//! HTTP/2, where the socket stays writable, are timed by
//! [`Activity::stalled_for`](crate::gateway::activity::Activity::stalled_for).

use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use crate::gateway::wait_timer::WaitTimer;

/// A client connection whose writes fail with [`io::ErrorKind::TimedOut`]
/// once one has waited on the client for the timeout without the client
/// taking anything. Only the time a write waits counts: a client that is
/// slow to send its next request is the header read timeout's business.
///
/// The kernel reports a full socket writable again only once a third or
/// so of its send buffer (up to megabytes) is free, so a client that
/// reads steadily but slowly can leave a write waiting longer than the
/// timeout. When the timeout runs out, the socket's send queue is looked
/// at: if the client took [`MIN_TAKEN`] of it since the wait began (or a
/// third of what it held, where that is less), a new wait begins instead.
/// Any take at all let a client that acknowledged a segment a minute keep
/// a streamed response, and the upstream's behind it, for ever.
pub struct SendTimeout<S> {
    inner: S,
    timer: WaitTimer,
    /// While a write waits: what the send queue held when the wait
    /// began, if the connection can tell.
    queued: Option<Option<usize>>,
    /// Set while a write waits, for whoever else judges the client.
    full: Arc<AtomicBool>,
    /// Where to count the bytes read from the client, if anywhere.
    read: Option<Arc<AtomicU64>>,
}

/// What a client must take of a full send queue within a timeout to keep
/// its connection (or a third of what the queue held, where less): about
/// 1 KiB a second at the default 60 s, far less than the third of a send
/// buffer of up to megabytes that nginx's `send_timeout` waits for.
pub const MIN_TAKEN: usize = 64 << 10;

/// A connection that can tell how much of what was written to it its
/// peer has not yet taken.
pub trait SendQueue {
    /// Bytes written but not yet acknowledged by the peer; `None` where
    /// the platform cannot tell.
    fn queued(&self) -> Option<usize>;
}

impl SendQueue for tokio::net::TcpStream {
    #[cfg(target_os = "linux")]
    fn queued(&self) -> Option<usize> {
        use std::os::fd::AsRawFd;

        let mut queued: libc::c_int = 0;
        // SAFETY: TIOCOUTQ (SIOCOUTQ) writes one int through the pointer,
        // which points at a live int.
        let status = unsafe { libc::ioctl(self.as_raw_fd(), libc::TIOCOUTQ, &mut queued) };
        (status == 0)
            .then(|| usize::try_from(queued).ok())
            .flatten()
    }

    #[cfg(not(target_os = "linux"))]
    fn queued(&self) -> Option<usize> {
        None
    }
}

#[cfg(test)]
impl SendQueue for tokio::io::DuplexStream {
    fn queued(&self) -> Option<usize> {
        None
    }
}

impl<S: SendQueue> SendTimeout<S> {
    /// `inner`, whose writes may wait on the client at most `timeout` each;
    /// `full` is set while one waits.
    pub fn new(inner: S, timeout: Duration, full: Arc<AtomicBool>) -> SendTimeout<S> {
        SendTimeout {
            inner,
            timer: WaitTimer::new(
                timeout,
                "the client took next to none of its response",
                "--send-timeout-ms",
            ),
            queued: None,
            full,
            read: None,
        }
    }

    /// The connection, without its timeout.
    pub fn into_inner(self) -> S {
        self.inner
    }

    /// Counts every byte read from the client in `read`.
    pub fn counting_reads_in(self, read: Arc<AtomicU64>) -> SendTimeout<S> {
        SendTimeout {
            read: Some(read),
            ..self
        }
    }

    /// Passes on a write's `result`, timing it if it waits.
    fn timed<T>(
        &mut self,
        cx: &mut Context<'_>,
        result: Poll<io::Result<T>>,
    ) -> Poll<io::Result<T>> {
        if result.is_ready() {
            if self.queued.take().is_some() {
                self.timer.progressed();
                self.full.store(false, Ordering::Relaxed);
            }
            return result;
        }
        let mut queued = match self.queued {
            Some(queued) => queued,
            None => {
                self.full.store(true, Ordering::Relaxed);
                *self.queued.insert(self.inner.queued())
            }
        };
        while self.timer.expired(cx) {
            match (queued, self.inner.queued()) {
                // The client took enough: it is reading, a new wait
                // begins.
                (Some(before), Some(now))
                    if now < before && before - now >= MIN_TAKEN.min(before.div_ceil(3)) =>
                {
                    queued = Some(now);
                    self.queued = Some(queued);
                    self.timer.progressed();
                }
                _ => {
                    return Poll::Ready(Err(io::Error::new(
                        io::ErrorKind::TimedOut,
                        self.timer.error(),
                    )))
                }
            }
        }
        Poll::Pending
    }
}
impl<S: AsyncRead + SendQueue + Unpin> AsyncRead for SendTimeout<S> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        let result = Pin::new(&mut this.inner).poll_read(cx, buf);
        if let (Some(read), Poll::Ready(Ok(()))) = (&this.read, &result) {
            let n = (buf.filled().len() - before) as u64;
            read.fetch_add(n, Ordering::Relaxed);
        }
        result
    }
}

impl<S: AsyncWrite + SendQueue + Unpin> AsyncWrite for SendTimeout<S> {
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
    use std::future::Future;
    use std::sync::atomic::AtomicUsize;

    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::time::Instant;

    use super::*;

    const TIMEOUT: Duration = Duration::from_secs(60);

    #[tokio::test(start_paused = true)]
    async fn a_write_the_client_never_takes_fails_at_the_timeout() {
        let (gateway, _client) = tokio::io::duplex(1024);
        let mut gateway = SendTimeout::new(gateway, TIMEOUT, Arc::default());
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

    /// A socket that never turns writable, whose send queue the test
    /// drains as a client reading slowly would.
    struct FullSocket(Arc<AtomicUsize>);

    impl SendQueue for FullSocket {
        fn queued(&self) -> Option<usize> {
            Some(self.0.load(Ordering::Relaxed))
        }
    }

    impl AsyncWrite for FullSocket {
        fn poll_write(
            self: Pin<&mut Self>,
            _: &mut Context<'_>,
            _: &[u8],
        ) -> Poll<io::Result<usize>> {
            Poll::Pending
        }

        fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
            Poll::Ready(Ok(()))
        }

        fn poll_shutdown(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
            Poll::Ready(Ok(()))
        }
    }

    /// A client that takes 64 KiB of the send queue within each timeout
    /// keeps its connection though the socket never turns writable (the
    /// kernel waits for a third of the buffer); one that stops taking
    /// loses it one timeout later.
    #[tokio::test(start_paused = true)]
    async fn a_client_draining_the_send_queue_keeps_its_connection() {
        let queue = Arc::new(AtomicUsize::new(4 << 20));
        let client = queue.clone();
        tokio::spawn(async move {
            for _ in 0..5 {
                tokio::time::sleep(TIMEOUT - Duration::from_millis(1)).await;
                client.fetch_sub(64 << 10, Ordering::Relaxed);
            }
        });
        let full = Arc::new(AtomicBool::new(false));
        let mut gateway = SendTimeout::new(FullSocket(queue), TIMEOUT, full.clone());
        let started = Instant::now();
        let write = gateway.write_all(b"more");
        tokio::pin!(write);
        let polled = std::future::poll_fn(|cx| Poll::Ready(write.as_mut().poll(cx)));
        assert!(polled.await.is_pending());
        assert!(full.load(Ordering::Relaxed), "the socket is full");
        let error = tokio::time::timeout(20 * TIMEOUT, write)
            .await
            .expect("the write ended")
            .expect_err("the client stopped taking");
        assert_eq!(error.kind(), io::ErrorKind::TimedOut);
        // Five takes kept it five timeouts; then one more timeout.
        assert_eq!(started.elapsed(), 6 * TIMEOUT);
    }

    /// A client that takes a segment's worth of the send queue a timeout
    /// (1448 bytes, one acknowledgement a minute) loses its connection at
    /// the first timeout: taking anything at all kept it for ever. Near
    /// the end of a response, a third of what is left is enough.
    #[tokio::test(start_paused = true)]
    async fn a_client_taking_a_trickle_of_a_full_queue_loses_its_connection() {
        for (queued, taken, kept) in [
            (4 << 20, 1448, false),
            (4 << 20, MIN_TAKEN - 1, false),
            (4 << 20, MIN_TAKEN, true),
            (3000, 1000, true),
            (3000, 999, false),
        ] {
            let queue = Arc::new(AtomicUsize::new(queued));
            let client = queue.clone();
            tokio::spawn(async move {
                tokio::time::sleep(TIMEOUT - Duration::from_millis(1)).await;
                client.fetch_sub(taken, Ordering::Relaxed);
            });
            let mut gateway = SendTimeout::new(FullSocket(queue), TIMEOUT, Arc::default());
            let started = Instant::now();
            let error = tokio::time::timeout(20 * TIMEOUT, gateway.write_all(b"more"))
                .await
                .expect("the write ended")
                .expect_err("the client took nothing more");
            assert_eq!(error.kind(), io::ErrorKind::TimedOut);
            let timeouts = if kept { 2 } else { 1 };
            assert_eq!(
                started.elapsed(),
                timeouts * TIMEOUT,
                "{taken} of {queued} taken"
            );
        }
    }

    /// The timeout is per wait: a client that takes something before each
    /// timeout runs out gets everything, however long the whole takes.
    #[tokio::test(start_paused = true)]
    async fn a_client_that_reads_before_each_timeout_gets_everything() {
        let (gateway, mut client) = tokio::io::duplex(1024);
        let full = Arc::new(AtomicBool::new(false));
        let mut gateway = SendTimeout::new(gateway, TIMEOUT, full.clone());
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
        assert!(!full.load(Ordering::Relaxed), "the last write went through");
        gateway.shutdown().await.expect("shutdown");
        drop(gateway);
        assert_eq!(reader.await.expect("reader"), sent);
        assert!(started.elapsed() > 7 * TIMEOUT, "{:?}", started.elapsed());
    }
}
