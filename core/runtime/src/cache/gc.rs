//! Which entries `cache gc` must keep: everything a pipeline's latest run used, and everything
//! an unfinished run (stopped by a signal or its time budget, or killed) may still need when it
//! is resumed.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::time::SystemTime;

use super::EntryMeta;
use crate::record::{RunRecord, Status};

/// A run that ended with every node done (failures included): nothing of it waits to be resumed.
fn complete(record: &RunRecord) -> bool {
    record.finished.is_some()
        && record
            .nodes
            .iter()
            .all(|n| !matches!(n.status, Status::Skipped | Status::Interrupted))
}

fn named_keys(record: &RunRecord) -> BTreeSet<&str> {
    record
        .nodes
        .iter()
        .filter_map(|n| n.key.as_deref())
        .collect()
}

/// The keys to keep, given every run record (newest first) and every entry's metadata.
///
/// Per pipeline, its newest runs back to and including its newest complete run are live: a
/// resumed sweep needs what the runs before its stop computed. An older unfinished run stays
/// live until a later complete run of its pipeline names every key it named. For live
/// unfinished runs, whose skipped nodes may lack a key (their inputs were never produced), also
/// kept are the entries built only from kept entries' outputs, for those nodes' ids (or any id,
/// where the run was killed before recording all its nodes), and, for a run killed outright,
/// the entries created after it started, which its record may not have caught.
pub fn live_keys(records: &[RunRecord], entries: &[EntryMeta]) -> HashSet<String> {
    let mut keep: HashSet<String> = HashSet::new();
    let mut completes: HashMap<&str, Vec<BTreeSet<&str>>> = HashMap::new();
    let mut unfinished: Vec<&RunRecord> = Vec::new();
    for record in records {
        let named = named_keys(record);
        let later = completes.entry(record.pipeline.as_str()).or_default();
        let live = if complete(record) {
            later.is_empty()
        } else {
            later.is_empty() || !later.iter().any(|done| named.is_subset(done))
        };
        if live {
            keep.extend(named.iter().map(|k| k.to_string()));
            if !complete(record) {
                unfinished.push(record);
            }
        }
        if complete(record) {
            later.push(named);
        }
    }
    if unfinished.is_empty() {
        return keep;
    }

    for record in unfinished.iter().filter(|r| r.finished.is_none()) {
        let Some(started) = parse_time(&record.started) else {
            // Cannot tell what it created: keep everything rather than guess.
            keep.extend(entries.iter().map(|e| e.key.clone()));
            return keep;
        };
        let since = truncate_to_second(started);
        for entry in entries {
            if parse_time(&entry.created).is_some_and(|created| created >= since) {
                keep.insert(entry.key.clone());
            }
        }
    }

    let any_id = unfinished.iter().any(|r| r.finished.is_none());
    let unkeyed: HashSet<&str> = unfinished
        .iter()
        .flat_map(|r| r.nodes.iter())
        .filter(|n| n.key.is_none())
        .map(|n| n.id.as_str())
        .collect();
    loop {
        let outputs: HashSet<&str> = entries
            .iter()
            .filter(|e| keep.contains(&e.key))
            .map(|e| e.output_digest.as_str())
            .collect();
        let grown: Vec<String> = entries
            .iter()
            .filter(|e| !keep.contains(&e.key))
            .filter(|e| any_id || unkeyed.contains(e.node.as_str()))
            .filter(|e| {
                !e.key_parts.inputs.is_empty()
                    && e.key_parts
                        .inputs
                        .iter()
                        .all(|input| outputs.contains(input.digest.as_str()))
            })
            .map(|e| e.key.clone())
            .collect();
        if grown.is_empty() {
            return keep;
        }
        keep.extend(grown);
    }
}

fn parse_time(text: &str) -> Option<SystemTime> {
    humantime::parse_rfc3339_weak(text).ok()
}

