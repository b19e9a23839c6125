//! The kernel-benchmark protocol, written once: what a kernel plugin's benchmark stage does to one
//! cell (a mask set, a shape, a direction), in the same order for every kernel, so that figures
//! from different plugins mean the same thing.
//!
//! A kernel implements [`KernelBench`]: whether it takes the cell, how much memory it needs,
//! how it prepares, runs and returns outputs, how it is timed and how much memory it held.
//! [`run`] takes the cell through the steps: unsupported → memory budget → seeded inputs →
//! prepare → first run → outputs written and checked against the f64 reference → timing →
//! memory, recording the seconds each step took as the record's phases.

use std::path::Path;
use std::time::Instant;

use serde_json::{json, Map, Value};

use crate::mask::MaskSet;
use crate::measure::{
    Direction, Harness, KernelParams, MeasureStatus, Measurement, Memory, Quantiles, Throughput,
    Timing,
};
use crate::reference::{self, CheckMode, Element, Forward, Grads, HeadMasks, Inputs, Shape};
use crate::PluginError;

/// One benchmark cell.
pub struct Cell<'a> {
    pub set: &'a MaskSet,
    pub shape: Shape,
    pub element: Element,
    pub direction: Direction,
    /// Seeds the inputs, so anyone can recompute the outputs.
    pub seed: u64,
}

impl<'a> Cell<'a> {
    /// The cell a kernel stage's parameters make of `set`, its inputs seeded by `seed`.
    pub fn of(params: &KernelParams, set: &'a MaskSet, seed: u64) -> Cell<'a> {
        Cell {
            set,
            shape: params.shape(set.seqlen as usize),
            element: params.dtype,
            direction: params.direction,
            seed,
        }
    }

    /// The cell's record for `kernel` of `plugin` (name, version), before anything ran.
    pub fn record(&self, kernel: &str, plugin: (&str, &str), harness: Harness) -> Measurement {
        Measurement::for_kernel(
            kernel,
            plugin,
            self.set,
            self.shape,
            self.element,
            self.direction,
            harness,
        )
    }

    pub fn backward(&self) -> bool {
        self.direction.backward()
    }
}

/// Memory a cell needs where memory is scarce, and how much is free there.
pub struct Budget {
    pub needed: u64,
    pub free: u64,
    /// Where, as a sentence ends: `on the device`.
    pub place: &'static str,
}

/// What preparing a cell came to.
pub enum Prepared {
    Ready,
    /// The kernel found, while preparing, that it cannot run the cell: why.
    Unsupported(String),
}

/// A kernel under the protocol. `forward` and `backward` run the kernel on what `prepare` set up;
/// `backward` uses the last forward's outputs.
pub trait KernelBench {
    /// Why the kernel cannot run `cell`, when it cannot: the cell is recorded `unsupported`.
    fn unsupported(&self, _cell: &Cell<'_>) -> Option<String> {
        None
    }

    /// The memory `cell` needs and the memory free, checked before anything is allocated: a
    /// cell that does not fit is recorded `oom`. `None`: nothing to check. A kernel that must ask
    /// elsewhere (a worker process) whether it takes the cell asks here, before the inputs are
    /// drawn, and answers [`PluginError::Unsupported`] when it does not.
    fn budget(&mut self, _cell: &Cell<'_>) -> Result<Option<Budget>, PluginError> {
        Ok(None)
    }

    /// Everything before the first call: uploads, compiles, buffers. `record` takes what the
    /// kernel wants to say about itself (`details`, `gpu`).
    fn prepare(
        &mut self,
        cell: &Cell<'_>,
        inputs: &Inputs,
        record: &mut Measurement,
    ) -> Result<Prepared, PluginError>;

    fn forward(&mut self) -> Result<(), PluginError>;

    fn backward(&mut self) -> Result<(), PluginError>;

    /// The last forward's outputs, and the last backward's gradients when `backward`.
    fn outputs(&mut self, backward: bool) -> Result<(Forward, Option<Grads>), PluginError>;

