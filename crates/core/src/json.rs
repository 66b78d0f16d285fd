//! Sizes of JSON documents, counted as they are written, without building the text.

/// The length of `value` as compact JSON (`serde_json::to_vec`), in bytes, counted as it is
/// written (no buffer kept). None if it cannot be written as JSON (a map whose keys serde_json
/// cannot write as strings, a tuple say; a `Serialize` that fails); a `serde_json::Value`
/// always can.
pub fn encoded_len(value: &impl serde::Serialize) -> Option<usize> {
    struct Count(usize);
    impl std::io::Write for Count {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0 += buf.len();
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let mut count = Count(0);
    serde_json::to_writer(&mut count, value).ok()?;
    Some(count.0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    #[test]
    fn a_length_counted_as_written_is_the_length_of_the_text() {
        let value = serde_json::json!({"phase": "Leased", "token": "t-1", "note": "ü".repeat(40)});
        assert_eq!(
            encoded_len(&value),
            Some(serde_json::to_vec(&value).unwrap().len())
        );
        assert_eq!(encoded_len(&None::<u8>), Some(4));
        let keys_not_strings = HashMap::from([((1, 2), 3)]);
        assert_eq!(encoded_len(&keys_not_strings), None);
    }
}
