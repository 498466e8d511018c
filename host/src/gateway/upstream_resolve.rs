//! The upstream's host name, resolved for one connection pool: one lookup
//! at a time, its addresses kept for [`KEEP_ADDRESSES`].
//!
//! A lookup runs on the blocking thread pool (`getaddrinfo`), and a
//! connect timeout stops waiting for it but cannot stop it. Each new
//! connection looking the name up itself, a DNS server that stops
//! answering left one blocking thread stuck per connection attempt, up to
//! tokio's 512 per runtime, until the resolver's own timeout. Here a
//! lookup runs on a task of its own that holds the pool's one lookup slot
//! until the lookup ends, whoever still waits for it; callers wait for the
//! slot or the addresses within their own deadline.

use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio::time::Instant;

/// How long a lookup's addresses serve new connections before the name
/// is looked up again: short, so that a changed DNS record (a service
/// moved) is followed within a second.
pub const KEEP_ADDRESSES: Duration = Duration::from_secs(1);

/// The last addresses a lookup found, and when it ended.
type Found = Option<(Arc<[SocketAddr]>, Instant)>;

/// A host and port, resolved as connections need it.
pub struct Resolver {
    host: String,
    port: u16,
    /// The host as an IP address, which needs no lookup.
    literal: Option<IpAddr>,
    /// The last addresses found, and when.
    found: Arc<Mutex<Found>>,
    /// Held by the lookup under way, until it ends.
    lookup: Arc<tokio::sync::Mutex<()>>,
}

/// Why no addresses came.
#[derive(Debug)]
pub enum ResolveError {
    /// The deadline passed first (the lookup may go on, alone).
    TimedOut,
    /// The lookup failed.
    Failed(std::io::Error),
}

impl Resolver {
    /// A resolver of `host` (a name or an IP address, without the brackets
    /// of an IPv6 literal) and `port`.
    pub fn new(host: &str, port: u16) -> Resolver {
        Resolver {
            host: host.to_string(),
            port,
            literal: host.parse().ok(),
            found: Arc::new(Mutex::new(None)),
            lookup: Arc::new(tokio::sync::Mutex::new(())),
        }
    }

    /// The host, as connections are made to it.
    pub fn host(&self) -> &str {
        &self.host
    }

    /// The addresses to try, by `deadline`.
    pub async fn addresses(&self, deadline: Instant) -> Result<Arc<[SocketAddr]>, ResolveError> {
        if let Some(ip) = self.literal {
            return Ok(Arc::from([SocketAddr::new(ip, self.port)]));
        }
        if let Some(fresh) = self.fresh() {
            return Ok(fresh);
        }
        let slot = tokio::time::timeout_at(deadline, self.lookup.clone().lock_owned())
            .await
            .map_err(|_elapsed| ResolveError::TimedOut)?;
        // Found by the lookup this caller waited behind.
        if let Some(fresh) = self.fresh() {
            return Ok(fresh);
        }
        let host = self.host.clone();
        let port = self.port;
        let kept = self.found.clone();
        // The lookup keeps the slot, and keeps what it finds for the
        // callers after it, even if this caller stops waiting.
        let lookup = tokio::spawn(async move {
            let addresses: Arc<[SocketAddr]> = tokio::net::lookup_host((host.as_str(), port))
                .await?
                .collect();
            *kept.lock().unwrap_or_else(PoisonError::into_inner) =
                Some((addresses.clone(), Instant::now()));
            drop(slot);
            Ok::<_, std::io::Error>(addresses)
        });
        tokio::time::timeout_at(deadline, lookup)
            .await
            .map_err(|_elapsed| ResolveError::TimedOut)?
            .map_err(|e| ResolveError::Failed(std::io::Error::other(e)))?
            .map_err(ResolveError::Failed)
    }

    /// The last addresses found, if found within [`KEEP_ADDRESSES`].
    fn fresh(&self) -> Option<Arc<[SocketAddr]>> {
        let found = self.found.lock().unwrap_or_else(PoisonError::into_inner);
        found
            .as_ref()
            .filter(|(_, at)| at.elapsed() < KEEP_ADDRESSES)
            .map(|(addresses, _)| addresses.clone())
    }
}
