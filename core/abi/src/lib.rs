//! The FFI-stable interface between the attnbench host and its plugins.
//!
//! Kept deliberately tiny: JSON strings cross the boundary, so the interface itself rarely needs
//! to change. abi_stable checks the layout of everything here when a library is loaded, and it
//! refuses a library whose root module has fewer fields than the host's: a new entry point would
//! lock out every plugin built before it. So a minor version changes what travels in the JSON
//! (ABI 1.2: typed failures), and anything else is a new major, which a host refuses.

use std::ffi::c_void;

pub use abi_stable;
use abi_stable::{
    declare_root_module_statics,
    library::RootModule,
    sabi_types::VersionStrings,
    std_types::{RResult, RSlice, RStr, RString},
    StableAbi,
};

/// The symbol under which a plugin library exports its [`abi_stable::library::LibHeader`]. It is
/// abi_stable's own name; spelled out so that plugins need not depend on abi_stable's proc macros.
pub const ROOT_MODULE_SYMBOL: &str = "_1as_0lib_1header_0root_bmodule_bloader";

/// The ABI version this crate describes, as `major.minor.patch`.
#[cfg(not(any(feature = "foreign-abi-major", feature = "abi-1-1")))]
pub const ABI_VERSION: &str = env!("CARGO_PKG_VERSION");
#[cfg(feature = "foreign-abi-major")]
pub const ABI_VERSION: &str = "2.0.0";
/// A plugin as built before ABI 1.2 (no typed failures), for the host's compatibility tests.
#[cfg(all(feature = "abi-1-1", not(feature = "foreign-abi-major")))]
pub const ABI_VERSION: &str = "1.1.0";

/// The version abi_stable compares when a library is loaded. abi_stable accepts a library whose
/// minor is at least the loader's; attnbench hosts also load plugins of older minors (their
/// missing entry points read as absent), so libraries declare minor 0 of their major since
/// ABI 1.2, and plugins built before it, which declared their own minor, still pass. The full
/// version a plugin was built for is its manifest's `abi`.
#[cfg(not(any(feature = "foreign-abi-major", feature = "abi-1-1")))]
const LOADED_VERSION: &str = "1.0.0";
#[cfg(feature = "foreign-abi-major")]
const LOADED_VERSION: &str = "2.0.0";
#[cfg(all(feature = "abi-1-1", not(feature = "foreign-abi-major")))]
const LOADED_VERSION: &str = "1.1.0";

/// Severity of a message a plugin sends to the host's log.
#[repr(u8)]
#[derive(StableAbi, Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogLevel {
    Error,
    Warn,
    Info,
    Debug,
    Trace,
}

impl LogLevel {
    pub fn as_str(self) -> &'static str {
        match self {
            LogLevel::Error => "error",
            LogLevel::Warn => "warn",
            LogLevel::Info => "info",
            LogLevel::Debug => "debug",
            LogLevel::Trace => "trace",
        }
    }

    pub fn parse(text: &str) -> Option<Self> {
        Some(match text {
            "error" => LogLevel::Error,
            "warn" => LogLevel::Warn,
            "info" => LogLevel::Info,
            "debug" => LogLevel::Debug,
            "trace" => LogLevel::Trace,
            _ => return None,
        })
    }
}

