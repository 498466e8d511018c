//! The process's allocator: mimalloc, asked for an alignment only when a
//! layout needs more than every mimalloc block has anyway.
//!
//! The `mimalloc` crate hands every Rust layout to `mi_malloc_aligned`.
//! Its fast path covers blocks of at most 1 KiB that happen to be aligned;
//! anything larger whose rounded size is not a power of two (a 1,100-byte
//! body, a boxed future of 1.5 KiB) goes to the generic path and is
//! over-allocated, about 240 instructions instead of 20, several times a
//! proxied request (BENCHMARKS.md; also purpleprotocol/mimalloc_rust#170).
//! Every mimalloc block is aligned to a machine word, so a layout aligned
//! to at most that takes plain `mi_malloc`.

use std::alloc::{GlobalAlloc, Layout};
use std::ffi::c_void;

use libmimalloc_sys as ffi;

/// The alignment every block `mi_malloc` returns has.
const WORD: usize = std::mem::size_of::<usize>();

/// mimalloc, called without alignment where none beyond a word is needed.
pub struct Mimalloc;

// SAFETY: each method forwards to the mimalloc function that meets the
// layout: the `_aligned` ones for alignments above a word, the plain ones,
// whose blocks are word-aligned, otherwise. Blocks of both are freed with
// `mi_free` and resized with either realloc.
unsafe impl GlobalAlloc for Mimalloc {
    #[inline]
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        unsafe {
            if layout.align() <= WORD {
                ffi::mi_malloc(layout.size()).cast()
            } else {
                ffi::mi_malloc_aligned(layout.size(), layout.align()).cast()
            }
        }
    }

    #[inline]
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        unsafe {
            if layout.align() <= WORD {
                ffi::mi_zalloc(layout.size()).cast()
            } else {
                ffi::mi_zalloc_aligned(layout.size(), layout.align()).cast()
            }
        }
    }

    #[inline]
    unsafe fn dealloc(&self, ptr: *mut u8, _layout: Layout) {
        unsafe { ffi::mi_free(ptr.cast::<c_void>()) }
    }

    #[inline]
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        unsafe {
            if layout.align() <= WORD {
                ffi::mi_realloc(ptr.cast::<c_void>(), new_size).cast()
            } else {
                ffi::mi_realloc_aligned(ptr.cast::<c_void>(), new_size, layout.align()).cast()
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every size up to 64 KiB (and some larger), at every alignment from
    /// 1 to 4 KiB, comes back aligned, zeroed where asked, and keeps its
    /// bytes when it grows.
    #[test]
    fn blocks_are_aligned_as_their_layouts_ask() {
        let sizes = (1..=4096)
            .chain((4097..=65536).step_by(97))
            .chain([1 << 20, (1 << 20) + 3]);
        for size in sizes {
            for align in (0..=12).map(|shift| 1usize << shift) {
                let layout = Layout::from_size_align(size, align).unwrap();
                unsafe {
                    let p = Mimalloc.alloc(layout);
                    assert!(!p.is_null(), "{layout:?}");
                    assert_eq!(p as usize % align, 0, "{layout:?}");
                    p.write_bytes(0xA5, size);
                    let grown = Mimalloc.realloc(p, layout, size * 2 + 1);
                    assert_eq!(grown as usize % align, 0, "grown {layout:?}");
                    assert!(
                        std::slice::from_raw_parts(grown, size)
                            .iter()
                            .all(|&b| b == 0xA5),
                        "grown {layout:?}"
                    );
                    Mimalloc.dealloc(grown, Layout::from_size_align(size * 2 + 1, align).unwrap());
                    let z = Mimalloc.alloc_zeroed(layout);
                    assert_eq!(z as usize % align, 0, "zeroed {layout:?}");
                    assert!(std::slice::from_raw_parts(z, size).iter().all(|&b| b == 0));
                    Mimalloc.dealloc(z, layout);
                }
            }
        }
    }
}
