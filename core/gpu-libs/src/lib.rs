//! Finding the CUDA libraries without the user's help, and giving GPU workers one consistent set.
//!
//! cudarc opens libraries by their plain names (`libcublas.so`, then a few versioned ones; never
//! `libnccl.so.2`). So the host looks in the usual places — `CUDA_HOME`, `/usr/local/cuda`, the
//! driver's folders, the `nvidia/*/lib` folders of the Python environment, `LD_LIBRARY_PATH` —
//! links the first match of each library under its plain name into one folder, and starts workers
//! with that folder first on `LD_LIBRARY_PATH`.

use std::path::{Path, PathBuf};

use serde::Serialize;

/// The libraries attnbench's GPU plugins may open: (what, file name stem).
pub const LIBRARIES: [(&str, &str); 8] = [
    ("driver", "libcuda"),
    ("NVRTC", "libnvrtc"),
    ("cuBLAS", "libcublas"),
    ("cuBLASLt", "libcublasLt"),
    ("cuDNN", "libcudnn"),
    ("NCCL", "libnccl"),
    ("NVML", "libnvidia-ml"),
    ("CUDA runtime", "libcudart"),
];

#[derive(Debug, Clone, Serialize)]
pub struct Found {
    pub library: String,
    pub path: PathBuf,
    /// From the file name (`libcublas.so.13.0.2` → `13.0.2`), where it carries one.
    pub version: Option<String>,
}

#[derive(Debug, Clone, Serialize)]
pub struct Discovery {
    /// Folders searched, in order.
    pub searched: Vec<PathBuf>,
    pub found: Vec<Found>,
    /// Libraries not found anywhere.
    pub missing: Vec<String>,
}

/// The folders to search, most specific first.
pub fn search_dirs() -> Vec<PathBuf> {
    let mut dirs = Vec::new();
    for var in ["CUDA_HOME", "CUDA_PATH"] {
        if let Some(home) = std::env::var_os(var) {
            let home = PathBuf::from(home);
            dirs.extend([
                home.join("lib64"),
                home.join("targets/x86_64-linux/lib"),
                home.join("lib"),
            ]);
        }
    }
    dirs.extend(
        [
            "/usr/local/cuda/lib64",
            "/usr/local/cuda/targets/x86_64-linux/lib",
            "/usr/local/nvidia/lib64",
            "/usr/local/nvidia/lib",
        ]
        .iter()
        .map(PathBuf::from),
    );
    dirs.extend(python_nvidia_dirs());
    if let Some(paths) = std::env::var_os("LD_LIBRARY_PATH") {
        dirs.extend(std::env::split_paths(&paths));
    }
    dirs.extend(
        ["/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/lib"]
            .iter()
            .map(PathBuf::from),
    );
    let mut unique = Vec::new();
    for dir in dirs {
        if dir.is_dir() && !unique.contains(&dir) {
            unique.push(dir);
        }
    }
    unique
}

/// `site-packages/nvidia/*/lib` of the Python environment in use (`ATTNBENCH_PYTHON`, an active
/// virtual environment, or `python3`).
fn python_nvidia_dirs() -> Vec<PathBuf> {
    let mut roots: Vec<PathBuf> = Vec::new();
    if let Some(venv) = std::env::var_os("VIRTUAL_ENV") {
        roots.extend(glob_dirs(&PathBuf::from(venv).join("lib"), "python3"));
    }
    let python = std::env::var("ATTNBENCH_PYTHON").unwrap_or_else(|_| "python3".into());
    if let Ok(output) = std::process::Command::new(python)
        .args([
            "-c",
            "import sysconfig; print(sysconfig.get_paths()['purelib'])",
        ])
        .stderr(std::process::Stdio::null())
        .output()
    {
        let purelib = String::from_utf8_lossy(&output.stdout).trim().to_string();
        if !purelib.is_empty() {
            roots.push(
                PathBuf::from(purelib)
                    .parent()
                    .map(Path::to_path_buf)
                    .unwrap_or_default(),
            );
        }
    }
    let mut dirs = Vec::new();
    for root in roots {
        let nvidia = if root.ends_with("site-packages") {
            root.join("nvidia")
        } else {
            root.join("site-packages/nvidia")
        };
        for package in glob_dirs(&nvidia, "") {
            dirs.push(package.join("lib"));
        }
    }
    dirs
}

fn glob_dirs(dir: &Path, prefix: &str) -> Vec<PathBuf> {
    let mut found: Vec<PathBuf> = std::fs::read_dir(dir)
        .map(|entries| {
            entries
                .flatten()
                .map(|e| e.path())
                .filter(|p| {
                    p.is_dir()
                        && p.file_name()
                            .is_some_and(|n| n.to_string_lossy().starts_with(prefix))
                })
                .collect()
        })
        .unwrap_or_default();
    found.sort();
    found
}

