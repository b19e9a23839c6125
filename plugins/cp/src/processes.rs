//! Ranks as processes: `attnbench-cp-rank JOB` runs one rank of a job file, joining the others
//! over TCP with the launcher's variables (`launch`). The `cp` stage's `processes` backend starts
//! them itself on this machine (torchrun-style variables, a free port on loopback) and gathers
//! their results; under Slurm, MPI or torchrun the same binary runs one rank per task:
//!
//! ```sh
//! srun --ntasks 16 --ntasks-per-node 8 attnbench-cp-rank job.json
//! ```

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use attnbench_sdk::attention::{AttentionError, Backend, HostBlock, RowIntervals};
use attnbench_sdk::mask::MaskSet;
use attnbench_sdk::reference::{Element, Inputs, Shape};
use serde::{Deserialize, Serialize};

use crate::device::GpuError;
use crate::launch::{LauncherError, RankInfo};
use crate::layout::LayoutError;
use crate::methods::{MethodError, Setup};
use crate::tcp::JoinError;
use crate::threads::{self, Outcome, PassError, RankResult};

/// What every rank of a context-parallel job computes, on CPUs or GPUs: the method and the
/// problem (inputs are drawn from the seed, so every rank draws the same).
#[derive(Serialize, Deserialize)]
pub struct RankProblem {
    pub setup: Setup,
    pub heads_q: usize,
    pub heads_kv: usize,
    pub head_dim: usize,
    pub dtype: Element,
    pub seed: u64,
    pub backward: bool,
    pub mask: MaskSet,
}

impl RankProblem {
    pub fn shape(&self) -> Shape {
        Shape {
            heads_q: self.heads_q,
            heads_kv: self.heads_kv,
            seqlen: self.mask.seqlen as usize,
            head_dim: self.head_dim,
            head_dim_v: None,
        }
    }

    /// The launcher started as many ranks as the method's groups need.
    pub fn check_world(&self, info: &RankInfo) -> Result<(), RankError> {
        let needed = self.setup.layout.world();
        if info.world != needed {
            return Err(RankError::World {
                started: info.world,
                launcher: info.source,
                needed,
            });
        }
        Ok(())
    }
}

/// Everything a CPU rank needs: the problem, its local attention, and where to write its result.
#[derive(Serialize, Deserialize)]
pub struct Job {
    #[serde(flatten)]
    pub problem: RankProblem,
    /// Each rank writes `rank-<r>.json` here.
    pub results: PathBuf,
    /// The local attention: a plugin library and its in-process kernel (`None`: builtin).
    #[serde(default)]
    pub attention: Option<(PathBuf, String)>,
}

/// Opens an in-process attention backend and runs one tiny forward and backward block through
/// it, so that a backend that cannot run this job fails here with its reason — not halfway
/// through a ring, where the other ranks would wait for it.
pub fn open_attention(path: &Path, kernel: &str) -> Result<Backend, AttentionError> {
    let backend = Backend::open(path, kernel)?;
    let rows = RowIntervals {
        row_start: vec![0, 1],
        intervals: vec![0, 1],
    };
    let block = HostBlock {
        head_dim: 1,
        q_len: 1,
        k_len: 1,
        scale: 1.0,
        kv_head_of: &[0],
        heads_kv: 1,
        rows: &rows,
    };
    let (mut out, mut lse) = ([0.0], [0.0]);
    backend.forward_host(&block, (&[1.0], &[1.0], &[1.0]), &mut out, &mut lse)?;
    let (mut dq, mut dk, mut dv) = ([0.0], [0.0], [0.0]);
    backend.backward_host(
        &block,
        (&[1.0], &[1.0], &[1.0]),
        &out,
        &lse,
        &[1.0],
        (&mut dq, &mut dk, &mut dv),
    )?;
    if out != [1.0] || lse != [1.0] || dv != [1.0] {
        return Err(AttentionError::Failed(format!(
            "{}: one key of value 1 gave O {out:?}, LSE {lse:?}, dV {dv:?}; expected 1, 1, 1",
            backend.name
        )));
    }
    Ok(backend)
}

