//! The MessagePack walk's memory on hostile array keys, measured with a
//! counting allocator (this file's own: every test binary has one).

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

use hostile_bodies::tuple_keyed;
use snowgate_plugin::find_msgpack_edits;

#[path = "support/hostile_bodies.rs"]
mod hostile_bodies;

struct Counting;

static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

// SAFETY: every call goes to the system allocator unchanged; only the
// counts are added.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let at = unsafe { System.alloc(layout) };
        if !at.is_null() {
            let live = LIVE.fetch_add(layout.size(), Ordering::Relaxed) + layout.size();
            PEAK.fetch_max(live, Ordering::Relaxed);
        }
        at
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) };
        LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// The edits found in `body`, and the most memory the walk held beyond
/// what was live before it.
fn walk(body: &[u8]) -> (usize, usize) {
    let before = LIVE.load(Ordering::Relaxed);
    PEAK.store(before, Ordering::Relaxed);
    let edits = find_msgpack_edits(body).expect("valid MessagePack").len();
    (edits, PEAK.load(Ordering::Relaxed) - before)
}

/// Before, every such key was kept whole, with the spare capacity its
/// growth left, until its map ended: the walk held six times the body
/// (and compared the keys byte by byte, 150 instructions a byte of body).
/// Now it makes at most 1 MiB of tuple keys' encodings a body; a key past
/// that is taken as equal to nothing, which can only stamp a map Python
/// drops. Distinct keys are all stamped; of 20 equal keys (640 KiB of
/// encodings) the last alone is; of 700 equal keys, the 31 that fit in
/// 1 MiB count as one, and the 669 after them as 669 others.
#[test]
fn array_keys_over_params_hold_little_memory() {
    let distinct = tuple_keyed(700, |i| i as u16);
    let (edits, held) = walk(&distinct);
    assert_eq!(edits, 700);
    assert!(
        held <= 3 << 20,
        "the walk held {held} bytes for a body of {}",
        distinct.len()
    );

    let (edits, _) = walk(&tuple_keyed(20, |_| 7));
    assert_eq!(edits, 1, "the last of equal keys counts");
    let equal = tuple_keyed(700, |_| 7);
    let (edits, held) = walk(&equal);
    assert_eq!(edits, 1 + 700 - 31);
    assert!(held <= 3 << 20, "{held} for {}", equal.len());
}
