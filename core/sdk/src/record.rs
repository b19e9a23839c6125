//! The measurement record: one kernel or context-parallel run, as every benchmark stage writes it
//! (`measurement.json`) and reports, `compare` and the cost model read it.
//!
//! Its layout is versioned ([`RECORD_VERSION`]) and typed: the machine, the GPU and the
//! context-parallel run are sections with named fields, so a reader gets a compile error, not a
//! silently missing key, when one changes. What only one plugin records (its interpreter, the
//! backend a Python kernel took, a kernel's instruction set) stays in `details`, a free map that
//! no other code reads by key. Records written before versions existed (version 1: one free
//! `environment` map) are read into the same types.

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::environment::Environment;
use crate::measure::{
    Correctness, Direction, Harness, MaskInfo, MeasureStatus, Memory, Quantiles, Throughput,
    Timing, UnsupportedScope,
};
use crate::reference::{Element, Shape};

/// The layout version this build writes; it reads every version up to it.
pub const RECORD_VERSION: u32 = 2;

/// One benchmark result: what ran, on what, how fast, how much memory, and whether it was right.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(try_from = "Wire")]
pub struct Measurement {
    /// [`RECORD_VERSION`] when written by this build.
    pub record_version: u32,
    pub kernel: String,
    pub plugin: String,
    pub plugin_version: String,
    pub mask: MaskInfo,
    pub shape: Shape,
    /// How the inputs were stored.
    pub dtype: Element,
    pub direction: Direction,
    pub status: MeasureStatus,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// With `unsupported`: whether this case is out of the kernel's reach or this whole machine
    /// is (none: the case, as records before the field said).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub unsupported_scope: Option<UnsupportedScope>,
    /// FLOPs of the measured direction, from the mask's exact area.
    pub flops: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub time_s: Option<Quantiles>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tflops: Option<Throughput>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory: Option<Memory>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub correctness: Option<Correctness>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timing: Option<Timing>,
    /// The machine it ran on (part of the cache key of every measurement).
    pub machine: Environment,
    /// The GPU the kernel ran on, when it ran on one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu: Option<GpuRun>,
    /// A context-parallel run: its layout, each rank's times, the bytes sent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cp: Option<CpRun>,
    /// Seconds spent before and around the timing (inputs, upload, first run, check, compile…)
    /// and what a phase chose (a Python kernel's mask form), by phase name.
    #[serde(default, skip_serializing_if = "Map::is_empty")]
    pub phases: Map<String, Value>,
    /// What only the writing plugin records, for people to read.
    #[serde(default, skip_serializing_if = "Map::is_empty")]
    pub details: Map<String, Value>,
    pub harness: Harness,
}

impl Measurement {
    pub const FILE: &'static str = "measurement.json";

    /// Writes the record as the node's `measurement.json` and returns it as the node's result.
    pub fn write(&self, dir: &std::path::Path) -> Result<Value, crate::PluginError> {
        crate::write_json(dir, Self::FILE, self)?;
        serde_json::to_value(self).map_err(|err| crate::PluginError::failed(err.to_string()))
    }

    /// The record of a kernel run on `set` before anything was timed: the mask, the shape and
    /// dtype, the FLOPs of `direction` from the exact area, this machine; status `ok`.
    pub fn for_kernel(
        kernel: &str,
        plugin: (&str, &str),
        set: &crate::mask::MaskSet,
        shape: Shape,
        dtype: Element,
        direction: Direction,
        harness: Harness,
    ) -> Measurement {
        let (heads_q, heads_kv) = (shape.heads_q as u64, shape.heads_kv as u64);
        let (head_dim, value_dim) = (shape.head_dim as u64, shape.value_dim() as u64);
        let flops = set.flops(heads_q, heads_kv, head_dim, value_dim);
        Measurement {
            record_version: RECORD_VERSION,
            kernel: kernel.to_string(),
            plugin: plugin.0.to_string(),
            plugin_version: plugin.1.to_string(),
            mask: MaskInfo {
                pattern: set.pattern.clone(),
                seqlen: set.seqlen,
                area: set.area_over_heads(heads_q, heads_kv),
                documents: set.documents.len(),
                params: set.params.clone(),
            },
            shape,
            dtype,
            direction,
            status: MeasureStatus::Ok,
            reason: None,
            unsupported_scope: None,
            flops: flops.for_direction(direction),
            time_s: None,
            tflops: None,
            memory: None,
            correctness: None,
            timing: None,
            machine: Environment::detect(),
            gpu: None,
            cp: None,
            phases: Map::new(),
            details: Map::new(),
            harness,
        }
    }