    /// How the outputs are checked against the f64 reference: every row, or sampled rows.
    fn check_mode(&self, cell: &Cell<'_>) -> CheckMode;

    /// The relative error allowed against the reference.
    fn tolerance(&self, cell: &Cell<'_>) -> f64 {
        cell.element.tolerance()
    }

    /// Times `direction`: the harness's repetitions of the forward, of the backward (on the
    /// first forward's outputs), or of both. The default times on the host's clock; a device
    /// kernel times with its own events.
    fn time(&mut self, harness: &Harness, direction: Direction) -> Result<Timing, PluginError> {
        let mut failure = None;
        let timing = harness.time_with(|| {
            let start = Instant::now();
            let outcome = match direction {
                Direction::Fwd => self.forward(),
                Direction::Bwd => self.backward(),
                Direction::FwdBwd => self.forward().and_then(|()| self.backward()),
            };
            if let Err(err) = outcome {
                failure.get_or_insert(err);
            }
            start.elapsed().as_secs_f64()
        });
        failure.map_or(Ok(timing), Err)
    }

    /// The memory the run held, as the kernel measures or counts it.
    fn memory(&mut self, cell: &Cell<'_>) -> Option<Memory>;
}

/// What [`run`] does beside the protocol's steps.
#[derive(Default)]
pub struct Options<'a> {
    /// Write the first run's outputs here (`out.f32`, `lse.f32`, the gradients).
    pub outputs_dir: Option<&'a Path>,
    /// Skip the check against the reference (a kernel's `check: off`).
    pub no_check: bool,
}

impl<'a> Options<'a> {
    /// A kernel stage's options: its outputs written into `output_dir` when it asks for them.
    pub fn of(params: &KernelParams, output_dir: &'a Path) -> Options<'a> {
        Options {
            outputs_dir: params.outputs.then_some(output_dir),
            no_check: false,
        }
    }
}

/// Takes `cell` through the protocol with `kernel`, filling `record` (made by
/// [`Measurement::for_kernel`] for the cell): its status, check, timing, throughput, memory and
/// phases. A step that runs out of memory ([`PluginError::OutOfMemory`]) makes the record `oom`,
/// one that finds the cell unsupported ([`PluginError::Unsupported`]) `unsupported`, with the
/// kernel's message; any other error fails the stage.
pub fn run<K: KernelBench + ?Sized>(
    kernel: &mut K,
    cell: &Cell<'_>,
    harness: &Harness,
    mut record: Measurement,
    options: Options<'_>,
) -> Result<Measurement, PluginError> {
    if let Some(reason) = kernel.unsupported(cell) {
        return Ok(record.unsupported(reason));
    }
    let budget = match kernel.budget(cell) {
        Ok(budget) => budget,
        Err(PluginError::Unsupported(reason)) => return Ok(record.unsupported(reason)),
        Err(PluginError::OutOfMemory(message)) => return Ok(out_of_memory(record, message)),
        Err(other) => return Err(other),
    };
    if let Some(budget) = budget {
        if budget.needed > budget.free {
            return Ok(out_of_memory(
                record,
                format!(
                    "needs {:.1} GiB {place}, {:.1} GiB are free",
                    gib(budget.needed),
                    gib(budget.free),
                    place = budget.place
                ),
            ));
        }
    }
    match measure(kernel, cell, harness, &mut record, options) {
        Ok(()) => Ok(record),
        Err(PluginError::OutOfMemory(message)) => Ok(out_of_memory(record, message)),
        Err(PluginError::Unsupported(reason)) => Ok(record.unsupported(reason)),
        Err(other) => Err(other),
    }
}

fn out_of_memory(mut record: Measurement, reason: String) -> Measurement {
    record.status = MeasureStatus::Oom;
    record.reason = Some(reason);
    record
}

/// The steps from the inputs on.
fn measure<K: KernelBench + ?Sized>(
    kernel: &mut K,
    cell: &Cell<'_>,
    harness: &Harness,
    record: &mut Measurement,
    options: Options<'_>,
) -> Result<(), PluginError> {
    let mut phases = Phases::new();
    let inputs = Inputs::random_as(&cell.shape, cell.seed, cell.element);
    phases.lap("inputs_s");
    if let Prepared::Unsupported(reason) = kernel.prepare(cell, &inputs, record)? {
        record.status = MeasureStatus::Unsupported;
        record.reason = Some(reason);
        return Ok(());
    }
    phases.lap("prepare_s");
    let backward = cell.backward();
    kernel.forward()?;
    if backward {
        kernel.backward()?;
    }
    let (forward, grads) = kernel.outputs(backward)?;
    phases.lap("first_run_s");
    if let Some(dir) = options.outputs_dir {
        reference::write_outputs(dir, &forward, grads.as_ref())?;
    }
    if !options.no_check {
        record.correctness = Some(reference::check(
            &cell.shape,
            &HeadMasks::new(cell.set, &cell.shape),
            &inputs,
            &forward,
            grads.as_ref(),
            kernel.check_mode(cell),
            kernel.tolerance(cell),
        ));
    }
    drop((forward, grads, inputs));
    phases.lap("check_s");
    let timing = kernel.time(harness, cell.direction)?;
    phases.lap("timing_s");
    let times = Quantiles::of(&timing.samples);
    record.tflops = times.map(|t| Throughput::of(record.flops, &t));
    record.time_s = times;
    record.timing = Some(timing);
    record.memory = kernel.memory(cell);
    record.phases.extend(phases.seconds);
    Ok(())
}

fn gib(bytes: u64) -> f64 {
    bytes as f64 / (1u64 << 30) as f64
}

/// Seconds between laps, by phase name.
struct Phases {
    seconds: Map<String, Value>,
    clock: Instant,
}

impl Phases {
    fn new() -> Phases {
        Phases {
            seconds: Map::new(),
            clock: Instant::now(),
        }
    }

    fn lap(&mut self, name: &str) {
        self.seconds
            .insert(name.into(), json!(self.clock.elapsed().as_secs_f64()));
        self.clock = Instant::now();
    }
}

#[cfg(test)]
#[path = "bench_tests.rs"]
mod tests;
