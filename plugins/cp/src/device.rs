//! A rank's tensors on its GPU: Q, K, V and dO in 16-bit (bf16 or fp16, what the kernels take),
//! O, LSE and the gradients in f32, all on one compute stream; blocks run on a kernel plugin's
//! in-process device backend (`cuda/flash`). The store's own arithmetic — gathering ranges,
//! adding, merging partial results — is `kernels/store.cu`, compiled by NVRTC.
//!
//! The [`Store`] trait has no room for errors (the host store has none): a failure here is a
//! broken GPU or an exhausted one, and unwinds with its message to the rank's boundary
//! (`gpu_rank`), which reports it as the rank's error.

use std::ops::Range;
use std::sync::Arc;

use attnbench_sdk::attention::{AttentionCall, AttentionError, Backend, DType, HostBlock, Memory};
use attnbench_sdk::libraries::MissingLibrary;
use cudarc::driver::{
    CudaContext, CudaEvent, CudaFunction, CudaSlice, CudaStream, DevicePtr, DriverError,
    LaunchConfig, PushKernelArg,
};
use cudarc::nccl::result::NcclError;

use crate::local::{Partial, Span, Store};

const SOURCE: &str = include_str!("../kernels/store.cu");

/// What a buffer holds: inputs (16-bit) or accumulated results (f32).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Input,
    Accumulator,
}

/// One tensor's values on the GPU. Clones share the buffer; the store copies before it changes
/// a shared one.
#[derive(Clone)]
pub struct DeviceValues {
    buffer: Arc<CudaSlice<u8>>,
    pub kind: Kind,
    /// Elements.
    pub len: usize,
}

impl DeviceValues {
    /// The device address of element `at`.
    pub fn address(&self, stream: &CudaStream, at: usize, element_bytes: usize) -> u64 {
        let (pointer, _) = self.buffer.device_ptr(stream);
        pointer + (at * element_bytes) as u64
    }

    pub fn buffer(&self) -> &CudaSlice<u8> {
        &self.buffer
    }

    /// The buffer, if these values are its only holder.
    pub fn buffer_mut(&mut self) -> Option<&mut CudaSlice<u8>> {
        Arc::get_mut(&mut self.buffer)
    }
}

struct Kernels {
    gather: CudaFunction,
    add: CudaFunction,
    fill: CudaFunction,
    merge: CudaFunction,
}

pub struct DeviceStore {
    pub stream: Arc<CudaStream>,
    kernels: Kernels,
    backend: Backend,
    /// bf16 or fp16.
    input: DType,
    /// Events around every block's kernels since [`DeviceStore::take_block_seconds`].
    blocks: Spans,
}

/// Pairs of timing events around work on one stream, to sum once that work is done.
#[derive(Default)]
pub struct Spans(std::sync::Mutex<Vec<(CudaEvent, CudaEvent)>>);

impl Spans {
    /// A timing event on `stream` now.
    pub fn mark(stream: &CudaStream) -> CudaEvent {
        use cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT;
        check("timing event", stream.record_event(Some(CU_EVENT_DEFAULT)))
    }

    pub fn push(&self, start: CudaEvent, end: CudaEvent) {
        self.0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push((start, end));
    }

    /// Seconds between the events of every pair so far (waiting for them), and forgets them.
    pub fn take_seconds(&self) -> f64 {
        let pairs = std::mem::take(&mut *self.0.lock().unwrap_or_else(|e| e.into_inner()));
        pairs
            .iter()
            .map(|(start, end)| check("timing", start.elapsed_ms(end)) as f64 * 1e-3)
            .sum()
    }
}

/// Why a GPU rank's step failed, named by what it was doing.
#[derive(Debug, thiserror::Error)]
pub enum GpuError {
    #[error(transparent)]
    Library(#[from] MissingLibrary),
    #[error("{what}: {error}")]
    Driver { what: String, error: DriverError },
    #[error("NVRTC could not compile the store's kernels: {0}")]
    Compile(cudarc::nvrtc::CompileError),
    #[error("NCCL {what}: {error:?}")]
    Nccl { what: String, error: NcclError },
    #[error("the group's first member sent an NCCL id of {0} bytes, not 128")]
    NcclId(usize),
}

impl GpuError {
    /// A driver error while doing `what`.
    pub fn driver(what: impl Into<String>) -> impl FnOnce(DriverError) -> GpuError {
        move |error| GpuError::Driver {
            what: what.into(),
            error,
        }
    }

