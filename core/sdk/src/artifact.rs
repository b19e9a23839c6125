use std::io::Write;
use std::path::Path;

use crate::PluginError;

/// Writes `bytes` to `dir/name` through a temporary file and a rename, so that a reader never
/// sees a half-written file even if the process dies mid-write.
pub fn write_atomically(dir: &Path, name: &str, bytes: &[u8]) -> Result<(), PluginError> {
    let target = dir.join(name);
    let partial = dir.join(format!(".{name}.partial"));
    let write = || -> std::io::Result<()> {
        let mut file = std::fs::File::create(&partial)?;
        file.write_all(bytes)?;
        file.sync_all()?;
        std::fs::rename(&partial, &target)
    };
    write().map_err(|source| PluginError::io(&target, source))
}

/// Writes `value` as pretty JSON to `dir/name`, atomically.
pub fn write_json(
    dir: &Path,
    name: &str,
    value: &impl serde::Serialize,
) -> Result<(), PluginError> {
    let text = serde_json::to_vec_pretty(value)
        .map_err(|err| PluginError::failed(format!("cannot encode {name}: {err}")))?;
    write_atomically(dir, name, &text)
}

/// `text` as part of a file name: ASCII letters and digits and the characters of `keep` stay,
/// anything else (a path separator among them) becomes `_`.
pub fn file_name_part(text: &str, keep: &str) -> String {
    text.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || keep.contains(c) {
                c
            } else {
                '_'
            }
        })
        .collect()
}
