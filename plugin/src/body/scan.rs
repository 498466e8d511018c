//! The string scan's fast part: skipping string content that needs no
//! attention, a word or 16-byte blocks at a time.
//!
//! Blocks are tested with SIMD where the target has it as a baseline, two
//! blocks a turn: `simd128` in wasm (which wasmtime compiles to SSE on
//! x86-64), SSE2 on x86-64, so that the native core the plugin is measured
//! against does the same work; elsewhere two words a turn. [`blocks`] picks one; every one
//! that compiles natively is tested against the same exact stops.

/// From `pos`, skips string content that needs no attention: no quote, no
/// backslash, no control character: a first 8-byte word, then 16-byte
/// blocks, then a last word. Returns where the scan must go on: at the
/// first such special byte when a whole word from `pos` holds it, or else
/// where fewer than 8 bytes are left (for the byte-by-byte scan); and
/// whether a skipped byte was outside ASCII (whose UTF-8 the string must
/// then have checked).
///
/// Each word test is the classic "has a zero byte" word trick: a byte is
/// flagged when subtracting sets its top bit and it had none. A borrow can
/// flag a byte falsely only above a true hit in the same word, and the
/// lowest flag of a little-endian word is below every borrow it causes, so
/// the lowest flagged byte is always a special byte and none is ever
/// skipped. Stopping right at it, rather than at the start of its word,
/// saves the byte-by-byte scan up to it, which in wasm costs an epoch
/// check per byte.
///
/// The first word is tested inline, in the string reader: most strings of a
/// chat request (keys, roles, short values) end inside it. A longer string
/// goes on in [`skip_plain_words_loop`], out of line, where the loop keeps
/// its values in registers of its own (inlined into the walk's large
/// function, a word loop once took 24 machine instructions a word instead
/// of 22 after an unrelated change elsewhere in the walk).
#[inline(always)]
pub(super) fn skip_plain_words(bytes: &[u8], pos: usize) -> (usize, bool) {
    let Some(word) = word_at(bytes, pos) else {
        return (pos, false);
    };
    match specials(word) {
        0 => skip_plain_words_loop(bytes, pos + 8, word),
        special => stop_in(word, special, pos, 0),
    }
}

/// [`skip_plain_words`] from `pos`, after plain bytes `seen` (ORed
/// together): a longer string, in 16-byte blocks and then a word.
#[inline(never)]
// In wasm, the function the block scan is inlined into has the SIMD feature.
#[cfg_attr(target_arch = "wasm32", target_feature(enable = "simd128"))]
fn skip_plain_words_loop(bytes: &[u8], pos: usize, seen: u64) -> (usize, bool) {
    let (pos, skipped_non_ascii, stopped) = blocks::skip_plain_blocks(bytes, pos);
    let non_ascii = skipped_non_ascii || seen & TOPS != 0;
    if stopped {
        return (pos, non_ascii);
    }
    match word_at(bytes, pos).map(|word| (word, specials(word))) {
        Some((word, 0)) => (pos + 8, non_ascii || word & TOPS != 0),
        Some((word, special)) => {
            let (stop, below) = stop_in(word, special, pos, 0);
            (stop, non_ascii || below)
        }
        None => (pos, non_ascii),
    }
}

/// Every byte's top bit.
const TOPS: u64 = 0x8080_8080_8080_8080;

/// The 8 bytes at `pos` as a little-endian word, if there are 8.
#[inline(always)]
fn word_at(bytes: &[u8], pos: usize) -> Option<u64> {
    let word = bytes.get(pos..pos + 8)?;
    Some(u64::from_le_bytes([
        word[0], word[1], word[2], word[3], word[4], word[5], word[6], word[7],
    ]))
}

