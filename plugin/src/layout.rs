//! Snowflake id layouts, bit for bit as TensorRT-LLM's
//! `get_global_disagg_request_id` makes them.

use std::fmt;
use std::str::FromStr;

/// `2^63 - 1`: ids are non-negative signed 64-bit integers.
const MAX_INT64: u128 = (1 << 63) - 1;

/// How a millisecond timestamp, a machine id and a sequence number are packed
/// into one id.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum SnowflakeLayout {
    /// TensorRT-LLM up to 1.3.0rc21: 41-bit ms, 10-bit machine id (0..=1022),
    /// 12-bit sequence, rotated to at least 2^42. The default.
    #[default]
    TrtllmV1,
    /// TensorRT-LLM 1.3.0rc22 and later: 39-bit ms (masked), 8-bit node,
    /// 6-bit process, 10-bit sequence, rotated to at least 2^40. One machine
    /// id 0..=16383 splits as node = id / 64, process = id % 64.
    TrtllmV2,
}

/// The parts of an id, as [`SnowflakeLayout::decode`] reads them back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IdParts {
    /// Milliseconds since the Unix epoch (for `trtllm-v2`, modulo 2^39).
    pub millis: u64,
    /// The machine id (for `trtllm-v2`, node * 64 + process).
    pub machine_id: u32,
    /// The sequence number within the millisecond.
    pub sequence: u32,
}

/// A value that does not fit a layout.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LayoutError {
    /// The machine id is outside the layout's range.
    MachineIdOutOfRange {
        /// The layout asked for.
        layout: SnowflakeLayout,
        /// The machine id given.
        machine_id: u32,
    },
    /// The sequence number is outside the layout's range.
    SequenceOutOfRange {
        /// The layout asked for.
        layout: SnowflakeLayout,
        /// The sequence given.
        sequence: u32,
    },
    /// The id is below the layout's smallest id, so it was not made by it.
    IdBelowRange {
        /// The layout asked for.
        layout: SnowflakeLayout,
        /// The id given.
        id: u64,
    },
    /// The id is at or above 2^63 - 1, which no layout makes (ids are
    /// below the largest signed 64-bit integer), or its machine id field is one no machine
    /// may have, so it was not made by the layout.
    NotMadeByLayout {
        /// The layout asked for.
        layout: SnowflakeLayout,
        /// The id given.
        id: u64,
    },
    /// A `trtllm-v2` id in the last 65.536 s before its 39-bit timestamp
    /// wraps (every 2^39 ms, about 17.4 years; next on
    /// 2039-09-07T15:47:35.552Z): TensorRT-LLM's rotation would give it
    /// the id of one made 65.536 s later, after the wrap, so none is made.
    StampFolds {
        /// The layout asked for.
        layout: SnowflakeLayout,
        /// The millisecond given (Unix time).
        millis: u64,
    },
    /// A layout name that is not known.
    UnknownLayout(String),
}

impl fmt::Display for LayoutError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LayoutError::MachineIdOutOfRange { layout, machine_id } => write!(
                f,
                "machine id {machine_id} is out of range for layout {layout}: use 0..={}",
                layout.max_machine_id()
            ),
            LayoutError::SequenceOutOfRange { layout, sequence } => write!(
                f,
                "sequence {sequence} is out of range for layout {layout}: it holds 0..={}",
                layout.sequence_space() - 1
            ),
            LayoutError::IdBelowRange { layout, id } => write!(
                f,
                "id {id} is below {}, the smallest id of layout {layout}",
                layout.min_id()
            ),
            LayoutError::NotMadeByLayout { layout, id } if *id >= i64::MAX as u64 => write!(
                f,
                "id {id} was not made by layout {layout}: it is at or above 2^63 - 1"
            ),
            LayoutError::NotMadeByLayout { layout, id } => write!(
                f,
                "id {id} was not made by layout {layout}: its machine id field is outside 0..={}",
                layout.max_machine_id()
            ),
            LayoutError::StampFolds { layout, millis } => write!(
                f,
                "layout {layout} makes no unique id at millisecond {millis}: it is in the last \
                 65.536 s before the layout's 39-bit timestamp wraps, where its ids would repeat \
                 those of the 65.536 s after the wrap; ids resume once it has wrapped"
            ),
            LayoutError::UnknownLayout(name) => {
                write!(f, "unknown id layout {name:?}: use trtllm-v1 or trtllm-v2")
            }
        }
    }
}

