//! The memory that request bodies read whole may hold at once.
//!
//! A body for the plugin is read into memory before the call, and stays
//! there until the upstream has taken it. Each is at most `--max-body-bytes`,
//! but without a bound on them all together, a burst of long prompts (or
//! one HTTP/2 connection's many streams) could take more memory than the
//! machine has, and the gateway, killed for it, would drop every request
//! in flight. So a body takes room here before any of it is read: its
//! declared length, or [`UNDECLARED_ROOM`] (1 MiB) when it declares none,
//! taking more as it arrives where that is free at once, and giving back
//! what it did not use once it is read. A request that finds no room waits
//! for it in the order requests came, at most for a given time, and is then
//! answered 503 `body_memory_full`; one of up to [`SMALL_BODY`] takes room
//! in a lane of its own first, where that has it (see [`BodyMemory::lane`]).
//!
//! No request waits for room while it holds room: a body that turns out
//! longer than the room it took (its declared length was wrong, which
//! hyper's framing does not let through) takes more only where it is free
//! at once. Two more rules keep the requests that hold room moving, so
//! that those waiting cannot hold them up:
//! - Once it has room, a body must arrive whole within the same time a
//!   request may wait for room, and keep pace while others wait (the
//!   caller bounds the read, see [`BodyMemory::wait`] and
//!   [`body_pace`](crate::gateway::body_pace)); otherwise a client could
//!   take room for a large body by declaring it and keep it by sending a
//!   byte now and then.
//! - A request waiting for room does not read its body, so over HTTP/2 its
//!   stream's flow-control window (1 MiB) fills. Sixteen such streams would
//!   use up their connection's window (16 MiB), and the streams of that
//!   connection that hold room would then get no more of their bodies. So
//!   at most [`MAX_WAITING_PER_CONNECTION`] requests of one connection wait
//!   at once; more are refused at once.
//!
//! A request whose client goes away while it waits leaves the line at once
//! (over HTTP/1 the connection's socket is watched for that meanwhile, see
//! `client_gone`).
//!
//! A body the plugin rewrote may be larger than the one read (each id it
//! inserts is some 40 bytes). Its room grows where that much is free at
//! once; where it is not, the body is sent anyway, as it is already in
//! memory, and what it holds beyond its room is counted apart, as the
//! overdraft ([`BodyMemory::overdrawn`]), so that the gauges show all the
//! memory bodies hold. A body may overdraw at most its own room; a larger
//! answer where no room is free is refused, so all bodies hold at most
//! twice the limit.
//!
//! Room is counted in KiB, rounded up, so that any body's size is a count
//! the semaphore can hold.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::gateway::client_gone::{self, ClientSocket};
use crate::gateway::queued::Queued;

/// Room is counted in units of this many bytes.
const UNIT: usize = 1024;

/// The bound on all bodies when none is given: 1 GiB, or the largest body
/// taken where that is larger.
pub const DEFAULT_LIMIT: usize = 1 << 30;

/// The room a body of no declared length (chunked, or HTTP/2 without
/// `Content-Length`) takes before any of it is read, if the body limit is
/// not smaller: one HTTP/2 stream's window, more than most JSON requests.
/// It takes more as it arrives, where that is free at once
/// ([`BodyMemory::grow_now`]); where none is, it is refused
/// ([`NoRoomCause::Outgrown`]). Taking the whole body limit (32 MiB) for
/// each, as before, let 32 small streamed bodies fill the default 1 GiB:
/// a review saw 60 of 100 such HTTP/2 requests refused.
pub const UNDECLARED_ROOM: usize = 1 << 20;

/// The largest declared body that may take room in the small bodies' lane
/// when none is free: a chat request is a few KiB.
pub const SMALL_BODY: usize = 64 << 10;

/// The units of the small bodies' lane (see [`BodyMemory::lane`]).
fn lane_units(total: usize) -> usize {
    (total / 16).max(SMALL_BODY / UNIT)
}

/// Whether room of `units` is for a small body, which may take room in
/// the small bodies' lane.
fn is_small(units: u32) -> bool {
    units as usize * UNIT <= SMALL_BODY
}

/// The most requests of one client connection that wait for room at once:
/// half of an HTTP/2 connection's flow-control window, in stream windows
/// (the gateway's are 16 and 1 MiB), so that the other half stays for the
/// connection's streams that hold room.
pub const MAX_WAITING_PER_CONNECTION: usize = 8;

