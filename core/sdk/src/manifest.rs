//! The manifest a plugin declares: its stages, their parameters, artifacts, caching and isolation.

use std::fmt;

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::size::parse_size;

/// Hosts ignore manifest fields they do not know, so a plugin built against a newer minor of the
/// SDK still loads in an older attnbench.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct PluginManifest {
    pub name: String,
    pub version: String,
    /// The ABI version the plugin was built against; filled in by the export macro.
    #[serde(default)]
    pub abi: String,
    #[serde(default)]
    pub description: String,
    pub stages: Vec<StageSpec>,
    /// Kernels this plugin also offers as an in-process attention backend
    /// ([`crate::attention`]), for context-parallel plugins.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub attention: Vec<String>,
}

impl PluginManifest {
    pub fn new(name: impl Into<String>, version: impl Into<String>) -> Self {
        PluginManifest {
            name: name.into(),
            version: version.into(),
            abi: attnbench_abi::ABI_VERSION.to_string(),
            description: String::new(),
            stages: Vec::new(),
            attention: Vec::new(),
        }
    }

    /// Offers `kernel` as an in-process attention backend: implement [`crate::Plugin::attention`].
    pub fn attention_kernel(mut self, kernel: impl Into<String>) -> Self {
        self.attention.push(kernel.into());
        self
    }

    pub fn description(mut self, text: impl Into<String>) -> Self {
        self.description = text.into();
        self
    }

    pub fn stage(mut self, stage: StageSpec) -> Self {
        self.stages.push(stage);
        self
    }

    pub fn find_stage(&self, name: &str) -> Option<&StageSpec> {
        self.stages.iter().find(|stage| stage.name == name)
    }

    /// Checks what the host relies on: names usable in `uses:`, unique stages and parameters,
    /// defaults of the declared type.
    pub fn validate(&self) -> Result<(), ManifestError> {
        check_name("plugin name", &self.name)?;
        if self.version.trim().is_empty() {
            return Err(ManifestError::NoVersion(self.name.clone()));
        }
        if self.stages.is_empty() {
            return Err(ManifestError::NoStages(self.name.clone()));
        }
        let mut seen = std::collections::BTreeSet::new();
        for stage in &self.stages {
            check_name("stage name", &stage.name)?;
            if !seen.insert(&stage.name) {
                return Err(ManifestError::StageTwice(stage.name.clone()));
            }
            let mut params = std::collections::BTreeSet::new();
            for param in &stage.params {
                check_name("parameter name", &param.name)?;
                if !params.insert(&param.name) {
                    return Err(ManifestError::ParamTwice {
                        stage: stage.name.clone(),
                        param: param.name.clone(),
                    });
                }
                if let Some(default) = &param.default {
                    param
                        .ty
                        .coerce(default)
                        .map_err(|source| ManifestError::Default {
                            stage: stage.name.clone(),
                            param: param.name.clone(),
                            source,
                        })?;
                }
            }
            if stage.timeout_s.is_some_and(|t| t.is_nan() || t <= 0.0) {
                return Err(ManifestError::Timeout(stage.name.clone()));
            }
        }
        Ok(())
    }
}

/// What is wrong with a plugin's manifest.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ManifestError {
    #[error("{what} `{name}` must start with a letter and use only letters, digits, `_` and `-`")]
    Name { what: &'static str, name: String },
    #[error("plugin `{0}` declares an empty version")]
    NoVersion(String),
    #[error("plugin `{0}` declares no stages")]
    NoStages(String),
    #[error("stage `{0}` is declared twice")]
    StageTwice(String),
    #[error("stage `{stage}` declares parameter `{param}` twice")]
    ParamTwice { stage: String, param: String },
    #[error("stage `{stage}` parameter `{param}`: default {source}")]
    Default {
        stage: String,
        param: String,
        source: ValueError,
    },
    #[error("stage `{0}` declares a timeout that is not positive")]
    Timeout(String),
}

