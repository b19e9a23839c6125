//! The host side of [`HostServices`]: one generic bridge from the C callbacks to whatever receives
//! a node's logs and progress (the scheduler in the host, the protocol pipe in a worker).

use std::ffi::c_void;

use attnbench_abi::abi_stable::std_types::RStr;
use attnbench_abi::{HostServices, LogLevel};

/// Receives what a running plugin reports.
pub trait ServiceSink {
    fn log(&self, level: LogLevel, message: &str);
    fn progress(&self, done: u64, total: u64, message: &str);
    fn is_cancelled(&self) -> bool;
}

/// Host services that forward to `sink`; valid for as long as `sink` is borrowed.
pub fn services_for<S: ServiceSink>(sink: &S) -> HostServices {
    HostServices {
        context: sink as *const S as *const c_void,
        log: log_callback::<S>,
        progress: progress_callback::<S>,
        is_cancelled: cancelled_callback::<S>,
    }
}

// SAFETY (all three): `context` is the `&S` given to `services_for`, which outlives the `run`
// call that the services were lent to.
extern "C" fn log_callback<S: ServiceSink>(
    context: *const c_void,
    level: LogLevel,
    message: RStr<'_>,
) {
    let sink = unsafe { &*(context as *const S) };
    sink.log(level, message.as_str());
}

extern "C" fn progress_callback<S: ServiceSink>(
    context: *const c_void,
    done: u64,
    total: u64,
    message: RStr<'_>,
) {
    let sink = unsafe { &*(context as *const S) };
    sink.progress(done, total, message.as_str());
}

extern "C" fn cancelled_callback<S: ServiceSink>(context: *const c_void) -> bool {
    let sink = unsafe { &*(context as *const S) };
    sink.is_cancelled()
}

/// Forwards a plugin's log line into the host's `tracing`.
pub fn trace_plugin_log(plugin: &str, node: &str, level: LogLevel, message: &str) {
    match level {
        LogLevel::Error => tracing::error!(target: "plugin", plugin, node, "{message}"),
        LogLevel::Warn => tracing::warn!(target: "plugin", plugin, node, "{message}"),
        LogLevel::Info => tracing::info!(target: "plugin", plugin, node, "{message}"),
        LogLevel::Debug => tracing::debug!(target: "plugin", plugin, node, "{message}"),
        LogLevel::Trace => tracing::trace!(target: "plugin", plugin, node, "{message}"),
    }
}

/// A sink that drops everything: for calls whose logs nobody reads (checks, probes).
pub struct Silent;

impl ServiceSink for Silent {
    fn log(&self, _: LogLevel, _: &str) {}
    fn progress(&self, _: u64, _: u64, _: &str) {}
    fn is_cancelled(&self) -> bool {
        false
    }
}
