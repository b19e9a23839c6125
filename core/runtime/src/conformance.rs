//! `attnbench plugins check LIB`: what a plugin library must do to work in any pipeline. Every
//! call runs in a worker process, so a plugin that crashes or hangs fails a check instead of the
//! checker.

use std::path::{Path, PathBuf};
use std::time::Duration;

use attnbench_sdk::measure::{MeasureStatus, Measurement, UnsupportedScope};
use attnbench_sdk::reference::{self, Arithmetic, HeadMasks, Inputs, Shape, OUTPUT_TENSORS};
use attnbench_sdk::{
    types_failures, FailureKind, InputArtifact, ParamType, StageFailure, StageRequest, StageSpec,
};
use serde::Serialize;
use serde_json::{json, Map, Value};

use crate::host::plugin::{Plugin, Registry};
use crate::host::services::Silent;
use crate::host::worker::{Worker, WorkerOutcome};

/// The small problem every kernel stage is checked on.
const SEQLEN: u64 = 256;
const SHAPE: Shape = Shape {
    heads_q: 2,
    heads_kv: 1,
    seqlen: SEQLEN as usize,
    head_dim: 32,
    head_dim_v: None,
};
const SEED: u64 = 1234;
const TIMEOUT: Duration = Duration::from_secs(120);
/// Relative error allowed against the f64 reference: f32 inputs, products perhaps in TF32.
const TOLERANCE: f64 = Arithmetic::Tf32.tolerance();

#[derive(Debug, Clone, Serialize)]
pub struct Check {
    pub name: String,
    pub passed: bool,
    /// Not run, for the reason in `detail` (a stage that needs a GPU, on a machine without one):
    /// it does not fail the report.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub skipped: bool,
    pub detail: String,
}

#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub library: PathBuf,
    pub plugin: Option<String>,
    pub checks: Vec<Check>,
}

impl Report {
    pub fn passed(&self) -> bool {
        self.checks.iter().all(|c| c.passed)
    }

    fn record(&mut self, name: impl Into<String>, result: Result<String, String>) {
        let (passed, detail) = match result {
            Ok(detail) => (true, detail),
            Err(detail) => (false, detail),
        };
        self.checks.push(Check {
            name: name.into(),
            passed,
            skipped: false,
            detail,
        });
    }

    fn skip(&mut self, name: impl Into<String>, reason: String) {
        self.checks.push(Check {
            name: name.into(),
            passed: true,
            skipped: true,
            detail: reason,
        });
    }
}

/// Runs one stage in a worker (a fresh one when the last died).
struct Runner {
    exe: PathBuf,
    library: PathBuf,
    worker: Option<Worker>,
    env: Vec<(String, String)>,
}

impl Runner {
    fn run(
        &mut self,
        stage: &str,
        request: &StageRequest,
    ) -> Result<Result<Value, StageFailure>, String> {
        let mut worker = match self.worker.take() {
            Some(worker) => worker,
            None => Worker::spawn(&self.exe, &self.library, &self.env)
                .map_err(|err| format!("the worker did not start: {err}"))?,
        };
        let text = serde_json::to_string(request).map_err(|err| err.to_string())?;
        let never = std::sync::atomic::AtomicBool::new(false);
        match worker.run(stage, &text, Some(TIMEOUT), &never, &Silent, None) {
            WorkerOutcome::Finished(outcome) => {
                self.worker = Some(worker);
                Ok(outcome.and_then(|text| {
                    serde_json::from_str(&text).map_err(|err| {
                        StageFailure::new(FailureKind::Failed, format!("malformed result: {err}"))
                    })
                }))
            }
            WorkerOutcome::Crashed(reason) => Err(reason),
            WorkerOutcome::TimedOut => Err(format!("did not answer within {}s", TIMEOUT.as_secs())),
            WorkerOutcome::Stopped => Err("stopped".into()),
        }
    }
}

/// The environment of a worker whose private library folder is the argument.
pub type EnvFor<'a> = Box<dyn Fn(&Path) -> Vec<(String, String)> + 'a>;

/// How the check's workers are set up: the caller knows the machine (GPU libraries), the runtime
/// does not.
pub struct WorkerSetup<'a> {
    pub env: EnvFor<'a>,
    /// Why checks that need a device cannot run on this machine, when they cannot.
    pub no_device: Option<String>,
}