    /// An NCCL error while doing `what`.
    pub fn nccl(what: impl Into<String>) -> impl FnOnce(NcclError) -> GpuError {
        move |error| GpuError::Nccl {
            what: what.into(),
            error,
        }
    }
}

/// The value of a driver call, or an unwinding with what failed (see the module's documentation).
pub fn check<T>(what: &str, result: Result<T, DriverError>) -> T {
    result.unwrap_or_else(|err| panic!("{what}: {err}"))
}

/// A grid-stride launch over `n` elements.
fn elementwise(n: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (n.div_ceil(256).clamp(1, 132 * 16) as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    }
}

impl DeviceStore {
    /// The store of `ctx` on `stream`, running blocks on `backend` with `input` (bf16 or fp16)
    /// inputs.
    pub fn new(
        ctx: &Arc<CudaContext>,
        stream: Arc<CudaStream>,
        backend: Backend,
        input: DType,
    ) -> Result<DeviceStore, GpuError> {
        let (major, minor) = ctx
            .compute_capability()
            .map_err(GpuError::driver("compute capability"))?;
        let options = cudarc::nvrtc::CompileOptions {
            arch: Some(Box::leak(format!("sm_{major}{minor}").into_boxed_str())),
            ..Default::default()
        };
        let ptx =
            cudarc::nvrtc::compile_ptx_with_opts(SOURCE, options).map_err(GpuError::Compile)?;
        let module = ctx
            .load_module(ptx)
            .map_err(GpuError::driver("loading the store's kernels"))?;
        let function =
            |name: &'static str| module.load_function(name).map_err(GpuError::driver(name));
        Ok(DeviceStore {
            stream,
            kernels: Kernels {
                gather: function("gather_parts")?,
                add: function("add_f32")?,
                fill: function("fill_f32")?,
                merge: function("merge_rows")?,
            },
            backend,
            input,
            blocks: Spans::default(),
        })
    }

    /// Seconds the blocks' kernels took since the last call (for how much of a pass was compute).
    pub fn take_block_seconds(&self) -> f64 {
        self.blocks.take_seconds()
    }

    /// `call` on the backend, timed.
    fn run_block(&self, call: &AttentionCall<'_>) -> Result<(), AttentionError> {
        let start = Spans::mark(&self.stream);
        self.backend.call(call)?;
        self.blocks.push(start, Spans::mark(&self.stream));
        Ok(())
    }

    pub fn element_bytes(&self, kind: Kind) -> usize {
        match kind {
            Kind::Input => 2,
            Kind::Accumulator => 4,
        }
    }

    /// `len` elements of `kind`, uninitialised (for what is written whole before it is read,
    /// such as a receive buffer).
    pub fn uninitialised(&self, len: usize, kind: Kind) -> DeviceValues {
        let bytes = (len * self.element_bytes(kind)).max(16);
        // SAFETY: every caller writes the whole buffer before it is read.
        let buffer = check("device memory", unsafe { self.stream.alloc::<u8>(bytes) });
        DeviceValues {
            buffer: Arc::new(buffer),
            kind,
            len,
        }
    }

    /// Host bytes of `kind` (16-bit inputs or f32) as device values.
    pub fn upload(&self, bytes: &[u8], kind: Kind) -> DeviceValues {
        let len = bytes.len() / self.element_bytes(kind);
        let buffer = check("upload", self.stream.clone_htod(bytes));
        DeviceValues {
            buffer: Arc::new(buffer),
            kind,
            len,
        }
    }

    /// The values of an accumulator as f32.
    pub fn download_f32(&self, x: &DeviceValues) -> Vec<f32> {
        assert_eq!(x.kind, Kind::Accumulator, "only results are read back");
        let bytes = check("download", self.stream.clone_dtoh(x.buffer.as_ref()));
        bytes[..x.len * 4]
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect()
    }

