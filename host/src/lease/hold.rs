//! Holding a machine id: renewing the lease, raising the slot's
//! high-water mark ahead of the ids, moving to another etcd member when
//! the current one stops answering, and letting go cleanly on a stop.

use std::time::{Duration, Instant, SystemTime};

use etcd_client::{Client, LeaseKeepAliveStream, LeaseKeeper};

use super::high_water::Reserved;
use super::{
    unless_stopped, Ended, Keeper, LeaseState, Sent, Stop, RELEASE_WAIT, RENEWALS_PER_TTL,
    RETRY_PAUSE, SAFETY_MARGIN,
};

/// Why a keep-alive stream could not be reopened.
pub(super) enum Reopen {
    /// etcd answered that the lease does not exist.
    Gone,
    /// No endpoint answered; why.
    Failed(String),
}

impl From<etcd_client::Error> for Reopen {
    fn from(error: etcd_client::Error) -> Reopen {
        if lease_not_found(&error) {
            Reopen::Gone
        } else {
            Reopen::Failed(error.to_string())
        }
    }
}

/// What an attempt to raise the mark while holding the slot came to.
pub(super) enum Raise {
    Done,
    /// The member answered with an error (etcd refuses writes: out of
    /// space, for example); another member would answer the same.
    Failed,
    /// The member did not answer in time, or the connection to it failed.
    Unanswered,
    /// The renewal due next came first: the write was given less time
    /// than a member has to answer, and that ran out. Not the member's
    /// fault; the renewal raises the mark right after.
    GaveWay,
    /// The slot is no longer ours.
    Lost(Ended),
}

/// A hold's keep-alive stream, and what is known of the renewals on it.
struct Renewals {
    keeper: LeaseKeeper,
    responses: LeaseKeepAliveStream,
    /// Whether the stream is open, as far as is known. It is watched
    /// between renewals too: etcd going away (a restart, maybe with its
    /// data lost) breaks it, and the lease is then checked at once and
    /// every half second, not only at the next renewal. With a long TTL, a
    /// holder whose lease went with etcd's data would otherwise go on
    /// stamping for up to a third of it, while a replica with a shorter TTL
    /// may already hold its slot.
    open: bool,
    /// Whether renewals are failing (warned once per episode).
    failing: bool,
    /// When the last renewal etcd confirmed was sent: the lease lives at
    /// least until a TTL after it.
    confirmed_at: Instant,
    /// When to renew next: moved only by a renewal attempt, so that
    /// requests to raise the mark cannot put renewals off.
    renew_at: Instant,
}

impl Renewals {
    /// The stream `pair`, reopened by a renewal etcd confirmed that was
    /// sent `at`: renewals go on through it, the next `every` later.
    fn reopened(
        &mut self,
        pair: (LeaseKeeper, LeaseKeepAliveStream),
        at: Instant,
        every: Duration,
    ) {
        (self.keeper, self.responses) = pair;
        self.open = true;
        self.failing = false;
        self.confirmed_at = at;
        self.renew_at = at + every;
    }
}