/// Entry times are recorded to the second, run starts to the millisecond.
fn truncate_to_second(time: SystemTime) -> SystemTime {
    let since_epoch = time
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap_or_default();
    SystemTime::UNIX_EPOCH + std::time::Duration::from_secs(since_epoch.as_secs())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn record(
        pipeline: &str,
        started: &str,
        finished: bool,
        nodes: &[(&str, &str, Option<&str>)],
    ) -> RunRecord {
        let nodes: Vec<_> = nodes
            .iter()
            .map(|(id, status, key)| {
                json!({"id": id, "stage": "s", "uses": "p/s", "params": {}, "inputs": [],
                       "status": status, "key": key, "duration_s": 0.0})
            })
            .collect();
        serde_json::from_value(json!({
            "id": started, "pipeline": pipeline, "file": "p.yaml", "seed": 0, "argv": [], "jobs": 1,
            "started": started, "finished": finished.then_some(started),
            "environment": {"os": "", "arch": "", "kernel": "", "cpu": "", "logical_cpus": 1,
                            "memory_bytes": 0, "attnbench_version": ""},
            "plugins": [], "counts": {}, "nodes": nodes,
        }))
        .unwrap()
    }

    fn entry(key: &str, node: &str, inputs: &[&str], created: &str) -> EntryMeta {
        let inputs: Vec<_> = inputs
            .iter()
            .map(|d| json!({"node": "up", "digest": d}))
            .collect();
        serde_json::from_value(json!({
            "key": key, "node": node, "uses": "p/s",
            "key_parts": {"plugin": "p", "plugin_version": "1", "library_hash": "h", "stage": "s",
                          "params": {}, "seed": 0, "inputs": inputs},
            "output_digest": format!("out-{key}"), "result_digest": "r", "files": {}, "bytes": 0,
            "created": created, "duration_s": 0.0,
        }))
        .unwrap()
    }

    const OLD: &str = "2026-01-01T00:00:00Z";

    #[test]
    fn a_complete_latest_run_releases_what_older_runs_used() {
        let runs = [
            record(
                "p",
                "2026-01-03T00:00:00.000Z",
                true,
                &[("a", "ok", Some("k2"))],
            ),
            record(
                "p",
                "2026-01-02T00:00:00.000Z",
                true,
                &[("a", "ok", Some("k1"))],
            ),
        ];
        let entries = [entry("k1", "a", &[], OLD), entry("k2", "a", &[], OLD)];
        assert_eq!(
            live_keys(&runs, &entries),
            HashSet::from(["k2".to_string()])
        );
    }

    #[test]
    fn a_stopped_run_keeps_what_its_pipeline_computed_before() {
        let runs = [
            record(
                "p",
                "2026-01-03T00:00:00.000Z",
                true,
                &[("a", "skipped", Some("ka")), ("b", "skipped", None)],
            ),
            record(
                "p",
                "2026-01-02T00:00:00.000Z",
                true,
                &[("a", "ok", Some("ka")), ("b", "ok", Some("kb"))],
            ),
            record(
                "p",
                "2026-01-01T00:00:00.000Z",
                true,
                &[("a", "ok", Some("old"))],
            ),
        ];
        let entries = [
            entry("ka", "a", &[], OLD),
            entry("kb", "b", &["out-ka"], OLD),
            entry("old", "a", &[], OLD),
        ];
        let keep = live_keys(&runs, &entries);
        assert!(keep.contains("ka") && keep.contains("kb"), "{keep:?}");
        assert!(
            !keep.contains("old"),
            "older than the newest complete run: {keep:?}"
        );
    }

    #[test]
    fn an_older_interrupted_run_stays_live_until_a_complete_run_covers_it() {
        let stopped = record(
            "p",
            "2026-01-01T00:00:00.000Z",
            true,
            &[("a", "ok", Some("y1")), ("b", "skipped", None)],
        );
        let other = record(
            "p",
            "2026-01-02T00:00:00.000Z",
            true,
            &[("a", "ok", Some("x1"))],
        );
        let entries = [
            entry("y1", "a", &[], OLD),
            entry("y2", "b", &["out-y1"], OLD),
            entry("x1", "a", &[], OLD),
        ];
        let keep = live_keys(&[other, stopped.clone()], &entries);
        assert!(keep.contains("y1") && keep.contains("y2"), "{keep:?}");
        let covering = record(
            "p",
            "2026-01-02T00:00:00.000Z",
            true,
            &[("a", "ok", Some("y1")), ("b", "ok", Some("y3"))],
        );
        let keep = live_keys(&[covering, stopped], &entries);
        assert!(!keep.contains("y2"), "{keep:?}");
    }

    #[test]
    fn a_killed_run_keeps_the_entries_it_made_before_its_record_caught_up() {
        let killed = record("p", "2026-01-02T10:00:00.700Z", false, &[]);
        let entries = [
            entry("new", "a", &[], "2026-01-02T10:00:00Z"),
            entry("old", "a", &[], "2026-01-02T09:59:59Z"),
        ];
        let keep = live_keys(&[killed], &entries);
        assert_eq!(keep, HashSet::from(["new".to_string()]));
    }
}
