//! `cp`: context-parallel attention. `cp/threads` runs one of the five methods with its ranks as
//! threads of one process on CPU tensors: outputs checked against the single-device reference,
//! bytes each rank sent checked against the method's formula, per-rank time as the paper defines
//! per-GPU throughput (global FLOPs / ranks / the slowest rank's time).

mod comm;
mod layout;
mod local;
mod methods;
mod threads;
mod volume;

use attnbench_sdk::measure::{Harness, Measurement, Quantiles, Shape as MeasuredShape, Throughput};
use attnbench_sdk::reference::{
    self, CheckMode, Element, Forward, Grads, HeadMasks, Inputs, Shape,
};
use attnbench_sdk::{
    kinds, write_json, CacheScope, Host, Isolation, ParamSpec, ParamType, Plugin, PluginError,
    PluginManifest, StageRequest, StageSpec,
};
use serde::Deserialize;
use serde_json::{json, Value};

pub use layout::{Layout, Placement};
pub use methods::{Method, Setup};

struct Cp;

fn choice(options: &[&str]) -> ParamType {
    ParamType::Enum(options.iter().map(|o| o.to_string()).collect())
}

fn default_harness() -> Harness {
    Harness {
        timer: "wall clock of the slowest rank (threads of one process)".into(),
        warmup_reps: 1,
        warmup_s: 0.0,
        min_reps: 3,
        max_reps: 20,
        max_time_s: 2.0,
        target_rel_ci: 0.05,
    }
}

/// Relative error allowed against the f64 reference: the methods compute in f64, so only the
/// outputs' rounding to f32 remains.
const TOLERANCE: f64 = 1e-5;

impl Plugin for Cp {
    fn manifest() -> PluginManifest {
        PluginManifest::new("cp", env!("CARGO_PKG_VERSION"))
            .description("Context-parallel attention: Ulysses, Ring P2P, Ring AllGather, USP, LoongTrain.")
            .stage(
                default_harness().declare(
                    StageSpec::new("threads")
                        .doc("Runs one method with its ranks as threads on CPU tensors: exact outputs, counted bytes.")
                        .param(ParamSpec::new("method", choice(&Method::ALL.map(Method::name))).default("ring_p2p"))
                        .param(ParamSpec::new("world", ParamType::Int).default(4).doc("Ranks."))
                        .param(ParamSpec::new("ulysses", ParamType::Int).default(0).doc("Ulysses group size for usp and loongtrain (0: the largest divisor U of world with U² ≤ world)."))
                        .param(ParamSpec::new("windows", ParamType::Int).default(0).doc("LoongTrain's ring windows (0: the largest divisor m of the ring size R with m² ≤ R, as LongCA-bench)."))
                        .param(ParamSpec::new("placement", choice(&["ring_inner", "ulysses_inner"])).default("ring_inner").doc("Which group is made of consecutive ranks."))
                        .param(ParamSpec::new("direction", choice(&["fwd", "bwd", "fwd_bwd"])).default("fwd"))
                        .param(ParamSpec::new("heads_q", ParamType::Int).default(8))
                        .param(ParamSpec::new("heads_kv", ParamType::Int).default(4))
                        .param(ParamSpec::new("head_dim", ParamType::Int).default(16))
                        .param(ParamSpec::new("dtype", choice(&["bf16", "fp16", "f32"])).default("bf16").doc("Inputs are rounded to it; bytes are counted in it.")),
                )
                .input(kinds::MASK)
                .output(kinds::MEASUREMENT)
                .cache_scope(CacheScope::Machine)
                .isolation(Isolation::Worker)
                .exclusive(),
            )
    }

    fn run(stage: &str, request: StageRequest, host: &Host) -> Result<Value, PluginError> {
        match stage {
            "threads" => threads_stage(&request, host),
            other => Err(PluginError::UnknownStage {
                stage: other.into(),
                known: "threads".into(),
            }),
        }
    }
}

#[derive(Deserialize)]
struct Params {
    method: String,
    world: usize,
    ulysses: usize,
    windows: usize,
    placement: String,
    direction: String,
    heads_q: usize,
    heads_kv: usize,
    head_dim: usize,
    dtype: String,
    #[serde(flatten)]
    harness: attnbench_sdk::measure::HarnessParams,
}

/// The largest divisor x of n with x² ≤ n.
fn balanced_divisor(n: usize) -> usize {
    (1..=n)
        .filter(|x| n % x == 0 && x * x <= n)
        .max()
        .unwrap_or(1)
}

/// The method's group sizes for `world` ranks, or why they do not fit.
pub fn setup(
    method: Method,
    world: usize,
    ulysses: usize,
    windows: usize,
    placement: Placement,
    seqlen: usize,
) -> Result<Setup, String> {
    if world == 0 {
        return Err("world must be at least 1".into());
    }
    let u = match method {
        Method::Ulysses => world,
        Method::RingP2p | Method::RingAllGather => 1,
        Method::Usp | Method::LoongTrain if ulysses == 0 => balanced_divisor(world),
        Method::Usp | Method::LoongTrain => ulysses,
    };
    if world % u != 0 {
        return Err(format!("ulysses ({u}) must divide world ({world})"));
    }
    let ring = world / u;
    let windows = match method {
        Method::LoongTrain if windows == 0 => balanced_divisor(ring),
        Method::LoongTrain => windows,
        _ => 1,
    };
    if ring % windows != 0 {
        return Err(format!(
            "windows ({windows}) must divide the ring size ({ring})"
        ));
    }
    let layout = Layout {
        seqlen,
        ulysses: u,
        ring,
        placement,
    };
    layout.check()?;
    Ok(Setup {
        method,
        layout,
        windows,
    })
}

