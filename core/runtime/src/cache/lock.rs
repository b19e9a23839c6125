//! Per-key locks and the atomic swap that replaces an entry under one.

use std::fs::File;
use std::path::Path;

/// Swaps two paths in one step (Linux `renameat2(RENAME_EXCHANGE)`).
#[cfg(target_os = "linux")]
pub(super) fn exchange(a: &Path, b: &Path) -> std::io::Result<()> {
    use std::os::unix::ffi::OsStrExt;
    let a = std::ffi::CString::new(a.as_os_str().as_bytes()).map_err(std::io::Error::other)?;
    let b = std::ffi::CString::new(b.as_os_str().as_bytes()).map_err(std::io::Error::other)?;
    // SAFETY: both are valid NUL-terminated paths; AT_FDCWD resolves them as rename(2) would.
    let rc = unsafe {
        libc::renameat2(
            libc::AT_FDCWD,
            a.as_ptr(),
            libc::AT_FDCWD,
            b.as_ptr(),
            libc::RENAME_EXCHANGE,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

#[cfg(not(target_os = "linux"))]
pub(super) fn exchange(_: &Path, _: &Path) -> std::io::Result<()> {
    Err(std::io::Error::from(std::io::ErrorKind::Unsupported))
}

thread_local! {
    /// Keys whose locks this thread holds: a lookup under its own key lock must not wait for it.
    static HELD_KEYS: std::cell::RefCell<Vec<String>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// A key's lock; it lasts as long as this value, which stays on the thread that took it.
pub struct KeyLock {
    _file: File,
    key: String,
    _not_send: std::marker::PhantomData<*const ()>,
}

impl KeyLock {
    /// Wraps the locked `file` of `key`, noting that this thread holds it.
    pub(super) fn new(file: File, key: &str) -> KeyLock {
        HELD_KEYS.with(|held| held.borrow_mut().push(key.to_string()));
        KeyLock {
            _file: file,
            key: key.to_string(),
            _not_send: std::marker::PhantomData,
        }
    }

    pub(super) fn held_here(key: &str) -> bool {
        HELD_KEYS.with(|held| held.borrow().iter().any(|k| k == key))
    }
}

impl Drop for KeyLock {
    fn drop(&mut self) {
        HELD_KEYS.with(|held| {
            let mut held = held.borrow_mut();
            if let Some(at) = held.iter().position(|k| *k == self.key) {
                held.swap_remove(at);
            }
        });
    }
}
