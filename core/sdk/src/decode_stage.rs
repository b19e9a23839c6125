//! What the timed decode stages share: their batch, check and harness parameters, the check of
//! a step's output against the f64 reference, and the record of its speed.

use serde::Deserialize;

use super::{difference, first_group, reference, DecodeError, DecodeInputs, DecodeProblem};
use crate::{ParamSpec, ParamType, StageSpec};

crate::named_enum! {
    /// How much of a decode step's output is compared with the f64 reference before timing:
    /// `full` every row, `group` KV head 0's group of query heads (1/heads_kv of the cost),
    /// `auto` full unless that would take more than about ten seconds, `off` none.
    pub enum StepCheck { Auto = "auto", Full = "full", Group = "group", Off = "off" }
}

/// Multiply-adds of the f64 reference (two a key, a row and a dimension) above which `auto`
/// checks KV head 0's group only: about ten seconds on one core.
pub const FULL_CHECK_WORK: u64 = 10_000_000_000;

/// The `check` parameter of the decode stages.
fn check_param() -> ParamSpec {
    ParamSpec::new("check", ParamType::one_of(StepCheck::NAMES))
        .default("auto")
        .doc("O and LSE against the f64 reference before timing: `full` every row, `group` KV head 0's group of rows (1/heads_kv of the cost), `auto` full unless the reference would take more than about ten seconds, `off`.")
}

/// The record's `correctness` when the step is not checked.
pub fn unchecked() -> serde_json::Value {
    serde_json::json!({"checked": "off"})
}

/// A kernel's O `[heads_q][rows][head_dim]` (and LSE `[heads_q][rows]`, where the kernel gives
/// one) against the f64 reference, as `mode` says: the record's `correctness`.
pub fn check_step(
    problem: &DecodeProblem,
    inputs: &DecodeInputs,
    (out, lse): (&[f32], Option<&[f32]>),
    mode: StepCheck,
    tolerance: f64,
) -> serde_json::Value {
    let work = 2 * problem.keys() * problem.heads_q * problem.queries * problem.head_dim;
    let (expected, checked) = match mode {
        StepCheck::Off => return unchecked(),
        StepCheck::Full => (reference(problem, inputs), "every row"),
        StepCheck::Auto if work <= FULL_CHECK_WORK => (reference(problem, inputs), "every row"),
        StepCheck::Auto | StepCheck::Group => {
            let (group, group_inputs) = first_group(problem, inputs);
            (
                reference(&group, &group_inputs),
                "every row of KV head 0's group of query heads",
            )
        }
    };
    // A value the kernel did not write (a short output) or wrote as NaN is an infinite error, so a
    // broken kernel cannot pass by omission. The group's rows are a prefix of the whole step's.
    let worst = |ours: &[f32], theirs: &[f64], whole: u64| {
        if ours.len() as u64 != whole {
            return f64::INFINITY;
        }
        ours.iter()
            .zip(theirs)
            .map(|(&x, &y)| difference(f64::from(x), y))
            .fold(0.0, f64::max)
    };
    let rows = problem.heads_q * problem.rows();
    let out_error = worst(out, &expected.out, rows * problem.head_dim);
    let lse_error = lse.map(|lse| worst(lse, &expected.lse, rows));
    let passed = out_error <= tolerance && lse_error.is_none_or(|e| e <= tolerance);
    serde_json::json!({
        "reference": "f64 over every key (decode::reference)",
        "checked": format!("O{} of {checked}", if lse.is_some() { " and LSE" } else { " (the kernel returns no LSE)" }),
        "errors": {"out": out_error, "lse": lse_error},
        "max_error": lse_error.map_or(out_error, |e| e.max(out_error)),
        "tolerance": tolerance,
        "passed": passed,
    })
}

/// The batch a decode stage describes, read from the parameters [`declare_batch`] declares
/// (`#[serde(flatten)]` it into the stage's own).
#[derive(Debug, Clone, Deserialize)]
pub struct BatchParams {
    pub batch: usize,
    pub kv_len: u64,
    pub queries: u64,
    pub heads_q: u64,
    pub heads_kv: u64,
    pub head_dim: u64,
    pub page_size: u64,
}