    /// Marks the record `unsupported` with `reason`: the kernel cannot run this case.
    pub fn unsupported(mut self, reason: impl Into<String>) -> Measurement {
        self.status = MeasureStatus::Unsupported;
        self.reason = Some(reason.into());
        self.unsupported_scope = Some(UnsupportedScope::Case);
        self
    }

    /// What makes two records the same cell, whatever kernel ran it: the mask with every drawn
    /// parameter, the shape and dtype, the direction, and a context-parallel run's layout. Two
    /// kernels' records of one cell share it; [`Measurement::cell`] tells kernels apart too.
    pub fn problem(&self) -> String {
        serde_json::json!([
            self.mask.params,
            self.mask.pattern,
            self.mask.seqlen,
            self.shape,
            self.dtype,
            self.direction,
            self.cp.as_ref().map(CpRun::cell),
        ])
        .to_string()
    }

    /// What makes two records the same cell: the plugin and kernel, and [`Measurement::problem`].
    pub fn cell(&self) -> String {
        serde_json::json!([self.plugin, self.kernel, self.problem()]).to_string()
    }

    /// What describes the machine and its software rather than this one run, by name: what
    /// `compare` lists when two sets of records differ in it.
    pub fn software(&self) -> Vec<(&'static str, String)> {
        let machine = &self.machine;
        let mut described = vec![
            ("os", machine.os.clone()),
            ("kernel", machine.kernel.clone()),
            ("cpu", machine.cpu.clone()),
            ("attnbench_version", machine.attnbench_version.clone()),
        ];
        if !machine.gpus.is_empty() {
            described.push(("gpus", machine.gpus.join(", ")));
        }
        if let Some(gpu) = &self.gpu {
            described.push(("gpu", gpu.name.clone()));
            if let Some(driver) = &gpu.driver_version {
                described.push(("driver_version", driver.clone()));
            }
            if !gpu.libraries.is_empty() {
                described.push(("libraries", gpu.libraries.join(", ")));
            }
        }
        if let Some(python) = self.details.get("python") {
            described.push(("python", text_of(python)));
        }
        described
    }
}

/// A JSON value as a person reads it: strings bare, anything else as JSON.
pub fn text_of(value: &Value) -> String {
    value
        .as_str()
        .map_or_else(|| value.to_string(), str::to_string)
}

/// The GPU a kernel ran on, as its plugin saw it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GpuRun {
    pub name: String,
    /// `major.minor`, e.g. `9.0`.
    pub compute_capability: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_bytes: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub multiprocessors: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub l2_bytes: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub driver_version: Option<String>,
    /// The CUDA library files the process had mapped.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub libraries: Vec<String>,
    /// NVML's clocks and throttle reasons just before and just after the timing.
    #[serde(default, skip_serializing_if = "Value::is_null")]
    pub clocks_before: Value,
    #[serde(default, skip_serializing_if = "Value::is_null")]
    pub clocks_after: Value,
}

/// A context-parallel run: how the sequence and heads were split, how throughput was computed,
/// what each rank took and sent.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CpRun {
    pub method: String,
    pub world: u64,
    pub ulysses: u64,
    pub ring: u64,
    pub windows: u64,
    pub placement: String,
    /// How the sequence was dealt over the ring: `zigzag`, `contiguous`, `striped(1)`,
    /// `balanced(64)` (records before shardings were chosen dealt zigzag).
    #[serde(default = "zigzag")]
    pub sharding: String,
    /// The most loaded rank's attention area over the mean rank's: 1 is perfect balance.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub imbalance: Option<f64>,
    pub backend: String,
    /// The local attention of every block (`builtin` or a kernel plugin's backend).
    pub attention: String,
    pub launcher: String,
    /// How the per-GPU throughput comes from the ranks' times (the record's `tflops`).
    pub throughput: String,
    /// Per-GPU TFLOP/s by the other rule, LongCA-bench's: global FLOPs / ranks / the mean over
    /// ranks of each rank's time (the record's `tflops` take the slowest rank's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mean_rank_tflops: Option<f64>,
    /// Bytes each rank sent in the forward, and the formula's figure per rank.
    pub bytes_sent_forward: Vec<u64>,
    pub formula_forward: u64,
    pub bytes_sent_backward: Vec<u64>,
    pub formula_backward: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bytes_note: Option<String>,
    pub ranks: Vec<CpRank>,
}

impl CpRun {
    /// What tells two context-parallel cells apart (its times and bytes do not): the method,
    /// its groups and placement, the backend and the local attention.
    pub fn cell(&self) -> Value {
        serde_json::json!([
            self.method,
            self.world,
            self.ulysses,
            self.ring,
            self.windows,
            self.placement,
            self.sharding,
            self.backend,
            self.attention
        ])
    }
}

fn zigzag() -> String {
    "zigzag".into()
}