    /// `x` as a buffer of its own, copied if it is shared.
    fn own<'a>(&self, x: &'a mut DeviceValues) -> &'a mut DeviceValues {
        if Arc::strong_count(&x.buffer) > 1 {
            *x = self.gather(&[(&*x, 0..x.len)]);
        }
        x
    }

    fn fill(&self, x: &DeviceValues, value: f32) {
        let (pointer, n) = (x.address(&self.stream, 0, 4), x.len as u64);
        let mut launch = self.stream.launch_builder(&self.kernels.fill);
        launch.arg(&pointer).arg(&value).arg(&n);
        // SAFETY: the buffer holds n f32 values.
        check(
            "fill",
            unsafe { launch.launch(elementwise(x.len)) }.map(drop),
        );
    }

    /// An attention call for `block` on this store's stream and element types (its device
    /// pointers are the caller's to set).
    fn call<'a>(&self, block: &'a HostBlock<'a>, backward: bool) -> AttentionCall<'a> {
        let mut call = block.call(Memory::Cuda, (self.input, DType::F32), backward);
        call.stream = self.stream.cu_stream() as *mut std::ffi::c_void;
        call
    }
}

/// The buffer `parts` are when they cover it exactly, in order.
fn whole_buffer<'a>(parts: &[(&'a DeviceValues, Range<usize>)]) -> Option<&'a DeviceValues> {
    let (first, _) = parts.first()?;
    let mut next = 0;
    for (x, range) in parts {
        if !Arc::ptr_eq(&x.buffer, &first.buffer) || x.len != first.len || range.start != next {
            return None;
        }
        next = range.end;
    }
    (next == first.len).then_some(*first)
}

impl Store for DeviceStore {
    type Values = DeviceValues;

    fn len(&self, x: &DeviceValues) -> usize {
        x.len
    }

    fn zeros(&self, count: usize) -> DeviceValues {
        let x = self.uninitialised(count, Kind::Accumulator);
        self.fill(&x, 0.0);
        x
    }

    fn negative_infinities(&self, count: usize) -> DeviceValues {
        let x = self.uninitialised(count, Kind::Accumulator);
        self.fill(&x, f32::NEG_INFINITY);
        x
    }

    /// Left unfilled: the attention backend writes every row of a call's heads
    /// (`AttentionCall`'s contract), so a fill would be a pass over memory for nothing.
    fn for_overwrite(&self, count: usize, _fill: f64) -> DeviceValues {
        self.uninitialised(count, Kind::Accumulator)
    }

