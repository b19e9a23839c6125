//! Pipeline files: parsing, `--set` overrides ([`overrides`]), and validation against the
//! plugins' manifests ([`check`], [`stage`], [`resolve`]), all before anything runs. Problems are
//! collected by one [`checker::Checker`], each at the place in the file (or the `--set` option)
//! it comes from.
//!
//! The file's typed model is [`Pipeline`] and its [`Stage`]s, and the checker is what builds it
//! from the YAML tree. A `#[derive(Deserialize)]` model of the file would stop at the first wrong
//! field and place every problem at one position; walking the tree lets each key be checked on
//! its own, so a file with five mistakes gets five diagnostics at five lines (`tests.rs`), and
//! parameters can only be typed once the plugin a stage `uses` is known anyway.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use attnbench_sdk::{ParamType, StageSpec};
use serde_json::{Map, Value};

use crate::diagnostic::{Diagnostic, Origin};
use crate::host::plugin::{Plugin, Registry};
use checker::Checker;
use overrides::{apply_override, strip_location};
use spans::SpanIndex;

mod check;
mod checker;
pub(crate) mod limits;
mod overrides;
pub(crate) mod presets;
mod resolve;
pub(crate) mod spans;
mod stage;
#[cfg(test)]
mod tests;

pub use limits::{MAX_FILE_BYTES, MAX_NODES, MAX_PIPELINE_BYTES, MAX_TIMEOUT, MIN_TIMEOUT};

const TOP_KEYS: [&str; 6] = [
    "name",
    "description",
    "seed",
    "defaults",
    "executor",
    "stages",
];
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
    /// Where the nodes run, as the pipeline says (the user's config file and `--executor`
    /// complete it).
    pub executor: crate::slurm::config::ExecutorSection,
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
    let pipeline = check::check(&mut checker, file, &document);
    match pipeline {
        Some(pipeline) if checker.problems.is_empty() => Ok(pipeline),
        _ => Err(PipelineError::Invalid(checker.problems)),
    }
}
