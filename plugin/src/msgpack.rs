//! Where ids go in a MessagePack body: TensorRT-LLM's orchestrator sends
//! requests to its workers as MessagePack (with `X-TRTLLM-Msgpack: 1`)
//! when `TRTLLM_SERVE_ENABLE_MSGSPEC=1`. The same rules as the JSON walk in
//! [`crate::body`], read the way Python's decoders build dicts: map keys
//! that are strings match by their bytes, the last of duplicate keys wins,
//! and only a `request_type` string equal to `context_only` (ignoring
//! ASCII case) asks for an id. The walk validates the whole body and
//! returns where ids go; [`apply`] splices them in, touching no other byte
//! but the count in the header of each map that gains a pair.

use std::fmt;

use crate::body::{
    live_edits, CONTEXT_ONLY, ID_KEY, MAX_NESTING_DEPTH, PARAMS_KEY, REQUEST_TYPE_KEY,
};
use crate::edits_by_key::{hash_of, EditsByKey};

/// `disagg_request_id` as a MessagePack fixstr (17 bytes).
const ID_KEY_FIXSTR: u8 = 0xa0 | ID_KEY.len() as u8;
/// The marker of a 64-bit unsigned integer, as MessagePack encoders write
/// every id (ids are at least 2^40).
const UINT64: u8 = 0xcf;
/// The nil marker.
const NIL: u8 = 0xc0;

/// One place an id goes in a MessagePack body.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MsgpackEdit {
    /// Add the pair `disagg_request_id: ID` to a map: its header, at
    /// `header` and `header_len` bytes long, counts one pair more, and the
    /// pair is inserted at `end`, just after the map's last pair.
    AppendPair {
        /// Byte offset of the map's header.
        header: usize,
        /// Length of the header (1, 3 or 5 bytes).
        header_len: usize,
        /// The number of pairs the map holds now.
        count: u32,
        /// Byte offset just after the map's last pair.
        end: usize,
    },
    /// Replace the nil byte at `at` with the id.
    ReplaceNil {
        /// Byte offset of the nil.
        at: usize,
    },
}

/// Why a body cannot be read as MessagePack.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MsgpackError {
    /// Byte offset where the problem was found.
    pub offset: usize,
    /// What was wrong there.
    pub problem: &'static str,
}

impl MsgpackError {
    /// A short machine-readable code for the error.
    pub fn code(&self) -> &'static str {
        "invalid_msgpack"
    }
}

impl fmt::Display for MsgpackError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "the request body is not valid MessagePack (X-TRTLLM-Msgpack: 1): {} at byte {}",
            self.problem, self.offset
        )
    }
}

impl std::error::Error for MsgpackError {}

/// Validates `body` as one MessagePack value and returns, in byte order of
/// their first change (a map's header when a pair is appended, the `nil`
/// when one is replaced), the edits that give every effective context-only
/// `disaggregated_params` map without an id its id.
pub fn find_msgpack_edits(body: &[u8]) -> Result<Vec<MsgpackEdit>, MsgpackError> {
    if body.is_empty() {
        return Err(MsgpackError {
            offset: 0,
            problem: "the body is empty",
        });
    }
    let mut walk = Walk::new(body);
    walk.value(false)?;
    if walk.pos != body.len() {
        return Err(walk.error("unexpected data after the MessagePack value"));
    }
    let mut edits = live_edits(walk.edits);
    // A map's own edit is recorded when it ends, after its children's.
    // Each starts at a byte of its own, so an unstable sort (which needs no
    // scratch memory) gives the one order.
    edits.sort_unstable_by_key(MsgpackEdit::start);
    // The list's room for more is free again for the stamped body when
    // the list is the plugin's topmost block: up to half of it, 7 MiB of
    // a 32 MiB body of params maps. (A request's few edits keep theirs:
    // the call would cost more than the room.)
    if (edits.capacity() - edits.len()) * std::mem::size_of::<MsgpackEdit>() >= 64 << 10 {
        edits.shrink_to_fit();
    }
    Ok(edits)
}

/// Returns `body` with `ids[i]` written by `edits[i]`, as
/// [`find_msgpack_edits`] returned them; `ids` must be as long as `edits`.
///
/// Beside the body and its copy it holds only the maps whose pair is yet
/// to be appended, each inside the one before (at most
/// [`MAX_NESTING_DEPTH`]): a body that is nothing but params maps has an
/// id every 49 bytes, and a list of every place the body changes (two a
/// map) took 32 bytes an id in wasm, two thirds of the body again.
pub fn apply(body: &[u8], edits: &[MsgpackEdit], ids: &[u64]) -> Vec<u8> {
    debug_assert_eq!(edits.len(), ids.len());
    let grown: usize = edits
        .iter()
        .map(|edit| match *edit {
            MsgpackEdit::AppendPair {
                header,
                header_len,
                count,
                ..
            } => map_header(body[header], count + 1).len() - header_len + ID_PAIR_LEN,
            MsgpackEdit::ReplaceNil { .. } => ID_VALUE_LEN - 1,
        })
        .sum();
    let mut out = Vec::with_capacity(body.len() + grown);
    // The maps whose header is written and whose pair is not, by where
    // the pair goes and its id: maps nest, so each ends where or before
    // the one under it does, and the last ends first.
    let mut open: Vec<(usize, u64)> = Vec::new();
    let mut copied = 0;
    // The pairs that go at or before `at`, innermost map's first.
    let close = |out: &mut Vec<u8>, open: &mut Vec<(usize, u64)>, copied: &mut usize, at| {
        while let Some(&(end, id)) = open.last().filter(|&&(end, _)| end <= at) {
            out.extend_from_slice(&body[*copied..end]);
            *copied = end;
            out.push(ID_KEY_FIXSTR);
            out.extend_from_slice(ID_KEY);
            push_id(out, id);
            open.pop();
        }
    };
    for (edit, &id) in edits.iter().zip(ids) {
        let at = edit.start();
        // Pairs appended at `at` go before a change that starts there.
        close(&mut out, &mut open, &mut copied, at);
        out.extend_from_slice(&body[copied..at]);
        copied = at;
        match *edit {
            MsgpackEdit::AppendPair {
                header_len,
                count,
                end,
                ..
            } => {
                out.extend_from_slice(&map_header(body[at], count + 1));
                copied += header_len;
                open.push((end, id));
            }
            MsgpackEdit::ReplaceNil { .. } => {
                push_id(&mut out, id);
                copied += 1;
            }
        }
    }
    close(&mut out, &mut open, &mut copied, usize::MAX);
    out.extend_from_slice(&body[copied..]);
    debug_assert_eq!(out.len(), body.len() + grown);
    out
}

