//! The pipeline as a whole: its top-level keys, its stages in dependency order (`needs`), their
//! timeouts and the defaults they share.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use petgraph::graphmap::DiGraphMap;
use serde_json::{Map, Value};

use super::checker::Checker;
use super::resolve::{resolve_backends, resolve_files};
use super::stage::check_stage;
use super::{limits, Pipeline, Stage, TOP_KEYS};
use crate::diagnostic::suggestion;
use crate::slurm::config::ExecutorSection;

pub(super) fn check(checker: &mut Checker, file: &Path, document: &Value) -> Option<Pipeline> {
    let Some(top) = document.as_object() else {
        checker.at_value(
            &[],
            "a pipeline must be a mapping with `stages`",
            Some("see pipelines/ for examples".into()),
        );
        return None;
    };
    checker.unknown_keys(top, &[], &TOP_KEYS, "the pipeline");
    let name = match top.get("name") {
        None => file
            .file_stem()
            .and_then(|s| s.to_str())
            .unwrap_or("pipeline")
            .to_string(),
        Some(Value::String(name)) => name.clone(),
        Some(_) => {
            checker.at_value(&["name"], "`name` must be a string", None);
            String::new()
        }
    };
    let seed = match top.get("seed") {
        None => 0,
        Some(value) => value.as_u64().unwrap_or_else(|| {
            checker.at_value(
                &["seed"],
                format!("`seed` must be a non-negative integer, found {value}"),
                None,
            );
            0
        }),
    };
    let executor = match top.get("executor") {
        None | Some(Value::Null) => ExecutorSection::default(),
        Some(value) => ExecutorSection::from_value(value).unwrap_or_else(|err| {
            checker.at_value(
                &["executor"],
                format!("`executor`: {err}"),
                Some(
                    "write `executor: slurm`, or a mapping of kind, partition, account, qos, \
                     extra, gpus_per_node, start_within and poll"
                        .into(),
                ),
            );
            ExecutorSection::default()
        }),
    };
    let empty = Map::new();
    let defaults = match top.get("defaults") {
        None => &empty,
        Some(Value::Object(map)) => map,
        Some(_) => {
            checker.at_value(
                &["defaults"],
                "`defaults` must be a mapping of parameter names to values",
                None,
            );
            &empty
        }
    };
    let stages_map = match top.get("stages") {
        Some(Value::Object(map)) if !map.is_empty() => map,
        Some(Value::Object(_)) | None => {
            checker.at_key(
                &["stages"],
                "the pipeline has no stages",
                Some("add `stages:` with at least one stage that `uses: plugin/stage`".into()),
            );
            return None;
        }
        Some(_) => {
            checker.at_value(
                &["stages"],
                "`stages` must be a mapping of stage names to stages",
                None,
            );
            return None;
        }
    };
    let stage_names: Vec<&str> = stages_map.keys().map(String::as_str).collect();

    let mut stages = Vec::new();
    let mut needs_of: Vec<(Vec<(String, bool)>, String)> = Vec::new();
    for (stage_name, raw) in stages_map {
        if let Some((stage, needs)) = check_stage(checker, stage_name, raw, defaults, &stage_names)
        {
            stages.push(stage);
            needs_of.push((needs, stage_name.clone()));
        }
    }
    check_defaults(checker, defaults, &stages);
    if stages.len() != stages_map.len() {
        return None;
    }
    let base = file.parent().map(Path::to_path_buf).unwrap_or_default();
    let file_digests = resolve_files(checker, &mut stages, &base);
    let backends = resolve_backends(checker, &stages, checker.registry);

    // Dependency order, and cycles named stage by stage.
    let index_of: BTreeMap<String, usize> = stages
        .iter()
        .enumerate()
        .map(|(i, s)| (s.name.clone(), i))
        .collect();
    let mut graph = DiGraphMap::<usize, ()>::new();
    for index in 0..stages.len() {
        graph.add_node(index);
    }
    for (index, (needs, _)) in needs_of.iter().enumerate() {
        for (upstream, _) in needs {
            graph.add_edge(index_of[upstream], index, ());
        }
    }
    let order = match petgraph::algo::toposort(&graph, None) {
        Ok(order) => order,
        Err(_) => {
            for component in petgraph::algo::tarjan_scc(&graph) {
                let cyclic = component.len() > 1 || graph.contains_edge(component[0], component[0]);
                if cyclic {
                    let mut names: Vec<&str> = component
                        .iter()
                        .rev()
                        .map(|&i| stages[i].name.as_str())
                        .collect();
                    names.push(names[0]);
                    let first = names[0].to_string();
                    checker.at_key(
                        &["stages", &first, "needs"],
                        format!(
                            "the stages depend on each other in a cycle: {}",
                            names.join(" → ")
                        ),
                        Some("remove one of these `needs` so that the stages form a DAG".into()),
                    );
                }
            }
            return None;
        }
    };
    let position: Vec<usize> = {
        let mut position = vec![0; stages.len()];
        for (rank, &index) in order.iter().enumerate() {
            position[index] = rank;
        }
        position
    };
    let mut ordered: Vec<Option<Stage>> = stages.into_iter().map(Some).collect();
    let mut sorted = Vec::with_capacity(ordered.len());
    for &index in &order {
        let mut stage = ordered[index].take()?;
        for (upstream, collect) in &needs_of[index].0 {
            let upstream = position[index_of[upstream]];
            if *collect {
                stage.collect.push(upstream);
            } else {
                stage.fan_out.push(upstream);
            }
        }
        sorted.push(stage);
    }
    Some(Pipeline {
        name,
        file: file.to_path_buf(),
        seed,
        stages: sorted,
        file_digests,
        backends,
        executor,
    })
}