fn check_name(what: &'static str, name: &str) -> Result<(), ManifestError> {
    let ok = !name.is_empty()
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
        && name.chars().next().is_some_and(|c| c.is_ascii_alphabetic());
    if ok {
        Ok(())
    } else {
        Err(ManifestError::Name {
            what,
            name: name.to_string(),
        })
    }
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct StageSpec {
    pub name: String,
    #[serde(default)]
    pub doc: String,
    #[serde(default)]
    pub params: Vec<ParamSpec>,
    /// Artifact kinds this stage reads from its `needs`.
    #[serde(default)]
    pub inputs: Vec<String>,
    /// Artifact kinds this stage writes.
    #[serde(default)]
    pub outputs: Vec<String>,
    #[serde(default)]
    pub cache_scope: CacheScope,
    #[serde(default)]
    pub isolation: Isolation,
    /// Default per-node time limit in seconds (worker isolation only); `timeout` in the pipeline overrides it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout_s: Option<f64>,
    /// The node must have the machine to itself (timings): nothing else runs alongside it.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub exclusive: bool,
    /// The stage runs on a GPU: without one it fails, and `attnbench plugins check` skips the
    /// checks that run it (saying so) instead of counting them as failures.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub needs_gpu: bool,
    /// Kernel stages: the mask patterns this kernel claims to run (empty = every pattern). Asked
    /// for another, it answers `unsupported` with a reason; `attnbench plugins check` holds it to both.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub masks: Vec<String>,
    /// The integer parameter that says how many processes a node starts (a CP stage's `world`):
    /// under Slurm, the job's task count, one per GPU where the stage needs GPUs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tasks_from: Option<String>,
    /// The nodes whose parameter has this value run on GPUs (`device: cuda`), when the stage
    /// does not always need one: a scheduler such as Slurm asks for GPUs for those nodes alone.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu_when: Option<ParamIs>,
}

/// A parameter's value, as a condition on a node.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ParamIs {
    pub param: String,
    pub value: String,
}

impl StageSpec {
    pub fn new(name: impl Into<String>) -> Self {
        StageSpec {
            name: name.into(),
            doc: String::new(),
            params: Vec::new(),
            inputs: Vec::new(),
            outputs: Vec::new(),
            cache_scope: CacheScope::Pure,
            isolation: Isolation::InProcess,
            timeout_s: None,
            exclusive: false,
            needs_gpu: false,
            masks: Vec::new(),
            tasks_from: None,
            gpu_when: None,
        }
    }

    /// Kernel stages: the mask patterns this kernel claims (default: all).
    pub fn masks(mut self, patterns: &[&str]) -> Self {
        self.masks = patterns.iter().map(|p| p.to_string()).collect();
        self
    }

    /// A kernel stage reads a mask and writes a measurement; it takes the standard shape
    /// parameters and, with `outputs: true`, writes its output tensors for checking.
    pub fn is_kernel(&self) -> bool {
        self.inputs.iter().any(|k| k == kinds::MASK)
            && self.outputs.iter().any(|k| k == kinds::MEASUREMENT)
    }

    /// Whether this kernel stage claims to run `pattern`.
    pub fn claims(&self, pattern: &str) -> bool {
        self.masks.is_empty() || self.masks.iter().any(|m| m == pattern)
    }

    /// A benchmark stage: one mask set in, one measurement out, in a worker process with the
    /// machine to itself, cached per machine.
    pub fn measures_masks(self) -> Self {
        self.input(kinds::MASK)
            .output(kinds::MEASUREMENT)
            .cache_scope(CacheScope::Machine)
            .isolation(Isolation::Worker)
            .exclusive()
    }

    /// Marks the stage's nodes as needing the machine to themselves (benchmarks).
    pub fn exclusive(mut self) -> Self {
        self.exclusive = true;
        self
    }