/// The flags of `word`'s special bytes (quote, backslash, control), as top
/// bits: see [`skip_plain_words`] for which flags are exact.
#[inline(always)]
fn specials(word: u64) -> u64 {
    const ONES: u64 = 0x0101_0101_0101_0101;
    let quote = word ^ (ONES * u64::from(b'"'));
    let backslash = word ^ (ONES * u64::from(b'\\'));
    let special = (quote.wrapping_sub(ONES) & !quote)
        | (backslash.wrapping_sub(ONES) & !backslash)
        | (word.wrapping_sub(ONES * 0x20) & !word);
    special & TOPS
}

/// Where the scan stops in `word` (at `pos`, with flags `special`, not 0):
/// at its lowest flagged byte; and whether that byte's plain bytes below
/// it, or `seen`, hold a byte outside ASCII.
#[inline(always)]
fn stop_in(word: u64, special: u64, pos: usize, seen: u64) -> (usize, bool) {
    let plain = special.trailing_zeros() / 8;
    let below = word & !(u64::MAX << (plain * 8));
    (pos + plain as usize, (seen | below) & TOPS != 0)
}

/// Skipping whole 16-byte blocks of plain bytes.
mod blocks {
    #[cfg(target_arch = "wasm32")]
    pub(super) use super::simd128::skip_plain_blocks;
    #[cfg(target_arch = "x86_64")]
    pub(super) use super::sse2::skip_plain_blocks;
    #[cfg(not(any(target_arch = "wasm32", target_arch = "x86_64")))]
    pub(super) use super::words::skip_plain_blocks;
}

/// The blocks of [`skip_plain_words_loop`], each implementation with the
/// same contract: from `pos`, skips whole 16-byte blocks of plain bytes, and
/// returns where it stopped, whether a skipped byte was outside ASCII, and
/// whether it stopped at a special byte (`true`) or because fewer than 16
/// bytes are left (`false`).
///
/// Two words a turn, for targets without a baseline SIMD.
#[cfg_attr(
    not(any(test, not(any(target_arch = "wasm32", target_arch = "x86_64")))),
    allow(dead_code)
)]
mod words {
    use super::{specials, stop_in, word_at, TOPS};

    #[inline]
    pub(crate) fn skip_plain_blocks(bytes: &[u8], mut pos: usize) -> (usize, bool, bool) {
        let mut seen = 0;
        while let (Some(first), Some(second)) = (word_at(bytes, pos), word_at(bytes, pos + 8)) {
            let (in_first, in_second) = (specials(first), specials(second));
            if in_first | in_second != 0 {
                let (stop, non_ascii) = match in_first {
                    0 => stop_in(second, in_second, pos + 8, seen | first),
                    _ => stop_in(first, in_first, pos, seen),
                };
                return (stop, non_ascii, true);
            }
            seen |= first | second;
            pos += 16;
        }
        (pos, seen & TOPS != 0, false)
    }
}

/// Where a block scan stops, from the flags of the bytes at `pos` (as many
/// as 32, one bit each, lowest first): `special` marks special bytes (not
/// 0), `tops` bytes outside ASCII; `seen_non_ascii` says whether a block
/// skipped before `pos` held one.
#[cfg_attr(
    not(any(target_arch = "wasm32", target_arch = "x86_64")),
    allow(dead_code)
)]
#[inline(always)]
fn stop_in_blocks(
    pos: usize,
    special: u32,
    tops: u32,
    seen_non_ascii: bool,
) -> (usize, bool, bool) {
    let plain = special.trailing_zeros();
    let below = tops & ((1 << plain) - 1);
    (pos + plain as usize, below != 0 || seen_non_ascii, true)
}

/// SSE2, part of every x86-64 CPU.
#[cfg(target_arch = "x86_64")]
mod sse2 {
    use std::arch::x86_64::{
        __m128i, _mm_cmpeq_epi8, _mm_loadu_si128, _mm_min_epu8, _mm_movemask_epi8, _mm_or_si128,
        _mm_set1_epi8, _mm_setzero_si128,
    };

    use super::stop_in_blocks;

