//! What a high-water file holds: two copies of one record, each a line of
//! text in a 4 KiB block of its own (a page, and a sector of its own also
//! on drives with 4 KiB sectors), with a CRC-32.
//!
//! Every write puts the new record in the first block, syncs, then in the
//! second, and syncs again. A write cut short (a crash, a power loss) can
//! tear only the block being written; the other still holds a mark that
//! was whole, and no id went past a mark before both copies of it were
//! written. So the file's mark is the higher of the copies that read.
//!
//! A record, padded with spaces to the end of its block:
//!
//! ```text
//! snowgate-high-water-mark v1 millis=1796448728439 at=2026-12-05T05:32:08.439Z layout=trtllm-v1 machine-id=5 crc32=1a2b3c4d
//! ```

use snowgate_plugin::SnowflakeLayout;

use crate::utc::format_millis;

/// The size of one copy of the record.
pub(super) const BLOCK: usize = 4096;

/// The size of a high-water file: two copies.
pub(super) const FILE_BYTES: usize = 2 * BLOCK;

/// How every record starts: what it is, and the version of its format.
const MAGIC: &str = "snowgate-high-water-mark v1";

/// One copy of the mark.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Record {
    /// No id of the machine id used a later millisecond (Unix time).
    pub millis: u64,
    /// The layout of the gateway that wrote it (for the reader).
    pub layout: SnowflakeLayout,
    /// The machine id of the gateway that wrote it (for the reader).
    pub machine_id: u32,
}

/// The record as a block: its line, padded with spaces, ending in `\n`.
pub(super) fn encode(record: &Record) -> [u8; BLOCK] {
    let text = format!(
        "{MAGIC} millis={} at={} layout={} machine-id={}",
        record.millis,
        format_millis(record.millis),
        record.layout,
        record.machine_id
    );
    let line = format!("{text} crc32={:08x}", crc32fast::hash(text.as_bytes()));
    let mut block = [b' '; BLOCK];
    // The longest line (u64::MAX milliseconds) is under 160 bytes.
    block[..line.len()].copy_from_slice(line.as_bytes());
    block[BLOCK - 1] = b'\n';
    block
}

/// Reads one block: `None` when it was never written (missing or all
/// zero bytes), or what is wrong with it.
pub(super) fn decode(block: &[u8]) -> Result<Option<Record>, String> {
    if block.iter().all(|&b| b == 0) {
        return Ok(None);
    }
    if block.len() != BLOCK {
        return Err(format!(
            "it is cut short ({} bytes, not a {BLOCK}-byte line)",
            block.len()
        ));
    }
    if block[BLOCK - 1] != b'\n' {
        return Err(format!(
            "its {BLOCK} bytes do not end a line, as a record does"
        ));
    }
    let line = std::str::from_utf8(&block[..BLOCK - 1])
        .map_err(|_| "it is not text".to_string())?
        .trim_end_matches(' ');
    let Some((text, sum)) = line.rsplit_once(" crc32=") else {
        return Err(format!("it is not a high-water mark: {}", shown(line)));
    };
    if sum != format!("{:08x}", crc32fast::hash(text.as_bytes())) {
        return Err(format!(
            "its checksum does not match its text (damaged): {}",
            shown(line)
        ));
    }
    let Some(fields) = text
        .strip_prefix(MAGIC)
        .filter(|rest| rest.starts_with(' '))
    else {
        return Err(format!("it is not a {MAGIC} record: {}", shown(line)));
    };
    let mut millis = None;
    let mut layout = None;
    let mut machine_id = None;
    for field in fields.split_ascii_whitespace() {
        let (key, value) = field.split_once('=').unwrap_or((field, ""));
        match key {
            "millis" => millis = value.parse::<u64>().ok(),
            "layout" => layout = value.parse::<SnowflakeLayout>().ok(),
            "machine-id" => machine_id = value.parse::<u32>().ok(),
            _ => {}
        }
    }
    match (millis, layout, machine_id) {
        (Some(millis), Some(layout), Some(machine_id)) => Ok(Some(Record {
            millis,
            layout,
            machine_id,
        })),
        _ => Err(format!(
            "it lacks a readable millis, layout or machine-id: {}",
            shown(line)
        )),
    }
}

/// Whether `block` (the first copy), which does not read as a record,
/// holds what a write of one leaves when it is cut short: the record's
/// start, up to where the bytes that reached the disk end (zeros after it,
/// or the file's end). A record damaged otherwise, or bytes that are not
/// a record's, are not.
pub(super) fn starts_like_a_record(block: &[u8]) -> bool {
    let written = block
        .iter()
        .rposition(|&b| b != 0)
        .map_or(0, |last| last + 1);
    if written == 0 || written == BLOCK {
        // Nothing at all, or the whole block: not a write cut short.
        return false;
    }
    let start = &block[..written.min(MAGIC.len())];
    MAGIC.as_bytes().starts_with(start) && (written <= MAGIC.len() || block[MAGIC.len()] == b' ')
}

/// The start of a line, quoted, for a message.
fn shown(line: &str) -> String {
    let start: String = line.chars().take(120).collect();
    let more = if start.len() < line.len() { "..." } else { "" };
    format!("{start:?}{more}")
}