    /// Names the integer parameter that gives a node's process count (see [`StageSpec::tasks_from`]).
    pub fn tasks_from(mut self, param: impl Into<String>) -> Self {
        self.tasks_from = Some(param.into());
        self
    }

    /// The nodes whose `param` is `value` run on GPUs (see [`StageSpec::gpu_when`]).
    pub fn gpu_when(mut self, param: &str, value: &str) -> Self {
        self.gpu_when = Some(ParamIs {
            param: param.into(),
            value: value.into(),
        });
        self
    }

    pub fn needs_gpu(mut self) -> Self {
        self.needs_gpu = true;
        self
    }

    pub fn doc(mut self, text: impl Into<String>) -> Self {
        self.doc = text.into();
        self
    }

    /// Several parameters at once, in order: a set that stages share.
    pub fn with_params(self, params: impl IntoIterator<Item = ParamSpec>) -> Self {
        params.into_iter().fold(self, StageSpec::param)
    }

    pub fn param(mut self, param: ParamSpec) -> Self {
        self.params.push(param);
        self
    }

    pub fn input(mut self, kind: impl Into<String>) -> Self {
        self.inputs.push(kind.into());
        self
    }

    pub fn output(mut self, kind: impl Into<String>) -> Self {
        self.outputs.push(kind.into());
        self
    }

    pub fn cache_scope(mut self, scope: CacheScope) -> Self {
        self.cache_scope = scope;
        self
    }

    pub fn isolation(mut self, isolation: Isolation) -> Self {
        self.isolation = isolation;
        self
    }

    pub fn timeout_s(mut self, seconds: f64) -> Self {
        self.timeout_s = Some(seconds);
        self
    }

    pub fn find_param(&self, name: &str) -> Option<&ParamSpec> {
        self.params.iter().find(|param| param.name == name)
    }

    /// `given` checked against the declared parameters, with defaults filled in and keys sorted:
    /// unknown names, values of the wrong type and missing required values are refused.
    pub fn resolve_params(
        &self,
        given: &Map<String, Value>,
    ) -> Result<Map<String, Value>, ParamsError> {
        for key in given.keys() {
            if self.find_param(key).is_none() {
                let names = self.params.iter().map(|p| p.name.as_str());
                return Err(ParamsError::Unknown {
                    stage: self.name.clone(),
                    key: key.clone(),
                    suggestion: crate::suggestion(key, names, "parameters"),
                });
            }
        }
        let mut params = Map::new();
        for param in &self.params {
            let value = match given.get(&param.name).or(param.default.as_ref()) {
                None if param.optional => continue,
                Some(value) => param
                    .ty
                    .coerce(value)
                    .map_err(|source| ParamsError::Invalid {
                        param: param.name.clone(),
                        source,
                    })?,
                None => {
                    return Err(ParamsError::Required {
                        param: param.name.clone(),
                        ty: param.ty.to_string(),
                    })
                }
            };
            params.insert(param.name.clone(), value);
        }
        if let Some(preset) = params
            .get(crate::shapes::SHAPE_PARAM)
            .and_then(Value::as_str)
            .and_then(crate::shapes::find)
        {
            for (param, value) in preset.apply_to(self, |p| given.get(p))? {
                params.insert(param.into(), value);
            }
        }
        params.sort_keys();
        Ok(params)
    }
}

/// Artifact kinds the built-in stages read and write.
pub mod kinds {
    /// A mask set (`mask.json`), from `masks/generate`.
    pub const MASK: &str = "mask";
    /// A measurement record (`measurement.json`).
    pub const MEASUREMENT: &str = "measurement";
    /// A document-length histogram (`histogram.json`).
    pub const HISTOGRAM: &str = "histogram";
    pub const REPORT: &str = "report";
}

/// The parameters every kernel stage takes, so pipelines and `plugins check` can drive any kernel.
pub const KERNEL_PARAMS: [&str; 6] = [
    "heads_q",
    "heads_kv",
    "head_dim",
    "direction",
    "dtype",
    "outputs",
];