/// The requests of one client connection waiting for room now: one per
/// connection, shared by its requests (the server hands it to each in its
/// `BodyProgress`).
#[derive(Debug, Default)]
pub struct ConnectionWaits(AtomicUsize);

impl ConnectionWaits {
    /// How many wait now.
    pub fn now(&self) -> usize {
        self.0.load(Ordering::Acquire)
    }

    /// Counts `change` more waiting requests, for tests of those that
    /// read the count.
    #[cfg(test)]
    pub(crate) fn add_for_test(&self, change: isize) {
        if change >= 0 {
            self.0.fetch_add(change.unsigned_abs(), Ordering::AcqRel);
        } else {
            self.0.fetch_sub(change.unsigned_abs(), Ordering::AcqRel);
        }
    }
}

/// What the body memory knows of the client connection a request came on.
#[derive(Debug, Clone)]
pub struct ClientConnection {
    /// Its requests waiting for room now.
    pub waits: Arc<ConnectionWaits>,
    /// Its socket, watched while the request waits, where the client could
    /// not otherwise be seen to go away (HTTP/1).
    pub socket: Option<ClientSocket>,
}

/// Why a request got no room.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unreserved {
    /// None came free in time, or its connection has as many requests
    /// waiting as it may.
    NoRoom(NoRoom),
    /// Its client went away while it waited.
    ClientGone,
}

/// The bound on all bodies for a gateway that takes bodies of up to
/// `max_body_bytes` and was given none.
pub fn default_limit(max_body_bytes: usize) -> usize {
    DEFAULT_LIMIT.max(max_body_bytes)
}

/// The memory request bodies read whole may hold at once, shared by every
/// request of a gateway.
#[derive(Debug)]
pub struct BodyMemory {
    units: Arc<Semaphore>,
    /// The small bodies' lane (see [`lane_units`]).
    lane: Arc<Semaphore>,
    /// All the units the lane has.
    lane_total: usize,
    /// All the units there are, beside the lane's.
    total: usize,
    limit: usize,
    wait: Duration,
    waiting: AtomicUsize,
    /// The units rewritten bodies hold beyond their room.
    overdrawn: Arc<AtomicUsize>,
}

/// Room held for one body: given back when dropped.
#[derive(Debug)]
pub struct Room {
    permit: Option<OwnedSemaphorePermit>,
    /// Room in the small bodies' lane, taken where none other was free.
    lane: Option<OwnedSemaphorePermit>,
    overdraft: Option<Overdraft>,
}

/// What one body holds beyond its room, counted in its memory's overdraft
/// until dropped.
#[derive(Debug)]
struct Overdraft {
    units: usize,
    count: Arc<AtomicUsize>,
}

impl Drop for Overdraft {
    fn drop(&mut self) {
        self.count.fetch_sub(self.units, Ordering::Relaxed);
    }
}

impl std::fmt::Display for Unreserved {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Unreserved::NoRoom(no_room) => no_room.fmt(f),
            Unreserved::ClientGone => f.write_str(
                "the client went away while its request waited for room in the gateway's body \
                 memory",
            ),
        }
    }
}

impl std::error::Error for Unreserved {}

/// No room for a body.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NoRoom {
    /// The bound on all bodies, in bytes.
    pub limit: usize,
    /// How long the request waited.
    pub waited: Duration,
    /// Why it got none.
    pub cause: NoRoomCause,
}

/// Why a body got no room.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NoRoomCause {
    /// None came free within the wait (or the body is larger than all the
    /// room there is).
    WaitRanOut,
    /// It was refused without waiting: as many requests of its connection
    /// as may already wait.
    ConnectionFull,
    /// The body grew past the room it took as it arrived (one of no
    /// declared length, see [`UNDECLARED_ROOM`]), and no more was free at
    /// once.
    Outgrown,
    /// The plugin answered a body more than twice the room its request
    /// took, and no room for the rest was free at once (see
    /// [`BodyMemory::resize_for`]).
    Rewritten {
        /// The size of the plugin's answer, in bytes.
        answer: usize,
        /// The room the request held, in bytes.
        held: usize,
    },
}

