//! `decode`: the split-KV kernel as an in-process attention backend, for decoding across GPUs
//! (`cp/decode` with `backend: nccl`). One call is one sequence: its new tokens (the call's rows,
//! every query head) against a contiguous block of its cache (the call's keys, a rank's shard),
//! on the caller's device pointers and stream, bf16/fp16 in and f32 O and LSE out so the caller
//! can merge the ranks' partials. The rows' masks must be what decoding gives: row `r` of `q_len`
//! sees the block's first `k_len + after − q_len + r + 1` keys (clipped to the block) for one
//! `after` ≥ 0, the keys of the sequence past the block.

use attnbench_sdk::attention::{AttentionCall, AttentionError, DType, Memory, RowIntervals};
use attnbench_sdk::decode::DecodeProblem;
use attnbench_sdk::reference::Element;
use attnbench_sdk::PluginError;

use crate::decode::{
    choose_splits, launch, m_tiles, shared_bytes, variant, DecodeArgs, Kernels, Step,
};
use crate::gpu::{Buffer, Gpu};
use crate::kept::Kept;

/// A call's shape: rows, keys, query heads, KV heads, head dim, and whether it is bf16 (else fp16).
type ShapeKey = (u64, u64, u32, u32, u32, bool);

/// What calls of one shape share: the kernels, the split count, and the device buffers of the
/// lengths and the splits' partials (reused in stream order by every call of that shape).
pub struct Prepared {
    step: Step,
    _index: (Buffer<u32>, Buffer<u64>),
    _parts: (Buffer<f32>, Buffer<f32>),
    args: DecodeArgs,
}

/// Shapes kept at once: a rank meets a handful (one per distinct shard length).
const KEPT_SHAPES: usize = 64;

/// The prepared shapes of this worker's calls.
pub struct Shapes(Kept<ShapeKey, Prepared>);

impl Default for Shapes {
    fn default() -> Self {
        Shapes(Kept::new(KEPT_SHAPES))
    }
}

/// `after` for the call's rows, or why the call is not a decode block.
fn keys_after(call: &AttentionCall<'_>) -> Result<u64, AttentionError> {
    let rows = RowIntervals::of_call(call)?;
    let (q_len, k_len) = (call.q_len, call.k_len);
    let seen = |r: usize| -> Option<u64> {
        let intervals =
            &rows.intervals[2 * rows.row_start[r] as usize..2 * rows.row_start[r + 1] as usize];
        match intervals {
            [] => Some(0),
            [0, end] => Some(u64::from(*end)),
            _ => None,
        }
    };
    let refuse = || {
        AttentionError::Unsupported(
            "the decode backend takes one sequence's new tokens against a block of its cache: row r \
             sees the block's first k_len + after − q_len + r + 1 keys; this call's rows differ"
                .into(),
        )
    };
    // The first row that sees part of the block fixes `after`; else the first that sees all.
    let mut after = None;
    for r in 0..q_len as usize {
        let end = seen(r).ok_or_else(refuse)?;
        if end > 0 && end < k_len {
            after = Some(
                (end + q_len - r as u64 - 1)
                    .checked_sub(k_len)
                    .ok_or_else(refuse)?,
            );
            break;
        }
        if end == k_len && after.is_none() {
            after = Some((q_len - 1).saturating_sub(r as u64));
            break;
        }
    }
    let after = after.unwrap_or(0);
    let expected = |r: u64| (k_len + after + r + 1).saturating_sub(q_len).min(k_len);
    if (0..q_len as usize).any(|r| seen(r) != Some(expected(r as u64))) {
        return Err(refuse());
    }
    Ok(after)
}

fn element_of(call: &AttentionCall<'_>) -> Result<Element, AttentionError> {
    let element = match call.input {
        DType::Bf16 => Element::Bf16,
        DType::F16 => Element::F16,
        other => {
            return Err(AttentionError::Unsupported(format!(
                "the decode kernel takes bf16 or fp16 inputs, not {other:?}"
            )))
        }
    };
    if call.memory != Memory::Cuda || call.output != DType::F32 || call.backward {
        return Err(AttentionError::Unsupported(format!(
            "the decode backend runs forward calls on device memory with f32 outputs, not {} on {:?} memory with {:?} outputs",
            if call.backward { "a backward" } else { "a forward" },
            call.memory,
            call.output
        )));
    }
    let (hq, hkv) = (call.heads_q, call.heads_kv);
    let grouped = hkv > 0
        && hq % hkv == 0
        && call.kv_head_of.len() == hq as usize
        && call
            .kv_head_of
            .iter()
            .enumerate()
            .all(|(h, &kv)| kv == h as u32 / (hq / hkv));
    if !grouped || call.k_len == 0 || call.k_len > u64::from(u32::MAX >> 1) {
        return Err(AttentionError::Unsupported(
            "the decode backend takes query head h reading KV head h / (heads_q / heads_kv), and 1 to 2^31 keys"
                .into(),
        ));
    }
    Ok(element)
}