/// What a node's cached result depends on.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum CacheScope {
    /// Only on the plugin, its parameters and its inputs: shareable across machines.
    #[default]
    Pure,
    /// Also on the hardware and software it ran on: measurements.
    Machine,
}

impl std::fmt::Display for CacheScope {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            CacheScope::Pure => "pure",
            CacheScope::Machine => "machine",
        })
    }
}

impl std::fmt::Display for Isolation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Isolation::InProcess => "in_process",
            Isolation::Worker => "worker",
        })
    }
}

/// Where a node runs.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum Isolation {
    /// In the host process: cheapest, for code that cannot crash the host.
    #[default]
    InProcess,
    /// In a persistent `attnbench worker` process: a crash or hang kills only the worker.
    Worker,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ParamSpec {
    pub name: String,
    #[serde(rename = "type")]
    pub ty: ParamType,
    /// The value when neither the pipeline nor the matrix sets one; none = required.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "present"
    )]
    pub default: Option<Value>,
    /// Neither required nor defaulted: a node that does not set it has no such key (so adding
    /// an optional parameter leaves existing cache keys as they were).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub optional: bool,
    #[serde(default)]
    pub doc: String,
}

/// A `default` key that is present is a default, even when its value is `null`.
fn present<'de, D: serde::Deserializer<'de>>(deserializer: D) -> Result<Option<Value>, D::Error> {
    Value::deserialize(deserializer).map(Some)
}

impl ParamSpec {
    pub fn new(name: impl Into<String>, ty: ParamType) -> Self {
        ParamSpec {
            name: name.into(),
            ty,
            default: None,
            optional: false,
            doc: String::new(),
        }
    }

    pub fn optional(mut self) -> Self {
        self.optional = true;
        self
    }

    pub fn default(mut self, value: impl Into<Value>) -> Self {
        self.default = Some(value.into());
        self
    }

    pub fn doc(mut self, text: impl Into<String>) -> Self {
        self.doc = text.into();
        self
    }
}

/// A parameter's type, written in manifests as `int`, `float`, `bool`, `string`, `size`, `json`,
/// `list<T>` or `enum[a|b|c]`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub enum ParamType {
    Int,
    Float,
    Bool,
    String,
    /// A token count: an integer or `1k`/`64K`/`1M`.
    Size,
    /// Any JSON value.
    Json,
    /// A file path (or a bare name the stage gives a meaning, such as `synthetic`). The host
    /// resolves relative paths against the pipeline's folder, refuses missing files, and puts
    /// the file's content digest into the cache key.
    File,
    /// An in-process attention backend, `plugin/kernel` ([`crate::attention`]), or `builtin`
    /// (the stage's own). The host checks that the plugin is found and offers the kernel, hands
    /// the stage its library in [`crate::StageRequest::plugins`], and puts the library's hash
    /// into the cache key.
    Backend,
    List(Box<ParamType>),
    Enum(Vec<String>),
}

/// Why a value does not fit a parameter's type.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ValueError {
    #[error("expected {expected}, found {found}")]
    WrongType { expected: String, found: String },
    #[error("`{given}` is not one of the choices; did you mean `{nearest}`?")]
    NearChoice { given: String, nearest: String },
    #[error("`{given}` is not one of {}", choices.join(", "))]
    NotAChoice { given: String, choices: Vec<String> },
    #[error("item {index}: {source}")]
    Item {
        index: usize,
        source: Box<ValueError>,
    },
    #[error(transparent)]
    Size(crate::SizeError),
}

/// Why a stage's parameters were refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ParamsError {
    #[error("`{stage}` has no parameter `{key}`; {suggestion}")]
    Unknown {
        stage: String,
        key: String,
        suggestion: String,
    },
    #[error("parameter `{param}`: {source}")]
    Invalid { param: String, source: ValueError },
    #[error("parameter `{param}` ({ty}) is required")]
    Required { param: String, ty: String },
    #[error(transparent)]
    Preset(#[from] crate::shapes::PresetError),
}

