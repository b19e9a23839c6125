//! `python`: attention kernels that live in Python packages, benchmarked under the same protocol as
//! the native ones — the SDPA backends, FlexAttention, FlashAttention 2/3/4, FlashInfer, FlashMask,
//! a numpy reference on the CPU, and any module with the documented `attention` function.
//!
//! The plugin starts a Python worker (see `bridge`) and takes each cell through the SDK's
//! kernel-benchmark protocol (`bench::run`), each step a request to the worker (see `cell`): the
//! inputs are the SDK's, the outputs are checked here against the f64 reference (every element up
//! to `check_max_seqlen`, sampled rows beyond), and the host's harness stops the timing.

mod bridge;
mod cell;
mod decode;
mod encodings;

use std::sync::Mutex;

use attnbench_sdk::measure::{text_of, Direction, GpuRun, Harness};
use attnbench_sdk::reference::Element;
use attnbench_sdk::{
    write_json, CacheScope, Host, Isolation, ParamSpec, ParamType, Plugin, PluginError,
    PluginManifest, StageRequest, StageSpec,
};
use serde::Deserialize;
use serde_json::{json, Map, Value};

use attnbench_sdk::bench::{self, Cell, Options};
use bridge::{Bridge, Reply};
use cell::{CellSetup, PyCell};

struct Python;

attnbench_sdk::named_enum! {
    /// The kernels the worker knows, as the `kernel` parameter names them.
    enum PyKernel {
        Numpy = "numpy",
        SdpaMath = "sdpa-math",
        SdpaFlash = "sdpa-flash",
        SdpaEfficient = "sdpa-efficient",
        SdpaCudnn = "sdpa-cudnn",
        Flex = "flex",
        Fa2 = "fa2",
        Fa3 = "fa3",
        Fa4 = "fa4",
        Cudnn = "cudnn",
        Flashinfer = "flashinfer",
        Flashmask = "flashmask",
        Module = "module",
    }
}

/// The worker, kept for the life of the native worker process.
static BRIDGE: Mutex<Option<Bridge>> = Mutex::new(None);

/// Runs one request on a worker for `python`, starting one (or replacing one for another
/// interpreter) as needed. A worker that died is dropped, so the next node starts afresh.
fn with_bridge(
    python: &str,
    op: &str,
    params: Value,
    harness: Option<&Harness>,
) -> Result<(Reply, Value), PluginError> {
    let mut guard = BRIDGE.lock().unwrap_or_else(|e| e.into_inner());
    if guard.as_ref().is_some_and(|b| b.python() != python) {
        *guard = None;
    }
    if guard.is_none() {
        *guard = Some(Bridge::start(python)?);
    }
    let bridge = guard.as_mut().expect("started above");
    let hello = bridge.hello.clone();
    let reply = bridge.request(op, params, harness);
    if matches!(reply, Reply::Died(_)) {
        *guard = None;
    }
    Ok((reply, hello))
}

/// The GPU plugins' harness; on the CPU (numpy) the worker times with `time.perf_counter`.
fn default_harness() -> Harness {
    Harness {
        timer: "CUDA events, L2 flushed (2× its size) before every repetition; time.perf_counter on the CPU".into(),
        ..Harness::gpu()
    }
}