impl BatchParams {
    /// The step these parameters describe ([`DecodeProblem::stepped`]).
    pub fn problem(&self) -> Result<DecodeProblem, DecodeError> {
        DecodeProblem::stepped(
            self.batch,
            self.kv_len,
            self.queries,
            (self.heads_q, self.heads_kv, self.head_dim),
            self.page_size,
        )
    }
}

/// Declares the parameters of [`BatchParams`] on `stage`, with a stage's own defaults for the
/// batch, the longest cache and the heads `(heads_q, heads_kv, head_dim)`.
pub fn declare_batch(
    stage: StageSpec,
    batch: usize,
    kv_len: &str,
    heads: (u64, u64, u64),
) -> StageSpec {
    stage
        .param(ParamSpec::new("batch", ParamType::Int).default(batch).doc("Sequences; their KV lengths are kv_len, kv_len − kv_len/batch, … (each its own)."))
        .param(ParamSpec::new("kv_len", ParamType::Size).default(kv_len).doc("The longest sequence's KV tokens, the new ones included."))
        .param(ParamSpec::new("queries", ParamType::Int).default(1).doc("New tokens per sequence (1–16, as speculative decoding verifies several), causal among themselves."))
        .param(ParamSpec::new("heads_q", ParamType::Int).default(heads.0))
        .param(ParamSpec::new("heads_kv", ParamType::Int).default(heads.1))
        .param(ParamSpec::new("head_dim", ParamType::Int).default(heads.2))
        .param(ParamSpec::new("page_size", ParamType::Int).default(0).doc("0: each sequence's cache contiguous; 16 or 64: pages of a shuffled pool, read through the page table."))
}

/// What every timed decode stage takes: the batch ([`declare_batch`]), the check and the
/// harness's settings, declared together by [`declare_step`] (`#[serde(flatten)]` it into the
/// stage's own parameters).
#[derive(Debug, Clone, Deserialize)]
pub struct StepParams {
    pub check: StepCheck,
    #[serde(flatten)]
    pub batch: BatchParams,
    #[serde(flatten)]
    pub harness: crate::measure::HarnessParams,
}

impl StepParams {
    /// The step the batch parameters describe, or a parameters error saying why there is none.
    pub fn problem(&self) -> Result<DecodeProblem, crate::PluginError> {
        self.batch
            .problem()
            .map_err(|err| crate::PluginError::Params(err.to_string()))
    }
}

/// A timed decode stage's shared parameters, the harness's with `harness`'s defaults.
pub fn declare_step(
    stage: StageSpec,
    harness: &crate::measure::Harness,
    batch: usize,
    kv_len: &str,
    heads: (u64, u64, u64),
) -> StageSpec {
    harness
        .declare(declare_batch(stage, batch, kv_len, heads))
        .param(check_param())
}

/// What every decode measurement records about its step and speed: the batch, FLOPs, the bytes
/// the step must move (in `element_bytes` a value), the time quantiles, latency, the bandwidth
/// reached and its share of the machine's copy bandwidth (`copy_bytes_per_s`, bytes read plus
/// written per second); then the keys of the stage's `own` object.
pub fn step_record(
    problem: &DecodeProblem,
    element_bytes: u64,
    times: &crate::measure::Quantiles,
    copy_bytes_per_s: f64,
    own: serde_json::Value,
) -> serde_json::Value {
    let bytes = problem.bytes(element_bytes);
    let bandwidth = bytes as f64 / times.p50;
    // The problem's own fields first (kv_lens, queries, heads, page_size), as it serialises.
    let mut record = serde_json::to_value(problem).expect("a DecodeProblem serialises");
    let measured = serde_json::json!({
        "flops": problem.flops(),
        "bytes": bytes,
        "bytes_counted": format!("K and V read once per KV head, Q read and O written once, {element_bytes} bytes a value"),
        "time_s": times,
        "latency_us": times.p50 * 1e6,
        "bandwidth_gbs": bandwidth / 1e9,
        "copy_gbs": copy_bytes_per_s / 1e9,
        "of_copy_bandwidth": bandwidth / copy_bytes_per_s,
        "tflops": problem.flops() as f64 / times.p50 / 1e12,
    });
    if let Some(map) = record.as_object_mut() {
        for part in [measured, own] {
            if let serde_json::Value::Object(part) = part {
                map.extend(part);
            }
        }
    }
    record
}
