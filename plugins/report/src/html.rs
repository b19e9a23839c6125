//! One self-contained HTML report: inline SVG plots, the support matrix, every measurement and
//! the environment. No scripts or styles are fetched from anywhere.

use std::collections::{BTreeMap, BTreeSet};

use attnbench_sdk::format_size;

use crate::rows::Row;
use crate::tables::tflops_text;

pub fn escape(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

const STYLE: &str = "
body{font-family:system-ui,sans-serif;margin:2rem auto;max-width:1400px;color:#1d2733;padding:0 1rem}
h1{margin-bottom:.2rem} .sub{color:#5b6b7c;margin-top:0}
.plots{display:flex;flex-wrap:wrap;gap:1rem} figure{margin:0;border:1px solid #d8dee6;border-radius:6px;padding:.4rem;background:#fff}
figcaption{font-size:.85rem;color:#5b6b7c;text-align:center}
table{border-collapse:collapse;font-size:.85rem;margin:.5rem 0 1.5rem} th,td{border:1px solid #d8dee6;padding:.25rem .5rem;text-align:left}
th{background:#f2f5f8} td.num{text-align:right;font-variant-numeric:tabular-nums}
.ok{background:#dff3e4} .unsupported{background:#eceff3;color:#5b6b7c} .oom{background:#fde8c8} .crashed,.error,.timeout{background:#f9d6d5} .skipped{background:#f4f4f4;color:#888}
.bad{color:#b42318;font-weight:600}
";

/// Confirms in the page itself that every plot rendered (the browser test reads it).
const CHECK: &str = "
document.addEventListener('DOMContentLoaded', () => {
  const plots = [...document.querySelectorAll('figure svg')];
  const drawn = plots.filter(svg => { const box = svg.getBBox(); return box.width > 0 && box.height > 0; });
  document.body.dataset.plots = String(plots.length);
  document.body.dataset.renderedPlots = String(drawn.length);
});
";

pub struct Page<'a> {
    pub title: &'a str,
    pub rows: &'a [Row],
    pub throughput: Vec<(String, String)>,
    pub memory: Vec<(String, String)>,
    pub predictions: &'a [attnbench_sdk::measure::Prediction],
    pub comparisons: &'a [attnbench_sdk::measure::Comparison],
    pub predicted: Vec<(String, String)>,
    pub decode_steps: &'a [crate::decode::DecodeStep],
    pub decoding: Vec<(String, String)>,
}

/// The cost model's points, with the reason of every size a method cannot run.
fn predictions(out: &mut String, points: &[attnbench_sdk::measure::Prediction]) {
    out.push_str("<table id=\"predictions\"><tr><th>method</th><th>sharding</th><th>mask</th><th>direction</th><th>GPUs</th><th>imbalance</th><th>TFLOP/s per GPU</th><th>time</th><th>compute</th><th>exposed communication</th></tr>");
    let ms = |s: Option<f64>| s.map(|s| format!("{:.3} ms", s * 1e3)).unwrap_or_default();
    for p in points {
        let tflops = match (p.tflops_per_gpu, &p.reason) {
            (Some(t), _) => format!("{t:.1}"),
            (None, Some(reason)) => format!("<span title=\"{}\">cannot run</span>", escape(reason)),
            (None, None) => String::new(),
        };
        let imbalance = p.imbalance.map(|x| format!("{x:.3}")).unwrap_or_default();
        out.push_str(&format!(
            "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td class=num>{}</td><td class=num>{imbalance}</td><td class=num>{tflops}</td><td class=num>{}</td><td class=num>{}</td><td class=num>{}</td></tr>",
            escape(&p.method), escape(p.sharding.as_deref().unwrap_or("")), escape(&p.mask), escape(&p.direction), p.world,
            ms(p.time_s), ms(p.compute_s), ms(p.exposed_communication_s)
        ));
    }
    out.push_str("</table>");
}

/// Measured GPU cells beside the model's prediction for the same method, world and groups.
fn comparisons(out: &mut String, rows: &[attnbench_sdk::measure::Comparison]) {
    out.push_str("<table id=\"against-measurements\"><tr><th>method</th><th>mask</th><th>direction</th><th>GPUs</th><th>TFLOP/s per GPU measured</th><th>predicted</th><th>time measured</th><th>predicted</th><th>kernels</th><th>not in kernels</th><th>predicted exposed communication</th><th>NCCL busy</th></tr>");
    let ms = |s: Option<f64>| s.map(|s| format!("{:.3} ms", s * 1e3)).unwrap_or_default();
    for c in rows {
        let p = &c.predicted;
        out.push_str(&format!(
            "<tr><td>{}</td><td>{}</td><td>{}</td><td class=num>{}</td><td class=num>{:.1}</td><td class=num>{}</td><td class=num>{}</td><td class=num>{}</td><td class=num>{}</td><td class=num>{}</td><td class=num>{}</td><td class=num>{}</td></tr>",
            escape(&c.method), escape(&c.mask), escape(&c.direction), c.world,
            c.measured_tflops_per_gpu,
            p.tflops_per_gpu.map(|t| format!("{t:.1}")).unwrap_or_default(),
            ms(Some(c.measured_time_s)), ms(p.time_s), ms(Some(c.kernels_s)), ms(Some(c.not_kernels_s)),
            ms(p.exposed_communication_s), ms(Some(c.communication_busy_s))
        ));
    }
    out.push_str("</table>");
}

fn figures(out: &mut String, plots: &[(String, String)]) {
    out.push_str("<div class=\"plots\">");
    for (caption, svg) in plots {
        out.push_str(&format!(
            "<figure>{svg}<figcaption>{}</figcaption></figure>",
            escape(caption)
        ));
    }
    out.push_str("</div>");
}

/// Kernel × mask: each cell shows the statuses over all sequence lengths and directions, with the
/// reasons on hover.
fn support_matrix(out: &mut String, rows: &[Row]) {
    let masks: BTreeSet<&str> = rows.iter().map(|r| r.mask.as_str()).collect();
    let mut cells: BTreeMap<(&str, &str), Vec<&Row>> = BTreeMap::new();
    for row in rows {
        cells
            .entry((row.kernel.as_str(), row.mask.as_str()))
            .or_default()
            .push(row);
    }
    let kernels: BTreeSet<&str> = rows.iter().map(|r| r.kernel.as_str()).collect();
    out.push_str("<table id=\"support\"><tr><th>kernel</th>");
    for mask in &masks {
        out.push_str(&format!("<th>{}</th>", escape(mask)));
    }
    out.push_str("</tr>");
    for kernel in &kernels {
        out.push_str(&format!("<tr><th>{}</th>", escape(kernel)));
        for mask in &masks {
            let Some(cell) = cells.get(&(*kernel, *mask)) else {
                out.push_str("<td></td>");
                continue;
            };
            let statuses: BTreeSet<&str> = cell.iter().map(|r| r.status.as_str()).collect();
            let worst = [
                "crashed",
                "timeout",
                "interrupted",
                "error",
                "oom",
                "unsupported",
                "skipped",
                "ok",
            ]
            .into_iter()
            .find(|s| statuses.contains(s))
            .unwrap_or("ok");
            let details: Vec<String> = cell
                .iter()
                .map(|r| {
                    let reason = r
                        .reason
                        .as_deref()
                        .map(|x| format!(": {x}"))
                        .unwrap_or_default();
                    format!(
                        "{} {} {}{reason}",
                        format_size(r.seqlen),
                        r.direction,
                        r.status
                    )
                })
                .collect();
            let label: Vec<&str> = statuses.into_iter().collect();
            out.push_str(&format!(
                "<td class=\"{worst}\" title=\"{}\">{}</td>",
                escape(&details.join("\n")),
                label.join(" / ")
            ));
        }
        out.push_str("</tr>");
    }
    out.push_str("</table>");
}

fn measurements(out: &mut String, rows: &[Row]) {
    out.push_str("<table id=\"measurements\"><tr><th>kernel</th><th>mask</th><th>seqlen</th><th>direction</th><th>shape</th><th>status</th><th>TFLOP/s p50 (p20–p80)</th><th>time p50</th><th>reps</th><th>peak memory</th><th>correct (max rel. error)</th></tr>");
    for row in rows {
        let throughput = row
            .tflops
            .map(|t| {
                format!(
                    "{} ({}–{})",
                    tflops_text(t.p50),
                    tflops_text(t.p80),
                    tflops_text(t.p20)
                )
            })
            .unwrap_or_default();
        let time = row
            .time_s
            .map(|t| format!("{:.3} ms", t.p50 * 1e3))
            .unwrap_or_default();
        let reps = row.time_s.map(|t| t.n.to_string()).unwrap_or_default();
        let memory = row
            .peak_bytes
            .map(|b| format!("{:.1} MiB", b as f64 / (1u64 << 20) as f64))
            .unwrap_or_default();
        let correct = match (row.correct, row.max_error) {
            (Some(true), Some(e)) => format!("yes ({e:.1e})"),
            (Some(false), Some(e)) => format!("<span class=\"bad\">no ({e:.1e})</span>"),
            _ => String::new(),
        };
        let status = match &row.reason {
            Some(reason) => format!("<span title=\"{}\">{}</span>", escape(reason), row.status),
            None => row.status.clone(),
        };
        out.push_str(&format!(
            "<tr><td>{}</td><td>{}</td><td class=num>{}</td><td>{}</td><td>{}{}:{}×{} {}</td><td class=\"{}\">{status}</td><td class=num>{throughput}</td><td class=num>{time}</td><td class=num>{reps}</td><td class=num>{memory}</td><td>{correct}</td></tr>",
            escape(&row.kernel),
            escape(&row.mask),
            format_size(row.seqlen),
            escape(&row.direction),
            row.shape.as_ref().map(|s| format!("{} ", escape(s))).unwrap_or_default(),
            row.heads_q,
            row.heads_kv,
            row.head_dim,
            escape(&row.dtype),
            escape(&row.status),
        ));
    }
    out.push_str("</table>");
}

fn environment(out: &mut String, rows: &[Row]) {
    let Some(row) = rows.iter().find(|r| !r.environment.is_empty()) else {
        out.push_str("<p>No measurement recorded its environment.</p>");
        return;
    };
    out.push_str("<table id=\"environment\">");
    for (key, value) in &row.environment {
        out.push_str(&format!(
            "<tr><th>{}</th><td>{}</td></tr>",
            escape(key),
            escape(value)
        ));
    }
    out.push_str("</table>");
}

pub fn render(page: &Page) -> String {
    let ok = page.rows.iter().filter(|r| r.is_ok()).count();
    let mut out = String::with_capacity(1 << 20);
    out.push_str(&format!(
        "<!doctype html><html lang=\"en\"><head><meta charset=\"utf-8\"><meta name=\"viewport\" content=\"width=device-width\"><title>{}</title><style>{STYLE}</style></head><body>",
        escape(page.title)
    ));
    out.push_str(&format!(
        "<h1>{}</h1><p class=\"sub\">{} measurements, {ok} ok. Throughput counts FLOPs from each mask's exact area (forward 4·area·h·d, backward 2.5× forward).</p>",
        escape(page.title),
        page.rows.len()
    ));
    out.push_str("<h2>Throughput</h2>");
    figures(&mut out, &page.throughput);
    out.push_str("<h2>Peak memory</h2>");
    figures(&mut out, &page.memory);
    if !page.predictions.is_empty() {
        out.push_str("<h2>Predicted context-parallel throughput</h2><p class=\"sub\">A cost model from the kernel's throughput, link bandwidths and latencies and each method's traffic; not a measurement.</p>");
        figures(&mut out, &page.predicted);
        predictions(&mut out, page.predictions);
    }
    if !page.comparisons.is_empty() {
        out.push_str("<h2>Cost model against measurements</h2><p class=\"sub\">Each measured GPU cell beside the model's prediction for its method, world, groups and tokens, with compute at the cell's own kernel time (its slowest rank's): the difference is what the model says about communication. Not in kernels: the slowest rank's communication not hidden by compute plus its own merging and copying, which the model omits.</p>");
        comparisons(&mut out, page.comparisons);
    }
    if !page.decode_steps.is_empty() {
        out.push_str("<h2>Decoding</h2><p class=\"sub\">One decode step of a batch: the bytes it must move (K and V once per KV head, Q and O once) over its median time, beside the device's own copy bandwidth measured in the same stage.</p>");
        figures(&mut out, &page.decoding);
        crate::decode::table(&mut out, page.decode_steps);
    }
    out.push_str("<h2>Support matrix</h2><p class=\"sub\">Statuses over all lengths and directions; hover a cell for the details.</p>");
    support_matrix(&mut out, page.rows);
    out.push_str("<h2>Measurements</h2>");
    measurements(&mut out, page.rows);
    out.push_str("<h2>Environment</h2>");
    environment(&mut out, page.rows);
    out.push_str(&format!("<script>{CHECK}</script></body></html>\n"));
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use attnbench_sdk::measure::{Comparison, Prediction};

    /// A cost model's comparisons get their own section: each measured cell beside its
    /// prediction, in milliseconds and TFLOP/s.
    #[test]
    fn measured_cells_appear_beside_their_predictions() {
        let predicted = Prediction {
            method: "ring_p2p".into(),
            mask: "full".into(),
            direction: "fwd".into(),
            world: 2,
            tokens_per_gpu: 8192,
            tflops_per_gpu: Some(290.4),
            time_s: Some(15.18e-3),
            compute_s: Some(15.18e-3),
            exposed_communication_s: Some(0.0),
            reason: None,
            sharding: Some("zigzag".into()),
            imbalance: Some(1.0),
        };
        let comparison = Comparison {
            method: "ring_p2p".into(),
            mask: "full".into(),
            direction: "fwd".into(),
            world: 2,
            tokens_per_gpu: 8192,
            measured_time_s: 18.72e-3,
            measured_tflops_per_gpu: 235.2,
            kernels_s: 15.18e-3,
            not_kernels_s: 3.51e-3,
            communication_busy_s: 0.18e-3,
            predicted: predicted.clone(),
        };
        let html = render(&Page {
            title: "t",
            rows: &[],
            throughput: Vec::new(),
            memory: Vec::new(),
            predictions: &[predicted],
            comparisons: &[comparison],
            predicted: Vec::new(),
            decode_steps: &[],
            decoding: Vec::new(),
        });
        assert!(html.contains("Cost model against measurements"));
        let table = &html[html.find("id=\"against-measurements\"").unwrap()..];
        for cell in [
            "235.2",
            "290.4",
            "18.720 ms",
            "15.180 ms",
            "3.510 ms",
            "0.180 ms",
        ] {
            assert!(table.contains(cell), "{cell} missing from {table}");
        }
        let without = render(&Page {
            title: "t",
            rows: &[],
            throughput: Vec::new(),
            memory: Vec::new(),
            predictions: &[],
            comparisons: &[],
            predicted: Vec::new(),
            decode_steps: &[],
            decoding: Vec::new(),
        });
        assert!(!without.contains("Cost model against measurements"));
    }
}