/// The bytes of an appended `disagg_request_id: ID` pair.
const ID_PAIR_LEN: usize = 1 + ID_KEY.len() + ID_VALUE_LEN;

/// The bytes of an id: a uint 64.
const ID_VALUE_LEN: usize = 9;

impl MsgpackEdit {
    /// Where the edit's first change is: a map's header, or the nil.
    fn start(&self) -> usize {
        match *self {
            MsgpackEdit::AppendPair { header, .. } => header,
            MsgpackEdit::ReplaceNil { at } => at,
        }
    }
}

/// A map's header for `count` pairs, in a buffer and its length.
struct MapHeader {
    bytes: [u8; 5],
    len: usize,
}

impl std::ops::Deref for MapHeader {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        &self.bytes[..self.len]
    }
}

/// A map header for `count` pairs in the format of the header that starts
/// with `marker` when it still fits, else in the next larger one.
fn map_header(marker: u8, count: u32) -> MapHeader {
    let mut bytes = [0; 5];
    let len = match marker {
        0x80..=0x8f if count <= 15 => {
            bytes[0] = 0x80 | count as u8;
            1
        }
        0x80..=0x8f | 0xde if count <= u32::from(u16::MAX) => {
            bytes[0] = 0xde;
            bytes[1..3].copy_from_slice(&(count as u16).to_be_bytes());
            3
        }
        _ => {
            bytes[0] = 0xdf;
            bytes[1..5].copy_from_slice(&count.to_be_bytes());
            5
        }
    };
    MapHeader { bytes, len }
}

fn push_id(out: &mut Vec<u8>, id: u64) {
    out.push(UINT64);
    out.extend_from_slice(&id.to_be_bytes());
}

/// What kind of value was just read, with what the params logic needs.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Value {
    /// A string; `start..end` is its content.
    Str { start: usize, end: usize },
    /// A byte string; `start..end` is its content.
    Bin { start: usize, end: usize },
    /// Nil, at `at`.
    Nil { at: usize },
    /// Anything else.
    Other,
}

/// A map key as Python compares dict keys once msgspec has decoded them,
/// so that of duplicate keys the last one wins as it does in Python:
/// strings and byte strings by their bytes (a string never equals a byte
/// string); integers, booleans and floats by their value (`1`, `1.0` and
/// `True` are one key); nil equals nil; arrays (tuples in Python) item by
/// item; timestamps (datetimes) to the microsecond msgspec rounds them
/// to. A NaN equals nothing, not even another NaN, and neither does a
/// tuple that holds one, or one too long to compare ([`MAX_TUPLE_KEY`],
/// [`MAX_TUPLE_ENCODING`]): such keys are `None` where keys are read.
/// Strings and byte strings are borrowed from the body.
#[derive(Clone, PartialEq, Eq, Hash)]
enum Key<'a> {
    Str(&'a [u8]),
    Bin(&'a [u8]),
    /// An integer, a boolean, or a float with an integral value of less
    /// than 2^127 in magnitude.
    Int(i128),
    /// Any other float but a NaN, by the bits of its `f64` value.
    Float(u64),
    Nil,
    /// Seconds and microseconds since the Unix epoch.
    Time(i64, u32),
    /// A tuple, by the canonical encoding of its items (see [`Key::encode`]).
    Tuple(Vec<u8>),
}

/// The most bytes a tuple key's encoding may take. A longer key is taken
/// as equal to no other: its encoding can be a few times the body's bytes
/// (a one-byte integer is three), which a body of many megabytes could
/// push past the plugin's memory; and a missed duplicate only stamps a
/// map Python then drops.
const MAX_TUPLE_KEY: usize = 64 << 10;

/// The most bytes of tuple keys' encodings a body's walk makes; a tuple key
/// that would pass it is taken as equal to no other, as a longer one is
/// (`()` too, once none is left). An encoding is up to three times the
/// bytes it encodes, and those of keys over edits are kept until their map
/// ends: without a bound on all of them, a 32 MiB body of long tuple keys
/// over params maps took the walk six times the body in memory and, with
/// each key compared byte by byte in an ordered map, 160 instructions a
/// byte, past the call's deadline.
const MAX_TUPLE_ENCODING: usize = 1 << 20;

/// The size of a value that is one integer, float, nil or boolean, by its
/// first byte; 0 for any other value (and for `0xc1`, which is none).
static SCALAR_SIZE: [u8; 256] = {
    let mut sizes = [0u8; 256];
    let mut marker = 0;
    while marker < 256 {
        sizes[marker] = match marker as u8 {
            0x00..=0x7f | 0xe0..=0xff | 0xc0 | 0xc2 | 0xc3 => 1,
            0xcc | 0xd0 => 2,
            0xcd | 0xd1 => 3,
            0xca | 0xce | 0xd2 => 5,
            0xcb | 0xcf | 0xd3 => 9,
            _ => 0,
        };
        marker += 1;
    }
    sizes
};

/// Canonical encoding tags of [`Key::encode`].
const TAG_STR: u8 = 1;
const TAG_BIN: u8 = 2;
const TAG_INT: u8 = 3;
const TAG_FLOAT: u8 = 4;
const TAG_NIL: u8 = 5;
const TAG_TIME: u8 = 6;
const TAG_TUPLE_START: u8 = 7;
const TAG_TUPLE_END: u8 = 8;

impl Key<'_> {
    /// The key of a float: by value, so that an integral one is the
    /// integer (`-0.0` is `0`); none for a NaN.
    fn float(v: f64) -> Option<Key<'static>> {
        if v.is_nan() {
            None
        } else if v.fract() == 0.0 && v.abs() < 2f64.powi(127) {
            Some(Key::Int(v as i128))
        } else {
            Some(Key::Float(v.to_bits()))
        }
    }

    /// Appends a self-delimiting encoding of the key to `out`, one per key
    /// value: two keys are equal exactly when their encodings are, so a
    /// tuple is compared by the concatenation of its items' encodings.
    fn encode(&self, out: &mut Vec<u8>) {
        match self {
            Key::Str(bytes) | Key::Bin(bytes) => {
                out.push(if matches!(self, Key::Str(_)) {
                    TAG_STR
                } else {
                    TAG_BIN
                });
                push_varint(out, bytes.len() as u128);
                out.extend_from_slice(bytes);
            }
            Key::Int(v) => {
                out.push(TAG_INT);
                push_varint(out, zigzag(*v));
            }
            Key::Float(bits) => {
                out.push(TAG_FLOAT);
                out.extend_from_slice(&bits.to_be_bytes());
            }
            Key::Nil => out.push(TAG_NIL),
            Key::Time(secs, micros) => {
                out.push(TAG_TIME);
                push_varint(out, zigzag(i128::from(*secs)));
                push_varint(out, u128::from(*micros));
            }
            Key::Tuple(items) => {
                out.push(TAG_TUPLE_START);
                out.extend_from_slice(items);
                out.push(TAG_TUPLE_END);
            }
        }
    }
}

