//! How a run looks: progress bars on a terminal, one plain line per node otherwise, and a summary.

use std::collections::HashMap;
use std::io::IsTerminal;
use std::process::ExitCode;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use attnbench_runtime::record::{NodeRecord, Status};
use attnbench_runtime::run::{Event, Observer, RunSummary};
use indicatif::{MultiProgress, ProgressBar, ProgressDrawTarget, ProgressStyle};

use crate::display_path;

pub struct Progress {
    total: usize,
    quiet: bool,
    verbose: bool,
    started: Instant,
    bars: Option<Bars>,
    finished: Mutex<usize>,
}

struct Bars {
    multi: MultiProgress,
    overall: ProgressBar,
    running: Mutex<HashMap<String, ProgressBar>>,
}

impl Progress {
    pub fn new(total: usize, quiet: bool, verbose: bool) -> Self {
        let bars = (!quiet && std::io::stderr().is_terminal()).then(|| {
            let multi = MultiProgress::with_draw_target(ProgressDrawTarget::stderr());
            let overall = multi.add(ProgressBar::new(total as u64));
            overall.set_style(
                ProgressStyle::with_template(
                    "{elapsed_precise} [{bar:30.cyan/blue}] {pos}/{len} nodes {msg}",
                )
                .unwrap_or_else(|_| ProgressStyle::default_bar())
                .progress_chars("=> "),
            );
            Bars {
                multi,
                overall,
                running: Mutex::new(HashMap::new()),
            }
        });
        Progress {
            total,
            quiet,
            verbose,
            started: Instant::now(),
            bars,
            finished: Mutex::new(0),
        }
    }

    pub fn finish(&self) {
        if let Some(bars) = &self.bars {
            bars.overall.finish_and_clear();
        }
    }

    fn line(&self, record: &NodeRecord, position: usize) {
        let width = self.total.to_string().len();
        let mut line = format!(
            "[{position:>width$}/{}] {:<8} {:>7.2}s  {}",
            self.total,
            record.status.as_str(),
            record.duration_s,
            record.id
        );
        if let Some(error) = &record.error {
            line.push_str(&format!("\n{:>w$}{error}", "", w = width * 2 + 4));
        }
        if let Some(note) = &record.note {
            line.push_str(&format!("\n{:>w$}note: {note}", "", w = width * 2 + 4));
        }
        match &self.bars {
            Some(bars) => bars.multi.suspend(|| eprintln!("{line}")),
            None => eprintln!("{line}"),
        }
    }
}

impl Observer for Progress {
    fn event(&self, event: Event<'_>) {
        match event {
            Event::Started { node } => {
                if let Some(bars) = &self.bars {
                    let bar = bars.multi.add(ProgressBar::new_spinner());
                    bar.set_style(
                        ProgressStyle::with_template("  {spinner} {msg}")
                            .unwrap_or_else(|_| ProgressStyle::default_spinner()),
                    );
                    bar.set_message(node.to_string());
                    bar.enable_steady_tick(Duration::from_millis(120));
                    if let Ok(mut running) = bars.running.lock() {
                        running.insert(node.to_string(), bar);
                    }
                }
            }
            Event::Progress {
                node,
                done,
                total,
                message,
            } => {
                if let Some(bars) = &self.bars {
                    if let Some(bar) = bars.running.lock().ok().and_then(|r| r.get(node).cloned()) {
                        let fraction = if total > 0 {
                            format!(" {done}/{total}")
                        } else {
                            String::new()
                        };
                        bar.set_message(format!("{node}{fraction} {message}"));
                    }
                }
            }
            Event::Finished { record } => {
                let position = {
                    let mut finished = self.finished.lock().unwrap_or_else(|p| p.into_inner());
                    *finished += 1;
                    *finished
                };
                if let Some(bars) = &self.bars {
                    if let Some(bar) = bars
                        .running
                        .lock()
                        .ok()
                        .and_then(|mut r| r.remove(&record.id))
                    {
                        bar.finish_and_clear();
                        bars.multi.remove(&bar);
                    }
                    bars.overall.inc(1);
                }
                let failed = !record.status.succeeded();
                let show =
                    failed || (!self.quiet && (record.status != Status::Cached || self.verbose));
                if show {
                    self.line(record, position);
                }
            }
        }
    }
}

