//! Pipeline files: parsing, `--set` overrides, and validation against the plugins' manifests,
//! all before anything runs.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use attnbench_sdk::{ParamType, StageSpec};
use petgraph::graphmap::DiGraphMap;
use serde_json::{Map, Value};

use crate::cache::canonical;
use crate::diagnostic::{suggestion, Diagnostic, Origin};
use crate::plugin::{Plugin, Registry};
use crate::spans::SpanIndex;

pub(crate) mod limits;

pub use limits::{MAX_FILE_BYTES, MAX_NODES, MAX_PIPELINE_BYTES, MAX_TIMEOUT, MIN_TIMEOUT};

const TOP_KEYS: [&str; 5] = ["name", "description", "seed", "defaults", "stages"];
const STAGE_KEYS: [&str; 6] = ["uses", "with", "needs", "matrix", "timeout", "description"];

#[derive(Debug, thiserror::Error)]
pub enum PipelineError {
    #[error("cannot read pipeline {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{}", render(.0))]
    Invalid(Vec<Diagnostic>),
}

fn render(diagnostics: &[Diagnostic]) -> String {
    let mut text: Vec<String> = diagnostics.iter().map(ToString::to_string).collect();
    if diagnostics.len() > 1 {
        text.push(format!(
            "{} problems in the pipeline; nothing was run",
            diagnostics.len()
        ));
    }
    text.join("\n")
}

/// A validated pipeline: stages in dependency order, parameters checked and canonical.
#[derive(Debug)]
pub struct Pipeline {
    pub name: String,
    pub file: PathBuf,
    pub seed: u64,
    pub stages: Vec<Stage>,
    /// blake3 of every file a `file` parameter names (absolute path → digest).
    pub file_digests: BTreeMap<String, String>,
    /// The plugins that `backend` parameters name, by plugin name.
    pub backends: BTreeMap<String, Arc<Plugin>>,
}

#[derive(Debug)]
pub struct Stage {
    pub name: String,
    pub plugin: Arc<Plugin>,
    pub spec: StageSpec,
    /// `plugin/stage`.
    pub uses: String,
    /// Defaults, manifest defaults and `with`, coerced to canonical values.
    pub params: Map<String, Value>,
    pub matrix: Vec<(String, Vec<Value>)>,
    /// Indices (into `Pipeline::stages`) of stages fanned out over: one node per upstream node.
    pub fan_out: Vec<usize>,
    /// Indices of stages whose every node is an input of each node of this stage.
    pub collect: Vec<usize>,
    pub timeout: Option<Duration>,
    /// Where the stage is defined, for problems found after validation (while expanding).
    pub origin: Origin,
}

impl Stage {
    /// The type of parameter `name` (all matrix and param keys are declared ones).
    pub fn param_type(&self, name: &str) -> Option<&ParamType> {
        self.spec.find_param(name).map(|param| &param.ty)
    }
}

struct Checker<'a> {
    file: PathBuf,
    spans: SpanIndex,
    overrides: BTreeMap<String, String>,
    registry: &'a Registry,
    problems: Vec<Diagnostic>,
}

impl Checker<'_> {
    fn origin(&self, path: &[&str], at_key: bool) -> Origin {
        let joined = path.join(".");
        if let Some((option, _)) = self
            .overrides
            .iter()
            .find(|(key, _)| joined.starts_with(key.as_str()))
        {
            return Origin::Override(format!("{option}={}", self.overrides[option]));
        }
        let position = if at_key {
            self.spans.key(path)
        } else {
            self.spans.value(path)
        };
        match position {
            Some((line, column)) => Origin::File {
                path: self.file.clone(),
                line,
                column,
            },
            None => Origin::Pipeline(self.file.clone()),
        }
    }

    fn at_key(&mut self, path: &[&str], message: impl Into<String>, hint: Option<String>) {
        let mut diagnostic = Diagnostic::new(self.origin(path, true), message);
        diagnostic.hint = hint;
        self.problems.push(diagnostic);
    }

    fn at_value(&mut self, path: &[&str], message: impl Into<String>, hint: Option<String>) {
        let mut diagnostic = Diagnostic::new(self.origin(path, false), message);
        diagnostic.hint = hint;
        self.problems.push(diagnostic);
    }

    fn unknown_keys(
        &mut self,
        map: &Map<String, Value>,
        path: &[&str],
        allowed: &[&str],
        what: &str,
    ) {
        for key in map.keys().filter(|key| !allowed.contains(&key.as_str())) {
            let mut at: Vec<&str> = path.to_vec();
            at.push(key);
            let hint = suggestion(key, allowed.iter().copied(), "allowed keys");
            self.at_key(&at, format!("unknown key `{key}` in {what}"), Some(hint));
        }
    }
}

/// Reads, overrides and validates a pipeline file.
pub fn load(
    file: &Path,
    overrides: &[String],
    registry: &Registry,
) -> Result<Pipeline, PipelineError> {
    let text = limits::read_pipeline(file).map_err(|source| PipelineError::Read {
        path: file.to_path_buf(),
        source,
    })?;
    parse(file, &text, overrides, registry)
}

