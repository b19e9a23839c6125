//! `attnbench doctor`: what this machine offers attnbench.

use std::ffi::CString;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Result;
use attnbench_runtime::cache::Cache;
use attnbench_runtime::plugin::Registry;
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
        attnbench_runtime::cache::environment_fingerprint(&environment)
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

    match loadable("libcuda.so.1") {
        true => println!("gpu: the NVIDIA driver library libcuda.so.1 loads"),
        false => println!(
            "gpu: no NVIDIA driver found (libcuda.so.1 is not loadable; looked through LD_LIBRARY_PATH={} and the system library cache); GPU stages will be refused",
            std::env::var("LD_LIBRARY_PATH").unwrap_or_default()
        ),
    }
    Ok(ExitCode::SUCCESS)
}

/// Whether the dynamic loader can open `name`.
fn loadable(name: &str) -> bool {
    let Ok(name) = CString::new(name) else {
        return false;
    };
    // SAFETY: dlopen with a valid C string; the handle is closed right away.
    unsafe {
        let handle = libc::dlopen(name.as_ptr(), libc::RTLD_LAZY | libc::RTLD_LOCAL);
        if handle.is_null() {
            return false;
        }
        libc::dlclose(handle);
    }
    true
}