impl Keeper {
    /// Keeps the lease alive, and the slot's high-water mark ahead of the
    /// ids, until stopped or until the lease may be lost. `alive_since` is
    /// when the last renewal etcd confirmed was sent, or the grant asked
    /// for. Every renewal and mark etcd confirms extends the bounds the
    /// request path enforces (see [`MachineIdentity::confirm`](crate::MachineIdentity::confirm)),
    /// so that nothing here being late can let an id out that is no longer
    /// this replica's to issue.
    pub(super) async fn hold(
        &mut self,
        client: &mut Client,
        lease_id: i64,
        id: u32,
        alive_since: Sent,
    ) -> Ended {
        let ttl = self.config.ttl;
        let every = ttl / RENEWALS_PER_TTL;
        let identity = self.services.identity.clone();
        // Every wait on etcd below also ends when the gateway stops.
        let mut stop = self.stop.clone();
        // The lease lives at least until a TTL after the last renewal that
        // etcd confirmed, counted from when it was sent; before the first,
        // a TTL after the claim's last renewal or grant (not after the
        // claim's end, which can be a while later).
        let mut confirmed_at = alive_since.at;
        let unconfirmed = || {
            Ended::Unconfirmed(format!(
                "no renewal confirmed by etcd within {} ms of sending the last one it confirmed \
                 (the TTL less a safety margin; time this process was frozen counts)",
                (ttl - SAFETY_MARGIN).as_millis()
            ))
        };
        // Opening the stream renews once and waits for etcd to confirm it.
        // Retried until the deadline, through the next endpoint when one
        // fails or does not answer within a call's wait (the client's
        // timeout: the member may have gone since the claim).
        let mut first = true;
        let (keeper, responses) = loop {
            let attempt = Sent::now();
            let within = (confirmed_at + ttl - SAFETY_MARGIN).saturating_duration_since(attempt.at);
            // First through the endpoint the claim just used.
            let opening = tokio::time::timeout(within, async {
                if std::mem::take(&mut first) {
                    return client
                        .lease_keep_alive(lease_id)
                        .await
                        .map_err(Reopen::from);
                }
                self.reopen(client, lease_id).await
            });
            let Some(opened_stream) = unless_stopped(&mut stop, opening).await else {
                return Ended::Stopped;
            };
            let failure = match opened_stream {
                Ok(Ok(pair)) => {
                    confirmed_at = self.renewed(attempt);
                    break pair;
                }
                Ok(Err(Reopen::Gone)) => return Ended::Lost(LEASE_NOT_FOUND.to_string()),
                Ok(Err(Reopen::Failed(e))) => e,
                Err(_) => return unconfirmed(),
            };
            tracing::warn!(error = %failure, "opening the keep-alive stream failed; retrying until the deadline");
            let pause = tokio::time::sleep(RETRY_PAUSE.min(within));
            if unless_stopped(&mut stop, pause).await.is_none() {
                return Ended::Stopped;
            }
        };
        // Whether a request for a higher mark is answered before the next
        // renewal: not after a failed attempt, so that requests refused at
        // the mark while etcd refuses writes do not each cost a write.
        let mut raise_on_request = true;
        // When to raise the mark even if nothing asks: half its lead after
        // the last attempt. A renewal raises it too, and comes sooner with a
        // TTL up to `LONGEST_MARK_LEAD`; with a longer one, renewals alone
        // would let the wall clock reach the mark between them, and the
        // first request after a quiet spell would be refused at it.
        let raise_every = Duration::from_millis(self.mark_ahead() / 2);
        let mut raise_at = Instant::now() + raise_every;
        let mut renewals = Renewals {
            keeper,
            responses,
            open: true,
            failing: false,
            confirmed_at,
            renew_at: confirmed_at + every,
        };
        // How long a renewal on the open stream is waited for.
        let renewal_wait = (every / 2).min(self.call_wait());
        loop {
            let deadline = renewals.confirmed_at + ttl - SAFETY_MARGIN;
            let next = renewals.renew_at.min(deadline);
            let renew = tokio::select! {
                _ = stop.changed() => return Ended::Stopped,
                () = tokio::time::sleep_until(next.into()) => true,
                () = tokio::time::sleep_until(raise_at.into()) => false,
                // Ids came near the mark before the next renewal would
                // raise it (a burst ran the id clock ahead): raise it now.
                () = identity.ceiling_near(), if raise_on_request => false,
                // Nothing is asked between renewals: an answer now is a
                // late one to a renewal given up on (not counted), and
                // an end or an error is the stream breaking.
                message = renewals.responses.message(), if renewals.open => match message {
                    Ok(Some(_late)) => continue,
                    Ok(None) | Err(_) => {
                        renewals.open = false;
                        true
                    }
                },
            };
            if Instant::now() >= deadline {
                return unconfirmed();
            }
            if renew {
                let sent = Sent::now();
                renewals.renew_at = sent.at + every;
                // Waits half the time between renewals at most, and a
                // call's wait, so that a member that stopped answering
                // leaves time to renew through another before the deadline
                // (with the shortest TTL, 3 s, the deadline is a second
                // after the next renewal is due).
                let wait = deadline
                    .saturating_duration_since(sent.at)
                    .min(renewal_wait);
                // A stream that broke or went unanswered is not used again:
                // an answer still queued on it belongs to an earlier renewal
                // and would be counted for this one. It is reopened instead.
                let renewal = tokio::time::timeout(wait, async {
                    if !renewals.open {
                        return Ok(None);
                    }
                    renewals.keeper.keep_alive().await?;
                    renewals.responses.message().await
                });
                let Some(renewed) = unless_stopped(&mut stop, renewal).await else {
                    return Ended::Stopped;
                };
                let failure = match renewed {
                    Ok(Ok(Some(response))) if response.ttl() > 0 => {
                        renewals.failing = false;
                        renewals.confirmed_at = self.renewed(sent);
                        self.status
                            .update(|s| s.last_renewed = Some(SystemTime::now()));
                        None
                    }
                    Ok(Ok(Some(_))) => {
                        return Ended::Lost(
                            "etcd says the lease expired or was revoked".to_string(),
                        )
                    }
                    Ok(Ok(None)) if !renewals.open => {
                        Some("the keep-alive stream broke".to_string())
                    }
                    Ok(Ok(None)) => Some("etcd closed the keep-alive stream".to_string()),
                    Ok(Err(e)) => Some(e.to_string()),
                    Err(_) => Some(format!("no answer within {} ms", wait.as_millis())),
                };
                if let Some(failure) = failure {
                    // Retried every half second while etcd is away: one
                    // warning when it starts, the rest at debug level.
                    if std::mem::replace(&mut renewals.failing, true) {
                        tracing::debug!(error = %failure, "renewing the lease failed again; retrying until the deadline");
                    } else {
                        tracing::warn!(error = %failure, "renewing the lease failed; retrying until the deadline");
                    }
                    renewals.open = false;
                    // Tried again soon, not a third of the TTL later.
                    renewals.renew_at = Instant::now() + RETRY_PAUSE;
                    // Reopening renews once and waits for etcd to confirm
                    // it, through another endpoint if this one fails.
                    let reopening = self.reopen_by(client, lease_id, deadline);
                    let Some(reopened) = unless_stopped(&mut stop, reopening).await else {
                        return Ended::Stopped;
                    };
                    match reopened {
                        Err(lost) => return lost,
                        Ok(Some((pair, at))) => {
                            renewals.reopened(pair, at, every);
                        }
                        Ok(None) => {}
                    }
                    continue;
                }
            }
            // After a confirmed renewal, or when ids came near the mark:
            // raise it, waiting no later than the next renewal is due (which
            // must not wait on a write).
            let until = renewals
                .renew_at
                .min(renewals.confirmed_at + ttl - SAFETY_MARGIN);
            // Right after a renewal the raise has all the time there is
            // until the next one; otherwise, less may be left.
            let raising = self.raise_mark(client, id, lease_id, until, !renew);
            let Some(raised) = unless_stopped(&mut stop, raising).await else {
                return Ended::Stopped;
            };
            raise_at = Instant::now() + raise_every;
            raise_on_request = match raised {
                Raise::Done => true,
                Raise::Failed => false,
                // The member answers renewals but not writes: its disk may
                // have stalled (a follower forwards a renewal to the
                // leader, but answers a write only once it has applied it
                // itself). Renewals alone would keep this replica on it,
                // refusing ids at the old mark, for as long as the stall
                // lasts: the keeper moves to another member, and raises the
                // mark through it at once.
                Raise::Unanswered if self.config.endpoints.len() > 1 => {
                    tracing::warn!(
                        "the etcd member did not answer a high-water mark write in time; \
                         moving to another member"
                    );
                    // Moving renews the lease; if no other member answers
                    // in time, the stream on this one is still open, and
                    // the move leaves a renewal's wait to renew on it.
                    let by = (renewals.confirmed_at + ttl - SAFETY_MARGIN)
                        .checked_sub(renewal_wait)
                        .unwrap_or(renewals.confirmed_at);
                    let moving = self.reopen_by(client, lease_id, by);
                    let Some(moved) = unless_stopped(&mut stop, moving).await else {
                        return Ended::Stopped;
                    };
                    match moved {
                        Err(lost) => return lost,
                        Ok(Some((pair, at))) => {
                            renewals.reopened(pair, at, every);
                            raise_at = Instant::now();
                        }
                        Ok(None) => {}
                    }
                    false
                }
                Raise::Unanswered => false,
                // Until the renewal, which raises it, nothing else asks.
                Raise::GaveWay => false,
                Raise::Lost(lost) => return lost,
            };
        }
    }

