//! The device, its streams and libraries, and timing on it: the GPU variant of the SDK's harness
//! (an L2 flush of twice the L2 before every repetition, outside the timed region; device events
//! around the call), and device memory taken through one counter so that a measurement's peak is
//! what its kernel really held at once.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use attnbench_sdk::measure::{GpuRun, Harness, Timing};
use attnbench_sdk::PluginError;
use cudarc::cublas::CudaBlas;
use cudarc::driver::sys::{CUdevice_attribute, CUevent_flags};
use cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, DeviceRepr, PushKernelArg, ValidAsZeroBits,
};
use serde_json::Value;

use crate::nvrtc::{compile_ptx, CudaSource};

/// Opens `stem` under the names cudarc tries, or says which library is missing (a stage error).
pub fn require_library(stem: &str, what: &str) -> Result<(), PluginError> {
    attnbench_sdk::libraries::require(stem, what)
        .map_err(|err| PluginError::failed(err.to_string()))
}

/// Bytes held now and at most since the last [`MemoryTracker::reset_peak`], over every [`Buffer`].
#[derive(Default)]
pub struct MemoryTracker {
    current: AtomicUsize,
    peak: AtomicUsize,
}

impl MemoryTracker {
    pub fn current(&self) -> usize {
        self.current.load(Ordering::Relaxed)
    }

    pub fn peak(&self) -> usize {
        self.peak.load(Ordering::Relaxed)
    }

    /// Starts a new peak from what is held now.
    pub fn reset_peak(&self) {
        self.peak.store(self.current(), Ordering::Relaxed);
    }

    fn take(&self, bytes: usize) {
        let now = self.current.fetch_add(bytes, Ordering::Relaxed) + bytes;
        self.peak.fetch_max(now, Ordering::Relaxed);
    }
}

/// Device memory counted by the GPU's [`MemoryTracker`] until it is dropped.
pub struct Buffer<T> {
    pub slice: CudaSlice<T>,
    bytes: usize,
    tracker: Arc<MemoryTracker>,
}

impl<T> Drop for Buffer<T> {
    fn drop(&mut self) {
        self.tracker
            .current
            .fetch_sub(self.bytes, Ordering::Relaxed);
    }
}

impl<T> Buffer<T> {
    /// The device address, for cuBLAS and kernel arguments. One stream orders every use, so the
    /// access guard can go at once.
    pub fn address(&self, stream: &Arc<CudaStream>) -> u64 {
        use cudarc::driver::DevicePtr;
        let (pointer, _guard) = self.slice.device_ptr(stream);
        pointer
    }
}

/// A driver error as a plugin error that says what was being done.
pub fn failed(what: &'static str) -> impl Fn(cudarc::driver::DriverError) -> PluginError {
    move |err| PluginError::failed(format!("{what}: {err}"))
}

/// `function`, allowed `bytes` of dynamic shared memory (more than the 48 KiB a kernel gets
/// unasked).
pub fn allow_shared(function: CudaFunction, bytes: u32) -> Result<CudaFunction, PluginError> {
    use cudarc::driver::sys::CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES as MAX_DYNAMIC_SHARED;
    function
        .set_attribute(MAX_DYNAMIC_SHARED, bytes as i32)
        .map_err(|err| {
            PluginError::failed(format!(
                "allowing a kernel {bytes} bytes of dynamic shared memory: {err}"
            ))
        })?;
    Ok(function)
}

pub struct Gpu {
    pub ctx: Arc<CudaContext>,
    pub stream: Arc<CudaStream>,
    pub blas: CudaBlas,
    pub memory: Arc<MemoryTracker>,
    flush: CudaSlice<u8>,
    /// Where compiled PTX is kept between processes: `nvrtc/` in the host's cache folder, set by
    /// each stage that gets one; without it kernels are compiled once per process.
    pub ptx_cache: Option<std::path::PathBuf>,
    /// The spin kernel [`Gpu::time`] runs before each start event, compiled on first use.
    host_lead: Option<CudaFunction>,
}

/// A one-thread kernel that spins for a number of GPU clock cycles.
pub(crate) const HOST_LEAD_SOURCE: CudaSource = CudaSource::single(
    "host_lead.cu",
    "extern \"C\" __global__ void host_lead(long long cycles) {\n    long long start = clock64();\n    while (clock64() - start < cycles) {}\n}\n",
);

/// GPU clock cycles spun between the flush and the start event (about 1 ms at 2 GHz): the host
/// enqueues the whole repetition meanwhile, so the timed region holds the kernels alone, as the
/// Python peers' harness does (`HOST_LEAD_CYCLES` in the bridge).
const HOST_LEAD_CYCLES: i64 = 2_000_000;

