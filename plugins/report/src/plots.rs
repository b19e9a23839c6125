//! Plots: throughput against sequence length for every mask and direction (a line per kernel,
//! p20–p80 as error bars), and peak memory. Drawn with plotters, as SVG for the HTML report and
//! as PNG files, with a font carried in the plugin (no system fonts needed).

use std::collections::BTreeMap;
use std::path::Path;

use attnbench_sdk::format_size;
use attnbench_sdk::measure::Prediction;
use plotters::coord::Shift;
use plotters::prelude::*;

use crate::rows::Row;

pub const FONT: &str = "sans-serif";
const SIZE: (u32, u32) = (640, 400);

pub struct Point {
    pub x: f64,
    pub y: f64,
    pub low: f64,
    pub high: f64,
}

pub struct Series {
    pub name: String,
    pub points: Vec<Point>,
}

pub struct Chart {
    /// A file-name-safe id.
    pub id: String,
    pub title: String,
    pub x_axis: XAxis,
    pub y_label: String,
    pub series: Vec<Series>,
}

/// What the (log₂) x axis counts.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum XAxis {
    SequenceLength,
    Gpus,
    /// A block-sparse mask's kept fraction.
    Density,
    /// A decode step's longest KV cache.
    KvLength,
}

/// Registers the bundled font once per process.
pub fn register_font() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let _ = plotters::style::register_font(
            FONT,
            FontStyle::Normal,
            include_bytes!("../assets/DejaVuSans.ttf"),
        );
    });
}

fn group<'a>(
    rows: impl Iterator<Item = &'a Row>,
    key: impl Fn(&Row) -> String,
) -> BTreeMap<String, Vec<&'a Row>> {
    let mut groups: BTreeMap<String, Vec<&Row>> = BTreeMap::new();
    for row in rows {
        groups.entry(key(row)).or_default().push(row);
    }
    groups
}

pub fn safe_id(text: &str) -> String {
    text.chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '-' })
        .collect()
}

/// TFLOP/s (median, p20–p80): against sequence length, one chart per mask and direction; for
/// block-sparse masks against density, one chart per mask, length, block size and direction, a
/// line per kernel and head layout.
pub fn throughput_charts(rows: &[Row]) -> Vec<Chart> {
    let measured = rows.iter().filter(|r| r.is_ok() && r.tflops.is_some());
    let (sparse, dense): (Vec<&Row>, Vec<&Row>) = measured.partition(|r| r.density.is_some());
    let dense_charts = group(dense.into_iter(), |r| {
        format!("{} · {}", r.mask, r.direction)
    })
    .into_iter()
    .map(|(title, rows)| {
        throughput_chart(
            title,
            XAxis::SequenceLength,
            rows,
            |r| r.kernel.clone(),
            |r| r.seqlen as f64,
        )
    });
    let sparse_charts = group(sparse.into_iter(), |r| {
        let block = r
            .sparse_block
            .map(|b| format!(" · blocks of {b}"))
            .unwrap_or_default();
        format!(
            "{} · {}{block} · {}",
            r.mask,
            format_size(r.seqlen),
            r.direction
        )
    })
    .into_iter()
    .map(|(title, rows)| {
        throughput_chart(
            title,
            XAxis::Density,
            rows,
            |r| format!("{} {}:{}", r.kernel, r.heads_q, r.heads_kv),
            |r| r.density.unwrap_or(0.0),
        )
    });
    dense_charts.chain(sparse_charts).collect()
}

fn throughput_chart(
    title: String,
    x_axis: XAxis,
    rows: Vec<&Row>,
    series_of: impl Fn(&Row) -> String,
    x_of: impl Fn(&Row) -> f64,
) -> Chart {
    let series = group(rows.into_iter(), series_of)
        .into_iter()
        .map(|(name, rows)| Series {
            name,
            points: rows
                .iter()
                .filter_map(|r| {
                    r.tflops.map(|t| Point {
                        x: x_of(r),
                        y: t.p50,
                        low: t.p80,
                        high: t.p20,
                    })
                })
                .collect(),
        })
        .collect();
    Chart {
        id: format!("tflops-{}", safe_id(&title)),
        title,
        x_axis,
        y_label: "TFLOP/s".into(),
        series,
    }
}

/// Peak memory (GiB) against sequence length: one chart per direction, a line per kernel and mask.
pub fn memory_charts(rows: &[Row]) -> Vec<Chart> {
    let measured = rows.iter().filter(|r| r.is_ok() && r.peak_bytes.is_some());
    group(measured, |r| r.direction.clone())
        .into_iter()
        .map(|(direction, rows)| {
            let series = group(rows.into_iter(), |r| format!("{} · {}", r.kernel, r.mask))
                .into_iter()
                .map(|(name, rows)| Series {
                    name,
                    points: rows
                        .iter()
                        .filter_map(|r| {
                            let gib = r.peak_bytes? as f64 / (1u64 << 30) as f64;
                            Some(Point {
                                x: r.seqlen as f64,
                                y: gib,
                                low: gib,
                                high: gib,
                            })
                        })
                        .collect(),
                })
                .collect();
            Chart {
                id: format!("memory-{}", safe_id(&direction)),
                title: format!("peak memory · {direction}"),
                x_axis: XAxis::SequenceLength,
                y_label: "GiB".into(),
                series,
            }
        })
        .collect()
}