    /// Reopens the keep-alive stream (see [`Keeper::reopen`]), waiting no
    /// later than `deadline`. The stream, and when the renewal that opened
    /// it was sent (see [`Keeper::renewed`]); `None` if no member confirmed
    /// the renewal in time; the end of the hold if etcd says the lease is
    /// gone.
    pub(super) async fn reopen_by(
        &mut self,
        client: &mut Client,
        lease_id: i64,
        deadline: Instant,
    ) -> Result<Option<((LeaseKeeper, LeaseKeepAliveStream), Instant)>, Ended> {
        let reopened = Sent::now();
        let within = deadline.saturating_duration_since(reopened.at);
        match tokio::time::timeout(within, self.reopen(client, lease_id)).await {
            Ok(Ok(pair)) => Ok(Some((pair, self.renewed(reopened)))),
            Ok(Err(Reopen::Gone)) => Err(Ended::Lost(LEASE_NOT_FOUND.to_string())),
            Ok(Err(Reopen::Failed(e))) => {
                tracing::debug!(error = %e, "reopening the keep-alive stream failed");
                Ok(None)
            }
            Err(_timeout) => Ok(None),
        }
    }

    /// Reopens the keep-alive stream for `lease_id` (which renews it once).
    /// With one endpoint, through `client`. With several, through the first
    /// that answers, the others before the current one (which just failed,
    /// and may hang rather than refuse: a call on it would wait for its
    /// timeout, and the deadline would come before another was tried); the
    /// new client replaces `client`.
    pub(super) async fn reopen(
        &mut self,
        client: &mut Client,
        lease_id: i64,
    ) -> Result<(LeaseKeeper, LeaseKeepAliveStream), Reopen> {
        if self.config.endpoints.len() < 2 {
            return client
                .lease_keep_alive(lease_id)
                .await
                .map_err(Reopen::from);
        }
        self.try_others_first();
        let mut other = self
            .connect()
            .await
            .map_err(|e| Reopen::Failed(format!("{e:#}")))?;
        let pair = other.lease_keep_alive(lease_id).await?;
        *client = other;
        Ok(pair)
    }

