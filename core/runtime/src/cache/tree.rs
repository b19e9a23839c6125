//! Reading and copying entry and run folders without trusting them: only regular files and
//! folders with plain names are accepted, links are never followed, and content is hashed as a
//! stream so that no artifact is ever held in memory whole.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::Read;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

/// Why a name is refused as one path component.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum BadName {
    #[error("an empty name")]
    Empty,
    #[error("a name containing `..`")]
    DotDot,
    #[error("a name containing a path separator")]
    Separator,
    #[error("a name containing control characters")]
    Control,
}

/// Why a file or folder of an entry or run is refused, or could not be read or copied.
#[derive(Debug, thiserror::Error)]
pub enum TreeError {
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{}: the name is not UTF-8", path.display())]
    NotUtf8 { path: PathBuf },
    #[error("{}: {why}", path.display())]
    Name { path: PathBuf, why: BadName },
    #[error("{}: a symbolic link; only regular files and folders are accepted", path.display())]
    Link { path: PathBuf },
    #[error("{}: a device, FIFO or socket; only regular files and folders are accepted", path.display())]
    Special { path: PathBuf },
    /// A relative path read from metadata that is absolute or has a bad component.
    #[error("`{path}` {why}")]
    Relative { path: String, why: String },
}

pub(crate) fn io_at(path: &Path) -> impl FnOnce(std::io::Error) -> TreeError + '_ {
    move |source| TreeError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// Why a name is refused, or `None` for a name that is safe as one path component anywhere.
/// `..` anywhere is refused (not only as a whole component) so that no name can read as a step
/// up after being joined, split or displayed.
pub fn bad_name(name: &str) -> Option<BadName> {
    if name.is_empty() || name == "." {
        Some(BadName::Empty)
    } else if name.contains("..") {
        Some(BadName::DotDot)
    } else if name.contains('/') || name.contains('\\') {
        Some(BadName::Separator)
    } else if name.chars().any(char::is_control) {
        Some(BadName::Control)
    } else {
        None
    }
}

/// Checks a relative path (components joined by `/`) read from metadata.
pub fn check_relative(path: &str) -> Result<(), TreeError> {
    let refuse = |why: String| TreeError::Relative {
        path: path.to_string(),
        why,
    };
    if path.starts_with('/') {
        return Err(refuse(
            "is an absolute path; only relative paths are allowed".into(),
        ));
    }
    match path.split('/').find_map(bad_name) {
        Some(why) => Err(refuse(format!("has {why}"))),
        None => Ok(()),
    }
}

/// `path`'s last component, when it is a plain UTF-8 name (see [`bad_name`]).
pub fn plain_name(path: &Path) -> Result<String, TreeError> {
    let name = path
        .file_name()
        .and_then(|n| n.to_str())
        .ok_or_else(|| TreeError::NotUtf8 {
            path: path.to_path_buf(),
        })?;
    match bad_name(name) {
        Some(why) => Err(TreeError::Name {
            path: path.to_path_buf(),
            why,
        }),
        None => Ok(name.to_string()),
    }
}

/// What kind of thing `path` is, without following a link; anything but a regular file or a
/// folder is an error naming it.
pub fn kind(path: &Path) -> Result<Kind, TreeError> {
    let meta = std::fs::symlink_metadata(path).map_err(io_at(path))?;
    let file_type = meta.file_type();
    let path = path.to_path_buf();
    if file_type.is_dir() {
        Ok(Kind::Dir)
    } else if file_type.is_file() {
        Ok(Kind::File)
    } else if file_type.is_symlink() {
        Err(TreeError::Link { path })
    } else {
        Err(TreeError::Special { path })
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    File,
    Dir,
}

/// The regular files under `dir`, by path relative to it (`/`-separated), refusing links,
/// special files and odd names.
pub fn regular_files(dir: &Path) -> Result<BTreeMap<String, PathBuf>, TreeError> {
    let mut files = BTreeMap::new();
    collect(dir, "", &mut files)?;
    Ok(files)
}

fn collect(
    dir: &Path,
    prefix: &str,
    files: &mut BTreeMap<String, PathBuf>,
) -> Result<(), TreeError> {
    for path in read_dir(dir)? {
        let name = plain_name(&path)?;
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
pub fn copy_tree(from: &Path, to: &Path) -> Result<(), TreeError> {
    std::fs::create_dir_all(to).map_err(io_at(to))?;
    for path in read_dir(from)? {
        let target = to.join(plain_name(&path)?);
        match kind(&path)? {
            Kind::Dir => copy_tree(&path, &target)?,
            Kind::File => copy_file(&path, &target)?,
        }
    }
    Ok(())
}

fn copy_file(from: &Path, to: &Path) -> Result<(), TreeError> {
    let mut source = open_regular(from).map_err(io_at(from))?;
    let mut target = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(to)
        .map_err(io_at(to))?;
    std::io::copy(&mut source, &mut target).map_err(io_at(from))?;
    Ok(())
}

/// The paths in `dir`, sorted.
pub fn read_dir(dir: &Path) -> Result<Vec<PathBuf>, TreeError> {
    let mut paths = Vec::new();
    for item in std::fs::read_dir(dir).map_err(io_at(dir))? {
        paths.push(item.map_err(io_at(dir))?.path());
    }
    paths.sort();
    Ok(paths)
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
        assert!(matches!(err, TreeError::Link { .. }), "{err}");
        assert!(copy_tree(dir.path(), &dir.path().join("copy")).is_err());
        assert!(check_relative("../x").is_err());
        assert!(check_relative("/etc/passwd").is_err());
        assert!(check_relative("a/b.json").is_ok());
        assert!(!is_key("../../etc"));
    }
}
