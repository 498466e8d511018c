//! Lingering close, as nginx's `lingering_close`: a client connection the
//! gateway ends while the client is still sending is not closed at once.
//!
//! Closing a socket with unread bytes in it makes the kernel answer with a
//! reset, and a reset makes the client's kernel drop what it had received
//! and not yet handed over: the client sees "connection reset" or "broken
//! pipe" instead of the answer that said why. That is every client that
//! sends a body past `--max-body-bytes` whole before it reads (Python's
//! `http.client`, `requests`), which the gateway answers 413 without
//! reading the body, and every head too large (431). So the gateway ends
//! its side (the client reads the whole answer, then the end) and reads
//! and throws away what the client still sends, until the client closes,
//! pauses for [`LINGER_PAUSE`], or [`LINGER_TIME`] has passed, or the
//! connection is told to close (the gateway stops, or needs the slot).
//! The connection keeps its slot meanwhile.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::TcpStream;
use tokio::sync::oneshot;

/// The longest the gateway reads what a client sends after its answer
/// (nginx's `lingering_time`).
pub const LINGER_TIME: Duration = Duration::from_secs(30);

/// The longest pause in what the client sends after which the gateway
/// stops reading it (nginx's `lingering_timeout`).
pub const LINGER_PAUSE: Duration = Duration::from_secs(5);

/// A connection's I/O that hyper serves on and drops when it is done with
/// the connection: on that drop, `io` is handed back (see
/// [`HandBack::new`]) instead of closed.
pub struct HandBack<S> {
    /// Always `Some` until the drop.
    io: Option<S>,
    back: Option<oneshot::Sender<Returned<S>>>,
    shut_down: bool,
}

/// A connection's I/O, handed back by hyper.
pub struct Returned<S> {
    /// The I/O.
    pub io: S,
    /// Whether hyper ended the connection itself, shutting down its
    /// sending side: after an answer that closes it (the client's
    /// `Connection: close`, an HTTP/1.0 request, or one framed by both
    /// `Transfer-Encoding` and `Content-Length`), or after its client
    /// ended its own side. Not after an error or a timeout.
    pub shut_down: bool,
}

impl<S> HandBack<S> {
    /// `io`, to be served on, and where it comes back once dropped.
    pub fn new(io: S) -> (HandBack<S>, oneshot::Receiver<Returned<S>>) {
        let (back, returned) = oneshot::channel();
        let io = HandBack {
            io: Some(io),
            back: Some(back),
            shut_down: false,
        };
        (io, returned)
    }

    fn io(&mut self) -> io::Result<&mut S> {
        self.io
            .as_mut()
            .ok_or_else(|| io::Error::other("the connection was handed back"))
    }
}

