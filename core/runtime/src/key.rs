//! The whole of a node's cache key: what it runs (plugin, library hash, stage), with what
//! (parameters, seed, the files its parameters name, the in-process backends it loads), on what
//! (its inputs' output digests) and, for measurements, where (the machine's fingerprint).

use std::collections::BTreeMap;
use std::sync::Arc;

use attnbench_sdk::{CacheScope, ParamType};
use serde::{Deserialize, Serialize};
use serde_json::Value;

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

/// What a node's key is made of; stored with the entry so `explain` can say what changed.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct KeyParts {
    pub plugin: String,
    pub plugin_version: String,
    pub library_hash: String,
    pub stage: String,
    /// Canonical (sorted) parameters.
    pub params: Value,
    pub seed: u64,
    pub inputs: Vec<InputDigest>,
    /// Content digests of the files that `file` parameters name (path → blake3).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub files: BTreeMap<String, String>,
    /// Library hashes of the plugins whose in-process backends `backend` parameters name.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub backends: BTreeMap<String, String>,
    /// The environment fingerprint, for `machine`-scoped stages only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub environment: Option<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct InputDigest {
    pub node: String,
    pub digest: String,
}

impl KeyParts {
    /// blake3 of the parts' JSON: fields in declaration order, `params` already canonical
    /// (plan nodes sort their parameters; values are canonicalised when validated).
    pub fn key(&self) -> String {
        let mut hasher = blake3::Hasher::new();
        // Writing JSON into a hasher cannot fail.
        let _ = serde_json::to_writer(&mut hasher, self);
        hasher.finalize().to_hex().to_string()
    }
}

/// What makes measurements comparable: the hardware and system, not attnbench's own version
/// (a new attnbench with the same plugin libraries measures the same thing).
pub fn environment_fingerprint(environment: &attnbench_sdk::environment::Environment) -> String {
    let mut identity = serde_json::json!({
        "os": environment.os, "arch": environment.arch, "kernel": environment.kernel, "cpu": environment.cpu,
        "logical_cpus": environment.logical_cpus, "memory_bytes": environment.memory_bytes,
    });
    // Only where there are GPUs, so that CPU machines keep their fingerprints.
    if !environment.gpus.is_empty() {
        identity["gpus"] = serde_json::json!(environment.gpus);
    }
    blake3::hash(identity.to_string().as_bytes()).to_hex()[..16].to_string()
}

/// `value` with every object's keys sorted, so equal values serialise to equal bytes.
pub fn canonical(value: &Value) -> Value {
    match value {
        Value::Object(map) => {
            let sorted: BTreeMap<&String, Value> =
                map.iter().map(|(k, v)| (k, canonical(v))).collect();
            Value::Object(sorted.into_iter().map(|(k, v)| (k.clone(), v)).collect())
        }
        Value::Array(items) => Value::Array(items.iter().map(canonical).collect()),
        other => other.clone(),
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use attnbench_sdk::environment::Environment;
    use serde_json::json;

    /// Key parts of a small made-up node, for the key's and the store's tests.
    pub(crate) fn parts(seqlen: u64) -> KeyParts {
        KeyParts {
            plugin: "p".into(),
            plugin_version: "1".into(),
            library_hash: "h".into(),
            stage: "s".into(),
            params: canonical(&json!({"seqlen": seqlen, "kernel": "k"})),
            seed: 0,
            inputs: vec![],
            files: BTreeMap::new(),
            backends: BTreeMap::new(),
            environment: None,
        }
    }

    #[test]
    fn keys_ignore_param_order_but_not_values() {
        let a = parts(1024);
        let mut b = parts(1024);
        b.params = canonical(&json!({"kernel": "k", "seqlen": 1024}));
        assert_eq!(a.key(), b.key());
        assert_ne!(a.key(), parts(2048).key());
    }

    #[test]
    fn every_part_is_in_the_key() {
        let base = parts(1024);
        type Change = (&'static str, fn(&mut KeyParts));
        let changes: [Change; 9] = [
            ("plugin", |p| p.plugin = "q".into()),
            ("plugin_version", |p| p.plugin_version = "2".into()),
            ("library_hash", |p| p.library_hash = "g".into()),
            ("stage", |p| p.stage = "t".into()),
            ("seed", |p| p.seed = 1),
            ("inputs", |p| {
                p.inputs.push(InputDigest {
                    node: "a".into(),
                    digest: "d".into(),
                })
            }),
            ("files", |p| {
                p.files.insert("f.json".into(), "d".into());
            }),
            ("backends", |p| {
                p.backends.insert("cpu".into(), "h".into());
            }),
            ("environment", |p| p.environment = Some("e".into())),
        ];
        for (what, change) in changes {
            let mut changed = base.clone();
            change(&mut changed);
            assert_ne!(changed.key(), base.key(), "{what} is not in the key");
        }
    }

    /// Keys of cached entries must survive refactors: a change here invalidates every cache.
    #[test]
    fn a_key_is_stable_across_builds() {
        assert_eq!(parts(1024).key(), GOLDEN_KEY);
    }

    const GOLDEN_KEY: &str = "757d30e38bd6ee856e8057b20a6f8273422518a53189475be6e11cbefcc4aca3";

    #[test]
    fn the_fingerprint_is_the_machine_not_the_attnbench_version() {
        let machine = Environment {
            os: "linux".into(),
            arch: "x86_64".into(),
            kernel: "6.1".into(),
            cpu: "a cpu".into(),
            logical_cpus: 2,
            memory_bytes: 1 << 34,
            attnbench_version: "0.1.0".into(),
            gpus: vec![],
        };
        let newer = Environment {
            attnbench_version: "0.2.0".into(),
            ..machine.clone()
        };
        assert_eq!(
            environment_fingerprint(&machine),
            environment_fingerprint(&newer)
        );
        let with_gpu = Environment {
            gpus: vec!["NVIDIA H200 (driver 580.159.04)".into()],
            ..machine.clone()
        };
        assert_ne!(
            environment_fingerprint(&machine),
            environment_fingerprint(&with_gpu)
        );
        let other_cpu = Environment {
            logical_cpus: 16,
            ..machine.clone()
        };
        assert_ne!(
            environment_fingerprint(&machine),
            environment_fingerprint(&other_cpu)
        );
    }
}
