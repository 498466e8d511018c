//! Noticing that a client has gone while the gateway reads nothing from its
//! connection.
//!
//! hyper's HTTP/1 server reads a connection only while something reads the
//! request's body (or the request has ended). A request waiting for room in
//! the body memory, or for a turn to the upstream with its body unread,
//! reads nothing, so a client that closes its connection meanwhile would
//! keep the request's place in line, and the connection's slot, until the
//! wait runs out (60 s by default for room). Here the connection's
//! socket is watched for the client closing or resetting it, through an
//! epoll instance of the request's own, apart from the runtime's: it asks
//! only for the hang-up (`EPOLLRDHUP`), so body bytes the client has sent
//! and nobody has read do not wake it, and the runtime's own readiness for
//! the socket is left alone. As hyper does by default, a client that shuts
//! down only its sending side counts as gone.
//!
//! HTTP/2 needs none of this: hyper reads an HTTP/2 connection all the
//! time, and drops a request whose stream or connection ends.

use std::os::fd::RawFd;

use bytes::Bytes;
use http::{Response, StatusCode};
use http_body_util::Full;

use crate::gateway::error_chain::causes;
use crate::gateway::responses;

/// Marks the answer to a request whose client went away while it waited:
/// nobody is meant to read it, so the server counts no response for it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClientGone;

/// The status the access log gives a request whose client went away
/// before it was answered, as nginx logs it.
pub const CLIENT_GONE_STATUS: u16 = 499;

/// A client connection's socket, to watch while one of its requests waits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClientSocket(RawFd);

impl ClientSocket {
    /// The client connection socket with file descriptor `fd`.
    ///
    /// # Safety
    ///
    /// [`gone`](Self::gone) must be polled only while `fd` is that
    /// socket's: from a future that the connection itself runs and drops
    /// before it closes the socket (as an HTTP/1 connection runs its
    /// requests), not from a task of its own, which may outlive it. Once
    /// the number is reused, the watch would be of another connection.
    pub unsafe fn new(fd: RawFd) -> ClientSocket {
        ClientSocket(fd)
    }

    /// Resolves once the client has closed or reset its connection. Where
    /// the watch cannot be set up (out of file descriptors, a platform
    /// without epoll), it never resolves: the request then waits as it
    /// would without it.
    pub async fn gone(self) {
        #[cfg(target_os = "linux")]
        if let Ok(watch) = linux::HangUpWatch::new(self.0) {
            watch.wait().await;
            return;
        }
        std::future::pending::<()>().await
    }
}

/// Resolves once the client of `socket` has gone; with no socket to watch
/// (an HTTP/2 request, or one from a server that tells of none), never.
pub async fn gone(socket: Option<ClientSocket>) {
    match socket {
        Some(socket) => socket.gone().await,
        None => std::future::pending().await,
    }
}

/// The answer to a request whose client went away while it waited for
/// `waited_for`: nobody is meant to read it (a client that only shut down
/// its sending side could); it ends the connection, and the server counts
/// it as no answer.
pub fn answer(waited_for: &str) -> Response<Full<Bytes>> {
    unread(&format!(
        "the client closed its connection, or shut down its sending side, while its request \
         waited for {waited_for}"
    ))
}

/// The answer to a request whose client went away while sending its body
/// (`error`, the body's): as [`answer`]'s, nobody is meant to read it.
pub fn answer_mid_body(error: &dyn std::fmt::Display) -> Response<Full<Bytes>> {
    unread(&format!(
        "the client went away while sending its request body: {error}"
    ))
}

/// A 400 `client_gone` saying `message`, that ends the connection, marked
/// [`ClientGone`] for the server to count no answer.
fn unread(message: &str) -> Response<Full<Bytes>> {
    let mut response = responses::closing_error(StatusCode::BAD_REQUEST, "client_gone", message);
    response.extensions_mut().insert(ClientGone);
    response
}

