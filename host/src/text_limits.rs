//! How much text a plugin may hand the host: its log lines, its error
//! messages and its rejections reach the gateway's log and its clients, so
//! each is bounded, whatever the plugin sends.

use std::borrow::Cow;

/// The most bytes kept of one log line, error message or reject message
/// (the rest is cut), and of what a call writes to stderr (a panic
/// message, quoted when the call traps).
pub(crate) const MAX_PLUGIN_TEXT: usize = 4096;

/// The most bytes kept of a plugin's name or version, which go on every
/// one of its log lines, on `/status` and in the metrics.
pub(crate) const MAX_PLUGIN_NAME: usize = 128;

/// The longest reject code: a machine-readable name, such as
/// `invalid_json`. A longer one makes the answer unusable.
pub(crate) const MAX_REJECT_CODE: usize = 64;

/// The most log lines one call may write; the rest are dropped.
pub(crate) const MAX_LOG_LINES_PER_CALL: u32 = 64;

/// The most log lines all plugin calls together may write in a second
/// (the rest are dropped, counted in a warning once a second): with the
/// per-call limit alone, a plugin that logs on every request wrote 64
/// lines of 4 KiB per request, 263 MB in 3 s in a review.
pub(crate) const MAX_LOG_LINES_PER_SECOND: u64 = 1000;

/// `text` cut to at most `max` bytes (at a character boundary), saying how
/// much was cut; unchanged when it fits.
pub(crate) fn cut(mut text: String, max: usize) -> String {
    if text.len() <= max {
        return text;
    }
    let mut end = max;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    let cut = text.len() - end;
    text.truncate(end);
    let unit = if cut == 1 { "byte" } else { "bytes" };
    text.push_str(&format!("... ({cut} more {unit} cut)"));
    text
}

/// At most `max` bytes of a plugin's text, escapes included, saying how
/// much of it was cut (as `cut` does), with every control character
/// written as its Rust escape (`\n`, `\r`, `\u{1b}`): what a plugin says
/// reaches the gateway's log, where a raw newline would let it forge a
/// line of its own and a raw escape would reach the terminal. So are the
/// line and paragraph separators (U+2028, U+2029), which log viewers
/// written in JavaScript break lines at, and the bidirectional controls
/// (U+200E, U+200F, U+202A to U+202E, U+2066 to U+2069), which turn the
/// text after them around. Other characters are kept as they are. The
/// bound holds after escaping: cut first, a line of NULs grew fivefold (a
/// review logged 1.3 MB a call).
pub fn plugin_text(text: String, max: usize) -> String {
    match shown_text(&text, max) {
        Cow::Borrowed(_) => text,
        Cow::Owned(shown) => shown,
    }
}

/// [`plugin_text`] of a reason the plugin gave (a refusal of its settings,
/// a rejection's message), or `(no reason given)` where it gave none (only
/// whitespace): an empty reason left a message ending in a colon.
pub fn plugin_reason(text: String, max: usize) -> String {
    if text.trim().is_empty() {
        return "(no reason given)".to_string();
    }
    plugin_text(text, max)
}

/// [`plugin_text`] of text the plugin still holds (in its memory): only
/// what is kept is copied.
pub fn plugin_text_of(text: &str, max: usize) -> String {
    shown_text(text, max).into_owned()
}

/// What [`plugin_text`] shows of `text`: `text` itself where it is short
/// enough and needs no escape.
fn shown_text(text: &str, max: usize) -> Cow<'_, str> {
    if text.len() <= max && !text.chars().any(escaped) {
        return Cow::Borrowed(text);
    }
    let mut shown = String::with_capacity(max.min(text.len()) + 32);
    let mut taken = 0;
    for c in text.chars() {
        let before = shown.len();
        if escaped(c) {
            shown.extend(c.escape_default());
        } else {
            shown.push(c);
        }
        if shown.len() > max {
            shown.truncate(before);
            break;
        }
        taken += c.len_utf8();
    }
    let left = text.len() - taken;
    if left > 0 {
        let unit = if left == 1 { "byte" } else { "bytes" };
        shown.push_str(&format!("... ({left} more {unit} cut)"));
    }
    Cow::Owned(shown)
}

/// Whether [`plugin_text`] writes `c` as its escape.
fn escaped(c: char) -> bool {
    c.is_control()
        || matches!(
            c,
            '\u{2028}'
                | '\u{2029}'
                | '\u{200e}'
                | '\u{200f}'
                | '\u{202a}'..='\u{202e}'
                | '\u{2066}'..='\u{2069}'
        )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_reason_of_nothing_but_whitespace_says_none_was_given() {
        for none in ["", " ", "\n\t"] {
            assert_eq!(plugin_reason(none.into(), 100), "(no reason given)");
        }
        assert_eq!(plugin_reason(" no\n".into(), 100), " no\\n");
    }

    #[test]
    fn control_characters_in_plugin_text_are_escaped_and_the_rest_kept() {
        assert_eq!(plugin_text("plain é \\ \"".into(), 100), "plain é \\ \"");
        assert_eq!(
            plugin_text("a\r\nERROR forged\u{1b}[31m\0\t\u{85}".into(), 100),
            "a\\r\\nERROR forged\\u{1b}[31m\\u{0}\\t\\u{85}"
        );
        // Line breaks and text direction for viewers beyond the terminal.
        assert_eq!(
            plugin_text(
                "a\u{2028}ERROR b\u{2029}\u{202e}desrever\u{2066}\u{200f}".into(),
                100
            ),
            "a\\u{2028}ERROR b\\u{2029}\\u{202e}desrever\\u{2066}\\u{200f}"
        );
        // The bound holds for the escaped text; what is cut is counted in
        // the plugin's bytes.
        assert_eq!(
            plugin_text("\n\n\n".into(), 5),
            "\\n\\n... (1 more byte cut)"
        );
        assert_eq!(plugin_text("ab\0".into(), 4), "ab... (1 more byte cut)");
        let nuls = plugin_text("\0".repeat(4096), 4096);
        assert!(
            nuls.len() <= 4096 + "... (3277 more bytes cut)".len(),
            "{}",
            nuls.len()
        );
        assert!(nuls.starts_with("\\u{0}\\u{0}"), "{nuls}");
        assert!(nuls.ends_with("... (3277 more bytes cut)"), "{nuls}");
        // Within the bound, unchanged but for the escapes.
        assert_eq!(plugin_text("é\t".into(), 4), "é\\t");
    }

    #[test]
    fn text_that_fits_is_kept_and_longer_text_is_cut_at_a_character_boundary() {
        assert_eq!(cut("abc".into(), 3), "abc");
        assert_eq!(cut("abcd".into(), 3), "abc... (1 more byte cut)");
        // "é" is two bytes: a cut inside it keeps it out whole.
        assert_eq!(cut("aé".into(), 2), "a... (2 more bytes cut)");
        assert_eq!(cut(String::new(), 0), "");
    }
}