    /// A renewal etcd confirmed, sent at `sent`: the request path may use
    /// the id until a TTL (less the margin) after it. Returns when it was
    /// sent, by the keeper's clock.
    pub(super) fn renewed(&self, sent: Sent) -> Instant {
        self.services.identity.lease_renewed(self.alive_until(sent));
        sent.at
    }

    /// Raises the slot's high-water mark, waiting at most until `deadline`
    /// (no later than the next renewal is due), and lets the request path
    /// use milliseconds up to it. A mark that could not be written is
    /// logged: ids stop at the old one (the request path refuses later
    /// ones) until a later attempt succeeds.
    pub(super) async fn raise_mark(
        &self,
        client: &mut Client,
        id: u32,
        lease_id: i64,
        deadline: Instant,
        may_give_way: bool,
    ) -> Raise {
        let within = deadline.saturating_duration_since(Instant::now());
        match tokio::time::timeout(within, self.reserve(client, id, lease_id, 0)).await {
            Ok(Ok(Reserved::Raised(mark))) => {
                self.services
                    .identity
                    .ceiling_raised(mark, self.raise_from(mark));
                Raise::Done
            }
            Ok(Ok(Reserved::NotOurs)) => Raise::Lost(Ended::Lost(format!(
                "the key of machine id {id} is no longer bound to this replica's lease"
            ))),
            Ok(Err(e)) => {
                tracing::warn!(error = %format!("{e:#}"), "raising the high-water mark failed; ids stop at the old mark until it is raised");
                if unanswered(&e) {
                    Raise::Unanswered
                } else {
                    Raise::Failed
                }
            }
            // A raise asked for just before a renewal is due has only the
            // time until then: running out of it says nothing of etcd.
            // Before, it was taken for a member that does not answer
            // writes ("etcd did not answer within 0 ms"), and the keeper
            // moved to another member for nothing. Not so for the raise
            // right after a renewal: with a TTL up to 6 s its time, a
            // renewal's interval, is less than a member's answer wait too,
            // and its running out is the sign of a member whose writes
            // stall, which the keeper must leave.
            Err(_timeout) if may_give_way && within < self.call_wait() => {
                tracing::debug!(
                    "raising the high-water mark gave way to the lease renewal due in {} ms, \
                     which raises it",
                    within.as_millis()
                );
                Raise::GaveWay
            }
            Err(_timeout) => {
                tracing::warn!(
                    "raising the high-water mark failed: etcd did not answer within {} ms; ids \
                     stop at the old mark until it is raised",
                    within.as_millis()
                );
                Raise::Unanswered
            }
        }
    }

    /// Clean stop: withdraw, record the exact high-water mark, revoke;
    /// through another endpoint if the current one fails.
    pub(super) async fn release(&mut self, client: &mut Client, lease_id: i64, id: u32) {
        self.services.identity.withdraw("the gateway is stopping");
        let exact = match *self.stop.borrow() {
            Stop::Drained => self.services.clock.last_tick().map(|last| last.millis),
            _ => None,
        };
        if !self.give_up(client, lease_id, id, exact).await && self.config.endpoints.len() > 1 {
            // The member may hang: once more through the others, within a
            // bounded time too.
            self.try_others_first();
            if let Ok(Ok(mut other)) = tokio::time::timeout(RELEASE_WAIT, self.connect()).await {
                self.give_up(&mut other, lease_id, id, exact).await;
            }
        }
        self.status.update(|s| {
            s.state = LeaseState::Released;
            s.machine_id = None;
            s.lease_id = None;
        });
    }