/// Looks for every library in `dirs`.
pub fn discover_in(dirs: &[PathBuf]) -> Discovery {
    let mut found = Vec::new();
    let mut missing = Vec::new();
    for (library, stem) in LIBRARIES {
        let prefix = format!("{stem}.so");
        let hit = dirs.iter().find_map(|dir| {
            let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
                .ok()?
                .flatten()
                .map(|e| e.path())
                .filter(|p| {
                    p.file_name()
                        .is_some_and(|n| n.to_string_lossy().starts_with(&prefix))
                })
                .collect();
            // The most specific name: the real file rather than a symlink to it.
            files.sort_by_key(|p| std::cmp::Reverse(p.to_string_lossy().len()));
            files.into_iter().next()
        });
        match hit {
            Some(path) => {
                let name = path
                    .file_name()
                    .map(|n| n.to_string_lossy().into_owned())
                    .unwrap_or_default();
                let version = name
                    .strip_prefix(&prefix)
                    .and_then(|v| v.strip_prefix('.'))
                    .filter(|v| !v.is_empty())
                    .map(String::from);
                found.push(Found {
                    library: library.to_string(),
                    path,
                    version,
                });
            }
            None => missing.push(library.to_string()),
        }
    }
    Discovery {
        searched: dirs.to_vec(),
        found,
        missing,
    }
}

pub fn discover() -> Discovery {
    discover_in(&search_dirs())
}

impl Discovery {
    /// Links every found library under its plain name (`libcublas.so`) into `dir`, so that
    /// cudarc finds one consistent set there.
    pub fn link_into(&self, dir: &Path) -> std::io::Result<()> {
        std::fs::create_dir_all(dir)?;
        for found in &self.found {
            let stem = LIBRARIES
                .iter()
                .find(|(library, _)| *library == found.library)
                .map(|(_, stem)| *stem)
                .unwrap_or_default();
            let link = dir.join(format!("{stem}.so"));
            let _ = std::fs::remove_file(&link);
            std::os::unix::fs::symlink(&found.path, &link)?;
        }
        Ok(())
    }

    /// The environment for GPU workers: `LD_LIBRARY_PATH` with the linked folder first.
    pub fn worker_env(&self, linked: &Path) -> Vec<(String, String)> {
        let mut paths = vec![linked.to_path_buf()];
        for found in &self.found {
            if let Some(parent) = found.path.parent() {
                if !paths.iter().any(|p| p == parent) {
                    paths.push(parent.to_path_buf());
                }
            }
        }
        if let Some(existing) = std::env::var_os("LD_LIBRARY_PATH") {
            paths.extend(std::env::split_paths(&existing));
        }
        let joined = std::env::join_paths(paths)
            .map(|p| p.to_string_lossy().into_owned())
            .unwrap_or_default();
        vec![("LD_LIBRARY_PATH".into(), joined)]
    }
}

/// The environment GPU workers start with: the discovered libraries linked into `link_dir`, or
/// nothing when no CUDA library is on this machine.
pub fn worker_env(link_dir: &Path) -> Vec<(String, String)> {
    discover().linked_worker_env(link_dir)
}

impl Discovery {
    /// [`worker_env`] from this discovery: its libraries linked into `link_dir`, or nothing when
    /// it found none.
    pub fn linked_worker_env(&self, link_dir: &Path) -> Vec<(String, String)> {
        if self.found.is_empty() {
            return Vec::new();
        }
        match self.link_into(link_dir) {
            Ok(()) => self.worker_env(link_dir),
            Err(err) => {
                tracing::warn!(
                    "cannot link the CUDA libraries into {}: {err}",
                    link_dir.display()
                );
                Vec::new()
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_libraries_by_stem_and_reads_versions_from_names() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("libcublas.so.13.0.2"), b"").unwrap();
        std::fs::write(dir.path().join("libnccl.so.2"), b"").unwrap();
        let discovery = discover_in(&[dir.path().to_path_buf()]);
        let cublas = discovery
            .found
            .iter()
            .find(|f| f.library == "cuBLAS")
            .unwrap();
        assert_eq!(cublas.version.as_deref(), Some("13.0.2"));
        assert!(discovery.missing.contains(&"driver".to_string()));
        let linked = dir.path().join("linked");
        discovery.link_into(&linked).unwrap();
        assert!(
            linked.join("libnccl.so").exists(),
            "NCCL under the plain name cudarc opens"
        );
        let env = discovery.worker_env(&linked);
        assert!(env[0].1.starts_with(&linked.display().to_string()));
    }
}