/// `needs: a`, `needs: [a, b]` or `needs: {a: each, b: all}`; returns (stage, collects-all).
pub(super) fn check_needs(
    checker: &mut Checker,
    stage_name: &str,
    needs: Option<&Value>,
    stage_names: &[&str],
) -> Vec<(String, bool)> {
    let at = ["stages", stage_name, "needs"];
    let entries: Vec<(String, bool, Vec<String>)> = match needs {
        None => Vec::new(),
        Some(Value::String(name)) => vec![(name.clone(), false, vec![])],
        Some(Value::Array(items)) => items
            .iter()
            .enumerate()
            .filter_map(|(index, item)| match item {
                Value::String(name) => Some((name.clone(), false, vec![index.to_string()])),
                _ => {
                    let index = index.to_string();
                    checker.at_value(&["stages", stage_name, "needs", &index], "each entry of `needs` must be a stage name", None);
                    None
                }
            })
            .collect(),
        Some(Value::Object(map)) => map
            .iter()
            .filter_map(|(name, mode)| match mode.as_str() {
                Some("all") => Some((name.clone(), true, vec![name.clone()])),
                Some("each") => Some((name.clone(), false, vec![name.clone()])),
                _ => {
                    checker.at_value(&["stages", stage_name, "needs", name], format!("`{name}: {mode}` must be `all` (collect every node) or `each` (one node per upstream node)"), None);
                    None
                }
            })
            .collect(),
        Some(_) => {
            checker.at_value(&at, "`needs` must be a stage name, a list of names, or a mapping `name: all|each`", None);
            Vec::new()
        }
    };
    let mut needs = Vec::new();
    for (name, collect, sub) in entries {
        let mut path: Vec<&str> = at.to_vec();
        path.extend(sub.iter().map(String::as_str));
        if !stage_names.contains(&name.as_str()) {
            let others = stage_names.iter().copied().filter(|s| *s != stage_name);
            let hint = suggestion(&name, others, "stages");
            checker.at_value(
                &path,
                format!(
                    "stage `{stage_name}` needs `{name}`, which is not a stage of this pipeline"
                ),
                Some(hint),
            );
        } else if name == stage_name {
            checker.at_value(
                &path,
                format!("stage `{stage_name}` needs itself"),
                Some("remove it from its own `needs`".into()),
            );
        } else if needs.iter().any(|(n, _)| n == &name) {
            checker.at_value(
                &path,
                format!("`{name}` appears twice in the `needs` of `{stage_name}`"),
                None,
            );
        } else {
            needs.push((name, collect));
        }
    }
    needs
}

pub(super) fn check_timeout(
    checker: &mut Checker,
    stage_name: &str,
    timeout: Option<&Value>,
) -> Option<Duration> {
    match limits::timeout(timeout?) {
        Ok(timeout) => Some(timeout),
        Err(err) => {
            checker.at_value(&["stages", stage_name, "timeout"], err.to_string(), None);
            None
        }
    }
}

pub(super) fn check_defaults(
    checker: &mut Checker,
    defaults: &Map<String, Value>,
    stages: &[Stage],
) {
    for key in defaults.keys() {
        if !stages
            .iter()
            .any(|stage| stage.spec.find_param(key).is_some())
        {
            let all: Vec<&str> = stages
                .iter()
                .flat_map(|s| s.spec.params.iter().map(|p| p.name.as_str()))
                .collect();
            let hint = suggestion(
                key,
                all.iter().copied(),
                "parameters of this pipeline's stages",
            );
            checker.at_key(
                &["defaults", key],
                format!("default `{key}` is a parameter of none of the stages"),
                Some(hint),
            );
        }
    }
}