/// Validates pipeline `text` (read from `file`) with `--set` `overrides` applied.
pub fn parse(
    file: &Path,
    text: &str,
    overrides: &[String],
    registry: &Registry,
) -> Result<Pipeline, PipelineError> {
    let mut document: Value = match serde_norway::from_str(text) {
        Ok(Value::Null) => Value::Object(Map::new()),
        Ok(value) => value,
        Err(err) => {
            let origin = match err.location() {
                Some(at) => Origin::File {
                    path: file.to_path_buf(),
                    line: at.line(),
                    column: at.column(),
                },
                None => Origin::Pipeline(file.to_path_buf()),
            };
            let message = format!("invalid YAML: {}", strip_location(&err.to_string()));
            return Err(PipelineError::Invalid(vec![Diagnostic::new(
                origin, message,
            )
            .hint("check the indentation and quoting around this place")]));
        }
    };
    let spans = SpanIndex::build(text);
    if !spans.duplicates().is_empty() {
        return Err(PipelineError::Invalid(limits::duplicate_keys(file, &spans)));
    }
    let mut applied = BTreeMap::new();
    let mut problems = Vec::new();
    for option in overrides {
        match apply_override(&mut document, option) {
            Ok(key) => {
                applied.insert(
                    key,
                    option
                        .split_once('=')
                        .map(|(_, v)| v.to_string())
                        .unwrap_or_default(),
                );
            }
            Err(diagnostic) => problems.push(diagnostic),
        }
    }
    let mut checker = Checker {
        file: file.to_path_buf(),
        spans,
        overrides: applied,
        registry,
        problems,
    };
    let pipeline = check(&mut checker, file, &document);
    match pipeline {
        Some(pipeline) if checker.problems.is_empty() => Ok(pipeline),
        _ => Err(PipelineError::Invalid(checker.problems)),
    }
}

fn strip_location(message: &str) -> String {
    match message.find(" at line ") {
        Some(index) => message[..index].to_string(),
        None => message.to_string(),
    }
}

/// Applies `a.b.c=VALUE` (VALUE in YAML) to the document; returns the key path.
fn apply_override(document: &mut Value, option: &str) -> Result<String, Diagnostic> {
    let origin = Origin::Override(option.to_string());
    let (key, raw) = option.split_once('=').ok_or_else(|| {
        Diagnostic::new(origin.clone(), "expected KEY=VALUE")
            .hint("for example --set stages.masks.matrix.seqlen=[16k]")
    })?;
    let value: Value = serde_norway::from_str(raw).map_err(|err| {
        Diagnostic::new(
            origin.clone(),
            format!(
                "the value is not valid YAML: {}",
                strip_location(&err.to_string())
            ),
        )
    })?;
    if let Some(duplicate) = SpanIndex::build(raw).duplicates().first() {
        return Err(Diagnostic::new(
            origin,
            format!(
                "duplicate key `{}` in the value; YAML would keep only the last one",
                duplicate.path
            ),
        ));
    }
    let segments: Vec<&str> = key.split('.').collect();
    if segments.iter().any(|segment| segment.is_empty()) {
        return Err(
            Diagnostic::new(origin, format!("`{key}` is not a key path"))
                .hint("write keys separated by dots, e.g. stages.bench.with.kernel"),
        );
    }
    let mut cursor = document;
    for segment in &segments[..segments.len() - 1] {
        let map = cursor.as_object_mut().ok_or_else(|| {
            Diagnostic::new(
                origin.clone(),
                format!("cannot set `{key}`: `{segment}` is inside a value that is not a mapping"),
            )
        })?;
        cursor = map
            .entry(segment.to_string())
            .or_insert_with(|| Value::Object(Map::new()));
    }
    let map = cursor.as_object_mut().ok_or_else(|| {
        Diagnostic::new(
            origin.clone(),
            format!("cannot set `{key}`: its parent is not a mapping"),
        )
    })?;
    map.insert(segments[segments.len() - 1].to_string(), value);
    Ok(key.to_string())
}

fn check(checker: &mut Checker, file: &Path, document: &Value) -> Option<Pipeline> {
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
    })
}

/// The plugins that `backend` parameters (`plugin/kernel`) name; refuses a plugin that is not
/// found or does not offer the kernel in process.
fn resolve_backends(
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

fn check_stage(
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
                checker.at_key(&["stages", stage_name, "matrix"], err, None);
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

    for param in &spec.params {
        let set =
            params.contains_key(&param.name) || matrix.iter().any(|(key, _)| key == &param.name);
        if !set {
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

fn unknown_parameter(
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

fn doc_suffix(doc: &str) -> String {
    if doc.is_empty() {
        String::new()
    } else {
        format!(" ({doc})")
    }
}

/// `needs: a`, `needs: [a, b]` or `needs: {a: each, b: all}`; returns (stage, collects-all).
fn check_needs(
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

fn check_timeout(
    checker: &mut Checker,
    stage_name: &str,
    timeout: Option<&Value>,
) -> Option<Duration> {
    match limits::timeout(timeout?) {
        Ok(timeout) => Some(timeout),
        Err(err) => {
            checker.at_value(&["stages", stage_name, "timeout"], err, None);
            None
        }
    }
}

/// Resolves `file` parameters against the pipeline's folder and hashes the files they name.
/// A bare word (no `/`, no `.`) is a name the stage defines and is passed through.
fn resolve_files(
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
                        let hint = err.starts_with("cannot read").then(|| {
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

fn check_defaults(checker: &mut Checker, defaults: &Map<String, Value>, stages: &[Stage]) {
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
