use std::os::unix::fs::PermissionsExt;

use super::*;

/// A file that is no shared library at all: loading it in this process could only fail, so a
/// manifest that comes back was not learnt by loading it here.
fn fake_library(dir: &Path) -> PathBuf {
    let path = dir.join("libfake.so");
    std::fs::write(&path, b"not an ELF file").unwrap();
    path
}

/// A stand-in for the attnbench binary as manifest reader: runs `body` as a shell script.
fn reader(dir: &Path, body: &str) -> PathBuf {
    let path = dir.join("reader");
    std::fs::write(&path, format!("#!/bin/sh\n{body}\n")).unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
    path
}

fn settings(dir: &Path, reader: Option<PathBuf>) -> Settings {
    Settings {
        dir: Some(dir.join("manifests")),
        reader,
        timeout: Duration::from_secs(20),
    }
}

const ANSWER: &str = r#"{"plugin":{"abi":"1.1.0","manifest":"{\"name\":\"fake\"}"}}"#;

#[test]
fn an_entry_is_used_only_for_the_hash_it_was_written_for() {
    let scratch = tempfile::tempdir().unwrap();
    let dir = scratch.path().join("manifests");
    let found = Found::Plugin {
        abi: "1.1.0".into(),
        manifest: "{}".into(),
    };
    write_entry(&dir, "aa11", &found);
    assert_eq!(read_entry(&dir, "aa11"), Some(found.clone()));
    assert_eq!(read_entry(&dir, "bb22"), None);

    std::fs::copy(entry_path(&dir, "aa11"), entry_path(&dir, "cc33")).unwrap();
    assert_eq!(
        read_entry(&dir, "cc33"),
        None,
        "a renamed entry is not trusted"
    );
    std::fs::write(entry_path(&dir, "aa11"), b"{\"library_ha").unwrap();
    assert_eq!(read_entry(&dir, "aa11"), None, "a torn entry is a miss");
    write_entry(&dir, "aa11", &found);
    assert_eq!(read_entry(&dir, "aa11"), Some(found), "and is rewritten");
    let leftovers: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .flatten()
        .filter(|e| !e.file_name().to_string_lossy().ends_with(".json"))
        .collect();
    assert!(
        leftovers.is_empty(),
        "no temporary files left: {leftovers:?}"
    );
}

#[test]
fn a_cached_manifest_is_known_without_loading_the_library() {
    let scratch = tempfile::tempdir().unwrap();
    let library = fake_library(scratch.path());
    let settings = settings(scratch.path(), None);
    write_entry(
        settings.dir.as_deref().unwrap(),
        "feed",
        &Found::Plugin {
            abi: "1.1.0".into(),
            manifest: "{\"name\":\"fake\"}".into(),
        },
    );
    let known = settings.manifest_of(&library, "feed").unwrap();
    assert_eq!(known.manifest, "{\"name\":\"fake\"}");
    assert!(known.module.is_none());
}

#[test]
fn a_miss_is_read_by_the_helper_once_then_cached() {
    let scratch = tempfile::tempdir().unwrap();
    let library = fake_library(scratch.path());
    let calls = scratch.path().join("calls");
    let reader = reader(
        scratch.path(),
        &format!(
            "[ \"$1 $2 $3 $4\" = \"worker --plugin {} --manifest\" ] || exit 3\necho called >> {}\necho 'initialiser chatter'\necho '{ANSWER}'",
            library.display(),
            calls.display()
        ),
    );
    let settings = settings(scratch.path(), Some(reader));
    for _ in 0..2 {
        let known = settings.manifest_of(&library, "beef").unwrap();
        assert_eq!(known.manifest, "{\"name\":\"fake\"}");
    }
    assert_eq!(std::fs::read_to_string(&calls).unwrap(), "called\n");
    // Other bytes, another key: read afresh.
    settings.manifest_of(&library, "f00d").unwrap();
    assert_eq!(std::fs::read_to_string(&calls).unwrap(), "called\ncalled\n");
}