    #[inline]
    pub(crate) fn skip_plain_blocks(bytes: &[u8], pos: usize) -> (usize, bool, bool) {
        // SAFETY: SSE2 is part of the x86-64 baseline: every x86-64 CPU
        // has it.
        unsafe { scan(bytes, pos) }
    }

    /// 32 bytes a turn, then one 16-byte block: the same steps as the
    /// `simd128` scan.
    #[inline]
    #[target_feature(enable = "sse2")]
    fn scan(bytes: &[u8], mut pos: usize) -> (usize, bool, bool) {
        let quote = _mm_set1_epi8(b'"' as i8);
        let backslash = _mm_set1_epi8(b'\\' as i8);
        let last_control = _mm_set1_epi8(0x1f);
        // A control byte is one whose unsigned minimum with 0x1f is itself.
        let special = |v: __m128i| {
            _mm_or_si128(
                _mm_or_si128(_mm_cmpeq_epi8(v, quote), _mm_cmpeq_epi8(v, backslash)),
                _mm_cmpeq_epi8(_mm_min_epu8(v, last_control), v),
            )
        };
        let mask = |v: __m128i| _mm_movemask_epi8(v) as u32;
        let mut seen = _mm_setzero_si128();
        while let Some(pair) = bytes.get(pos..pos + 32) {
            // SAFETY: `pair` is 32 readable bytes, and these loads take 16
            // each, unaligned.
            let (first, second) = unsafe {
                (
                    _mm_loadu_si128(pair.as_ptr().cast::<__m128i>()),
                    _mm_loadu_si128(pair[16..].as_ptr().cast::<__m128i>()),
                )
            };
            let (in_first, in_second) = (special(first), special(second));
            if mask(_mm_or_si128(in_first, in_second)) != 0 {
                let flags = mask(in_first) | mask(in_second) << 16;
                let tops = mask(first) | mask(second) << 16;
                return stop_in_blocks(pos, flags, tops, mask(seen) != 0);
            }
            seen = _mm_or_si128(seen, _mm_or_si128(first, second));
            pos += 32;
        }
        if let Some(block) = bytes.get(pos..pos + 16) {
            // SAFETY: `block` is 16 readable bytes, and this load takes
            // them unaligned.
            let v = unsafe { _mm_loadu_si128(block.as_ptr().cast::<__m128i>()) };
            let flags = mask(special(v));
            if flags != 0 {
                return stop_in_blocks(pos, flags, mask(v), mask(seen) != 0);
            }
            seen = _mm_or_si128(seen, v);
            pos += 16;
        }
        (pos, mask(seen) != 0, false)
    }
}

/// wasm's `simd128`: 32 bytes a turn, then one 16-byte block. Two blocks a
/// turn halve the loop's own cost per byte: its epoch check, and the four
/// vectors Cranelift keeps on the stack across it and reloads every turn.
#[cfg(target_arch = "wasm32")]
mod simd128 {
    use core::arch::wasm32::{
        i8x16_lt, i8x16_splat, u8x16_bitmask, u8x16_eq, u8x16_splat, v128, v128_andnot, v128_load,
        v128_or,
    };

    use super::stop_in_blocks;

