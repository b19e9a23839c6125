//! Whether a GPU library can be opened, asked before cudarc opens it: cudarc panics on a missing
//! library, and a stage should instead say which one it looked for, and where.

/// Opens `stem` (`libcuda`, `libnccl`, …) under the names cudarc tries, or says which library
/// (`what`, e.g. "NCCL") is missing and where it was looked for.
pub fn require(stem: &str, what: &str) -> Result<(), MissingLibrary> {
    let candidates = [
        format!("{stem}.so"),
        format!("{stem}.so.1"),
        format!("{stem}.so.13"),
        format!("{stem}.so.12"),
    ];
    for name in &candidates {
        // SAFETY: opening a system library only runs its initialisers, as cudarc would.
        if unsafe { libloading::Library::new(name) }.is_ok() {
            return Ok(());
        }
    }
    Err(MissingLibrary {
        stem: stem.to_string(),
        what: what.to_string(),
        search_path: std::env::var("LD_LIBRARY_PATH").unwrap_or_default(),
    })
}

/// A GPU library that could not be opened, with where it was looked for.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("this stage needs a GPU, but the {what} library ({stem}.so) could not be loaded from LD_LIBRARY_PATH={search_path} or the system library cache; `attnbench doctor` shows where attnbench looked")]
pub struct MissingLibrary {
    pub stem: String,
    pub what: String,
    pub search_path: String,
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_missing_library_is_named_with_where_it_was_looked_for() {
        let err = super::require("libattnbench-no-such-library", "Nothing")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("Nothing library (libattnbench-no-such-library.so)"),
            "{err}"
        );
        assert!(err.contains("LD_LIBRARY_PATH="), "{err}");
    }
}
