//! Decode steps in reports: the `decode.json` of the one-device decode stages (`cpu/decode`,
//! `cuda/decode`, `python/decode`), drawn as bandwidth and latency against the longest KV cache,
//! a line per kernel, and listed with the copy bandwidth beside each.

use std::collections::BTreeMap;

use attnbench_sdk::{format_size, InputArtifact};
use serde_json::Value;

use crate::html::escape;
use crate::plots::{safe_id, Chart, Point, Series, XAxis};

/// One measured decode step.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct DecodeStep {
    pub kernel: String,
    /// The longest sequence's KV tokens.
    pub kv_len: u64,
    pub batch: usize,
    pub queries: u64,
    /// `packed`, or the page size of a paged cache.
    pub cache: String,
    pub latency_us: f64,
    pub bandwidth_gbs: f64,
    pub copy_gbs: f64,
    pub passed: Option<bool>,
}

/// The measured decode steps among the inputs (cp/decode's records, which measure exactness
/// rather than speed, and unsupported cells are left out).
pub fn collect(inputs: &[InputArtifact]) -> Result<Vec<DecodeStep>, String> {
    let mut steps = Vec::new();
    for input in inputs.iter().filter(|i| i.succeeded()) {
        let path = input.dir.join("decode.json");
        let Ok(bytes) = std::fs::read(&path) else {
            continue;
        };
        let record: Value = serde_json::from_slice(&bytes)
            .map_err(|err| format!("{}: not a decode record: {err}", path.display()))?;
        let (Some(latency_us), Some(kv_lens)) =
            (record["latency_us"].as_f64(), record["kv_lens"].as_array())
        else {
            continue;
        };
        steps.push(DecodeStep {
            kernel: record["kernel"].as_str().unwrap_or("?").to_string(),
            kv_len: kv_lens.iter().filter_map(Value::as_u64).max().unwrap_or(0),
            batch: kv_lens.len(),
            queries: record["queries"].as_u64().unwrap_or(1),
            cache: match record["page_size"].as_u64() {
                Some(page) => format!("paged {page}"),
                None => "packed".into(),
            },
            latency_us,
            bandwidth_gbs: record["bandwidth_gbs"].as_f64().unwrap_or(0.0),
            copy_gbs: record["copy_gbs"].as_f64().unwrap_or(0.0),
            passed: record["correctness"]["passed"].as_bool(),
        });
    }
    steps.sort_by(|a, b| {
        (a.queries, &a.cache, &a.kernel, a.kv_len).cmp(&(b.queries, &b.cache, &b.kernel, b.kv_len))
    });
    Ok(steps)
}

/// Per (new tokens, cache): bandwidth and latency against the longest KV cache, a line per kernel.
pub fn charts(steps: &[DecodeStep]) -> Vec<Chart> {
    type Lines = BTreeMap<String, Vec<Point>>;
    let mut groups: BTreeMap<(u64, String), (Lines, Lines)> = BTreeMap::new();
    for step in steps {
        let (bandwidth, latency) = groups
            .entry((step.queries, step.cache.clone()))
            .or_default();
        let at = |y: f64| Point {
            x: step.kv_len as f64,
            y,
            low: y,
            high: y,
        };
        bandwidth
            .entry(step.kernel.clone())
            .or_default()
            .push(at(step.bandwidth_gbs));
        latency
            .entry(step.kernel.clone())
            .or_default()
            .push(at(step.latency_us));
    }
    let series = |lines: Lines| {
        lines
            .into_iter()
            .map(|(name, points)| Series { name, points })
            .collect()
    };
    let mut charts = Vec::new();
    for ((queries, cache), (bandwidth, latency)) in groups {
        let about = format!(
            "decode · {queries} new token{} · {cache}",
            if queries == 1 { "" } else { "s" }
        );
        for (what, unit, lines) in [
            ("bandwidth", "GB/s moved", bandwidth),
            ("latency", "µs a step", latency),
        ] {
            let title = format!("{about} · {what}");
            charts.push(Chart {
                id: safe_id(&title),
                title,
                x_axis: XAxis::KvLength,
                y_label: unit.into(),
                series: series(lines),
            });
        }
    }
    charts
}

/// Every step as a table row, the copy bandwidth and the check beside it.
pub fn table(out: &mut String, steps: &[DecodeStep]) {
    out.push_str("<table id=\"decode\"><tr><th>kernel</th><th>new tokens</th><th>cache</th><th>sequences</th><th>longest KV</th><th>latency</th><th>GB/s</th><th>of copy</th><th>check</th></tr>");
    for s in steps {
        let of_copy = if s.copy_gbs > 0.0 {
            format!(
                "{:.0}% of {:.0}",
                100.0 * s.bandwidth_gbs / s.copy_gbs,
                s.copy_gbs
            )
        } else {
            "—".to_string()
        };
        let check = match s.passed {
            Some(true) => "passed",
            Some(false) => "FAILED",
            None => "off",
        };
        out.push_str(&format!(
            "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{:.1} µs</td><td>{:.1}</td><td>{of_copy}</td><td>{check}</td></tr>",
            escape(&s.kernel),
            s.queries,
            escape(&s.cache),
            s.batch,
            format_size(s.kv_len),
            s.latency_us,
            s.bandwidth_gbs,
        ));
    }
    out.push_str("</table>");
}
