//! Stand-ins for an etcd member that fails in one way, each in front of a
//! real etcd on loopback: a TCP proxy that can go away or hang, and an
//! HTTP/2 (gRPC) proxy whose member answers lease calls but not reads or
//! writes, as a member whose disk stalled does. No etcd build here can
//! stall one member's disk: `fsfreeze` needs root and a file system of its
//! own, so the fault is made at the protocol level instead.

use tokio::io::AsyncWriteExt as _;

/// A TCP proxy to etcd on loopback, which a test can take down (its
/// listener closes and every connection through it is cut) or hang (its
/// connections stay open and nothing more goes through, as with a member
/// that stopped answering or a network that drops its packets), and then
/// resume (what was held back goes through).
pub struct EtcdProxy {
    /// Where clients reach etcd through it.
    pub url: String,
    tasks: tokio::task::JoinSet<()>,
    hung: tokio::sync::watch::Sender<bool>,
}

/// Copies `from` to `to`, holding each read back while `hung` is set.
async fn relay(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    mut hung: tokio::sync::watch::Receiver<bool>,
) {
    use tokio::io::AsyncReadExt as _;
    let mut buffer = vec![0; 16 * 1024];
    loop {
        let read = match from.read(&mut buffer).await {
            Ok(0) | Err(_) => return,
            Ok(read) => read,
        };
        if hung.wait_for(|&hung| !hung).await.is_err() {
            return;
        }
        if to.write_all(&buffer[..read]).await.is_err() {
            return;
        }
    }
}

impl EtcdProxy {
    /// Starts relaying to etcd at `target` (`host:port`).
    pub async fn start(target: &str) -> EtcdProxy {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind the proxy");
        let url = format!("http://{}", listener.local_addr().expect("address"));
        let target = target.to_string();
        let (hung, hang) = tokio::sync::watch::channel(false);
        let mut tasks = tokio::task::JoinSet::new();
        tasks.spawn(async move {
            let mut connections = tokio::task::JoinSet::new();
            while let Ok((client, _)) = listener.accept().await {
                let target = target.clone();
                let hang = hang.clone();
                connections.spawn(async move {
                    let Ok(server) = tokio::net::TcpStream::connect(&target).await else {
                        return;
                    };
                    let (client_in, client_out) = client.into_split();
                    let (server_in, server_out) = server.into_split();
                    tokio::join!(
                        relay(client_in, server_out, hang.clone()),
                        relay(server_in, client_out, hang),
                    );
                });
            }
        });
        EtcdProxy { url, tasks, hung }
    }

    /// Closes the listener and cuts every connection.
    pub fn take_down(&mut self) {
        self.tasks.abort_all();
    }

    /// Stops forwarding: connections, old and new, stay open and silent.
    pub fn hang(&self) {
        self.hung.send_replace(true);
    }

    /// Forwards again, what was held back first.
    pub fn resume(&self) {
        self.hung.send_replace(false);
    }
}

/// An HTTP/2 proxy to etcd on loopback that, while its disk is "stalled",
/// withholds its answers to key-value calls (reads and transactions), as
/// an etcd follower whose disk stalled does: it forwards a write to the
/// leader, which commits it with the other members, but answers only once
/// it has applied the write itself, and it serves a linearizable read only
/// once it has applied what the leader committed before. Lease calls go
/// through, as a follower forwards them to the leader without its disk.
/// Each call is still forwarded at once, so a write lands in etcd though
/// its answer is held back.
pub struct StallingMember {
    /// Where clients reach etcd through it.
    pub url: String,
    stalled: tokio::sync::watch::Sender<bool>,
    task: tokio::task::JoinHandle<()>,
}

impl StallingMember {
    /// Starts proxying to etcd at `target` (`host:port`).
    pub async fn start(target: &str) -> StallingMember {
        let (stalled, stall) = tokio::sync::watch::channel(false);
        let (url, task) = grpc_proxy(target, move |mut sender, request| {
            let mut stall = stall.clone();
            async move {
                let key_value = request.uri().path().starts_with("/etcdserverpb.KV/");
                let response = sender.send_request(request).await?;
                if key_value {
                    // Answered once the disk is back (or never, if the
                    // proxy goes first).
                    let _ = stall.wait_for(|&stalled| !stalled).await;
                }
                Ok(response)
            }
        })
        .await;
        StallingMember { url, stalled, task }
    }

    /// Stalls the disk: key-value calls go unanswered from now on.
    pub fn stall(&self) {
        self.stalled.send_replace(true);
    }

    /// The disk is back: held answers go out.
    pub fn thaw(&self) {
        self.stalled.send_replace(false);
    }
}