impl std::fmt::Display for NoRoom {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "the gateway holds as many request bodies in memory as it may ({} MiB, \
             --body-memory-mib), and ",
            self.limit >> 20,
        )?;
        match self.cause {
            NoRoomCause::ConnectionFull => write!(
                f,
                "{MAX_WAITING_PER_CONNECTION} other requests of this connection already wait \
                 for room: retry later"
            ),
            NoRoomCause::WaitRanOut => write!(
                f,
                "no room for this one came free within {} ms: retry later",
                self.waited.as_millis()
            ),
            NoRoomCause::Outgrown => write!(
                f,
                "this body, of no declared length, grew past its room as it arrived where no \
                 more was free: retry later, or declare its length (Content-Length) so that it \
                 waits for its room before it is sent"
            ),
            NoRoomCause::Rewritten { answer, held } => write!(
                f,
                "the plugin made this request's body of {held} bytes (its room) into one of \
                 {answer} bytes, more than twice its size, where no room for the rest was \
                 free: retry later"
            ),
        }
    }
}

impl std::error::Error for NoRoom {}

impl BodyMemory {
    /// Room for `limit` bytes of bodies at once; a request waits at most
    /// `wait` for room. `limit` must be at least the largest body taken,
    /// or such a body could never be read.
    pub fn new(limit: usize, wait: Duration) -> Self {
        let total = limit.div_ceil(UNIT).min(Semaphore::MAX_PERMITS);
        let lane_total = lane_units(total);
        BodyMemory {
            units: Arc::new(Semaphore::new(total)),
            lane: Arc::new(Semaphore::new(lane_total)),
            lane_total,
            total,
            limit,
            wait,
            waiting: AtomicUsize::new(0),
            overdrawn: Arc::default(),
        }
    }

    /// The bound on all bodies, in bytes.
    pub fn limit(&self) -> usize {
        self.limit
    }

    /// How long a request waits for room at most; also how long a body
    /// that has room may take to arrive whole.
    pub fn wait(&self) -> Duration {
        self.wait
    }

    /// The bytes the small bodies' lane holds beside the limit: a
    /// sixteenth of it, at least one [`SMALL_BODY`]. A body of up to
    /// [`SMALL_BODY`] that finds no room takes it there at once, where the
    /// lane has it, and otherwise waits both in line and for the lane,
    /// taking whichever room comes first: without it a small body waited
    /// behind every large one ahead of it, each of which
    /// may hold its room for
    /// [`PACE_SLACK`](crate::gateway::body_pace::PACE_SLACK) without sending
    /// a byte (a review's 700 head-only connections kept small requests
    /// waiting 55 s).
    pub fn lane(&self) -> usize {
        self.lane_total * UNIT
    }

    /// The bytes taken now (in whole KiB per body), the room that the
    /// request first in line has gathered towards its own and the small
    /// bodies' lane included.
    pub fn held(&self) -> usize {
        let lane = self.lane_total - self.lane.available_permits();
        (self.total - self.units.available_permits() + lane) * UNIT
    }

    /// The bytes rewritten bodies hold beyond their room now (in whole KiB
    /// per body): memory on top of [`held`](Self::held), which may then
    /// pass the limit.
    pub fn overdrawn(&self) -> usize {
        self.overdrawn.load(Ordering::Relaxed) * UNIT
    }

    /// How many requests wait for room now.
    pub fn waiting(&self) -> usize {
        self.waiting.load(Ordering::Relaxed)
    }

    /// Room for `bytes`, waiting for it (after the requests that came
    /// earlier) at most for the wait this was made with. More than the
    /// limit is refused at once, and so is a request of `connection` (its
    /// client connection, where known: asked for only when the request
    /// must wait) that would have to wait while
    /// [`MAX_WAITING_PER_CONNECTION`] of its requests already do; one whose
    /// client is seen to go away while it waits leaves the line then.
    pub async fn reserve(
        &self,
        bytes: usize,
        connection: impl FnOnce() -> Option<ClientConnection>,
    ) -> Result<Room, Unreserved> {
        let units = bytes.div_ceil(UNIT);
        if units == 0 {
            return Ok(Room::none());
        }
        let units = self
            .units_within_limit(units, 0)
            .map_err(Unreserved::NoRoom)?;
        let permit = match self.units.clone().try_acquire_many_owned(units) {
            Ok(permit) => permit,
            Err(_) if is_small(units) => {
                if let Ok(lane) = self.lane.clone().try_acquire_many_owned(units) {
                    return Ok(Room::of(None, Some(lane)));
                }
                return self.wait_for(units, connection).await;
            }
            Err(_) => return self.wait_for(units, connection).await,
        };
        Ok(Room::of(Some(permit), None))
    }

