//! `cpu/decode`: Flash-Decoding on the CPU. Each sequence's KV cache is cut into splits; one work
//! item is a (sequence, KV head, split), which reads its keys and values once for every query row
//! of the KV head's group (GQA's sharing, and all new tokens of the step), keeps an online softmax
//! per row, and leaves a partial O and LSE; the partials then merge by their LSE. The cache is
//! packed or paged (read through the page table, as serving engines' kernels read it).
//!
//! A decode step is bound by memory, not arithmetic, so the record puts the bytes the step must
//! move over its time beside the machine's own copy bandwidth, measured in the same stage with
//! the same threads.

use std::time::Instant;

use attnbench_sdk::decode::{
    check_step, declare_step, split_range, step_record, unchecked, DecodeInputs, DecodeProblem,
    PageTable, StepCheck, StepParams,
};

use attnbench_sdk::measure::{Harness, Quantiles};
use attnbench_sdk::reference::{Arithmetic, Element};
use attnbench_sdk::{
    write_json, CacheScope, ParamSpec, ParamType, PluginError, StageRequest, StageSpec,
};
use serde::Deserialize;
use serde_json::{json, Value};

use crate::problem::{axpy, dot, parallel};

/// Fewest keys a split gets when the split count is chosen: below it the merge and the work
/// item's start cost more than the extra parallelism gains.
pub const MIN_SPLIT_KEYS: u64 = 256;

/// Keys scored together before the running maximum is rescaled.
const KEY_BLOCK: usize = 32;

/// `cpu/decode`'s parameters.
#[derive(Deserialize)]
pub struct DecodeParams {
    splits: u64,
    threads: usize,
    #[serde(flatten)]
    step: StepParams,
}

/// `cpu/decode` as the manifest declares it.
pub fn spec() -> StageSpec {
    declare_step(StageSpec::new("decode"), &Harness::default(), 4, "4k", (8, 2, 64))
        .doc("Times one decode step of a batch with a split-KV (Flash-Decoding) kernel on CPU threads, checked against the f64 reference; records latency and the bandwidth it reached beside the machine's copy bandwidth.")
        .param(ParamSpec::new("splits", ParamType::Int).default(0).doc("KV splits per sequence; 0 chooses from the threads and the KV length (the record says how)."))
        .param(ParamSpec::new("threads", ParamType::Int).default(0).doc("Threads (0 = one per CPU)."))
        .output("decode")
        .cache_scope(CacheScope::Machine)
        // A timing shares the cores with nothing else.
        .exclusive()
}

/// The split count for `problem` on `threads` threads: enough work items to give every thread
/// two, with no split shorter than [`MIN_SPLIT_KEYS`] keys of the longest sequence. Returns the
/// count and why.
pub fn choose_splits(problem: &DecodeProblem, threads: usize) -> (u64, String) {
    let items = problem.batch() as u64 * problem.heads_kv;
    let wanted = (2 * threads as u64).div_ceil(items).max(1);
    let longest = problem.kv_lens.iter().copied().max().unwrap_or(1);
    let cap = (longest / MIN_SPLIT_KEYS).max(1);
    let splits = wanted.min(cap);
    let why = format!(
        "{items} (sequence, KV head) items for {threads} threads want {wanted} splits for two items a thread; \
         splits of at least {MIN_SPLIT_KEYS} keys allow {cap}"
    );
    (splits, why)
}

/// Where the kernel reads K and V.
pub enum Cache<'a> {
    /// `[heads_kv][Σ kv_len][head_dim]`.
    Packed { k: &'a [f32], v: &'a [f32] },
    /// `[pool slots][heads_kv][head_dim]`, sequence `b`'s token `t` in its page table's slot.
    Paged {
        k: &'a [f32],
        v: &'a [f32],
        table: &'a PageTable,
    },
}

impl Cache<'_> {
    /// Offset of (KV head, sequence, token)'s row in K and V.
    fn offset(&self, problem: &DecodeProblem, kv_head: usize, b: usize, token: u64) -> usize {
        let d = problem.head_dim as usize;
        match self {
            Cache::Packed { .. } => {
                let key = problem.key_offset(b) + token;
                (kv_head * problem.keys() as usize + key as usize) * d
            }
            Cache::Paged { table, .. } => {
                let page = table.page_size;
                let slot = u64::from(table.pages[b][(token / page) as usize]) * page + token % page;
                (slot as usize * problem.heads_kv as usize + kv_head) * d
            }
        }
    }

    fn tensors(&self) -> (&[f32], &[f32]) {
        match self {
            Cache::Packed { k, v } | Cache::Paged { k, v, .. } => (k, v),
        }
    }
}