impl Drop for StallingMember {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Where a [`ReadHoldingMember`] is in holding back one read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Hold {
    /// Nothing to hold.
    Off,
    /// The next read that comes through is held.
    Armed,
    /// A read came and was sent on to etcd, which has not answered yet.
    Sent,
    /// etcd answered the read: the answer is held back.
    Held,
    /// The answer went out; key-value calls are logged from now on.
    Released,
}

/// An HTTP/2 (gRPC) proxy to etcd on loopback that can hold back etcd's
/// answer to one read (a `Range` call): a test can then change a key after
/// etcd served a client's read of it and before the client acts on what it
/// read, as when another write lands between the two. The key-value calls
/// that come after the held answer are logged, in order, by method.
pub struct ReadHoldingMember {
    /// Where clients reach etcd through it.
    pub url: String,
    hold: std::sync::Arc<tokio::sync::watch::Sender<Hold>>,
    calls: std::sync::Arc<tokio::sync::watch::Sender<Vec<String>>>,
    task: tokio::task::JoinHandle<()>,
}

impl ReadHoldingMember {
    /// Starts proxying to etcd at `target` (`host:port`).
    pub async fn start(target: &str) -> ReadHoldingMember {
        let hold = std::sync::Arc::new(tokio::sync::watch::channel(Hold::Off).0);
        let calls = std::sync::Arc::new(tokio::sync::watch::channel(Vec::new()).0);
        let (proxy_hold, proxy_calls) = (hold.clone(), calls.clone());
        let (url, task) = grpc_proxy(target, move |mut sender, request| {
            let (hold, calls) = (proxy_hold.clone(), proxy_calls.clone());
            async move {
                let method = request
                    .uri()
                    .path()
                    .strip_prefix("/etcdserverpb.KV/")
                    .map(str::to_string);
                let mut held = false;
                if let Some(method) = method {
                    if *hold.borrow() == Hold::Released {
                        calls.send_modify(|calls| calls.push(method.clone()));
                    }
                    held = method == "Range"
                        && hold.send_if_modified(|hold| {
                            let armed = *hold == Hold::Armed;
                            if armed {
                                *hold = Hold::Sent;
                            }
                            armed
                        });
                }
                // For a unary call, the answer's headers come once etcd has
                // served it.
                let response = sender.send_request(request).await?;
                if held {
                    hold.send_replace(Hold::Held);
                    let _ = hold
                        .subscribe()
                        .wait_for(|&hold| hold == Hold::Released)
                        .await;
                }
                Ok(response)
            }
        })
        .await;
        ReadHoldingMember {
            url,
            hold,
            calls,
            task,
        }
    }

    /// Holds back the answer to the next read that comes through, once
    /// etcd has given it.
    pub fn hold_next_read(&self) {
        self.hold.send_replace(Hold::Armed);
    }

    /// Waits, at most `bound`, until etcd has answered the read and its
    /// answer is held back.
    pub async fn wait_held(&self, bound: std::time::Duration) {
        let mut hold = self.hold.subscribe();
        let held = tokio::time::timeout(bound, hold.wait_for(|&hold| hold == Hold::Held)).await;
        assert!(
            matches!(held, Ok(Ok(_))),
            "no read came through and was answered within {bound:?} ({:?})",
            *self.hold.borrow()
        );
    }

    /// Lets the held answer go out.
    pub fn release(&self) {
        self.hold.send_replace(Hold::Released);
    }

    /// The first `count` key-value calls (by method: `Range`, `Txn`, ...)
    /// that came through after the held answer went out, waiting for them
    /// at most `bound`.
    pub async fn calls_after_release(
        &self,
        count: usize,
        bound: std::time::Duration,
    ) -> Vec<String> {
        let mut calls = self.calls.subscribe();
        let came = tokio::time::timeout(bound, calls.wait_for(|calls| calls.len() >= count)).await;
        let calls = self.calls.borrow().clone();
        assert!(
            matches!(came, Ok(Ok(_))),
            "{count} key-value calls did not come within {bound:?} after the held answer went \
             out: {calls:?}"
        );
        calls[..count].to_vec()
    }
}

impl Drop for ReadHoldingMember {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// An HTTP/2 (gRPC) proxy on a loopback port of its own to etcd at
/// `target` (`host:port`): each request of a client goes to `answer` with
/// a sender on a connection of its own to etcd, and what `answer` gives
/// goes back. Its URL, and the task that serves it.
async fn grpc_proxy<F, A>(target: &str, answer: F) -> (String, tokio::task::JoinHandle<()>)
where
    F: Fn(
            hyper::client::conn::http2::SendRequest<hyper::body::Incoming>,
            http::Request<hyper::body::Incoming>,
        ) -> A
        + Clone
        + Send
        + Sync
        + 'static,
    A: std::future::Future<Output = Result<http::Response<hyper::body::Incoming>, hyper::Error>>
        + Send
        + 'static,
{
    use hyper_util::rt::{TokioExecutor, TokioIo};

    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind the proxy");
    let url = format!("http://{}", listener.local_addr().expect("address"));
    let target = target.to_string();
    let task = tokio::spawn(async move {
        while let Ok((client, _)) = listener.accept().await {
            let (target, answer) = (target.clone(), answer.clone());
            tokio::spawn(async move {
                let Ok(server) = tokio::net::TcpStream::connect(&target).await else {
                    return;
                };
                let Ok((sender, connection)) = hyper::client::conn::http2::handshake(
                    TokioExecutor::new(),
                    TokioIo::new(server),
                )
                .await
                else {
                    return;
                };
                tokio::spawn(connection);
                let service =
                    hyper::service::service_fn(move |request| answer(sender.clone(), request));
                let _ = hyper::server::conn::http2::Builder::new(TokioExecutor::new())
                    .serve_connection(TokioIo::new(client), service)
                    .await;
            });
        }
    });
    (url, task)
}
