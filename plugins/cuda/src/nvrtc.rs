//! CUDA C to PTX with NVRTC, headers included by name. The plugin is one shared library, so its
//! kernels' headers travel inside it (`include_str!`) and reach NVRTC as named in-memory headers
//! rather than as files on an include path.

use std::ffi::{c_char, CString};

use cudarc::nvrtc::{result, sys};

/// One translation unit: its main file and every header it includes, by include name.
pub struct CudaSource {
    /// The main file's name, as NVRTC's messages cite it.
    pub name: &'static str,
    pub text: &'static str,
    /// (include name, text), as `#include "NAME"` writes them.
    pub headers: &'static [(&'static str, &'static str)],
}

impl CudaSource {
    /// A file that includes nothing of the plugin's.
    pub const fn single(name: &'static str, text: &'static str) -> CudaSource {
        CudaSource {
            name,
            text,
            headers: &[],
        }
    }

    /// Every text NVRTC reads, in a fixed order: what a compiled form's cache key covers.
    pub fn texts(&self) -> impl Iterator<Item = &'static str> + '_ {
        std::iter::once(self.name)
            .chain(std::iter::once(self.text))
            .chain(self.headers.iter().flat_map(|(name, text)| [*name, *text]))
    }
}

/// The PTX of `source` for `arch` (`sm_90a`, `sm_80`, …), or NVRTC's error and log.
pub fn compile_ptx(source: &CudaSource, arch: &str) -> Result<String, String> {
    let c_string =
        |text: &str| CString::new(text).map_err(|_| format!("{} holds a NUL byte", source.name));
    let text = c_string(source.text)?;
    let name = c_string(source.name)?;
    let header_texts = source
        .headers
        .iter()
        .map(|(_, text)| c_string(text))
        .collect::<Result<Vec<_>, _>>()?;
    let header_names = source
        .headers
        .iter()
        .map(|(name, _)| c_string(name))
        .collect::<Result<Vec<_>, _>>()?;
    let texts: Vec<*const c_char> = header_texts.iter().map(|t| t.as_ptr()).collect();
    let names: Vec<*const c_char> = header_names.iter().map(|n| n.as_ptr()).collect();
    let mut program: sys::nvrtcProgram = std::ptr::null_mut();
    // SAFETY: every pointer refers to a CString that outlives the program (destroyed below), and
    // the two header arrays hold `headers.len()` entries each.
    unsafe {
        sys::nvrtcCreateProgram(
            &mut program,
            text.as_ptr(),
            name.as_ptr(),
            texts.len() as i32,
            texts.as_ptr(),
            names.as_ptr(),
        )
        .result()
        .map_err(|err| format!("NVRTC could not create the program: {err}"))?;
    }
    let options = [format!("--gpu-architecture={arch}")];
    // SAFETY: `program` was created above and is destroyed once, at the end.
    let outcome = unsafe {
        match result::compile_program(program, &options) {
            Ok(()) => result::get_ptx(program)
                .map(|ptx| text_of(&ptx))
                .map_err(|err| format!("NVRTC gave no PTX: {err}")),
            Err(err) => {
                let log = result::get_program_log(program)
                    .map(|log| text_of(&log))
                    .unwrap_or_default();
                Err(format!("{err}\n{log}"))
            }
        }
    };
    // SAFETY: created above, not destroyed before.
    let _ = unsafe { result::destroy_program(program) };
    outcome
}

