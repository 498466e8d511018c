//! How far ahead of the ids the high-water mark is kept: far enough that
//! the next raise lands before ids reach the mark, however long the disk
//! has lately taken to write one.
//!
//! Ids stop at the mark last written (a 503 says why), so the lead must
//! cover the time from one raise's start to the end of the next: the
//! [interval](RAISE_EVERY) between raises, or a write's time when writes
//! take longer, plus that next write's time. A fixed lead of 2 s turned a
//! disk that takes half a second or more per sync (a write syncs twice)
//! into 503s; the lead now
//! grows with the slowest of the last [`WRITES_REMEMBERED`] writes, up to
//! [`LONGEST_LEAD`], and shrinks back once the disk is quick again.

use std::time::Duration;

/// The lead of a quick disk, and the shortest: a crash leaves the next
/// start at most this far past the ids given out, plus the id clock's own
/// lead.
pub const SHORTEST_LEAD: Duration = Duration::from_secs(2);

/// The longest lead, whatever the disk does: [`START_LEAD`](super::keeper::START_LEAD)
/// less [`SHORTEST_LEAD`], so that a gateway that crashed with its ids at
/// the wall clock leaves a mark the next start takes without waiting. A
/// disk that takes longer than about 1.9 s a write still stops ids at the
/// mark between raises.
pub const LONGEST_LEAD: Duration = Duration::from_secs(5);

/// How often the mark is raised while ids stay clear of it.
pub const RAISE_EVERY: Duration = Duration::from_secs(1);

/// What the lead keeps beyond the time raises need: for the writing
/// thread's scheduling and a write a little slower than the last ones.
const MARGIN: Duration = Duration::from_millis(250);

/// How many of the latest writes size the lead: at one raise a second, a
/// slow spell is forgotten some 16 s after it ended.
pub const WRITES_REMEMBERED: usize = 16;

/// The latest writes' times, and the lead they call for.
#[derive(Debug, Default)]
pub struct Lead {
    /// The times of the latest writes, oldest overwritten first.
    recent: [Duration; WRITES_REMEMBERED],
    /// Where the next time goes in `recent`.
    next: usize,
}

impl Lead {
    /// Records that a raise, from its start until its mark was on disk,
    /// took `took`.
    pub fn record(&mut self, took: Duration) {
        self.recent[self.next] = took;
        self.next = (self.next + 1) % WRITES_REMEMBERED;
    }

    /// The slowest of the latest writes.
    pub fn slowest(&self) -> Duration {
        self.recent.iter().copied().max().unwrap_or_default()
    }

    /// The lead the latest writes call for: the interval between raises
    /// and two of the slowest write (the one under way when ids come near
    /// the mark, and the next), and a margin, within [`SHORTEST_LEAD`] and
    /// [`LONGEST_LEAD`].
    pub fn now(&self) -> Duration {
        (RAISE_EVERY + self.slowest() * 2 + MARGIN).clamp(SHORTEST_LEAD, LONGEST_LEAD)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(millis: u64) -> Duration {
        Duration::from_millis(millis)
    }

    /// Each raise, begun at most `max(RAISE_EVERY, write)` after the one
    /// before, lands `write` later; ids at the wall clock must not reach
    /// the mark of the raise before it meanwhile.
    fn covers(lead: Duration, write: Duration) -> bool {
        lead > RAISE_EVERY.max(write) + write
    }

    #[test]
    fn a_quick_disk_keeps_the_shortest_lead() {
        let mut lead = Lead::default();
        assert_eq!(lead.now(), SHORTEST_LEAD, "before any write");
        for _ in 0..WRITES_REMEMBERED {
            lead.record(ms(3));
        }
        assert_eq!(lead.now(), SHORTEST_LEAD);
    }

    #[test]
    fn the_lead_covers_slow_writes_up_to_the_longest() {
        for write in [300, 550, 800, 1_200, 1_800] {
            let mut lead = Lead::default();
            lead.record(ms(write));
            assert!(
                covers(lead.now(), ms(write)),
                "a lead of {:?} for writes of {write} ms",
                lead.now()
            );
            assert!(lead.now() <= LONGEST_LEAD);
        }
        let mut lead = Lead::default();
        lead.record(ms(10_000));
        assert_eq!(lead.now(), LONGEST_LEAD, "a hung disk is not waited for");
        // The fixed lead of before did not cover a write of two syncs of
        // 550 ms each.
        assert!(!covers(SHORTEST_LEAD, ms(1_100)));
    }

    #[test]
    fn a_slow_spell_is_forgotten_after_the_remembered_writes() {
        let mut lead = Lead::default();
        lead.record(ms(1_000));
        for _ in 0..WRITES_REMEMBERED - 1 {
            lead.record(ms(2));
            assert!(lead.now() > SHORTEST_LEAD, "still remembered");
        }
        lead.record(ms(2));
        assert_eq!(lead.now(), SHORTEST_LEAD, "forgotten");
        assert_eq!(lead.slowest(), ms(2));
    }
}