    #[inline]
    #[target_feature(enable = "simd128")]
    pub(crate) fn skip_plain_blocks(bytes: &[u8], mut pos: usize) -> (usize, bool, bool) {
        let quote = u8x16_splat(b'"');
        let backslash = u8x16_splat(b'\\');
        let space = i8x16_splat(0x20);
        // Only each lane's top bit counts (`u8x16_bitmask`). A control byte
        // is below 0x20 as a signed byte and has no top bit of its own: a
        // signed compare and an and-not, one instruction each on x86-64,
        // where the unsigned `u8x16_lt` takes four.
        let special = |v: v128| {
            v128_or(
                v128_or(u8x16_eq(v, quote), u8x16_eq(v, backslash)),
                v128_andnot(i8x16_lt(v, space), v),
            )
        };
        let mask = |v: v128| u32::from(u8x16_bitmask(v));
        let mut seen = u8x16_splat(0);
        while let Some(pair) = bytes.get(pos..pos + 32) {
            // SAFETY: `pair` is 32 readable bytes, and these loads take 16
            // each; a wasm load needs no alignment.
            let (first, second) = unsafe {
                (
                    v128_load(pair.as_ptr().cast::<v128>()),
                    v128_load(pair[16..].as_ptr().cast::<v128>()),
                )
            };
            let (in_first, in_second) = (special(first), special(second));
            if mask(v128_or(in_first, in_second)) != 0 {
                let flags = mask(in_first) | mask(in_second) << 16;
                let tops = mask(first) | mask(second) << 16;
                return stop_in_blocks(pos, flags, tops, mask(seen) != 0);
            }
            seen = v128_or(seen, v128_or(first, second));
            pos += 32;
        }
        if let Some(block) = bytes.get(pos..pos + 16) {
            // SAFETY: `block` is 16 readable bytes; a wasm load needs no
            // alignment.
            let v = unsafe { v128_load(block.as_ptr().cast::<v128>()) };
            let flags = mask(special(v));
            if flags != 0 {
                return stop_in_blocks(pos, flags, mask(v), mask(seen) != 0);
            }
            seen = v128_or(seen, v);
            pos += 16;
        }
        (pos, mask(seen) != 0, false)
    }
}

#[cfg(test)]
mod tests {
    use super::skip_plain_words;

    fn special(b: u8) -> bool {
        b == b'"' || b == b'\\' || b < 0x20
    }

    /// Every special byte, at every offset of five words, after every
    /// kind of ordinary byte (ASCII and UTF-8 continuation bytes alike),
    /// with a second special byte or none after it: the skip stops right
    /// at it when a whole word from the start holds it, and otherwise
    /// skips whole plain words up to the last 7 bytes.
    #[test]
    fn word_skipping_stops_at_a_quote_a_backslash_or_a_control_byte() {
        const LEN: usize = 40;
        for filler in [b'a', b' ', 0x7f, 0x80, 0xbf, 0xe2, 0xff, b'!', b'#', b'['] {
            for hit in (0u8..0x20).chain([b'"', b'\\']) {
                for at in 0..LEN {
                    for second in [None, Some(0u8), Some(b'"'), Some(0x1f)] {
                        let mut bytes = vec![filler; LEN];
                        if let Some(second) = second.filter(|_| at + 1 < LEN) {
                            bytes[at + 1] = second;
                        }
                        bytes[at] = hit;
                        for start in 0..=at {
                            let (stop, _) = skip_plain_words(&bytes, start);
                            let word_start = start + (at - start) / 8 * 8;
                            let expected = if word_start + 8 <= LEN {
                                at
                            } else {
                                word_start
                            };
                            assert_eq!(
                                stop, expected,
                                "filler {filler:#x} hit {hit:#x} at {at}, then {second:?}, start {start}"
                            );
                        }
                    }
                }
            }
        }
        let plain = vec![b'x'; 64];
        assert_eq!(skip_plain_words(&plain, 0), (64, false));
        assert_eq!(skip_plain_words(&plain, 3), (59, false));
    }