/// The step's O `[heads_q][rows][head_dim]` and LSE `[heads_q][rows]`, in f32.
pub struct DecodeOutput {
    pub out: Vec<f32>,
    pub lse: Vec<f32>,
}

/// One decode step: every (sequence, KV head, split) on `threads` threads, then the merge.
pub fn decode(
    problem: &DecodeProblem,
    q: &[f32],
    cache: &Cache<'_>,
    splits: u64,
    threads: usize,
) -> DecodeOutput {
    let d = problem.head_dim as usize;
    let row_count = (problem.heads_q / problem.heads_kv * problem.queries) as usize;
    let splits = splits.max(1) as usize;
    let items = problem.batch() * problem.heads_kv as usize * splits;
    let mut outs = vec![0f32; items * row_count * d];
    let mut lses = vec![f32::NEG_INFINITY; items * row_count];
    let jobs: Vec<_> = outs
        .chunks_mut(row_count * d)
        .zip(lses.chunks_mut(row_count))
        .enumerate()
        .collect();
    parallel(jobs, threads, |(item, (out, lse))| {
        let per_sequence = problem.heads_kv as usize * splits;
        let (b, kv_head, split) = (
            item / per_sequence,
            item % per_sequence / splits,
            item % splits,
        );
        let keys = split_range(problem.kv_lens[b], splits as u64, split as u64);
        attend_split(problem, q, cache, (b, kv_head, keys), out, lse);
    });
    merge(problem, &outs, &lses, splits)
}

/// One work item: the partial O (normalised over its keys) and LSE of every query row of
/// `kv_head`'s group in sequence `b`, over `keys`.
fn attend_split(
    problem: &DecodeProblem,
    q: &[f32],
    cache: &Cache<'_>,
    (b, kv_head, keys): (usize, usize, std::ops::Range<u64>),
    out: &mut [f32],
    lse: &mut [f32],
) {
    let d = problem.head_dim as usize;
    let group = (problem.heads_q / problem.heads_kv) as usize;
    let queries = problem.queries as usize;
    let rows = problem.rows() as usize;
    let scale = 1.0 / (d as f32).sqrt();
    let (k, v) = cache.tensors();
    // Row j of the item is query head kv_head·group + j / queries, new token j % queries; it sees
    // keys up to `last[j]`.
    let row_count = group * queries;
    let query: Vec<&[f32]> = (0..row_count)
        .map(|j| {
            let (head, row) = (kv_head * group + j / queries, b * queries + j % queries);
            &q[(head * rows + row) * d..][..d]
        })
        .collect();
    let last: Vec<u64> = (0..row_count)
        .map(|j| problem.kv_lens[b] - problem.queries + (j % queries) as u64)
        .collect();
    let mut high = vec![f32::NEG_INFINITY; row_count];
    let mut sum = vec![0f32; row_count];
    let mut scores = vec![[f32::NEG_INFINITY; KEY_BLOCK]; row_count];
    let mut offsets = [0usize; KEY_BLOCK];
    let mut start = keys.start;
    while start < keys.end {
        let end = (start + KEY_BLOCK as u64).min(keys.end);
        let width = (end - start) as usize;
        for (t, token) in (start..end).enumerate() {
            offsets[t] = cache.offset(problem, kv_head, b, token);
            let key = &k[offsets[t]..][..d];
            for j in 0..row_count {
                scores[j][t] = if token <= last[j] {
                    dot(query[j], key) * scale
                } else {
                    f32::NEG_INFINITY
                };
            }
        }
        for j in 0..row_count {
            let block_high = scores[j][..width]
                .iter()
                .copied()
                .fold(f32::NEG_INFINITY, f32::max);
            if block_high == f32::NEG_INFINITY {
                continue;
            }
            let new_high = high[j].max(block_high);
            let rescale = (high[j] - new_high).exp();
            sum[j] *= rescale;
            let acc = &mut out[j * d..][..d];
            acc.iter_mut().for_each(|o| *o *= rescale);
            for t in 0..width {
                let p = (scores[j][t] - new_high).exp();
                sum[j] += p;
                axpy(p, &v[offsets[t]..][..d], acc);
            }
            high[j] = new_high;
        }
        start = end;
    }
    for j in 0..row_count {
        if sum[j] > 0.0 {
            out[j * d..][..d].iter_mut().for_each(|o| *o /= sum[j]);
            lse[j] = high[j] + sum[j].ln();
        }
    }
}

