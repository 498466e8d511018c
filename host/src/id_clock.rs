//! Where id time comes from: one process-wide clock whose every reading is a
//! unique, strictly increasing (millisecond, sequence) pair.
//!
//! Plugin instances share no memory and a plugin swap must not reset a
//! counter, so this state lives in the host, behind the `clock` import.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use crate::unpoisoned::LockUnpoisoned as _;

pub use snowgate_plugin::Tick;

/// The ticks one plugin call took from the id clock: the first, the last,
/// and how many. Other calls' ticks may fall between the two.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TicksTaken {
    /// The first tick the call took.
    pub first: Tick,
    /// The last tick the call took.
    pub last: Tick,
    /// How many ticks the call took.
    pub count: u64,
}

/// A source of wall-clock milliseconds. It may step backwards; [`IdClock`]
/// never does.
pub trait WallClock: Send + Sync {
    /// Milliseconds since the Unix epoch.
    fn now_millis(&self) -> u64;
}

/// The operating system's real-time clock.
#[derive(Debug, Default, Clone, Copy)]
pub struct SystemClock;

impl WallClock for SystemClock {
    fn now_millis(&self) -> u64 {
        // A clock before 1970 reads as 1970; IdClock still never goes back.
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64)
    }
}

/// A clock that always reads the same millisecond, for reproducible runs.
#[derive(Debug, Clone, Copy)]
pub struct FixedClock(pub u64);

impl WallClock for FixedClock {
    fn now_millis(&self) -> u64 {
        self.0
    }
}

/// The process-wide id clock.
///
/// Each reading is unique in the process: the sequence starts at 0 in each
/// new millisecond; when a millisecond's sequence space is used up the clock
/// moves on to the next millisecond instead of wrapping; and it never goes
/// backwards, even when the wall clock does (it keeps counting from the last
/// reading until the wall clock catches up).
///
/// A clock made with [`IdClock::system`] also never runs more than
/// [`MAX_LEAD`] ahead of time (see [`NoTick::TooFarAhead`]), so that a
/// stopping process can always wait its lead out.
pub struct IdClock {
    wall: Box<dyn WallClock>,
    state: Mutex<State>,
    issued: AtomicU64,
    max_lead: Option<u64>,
}

/// The clock's readings so far, behind its lock.
#[derive(Debug, Clone, Copy, Default)]
struct State {
    /// The last tick handed out, or the floor set by
    /// [`IdClock::advance_past`] if that is later.
    last: Option<Tick>,
    /// The highest wall clock reading. The lead is bounded from here, so
    /// that a wall clock that steps back does not stop the clock.
    reached: u64,
}

/// Why the clock gave no tick.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NoTick {
    /// The clock has used every millisecond a `u64` holds (only a fixed
    /// clock or a corrupt high-water mark gets there): a new tick would
    /// repeat one.
    EndOfTime,
    /// Another tick would put the clock more than this far ahead of the
    /// latest wall clock reading: ids are being asked for faster than the
    /// layout can make them (more than its sequence space per
    /// millisecond, for this long). Refused rather than let the lead grow
    /// past what a stopping process waits out ([`MAX_CATCH_UP`]).
    TooFarAhead {
        /// The largest lead allowed.
        max_lead: Duration,
    },
}

impl std::fmt::Display for NoTick {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            NoTick::EndOfTime => f.write_str(
                "the id clock has used up every millisecond it can count (a fixed clock or a \
                 high-water mark at the end of time): a new id would repeat one",
            ),
            NoTick::TooFarAhead { max_lead } => write!(
                f,
                "ids are being asked for faster than the id layout can make them: the id clock \
                 is {} ms ahead of the wall clock, the most it may run ahead; retry shortly",
                max_lead.as_millis()
            ),
        }
    }
}

impl std::error::Error for NoTick {}

impl NoTick {
    /// The machine-readable code of the 503 that withholds the call's ids.
    pub fn code(&self) -> &'static str {
        match self {
            NoTick::EndOfTime => "id_clock_exhausted",
            NoTick::TooFarAhead { .. } => "id_rate_exceeded",
        }
    }
}