#[cfg(test)]
mod tests {
    use super::*;

    const RECORD: Record = Record {
        millis: 1_796_448_728_439,
        layout: SnowflakeLayout::TrtllmV2,
        machine_id: 16_383,
    };

    #[test]
    fn a_record_reads_back_as_written_and_says_what_it_is() {
        let block = encode(&RECORD);
        assert_eq!(decode(&block), Ok(Some(RECORD)));
        let line = std::str::from_utf8(&block).expect("text");
        assert!(
            line.starts_with(
                "snowgate-high-water-mark v1 millis=1796448728439 at=2026-12-05T05:32:08.439Z \
                 layout=trtllm-v2 machine-id=16383 crc32="
            ),
            "{line}"
        );
        assert!(line.ends_with(" \n"), "{line:?}");
        let end = Record {
            millis: u64::MAX,
            ..RECORD
        };
        assert_eq!(decode(&encode(&end)), Ok(Some(end)));
    }

    #[test]
    fn a_block_never_written_is_no_record() {
        assert_eq!(decode(&[]), Ok(None));
        assert_eq!(decode(&[0; BLOCK]), Ok(None));
    }

    /// A write torn anywhere: the block holds the start of the new record
    /// and the rest of the old one (or zeros, or garbage). Every such mix
    /// is refused, never read as some other mark.
    #[test]
    fn a_torn_block_is_refused_whatever_the_mix() {
        let old = encode(&Record {
            millis: 1_796_448_700_000,
            ..RECORD
        });
        let new = encode(&RECORD);
        for cut in 1..BLOCK {
            let mut torn = old;
            torn[..cut].copy_from_slice(&new[..cut]);
            match decode(&torn) {
                Ok(Some(record)) => assert!(
                    record == RECORD || record.millis == 1_796_448_700_000,
                    "cut at {cut}: read {record:?}"
                ),
                Ok(None) => panic!("cut at {cut}: read as never written"),
                Err(_) => {}
            }
            let mut torn = [0; BLOCK];
            torn[..cut].copy_from_slice(&new[..cut]);
            assert!(decode(&torn).is_err(), "cut at {cut} over zeros");
        }
    }

    /// A first write cut short leaves the record's start and zeros;
    /// anything else that fails to read is not one (the file's own tests
    /// go through whole files; these pin the rule on blocks).
    #[test]
    fn only_a_records_start_followed_by_zeros_is_a_write_cut_short() {
        let whole = encode(&RECORD);
        let written = whole.iter().rposition(|&b| b != 0).expect("a record") + 1;
        for cut in [1, 10, MAGIC.len(), MAGIC.len() + 1, written - 1] {
            let mut block = [0u8; BLOCK];
            block[..cut].copy_from_slice(&whole[..cut]);
            assert!(starts_like_a_record(&block), "cut at {cut}");
        }
        let cut_short = |bytes: &[u8]| {
            let mut block = [0u8; BLOCK];
            block[..bytes.len()].copy_from_slice(bytes);
            starts_like_a_record(&block)
        };
        assert!(!starts_like_a_record(&[0u8; BLOCK]), "nothing written");
        assert!(!starts_like_a_record(&[b'x'; BLOCK]), "a whole block");
        assert!(!cut_short(b"snowmelt"), "another magic");
        assert!(!cut_short(b"v2"), "not the start");
        // The magic, then something other than the space after it.
        let mut damaged = whole[..written - 1].to_vec();
        damaged[MAGIC.len()] = b'x';
        assert!(!cut_short(&damaged), "damaged after the magic");
        // A record's start, moved off the block's start.
        let mut moved = vec![0u8; 512];
        moved.extend_from_slice(&whole[..40]);
        assert!(!cut_short(&moved), "moved");
    }

    #[test]
    fn damage_is_named() {
        let mut block = encode(&RECORD);
        block[40] ^= 1;
        let problem = decode(&block).expect_err("a flipped bit");
        assert!(problem.contains("checksum does not match"), "{problem}");

        let problem = decode(&encode(&RECORD)[..100]).expect_err("short");
        assert!(problem.contains("cut short (100 bytes"), "{problem}");

        let mut block = [b' '; BLOCK];
        block[..5].copy_from_slice(b"hello");
        block[BLOCK - 1] = b'\n';
        let problem = decode(&block).expect_err("not a mark");
        assert!(
            problem.contains("not a high-water mark: \"hello\""),
            "{problem}"
        );

        let mut block = [0xff; BLOCK];
        block[BLOCK - 1] = b'\n';
        assert_eq!(decode(&block), Err("it is not text".to_string()));

        // A record with the right checksum but another format.
        let text = "snowgate-high-water-mark v2 millis=5";
        let line = format!("{text} crc32={:08x}", crc32fast::hash(text.as_bytes()));
        let mut block = [b' '; BLOCK];
        block[..line.len()].copy_from_slice(line.as_bytes());
        block[BLOCK - 1] = b'\n';
        let problem = decode(&block).expect_err("another version");
        assert!(
            problem.contains("not a snowgate-high-water-mark v1 record"),
            "{problem}"
        );
    }
}
