//! The machine a measurement ran on. The runtime puts its fingerprint into the key of every
//! `machine`-scoped node, so cached measurements are never reused on other hardware or system
//! software; measurement records carry it so that reports can say where numbers came from.

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Environment {
    pub os: String,
    pub arch: String,
    pub kernel: String,
    pub cpu: String,
    pub logical_cpus: usize,
    pub memory_bytes: u64,
    pub attnbench_version: String,
    /// The NVIDIA GPUs the driver lists, e.g. `NVIDIA H200 (driver 580.159.04)`: part of the
    /// fingerprint, so a GPU measurement is never reused on another GPU or driver.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub gpus: Vec<String>,
}

impl Environment {
    pub fn detect() -> Environment {
        let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
        let cpu = cpuinfo
            .lines()
            .find(|line| line.starts_with("model name"))
            .and_then(|line| line.split_once(':'))
            .map(|(_, name)| name.trim().to_string())
            .unwrap_or_else(|| "unknown".into());
        let memory_bytes = std::fs::read_to_string("/proc/meminfo")
            .unwrap_or_default()
            .lines()
            .find(|line| line.starts_with("MemTotal:"))
            .and_then(|line| line.split_whitespace().nth(1))
            .and_then(|kib| kib.parse::<u64>().ok())
            .map(|kib| kib * 1024)
            .unwrap_or(0);
        let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease")
            .unwrap_or_default()
            .trim()
            .to_string();
        Environment {
            os: std::env::consts::OS.into(),
            arch: std::env::consts::ARCH.into(),
            kernel,
            cpu,
            logical_cpus: std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(1),
            memory_bytes,
            attnbench_version: env!("CARGO_PKG_VERSION").into(),
            gpus: nvidia_gpus(),
        }
    }
}

/// The driver's list of NVIDIA GPUs (`/proc/driver/nvidia`), without loading any library.
fn nvidia_gpus() -> Vec<String> {
    let root = std::path::Path::new("/proc/driver/nvidia");
    let driver = std::fs::read_to_string(root.join("version"))
        .ok()
        .and_then(|text| driver_version(&text));
    let mut informations: Vec<String> = std::fs::read_dir(root.join("gpus"))
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|gpu| std::fs::read_to_string(gpu.path().join("information")).ok())
        .collect();
    informations.sort();
    gpu_names(&informations, driver.as_deref())
}

/// `Model:` of each GPU's information file, with the driver version.
fn gpu_names(informations: &[String], driver: Option<&str>) -> Vec<String> {
    informations
        .iter()
        .filter_map(|text| {
            let model = text
                .lines()
                .find_map(|line| line.strip_prefix("Model:"))?
                .trim();
            Some(match driver {
                Some(version) => format!("{model} (driver {version})"),
                None => model.to_string(),
            })
        })
        .collect()
}

/// The version in the driver's `NVRM version: … Kernel Module  580.159.04  …` line.
fn driver_version(text: &str) -> Option<String> {
    let line = text
        .lines()
        .find(|line| line.starts_with("NVRM version:"))?;
    line.split_whitespace()
        .find(|word| {
            word.contains('.')
                && word
                    .split('.')
                    .all(|part| !part.is_empty() && part.bytes().all(|b| b.is_ascii_digit()))
        })
        .map(String::from)
}

/// The Python interpreter attnbench runs: `param` (a stage's `python` parameter) when set, then
/// `ATTNBENCH_PYTHON`, then the `python3` in the folder of the running `attnbench` (a virtual
/// environment attnbench was pip-installed into has it there), then `python3` on the PATH.
pub fn python_interpreter(param: &str) -> String {
    if !param.is_empty() {
        return param.to_string();
    }
    if let Some(python) = std::env::var("ATTNBENCH_PYTHON")
        .ok()
        .filter(|p| !p.is_empty())
    {
        return python;
    }
    std::env::current_exe()
        .ok()
        .and_then(|exe| Some(exe.parent()?.join("python3")))
        .filter(|python| python.is_file())
        .map(|python| python.display().to_string())
        .unwrap_or_else(|| "python3".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpus_and_driver_are_read_from_the_drivers_files() {
        let version = "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.159.04  Release Build  (dvs-builder@U22-I3-AE18-23-3)  Thu Oct  2 2025\nGCC version:  gcc version 12.2.0\n";
        assert_eq!(driver_version(version).as_deref(), Some("580.159.04"));
        let information =
            "Model: \t\t NVIDIA H200\nIRQ:   \t\t 150\nGPU UUID: \t GPU-0\n".to_string();
        assert_eq!(
            gpu_names(&[information.clone(), information], Some("580.159.04")),
            vec!["NVIDIA H200 (driver 580.159.04)"; 2]
        );
        assert!(gpu_names(&[], None).is_empty());
    }
}