/// One rank of a context-parallel run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CpRank {
    /// The GPU it ran on (NCCL runs).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device: Option<String>,
    /// The attention area the rank computes: its query rows' allowed keys over its heads.
    #[serde(default)]
    pub area: u64,
    /// The runs of consecutive tokens its share of the sequence comes in.
    #[serde(default)]
    pub pieces: u64,
    pub forward: PassTimes,
    pub backward: PassTimes,
}

/// A rank's seconds for one pass: in all, in its attention kernels, with its communication busy,
/// and outside the kernels (median over repetitions where it was repeated).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct PassTimes {
    pub total_s: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kernels_s: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub communication_busy_s: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub not_kernels_s: Option<f64>,
}

/// The record as stored, in any version this build reads.
#[derive(Deserialize)]
struct Wire {
    #[serde(default)]
    record_version: Option<u32>,
    kernel: String,
    plugin: String,
    plugin_version: String,
    mask: MaskInfo,
    shape: WireShape,
    /// Version 2; version 1 kept it in `shape`.
    #[serde(default)]
    dtype: Option<Element>,
    direction: Direction,
    status: MeasureStatus,
    #[serde(default)]
    reason: Option<String>,
    #[serde(default)]
    unsupported_scope: Option<UnsupportedScope>,
    flops: u64,
    #[serde(default)]
    time_s: Option<Quantiles>,
    #[serde(default)]
    tflops: Option<Throughput>,
    #[serde(default)]
    memory: Option<Memory>,
    #[serde(default)]
    correctness: Option<Correctness>,
    #[serde(default)]
    timing: Option<Timing>,
    #[serde(default)]
    machine: Option<Environment>,
    #[serde(default)]
    gpu: Option<GpuRun>,
    #[serde(default)]
    cp: Option<CpRun>,
    #[serde(default)]
    phases: Map<String, Value>,
    #[serde(default)]
    details: Map<String, Value>,
    /// Version 1: the machine, the GPU, the CP run, the phases and the plugin's extras in one map.
    #[serde(default)]
    environment: Option<Map<String, Value>>,
    harness: Harness,
}

/// Why a stored measurement record cannot be read as a [`Measurement`].
#[derive(Debug, thiserror::Error)]
pub enum WireError {
    #[error("record version {0} is newer than this attnbench reads ({RECORD_VERSION}): upgrade attnbench to read it")]
    Newer(u32),
    #[error("the record names no dtype")]
    NoDtype,
    #[error("a version-1 record needs its `environment`")]
    NoEnvironment,
    #[error("environment.context_parallel is not an object")]
    CpNotAnObject,
    /// A version-1 section that does not parse: `environment`, `environment.context_parallel`.
    #[error("{section}: {source}")]
    Section {
        section: &'static str,
        source: serde_json::Error,
    },
}

impl TryFrom<Wire> for Measurement {
    type Error = WireError;

    fn try_from(wire: Wire) -> Result<Measurement, WireError> {
        let version = wire.record_version.unwrap_or(1);
        if version > RECORD_VERSION {
            return Err(WireError::Newer(version));
        }
        let dtype = wire.dtype.or(wire.shape.dtype).ok_or(WireError::NoDtype)?;
        let shape = Shape {
            heads_q: wire.shape.heads_q,
            heads_kv: wire.shape.heads_kv,
            // Version 1 took it from the mask.
            seqlen: wire.shape.seqlen.unwrap_or(wire.mask.seqlen as usize),
            head_dim: wire.shape.head_dim,
            head_dim_v: wire.shape.head_dim_v,
        };
        let mut record = Measurement {
            record_version: version,
            kernel: wire.kernel,
            plugin: wire.plugin,
            plugin_version: wire.plugin_version,
            mask: wire.mask,
            shape,
            dtype,
            direction: wire.direction,
            status: wire.status,
            reason: wire.reason,
            unsupported_scope: wire.unsupported_scope,
            flops: wire.flops,
            time_s: wire.time_s,
            tflops: wire.tflops,
            memory: wire.memory,
            correctness: wire.correctness,
            timing: wire.timing,
            machine: wire.machine.unwrap_or_else(unknown_machine),
            gpu: wire.gpu,
            cp: wire.cp,
            phases: wire.phases,
            details: wire.details,
            harness: wire.harness,
        };
        if let Some(environment) = wire.environment {
            legacy::split(environment, &mut record)?;
        } else if version == 1 {
            return Err(WireError::NoEnvironment);
        }
        Ok(record)
    }
}

/// The shape in either version: version 1 wrote a batch and the dtype in it, and no length.
#[derive(Deserialize)]
struct WireShape {
    heads_q: usize,
    heads_kv: usize,
    head_dim: usize,
    #[serde(default)]
    head_dim_v: Option<usize>,
    #[serde(default)]
    seqlen: Option<usize>,
    #[serde(default)]
    dtype: Option<Element>,
}