impl IdClock {
    /// A clock that reads `wall`, with no bound on its lead (for fixed and
    /// test clocks).
    pub fn new(wall: impl WallClock + 'static) -> IdClock {
        IdClock {
            wall: Box::new(wall),
            state: Mutex::new(State::default()),
            issued: AtomicU64::new(0),
            max_lead: None,
        }
    }

    /// A clock on the operating system's real-time clock, whose lead is
    /// bounded by [`MAX_LEAD`].
    pub fn system() -> IdClock {
        IdClock::new(SystemClock).with_max_lead(MAX_LEAD)
    }

    /// Refuses ticks that would put the clock more than `max_lead` ahead of
    /// the latest wall clock reading: see [`NoTick::TooFarAhead`]. A floor
    /// set by [`IdClock::advance_past`] further ahead than that stops the
    /// clock until the wall clock is near it (a leased slot waits for that
    /// before it is used).
    pub fn with_max_lead(mut self, max_lead: Duration) -> IdClock {
        self.max_lead = Some(u64::try_from(max_lead.as_millis()).unwrap_or(u64::MAX));
        self
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        // The lock only guards integers; a panic cannot leave them torn.
        self.state.lock_unpoisoned()
    }

    /// The next unique tick for a layout with `sequence_space` sequence
    /// numbers per millisecond (0 is taken as 1), or why there is none: the
    /// clock never gives a tick it gave before.
    pub fn next_tick(&self, sequence_space: u32) -> Result<Tick, NoTick> {
        let space = sequence_space.max(1);
        let now = self.wall.now_millis();
        let mut state = self.state();
        state.reached = state.reached.max(now);
        let tick = match state.last {
            Some(prev) if now <= prev.millis => {
                match prev.sequence.checked_add(1).filter(|&s| s < space) {
                    Some(sequence) => Tick {
                        millis: prev.millis,
                        sequence,
                    },
                    None => Tick {
                        millis: prev.millis.checked_add(1).ok_or(NoTick::EndOfTime)?,
                        sequence: 0,
                    },
                }
            }
            _ => Tick {
                millis: now,
                sequence: 0,
            },
        };
        if let Some(max_lead) = self.max_lead {
            if tick.millis > state.reached.saturating_add(max_lead) {
                return Err(NoTick::TooFarAhead {
                    max_lead: Duration::from_millis(max_lead),
                });
            }
        }
        state.last = Some(tick);
        self.issued.fetch_add(1, Ordering::Relaxed);
        Ok(tick)
    }

    /// How many ticks (so, ids) this clock has handed out.
    pub fn issued(&self) -> u64 {
        self.issued.load(Ordering::Relaxed)
    }

    /// Makes every later reading fall after `millis`: for a process that
    /// takes over a machine id whose previous holder may have issued ids up
    /// to and including that millisecond.
    pub fn advance_past(&self, millis: u64) {
        let mut state = self.state();
        let floor = Tick {
            millis,
            sequence: u32::MAX,
        };
        if state.last.is_none_or(|prev| prev < floor) {
            state.last = Some(floor);
        }
    }

    /// The last tick handed out, or the floor [`IdClock::advance_past`] set
    /// if that is later; `None` when there is neither.
    pub fn last_tick(&self) -> Option<Tick> {
        self.state().last
    }

    /// The earliest millisecond the next tick can have: the wall clock's,
    /// or the last tick's where that is later, or the one after a floor
    /// [`IdClock::advance_past`] set (a floor takes its whole millisecond).
    pub fn next_millis(&self) -> u64 {
        let now = self.wall.now_millis();
        self.last_tick().map_or(now, |last| {
            let earliest = if last.sequence == u32::MAX {
                last.millis.saturating_add(1)
            } else {
                last.millis
            };
            earliest.max(now)
        })
    }

    /// How long until the wall clock reads a later millisecond than every
    /// tick handed out and any floor set by [`IdClock::advance_past`]: zero
    /// when it already does, or when there is neither. The clock runs ahead
    /// after bursts (more ids than a millisecond's sequence space), and
    /// stays ahead after the wall clock steps back.
    pub fn lead(&self) -> Duration {
        match self.last_tick() {
            Some(last) => {
                let now = self.wall.now_millis();
                Duration::from_millis(last.millis.saturating_add(1).saturating_sub(now))
            }
            None => Duration::ZERO,
        }
    }

