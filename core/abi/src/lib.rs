//! The FFI-stable interface between the attnbench host and its plugins.
//!
//! Kept deliberately tiny: JSON strings cross the boundary, so the interface itself rarely needs
//! to change. abi_stable checks the layout of everything here when a plugin is loaded. New entry
//! points are added after the last prefix field of [`PluginMod`] (a minor version bump); anything
//! else is a new major, and a host refuses plugins of another major.

use std::ffi::c_void;

pub use abi_stable;
use abi_stable::{
    declare_root_module_statics,
    library::RootModule,
    sabi_types::VersionStrings,
    std_types::{RResult, RStr, RString},
    StableAbi,
};

/// The symbol under which a plugin library exports its [`abi_stable::library::LibHeader`]. It is
/// abi_stable's own name; spelled out so that plugins need not depend on abi_stable's proc macros.
pub const ROOT_MODULE_SYMBOL: &str = "_1as_0lib_1header_0root_bmodule_bloader";

/// The ABI version this crate describes, as `major.minor.patch`.
#[cfg(not(feature = "foreign-abi-major"))]
pub const ABI_VERSION: &str = env!("CARGO_PKG_VERSION");
#[cfg(feature = "foreign-abi-major")]
pub const ABI_VERSION: &str = "2.0.0";

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

/// The root module every attnbench plugin library exports.
#[repr(C)]
#[derive(StableAbi)]
#[sabi(kind(Prefix(prefix_ref = PluginModRef)))]
#[sabi(missing_field(panic))]
pub struct PluginMod {
    /// The plugin's manifest as a JSON document (see `attnbench_sdk::PluginManifest`).
    pub manifest: extern "C" fn() -> RString,
    /// Runs one node of `stage`. `request` is a JSON `StageRequest`; the result is the node's
    /// result JSON, or an error message.
    #[sabi(last_prefix_field)]
    pub run: extern "C" fn(
        stage: RStr<'_>,
        request: RStr<'_>,
        host: &HostServices,
    ) -> RResult<RString, RString>,
}

impl RootModule for PluginModRef {
    declare_root_module_statics! {PluginModRef}
    const BASE_NAME: &'static str = "attnbench_plugin";
    const NAME: &'static str = "attnbench_plugin";
    const VERSION_STRINGS: VersionStrings = VersionStrings::new(ABI_VERSION);
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
