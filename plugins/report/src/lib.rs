//! Reports from measurement records: `report/table` writes tidy CSV and JSON and a Markdown
//! summary; `report/html` also draws the plots (SVG inline, PNG files) and writes one
//! self-contained HTML file.

mod decode;
mod html;
mod plots;
mod rows;
mod tables;

use attnbench_sdk::{
    write_atomically, write_json, Host, ParamSpec, ParamType, Plugin, PluginError, PluginManifest,
    StageRequest, StageSpec,
};
use serde_json::{json, Value};

struct Report;

fn stage(name: &str, doc: &str) -> StageSpec {
    StageSpec::new(name)
        .doc(doc)
        .param(
            ParamSpec::new("title", ParamType::String)
                .default("attnbench report")
                .doc("The report's title."),
        )
        .input("measurement")
        .input("decode")
        .output("report")
}

impl Plugin for Report {
    fn manifest() -> PluginManifest {
        PluginManifest::new("report", env!("CARGO_PKG_VERSION"))
            .description("Tables, plots and an HTML report from measurement records.")
            .stage(stage("table", "results.csv, results.json and summary.md from every collected measurement."))
            .stage(stage(
                "html",
                "The tables, plots (PNG under plots/) and report.html: throughput, memory, the support matrix and the environment.",
            ))
    }

    fn run(stage: &str, request: StageRequest, host: &Host) -> Result<Value, PluginError> {
        if stage != "table" && stage != "html" {
            return Err(PluginError::UnknownStage {
                stage: stage.into(),
                known: "table, html".into(),
            });
        }
        let title = request
            .params
            .get("title")
            .and_then(Value::as_str)
            .unwrap_or("attnbench report")
            .to_string();
        let rows = rows::collect(&request.inputs).map_err(PluginError::failed)?;
        let (predictions, comparisons) =
            rows::predictions(&request.inputs).map_err(PluginError::failed)?;
        let decode_steps = decode::collect(&request.inputs).map_err(PluginError::failed)?;
        if rows.is_empty() && predictions.is_empty() && decode_steps.is_empty() {
            return Err(PluginError::Params(
                "no measurements (or cost-model predictions, or decode steps) reached the report; give it `needs: {bench: all}`".into(),
            ));
        }
        let dir = &request.output_dir;
        write_atomically(dir, "results.csv", tables::csv(&rows).as_bytes())?;
        write_json(dir, "results.json", &rows)?;
        write_atomically(
            dir,
            "summary.md",
            tables::markdown(&rows, &title).as_bytes(),
        )?;
        let failed = rows.iter().filter(|r| !r.is_ok()).count();
        let mut result = json!({"rows": rows.len(), "failed": failed, "files": ["results.csv", "results.json", "summary.md"]});
        if stage == "table" {
            return Ok(result);
        }
        plots::register_font();
        let plots_dir = dir.join("plots");
        std::fs::create_dir_all(&plots_dir).map_err(|err| PluginError::io(&plots_dir, err))?;
        let mut pngs = Vec::new();
        let mut render = |charts: Vec<plots::Chart>| -> Result<Vec<(String, String)>, PluginError> {
            let mut rendered = Vec::new();
            for chart in charts {
                let svg = plots::render_svg(&chart)
                    .map_err(|err| PluginError::failed(err.to_string()))?;
                let png = format!("plots/{}.png", chart.id);
                plots::render_png(&chart, &dir.join(&png))
                    .map_err(|err| PluginError::failed(err.to_string()))?;
                pngs.push(png);
                rendered.push((chart.title, svg));
            }
            Ok(rendered)
        };
        let throughput = render(plots::throughput_charts(&rows))?;
        let memory = render(plots::memory_charts(&rows))?;
        let predicted = render(plots::prediction_charts(&predictions))?;
        let decoding = render(decode::charts(&decode_steps))?;
        let page = html::render(&html::Page {
            title: &title,
            rows: &rows,
            throughput,
            memory,
            predictions: &predictions,
            comparisons: &comparisons,
            predicted,
            decode_steps: &decode_steps,
            decoding,
        });
        write_atomically(dir, "report.html", page.as_bytes())?;
        host.info(&format!("report with {} plots", pngs.len()));
        result["report"] = json!("report.html");
        result["plots"] = json!(pngs);
        Ok(result)
    }
}

attnbench_sdk::export_plugin!(Report);