/// Each node's result (`result.json` beside its files), for the nodes that have one.
fn results(record: &attnbench_runtime::record::RunRecord) -> Vec<(&NodeRecord, serde_json::Value)> {
    record
        .nodes
        .iter()
        .filter_map(|node| {
            let artifact = node.artifact.as_ref()?;
            let result = serde_json::from_slice(
                &std::fs::read(artifact.parent()?.join("result.json")).ok()?,
            )
            .ok()?;
            Some((node, result))
        })
        .collect()
}

/// Files that nodes name as their `report` in their result (e.g. `report/html`'s HTML page).
fn reports(results: &[(&NodeRecord, serde_json::Value)]) -> Vec<std::path::PathBuf> {
    results
        .iter()
        .filter_map(|(node, result)| {
            Some(
                node.artifact
                    .as_ref()?
                    .join(result.get("report")?.as_str()?),
            )
        })
        .collect()
}

/// Whether a result records a check against the reference that failed: the node ran (its
/// status is `ok`), but its outputs are wrong.
fn check_failed(result: &serde_json::Value) -> bool {
    result
        .pointer("/correctness/passed")
        .and_then(serde_json::Value::as_bool)
        == Some(false)
}

/// Prints the first 20 lines and how many more there were, so a run of thousands of failed cells
/// keeps its summary readable.
fn print_capped(lines: impl ExactSizeIterator<Item = String>) {
    const SHOWN: usize = 20;
    let total = lines.len();
    for line in lines.take(SHOWN) {
        eprintln!("{line}");
    }
    if total > SHOWN {
        eprintln!("  … and {} more", total - SHOWN);
    }
}

/// Prints what happened and returns the exit code: non-zero when any node did not succeed.
pub fn print_summary(
    summary: &RunSummary,
    progress: &Progress,
    cache_root: &std::path::Path,
) -> ExitCode {
    let record = &summary.record;
    let counts: Vec<String> = record
        .counts
        .iter()
        .map(|(status, n)| format!("{n} {}", status.as_str()))
        .collect();
    let elapsed = progress.started.elapsed().as_secs_f64();
    let results = results(record);
    let wrong: Vec<&NodeRecord> = results
        .iter()
        .filter(|(_, result)| check_failed(result))
        .map(|(node, _)| *node)
        .collect();
    let wrong_count = match wrong.len() {
        0 => String::new(),
        1 => " (1 of them failed its check)".to_string(),
        n => format!(" ({n} of them failed their check)"),
    };
    eprintln!(
        "run {} of `{}` finished in {elapsed:.2}s: {}{wrong_count}",
        record.id,
        record.pipeline,
        counts.join(", ")
    );
    print_capped(wrong.iter().map(|node| {
        format!(
            "  check    {}: outputs off the reference past the tolerance",
            node.id
        )
    }));
    let failed: Vec<&NodeRecord> = record
        .nodes
        .iter()
        .filter(|n| !n.status.succeeded())
        .collect();
    print_capped(failed.iter().map(|node| {
        let reason = node.error.as_deref().unwrap_or("");
        format!("  {:<8} {}: {reason}", node.status.as_str(), node.id)
    }));
    eprintln!("record: {}", display_path(&summary.dir.join("run.json")));
    for published in crate::latest_report::publish(cache_root, &record.pipeline, &reports(&results))
    {
        match published {
            Ok(page) => eprintln!("report: {}", display_path(&page)),
            Err(why) => eprintln!("report: {why}"),
        }
    }
    if failed.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    }
}

#[cfg(test)]
mod tests {
    use super::check_failed;
    use serde_json::json;

    #[test]
    fn only_a_check_that_ran_and_failed_counts_as_failed() {
        assert!(check_failed(
            &json!({"status": "ok", "correctness": {"passed": false}})
        ));
        assert!(!check_failed(
            &json!({"status": "ok", "correctness": {"passed": true}})
        ));
        // Unchecked (a decode step with `check: off`) and records without a check.
        assert!(!check_failed(&json!({"status": "ok", "correctness": null})));
        assert!(!check_failed(&json!({"status": "unsupported"})));
    }
}
