//! `plan` and `explain`: what a run would do, and why, without running anything.

use std::path::Path;

use serde_json::Value;

use crate::cache::{Cache, EntryMeta};
use crate::diagnostic::nearest;
use crate::key::key_parts;
use crate::key::{environment_fingerprint, InputDigest, KeyParts};
use crate::plan::Plan;
use crate::record::{run_dirs, RunRecord};
use attnbench_sdk::environment::Environment;

#[derive(Debug, Clone)]
pub enum NodeState {
    /// A cache entry exists for the node's key.
    Cached { meta: Box<EntryMeta> },
    /// The node's key is known and has no entry.
    ToRun { key: String },
    /// An input will run first, so the key is not known yet.
    AfterInputs { waiting_for: Vec<usize> },
}

impl NodeState {
    pub fn label(&self) -> &'static str {
        match self {
            NodeState::Cached { .. } => "cached",
            NodeState::ToRun { .. } | NodeState::AfterInputs { .. } => "to run",
        }
    }
}

/// The state of every node, reading only entry metadata (`run` verifies digests when it reads).
pub fn node_states(plan: &Plan, cache: &Cache) -> Vec<NodeState> {
    let fingerprint = environment_fingerprint(&Environment::detect());
    let existing = cache.keys();
    let mut states: Vec<NodeState> = Vec::with_capacity(plan.nodes.len());
    for (index, node) in plan.nodes.iter().enumerate() {
        let mut digests = Vec::with_capacity(node.inputs.len());
        let mut waiting_for = Vec::new();
        for &input in &node.inputs {
            match &states[input] {
                NodeState::Cached { meta } => digests.push(InputDigest {
                    node: plan.nodes[input].id.clone(),
                    digest: meta.output_digest.clone(),
                }),
                _ => waiting_for.push(input),
            }
        }
        if !waiting_for.is_empty() {
            states.push(NodeState::AfterInputs { waiting_for });
            continue;
        }
        let parts = key_parts(plan, index, digests, &fingerprint);
        let key = parts.key();
        let meta = existing
            .contains(&key)
            .then(|| std::fs::read(cache.entry_dir(&key).join("entry.json")).ok())
            .flatten()
            .and_then(|bytes| serde_json::from_slice::<EntryMeta>(&bytes).ok());
        states.push(match meta {
            Some(meta) => NodeState::Cached {
                meta: Box::new(meta),
            },
            None => NodeState::ToRun { key },
        });
    }
    states
}

/// A node name that selects no node of the plan, or more than one.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SelectError {
    #[error("pipeline `{pipeline}` has no node `{node}`{hint} (`attnbench plan` lists them)")]
    NoNode {
        pipeline: String,
        node: String,
        /// `; did you mean `…`?` when a node id is close, else empty.
        hint: String,
    },
    #[error("`{node}` names {count} nodes, e.g. {examples}; give one node id")]
    Many {
        node: String,
        count: usize,
        examples: String,
    },
}

/// Why `node` (an id, or a stage with one node) will or will not run.
pub fn explain(plan: &Plan, cache: &Cache, node: &str) -> Result<String, SelectError> {
    let selected = plan.select(node);
    let index = match selected.as_slice() {
        [one] => *one,
        [] => {
            let ids = plan.nodes.iter().map(|n| n.id.as_str());
            let hint = nearest(node, ids)
                .map(|id| format!("; did you mean `{id}`?"))
                .unwrap_or_default();
            return Err(SelectError::NoNode {
                pipeline: plan.pipeline.name.clone(),
                node: node.to_string(),
                hint,
            });
        }
        many => {
            let examples: Vec<&str> = many
                .iter()
                .take(3)
                .map(|&i| plan.nodes[i].id.as_str())
                .collect();
            return Err(SelectError::Many {
                node: node.to_string(),
                count: many.len(),
                examples: examples.join(", "),
            });
        }
    };
    let states = node_states(plan, cache);
    let id = &plan.nodes[index].id;
    let previous = previous_parts(&cache.runs_dir(), &plan.pipeline.name, id);
    let mut lines = Vec::new();
    match &states[index] {
        NodeState::Cached { meta } => {
            lines.push(format!("`{id}` is cached: it will not run."));
            lines.push(format!(
                "  key {} (computed {}, took {:.2}s)",
                &meta.key[..16],
                meta.created,
                meta.duration_s
            ));
            lines.push("  use `attnbench run … --force NODE` to recompute it".into());
        }
        NodeState::AfterInputs { waiting_for } => {
            lines.push(format!(
                "`{id}` will run after its inputs, which are not cached:"
            ));
            for &input in waiting_for {
                lines.push(format!("  input `{}` runs first", plan.nodes[input].id));
            }
            if let Some((run, old)) = &previous {
                let current = key_parts(
                    plan,
                    index,
                    Vec::new(),
                    &environment_fingerprint(&Environment::detect()),
                );
                let own: Vec<String> = differences(old, &current)
                    .into_iter()
                    .filter(|d| !d.starts_with("input"))
                    .collect();
                if !own.is_empty() {
                    lines.push(format!("  and since run {run} its own key changed:"));
                    lines.extend(own.into_iter().map(|d| format!("    {d}")));
                }
            }
        }
        NodeState::ToRun { key } => {
            lines.push(format!(
                "`{id}` will run: no cached result has its key {}.",
                &key[..16]
            ));
            let inputs = plan.nodes[index]
                .inputs
                .iter()
                .filter_map(|&input| match &states[input] {
                    NodeState::Cached { meta } => Some(InputDigest {
                        node: plan.nodes[input].id.clone(),
                        digest: meta.output_digest.clone(),
                    }),
                    _ => None,
                })
                .collect();
            let parts = &key_parts(
                plan,
                index,
                inputs,
                &environment_fingerprint(&Environment::detect()),
            );
            match &previous {
                None => lines.push("  it has not run before in this cache".into()),
                Some((run, old)) => {
                    let changes = differences(old, parts);
                    if changes.is_empty() {
                        lines.push(format!("  nothing changed since run {run}; its cached result is gone (removed by `cache gc`, or found corrupted)"));
                    } else {
                        lines.push(format!("  since run {run}:"));
                        lines.extend(changes.into_iter().map(|d| format!("    {d}")));
                    }
                }
            }
        }
    }
    Ok(lines.join("\n"))
}

