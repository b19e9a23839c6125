//! `attnbench compare BASE NEW`: cell by cell, how NEW's measurements differ from BASE's — two
//! builds of a kernel, two machines, two library versions. For every cell measured on both sides
//! it gives the ratio of median times with a 95% bootstrap interval from both cells' timing
//! samples, and a verdict: `faster` or `slower` when the whole interval lies beyond
//! ±threshold, `same` when it lies within, `unsure` otherwise (too few samples, or too much
//! noise for the threshold). Cells whose status or correctness changed are listed apart, and so
//! is what differs between the two sides' environments (GPU, driver, libraries, plugin versions),
//! which often explains the rest. With `--fail-if-slower` the exit code is 1 when a cell got
//! slower, stopped running or stopped passing its check: a regression gate for CI.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{bail, Context, Result};
use attnbench_sdk::measure::{MeasureStatus, Measurement};
use attnbench_sdk::rng::PyRandom;
use clap::Args;
use serde_json::{json, Value};

#[derive(Args)]
pub struct CompareArgs {
    /// The measurements to compare against: a run directory, a cache directory or a folder of
    /// measurement records (the newest record of each cell counts).
    #[arg(value_name = "BASE")]
    base: PathBuf,
    /// The measurements to judge, given the same way.
    #[arg(value_name = "NEW")]
    new: PathBuf,
    /// Median times within ±this fraction of each other count as the same.
    #[arg(long, default_value_t = 0.02, value_name = "FRACTION")]
    threshold: f64,
    /// Exit with status 1 if a cell got slower, stopped running or stopped passing its check.
    #[arg(long)]
    fail_if_slower: bool,
    /// Also write every compared cell as JSON to this file.
    #[arg(long, value_name = "FILE")]
    json: Option<PathBuf>,
    /// Compare one kernel with another (`BASE_KERNEL:NEW_KERNEL`, e.g. `flex:cuda-flash`):
    /// BASE's cells of the first against NEW's of the second on the same mask, shape and
    /// direction. BASE and NEW may be the same folder.
    #[arg(long, value_name = "A:B")]
    kernels: Option<String>,
}

/// Resamples drawn for each interval; seeded, so a comparison always reads the same.
const RESAMPLES: usize = 2000;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    Faster,
    Slower,
    Same,
    Unsure,
}

impl Verdict {
    fn name(self) -> &'static str {
        match self {
            Verdict::Faster => "faster",
            Verdict::Slower => "slower",
            Verdict::Same => "same",
            Verdict::Unsure => "unsure",
        }
    }
}

/// One cell measured on both sides: its TFLOP/s there, NEW's time over BASE's with its 95%
/// interval, and the verdict.
struct Compared {
    label: String,
    base_tflops: Option<f64>,
    new_tflops: Option<f64>,
    ratio: f64,
    interval: (f64, f64),
    verdict: Verdict,
}

/// NEW's median time over BASE's, with the 2.5th and 97.5th percentiles of the ratio over
/// bootstrap resamples of both sample sets.
pub fn ratio_interval(base: &[f64], new: &[f64], seed: u64) -> (f64, f64, f64) {
    let ratio = median(new.to_vec()) / median(base.to_vec());
    let mut rng = PyRandom::new(seed);
    let mut resample = |samples: &[f64]| -> f64 {
        median(
            (0..samples.len())
                .map(|_| samples[rng.randbelow(samples.len() as u64) as usize])
                .collect(),
        )
    };
    let mut ratios: Vec<f64> = (0..RESAMPLES)
        .map(|_| resample(new) / resample(base))
        .collect();
    ratios.sort_by(f64::total_cmp);
    let at = |q: f64| ratios[((RESAMPLES - 1) as f64 * q).round() as usize];
    (ratio, at(0.025), at(0.975))
}

fn median(mut samples: Vec<f64>) -> f64 {
    samples.sort_by(f64::total_cmp);
    let n = samples.len();
    if n % 2 == 1 {
        samples[n / 2]
    } else {
        (samples[n / 2 - 1] + samples[n / 2]) / 2.0
    }
}

/// The verdict on a time ratio's interval `[low, high]`; fewer than 3 samples on a side decide
/// nothing.
pub fn verdict(low: f64, high: f64, threshold: f64, samples: (usize, usize)) -> Verdict {
    if samples.0 < 3 || samples.1 < 3 {
        Verdict::Unsure
    } else if high < 1.0 - threshold {
        Verdict::Faster
    } else if low > 1.0 + threshold {
        Verdict::Slower
    } else if low >= 1.0 - threshold && high <= 1.0 + threshold {
        Verdict::Same
    } else {
        Verdict::Unsure
    }
}

fn read(dir: &std::path::Path) -> Result<Option<Measurement>> {
    let path = dir.join(Measurement::FILE);
    if !path.is_file() {
        // Cost-model predictions sit beside measurements; they have no times to compare.
        return Ok(None);
    }
    let bytes = std::fs::read(&path).with_context(|| format!("{}", path.display()))?;
    let record = serde_json::from_slice(&bytes)
        .with_context(|| format!("{}: not a measurement record", path.display()))?;
    Ok(Some(record))
}

