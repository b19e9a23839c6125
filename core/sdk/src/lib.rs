//! What attnbench plugin authors use.
//!
//! A plugin is a `cdylib` crate that depends on this crate alone. It implements [`Plugin`] and
//! exports it with [`export_plugin!`]:
//!
//! ```ignore
//! struct Mine;
//! impl attnbench_sdk::Plugin for Mine {
//!     fn manifest() -> attnbench_sdk::PluginManifest { /* name, version, stages */ }
//!     fn run(stage: &str, request: attnbench_sdk::StageRequest, host: &attnbench_sdk::Host)
//!         -> Result<serde_json::Value, attnbench_sdk::PluginError> { /* ... */ }
//! }
//! attnbench_sdk::export_plugin!(Mine);
//! ```
//!
//! Every entry point the macro exports catches panics, so a bug in a plugin becomes an error
//! result for one node instead of undefined behaviour across the FFI boundary.

// The name `named_enum!`'s serde derives use, inside this crate too.
extern crate self as attnbench_sdk;

mod artifact;
pub mod attention;
pub mod bench;
pub mod decode;
pub mod environment;
mod error;
mod export;
mod failure;
pub mod histogram;
mod host;
pub mod libraries;
mod manifest;
pub mod mask;
pub mod measure;
mod names;
pub mod nvml;
mod record;
pub mod reference;
mod request;
pub mod rng;
pub mod shapes;
mod size;
mod suggest;

pub use artifact::{file_name_part, write_atomically, write_json};
pub use attnbench_abi as abi;
pub use error::PluginError;
pub use export::Plugin;
pub use failure::{types_failures, FailureKind, StageFailure};
pub use host::Host;
pub use manifest::{
    kinds, CacheScope, Isolation, ManifestError, ParamIs, ParamSpec, ParamType, ParamsError,
    PluginManifest, StageSpec, ValueError, KERNEL_PARAMS,
};
pub use request::{InputArtifact, StageRequest};
/// Re-exported so that a plugin can depend on this crate alone; derive with
/// `#[serde(crate = "attnbench_sdk::serde")]`.
pub use serde;
pub use serde_json;
pub use size::{format_size, parse_size, SizeError};
pub use suggest::{nearest, suggestion};

#[doc(hidden)]
pub mod __private {
    pub use crate::export::{call_root_module_loader, root_module};
    pub use attnbench_abi::abi_stable::library::{CheckTypeLayout, LibHeader, RootModuleResult};
    pub use attnbench_abi::PluginModRef;
}
