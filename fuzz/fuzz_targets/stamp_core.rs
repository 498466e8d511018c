//! The plugin's pure core on arbitrary bytes: `decide` never panics or
//! fails, refuses exactly what is not JSON, and stamps byte-preservingly
//! exactly where serde_json says ids belong. See `src/oracle.rs`.

#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    snowgate_fuzz::oracle::check_body(data, snowgate_fuzz::parse_unbounded);
});
