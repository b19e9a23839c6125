//! `cpu/benchmark`: attention on the CPU for any mask the IR can express — the naive reference
//! kernel and the tiled multi-threaded one — timed with the SDK's harness and checked against a
//! reference before it is timed. `cpu/decode`: a split-KV decode step on CPU threads.

pub mod decode;
pub mod problem;
pub mod tiled;

use attnbench_sdk::attention::{run_on_host, AttentionCall, AttentionError};
use attnbench_sdk::bench::{self, Cell, KernelBench, Options, Prepared};
use attnbench_sdk::mask::MaskSet;
use attnbench_sdk::measure::{Direction, Harness, Measurement, Memory};
use attnbench_sdk::{
    Host, ParamSpec, ParamType, Plugin, PluginError, PluginManifest, StageRequest, StageSpec,
};
use serde::Deserialize;
use serde_json::{json, Value};

use attnbench_sdk::reference::{self as naive, Arithmetic, CheckMode, Element};
use problem::{Forward, Grads, HeadMasks, Inputs, Shape};

struct Cpu;

attnbench_sdk::named_enum! {
    /// The cpu plugin's kernels.
    enum Kernel { Tiled = "tiled", Naive = "naive" }
}

attnbench_sdk::named_enum! {
    /// How much of the output is compared with the reference.
    enum Check { Auto = "auto", Full = "full", Sampled = "sampled", Off = "off" }
}

#[derive(Deserialize)]
struct Params {
    kernel: Kernel,
    threads: usize,
    check: Check,
    full_check_max_seqlen: usize,
    max_scores_bytes: u64,
    #[serde(flatten)]
    common: attnbench_sdk::measure::KernelParams,
}

/// The CPU harness's settings when a pipeline does not change them.
fn default_harness() -> Harness {
    Harness {
        max_reps: 100,
        ..Harness::default()
    }
}

impl Plugin for Cpu {
    fn manifest() -> PluginManifest {
        PluginManifest::new("cpu", env!("CARGO_PKG_VERSION"))
            .description("Reference attention on the CPU: any mask, forward and backward, MHA and GQA.")
            .stage(
                default_harness()
                    .declare(StageSpec::new("benchmark"))
                    .doc("Times one kernel on one mask (from a masks/generate node) and checks its output.")
                    .param(ParamSpec::new("kernel", ParamType::one_of(Kernel::NAMES)).default("tiled").doc("`tiled` (online softmax, threads) or `naive` (f64, materialised scores)."))
                    .param(ParamSpec::new("direction", ParamType::one_of(Direction::NAMES)).default("fwd").doc("`bwd` is timed alone, after one forward outside the timing."))
                    .param(ParamSpec::new("heads_q", ParamType::Int).default(64).doc("Query heads."))
                    .param(ParamSpec::new("heads_kv", ParamType::Int).default(8).doc("Key/value heads (GQA when fewer than heads_q)."))
                    .param(ParamSpec::new("head_dim", ParamType::Int).default(128).doc("Head dimension."))
                        .param(attnbench_sdk::shapes::value_dim_param())
                        .param(attnbench_sdk::shapes::shape_param())
                    .param(ParamSpec::new("dtype", Element::param_type(&[Element::F32, Element::Bf16])).default("f32").doc("Input precision (bf16 rounds the inputs; arithmetic is f32, or f64 for naive)."))
                    .param(ParamSpec::new("threads", ParamType::Int).default(0).doc("Threads for the tiled kernel (0 = one per CPU)."))
                    .param(ParamSpec::new("check", ParamType::one_of(Check::NAMES)).default("auto").doc(
                        "Correctness: `full` compares every output with the naive kernel, `sampled` 64 rows per head with an independent per-row reference; `auto` is full up to full_check_max_seqlen.",
                    ))
                    .param(ParamSpec::new("full_check_max_seqlen", ParamType::Size).default(1024).doc("Longest sequence `auto` checks in full."))
                    .param(ParamSpec::new("max_scores_bytes", ParamType::Size).default("1G").doc("The naive kernel refuses (unsupported) when its score matrix would be larger."))
                    .param(ParamSpec::new("outputs", ParamType::Bool).default(false).doc("Also write the output tensors (out.f32, lse.f32 and, with a backward, dq/dk/dv.f32) for checking."))
                    .measures_masks(),
            )
            .stage(decode::spec())
            .attention_kernel("reference")
    }

    /// `reference`: exact f64 attention of one block on the host, the local backend that
    /// context parallelism on CPU threads runs through the in-process interface.
    fn attention(kernel: &str, call: &AttentionCall<'_>) -> Result<(), AttentionError> {
        match kernel {
            "reference" => run_on_host(call),
            other => Err(AttentionError::UnknownKernel {
                kernel: other.to_string(),
                offered: "the cpu plugin offers `reference`".into(),
            }),
        }
    }

    fn run(stage: &str, request: StageRequest, host: &Host) -> Result<Value, PluginError> {
        match stage {
            "benchmark" => {}
            "decode" => return decode::stage(&request),
            _ => {
                return Err(PluginError::UnknownStage {
                    stage: stage.into(),
                    known: "benchmark, decode".into(),
                })
            }
        }
        let params: Params = request.params()?;
        let set = request.mask_set()?;
        benchmark(&params, &set, request.seed, host, &request.output_dir)?
            .write(&request.output_dir)
    }
}