impl std::error::Error for LayoutError {}

impl SnowflakeLayout {
    /// Every layout, in the order they were introduced.
    pub const ALL: [SnowflakeLayout; 2] = [SnowflakeLayout::TrtllmV1, SnowflakeLayout::TrtllmV2];

    /// The layout's name as used in flags and settings, e.g. `trtllm-v1`.
    pub fn name(self) -> &'static str {
        match self {
            SnowflakeLayout::TrtllmV1 => "trtllm-v1",
            SnowflakeLayout::TrtllmV2 => "trtllm-v2",
        }
    }

    /// The largest machine id the layout can hold.
    pub fn max_machine_id(self) -> u32 {
        match self {
            // 1023 is left out, as TensorRT-LLM does.
            SnowflakeLayout::TrtllmV1 => 1022,
            SnowflakeLayout::TrtllmV2 => 16383,
        }
    }

    /// How many sequence numbers fit in one millisecond.
    pub fn sequence_space(self) -> u32 {
        match self {
            SnowflakeLayout::TrtllmV1 => 1 << 12,
            SnowflakeLayout::TrtllmV2 => 1 << 10,
        }
    }

    /// The smallest id the layout makes; the space below is left to
    /// engine-local ids.
    pub fn min_id(self) -> u64 {
        match self {
            SnowflakeLayout::TrtllmV1 => 1 << 42,
            SnowflakeLayout::TrtllmV2 => 1 << 40,
        }
    }

    /// Checks that `machine_id` fits the layout.
    pub fn check_machine_id(self, machine_id: u32) -> Result<(), LayoutError> {
        if machine_id > self.max_machine_id() {
            return Err(LayoutError::MachineIdOutOfRange {
                layout: self,
                machine_id,
            });
        }
        Ok(())
    }

    /// Packs one id that no other (millisecond, machine id, sequence) since
    /// 1970 packs to: [`SnowflakeLayout::compose`], refusing the ids
    /// TensorRT-LLM's `trtllm-v2` would repeat ([`LayoutError::StampFolds`]).
    /// (`trtllm-v1`'s ids from 2039-09-07 15:30:06.976 on fold onto those
    /// of 1970, which no gateway made, and are not refused.)
    /// What the plugin stamps with.
    pub fn compose_unique(
        self,
        millis: u64,
        machine_id: u32,
        sequence: u32,
    ) -> Result<u64, LayoutError> {
        let raw = self.composition(millis, machine_id, sequence)?;
        // A v2 stamp masked to 39 bits ends each period (its last 2^16 ms)
        // in compositions at or above the rotation's modulus, which fold
        // onto those of the next period's first 2^16 ms. (v1's fold begins
        // in 2039 too, but onto compositions of 1970, which no gateway
        // made.)
        if self == SnowflakeLayout::TrtllmV2 && raw >= self.modulus() {
            return Err(LayoutError::StampFolds {
                layout: self,
                millis,
            });
        }
        Ok(self.rotate(raw))
    }

    /// Packs one id, exactly as TensorRT-LLM does, folds included (see
    /// [`SnowflakeLayout::compose_unique`]).
    pub fn compose(self, millis: u64, machine_id: u32, sequence: u32) -> Result<u64, LayoutError> {
        Ok(self.rotate(self.composition(millis, machine_id, sequence)?))
    }

    /// The millisecond as the layout keeps it: whole in `trtllm-v1`, its
    /// low 39 bits in `trtllm-v2` (as [`IdParts::millis`] reads back).
    pub fn stamp(self, millis: u64) -> u64 {
        match self {
            SnowflakeLayout::TrtllmV1 => millis,
            SnowflakeLayout::TrtllmV2 => millis & ((1 << 39) - 1),
        }
    }

    /// The plain composition of an id, before the rotation.
    fn composition(self, millis: u64, machine_id: u32, sequence: u32) -> Result<u128, LayoutError> {
        self.check_machine_id(machine_id)?;
        if sequence >= self.sequence_space() {
            return Err(LayoutError::SequenceOutOfRange {
                layout: self,
                sequence,
            });
        }
        // Python's integers do not overflow: v1 timestamps past 2^41 carry
        // into higher bits before the rotation, so compute in 128 bits.
        let stamp = u128::from(self.stamp(millis));
        Ok(match self {
            SnowflakeLayout::TrtllmV1 => {
                (stamp << 22) | (u128::from(machine_id) << 12) | u128::from(sequence)
            }
            SnowflakeLayout::TrtllmV2 => {
                let (node, process) = (machine_id / 64, machine_id % 64);
                (stamp << 24)
                    | (u128::from(node) << 16)
                    | (u128::from(process) << 10)
                    | u128::from(sequence)
            }
        })
    }

    /// The rotation's modulus: compositions at or above it fold.
    fn modulus(self) -> u128 {
        MAX_INT64 - u128::from(self.min_id())
    }

    /// A composition rotated into the layout's range, as TensorRT-LLM
    /// does; below `MAX_INT64` by construction.
    fn rotate(self, raw: u128) -> u64 {
        (raw % self.modulus() + u128::from(self.min_id())) as u64
    }

    /// Reads the parts back out of an id this layout made. Exact for ids
    /// whose plain composition was below the rotation modulus, which holds
    /// for every timestamp before 2039 (v1) and for every masked v2 stamp
    /// but those of the last 2^16 ms (65.536 s) before the 39-bit stamp
    /// wraps, whose compositions are the last 2^40 values below 2^63.
    pub fn decode(self, id: u64) -> Result<IdParts, LayoutError> {
        let raw = id
            .checked_sub(self.min_id())
            .ok_or(LayoutError::IdBelowRange { layout: self, id })?;
        let not_made = LayoutError::NotMadeByLayout { layout: self, id };
        // Ids are below MAX_INT64 (see `compose`).
        if id >= i64::MAX as u64 {
            return Err(not_made);
        }
        self.parts_of(u128::from(raw)).ok_or(not_made)
    }

    /// Every reading of `id` as (millisecond, machine id, sequence) this
    /// layout could have packed: [`SnowflakeLayout::decode`]'s, and for
    /// `trtllm-v1` the one its rotation folded, which
    /// [`SnowflakeLayout::compose_unique`] makes from 2039-09-07
    /// 15:30:06.976 UTC on (millis from 2^41 - 2^20). Empty for an id the
    /// layout cannot have made.
    pub fn readings(self, id: u64) -> impl Iterator<Item = IdParts> {
        let folded = match self {
            SnowflakeLayout::TrtllmV1 => id
                .checked_sub(self.min_id())
                .and_then(|raw| self.parts_of(u128::from(raw) + self.modulus())),
            // Its folded ids are the ones `compose_unique` refuses.
            SnowflakeLayout::TrtllmV2 => None,
        };
        self.decode(id).ok().into_iter().chain(folded)
    }

    /// The parts of a plain composition `raw` (before the rotation), if
    /// its machine id is one the layout gives out.
    fn parts_of(self, raw: u128) -> Option<IdParts> {
        let parts = match self {
            SnowflakeLayout::TrtllmV1 => IdParts {
                millis: u64::try_from(raw >> 22).ok()?,
                machine_id: ((raw >> 12) & 0x3ff) as u32,
                sequence: (raw & 0xfff) as u32,
            },
            SnowflakeLayout::TrtllmV2 => IdParts {
                millis: u64::try_from(raw >> 24).ok().filter(|&m| m < 1 << 39)?,
                machine_id: (((raw >> 16) & 0xff) * 64 + ((raw >> 10) & 0x3f)) as u32,
                sequence: (raw & 0x3ff) as u32,
            },
        };
        self.check_machine_id(parts.machine_id).ok()?;
        Some(parts)
    }
}