impl ParamType {
    /// An enum of these names.
    pub fn one_of(options: &[&str]) -> ParamType {
        ParamType::Enum(options.iter().map(|o| o.to_string()).collect())
    }

    /// Checks `value` against the type and returns its canonical form (sizes become integers).
    pub fn coerce(&self, value: &Value) -> Result<Value, ValueError> {
        let wrong = || {
            Err(ValueError::WrongType {
                expected: self.describe(),
                found: describe_value(value),
            })
        };
        match (self, value) {
            (ParamType::Json, _) => Ok(value.clone()),
            (ParamType::Int, Value::Number(n)) if n.is_i64() || n.is_u64() => Ok(value.clone()),
            (ParamType::Float, Value::Number(_)) => Ok(value.clone()),
            (ParamType::Bool, Value::Bool(_)) => Ok(value.clone()),
            (ParamType::String | ParamType::File, Value::String(_)) => Ok(value.clone()),
            (ParamType::Backend, Value::String(text))
                if text == "builtin"
                    || text
                        .split_once('/')
                        .is_some_and(|(p, k)| !p.is_empty() && !k.is_empty()) =>
            {
                Ok(value.clone())
            }
            (ParamType::Size, Value::Number(n)) if n.is_u64() => Ok(value.clone()),
            (ParamType::Size, Value::String(text)) => {
                Ok(Value::from(parse_size(text).map_err(ValueError::Size)?))
            }
            (ParamType::Enum(options), Value::String(text)) => {
                if options.contains(text) {
                    Ok(value.clone())
                } else {
                    let given = text.clone();
                    match crate::nearest(text, options.iter().map(String::as_str)) {
                        Some(nearest) => Err(ValueError::NearChoice {
                            given,
                            nearest: nearest.to_string(),
                        }),
                        None => Err(ValueError::NotAChoice {
                            given,
                            choices: options.clone(),
                        }),
                    }
                }
            }
            (ParamType::List(item), Value::Array(items)) => items
                .iter()
                .enumerate()
                .map(|(index, element)| {
                    item.coerce(element).map_err(|err| ValueError::Item {
                        index,
                        source: Box::new(err),
                    })
                })
                .collect::<Result<Vec<_>, _>>()
                .map(Value::Array),
            _ => wrong(),
        }
    }

    fn describe(&self) -> String {
        match self {
            ParamType::Int => "an integer".into(),
            ParamType::Float => "a number".into(),
            ParamType::Bool => "true or false".into(),
            ParamType::String => "a string".into(),
            ParamType::Size => "a size such as 4096 or 4k".into(),
            ParamType::Json => "any value".into(),
            ParamType::File => "a file path".into(),
            ParamType::Backend => "`builtin` or an attention backend `plugin/kernel`".into(),
            ParamType::List(item) => format!("a list of {}", item.describe()),
            ParamType::Enum(options) => format!("one of {}", options.join(", ")),
        }
    }
}

fn describe_value(value: &Value) -> String {
    match value {
        Value::Null => "nothing (null)".into(),
        Value::Bool(b) => format!("`{b}`"),
        Value::Number(n) => format!("`{n}`"),
        Value::String(s) => format!("the string `{s}`"),
        Value::Array(_) => "a list".into(),
        Value::Object(_) => "a mapping".into(),
    }
}

impl fmt::Display for ParamType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ParamType::Int => f.write_str("int"),
            ParamType::Float => f.write_str("float"),
            ParamType::Bool => f.write_str("bool"),
            ParamType::String => f.write_str("string"),
            ParamType::Size => f.write_str("size"),
            ParamType::Json => f.write_str("json"),
            ParamType::File => f.write_str("file"),
            ParamType::Backend => f.write_str("backend"),
            ParamType::List(item) => write!(f, "list<{item}>"),
            ParamType::Enum(options) => write!(f, "enum[{}]", options.join("|")),
        }
    }
}

