//! `cuda/backend-check`: the in-process flash backend on the GPU, against the host's f64 block
//! (`HostBlock`), on blocks like the ones context-parallel methods make: rows and keys gathered
//! from two chunks each (a zigzag shard), the diagonal block and an off-diagonal one, forward
//! and backward, through the same entry point the ABI calls.

use std::ffi::c_void;

use attnbench_sdk::attention::{AttentionCall, DType, HostBlock, Memory, RowIntervals};
use attnbench_sdk::reference::{relative_error, Element, Inputs, Shape};
use attnbench_sdk::{Plugin, PluginError, StageRequest};
use serde::Deserialize;
use serde_json::{json, Value};

use crate::gpu::Buffer;
use crate::{with_gpu, Cuda};

#[derive(Deserialize)]
struct Params {
    heads_q: usize,
    heads_kv: usize,
    head_dim: usize,
    dtype: String,
    block: usize,
}

/// Two chunks of `half` positions: one starting at `a`, one at `b`.
fn chunks(a: usize, b: usize, half: usize) -> Vec<u32> {
    (a..a + half).chain(b..b + half).map(|p| p as u32).collect()
}

pub fn run(request: &StageRequest) -> Result<Value, PluginError> {
    let p: Params = request.params()?;
    let element = match p.dtype.as_str() {
        "bf16" => Element::Bf16,
        "fp16" => Element::F16,
        other => {
            return Err(PluginError::Params(format!(
                "dtype `{other}`: expected bf16 or fp16"
            )))
        }
    };
    let set = request.mask_set()?;
    let s = set.seqlen as usize;
    let half = p.block / 2;
    if p.block == 0 || !p.block.is_multiple_of(2) || 2 * p.block > s {
        return Err(PluginError::Params(format!(
            "block {}: expected an even length of at most half the mask's {s} tokens",
            p.block
        )));
    }
    let mask = &set.masks[0];
    // A zigzag shard (chunk i and its mirror) against itself and against another shard's keys.
    let mine = chunks(half, s - 2 * half, half);
    let theirs = chunks(0, s - half, half);
    let mut report = Vec::new();
    let mut failures = Vec::new();
    for (name, keys) in [("diagonal", &mine), ("off-diagonal", &theirs)] {
        let rows = RowIntervals::restrict(mask, &mine, keys);
        let errors = check_block(&p, element, &rows, request.seed)?;
        let passed = errors.values().all(|e| *e <= element.tolerance());
        if !passed {
            failures.push(format!("{name}: {errors:?}"));
        }
        report.push(json!({"block": name, "len": p.block, "errors": errors, "passed": passed}));
    }
    if !failures.is_empty() {
        return Err(PluginError::failed(format!(
            "the flash backend differs from the f64 block beyond {}: {}",
            element.tolerance(),
            failures.join("; ")
        )));
    }
    Ok(
        json!({"kernel": "flash", "dtype": p.dtype, "tolerance": element.tolerance(), "blocks": report}),
    )
}

