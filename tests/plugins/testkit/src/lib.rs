//! A plugin that behaves well and badly on purpose, so that the runtime's scheduling, caching
//! and fault handling are tested against a real shared library and real worker processes.

use std::time::Duration;

use attnbench_sdk::{
    kinds, write_json, CacheScope, Host, Isolation, ParamSpec, ParamType, Plugin, PluginError,
    PluginManifest, StageRequest, StageSpec,
};
use serde::Deserialize;
use serde_json::{json, Value};

struct Testkit;

#[derive(Deserialize)]
struct EchoParams {
    value: Value,
    sleep_ms: u64,
    size: u64,
}

fn echo_stage(name: &str, isolation: Isolation) -> StageSpec {
    StageSpec::new(name)
        .doc("Returns its parameters and the ids of its inputs, after sleeping `sleep_ms`.")
        .param(
            ParamSpec::new("value", ParamType::Json)
                .default(Value::Null)
                .doc("Echoed back."),
        )
        .param(
            ParamSpec::new("sleep_ms", ParamType::Int)
                .default(0)
                .doc("Milliseconds to sleep first."),
        )
        .param(
            ParamSpec::new("size", ParamType::Size)
                .default(0)
                .doc("A size parameter, echoed."),
        )
        .output("echo")
        .isolation(isolation)
}

fn misbehaving(name: &str, doc: &str) -> StageSpec {
    StageSpec::new(name)
        .doc(doc)
        .isolation(Isolation::Worker)
        .timeout_s(60.0)
}

impl Plugin for Testkit {
    fn manifest() -> PluginManifest {
        PluginManifest::new("testkit", env!("CARGO_PKG_VERSION"))
            .description("Well- and ill-behaved stages for testing the attnbench runtime.")
            .stage(echo_stage("echo", Isolation::InProcess))
            .stage(echo_stage("echo-worker", Isolation::Worker))
            .stage(
                echo_stage("measure", Isolation::Worker)
                    .cache_scope(CacheScope::Machine)
                    .exclusive(),
            )
            .stage(StageSpec::new("panic").doc("Panics (in process: caught by the SDK)."))
            .stage(misbehaving("panic-worker", "Panics inside a worker."))
            .stage(misbehaving("abort", "Aborts the process."))
            .stage(misbehaving("segfault", "Dereferences a null pointer."))
            .stage(misbehaving("hang", "Sleeps forever, ignoring cancellation.").timeout_s(1.0))
            .stage(echo_stage("hang-in-process", Isolation::InProcess).doc(
                "Checks its parameters, then sleeps forever in process, ignoring cancellation.",
            ))
            .stage(
                StageSpec::new("malformed").doc("Returns a bare string instead of a JSON object."),
            )
            .stage(misbehaving(
                "noisy",
                "Prints to stdout and stderr, then succeeds.",
            ))
            .stage(StageSpec::new("fail").doc("Returns an error."))
            .stage(wrong_kernel_stage())
    }

    fn run(stage: &str, request: StageRequest, host: &Host) -> Result<Value, PluginError> {
        match stage {
            "echo" | "echo-worker" | "measure" => echo(&request, host),
            "panic" | "panic-worker" => panic!("testkit panics on purpose in {}", request.node),
            "abort" => std::process::abort(),
            "segfault" => {
                // SAFETY: none; the point is to crash the process.
                unsafe { std::ptr::null_mut::<u64>().write_volatile(7) };
                Ok(Value::Null)
            }
            "hang" => loop {
                std::thread::sleep(Duration::from_secs(3600));
            },
            "hang-in-process" => {
                let _: EchoParams = request.params()?;
                loop {
                    std::thread::sleep(Duration::from_secs(3600));
                }
            }
            "malformed" => Ok(json!("not an object")),
            "noisy" => {
                println!("testkit writes to stdout, which must not corrupt the worker protocol");
                eprintln!("testkit writes to stderr");
                Ok(json!({"noisy": true}))
            }
            "fail" => Err(PluginError::failed("testkit fails on purpose")),
            "wrong-kernel" => wrong_kernel(&request),
            other => Err(PluginError::UnknownStage {
                stage: other.into(),
                known: "see the manifest".into(),
            }),
        }
    }
}

