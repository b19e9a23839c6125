use std::panic::{catch_unwind, AssertUnwindSafe};

use attnbench_abi::abi_stable::library::RootModuleResult;
use attnbench_abi::abi_stable::prefix_type::PrefixTypeTrait;
use attnbench_abi::abi_stable::std_types::{RErr, ROk, RResult, RStr, RString};
use attnbench_abi::{AttentionCall, HostServices, PluginMod, PluginModRef};
use serde_json::Value;

use crate::{FailureKind, Host, PluginError, PluginManifest, StageFailure, StageRequest};

/// A plugin: a manifest and a `run` for each of its stages. Export it with [`crate::export_plugin!`].
pub trait Plugin {
    fn manifest() -> PluginManifest;
    fn run(stage: &str, request: StageRequest, host: &Host) -> Result<Value, PluginError>;

    /// Runs one block with `kernel` of the in-process attention backend (the kernels the
    /// manifest lists with [`PluginManifest::attention_kernel`]); see [`crate::attention`].
    fn attention(
        kernel: &str,
        call: &AttentionCall<'_>,
    ) -> Result<(), crate::attention::AttentionError> {
        let _ = call;
        Err(crate::attention::AttentionError::UnknownKernel {
            kernel: kernel.to_string(),
            offered: "this plugin offers none".into(),
        })
    }
}

/// Exports a type implementing [`Plugin`] as the library's attnbench root module.
#[macro_export]
macro_rules! export_plugin {
    ($plugin:ty) => {
        // The symbol name is abi_stable's root-module symbol (`attnbench_abi::ROOT_MODULE_SYMBOL`).
        #[doc(hidden)]
        #[export_name = "_1as_0lib_1header_0root_bmodule_bloader"]
        pub static ATTNBENCH_PLUGIN_HEADER: $crate::__private::LibHeader = {
            extern "C" fn construct() -> $crate::__private::RootModuleResult {
                $crate::__private::call_root_module_loader(
                    $crate::__private::root_module::<$plugin>,
                )
            }
            // SAFETY: `construct` returns the `PluginModRef` declared as the module type.
            unsafe {
                $crate::__private::LibHeader::from_constructor::<$crate::__private::PluginModRef>(
                    construct,
                    $crate::__private::CheckTypeLayout::Yes,
                )
            }
        };
    };
}

#[doc(hidden)]
pub fn call_root_module_loader(loader: fn() -> PluginModRef) -> RootModuleResult {
    attnbench_abi::abi_stable::library::__call_root_module_loader(loader)
}

#[doc(hidden)]
pub fn root_module<P: Plugin>() -> PluginModRef {
    PluginMod {
        manifest: manifest_entry::<P>,
        run: run_entry::<P>,
        attention: attention_entry::<P>,
    }
    .leak_into_prefix()
}

extern "C" fn attention_entry<P: Plugin>(
    kernel: RStr<'_>,
    call: &AttentionCall<'_>,
) -> RResult<(), RString> {
    capture_panics();
    match catch_unwind(AssertUnwindSafe(|| P::attention(kernel.as_str(), call))) {
        Ok(Ok(())) => ROk(()),
        Ok(Err(error)) => RErr(error.to_string().into()),
        Err(panic) => RErr(format!("attention panicked: {}", panic_message(&*panic)).into()),
    }
}

extern "C" fn manifest_entry<P: Plugin>() -> RString {
    let manifest = catch_unwind(|| {
        let mut manifest = P::manifest();
        manifest.abi = attnbench_abi::ABI_VERSION.to_string();
        serde_json::to_string(&manifest).map_err(|err| err.to_string())
    });
    match manifest {
        Ok(Ok(json)) => json.into(),
        Ok(Err(err)) => serde_json::json!({ "manifest_error": err }).to_string().into(),
        Err(panic) => serde_json::json!({ "manifest_error": format!("manifest() panicked: {}", panic_message(&*panic)) })
            .to_string()
            .into(),
    }
}

extern "C" fn run_entry<P: Plugin>(
    stage: RStr<'_>,
    request: RStr<'_>,
    host: &HostServices,
) -> RResult<RString, RString> {
    match run_stage::<P>(stage, request, host) {
        Ok(result) => ROk(result.into()),
        Err(failure) => RErr(wire(&failure).into()),
    }
}

/// A failure as this ABI sends it: typed since 1.2; the message alone when the SDK is built as
/// ABI 1.1 for the host's compatibility tests.
fn wire(failure: &StageFailure) -> String {
    if cfg!(feature = "abi-1-1") {
        failure.message.clone()
    } else {
        failure.to_wire()
    }
}

fn run_stage<P: Plugin>(
    stage: RStr<'_>,
    request: RStr<'_>,
    host: &HostServices,
) -> Result<String, StageFailure> {
    capture_panics();
    let outcome = catch_unwind(AssertUnwindSafe(|| {
        let request: StageRequest = serde_json::from_str(request.as_str()).map_err(|err| {
            PluginError::failed(format!("the host sent a malformed request: {err}"))
        })?;
        // Parameters are checked against the plugin's own manifest, whoever sent them.
        let manifest = P::manifest();
        let spec =
            manifest
                .find_stage(stage.as_str())
                .ok_or_else(|| PluginError::UnknownStage {
                    stage: stage.as_str().to_string(),
                    known: manifest
                        .stages
                        .iter()
                        .map(|s| s.name.as_str())
                        .collect::<Vec<_>>()
                        .join(", "),
                })?;
        spec.resolve_params(&request.params)
            .map_err(|err| PluginError::Params(err.to_string()))?;
        let cache_dir = request.cache_dir.clone();
        P::run(stage.as_str(), request, &Host::new(host, cache_dir))
    }));
    match outcome {
        Ok(Ok(result)) => Ok(result.to_string()),
        Ok(Err(err)) => Err(StageFailure::new(err.kind(), err.to_string())),
        Err(panic) => {
            let described = LAST_PANIC
                .with(|last| last.borrow_mut().take())
                .unwrap_or_else(|| panic_message(&*panic));
            Err(StageFailure::new(
                FailureKind::Panicked,
                format!("plugin panicked: {described}"),
            ))
        }
    }
}

thread_local! {
    static LAST_PANIC: std::cell::RefCell<Option<String>> = const { std::cell::RefCell::new(None) };
}

/// Replaces the default panic hook of this library's copy of std: a panic becomes the node's
/// error message (with its location) instead of text on the host's terminal.
fn capture_panics() {
    static INSTALL: std::sync::Once = std::sync::Once::new();
    INSTALL.call_once(|| {
        std::panic::set_hook(Box::new(|info| {
            let location = info
                .location()
                .map(|l| format!(" (at {}:{})", l.file(), l.line()))
                .unwrap_or_default();
            let described = format!("{}{location}", panic_message(info.payload()));
            LAST_PANIC.with(|last| *last.borrow_mut() = Some(described));
        }));
    });
}

fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(text) = payload.downcast_ref::<&str>() {
        (*text).to_string()
    } else if let Some(text) = payload.downcast_ref::<String>() {
        text.clone()
    } else {
        "(a non-text panic payload)".to_string()
    }
}
