//! One stage: `uses`, its parameters against the plugin's manifest (types, enums, ranges,
//! defaults), its matrix and the keys it may have.

use serde_json::{Map, Value};

use super::check::{check_needs, check_timeout};
use super::checker::Checker;
use super::{limits, presets, Stage, STAGE_KEYS};
use crate::diagnostic::suggestion;
use crate::key::canonical;

pub(super) fn check_stage(
    checker: &mut Checker,
    stage_name: &str,
    raw: &Value,
    defaults: &Map<String, Value>,
    stage_names: &[&str],
) -> Option<(Stage, Vec<(String, bool)>)> {
    let at = ["stages", stage_name];
    if !stage_name
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
    {
        checker.at_key(
            &at,
            format!("stage name `{stage_name}` may use only letters, digits, `_` and `-`"),
            None,
        );
    }
    let Some(map) = raw.as_object() else {
        checker.at_value(
            &at,
            format!("stage `{stage_name}` must be a mapping with `uses`"),
            None,
        );
        return None;
    };
    checker.unknown_keys(map, &at, &STAGE_KEYS, &format!("stage `{stage_name}`"));
    let needs = check_needs(checker, stage_name, map.get("needs"), stage_names);
    let timeout = check_timeout(checker, stage_name, map.get("timeout"));

    let uses = match map.get("uses") {
        Some(Value::String(uses)) => uses.clone(),
        Some(_) => {
            checker.at_value(
                &["stages", stage_name, "uses"],
                "`uses` must be a string `plugin/stage`",
                None,
            );
            return None;
        }
        None => {
            checker.at_key(
                &at,
                format!("stage `{stage_name}` has no `uses`"),
                Some("add `uses: plugin/stage`, e.g. `uses: masks/generate`".into()),
            );
            return None;
        }
    };
    let uses_at = ["stages", stage_name, "uses"];
    let Some((plugin_name, plugin_stage)) = uses.split_once('/') else {
        checker.at_value(
            &uses_at,
            format!("`uses: {uses}` must name a plugin and a stage as `plugin/stage`"),
            None,
        );
        return None;
    };
    let Some(plugin) = checker.registry.get(plugin_name).cloned() else {
        let hint = if checker.registry.names().next().is_none() {
            let dirs: Vec<String> = checker
                .registry
                .dirs
                .iter()
                .map(|d| d.display().to_string())
                .collect();
            format!("no plugins were found; searched {} (build them with `cargo build --workspace`, or pass --plugin-dir)", dirs.join(", "))
        } else if let Some((path, reason)) = checker.registry.rejected.iter().find(|(path, _)| {
            path.file_name()
                .is_some_and(|f| f.to_string_lossy().contains(&plugin_name.replace('-', "_")))
        }) {
            format!(
                "{} looks like it, but could not be loaded: {reason}",
                path.display()
            )
        } else {
            suggestion(plugin_name, checker.registry.names(), "installed plugins")
        };
        checker.at_value(
            &uses_at,
            format!("unknown plugin `{plugin_name}`"),
            Some(hint),
        );
        return None;
    };
    let Some(spec) = plugin.stage(plugin_stage).cloned() else {
        let names = plugin.manifest.stages.iter().map(|s| s.name.as_str());
        let hint = suggestion(plugin_stage, names, &format!("stages of `{plugin_name}`"));
        checker.at_value(
            &uses_at,
            format!("plugin `{plugin_name}` has no stage `{plugin_stage}`"),
            Some(hint),
        );
        return None;
    };

    let param_names: Vec<&str> = spec.params.iter().map(|p| p.name.as_str()).collect();
    let mut params = Map::new();
    for param in &spec.params {
        if let Some(value) = defaults.get(&param.name) {
            match param
                .ty
                .coerce(value)
                .and_then(|value| limits::check_number(param, &value).map(|()| value))
            {
                Ok(value) => {
                    params.insert(param.name.clone(), canonical(&value));
                }
                Err(err) => checker.at_value(
                    &["defaults", &param.name],
                    format!(
                        "default `{}` does not fit stage `{stage_name}`: {err}",
                        param.name
                    ),
                    None,
                ),
            }
        } else if let Some(value) = &param.default {
            params.insert(
                param.name.clone(),
                canonical(&param.ty.coerce(value).unwrap_or_else(|_| value.clone())),
            );
        }
    }
    let with = match map.get("with") {
        None => Map::new(),
        Some(Value::Object(with)) => with.clone(),
        Some(_) => {
            checker.at_value(
                &["stages", stage_name, "with"],
                "`with` must be a mapping of parameter names to values",
                None,
            );
            Map::new()
        }
    };
    for (key, value) in &with {
        let at = ["stages", stage_name, "with", key.as_str()];
        let Some(param) = spec.find_param(key) else {
            unknown_parameter(checker, &at, &uses, key, &param_names, "");
            continue;
        };
        match param.ty.coerce(value) {
            Ok(value) => match limits::check_number(param, &value) {
                Ok(()) => {
                    params.insert(key.clone(), canonical(&value));
                }
                Err(err) => checker.at_value(&at, format!("parameter `{key}`: {err}"), None),
            },
            Err(err) => checker.at_value(
                &at,
                format!("parameter `{key}`: {err}"),
                Some(format!("`{key}` is {}", param.ty)),
            ),
        }
    }

    let mut matrix = Vec::new();
    match map.get("matrix") {
        None => {}
        Some(Value::Object(raw_matrix)) => {
            // Before anything is coerced: a 70 KB file can spell out a matrix of 10⁷ nodes.
            if let Err(err) = limits::matrix_size(stage_name, raw_matrix) {
                checker.at_key(&["stages", stage_name, "matrix"], err.to_string(), None);
                return None;
            }
            for (key, values) in raw_matrix {
                let at = ["stages", stage_name, "matrix", key.as_str()];
                let Some(param) = spec.find_param(key) else {
                    unknown_parameter(checker, &at, &uses, key, &param_names, " to vary");
                    continue;
                };
                if with.contains_key(key) {
                    checker.at_key(
                        &at,
                        format!("`{key}` is set both in `with` and in `matrix`"),
                        Some("keep one of the two".into()),
                    );
                }
                let Some(values) = values.as_array() else {
                    checker.at_value(
                        &at,
                        format!("matrix entry `{key}` must be a list of values"),
                        Some(format!("write `{key}: [a, b]`")),
                    );
                    continue;
                };
                if values.is_empty() {
                    checker.at_value(
                        &at,
                        format!("matrix entry `{key}` is empty, so the stage would have no nodes"),
                        Some("give it at least one value or remove it".into()),
                    );
                    continue;
                }
                let mut coerced: Vec<Value> = Vec::with_capacity(values.len());
                // By their JSON text: a linear scan per value made 20,000 values take seconds.
                let mut seen = std::collections::HashSet::with_capacity(values.len());
                for (index, value) in values.iter().enumerate() {
                    let index = index.to_string();
                    let at = ["stages", stage_name, "matrix", key.as_str(), index.as_str()];
                    match param.ty.coerce(value).map(|value| canonical(&value)) {
                        Ok(value) if !seen.insert(value.to_string()) => checker.at_value(
                            &at,
                            format!("matrix entry `{key}` repeats the value {value}"),
                            None,
                        ),
                        Ok(value) => match limits::check_number(param, &value) {
                            Ok(()) => coerced.push(value),
                            Err(err) => {
                                checker.at_value(&at, format!("matrix entry `{key}`: {err}"), None)
                            }
                        },
                        Err(err) => checker.at_value(
                            &at,
                            format!("matrix entry `{key}`: {err}"),
                            Some(format!("`{key}` is {}", param.ty)),
                        ),
                    }
                }
                matrix.push((key.clone(), coerced));
            }
        }
        Some(_) => checker.at_value(
            &["stages", stage_name, "matrix"],
            "`matrix` must be a mapping of parameter names to lists",
            None,
        ),
    }

    let mut written = defaults.clone();
    written.extend(with);
    presets::check_presets(checker, stage_name, &spec, &written, &matrix, &mut params);

    for param in &spec.params {
        let set =
            params.contains_key(&param.name) || matrix.iter().any(|(key, _)| key == &param.name);
        if !set && !param.optional {
            checker.at_key(
                &at,
                format!(
                    "stage `{stage_name}` needs parameter `{}` ({}), which has no default",
                    param.name, param.ty
                ),
                Some(format!(
                    "set it under `with:`, `matrix:` or the pipeline's `defaults:`{}",
                    doc_suffix(&param.doc)
                )),
            );
        }
    }
    let timeout = match (timeout, spec.timeout_s) {
        (Some(timeout), _) => Some(timeout),
        (None, None) => None,
        (None, Some(seconds)) => match limits::declared_timeout(seconds) {
            Ok(timeout) => Some(timeout),
            Err(err) => {
                checker.at_value(&uses_at, format!("`{uses}`: {err}"), None);
                None
            }
        },
    };
    let origin = checker.origin(&at, true);
    let stage = Stage {
        name: stage_name.to_string(),
        plugin,
        spec,
        uses,
        params,
        matrix,
        fan_out: Vec::new(),
        collect: Vec::new(),
        timeout,
        origin,
    };
    Some((stage, needs))
}

pub(super) fn unknown_parameter(
    checker: &mut Checker,
    at: &[&str],
    uses: &str,
    key: &str,
    names: &[&str],
    what: &str,
) {
    let hint = suggestion(
        key,
        names.iter().copied(),
        &format!("parameters of `{uses}`"),
    );
    checker.at_key(
        at,
        format!("`{uses}` has no parameter `{key}`{what}"),
        Some(hint),
    );
}

pub(super) fn doc_suffix(doc: &str) -> String {
    if doc.is_empty() {
        String::new()
    } else {
        format!(" ({doc})")
    }
}
