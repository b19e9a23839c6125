//! `--set KEY=VALUE`: a YAML value placed at a dotted key path of the document, before it is
//! checked.

use serde_json::{Map, Value};

use super::spans::SpanIndex;
use crate::diagnostic::{Diagnostic, Origin};

pub(super) fn strip_location(message: &str) -> String {
    match message.find(" at line ") {
        Some(index) => message[..index].to_string(),
        None => message.to_string(),
    }
}

/// Applies `a.b.c=VALUE` (VALUE in YAML) to the document; returns the key path.
pub(super) fn apply_override(document: &mut Value, option: &str) -> Result<String, Diagnostic> {
    let origin = Origin::Override(option.to_string());
    let (key, raw) = option.split_once('=').ok_or_else(|| {
        Diagnostic::new(origin.clone(), "expected KEY=VALUE")
            .hint("for example --set stages.masks.matrix.seqlen=[16k]")
    })?;
    let value: Value = serde_norway::from_str(raw).map_err(|err| {
        Diagnostic::new(
            origin.clone(),
            format!(
                "the value is not valid YAML: {}",
                strip_location(&err.to_string())
            ),
        )
    })?;
    if let Some(duplicate) = SpanIndex::build(raw).duplicates().first() {
        return Err(Diagnostic::new(
            origin,
            format!(
                "duplicate key `{}` in the value; YAML would keep only the last one",
                duplicate.path
            ),
        ));
    }
    let segments: Vec<&str> = key.split('.').collect();
    if segments.iter().any(|segment| segment.is_empty()) {
        return Err(
            Diagnostic::new(origin, format!("`{key}` is not a key path"))
                .hint("write keys separated by dots, e.g. stages.bench.with.kernel"),
        );
    }
    let mut cursor = document;
    for segment in &segments[..segments.len() - 1] {
        let map = cursor.as_object_mut().ok_or_else(|| {
            Diagnostic::new(
                origin.clone(),
                format!("cannot set `{key}`: `{segment}` is inside a value that is not a mapping"),
            )
        })?;
        cursor = map
            .entry(segment.to_string())
            .or_insert_with(|| Value::Object(Map::new()));
    }
    let map = cursor.as_object_mut().ok_or_else(|| {
        Diagnostic::new(
            origin.clone(),
            format!("cannot set `{key}`: its parent is not a mapping"),
        )
    })?;
    map.insert(segments[segments.len() - 1].to_string(), value);
    Ok(key.to_string())
}

#[cfg(test)]
mod tests {
    use serde_json::{json, Value};

    use super::apply_override;

    fn applied(document: Value, option: &str) -> Result<Value, String> {
        let mut document = document;
        apply_override(&mut document, option)
            .map(|_| document)
            .map_err(|diagnostic| diagnostic.to_string())
    }

    #[test]
    fn a_value_lands_at_its_key_path_and_missing_maps_are_made() {
        let document = json!({"stages": {"masks": {"with": {"window": 64}}}});
        assert_eq!(
            applied(document.clone(), "stages.masks.matrix.seqlen=[1k, 2k]").unwrap(),
            json!({"stages": {"masks": {"with": {"window": 64}, "matrix": {"seqlen": ["1k", "2k"]}}}})
        );
        assert_eq!(
            applied(document, "stages.masks.with.window=128").unwrap()["stages"]["masks"]["with"]
                ["window"],
            json!(128)
        );
    }

    #[test]
    fn malformed_options_are_refused_with_what_to_write() {
        let document = json!({"seed": 1, "stages": {}});
        let cases = [
            ("seed", "expected KEY=VALUE"),
            ("stages..with.x=1", "is not a key path"),
            ("seed.value=2", "its parent is not a mapping"),
            ("seed.a.b=2", "is inside a value that is not a mapping"),
            ("stages.a=[1, 2", "the value is not valid YAML"),
            ("stages.a={x: 1, x: 2}", "duplicate key `x`"),
        ];
        for (option, expected) in cases {
            let error = applied(document.clone(), option).unwrap_err();
            assert!(error.contains(expected), "{option}: {error}");
        }
    }
}
