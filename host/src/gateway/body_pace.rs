//! A body that holds room in the body memory must keep pace while other
//! requests wait for room.
//!
//! Once it has room, a body must arrive whole within the body read timeout
//! (`--body-read-timeout-ms`, 60 s). That alone let a client hold room
//! for a large body by declaring it and sending a byte now and then, for
//! the whole timeout, while requests that could have used the room
//! waited: a review filled the default 1 GiB with 64 connections that
//! each declared 32 MiB and sent a byte a second, and small requests
//! waited 60 s and got 503. So while any request waits for room, a body
//! that holds room must have arrived at least at the pace that brings its
//! declared length whole within the timeout, counted from [`PACE_SLACK`] after it got its
//! room; one that is behind is cut off (408), and its room goes to those
//! waiting. Nobody waiting, a slow body keeps its room until the timeout.
//! Holding room then costs a client the bandwidth to fill it, not a byte
//! a second.
//!
//! A body of no declared length takes [`UNDECLARED_ROOM`] (1 MiB) without
//! saying how much it will send, so it cannot be held to the pace of its
//! length; nor to the pace of its room, which a small body sent slowly
//! never fills (a review saw a 40 KB chunked body sent at 4 KB/s refused,
//! held to 1 MiB in 60 s). It is held to the pace of
//! [`UNDECLARED_PACED_BYTES`] (64 KiB) instead: about 1 KiB a second. Not
//! pacing it at all let a client hold the whole body memory with heads
//! alone: a review counted 1024 HTTP/2 streams that sent a JSON head and
//! nothing more holding the default 1 GiB for 60 s, while every other
//! request waited and got 503.
//!
//! Nor may it hold its 1 MiB at that pace: 1024 streams each sending a
//! little over 1 KiB a second held the whole default 1 GiB for the timeout,
//! a sixteenth of what declared bodies pay for as much (a review's count).
//! So while others wait, from [`PACE_SLACK`] on, such a body keeps only
//! what its read holds (what has arrived, in a buffer of up to twice that)
//! and [`UNDECLARED_HEADROOM`] (64 KiB) more, given back at each check
//! (`CHECK_EVERY`). A body that arrives at up to 256 KiB a
//! second never outgrows that between two checks, and one faster has
//! arrived past its 1 MiB before the slack is over: only bursts over 64 KiB
//! after a pause need more, where none is free while others wait (503,
//! which says to declare the length).
//!
//! [`UNDECLARED_ROOM`]: crate::gateway::body_memory::UNDECLARED_ROOM

use std::future::Future;
use std::sync::atomic::Ordering;
use std::sync::Mutex;
use std::time::Duration;

use tokio::time::{Instant, MissedTickBehavior};

use crate::gateway::body_memory::{BodyMemory, Room};
use crate::gateway::read_body::ReadProgress;
use crate::unpoisoned::LockUnpoisoned as _;

/// How long after it got its room a body is first held to its pace: the
/// time a client may take to start sending (a connection's slow start,
/// a request made before its body) and the longest others wait for room
/// behind a body that never comes.
pub const PACE_SLACK: Duration = Duration::from_secs(5);

/// The length a body of no declared length is paced as if it had: one
/// that sends nothing, or less than about 1 KiB a second, gives way to
/// those waiting (see the module's documentation).
pub const UNDECLARED_PACED_BYTES: usize = 64 << 10;

/// How often a body's pace is checked once [`PACE_SLACK`] is over.
const CHECK_EVERY: Duration = Duration::from_millis(250);

/// What a body of no declared length keeps beyond what has arrived while
/// others wait for room (see the module's documentation).
pub const UNDECLARED_HEADROOM: usize = 64 << 10;

/// Why a body with room was cut off.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TooSlow {
    /// It did not arrive whole within the body read timeout.
    TimedOut,
    /// Others waited for room, and it had arrived slower than the pace
    /// that brings its declared length whole within the timeout.
    BehindPace,
}

/// The length a body is paced by: the one it declared, or, where it
/// declared none, [`UNDECLARED_PACED_BYTES`], or its `room` where that is
/// smaller (`--max-body-bytes` below 1 MiB).
pub fn paced_length(declared: Option<usize>, room: usize) -> usize {
    declared.unwrap_or(UNDECLARED_PACED_BYTES.min(room))
}