impl fmt::Display for SnowflakeLayout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for SnowflakeLayout {
    type Err = LayoutError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        SnowflakeLayout::ALL
            .into_iter()
            .find(|layout| layout.name() == s)
            .ok_or_else(|| LayoutError::UnknownLayout(s.to_string()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The shared test vectors (a copy of `shared/vectors/trtllm-snowflake.json`).
    fn vectors() -> serde_json::Value {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/vectors/trtllm-snowflake.json");
        let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("reading {path}: {e}"));
        serde_json::from_str(&text).expect("vectors are JSON")
    }

    fn field(v: &serde_json::Value, name: &str) -> u64 {
        v[name]
            .as_u64()
            .unwrap_or_else(|| panic!("vector field {name} in {v}"))
    }

    #[test]
    fn v1_matches_every_vector() {
        let vectors = vectors();
        let cases = vectors["v1"].as_array().expect("v1 vectors");
        assert!(cases.len() >= 40);
        for case in cases {
            let id = SnowflakeLayout::TrtllmV1
                .compose(
                    field(case, "timestamp_ms"),
                    field(case, "machine_id") as u32,
                    field(case, "counter") as u32,
                )
                .expect("vector inputs are in range");
            assert_eq!(id, field(case, "id"), "vector {case}");
        }
    }

    #[test]
    fn v2_matches_every_vector() {
        let vectors = vectors();
        let cases = vectors["v2"].as_array().expect("v2 vectors");
        assert!(cases.len() >= 40);
        for case in cases {
            let machine_id = field(case, "node_id") * 64 + field(case, "process_id");
            let id = SnowflakeLayout::TrtllmV2
                .compose(
                    field(case, "timestamp_ms"),
                    machine_id as u32,
                    field(case, "counter") as u32,
                )
                .expect("vector inputs are in range");
            assert_eq!(id, field(case, "id"), "vector {case}");
        }
    }

    #[test]
    fn decode_reads_back_what_compose_packed() {
        for layout in SnowflakeLayout::ALL {
            let millis = 1_764_000_000_000 & ((1 << 39) - 1);
            for (machine_id, sequence) in [
                (0, 0),
                (layout.max_machine_id(), layout.sequence_space() - 1),
                (7, 3),
            ] {
                let id = layout
                    .compose(millis, machine_id, sequence)
                    .expect("in range");
                assert_eq!(
                    layout.decode(id),
                    Ok(IdParts {
                        millis,
                        machine_id,
                        sequence
                    }),
                    "{layout}"
                );
            }
        }
    }

    #[test]
    fn refuses_out_of_range_parts_with_the_range_in_the_message() {
        let err = SnowflakeLayout::TrtllmV1.compose(0, 1023, 0).unwrap_err();
        assert_eq!(
            err.to_string(),
            "machine id 1023 is out of range for layout trtllm-v1: use 0..=1022"
        );
        use SnowflakeLayout::{TrtllmV1, TrtllmV2};
        assert_eq!(
            TrtllmV2.compose(0, 16384, 0),
            Err(LayoutError::MachineIdOutOfRange {
                layout: TrtllmV2,
                machine_id: 16384
            })
        );
        assert_eq!(
            TrtllmV2.compose(0, 16383, 1024),
            Err(LayoutError::SequenceOutOfRange {
                layout: TrtllmV2,
                sequence: 1024
            })
        );
        assert_eq!(
            TrtllmV1.compose(0, 0, 4096),
            Err(LayoutError::SequenceOutOfRange {
                layout: TrtllmV1,
                sequence: 4096
            })
        );
        assert_eq!(
            TrtllmV1.decode(5),
            Err(LayoutError::IdBelowRange {
                layout: TrtllmV1,
                id: 5
            })
        );
        // Machine id 1023, which trtllm-v1 never gives out.
        let id = SnowflakeLayout::TrtllmV1.min_id() + (1023 << 12);
        let err = SnowflakeLayout::TrtllmV1
            .decode(id)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("was not made by layout trtllm-v1: its machine id field is outside"),
            "{err}"
        );
        // Each refusal says which of the two it is.
        for layout in SnowflakeLayout::ALL {
            for id in [i64::MAX as u64, u64::MAX] {
                let err = layout.decode(id).unwrap_err().to_string();
                assert!(
                    err.ends_with("it is at or above 2^63 - 1"),
                    "{layout} {id}: {err}"
                );
            }
        }
    }

