//! `attnbench mask show`: one pattern, its drawn parameters, documents, area and FLOPs — as text,
//! JSON, or a picture.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{anyhow, bail, Context, Result};
use attnbench_runtime::host::plugin::Registry;
use attnbench_sdk::mask::{Flops, Mask, MaskSet};
use attnbench_sdk::{format_size, parse_size};
use clap::{Args, Subcommand};
use serde_json::{json, Map, Value};

#[derive(Subcommand)]
pub enum MaskCommand {
    /// Generate one mask and describe it.
    Show(ShowArgs),
}

#[derive(Args)]
pub struct ShowArgs {
    /// The pattern (`attnbench plugins info masks` lists them).
    #[arg(long)]
    mask: String,
    /// Tokens, e.g. 8k.
    #[arg(long, value_parser = parse_size)]
    seqlen: u64,
    /// `synthetic`, or a LongCA-bench histogram JSON file.
    #[arg(long, default_value = "synthetic")]
    distribution: String,
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// Query heads, for FLOPs (and per-head block-sparse masks).
    #[arg(long, default_value_t = 64)]
    heads_q: u64,
    /// Key/value heads (per-KV-group block-sparse masks).
    #[arg(long, default_value_t = 8)]
    heads_kv: u64,
    #[arg(long, default_value_t = 128)]
    head_dim: u64,
    /// Any other parameter of masks/generate, e.g. --param window=512; repeatable.
    #[arg(long = "param", value_name = "KEY=VALUE")]
    params: Vec<String>,
    /// Print one JSON object instead of text.
    #[arg(long)]
    json: bool,
    /// Also draw the mask into this PNG file (downsampled for long sequences).
    #[arg(long, value_name = "FILE")]
    png: Option<PathBuf>,
}

pub fn run(command: MaskCommand, plugin_dirs: &[PathBuf]) -> Result<ExitCode> {
    let MaskCommand::Show(args) = command;
    let registry = Registry::discover(plugin_dirs);
    let plugin = registry
        .get("masks")
        .ok_or_else(|| anyhow!("the masks plugin was not found; build it with `cargo build --release --workspace` or pass --plugin-dir"))?;
    let mut given = Map::new();
    given.insert("mask".into(), json!(args.mask));
    given.insert("seqlen".into(), json!(args.seqlen));
    given.insert("heads_q".into(), json!(args.heads_q));
    given.insert("heads_kv".into(), json!(args.heads_kv));
    let distribution = if Path::new(&args.distribution).is_file() {
        Path::new(&args.distribution)
            .canonicalize()?
            .display()
            .to_string()
    } else if args.distribution.contains('/') || args.distribution.ends_with(".json") {
        bail!("--distribution {}: no such file", args.distribution);
    } else {
        args.distribution.clone()
    };
    given.insert("distribution".into(), json!(distribution));
    for option in &args.params {
        let (key, value) = option
            .split_once('=')
            .ok_or_else(|| anyhow!("--param {option}: expected KEY=VALUE"))?;
        let value = parse_param_value(value);
        given.insert(key.to_string(), value);
    }
    let output = tempfile::tempdir()?;
    let result = plugin
        .call("generate", &given, args.seed, output.path(), Vec::new())
        .map_err(|err| anyhow!("{err}"))?;
    let set = MaskSet::load(output.path()).map_err(|err| anyhow!("{err}"))?;
    let flops = set
        .checked_flops(args.heads_q, args.heads_kv, args.head_dim)
        .ok_or_else(|| {
            anyhow!(
                "the FLOPs of this mask with {} query heads of dimension {} do not fit in 64 bits; use fewer tokens or heads",
                args.heads_q,
                args.head_dim
            )
        })?;
    if let Some(path) = &args.png {
        draw_png(&set.masks[0], path)
            .with_context(|| format!("cannot write {}", path.display()))?;
    }
    if args.json {
        let mut object = result.as_object().cloned().unwrap_or_default();
        object.insert("heads_q".into(), json!(args.heads_q));
        object.insert("heads_kv".into(), json!(args.heads_kv));
        object.insert("head_dim".into(), json!(args.head_dim));
        object.insert("flops_fwd".into(), json!(flops.fwd));
        object.insert("flops_bwd".into(), json!(flops.bwd));
        object.insert("flops_fwd_bwd".into(), json!(flops.fwd_bwd));
        println!("{}", serde_json::to_string_pretty(&Value::Object(object))?);
    } else {
        print_text(&set, &result, flops, &args);
    }
    Ok(ExitCode::SUCCESS)
}

/// A `--param` value: a JSON scalar (number, boolean), else the text itself.
fn parse_param_value(text: &str) -> Value {
    serde_json::from_str(text).unwrap_or_else(|_| Value::String(text.to_string()))
}

fn print_text(set: &MaskSet, result: &Value, flops: Flops, args: &ShowArgs) {
    println!(
        "{} at {} tokens (seed {}, distribution {})",
        set.pattern,
        format_size(set.seqlen),
        args.seed,
        args.distribution
    );
    let drawn: Vec<String> = set
        .params
        .iter()
        .filter(|(k, _)| !["mask", "seqlen", "seed"].contains(&k.as_str()))
        .map(|(k, v)| format!("{k}={v}"))
        .collect();
    if !drawn.is_empty() {
        println!("  parameters: {}", drawn.join(", "));
    }
    if !set.documents.is_empty() {
        let shown: Vec<String> = set.documents.iter().take(12).map(u64::to_string).collect();
        let more = if set.documents.len() > 12 {
            ", …"
        } else {
            ""
        };
        println!(
            "  documents: {} ({}{more})",
            set.documents.len(),
            shown.join(", ")
        );
    }
    let area = result["area"].as_u64().unwrap_or(0);
    println!(
        "  masks: {} ({:?}), slices: {}, area: {area} ({:.2}% of the cells)",
        set.masks.len(),
        set.scope,
        result["slices"],
        100.0 * result["density"].as_f64().unwrap_or(0.0)
    );
    println!(
        "  FLOPs (h_q={}, d={}): fwd {:.4e}, bwd {:.4e}, fwd+bwd {:.4e}",
        args.heads_q, args.head_dim, flops.fwd as f64, flops.bwd as f64, flops.fwd_bwd as f64
    );
    if let Some(path) = &args.png {
        println!("  picture: {}", path.display());
    }
}

/// Draws the mask at most 1024 pixels wide: one pixel per tile, dark where the tile is fully
/// allowed, light where partly, white where empty.
fn draw_png(mask: &Mask, path: &Path) -> Result<()> {
    let tile = mask.seqlen_q.max(mask.seqlen_k).div_ceil(1024).max(1);
    let blocks = mask.block_mask(tile, tile);
    let (width, height) = (blocks.k_tiles() as u32, blocks.q_tiles() as u32);
    let mut pixels = vec![255u8; (width * height * 3) as usize];
    for row in 0..height as usize {
        for (kt, full) in blocks.row(row) {
            let color: [u8; 3] = if full { [31, 73, 125] } else { [140, 180, 220] };
            let at = (row * width as usize + kt as usize) * 3;
            pixels[at..at + 3].copy_from_slice(&color);
        }
    }
    let file = std::io::BufWriter::new(std::fs::File::create(path)?);
    let mut encoder = png::Encoder::new(file, width, height);
    encoder.set_color(png::ColorType::Rgb);
    encoder.set_depth(png::BitDepth::Eight);
    encoder.write_header()?.write_image_data(&pixels)?;
    Ok(())
}