impl Gpu {
    pub fn open() -> Result<Gpu, PluginError> {
        require_library("libcuda", "NVIDIA driver")?;
        require_library("libcublas", "cuBLAS")?;
        require_library("libnvrtc", "NVRTC")?;
        let ctx = CudaContext::new(0).map_err(failed("cannot open GPU 0"))?;
        let stream = ctx.default_stream();
        let blas = CudaBlas::new(stream.clone())
            .map_err(|err| PluginError::failed(format!("cannot start cuBLAS: {err}")))?;
        let l2 = ctx
            .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE)
            .map_err(failed("L2 size"))? as usize;
        let flush = stream
            .alloc_zeros::<u8>((2 * l2).max(1 << 20))
            .map_err(failed("L2 flush buffer"))?;
        Ok(Gpu {
            ctx,
            stream,
            blas,
            memory: Arc::default(),
            flush,
            ptx_cache: None,
            host_lead: None,
        })
    }

    fn track<T>(
        &self,
        what: &str,
        bytes: usize,
        made: Result<CudaSlice<T>, cudarc::driver::DriverError>,
    ) -> Result<Buffer<T>, PluginError> {
        let slice = made.map_err(|err| {
            if err.0 == cudarc::driver::sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY {
                PluginError::OutOfMemory(format!(
                    "out of device memory for {what} ({:.2} GiB)",
                    bytes as f64 / (1u64 << 30) as f64
                ))
            } else {
                PluginError::failed(format!("cannot allocate {what}: {err}"))
            }
        })?;
        self.memory.take(bytes);
        Ok(Buffer {
            slice,
            bytes,
            tracker: self.memory.clone(),
        })
    }

    /// `len` zeroed elements on the device, counted by the tracker.
    pub fn alloc<T: DeviceRepr + ValidAsZeroBits>(
        &self,
        what: &str,
        len: usize,
    ) -> Result<Buffer<T>, PluginError> {
        let bytes = len * std::mem::size_of::<T>();
        self.track(what, bytes, self.stream.alloc_zeros::<T>(len))
    }

    /// A device copy of `data`, counted by the tracker.
    pub fn upload<T: DeviceRepr>(&self, what: &str, data: &[T]) -> Result<Buffer<T>, PluginError> {
        self.track(
            what,
            std::mem::size_of_val(data),
            self.stream.clone_htod(data),
        )
    }

    /// CUDA C compiled by NVRTC for this device and loaded; the PTX is cached on disk in
    /// [`Gpu::ptx_cache`] (`<key>.ptx`, key: every text of the source, architecture, NVRTC
    /// version).
    pub fn compile(
        &self,
        what: &'static str,
        source: &CudaSource,
    ) -> Result<Arc<cudarc::driver::CudaModule>, PluginError> {
        let (major, minor) = self.ctx.compute_capability().map_err(failed(what))?;
        // Hopper's own instructions (wgmma) need the architecture-specific target.
        let arch: &'static str = match (major, minor) {
            (9, 0) => "sm_90a",
            _ => Box::leak(format!("sm_{major}{minor}").into_boxed_str()),
        };
        let mut key = blake3::Hasher::new();
        let version = nvrtc_version();
        let mut hash = |text: &str| {
            // Lengths first, so that no two splits of the same bytes hash alike.
            key.update(&(text.len() as u64).to_le_bytes());
            key.update(text.as_bytes());
        };
        source.texts().for_each(&mut hash);
        [arch, version.as_str()].into_iter().for_each(hash);
        let key = key.finalize().to_hex();
        let path = self
            .ptx_cache
            .as_ref()
            .map(|dir| dir.join(format!("{key}.ptx")));
        let cached = path.as_ref().and_then(|p| std::fs::read_to_string(p).ok());
        let ptx = match cached {
            Some(text) => text,
            None => {
                let ptx = compile_ptx(source, arch).map_err(|err| {
                    PluginError::failed(format!("NVRTC could not compile {what} for {arch}: {err}"))
                })?;
                if let Some((path, dir)) = path.as_ref().and_then(|p| Some((p, p.parent()?))) {
                    // A cache that cannot be written only costs a compile next time.
                    let _ = std::fs::create_dir_all(dir).and_then(|_| {
                        let partial = path.with_extension("partial");
                        std::fs::write(&partial, &ptx).and_then(|_| std::fs::rename(&partial, path))
                    });
                }
                ptx
            }
        };
        let ptx = cudarc::nvrtc::Ptx::from_src(ptx);
        self.ctx.load_module(ptx).map_err(failed(what))
    }

    /// A host copy of a device buffer.
    pub fn download<T: DeviceRepr + Default + Clone>(
        &self,
        buffer: &Buffer<T>,
    ) -> Result<Vec<T>, PluginError> {
        self.stream
            .clone_dtoh(&buffer.slice)
            .map_err(failed("download"))
    }

    pub fn l2_bytes(&self) -> usize {
        self.flush.len() / 2
    }

    /// Shared memory a block may opt in to, and an SM's whole, in bytes (0 where the driver
    /// does not say).
    pub fn shared_memory(&self) -> (u64, u64) {
        let attribute = |a| self.ctx.attribute(a).map_or(0, |v| v.max(0) as u64);
        (
            attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN),
            attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR),
        )
    }

    /// Bytes free on the device now. Freed buffers go back to the stream-ordered allocator's
    /// pool first; the pool is trimmed so that an earlier node's memory counts as free.
    pub fn free_bytes(&self) -> Result<usize, PluginError> {
        self.stream.synchronize().map_err(failed("synchronize"))?;
        let mut pool = std::ptr::null_mut();
        // SAFETY: the pool handle is written by the driver for this context's device and only
        // used to release cached memory.
        unsafe {
            use cudarc::driver::sys;
            if sys::cuDeviceGetDefaultMemPool(&mut pool, self.ctx.cu_device())
                == sys::CUresult::CUDA_SUCCESS
            {
                sys::cuMemPoolTrimTo(pool, 0);
            }
        }
        self.ctx
            .mem_get_info()
            .map(|(free, _)| free)
            .map_err(failed("memory info"))
    }

    /// Times `work` with the harness: before each repetition the L2 is flushed and the GPU spins
    /// for about a millisecond (both outside the timed region), so that device events bracket the
    /// kernels and not the host's launch work.
    pub fn time(
        &mut self,
        harness: &Harness,
        mut work: impl FnMut(&mut Gpu) -> Result<(), PluginError>,
    ) -> Result<Timing, PluginError> {
        let events = |ctx: &Arc<CudaContext>| ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT));
        let start = events(&self.ctx).map_err(failed("event"))?;
        let end = events(&self.ctx).map_err(failed("event"))?;
        let lead = match self.host_lead.clone() {
            Some(function) => function,
            None => {
                let module = self.compile("the timing spin kernel", &HOST_LEAD_SOURCE)?;
                let function = module
                    .load_function("host_lead")
                    .map_err(failed("the timing spin kernel"))?;
                self.host_lead = Some(function.clone());
                function
            }
        };
        let one_thread = cudarc::driver::LaunchConfig {
            grid_dim: (1, 1, 1),
            block_dim: (1, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut failure: Option<PluginError> = None;
        let timing = harness.time_with(|| {
            if failure.is_some() {
                return 0.0;
            }
            let rep = (|| -> Result<f64, PluginError> {
                let failed = failed("timing");
                self.stream.memset_zeros(&mut self.flush).map_err(&failed)?;
                let mut spin = self.stream.launch_builder(&lead);
                spin.arg(&HOST_LEAD_CYCLES);
                // SAFETY: the kernel takes one i64 and touches no memory.
                unsafe { spin.launch(one_thread) }.map_err(&failed)?;
                start.record(&self.stream).map_err(&failed)?;
                work(self)?;
                end.record(&self.stream).map_err(&failed)?;
                end.synchronize().map_err(&failed)?;
                Ok(start.elapsed_ms(&end).map_err(&failed)? as f64 / 1e3)
            })();
            rep.unwrap_or_else(|err| {
                failure = Some(err);
                0.0
            })
        });
        match failure {
            Some(err) => Err(err),
            None => Ok(timing),
        }
    }

    /// The device as a measurement records it (clocks are sampled around the timing).
    pub fn describe(&self) -> GpuRun {
        let attribute = |a| self.ctx.attribute(a).unwrap_or(-1);
        let (major, minor) = self.ctx.compute_capability().unwrap_or((0, 0));
        GpuRun {
            name: self.ctx.name().unwrap_or_default(),
            compute_capability: format!("{major}.{minor}"),
            memory_bytes: self.ctx.total_mem().ok().map(|bytes| bytes as u64),
            multiprocessors: Some(attribute(
                CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
            ) as i64),
            l2_bytes: Some(self.l2_bytes() as u64),
            driver_version: Some(driver_version().to_string()),
            libraries: loaded_libraries(),
            clocks_before: Value::Null,
            clocks_after: Value::Null,
        }
    }
}