    /// [`BodyMemory::reserve`]'s wait in line for `units`.
    async fn wait_for(
        &self,
        units: u32,
        connection: impl FnOnce() -> Option<ClientConnection>,
    ) -> Result<Room, Unreserved> {
        let connection = connection();
        let _in_connection = match connection.as_ref().map(|c| &c.waits.0) {
            Some(waits) => {
                if waits.load(Ordering::Relaxed) >= MAX_WAITING_PER_CONNECTION {
                    let full = self.no_room(Duration::ZERO, NoRoomCause::ConnectionFull);
                    return Err(Unreserved::NoRoom(full));
                }
                Some(Queued::join(waits))
            }
            None => None,
        };
        let _in_line = Queued::join(&self.waiting);
        let gone = client_gone::gone(connection.as_ref().and_then(|c| c.socket));
        let room = tokio::select! {
            room = tokio::time::timeout(self.wait, self.first_free(units)) => match room {
                Ok(Some(room)) => room,
                // Never closed; and a wait that ran out is refused.
                Ok(None) | Err(_) => {
                    return Err(Unreserved::NoRoom(self.no_room(self.wait, NoRoomCause::WaitRanOut)))
                }
            },
            () = gone => return Err(Unreserved::ClientGone),
        };
        Ok(room)
    }

    /// Room for `units` in line, or, for a small body, in the small bodies'
    /// lane, whichever comes first: a small body that found the lane full
    /// takes room freed there later, not only in line behind the large
    /// ones. `None` if a semaphore closed, which they never are.
    async fn first_free(&self, units: u32) -> Option<Room> {
        let in_line = self.units.clone().acquire_many_owned(units);
        if !is_small(units) {
            let permit = in_line.await.ok()?;
            return Some(Room::of(Some(permit), None));
        }
        // The one not taken leaves its line, giving back what it gathered.
        tokio::select! {
            permit = in_line => Some(Room::of(Some(permit.ok()?), None)),
            lane = self.lane.clone().acquire_many_owned(units) => Some(Room::of(None, Some(lane.ok()?))),
        }
    }

    /// Makes `room` hold `bytes`, for a body already in memory (one the
    /// plugin rewrote): more room where that much is free at once, and
    /// otherwise the same room with the rest counted as overdrawn, as long
    /// as the rest is no more than the room itself; less gives the surplus
    /// back.
    ///
    /// So a rewritten body is sent even where no room is free (stamping
    /// makes a body at most some 75 % larger), and what all bodies hold
    /// beyond their room is at most the room they hold: bodies read whole
    /// hold at most twice the limit. A larger answer where no room is free
    /// is refused with [`NoRoomCause::Rewritten`] and `room` keeps what it
    /// held: without that bound, a plugin answering 64 MiB to every
    /// two-byte request held 64 MiB for each until its upstream took it.
    pub fn resize_for(&self, room: &mut Room, bytes: usize) -> Result<(), NoRoom> {
        let held = room.bytes();
        if bytes <= held {
            room.shrink_to(bytes);
            return Ok(());
        }
        room.overdraft = None;
        if self.grow_now(room, bytes - held).is_err() {
            let units = bytes.div_ceil(UNIT) - held / UNIT;
            if units > held / UNIT {
                return Err(NoRoom {
                    limit: self.limit,
                    waited: Duration::ZERO,
                    cause: NoRoomCause::Rewritten {
                        answer: bytes,
                        held,
                    },
                });
            }
            self.overdrawn.fetch_add(units, Ordering::Relaxed);
            room.overdraft = Some(Overdraft {
                units,
                count: self.overdrawn.clone(),
            });
        }
        Ok(())
    }

