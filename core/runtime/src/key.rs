//! The whole of a node's cache key: what it runs (plugin, library hash, stage), with what
//! (parameters, seed, the files its parameters name, the in-process backends it loads), on what
//! (its inputs' output digests) and, for measurements, where (the machine's fingerprint).

use std::sync::Arc;

use attnbench_sdk::{CacheScope, ParamType};
use serde_json::Value;

use crate::cache::{InputDigest, KeyParts};
use crate::host::plugin::Plugin;
use crate::plan::Plan;

/// The plugins whose in-process backends the node's `backend` parameters name.
pub(crate) fn backends_of(plan: &Plan, node: usize) -> impl Iterator<Item = &Arc<Plugin>> {
    let node = &plan.nodes[node];
    plan.stage_of(node)
        .spec
        .params
        .iter()
        .filter(|p| p.ty == ParamType::Backend)
        .filter_map(|p| node.params.get(&p.name)?.as_str()?.split_once('/'))
        .filter_map(|(plugin, _)| plan.pipeline.backends.get(plugin))
}

/// The key parts of a node whose inputs' output digests are known.
pub fn key_parts(
    plan: &Plan,
    node: usize,
    inputs: Vec<InputDigest>,
    environment: &str,
) -> KeyParts {
    let backends = backends_of(plan, node)
        .map(|plugin| (plugin.manifest.name.clone(), plugin.library_hash.clone()))
        .collect();
    let node = &plan.nodes[node];
    let stage = plan.stage_of(node);
    let files = stage
        .spec
        .params
        .iter()
        .filter(|p| p.ty == ParamType::File)
        .filter_map(|p| node.params.get(&p.name)?.as_str())
        .filter_map(|path| {
            Some((
                path.to_string(),
                plan.pipeline.file_digests.get(path)?.clone(),
            ))
        })
        .collect();
    KeyParts {
        plugin: stage.plugin.manifest.name.clone(),
        plugin_version: stage.plugin.manifest.version.clone(),
        library_hash: stage.plugin.library_hash.clone(),
        stage: stage.spec.name.clone(),
        params: Value::Object(node.params.to_map()),
        seed: plan.pipeline.seed,
        inputs,
        files,
        backends,
        environment: (stage.spec.cache_scope == CacheScope::Machine)
            .then(|| environment.to_string()),
    }
}
