//! The latest report of each pipeline at a path a person can bookmark:
//! `<cache>/reports/<pipeline>/report.html`. `reports/<pipeline>` is a symbolic link to the report
//! node's artifact folder (the page and the files beside it), replaced by renaming a new link over
//! it: a reader opens the previous report or the new one, never a mixture.

use std::path::{Path, PathBuf};

/// Points `<cache>/reports/<pipeline>` (then `<pipeline>-2`, … for a pipeline's further report
/// nodes) at each report's folder and returns the stable path of each page, or for a report it
/// could not publish, why not beside the page's path in the cache.
pub fn publish(
    cache_root: &Path,
    pipeline: &str,
    pages: &[PathBuf],
) -> Vec<Result<PathBuf, String>> {
    let folder = cache_root.join("reports");
    pages
        .iter()
        .enumerate()
        .map(|(index, page)| {
            let name = match index {
                0 => file_name(pipeline),
                n => format!("{}-{}", file_name(pipeline), n + 1),
            };
            link(&folder, &name, page).map_err(|err| {
                format!(
                    "{} (not published at {}: {err})",
                    page.display(),
                    folder.join(&name).display()
                )
            })
        })
        .collect()
}

fn link(folder: &Path, name: &str, page: &Path) -> std::io::Result<PathBuf> {
    let (Some(artifact), Some(file)) = (page.parent(), page.file_name()) else {
        return Err(std::io::Error::other("the report has no folder"));
    };
    std::fs::create_dir_all(folder)?;
    // Relative when the artifact lives in the cache, so that a cache moved whole keeps its links.
    let target = match (
        artifact.strip_prefix(folder.parent().unwrap_or(folder)),
        artifact.is_absolute(),
    ) {
        (Ok(inside), _) => Path::new("..").join(inside),
        (Err(_), true) => artifact.to_path_buf(),
        (Err(_), false) => std::env::current_dir()?.join(artifact),
    };
    let staged = folder.join(format!(".{name}.{}.new", std::process::id()));
    let _ = std::fs::remove_file(&staged);
    std::os::unix::fs::symlink(&target, &staged)?;
    std::fs::rename(&staged, folder.join(name)).inspect_err(|_| {
        let _ = std::fs::remove_file(&staged);
    })?;
    Ok(folder.join(name).join(file))
}

/// A pipeline name as one path component.
fn file_name(pipeline: &str) -> String {
    let name = attnbench_sdk::file_name_part(pipeline, "-_.");
    if name.is_empty() || name.starts_with('.') {
        format!("pipeline{name}")
    } else {
        name
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_publication_replaces_the_first_and_names_stay_one_component() {
        let cache = tempfile::tempdir().unwrap();
        let artifact = |key: &str| {
            let dir = cache.path().join("cache").join(key).join("files");
            std::fs::create_dir_all(&dir).unwrap();
            std::fs::write(dir.join("report.html"), key).unwrap();
            dir.join("report.html")
        };
        let (old, new) = (artifact("aa"), artifact("bb"));
        let first = publish(cache.path(), "dense/kernels", &[old]);
        let stable = first[0].as_ref().unwrap().clone();
        assert_eq!(
            stable,
            cache.path().join("reports/dense_kernels/report.html")
        );
        assert_eq!(std::fs::read_to_string(&stable).unwrap(), "aa");
        publish(cache.path(), "dense/kernels", &[new]);
        assert_eq!(std::fs::read_to_string(&stable).unwrap(), "bb");
        let target = std::fs::read_link(cache.path().join("reports/dense_kernels")).unwrap();
        assert!(target.is_relative(), "{target:?}");
        assert_eq!(file_name(".."), "pipeline..");
    }
}
