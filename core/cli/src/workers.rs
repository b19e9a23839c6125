//! What the CLI tells the runtime about this machine for its worker processes: the GPU libraries
//! found here, linked under their plain names for the workers. The runtime itself does not know
//! them. (Plugins get the cache folder from the host, in each request.)

use std::path::Path;
use std::sync::Arc;

use attnbench_gpu_libs::Discovery;
use attnbench_runtime::conformance::WorkerSetup;
use attnbench_runtime::host::worker::WorkerEnv;

/// The workers' environment for runs on the cache at `cache_root`, found when the first worker
/// starts.
pub fn run_env(cache_root: &Path) -> WorkerEnv {
    let root = cache_root.to_path_buf();
    Arc::new(move || attnbench_gpu_libs::worker_env(&root.join("cuda-libs")))
}

/// Why stages that need a GPU cannot run here, when they cannot.
pub fn no_device(discovery: &Discovery) -> Option<String> {
    discovery.missing.iter().any(|m| m == "driver").then(|| {
        "needs a GPU, and this machine has none: the NVIDIA driver library (libcuda.so) is in none of the \
         folders `attnbench doctor` searches"
            .to_string()
    })
}

/// The conformance suite's worker setup on this machine.
pub fn check_setup(discovery: &Discovery) -> WorkerSetup<'_> {
    WorkerSetup {
        env: Box::new(|dir: &Path| discovery.linked_worker_env(dir)),
        no_device: no_device(discovery),
    }
}