/// A NUL-terminated buffer NVRTC filled, as text.
fn text_of(buffer: &[c_char]) -> String {
    let bytes: Vec<u8> = buffer
        .iter()
        .take_while(|&&c| c != 0)
        .map(|&c| c as u8)
        .collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

#[cfg(test)]
mod tests {
    use crate::flash::SOURCE;

    /// The include names a text asks for with `#include "NAME"`.
    fn includes(text: &str) -> Vec<&str> {
        text.lines()
            .filter_map(|line| line.trim().strip_prefix("#include \""))
            .filter_map(|rest| rest.split('"').next())
            .collect()
    }

    #[test]
    fn the_flash_kernel_carries_every_header_it_includes_and_no_other() {
        let mut wanted: Vec<&str> = includes(SOURCE.text);
        for (_, text) in SOURCE.headers {
            wanted.extend(includes(text));
        }
        wanted.sort_unstable();
        wanted.dedup();
        let mut carried: Vec<&str> = SOURCE.headers.iter().map(|(name, _)| *name).collect();
        carried.sort_unstable();
        assert_eq!(wanted, carried);
    }

    /// The architectures the plugin may compile for: Ampere, Ada, Hopper (with its own
    /// instructions), Blackwell.
    const ARCHITECTURES: [&str; 6] = ["sm_80", "sm_86", "sm_89", "sm_90a", "sm_100", "sm_120"];

    /// Every kernel source of the plugin compiles for every architecture, and the flash module
    /// has every kernel the plugin looks up. CI runs it with the nvidia-cuda-nvrtc wheel's
    /// library. With `ATTNBENCH_PTX_OUT=DIR`, the PTX is kept as DIR/NAME.ARCH.ptx, to compare
    /// with `scripts/nvrtc-check.py --ptx-dir`'s (the same compiler on the files themselves).
    #[test]
    #[ignore = "needs libnvrtc on the library path (a CUDA toolkit or the nvidia-cuda-nvrtc wheel)"]
    fn nvrtc_compiles_every_kernel_source_for_every_architecture() {
        let sources = [
            &SOURCE,
            &crate::decode::SOURCE,
            &crate::naive::SOURCE,
            &crate::gpu::HOST_LEAD_SOURCE,
        ];
        let out = std::env::var_os("ATTNBENCH_PTX_OUT");
        let compile_all = |arch: &str| {
            for source in sources {
                let ptx = super::compile_ptx(source, arch)
                    .unwrap_or_else(|err| panic!("{} for {arch}: {err}", source.name));
                assert!(
                    ptx.contains(".entry "),
                    "{} for {arch}: no kernel",
                    source.name
                );
                if let Some(dir) = &out {
                    let name = format!("{}.{arch}.ptx", source.name.trim_end_matches(".cu"));
                    std::fs::write(std::path::Path::new(dir).join(name), &ptx).unwrap();
                }
                if source.name == SOURCE.name {
                    for name in flash_kernels(arch == "sm_90a") {
                        assert!(
                            ptx.contains(&format!(".entry {name}(")),
                            "{arch}: no {name}"
                        );
                    }
                }
            }
        };
        // An architecture a thread: NVRTC compiles each program on its own.
        std::thread::scope(|scope| {
            for arch in ARCHITECTURES {
                scope.spawn(move || compile_all(arch));
            }
        });
    }

    /// The flash kernels the plugin looks up (`flash/functions.rs`), the wgmma ones on sm_90a.
    fn flash_kernels(hopper: bool) -> Vec<String> {
        let mut names = Vec::new();
        for element in ["bf16", "f16"] {
            for head in crate::flash::HEAD_DIMS {
                let d = head.suffix();
                for kind in [
                    "forward",
                    "forward_narrow",
                    "delta",
                    "backward_dq",
                    "backward_dkdv",
                    "backward_fused",
                ] {
                    names.push(format!("flash_{kind}_{element}_{d}"));
                }
            }
            if hopper {
                for kind in [
                    "forward_tma",
                    "forward_narrow_tma",
                    "backward_dq_hopper",
                    "backward_dq_tma",
                    "backward_dkdv_hopper",
                    "backward_dkdv_tma",
                    "backward_fused_tma",
                ] {
                    names.push(format!("flash_{kind}_{element}_d128"));
                }
            }
        }
        names
    }

    #[test]
    fn the_flash_kernel_includes_its_headers_in_the_order_it_carries_them() {
        let carried: Vec<&str> = SOURCE.headers.iter().map(|(name, _)| *name).collect();
        assert_eq!(includes(SOURCE.text), carried);
    }
}