    /// How far the last tick (or a floor set by
    /// [`IdClock::advance_past`]) runs ahead of the highest wall clock
    /// reading yet: what ids asked for faster than the layout makes them
    /// put the clock ahead by, which [`IdClock::system`] bounds at
    /// [`MAX_LEAD`] (see [`NoTick::TooFarAhead`]). Unlike
    /// [`lead`](Self::lead), a wall clock that steps back adds nothing:
    /// the bound is from the highest reading, so ids are not refused for
    /// it.
    pub fn lead_over_latest_reading(&self) -> Duration {
        let now = self.wall.now_millis();
        let state = self.state();
        let latest = state.reached.max(now);
        Duration::from_millis(
            state
                .last
                .map_or(0, |last| last.millis.saturating_sub(latest)),
        )
    }

    /// Blocks until the wall clock has passed every tick handed out, and
    /// returns how long that took (zero when it already had).
    ///
    /// A process's clock starts at the wall clock, so a process that
    /// stops while its clock is ahead must wait this out: otherwise the
    /// next process on the same machine id could issue ids it issued. A
    /// lead longer than `limit` (the wall clock stepped back, or a burst of
    /// millions of ids) is not waited out; the error says how long it is.
    pub fn wait_for_wall_clock(&self, limit: Duration) -> Result<Duration, LeadTooLong> {
        let started = Instant::now();
        let mut waited = Duration::ZERO;
        loop {
            let lead = self.lead();
            if lead.is_zero() {
                return Ok(waited);
            }
            // Sleeps run on the monotonic clock and the lead on the wall
            // clock, so this may take a few rounds; a wall clock that stops
            // or steps back meanwhile ends it at `limit`.
            if waited + lead > limit {
                return Err(LeadTooLong(lead));
            }
            std::thread::sleep(lead);
            waited = started.elapsed();
        }
    }
}

/// The longest a stopping process waits for the wall clock to pass its id
/// clock ([`IdClock::wait_for_wall_clock`]). Bursts put the id clock ahead
/// by a millisecond per sequence space of ids (4096 in `trtllm-v1`, 1024 in
/// `trtllm-v2`), and [`IdClock::system`] refuses ids past [`MAX_LEAD`], so
/// a longer lead means the wall clock stepped back.
pub const MAX_CATCH_UP: Duration = Duration::from_secs(10);

/// How far [`IdClock::system`] may run ahead of the latest wall clock
/// reading: about 36 million `trtllm-v1` or 9 million `trtllm-v2` ids beyond
/// what the wall clock absorbs. Under [`MAX_CATCH_UP`], with room for the
/// stop itself.
pub const MAX_LEAD: Duration = Duration::from_secs(9);

/// The clock's lead over the wall clock was too long to wait out: how long
/// it was. See [`IdClock::wait_for_wall_clock`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeadTooLong(pub Duration);

impl std::fmt::Display for LeadTooLong {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "the id clock is {} ms ahead of the wall clock; a process started on the \
             same machine id within that time may repeat its ids",
            self.0.as_millis()
        )
    }
}

impl std::error::Error for LeadTooLong {}

impl std::fmt::Debug for IdClock {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IdClock")
            .field("last", &self.last_tick())
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use std::collections::HashSet;
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::Arc;

    /// A wall clock a test moves by hand.
    struct HandClock(Arc<AtomicU64>);

    impl WallClock for HandClock {
        fn now_millis(&self) -> u64 {
            self.0.load(Ordering::SeqCst)
        }
    }

    /// An unbounded id clock on a wall clock that reads `start` until the
    /// returned handle moves it.
    pub(crate) fn hand_clock(start: u64) -> (IdClock, Arc<AtomicU64>) {
        let now = Arc::new(AtomicU64::new(start));
        (IdClock::new(HandClock(now.clone())), now)
    }