fn unknown_machine() -> Environment {
    Environment {
        os: String::new(),
        arch: String::new(),
        kernel: String::new(),
        cpu: String::new(),
        logical_cpus: 0,
        memory_bytes: 0,
        attnbench_version: String::new(),
        gpus: Vec::new(),
    }
}

/// Version 1's free `environment` map, split into the typed sections.
mod legacy {
    use super::*;

    const MACHINE: [&str; 8] = [
        "os",
        "arch",
        "kernel",
        "cpu",
        "logical_cpus",
        "memory_bytes",
        "attnbench_version",
        "gpus",
    ];

    pub(super) fn split(
        mut environment: Map<String, Value>,
        record: &mut Measurement,
    ) -> Result<(), WireError> {
        let machine: Map<String, Value> = MACHINE
            .iter()
            .filter_map(|key| environment.remove(*key).map(|v| (key.to_string(), v)))
            .collect();
        record.machine = serde_json::from_value(Value::Object(machine)).map_err(|source| {
            WireError::Section {
                section: "environment",
                source,
            }
        })?;
        if let Some(Value::Object(phases)) = environment.remove("phases") {
            record.phases = phases;
        }
        if let Some(cp) = environment.remove("context_parallel") {
            record.cp = Some(cp_run(cp)?);
        }
        record.gpu = gpu_run(&mut environment);
        record.details = environment;
        Ok(())
    }

    /// The GPU keys the cuda plugin (`gpu`, …) or the Python bridge (`device_name`, …) wrote.
    fn gpu_run(environment: &mut Map<String, Value>) -> Option<GpuRun> {
        let take = |environment: &mut Map<String, Value>, key: &str| environment.remove(key);
        let (name, capability) = match (environment.get("gpu"), environment.get("device")) {
            (Some(Value::String(_)), _) => (
                take(environment, "gpu"),
                take(environment, "compute_capability"),
            ),
            (_, Some(Value::String(device))) if device.starts_with("cuda") => (
                take(environment, "device_name"),
                take(environment, "capability"),
            ),
            _ => return None,
        };
        let text = |v: Option<Value>| v.as_ref().map(text_of).unwrap_or_default();
        Some(GpuRun {
            name: text(name),
            compute_capability: text(capability),
            memory_bytes: take(environment, "memory_bytes").and_then(|v| v.as_u64()),
            multiprocessors: take(environment, "multiprocessors").and_then(|v| v.as_i64()),
            l2_bytes: take(environment, "l2_bytes").and_then(|v| v.as_u64()),
            driver_version: take(environment, "driver_version").map(|v| text_of(&v)),
            libraries: take(environment, "libraries")
                .and_then(|v| serde_json::from_value(v).ok())
                .unwrap_or_default(),
            clocks_before: take(environment, "clocks_before").unwrap_or(Value::Null),
            clocks_after: take(environment, "clocks_after").unwrap_or(Value::Null),
        })
    }

    /// Version 1's `context_parallel` object: threads and processes wrote each rank's first-run
    /// seconds (`forward_s_per_rank`), NCCL runs a `ranks` list.
    fn cp_run(mut cp: Value) -> Result<CpRun, WireError> {
        let section = |source| WireError::Section {
            section: "environment.context_parallel",
            source,
        };
        let object = cp.as_object_mut().ok_or(WireError::CpNotAnObject)?;
        if !object.contains_key("ranks") {
            let seconds = |key: &str| -> Vec<f64> {
                object
                    .get(key)
                    .and_then(|v| serde_json::from_value(v.clone()).ok())
                    .unwrap_or_default()
            };
            let (forward, backward) = (
                seconds("forward_s_per_rank"),
                seconds("backward_s_per_rank"),
            );
            let pass = |times: &[f64], rank: usize| PassTimes {
                total_s: times.get(rank).copied(),
                ..PassTimes::default()
            };
            let ranks: Vec<CpRank> = (0..forward.len().max(backward.len()))
                .map(|rank| CpRank {
                    device: None,
                    area: 0,
                    pieces: 0,
                    forward: pass(&forward, rank),
                    backward: pass(&backward, rank),
                })
                .collect();
            object.insert(
                "ranks".into(),
                serde_json::to_value(ranks).map_err(section)?,
            );
        }
        for key in ["bytes_sent_forward", "bytes_sent_backward"] {
            if let Some(Value::Number(total)) = object.get(key).cloned() {
                object.insert(key.into(), Value::Array(vec![Value::Number(total)]));
            }
        }
        serde_json::from_value(cp).map_err(section)
    }
}

#[cfg(test)]
#[path = "record_tests.rs"]
mod tests;
