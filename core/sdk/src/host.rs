use std::path::{Path, PathBuf};

use attnbench_abi::abi_stable::std_types::RStr;
use attnbench_abi::{HostServices, LogLevel};

/// The host's services as a plugin sees them during one `run` call.
pub struct Host<'a> {
    services: &'a HostServices,
    cache_dir: Option<PathBuf>,
}

impl<'a> Host<'a> {
    pub fn new(services: &'a HostServices, cache_dir: Option<PathBuf>) -> Self {
        Host {
            services,
            cache_dir,
        }
    }

    /// The host's cache folder, where a plugin keeps what outlives a node (downloads, compiled
    /// kernels) in a subfolder named for it; `None` when the host keeps no cache (a host before
    /// ABI 1.2, or a one-off call).
    pub fn cache_dir(&self) -> Option<&Path> {
        self.cache_dir.as_deref()
    }

    pub fn log(&self, level: LogLevel, message: &str) {
        (self.services.log)(self.services.context, level, RStr::from_str(message));
    }

    pub fn info(&self, message: &str) {
        self.log(LogLevel::Info, message);
    }

    pub fn warn(&self, message: &str) {
        self.log(LogLevel::Warn, message);
    }

    pub fn debug(&self, message: &str) {
        self.log(LogLevel::Debug, message);
    }

    /// Reports `done` of `total` units of work; the host draws it as a progress bar.
    pub fn progress(&self, done: u64, total: u64, message: &str) {
        (self.services.progress)(self.services.context, done, total, RStr::from_str(message));
    }

    /// True once the host asked the node to stop; poll it in long loops and return early.
    pub fn is_cancelled(&self) -> bool {
        (self.services.is_cancelled)(self.services.context)
    }
}