    /// Makes `room` hold `bytes` more if that much is free now, without
    /// waiting (a request that holds room never waits for more); on
    /// failure `room` keeps what it held.
    pub fn grow_now(&self, room: &mut Room, bytes: usize) -> Result<(), NoRoom> {
        let units = bytes.div_ceil(UNIT);
        if units == 0 {
            return Ok(());
        }
        let held = room
            .permit
            .as_ref()
            .map_or(0, OwnedSemaphorePermit::num_permits);
        let units = self.units_within_limit(units, held)?;
        let more = self
            .units
            .clone()
            .try_acquire_many_owned(units)
            .map_err(|_| self.no_room(Duration::ZERO, NoRoomCause::Outgrown))?;
        match &mut room.permit {
            Some(permit) => permit.merge(more),
            none => *none = Some(more),
        }
        // Room taken for what was overdrawn is no longer overdrawn.
        if let Some(overdraft) = &mut room.overdraft {
            let covered = overdraft.units.min(units as usize);
            overdraft.count.fetch_sub(covered, Ordering::Relaxed);
            overdraft.units -= covered;
        }
        Ok(())
    }

    /// `units` as a count to ask the semaphore for, if they and the
    /// `held` ones are within the limit; more could never come.
    fn units_within_limit(&self, units: usize, held: usize) -> Result<u32, NoRoom> {
        match u32::try_from(units) {
            Ok(n) if units.saturating_add(held) <= self.total => Ok(n),
            _ => Err(self.no_room(Duration::ZERO, NoRoomCause::WaitRanOut)),
        }
    }

    fn no_room(&self, waited: Duration, cause: NoRoomCause) -> NoRoom {
        NoRoom {
            limit: self.limit,
            waited,
            cause,
        }
    }
}

impl Room {
    /// Room that holds nothing.
    pub fn none() -> Room {
        Room::of(None, None)
    }

    /// Room of `permit` in line and `lane` in the small bodies' lane.
    fn of(permit: Option<OwnedSemaphorePermit>, lane: Option<OwnedSemaphorePermit>) -> Room {
        Room {
            permit,
            lane,
            overdraft: None,
        }
    }

    /// The bytes this room holds (in whole KiB), not counting an
    /// overdraft.
    pub fn bytes(&self) -> usize {
        self.units() * UNIT
    }

    /// The units this room holds, in the lane or not.
    fn units(&self) -> usize {
        [&self.permit, &self.lane]
            .into_iter()
            .flatten()
            .map(OwnedSemaphorePermit::num_permits)
            .sum()
    }

    /// Gives back what this room holds beyond `bytes`, an overdraft first,
    /// then room in the small bodies' lane.
    pub fn shrink_to(&mut self, bytes: usize) {
        let keep = bytes.div_ceil(UNIT);
        let in_room = self.units();
        if let Some(overdraft) = &mut self.overdraft {
            let beyond = keep.saturating_sub(in_room);
            if beyond < overdraft.units {
                overdraft
                    .count
                    .fetch_sub(overdraft.units - beyond, Ordering::Relaxed);
                overdraft.units = beyond;
            }
        }
        let mut surplus = in_room.saturating_sub(keep);
        for permit in [&mut self.lane, &mut self.permit].into_iter().flatten() {
            let given = surplus.min(permit.num_permits());
            drop(permit.split(given));
            surplus -= given;
        }
    }
}

/// `bytes`, holding `room` until the last reference to them is gone:
/// for a body sent upstream, once the upstream client has written it out
/// (or the request ended without sending it).
pub fn hold(bytes: Bytes, room: Room) -> Bytes {
    Bytes::from_owner(Held { bytes, _room: room })
}

/// The owner of the bytes [`hold`] gives out.
struct Held {
    bytes: Bytes,
    _room: Room,
}

