//! The cuda plugin's kernels under the SDK's benchmark protocol: the naive and the flash kernel
//! on the worker's GPU, timed with device events and an L2 flush, their memory counted by the
//! plugin's tracking allocator.

use attnbench_sdk::bench::{Budget, Cell, KernelBench, Prepared};
use attnbench_sdk::measure::{Direction, Harness, Measurement, Memory, Timing};
use attnbench_sdk::nvml;
use attnbench_sdk::reference::{CheckMode, Forward, Grads, HeadMasks, Inputs};
use attnbench_sdk::{Host, PluginError};
use serde_json::{json, Value};

use crate::gpu::Gpu;
use crate::{flash, naive, BenchParams, Kernel, State};

/// One cell's kernel on the worker's GPU.
pub(crate) struct CudaBench<'a> {
    pub state: &'a mut State,
    pub params: &'a BenchParams,
    pub masks: HeadMasks<'a>,
    pub host: &'a Host<'a>,
    problem: Option<Problem>,
    /// Device memory in use before the cell's buffers.
    base: usize,
    peak: usize,
    /// NVML's clocks just before and just after the timing.
    pub clocks: (Value, Value),
}

impl<'a> CudaBench<'a> {
    pub fn new(
        state: &'a mut State,
        params: &'a BenchParams,
        masks: HeadMasks<'a>,
        host: &'a Host<'a>,
    ) -> Self {
        CudaBench {
            state,
            params,
            masks,
            host,
            problem: None,
            base: 0,
            peak: 0,
            clocks: (Value::Null, Value::Null),
        }
    }

    fn flash(&self) -> bool {
        self.params.kernel == Kernel::Flash
    }
}

fn unprepared() -> PluginError {
    PluginError::failed("the cuda kernel ran before it was prepared")
}