/// Appends `v` in LEB128: seven bits a byte, low bits first.
fn push_varint(out: &mut Vec<u8>, mut v: u128) {
    while v >= 0x80 {
        out.push(v as u8 | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

/// Maps a signed integer to an unsigned one, small magnitudes to small.
fn zigzag(v: i128) -> u128 {
    ((v << 1) ^ (v >> 127)) as u128
}

/// The MessagePack extension type of timestamps.
const TIMESTAMP: i8 = -1;

/// The seconds of 0001-01-01T00:00:00Z and 9999-12-31T23:59:59Z: the
/// range of Python's `datetime`, which msgspec decodes timestamps to.
const DATETIME_SECONDS: std::ops::RangeInclusive<i64> = -62_135_596_800..=253_402_300_799;

/// A big-endian unsigned integer of up to 8 bytes.
fn big_endian(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0u64, |n, &b| (n << 8) | u64::from(b))
}

/// The state of a `disaggregated_params` map while it is read.
enum IdMember {
    Missing,
    Nil { at: usize },
    Set,
}

struct Walk<'a> {
    bytes: &'a [u8],
    pos: usize,
    depth: usize,
    /// Edits in the order found; `None` once the edit sits under a key
    /// that a later duplicate key overrides.
    edits: Vec<Option<MsgpackEdit>>,
    /// How many map keys are being read around `pos`: a map inside a key
    /// is refused, as msgspec refuses it (a dict is not hashable).
    in_key: usize,
    /// How many arrays inside a map key are being read around `pos`.
    tuple_depth: usize,
    /// The canonical encoding of the array key being read (see
    /// [`Key::encode`]).
    tuple: Vec<u8>,
    /// Whether that array key equals nothing: it holds a NaN, or its
    /// encoding outgrew [`MAX_TUPLE_KEY`] or what is left of
    /// [`MAX_TUPLE_ENCODING`] (and was dropped).
    tuple_incomparable: bool,
    /// How many more bytes of array keys' encodings the walk may make
    /// ([`MAX_TUPLE_ENCODING`]).
    tuple_encoding_left: usize,
}

/// The refusal of a body that nests deeper than [`MAX_NESTING_DEPTH`].
const TOO_DEEP: &str = "arrays and maps nest deeper than 128 levels";

impl<'a> Walk<'a> {
    /// A walk of `bytes` from its start.
    fn new(bytes: &'a [u8]) -> Walk<'a> {
        Walk {
            bytes,
            pos: 0,
            depth: 0,
            edits: Vec::new(),
            in_key: 0,
            tuple_depth: 0,
            tuple: Vec::new(),
            tuple_incomparable: false,
            tuple_encoding_left: MAX_TUPLE_ENCODING,
        }
    }

    fn error(&self, problem: &'static str) -> MsgpackError {
        MsgpackError {
            offset: self.pos.min(self.bytes.len()),
            problem,
        }
    }

    /// Takes `n` bytes, or says the body ends inside what was being read.
    fn take(&mut self, n: usize) -> Result<&'a [u8], MsgpackError> {
        let bytes = self.bytes;
        let taken = self
            .pos
            .checked_add(n)
            .and_then(|end| bytes.get(self.pos..end))
            .ok_or_else(|| self.error("the body ends inside a value"))?;
        self.pos += n;
        Ok(taken)
    }

    /// Reads a big-endian length of `width` bytes (1, 2 or 4).
    fn length(&mut self, width: usize) -> Result<usize, MsgpackError> {
        let bytes = self.take(width)?;
        Ok(bytes.iter().fold(0usize, |n, &b| (n << 8) | usize::from(b)))
    }

    /// Reads one value at `pos`. `params` says the value belongs to a
    /// `disaggregated_params` key.
    fn value(&mut self, params: bool) -> Result<Value, MsgpackError> {
        self.value_and_key(params).map(|(value, _)| value)
    }

    /// Reads one value and, when it can be a map key, that key (none for a
    /// key that equals nothing, and for maps and extension values, which
    /// cannot be keys).
    fn value_and_key(&mut self, params: bool) -> Result<(Value, Option<Key<'a>>), MsgpackError> {
        let at = self.pos;
        let (value, key) = self.read(params)?;
        // An item of an array key: its encoding goes into the tuple's (an
        // array item has put its own there already).
        if self.tuple_depth > 0
            && !self.tuple_incomparable
            && !matches!(self.bytes[at], 0x90..=0x9f | 0xdc | 0xdd)
        {
            match &key {
                Some(key) => key.encode(&mut self.tuple),
                None => self.tuple_incomparable = true,
            }
            self.check_tuple_length();
        }
        Ok((value, key))
    }

    /// Gives up the array key being read as equal to nothing once its
    /// encoding outgrows [`MAX_TUPLE_KEY`] or what is left of
    /// [`MAX_TUPLE_ENCODING`] (or it holds a NaN), and frees the encoding,
    /// counting what it made.
    fn check_tuple_length(&mut self) {
        let made = self.tuple.len();
        if made > MAX_TUPLE_KEY || made > self.tuple_encoding_left {
            self.tuple_incomparable = true;
        }
        if self.tuple_incomparable {
            self.tuple_encoding_left = self.tuple_encoding_left.saturating_sub(made);
            self.tuple = Vec::new();
        }
    }

    /// Reads `count` items of an array. Outside map keys, each as
    /// [`Walk::skip`] reads it. In an array key that equals nothing,
    /// integers, floats, nil, booleans and empty arrays are stepped over,
    /// as nothing is made of them there either (an empty map is refused
    /// by the general read, as any map in a key is).
    fn items(&mut self, count: usize) -> Result<(), MsgpackError> {
        if self.in_key == 0 {
            for _ in 0..count {
                self.skip(false)?;
            }
            return Ok(());
        }
        for _ in 0..count {
            if self.tuple_incomparable {
                if self.step_over_scalar() {
                    continue;
                }
                if self.bytes.get(self.pos) == Some(&0x90) {
                    self.step_over_empty()?;
                    continue;
                }
            }
            self.value(false)?;
        }
        Ok(())
    }

    /// Reads a value outside map keys, where nothing is made of it but
    /// the edits of the maps in it, without the general read where it
    /// can: integers, floats, nil and booleans (a long prompt's token ids)
    /// are stepped over by their size, empty arrays and maps by their one
    /// byte (a body can be 32 million of them, which the general read took
    /// past the plugin's deadline), and a fixarray's items or a fixmap's
    /// pairs are read without it. Any other value, or one cut short, is
    /// left to the general read, which says what is wrong with it.
    #[inline(always)]
    fn skip(&mut self, params: bool) -> Result<(), MsgpackError> {
        if self.step_over_scalar() {
            return Ok(());
        }
        let at = self.pos;
        match self.bytes.get(at) {
            Some(0x80 | 0x90) => self.step_over_empty(),
            Some(&marker @ 0x81..=0x8f) => {
                self.pos += 1;
                self.map(at, usize::from(marker & 0x0f), params)
            }
            Some(&marker @ 0x91..=0x9f) => {
                self.pos += 1;
                self.array_items(at, usize::from(marker & 0x0f))
            }
            _ => self.value(params).map(drop),
        }
    }

    /// Steps over the empty array or map at `pos`, one level deeper than
    /// the walk is, as [`Walk::enter`] would.
    #[inline(always)]
    fn step_over_empty(&mut self) -> Result<(), MsgpackError> {
        if self.depth == MAX_NESTING_DEPTH {
            return Err(self.error(TOO_DEEP));
        }
        self.pos += 1;
        Ok(())
    }

    /// Steps over the value at `pos` if it is a whole integer, float, nil
    /// or boolean; whether it did.
    #[inline(always)]
    fn step_over_scalar(&mut self) -> bool {
        let size = self
            .bytes
            .get(self.pos)
            .map_or(0, |&marker| usize::from(SCALAR_SIZE[usize::from(marker)]));
        let whole = size != 0 && size <= self.bytes.len() - self.pos;
        if whole {
            self.pos += size;
        }
        whole
    }

    /// [`Walk::value_and_key`] but for array keys.
    fn read(&mut self, params: bool) -> Result<(Value, Option<Key<'a>>), MsgpackError> {
        let at = self.pos;
        let marker = *self
            .bytes
            .get(at)
            .ok_or_else(|| self.error("the body ends where a value was expected"))?;
        self.pos += 1;
        let int = |v: i128| Ok((Value::Other, Some(Key::Int(v))));
        match marker {
            0x00..=0x7f => int(i128::from(marker)),
            0xe0..=0xff => int(i128::from(marker as i8)),
            0x80..=0x8f => self
                .map(at, usize::from(marker & 0x0f), params)
                .map(|()| (Value::Other, None)),
            // map 16, map 32: a 2- or 4-byte count.
            0xde | 0xdf => {
                let count = self.length(2 << (marker - 0xde))?;
                self.map(at, count, params).map(|()| (Value::Other, None))
            }
            0x90..=0x9f => self.array(at, usize::from(marker & 0x0f)),
            // array 16, array 32.
            0xdc | 0xdd => {
                let count = self.length(2 << (marker - 0xdc))?;
                self.array(at, count)
            }
            0xa0..=0xbf => self.str(usize::from(marker & 0x1f)),
            // str 8, str 16, str 32: a 1-, 2- or 4-byte length.
            0xd9..=0xdb => {
                let len = self.length(1 << (marker - 0xd9))?;
                self.str(len)
            }
            0xc4..=0xc6 => {
                let len = self.length(1 << (marker - 0xc4))?;
                let start = self.pos;
                let bytes = self.take(len)?;
                let end = self.pos;
                Ok((Value::Bin { start, end }, Some(Key::Bin(bytes))))
            }
            0xc0 => Ok((Value::Nil { at }, Some(Key::Nil))),
            0xc2 | 0xc3 => int(i128::from(marker == 0xc3)),
            0xca => {
                let bits = big_endian(self.take(4)?) as u32;
                Ok((Value::Other, Key::float(f64::from(f32::from_bits(bits)))))
            }
            0xcb => {
                let bits = big_endian(self.take(8)?);
                Ok((Value::Other, Key::float(f64::from_bits(bits))))
            }
            0xcc..=0xcf => {
                let v = big_endian(self.take(1 << (marker - 0xcc))?);
                int(i128::from(v))
            }
            0xd0..=0xd3 => {
                let width = 1 << (marker - 0xd0);
                let unsigned = big_endian(self.take(width)?);
                let shift = 64 - 8 * width as u32;
                int(i128::from(((unsigned << shift) as i64) >> shift))
            }
            // fixext 1, 2, 4, 8, 16: a type byte and the data.
            0xd4..=0xd8 => self.ext(at, 1 << (marker - 0xd4)),
            0xc7..=0xc9 => {
                let len = self.length(1 << (marker - 0xc7))?;
                self.ext(at, len)
            }
            0xc1 => {
                self.pos = at;
                Err(self.error("0xc1 is never used in MessagePack"))
            }
        }
    }

    /// Reads an extension value of `len` data bytes after its type byte;
    /// its header is at `at`. A timestamp must be one Python's datetime
    /// can hold, as msgspec decodes it to one; any other extension value
    /// (a `msgspec.msgpack.Ext`, not hashable) cannot be a map key.
    fn ext(&mut self, at: usize, len: usize) -> Result<(Value, Option<Key<'a>>), MsgpackError> {
        let kind = self.take(1)?[0] as i8;
        // Separate from the type byte: `1 + len` overflows a 32-bit usize
        // for a 4 GiB length.
        let data = self.take(len)?;
        let refuse = |problem| {
            Err(MsgpackError {
                offset: at,
                problem,
            })
        };
        if kind != TIMESTAMP {
            if self.in_key > 0 {
                return refuse(
                    "a map key is or holds an extension value, which msgspec refuses as a dict key",
                );
            }
            return Ok((Value::Other, None));
        }
        let (secs, nanos) = match len {
            4 => (big_endian(data) as i64, 0),
            8 => {
                let v = big_endian(data);
                ((v & ((1 << 34) - 1)) as i64, v >> 34)
            }
            12 => (big_endian(&data[4..]) as i64, big_endian(&data[..4])),
            _ => return refuse("a timestamp (extension type -1) is not 4, 8 or 12 bytes long"),
        };
        if nanos >= 1_000_000_000 {
            return refuse("a timestamp's nanoseconds are 1,000,000,000 or more");
        }
        const OUT_OF_RANGE: &str =
            "a timestamp is outside the years 1 to 9999, which Python's datetime holds";
        if !DATETIME_SECONDS.contains(&secs) {
            return refuse(OUT_OF_RANGE);
        }
        // msgspec rounds to the microsecond, half up.
        let micros = (nanos + 500) / 1000;
        let (secs, micros) = if micros == 1_000_000 {
            (secs + 1, 0)
        } else {
            (secs, micros as u32)
        };
        if !DATETIME_SECONDS.contains(&secs) {
            return refuse(OUT_OF_RANGE);
        }
        Ok((Value::Other, Some(Key::Time(secs, micros))))
    }

    fn str(&mut self, len: usize) -> Result<(Value, Option<Key<'a>>), MsgpackError> {
        let start = self.pos;
        let bytes = self.take(len)?;
        if std::str::from_utf8(bytes).is_err() {
            self.pos = start;
            return Err(self.error("a string is not valid UTF-8"));
        }
        Ok((
            Value::Str {
                start,
                end: self.pos,
            },
            Some(Key::Str(bytes)),
        ))
    }

    fn enter(&mut self, at: usize) -> Result<(), MsgpackError> {
        if self.depth == MAX_NESTING_DEPTH {
            return Err(MsgpackError {
                offset: at,
                problem: TOO_DEEP,
            });
        }
        self.depth += 1;
        Ok(())
    }

    /// Reads an array of `count` items outside map keys, whose header is
    /// at `at`.
    fn array_items(&mut self, at: usize, count: usize) -> Result<(), MsgpackError> {
        self.enter(at)?;
        self.items(count)?;
        self.depth -= 1;
        Ok(())
    }

    /// Reads an array of `count` items whose header is at `at`. Inside a
    /// map key it is a tuple, whose key is the encoding of its items.
    fn array(&mut self, at: usize, count: usize) -> Result<(Value, Option<Key<'a>>), MsgpackError> {
        if self.in_key == 0 {
            self.array_items(at, count)?;
            return Ok((Value::Other, None));
        }
        self.enter(at)?;
        // The outermost tuple's key holds its items' encodings; one inside
        // it adds its own, wrapped as `Key::encode` wraps them.
        let outermost = self.tuple_depth == 0;
        if outermost && self.tuple_encoding_left == 0 {
            self.tuple_incomparable = true;
        }
        self.tuple_depth += 1;
        if !outermost && !self.tuple_incomparable {
            self.tuple.push(TAG_TUPLE_START);
        }
        self.items(count)?;
        self.tuple_depth -= 1;
        self.depth -= 1;
        if !outermost {
            if !self.tuple_incomparable {
                self.tuple.push(TAG_TUPLE_END);
                self.check_tuple_length();
            }
            return Ok((Value::Other, None));
        }
        let items = std::mem::take(&mut self.tuple);
        let comparable = !std::mem::replace(&mut self.tuple_incomparable, false);
        if comparable {
            // Within what was left: `check_tuple_length` saw to it.
            self.tuple_encoding_left -= items.len();
        }
        Ok((Value::Other, comparable.then_some(Key::Tuple(items))))
    }

    /// Steps over the first pairs, of up to `count`, of a map that is not
    /// a params map, while each key and value is a whole integer, float,
    /// nil, boolean or short string (valid UTF-8), or an empty array (`()`
    /// as a key) or, as a value, an empty map: pairs that make no edit,
    /// with none before them that did, so that no key is held to compare
    /// them with and none of them need be held; nothing is made of them.
    /// Returns how many it stepped over; the general read reads the rest,
    /// and says what is wrong with the first, if anything.
    #[inline(always)]
    fn simple_pairs(&mut self, count: usize) -> usize {
        // An empty array or map here is one level deeper than the map.
        let deep = self.depth == MAX_NESTING_DEPTH;
        for done in 0..count {
            let Some((value, key_text)) = simple_end(self.bytes, self.pos, deep, false) else {
                return done;
            };
            let Some((end, value_text)) = simple_end(self.bytes, value, deep, true) else {
                return done;
            };
            // Strings checked last: a params key is followed by a map.
            if !(key_text.is_none_or(is_text) && value_text.is_none_or(is_text)) {
                return done;
            }
            self.pos = end;
        }
        count
    }

    /// Reads a map key: its value as Python compares it, none for a key
    /// that equals nothing. A short string (most keys) is read in place,
    /// any other key by the general read. (`()` keys, a body of which is
    /// a map `{(): 0}` after another, are stepped over by
    /// [`Walk::simple_pairs`] before any key is read.)
    #[inline(always)]
    fn key(&mut self) -> Result<Option<Key<'a>>, MsgpackError> {
        match self.bytes.get(self.pos) {
            Some(&marker @ 0xa0..=0xbf) => {
                self.pos += 1;
                self.str(usize::from(marker & 0x1f)).map(|(_, key)| key)
            }
            // An array key is a tuple in Python; a map or an extension
            // value in a key is refused where it is read. (A map is never
            // inside a key, so no tuple is being read around this one.)
            _ => {
                self.in_key += 1;
                let read = self.read(false);
                self.in_key -= 1;
                read.map(|(_, key)| key)
            }
        }
    }

    /// Reads a map of `count` pairs whose header is at `header`. When
    /// `params` is set it is a `disaggregated_params` value: decide from its
    /// effective members whether it needs an id.
    fn map(&mut self, header: usize, count: usize, params: bool) -> Result<(), MsgpackError> {
        if self.in_key > 0 {
            self.pos = header;
            return Err(self.error(
                "a map key is or holds a map, which msgspec and Python refuse as a dict key",
            ));
        }
        self.enter(header)?;
        let header_len = self.pos - header;
        // The first pairs, while nothing is made of them: a body can be 11
        // million maps `{(): 0}`.
        let mut done = 0;
        if !params {
            done = self.simple_pairs(count);
            if done == count {
                self.depth -= 1;
                return Ok(());
            }
        }
        // The key held singly is held as its value; the others by where
        // they are, read again to be compared when a key of their hash
        // comes.
        let mut with_edits: EditsByKey<Key<'a>, usize> = EditsByKey::new();
        let mut context_only = false;
        let mut id = IdMember::Missing;
        for _ in done..count {
            let key_at = self.pos;
            let key = self.key()?;
            let (is_params, is_type, is_id) = match &key {
                Some(Key::Str(name)) => (
                    *name == PARAMS_KEY,
                    *name == REQUEST_TYPE_KEY,
                    *name == ID_KEY,
                ),
                _ => (false, false, false),
            };
            if let Some(key) = key.as_ref().filter(|_| !with_edits.is_empty()) {
                let bytes = self.bytes;
                let found = with_edits.remove_by(
                    |held| held == key,
                    || hash_of(key),
                    |&held| key_at_offset(bytes, held).as_ref() == Some(key),
                );
                if let Some(range) = found {
                    self.edits[range].iter_mut().for_each(|e| *e = None);
                }
            }
            let first_edit = self.edits.len();
            if params && is_type {
                // A byte string too: the worker's pydantic model takes
                // bytes for a `str` field (lax mode), as UTF-8.
                context_only = match self.value(false)? {
                    Value::Str { start, end } | Value::Bin { start, end } => {
                        self.bytes[start..end].eq_ignore_ascii_case(CONTEXT_ONLY)
                    }
                    _ => false,
                };
            } else if params && is_id {
                id = match self.value(false)? {
                    Value::Nil { at } => IdMember::Nil { at },
                    _ => IdMember::Set,
                };
            } else {
                self.skip(is_params)?;
            }
            if self.edits.len() > first_edit {
                if let Some(key) = key {
                    let range = first_edit..self.edits.len();
                    with_edits.insert_by(key, |key| (hash_of(&key), key_at), range);
                }
            }
        }
        self.depth -= 1;
        if params && context_only {
            let edit = match id {
                IdMember::Missing => {
                    let count = u32::try_from(count).ok().filter(|&c| c < u32::MAX).ok_or(
                        MsgpackError {
                            offset: header,
                            problem: "a disaggregated_params map is too large to add an id to",
                        },
                    )?;
                    Some(MsgpackEdit::AppendPair {
                        header,
                        header_len,
                        count,
                        end: self.pos,
                    })
                }
                IdMember::Nil { at } => {
                    debug_assert_eq!(self.bytes[at], NIL);
                    Some(MsgpackEdit::ReplaceNil { at })
                }
                IdMember::Set => None,
            };
            if let Some(edit) = edit {
                self.edits.push(Some(edit));
            }
        }
        Ok(())
    }
}

