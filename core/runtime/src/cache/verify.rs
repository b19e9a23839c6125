//! Checking one entry folder against its metadata: what a run, `cache verify`, an import and a
//! report read must be exactly what the entry lists.

use std::collections::BTreeSet;
use std::io::BufReader;
use std::path::Path;

use super::tree::{
    check_relative, hash_file, io_at, is_key, kind, open_regular, read_dir, regular_files, Hashing,
    Kind, TreeError,
};
use super::{Entry, EntryMeta};

/// What an entry folder holds; anything else in it is unaccounted for and makes it invalid.
const ENTRY_ITEMS: [&str; 3] = ["entry.json", "result.json", "files"];

/// What is wrong with an entry folder.
#[derive(Debug, thiserror::Error)]
pub enum EntryError {
    #[error(transparent)]
    Tree(#[from] TreeError),
    #[error("{name} is not part of an entry (only entry.json, result.json, files are)")]
    Stray { name: String },
    #[error("{file}: {source}")]
    Unreadable {
        file: &'static str,
        source: std::io::Error,
    },
    #[error("{file}: {source}")]
    Malformed {
        file: &'static str,
        source: serde_json::Error,
    },
    #[error("entry.json: key `{0}` is not 64 hex digits")]
    NotAKey(String),
    #[error("entry.json: its key is not the hash of its key parts")]
    KeyNotItsParts,
    #[error("filed under a folder other than its key {0}")]
    Misfiled(String),
    #[error("files is not a folder")]
    FilesNotAFolder,
    #[error("entry.json: files: {0}")]
    BadListing(TreeError),
    #[error(
        "files/{0} is not listed in entry.json; an entry holds only what it was committed with"
    )]
    Unlisted(String),
    #[error("files/{0} is missing")]
    Missing(String),
    /// `result.json` or `files/<path>`: its content is not what entry.json says.
    #[error("{0} does not match its digest")]
    Digest(String),
    #[error("entry.json: output_digest is not the digest of its result and files")]
    OutputDigest,
}

/// Reads the entry at `dir` and checks it: its folder holds only its metadata, result and
/// `files/`; every file under `files/` is listed and every listed file is there with its digest
/// (hashed as a stream); its key is the one its key parts hash to. `Err` says what is wrong.
pub fn verify_entry(dir: &Path) -> Result<Entry, EntryError> {
    for item in read_dir(dir)? {
        let name = item.file_name().unwrap_or_default();
        if !ENTRY_ITEMS.iter().any(|known| name == *known) {
            return Err(EntryError::Stray {
                name: name.to_string_lossy().into_owned(),
            });
        }
    }
    let unreadable = |file| move |source| EntryError::Unreadable { file, source };
    let malformed = |file| move |source| EntryError::Malformed { file, source };
    let meta_file = open_regular(&dir.join("entry.json")).map_err(unreadable("entry.json"))?;
    let meta: EntryMeta =
        serde_json::from_reader(BufReader::new(meta_file)).map_err(malformed("entry.json"))?;
    if !is_key(&meta.key) {
        return Err(EntryError::NotAKey(meta.key));
    }
    if meta.key_parts.key() != meta.key {
        return Err(EntryError::KeyNotItsParts);
    }
    if dir.file_name().and_then(|n| n.to_str()) != Some(meta.key.as_str()) {
        return Err(EntryError::Misfiled(meta.key));
    }

    let result_file = open_regular(&dir.join("result.json")).map_err(unreadable("result.json"))?;
    let mut reader = Hashing {
        inner: BufReader::new(result_file),
        hasher: blake3::Hasher::new(),
    };
    let parsed: Result<serde_json::Value, _> = serde_json::from_reader(&mut reader);
    // Whatever the parser left unread still counts towards the digest.
    std::io::copy(&mut reader, &mut std::io::sink()).map_err(unreadable("result.json"))?;
    if reader.hasher.finalize().to_hex().as_str() != meta.result_digest {
        return Err(EntryError::Digest("result.json".into()));
    }
    let result = parsed.map_err(malformed("result.json"))?;

    let files_dir = dir.join("files");
    if kind(&files_dir)? != Kind::Dir {
        return Err(EntryError::FilesNotAFolder);
    }
    let present = regular_files(&files_dir)?;
    for relative in meta.files.keys() {
        check_relative(relative).map_err(EntryError::BadListing)?;
    }
    let listed: BTreeSet<&String> = meta.files.keys().collect();
    if let Some(extra) = present.keys().find(|p| !listed.contains(p)) {
        return Err(EntryError::Unlisted(extra.clone()));
    }
    for (relative, digest) in &meta.files {
        let path = present
            .get(relative)
            .ok_or_else(|| EntryError::Missing(relative.clone()))?;
        let (actual, _) = hash_file(path).map_err(io_at(path))?;
        if &actual != digest {
            return Err(EntryError::Digest(format!("files/{relative}")));
        }
    }
    if super::output_digest(&meta.result_digest, &meta.files) != meta.output_digest {
        return Err(EntryError::OutputDigest);
    }
    Ok(Entry {
        meta,
        files_dir,
        result,
    })
}