/// Whether `error`, a request body's, means that its client went away
/// mid-body: it closed its HTTP/1 connection (or shut down its sending
/// side, which hyper takes as the same, and which this cannot tell apart)
/// or reset it, or it reset its HTTP/2 stream, or closed or reset the
/// connection beneath it. Not a body it framed badly, which it is told
/// of, nor a stream h2 itself reset for a fault of the client's. A client
/// that resets its HTTP/2 stream with `NO_ERROR` (the body then ends, as
/// if whole) is not seen here.
pub fn went_away(error: &(dyn std::error::Error + 'static)) -> bool {
    let gone = |e: &std::io::Error| {
        matches!(
            e.kind(),
            std::io::ErrorKind::ConnectionReset
                | std::io::ErrorKind::ConnectionAborted
                | std::io::ErrorKind::UnexpectedEof
                | std::io::ErrorKind::BrokenPipe
        )
    };
    causes(error).any(|cause| {
        if let Some(e) = cause.downcast_ref::<hyper::Error>() {
            return e.is_incomplete_message();
        }
        // h2's error names no source: its I/O error is asked of it. A
        // connection that ended is a broken pipe to h2, whether the client
        // closed it or the gateway itself dropped it (its grace period
        // over, say): no answer reaches the client either way.
        if let Some(e) = cause.downcast_ref::<h2::Error>() {
            return (e.is_reset() && e.is_remote()) || e.get_io().is_some_and(gone);
        }
        cause.downcast_ref::<std::io::Error>().is_some_and(gone)
    })
}

#[cfg(target_os = "linux")]
mod linux {
    use std::io;
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

    use tokio::io::unix::AsyncFd;
    use tokio::io::Interest;

    /// An epoll instance that holds one socket, for its hang-up only; it is
    /// readable (to the runtime) once that has come.
    pub struct HangUpWatch(AsyncFd<OwnedFd>);

    impl HangUpWatch {
        pub fn new(socket: RawFd) -> io::Result<HangUpWatch> {
            // SAFETY: creates a new descriptor, owned below.
            let fd = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
            if fd < 0 {
                return Err(io::Error::last_os_error());
            }
            // SAFETY: `fd` was just made and nothing else owns it.
            let epoll = unsafe { OwnedFd::from_raw_fd(fd) };
            // `EPOLLHUP` and `EPOLLERR` are reported whether asked for or
            // not; no `EPOLLIN`, so that unread bytes do not wake it.
            let mut event = libc::epoll_event {
                events: (libc::EPOLLRDHUP | libc::EPOLLHUP | libc::EPOLLERR) as u32,
                u64: 0,
            };
            // SAFETY: both descriptors are open (see `ClientSocket`), and
            // the event is a live value the kernel only reads.
            let added = unsafe { libc::epoll_ctl(fd, libc::EPOLL_CTL_ADD, socket, &mut event) };
            if added < 0 {
                return Err(io::Error::last_os_error());
            }
            // SAFETY: the `OwnedFd` is open and moves into the `AsyncFd`,
            // which alone owns it from then on.
            let watch = unsafe { AsyncFd::register_with_interest(epoll, Interest::READABLE) };
            watch.map(HangUpWatch).map_err(|e| e.into())
        }

        /// Waits for the hang-up.
        pub async fn wait(&self) {
            loop {
                let Ok(mut ready) = self.0.readable().await else {
                    return std::future::pending().await;
                };
                let mut event = libc::epoll_event { events: 0, u64: 0 };
                // SAFETY: room for the one event asked for; a timeout of 0
                // never blocks.
                let n = unsafe { libc::epoll_wait(self.0.as_raw_fd(), &mut event, 1, 0) };
                if n > 0 {
                    return;
                }
                ready.clear_ready();
            }
        }
    }
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use std::os::fd::AsRawFd;
    use std::time::Duration;

    use tokio::io::AsyncWriteExt;
    use tokio::net::{TcpListener, TcpStream};

    use super::*;

    async fn pair() -> (TcpStream, TcpStream) {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let client = TcpStream::connect(listener.local_addr().expect("address"))
            .await
            .expect("connect");
        let (server, _) = listener.accept().await.expect("accept");
        (client, server)
    }

    #[tokio::test]
    async fn unread_bytes_are_not_a_hang_up_and_a_close_is() {
        let (mut client, server) = pair().await;
        // SAFETY: `server` outlives the watch.
        let gone = unsafe { ClientSocket::new(server.as_raw_fd()) }.gone();
        let mut gone = std::pin::pin!(gone);
        client
            .write_all(b"a body nobody reads")
            .await
            .expect("send");
        // The bytes have arrived once the server side is readable.
        server.readable().await.expect("readable");
        assert!(
            tokio::time::timeout(Duration::from_millis(100), &mut gone)
                .await
                .is_err(),
            "unread bytes woke the watch"
        );
        drop(client);
        tokio::time::timeout(Duration::from_secs(30), gone)
            .await
            .expect("the close is seen");
        // The runtime's readiness for the socket is left as it was: the
        // unread bytes are still there to read.
        let mut buffer = [0u8; 64];
        let n = server.try_read(&mut buffer).expect("the bytes");
        assert_eq!(&buffer[..n], b"a body nobody reads");
    }

    #[tokio::test]
    async fn a_client_that_shuts_down_its_sending_side_is_gone() {
        let (mut client, server) = pair().await;
        client.shutdown().await.expect("shut down");
        tokio::time::timeout(
            Duration::from_secs(30),
            // SAFETY: `server` outlives the watch.
            unsafe { ClientSocket::new(server.as_raw_fd()) }.gone(),
        )
        .await
        .expect("the shutdown is seen");
    }
}