impl AsRef<[u8]> for Held {
    fn as_ref(&self) -> &[u8] {
        &self.bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: usize = 1 << 20;

    /// A body larger than a small one, which takes room in the small
    /// bodies' lane where none other is free.
    const LARGER: usize = SMALL_BODY + 1;

    /// A connection of `waits`, with no socket to watch.
    fn on(waits: &Arc<ConnectionWaits>) -> Option<ClientConnection> {
        Some(ClientConnection {
            waits: waits.clone(),
            socket: None,
        })
    }

    #[tokio::test]
    async fn room_is_held_until_dropped_and_counted_in_whole_kib() {
        let memory = BodyMemory::new(MIB, Duration::from_secs(1));
        let room = memory.reserve(1, || None).await.expect("room");
        assert_eq!(room.bytes(), 1024);
        assert_eq!(memory.held(), 1024);
        let more = memory.reserve(MIB - 1024, || None).await.expect("the rest");
        assert_eq!(memory.held(), MIB);
        drop(room);
        assert_eq!(memory.held(), MIB - 1024);
        drop(more);
        assert_eq!(memory.held(), 0);
        assert_eq!(
            memory.reserve(0, || None).await.expect("nothing").bytes(),
            0
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_request_without_room_waits_for_it_in_turn() {
        let memory = Arc::new(BodyMemory::new(MIB, Duration::from_secs(60)));
        let first = memory.reserve(MIB / 2 + 1024, || None).await.expect("room");
        let waiter = {
            let memory = memory.clone();
            tokio::spawn(async move { memory.reserve(MIB / 2, || None).await.map(|r| r.bytes()) })
        };
        while memory.waiting() == 0 {
            tokio::task::yield_now().await;
        }
        // Time passes (paused time moves on at once while every task
        // waits), and the waiter stays queued until room is given back.
        tokio::time::sleep(Duration::from_secs(10)).await;
        assert_eq!(memory.waiting(), 1);
        assert!(!waiter.is_finished());
        drop(first);
        assert_eq!(waiter.await.expect("joined"), Ok(MIB / 2));
        assert_eq!(memory.waiting(), 0);
        assert_eq!(memory.held(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn a_wait_that_runs_out_is_refused_and_takes_nothing() {
        let memory = BodyMemory::new(MIB, Duration::from_millis(500));
        let _held = memory.reserve(MIB, || None).await.expect("room");
        let started = tokio::time::Instant::now();
        let refused = memory.reserve(LARGER, || None).await.expect_err("no room");
        assert_eq!(started.elapsed(), Duration::from_millis(500));
        assert_eq!(
            refused,
            Unreserved::NoRoom(NoRoom {
                limit: MIB,
                waited: Duration::from_millis(500),
                cause: NoRoomCause::WaitRanOut,
            })
        );
        assert!(refused.to_string().contains("1 MiB, --body-memory-mib"));
        assert_eq!(memory.waiting(), 0);
        assert_eq!(memory.held(), MIB);
    }

    /// Where no room is free, a small body takes room in the small bodies'
    /// lane at once, ahead of a larger one waiting in line, as long as the
    /// lane has it; then it waits both in line and for the lane, and takes
    /// what comes first. Room in the lane is counted as held, and given back
    /// when shrunk or dropped.
    #[tokio::test(start_paused = true)]
    async fn a_small_body_takes_room_in_its_lane_ahead_of_larger_ones_waiting() {
        let memory = Arc::new(BodyMemory::new(MIB, Duration::from_secs(60)));
        assert_eq!(memory.lane(), SMALL_BODY);
        let held = memory.reserve(MIB, || None).await.expect("room");
        let larger = {
            let memory = memory.clone();
            tokio::spawn(async move { memory.reserve(LARGER, || None).await.map(|r| r.bytes()) })
        };
        while memory.waiting() == 0 {
            tokio::task::yield_now().await;
        }
        let mut small = memory.reserve(SMALL_BODY / 2, || None).await.expect("room");
        assert_eq!(small.bytes(), SMALL_BODY / 2);
        assert_eq!(memory.held(), MIB + SMALL_BODY / 2);
        let other = memory.reserve(SMALL_BODY / 2, || None).await.expect("room");
        // The lane is full: the next small body waits, in line and for the
        // lane, and takes the room freed in the lane first, though the
        // larger body is ahead of it in line.
        let last = {
            let memory = memory.clone();
            tokio::spawn(async move { memory.reserve(1024, || None).await.map(|r| r.bytes()) })
        };
        while memory.waiting() < 2 {
            tokio::task::yield_now().await;
        }
        tokio::time::sleep(Duration::from_secs(10)).await;
        assert!(!last.is_finished());
        small.shrink_to(1024);
        assert_eq!(small.bytes(), 1024);
        assert_eq!(last.await.expect("joined"), Ok(1024));
        assert_eq!(memory.held(), MIB + SMALL_BODY / 2 + 1024);
        assert!(!larger.is_finished());
        drop((small, other));
        assert_eq!(memory.held(), MIB);
        drop(held);
        assert_eq!(
            larger.await.expect("joined"),
            Ok(LARGER.div_ceil(UNIT) * UNIT)
        );
        assert_eq!(memory.held(), 0);
    }

    #[tokio::test]
    async fn room_grows_only_where_it_is_free_at_once_and_shrinks_to_a_size() {
        let memory = BodyMemory::new(MIB, Duration::from_secs(3600));
        let mut room = memory.reserve(MIB / 4, || None).await.expect("room");
        memory.grow_now(&mut room, MIB / 2).expect("more");
        assert_eq!(room.bytes(), MIB * 3 / 4);
        let other = memory.reserve(MIB / 8, || None).await.expect("room");
        // Free but for the other's eighth: refused without waiting, and the
        // room keeps what it held.
        assert!(memory.grow_now(&mut room, MIB / 4).is_err());
        assert_eq!(room.bytes(), MIB * 3 / 4);
        assert_eq!(memory.waiting(), 0);
        room.shrink_to(1000);
        assert_eq!(room.bytes(), 1024);
        assert_eq!(memory.held(), 1024 + MIB / 8);
        room.shrink_to(1 << 40);
        assert_eq!(room.bytes(), 1024);
        drop((room, other));
        assert_eq!(memory.held(), 0);
        let mut none = Room::none();
        none.shrink_to(0);
        memory.grow_now(&mut none, 1).expect("from nothing");
        assert_eq!(none.bytes(), 1024);
    }

    #[tokio::test]
    async fn a_body_resized_past_the_free_room_is_counted_as_overdrawn() {
        let memory = BodyMemory::new(MIB, Duration::from_secs(3600));
        let mut room = memory.reserve(MIB / 2, || None).await.expect("room");
        memory.resize_for(&mut room, MIB * 3 / 4).expect("grown");
        assert_eq!((room.bytes(), memory.overdrawn()), (MIB * 3 / 4, 0));
        let other = memory.reserve(MIB / 4, || None).await.expect("the rest");
        // No room is free: the room stays, the rest is overdrawn.
        memory.resize_for(&mut room, MIB + 1).expect("overdrawn");
        assert_eq!(room.bytes(), MIB * 3 / 4);
        assert_eq!(memory.overdrawn(), MIB / 4 + 1024);
        assert_eq!(memory.held(), MIB);
        room.shrink_to(MIB * 3 / 4 + 1);
        assert_eq!(memory.overdrawn(), 1024);
        memory.resize_for(&mut room, MIB / 4).expect("shrunk");
        assert_eq!((room.bytes(), memory.overdrawn()), (MIB / 4, 0));
        // Free room again: taken, and nothing is overdrawn.
        memory
            .resize_for(&mut room, MIB * 3 / 4 - 1)
            .expect("grown");
        assert_eq!((room.bytes(), memory.overdrawn()), (MIB * 3 / 4, 0));
        // At most the room itself is overdrawn: twice the room is taken,
        // a byte more is refused, and the room stays as it was.
        memory
            .resize_for(&mut room, MIB * 3 / 2)
            .expect("twice the room");
        assert_eq!(memory.overdrawn(), MIB * 3 / 4);
        memory.resize_for(&mut room, MIB / 4).expect("shrunk");
        memory
            .resize_for(&mut room, MIB * 3 / 4 - 1)
            .expect("grown");
        let refused = memory
            .resize_for(&mut room, MIB * 3 / 2 + 1)
            .expect_err("more than twice the room");
        assert_eq!(
            refused.cause,
            NoRoomCause::Rewritten {
                answer: MIB * 3 / 2 + 1,
                held: MIB * 3 / 4
            }
        );
        assert!(
            refused.to_string().contains("more than twice its size"),
            "{refused}"
        );
        assert_eq!((room.bytes(), memory.overdrawn()), (MIB * 3 / 4, 0));
        memory
            .resize_for(&mut room, MIB * 3 / 2)
            .expect("twice the room");
        assert_eq!(memory.overdrawn(), MIB * 3 / 4);
        drop(room);
        assert_eq!((memory.overdrawn(), memory.held()), (0, MIB / 4));
        drop(other);
        assert_eq!(memory.held(), 0);
    }

    #[tokio::test]
    async fn room_grown_for_an_overdrawn_body_is_no_longer_overdrawn() {
        let memory = BodyMemory::new(MIB, Duration::from_secs(3600));
        let mut room = memory.reserve(MIB / 2, || None).await.expect("room");
        let other = memory.reserve(MIB / 2, || None).await.expect("the rest");
        memory
            .resize_for(&mut room, MIB * 3 / 4)
            .expect("overdrawn");
        assert_eq!(memory.overdrawn(), MIB / 4);
        drop(other);
        memory.grow_now(&mut room, MIB / 8).expect("free now");
        assert_eq!(room.bytes(), MIB * 5 / 8);
        assert_eq!(memory.overdrawn(), MIB / 8);
        memory.grow_now(&mut room, MIB / 4).expect("free now");
        assert_eq!(room.bytes(), MIB * 7 / 8);
        assert_eq!(memory.overdrawn(), 0);
        drop(room);
        assert_eq!((memory.held(), memory.overdrawn()), (0, 0));
    }

    #[tokio::test]
    async fn a_connection_has_at_most_its_share_of_requests_waiting() {
        let memory = Arc::new(BodyMemory::new(MIB, Duration::from_secs(3600)));
        let connection = Arc::new(ConnectionWaits::default());
        let _held = memory.reserve(MIB, || None).await.expect("room");
        let waiters: Vec<_> = (0..MAX_WAITING_PER_CONNECTION)
            .map(|_| {
                let (memory, connection) = (memory.clone(), connection.clone());
                tokio::spawn(async move { memory.reserve(LARGER, || on(&connection)).await })
            })
            .collect();
        while memory.waiting() < MAX_WAITING_PER_CONNECTION {
            tokio::task::yield_now().await;
        }
        let refused = memory
            .reserve(LARGER, || on(&connection))
            .await
            .expect_err("one too many of the connection");
        assert!(matches!(
            refused,
            Unreserved::NoRoom(NoRoom {
                cause: NoRoomCause::ConnectionFull,
                ..
            })
        ));
        assert!(
            refused
                .to_string()
                .contains("8 other requests of this connection"),
            "{refused}"
        );
        // Another connection's request still queues.
        let other = Arc::new(ConnectionWaits::default());
        let queued = tokio::time::timeout(
            Duration::from_millis(50),
            memory.reserve(LARGER, || on(&other)),
        );
        assert!(queued.await.is_err(), "it waited");
        for waiter in waiters {
            waiter.abort();
            let _ = waiter.await;
        }
        assert_eq!(memory.waiting(), 0);
        assert_eq!(connection.0.load(Ordering::Relaxed), 0);
    }

    #[tokio::test]
    async fn held_bytes_give_their_room_back_when_the_last_reference_goes() {
        let memory = BodyMemory::new(MIB, Duration::from_secs(1));
        let room = memory.reserve(4096, || None).await.expect("room");
        let held = hold(Bytes::from_static(b"{}"), room);
        assert_eq!(&held[..], b"{}");
        let written = held.clone();
        drop(held);
        assert_eq!(memory.held(), 4096, "a reference is still out");
        drop(written);
        assert_eq!(memory.held(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn more_than_there_is_is_refused_at_once() {
        let memory = BodyMemory::new(MIB, Duration::from_secs(3600));
        let started = tokio::time::Instant::now();
        for bytes in [MIB + 1, 1 << 40, usize::MAX] {
            let refused = memory
                .reserve(bytes, || None)
                .await
                .expect_err("more than the limit");
            assert!(
                matches!(refused, Unreserved::NoRoom(NoRoom { waited, .. }) if waited.is_zero()),
                "{bytes} bytes"
            );
        }
        let mut room = memory.reserve(MIB / 2, || None).await.expect("room");
        assert!(memory.grow_now(&mut room, MIB / 2 + 1).is_err());
        assert_eq!(started.elapsed(), Duration::ZERO);
        assert_eq!(memory.held(), MIB / 2);
    }

    /// Each refusal reads as one sentence, whatever its cause: no line
    /// break or source indentation leaks into what the client is told.
    #[test]
    fn every_refusal_names_its_flag_in_plain_text() {
        let causes = [
            NoRoomCause::WaitRanOut,
            NoRoomCause::ConnectionFull,
            NoRoomCause::Outgrown,
            NoRoomCause::Rewritten {
                answer: 3000,
                held: 1024,
            },
        ];
        for cause in causes {
            let message = NoRoom {
                limit: 1 << 30,
                waited: Duration::from_millis(5),
                cause,
            }
            .to_string();
            assert!(message.contains("--body-memory-mib"), "{message}");
            assert!(!message.contains("  "), "{cause:?}: {message}");
            assert!(!message.contains('\n'), "{cause:?}: {message}");
        }
    }
}