/// The key parts `node` had in the newest run of `pipeline` that computed or reused it.
fn previous_parts(runs_dir: &Path, pipeline: &str, node: &str) -> Option<(String, KeyParts)> {
    run_dirs(runs_dir).into_iter().find_map(|dir| {
        let record = RunRecord::read(&dir).ok()?;
        if record.pipeline != pipeline {
            return None;
        }
        let found = record
            .nodes
            .into_iter()
            .find(|n| n.id == node && n.status.succeeded())?;
        Some((record.id, found.key_parts?))
    })
}

/// What differs between two key parts, one line each.
pub fn differences(old: &KeyParts, new: &KeyParts) -> Vec<String> {
    let mut changes = Vec::new();
    if old.plugin != new.plugin || old.stage != new.stage {
        changes.push(format!(
            "stage changed: {}/{} → {}/{}",
            old.plugin, old.stage, new.plugin, new.stage
        ));
    }
    if old.plugin_version != new.plugin_version {
        changes.push(format!(
            "plugin version changed: {} → {}",
            old.plugin_version, new.plugin_version
        ));
    }
    if old.library_hash != new.library_hash {
        changes.push(format!(
            "plugin library rebuilt: {} → {}",
            &old.library_hash[..12.min(old.library_hash.len())],
            &new.library_hash[..12.min(new.library_hash.len())]
        ));
    }
    let empty = serde_json::Map::new();
    let old_params = old.params.as_object().unwrap_or(&empty);
    let new_params = new.params.as_object().unwrap_or(&empty);
    for (key, value) in new_params {
        match old_params.get(key) {
            Some(before) if before != value => changes.push(format!(
                "parameter `{key}` changed: {} → {}",
                show(before),
                show(value)
            )),
            None => changes.push(format!("parameter `{key}` added: {}", show(value))),
            _ => {}
        }
    }
    for key in old_params.keys().filter(|k| !new_params.contains_key(*k)) {
        changes.push(format!("parameter `{key}` removed"));
    }
    if old.seed != new.seed {
        changes.push(format!("seed changed: {} → {}", old.seed, new.seed));
    }
    for input in &new.inputs {
        match old.inputs.iter().find(|i| i.node == input.node) {
            Some(before) if before.digest != input.digest => {
                changes.push(format!("input `{}` changed its output", input.node))
            }
            None => changes.push(format!("input `{}` added", input.node)),
            _ => {}
        }
    }
    for input in old
        .inputs
        .iter()
        .filter(|i| !new.inputs.iter().any(|n| n.node == i.node))
    {
        changes.push(format!("input `{}` removed", input.node));
    }
    for (path, digest) in &new.files {
        if old.files.get(path).is_some_and(|before| before != digest) {
            changes.push(format!("file {path} changed"));
        }
    }
    for (plugin, hash) in &new.backends {
        if old
            .backends
            .get(plugin)
            .is_some_and(|before| before != hash)
        {
            changes.push(format!(
                "the backend plugin `{plugin}` was rebuilt (library hash differs)"
            ));
        }
    }
    if old.environment != new.environment {
        changes.push("the machine changed (environment fingerprint differs)".into());
    }
    changes
}

fn show(value: &Value) -> String {
    match value {
        Value::String(text) => text.clone(),
        other => other.to_string(),
    }
}
