//! The parts of the measurement record every benchmark stage emits ([`Measurement`], in
//! `record`), and the timing harness (CPU variant) that produces its statistics: warm-up by count
//! and time, repetitions until the median is stable or a time cap, quantiles rather than a single
//! mean.

use std::time::Instant;

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

pub use crate::record::{text_of, CpRank, CpRun, GpuRun, Measurement, PassTimes, RECORD_VERSION};

/// How a measurement ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MeasureStatus {
    Ok,
    /// The kernel cannot run this case, or not on this machine (`unsupported_scope` says
    /// which); `reason` says why.
    Unsupported,
    Oom,
    Crashed,
    Timeout,
    Error,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MaskInfo {
    pub pattern: String,
    pub seqlen: u64,
    /// Allowed cells summed over the query heads (what FLOPs are counted from).
    pub area: u64,
    pub documents: usize,
    pub params: Map<String, Value>,
}

crate::named_enum! {
    /// What an `unsupported` refers to: this case (a mask, shape or dtype the kernel cannot take)
    /// or this machine (a package, library or device the kernel needs is missing here).
    pub enum UnsupportedScope { Case = "case", Machine = "machine" }
}

crate::named_enum! {
    /// What a kernel measurement times: the forward, the backward alone (after one forward
    /// outside the timed region), or both.
    pub enum Direction { Fwd = "fwd", Bwd = "bwd", FwdBwd = "fwd_bwd" }
}

impl Direction {
    /// Whether it runs a backward pass (and so needs dO and gives gradients).
    pub fn backward(self) -> bool {
        self != Direction::Fwd
    }
}

/// Seconds at the 20th, 50th and 80th percentiles, the minimum, the mean and the count.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Quantiles {
    pub p20: f64,
    pub p50: f64,
    pub p80: f64,
    pub min: f64,
    pub mean: f64,
    pub n: usize,
}

impl Quantiles {
    /// Quantiles of `samples` (linear interpolation between order statistics).
    pub fn of(samples: &[f64]) -> Option<Quantiles> {
        if samples.is_empty() {
            return None;
        }
        let mut sorted = samples.to_vec();
        sorted.sort_by(f64::total_cmp);
        let at = |p: f64| {
            let position = p * (sorted.len() - 1) as f64;
            let (low, high) = (position.floor() as usize, position.ceil() as usize);
            sorted[low] + (sorted[high] - sorted[low]) * (position - low as f64)
        };
        Some(Quantiles {
            p20: at(0.2),
            p50: at(0.5),
            p80: at(0.8),
            min: sorted[0],
            mean: sorted.iter().sum::<f64>() / sorted.len() as f64,
            n: sorted.len(),
        })
    }
}

/// TFLOP/s at each time quantile (`max` from the fastest repetition).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Throughput {
    pub p20: f64,
    pub p50: f64,
    pub p80: f64,
    pub max: f64,
}

