//! One tidy row per measurement, from successful inputs (their measurement records) and from
//! collected inputs that failed (their status and reason).

use attnbench_sdk::measure::{text_of, MeasureStatus, Measurement, Quantiles, Throughput};
use attnbench_sdk::{parse_size, InputArtifact};
use serde::Serialize;
use serde_json::Value;

#[derive(Debug, Clone, Serialize)]
pub struct Row {
    pub node: String,
    pub kernel: String,
    pub mask: String,
    pub seqlen: u64,
    pub direction: String,
    pub heads_q: u64,
    pub heads_kv: u64,
    pub head_dim: u64,
    /// The model preset the node named (`shape:`), if any.
    pub shape: Option<String>,
    pub dtype: String,
    pub status: String,
    pub reason: Option<String>,
    pub flops: Option<u64>,
    pub time_s: Option<Quantiles>,
    pub tflops: Option<Throughput>,
    pub peak_bytes: Option<u64>,
    pub above_inputs_bytes: Option<u64>,
    pub correct: Option<bool>,
    pub max_error: Option<f64>,
    /// Block-sparse masks: the kept fraction and the block size.
    pub density: Option<f64>,
    pub sparse_block: Option<u64>,
    /// The machine, GPU and plugin details of the run, as a person reads them.
    #[serde(skip)]
    pub environment: Vec<(String, String)>,
}

impl Row {
    pub fn is_ok(&self) -> bool {
        self.status == "ok"
    }
}

fn status_name(status: MeasureStatus) -> String {
    serde_json::to_value(status)
        .ok()
        .and_then(|v| v.as_str().map(String::from))
        .unwrap_or_else(|| "error".into())
}

pub fn from_measurement(input: &InputArtifact, m: Measurement) -> Row {
    let max_error = m.correctness.as_ref().map(|c| {
        c.errors
            .values()
            .filter_map(Value::as_f64)
            .fold(0.0, f64::max)
    });
    // Context-parallel results are per method and world size: one line each.
    let environment = described(&m);
    let kernel = match &m.cp {
        Some(cp) => format!("{} ×{}", m.kernel, cp.world),
        None => m.kernel,
    };
    Row {
        node: input.node.clone(),
        kernel,
        mask: m.mask.pattern,
        seqlen: m.mask.seqlen,
        direction: m.direction.to_string(),
        heads_q: m.shape.heads_q as u64,
        heads_kv: m.shape.heads_kv as u64,
        head_dim: m.shape.head_dim as u64,
        shape: preset_of(input),
        dtype: m.dtype.to_string(),
        status: status_name(m.status),
        reason: m.reason,
        flops: Some(m.flops),
        time_s: m.time_s,
        tflops: m.tflops,
        peak_bytes: m.memory.as_ref().map(|x| x.peak_bytes),
        above_inputs_bytes: m.memory.as_ref().map(|x| x.above_inputs_bytes),
        correct: m.correctness.as_ref().map(|c| c.passed),
        max_error,
        density: m.mask.params.get("density").and_then(Value::as_f64),
        sparse_block: m.mask.params.get("sparse_block").and_then(Value::as_u64),
        environment,
    }
}

/// Every machine, GPU and detail entry of a record, flattened to `section.name: value`.
fn described(m: &Measurement) -> Vec<(String, String)> {
    let mut entries = Vec::new();
    let mut add = |section: &str, value: Value| {
        if let Value::Object(map) = value {
            for (key, value) in map {
                entries.push((format!("{section}.{key}"), text_of(&value)));
            }
        }
    };
    add(
        "machine",
        serde_json::to_value(&m.machine).unwrap_or_default(),
    );
    if let Some(gpu) = &m.gpu {
        add("gpu", serde_json::to_value(gpu).unwrap_or_default());
    }
    add("details", Value::Object(m.details.clone()));
    entries
}

/// The `shape:` preset a node named.
fn preset_of(input: &InputArtifact) -> Option<String> {
    let preset = input.params.get(attnbench_sdk::shapes::SHAPE_PARAM)?;
    preset.as_str().map(String::from)
}

/// A node that failed before it could write a measurement (crashed, timed out, …).
pub fn from_failure(input: &InputArtifact) -> Row {
    let text = |key: &str| -> Option<String> {
        input
            .params
            .get(key)
            .or_else(|| input.coords.get(key))
            .and_then(|v| match v {
                Value::String(s) => Some(s.clone()),
                Value::Null => None,
                other => Some(other.to_string()),
            })
    };
    let number = |key: &str| input.params.get(key).and_then(Value::as_u64).unwrap_or(0);
    let plugin = input.uses.split('/').next().unwrap_or_default();
    Row {
        node: input.node.clone(),
        kernel: text("kernel")
            .map(|k| format!("{plugin}-{k}"))
            .unwrap_or_else(|| input.uses.clone()),
        mask: text("mask").unwrap_or_else(|| "?".into()),
        seqlen: text("seqlen")
            .and_then(|s| parse_size(&s).ok())
            .unwrap_or(0),
        direction: text("direction").unwrap_or_else(|| "fwd".into()),
        heads_q: number("heads_q"),
        heads_kv: number("heads_kv"),
        head_dim: number("head_dim"),
        shape: preset_of(input),
        dtype: text("dtype").unwrap_or_default(),
        status: input.status.clone(),
        reason: input.error.clone(),
        flops: None,
        time_s: None,
        tflops: None,
        peak_bytes: None,
        above_inputs_bytes: None,
        correct: None,
        max_error: None,
        density: input
            .coords
            .get("density")
            .and_then(|v| v.as_str()?.parse().ok()),
        sparse_block: None,
        environment: Vec::new(),
    }
}

/// Rows from every input: measurement records where they exist, failures otherwise.
/// The cost-model curves among the inputs.
/// Every cost model's points, and its predictions beside the measured cells it was given.
pub fn predictions(
    inputs: &[InputArtifact],
) -> Result<
    (
        Vec<attnbench_sdk::measure::Prediction>,
        Vec<attnbench_sdk::measure::Comparison>,
    ),
    String,
> {
    let (mut points, mut comparisons) = (Vec::new(), Vec::new());
    for input in inputs.iter().filter(|i| i.succeeded()) {
        let path = input.dir.join(attnbench_sdk::measure::Predictions::FILE);
        let Ok(bytes) = std::fs::read(&path) else {
            continue;
        };
        let predictions: attnbench_sdk::measure::Predictions = serde_json::from_slice(&bytes)
            .map_err(|err| format!("{}: not a cost model's predictions: {err}", path.display()))?;
        points.extend(predictions.points);
        comparisons.extend(predictions.against_measurements);
    }
    Ok((points, comparisons))
}

pub fn collect(inputs: &[InputArtifact]) -> Result<Vec<Row>, String> {
    let mut rows = Vec::new();
    for input in inputs {
        if !input.succeeded() {
            rows.push(from_failure(input));
            continue;
        }
        let path = input.dir.join(Measurement::FILE);
        let Ok(bytes) = std::fs::read(&path) else {
            continue;
        };
        let measurement: Measurement = serde_json::from_slice(&bytes)
            .map_err(|err| format!("{}: not a measurement record: {err}", path.display()))?;
        rows.push(from_measurement(input, measurement));
    }
    rows.sort_by(|a, b| {
        (&a.mask, &a.direction, &a.kernel, a.seqlen).cmp(&(
            &b.mask,
            &b.direction,
            &b.kernel,
            b.seqlen,
        ))
    });
    Ok(rows)
}
