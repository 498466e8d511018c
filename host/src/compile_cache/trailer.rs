//! What follows a build in its cache file, so that a damaged or misnamed
//! file is caught before wasmtime runs it: the SHA-256 of the build, the
//! SHA-256 of the component it was compiled from, and [`MAGIC`].

use sha2::{Digest, Sha256};

/// The end of every file the cache writes.
const MAGIC: &[u8; 16] = b"snowgate-cache-1";

/// The trailer's length.
const LEN: usize = 32 + 32 + MAGIC.len();

/// The trailer of `build`, compiled from the component whose hex SHA-256 is
/// `sha256`.
pub(super) fn of(build: &[u8], sha256: &str) -> Vec<u8> {
    let mut trailer = Vec::with_capacity(LEN);
    trailer.extend_from_slice(&Sha256::digest(build));
    trailer.extend_from_slice(&component_digest(sha256));
    trailer.extend_from_slice(MAGIC);
    trailer
}

/// The build in a cache file of the component whose hex SHA-256 is
/// `sha256`: its bytes, once the trailer shows them whole and of that
/// component.
pub(super) fn checked<'a>(stored: &'a [u8], sha256: &str) -> anyhow::Result<&'a [u8]> {
    anyhow::ensure!(
        stored.len() > LEN && stored.ends_with(MAGIC),
        "it is not a file the compile cache wrote (no checksum at its end)"
    );
    let (build, trailer) = stored.split_at(stored.len() - LEN);
    anyhow::ensure!(
        Sha256::digest(build).as_slice() == &trailer[..32],
        "its checksum does not match: the file is damaged"
    );
    anyhow::ensure!(
        trailer[32..64] == component_digest(sha256),
        "it holds the build of another component"
    );
    Ok(build)
}

/// The hex SHA-256 `sha256` as its 32 bytes (zeros if it is not hex,
/// which matches no file).
fn component_digest(sha256: &str) -> [u8; 32] {
    let mut digest = [0; 32];
    for (i, byte) in digest.iter_mut().enumerate() {
        *byte = sha256
            .get(2 * i..2 * i + 2)
            .and_then(|h| u8::from_str_radix(h, 16).ok())
            .unwrap_or(0);
    }
    digest
}

#[cfg(test)]
mod tests {
    use super::*;

    const SHA: &str = "00112233445566778899aabbccddeeff00112233445566778899aabbccddeeff";

    #[test]
    fn a_build_is_read_back_only_whole_undamaged_and_under_its_own_component() {
        let build = b"\x7fELF and the rest of a compiled plugin".to_vec();
        let mut stored = build.clone();
        stored.extend_from_slice(&of(&build, SHA));
        assert_eq!(checked(&stored, SHA).expect("whole"), &build[..]);

        let mut damaged = stored.clone();
        damaged[5] ^= 1;
        let error = checked(&damaged, SHA).expect_err("damaged").to_string();
        assert!(error.contains("checksum does not match"), "{error}");

        let other = SHA.replace("00", "11");
        let error = checked(&stored, &other).expect_err("misnamed").to_string();
        assert!(error.contains("another component"), "{error}");

        for cut in [&stored[..stored.len() - 1], &build[..], &[][..]] {
            let error = checked(cut, SHA).expect_err("cut").to_string();
            assert!(
                error.contains("not a file the compile cache wrote"),
                "{error}"
            );
        }
    }
}