/// Where the value at `at` in `bytes` ends when it is a whole integer,
/// float, nil, boolean or short string (a fixstr), or, unless `deep`, an
/// empty array or (with `empty_map`: not a key) an empty map: what
/// [`Walk::simple_pairs`] steps over. With a string's content, which must
/// be valid UTF-8.
#[inline(always)]
fn simple_end(
    bytes: &[u8],
    at: usize,
    deep: bool,
    empty_map: bool,
) -> Option<(usize, Option<&[u8]>)> {
    let marker = *bytes.get(at)?;
    let size = usize::from(SIMPLE_SIZE[usize::from(marker)]);
    if size == 0 || size > bytes.len() - at {
        return None;
    }
    match marker {
        0xa0..=0xbf => Some((at + size, Some(&bytes[at + 1..at + size]))),
        0x90 if deep => None,
        0x80 if deep || !empty_map => None,
        _ => Some((at + size, None)),
    }
}

/// [`SCALAR_SIZE`], and the size of a fixstr, an empty array and an
/// empty map.
static SIMPLE_SIZE: [u8; 256] = {
    let mut sizes = SCALAR_SIZE;
    let mut marker = 0xa0;
    while marker <= 0xbf {
        sizes[marker] = (marker - 0xa0 + 1) as u8;
        marker += 1;
    }
    sizes[0x80] = 1;
    sizes[0x90] = 1;
    sizes
};

