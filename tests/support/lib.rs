//! Helpers for the integration tests and benchmarks: the real `attnbench` binary, run in a
//! scratch directory with its own cache, against the real plugin libraries of the workspace.
//!
//! The tests use what `cargo build --workspace` produced (the README's test command builds first).

pub mod http;
pub mod slurm;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde_json::Value;

/// `target/<profile>` of the running test or bench executable.
pub fn target_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("the test executable has a path");
    let deps = exe
        .parent()
        .expect("the test executable is in target/<profile>/deps");
    deps.parent()
        .expect("target/<profile> exists")
        .to_path_buf()
}

/// The workspace root.
pub fn workspace_root() -> PathBuf {
    let tests = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    tests
        .parent()
        .expect("the tests crate is a folder of the workspace")
        .to_path_buf()
}

/// The `attnbench` binary next to the test executable.
pub fn binary() -> PathBuf {
    let binary = target_dir().join("attnbench");
    assert!(
        binary.is_file(),
        "{} is missing: run `cargo build --workspace` before the tests",
        binary.display()
    );
    binary
}

/// A scratch directory with its own cache, where pipelines are written and run.
pub struct Sandbox {
    pub dir: tempfile::TempDir,
}

impl Default for Sandbox {
    fn default() -> Self {
        Self::new()
    }
}

impl Sandbox {
    pub fn new() -> Self {
        Sandbox {
            dir: tempfile::tempdir().expect("a temporary directory"),
        }
    }

    pub fn path(&self) -> &Path {
        self.dir.path()
    }

    pub fn cache(&self) -> PathBuf {
        self.path().join("artifacts")
    }

    pub fn write(&self, name: &str, text: &str) -> PathBuf {
        let path = self.path().join(name);
        std::fs::write(&path, text).expect("write a file in the sandbox");
        path
    }

    /// `attnbench ARGS` in the sandbox, with its cache, not yet started.
    pub fn command(&self, args: &[&str]) -> Command {
        let mut command = Command::new(binary());
        command
            .args(args)
            .current_dir(self.path())
            .env("ATTNBENCH_CACHE", self.cache())
            .env_remove("RUST_LOG");
        command
    }

    pub fn run(&self, args: &[&str]) -> Output {
        self.command(args).output().expect("attnbench starts")
    }

    /// The record of the newest run in the sandbox's cache.
    pub fn last_record(&self) -> Value {
        let runs = self.cache().join("runs");
        let id = std::fs::read_to_string(runs.join("latest")).expect("a run has finished");
        let text =
            std::fs::read_to_string(runs.join(id.trim()).join("run.json")).expect("run.json");
        serde_json::from_str(&text).expect("run.json is JSON")
    }

    /// Node id → status of the newest run.
    pub fn statuses(&self) -> std::collections::BTreeMap<String, String> {
        statuses(&self.last_record())
    }
}

pub fn statuses(record: &Value) -> std::collections::BTreeMap<String, String> {
    record["nodes"]
        .as_array()
        .expect("nodes")
        .iter()
        .map(|node| {
            (
                node["id"].as_str().unwrap_or_default().to_string(),
                node["status"].as_str().unwrap_or_default().to_string(),
            )
        })
        .collect()
}