impl Throughput {
    pub fn of(flops: u64, times: &Quantiles) -> Throughput {
        let rate = |seconds: f64| {
            if seconds > 0.0 {
                flops as f64 / seconds / 1e12
            } else {
                0.0
            }
        };
        Throughput {
            p20: rate(times.p20),
            p50: rate(times.p50),
            p80: rate(times.p80),
            max: rate(times.min),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Memory {
    pub peak_bytes: u64,
    /// Peak above the inputs (Q, K, V and, for backward, O and dO).
    pub above_inputs_bytes: u64,
    /// How the peak was obtained.
    pub method: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Correctness {
    /// What the output was compared with.
    pub reference: String,
    /// Which outputs, and which part of them (all rows, or sampled rows).
    pub checked: String,
    /// Largest |error| divided by the largest |reference value|, per output.
    pub errors: Map<String, Value>,
    pub tolerance: f64,
    pub passed: bool,
}

/// Settings of the timing harness; recorded with every measurement.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Harness {
    pub timer: String,
    pub warmup_reps: u32,
    pub warmup_s: f64,
    pub min_reps: u32,
    pub max_reps: u32,
    pub max_time_s: f64,
    /// Stop once the 95% confidence interval of the median is within ± this fraction of it.
    pub target_rel_ci: f64,
}

impl Default for Harness {
    fn default() -> Self {
        Harness {
            timer: "wall clock (CPU)".into(),
            warmup_reps: 1,
            warmup_s: 0.05,
            min_reps: 5,
            max_reps: 200,
            max_time_s: 2.0,
            target_rel_ci: 0.01,
        }
    }
}

impl Harness {
    /// The GPU plugins' settings when a pipeline does not change them: device events with the
    /// L2 flushed before every repetition, a 1% confidence bound, at most 5 s of repetitions.
    pub fn gpu() -> Harness {
        Harness {
            timer: "CUDA events, L2 flushed (2× its size) before every repetition".into(),
            warmup_reps: 3,
            warmup_s: 0.1,
            min_reps: 10,
            max_reps: 200,
            max_time_s: 5.0,
            target_rel_ci: 0.01,
        }
    }

    /// Declares the harness's settings as parameters of `stage`, with this harness's values as
    /// defaults, so pipelines can tune them per stage (read back with [`HarnessParams`]).
    pub fn declare(&self, stage: crate::StageSpec) -> crate::StageSpec {
        use crate::{ParamSpec, ParamType};
        stage
            .param(
                ParamSpec::new("warmup_reps", ParamType::Int)
                    .default(self.warmup_reps)
                    .doc("Harness: warm-up repetitions."),
            )
            .param(
                ParamSpec::new("min_reps", ParamType::Int)
                    .default(self.min_reps)
                    .doc("Harness: fewest timed repetitions."),
            )
            .param(
                ParamSpec::new("max_reps", ParamType::Int)
                    .default(self.max_reps)
                    .doc("Harness: most timed repetitions."),
            )
            .param(
                ParamSpec::new("max_time_s", ParamType::Float)
                    .default(self.max_time_s)
                    .doc("Harness: time cap for the timed repetitions."),
            )
            .param(
                ParamSpec::new("target_rel_ci", ParamType::Float)
                    .default(self.target_rel_ci)
                    .doc("Harness: stop once the median's 95% CI is within ± this fraction."),
            )
    }
}

/// The harness settings a stage declared with [`Harness::declare`]; `#[serde(flatten)]` it into
/// the stage's parameter struct.
#[derive(Debug, Clone, Deserialize)]
pub struct HarnessParams {
    pub warmup_reps: u32,
    pub min_reps: u32,
    pub max_reps: u32,
    pub max_time_s: f64,
    pub target_rel_ci: f64,
}

impl HarnessParams {
    /// `base` (timer, warm-up time) with these settings; at least one repetition, and no fewer
    /// maximum than minimum repetitions.
    pub fn apply(&self, base: Harness) -> Harness {
        Harness {
            warmup_reps: self.warmup_reps,
            min_reps: self.min_reps.max(1),
            max_reps: self.max_reps.max(self.min_reps.max(1)),
            max_time_s: self.max_time_s,
            target_rel_ci: self.target_rel_ci,
            ..base
        }
    }
}

/// What one timing run observed.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Timing {
    pub samples: Vec<f64>,
    /// Half-width of the median's 95% confidence interval, relative to the median; infinite
    /// (`null` in JSON, which has no infinity) when too few samples bound it.
    #[serde(deserialize_with = "infinite_if_null")]
    pub rel_ci: f64,
    /// Why repetitions stopped: `stable`, `time cap` or `max reps`.
    pub stopped: String,
}

fn infinite_if_null<'de, D: serde::Deserializer<'de>>(value: D) -> Result<f64, D::Error> {
    Ok(Option::<f64>::deserialize(value)?.unwrap_or(f64::INFINITY))
}

impl Harness {
    /// Times `work` on the CPU: warm-up (at least `warmup_reps` and `warmup_s`), then
    /// repetitions until the median is stable, the time cap, or `max_reps`. `prepare` runs before
    /// each repetition, outside the timed region.
    pub fn time(&self, mut prepare: impl FnMut(), mut work: impl FnMut()) -> Timing {
        self.time_with(|| {
            prepare();
            let rep = Instant::now();
            work();
            rep.elapsed().as_secs_f64()
        })
    }

    /// The same protocol for a repetition that times itself (device events, say): `rep` does
    /// whatever must happen before the timed region, then returns the seconds the region took.
    pub fn time_with(&self, mut rep: impl FnMut() -> f64) -> Timing {
        let mut run = HarnessRun::new(self);
        loop {
            if let Some(timing) = run.record(rep()) {
                return timing;
            }
        }
    }
}

/// One timing run under a [`Harness`], a repetition at a time: the rule itself, for
/// [`Harness::time_with`] and for repetitions that run elsewhere and are reported as they finish
/// (the Python worker's, which asks after each whether another follows). The warm-up clock
/// starts when the run is made ([`HarnessRun::since`]: when its first repetition began).
pub struct HarnessRun<'a> {
    harness: &'a Harness,
    warmups: u32,
    warmup_start: Instant,
    /// When the timed repetitions began; `None` while warming up.
    timed_start: Option<Instant>,
    samples: Vec<f64>,
}

impl<'a> HarnessRun<'a> {
    pub fn new(harness: &'a Harness) -> HarnessRun<'a> {
        HarnessRun::since(harness, Instant::now())
    }

    /// A run whose first repetition began at `start`: reported after the fact, it counts
    /// toward the warm-up's time (or the time cap, without a warm-up) as it would have.
    pub fn since(harness: &'a Harness, start: Instant) -> HarnessRun<'a> {
        let mut run = HarnessRun {
            harness,
            warmups: 0,
            warmup_start: start,
            timed_start: None,
            samples: Vec::new(),
        };
        run.end_warmup_if_done();
        run
    }

    /// Whether the next repetition recorded is still a warm-up one (its seconds are dropped).
    pub fn warming_up(&self) -> bool {
        self.timed_start.is_none()
    }

    /// Records a finished repetition's seconds (a warm-up's are dropped): the timing once the
    /// rule stops the run, `None` while another repetition should follow.
    pub fn record(&mut self, seconds: f64) -> Option<Timing> {
        let Some(start) = self.timed_start else {
            self.warmups += 1;
            self.end_warmup_if_done();
            return None;
        };
        self.samples.push(seconds);
        let h = self.harness;
        let rel_ci = median_rel_ci(&self.samples);
        let n = self.samples.len() as u32;
        let stopped = if n >= h.min_reps && rel_ci <= h.target_rel_ci {
            "stable"
        } else if n >= h.max_reps {
            "max reps"
        } else if n >= h.min_reps.min(3) && start.elapsed().as_secs_f64() >= h.max_time_s {
            "time cap"
        } else {
            return None;
        };
        Some(Timing {
            samples: std::mem::take(&mut self.samples),
            rel_ci,
            stopped: stopped.into(),
        })
    }

    /// Warm-up lasts at least `warmup_reps` repetitions and `warmup_s` seconds, at most
    /// `max_reps` repetitions.
    fn end_warmup_if_done(&mut self) {
        let h = self.harness;
        let warming =
            self.warmups < h.warmup_reps || self.warmup_start.elapsed().as_secs_f64() < h.warmup_s;
        if !warming || self.warmups >= h.max_reps {
            // Without a warm-up the timed repetitions began with the run.
            self.timed_start = Some(if self.warmups == 0 {
                self.warmup_start
            } else {
                Instant::now()
            });
        }
    }
}

/// Distribution-free 95% confidence interval of the median from order statistics, as a
/// fraction of the median (half-width).
pub fn median_rel_ci(samples: &[f64]) -> f64 {
    let n = samples.len();
    if n < 3 {
        return f64::INFINITY;
    }
    let mut sorted = samples.to_vec();
    sorted.sort_by(f64::total_cmp);
    let half = 0.98 * (n as f64).sqrt();
    let low = ((n as f64 / 2.0 - half).floor().max(0.0)) as usize;
    let high = ((n as f64 / 2.0 + half).ceil() as usize).min(n - 1);
    let median = Quantiles::of(&sorted).map(|q| q.p50).unwrap_or(0.0);
    if median <= 0.0 {
        return f64::INFINITY;
    }
    (sorted[high] - sorted[low]) / 2.0 / median
}

/// The parameters every kernel stage takes ([`crate::KERNEL_PARAMS`]) and the harness's, as a stage
/// reads them: `#[serde(flatten)] common: KernelParams` beside the stage's own.
#[derive(Debug, Clone, Deserialize)]
pub struct KernelParams {
    pub direction: Direction,
    pub heads_q: usize,
    pub heads_kv: usize,
    pub head_dim: usize,
    /// Absent: equal to `head_dim`.
    #[serde(default)]
    pub head_dim_v: Option<usize>,
    pub dtype: crate::reference::Element,
    pub outputs: bool,
    #[serde(flatten)]
    pub harness: HarnessParams,
}

impl KernelParams {
    pub fn backward(&self) -> bool {
        self.direction.backward()
    }

    /// The problem's layout for a mask of `seqlen` tokens.
    pub fn shape(&self, seqlen: usize) -> crate::reference::Shape {
        crate::reference::Shape::new(self.heads_q, self.heads_kv, seqlen, self.head_dim)
            .with_value_dim(self.head_dim_v)
    }
}

/// One point of a cost model's curve: a method's predicted per-GPU throughput at a world size.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Prediction {
    pub method: String,
    pub mask: String,
    pub direction: String,
    pub world: u64,
    pub tokens_per_gpu: u64,
    /// `None` when the method cannot run at this size; `reason` says why.
    pub tflops_per_gpu: Option<f64>,
    pub time_s: Option<f64>,
    pub compute_s: Option<f64>,
    /// Communication time not hidden behind compute.
    pub exposed_communication_s: Option<f64>,
    pub reason: Option<String>,
    /// How the sequence is dealt over the ring, and the most loaded rank's work over the mean
    /// rank's under it (its compute is that much longer).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sharding: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub imbalance: Option<f64>,
}

/// A context-parallel cell measured on GPUs beside the cost model's prediction for it: the same
/// method, world, groups and tokens, compute at the cell's own kernel rate (its slowest rank's
/// kernel time), so that the two differ only in what the model says about communication.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Comparison {
    pub method: String,
    pub mask: String,
    pub direction: String,
    pub world: u64,
    pub tokens_per_gpu: u64,
    /// The cell's median time of one pass, from its slowest rank.
    pub measured_time_s: f64,
    pub measured_tflops_per_gpu: f64,
    /// The slowest rank's time in its blocks' kernels, and the rest of its pass (communication
    /// not hidden by compute, plus the rank's own merging and copying, which the model omits).
    pub kernels_s: f64,
    pub not_kernels_s: f64,
    /// How long that rank's NCCL streams were busy, hidden or not.
    pub communication_busy_s: f64,
    pub predicted: Prediction,
}

/// What a cost model writes: its assumptions, its curves, and how it fares against measured
/// cells it was given.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Predictions {
    pub model: Map<String, Value>,
    pub points: Vec<Prediction>,
    #[serde(default)]
    pub against_measurements: Vec<Comparison>,
}