/// Runs `read`, the read of a body that holds room in `memory`, paced by
/// `length` bytes (see [`paced_length`]), which counts the bytes that have
/// arrived in `progress`: cut off once `within` has passed, or, while
/// requests wait for room, once the body is behind the pace of `length`
/// (see the module's documentation). With `undeclared_room` (the room of a
/// body of no declared length, which `read` grows), it keeps meanwhile
/// only what the read holds (what has arrived, or its buffer where that is
/// larger) and [`UNDECLARED_HEADROOM`] more.
pub async fn keeping_pace<F: Future>(
    read: F,
    progress: &ReadProgress,
    length: usize,
    within: Duration,
    memory: &BodyMemory,
    undeclared_room: Option<&Mutex<Room>>,
) -> Result<F::Output, TooSlow> {
    let started = Instant::now();
    let timed_out = tokio::time::sleep_until(started + within);
    let mut check = tokio::time::interval_at(started + PACE_SLACK, CHECK_EVERY);
    check.set_missed_tick_behavior(MissedTickBehavior::Delay);
    let mut read = std::pin::pin!(read);
    let mut timed_out = std::pin::pin!(timed_out);
    loop {
        tokio::select! {
            biased;
            done = read.as_mut() => return Ok(done),
            () = timed_out.as_mut() => return Err(TooSlow::TimedOut),
            _ = check.tick() => {
                if memory.waiting() == 0 {
                    continue;
                }
                let arrived = progress.arrived.load(Ordering::Relaxed);
                if behind(arrived, length, started.elapsed(), within) {
                    return Err(TooSlow::BehindPace);
                }
                if let Some(room) = undeclared_room {
                    // Never below what the read's buffer holds, which
                    // grows past what has arrived: the room counts that
                    // memory.
                    let held = arrived.max(progress.buffered.load(Ordering::Relaxed));
                    room.lock_unpoisoned()
                        .shrink_to(held.saturating_add(UNDECLARED_HEADROOM));
                }
            }
        }
    }
}

/// Whether `arrived` bytes of a body of `length`, `elapsed` after it got
/// its room, are behind the pace that brings it whole within `within`,
/// counted from [`PACE_SLACK`] on.
fn behind(arrived: usize, length: usize, elapsed: Duration, within: Duration) -> bool {
    let due = elapsed.saturating_sub(PACE_SLACK);
    (arrived as u128) * within.as_nanos() < (length as u128) * due.as_nanos()
}