pub fn check(
    library: &Path,
    registry: &Registry,
    worker_exe: &Path,
    setup: &WorkerSetup<'_>,
) -> Report {
    let mut report = Report {
        library: library.to_path_buf(),
        plugin: None,
        checks: Vec::new(),
    };
    let plugin = match Plugin::load(library) {
        Ok(plugin) => plugin,
        Err(err) => {
            report.record("loads", Err(err.to_string()));
            return report;
        }
    };
    report.plugin = Some(plugin.manifest.name.clone());
    report.record(
        "loads",
        Ok(format!(
            "{} {}, ABI {}",
            plugin.manifest.name, plugin.manifest.version, plugin.manifest.abi
        )),
    );
    report.record(
        "manifest is valid",
        plugin
            .manifest
            .validate()
            .map_err(|err| err.to_string())
            .map(|_| {
                let stages: Vec<String> = plugin
                    .manifest
                    .stages
                    .iter()
                    .map(|s| format!("{} ({}, {})", s.name, s.cache_scope, s.isolation))
                    .collect();
                format!("stages: {}", stages.join(", "))
            }),
    );
    let scratch = match tempfile::tempdir() {
        Ok(dir) => dir,
        Err(err) => {
            report.record("scratch directory", Err(err.to_string()));
            return report;
        }
    };
    // Workers search this folder first for the libraries the setup links: it must be one nobody
    // else can write, so it lives in the check's own private scratch folder, never under a
    // guessable name.
    let no_gpu = setup.no_device.clone();
    let env = (setup.env)(&scratch.path().join("worker-libs"));
    let mut runner = Runner {
        exe: worker_exe.to_path_buf(),
        library: plugin.path.clone(),
        worker: None,
        env,
    };
    for spec in &plugin.manifest.stages {
        let mask_input = if spec.is_kernel() {
            mask_input(registry, "causal", scratch.path())
        } else {
            Ok(Vec::new())
        };
        let inputs = match mask_input {
            Ok(inputs) => inputs,
            Err(err) => {
                report.record(format!("{}: mask for checks", spec.name), Err(err));
                continue;
            }
        };
        report.record(
            format!("{}: rejects bad parameters", spec.name),
            bad_parameters(
                &mut runner,
                spec,
                &inputs,
                scratch.path(),
                types_failures(&plugin.manifest.abi),
            ),
        );
        if spec.is_kernel() {
            let missing: Vec<&str> = attnbench_sdk::KERNEL_PARAMS
                .iter()
                .copied()
                .filter(|p| spec.find_param(p).is_none())
                .collect();
            if !missing.is_empty() {
                report.record(
                    format!("{}: kernel parameters", spec.name),
                    Err(format!("a kernel stage must take {}", missing.join(", "))),
                );
                continue;
            }
            if let (true, Some(reason)) = (spec.needs_gpu, &no_gpu) {
                report.skip(format!("{}: every mask pattern", spec.name), reason.clone());
                continue;
            }
            for (index, pattern) in attnbench_mask_patterns(registry).iter().enumerate() {
                let name = format!("{}: {pattern}", spec.name);
                match kernel_on_pattern(&mut runner, registry, spec, pattern, scratch.path()) {
                    Ok(PatternOutcome::Checked(detail)) => report.record(name, Ok(detail)),
                    Ok(PatternOutcome::UnavailableHere(reason)) => {
                        let which = match index {
                            0 => "every mask pattern".to_string(),
                            _ => format!("{pattern} and the patterns after it"),
                        };
                        report.skip(format!("{}: {which}", spec.name), reason);
                        break;
                    }
                    Err(detail) => report.record(name, Err(detail)),
                }
            }
        }
    }
    report
}

/// The catalogue's patterns, from the masks plugin's manifest.
fn attnbench_mask_patterns(registry: &Registry) -> Vec<String> {
    registry
        .get("masks")
        .and_then(|masks| masks.stage("generate"))
        .and_then(|stage| stage.find_param("mask"))
        .and_then(|param| match &param.ty {
            ParamType::Enum(options) => Some(options.clone()),
            _ => None,
        })
        .unwrap_or_default()
}