    fn gather(&self, parts: &[(&DeviceValues, Range<usize>)]) -> DeviceValues {
        // Parts that are one buffer whole, in order (one rank's share of an all-to-all at world
        // 1, a tensor regrouped by heads it already has): the same values, shared rather than
        // copied; the store copies a shared buffer before it changes it.
        if let Some(whole) = whole_buffer(parts) {
            return whole.clone();
        }
        let kind = parts.first().map_or(Kind::Accumulator, |(x, _)| x.kind);
        let size = self.element_bytes(kind);
        let total: usize = parts.iter().map(|(_, r)| r.len()).sum();
        let out = self.uninitialised(total, kind);
        let (mut sources, mut targets, mut lengths) = (Vec::new(), Vec::new(), Vec::new());
        let mut offset = 0;
        for (x, range) in parts {
            assert_eq!(x.kind, kind, "a gather mixes inputs and results");
            let bytes = range.len() * size;
            assert!(
                (range.start * size).is_multiple_of(16) && bytes.is_multiple_of(16),
                "gather parts are whole 16-byte chunks (head_dim × element size)"
            );
            if bytes > 0 {
                sources.push(x.address(&self.stream, range.start, size));
                targets.push(out.address(&self.stream, offset, size));
                lengths.push(bytes as u64);
            }
            offset += range.len();
        }
        if lengths.is_empty() {
            return out;
        }
        // One upload per gather: sources, then targets, then lengths.
        let count = lengths.len();
        let longest = lengths.iter().max().copied().unwrap_or(0) as usize / 16;
        let table = [sources, targets, lengths].concat();
        let table = check("gather table", self.stream.clone_htod(&table));
        let config = LaunchConfig {
            grid_dim: (longest.div_ceil(256).clamp(1, 64) as u32, count as u32, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut launch = self.stream.launch_builder(&self.kernels.gather);
        launch.arg(&table);
        // SAFETY: every part lies inside its source and the output (checked above).
        check("gather", unsafe { launch.launch(config) }.map(drop));
        out
    }

    fn add(&self, target: &mut DeviceValues, at: usize, source: &DeviceValues) {
        assert!(
            target.kind == Kind::Accumulator && source.kind == Kind::Accumulator,
            "only results are added"
        );
        assert!(
            at + source.len <= target.len,
            "an addition past the target's end"
        );
        let target = self.own(target);
        let (to, from, n) = (
            target.address(&self.stream, at, 4),
            source.address(&self.stream, 0, 4),
            source.len as u64,
        );
        let mut launch = self.stream.launch_builder(&self.kernels.add);
        launch.arg(&to).arg(&from).arg(&n);
        // SAFETY: both ranges hold n f32 values (checked above).
        check(
            "add",
            unsafe { launch.launch(elementwise(source.len)) }.map(drop),
        );
    }

    fn merge(&self, done: &mut Partial<DeviceValues>, other: &Partial<DeviceValues>, d: usize) {
        let rows = done.lse.len;
        let out = self.own(&mut done.out).address(&self.stream, 0, 4);
        let lse = self.own(&mut done.lse).address(&self.stream, 0, 4);
        let (other_out, other_lse) = (
            other.out.address(&self.stream, 0, 4),
            other.lse.address(&self.stream, 0, 4),
        );
        let (rows_arg, d_arg) = (rows as u64, d as i32);
        let mut launch = self.stream.launch_builder(&self.kernels.merge);
        launch
            .arg(&out)
            .arg(&lse)
            .arg(&other_out)
            .arg(&other_lse)
            .arg(&rows_arg)
            .arg(&d_arg);
        let config = LaunchConfig {
            grid_dim: ((rows * 32).div_ceil(256).max(1) as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: O holds rows × d and LSE rows f32 values on both sides.
        check("merge", unsafe { launch.launch(config) }.map(drop));
    }

    fn forward(
        &self,
        block: &HostBlock<'_>,
        spans: &Span,
        (q, k, v): (&DeviceValues, &DeviceValues, &DeviceValues),
        out: &mut DeviceValues,
        lse: &mut DeviceValues,
    ) -> Result<(), AttentionError> {
        let s = &self.stream;
        let mut call = self.call(block, false);
        call.q = q.address(s, spans.rows.start, 2) as *const _;
        call.k = k.address(s, spans.keys.start, 2) as *const _;
        call.v = v.address(s, spans.keys.start, 2) as *const _;
        call.out = self.own(out).address(s, spans.rows.start, 4) as *mut _;
        call.lse = self.own(lse).address(s, spans.lse.start, 4) as *mut _;
        self.run_block(&call)
    }

    fn backward(
        &self,
        block: &HostBlock<'_>,
        spans: &Span,
        (q, k, v): (&DeviceValues, &DeviceValues, &DeviceValues),
        (out, lse, d_out): (&DeviceValues, &DeviceValues, &DeviceValues),
        dq: &mut DeviceValues,
    ) -> Result<(DeviceValues, DeviceValues), AttentionError> {
        let s = &self.stream;
        let (dk, dv) = (
            self.uninitialised(spans.keys.len(), Kind::Accumulator),
            self.uninitialised(spans.keys.len(), Kind::Accumulator),
        );
        let mut call = self.call(block, true);
        call.q = q.address(s, spans.rows.start, 2) as *const _;
        call.k = k.address(s, spans.keys.start, 2) as *const _;
        call.v = v.address(s, spans.keys.start, 2) as *const _;
        call.out = out.address(s, spans.rows.start, 4) as *mut _;
        call.lse = lse.address(s, spans.lse.start, 4) as *mut _;
        call.d_out = d_out.address(s, spans.rows.start, 2) as *const _;
        call.dq = self.own(dq).address(s, spans.rows.start, 4) as *mut _;
        call.dk = dk.address(s, 0, 4) as *mut _;
        call.dv = dv.address(s, 0, 4) as *mut _;
        self.run_block(&call)?;
        Ok((dk, dv))
    }
}

#[cfg(test)]
mod tests {
    /// The store's kernels compile for every architecture the cuda plugin's do (CI runs it with
    /// the nvidia-cuda-nvrtc wheel's library).
    #[test]
    #[ignore = "needs libnvrtc on the library path (a CUDA toolkit or the nvidia-cuda-nvrtc wheel)"]
    fn nvrtc_compiles_the_store_kernels_for_every_architecture() {
        for arch in ["sm_80", "sm_86", "sm_89", "sm_90a", "sm_100", "sm_120"] {
            let options = cudarc::nvrtc::CompileOptions {
                arch: Some(arch),
                ..Default::default()
            };
            let ptx = cudarc::nvrtc::compile_ptx_with_opts(super::SOURCE, options)
                .unwrap_or_else(|err| panic!("store.cu for {arch}: {err}"));
            assert!(ptx.to_src().contains(".entry "), "store.cu for {arch}");
        }
    }
}
