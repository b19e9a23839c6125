//! `attnbench doctor`: what this machine offers attnbench.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Result;
use attnbench_runtime::cache::Cache;
use attnbench_runtime::host::plugin::Registry;
use attnbench_runtime::host::services::Silent;
use attnbench_runtime::host::worker::{Worker, WorkerOutcome};
use attnbench_sdk::environment::Environment;

use crate::cache_cmd::human_bytes;
use crate::display_path;

pub fn run(plugin_dirs: &[PathBuf], cache: &Cache) -> Result<ExitCode> {
    println!(
        "attnbench {} (plugin ABI {})",
        env!("CARGO_PKG_VERSION"),
        attnbench_sdk::abi::ABI_VERSION
    );
    let environment = Environment::detect();
    println!(
        "machine: {} {} (kernel {}), {} logical CPUs, {} memory; fingerprint {}",
        environment.os,
        environment.arch,
        environment.kernel,
        environment.logical_cpus,
        human_bytes(environment.memory_bytes),
        attnbench_runtime::key::environment_fingerprint(&environment)
    );
    println!("cpu: {}", environment.cpu);

    let registry = Registry::discover(plugin_dirs);
    let dirs: Vec<String> = registry.dirs.iter().map(|d| display_path(d)).collect();
    println!("plugin search path: {}", dirs.join(", "));
    for plugin in registry.plugins() {
        println!(
            "  plugin {} {} — {}",
            plugin.manifest.name,
            plugin.manifest.version,
            display_path(&plugin.path)
        );
    }
    for (path, reason) in &registry.rejected {
        println!("  skipped {}: {reason}", display_path(path));
    }
    if registry.plugins().next().is_none() {
        println!("  no plugins found: build them with `cargo build --release --workspace` or pass --plugin-dir");
    }

    let entries = cache.entries();
    let bytes: u64 = entries
        .iter()
        .filter_map(|(_, m)| m.as_ref().ok().map(|m| m.bytes))
        .sum();
    println!(
        "cache: {} ({} entries, {})",
        display_path(&cache.root),
        entries.len(),
        human_bytes(bytes)
    );

    gpu(&registry, cache)?;
    python_backends();
    Ok(ExitCode::SUCCESS)
}

/// Python packages whose kernels the benchmarks compare, as the Python in use sees them: each
/// with the entry point its adapter calls, so that a namespace package left by another wheel
/// (FA4's installs `flash_attn/cute` only) is not taken for the package itself.
const PYTHON_BACKENDS: &str = r#"
import importlib, json, sys
found = {}
for name, entry in [("torch", None), ("triton", None), ("flash_attn", "flash_attn_func"),
                    ("flash_attn_interface", "flash_attn_func"), ("flash_attn.cute", "flash_attn_func"),
                    ("cudnn", "pygraph"), ("flashinfer", None), ("paddle", None), ("xformers", None),
                    ("transformer_engine", None), ("numpy", None)]:
    try:
        module = importlib.import_module(name)
    except Exception as error:
        found[name] = None
        continue
    if entry is not None and not hasattr(module, entry):
        found[name] = {"missing": entry, "namespace": getattr(module, "__file__", None) is None}
        continue
    found[name] = str(getattr(module, "__version__", "importable"))
print(json.dumps({"python": sys.executable, "version": sys.version.split()[0], "backends": found}))
"#;

fn python_backends() {
    let python = attnbench_sdk::environment::python_interpreter("");
    let output = std::process::Command::new(&python)
        .args(["-c", PYTHON_BACKENDS])
        .stderr(std::process::Stdio::null())
        .output();
    let parsed = output
        .ok()
        .and_then(|o| serde_json::from_slice::<serde_json::Value>(&o.stdout).ok());
    let Some(report) = parsed else {
        println!("python backends: `{python}` did not run (set ATTNBENCH_PYTHON to the interpreter to use)");
        return;
    };
    println!(
        "python backends ({} {}):",
        report["python"].as_str().unwrap_or(&python),
        report["version"].as_str().unwrap_or("?")
    );
    if let Some(backends) = report["backends"].as_object() {
        for (name, version) in backends {
            match (version.as_str(), version["missing"].as_str()) {
                (Some(version), _) => println!("  {name} {version}"),
                (None, Some(entry)) if version["namespace"] == true => println!(
                    "  {name}: only a namespace package (another package's subfolder), without its {entry}: not installed"
                ),
                (None, Some(entry)) => println!("  {name}: imports, but has no {entry}: not usable"),
                (None, None) => println!("  {name}: not importable"),
            }
        }
    }
}

/// The CUDA libraries found (and where attnbench looked), and the GPUs as the cuda plugin sees
/// them from a worker started with those libraries.
fn gpu(registry: &Registry, cache: &Cache) -> Result<()> {
    let discovery = attnbench_gpu_libs::discover();
    for found in &discovery.found {
        let version = found
            .version
            .as_deref()
            .map(|v| format!(" {v}"))
            .unwrap_or_default();
        println!(
            "cuda library: {}{version} — {}",
            found.library,
            found.path.display()
        );
    }
    if !discovery.missing.is_empty() {
        println!("cuda libraries not found: {}", discovery.missing.join(", "));
    }
    let searched: Vec<String> = discovery
        .searched
        .iter()
        .map(|d| d.display().to_string())
        .collect();
    println!("  (searched {})", searched.join(", "));
    if !discovery.found.iter().any(|f| f.library == "driver") {
        println!("gpu: no NVIDIA driver found (no libcuda.so in the folders above); GPU stages will be refused");
        return Ok(());
    }
    let Some(plugin) = registry.get("cuda") else {
        println!("gpu: the cuda plugin was not found, so the devices were not queried");
        return Ok(());
    };
    let links = cache.root.join("cuda-libs");
    let env = attnbench_gpu_libs::worker_env(&links);
    let exe = std::env::current_exe()?;
    let mut worker = match Worker::spawn(&exe, &plugin.path, &env) {
        Ok(worker) => worker,
        Err(err) => {
            println!("gpu: the cuda plugin's worker did not start: {err}");
            return Ok(());
        }
    };
    let output = tempfile::tempdir()?;
    let request = serde_json::json!({"node": "doctor", "stage": "devices", "params": {}, "seed": 0, "output_dir": output.path(), "inputs": []});
    match worker.run(
        "devices",
        &request.to_string(),
        Some(std::time::Duration::from_secs(120)),
        &std::sync::atomic::AtomicBool::new(false),
        &Silent,
        None,
    ) {
        WorkerOutcome::Finished(Ok(text)) => println!("gpu: {text}"),
        WorkerOutcome::Finished(Err(err)) => println!("gpu: {err}"),
        WorkerOutcome::Crashed(reason) => {
            println!("gpu: querying the devices crashed the worker: {reason}")
        }
        WorkerOutcome::TimedOut => println!("gpu: querying the devices did not finish in 120 s"),
        WorkerOutcome::Stopped => println!("gpu: stopped"),
    }
    Ok(())
}