/// Whether `bytes` are valid UTF-8, ASCII (most keys) without a call.
#[inline(always)]
fn is_text(bytes: &[u8]) -> bool {
    bytes.is_ascii() || std::str::from_utf8(bytes).is_ok()
}

/// The key at `at` in `bytes`, which was read there before as one that
/// equals some other: read again, to be compared.
fn key_at_offset(bytes: &[u8], at: usize) -> Option<Key<'_>> {
    let mut walk = Walk::new(bytes);
    walk.pos = at;
    walk.in_key = 1;
    walk.read(false).ok().and_then(|(_, key)| key)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn map_headers_keep_their_format_until_the_count_outgrows_it() {
        assert_eq!(*map_header(0x82, 3), [0x83]);
        assert_eq!(*map_header(0x8f, 16), [0xde, 0x00, 0x10]);
        assert_eq!(*map_header(0xde, 3), [0xde, 0x00, 0x03]);
        assert_eq!(*map_header(0xde, 65536), [0xdf, 0x00, 0x01, 0x00, 0x00]);
        assert_eq!(*map_header(0xdf, 2), [0xdf, 0, 0, 0, 2]);
    }

    /// Every length format, in its widest form where a narrower one would
    /// do (as some encoders write them), is read, and the params map keeps
    /// its format when it gains a pair.
    #[test]
    fn reads_every_length_format_and_keeps_a_wide_header() {
        let str8 = |s: &[u8]| [&[0xd9, s.len() as u8][..], s].concat();
        let str16 = |s: &[u8]| [&[0xda, 0, s.len() as u8][..], s].concat();
        let str32 = |s: &[u8]| [&[0xdb, 0, 0, 0, s.len() as u8][..], s].concat();
        // map 16 {str8 "xs": array 32 [nil], str16 "disaggregated_params":
        //   map 32 {str32 "request_type": str8 "context_only"}}
        let mut body = vec![0xde, 0, 2];
        body.extend(str8(b"xs"));
        body.extend([0xdd, 0, 0, 0, 1, 0xc0]);
        body.extend(str16(PARAMS_KEY));
        let header = body.len();
        body.extend([0xdf, 0, 0, 0, 1]);
        body.extend(str32(REQUEST_TYPE_KEY));
        body.extend(str8(CONTEXT_ONLY));
        // bin 8, ext 8 and fixext 4 values are skipped whole.
        let mut batch = vec![0x94, 0xc4, 1, 0xff, 0xc7, 1, 5, 0xee, 0xd6, 9, 1, 2, 3, 4];
        batch.extend(&body);
        let edits = find_msgpack_edits(&batch).unwrap();
        assert_eq!(edits.len(), 1);
        let out = apply(&batch, &edits, &[1 << 42]);
        let at = 14 + header;
        assert_eq!(out[at..at + 5], [0xdf, 0, 0, 0, 2]);
        assert_eq!(out[..at], batch[..at]);
        assert_eq!(out[out.len() - 8..], (1u64 << 42).to_be_bytes());
    }

    /// Python reads an array key as a tuple, so a body with one is read;
    /// a map as a key, or inside one, is refused as msgspec refuses it.
    #[test]
    fn array_keys_are_read_and_maps_in_keys_refused() {
        // {[1]: "x", "disaggregated_params": {"request_type": "context_only"}}
        let mut body = vec![0x82, 0x91, 0x01, 0xa1, b'x', 0xb4];
        body.extend_from_slice(PARAMS_KEY);
        body.extend_from_slice(&[0x81, 0xac]);
        body.extend_from_slice(REQUEST_TYPE_KEY);
        body.push(0xac);
        body.extend_from_slice(CONTEXT_ONLY);
        assert_eq!(find_msgpack_edits(&body).unwrap().len(), 1);
        for key in [&[0x80][..], &[0x91, 0x80], &[0xde, 0, 0]] {
            let body = [&[0x81][..], key, &[0x01]].concat();
            let error = find_msgpack_edits(&body).unwrap_err();
            assert!(error.problem.contains("map key"), "{error}");
        }
    }

    /// `{KEY: {"disaggregated_params": {"request_type": "context_only"}},
    /// OTHER: 0}`: how many ids it gets, 1 when the two keys differ in
    /// Python and 0 when the second overrides the first.
    fn ids_with_keys(key: &[u8], other: &[u8]) -> usize {
        let mut body = vec![0x82];
        body.extend_from_slice(key);
        body.extend_from_slice(&[0x81, 0xb4]);
        body.extend_from_slice(PARAMS_KEY);
        body.extend_from_slice(&[0x81, 0xac]);
        body.extend_from_slice(REQUEST_TYPE_KEY);
        body.push(0xac);
        body.extend_from_slice(CONTEXT_ONLY);
        body.extend_from_slice(other);
        body.push(0x00);
        find_msgpack_edits(&body)
            .unwrap_or_else(|e| panic!("{e}"))
            .len()
    }

    /// Keys are compared as Python compares the dict keys msgspec decodes
    /// them to (checked against msgspec 0.23): the last of equal keys wins.
    #[test]
    fn duplicate_keys_are_equal_keys_in_python() {
        let f32 = |v: f32| [&[0xca][..], &v.to_bits().to_be_bytes()].concat();
        let f64 = |v: f64| [&[0xcb][..], &v.to_bits().to_be_bytes()].concat();
        let ts32 = |s: u32| [&[0xd6, 0xff][..], &s.to_be_bytes()].concat();
        let ts96 =
            |s: i64, n: u32| [&[0xc7, 12, 0xff][..], &n.to_be_bytes(), &s.to_be_bytes()].concat();
        let nan = f64(f64::NAN);
        let same = [
            // 1 == 1.0 == True, 0 == -0.0 == False, in every width.
            (vec![0x01], vec![0xc3]),
            (vec![0xcd, 0, 1], f64(1.0)),
            (f32(1.0), vec![0xd0, 1]),
            (vec![0xc2], f64(-0.0)),
            (
                vec![0xd3, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff],
                f32(-1.0),
            ),
            (f32(1.5), f64(1.5)),
            (f64(f64::INFINITY), f32(f32::INFINITY)),
            (vec![0xc0], vec![0xc0]),
            // Tuples item by item, nested ones too.
            (
                vec![0x92, 0x01, 0xa1, b'a'],
                vec![0x92, 0xc3, 0xd9, 1, b'a'],
            ),
            (
                vec![0x91, 0x91, 0x01],
                vec![0xdc, 0, 1, 0x91, 0xcb, 0x3f, 0xf0, 0, 0, 0, 0, 0, 0],
            ),
            (vec![0x90], vec![0xdd, 0, 0, 0, 0]),
            // Timestamps to the microsecond, rounded half up.
            (ts32(7), ts96(7, 0)),
            (ts32(7), [&[0xd7, 0xff][..], &7u64.to_be_bytes()].concat()),
            (ts96(7, 1_000), ts96(7, 1_499)),
            (ts96(7, 999_999_500), ts32(8)),
            (ts96(-1, 999_999_500), ts32(0)),
        ];
        for (key, other) in &same {
            assert_eq!(ids_with_keys(key, other), 0, "{key:02x?} then {other:02x?}");
        }
        let different = [
            (vec![0x01], vec![0x02]),
            (vec![0xa1, b'a'], vec![0xc4, 1, b'a']),
            (f32(1.1), f64(1.1)),
            (nan.clone(), nan.clone()),
            ([&[0x91][..], &nan].concat(), [&[0x91][..], &nan].concat()),
            (vec![0x91, 0x01], vec![0x01]),
            (vec![0x92, 0x91, 0x01, 0x02], vec![0x92, 0x01, 0x91, 0x02]),
            (vec![0x91, 0x90], vec![0x90]),
            (vec![0xc0], vec![0x00]),
            (ts96(7, 1_000), ts96(7, 1_500)),
            (ts32(1), vec![0x01]),
        ];
        for (key, other) in &different {
            assert_eq!(ids_with_keys(key, other), 1, "{key:02x?} then {other:02x?}");
        }
    }

    /// The scalars an array's items are stepped over by: each whole one is
    /// read, in an array and in an array key, and each cut short at any
    /// byte gets the general read's error, at the byte after its marker.
    #[test]
    fn scalars_stepped_over_are_whole_or_refused_where_they_are_cut() {
        for marker in 0..=255u8 {
            let size = usize::from(SCALAR_SIZE[usize::from(marker)]);
            if size == 0 {
                continue;
            }
            let scalar: Vec<u8> = std::iter::once(marker)
                .chain((1..size as u8).map(|b| b.wrapping_mul(37)))
                .collect();
            // [s, s] and {(s, s): nil}.
            let array = [&[0x92][..], &scalar, &scalar].concat();
            assert_eq!(
                find_msgpack_edits(&array).map(|e| e.len()),
                Ok(0),
                "{marker:#x}"
            );
            let keyed = [&[0x81][..], &array, &[0xc0]].concat();
            assert_eq!(
                find_msgpack_edits(&keyed).map(|e| e.len()),
                Ok(0),
                "{marker:#x}"
            );
            for cut in 1..size {
                let body = [&[0x92][..], &scalar, &scalar[..cut]].concat();
                let error = find_msgpack_edits(&body).unwrap_err();
                assert_eq!(
                    (error.offset, error.problem),
                    (1 + size + 1, "the body ends inside a value"),
                    "{marker:#x} cut after {cut}"
                );
            }
        }
        // The one marker that is no value is refused in an array too.
        let error = find_msgpack_edits(&[0x91, 0xc1]).unwrap_err();
        assert_eq!(error.offset, 1);
    }

    /// A tuple key of a million items is read without its encoding
    /// growing past the cap, and taken as equal to nothing.
    #[test]
    fn a_huge_tuple_key_equals_nothing() {
        // An array 32 of a million copies of the one-byte value `item`.
        let million = |item: u8| {
            [
                &[0xdd][..],
                &1_000_000u32.to_be_bytes(),
                &vec![item; 1_000_000],
            ]
            .concat()
        };
        let huge = million(0x7f);
        assert_eq!(ids_with_keys(&huge, &huge), 1);
        // Empty tuples in a tuple add to the encoding too.
        let empties = million(0x90);
        assert_eq!(ids_with_keys(&empties, &empties), 1);
        // Just under the cap, equal tuples are still one key.
        let small = [&[0xdc][..], &1000u16.to_be_bytes(), &[0x7f; 1000]].concat();
        assert_eq!(ids_with_keys(&small, &small), 0);
    }

    /// msgspec decodes an extension value to an unhashable `Ext`, so it
    /// refuses one as a map key or inside one; a timestamp is a datetime.
    #[test]
    fn extension_keys_are_refused_but_timestamps_read() {
        // The offset is the extension value's.
        for (key, at) in [
            (&[0xd4, 0x05, 0x01][..], 1),
            (&[0x91, 0xc7, 1, 0x05, 0x01], 2),
        ] {
            let body = [&[0x81][..], key, &[0x01]].concat();
            let error = find_msgpack_edits(&body).unwrap_err();
            assert!(error.problem.contains("extension value"), "{error}");
            assert_eq!(error.offset, at, "{error}");
        }
        assert!(find_msgpack_edits(&[0x81, 0xd6, 0xff, 0, 0, 0, 1, 0x01]).is_ok());
        assert!(find_msgpack_edits(&[0x91, 0xd4, 0x05, 0x01]).is_ok());
    }

    /// msgspec refuses a timestamp that is not 4, 8 or 12 bytes, that has
    /// a billion nanoseconds or more, or that Python's datetime cannot
    /// hold (years 1 to 9999, after rounding to the microsecond), anywhere.
    #[test]
    fn invalid_timestamps_are_refused_anywhere() {
        let ts96 = |s: i64, n: u32| {
            [
                &[0x91, 0xc7, 12, 0xff][..],
                &n.to_be_bytes(),
                &s.to_be_bytes(),
            ]
            .concat()
        };
        let bad = [
            (vec![0x91, 0xd4, 0xff, 0x00], "4, 8 or 12"),
            (vec![0x91, 0xc7, 0, 0xff], "4, 8 or 12"),
            (
                [
                    &[0x91, 0xd7, 0xff][..],
                    &((1_000_000_000u64 << 34) | 5).to_be_bytes(),
                ]
                .concat(),
                "nanoseconds",
            ),
            (ts96(0, 1_000_000_000), "nanoseconds"),
            (ts96(-62_135_596_801, 999_999_500), "years 1 to 9999"),
            (ts96(253_402_300_800, 0), "years 1 to 9999"),
            (ts96(253_402_300_799, 999_999_500), "years 1 to 9999"),
        ];
        for (body, problem) in &bad {
            let error = find_msgpack_edits(body).unwrap_err();
            assert!(error.problem.contains(problem), "{body:02x?}: {error}");
            assert_eq!(error.offset, 1, "{body:02x?}: {error}");
        }
        for good in [ts96(-62_135_596_800, 0), ts96(253_402_300_799, 999_999_499)] {
            assert!(find_msgpack_edits(&good).is_ok(), "{good:02x?}");
        }
    }

    /// Too deep: the offset is the opening header's, for arrays as for maps.
    #[test]
    fn too_deep_names_the_header_that_went_too_deep() {
        for deepest in [&[0x91, 0x00][..], &[0xdc, 0, 1, 0x00], &[0x81, 0x00, 0x00]] {
            let body = [&[0x91; MAX_NESTING_DEPTH][..], deepest].concat();
            let error = find_msgpack_edits(&body).unwrap_err();
            assert_eq!(error.offset, MAX_NESTING_DEPTH, "{error}");
            assert!(error.problem.contains("deeper"), "{error}");
        }
    }

    /// An ext 32 whose length is 4 GiB - 1 is cut short, not read as an
    /// empty value (`1 + len` wrapped to 0 on 32-bit targets).
    #[test]
    fn an_ext_of_the_largest_length_is_cut_short() {
        let body = [0x92, 0xc9, 0xff, 0xff, 0xff, 0xff, 0x80, 0xc0];
        let error = find_msgpack_edits(&body).unwrap_err();
        assert!(error.problem.contains("ends inside"), "{error}");
    }

    #[test]
    fn a_nested_map_ending_with_its_parent_gets_its_pair_first() {
        // {"disaggregated_params": {"request_type": "context_only",
        //   "x": {"disaggregated_params": {"request_type": "context_only"}}}}
        let mut body = vec![0x81, 0xb4];
        body.extend_from_slice(PARAMS_KEY);
        body.extend_from_slice(&[0x82, 0xac]);
        body.extend_from_slice(REQUEST_TYPE_KEY);
        body.push(0xac);
        body.extend_from_slice(CONTEXT_ONLY);
        body.extend_from_slice(&[0xa1, b'x', 0x81, 0xb4]);
        body.extend_from_slice(PARAMS_KEY);
        body.extend_from_slice(&[0x81, 0xac]);
        body.extend_from_slice(REQUEST_TYPE_KEY);
        body.push(0xac);
        body.extend_from_slice(CONTEXT_ONLY);
        let edits = find_msgpack_edits(&body).unwrap();
        assert_eq!(edits.len(), 2);
        let out = apply(&body, &edits, &[1 << 42, (1 << 42) + 1]);
        // The outer map now has 3 pairs and ends with the first id; the
        // inner one 2, ending with the second, inside the outer's "x".
        let inner_pair_at = out.len() - 2 * (1 + ID_KEY.len() + 9);
        assert_eq!(out[22], 0x83);
        assert_eq!(
            out[inner_pair_at + 1 + ID_KEY.len() + 1..][..8],
            ((1u64 << 42) + 1).to_be_bytes()
        );
        assert_eq!(out[out.len() - 8..], (1u64 << 42).to_be_bytes());
    }
}