impl Predictions {
    pub const FILE: &'static str = "predictions.json";
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_unbounded_interval_survives_its_json_round_trip() {
        let timing = Timing {
            samples: vec![1.0, 2.0],
            rel_ci: f64::INFINITY,
            stopped: "time cap".into(),
        };
        let text = serde_json::to_string(&timing).unwrap();
        assert!(text.contains("\"rel_ci\":null"), "{text}");
        let back: Timing = serde_json::from_str(&text).unwrap();
        assert_eq!(back, timing);
    }

    #[test]
    fn quantiles_interpolate() {
        let q = Quantiles::of(&[4.0, 1.0, 3.0, 2.0, 5.0]).unwrap();
        assert_eq!(
            (q.p20, q.p50, q.p80, q.min, q.mean, q.n),
            (1.8, 3.0, 4.2, 1.0, 3.0, 5)
        );
        assert!(Quantiles::of(&[]).is_none());
    }

    #[test]
    fn a_constant_series_is_stable_and_a_noisy_one_is_not() {
        assert_eq!(median_rel_ci(&[1.0; 10]), 0.0);
        assert!(median_rel_ci(&[1.0, 2.0, 1.0, 2.0, 1.0, 2.0]) > 0.1);
    }

    /// Reported repetitions: the warm-ups' seconds are dropped, a steady series stops as stable
    /// at `min_reps`, a noisy one runs to `max_reps`.
    #[test]
    fn a_reported_run_drops_the_warm_up_and_stops_by_the_rule() {
        let harness = Harness {
            warmup_reps: 2,
            warmup_s: 0.0,
            min_reps: 4,
            max_reps: 9,
            max_time_s: 60.0,
            ..Harness::default()
        };
        let mut run = HarnessRun::new(&harness);
        assert_eq!(run.record(100.0), None);
        assert_eq!(run.record(100.0), None);
        let mut timing = None;
        for rep in 0..4 {
            timing = run.record(1.0);
            assert_eq!(timing.is_some(), rep == 3, "{timing:?}");
        }
        let timing = timing.unwrap();
        assert_eq!(
            (timing.samples, timing.stopped.as_str()),
            (vec![1.0; 4], "stable")
        );

        let mut noisy = HarnessRun::new(&harness);
        let seconds = [100.0, 100.0, 1.0, 3.0, 1.0, 3.0, 1.0, 3.0, 1.0, 3.0, 1.0];
        let reports: Vec<_> = seconds.iter().map(|&s| noisy.record(s)).collect();
        let done: Vec<usize> = (0..reports.len())
            .filter(|&i| reports[i].is_some())
            .collect();
        assert_eq!(done, vec![10]);
        assert_eq!(reports[10].as_ref().unwrap().stopped, "max reps");
        assert_eq!(reports[10].as_ref().unwrap().samples.len(), 9);
    }