/// Services the host lends a plugin for the duration of one `run` call.
///
/// `context` is opaque to the plugin and only handed back to the callbacks; it is valid until `run`
/// returns and must not be kept.
#[repr(C)]
#[derive(StableAbi)]
pub struct HostServices {
    pub context: *const c_void,
    /// A log line, recorded in the node's log file and forwarded to the host's `tracing`.
    pub log: extern "C" fn(context: *const c_void, level: LogLevel, message: RStr<'_>),
    /// Progress of the current node: `done` of `total` units (total 0 = unknown).
    pub progress: extern "C" fn(context: *const c_void, done: u64, total: u64, message: RStr<'_>),
    /// True once the host wants the node to stop (timeout, interrupt); long loops should poll it.
    pub is_cancelled: extern "C" fn(context: *const c_void) -> bool,
}

/// Where the tensors of an [`AttentionCall`] live.
#[repr(u8)]
#[derive(StableAbi, Debug, Clone, Copy, PartialEq, Eq)]
pub enum Memory {
    Host,
    /// CUDA device memory of the calling thread's current context; work goes on `stream`.
    Cuda,
}

/// Element types of an [`AttentionCall`]'s tensors.
#[repr(u8)]
#[derive(StableAbi, Debug, Clone, Copy, PartialEq, Eq)]
pub enum DType {
    F64,
    F32,
    Bf16,
    F16,
}

/// One block of attention for the in-process backend a kernel plugin may offer: a
/// context-parallel plugin calls it for each (query chunk, key chunk) step of its algorithm.
///
/// Tensors are head-major, `[heads][tokens][head_dim]`; LSE is `[heads_q][q_len]`, natural log,
/// −∞ for a row with no allowed key (whose O is 0). Local query head `h` reads local KV head
/// `kv_head_of[h]`. The mask comes per row of the block, in the block's own coordinates: row
/// `r` may see keys `[intervals[2i], intervals[2i+1])` for `i` in `row_start[r]..row_start[r+1]`
/// (sorted, disjoint) — the exact restriction of any mask to any rows × keys. Masks and the head
/// map are always in host memory.
#[repr(C)]
#[derive(StableAbi)]
pub struct AttentionCall<'a> {
    pub memory: Memory,
    /// Element type of Q, K, V and dO.
    pub input: DType,
    /// Element type of O, LSE, dQ, dK and dV.
    pub output: DType,
    pub backward: bool,
    pub heads_q: u32,
    pub heads_kv: u32,
    pub head_dim: u32,
    pub q_len: u64,
    pub k_len: u64,
    pub scale: f64,
    pub kv_head_of: RSlice<'a, u32>,
    pub row_start: RSlice<'a, u32>,
    pub intervals: RSlice<'a, u32>,
    pub q: *const c_void,
    pub k: *const c_void,
    pub v: *const c_void,
    /// Forward: written with this block's O and LSE. Backward: read, the rows' final O and LSE
    /// over all their keys.
    pub out: *mut c_void,
    pub lse: *mut c_void,
    /// Backward only (null in a forward call): dO is read; this block's share of dQ and its
    /// keys' dK and dV are written (overwritten, not accumulated).
    pub d_out: *const c_void,
    pub dq: *mut c_void,
    pub dk: *mut c_void,
    pub dv: *mut c_void,
    /// A `CUstream` for [`Memory::Cuda`]; null on the host.
    pub stream: *mut c_void,
}

/// The root module every attnbench plugin library exports.
#[repr(C)]
#[derive(StableAbi)]
#[sabi(kind(Prefix(prefix_ref = PluginModRef)))]
#[sabi(missing_field(panic))]
pub struct PluginMod {
    /// The plugin's manifest as a JSON document (see `attnbench_sdk::PluginManifest`).
    pub manifest: extern "C" fn() -> RString,
    /// Runs one node of `stage`. `request` is a JSON `StageRequest`; the result is the node's
    /// result JSON, or its failure: since ABI 1.2 a JSON object `{"failure": KIND, "message":
    /// TEXT}` (`attnbench_sdk::StageFailure`), before it the message alone.
    #[sabi(last_prefix_field)]
    pub run: extern "C" fn(
        stage: RStr<'_>,
        request: RStr<'_>,
        host: &HostServices,
    ) -> RResult<RString, RString>,
    /// Runs one [`AttentionCall`] with kernel `kernel` of the plugin's in-process attention
    /// backend (the manifest's `attention` lists the kernels offered); an error message for what
    /// it cannot run. Missing in plugins built before ABI 1.1.
    #[sabi(missing_field(option))]
    pub attention:
        extern "C" fn(kernel: RStr<'_>, call: &AttentionCall<'_>) -> RResult<(), RString>,
}

impl RootModule for PluginModRef {
    declare_root_module_statics! {PluginModRef}
    const BASE_NAME: &'static str = "attnbench_plugin";
    const NAME: &'static str = "attnbench_plugin";
    const VERSION_STRINGS: VersionStrings = VersionStrings::new(LOADED_VERSION);
}

/// The major part of [`ABI_VERSION`].
pub fn abi_major() -> u32 {
    ABI_VERSION
        .split('.')
        .next()
        .and_then(|major| major.parse().ok())
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn root_module_symbol_is_abi_stables_own() {
        assert_eq!(
            ROOT_MODULE_SYMBOL,
            abi_stable::library::ROOT_MODULE_LOADER_NAME
        );
    }

    #[test]
    fn abi_major_is_parsed_from_the_version() {
        assert_eq!(abi_major(), 1);
    }

    #[test]
    fn libraries_declare_minor_zero_of_the_abi_major() {
        assert_eq!(LOADED_VERSION.split('.').next(), Some("1"));
        assert!(LOADED_VERSION.ends_with(".0.0"));
    }

    #[test]
    fn log_levels_round_trip() {
        for level in [
            LogLevel::Error,
            LogLevel::Warn,
            LogLevel::Info,
            LogLevel::Debug,
            LogLevel::Trace,
        ] {
            assert_eq!(LogLevel::parse(level.as_str()), Some(level));
        }
    }
}