/// A mask of `pattern` at the check's size, generated by the masks plugin.
fn mask_input(
    registry: &Registry,
    pattern: &str,
    scratch: &Path,
) -> Result<Vec<InputArtifact>, String> {
    let masks = registry
        .get("masks")
        .ok_or("the masks plugin is needed to check kernel stages and was not found")?;
    let dir = scratch.join(format!("mask-{pattern}"));
    std::fs::create_dir_all(&dir).map_err(|err| err.to_string())?;
    let params: Map<String, Value> = serde_json::from_value(json!({
        "mask": pattern, "seqlen": SEQLEN, "window": 32, "block_size": 64, "long_min": 32, "long_max": 96,
        "sparse_block": 32, "min_block": 16, "heads_q": SHAPE.heads_q, "heads_kv": SHAPE.heads_kv,
    }))
    .map_err(|err| err.to_string())?;
    let result = masks
        .call("generate", &params, SEED, &dir, Vec::new())
        .map_err(|err| err.to_string())?;
    Ok(vec![InputArtifact {
        node: format!("masks[mask={pattern}]"),
        uses: "masks/generate".into(),
        params,
        coords: Map::new(),
        dir,
        result,
        status: "ok".into(),
        error: None,
    }])
}

fn request(
    spec: &StageSpec,
    params: Map<String, Value>,
    inputs: &[InputArtifact],
    scratch: &Path,
    tag: &str,
) -> Result<StageRequest, String> {
    let output_dir = scratch.join(format!("out-{}-{tag}", spec.name));
    let _ = std::fs::remove_dir_all(&output_dir);
    std::fs::create_dir_all(&output_dir).map_err(|err| err.to_string())?;
    Ok(StageRequest {
        node: format!("check[{tag}]"),
        stage: spec.name.clone(),
        params,
        seed: SEED,
        output_dir,
        inputs: inputs.to_vec(),
        plugins: Default::default(),
        // The check's own scratch, so that what a plugin keeps between nodes stays out of caches.
        cache_dir: Some(scratch.join("cache")),
    })
}

/// A value of the wrong type for `ty`.
fn wrong_value(ty: &ParamType) -> Option<Value> {
    Some(match ty {
        ParamType::Int | ParamType::Float | ParamType::Size => json!("not a number"),
        ParamType::Bool => json!("maybe"),
        ParamType::String | ParamType::File | ParamType::Backend => json!(12345),
        ParamType::Enum(_) => json!("no-such-choice"),
        ParamType::List(_) => json!("not a list"),
        ParamType::Json => return None,
    })
}

/// Each parameter in turn gets a value of the wrong type: the stage must answer with an error,
/// typed as a parameter error where the plugin types its failures.
fn bad_parameters(
    runner: &mut Runner,
    spec: &StageSpec,
    inputs: &[InputArtifact],
    scratch: &Path,
    typed: bool,
) -> Result<String, String> {
    let defaults = spec.resolve_params(&Map::new()).unwrap_or_default();
    let mut tried = 0;
    for param in &spec.params {
        let Some(bad) = wrong_value(&param.ty) else {
            continue;
        };
        let mut params = defaults.clone();
        params.insert(param.name.clone(), bad.clone());
        let request = request(
            spec,
            params,
            inputs,
            scratch,
            &format!("bad-{}", param.name),
        )?;
        match runner.run(&spec.name, &request) {
            Ok(Err(failure)) if failure.kind == FailureKind::Panicked => {
                return Err(format!(
                    "`{}` = {bad}: it panicked instead of returning an error ({failure})",
                    param.name
                ))
            }
            Ok(Err(failure)) if failure.message.trim().is_empty() => {
                return Err(format!("`{}` = {bad}: an empty error message", param.name))
            }
            // A plugin of ABI 1.2 or later says what kind of failure it is; one that checks its
            // parameters must call a wrong one a parameter error.
            Ok(Err(failure)) if failure.kind != FailureKind::Params && typed => {
                return Err(format!(
                    "`{}` = {bad}: refused as a {:?} failure, not a Params one ({failure})",
                    param.name, failure.kind
                ))
            }
            Ok(Err(_)) => tried += 1,
            Ok(Ok(_)) => return Err(format!("`{}` = {bad} was accepted", param.name)),
            Err(crash) => return Err(format!("`{}` = {bad}: {crash}", param.name)),
        }
    }
    Ok(format!(
        "{tried} parameters refused a value of the wrong type with an error"
    ))
}