/// The pace a body of `length` must keep to arrive whole `within`, in KiB
/// a second (at least 1), for messages.
pub fn pace_kib_per_sec(length: usize, within: Duration) -> u64 {
    let per_sec = (length as f64 / within.as_secs_f64().max(0.001)) / 1024.0;
    (per_sec.ceil() as u64).max(1)
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::gateway::body_memory::SMALL_BODY;

    const MIB: usize = 1 << 20;
    const WITHIN: Duration = Duration::from_secs(60);

    /// A request for `bytes` of `memory`, spawned, once it waits in line;
    /// its room when it gets some.
    async fn waiting_for(
        memory: &Arc<BodyMemory>,
        bytes: usize,
    ) -> tokio::task::JoinHandle<Option<Room>> {
        let waiter = {
            let memory = memory.clone();
            tokio::spawn(async move { memory.reserve(bytes, || None).await.ok() })
        };
        while memory.waiting() == 0 {
            tokio::task::yield_now().await;
        }
        waiter
    }

    /// A read that has `arrived` bytes, held in as many.
    fn progress_of(arrived: usize) -> ReadProgress {
        ReadProgress {
            arrived: arrived.into(),
            buffered: arrived.into(),
        }
    }

    /// A body of no declared length is paced as 64 KiB, or as its room
    /// where `--max-body-bytes` makes that smaller; a declared one by its
    /// length.
    #[test]
    fn a_body_is_paced_by_its_length_or_at_most_64_kib() {
        assert_eq!(paced_length(Some(5 * MIB), MIB), 5 * MIB);
        assert_eq!(paced_length(None, MIB), UNDECLARED_PACED_BYTES);
        assert_eq!(paced_length(None, 16 << 10), 16 << 10);
    }

    #[test]
    fn a_body_is_behind_once_it_lags_the_pace_after_the_slack() {
        // 60 MiB in 60 s: 1 MiB a second, from 5 s on.
        let room = 60 * MIB;
        let at = Duration::from_secs;
        assert!(!behind(0, room, at(5), WITHIN));
        assert!(behind(0, room, at(6), WITHIN));
        assert!(!behind(MIB, room, at(6), WITHIN));
        assert!(behind(MIB, room, at(7), WITHIN));
        assert!(!behind(room, room, at(65), WITHIN));
        assert_eq!(pace_kib_per_sec(room, WITHIN), 1024);
        assert_eq!(pace_kib_per_sec(1, WITHIN), 1);
    }

    /// A body that never comes, holding room: cut off after the slack
    /// only while another request waits for room.
    #[tokio::test(start_paused = true)]
    async fn a_stalled_body_is_cut_off_only_while_others_wait() {
        let memory = Arc::new(BodyMemory::new(MIB, WITHIN));
        let room = memory.reserve(MIB, || None).await.expect("room");
        let arrived = progress_of(1024);
        let never = std::future::pending::<()>();
        let started = Instant::now();
        let alone = keeping_pace(never, &arrived, MIB, WITHIN, &memory, None).await;
        assert_eq!(alone, Err(TooSlow::TimedOut));
        assert_eq!(started.elapsed(), WITHIN);

        let waiter = waiting_for(&memory, SMALL_BODY + 1024).await;
        let started = Instant::now();
        let never = std::future::pending::<()>();
        let cut = keeping_pace(never, &arrived, MIB, WITHIN, &memory, None).await;
        assert_eq!(cut, Err(TooSlow::BehindPace));
        assert!(
            started.elapsed() <= PACE_SLACK + CHECK_EVERY,
            "{:?}",
            started.elapsed()
        );
        // A body of no declared length that sent nothing is cut off as
        // soon; one that sent 64 KiB keeps pace until the timeout (half
        // the wait here, so that the waiter still waits).
        let within = WITHIN / 2;
        for (sent, cut_off) in [(0, true), (UNDECLARED_PACED_BYTES, false)] {
            let arrived = progress_of(sent);
            let started = Instant::now();
            let never = std::future::pending::<()>();
            let read = keeping_pace(
                never,
                &arrived,
                paced_length(None, MIB),
                within,
                &memory,
                None,
            )
            .await;
            if cut_off {
                assert_eq!(read, Err(TooSlow::BehindPace));
                assert!(started.elapsed() <= PACE_SLACK + CHECK_EVERY);
            } else {
                assert_eq!(read, Err(TooSlow::TimedOut));
                assert_eq!(started.elapsed(), within);
            }
        }
        drop(room);
        assert!(
            waiter.await.expect("joined").is_some(),
            "the waiter got the room"
        );
    }

    /// A body of no declared length that keeps its 64 KiB pace, but holds
    /// the whole memory: while another request waits, it keeps what has
    /// arrived and 64 KiB more from the slack on, and the waiter gets the
    /// rest; a body with a declared length keeps all of its room.
    #[tokio::test(start_paused = true)]
    async fn a_body_of_no_declared_length_gives_back_what_it_does_not_use_while_others_wait() {
        for undeclared in [true, false] {
            let memory = Arc::new(BodyMemory::new(MIB, WITHIN));
            let room = Mutex::new(memory.reserve(MIB, || None).await.expect("room"));
            let waiter = waiting_for(&memory, MIB / 2).await;
            // Sent at the pace exactly: never behind it before the timeout.
            let arrived = progress_of(UNDECLARED_PACED_BYTES);
            let never = std::future::pending::<()>();
            let within = WITHIN / 2;
            let started = Instant::now();
            let read = keeping_pace(
                never,
                &arrived,
                UNDECLARED_PACED_BYTES,
                within,
                &memory,
                undeclared.then_some(&room),
            )
            .await;
            assert_eq!(read, Err(TooSlow::TimedOut));
            assert_eq!(started.elapsed(), within);
            let kept = room.lock().unwrap().bytes();
            if undeclared {
                assert_eq!(kept, UNDECLARED_PACED_BYTES + UNDECLARED_HEADROOM);
                let got = waiter.await.expect("joined").expect("the waiter got room");
                assert_eq!(got.bytes(), MIB / 2);
                assert_eq!(memory.held(), kept + MIB / 2);
            } else {
                assert_eq!(kept, MIB);
                assert_eq!(memory.waiting(), 1, "the waiter still waits");
                waiter.abort();
            }
        }
    }

    /// The room given back never goes below what the read's buffer holds,
    /// which grows past what has arrived: the room counts that memory.
    #[tokio::test(start_paused = true)]
    async fn a_body_of_no_declared_length_keeps_room_for_its_whole_buffer() {
        let memory = Arc::new(BodyMemory::new(MIB, WITHIN));
        let room = Mutex::new(memory.reserve(MIB, || None).await.expect("room"));
        let waiter = waiting_for(&memory, MIB / 2).await;
        let progress = ReadProgress {
            arrived: UNDECLARED_PACED_BYTES.into(),
            buffered: (MIB / 2).into(),
        };
        let never = std::future::pending::<()>();
        let within = WITHIN / 2;
        let read = keeping_pace(
            never,
            &progress,
            UNDECLARED_PACED_BYTES,
            within,
            &memory,
            Some(&room),
        )
        .await;
        assert_eq!(read, Err(TooSlow::TimedOut));
        assert_eq!(room.lock().unwrap().bytes(), MIB / 2 + UNDECLARED_HEADROOM);
        // What is left, 448 KiB, is too little for the waiter's 512 KiB.
        assert_eq!(memory.waiting(), 1, "the waiter still waits");
        waiter.abort();
    }

    /// A body that keeps pace is never cut off while others wait.
    #[tokio::test(start_paused = true)]
    async fn a_body_keeping_pace_is_read_whole() {
        let memory = Arc::new(BodyMemory::new(MIB, WITHIN));
        let _room = memory.reserve(MIB, || None).await.expect("room");
        let waiter = waiting_for(&memory, SMALL_BODY + 1024).await;
        let arrived = progress_of(0);
        let read = async {
            // A sixtieth of the room a second, the pace exactly.
            for _ in 0..60 {
                tokio::time::sleep(Duration::from_secs(1)).await;
                arrived.arrived.fetch_add(MIB / 60, Ordering::Relaxed);
            }
        };
        let read = keeping_pace(
            read,
            &arrived,
            MIB,
            WITHIN + Duration::from_secs(1),
            &memory,
            None,
        );
        assert_eq!(read.await, Ok(()));
        waiter.abort();
    }
}