    /// The block scans this target compiles natively (the wasm one runs in
    /// the integration tests, `tests/bodies.rs`).
    type BlockScan = fn(&[u8], usize) -> (usize, bool, bool);
    fn block_scans() -> Vec<(&'static str, BlockScan)> {
        #[allow(unused_mut)]
        let mut scans: Vec<(&'static str, BlockScan)> =
            vec![("words", super::words::skip_plain_blocks)];
        #[cfg(target_arch = "x86_64")]
        scans.push(("sse2", super::sse2::skip_plain_blocks));
        scans
    }

    /// What a block scan must answer, by a byte scan: whole blocks up to the
    /// one holding the first special byte; a stop right at it when that
    /// block is whole, else at the first block that is not.
    fn expected_block_stop(bytes: &[u8], start: usize) -> (usize, bool, bool) {
        let len = bytes.len();
        let first = (start..len).find(|&i| special(bytes[i])).unwrap_or(len);
        let whole_blocks_end = start + (len - start) / 16 * 16;
        let (stop, stopped) = if first < whole_blocks_end {
            (first, true)
        } else {
            (whole_blocks_end, false)
        };
        (stop, !bytes[start..stop].is_ascii(), stopped)
    }

    /// Every special byte at every offset of five blocks (two 32-byte
    /// turns, a last block and some), after every kind of filler, from
    /// every start: each block scan answers as the byte scan does.
    #[test]
    fn block_scans_stop_at_the_first_special_byte_of_a_whole_block() {
        const LEN: usize = 88;
        for (name, scan) in block_scans() {
            for filler in [b'a', 0x7f, 0x80, 0xbf, 0xe2, 0xff] {
                for hit in [0u8, 0x09, 0x1f, b'"', b'\\', 0x20, 0x7f, 0x80] {
                    for at in 0..LEN {
                        let mut bytes = vec![filler; LEN];
                        bytes[at] = hit;
                        for start in 0..=LEN {
                            assert_eq!(
                                scan(&bytes, start),
                                expected_block_stop(&bytes, start),
                                "{name}: filler {filler:#x}, {hit:#x} at {at}, from {start}"
                            );
                        }
                    }
                }
            }
        }
    }

    /// Each block scan against the byte scan, on pseudo-random bytes.
    #[test]
    fn block_scans_agree_with_a_byte_scan() {
        for (name, scan) in block_scans() {
            let mut state: u64 = 0x2545_f491_4f6c_dd1d;
            for _ in 0..20_000 {
                let bytes = random_bytes(&mut state, 72);
                for start in 0..=bytes.len() {
                    assert_eq!(
                        scan(&bytes, start),
                        expected_block_stop(&bytes, start),
                        "{name}: {bytes:?} from {start}"
                    );
                }
            }
        }
    }

    /// Up to `max_len` pseudo-random bytes: mostly ordinary, ASCII and not,
    /// now and then a special one.
    fn random_bytes(state: &mut u64, max_len: u64) -> Vec<u8> {
        let mut next = || {
            *state ^= *state << 13;
            *state ^= *state >> 7;
            *state ^= *state << 17;
            *state
        };
        let len = (next() % max_len) as usize;
        (0..len)
            .map(|_| {
                let r = next();
                match r % 50 {
                    0 => b'"',
                    1 => b'\\',
                    2 => (r >> 8) as u8 % 0x20,
                    _ => 0x20 + ((r >> 8) as u8 % 0xdf),
                }
            })
            .collect()
    }

    /// Against the plain byte scan, on pseudo-random bytes.
    #[test]
    fn word_skipping_agrees_with_a_byte_scan() {
        let mut state: u64 = 0x9e37_79b9_7f4a_7c15;
        for _ in 0..20_000 {
            let bytes = random_bytes(&mut state, 72);
            let len = bytes.len();
            for start in 0..=len {
                let (stop, non_ascii) = skip_plain_words(&bytes, start);
                let first_special = (start..len).find(|&i| special(bytes[i])).unwrap_or(len);
                assert_eq!(
                    non_ascii,
                    !bytes[start..stop].is_ascii(),
                    "{bytes:?} from {start}: non-ASCII in what was skipped"
                );
                assert!(stop <= first_special, "{bytes:?} from {start}");
                assert!(
                    stop == first_special || (len - stop < 8 && (stop - start) % 8 == 0),
                    "{bytes:?} from {start}: stopped at {stop}, first special at {first_special}"
                );
            }
        }
    }
}