    /// The next tick's earliest millisecond is the wall clock's, unless
    /// the clock runs ahead of it: readiness and the self-check judge the
    /// ids about to be made by it (the `trtllm-v2` wrap, the confirmed
    /// mark), so one that read only the wall clock would miss a clock
    /// that ran ahead into the wrap.
    #[test]
    fn the_next_millisecond_is_the_wall_clocks_or_the_clocks_lead() {
        let (clock, wall) = hand_clock(100);
        assert_eq!(clock.next_millis(), 100);
        clock.next_tick(4096).expect("a tick");
        assert_eq!(clock.next_millis(), 100);
        clock.advance_past(500);
        assert_eq!(
            clock.next_millis(),
            501,
            "ahead of the wall clock, past the floor"
        );
        assert_eq!(clock.next_tick(4096).expect("a tick").millis, 501);
        assert_eq!(clock.next_millis(), 501, "the tick's millisecond has room");
        wall.store(700, Ordering::SeqCst);
        assert_eq!(clock.next_millis(), 700, "the wall clock caught up");
        wall.store(600, Ordering::SeqCst);
        assert_eq!(
            clock.next_millis(),
            600,
            "the wall clock stepped back, and no tick was taken at 700"
        );
    }

    #[test]
    fn a_clock_that_issued_nothing_has_no_lead_to_wait_out() {
        let (clock, _) = hand_clock(100);
        assert_eq!(clock.lead(), Duration::ZERO);
        // Even with no time allowed, there is nothing to wait for.
        assert_eq!(
            clock.wait_for_wall_clock(Duration::ZERO),
            Ok(Duration::ZERO)
        );
    }

    #[test]
    fn the_lead_is_the_time_until_the_wall_clock_passes_the_last_tick() {
        let (clock, now) = hand_clock(100);
        clock.next_tick(4096).unwrap();
        // The wall clock still reads 100, the millisecond of the last tick.
        assert_eq!(clock.lead(), Duration::from_millis(1));
        now.store(101, Ordering::SeqCst);
        assert_eq!(clock.lead(), Duration::ZERO);
        // A burst of three milliseconds' sequence space runs 3 ms ahead.
        for _ in 0..3 * 1024 {
            clock.next_tick(1024).unwrap();
        }
        assert_eq!(clock.last_tick().map(|t| t.millis), Some(103));
        assert_eq!(clock.lead(), Duration::from_millis(3));
        assert_eq!(clock.lead_over_latest_reading(), Duration::from_millis(2));
        // A wall clock that steps back leaves the clock further ahead of
        // it, but not of the highest reading, which bounds the lead.
        now.store(50, Ordering::SeqCst);
        assert_eq!(clock.lead(), Duration::from_millis(54));
        assert_eq!(clock.lead_over_latest_reading(), Duration::from_millis(2));
        // Bursts run it ahead of that reading, up to the bound.
        let clock = clock.with_max_lead(Duration::from_millis(5));
        while clock.next_tick(1024).is_ok() {}
        assert_eq!(clock.lead_over_latest_reading(), Duration::from_millis(5));
    }

    #[test]
    fn waiting_for_the_wall_clock_ends_after_the_last_tick() {
        let clock = IdClock::system();
        clock.next_tick(4096).unwrap();
        // What a burst of 200 ms of sequence space does.
        clock.advance_past(SystemClock.now_millis() + 200);
        let last = clock.last_tick().expect("a tick").millis;
        let lead = clock.lead();
        let waited = clock
            .wait_for_wall_clock(Duration::from_secs(10))
            .expect("a 200 ms lead is waited out");
        assert!(SystemClock.now_millis() > last);
        // The lead is in whole wall-clock milliseconds, the wait on the
        // monotonic clock: allow for the rounding.
        assert!(
            waited + Duration::from_millis(2) >= lead,
            "waited {waited:?} of a {lead:?} lead"
        );
        assert_eq!(clock.lead(), Duration::ZERO);
    }

    #[test]
    fn a_lead_longer_than_the_limit_is_reported_not_waited_out() {
        let clock = IdClock::system();
        clock.advance_past(SystemClock.now_millis() + 3_600_000);
        let started = Instant::now();
        let LeadTooLong(lead) = clock
            .wait_for_wall_clock(Duration::from_secs(10))
            .expect_err("an hour's lead is over the limit");
        assert!(started.elapsed() < Duration::from_secs(5));
        assert!(lead > Duration::from_secs(3_590), "{lead:?}");
        assert!(LeadTooLong(lead)
            .to_string()
            .contains("ahead of the wall clock"));
    }

