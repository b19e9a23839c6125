//! `python/decode`: one decode step through a Python peer in the bridge (numpy on the CPU; SDPA,
//! FlashAttention-4 and FlashInfer on a GPU), on the SDK's inputs, checked here against the f64
//! reference and recorded as the other decode stages record (latency, bandwidth, the device's
//! copy bandwidth measured by the bridge with the same harness).

use attnbench_sdk::decode::{
    check_step, declare_step, step_record, unchecked, DecodeInputs, StepCheck, StepParams,
};
use attnbench_sdk::measure::Quantiles;
use attnbench_sdk::nvml;
use attnbench_sdk::reference::{self, Element};
use attnbench_sdk::{
    write_json, CacheScope, Isolation, ParamSpec, ParamType, PluginError, StageRequest, StageSpec,
};
use serde::Deserialize;
use serde_json::{json, Value};

use crate::bridge::Reply;
use crate::{default_harness, with_bridge};

attnbench_sdk::named_enum! {
    /// The decode peers the bridge runs.
    pub enum DecodeKernel { Numpy = "numpy", Sdpa = "sdpa", Fa4 = "fa4", Flashinfer = "flashinfer" }
}

/// `python/decode`'s parameters.
#[derive(Deserialize)]
pub struct DecodeParams {
    kernel: DecodeKernel,
    python: String,
    device: crate::Device,
    dtype: Element,
    #[serde(flatten)]
    step: StepParams,
}

/// `python/decode` as the manifest declares it.
pub fn spec() -> StageSpec {
    declare_step(StageSpec::new("decode"), &default_harness(), 8, "32k", (64, 8, 128))
        .doc("Times one decode step of a batch through a Python peer (numpy; SDPA with a padding mask, FA4's varlen or paged call, FlashInfer's batch decode or paged prefill), checked against the f64 reference; records latency and the bandwidth reached beside the device's copy bandwidth.")
        .param(ParamSpec::new("kernel", ParamType::one_of(DecodeKernel::NAMES)).default("numpy").doc("`numpy` (the CPU, f32), `sdpa` (torch's scaled_dot_product_attention over the batch padded to its longest cache, a boolean mask, enable_gqa; contiguous caches), `fa4` (flash_attn.cute.flash_attn_varlen_func: cu_seqlens, or a page_table with seqused_k; one split on Hopper, FA4's heuristic elsewhere), `flashinfer` (BatchDecodeWithPagedKVCacheWrapper for one new token, BatchPrefillWithPagedKVCacheWrapper with causal for several; a contiguous cache as in-order pages)."))
        .param(ParamSpec::new("python", ParamType::String).default("").doc("The interpreter; empty: ATTNBENCH_PYTHON, then the python3 beside the attnbench binary, then python3 on the PATH."))
        .param(ParamSpec::new("device", ParamType::one_of(crate::Device::NAMES)).default("cuda").doc("`cuda`: the node asks for a GPU, which the torch peers need; `cpu`: it does not, and only `numpy` runs (the others record why not)."))
        .param(ParamSpec::new("dtype", Element::param_type(&[Element::Bf16, Element::F16])).default("bf16").doc("The inputs' type (numpy computes in f32 on values rounded to it)."))
        .output("decode")
        .cache_scope(CacheScope::Machine)
        .isolation(Isolation::Worker)
        .exclusive()
        .gpu_when("device", "cuda")
        .timeout_s(1800.0)
}

/// The folder the inputs and outputs pass through, removed however the stage ends.
struct Exchange(std::path::PathBuf);

impl Drop for Exchange {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Runs `python/decode`.
pub fn run(request: &StageRequest) -> Result<Value, PluginError> {
    let p: DecodeParams = request.params()?;
    let problem = p.step.problem()?;
    let on_gpu = p.device == crate::Device::Cuda && p.kernel != DecodeKernel::Numpy;
    let element_bytes = if on_gpu { p.dtype.bytes() } else { 4 } as u64;
    let inputs = DecodeInputs::random(&problem, request.seed, p.dtype);
    let exchange = Exchange(request.output_dir.join("exchange"));
    let exchange = &exchange.0;
    std::fs::create_dir_all(exchange).map_err(|err| PluginError::io(exchange, err))?;
    for (name, values) in [
        ("q.f32", &inputs.q),
        ("k.f32", &inputs.k),
        ("v.f32", &inputs.v),
    ] {
        reference::write_tensor(exchange, name, values)?;
    }
    let harness = p.step.harness.apply(default_harness());
    let params = json!({
        "problem": problem,
        "kernel": p.kernel,
        "dtype": p.dtype,
        "device": if on_gpu { "cuda" } else { "cpu" },
        "pages": problem.page_table(request.seed).map(|table| table.pages),
        "bytes": problem.bytes(element_bytes),
        "inputs_dir": exchange.display().to_string(),
        "outputs_dir": exchange.display().to_string(),
    });
    let python = attnbench_sdk::environment::python_interpreter(&p.python);
    let clocks = || if on_gpu { nvml::clocks() } else { Value::Null };
    let clocks_before = clocks();
    let (reply, hello) = with_bridge(&python, "decode", params, Some(&harness))?;
    let clocks_after = clocks();
    let result = match reply {
        Reply::Ok(result) => result,
        Reply::BadParams(message) => {
            return Err(PluginError::Params(format!("{}: {message}", p.kernel)))
        }
        Reply::Failed(message) => {
            return Err(PluginError::failed(format!("{}: {message}", p.kernel)))
        }
        Reply::Died(message) => {
            return Err(PluginError::failed(format!(
                "{} crashed: {message}",
                p.kernel
            )))
        }
    };
    if result["status"] != "ok" {
        let record = json!({"kernel": p.kernel, "status": result["status"], "reason": result["reason"],
                            "scope": result["scope"], "python": hello});
        write_json(&request.output_dir, "decode.json", &record)?;
        return Ok(record);
    }
    let correctness = if p.step.check == StepCheck::Off {
        unchecked()
    } else {
        let out = reference::read_tensor(&exchange.join("out.f32"))?;
        let lse = match result["lse"] == true {
            true => Some(reference::read_tensor(&exchange.join("lse.f32"))?),
            false => None,
        };
        let tolerance = if on_gpu {
            p.dtype.tolerance()
        } else {
            reference::Arithmetic::F32.tolerance()
        };
        check_step(
            &problem,
            &inputs,
            (&out, lse.as_deref()),
            p.step.check,
            tolerance,
        )
    };
    let samples: Vec<f64> = serde_json::from_value(result["samples"].clone())
        .map_err(|err| PluginError::failed(format!("{}: the bridge's samples: {err}", p.kernel)))?;
    let times =
        Quantiles::of(&samples).ok_or_else(|| PluginError::failed("no repetition was timed"))?;
    let copy = result["copy_bytes_per_s"].as_f64().unwrap_or(f64::NAN);
    let record = step_record(
        &problem,
        element_bytes,
        &times,
        copy,
        json!({
            "kernel": p.kernel,
            "status": "ok",
            "dtype": p.dtype,
            "copy_counted": result["copy_counted"],
            "details": result["details"],
            "correctness": correctness,
            "timing": {"samples": samples, "rel_ci": result["rel_ci"], "stopped": result["stopped"]},
            "harness": harness,
            "environment": result["environment"],
            "python": hello,
            "clocks_before": clocks_before,
            "clocks_after": clocks_after,
        }),
    );
    write_json(&request.output_dir, "decode.json", &record)?;
    Ok(record)
}
