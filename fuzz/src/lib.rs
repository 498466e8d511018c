//! Shared code of the snowgate fuzz targets.

pub mod mp_oracle;
pub mod oracle;

/// serde_json without its recursion limit (snowgate allows one level more
/// than serde_json's default). The oracle only parses bodies whose brackets
/// nest at most `MAX_NESTING_DEPTH` deep, so the stack stays small.
pub fn parse_unbounded(body: &[u8]) -> Result<serde_json::Value, serde_json::Error> {
    use serde::Deserialize as _;
    let mut de = serde_json::Deserializer::from_slice(body);
    de.disable_recursion_limit();
    let value = serde_json::Value::deserialize(&mut de)?;
    de.end()?;
    Ok(value)
}