/// Runs one block forward and backward on the GPU and returns each output's relative error.
fn check_block(
    p: &Params,
    element: Element,
    rows: &RowIntervals,
    seed: u64,
) -> Result<std::collections::BTreeMap<&'static str, f64>, PluginError> {
    let shape = Shape {
        heads_q: p.heads_q,
        heads_kv: p.heads_kv,
        seqlen: p.block,
        head_dim: p.head_dim,
        head_dim_v: None,
    };
    let inputs = Inputs::random_as(&shape, seed, element);
    let (q_n, kv_n, lse_n) = (shape.q_len(), shape.kv_len(), p.heads_q * p.block);
    // Device buffers, made and read back under the GPU lock; the calls go through the entry
    // point, which takes the lock itself.
    let upload =
        |data: &[f32]| with_gpu(|state| state.gpu.upload("block input", &element.encode(data)));
    let zeros = |len: usize| with_gpu(|state| state.gpu.alloc::<f32>("block output", len));
    let (q, k, v, d_out) = (
        upload(&inputs.q)?,
        upload(&inputs.k)?,
        upload(&inputs.v)?,
        upload(&inputs.d_out)?,
    );
    let (out, lse, dq, dk, dv) = (
        zeros(q_n)?,
        zeros(lse_n)?,
        zeros(q_n)?,
        zeros(kv_n)?,
        zeros(kv_n)?,
    );
    let stream = with_gpu(|state| Ok(state.gpu.stream.clone()))?;
    let kv_head_of: Vec<u32> = (0..p.heads_q)
        .map(|h| (h / (p.heads_q / p.heads_kv)) as u32)
        .collect();
    let pointer = |a: u64| a as *const c_void;
    let mut call = AttentionCall {
        memory: Memory::Cuda,
        input: if element == Element::F16 {
            DType::F16
        } else {
            DType::Bf16
        },
        output: DType::F32,
        backward: false,
        heads_q: p.heads_q as u32,
        heads_kv: p.heads_kv as u32,
        head_dim: p.head_dim as u32,
        q_len: p.block as u64,
        k_len: p.block as u64,
        scale: 1.0 / (p.head_dim as f64).sqrt(),
        kv_head_of: kv_head_of.as_slice().into(),
        row_start: rows.row_start.as_slice().into(),
        intervals: rows.intervals.as_slice().into(),
        q: pointer(q.address(&stream)),
        k: pointer(k.address(&stream)),
        v: pointer(v.address(&stream)),
        out: out.address(&stream) as *mut c_void,
        lse: lse.address(&stream) as *mut c_void,
        d_out: std::ptr::null(),
        dq: std::ptr::null_mut(),
        dk: std::ptr::null_mut(),
        dv: std::ptr::null_mut(),
        stream: stream.cu_stream() as *mut c_void,
    };
    Cuda::attention("flash", &call).map_err(|err| PluginError::Failed(err.to_string()))?;
    call.backward = true;
    call.d_out = pointer(d_out.address(&stream));
    call.dq = dq.address(&stream) as *mut c_void;
    call.dk = dk.address(&stream) as *mut c_void;
    call.dv = dv.address(&stream) as *mut c_void;
    Cuda::attention("flash", &call).map_err(|err| PluginError::Failed(err.to_string()))?;
    let download = |b: &Buffer<f32>| with_gpu(|state| state.gpu.download(b));
    let got = [
        download(&out)?,
        download(&lse)?,
        download(&dq)?,
        download(&dk)?,
        download(&dv)?,
    ];

    let wide = |x: &[f32]| x.iter().map(|&v| v as f64).collect::<Vec<f64>>();
    let (qw, kw, vw, dow) = (
        wide(&inputs.q),
        wide(&inputs.k),
        wide(&inputs.v),
        wide(&inputs.d_out),
    );
    let block = HostBlock {
        head_dim: p.head_dim,
        q_len: p.block,
        k_len: p.block,
        scale: call.scale,
        kv_head_of: &kv_head_of,
        heads_kv: p.heads_kv,
        rows,
    };
    let (mut o, mut l) = (vec![0.0; q_n], vec![0.0; lse_n]);
    block.forward(&qw, &kw, &vw, &mut o, &mut l);
    let (mut gq, mut gk, mut gv) = (vec![0.0; q_n], vec![0.0; kv_n], vec![0.0; kv_n]);
    block.backward((&qw, &kw, &vw), &o, &l, &dow, &mut gq, &mut gk, &mut gv);
    let narrow = |x: &[f64]| x.iter().map(|&v| v as f32).collect::<Vec<f32>>();
    let names = ["out", "lse", "dq", "dk", "dv"];
    let expected = [
        narrow(&o),
        narrow(&l),
        narrow(&gq),
        narrow(&gk),
        narrow(&gv),
    ];
    Ok(names
        .into_iter()
        .zip(got.iter().zip(&expected))
        .map(|(name, (got, want))| (name, relative_error(got, want)))
        .collect())
}
