//! A Python kernel under the SDK's kernel-benchmark protocol: each step of [`bench::run`] is a
//! request on the worker's open cell (the bridge's `session.py`). The host draws the inputs,
//! checks the outputs and stops the timing, as for every native kernel; the worker runs the
//! library's call.
//!
//! [`bench::run`]: attnbench_sdk::bench::run

use std::io::Write;
use std::path::{Path, PathBuf};

use attnbench_sdk::bench::{Budget, Cell, KernelBench, Prepared};
use attnbench_sdk::measure::{
    Direction, Harness, MeasureStatus, Measurement, Memory, Timing, UnsupportedScope,
};
use attnbench_sdk::reference::{self, CheckMode, Element, Forward, Grads, Inputs};
use attnbench_sdk::{nvml, PluginError};
use serde_json::{json, Map, Value};

use crate::bridge::Reply;
use crate::with_bridge;

/// Values encoded and written per chunk: the inputs of a long sequence are gigabytes.
const WRITE_CHUNK: usize = 1 << 20;

/// One cell on the worker, and what its replies said about the run.
pub struct PyCell<'a> {
    setup: CellSetup<'a>,
    /// The worker's greeting (Python version and executable).
    pub hello: Value,
    /// The worker's last word on its environment (versions, device, notes).
    pub environment: Map<String, Value>,
    /// The worker's own phases (compile, mask build, upload).
    pub phases: Map<String, Value>,
    /// GPU clocks before and after the timed repetitions.
    pub clocks: (Value, Value),
    /// Set when the worker refused the cell for this machine's reasons (a missing package).
    pub scope: Option<UnsupportedScope>,
    memory: Option<Memory>,
}

/// What the plugin passes to a cell.
pub struct CellSetup<'a> {
    pub python: &'a str,
    /// How errors name the kernel (`flex`, `module:my_kernel`, `sdpa-math layout=bhsd`).
    pub kernel: &'a str,
    /// The problem, as the `open` request carries it.
    pub problem: Value,
    /// A private folder for the inputs and outputs the worker exchanges with the host.
    pub exchange: PathBuf,
    pub element: Element,
    pub check_max_seqlen: usize,
    pub check_rows: usize,
    pub on_gpu: bool,
}

impl<'a> PyCell<'a> {
    pub fn new(setup: CellSetup<'a>) -> PyCell<'a> {
        PyCell {
            setup,
            hello: Value::Null,
            environment: Map::new(),
            phases: Map::new(),
            clocks: (Value::Null, Value::Null),
            scope: None,
            memory: None,
        }
    }

    /// One request on the open cell: its result when the worker says `ok`; a refusal as the
    /// protocol's `Unsupported` or `OutOfMemory`.
    fn step(
        &mut self,
        op: &str,
        params: Value,
        harness: Option<&Harness>,
    ) -> Result<Value, PluginError> {
        let kernel = self.setup.kernel;
        let (reply, hello) = with_bridge(self.setup.python, op, params, harness)?;
        self.hello = hello;
        let result = match reply {
            Reply::Ok(result) => result,
            Reply::BadParams(message) => {
                return Err(PluginError::Params(format!("{kernel}: {message}")))
            }
            Reply::Failed(message) => {
                return Err(PluginError::failed(format!("{kernel}: {message}")))
            }
            Reply::Died(message) => {
                return Err(PluginError::failed(format!("{kernel} crashed: {message}")))
            }
        };
        if let Some(environment) = result["environment"].as_object() {
            self.environment = environment.clone();
        }
        let reason = || {
            result["reason"]
                .as_str()
                .unwrap_or("no reason given")
                .to_string()
        };
        match result["status"].as_str() {
            Some("ok") => Ok(result),
            Some("unsupported") => {
                // `machine` where an import or the device failed; without a scope it is the case's.
                self.scope = result["scope"]
                    .as_str()
                    .and_then(UnsupportedScope::from_name);
                Err(PluginError::Unsupported(reason()))
            }
            Some("oom") => Err(PluginError::OutOfMemory(reason())),
            other => Err(PluginError::failed(format!(
                "{kernel}: the Python worker answered `{op}` with status {other:?}"
            ))),
        }
    }

    /// Writes `values` in the cell's element type (what the worker reads as `name.<dtype>`).
    fn write_input(&self, name: &str, values: &[f32]) -> Result<(), PluginError> {
        let path = self
            .setup
            .exchange
            .join(format!("{name}.{}", self.setup.element));
        let file = std::fs::File::create(&path).map_err(|err| PluginError::io(&path, err))?;
        let mut out = std::io::BufWriter::new(file);
        for chunk in values.chunks(WRITE_CHUNK) {
            out.write_all(&self.setup.element.encode(chunk))
                .map_err(|err| PluginError::io(&path, err))?;
        }
        out.flush().map_err(|err| PluginError::io(&path, err))
    }

    fn read_output(&self, name: &str) -> Result<Vec<f32>, PluginError> {
        let path = self.setup.exchange.join(name);
        let values = reference::read_tensor(&path)?;
        let _ = std::fs::remove_file(&path);
        Ok(values)
    }

    /// Fills what the worker said beside the protocol's steps into the record.
    pub fn describe(&self, record: &mut Measurement) {
        record.details.insert("python".into(), self.hello.clone());
        if record.status == MeasureStatus::Unsupported {
            if let Some(scope) = self.scope {
                record.unsupported_scope = Some(scope);
            }
        }
        for (name, seconds) in &self.phases {
            record.phases.entry(name.clone()).or_insert(seconds.clone());
        }
    }
}

impl KernelBench for PyCell<'_> {
    /// Opens the cell on the worker: whether the kernel takes it, and the device memory it needs.
    fn budget(&mut self, _cell: &Cell<'_>) -> Result<Option<Budget>, PluginError> {
        let opened = self.step("open", self.setup.problem.clone(), None)?;
        let budget = &opened["budget"];
        Ok(
            match (
                budget["needed_bytes"].as_u64(),
                budget["free_bytes"].as_u64(),
            ) {
                (Some(needed), Some(free)) => Some(Budget {
                    needed,
                    free,
                    place: "on the device",
                }),
                _ => None,
            },
        )
    }

