//! A CP method on threads or rank processes under the SDK's kernel-benchmark protocol
//! (`attnbench_sdk::bench`): the same steps, check and record as every other kernel stage. What is
//! CP's own: one pass runs the forward and, for a backward cell, the backward with it (the ranks
//! exchange what the backward needs during the pass), and a repetition lasts as long as its
//! slowest rank — the paper's per-GPU time.

use attnbench_sdk::attention::Backend as AttentionBackend;
use attnbench_sdk::bench::{Cell, KernelBench, Prepared};
use attnbench_sdk::mask::MaskSet;
use attnbench_sdk::measure::{Direction, Harness, Measurement, Memory, Timing};
use attnbench_sdk::reference::{Arithmetic, CheckMode, Forward, Grads, Inputs, Shape};
use attnbench_sdk::PluginError;

use crate::methods::Setup;
use crate::processes;
use crate::threads::{self, Outcome};

/// Where the ranks run.
pub enum Ranks<'a> {
    /// Threads of this process, on the protocol's inputs.
    Threads {
        setup: &'a Setup,
        set: &'a MaskSet,
        attention: Option<&'a AttentionBackend>,
    },
    /// `attnbench-cp-rank` processes started on `job` (written at `path`); each draws the same
    /// inputs from the job's seed.
    Processes {
        job: &'a processes::Job,
        path: &'a std::path::Path,
    },
}

pub struct CpBench<'a> {
    pub ranks: Ranks<'a>,
    pub shape: Shape,
    pub backward: bool,
    inputs: Option<Inputs>,
    /// The first pass's outcome (the protocol's one forward): its outputs are checked, and its
    /// bytes and rank times go into the record. Timed passes keep only their times.
    pub first: Option<Outcome>,
    /// The mean rank's time of each timed repetition (for the mean-rank throughput).
    pub mean_rank_s: Vec<f64>,
}

impl<'a> CpBench<'a> {
    pub fn new(ranks: Ranks<'a>, shape: Shape, backward: bool) -> CpBench<'a> {
        CpBench {
            ranks,
            shape,
            backward,
            inputs: None,
            first: None,
            mean_rank_s: Vec::new(),
        }
    }

    fn pass(&self) -> Result<Outcome, PluginError> {
        let outcome = match &self.ranks {
            Ranks::Threads {
                setup,
                set,
                attention,
            } => {
                let inputs = self.inputs.as_ref().ok_or_else(unprepared)?;
                threads::run(setup, &self.shape, set, inputs, self.backward, *attention)
            }
            Ranks::Processes { job, path } => {
                processes::run(job, path, std::time::Duration::from_secs(600))
            }
        };
        outcome.map_err(|err| PluginError::failed(err.to_string()))
    }
}

fn unprepared() -> PluginError {
    PluginError::failed("the CP benchmark ran before it was prepared")
}

/// Each rank's time of a repetition in `direction`: its forward, its backward, or both.
pub fn pass_times(direction: Direction, forward: &[f64], backward: &[f64]) -> Vec<f64> {
    match direction {
        Direction::Fwd => forward.to_vec(),
        Direction::Bwd => backward.to_vec(),
        Direction::FwdBwd => forward.iter().zip(backward).map(|(f, b)| f + b).collect(),
    }
}

impl KernelBench for CpBench<'_> {
    fn prepare(
        &mut self,
        _cell: &Cell<'_>,
        inputs: &Inputs,
        _record: &mut Measurement,
    ) -> Result<Prepared, PluginError> {
        // Rank processes draw their own inputs from the seed; threads share these.
        if matches!(self.ranks, Ranks::Threads { .. }) {
            self.inputs = Some(inputs.clone());
        }
        Ok(Prepared::Ready)
    }

    fn forward(&mut self) -> Result<(), PluginError> {
        self.first = Some(self.pass()?);
        Ok(())
    }

    /// The pass that [`forward`](Self::forward) ran already holds the gradients.
    fn backward(&mut self) -> Result<(), PluginError> {
        match &self.first {
            Some(outcome) if outcome.grads.is_some() => Ok(()),
            _ => Err(PluginError::failed(
                "the CP pass ran without its backward on a backward cell",
            )),
        }
    }

    fn outputs(&mut self, backward: bool) -> Result<(Forward, Option<Grads>), PluginError> {
        let outcome = self.first.as_ref().ok_or_else(unprepared)?;
        let forward = Forward {
            out: outcome.out.clone(),
            lse: outcome.lse.clone(),
        };
        let grads = match (&outcome.grads, backward) {
            (Some([dq, dk, dv]), true) => Some(Grads {
                dq: dq.clone(),
                dk: dk.clone(),
                dv: dv.clone(),
            }),
            _ => None,
        };
        Ok((forward, grads))
    }

    /// Every output row: CP runs at CPU sizes, and a wrong exchange shows in a few rows only.
    fn check_mode(&self, _cell: &Cell<'_>) -> CheckMode {
        CheckMode::Full
    }

    /// Ranks on the host keep their values in f64, as the reference does.
    fn tolerance(&self, _cell: &Cell<'_>) -> f64 {
        Arithmetic::F64.tolerance()
    }

    fn time(&mut self, harness: &Harness, direction: Direction) -> Result<Timing, PluginError> {
        let mut failure = None;
        let timing = harness.time_with(|| match self.pass() {
            Ok(outcome) => {
                let ranks = pass_times(direction, &outcome.forward_s, &outcome.backward_s);
                let slowest = ranks.iter().copied().fold(0.0, f64::max);
                self.mean_rank_s
                    .push(ranks.iter().sum::<f64>() / ranks.len().max(1) as f64);
                slowest
            }
            Err(err) => {
                failure.get_or_insert(err);
                0.0
            }
        });
        failure.map_or(Ok(timing), Err)
    }

    fn memory(&mut self, _cell: &Cell<'_>) -> Option<Memory> {
        None
    }
}