/// How a person names a cell: kernel (or the two compared), mask, length, direction, shape.
fn label(m: &Measurement, kernels: Option<&(String, String)>) -> String {
    let kernel = kernels.map_or_else(|| m.kernel.clone(), |(a, b)| format!("{a}→{b}"));
    let cp =
        m.cp.as_ref()
            .map(|cp| format!(" {}", cp.cell()))
            .unwrap_or_default();
    format!(
        "{kernel} {} {} {} {}:{} d{} {}{cp}",
        m.mask.pattern,
        m.mask.seqlen,
        m.direction,
        m.shape.heads_q,
        m.shape.heads_kv,
        m.shape.head_dim,
        m.dtype
    )
}

/// Every value each environment key and plugin version takes over `records`.
fn environment(records: &[&Measurement]) -> BTreeMap<String, BTreeSet<String>> {
    let mut values: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for m in records {
        for (key, text) in m.software() {
            values.entry(key.to_string()).or_default().insert(text);
        }
        values
            .entry(format!("plugin {}", m.plugin))
            .or_default()
            .insert(m.plugin_version.clone());
    }
    values
}

fn status_name(m: &Measurement) -> String {
    serde_json::to_value(m.status)
        .ok()
        .and_then(|v| v.as_str().map(str::to_string))
        .unwrap_or_else(|| format!("{:?}", m.status))
}

fn passed(m: &Measurement) -> Option<bool> {
    m.correctness.as_ref().map(|c| c.passed)
}