/// What calls of this shape share. A shape the kernel cannot take is `Unsupported`; a device
/// that fails to compile or allocate is `Failed`.
fn prepare(
    gpu: &Gpu,
    kernels: &Kernels,
    call: &AttentionCall<'_>,
    element: Element,
) -> Result<Prepared, AttentionError> {
    let d = u64::from(call.head_dim);
    let name = variant(element, d).map_err(AttentionError::Unsupported)?;
    // The problem of one sequence as the split planner sees it (its fields directly: a shard may
    // hold fewer keys than there are new tokens, which a whole cache may not).
    let problem = DecodeProblem {
        kv_lens: vec![call.k_len],
        queries: call.q_len,
        heads_q: u64::from(call.heads_q),
        heads_kv: u64::from(call.heads_kv),
        head_dim: d,
        page_size: None,
    };
    let group = problem.heads_q / problem.heads_kv;
    let group_rows = group * problem.queries;
    if group_rows > 32 {
        return Err(AttentionError::Unsupported(format!(
            "the decode kernel takes up to 32 rows a KV head (group × new tokens), not {group_rows}"
        )));
    }
    let tiles = m_tiles(group_rows);
    let (block_bytes, sm_bytes) = gpu.shared_memory();
    if shared_bytes(d, tiles) > block_bytes {
        return Err(AttentionError::Unsupported(format!(
            "the decode kernel needs {} bytes of shared memory a block, this GPU allows {block_bytes}",
            shared_bytes(d, tiles)
        )));
    }
    let multiprocessors = gpu.describe().multiprocessors.unwrap_or(1).max(1) as u64;
    let (splits, _) = choose_splits(&problem, multiprocessors, sm_bytes);
    let plugin = |err: PluginError| AttentionError::Failed(err.to_string());
    let step = Step::find(kernels, &name, d, tiles, true).map_err(plugin)?;
    let kv_lens = gpu
        .upload("KV length", &[call.k_len as u32])
        .map_err(plugin)?;
    let key_offsets = gpu.upload("key offset", &[0u64]).map_err(plugin)?;
    let items = (problem.heads_kv * splits * group_rows) as usize;
    let part_out = gpu
        .alloc::<f32>("split partial O", items * d as usize)
        .map_err(plugin)?;
    let part_lse = gpu
        .alloc::<f32>("split partial LSE", items)
        .map_err(plugin)?;
    let stream = &gpu.stream;
    let args = DecodeArgs {
        q: 0,
        k: 0,
        v: 0,
        part_out: part_out.address(stream),
        part_lse: part_lse.address(stream),
        out: 0,
        lse: 0,
        kv_lens: kv_lens.address(stream),
        key_offsets: key_offsets.address(stream),
        page_offsets: kv_lens.address(stream),
        pages: kv_lens.address(stream),
        batch: 1,
        heads_kv: call.heads_kv,
        group: group as u32,
        queries: call.q_len as u32,
        splits: splits as u32,
        row_tiles: group_rows.div_ceil(16 * tiles) as u32,
        rows: call.q_len as u32,
        page_size: 0,
        keys: call.k_len,
        scale_log2: (call.scale * std::f64::consts::LOG2_E) as f32,
        keys_after: 0,
    };
    Ok(Prepared {
        step,
        _index: (kv_lens, key_offsets),
        _parts: (part_out, part_lse),
        args,
    })
}

/// Runs one decode block on the caller's pointers, ordered after the caller's stream's work and
/// before its later work.
pub fn attend(
    gpu: &Gpu,
    kernels: &Kernels,
    shapes: &Shapes,
    call: &AttentionCall<'_>,
) -> Result<(), AttentionError> {
    let element = element_of(call)?;
    let after = keys_after(call)?;
    let key = (
        call.q_len,
        call.k_len,
        call.heads_q,
        call.heads_kv,
        call.head_dim,
        call.input == DType::Bf16,
    );
    let prepared = shapes
        .0
        .get_or_make(key, || prepare(gpu, kernels, call, element))?;
    let args = DecodeArgs {
        q: call.q as u64,
        k: call.k as u64,
        v: call.v as u64,
        out: call.out as u64,
        lse: call.lse as u64,
        keys_after: after as u32,
        ..prepared.args
    };
    let caller = call.stream as cudarc::driver::sys::CUstream;
    crate::flash::follow(caller, gpu.stream.cu_stream()).map_err(|err| {
        AttentionError::Failed(format!("ordering after the caller's stream: {err}"))
    })?;
    launch(gpu, &prepared.step, &args).map_err(|err| AttentionError::Failed(err.to_string()))?;
    crate::flash::follow(gpu.stream.cu_stream(), caller).map_err(|err| {
        AttentionError::Failed(format!(
            "ordering the caller's stream after the kernels: {err}"
        ))
    })
}

#[cfg(test)]
#[path = "decode_backend_tests.rs"]
mod tests;
