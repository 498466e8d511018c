//! Stand-ins for an etcd member that fails in one way, in front of a real
//! etcd on loopback: a TCP proxy that can go away or hang.

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
