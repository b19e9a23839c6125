//! `attnbench`: long-context attention benchmarks as reproducible, cached pipelines of plugins.

mod cache_cmd;
mod compare_cmd;
mod doctor;
mod latest_report;
mod mask_cmd;
mod plugin_kit;
mod plugins_cmd;
mod progress;
mod report_cmd;
mod workers;

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{Context, Result};
use attnbench_runtime::cache::Cache;
use attnbench_runtime::host::plugin::Registry;
use attnbench_runtime::inspect::{explain, node_states, NodeState};
use attnbench_runtime::pipeline::{self, PipelineError};
use attnbench_runtime::plan::{nodes_per_stage, Plan};
use attnbench_runtime::run::{execute, RunOptions};
use attnbench_runtime::stop::StopToken;
use clap::{Args, Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "attnbench",
    version,
    about = "Long-context attention benchmarks as reproducible, cached pipelines of plugins."
)]
struct Cli {
    /// Also look for plugin libraries here (before ATTNBENCH_PLUGIN_PATH); repeatable.
    #[arg(long = "plugin-dir", global = true, value_name = "DIR")]
    plugin_dirs: Vec<PathBuf>,
    /// The artifact cache [default: ATTNBENCH_CACHE, else ./artifacts].
    #[arg(long, global = true, value_name = "DIR")]
    cache: Option<PathBuf>,
    /// More log output (-v info, -vv debug, -vvv trace); RUST_LOG overrides.
    #[arg(short, long, global = true, action = clap::ArgAction::Count)]
    verbose: u8,
    /// No progress output; only errors and the final summary.
    #[arg(short, long, global = true)]
    quiet: bool,
    #[command(subcommand)]
    command: Command,
}

#[derive(Args)]
struct PipelineArgs {
    /// The pipeline file (YAML).
    pipeline: PathBuf,
    /// Override a value of the pipeline, e.g. stages.masks.matrix.seqlen=[16k]; repeatable.
    #[arg(long = "set", value_name = "KEY=VALUE")]
    sets: Vec<String>,
}

