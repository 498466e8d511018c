//! The upstream's host name, resolved for one connection pool: one lookup
//! at a time, its addresses kept for [`KEEP_ADDRESSES`], and served past
//! that while the next lookup runs, fails or hangs, for up to
//! [`STALE_ADDRESSES`].
//!
//! A lookup runs on the blocking thread pool (`getaddrinfo`), and a
//! connect timeout stops waiting for it but cannot stop it. Each new
//! connection looking the name up itself, a DNS server that stops
//! answering left one blocking thread stuck per connection attempt, up to
//! tokio's 512 per runtime, until the resolver's own timeout. Here a
//! lookup runs on a task of its own that holds the pool's one lookup slot
//! until the lookup ends, whoever still waits for it; callers wait for the
//! slot or the addresses within their own deadline only when there are no
//! addresses to go on with.
//!
//! Before, addresses over a second old were never used again: while a
//! DNS server restarted or lost packets, every request that needed a new
//! connection got 502 or 504, though the upstream still answered at the
//! addresses found a second before.
//!
//! The lookups also tell the pool which kept connections go to an address
//! the name no longer has ([`Resolver::moved_from`]).

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::time::Instant;

use crate::log_throttle::LogThrottle;
use crate::unpoisoned::LockUnpoisoned as _;

/// How long a lookup's addresses serve new connections before the name
/// is looked up again: short, so that a changed DNS record (a service
/// moved) is followed within a second.
pub const KEEP_ADDRESSES: Duration = Duration::from_secs(1);

/// How long the last addresses found go on serving while the lookups
/// after them fail or hang: a DNS outage of up to five minutes costs no
/// request to an upstream that is still where it was. Past that, callers
/// wait for a lookup again, and fail with it.
pub const STALE_ADDRESSES: Duration = Duration::from_secs(300);

/// How long an address the lookups stopped returning stays the name's,
/// for the connections kept to it: DNS servers that answer with a subset
/// of a name's addresses (Route 53's multivalue answers, Consul's record
/// limit) or that lose the AAAA answer now and then would otherwise have
/// healthy connections closed at every lookup.
pub const MOVED_AFTER: Duration = Duration::from_secs(10);

/// How often the name is looked up again for the connections kept to it,
/// while none is needed anew.
pub const RECHECK_KEPT: Duration = Duration::from_secs(5);

/// What the lookups found.
#[derive(Default)]
struct Found {
    /// The last addresses found, and when the lookup ended.
    last: Option<(Arc<[SocketAddr]>, Instant)>,
    /// Every address a lookup returned within [`MOVED_AFTER`], and when
    /// one last did.
    seen: HashMap<SocketAddr, Instant>,
}