    /// In the 2^16 ms before trtllm-v2's 39-bit stamp wraps, TensorRT-LLM's
    /// rotation folds ids onto those made after the wrap: the review's pair
    /// made 65.536 s apart was one id. Those are refused; every id made
    /// around the wrap reads back as what it was made of (so no two are
    /// equal), and the ids of either side of the window are made.
    #[test]
    fn v2_makes_no_id_its_rotation_would_repeat_across_the_stamp_wrap() {
        let v2 = SnowflakeLayout::TrtllmV2;
        // 2039-09-07T15:47:35.552Z.
        let wrap = 4u64 << 39;
        let folds = |result| matches!(result, Err(LayoutError::StampFolds { .. }));
        // TensorRT-LLM's formula, which the vectors hold, makes them.
        assert_eq!(
            v2.compose(wrap - 1000, 7, 5),
            v2.compose(wrap + 64_536, 7, 6)
        );
        assert!(folds(v2.compose_unique(wrap - 1000, 7, 5)));
        let after = v2
            .compose_unique(wrap + 64_536, 7, 6)
            .expect("after the wrap");
        assert_eq!(v2.decode(after).map(|p| p.millis), Ok(64_536));
        let err = v2.compose_unique(wrap - 1, 0, 0).unwrap_err().to_string();
        assert!(err.contains("65.536 s before"), "{err}");
        let (top_machine, top_sequence) = (v2.max_machine_id(), v2.sequence_space() - 1);
        // The window's first millisecond folds only its very last id.
        let first = wrap - (1 << 16) - 1;
        assert!(folds(v2.compose_unique(first, top_machine, top_sequence)));
        v2.compose_unique(first, top_machine, top_sequence - 1)
            .expect("below the fold");
        v2.compose_unique(first - 1, top_machine, top_sequence)
            .expect("before the window");
        let mut refused = 0;
        for millis in (first - 3..first + 3)
            .chain(wrap - 3..wrap + 3)
            .chain(wrap + (1 << 16) - 3..wrap + (1 << 16) + 3)
        {
            for (machine_id, sequence) in [
                (0, 0),
                (7, 5),
                (top_machine, top_sequence),
                (top_machine, 0),
                (0, top_sequence),
            ] {
                match v2.compose_unique(millis, machine_id, sequence) {
                    Ok(id) => assert_eq!(
                        v2.decode(id),
                        Ok(IdParts {
                            millis: millis & ((1 << 39) - 1),
                            machine_id,
                            sequence
                        }),
                        "{millis} {machine_id} {sequence}"
                    ),
                    Err(e) => {
                        assert!(millis >= first && millis < wrap, "{millis}: {e}");
                        refused += 1;
                    }
                }
            }
        }
        assert!(refused > 0);
        // trtllm-v1 folds from 2039 too, onto 1970's ids: made all the same,
        // and read back as made among its readings.
        let v1 = SnowflakeLayout::TrtllmV1;
        for millis in [wrap - (1 << 20) - 1, wrap - 1000, wrap, wrap + 5] {
            let id = v1.compose_unique(millis, 7, 5).expect("v1 in 2039");
            let made = IdParts {
                millis,
                machine_id: 7,
                sequence: 5,
            };
            assert!(v1.readings(id).any(|p| p == made), "{millis}");
        }
        assert_eq!(v1.readings(5).count(), 0, "below the range");
        assert_eq!(v2.readings(after).count(), 1);
    }

    #[test]
    fn names_round_trip() {
        for layout in SnowflakeLayout::ALL {
            assert_eq!(layout.name().parse::<SnowflakeLayout>(), Ok(layout));
        }
        assert!("v3"
            .parse::<SnowflakeLayout>()
            .unwrap_err()
            .to_string()
            .contains("trtllm-v1"));
    }
}