impl Plugin for Python {
    fn manifest() -> PluginManifest {
        PluginManifest::new("python", env!("CARGO_PKG_VERSION"))
            .description("Attention kernels from Python packages through a JSON-lines Python worker, on the same mask IR, harness and checks.")
            .stage(
                StageSpec::new("backends")
                    .doc("Which kernels the interpreter can run, with versions or the reason they cannot.")
                    .param(ParamSpec::new("python", ParamType::String).default("").doc("The interpreter; empty: ATTNBENCH_PYTHON, then the python3 beside the attnbench binary (a virtual environment it was installed into), then python3 on the PATH."))
                    .isolation(Isolation::Worker)
                    .cache_scope(CacheScope::Machine),
            )
            .stage(
                default_harness().declare(
                    StageSpec::new("benchmark")
                        .doc("Times one Python kernel on one mask (from a masks/generate node), checked against the reference first.")
                        .gpu_when("device", "cuda")
                        .param(ParamSpec::new("kernel", ParamType::one_of(PyKernel::NAMES)).default("numpy").doc("`numpy` runs on the CPU; `module` runs the `attention` function of the file given as `module`."))
                        .param(ParamSpec::new("module", ParamType::File).default("").doc("For kernel `module`: a Python file defining `attention(q, k, v, mask, scale)` (README: third-party kernels)."))
                        .param(ParamSpec::new("python", ParamType::String).default("").doc("The interpreter; empty: ATTNBENCH_PYTHON, then the python3 beside the attnbench binary (a virtual environment it was installed into), then python3 on the PATH."))
                        .param(ParamSpec::new("device", ParamType::one_of(Device::NAMES)).default("cuda").doc("Where torch kernels run (`numpy` always runs on the CPU)."))
                        .param(ParamSpec::new("layout", ParamType::one_of(Layout::NAMES)).default("auto").doc("How Q, K, V and dO are stored: `bshd` ([1, S, H, D], as a model's projections produce them and as LongCA-bench creates them; kernels taking [1, H, S, D] get a transposed view), `bhsd` (contiguous [1, H, S, D]), or `auto`: the layout each kernel's documentation passes (contiguous [1, H, S, D] for flex and FlashInfer's variable block-sparse wrapper, [1, S, H, D] storage for the others). Some backends' speed depends on it (flex's backward and cuDNN's do)."))
                        .param(ParamSpec::new("direction", ParamType::one_of(Direction::NAMES)).default("fwd").doc("`bwd` is timed alone: the forward runs once, outside the timed region."))
                        .param(ParamSpec::new("heads_q", ParamType::Int).default(64))
                        .param(ParamSpec::new("heads_kv", ParamType::Int).default(8))
                        .param(ParamSpec::new("head_dim", ParamType::Int).default(128))
                        .param(attnbench_sdk::shapes::value_dim_param())
                        .param(attnbench_sdk::shapes::shape_param())
                        .param(ParamSpec::new("dtype", ParamType::one_of(Element::NAMES)).default("bf16"))
                        .param(ParamSpec::new("outputs", ParamType::Bool).default(false).doc("Also write out.f32, lse.f32 (when the kernel gives one) and, for a backward, dq/dk/dv.f32 beside the measurement."))
                        .param(ParamSpec::new("gqa", ParamType::one_of(Gqa::NAMES)).default("native").doc("How the SDPA kernels get grouped K and V: `native` passes the KV heads with enable_gqa; `expand` repeats them to every query head once, before the timed region, as a model that keeps them expanded would. Other kernels take `native` only."))
                        .param(ParamSpec::new("check_max_seqlen", ParamType::Size).default("2k").doc("Up to this length every output is checked against the f64 reference; beyond it `check_rows` rows of every head."))
                        .param(ParamSpec::new("check_rows", ParamType::Int).default(16).doc("Rows of every head checked beyond check_max_seqlen.")),
                )
                .measures_masks()
                // A hung kernel or worker ends the node, not the run; `timeout:` in a pipeline overrides.
                .timeout_s(1800.0),
            )
            .stage(decode::spec())
    }

    fn run(stage: &str, request: StageRequest, host: &Host) -> Result<Value, PluginError> {
        match stage {
            "backends" => backends(&request),
            "benchmark" => benchmark(&request, host),
            "decode" => decode::run(&request),
            other => Err(PluginError::UnknownStage {
                stage: other.into(),
                known: "backends, benchmark, decode".into(),
            }),
        }
    }
}

#[derive(Deserialize)]
struct BackendsParams {
    python: String,
}

fn backends(request: &StageRequest) -> Result<Value, PluginError> {
    let p: BackendsParams = request.params()?;
    let python = attnbench_sdk::environment::python_interpreter(&p.python);
    let (reply, hello) = with_bridge(&python, "backends", Value::Null, None)?;
    let backends = match reply {
        Reply::Ok(value) => value,
        Reply::BadParams(message) => return Err(PluginError::Params(message)),
        Reply::Failed(message) | Reply::Died(message) => return Err(PluginError::failed(message)),
    };
    let result = json!({"python": hello, "backends": backends});
    write_json(&request.output_dir, "backends.json", &result)?;
    Ok(result)
}

attnbench_sdk::named_enum! {
    /// Where torch kernels run.
    enum Device { Cuda = "cuda", Cpu = "cpu" }
}

attnbench_sdk::named_enum! {
    /// How Q, K, V and dO are stored (the bridge's `to_layout`).
    enum Layout { Auto = "auto", Bshd = "bshd", Bhsd = "bhsd" }
}

attnbench_sdk::named_enum! {
    /// How the SDPA kernels get grouped K and V.
    enum Gqa { Native = "native", Expand = "expand" }
}

#[derive(Deserialize)]
struct BenchParams {
    kernel: PyKernel,
    module: String,
    python: String,
    device: Device,
    layout: Layout,
    gqa: Gqa,
    check_max_seqlen: usize,
    check_rows: usize,
    #[serde(flatten)]
    common: attnbench_sdk::measure::KernelParams,
}