    /// Writes the exact mark `exact` (when the stop drained: only while
    /// the slot is still ours, see `put_mark`; if not, or etcd does not
    /// answer, the reserved mark stays) and revokes the lease, waiting at
    /// most [`RELEASE_WAIT`] for each. Whether the revocation went through.
    pub(super) async fn give_up(
        &self,
        client: &mut Client,
        lease_id: i64,
        id: u32,
        exact: Option<u64>,
    ) -> bool {
        if let Some(millis) = exact {
            let write = self.put_mark(client, id, lease_id, millis);
            let _ = tokio::time::timeout(RELEASE_WAIT, write).await;
        }
        match tokio::time::timeout(RELEASE_WAIT, client.lease_revoke(lease_id)).await {
            Ok(Ok(_)) => {
                tracing::info!(machine_id = id, "machine id lease revoked");
                true
            }
            Ok(Err(e)) => {
                tracing::warn!(error = %e, "revoking the lease failed; it expires after its TTL");
                false
            }
            Err(_) => {
                tracing::warn!(
                    "revoking the lease failed: etcd did not answer within {} s; it expires after its TTL",
                    RELEASE_WAIT.as_secs()
                );
                false
            }
        }
    }
}

/// Why a lease ended that etcd no longer knows.
pub(super) const LEASE_NOT_FOUND: &str =
    "etcd no longer knows the lease (it expired, was revoked, or etcd lost its data)";

/// Whether `error` says that an etcd member did not answer (in time, or
/// at all), rather than answered with a refusal: then another member may
/// answer.
pub(super) fn unanswered(error: &anyhow::Error) -> bool {
    error
        .chain()
        .filter_map(|cause| cause.downcast_ref::<etcd_client::Error>())
        .any(|cause| match cause {
            etcd_client::Error::TransportError(_) | etcd_client::Error::IoError(_) => true,
            etcd_client::Error::GRpcStatus(status) => matches!(
                status.code(),
                tonic::Code::Cancelled | tonic::Code::DeadlineExceeded | tonic::Code::Unavailable
            ),
            _ => false,
        })
}

/// Whether `error` says etcd answered that the lease does not exist (see
/// [`lease_not_found`]).
pub(super) fn gone(error: &anyhow::Error) -> bool {
    error
        .chain()
        .filter_map(|cause| cause.downcast_ref::<etcd_client::Error>())
        .any(lease_not_found)
}

/// Whether opening a keep-alive stream failed because etcd answered that
/// the lease does not exist (or has expired): then it is gone for good,
/// unlike a failure to reach etcd. etcd-client reports that answer, a TTL
/// of 0 or less, only by this message.
pub(super) fn lease_not_found(error: &etcd_client::Error) -> bool {
    matches!(error, etcd_client::Error::LeaseKeepAliveError(m) if m == "lease not found")
}

#[cfg(test)]
mod tests {
    use super::*;
    use anyhow::Context as _;

    fn status(status: tonic::Status) -> anyhow::Error {
        Err::<(), _>(etcd_client::Error::GRpcStatus(status))
            .context("writing the slot's high-water mark")
            .unwrap_err()
    }

    #[test]
    fn a_member_that_times_out_or_is_unavailable_did_not_answer() {
        assert!(unanswered(&status(tonic::Status::cancelled(
            "Timeout expired"
        ))));
        assert!(unanswered(&status(tonic::Status::deadline_exceeded(
            "late"
        ))));
        assert!(unanswered(&status(tonic::Status::unavailable(
            "connection refused"
        ))));
    }

    #[test]
    fn a_member_that_refuses_answered() {
        let full = tonic::Status::resource_exhausted("etcdserver: mvcc: database space exceeded");
        assert!(!unanswered(&status(full)));
        assert!(!unanswered(&status(tonic::Status::permission_denied("no"))));
        assert!(!unanswered(&anyhow::anyhow!(
            "the high-water mark changed 3 times"
        )));
    }

    #[test]
    fn only_etcds_lease_not_found_means_the_lease_is_gone() {
        let not_found = Err::<(), _>(etcd_client::Error::LeaseKeepAliveError(
            "lease not found".to_string(),
        ))
        .context("renewing the lease while claiming a machine id")
        .unwrap_err();
        assert!(gone(&not_found));
        assert!(!gone(&status(tonic::Status::unavailable("down"))));
        assert!(!gone(&anyhow::anyhow!("lease not found")));
    }
}
