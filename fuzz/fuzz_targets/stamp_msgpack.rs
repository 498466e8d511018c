//! The plugin's MessagePack path on arbitrary bytes: `decide` never panics
//! or fails, a new body is one whole MessagePack value, and where rmpv and
//! the documented rules read the body, ids go exactly where a Python
//! reader expects them and nothing else changes; what the rules refuse is
//! refused. See `src/mp_oracle.rs`.

#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    snowgate_fuzz::mp_oracle::check_msgpack_body(data);
});