impl<S> Drop for HandBack<S> {
    fn drop(&mut self) {
        if let (Some(io), Some(back)) = (self.io.take(), self.back.take()) {
            // Nobody waiting for it: it closes here, as without a hand-back.
            let shut_down = self.shut_down;
            let _ = back.send(Returned { io, shut_down });
        }
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for HandBack<S> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match self.get_mut().io() {
            Ok(io) => Pin::new(io).poll_read(cx, buf),
            Err(e) => Poll::Ready(Err(e)),
        }
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for HandBack<S> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut().io() {
            Ok(io) => Pin::new(io).poll_write(cx, buf),
            Err(e) => Poll::Ready(Err(e)),
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut().io() {
            Ok(io) => Pin::new(io).poll_write_vectored(cx, bufs),
            Err(e) => Poll::Ready(Err(e)),
        }
    }

    fn is_write_vectored(&self) -> bool {
        self.io.as_ref().is_some_and(S::is_write_vectored)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut().io() {
            Ok(io) => Pin::new(io).poll_flush(cx),
            Err(e) => Poll::Ready(Err(e)),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        this.shut_down = true;
        match this.io() {
            Ok(io) => Pin::new(io).poll_shutdown(cx),
            Err(e) => Poll::Ready(Err(e)),
        }
    }
}

/// Closes `stream`, which the gateway is done with: at once if the client
/// has sent nothing that is still unread and `client_may_send` is false,
/// and otherwise after lingering (see the module's docs) until
/// `told_to_close` resolves at the latest. `client_may_send` says that the
/// client may still be sending what the gateway did not wait for (a body
/// answered before it all came, the rest of a head too large), which may
/// not have arrived yet: a client's head and body often come in segments
/// a round trip apart. Returns the bytes thrown away.
pub async fn close(
    mut stream: TcpStream,
    client_may_send: bool,
    told_to_close: impl Future<Output = ()>,
) -> u64 {
    if !client_may_send && !has_unread(&stream) {
        return 0;
    }
    // The gateway's side ends (a FIN after the answer, where hyper has not
    // sent one); a client that reads sees the whole answer, then the end.
    let _ = stream.shutdown().await;
    let mut thrown = 0u64;
    let discard = async {
        // Small, as nginx's: a flood of refused bodies holds one each.
        let mut scratch = [0u8; 4 << 10];
        loop {
            match tokio::time::timeout(LINGER_PAUSE, stream.read(&mut scratch)).await {
                Ok(Ok(n)) if n > 0 => thrown += n as u64,
                // Closed, failed, or paused too long.
                _ => break,
            }
        }
    };
    // Biased: what has come is thrown away before a close is looked at.
    tokio::select! {
        biased;
        () = discard => {}
        () = tokio::time::sleep(LINGER_TIME) => {}
        () = told_to_close => {}
    }
    thrown
}

/// Whether the client has sent bytes on `socket` that are not yet read:
/// a peek at the socket that neither waits, whatever the socket's mode,
/// nor takes them. Asked before a connection is registered with its
/// worker's reactor (a stream registered anew reads as not ready until the
/// reactor's next turn, so a shutdown beginning in that moment would
/// otherwise close a connection whose request is already there), and when
/// the gateway is done with one (see `lingering_close`).
pub fn has_unread(socket: &impl std::os::fd::AsRawFd) -> bool {
    let mut probe = 0u8;
    // SAFETY: recv writes at most one byte through the pointer, which
    // points at a live byte; the descriptor is `socket`'s, open while it
    // is borrowed.
    let got = unsafe {
        libc::recv(
            socket.as_raw_fd(),
            (&mut probe as *mut u8).cast(),
            1,
            libc::MSG_PEEK | libc::MSG_DONTWAIT,
        )
    };
    got > 0
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A connected pair on loopback: the gateway's end, the client's.
    async fn pair() -> (TcpStream, TcpStream) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let client = TcpStream::connect(listener.local_addr().unwrap())
            .await
            .unwrap();
        let (server, _) = listener.accept().await.unwrap();
        (server, client)
    }

    #[tokio::test]
    async fn a_connection_with_nothing_unread_closes_at_once() {
        let (server, mut client) = pair().await;
        assert_eq!(close(server, false, std::future::pending()).await, 0);
        let mut end = [0u8; 1];
        assert_eq!(client.read(&mut end).await.unwrap(), 0, "closed");
    }

    #[tokio::test]
    async fn a_client_still_sending_reads_the_answer_and_then_the_end() {
        let (mut server, mut client) = pair().await;
        client.write_all(b"more of a body").await.unwrap();
        server.write_all(b"HTTP/1.1 413").await.unwrap();
        // Readiness comes through the reactor: wait for the bytes to be
        // there, as they are when hyper gives up on a request.
        server.readable().await.unwrap();
        let lingering = tokio::spawn(close(server, false, std::future::pending()));
        let mut answer = Vec::new();
        client.write_all(&[b'a'; 100_000]).await.unwrap();
        client.shutdown().await.unwrap();
        client.read_to_end(&mut answer).await.unwrap();
        assert_eq!(answer, b"HTTP/1.1 413");
        assert_eq!(lingering.await.unwrap(), 14 + 100_000, "all thrown away");
    }

    /// A client that may still send lingers even with nothing unread yet:
    /// what it sends after the gateway's end is read, not reset.
    #[tokio::test]
    async fn a_client_that_may_send_is_read_from_before_it_has_sent() {
        let (server, mut client) = pair().await;
        let lingering = tokio::spawn(close(server, true, std::future::pending()));
        // The gateway's end comes first: then the client sends.
        let mut end = [0u8; 1];
        assert_eq!(client.read(&mut end).await.unwrap(), 0);
        client.write_all(&[b'a'; 100_000]).await.unwrap();
        client.shutdown().await.unwrap();
        assert_eq!(lingering.await.unwrap(), 100_000);
    }

    #[tokio::test]
    async fn lingering_ends_when_the_connection_is_told_to_close() {
        let (server, mut client) = pair().await;
        client.write_all(b"unread").await.unwrap();
        server.readable().await.unwrap();
        let (tell, told) = oneshot::channel::<()>();
        let lingering = tokio::spawn(close(server, false, async {
            let _ = told.await;
        }));
        tell.send(()).unwrap();
        assert_eq!(lingering.await.unwrap(), 6);
        // Closed with nothing unread: the client sees the end, no reset.
        let mut end = [0u8; 1];
        assert_eq!(client.read(&mut end).await.unwrap(), 0);
    }

    #[tokio::test]
    async fn a_dropped_hand_back_returns_its_io() {
        let (server, _client) = pair().await;
        let addr = server.local_addr().unwrap();
        let (io, returned) = HandBack::new(server);
        drop(io);
        let returned = returned.await.unwrap();
        assert_eq!(returned.io.local_addr().unwrap(), addr);
        assert!(!returned.shut_down);
    }
}