/// A cost model's predicted per-GPU TFLOP/s against GPUs: one chart per mask and direction, a
/// line per method (sizes a method cannot run are left out).
pub fn prediction_charts(predictions: &[Prediction]) -> Vec<Chart> {
    let mut charts: BTreeMap<String, BTreeMap<String, Vec<Point>>> = BTreeMap::new();
    for p in predictions {
        let Some(tflops) = p.tflops_per_gpu else {
            continue;
        };
        let title = format!(
            "{} · {} · {} tokens per GPU{}",
            p.mask,
            p.direction,
            format_size(p.tokens_per_gpu),
            p.sharding
                .as_ref()
                .map(|s| format!(" · {s}"))
                .unwrap_or_default()
        );
        charts
            .entry(title)
            .or_default()
            .entry(p.method.clone())
            .or_default()
            .push(Point {
                x: p.world as f64,
                y: tflops,
                low: tflops,
                high: tflops,
            });
    }
    charts
        .into_iter()
        .map(|(title, methods)| Chart {
            id: format!("model-{}", safe_id(&title)),
            title: format!("predicted · {title}"),
            x_axis: XAxis::Gpus,
            y_label: "TFLOP/s per GPU".into(),
            series: methods
                .into_iter()
                .map(|(name, points)| Series { name, points })
                .collect(),
        })
        .collect()
}

/// A chart plotters could not draw, and what it said (its error type differs per backend).
#[derive(Debug, thiserror::Error)]
#[error("{chart}: {reason}")]
pub struct PlotError {
    pub chart: String,
    pub reason: String,
}

fn draw<DB: DrawingBackend>(root: &DrawingArea<DB, Shift>, chart: &Chart) -> Result<(), PlotError> {
    let error = |err: DrawingAreaErrorKind<DB::ErrorType>| PlotError {
        chart: chart.title.clone(),
        reason: err.to_string(),
    };
    root.fill(&WHITE).map_err(error)?;
    let points = || chart.series.iter().flat_map(|s| s.points.iter());
    let x_min = points().map(|p| p.x).fold(f64::INFINITY, f64::min);
    let x_max = points().map(|p| p.x).fold(0.0, f64::max);
    let y_max = points().map(|p| p.high.max(p.y)).fold(0.0, f64::max);
    if !x_min.is_finite() || x_max <= 0.0 {
        return Ok(());
    }
    let y_top = if y_max > 0.0 { y_max * 1.15 } else { 1.0 };
    let mut context = ChartBuilder::on(root)
        .caption(&chart.title, (FONT, 18))
        .margin(12)
        .x_label_area_size(36)
        .y_label_area_size(64)
        .build_cartesian_2d(
            (x_min / 1.25..x_max * 1.25).log_scale().base(2.0),
            0f64..y_top,
        )
        .map_err(error)?;
    context
        .configure_mesh()
        .x_desc(match chart.x_axis {
            XAxis::SequenceLength => "sequence length (tokens)",
            XAxis::Gpus => "GPUs",
            XAxis::Density => "density (kept fraction of key blocks, log scale)",
            XAxis::KvLength => "longest KV cache (tokens)",
        })
        .y_desc(chart.y_label.as_str())
        // Label only the powers of two the sizes are.
        .x_label_formatter(&|x| {
            if chart.x_axis == XAxis::Density {
                return format!("{x:.2}");
            }
            let rounded = x.round() as u64;
            if !(rounded.is_power_of_two() && (x - rounded as f64).abs() < 1e-6 * x.abs().max(1.0))
            {
                String::new()
            } else if chart.x_axis == XAxis::Gpus {
                rounded.to_string()
            } else {
                format_size(rounded)
            }
        })
        .label_style((FONT, 12))
        .draw()
        .map_err(error)?;
    for (index, series) in chart.series.iter().enumerate() {
        let color = Palette99::pick(index).mix(0.95);
        let line: Vec<(f64, f64)> = series.points.iter().map(|p| (p.x, p.y)).collect();
        context
            .draw_series(LineSeries::new(line.clone(), color.stroke_width(2)))
            .map_err(error)?
            .label(series.name.as_str())
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(2))
            });
        context
            .draw_series(line.iter().map(|&p| Circle::new(p, 3, color.filled())))
            .map_err(error)?;
        context
            .draw_series(
                series
                    .points
                    .iter()
                    .map(|p| PathElement::new(vec![(p.x, p.low), (p.x, p.high)], color)),
            )
            .map_err(error)?;
    }
    context
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .label_font((FONT, 12))
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK.mix(0.3))
        .draw()
        .map_err(error)?;
    root.present().map_err(error)
}

pub fn render_svg(chart: &Chart) -> Result<String, PlotError> {
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, SIZE).into_drawing_area();
        draw(&root, chart)?;
    }
    Ok(svg)
}

pub fn render_png(chart: &Chart, path: &Path) -> Result<(), PlotError> {
    let root = BitMapBackend::new(path, SIZE).into_drawing_area();
    draw(&root, chart)
}
