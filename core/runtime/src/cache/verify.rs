//! Checking one entry folder against its metadata: what a run, `cache verify`, an import and a
//! report read must be exactly what the entry lists.

use std::collections::BTreeSet;
use std::io::BufReader;
use std::path::Path;

use super::tree::{
    check_relative, hash_file, is_key, kind, open_regular, regular_files, Hashing, Kind,
};
use super::{Entry, EntryMeta};

/// What an entry folder holds; anything else in it is unaccounted for and makes it invalid.
const ENTRY_ITEMS: [&str; 3] = ["entry.json", "result.json", "files"];

/// Reads the entry at `dir` and checks it: its folder holds only its metadata, result and
/// `files/`; every file under `files/` is listed and every listed file is there with its digest
/// (hashed as a stream); its key is the one its key parts hash to. `Err` says what is wrong.
pub fn verify_entry(dir: &Path) -> Result<Entry, String> {
    let listing = std::fs::read_dir(dir).map_err(|err| format!("{}: {err}", dir.display()))?;
    for item in listing {
        let item = item.map_err(|err| format!("{}: {err}", dir.display()))?;
        let name = item.file_name();
        if !ENTRY_ITEMS.iter().any(|known| name == *known) {
            return Err(format!(
                "{} is not part of an entry (only {} are)",
                name.to_string_lossy(),
                ENTRY_ITEMS.join(", ")
            ));
        }
    }
    let meta_file =
        open_regular(&dir.join("entry.json")).map_err(|err| format!("entry.json: {err}"))?;
    let meta: EntryMeta = serde_json::from_reader(BufReader::new(meta_file))
        .map_err(|err| format!("entry.json: {err}"))?;
    if !is_key(&meta.key) {
        return Err(format!(
            "entry.json: key `{}` is not 64 hex digits",
            meta.key
        ));
    }
    if meta.key_parts.key() != meta.key {
        return Err("entry.json: its key is not the hash of its key parts".into());
    }
    if dir.file_name().and_then(|n| n.to_str()) != Some(meta.key.as_str()) {
        return Err(format!(
            "filed under a folder other than its key {}",
            meta.key
        ));
    }

    let result_file =
        open_regular(&dir.join("result.json")).map_err(|err| format!("result.json: {err}"))?;
    let mut reader = Hashing {
        inner: BufReader::new(result_file),
        hasher: blake3::Hasher::new(),
    };
    let parsed: Result<serde_json::Value, _> = serde_json::from_reader(&mut reader);
    // Whatever the parser left unread still counts towards the digest.
    std::io::copy(&mut reader, &mut std::io::sink())
        .map_err(|err| format!("result.json: {err}"))?;
    if reader.hasher.finalize().to_hex().as_str() != meta.result_digest {
        return Err("result.json does not match its digest".into());
    }
    let result = parsed.map_err(|err| format!("result.json: {err}"))?;

    let files_dir = dir.join("files");
    if kind(&files_dir).map_err(|err| format!("files: {err}"))? != Kind::Dir {
        return Err("files is not a folder".into());
    }
    let present = regular_files(&files_dir)?;
    for relative in meta.files.keys() {
        check_relative(relative).map_err(|err| format!("entry.json: files: {err}"))?;
    }
    let listed: BTreeSet<&String> = meta.files.keys().collect();
    if let Some(extra) = present.keys().find(|p| !listed.contains(p)) {
        return Err(format!(
            "files/{extra} is not listed in entry.json; an entry holds only what it was committed with"
        ));
    }
    for (relative, digest) in &meta.files {
        let path = present
            .get(relative)
            .ok_or_else(|| format!("files/{relative} is missing"))?;
        let (actual, _) = hash_file(path).map_err(|err| format!("files/{relative}: {err}"))?;
        if &actual != digest {
            return Err(format!("files/{relative} does not match its digest"));
        }
    }
    if super::output_digest(&meta.result_digest, &meta.files) != meta.output_digest {
        return Err("entry.json: output_digest is not the digest of its result and files".into());
    }
    Ok(Entry {
        meta,
        files_dir,
        result,
    })
}