fn benchmark(request: &StageRequest, host: &Host) -> Result<Value, PluginError> {
    let p: BenchParams = request.params()?;
    if p.kernel == PyKernel::Module && p.module.is_empty() {
        return Err(PluginError::Params(
            "kernel `module` needs `module`: the path of a Python file defining `attention(q, k, v, mask, scale)`".into(),
        ));
    }
    let set = request.mask_set()?;
    set.check_heads(
        p.common.heads_q as u64,
        p.common.heads_kv as u64,
        p.common.head_dim as u64,
    )?;
    let harness = p.common.harness.apply(default_harness());
    let kernel = kernel_name(&p);
    let cell = Cell::of(&p.common, &set, request.seed);
    let measurement = cell.record(
        &kernel,
        ("python", env!("CARGO_PKG_VERSION")),
        harness.clone(),
    );
    let on_gpu = p.device == Device::Cuda && p.kernel != PyKernel::Numpy;
    let encodings = encodings::of_set(
        &set,
        encodings::Wanted {
            flashmask: p.kernel == PyKernel::Flashmask,
            grid: matches!(
                p.kernel,
                PyKernel::Flex | PyKernel::Fa4 | PyKernel::Flashinfer
            ),
        },
    );
    let problem = json!({
        "kernel": p.kernel,
        "module": p.module,
        "direction": p.common.direction,
        "shape": {"heads_q": p.common.heads_q, "heads_kv": p.common.heads_kv, "seqlen": cell.shape.seqlen, "head_dim": p.common.head_dim, "head_dim_v": cell.shape.head_dim_v},
        "dtype": p.common.dtype,
        "mask": set,
        "encodings": encodings,
        "seed": request.seed,
        "device": if on_gpu { "cuda" } else { "cpu" },
        "layout": p.layout,
        "gqa": p.gqa,
    });
    let python = attnbench_sdk::environment::python_interpreter(&p.python);
    host.debug(&format!("running {kernel} in `{python}`"));
    let exchange = request.output_dir.join("exchange");
    let mut py_cell = PyCell::new(CellSetup {
        python: &python,
        kernel: &kernel,
        problem,
        exchange: exchange.clone(),
        element: p.common.dtype,
        check_max_seqlen: p.check_max_seqlen,
        check_rows: p.check_rows,
        on_gpu,
    });
    let options = Options::of(&p.common, &request.output_dir);
    let outcome = bench::run(&mut py_cell, &cell, &harness, measurement, options);
    close_cell(&python);
    cell::clear(&exchange);
    let mut measurement = outcome?;
    py_cell.describe(&mut measurement);
    let mut details = std::mem::take(&mut py_cell.environment);
    measurement.gpu = gpu_of(&mut details, std::mem::take(&mut py_cell.clocks));
    measurement.details.extend(details);
    // What the adapter was given, so its call can be repeated beside a plain loop
    // (scripts/peer-plain.py).
    write_json(&request.output_dir, encodings::FILE, &encodings)?;
    measurement.write(&request.output_dir)
}

/// The kernel's name in records: settings that change what it measures name it, so a sweep over
/// them keeps each variant's cells apart in tables and merged reports; the defaults keep the
/// plain name.
fn kernel_name(p: &BenchParams) -> String {
    let kernel = if p.kernel == PyKernel::Module {
        let stem = std::path::Path::new(&p.module)
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_default();
        format!("module:{stem}")
    } else {
        p.kernel.to_string()
    };
    let settings = [
        ("layout", p.layout.as_str(), p.layout == Layout::Auto),
        ("gqa", p.gqa.as_str(), p.gqa == Gqa::Native),
    ];
    settings
        .into_iter()
        .filter(|(_, _, default)| !default)
        .fold(kernel, |name, (key, value, _)| {
            format!("{name} {key}={value}")
        })
}

/// Ends the worker's open cell (its device memory given back), when a worker is running.
fn close_cell(python: &str) {
    let mut guard = BRIDGE.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(bridge) = guard.as_mut().filter(|b| b.python() == python) {
        if matches!(bridge.request("close", Value::Null, None), Reply::Died(_)) {
            *guard = None;
        }
    }
}

attnbench_sdk::export_plugin!(Python);

/// The GPU a torch kernel ran on, from the bridge's environment (`device_name`, `capability`
/// for a `cuda` device), taken out of what stays the plugin's details.
fn gpu_of(environment: &mut Map<String, Value>, clocks: (Value, Value)) -> Option<GpuRun> {
    let on_cuda = environment
        .get("device")
        .and_then(Value::as_str)
        .is_some_and(|d| d.starts_with("cuda"));
    if !on_cuda {
        return None;
    }
    let mut take = |key: &str| {
        environment
            .remove(key)
            .as_ref()
            .map(text_of)
            .unwrap_or_default()
    };
    Some(GpuRun {
        name: take("device_name"),
        compute_capability: take("capability"),
        memory_bytes: None,
        multiprocessors: None,
        l2_bytes: None,
        driver_version: None,
        libraries: Vec::new(),
        clocks_before: clocks.0,
        clocks_after: clocks.1,
    })
}