fn threads_stage(request: &StageRequest, host: &Host) -> Result<Value, PluginError> {
    let p: Params = request.params()?;
    let set = request.mask_set()?;
    set.check_heads(p.heads_q as u64, p.heads_kv as u64, p.head_dim as u64)
        .map_err(PluginError::Params)?;
    let method = Method::parse(&p.method)
        .ok_or_else(|| PluginError::Params(format!("unknown method `{}`", p.method)))?;
    let placement = if p.placement == "ulysses_inner" {
        Placement::UlyssesInner
    } else {
        Placement::RingInner
    };
    let shape = Shape {
        heads_q: p.heads_q,
        heads_kv: p.heads_kv,
        seqlen: set.seqlen as usize,
        head_dim: p.head_dim,
    };
    let setup = setup(
        method,
        p.world,
        p.ulysses,
        p.windows,
        placement,
        shape.seqlen,
    )
    .map_err(PluginError::Params)?;
    let element = Element::parse(&p.dtype)
        .ok_or_else(|| PluginError::Params(format!("dtype `{}`", p.dtype)))?;
    let harness = p.harness.apply(default_harness());
    let mut measurement = Measurement::for_kernel(
        &format!("cp-{}", method.name()),
        ("cp", env!("CARGO_PKG_VERSION")),
        &set,
        MeasuredShape {
            batch: 1,
            heads_q: p.heads_q as u64,
            heads_kv: p.heads_kv as u64,
            head_dim: p.head_dim as u64,
            dtype: p.dtype.clone(),
        },
        &p.direction,
        harness.clone(),
    );
    let inputs = Inputs::random_as(&shape, request.seed, element);
    let backward = p.direction != "fwd";
    let first =
        threads::run(setup, &shape, &set, &inputs, backward).map_err(PluginError::Params)?;
    host.debug("checking the gathered outputs against the single-device reference");
    let forward = Forward {
        out: first.out.clone(),
        lse: first.lse.clone(),
    };
    let grads = first.grads.clone().map(|[dq, dk, dv]| Grads { dq, dk, dv });
    let masks = HeadMasks::new(&set, &shape);
    measurement.correctness = Some(reference::check(
        &shape,
        &masks,
        &inputs,
        &forward,
        grads.as_ref(),
        CheckMode::Full,
        TOLERANCE,
    ));
    let sizes = volume::Sizes {
        tokens: (shape.seqlen / setup.layout.world()) as u64,
        heads_q: p.heads_q as u64,
        heads_kv: p.heads_kv as u64,
        head_dim: p.head_dim as u64,
        element: element.bytes() as u64,
    };
    let (formula_fwd, formula_bwd) = volume::bytes(&setup, &sizes);
    let counted = |elements: &[u64]| {
        elements
            .iter()
            .map(|e| e * element.bytes() as u64)
            .collect::<Vec<_>>()
    };
    let timing = harness.time_with(|| {
        let outcome = threads::run(setup, &shape, &set, &inputs, backward).expect("ran once above");
        let slowest = |times: &[f64]| times.iter().copied().fold(0.0, f64::max);
        match p.direction.as_str() {
            "fwd" => slowest(&outcome.forward_s),
            "bwd" => slowest(&outcome.backward_s),
            _ => slowest(&outcome.forward_s) + slowest(&outcome.backward_s),
        }
    });
    let ranks = setup.layout.world() as u64;
    let per_rank_flops = measurement.flops / ranks;
    let times = Quantiles::of(&timing.samples);
    measurement.tflops = times.map(|t| Throughput::of(per_rank_flops, &t));
    measurement.time_s = times;
    measurement.timing = Some(timing);
    measurement.environment.insert(
        "context_parallel".into(),
        json!({
            "method": method.name(), "world": ranks, "ulysses": setup.layout.ulysses, "ring": setup.layout.ring,
            "windows": setup.windows, "placement": p.placement, "backend": "threads",
            "throughput": "per rank: global FLOPs / ranks / slowest rank's time",
            "bytes_sent_forward": counted(&first.sent_forward), "formula_forward": formula_fwd,
            "bytes_sent_backward": counted(&first.sent_backward), "formula_backward": formula_bwd,
            "forward_s_per_rank": first.forward_s, "backward_s_per_rank": first.backward_s,
        }),
    );
    write_json(&request.output_dir, Measurement::FILE, &measurement)?;
    serde_json::to_value(&measurement).map_err(|err| PluginError::failed(err.to_string()))
}

attnbench_sdk::export_plugin!(Cp);

#[cfg(test)]
mod tests;