/// Why one rank stopped without a result. Its process prints this as its last line and exits
/// non-zero; the launcher relays that line.
#[derive(Debug, thiserror::Error)]
pub enum RankError {
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{}: not {what}: {source}", path.display())]
    Job {
        path: PathBuf,
        /// `a job`, `a links job`, `a GPU job`.
        what: &'static str,
        source: serde_json::Error,
    },
    #[error(transparent)]
    Launcher(#[from] LauncherError),
    #[error("{started} ranks were started ({launcher}), the job needs {needed}")]
    World {
        started: usize,
        launcher: &'static str,
        needed: usize,
    },
    #[error(transparent)]
    Layout(#[from] LayoutError),
    #[error(transparent)]
    Join(#[from] JoinError),
    #[error(transparent)]
    Attention(#[from] AttentionError),
    /// cudarc or the GPU store unwound (a missing library, a broken or exhausted GPU).
    #[error("rank {rank} stopped: {message}")]
    Panicked { rank: usize, message: String },
    #[error(transparent)]
    Method(#[from] MethodError),
    #[error(transparent)]
    Gpu(#[from] GpuError),
    #[error("LOCAL_RANK {local_rank} but CUDA_VISIBLE_DEVICES={visible} names fewer GPUs")]
    Visible { local_rank: usize, visible: String },
    #[error("dtype `f32`: GPU ranks take bf16 or fp16")]
    GpuDtype,
    /// A collective's check of what arrived (`cp/links`).
    #[error("{collective} of {bytes} bytes: rank {rank} received {got} at element {element}, expected {want}")]
    Received {
        collective: &'static str,
        bytes: u64,
        rank: usize,
        element: usize,
        got: f32,
        want: f32,
    },
}

impl RankError {
    pub(crate) fn job(path: &Path, what: &'static str) -> impl FnOnce(serde_json::Error) -> Self {
        let path = path.to_path_buf();
        move |source| RankError::Job { path, what, source }
    }
}

/// Runs this process's rank of the job at `path`: a context-parallel attention job, or a links
/// job (`"kind": "links"`, see `links`).
pub fn rank_main(path: &Path) -> Result<(), RankError> {
    let text = std::fs::read(path).map_err(|source| RankError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    let kind: serde_json::Value =
        serde_json::from_slice(&text).map_err(RankError::job(path, "a job"))?;
    match kind.get("kind").and_then(|k| k.as_str()) {
        Some("links") => return crate::links::rank_main(&text, path),
        Some("gpu") => return crate::gpu_rank::rank_main(&text, path),
        Some("gpu-decode") => return crate::decode_gpu::rank_main(&text, path),
        _ => {}
    }
    let job: Job = serde_json::from_slice(&text).map_err(RankError::job(path, "a job"))?;
    let info = RankInfo::from_env()?;
    let problem = &job.problem;
    problem.check_world(&info)?;
    let shape = problem.shape();
    threads::check(&problem.setup, &shape)?;
    let inputs = Inputs::random_as(&shape, problem.seed, problem.dtype);
    let world = crate::tcp::join(&info)?;
    let attention = job
        .attention
        .as_ref()
        .map(|(path, kernel)| open_attention(path, kernel))
        .transpose()?;
    let result = threads::run_rank(
        world,
        info.rank,
        &problem.setup,
        &shape,
        &problem.mask,
        &inputs,
        problem.backward,
        attention.as_ref(),
    )?;
    write_rank_result(&job.results, info.rank, &result)
}

/// Writes rank `rank`'s result as `rank-<rank>.json` in `dir`, whole or not at all.
fn write_rank_result(dir: &Path, rank: usize, result: &impl Serialize) -> Result<(), RankError> {
    let target = dir.join(format!("rank-{rank}.json"));
    let bytes = serde_json::to_vec(result).map_err(|err| RankError::Io {
        path: target.clone(),
        source: err.into(),
    })?;
    let partial = target.with_extension("partial");
    std::fs::write(&partial, bytes)
        .and_then(|_| std::fs::rename(&partial, &target))
        .map_err(|source| RankError::Io {
            path: target,
            source,
        })
}

/// Runs `work` as rank `rank` and writes what it returns (see [`write_rank_result`]). cudarc
/// and the GPU store unwind on some failures (a missing library, a broken or exhausted GPU):
/// the rank reports those like any other error.
pub fn run_rank_catching<T: Serialize>(
    dir: &Path,
    rank: usize,
    work: impl FnOnce() -> Result<T, RankError>,
) -> Result<(), RankError> {
    let result = match std::panic::catch_unwind(std::panic::AssertUnwindSafe(work)) {
        Ok(done) => done?,
        Err(panic) => {
            let message = panic
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_default();
            return Err(RankError::Panicked { rank, message });
        }
    };
    write_rank_result(dir, rank, &result)
}

/// Why the rank processes could not be started, did not finish, or left no result.
#[derive(Debug, thiserror::Error)]
pub enum LaunchError {
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{}: {source}", path.display())]
    Result {
        path: PathBuf,
        source: serde_json::Error,
    },
    #[error("no free port between 20000 and 32000 for the ranks to meet on")]
    NoPort,
    #[error("cannot start {}: {source}; it is built and installed beside the attnbench binary", binary.display())]
    Spawn {
        binary: PathBuf,
        source: std::io::Error,
    },
    #[error("rank {rank} {status}: {tail}")]
    RankFailed {
        rank: usize,
        status: std::process::ExitStatus,
        tail: String,
    },
    #[error("rank {rank} did not finish within {seconds} s")]
    RankTimeout { rank: usize, seconds: u64 },
    #[error("cannot start srun: {0}")]
    SrunSpawn(std::io::Error),
    #[error("srun's {ranks} ranks did not finish within {seconds} s")]
    SrunTimeout { ranks: usize, seconds: u64 },
    #[error("srun --ntasks={ranks} {status}: {tail} (rank logs: {})", logs.display())]
    SrunFailed {
        ranks: usize,
        status: std::process::ExitStatus,
        tail: String,
        logs: PathBuf,
    },
    /// Waiting on a rank process failed.
    #[error("waiting for a rank: {0}")]
    Wait(std::io::Error),
}

fn io_at(path: &Path) -> impl FnOnce(std::io::Error) -> LaunchError + '_ {
    move |source| LaunchError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// Every rank's `rank-<r>.json` from `dir`.
pub fn read_rank_results<T: for<'de> Deserialize<'de>>(
    dir: &Path,
    ranks: usize,
) -> Result<Vec<T>, LaunchError> {
    (0..ranks)
        .map(|rank| {
            let file = dir.join(format!("rank-{rank}.json"));
            let bytes = std::fs::read(&file).map_err(io_at(&file))?;
            serde_json::from_slice(&bytes)
                .map_err(|source| LaunchError::Result { path: file, source })
        })
        .collect()
}

/// The rank binary: beside the running `attnbench` (how it is installed and built), else on PATH.
fn rank_binary() -> PathBuf {
    const NAME: &str = "attnbench-cp-rank";
    std::env::current_exe()
        .ok()
        .and_then(|exe| exe.parent().map(|dir| dir.join(NAME)))
        .filter(|path| path.is_file())
        .unwrap_or_else(|| PathBuf::from(NAME))
}

/// A port nobody listens on now, below Linux's ephemeral range (32768–60999) so that the ranks'
/// own listeners, which take ephemeral ports, cannot take it before rank 0 binds it.
fn free_port() -> Result<u16, LaunchError> {
    let start = 20000 + (std::process::id() % 10000) as u16;
    (0..2000)
        .map(|offset| 20000 + (start - 20000 + offset) % 12000)
        .find(|&port| std::net::TcpListener::bind(("0.0.0.0", port)).is_ok())
        .ok_or(LaunchError::NoPort)
}

/// Starts every rank of `job` (written at `path`) as a process on this machine and gathers their
/// results; their logs go into the job's results folder.
pub fn run(job: &Job, path: &Path, timeout: Duration) -> Result<Outcome, PassError> {
    let problem = &job.problem;
    let shape = problem.shape();
    threads::check(&problem.setup, &shape)?;
    let n = problem.setup.layout.world();
    start_ranks(path, n, &job.results, timeout)?;
    let results: Vec<RankResult> = read_rank_results(&job.results, n)?;
    Ok(threads::assemble(&shape, results, problem.backward))
}

/// Who starts the rank processes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Launch {
    /// This process, on this machine.
    Local,
    /// `srun`, inside the Slurm job that runs the node (`attnbench run --executor slurm` sets
    /// `ATTNBENCH_RANK_LAUNCHER=srun` in its jobs): one task per rank, over the job's nodes.
    Srun,
}

impl Launch {
    pub fn from_env() -> Launch {
        let srun = std::env::var("ATTNBENCH_RANK_LAUNCHER").is_ok_and(|v| v == "srun")
            && std::env::var_os("SLURM_JOB_ID").is_some();
        if srun {
            Launch::Srun
        } else {
            Launch::Local
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Launch::Local => "local",
            Launch::Srun => "srun",
        }
    }
}

/// Runs `n` rank processes of the job at `path` until all have finished, or one has failed, or
/// `timeout`; their logs go into `dir`, `rank-<r>.log`. Locally they get torchrun-style
/// variables (GPU `LOCAL_RANK` each); under `srun`, Slurm's own.
pub fn start_ranks(
    path: &Path,
    n: usize,
    dir: &Path,
    timeout: Duration,
) -> Result<(), LaunchError> {
    std::fs::create_dir_all(dir).map_err(io_at(dir))?;
    let port = free_port()?;
    let binary = rank_binary();
    if Launch::from_env() == Launch::Srun {
        return srun_ranks(&binary, path, n, dir, port, timeout);
    }
    let mut children: Vec<(Child, PathBuf)> = Vec::new();
    for rank in 0..n {
        let log = dir.join(format!("rank-{rank}.log"));
        let stderr = std::fs::File::create(&log).map_err(io_at(&log))?;
        let child = Command::new(&binary)
            .arg(path)
            .env("RANK", rank.to_string())
            .env("WORLD_SIZE", n.to_string())
            .env("LOCAL_RANK", rank.to_string())
            .env("MASTER_ADDR", "127.0.0.1")
            .env("MASTER_PORT", port.to_string())
            .stdout(Stdio::null())
            .stderr(stderr)
            .spawn()
            .map_err(|source| LaunchError::Spawn {
                binary: binary.clone(),
                source,
            });
        match child {
            Ok(child) => children.push((child, log)),
            Err(err) => {
                for (mut child, _) in children {
                    let _ = child.kill();
                    let _ = child.wait();
                }
                return Err(err);
            }
        }
    }
    let deadline = Instant::now() + timeout;
    let mut failure = None;
    for (rank, (child, log)) in children.iter_mut().enumerate() {
        let status = loop {
            if let Some(status) = child.try_wait().map_err(LaunchError::Wait)? {
                break Some(status);
            }
            if Instant::now() > deadline || failure.is_some() {
                break None;
            }
            std::thread::sleep(Duration::from_millis(5));
        };
        let tail = || {
            std::fs::read_to_string(&*log)
                .unwrap_or_default()
                .lines()
                .rev()
                .take(3)
                .collect::<Vec<_>>()
                .join(" | ")
        };
        match status {
            Some(status) if status.success() => {}
            Some(status) => {
                failure = failure.or(Some(LaunchError::RankFailed {
                    rank,
                    status,
                    tail: tail(),
                }))
            }
            None => {
                failure = failure.or(Some(LaunchError::RankTimeout {
                    rank,
                    seconds: timeout.as_secs(),
                }))
            }
        }
    }
    if let Some(failure) = failure {
        for (child, _) in &mut children {
            let _ = child.kill();
            let _ = child.wait();
        }
        return Err(failure);
    }
    Ok(())
}

/// The ranks as the tasks of one `srun` step in the node's Slurm job. The rendezvous is the
/// job's first node (where this batch step runs) at `port`; the local launcher's variables are
/// removed so that the ranks read Slurm's.
fn srun_ranks(
    binary: &Path,
    path: &Path,
    n: usize,
    dir: &Path,
    port: u16,
    timeout: Duration,
) -> Result<(), LaunchError> {
    let rank_logs = dir.join("rank-%t.log");
    let srun_log = dir.join("srun.log");
    let stderr = std::fs::File::create(&srun_log).map_err(io_at(&srun_log))?;
    let mut child = Command::new("srun")
        .arg(format!("--ntasks={n}"))
        .arg("--kill-on-bad-exit=1")
        .arg(format!("--output={}", rank_logs.display()))
        .arg(binary)
        .arg(path)
        .env_remove("RANK")
        .env_remove("WORLD_SIZE")
        .env_remove("LOCAL_RANK")
        .env_remove("MASTER_ADDR")
        .env("MASTER_PORT", port.to_string())
        .stdout(Stdio::null())
        .stderr(stderr)
        .spawn()
        .map_err(LaunchError::SrunSpawn)?;
    let deadline = Instant::now() + timeout;
    let status = loop {
        if let Some(status) = child.try_wait().map_err(LaunchError::Wait)? {
            break status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            return Err(LaunchError::SrunTimeout {
                ranks: n,
                seconds: timeout.as_secs(),
            });
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    if status.success() {
        return Ok(());
    }
    let said = std::fs::read_to_string(&srun_log).unwrap_or_default();
    let last: Vec<&str> = said.lines().rev().take(3).collect();
    Err(LaunchError::SrunFailed {
        ranks: n,
        status,
        tail: last.into_iter().rev().collect::<Vec<_>>().join(" | "),
        logs: rank_logs,
    })
}
