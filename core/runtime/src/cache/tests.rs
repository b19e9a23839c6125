//! The store itself: commits, lookups, corruption and concurrent replacement.

use super::*;
use crate::key::tests::parts;
use serde_json::json;

#[test]
fn commit_then_lookup_and_detect_corruption() {
    let root = tempfile::tempdir().unwrap();
    let cache = Cache::open(root.path()).unwrap();
    let staging = cache.staging().unwrap();
    std::fs::write(staging.files_dir().join("data.bin"), b"payload").unwrap();
    let entry = cache
        .commit(staging, parts(1), "n", "p/s", &json!({"ok": 1}), 0.1)
        .unwrap();
    assert_eq!(entry.result, json!({"ok": 1}));
    let key = parts(1).key();
    assert!(matches!(cache.lookup(&key), Lookup::Hit(_)));
    std::fs::write(cache.entry_dir(&key).join("files/data.bin"), b"tampered").unwrap();
    match cache.lookup(&key) {
        Lookup::Corrupted(reason) => assert!(
            matches!(&reason, EntryError::Digest(file) if file == "files/data.bin"),
            "{reason}"
        ),
        _ => panic!("corruption not detected"),
    }
    assert!(matches!(cache.lookup(&key), Lookup::Miss));
}

fn commit_files(cache: &Cache, round: usize) -> Result<Entry, CacheError> {
    let staging = cache.staging().unwrap();
    for file in 0..8 {
        let content = format!("round {round} file {file} ").repeat(2000);
        std::fs::write(staging.files_dir().join(format!("f{file}.txt")), content).unwrap();
    }
    cache.commit(staging, parts(7), "n", "p/s", &json!({"round": round}), 0.0)
}

/// `--force` beside another run: the forced run replaces the entry under the key lock while
/// the other reads it without the lock. The reader must never call it corrupted (and so
/// never discard it), and the writer's fresh entry must survive.
#[test]
fn a_forced_replacement_is_never_seen_as_corruption_by_a_concurrent_reader() {
    let root = tempfile::tempdir().unwrap();
    let cache = Cache::open(root.path()).unwrap();
    let key = parts(7).key();
    commit_files(&cache, 0).unwrap();
    let done = std::sync::atomic::AtomicBool::new(false);
    std::thread::scope(|scope| {
        let reader = scope.spawn(|| {
            let mut hits = 0;
            while !done.load(std::sync::atomic::Ordering::Relaxed) {
                match cache.lookup(&key) {
                    Lookup::Hit(_) => hits += 1,
                    Lookup::Miss => {}
                    Lookup::Corrupted(reason) => return Err(reason),
                }
            }
            Ok(hits)
        });
        for round in 1..150 {
            let _lock = cache.lock_key(&key).unwrap();
            let entry = commit_files(&cache, round);
            assert!(entry.is_ok(), "round {round}: {:?}", entry.err());
        }
        done.store(true, std::sync::atomic::Ordering::Relaxed);
        let seen = reader.join().unwrap();
        assert!(seen.is_ok(), "the reader saw corruption: {:?}", seen.err());
    });
    match cache.lookup(&key) {
        Lookup::Hit(entry) => assert_eq!(entry.result, json!({"round": 149})),
        _ => panic!("the last forced entry is gone"),
    }
}

#[test]
fn a_file_added_to_an_entry_makes_it_invalid() {
    let root = tempfile::tempdir().unwrap();
    let cache = Cache::open(root.path()).unwrap();
    commit_files(&cache, 0).unwrap();
    let dir = cache.entry_dir(&parts(7).key());
    std::fs::write(dir.join("files/measurement.json"), b"{}").unwrap();
    let reason = verify_entry(&dir).expect_err("an unlisted file is refused");
    assert!(
        matches!(&reason, EntryError::Unlisted(file) if file == "measurement.json"),
        "{reason}"
    );
}