/// Text of a process's stderr.
pub fn stderr(output: &Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

pub fn stdout(output: &Output) -> String {
    String::from_utf8_lossy(&output.stdout).into_owned()
}

/// Runs `cargo ARGS` on the crate at `crate_dir` (outside the workspace) with the shared fixture
/// target directory, serialised through a lock file because tests run in parallel; returns that
/// target directory.
pub fn cargo_outside(crate_dir: &Path, args: &[&str]) -> PathBuf {
    let target = workspace_root().join("target/fixtures");
    std::fs::create_dir_all(&target).expect("fixture target dir");
    let lock = std::fs::File::create(target.join("build.lock")).expect("lock file");
    lock.lock().expect("lock the fixture build");
    // Same versions as the workspace, so the build reuses what is already compiled.
    let _ = std::fs::copy(
        workspace_root().join("Cargo.lock"),
        crate_dir.join("Cargo.lock"),
    );
    let output = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
        .args(args)
        .arg("--quiet")
        .arg("--manifest-path")
        .arg(crate_dir.join("Cargo.toml"))
        .arg("--target-dir")
        .arg(&target)
        .output()
        .expect("cargo runs");
    assert!(
        output.status.success(),
        "cargo {args:?} in {} failed:\n{}",
        crate_dir.display(),
        stderr(&output)
    );
    target
}

/// Builds the third-party example plugin (outside the workspace) and returns a copy of its
/// library under `dest`, named `name`.
pub fn build_example_plugin(features: &[&str], dest: &Path, name: &str) -> PathBuf {
    let fixture = workspace_root().join("tests/fixtures/example-kernel");
    let feature_list = features.join(",");
    let mut args = vec!["build"];
    if !features.is_empty() {
        args.extend(["--features", feature_list.as_str()]);
    }
    let target = cargo_outside(&fixture, &args);
    let built = target
        .join("debug")
        .join(format!("libexample_kernel{}", std::env::consts::DLL_SUFFIX));
    let copy = dest.join(name);
    std::fs::copy(&built, &copy).expect("copy the built plugin");
    copy
}

/// A Python interpreter with numpy, for the bridge's tests: `ATTNBENCH_TEST_PYTHON` when set,
/// else a virtual environment made once under `target/python-env` (python3 -m venv, then
/// `pip install numpy`), serialised through a lock file because tests run in parallel.
pub fn python_with_numpy() -> PathBuf {
    if let Some(python) = std::env::var_os("ATTNBENCH_TEST_PYTHON") {
        return PathBuf::from(python);
    }
    let env = workspace_root().join("target/python-env");
    let python = env.join("bin/python3");
    std::fs::create_dir_all(workspace_root().join("target")).expect("target dir");
    let lock =
        std::fs::File::create(workspace_root().join("target/python-env.lock")).expect("lock file");
    lock.lock().expect("lock the Python environment");
    let has_numpy = |python: &Path| {
        Command::new(python)
            .args(["-c", "import numpy"])
            .output()
            .is_ok_and(|o| o.status.success())
    };
    if has_numpy(&python) {
        return python;
    }
    let steps: [(&str, Vec<&std::ffi::OsStr>); 2] = [
        (
            "python3",
            vec!["-m".as_ref(), "venv".as_ref(), env.as_os_str()],
        ),
        (
            python.to_str().expect("a UTF-8 path"),
            vec![
                "-m".as_ref(),
                "pip".as_ref(),
                "install".as_ref(),
                "--quiet".as_ref(),
                "numpy".as_ref(),
            ],
        ),
    ];
    for (program, args) in steps {
        let output = Command::new(program)
            .args(&args)
            .output()
            .unwrap_or_else(|err| panic!("{program} did not start: {err}"));
        assert!(
            output.status.success(),
            "setting up the tests' Python environment ({program} {args:?}) failed; set ATTNBENCH_TEST_PYTHON to an interpreter with numpy instead:\n{}",
            stderr(&output)
        );
    }
    assert!(
        has_numpy(&python),
        "numpy is not importable from {}",
        python.display()
    );
    python
}

/// The node `id` of a run record.
pub fn node<'a>(record: &'a Value, id: &str) -> &'a Value {
    record["nodes"]
        .as_array()
        .expect("nodes")
        .iter()
        .find(|n| n["id"] == id)
        .unwrap_or_else(|| panic!("no node {id} in {record}"))
}

/// The measurement record a node wrote into its artifact.
pub fn measurement_of(node: &Value) -> Value {
    let artifact = node["artifact"]
        .as_str()
        .unwrap_or_else(|| panic!("{} has no artifact: {node}", node["id"]));
    let text = std::fs::read_to_string(Path::new(artifact).join("measurement.json"))
        .unwrap_or_else(|err| panic!("{}: measurement.json: {err}", node["id"]));
    serde_json::from_str(&text).expect("measurement.json is JSON")
}

/// (id, measurement) of every node whose id starts with `prefix`.
pub fn measurements(record: &Value, prefix: &str) -> Vec<(String, Value)> {
    record["nodes"]
        .as_array()
        .expect("nodes")
        .iter()
        .filter(|n| n["id"].as_str().is_some_and(|id| id.starts_with(prefix)))
        .map(|n| (n["id"].as_str().unwrap().to_string(), measurement_of(n)))
        .collect()
}

/// The tests' Python environment (see [`python_with_numpy`]) with NVRTC from the
/// `nvidia-cuda-nvrtc` wheel (CUDA 13.0, the GPU machines' version), for compiling the CUDA C
/// sources on a machine without CUDA.
pub fn python_with_nvrtc() -> PathBuf {
    let python = python_with_numpy();
    let lock =
        std::fs::File::create(workspace_root().join("target/python-env.lock")).expect("lock file");
    lock.lock().expect("lock the Python environment");
    let probe = "import glob, sys; sys.exit(0 if any(glob.glob(p + '/nvidia/cu13/lib/libnvrtc.so.13') for p in sys.path) else 1)";
    let has = |python: &Path| {
        Command::new(python)
            .args(["-c", probe])
            .status()
            .is_ok_and(|s| s.success())
    };
    if !has(&python) {
        let output = Command::new(&python)
            .args([
                "-m",
                "pip",
                "install",
                "--quiet",
                "nvidia-cuda-nvrtc==13.0.*",
            ])
            .output()
            .expect("pip runs");
        assert!(
            output.status.success(),
            "installing NVRTC into the tests' Python environment failed:\n{}",
            stderr(&output)
        );
    }
    python
}

/// The fastest of `tries` runs of `work` (benchmarks), with the last run's value.
pub fn best<T>(tries: usize, mut work: impl FnMut() -> T) -> (std::time::Duration, T) {
    let mut best = std::time::Duration::MAX;
    let mut last = None;
    for _ in 0..tries {
        let start = std::time::Instant::now();
        let value = work();
        best = best.min(start.elapsed());
        last = Some(value);
    }
    (best, last.expect("at least one try"))
}