/// Folds each (sequence, KV head)'s split partials into the step's O and LSE.
fn merge(problem: &DecodeProblem, outs: &[f32], lses: &[f32], splits: usize) -> DecodeOutput {
    let d = problem.head_dim as usize;
    let group = (problem.heads_q / problem.heads_kv) as usize;
    let queries = problem.queries as usize;
    let rows = problem.rows() as usize;
    let row_count = group * queries;
    let mut output = DecodeOutput {
        out: vec![0f32; problem.heads_q as usize * rows * d],
        lse: vec![f32::NEG_INFINITY; problem.heads_q as usize * rows],
    };
    for b in 0..problem.batch() {
        for kv_head in 0..problem.heads_kv as usize {
            let first = (b * problem.heads_kv as usize + kv_head) * splits;
            for j in 0..row_count {
                let parts = (first..first + splits).map(|item| item * row_count + j);
                let high = parts
                    .clone()
                    .map(|at| lses[at])
                    .fold(f32::NEG_INFINITY, f32::max);
                if high == f32::NEG_INFINITY {
                    continue;
                }
                let (head, row) = (kv_head * group + j / queries, b * queries + j % queries);
                let target = &mut output.out[(head * rows + row) * d..][..d];
                let mut total = 0f32;
                for at in parts {
                    let weight = (lses[at] - high).exp();
                    total += weight;
                    target
                        .iter_mut()
                        .zip(&outs[at * d..][..d])
                        .for_each(|(o, x)| *o += weight * x);
                }
                target.iter_mut().for_each(|o| *o /= total);
                output.lse[head * rows + row] = high + total.ln();
            }
        }
    }
    output
}

/// Copy bandwidth of this machine, bytes read plus bytes written per second, copying `bytes`
/// with `threads` threads under `harness` (the median repetition).
fn copy_bandwidth(bytes: usize, threads: usize, harness: &Harness) -> f64 {
    let count = (bytes / 4).max(1);
    let source = vec![1f32; count];
    let mut target = vec![0f32; count];
    let chunk = count.div_ceil(threads.max(1));
    let timing = harness.time(
        || {},
        || {
            std::thread::scope(|scope| {
                for (to, from) in target.chunks_mut(chunk).zip(source.chunks(chunk)) {
                    scope.spawn(move || to.copy_from_slice(from));
                }
            })
        },
    );
    let median = Quantiles::of(&timing.samples).map_or(f64::INFINITY, |q| q.p50);
    2.0 * (count * 4) as f64 / median
}

/// Runs `cpu/decode`.
pub fn stage(request: &StageRequest) -> Result<Value, PluginError> {
    let p: DecodeParams = request.params()?;
    let problem = p.step.problem()?;
    let threads = match p.threads {
        0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
        n => n,
    };
    let (splits, splits_reason) = match p.splits {
        0 => choose_splits(&problem, threads),
        n => (n, "set by the pipeline".to_string()),
    };
    let inputs = DecodeInputs::random(&problem, request.seed, Element::F32);
    let table = problem.page_table(request.seed);
    let pooled = table.as_ref().map(|t| {
        (
            t.to_pool(&problem, &inputs.k),
            t.to_pool(&problem, &inputs.v),
        )
    });
    let cache = match (&table, &pooled) {
        (Some(table), Some((k, v))) => Cache::Paged { k, v, table },
        _ => Cache::Packed {
            k: &inputs.k,
            v: &inputs.v,
        },
    };
    let correctness = if p.step.check == StepCheck::Off {
        unchecked()
    } else {
        let output = decode(&problem, &inputs.q, &cache, splits, threads);
        let tolerance = Arithmetic::F32.tolerance();
        check_step(
            &problem,
            &inputs,
            (&output.out, Some(&output.lse)),
            p.step.check,
            tolerance,
        )
    };
    let harness = p.step.harness.apply(Harness::default());
    let started = Instant::now();
    let timing = harness.time(
        || {},
        || {
            std::hint::black_box(decode(&problem, &inputs.q, &cache, splits, threads));
        },
    );
    let timed_s = started.elapsed().as_secs_f64();
    let times = Quantiles::of(&timing.samples)
        .ok_or_else(|| PluginError::failed("no repetition was timed"))?;
    let bytes = problem.bytes(4);
    let copy = copy_bandwidth((bytes as usize).max(1 << 20), threads, &harness);
    let result = step_record(
        &problem,
        4,
        &times,
        copy,
        json!({
            "kernel": "cpu-split-kv",
            "splits": splits,
            "splits_reason": splits_reason,
            "threads": threads,
            "copy_counted": "bytes read plus bytes written per second, copying at least the step's bytes with the same threads",
            "correctness": correctness,
            "timing": timing,
            "timed_s": timed_s,
            "harness": harness,
        }),
    );
    write_json(&request.output_dir, "decode.json", &result)?;
    Ok(result)
}

#[cfg(test)]
#[path = "decode_tests.rs"]
mod tests;