/// What a kernel stage did with one pattern, when that was right.
enum PatternOutcome {
    /// It ran and matched the reference, or refused a pattern it does not claim: the detail.
    Checked(String),
    /// It cannot run on this machine at all (a package, library or device it needs is missing
    /// here): the reason. Like a GPU stage on a machine without one, that is skipped, not failed.
    UnavailableHere(String),
}

/// A claimed pattern must run forward and match the reference (and backward too, unless the
/// kernel says it has none); another pattern must be `unsupported` with a reason.
fn kernel_on_pattern(
    runner: &mut Runner,
    registry: &Registry,
    spec: &StageSpec,
    pattern: &str,
    scratch: &Path,
) -> Result<PatternOutcome, String> {
    let inputs = mask_input(registry, pattern, scratch)?;
    let set = attnbench_sdk::mask::MaskSet::load(&inputs[0].dir).map_err(|err| err.to_string())?;
    let masks = HeadMasks::new(&set, &SHAPE);
    let tensors = Inputs::random(&SHAPE, SEED, false);
    let forward = reference::forward(&SHAPE, &masks, &tensors);
    let grads = reference::backward(&SHAPE, &masks, &tensors, &forward);
    let expected = [&forward.out, &forward.lse, &grads.dq, &grads.dk, &grads.dv];
    let mut details = Vec::new();
    for direction in ["fwd", "bwd"] {
        let given: Map<String, Value> = serde_json::from_value(json!({
            "heads_q": SHAPE.heads_q, "heads_kv": SHAPE.heads_kv, "head_dim": SHAPE.head_dim,
            "direction": direction, "dtype": "f32", "outputs": true,
        }))
        .map_err(|err| err.to_string())?;
        let params = spec.resolve_params(&given).map_err(|err| err.to_string())?;
        let request = request(
            spec,
            params,
            &inputs,
            scratch,
            &format!("{pattern}-{direction}"),
        )?;
        let result = runner
            .run(&spec.name, &request)?
            .map_err(|err| format!("{direction}: the stage failed: {err}"))?;
        let measurement: Measurement = serde_json::from_value(result)
            .map_err(|err| format!("{direction}: the result is not a measurement record: {err}"))?;
        let reason = measurement.reason.clone().unwrap_or_default();
        if measurement.status == MeasureStatus::Unsupported
            && measurement.unsupported_scope == Some(UnsupportedScope::Machine)
        {
            return Ok(PatternOutcome::UnavailableHere(reason));
        }
        if !spec.claims(pattern) {
            return match measurement.status {
                MeasureStatus::Unsupported if !reason.trim().is_empty() => Ok(
                    PatternOutcome::Checked(format!("not claimed; unsupported: {reason}")),
                ),
                status => Err(format!(
                    "not claimed, so it must be `unsupported` with a reason, but it is {status:?}"
                )),
            };
        }
        match (direction, measurement.status) {
            (_, MeasureStatus::Ok) => {}
            ("bwd", MeasureStatus::Unsupported) if !reason.trim().is_empty() => {
                details.push(format!("no backward ({reason})"));
                continue;
            }
            (_, status) => return Err(format!("claimed, but {direction} is {status:?}: {reason}")),
        }
        let wanted = if direction == "fwd" { 2 } else { 5 };
        for (name, expected) in OUTPUT_TENSORS.iter().zip(expected).take(wanted) {
            let path = request.output_dir.join(name);
            let actual = reference::read_tensor(&path)
                .map_err(|_| format!("{direction}: it wrote no {name} with `outputs: true`"))?;
            let error = reference::relative_error(&actual, expected);
            if error > TOLERANCE {
                return Err(format!("{direction}: {name} differs from the reference: relative error {error:.2e} > {TOLERANCE:.0e}"));
            }
            details.push(format!(
                "{direction} {} {error:.1e}",
                name.trim_end_matches(".f32")
            ));
        }
    }
    Ok(PatternOutcome::Checked(format!(
        "matches the reference ({})",
        details.join(", ")
    )))
}
