//! The flash kernel as an in-process attention backend: one block of a caller's (a
//! context-parallel rank's) attention on the caller's device buffers and stream.

use std::ffi::c_void;

use attnbench_sdk::attention::{
    require_tensors, AttentionCall, AttentionError, DType, Memory, RowIntervals,
};
use attnbench_sdk::reference::Element;
use attnbench_sdk::PluginError;

use super::device::{DeviceTables, Dims, GradTensors, Tensors};
use super::launch::{launch_backward, launch_forward, Backward, Instructions, Schedule};
use super::tables::{tables, MaskTiles};
use super::Kernels;
use crate::gpu::Gpu;

/// What identifies a call's work lists: its lengths, heads and rows.
pub(super) fn block_digest(call: &AttentionCall<'_>) -> [u8; 32] {
    let mut digest = blake3::Hasher::new();
    for number in [call.q_len, call.k_len, call.heads_q as u64] {
        digest.update(&number.to_le_bytes());
    }
    for list in [&call.row_start, &call.intervals] {
        digest.update(&(list.len() as u64).to_le_bytes());
        let bytes: Vec<u8> = list.iter().flat_map(|value| value.to_le_bytes()).collect();
        digest.update(&bytes);
    }
    digest.finalize().into()
}

/// What of `call` the flash kernel runs (its element type and sizes), or why it cannot; checked
/// before any device work, so a caller with host memory hears why rather than about the GPU.
pub fn accepts(call: &AttentionCall<'_>) -> Result<(Element, Dims), AttentionError> {
    let element = match call.input {
        DType::Bf16 => Element::Bf16,
        DType::F16 => Element::F16,
        other => {
            return Err(AttentionError::Unsupported(format!(
                "the flash kernel takes bf16 or fp16 inputs, not {other:?}"
            )))
        }
    };
    if call.memory != Memory::Cuda || call.output != DType::F32 {
        return Err(AttentionError::Unsupported(format!(
            "the flash kernel runs device memory with f32 outputs, not {:?} memory with {:?} outputs",
            call.memory, call.output
        )));
    }
    let (hq, hkv, d) = (
        call.heads_q as usize,
        call.heads_kv as usize,
        call.head_dim as usize,
    );
    if let Some(reason) = super::unsupported_head_dims(super::HeadDims { qk: d, v: d }) {
        return Err(AttentionError::Unsupported(reason));
    }
    if call.q_len != call.k_len {
        return Err(AttentionError::Unsupported(format!(
            "the flash kernel runs blocks of as many queries as keys, not {} × {}",
            call.q_len, call.k_len
        )));
    }
    if hkv == 0
        || hq % hkv != 0
        || call.kv_head_of.len() != hq
        || call
            .kv_head_of
            .iter()
            .enumerate()
            .any(|(h, &kv)| kv as usize != h / (hq / hkv))
    {
        return Err(AttentionError::Unsupported(format!(
            "the flash kernel maps query head h to KV head h / (heads_q / heads_kv); the call's kv_head_of for {hq} query and {hkv} KV heads does not"
        )));
    }
    require_tensors(call)?;
    let dims = Dims {
        heads_q: hq,
        heads_kv: hkv,
        len: call.q_len as usize,
        head: super::HeadDims { qk: d, v: d },
        scale: call.scale as f32,
    };
    Ok((element, dims))
}

/// One block of an in-process attention call (see `attnbench_sdk::attention`) on the caller's
/// device pointers, ordered after the work already on its stream and before what it queues
/// next. Runs bf16/fp16 inputs with f32 outputs, equal query and key lengths (every block the
/// context-parallel methods make) and the usual KV-head grouping; refuses the rest with why.
pub fn attend(
    gpu: &Gpu,
    kernels: &Kernels,
    call: &AttentionCall<'_>,
) -> Result<(), AttentionError> {
    let (element, dims) = accepts(call)?;
    let (hq, len) = (dims.heads_q, dims.len);
    let as_message = |err: PluginError| AttentionError::Failed(err.to_string());
    let tables = kernels.blocks.get_or_make(block_digest(call), || {
        let rows = RowIntervals::of_call(call)?;
        let lists = tables(&[MaskTiles::of_rows(rows, call.k_len)]);
        DeviceTables::upload(gpu, &lists, &vec![0; hq]).map_err(as_message)
    })?;
    let functions = kernels.functions(element, dims.head).map_err(as_message)?;
    let address = |p: *const c_void| p as u64;
    let x = Tensors {
        q: address(call.q),
        k: address(call.k),
        v: address(call.v),
        out: address(call.out),
        lse: address(call.lse),
    };
    let caller = call.stream as cudarc::driver::sys::CUstream;
    // The caller's queued work first, ours next, and the caller's later work after ours.
    follow(caller, gpu.stream.cu_stream()).map_err(|err| {
        AttentionError::Failed(format!("ordering after the caller's stream: {err}"))
    })?;
    let delta = if call.backward {
        Some(gpu.alloc::<f32>("D", hq * len).map_err(as_message)?)
    } else {
        None
    };
    // SAFETY: the call's contract gives these extents to its pointers (AttentionCall); the tables
    // were built from its rows.
    let launched = unsafe {
        match &delta {
            None => launch_forward(
                &gpu.stream,
                &functions,
                dims,
                &x,
                &tables,
                Instructions::Auto,
                Schedule::Grid,
            ),
            Some(delta) => {
                let g = GradTensors {
                    d_out: address(call.d_out),
                    delta: delta.address(&gpu.stream),
                    dq: address(call.dq as *const c_void),
                    dk: address(call.dk as *const c_void),
                    dv: address(call.dv as *const c_void),
                };
                launch_backward(
                    &gpu.stream,
                    &functions,
                    dims,
                    &x,
                    &g,
                    &tables,
                    Backward::Split,
                    Instructions::Auto,
                )
            }
        }
    };
    launched.map_err(as_message)?;
    follow(gpu.stream.cu_stream(), caller).map_err(|err| {
        AttentionError::Failed(format!(
            "ordering the caller's stream after the kernels: {err}"
        ))
    })
}

/// Makes `later` wait for the work queued on `earlier` so far (an event between them).
pub(crate) fn follow(
    earlier: cudarc::driver::sys::CUstream,
    later: cudarc::driver::sys::CUstream,
) -> Result<(), cudarc::driver::DriverError> {
    use cudarc::driver::result::{event, stream};
    use cudarc::driver::sys::{CUevent_flags, CUevent_wait_flags};
    let marker = event::create(CUevent_flags::CU_EVENT_DISABLE_TIMING)?;
    // SAFETY: both streams belong to this process's context; an event may be destroyed while
    // work still waits on it (its resources go once that work completes).
    unsafe {
        let ordered = event::record(marker, earlier).and_then(|_| {
            stream::wait_event(later, marker, CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT)
        });
        let _ = event::destroy(marker);
        ordered
    }
}
