//! `cuda/decode-backend-check`: the in-process decode backend on the GPU against the host's f64
//! block (`HostBlock`), on the blocks decoding across ranks makes of one sequence: its whole cache,
//! an early shard its new tokens see whole, a middle one they see all but the end of, and a last
//! shard shorter than the new tokens — through the same entry point the ABI calls.

use std::ffi::c_void;
use std::ops::Range;

use attnbench_sdk::attention::{DType, HostBlock, Memory, RowIntervals};
use attnbench_sdk::decode::block_rows;
use attnbench_sdk::reference::{relative_error, Element, UniformStream};
use attnbench_sdk::{Plugin, PluginError, StageRequest};
use serde::Deserialize;
use serde_json::{json, Value};

use crate::{with_gpu, Cuda};

#[derive(Deserialize)]
struct Params {
    heads_q: usize,
    heads_kv: usize,
    head_dim: usize,
    dtype: Element,
    queries: usize,
    kv_len: usize,
}

pub fn run(request: &StageRequest) -> Result<Value, PluginError> {
    let p: Params = request.params()?;
    let (n, q) = (p.kv_len, p.queries);
    if q == 0 || n < 3 * q + 8 || p.heads_kv == 0 || !p.heads_q.is_multiple_of(p.heads_kv) {
        return Err(PluginError::Params(format!(
            "kv_len {n}, queries {q}, heads {}:{}: expected at least one new token, kv_len of at least 3 · queries + 8, heads_q a multiple of heads_kv",
            p.heads_q, p.heads_kv
        )));
    }
    let tolerance = p.dtype.tolerance();
    let mut report = Vec::new();
    let mut failures = Vec::new();
    for (name, range) in shard_blocks(n, q) {
        let rows = block_rows(n as u64, q as u64, range.start as u64..range.end as u64);
        let errors = check_block(&p, &rows, range.len(), request.seed)?;
        let passed = errors.iter().all(|(_, e)| *e <= tolerance);
        if !passed {
            failures.push(format!("{name}: {errors:?}"));
        }
        report.push(json!({"block": name, "keys": [range.start, range.end], "errors": errors, "passed": passed}));
    }
    if !failures.is_empty() {
        return Err(PluginError::failed(format!(
            "the decode backend differs from the f64 block beyond {tolerance}: {}",
            failures.join("; ")
        )));
    }
    Ok(json!({"kernel": "decode", "dtype": p.dtype, "tolerance": tolerance, "blocks": report}))
}

/// The blocks a sequence of `n` keys (its `q` new tokens last) is cut into when decoding across
/// ranks, one of each kind the tokens' rows can make of a block: all of it seen by every token,
/// its end unseen by the first tokens, and (from 2 tokens) a last shard shorter than the tokens,
/// which the first tokens see none of.
fn shard_blocks(n: usize, q: usize) -> Vec<(&'static str, Range<usize>)> {
    let mut blocks = vec![("whole cache", 0..n), ("early shard, seen whole", 0..n / 3)];
    match q {
        1 => blocks.extend([
            ("middle shard, seen whole", n / 3..2 * n / 3),
            ("last shard, seen whole", 2 * n / 3..n),
        ]),
        2 => blocks.extend([
            ("last shard, its end unseen by the first token", n / 3..n),
            ("last shard, shorter than the new tokens", n - 1..n),
        ]),
        _ => blocks.extend([
            (
                "middle shard, its end unseen by the first tokens",
                n / 3..n + 2 - q,
            ),
            ("last shard, shorter than the new tokens", n + 2 - q..n),
        ]),
    }
    blocks
}

/// Runs one block on the GPU through the entry point and returns O's and the LSE's relative
/// errors against the f64 block.
fn check_block(
    p: &Params,
    rows: &RowIntervals,
    keys: usize,
    seed: u64,
) -> Result<Vec<(&'static str, f64)>, PluginError> {
    let d = p.head_dim;
    let draws = UniformStream::new(seed, p.dtype);
    let (q_n, kv_n) = (p.heads_q * p.queries * d, p.heads_kv * keys * d);
    let (q, k, v) = (
        draws.fill(0, q_n),
        draws.fill(q_n as u64, kv_n),
        draws.fill((q_n + kv_n) as u64, kv_n),
    );
    let upload =
        |data: &[f32]| with_gpu(|state| state.gpu.upload("block input", &p.dtype.encode(data)));
    let zeros = |len: usize| with_gpu(|state| state.gpu.alloc::<f32>("block output", len));
    let (q_dev, k_dev, v_dev) = (upload(&q)?, upload(&k)?, upload(&v)?);
    let (out, lse) = (zeros(q_n)?, zeros(p.heads_q * p.queries)?);
    let stream = with_gpu(|state| Ok(state.gpu.stream.clone()))?;
    let kv_head_of: Vec<u32> = (0..p.heads_q)
        .map(|h| (h / (p.heads_q / p.heads_kv)) as u32)
        .collect();
    let block = HostBlock {
        head_dim: d,
        q_len: p.queries,
        k_len: keys,
        scale: 1.0 / (d as f64).sqrt(),
        kv_head_of: &kv_head_of,
        heads_kv: p.heads_kv,
        rows,
    };
    let input = if p.dtype == Element::F16 {
        DType::F16
    } else {
        DType::Bf16
    };
    let mut call = block.call(Memory::Cuda, (input, DType::F32), false);
    call.q = q_dev.address(&stream) as *const c_void;
    call.k = k_dev.address(&stream) as *const c_void;
    call.v = v_dev.address(&stream) as *const c_void;
    call.out = out.address(&stream) as *mut c_void;
    call.lse = lse.address(&stream) as *mut c_void;
    call.stream = stream.cu_stream() as *mut c_void;
    Cuda::attention("decode", &call).map_err(|err| PluginError::Failed(err.to_string()))?;
    let got_out = with_gpu(|state| state.gpu.download(&out))?;
    let got_lse = with_gpu(|state| state.gpu.download(&lse))?;

    let wide = |x: &[f32]| x.iter().map(|&v| v as f64).collect::<Vec<f64>>();
    let (mut o, mut l) = (vec![0.0; q_n], vec![0.0; p.heads_q * p.queries]);
    block.forward(&wide(&q), &wide(&k), &wide(&v), &mut o, &mut l);
    let narrow = |x: &[f64]| x.iter().map(|&v| v as f32).collect::<Vec<f32>>();
    Ok(vec![
        ("out", relative_error(&got_out, &narrow(&o))),
        ("lse", relative_error(&got_lse, &narrow(&l))),
    ])
}

#[cfg(test)]
mod tests {
    use super::shard_blocks;

    #[test]
    fn every_shard_block_is_a_nonempty_part_of_the_sequence() {
        for q in 1..=16 {
            let n = 3 * q + 8;
            for (name, range) in shard_blocks(n, q) {
                assert!(
                    range.start < range.end && range.end <= n,
                    "q {q}: {name} {range:?}"
                );
            }
            let last = shard_blocks(n, q).pop().unwrap().1;
            assert_eq!(last.end, n, "q {q}: the last block ends the sequence");
            if q >= 2 {
                assert!(
                    last.len() < q,
                    "q {q}: the last shard is shorter than the tokens"
                );
            }
        }
    }
}