    #[test]
    fn a_wall_clock_that_stands_still_ends_the_wait_at_the_limit() {
        let (clock, _) = hand_clock(100);
        clock.next_tick(4096).unwrap();
        let started = Instant::now();
        let limit = Duration::from_millis(30);
        assert_eq!(
            clock.wait_for_wall_clock(limit),
            Err(LeadTooLong(Duration::from_millis(1)))
        );
        assert!(started.elapsed() <= limit + Duration::from_secs(5));
    }

    #[test]
    fn sequence_starts_at_zero_in_each_new_millisecond() {
        let (clock, now) = hand_clock(100);
        assert_eq!(
            clock.next_tick(4096).unwrap(),
            Tick {
                millis: 100,
                sequence: 0
            }
        );
        assert_eq!(
            clock.next_tick(4096).unwrap(),
            Tick {
                millis: 100,
                sequence: 1
            }
        );
        now.store(101, Ordering::SeqCst);
        assert_eq!(
            clock.next_tick(4096).unwrap(),
            Tick {
                millis: 101,
                sequence: 0
            }
        );
    }

    #[test]
    fn moves_to_the_next_millisecond_when_the_sequence_space_is_used_up() {
        let clock = IdClock::new(FixedClock(7));
        let ticks: Vec<Tick> = (0..2050).map(|_| clock.next_tick(1024).unwrap()).collect();
        assert_eq!(
            ticks[1023],
            Tick {
                millis: 7,
                sequence: 1023
            }
        );
        assert_eq!(
            ticks[1024],
            Tick {
                millis: 8,
                sequence: 0
            }
        );
        assert_eq!(
            ticks[2048],
            Tick {
                millis: 9,
                sequence: 0
            }
        );
        assert!(ticks.windows(2).all(|w| w[0] < w[1]));
    }

    #[test]
    fn never_goes_backwards_when_the_wall_clock_steps_back() {
        let (clock, now) = hand_clock(5_000);
        let before = clock.next_tick(4096).unwrap();
        now.store(1_000, Ordering::SeqCst);
        let after: Vec<Tick> = (0..5000).map(|_| clock.next_tick(4096).unwrap()).collect();
        assert!(after[0] > before);
        assert!(after.windows(2).all(|w| w[0] < w[1]));
        assert_eq!(
            after[4095],
            Tick {
                millis: 5_001,
                sequence: 0
            }
        );
        now.store(9_000, Ordering::SeqCst);
        assert_eq!(
            clock.next_tick(4096).unwrap(),
            Tick {
                millis: 9_000,
                sequence: 0
            }
        );
    }