    /// A run reported after the fact counts its first repetition's time: toward the warm-up,
    /// or toward the time cap when there is none.
    #[test]
    fn a_run_since_its_first_repetition_counts_that_repetitions_time() {
        use std::time::Duration;
        let began = Instant::now() - Duration::from_secs(2);
        let capped = Harness {
            warmup_reps: 0,
            warmup_s: 0.0,
            min_reps: 1,
            max_reps: 100,
            max_time_s: 1.0,
            target_rel_ci: 0.0,
            ..Harness::default()
        };
        let timing = HarnessRun::since(&capped, began).record(2.0).unwrap();
        assert_eq!(timing.stopped, "time cap");
        assert!(HarnessRun::new(&capped).record(2.0).is_none());

        // One warm-up repetition and a second of warm-up: the first report's two seconds
        // complete it, so the next two are timed (max_reps 2); a run whose clock started at
        // the report warms up one more.
        let warmed = Harness {
            warmup_reps: 1,
            warmup_s: 1.0,
            max_reps: 2,
            ..capped
        };
        let mut run = HarnessRun::since(&warmed, began);
        let reports: Vec<_> = [2.0, 0.5, 0.5].map(|s| run.record(s)).into();
        assert_eq!(reports[2].clone().map(|t| t.samples), Some(vec![0.5, 0.5]));
        let mut fresh = HarnessRun::new(&warmed);
        let reports: Vec<_> = [2.0, 0.5, 0.5].map(|s| fresh.record(s)).into();
        assert_eq!(reports[2], None, "one more warm-up: its clock started late");
    }

    #[test]
    fn without_a_warm_up_the_first_repetition_is_timed() {
        let harness = Harness {
            warmup_reps: 0,
            warmup_s: 0.0,
            min_reps: 1,
            max_reps: 1,
            ..Harness::default()
        };
        let timing = HarnessRun::new(&harness).record(2.5).unwrap();
        assert_eq!(
            (timing.samples, timing.stopped.as_str()),
            (vec![2.5], "max reps")
        );
    }

    #[test]
    fn the_harness_stops_when_stable_or_at_the_cap() {
        let harness = Harness {
            max_time_s: 0.05,
            ..Harness::default()
        };
        let timing = harness.time(
            || {},
            || std::thread::sleep(std::time::Duration::from_millis(2)),
        );
        assert!(timing.samples.len() >= 3, "{timing:?}");
        let throughput = Throughput::of(2_000_000_000_000, &Quantiles::of(&[1.0, 2.0]).unwrap());
        assert_eq!(throughput.max, 2.0);
    }
}