#[test]
fn a_refusal_that_follows_from_the_bytes_is_cached_one_that_may_pass_later_is_not() {
    let scratch = tempfile::tempdir().unwrap();
    let library = fake_library(scratch.path());
    let calls = scratch.path().join("calls");
    let answer = scratch.path().join("answer");
    let reader = reader(
        scratch.path(),
        &format!(
            "echo called >> {}\ncat {}",
            calls.display(),
            answer.display()
        ),
    );
    let settings = settings(scratch.path(), Some(reader));
    std::fs::write(
        &answer,
        r#"{"refused":{"open":{"reason":"libcuda.so.1: cannot open shared object file"}}}"#,
    )
    .unwrap();
    for _ in 0..2 {
        let err = settings.manifest_of(&library, "0001").err().unwrap();
        assert!(
            err.to_string()
                .starts_with(&format!("cannot load {}: libcuda.so.1", library.display())),
            "{err}"
        );
    }
    std::fs::write(&answer, r#"{"refused":{"other_major":{"found":"2.0.0"}}}"#).unwrap();
    for _ in 0..2 {
        let err = settings.manifest_of(&library, "0002").err().unwrap();
        assert!(
            err.to_string().contains("built for plugin ABI 2.0.0"),
            "{err}"
        );
    }
    let calls = std::fs::read_to_string(&calls).unwrap();
    assert_eq!(
        calls.lines().count(),
        3,
        "open errors are asked again, ABI refusals not"
    );
}

#[test]
fn a_helper_that_crashes_is_one_line_naming_the_library_and_what_to_do() {
    let scratch = tempfile::tempdir().unwrap();
    let library = fake_library(scratch.path());
    let reader = reader(
        scratch.path(),
        "echo 'plugin says: bad things' >&2\nkill -SEGV $$",
    );
    let settings = settings(scratch.path(), Some(reader));
    let err = settings
        .manifest_of(&library, "dead")
        .err()
        .unwrap()
        .to_string();
    assert_eq!(err.lines().count(), 1, "{err}");
    for fragment in [
        library.display().to_string().as_str(),
        "SIGSEGV",
        "plugin says: bad things",
        "take it off the plugin path",
    ] {
        assert!(err.contains(fragment), "`{fragment}` in {err}");
    }
    assert_eq!(read_entry(settings.dir.as_deref().unwrap(), "dead"), None);
}

#[test]
fn a_helper_that_hangs_is_stopped() {
    let scratch = tempfile::tempdir().unwrap();
    let library = fake_library(scratch.path());
    let reader = reader(scratch.path(), "exec sleep 30");
    let mut settings = settings(scratch.path(), Some(reader));
    settings.timeout = Duration::from_millis(300);
    let started = std::time::Instant::now();
    let err = settings
        .manifest_of(&library, "0bad")
        .err()
        .unwrap()
        .to_string();
    assert!(started.elapsed() < Duration::from_secs(10));
    assert!(err.contains("did not finish within"), "{err}");
}

#[test]
fn a_missing_reader_is_reported_not_a_panic() {
    let scratch = tempfile::tempdir().unwrap();
    let library = fake_library(scratch.path());
    let settings = settings(scratch.path(), Some(scratch.path().join("no-such-binary")));
    let err = settings
        .manifest_of(&library, "0abc")
        .err()
        .unwrap()
        .to_string();
    assert!(
        err.contains("cannot start") && err.contains("libfake.so"),
        "{err}"
    );
}

#[test]
fn a_library_rebuilt_after_its_manifest_was_read_is_not_run_under_the_old_hash() {
    let scratch = tempfile::tempdir().unwrap();
    let library = fake_library(scratch.path());
    let plugin = Plugin {
        path: library.clone(),
        library_hash: "the hash of an earlier build".into(),
        manifest: attnbench_sdk::PluginManifest::new("fake", "0.1.0"),
        module: OnceLock::new(),
    };
    let err = plugin
        .run("stage", "{}", &crate::host::services::Silent)
        .unwrap_err();
    assert!(
        err.message
            .contains("libfake.so changed since attnbench read its manifest"),
        "{err}"
    );
}