/// The CUDA library files this process has actually mapped (from `/proc/self/maps`): what a
/// measurement really ran with, whatever the search paths said.
pub fn loaded_libraries() -> Vec<String> {
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap_or_default();
    let mut files: Vec<String> = maps
        .lines()
        .filter_map(|line| line.split_whitespace().nth(5))
        .filter(|path| {
            [
                "libcuda.",
                "libcublas",
                "libnvrtc",
                "libcudnn",
                "libnccl",
                "libnvidia-ml",
            ]
            .iter()
            .any(|name| path.contains(name))
        })
        .map(String::from)
        .collect();
    files.sort();
    files.dedup();
    files
}

/// The driver's CUDA version, e.g. 13000 for 13.0.
pub fn driver_version() -> i32 {
    let mut version = 0;
    // SAFETY: writes one integer; the driver library is loaded (checked in `Gpu::open`).
    unsafe { cudarc::driver::sys::cuDriverGetVersion(&mut version) };
    version
}

/// NVRTC's version as `major.minor` (part of the compiled-kernel cache key).
pub fn nvrtc_version() -> String {
    let (mut major, mut minor) = (0, 0);
    // SAFETY: writes two integers; NVRTC is loaded (checked in `Gpu::open`).
    unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut major, &mut minor) };
    format!("{major}.{minor}")
}