pub fn run(args: CompareArgs) -> Result<ExitCode> {
    if !(0.0..1.0).contains(&args.threshold) {
        bail!(
            "--threshold {}: give a fraction between 0 and 1, e.g. 0.02 for ±2%",
            args.threshold
        );
    }
    let kernels = match &args.kernels {
        None => None,
        Some(pair) => match pair.split_once(':') {
            Some((a, b)) if !a.is_empty() && !b.is_empty() => Some((a.to_string(), b.to_string())),
            _ => bail!("--kernels {pair}: give BASE_KERNEL:NEW_KERNEL, e.g. flex:cuda-flash"),
        },
    };
    // With --kernels, one side's cells of one kernel meet the other's of the other: the kernel
    // leaves the cell's identity.
    let load = |path: &PathBuf, kernel: Option<&str>| -> Result<BTreeMap<String, Measurement>> {
        let mut cells = BTreeMap::new();
        for (cell, input) in crate::report_cmd::newest_by_cell(std::slice::from_ref(path))? {
            let Some(record) = read(&input.dir)? else {
                continue;
            };
            match kernel {
                None => {
                    cells.insert(cell, record);
                }
                Some(kernel) if record.kernel == kernel => {
                    cells.insert(record.problem(), record);
                }
                Some(_) => {}
            }
        }
        Ok(cells)
    };
    let (base, new) = (
        load(&args.base, kernels.as_ref().map(|k| k.0.as_str()))?,
        load(&args.new, kernels.as_ref().map(|k| k.1.as_str()))?,
    );
    if let Some((a, b)) = &kernels {
        for (kernel, side, cells) in [(a, &args.base, &base), (b, &args.new, &new)] {
            if cells.is_empty() {
                bail!("{}: no measurements of kernel `{kernel}`", side.display());
            }
        }
    }

    let mut compared = Vec::new();
    let mut changed = Vec::new();
    for (index, (cell, b)) in base.iter().enumerate() {
        let Some(n) = new.get(cell) else { continue };
        let (b_ok, n_ok) = (b.status == MeasureStatus::Ok, n.status == MeasureStatus::Ok);
        if b_ok != n_ok || passed(b) != passed(n) {
            let describe = |m: &Measurement| match passed(m) {
                Some(false) => format!("{} (check failed)", status_name(m)),
                _ => status_name(m),
            };
            let worse = (b_ok && !n_ok) || (passed(b) == Some(true) && passed(n) == Some(false));
            changed.push((label(b, kernels.as_ref()), describe(b), describe(n), worse));
            continue;
        }
        let samples = |m: &Measurement| m.timing.as_ref().map(|t| t.samples.clone());
        let (Some(bs), Some(ns)) = (samples(b), samples(n)) else {
            continue;
        };
        if bs.is_empty() || ns.is_empty() {
            continue;
        }
        let (ratio, low, high) = ratio_interval(&bs, &ns, index as u64);
        let judged = verdict(low, high, args.threshold, (bs.len(), ns.len()));
        let tflops = |m: &Measurement| m.tflops.as_ref().map(|t| t.p50);
        compared.push(Compared {
            label: label(b, kernels.as_ref()),
            base_tflops: tflops(b),
            new_tflops: tflops(n),
            ratio,
            interval: (low, high),
            verdict: judged,
        });
    }
    compared.sort_by(|a, b| a.ratio.total_cmp(&b.ratio));

    let only = |a: &BTreeMap<String, Measurement>, b: &BTreeMap<String, Measurement>| {
        a.keys().filter(|k| !b.contains_key(*k)).count()
    };
    let width = compared
        .iter()
        .map(|c| c.label.len())
        .chain(changed.iter().map(|c| c.0.len()))
        .max()
        .unwrap_or(4);
    let number = |v: Option<f64>| match v {
        None => "–".to_string(),
        Some(v) if v >= 10.0 => format!("{v:.1}"),
        Some(v) => format!("{v:.4}"),
    };
    if !compared.is_empty() {
        println!(
            "{:<width$}  {:>9}  {:>9}  {:>7}  {:>17}  verdict",
            "cell", "base TF/s", "new TF/s", "time", "95% interval"
        );
    }
    for c in &compared {
        println!(
            "{:<width$}  {:>9}  {:>9}  {:>+6.1}%  [{:>+6.1}%, {:>+6.1}%]  {}",
            c.label,
            number(c.base_tflops),
            number(c.new_tflops),
            (c.ratio - 1.0) * 100.0,
            (c.interval.0 - 1.0) * 100.0,
            (c.interval.1 - 1.0) * 100.0,
            c.verdict.name()
        );
    }
    for (label, before, after, _) in &changed {
        println!("{label:<width$}  {before} → {after}");
    }
    let count = |v: Verdict| compared.iter().filter(|c| c.verdict == v).count();
    println!(
        "{} cells compared (threshold ±{:.1}%): {} faster, {} slower, {} same, {} unsure; {} changed status; {} only in BASE, {} only in NEW",
        compared.len(),
        args.threshold * 100.0,
        count(Verdict::Faster),
        count(Verdict::Slower),
        count(Verdict::Same),
        count(Verdict::Unsure),
        changed.len(),
        only(&base, &new),
        only(&new, &base)
    );
    let (base_env, new_env) = (
        environment(&base.values().collect::<Vec<_>>()),
        environment(&new.values().collect::<Vec<_>>()),
    );
    let keys: BTreeSet<&String> = base_env.keys().chain(new_env.keys()).collect();
    for key in keys {
        let (b, n) = (base_env.get(key), new_env.get(key));
        if b != n {
            let show = |v: Option<&BTreeSet<String>>| {
                v.map_or("–".to_string(), |v| {
                    v.iter().cloned().collect::<Vec<_>>().join(" | ")
                })
            };
            println!("environment {key}: {} → {}", show(b), show(n));
        }
    }
    if let Some(path) = &args.json {
        let cells: Vec<Value> = compared
            .iter()
            .map(|c| {
                json!({"cell": c.label, "base_tflops": c.base_tflops, "new_tflops": c.new_tflops,
                       "time_ratio": c.ratio, "interval": [c.interval.0, c.interval.1],
                       "verdict": c.verdict.name()})
            })
            .chain(changed.iter().map(|(label, before, after, worse)| {
                json!({"cell": label, "base_status": before, "new_status": after, "worse": worse})
            }))
            .collect();
        std::fs::write(path, serde_json::to_vec_pretty(&cells)?)
            .with_context(|| format!("{}", path.display()))?;
    }
    if compared.is_empty() && changed.is_empty() && !base.is_empty() && !new.is_empty() {
        println!("no cell is on both sides: cells match by plugin, kernel, mask (with its parameters), shape and direction");
    }
    let regressed = count(Verdict::Slower) > 0 || changed.iter().any(|c| c.3);
    Ok(if args.fail_if_slower && regressed {
        ExitCode::from(1)
    } else {
        ExitCode::SUCCESS
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn around(center: f64, spread: f64, n: usize) -> Vec<f64> {
        (0..n)
            .map(|i| center * (1.0 + spread * ((i as f64 / (n - 1) as f64) - 0.5)))
            .collect()
    }

    #[test]
    fn intervals_separate_real_changes_from_noise() {
        let base = around(1.0, 0.01, 20);
        let judge = |new: &[f64]| {
            let (_, low, high) = ratio_interval(&base, new, 7);
            verdict(low, high, 0.02, (base.len(), new.len()))
        };
        assert_eq!(judge(&around(0.90, 0.01, 20)), Verdict::Faster);
        assert_eq!(judge(&around(1.10, 0.01, 20)), Verdict::Slower);
        assert_eq!(judge(&around(1.002, 0.01, 20)), Verdict::Same);
        // A 3% change measured with ±15% noise cannot be told.
        assert_eq!(judge(&around(1.03, 0.3, 20)), Verdict::Unsure);
        assert_eq!(
            judge(&[0.5, 0.5]),
            Verdict::Unsure,
            "two samples decide nothing"
        );
    }

    #[test]
    fn the_ratio_is_of_medians_and_the_interval_holds_it() {
        let (ratio, low, high) = ratio_interval(&[1.0, 2.0, 3.0], &[2.0, 4.0, 6.0], 1);
        assert_eq!(ratio, 2.0);
        assert!(low <= ratio && ratio <= high, "{low} {high}");
    }
}
