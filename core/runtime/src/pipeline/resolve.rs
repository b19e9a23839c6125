//! What a pipeline's parameters point outside it: the plugins `backend` parameters name, and
//! the files `file` parameters name (resolved against the pipeline's folder and hashed).

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

use attnbench_sdk::ParamType;
use serde_json::Value;

use super::checker::Checker;
use super::{limits, Stage};
use crate::host::plugin::{Plugin, Registry};

/// The plugins that `backend` parameters (`plugin/kernel`) name; refuses a plugin that is not
/// found or does not offer the kernel in process.
pub(super) fn resolve_backends(
    checker: &mut Checker,
    stages: &[Stage],
    registry: &Registry,
) -> BTreeMap<String, Arc<Plugin>> {
    let mut found = BTreeMap::new();
    for stage in stages {
        for spec in stage
            .spec
            .params
            .iter()
            .filter(|p| p.ty == ParamType::Backend)
        {
            let name = &spec.name;
            let at = ["stages", stage.name.as_str(), "with", name.as_str()];
            let values = stage.params.get(name).into_iter().chain(
                stage
                    .matrix
                    .iter()
                    .filter(|(key, _)| key == name)
                    .flat_map(|(_, values)| values),
            );
            for value in values {
                let Some((plugin, kernel)) = value.as_str().and_then(|v| v.split_once('/')) else {
                    continue;
                };
                match registry.get(plugin) {
                    Some(library) if library.manifest.attention.iter().any(|k| k == kernel) => {
                        found.insert(plugin.to_string(), library.clone());
                    }
                    _ => checker.at_value(
                        &at,
                        format!(
                            "parameter `{name}` of stage `{}`: no plugin offers the in-process attention backend `{plugin}/{kernel}`",
                            stage.name
                        ),
                        Some(format!(
                            "offered here: builtin{}",
                            registry
                                .plugins()
                                .flat_map(|p| p.manifest.attention.iter().map(move |k| format!(", {}/{k}", p.manifest.name)))
                                .collect::<String>()
                        )),
                    ),
                }
            }
        }
    }
    found
}

/// Resolves `file` parameters against the pipeline's folder and hashes the files they name.
/// A bare word (no `/`, no `.`) is a name the stage defines and is passed through.
pub(super) fn resolve_files(
    checker: &mut Checker,
    stages: &mut [Stage],
    base: &Path,
) -> BTreeMap<String, String> {
    let mut digests = BTreeMap::new();
    for stage in stages.iter_mut() {
        let file_params: Vec<String> = stage
            .spec
            .params
            .iter()
            .filter(|p| p.ty == ParamType::File)
            .map(|p| p.name.clone())
            .collect();
        for name in file_params {
            let at = [
                "stages".to_string(),
                stage.name.clone(),
                "with".to_string(),
                name.clone(),
            ];
            let at: Vec<&str> = at.iter().map(String::as_str).collect();
            let mut values: Vec<&mut Value> = stage.params.get_mut(&name).into_iter().collect();
            for (key, matrix_values) in stage.matrix.iter_mut() {
                if *key == name {
                    values.extend(matrix_values.iter_mut());
                }
            }
            for value in values {
                let Some(text) = value.as_str() else { continue };
                if text.is_empty() || !(text.contains('/') || text.contains('.')) {
                    continue;
                }
                let path = base.join(text);
                let resolved = limits::hash_file(&path).map(|(resolved, digest)| {
                    let resolved = resolved.display().to_string();
                    digests.insert(resolved.clone(), digest);
                    resolved
                });
                match resolved {
                    Ok(resolved) => *value = Value::String(resolved),
                    Err(err) => {
                        // Limits say what is wrong in full; a missing file may be a wrong folder.
                        let hint =
                            matches!(err, limits::FileParamError::Unreadable { .. }).then(|| {
                                "paths are relative to the pipeline file's folder".to_string()
                            });
                        checker.at_value(
                            &at,
                            format!("parameter `{name}` of stage `{}`: {err}", stage.name),
                            hint,
                        )
                    }
                }
            }
        }
    }
    digests
}