/// A kernel stage that claims `causal` but computes nothing (zeros), and claims to have run
/// every other mask too: `attnbench plugins check` must catch both.
fn wrong_kernel_stage() -> StageSpec {
    let choice =
        |options: &[&str]| ParamType::Enum(options.iter().map(|o| o.to_string()).collect());
    StageSpec::new("wrong-kernel")
        .doc("A kernel that is wrong on purpose.")
        .param(ParamSpec::new("heads_q", ParamType::Int).default(2))
        .param(ParamSpec::new("heads_kv", ParamType::Int).default(1))
        .param(ParamSpec::new("head_dim", ParamType::Int).default(32))
        .param(ParamSpec::new("direction", choice(&["fwd", "bwd", "fwd_bwd"])).default("fwd"))
        .param(ParamSpec::new("dtype", choice(&["f32", "bf16"])).default("f32"))
        .param(ParamSpec::new("outputs", ParamType::Bool).default(false))
        .input(kinds::MASK)
        .output(kinds::MEASUREMENT)
        .masks(&["causal"])
        .isolation(Isolation::Worker)
}

fn wrong_kernel(request: &StageRequest) -> Result<Value, PluginError> {
    let count = |key: &str| request.params.get(key).and_then(Value::as_u64).unwrap_or(1) as usize;
    let seqlen = request
        .inputs
        .first()
        .and_then(|i| i.result.get("seqlen"))
        .and_then(Value::as_u64)
        .unwrap_or(0) as usize;
    let (heads, dim) = (count("heads_q"), count("head_dim"));
    attnbench_sdk::reference::write_tensor(
        &request.output_dir,
        "out.f32",
        &vec![0.0; heads * seqlen * dim],
    )?;
    attnbench_sdk::reference::write_tensor(
        &request.output_dir,
        "lse.f32",
        &vec![0.0; heads * seqlen],
    )?;
    Ok(json!({
        "kernel": "wrong", "plugin": "testkit", "plugin_version": "0",
        "mask": {"pattern": "?", "seqlen": seqlen, "area": 0, "documents": 0, "params": {}},
        "shape": {"heads_q": heads, "heads_kv": count("heads_kv"), "seqlen": seqlen, "head_dim": dim}, "dtype": "f32",
        "direction": request.params.get("direction").cloned().unwrap_or(json!("fwd")),
        "status": "ok", "flops": 0, "record_version": 2,
        "machine": {"os": "", "arch": "", "kernel": "", "cpu": "", "logical_cpus": 0, "memory_bytes": 0, "attnbench_version": ""},
        "harness": {"timer": "none", "warmup_reps": 0, "warmup_s": 0.0, "min_reps": 0, "max_reps": 0, "max_time_s": 0.0, "target_rel_ci": 0.0},
    }))
}

fn micros_now() -> u128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_micros())
        .unwrap_or(0)
}

fn echo(request: &StageRequest, host: &Host) -> Result<Value, PluginError> {
    let started = micros_now();
    let params: EchoParams = request.params()?;
    let steps = params.sleep_ms.div_ceil(10);
    for step in 0..steps {
        if host.is_cancelled() {
            return Err(PluginError::failed("cancelled"));
        }
        std::thread::sleep(Duration::from_millis(10));
        host.progress(step + 1, steps, "sleeping");
    }
    host.debug(&format!(
        "echo {} with {} inputs",
        request.node,
        request.inputs.len()
    ));
    let result = json!({
        "value": params.value,
        "size": params.size,
        "seed": request.seed,
        "inputs": request.inputs.iter().map(|input| input.node.clone()).collect::<Vec<_>>(),
        "pid": std::process::id(),
        "started_us": started,
        "finished_us": micros_now(),
    });
    write_json(&request.output_dir, "echo.json", &result)?;
    Ok(result)
}

attnbench_sdk::export_plugin!(Testkit);