impl KernelBench for CudaBench<'_> {
    fn unsupported(&self, cell: &Cell<'_>) -> Option<String> {
        if self.flash() {
            return flash::unsupported(&cell.shape, cell.element);
        }
        cell.shape.head_dim_v.map(|value_dim| {
            format!(
                "the naive kernel takes one head dim for Q, K and V; head_dim_v {value_dim} differs from head_dim {} (the flash kernel takes MLA's 192/128)",
                cell.shape.head_dim
            )
        })
    }

    fn budget(&mut self, cell: &Cell<'_>) -> Result<Option<Budget>, PluginError> {
        let needed = if self.flash() {
            flash::bytes_needed(&cell.shape, cell.element, cell.backward())
        } else {
            naive::bytes_needed(&cell.shape, cell.element, cell.backward())
        };
        Ok(Some(Budget {
            needed: needed as u64,
            free: self.state.gpu.free_bytes()? as u64,
            place: "on the device",
        }))
    }

    fn prepare(
        &mut self,
        cell: &Cell<'_>,
        inputs: &Inputs,
        record: &mut Measurement,
    ) -> Result<Prepared, PluginError> {
        let compiling = std::time::Instant::now();
        let state = &mut *self.state;
        if self.params.kernel == Kernel::Flash && state.flash.is_none() {
            self.host.info("compiling the flash kernel with NVRTC");
            state.flash = Some(flash::compile(&state.gpu)?);
            record
                .phases
                .insert("compile_s".into(), json!(compiling.elapsed().as_secs_f64()));
        }
        if self.params.kernel == Kernel::Naive && state.naive.is_none() {
            self.host
                .info("compiling the naive kernel's row kernels with NVRTC");
            state.naive = Some(naive::compile(&state.gpu)?);
            record
                .phases
                .insert("compile_s".into(), json!(compiling.elapsed().as_secs_f64()));
        }
        let gpu = &state.gpu;
        self.base = gpu.memory.current();
        gpu.memory.reset_peak();
        let (shape, element, backward) = (cell.shape, cell.element, cell.backward());
        let problem = match (&state.flash, &state.naive, self.params.kernel) {
            (Some(kernels), _, Kernel::Flash) => {
                let mut problem = flash::Problem::upload(
                    gpu,
                    kernels,
                    shape,
                    element,
                    &self.masks,
                    inputs,
                    backward,
                )?;
                problem.backward = self.params.backward;
                problem.instructions = self.params.instructions;
                problem.schedule = self.params.schedule;
                match problem.instructions_used() {
                    Ok((forward, backward)) => {
                        record
                            .details
                            .insert("flash_forward".into(), forward.into());
                        if let Some(backward) = backward {
                            record
                                .details
                                .insert("flash_backward".into(), backward.into());
                        }
                    }
                    Err(PluginError::Failed(reason)) => return Ok(Prepared::Unsupported(reason)),
                    Err(other) => return Err(other),
                }
                Problem::Flash(Box::new(problem))
            }
            (_, Some(kernels), Kernel::Naive) => Problem::Naive(Box::new(naive::Problem::upload(
                gpu,
                kernels,
                shape,
                element,
                &self.masks,
                inputs,
                backward,
            )?)),
            _ => unreachable!("the kernel was compiled above"),
        };
        self.problem = Some(problem);
        Ok(Prepared::Ready)
    }

    fn forward(&mut self) -> Result<(), PluginError> {
        let problem = self.problem.as_ref().ok_or_else(unprepared)?;
        problem.forward(&self.state.gpu)
    }

    fn backward(&mut self) -> Result<(), PluginError> {
        let problem = self.problem.as_mut().ok_or_else(unprepared)?;
        problem.backward(&self.state.gpu)
    }

    fn outputs(&mut self, backward: bool) -> Result<(Forward, Option<Grads>), PluginError> {
        let problem = self.problem.as_ref().ok_or_else(unprepared)?;
        let gpu = &self.state.gpu;
        let grads = if backward { problem.grads(gpu)? } else { None };
        Ok((problem.outputs(gpu)?, grads))
    }

    fn check_mode(&self, cell: &Cell<'_>) -> CheckMode {
        if cell.shape.seqlen <= self.params.check_max_seqlen {
            CheckMode::Full
        } else {
            CheckMode::Sampled { rows: 16 }
        }
    }

    /// Device events around each repetition, the L2 flushed before it (the GPU's harness).
    fn time(&mut self, harness: &Harness, direction: Direction) -> Result<Timing, PluginError> {
        let problem = self.problem.as_mut().ok_or_else(unprepared)?;
        let gpu = &mut self.state.gpu;
        self.clocks.0 = nvml::clocks();
        let timing = match direction {
            Direction::Fwd => gpu.time(harness, |gpu| problem.forward(gpu))?,
            Direction::Bwd => gpu.time(harness, |gpu| problem.backward(gpu))?,
            Direction::FwdBwd => gpu.time(harness, |gpu| {
                problem.forward(gpu)?;
                problem.backward(gpu)
            })?,
        };
        self.peak = gpu.memory.peak() - self.base;
        self.problem = None;
        self.clocks.1 = nvml::clocks();
        Ok(timing)
    }

    fn memory(&mut self, cell: &Cell<'_>) -> Option<Memory> {
        let shape = &cell.shape;
        let d_out = if cell.backward() { shape.out_len() } else { 0 };
        let inputs_bytes =
            (shape.q_len() + shape.kv_len() + shape.v_len() + d_out) * cell.element.bytes();
        Some(Memory {
            peak_bytes: self.peak as u64,
            above_inputs_bytes: self.peak.saturating_sub(inputs_bytes) as u64,
            method: "the plugin's tracking allocator: the most device memory the kernel's buffers held at once (cuBLAS's own workspace not included)".into(),
        })
    }
}

/// One kernel's device problem.
enum Problem {
    Naive(Box<naive::Problem>),
    Flash(Box<flash::Problem>),
}

impl Problem {
    fn forward(&self, gpu: &Gpu) -> Result<(), PluginError> {
        match self {
            Problem::Naive(p) => p.forward(gpu),
            Problem::Flash(p) => p.forward(gpu),
        }
    }

    fn backward(&mut self, gpu: &Gpu) -> Result<(), PluginError> {
        match self {
            Problem::Naive(p) => p.backward(gpu),
            Problem::Flash(p) => p.backward(gpu),
        }
    }

    fn outputs(&self, gpu: &Gpu) -> Result<Forward, PluginError> {
        let (out, lse) = match self {
            Problem::Naive(p) => (&p.out, &p.lse),
            Problem::Flash(p) => (&p.out, &p.lse),
        };
        Ok(Forward {
            out: gpu.download(out)?,
            lse: gpu.download(lse)?,
        })
    }

    fn grads(&self, gpu: &Gpu) -> Result<Option<Grads>, PluginError> {
        match self {
            Problem::Naive(p) => p.grads(gpu),
            Problem::Flash(p) => p.grads(gpu),
        }
    }
}
