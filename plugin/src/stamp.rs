//! Splices ids into a body at the places [`crate::body::find_edits`] found,
//! touching no other byte.

use crate::body::Edit;

/// The member name written for a missing id.
const INSERTED_MEMBER: &[u8] = b"\"disagg_request_id\":";

/// Returns `body` with `ids[i]` written by `edits[i]`. `edits` must be sorted
/// by position, as `find_edits` returns them, and `ids` as long as `edits`.
pub fn apply(body: &[u8], edits: &[Edit], ids: &[u64]) -> Vec<u8> {
    debug_assert_eq!(edits.len(), ids.len());
    let mut out = Vec::with_capacity(body.len() + edits.len() * (1 + INSERTED_MEMBER.len() + 20));
    let mut copied = 0;
    for (edit, &id) in edits.iter().zip(ids) {
        match *edit {
            Edit::InsertMember { at, comma } => {
                out.extend_from_slice(&body[copied..at]);
                if comma {
                    out.push(b',');
                }
                out.extend_from_slice(INSERTED_MEMBER);
                copied = at;
            }
            Edit::ReplaceNull { at } => {
                out.extend_from_slice(&body[copied..at]);
                copied = at + b"null".len();
            }
        }
        push_decimal(&mut out, id);
    }
    out.extend_from_slice(&body[copied..]);
    out
}

/// Appends `n` in decimal without going through `fmt`.
fn push_decimal(out: &mut Vec<u8>, mut n: u64) {
    let mut digits = [0u8; 20];
    let mut i = digits.len();
    loop {
        i -= 1;
        digits[i] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    out.extend_from_slice(&digits[i..]);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writes_every_digit_of_extreme_ids() {
        for n in [0, 9, 10, u64::MAX, (1 << 63) - 1] {
            let mut out = Vec::new();
            push_decimal(&mut out, n);
            assert_eq!(out, n.to_string().into_bytes());
        }
    }

    #[test]
    fn inserts_and_replaces_in_order() {
        let body = br#"[{"a":1},{"b":null},{}]"#;
        let edits = [
            Edit::InsertMember { at: 7, comma: true },
            Edit::ReplaceNull { at: 14 },
            Edit::InsertMember {
                at: 21,
                comma: false,
            },
        ];
        let out = apply(body, &edits, &[11, 22, 33]);
        assert_eq!(
            String::from_utf8(out).unwrap(),
            r#"[{"a":1,"disagg_request_id":11},{"b":22},{"disagg_request_id":33}]"#
        );
    }
}