#[derive(Subcommand)]
enum Command {
    /// Run a pipeline: nodes whose results are cached are reused, the others computed.
    Run {
        #[command(flatten)]
        pipeline: PipelineArgs,
        /// Nodes to run at once [default: the number of CPUs].
        #[arg(short, long)]
        jobs: Option<usize>,
        /// Recompute this node (or every node of this stage) even if cached; repeatable.
        #[arg(long, value_name = "NODE")]
        force: Vec<String>,
        /// Show the plan instead of running it.
        #[arg(long)]
        dry_run: bool,
        /// Start no node after this long (e.g. `9m`, `540s`): the run then ends as a stop signal
        /// ends it, with what finished cached, so a sweep can fill a limited allocation and
        /// resume in the next.
        #[arg(long, value_name = "DURATION", value_parser = humantime::parse_duration)]
        time_budget: Option<std::time::Duration>,
        /// Where worker-isolated nodes run: here, or as Slurm jobs [default: the pipeline's
        /// `executor:`, else the config file's, else local].
        #[arg(long, value_enum)]
        executor: Option<ExecutorArg>,
    },
    /// List the nodes of a pipeline and whether each is cached or will run.
    Plan {
        #[command(flatten)]
        pipeline: PipelineArgs,
        /// Only the per-stage summary.
        #[arg(long)]
        summary: bool,
    },
    /// Say why a node will run: which part of its key changed since its cached result.
    Explain {
        #[command(flatten)]
        pipeline: PipelineArgs,
        /// The node id (as `plan` prints it), or a stage with a single node.
        node: String,
    },
    /// Start a new plugin crate.
    Plugin {
        #[command(subcommand)]
        command: plugin_kit::PluginCommand,
    },
    /// Inspect and check the plugins attnbench can find.
    Plugins {
        #[command(subcommand)]
        command: plugins_cmd::PluginsCommand,
    },
    /// Inspect and maintain the artifact cache.
    Cache {
        #[command(subcommand)]
        command: cache_cmd::CacheCommand,
    },
    /// One report (tables, plots, HTML) from the measurements of earlier runs, merged.
    Report(report_cmd::ReportArgs),
    /// Cell by cell, how NEW's measurements differ from BASE's: time ratios with 95% intervals,
    /// verdicts, status changes and the environments' differences.
    Compare(compare_cmd::CompareArgs),
    /// Look at mask patterns: parameters, documents, area, FLOPs, a picture.
    Mask {
        #[command(subcommand)]
        command: mask_cmd::MaskCommand,
    },
    /// The model shapes a stage's `shape:` can name: heads and head dims of published models.
    Shapes,
    /// Check this machine: plugins, cache, CPU, GPU driver and libraries.
    Doctor,
    /// Serve nodes of one plugin for a host process (started by `run`; not for direct use).
    #[command(hide = true)]
    Worker {
        #[arg(long)]
        plugin: PathBuf,
        /// Only print the plugin's manifest and exit: how discovery reads a library it has not
        /// seen, without loading it into its own process.
        #[arg(long)]
        manifest: bool,
    },
    /// Run one node of a Slurm job array (started by `run --executor slurm`; not for direct use).
    #[command(hide = true)]
    SlurmTask {
        /// The wave's task file.
        tasks: PathBuf,
        /// The task to run [default: $SLURM_ARRAY_TASK_ID].
        #[arg(long)]
        index: Option<usize>,
    },
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum ExecutorArg {
    Local,
    Slurm,
}

/// Nodes in flight at once under Slurm when `--jobs` is not given: the cluster, not this
/// machine, runs them.
const SLURM_JOBS: usize = 256;

fn main() -> ExitCode {
    let cli = Cli::parse();
    init_logging(cli.verbose);
    match dispatch(cli) {
        Ok(code) => code,
        Err(err) => {
            if let Some(PipelineError::Invalid(_)) = err.downcast_ref::<PipelineError>() {
                eprintln!("{err}");
            } else {
                eprintln!("error: {err:#}");
            }
            ExitCode::from(2)
        }
    }
}

/// `attnbench shapes`: one line per preset, and where its numbers come from.
fn print_shapes() {
    use attnbench_sdk::shapes::MODEL_SHAPES;
    println!(
        "{:<16} {:>7} {:>8} {:>8} {:>10}  model (source)",
        "shape", "heads_q", "heads_kv", "head_dim", "head_dim_v"
    );
    for shape in MODEL_SHAPES {
        println!(
            "{:<16} {:>7} {:>8} {:>8} {:>10}  {} ({})",
            shape.name,
            shape.heads_q,
            shape.heads_kv,
            shape.head_dim,
            shape.head_dim_v,
            shape.model,
            shape.source
        );
    }
    println!("\nuse one in any kernel or context-parallel stage: `with: {{shape: llama3-70b}}`, or `matrix: {{shape: [llama3-8b, qwen3-32b]}}`");
}

/// Leaves `value` to the operating system instead of freeing it piece by piece: a plan of
/// 100,000 nodes takes longer to free than to print.
fn keep_until_exit<T>(value: T) {
    std::mem::forget(value);
}

fn init_logging(verbose: u8) {
    let default = match verbose {
        0 => "warn",
        1 => "info",
        2 => "debug",
        _ => "trace",
    };
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .without_time()
        .with_target(false)
        .init();
}

fn open_cache(cli_cache: &Option<PathBuf>) -> Result<Cache> {
    let root = cli_cache.clone().unwrap_or_else(Cache::default_root);
    Ok(Cache::open(&root)?)
}

fn load_plan(args: &PipelineArgs, registry: &Registry) -> Result<Plan> {
    let pipeline = pipeline::load(&args.pipeline, &args.sets, registry)?;
    Ok(Plan::expand(pipeline)?)
}

fn dispatch(cli: Cli) -> Result<ExitCode> {
    if let Command::Worker {
        plugin,
        manifest: true,
    } = &cli.command
    {
        attnbench_runtime::host::plugin::serve_manifest(plugin);
    }
    // Discovery knows plugins by their cached manifests and reads a new library's manifest in a
    // child process, so no command runs a plugin's code here unless it runs one of its stages.
    // The manifests live in the artifact cache; the implicit `./artifacts` is not created just
    // for them, so `plugins list` in some other folder leaves nothing behind.
    let explicit = cli.cache.is_some() || std::env::var_os("ATTNBENCH_CACHE").is_some();
    let cache_root = cli.cache.clone().unwrap_or_else(Cache::default_root);
    attnbench_runtime::host::plugin::configure_manifests(
        (explicit || cache_root.is_dir()).then_some(cache_root.as_path()),
        std::env::current_exe().ok(),
    );
    match cli.command {
        Command::Worker { plugin, .. } => {
            attnbench_runtime::host::worker::serve(&plugin).context("worker")?;
            Ok(ExitCode::SUCCESS)
        }
        Command::SlurmTask { tasks, index } => {
            attnbench_runtime::slurm::task::run_task(&tasks, index)?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Run {
            pipeline,
            jobs,
            force,
            dry_run,
            time_budget,
            executor,
        } => {
            let registry = Registry::discover(&cli.plugin_dirs);
            let plan = load_plan(&pipeline, &registry)?;
            let cache = open_cache(&cli.cache)?;
            if dry_run {
                print_plan(&plan, &cache, false);
                return Ok(ExitCode::SUCCESS);
            }
            let slurm = slurm_settings(&plan, executor)?;
            let options = RunOptions {
                jobs: jobs.unwrap_or_else(|| match slurm {
                    Some(_) => SLURM_JOBS,
                    None => std::thread::available_parallelism()
                        .map(|n| n.get())
                        .unwrap_or(1),
                }),
                force,
                worker_exe: std::env::current_exe()
                    .context("cannot find the attnbench binary to start workers")?,
                argv: std::env::args().collect(),
                time_budget,
                stop: StopToken::new(),
                worker_env: workers::run_env(&cache.root),
                slurm,
            };
            attnbench_runtime::stop::install_handler(options.stop.clone())
                .context("cannot install the stop-signal handler")?;
            let observer = progress::Progress::new(plan.nodes.len(), cli.quiet, cli.verbose > 0);
            let summary = execute(&plan, &cache, &options, &observer)?;
            observer.finish();
            let code = progress::print_summary(&summary, &observer, &cache.root);
            keep_until_exit((plan, summary));
            Ok(code)
        }
        Command::Plan { pipeline, summary } => {
            let registry = Registry::discover(&cli.plugin_dirs);
            let plan = load_plan(&pipeline, &registry)?;
            let cache = open_cache(&cli.cache)?;
            print_plan(&plan, &cache, summary);
            keep_until_exit(plan);
            Ok(ExitCode::SUCCESS)
        }
        Command::Explain { pipeline, node } => {
            let registry = Registry::discover(&cli.plugin_dirs);
            let plan = load_plan(&pipeline, &registry)?;
            let cache = open_cache(&cli.cache)?;
            println!("{}", explain(&plan, &cache, &node)?);
            Ok(ExitCode::SUCCESS)
        }
        Command::Plugin { command } => plugin_kit::run(command),
        Command::Plugins { command } => plugins_cmd::run(command, &cli.plugin_dirs),
        Command::Cache { command } => cache_cmd::run(command, &open_cache(&cli.cache)?),
        Command::Mask { command } => mask_cmd::run(command, &cli.plugin_dirs),
        Command::Report(args) => report_cmd::run(args, &cli.plugin_dirs),
        Command::Compare(args) => compare_cmd::run(args),
        Command::Shapes => {
            print_shapes();
            Ok(ExitCode::SUCCESS)
        }
        Command::Doctor => doctor::run(&cli.plugin_dirs, &open_cache(&cli.cache)?),
    }
}

/// Slurm's settings when the run's nodes go to Slurm: `--executor` over the pipeline's
/// `executor:` over the user's config file.
fn slurm_settings(
    plan: &Plan,
    flag: Option<ExecutorArg>,
) -> anyhow::Result<Option<attnbench_runtime::slurm::config::SlurmSettings>> {
    use attnbench_runtime::slurm::config::{user_section, ExecutorKind};
    let section = plan
        .pipeline
        .executor
        .clone()
        .over(user_section().map_err(anyhow::Error::msg)?);
    let kind = match flag {
        Some(ExecutorArg::Local) => ExecutorKind::Local,
        Some(ExecutorArg::Slurm) => ExecutorKind::Slurm,
        None => section.kind.unwrap_or_default(),
    };
    Ok((kind == ExecutorKind::Slurm).then(|| section.slurm()))
}

fn print_plan(plan: &Plan, cache: &Cache, summary_only: bool) {
    use std::io::Write;
    let states = node_states(plan, cache);
    let stdout = std::io::stdout();
    let mut out = std::io::BufWriter::new(stdout.lock());
    if !summary_only {
        let width = plan
            .nodes
            .iter()
            .map(|n| n.id.len())
            .max()
            .unwrap_or(0)
            .min(100);
        for (node, state) in plan.nodes.iter().zip(&states) {
            let _ = writeln!(
                out,
                "{:<7} {:<width$}  {}",
                state.label(),
                node.id,
                plan.stage_of(node).uses
            );
        }
    }
    let counts = nodes_per_stage(plan);
    for (stage, total) in counts {
        let cached = plan
            .nodes
            .iter()
            .zip(&states)
            .filter(|(n, s)| {
                plan.stage_of(n).name == stage && matches!(s, NodeState::Cached { .. })
            })
            .count();
        let _ = writeln!(
            out,
            "stage {stage}: {total} nodes, {cached} cached, {} to run",
            total - cached
        );
    }
    let cached = states
        .iter()
        .filter(|s| matches!(s, NodeState::Cached { .. }))
        .count();
    let _ = writeln!(
        out,
        "pipeline {}: {} nodes, {cached} cached, {} to run",
        plan.pipeline.name,
        plan.nodes.len(),
        plan.nodes.len() - cached
    );
}

/// A path shown relative to the current directory when it is under it.
pub fn display_path(path: &Path) -> String {
    std::env::current_dir()
        .ok()
        .and_then(|cwd| path.strip_prefix(cwd).ok().map(|p| p.display().to_string()))
        .unwrap_or_else(|| path.display().to_string())
}
