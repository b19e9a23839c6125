//! Carrying a cache to another machine: `cache export` and `cache import` bring runs back
//! whole, refuse links, special files, names that escape and broken records, and bring in all or
//! nothing.

use crate::cache_common::{count, entry_count, run_chain, run_folders, walk_files, CHAIN};
use attnbench_tests::{stderr, stdout, Sandbox};

/// A sweep cut short on one machine resumes on another: `cache export` there, `cache import`
/// here, and the run is served from what was carried over. A tampered entry is refused.
#[test]
fn an_export_carried_to_another_cache_is_reused_and_tampering_is_refused() {
    let first = Sandbox::new();
    let pipeline = first.write("chain.yaml", CHAIN);
    assert!(first
        .run(&["run", pipeline.to_str().unwrap(), "-q"])
        .status
        .success());
    let carried = first.path().join("carried");
    let export = first.run(&["cache", "export", carried.to_str().unwrap()]);
    assert!(export.status.success(), "{}", stderr(&export));
    assert!(
        stdout(&export).contains("exported 5 entries and 1 run records"),
        "{}",
        stdout(&export)
    );

    let second = Sandbox::new();
    let pipeline = second.write("chain.yaml", CHAIN);
    let import = second.run(&["cache", "import", carried.to_str().unwrap()]);
    assert!(import.status.success(), "{}", stderr(&import));
    assert!(
        stdout(&import).contains("imported 5 entries (0 already here) and 1 run records"),
        "{}",
        stdout(&import)
    );
    let imported_run = std::fs::read_dir(second.cache().join("runs"))
        .unwrap()
        .flatten()
        .find(|e| e.path().join("run.json").is_file())
        .expect("the run record came along")
        .path();
    let record: serde_json::Value =
        serde_json::from_slice(&std::fs::read(imported_run.join("run.json")).unwrap()).unwrap();
    for node in record["nodes"].as_array().unwrap() {
        let artifact = node["artifact"].as_str().unwrap();
        assert!(
            std::path::Path::new(artifact).starts_with(second.cache().canonicalize().unwrap()),
            "{artifact} points into this cache"
        );
    }
    assert!(second
        .run(&["run", pipeline.to_str().unwrap(), "-q"])
        .status
        .success());
    assert_eq!(
        count(&second.statuses(), "cached"),
        5,
        "{:?}",
        second.statuses()
    );

    // One entry's file altered after the export: refused, the others still come in.
    let victim = walk_files(&carried.join("cache"))
        .into_iter()
        .find(|p| p.file_name().is_some_and(|n| n == "echo.json"))
        .expect("an entry file");
    std::fs::write(&victim, b"{\"tampered\": true}").unwrap();
    let third = Sandbox::new();
    let import = third.run(&["cache", "import", carried.to_str().unwrap()]);
    assert_eq!(import.status.code(), Some(1), "{}", stdout(&import));
    let text = stdout(&import);
    assert!(
        text.contains("does not match its digest") && text.contains("imported nothing"),
        "{text}"
    );
    assert_eq!(
        entry_count(&third),
        0,
        "a failed import leaves the cache as it was"
    );
    let missing = third.run(&[
        "cache",
        "import",
        third.path().join("nothing").to_str().unwrap(),
    ]);
    assert!(
        !missing.status.success() && stderr(&missing).contains("not a cache or an export"),
        "{}",
        stderr(&missing)
    );
}

/// A finished pipeline, exported: (the sandbox it ran in, the export).
fn exported_chain() -> (Sandbox, std::path::PathBuf) {
    let first = Sandbox::new();
    let pipeline = first.write("chain.yaml", CHAIN);
    assert!(first
        .run(&["run", pipeline.to_str().unwrap(), "-q"])
        .status
        .success());
    let carried = first.path().join("carried");
    let export = first.run(&["cache", "export", carried.to_str().unwrap()]);
    assert!(export.status.success(), "{}", stderr(&export));
    (first, carried)
}

fn exported_run(carried: &std::path::Path) -> std::path::PathBuf {
    std::fs::read_dir(carried.join("runs"))
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .find(|p| p.join("run.json").is_file())
        .expect("the export has a run")
}