impl std::str::FromStr for ParamType {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, String> {
        let text = text.trim();
        Ok(match text {
            "int" => ParamType::Int,
            "float" => ParamType::Float,
            "bool" => ParamType::Bool,
            "string" => ParamType::String,
            "size" => ParamType::Size,
            "json" => ParamType::Json,
            "file" => ParamType::File,
            "backend" => ParamType::Backend,
            _ => {
                if let Some(inner) = text
                    .strip_prefix("list<")
                    .and_then(|rest| rest.strip_suffix('>'))
                {
                    ParamType::List(Box::new(inner.parse()?))
                } else if let Some(inner) = text
                    .strip_prefix("enum[")
                    .and_then(|rest| rest.strip_suffix(']'))
                {
                    let options: Vec<String> =
                        inner.split('|').map(|o| o.trim().to_string()).collect();
                    if options.iter().any(String::is_empty) {
                        return Err(format!("`{text}` has an empty option"));
                    }
                    ParamType::Enum(options)
                } else {
                    return Err(format!(
                        "unknown parameter type `{text}`; use int, float, bool, string, size, json, list<T> or enum[a|b]"
                    ));
                }
            }
        })
    }
}

impl TryFrom<String> for ParamType {
    type Error = String;
    fn try_from(text: String) -> Result<Self, String> {
        text.parse()
    }
}

impl From<ParamType> for String {
    fn from(ty: ParamType) -> String {
        ty.to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn types_round_trip_through_text() {
        for text in [
            "int",
            "float",
            "bool",
            "string",
            "size",
            "json",
            "list<size>",
            "enum[fwd|bwd]",
            "list<enum[a|b]>",
        ] {
            let ty: ParamType = text.parse().unwrap();
            assert_eq!(ty.to_string(), text);
        }
        assert!("list<nope>".parse::<ParamType>().is_err());
        assert!("enum[a||b]".parse::<ParamType>().is_err());
    }

    #[test]
    fn coercion_canonicalises_sizes_and_names_the_mismatch() {
        assert_eq!(ParamType::Size.coerce(&json!("2k")), Ok(json!(2048)));
        assert_eq!(
            ParamType::List(Box::new(ParamType::Size)).coerce(&json!(["1k", 8])),
            Ok(json!([1024, 8]))
        );
        let err = ParamType::Int.coerce(&json!("x")).unwrap_err();
        assert_eq!(err.to_string(), "expected an integer, found the string `x`");
        let err = ParamType::Enum(vec!["fwd".into(), "bwd".into()])
            .coerce(&json!("both"))
            .unwrap_err();
        assert!(matches!(&err, ValueError::NotAChoice { given, .. } if given == "both"));
        assert!(err.to_string().contains("fwd, bwd"), "{err}");
        assert!(ParamType::Int.coerce(&json!(1.5)).is_err());
    }

    #[test]
    fn manifests_validate_defaults_and_names() {
        let good = PluginManifest::new("demo", "0.1.0")
            .stage(StageSpec::new("run").param(ParamSpec::new("n", ParamType::Size).default("1k")));
        assert_eq!(good.validate(), Ok(()));
        let bad_default = PluginManifest::new("demo", "0.1.0")
            .stage(StageSpec::new("run").param(ParamSpec::new("n", ParamType::Int).default("x")));
        assert!(matches!(
            bad_default.validate(),
            Err(ManifestError::Default { param, .. }) if param == "n"
        ));
        let bad_name = PluginManifest::new("de mo", "0.1.0").stage(StageSpec::new("run"));
        let err = bad_name.validate().unwrap_err();
        assert!(
            err.to_string().contains("must start with a letter"),
            "{err}"
        );
    }
}
