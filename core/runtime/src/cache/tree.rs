//! Reading and copying entry and run folders without trusting them: only regular files and
//! folders with plain names are accepted, links are never followed, and content is hashed as a
//! stream so that no artifact is ever held in memory whole.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::Read;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

/// Why a name is refused, or `None` for a name that is safe as one path component anywhere.
/// `..` anywhere is refused (not only as a whole component) so that no name can read as a step
/// up after being joined, split or displayed.
pub fn bad_name(name: &str) -> Option<&'static str> {
    if name.is_empty() || name == "." {
        Some("an empty name")
    } else if name.contains("..") {
        Some("a name containing `..`")
    } else if name.contains('/') || name.contains('\\') {
        Some("a name containing a path separator")
    } else if name.chars().any(char::is_control) {
        Some("a name containing control characters")
    } else {
        None
    }
}

/// Checks a relative path (components joined by `/`) read from metadata.
pub fn check_relative(path: &str) -> Result<(), String> {
    if path.starts_with('/') {
        return Err(format!(
            "`{path}` is an absolute path; only relative paths are allowed"
        ));
    }
    for part in path.split('/') {
        if let Some(why) = bad_name(part) {
            return Err(format!("`{path}` has {why}"));
        }
    }
    Ok(())
}

fn utf8_name(path: &Path) -> Result<String, String> {
    let name = path
        .file_name()
        .ok_or_else(|| format!("{}: no file name", path.display()))?;
    let name = name
        .to_str()
        .ok_or_else(|| format!("{}: the name is not UTF-8", path.display()))?;
    if let Some(why) = bad_name(name) {
        return Err(format!("{}: {why}", path.display()));
    }
    Ok(name.to_string())
}

/// What kind of thing `path` is, without following a link; anything but a regular file or a
/// folder is an error naming it.
pub fn kind(path: &Path) -> Result<Kind, String> {
    let meta =
        std::fs::symlink_metadata(path).map_err(|err| format!("{}: {err}", path.display()))?;
    let file_type = meta.file_type();
    if file_type.is_dir() {
        Ok(Kind::Dir)
    } else if file_type.is_file() {
        Ok(Kind::File)
    } else if file_type.is_symlink() {
        Err(format!(
            "{}: a symbolic link; only regular files and folders are accepted",
            path.display()
        ))
    } else {
        Err(format!(
            "{}: a device, FIFO or socket; only regular files and folders are accepted",
            path.display()
        ))
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    File,
    Dir,
}

/// The regular files under `dir`, by path relative to it (`/`-separated), refusing links,
/// special files and odd names.
pub fn regular_files(dir: &Path) -> Result<BTreeMap<String, PathBuf>, String> {
    let mut files = BTreeMap::new();
    collect(dir, "", &mut files)?;
    Ok(files)
}

fn collect(dir: &Path, prefix: &str, files: &mut BTreeMap<String, PathBuf>) -> Result<(), String> {
    let entries = std::fs::read_dir(dir).map_err(|err| format!("{}: {err}", dir.display()))?;
    for entry in entries {
        let path = entry
            .map_err(|err| format!("{}: {err}", dir.display()))?
            .path();
        let name = utf8_name(&path)?;
        let relative = format!("{prefix}{name}");
        match kind(&path)? {
            Kind::Dir => collect(&path, &format!("{relative}/"), files)?,
            Kind::File => {
                files.insert(relative, path);
            }
        }
    }
    Ok(())
}

/// Opens a regular file for reading; a link in its place is refused by the kernel, not followed.
pub fn open_regular(path: &Path) -> std::io::Result<File> {
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(path)?;
    // O_NONBLOCK keeps a FIFO planted after the check from hanging the open; this refuses it.
    if !file.metadata()?.is_file() {
        return Err(std::io::Error::other("not a regular file"));
    }
    Ok(file)
}

/// blake3 (hex) and length of a file's content, read in fixed-size chunks.
pub fn hash_file(path: &Path) -> std::io::Result<(String, u64)> {
    hash_reader(open_regular(path)?)
}

pub fn hash_reader(reader: impl Read) -> std::io::Result<(String, u64)> {
    let mut hasher = blake3::Hasher::new();
    let mut counted = Counted {
        inner: reader,
        bytes: 0,
    };
    hasher.update_reader(&mut counted)?;
    Ok((hasher.finalize().to_hex().to_string(), counted.bytes))
}

/// A reader that feeds what passes through it to a hasher: a result file is parsed and hashed
/// in one pass.
pub struct Hashing<R> {
    pub inner: R,
    pub hasher: blake3::Hasher,
}

impl<R: Read> Read for Hashing<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let read = self.inner.read(buf)?;
        self.hasher.update(&buf[..read]);
        Ok(read)
    }
}

struct Counted<R> {
    inner: R,
    bytes: u64,
}

impl<R: Read> Read for Counted<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let read = self.inner.read(buf)?;
        self.bytes += read as u64;
        Ok(read)
    }
}

/// Copies the tree `from` into `to` (created), refusing links, special files and odd names, so
/// that a copy can never carry in a file from outside the tree.
pub fn copy_tree(from: &Path, to: &Path) -> Result<(), String> {
    std::fs::create_dir_all(to).map_err(|err| format!("{}: {err}", to.display()))?;
    let entries = std::fs::read_dir(from).map_err(|err| format!("{}: {err}", from.display()))?;
    for entry in entries {
        let path = entry
            .map_err(|err| format!("{}: {err}", from.display()))?
            .path();
        let target = to.join(utf8_name(&path)?);
        match kind(&path)? {
            Kind::Dir => copy_tree(&path, &target)?,
            Kind::File => copy_file(&path, &target)?,
        }
    }
    Ok(())
}

fn copy_file(from: &Path, to: &Path) -> Result<(), String> {
    let mut source = open_regular(from).map_err(|err| format!("{}: {err}", from.display()))?;
    let mut target = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(to)
        .map_err(|err| format!("{}: {err}", to.display()))?;
    std::io::copy(&mut source, &mut target).map_err(|err| format!("{}: {err}", from.display()))?;
    Ok(())
}

/// A cache key: 64 lowercase hex digits. Keys read from records name folders, so anything else
/// must never reach a path.
pub fn is_key(key: &str) -> bool {
    key.len() == 64 && key.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn streaming_hash_matches_the_whole_file_hash() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("data");
        let content: Vec<u8> = (0..300_000u32).map(|i| (i % 251) as u8).collect();
        std::fs::write(&path, &content).unwrap();
        let (digest, bytes) = hash_file(&path).unwrap();
        assert_eq!(digest, blake3::hash(&content).to_hex().to_string());
        assert_eq!(bytes, content.len() as u64);
    }

    #[test]
    fn links_and_odd_names_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("ok.json"), b"{}").unwrap();
        std::os::unix::fs::symlink("/etc/hostname", dir.path().join("link")).unwrap();
        let err = regular_files(dir.path()).unwrap_err();
        assert!(
            err.contains("link") && err.contains("symbolic link"),
            "{err}"
        );
        assert!(copy_tree(dir.path(), &dir.path().join("copy")).is_err());
        assert!(check_relative("../x").is_err());
        assert!(check_relative("/etc/passwd").is_err());
        assert!(check_relative("a/b.json").is_ok());
        assert!(!is_key("../../etc"));
    }
}