    #[test]
    fn threads_hammering_the_clock_never_see_the_same_tick() {
        let clock = Arc::new(IdClock::system());
        let threads: Vec<_> = (0..8)
            .map(|_| {
                let clock = clock.clone();
                std::thread::spawn(move || {
                    (0..50_000)
                        .map(|_| clock.next_tick(4096).unwrap())
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        let mut seen = HashSet::new();
        for thread in threads {
            let ticks = thread.join().expect("clock thread");
            // Each thread's own readings increase strictly.
            assert!(ticks.windows(2).all(|w| w[0] < w[1]));
            for tick in ticks {
                assert!(tick.sequence < 4096);
                assert!(seen.insert(tick), "tick {tick:?} handed out twice");
            }
        }
        assert_eq!(seen.len(), 8 * 50_000);
    }

    #[test]
    fn advance_past_skips_a_previous_holders_millisecond() {
        let clock = IdClock::new(FixedClock(10));
        clock.advance_past(20);
        assert_eq!(
            clock.next_tick(4096).unwrap(),
            Tick {
                millis: 21,
                sequence: 0
            }
        );
        clock.advance_past(5);
        assert_eq!(
            clock.next_tick(4096).unwrap(),
            Tick {
                millis: 21,
                sequence: 1
            }
        );
    }

    #[test]
    fn a_zero_sequence_space_counts_as_one() {
        let clock = IdClock::new(FixedClock(3));
        assert_eq!(
            clock.next_tick(0).unwrap(),
            Tick {
                millis: 3,
                sequence: 0
            }
        );
        assert_eq!(
            clock.next_tick(0).unwrap(),
            Tick {
                millis: 4,
                sequence: 0
            }
        );
    }

    /// A bounded clock refuses the tick that would run it too far ahead,
    /// without using it up, and gives it once the wall clock has moved on.
    #[test]
    fn a_bounded_clock_refuses_ticks_past_its_lead_until_the_wall_clock_moves() {
        let (clock, now) = hand_clock(100);
        let clock = clock.with_max_lead(Duration::from_millis(2));
        // Milliseconds 100, 101 and 102: three sequence spaces.
        let ticks: Vec<Tick> = (0..3 * 1024)
            .map(|_| clock.next_tick(1024).unwrap())
            .collect();
        assert_eq!(
            ticks.last().map(|t| (t.millis, t.sequence)),
            Some((102, 1023))
        );
        let refused = NoTick::TooFarAhead {
            max_lead: Duration::from_millis(2),
        };
        assert_eq!(clock.next_tick(1024), Err(refused));
        assert_eq!(clock.next_tick(1024), Err(refused));
        assert_eq!(clock.issued(), 3 * 1024);
        assert!(refused.to_string().contains("faster than the id layout"));
        assert_eq!(refused.code(), "id_rate_exceeded");
        // One millisecond later, one more millisecond of ids, right after
        // the last one given.
        now.store(101, Ordering::SeqCst);
        assert_eq!(
            clock.next_tick(1024),
            Ok(Tick {
                millis: 103,
                sequence: 0
            })
        );
        // The lead is counted from the latest wall clock reading: a wall
        // clock that steps back does not stop the clock.
        now.store(50, Ordering::SeqCst);
        assert_eq!(
            clock.next_tick(1024),
            Ok(Tick {
                millis: 103,
                sequence: 1
            })
        );
        // A floor further ahead than the bound stops the clock until the
        // wall clock is near it: no tick is ever more than the bound ahead.
        clock.advance_past(10_000);
        assert_eq!(clock.next_tick(1024), Err(refused));
        now.store(9_998, Ordering::SeqCst);
        assert_eq!(clock.next_tick(1024), Err(refused));
        now.store(9_999, Ordering::SeqCst);
        assert_eq!(
            clock.next_tick(1024),
            Ok(Tick {
                millis: 10_001,
                sequence: 0
            })
        );
        // A clock without the bound runs as far ahead as asked.
        let (unbounded, _) = hand_clock(100);
        for _ in 0..100 * 1024 {
            unbounded.next_tick(1024).unwrap();
        }
        assert_eq!(unbounded.last_tick().map(|t| t.millis), Some(199));
    }

    /// A stopping process can always wait out the lead its own ids made.
    #[test]
    fn the_system_clock_never_runs_further_ahead_than_a_stop_waits() {
        const { assert!(MAX_LEAD.as_millis() + 1_000 <= MAX_CATCH_UP.as_millis()) };
        assert_eq!(
            IdClock::system().max_lead,
            Some(MAX_LEAD.as_millis() as u64)
        );
    }

    /// At the last millisecond a u64 holds, the clock gives that
    /// millisecond's sequence space and then nothing, never a tick again.
    #[test]
    fn a_clock_at_the_end_of_time_runs_out_instead_of_repeating() {
        let clock = IdClock::new(FixedClock(u64::MAX));
        let ticks: Vec<Tick> = std::iter::from_fn(|| clock.next_tick(1024).ok())
            .take(5000)
            .collect();
        assert_eq!(ticks.len(), 1024);
        assert!(ticks.iter().all(|t| t.millis == u64::MAX));
        assert_eq!(ticks.last().map(|t| t.sequence), Some(1023));
        assert_eq!(clock.next_tick(1024), Err(NoTick::EndOfTime));
        // A layout with a larger sequence space still has unused pairs.
        let more = clock.next_tick(4096).map(|t| t.sequence);
        assert_eq!(more, Ok(1024));
    }
}
