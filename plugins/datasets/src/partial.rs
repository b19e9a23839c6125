//! Where unfinished downloads live: a folder only this user can enter, inside the downloads
//! folder, whose files are opened without following links. The downloads folder may be shared
//! (a cluster's cache); a predictable name there is a place for someone else's symlink, and a
//! download written through it would overwrite whatever the link points at.

use std::fs::{DirBuilder, File, OpenOptions, TryLockError};
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::time::Duration;

/// The private folder's name inside the downloads folder.
pub const FOLDER: &str = ".partial";

/// Why the private folder or one of its files is refused.
#[derive(Debug, thiserror::Error)]
pub enum PartialError {
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{} is a symbolic link; the folder for partial downloads must be a real directory of yours (remove the link)", .0.display())]
    FolderLink(PathBuf),
    #[error("{} is not a directory; it is where partial downloads go (remove it)", .0.display())]
    NotAFolder(PathBuf),
    #[error("{} is open to other users (mode {mode:04o}); partial downloads need a folder only you can use (chmod 700 {})", path.display(), path.display())]
    OpenToOthers { path: PathBuf, mode: u32 },
    #[error("{} is a symbolic link; refusing to write a download through it (remove the link)", .0.display())]
    FileLink(PathBuf),
    #[error("{} is not a regular file; refusing to write a download into it (remove it)", .0.display())]
    NotAFile(PathBuf),
    #[error("{} has {links} hard links; refusing to write a download into a file reachable from elsewhere (remove it)", path.display())]
    HardLinks { path: PathBuf, links: u64 },
    #[error("{} belongs to user {owner}, not to the user downloading ({me}); remove it", path.display())]
    Owner { path: PathBuf, owner: u32, me: u32 },
}

fn io_at(path: &Path) -> impl FnOnce(std::io::Error) -> PartialError + '_ {
    move |source| PartialError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// Creates (0700) or checks the private folder under `downloads` and returns its path.
pub fn private_folder(downloads: &Path) -> Result<PathBuf, PartialError> {
    let dir = downloads.join(FOLDER);
    if let Err(err) = DirBuilder::new().mode(0o700).create(&dir) {
        if err.kind() != std::io::ErrorKind::AlreadyExists {
            return Err(io_at(&dir)(err));
        }
    }
    let meta = std::fs::symlink_metadata(&dir).map_err(io_at(&dir))?;
    if meta.file_type().is_symlink() {
        return Err(PartialError::FolderLink(dir));
    }
    if !meta.is_dir() {
        return Err(PartialError::NotAFolder(dir));
    }
    check_owner(&dir, &meta)?;
    let mode = meta.mode() & 0o7777;
    if mode & 0o077 != 0 {
        return Err(PartialError::OpenToOthers { path: dir, mode });
    }
    Ok(dir)
}

/// Opens (creating, 0600) a regular file of the private folder for reading and writing, refusing
/// a symbolic link or a file with other names, and keeping what it holds.
pub fn open(path: &Path) -> Result<File, PartialError> {
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(path)
        .map_err(|err| {
            if err.raw_os_error() == Some(libc::ELOOP) {
                PartialError::FileLink(path.to_path_buf())
            } else {
                io_at(path)(err)
            }
        })?;
    let meta = file.metadata().map_err(io_at(path))?;
    if !meta.is_file() {
        return Err(PartialError::NotAFile(path.to_path_buf()));
    }
    // A second name is another way to reach a file outside the folder.
    if meta.nlink() > 1 {
        return Err(PartialError::HardLinks {
            path: path.to_path_buf(),
            links: meta.nlink(),
        });
    }
    check_owner(path, &meta)?;
    Ok(file)
}

/// Takes the exclusive lock on `file`, waiting while another process holds it; false when
/// `cancelled` turned true first.
pub fn lock(
    file: &File,
    path: &Path,
    poll: Duration,
    cancelled: impl Fn() -> bool,
) -> Result<bool, PartialError> {
    loop {
        match file.try_lock() {
            Ok(()) => return Ok(true),
            Err(TryLockError::WouldBlock) if cancelled() => return Ok(false),
            Err(TryLockError::WouldBlock) => std::thread::sleep(poll),
            Err(TryLockError::Error(err)) => return Err(io_at(path)(err)),
        }
    }
}

fn check_owner(path: &Path, meta: &std::fs::Metadata) -> Result<(), PartialError> {
    // SAFETY: geteuid has no preconditions and cannot fail.
    let me = unsafe { libc::geteuid() };
    if meta.uid() != me {
        return Err(PartialError::Owner {
            path: path.to_path_buf(),
            owner: meta.uid(),
            me,
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn the_folder_is_made_private_and_links_are_refused() {
        let root = tempfile_dir();
        let dir = private_folder(&root).unwrap();
        let mode = std::fs::metadata(&dir).unwrap().mode() & 0o777;
        assert_eq!(mode & 0o077, 0, "{mode:o}");
        let victim = root.join("victim");
        std::fs::write(&victim, "precious").unwrap();
        let link = dir.join("shard");
        std::os::unix::fs::symlink(&victim, &link).unwrap();
        let err = open(&link).unwrap_err();
        assert!(matches!(err, PartialError::FileLink(_)), "{err}");
        std::fs::remove_file(&link).unwrap();
        std::fs::hard_link(&victim, &link).unwrap();
        let err = open(&link).unwrap_err();
        assert!(
            matches!(err, PartialError::HardLinks { links: 2, .. }),
            "{err}"
        );
        assert_eq!(std::fs::read_to_string(&victim).unwrap(), "precious");
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
        let err = private_folder(&root).unwrap_err().to_string();
        assert!(
            err.contains("mode 0755") && err.contains("chmod 700"),
            "{err}"
        );
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn waiting_for_a_held_lock_ends_when_cancelled() {
        let root = tempfile_dir();
        let dir = private_folder(&root).unwrap();
        let path = dir.join("shard.lock");
        let holder = open(&path).unwrap();
        holder.lock().unwrap();
        let waiter = File::open(&path).unwrap();
        let asked = std::cell::Cell::new(0);
        let got = lock(&waiter, &path, Duration::from_millis(1), || {
            asked.set(asked.get() + 1);
            asked.get() > 3
        });
        assert!(matches!(got, Ok(false)));
        drop(holder);
        assert!(matches!(
            lock(&waiter, &path, Duration::from_millis(1), || true),
            Ok(true)
        ));
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn a_linked_folder_is_refused() {
        let root = tempfile_dir();
        let elsewhere = root.join("elsewhere");
        std::fs::create_dir(&elsewhere).unwrap();
        std::os::unix::fs::symlink(&elsewhere, root.join(FOLDER)).unwrap();
        let err = private_folder(&root).unwrap_err();
        assert!(matches!(err, PartialError::FolderLink(_)), "{err}");
        std::fs::remove_dir_all(&root).unwrap();
    }

    fn tempfile_dir() -> PathBuf {
        let dir = std::env::temp_dir().join(format!(
            "attnbench-partial-{}-{:?}",
            std::process::id(),
            std::thread::current().id()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }
}