    fn prepare(
        &mut self,
        cell: &Cell<'_>,
        inputs: &Inputs,
        _record: &mut Measurement,
    ) -> Result<Prepared, PluginError> {
        std::fs::create_dir_all(&self.setup.exchange)
            .map_err(|err| PluginError::io(&self.setup.exchange, err))?;
        self.write_input("q", &inputs.q)?;
        self.write_input("k", &inputs.k)?;
        self.write_input("v", &inputs.v)?;
        if cell.backward() {
            self.write_input("do", &inputs.d_out)?;
        }
        let dir = self.setup.exchange.display().to_string();
        let prepared = self.step("prepare", json!({"inputs_dir": dir}), None);
        for name in ["q", "k", "v", "do"] {
            let _ = std::fs::remove_file(
                self.setup
                    .exchange
                    .join(format!("{name}.{}", self.setup.element)),
            );
        }
        prepared.map(|_| Prepared::Ready)
    }

    fn forward(&mut self) -> Result<(), PluginError> {
        self.step("forward", Value::Null, None).map(drop)
    }

    fn backward(&mut self) -> Result<(), PluginError> {
        self.step("backward", Value::Null, None).map(drop)
    }

    fn outputs(&mut self, backward: bool) -> Result<(Forward, Option<Grads>), PluginError> {
        let dir = self.setup.exchange.display().to_string();
        let written = self.step("outputs", json!({"dir": dir}), None)?;
        let has_lse = written["written"]
            .as_array()
            .is_some_and(|names| names.iter().any(|n| n == "lse.f32"));
        let forward = Forward {
            out: self.read_output("out.f32")?,
            lse: if has_lse {
                self.read_output("lse.f32")?
            } else {
                Vec::new()
            },
        };
        let grads = if backward {
            Some(Grads {
                dq: self.read_output("dq.f32")?,
                dk: self.read_output("dk.f32")?,
                dv: self.read_output("dv.f32")?,
            })
        } else {
            None
        };
        Ok((forward, grads))
    }

    fn check_mode(&self, cell: &Cell<'_>) -> CheckMode {
        if cell.shape.seqlen <= self.setup.check_max_seqlen {
            CheckMode::Full
        } else {
            CheckMode::Sampled {
                rows: self.setup.check_rows,
            }
        }
    }

    /// The SDK's table, except that a library's f32 kernels may run their products in TF32.
    fn tolerance(&self, cell: &Cell<'_>) -> f64 {
        match cell.element {
            Element::F32 => reference::Arithmetic::Tf32.tolerance(),
            other => other.tolerance(),
        }
    }

    /// The worker's repetitions (CUDA events around each, the L2 flushed before it; the CPU's
    /// clock for numpy), stopped by the host's harness.
    fn time(&mut self, harness: &Harness, _direction: Direction) -> Result<Timing, PluginError> {
        let clocks = |on_gpu| if on_gpu { nvml::clocks() } else { Value::Null };
        let before = clocks(self.setup.on_gpu);
        let timed = self.step("time", Value::Null, Some(harness))?;
        self.clocks = (before, clocks(self.setup.on_gpu));
        if let Some(phases) = timed["phases"].as_object() {
            self.phases = phases.clone();
        }
        let memory = &timed["memory"];
        if let (Some(peak), Some(above)) = (
            memory["peak_bytes"].as_u64(),
            memory["above_inputs_bytes"].as_u64(),
        ) {
            self.memory = Some(Memory {
                peak_bytes: peak,
                above_inputs_bytes: above,
                method: memory["method"]
                    .as_str()
                    .unwrap_or("reported by the Python worker")
                    .into(),
            });
        }
        let samples: Vec<f64> = timed["samples"]
            .as_array()
            .map(|a| a.iter().filter_map(Value::as_f64).collect())
            .unwrap_or_default();
        Ok(Timing {
            rel_ci: attnbench_sdk::measure::median_rel_ci(&samples),
            stopped: timed["stopped"].as_str().unwrap_or("").into(),
            samples,
        })
    }

    fn memory(&mut self, _cell: &Cell<'_>) -> Option<Memory> {
        self.memory.take()
    }
}

/// Removes the exchange folder whatever happened (a refused or failed step leaves files).
pub fn clear(exchange: &Path) {
    let _ = std::fs::remove_dir_all(exchange);
}