/// A link inside an export (here: a run's log pointing at a private file) is refused by name,
/// and nothing of the import enters the cache.
#[test]
fn an_import_refuses_links_and_leaves_the_cache_unchanged() {
    let (first, carried) = exported_chain();
    let secret = first.write("secret.txt", "not for the cache");
    let link = exported_run(&carried).join("logs/stolen.log");
    std::os::unix::fs::symlink(&secret, &link).unwrap();

    let second = Sandbox::new();
    let import = second.run(&["cache", "import", carried.to_str().unwrap()]);
    assert_eq!(import.status.code(), Some(1), "{}", stdout(&import));
    let text = stdout(&import);
    assert!(
        text.contains("stolen.log") && text.contains("symbolic link"),
        "{text}"
    );
    assert_eq!(entry_count(&second), 0);
    assert!(run_folders(&second).is_empty(), "no run record came in");

    // A link in an entry's files, even to identical content, is refused too.
    std::fs::remove_file(&link).unwrap();
    let victim = walk_files(&carried.join("cache"))
        .into_iter()
        .find(|p| p.file_name().is_some_and(|n| n == "echo.json"))
        .unwrap();
    let copy = first.path().join("echo-copy.json");
    std::fs::rename(&victim, &copy).unwrap();
    std::os::unix::fs::symlink(&copy, &victim).unwrap();
    let import = second.run(&["cache", "import", carried.to_str().unwrap()]);
    assert_eq!(import.status.code(), Some(1), "{}", stdout(&import));
    assert!(
        stdout(&import).contains("symbolic link"),
        "{}",
        stdout(&import)
    );
    assert_eq!(entry_count(&second), 0);
}

/// A broken run record is found before anything is copied, not after the entries went in.
#[test]
fn an_import_with_a_broken_run_record_imports_nothing() {
    let (_first, carried) = exported_chain();
    let broken = carried.join("runs/20990101-000000.000-abcdef");
    std::fs::create_dir_all(&broken).unwrap();
    std::fs::write(broken.join("run.json"), "{\"id\": ").unwrap();

    let second = Sandbox::new();
    let import = second.run(&["cache", "import", carried.to_str().unwrap()]);
    assert_eq!(import.status.code(), Some(1), "{}", stdout(&import));
    assert!(
        stdout(&import).contains("20990101-000000.000-abcdef/run.json"),
        "names the record: {}",
        stdout(&import)
    );
    assert_eq!(entry_count(&second), 0);
    assert!(run_folders(&second).is_empty());
}

/// Names from an export's metadata never reach a path: a run record's key that climbs out of
/// the cache, an entry listing a file outside its `files/`.
#[test]
fn an_import_refuses_names_that_escape() {
    let (_first, carried) = exported_chain();
    let run = exported_run(&carried);
    let original = std::fs::read(run.join("run.json")).unwrap();
    let mut record: serde_json::Value = serde_json::from_slice(&original).unwrap();
    record["nodes"][0]["key"] = "../../../../../../etc".into();
    std::fs::write(run.join("run.json"), record.to_string()).unwrap();
    let second = Sandbox::new();
    let import = second.run(&["cache", "import", carried.to_str().unwrap()]);
    assert_eq!(import.status.code(), Some(1), "{}", stdout(&import));
    assert!(
        stdout(&import).contains("not 64 hex digits"),
        "{}",
        stdout(&import)
    );
    assert_eq!(entry_count(&second), 0);
    std::fs::write(run.join("run.json"), &original).unwrap();

    // `../result.json` with the result's own digest: it "verifies" if the name is followed.
    let entry_json = walk_files(&carried.join("cache"))
        .into_iter()
        .find(|p| p.file_name().is_some_and(|n| n == "entry.json"))
        .unwrap();
    let mut meta: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&entry_json).unwrap()).unwrap();
    let digest = meta["result_digest"].clone();
    meta["files"]["../result.json"] = digest;
    std::fs::write(&entry_json, meta.to_string()).unwrap();
    let import = second.run(&["cache", "import", carried.to_str().unwrap()]);
    assert_eq!(import.status.code(), Some(1), "{}", stdout(&import));
    assert!(stdout(&import).contains("`..`"), "{}", stdout(&import));
    assert_eq!(entry_count(&second), 0);
}

/// The help says plainly what the digests do and do not prove.
#[test]
fn import_help_says_an_export_is_trusted_input() {
    let sandbox = Sandbox::new();
    let help = stdout(&sandbox.run(&["cache", "import", "--help"]));
    assert!(help.contains("trusted input"), "{help}");
}

/// An export carries only what entries and records were made of: a link planted in a run
/// folder stops it, and the file it points at is not copied.
#[test]
fn an_export_refuses_links() {
    let sandbox = Sandbox::new();
    run_chain(&sandbox);
    let secret = sandbox.write("secret.txt", "not for the export");
    let run = run_folders(&sandbox).pop().unwrap();
    std::os::unix::fs::symlink(&secret, run.join("logs/stolen.log")).unwrap();
    let carried = sandbox.path().join("carried");
    let export = sandbox.run(&["cache", "export", carried.to_str().unwrap()]);
    assert!(!export.status.success(), "{}", stdout(&export));
    assert!(
        stderr(&export).contains("stolen.log") && stderr(&export).contains("symbolic link"),
        "{}",
        stderr(&export)
    );
    let leaked = walk_files(&carried)
        .into_iter()
        .any(|p| std::fs::read(&p).is_ok_and(|b| b == b"not for the export"));
    assert!(!leaked, "the linked file was copied into the export");
}
