//! How much text a plugin may hand the host: its log lines, its error
//! messages and its rejections reach the gateway's log and its clients, so
//! each is bounded, whatever the plugin sends.

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

/// At most `max` bytes of a plugin's text (see [`cut`]), with every
/// control character written as its Rust escape (`\n`, `\r`, `\u{1b}`):
/// what a plugin says reaches the gateway's log, where a raw newline would
/// let it forge a line of its own and a raw escape would reach the
/// terminal. Other characters are kept as they are.
pub(crate) fn plugin_text(text: String, max: usize) -> String {
    let text = cut(text, max);
    if !text.chars().any(char::is_control) {
        return text;
    }
    let mut escaped = String::with_capacity(text.len() + 16);
    for c in text.chars() {
        if c.is_control() {
            escaped.extend(c.escape_default());
        } else {
            escaped.push(c);
        }
    }
    escaped
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn control_characters_in_plugin_text_are_escaped_and_the_rest_kept() {
        assert_eq!(plugin_text("plain é \\ \"".into(), 100), "plain é \\ \"");
        assert_eq!(
            plugin_text("a\r\nERROR forged\u{1b}[31m\0\t\u{85}".into(), 100),
            "a\\r\\nERROR forged\\u{1b}[31m\\u{0}\\t\\u{85}"
        );
        // Cut first, so the escaped text stays bounded.
        assert_eq!(
            plugin_text("\n\n\n".into(), 2),
            "\\n\\n... (1 more byte cut)"
        );
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