/// A host and port, resolved as connections need it.
pub struct Resolver {
    host: String,
    port: u16,
    /// The host as an IP address, which needs no lookup.
    literal: Option<IpAddr>,
    /// The last addresses found, and when.
    found: Arc<Mutex<Found>>,
    /// When the last lookup in the background started: one a
    /// [`KEEP_ADDRESSES`] at most, however many requests ask while the
    /// DNS server fails at once.
    refreshed: Mutex<Option<Instant>>,
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
            found: Arc::new(Mutex::new(Found::default())),
            refreshed: Mutex::new(None),
            lookup: Arc::new(tokio::sync::Mutex::new(())),
        }
    }

    /// The host, as connections are made to it.
    pub fn host(&self) -> &str {
        &self.host
    }

    /// The addresses to try, by `deadline`: those found within
    /// [`KEEP_ADDRESSES`]; or older ones, up to [`STALE_ADDRESSES`], at
    /// once, while a lookup in the background looks for newer ones; or
    /// what a lookup finds by `deadline`.
    pub async fn addresses(&self, deadline: Instant) -> Result<Arc<[SocketAddr]>, ResolveError> {
        if let Some(ip) = self.literal {
            return Ok(Arc::from([SocketAddr::new(ip, self.port)]));
        }
        if let Some(known) = self.known() {
            return Ok(known);
        }
        let slot = tokio::time::timeout_at(deadline, self.lookup.clone().lock_owned())
            .await
            .map_err(|_elapsed| ResolveError::TimedOut)?;
        // Found by the lookup this caller waited behind.
        if let Some(known) = self.known() {
            return Ok(known);
        }
        let lookup = tokio::spawn(self.look_up(slot));
        tokio::time::timeout_at(deadline, lookup)
            .await
            .map_err(|_elapsed| ResolveError::TimedOut)?
            .map_err(|e| ResolveError::Failed(std::io::Error::other(e)))?
            .map_err(ResolveError::Failed)
    }

    /// Whether the name no longer has `peer`, the address of a kept
    /// connection: no lookup returned it in the [`MOVED_AFTER`] up to the
    /// last one (so a DNS outage, in which no lookup ends, moves nothing).
    /// Asking starts a lookup in the background where the last is older
    /// than [`RECHECK_KEPT`]. Never for an IP address, whose connections
    /// all go to it.
    pub fn moved_from(&self, peer: SocketAddr) -> bool {
        if self.literal.is_some() {
            return false;
        }
        let (last, seen) = {
            let found = self.found.lock_unpoisoned();
            let Some((_, last)) = found.last else {
                return false;
            };
            (last, found.seen.get(&peer).copied())
        };
        if last.elapsed() >= RECHECK_KEPT {
            self.refresh();
        }
        seen.is_none_or(|seen| last.duration_since(seen) >= MOVED_AFTER)
    }

    /// The last addresses found, if found within [`KEEP_ADDRESSES`], or
    /// within [`STALE_ADDRESSES`]. A lookup in the background is started
    /// for any older (if none ran for a [`KEEP_ADDRESSES`]).
    fn known(&self) -> Option<Arc<[SocketAddr]>> {
        let (addresses, age) = {
            let found = self.found.lock_unpoisoned();
            let (addresses, at) = found.last.as_ref()?;
            (addresses.clone(), at.elapsed())
        };
        if age < KEEP_ADDRESSES {
            return Some(addresses);
        }
        self.refresh();
        (age < STALE_ADDRESSES).then_some(addresses)
    }

    /// Starts a lookup in the background, unless one is under way or
    /// started within a [`KEEP_ADDRESSES`] (or this thread runs no tokio
    /// runtime).
    fn refresh(&self) {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        {
            let mut refreshed = self.refreshed.lock_unpoisoned();
            if refreshed.is_some_and(|at| at.elapsed() < KEEP_ADDRESSES) {
                return;
            }
            *refreshed = Some(Instant::now());
        }
        let Ok(slot) = self.lookup.clone().try_lock_owned() else {
            return;
        };
        let lookup = self.look_up(slot);
        let host = self.host.clone();
        runtime.spawn(async move {
            if let Err(e) = lookup.await {
                // While the DNS server is down every lookup fails alike.
                static FAILED: LogThrottle = LogThrottle::new();
                if let Some(held_back) = FAILED.admit() {
                    tracing::warn!(
                        error = %e,
                        "looking up the upstream host {host} failed; the addresses found before \
                         serve for up to {} s after they were found {held_back}",
                        STALE_ADDRESSES.as_secs()
                    );
                }
            }
        });
    }

    /// A lookup of the name, holding `slot` until it ends, that keeps what
    /// it finds for the callers after it, whoever still waits for it.
    fn look_up(
        &self,
        slot: tokio::sync::OwnedMutexGuard<()>,
    ) -> impl std::future::Future<Output = std::io::Result<Arc<[SocketAddr]>>> + Send + 'static
    {
        let host = self.host.clone();
        let port = self.port;
        let kept = self.found.clone();
        async move {
            let addresses: Arc<[SocketAddr]> = tokio::net::lookup_host((host.as_str(), port))
                .await?
                .collect();
            // Not a name's addresses to go on with: the ones found before
            // serve instead.
            if addresses.is_empty() {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::NotFound,
                    "the upstream's host name resolves to no address",
                ));
            }
            let now = Instant::now();
            let mut found = kept.lock_unpoisoned();
            found
                .seen
                .retain(|_, at| now.duration_since(*at) < MOVED_AFTER);
            found
                .seen
                .extend(addresses.iter().map(|&address| (address, now)));
            found.last = Some((addresses.clone(), now));
            drop(found);
            drop(slot);
            Ok(addresses)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A kept connection's address counts as moved only once the lookups
    /// up to the last have not returned it for [`MOVED_AFTER`]: an answer
    /// that leaves it out now and then (a subset of the name's addresses)
    /// closes nothing, and neither does a DNS outage, in which no lookup
    /// ends.
    #[test]
    fn an_address_moves_only_once_the_lookups_leave_it_out_for_ten_seconds() {
        let at = |text: &str| text.parse::<SocketAddr>().expect("an address");
        let (a, b) = (at("10.0.0.1:80"), at("10.0.0.2:80"));
        let resolver = Resolver::new("upstream.test", 80);
        assert!(!resolver.moved_from(a), "nothing looked up yet");
        let last = Instant::now();
        let before = |secs: u64| {
            last.checked_sub(Duration::from_secs(secs))
                .expect("a machine up for a minute")
        };
        let found = |seen: &[(SocketAddr, Instant)]| {
            let mut found = resolver.found.lock().expect("not poisoned");
            found.last = Some((Arc::from([b]), last));
            found.seen = seen.iter().copied().collect();
        };
        found(&[(a, before(9)), (b, last)]);
        assert!(!resolver.moved_from(a), "left out of the last answer only");
        assert!(!resolver.moved_from(b));
        found(&[(a, before(10)), (b, last)]);
        assert!(resolver.moved_from(a), "left out for 10 s");
        found(&[(b, last)]);
        assert!(resolver.moved_from(a), "never returned");
        // The last lookup long ago (DNS down since): judged as of then.
        let mut kept = resolver.found.lock().expect("not poisoned");
        kept.last = Some((Arc::from([a]), before(60)));
        kept.seen = [(a, before(60))].into_iter().collect();
        drop(kept);
        assert!(!resolver.moved_from(a));
        assert!(
            !Resolver::new("10.0.0.1", 80).moved_from(b),
            "an IP address"
        );
    }
}