fn benchmark(
    params: &Params,
    set: &MaskSet,
    seed: u64,
    host: &Host,
    output_dir: &std::path::Path,
) -> Result<Measurement, PluginError> {
    set.check_heads(
        params.common.heads_q as u64,
        params.common.heads_kv as u64,
        params.common.head_dim as u64,
    )?;
    let shape = params.common.shape(set.seqlen as usize);
    let threads = if params.threads == 0 {
        std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1)
    } else {
        params.threads
    };
    let harness = params.common.harness.apply(default_harness());
    let kernel = format!("cpu-{}", params.kernel);
    let cell = Cell::of(&params.common, set, seed);
    let record = cell.record(&kernel, ("cpu", env!("CARGO_PKG_VERSION")), harness.clone());
    if params.check != Check::Off {
        host.debug("the outputs are checked against the reference before they are timed");
    }
    let options = Options {
        no_check: params.check == Check::Off,
        ..Options::of(&params.common, output_dir)
    };
    let mut kernel = CpuKernel {
        params,
        // The naive kernel is the single-threaded textbook one (its record says threads: 1).
        threads: if params.kernel == Kernel::Tiled {
            threads
        } else {
            1
        },
        masks: HeadMasks::new(set, &shape),
        inputs: None,
        forward: None,
        grads: None,
    };
    bench::run(&mut kernel, &cell, &harness, record, options)
}

/// One of the cpu plugin's kernels under the SDK's benchmark protocol.
struct CpuKernel<'a> {
    params: &'a Params,
    threads: usize,
    masks: HeadMasks<'a>,
    inputs: Option<(Shape, Inputs)>,
    forward: Option<Forward>,
    grads: Option<Grads>,
}

impl KernelBench for CpuKernel<'_> {
    fn unsupported(&self, cell: &Cell<'_>) -> Option<String> {
        let bytes = naive::score_bytes(&cell.shape);
        (self.params.kernel == Kernel::Naive && bytes > self.params.max_scores_bytes).then(|| {
            format!(
                "the naive kernel materialises a {0}×{0} f64 score matrix ({1:.1} GiB), above max_scores_bytes ({2:.1} GiB)",
                cell.shape.seqlen,
                bytes as f64 / (1u64 << 30) as f64,
                self.params.max_scores_bytes as f64 / (1u64 << 30) as f64
            )
        })
    }

    fn prepare(
        &mut self,
        cell: &Cell<'_>,
        inputs: &Inputs,
        record: &mut Measurement,
    ) -> Result<Prepared, PluginError> {
        record.details.insert("threads".into(), json!(self.threads));
        self.inputs = Some((cell.shape, inputs.clone()));
        Ok(Prepared::Ready)
    }

    fn forward(&mut self) -> Result<(), PluginError> {
        let (shape, inputs) = self.inputs.as_ref().ok_or_else(unprepared)?;
        self.forward = Some(match self.params.kernel {
            Kernel::Naive => naive::forward_with_threads(shape, &self.masks, inputs, 1),
            Kernel::Tiled => tiled::forward(shape, &self.masks, inputs, self.threads),
        });
        Ok(())
    }

    fn backward(&mut self) -> Result<(), PluginError> {
        let (shape, inputs) = self.inputs.as_ref().ok_or_else(unprepared)?;
        let forward = self.forward.as_ref().ok_or_else(unprepared)?;
        self.grads = Some(match self.params.kernel {
            Kernel::Naive => naive::backward_with_threads(shape, &self.masks, inputs, forward, 1),
            Kernel::Tiled => tiled::backward(shape, &self.masks, inputs, forward, self.threads),
        });
        Ok(())
    }

    fn outputs(&mut self, backward: bool) -> Result<(Forward, Option<Grads>), PluginError> {
        let forward = self.forward.clone().ok_or_else(unprepared)?;
        let grads = if backward {
            Some(self.grads.clone().ok_or_else(unprepared)?)
        } else {
            None
        };
        Ok((forward, grads))
    }

    fn check_mode(&self, cell: &Cell<'_>) -> CheckMode {
        let full = match self.params.check {
            Check::Full => true,
            Check::Sampled | Check::Off => false,
            Check::Auto => {
                cell.shape.seqlen <= self.params.full_check_max_seqlen
                    && self.params.kernel != Kernel::Naive
            }
        };
        if full {
            CheckMode::Full
        } else {
            CheckMode::Sampled { rows: 64 }
        }
    }

    /// The kernels compute in f32 (the naive one in f64) whatever the inputs' type.
    fn tolerance(&self, _cell: &Cell<'_>) -> f64 {
        Arithmetic::F32.tolerance()
    }

    fn memory(&mut self, cell: &Cell<'_>) -> Option<Memory> {
        Some(memory(self.params, &cell.shape, self.threads))
    }
}

fn unprepared() -> PluginError {
    PluginError::failed("the cpu kernel ran before it was prepared")
}

/// Bytes the kernel's buffers occupy at their peak: inputs, outputs and scratch.
fn memory(params: &Params, shape: &Shape, threads: usize) -> Memory {
    let float = 4u64;
    let q = shape.q_len() as u64 * float;
    let k = shape.kv_len() as u64 * float;
    let v = shape.v_len() as u64 * float;
    let out = shape.out_len() as u64 * float;
    let lse = (shape.heads_q * shape.seqlen) as u64 * float;
    let backward = params.common.backward();
    // Backward inputs: dO, O and the LSE; its outputs dQ, dK, dV.
    let inputs = q + k + v + if backward { 2 * out + lse } else { 0 };
    let outputs = if backward { q + k + v } else { out + lse };
    let scratch = match params.kernel {
        Kernel::Naive => naive::score_bytes(shape) + if backward { q + k + v } else { 0 },
        Kernel::Tiled => threads as u64 * tiled::workspace_bytes_per_thread(),
    };
    Memory {
        peak_bytes: inputs + outputs + scratch,
        above_inputs_bytes: outputs + scratch,
        method: "sum of the buffers the kernel allocates".into(),
    }
}

attnbench_sdk::export_plugin!(Cpu);

#[cfg(test)]
mod tests;
