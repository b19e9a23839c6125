//! Tidy tables: CSV (one row per measurement), JSON, and a Markdown summary.

use attnbench_sdk::format_size;

use crate::rows::Row;

const COLUMNS: [&str; 28] = [
    "node",
    "kernel",
    "mask",
    "seqlen",
    "density",
    "sparse_block",
    "direction",
    "heads_q",
    "heads_kv",
    "head_dim",
    "shape",
    "dtype",
    "status",
    "reason",
    "flops",
    "time_p20_s",
    "time_p50_s",
    "time_p80_s",
    "time_min_s",
    "reps",
    "tflops_p20",
    "tflops_p50",
    "tflops_p80",
    "tflops_max",
    "peak_bytes",
    "above_inputs_bytes",
    "correct",
    "max_error",
];

fn field(value: Option<impl ToString>) -> String {
    value.map(|v| v.to_string()).unwrap_or_default()
}

fn escape(text: &str) -> String {
    if text.contains([',', '"', '\n']) {
        format!("\"{}\"", text.replace('"', "\"\""))
    } else {
        text.to_string()
    }
}

pub fn csv(rows: &[Row]) -> String {
    let mut out = COLUMNS.join(",");
    out.push('\n');
    for row in rows {
        let t = row.time_s.as_ref();
        let f = row.tflops.as_ref();
        let cells = [
            row.node.clone(),
            row.kernel.clone(),
            row.mask.clone(),
            row.seqlen.to_string(),
            field(row.density),
            field(row.sparse_block),
            row.direction.clone(),
            row.heads_q.to_string(),
            row.heads_kv.to_string(),
            row.head_dim.to_string(),
            field(row.shape.as_ref()),
            row.dtype.clone(),
            row.status.clone(),
            field(row.reason.as_ref()),
            field(row.flops),
            field(t.map(|t| t.p20)),
            field(t.map(|t| t.p50)),
            field(t.map(|t| t.p80)),
            field(t.map(|t| t.min)),
            field(t.map(|t| t.n)),
            field(f.map(|f| f.p20)),
            field(f.map(|f| f.p50)),
            field(f.map(|f| f.p80)),
            field(f.map(|f| f.max)),
            field(row.peak_bytes),
            field(row.above_inputs_bytes),
            field(row.correct),
            field(row.max_error),
        ];
        let line: Vec<String> = cells.iter().map(|c| escape(c)).collect();
        out.push_str(&line.join(","));
        out.push('\n');
    }
    out
}

/// Throughput in TFLOP/s with sensible precision for CPU (small) and GPU (large) numbers.
pub fn tflops_text(value: f64) -> String {
    if value >= 10.0 {
        format!("{value:.0}")
    } else if value >= 0.1 {
        format!("{value:.2}")
    } else {
        format!("{value:.4}")
    }
}

pub fn markdown(rows: &[Row], title: &str) -> String {
    let mut out = format!("# {title}\n\n");
    let ok = rows.iter().filter(|r| r.is_ok()).count();
    out.push_str(&format!(
        "{} measurements: {ok} ok, {} not.\n\n",
        rows.len(),
        rows.len() - ok
    ));
    out.push_str("| kernel | mask | seqlen | direction | dtype | status | TFLOP/s (p50) | time p50 | correct |\n|---|---|---|---|---|---|---|---|---|\n");
    for row in rows {
        let throughput = row
            .tflops
            .map(|t| tflops_text(t.p50))
            .unwrap_or_else(|| "–".into());
        let time = row
            .time_s
            .map(|t| format!("{:.3} ms", t.p50 * 1e3))
            .unwrap_or_else(|| "–".into());
        let status = match &row.reason {
            Some(reason) if !row.is_ok() => {
                format!("{}: {}", row.status, brief(reason).replace('|', "\\|"))
            }
            _ => row.status.clone(),
        };
        let correct = match row.correct {
            Some(true) => "yes",
            Some(false) => "**no**",
            None => "–",
        };
        out.push_str(&format!(
            "| {} | {} | {} | {} | {} | {status} | {throughput} | {time} | {correct} |\n",
            row.kernel,
            row.mask,
            format_size(row.seqlen),
            row.direction,
            row.dtype
        ));
    }
    out
}

/// A reason short enough for a table cell: its first sentence, at most 160 characters (the CSV
/// and JSON keep it whole; libraries' out-of-memory messages run to paragraphs).
fn brief(reason: &str) -> String {
    const LIMIT: usize = 160;
    let first = reason.split(". ").next().unwrap_or(reason);
    if first.chars().count() <= LIMIT {
        return first.to_string();
    }
    let cut: String = first.chars().take(LIMIT - 1).collect();
    format!("{cut}…")
}
