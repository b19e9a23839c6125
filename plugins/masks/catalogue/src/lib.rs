//! The mask catalogue of attnbench.
//!
//! The mask patterns. Random draws use CPython's generator in LongCA-bench's order, so the same
//! seed and histogram give the same documents and parameters; the definitions follow attnbench's
//! (sliding windows are what their names say, prefixes are `k < P`, the global window is
//! `k < g ∨ q < g ∨ |q − k| ≤ W`).

use attnbench_sdk::histogram::{Bucket, Histogram};
use attnbench_sdk::mask::{window_slices, HeadScope, Mask, MaskError, MaskSet, Slice, SliceKind};
use attnbench_sdk::rng::PyRandom;
use serde::Deserialize;
use serde_json::{json, Map, Value};

attnbench_sdk::named_enum! {
    /// The catalogue's mask patterns, as `masks/generate`'s `mask` parameter names them.
    pub enum Pattern {
        Full = "full",
        Causal = "causal",
        FullDocument = "full_document",
        CausalDocument = "causal_document",
        FullDocumentLong = "full_document_long",
        CausalDocumentLong = "causal_document_long",
        SlidingWindow = "sliding_window",
        SlidingWindowCausal = "sliding_window_causal",
        ShareQuestion = "share_question",
        CausalBlockwise = "causal_blockwise",
        PrefixLmCausal = "prefix_lm_causal",
        PrefixLmDocument = "prefix_lm_document",
        GlobalSlidingWindow = "global_sliding_window",
        BlockCausalDocument = "block_causal_document",
        BlockSparseUniform = "block_sparse_uniform",
        BlockSparseVariable = "block_sparse_variable",
    }
}

/// LongCA-bench's histogram `name` (`pile`, `prolong64k`, `prolong512k`) from the shared data
/// folder beside the checkout, or `ATTNBENCH_LONGCA_DATA`: tests and measurements read it at run
/// time, and the project never holds a copy. `None` when it is not there, which CI (`CI` set)
/// does not allow.
pub fn shared_longca_histogram(name: &str) -> Option<Histogram> {
    let dir = std::env::var_os("ATTNBENCH_LONGCA_DATA")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| {
            std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("../../../../shared/data/longca-distributions")
        });
    match std::fs::read_to_string(dir.join(format!("{name}.json"))) {
        Ok(text) => {
            Some(Histogram::from_longca_json(&text).expect("LongCA-bench's histogram parses"))
        }
        Err(err) => {
            assert!(
                std::env::var_os("CI").is_none(),
                "LongCA-bench's {name}.json is missing under CI: {err}"
            );
            eprintln!(
                "skipping: LongCA-bench's {name}.json not found in {} ({err}); set ATTNBENCH_LONGCA_DATA",
                dir.display()
            );
            None
        }
    }
}

/// The parameters of `masks/generate` (defaults in the manifest are LongCA-bench's).
#[derive(Debug, Clone, Deserialize)]
pub struct Params {
    pub mask: Pattern,
    pub seqlen: u64,
    pub window: u64,
    pub prefix: i64,
    pub global_tokens: i64,
    pub global_window: i64,
    pub block_size: u64,
    pub short_fraction: f64,
    pub long_min: u64,
    pub long_max: u64,
    pub density: f64,
    pub sparse_block: u64,
    pub min_block: u64,
    pub sparse_scope: HeadScope,
    pub heads_q: u64,
    pub heads_kv: u64,
}

impl Params {
    /// `mask` at `seqlen` with every other parameter at LongCA-bench's default (the same
    /// defaults `masks/generate` declares).
    pub fn new(mask: Pattern, seqlen: u64) -> Params {
        Params {
            mask,
            seqlen,
            window: 1024,
            prefix: -1,
            global_tokens: -1,
            global_window: -1,
            block_size: 1024,
            short_fraction: 0.4,
            long_min: 8192,
            long_max: 30720,
            density: 0.5,
            sparse_block: 128,
            min_block: 128,
            sparse_scope: HeadScope::PerKvGroup,
            heads_q: 64,
            heads_kv: 8,
        }
    }
}

type Drawn = Map<String, Value>;

/// Why a pattern cannot be drawn with these parameters.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum GenerateError {
    #[error("seqlen must be positive")]
    EmptySequence,
    #[error("long documents need 0 ≤ short_fraction ≤ 1 and 0 < long_min ≤ long_max")]
    LongDocuments,
    #[error("prefix {prefix} is longer than the sequence ({seqlen})")]
    Prefix { prefix: u64, seqlen: u64 },
    #[error("drawing the global tokens needs seqlen ≥ 6 (got {seqlen}); set global_tokens")]
    GlobalDraw { seqlen: u64 },
    #[error("global_tokens {global} exceeds the sequence ({seqlen})")]
    GlobalTokens { global: u64, seqlen: u64 },
    #[error(
        "block_causal_document needs seqlen ({seqlen}) to be a multiple of block_size ({block})"
    )]
    BlockSize { seqlen: u64, block: u64 },
    #[error("density must be in (0, 1], got {0}")]
    Density(f64),
    #[error("sparse_block must be between 1 and seqlen ({seqlen}), got {block}")]
    SparseBlock { block: u64, seqlen: u64 },
    #[error("heads_q ({heads_q}) must be a multiple of heads_kv ({heads_kv})")]
    Heads { heads_q: u64, heads_kv: u64 },
    #[error("{blocks} blocks of at least {min_block} tokens do not fit in {seqlen}")]
    MinBlock {
        blocks: u64,
        min_block: u64,
        seqlen: u64,
    },
    #[error(transparent)]
    Mask(#[from] MaskError),
}

/// Generates `params.mask` from `histogram` with a generator seeded by `seed`.
pub fn generate(
    params: &Params,
    histogram: &Histogram,
    seed: u64,
) -> Result<MaskSet, GenerateError> {
    let s = params.seqlen;
    if s == 0 {
        return Err(GenerateError::EmptySequence);
    }
    let mut rng = PyRandom::new(seed);
    let mut drawn = Drawn::new();
    let mut documents = Vec::new();
    let square = |slices: Vec<Slice>| Mask::square(s, slices);
    let (scope, masks) = match params.mask {
        Pattern::Full => (
            HeadScope::Shared,
            vec![square(vec![Slice::new([0, s], [0, s], SliceKind::Full)])?],
        ),
        Pattern::Causal => (
            HeadScope::Shared,
            vec![square(vec![Slice::new([0, s], [0, s], SliceKind::Causal)])?],
        ),
        Pattern::FullDocument | Pattern::CausalDocument => {
            documents = histogram.sample_documents(s, &mut rng);
            let kind = if params.mask == Pattern::FullDocument {
                SliceKind::Full
            } else {
                SliceKind::Causal
            };
            (
                HeadScope::Shared,
                vec![square(per_document(&documents, kind))?],
            )
        }
        Pattern::FullDocumentLong | Pattern::CausalDocumentLong => {
            if !(0.0..=1.0).contains(&params.short_fraction)
                || params.long_min == 0
                || params.long_max < params.long_min
            {
                return Err(GenerateError::LongDocuments);
            }
            let short_total = (params.short_fraction * s as f64).floor() as u64;
            documents = histogram.sample_documents(short_total, &mut rng);
            let long = Histogram {
                buckets: vec![Bucket {
                    lo: params.long_min,
                    hi: params.long_max,
                    weight: 1.0,
                }],
            };
            documents.extend(long.sample_documents(s - short_total, &mut rng));
            rng.shuffle(&mut documents);
            let kind = if params.mask == Pattern::FullDocumentLong {
                SliceKind::Full
            } else {
                SliceKind::Causal
            };
            (
                HeadScope::Shared,
                vec![square(per_document(&documents, kind))?],
            )
        }
        Pattern::SlidingWindow | Pattern::SlidingWindowCausal => {
            let w = params.window as i64;
            let right = if params.mask == Pattern::SlidingWindow {
                w
            } else {
                0
            };
            (
                HeadScope::Shared,
                vec![square(window_slices([0, s], [0, s], w, right))?],
            )
        }
        Pattern::ShareQuestion => {
            documents = histogram.sample_documents(s, &mut rng);
            (HeadScope::Shared, vec![square(share_question(&documents))?])
        }
        Pattern::CausalBlockwise => {
            documents = histogram.sample_documents(s, &mut rng);
            let mut slices = per_document(&documents, SliceKind::Causal);
            if let Some(last) = slices.last_mut() {
                last.k[0] = 0;
            }
            (HeadScope::Shared, vec![square(slices)?])
        }
        Pattern::PrefixLmCausal => {
            let p = if params.prefix > 0 {
                params.prefix as u64
            } else {
                rng.randint(1, s as i64) as u64
            };
            if p > s {
                return Err(GenerateError::Prefix {
                    prefix: p,
                    seqlen: s,
                });
            }
            drawn.insert("prefix".into(), json!(p));
            (HeadScope::Shared, vec![square(prefix_slices(0, s, p))?])
        }
        Pattern::PrefixLmDocument => {
            documents = histogram.sample_documents(s, &mut rng);
            let p = if params.prefix > 0 {
                params.prefix as u64
            } else {
                rng.randint(1, documents[0] as i64) as u64
            };
            drawn.insert("prefix".into(), json!(p));
            let mut slices = Vec::new();
            let mut start = 0;
            for &length in &documents {
                slices.extend(prefix_slices(start, start + length, p.min(length)));
                start += length;
            }
            (HeadScope::Shared, vec![square(slices)?])
        }
        Pattern::GlobalSlidingWindow => {
            let g = if params.global_tokens > 0 {
                params.global_tokens as u64
            } else {
                if s / 3 < 2 {
                    return Err(GenerateError::GlobalDraw { seqlen: s });
                }
                rng.randint(1, (s / 3 - 1) as i64).max(1) as u64
            };
            if g > s {
                return Err(GenerateError::GlobalTokens {
                    global: g,
                    seqlen: s,
                });
            }
            let w = if params.global_window >= 0 {
                params.global_window
            } else {
                g as i64
            };
            drawn.insert("global_tokens".into(), json!(g));
            drawn.insert("global_window".into(), json!(w));
            let mut slices = vec![
                Slice::new([0, s], [0, g], SliceKind::Full),
                Slice::new([0, g], [g, s], SliceKind::Full),
            ];
            slices.extend(window_slices([g, s], [g, s], w, w));
            (HeadScope::Shared, vec![square(slices)?])
        }
        Pattern::BlockCausalDocument => {
            let b = params.block_size;
            if b == 0 || !s.is_multiple_of(b) {
                return Err(GenerateError::BlockSize {
                    seqlen: s,
                    block: b,
                });
            }
            let mut remaining = s / b;
            let mut slices = Vec::new();
            let mut start = 0;
            while remaining > 0 {
                let m = (rng.randint(1, 8) as u64).min(remaining);
                for t in 0..m {
                    slices.push(Slice::new(
                        [start + t * b, start + (t + 1) * b],
                        [start, start + (t + 1) * b],
                        SliceKind::Full,
                    ));
                }
                documents.push(m * b);
                start += m * b;
                remaining -= m;
            }
            (HeadScope::Shared, vec![square(slices)?])
        }
        Pattern::BlockSparseUniform | Pattern::BlockSparseVariable => {
            block_sparse(params, &mut rng, &mut drawn)?
        }
    };
    let mut all = Map::new();
    all.insert("mask".into(), json!(params.mask));
    all.insert("seqlen".into(), json!(s));
    all.insert("seed".into(), json!(seed));
    for (key, value) in used_params(params) {
        all.insert(key.into(), value);
    }
    all.extend(drawn);
    Ok(MaskSet {
        pattern: params.mask.to_string(),
        seqlen: s,
        params: all,
        documents,
        scope,
        masks,
    })
}

/// The parameters that shaped `params.mask`, so the record names exactly what was used.
fn used_params(params: &Params) -> Vec<(&'static str, Value)> {
    match params.mask {
        Pattern::SlidingWindow | Pattern::SlidingWindowCausal => {
            vec![("window", json!(params.window))]
        }
        Pattern::BlockCausalDocument => vec![("block_size", json!(params.block_size))],
        Pattern::FullDocumentLong | Pattern::CausalDocumentLong => vec![
            ("short_fraction", json!(params.short_fraction)),
            ("long_min", json!(params.long_min)),
            ("long_max", json!(params.long_max)),
        ],
        Pattern::BlockSparseUniform | Pattern::BlockSparseVariable => vec![
            ("density", json!(params.density)),
            ("sparse_block", json!(params.sparse_block)),
            ("sparse_scope", json!(params.sparse_scope)),
            ("heads_q", json!(params.heads_q)),
            ("heads_kv", json!(params.heads_kv)),
        ],
        Pattern::Full
        | Pattern::Causal
        | Pattern::FullDocument
        | Pattern::CausalDocument
        | Pattern::ShareQuestion
        | Pattern::CausalBlockwise
        | Pattern::PrefixLmCausal
        | Pattern::PrefixLmDocument
        | Pattern::GlobalSlidingWindow => Vec::new(),
    }
}

fn per_document(documents: &[u64], kind: SliceKind) -> Vec<Slice> {
    let mut start = 0;
    documents
        .iter()
        .map(|&length| {
            let slice = Slice::new([start, start + length], [start, start + length], kind);
            start += length;
            slice
        })
        .collect()
}

/// Document 0 is the question; every later document (an answer) sees it whole and itself causally.
fn share_question(documents: &[u64]) -> Vec<Slice> {
    let s: u64 = documents.iter().sum();
    let cu: Vec<u64> = std::iter::once(0)
        .chain(documents.iter().scan(0, |acc, &l| {
            *acc += l;
            Some(*acc)
        }))
        .collect();
    if documents.len() == 1 {
        return vec![Slice::new([0, s], [0, s], SliceKind::Causal)];
    }
    let mut slices = vec![Slice::new([0, cu[2]], [0, cu[2]], SliceKind::Causal)];
    if documents.len() > 2 {
        slices.push(Slice::new([cu[2], s], [0, cu[1]], SliceKind::Full));
    }
    for i in 2..documents.len() {
        slices.push(Slice::new(
            [cu[i], cu[i + 1]],
            [cu[i], cu[i + 1]],
            SliceKind::Causal,
        ));
    }
    slices
}

/// A prefix-LM document `[start, end)`: keys of the first `p` tokens are visible to all its
/// queries; the rest is causal.
fn prefix_slices(start: u64, end: u64, p: u64) -> Vec<Slice> {
    if start + p >= end {
        return vec![Slice::new([start, end], [start, end], SliceKind::Full)];
    }
    vec![
        Slice::new([start, start + p], [start, start + p], SliceKind::Full),
        Slice::new([start + p, end], [start, end], SliceKind::Causal),
    ]
}

/// Block-sparse patterns: every query block keeps `clamp(floor(density·n), 1, n)` key blocks
/// chosen uniformly at random, independently per mask of the scope.
fn block_sparse(
    params: &Params,
    rng: &mut PyRandom,
    drawn: &mut Drawn,
) -> Result<(HeadScope, Vec<Mask>), GenerateError> {
    let s = params.seqlen;
    if !(params.density > 0.0 && params.density <= 1.0) {
        return Err(GenerateError::Density(params.density));
    }
    if params.sparse_block == 0 || params.sparse_block > s {
        return Err(GenerateError::SparseBlock {
            block: params.sparse_block,
            seqlen: s,
        });
    }
    let scope = params.sparse_scope;
    let count = match scope {
        HeadScope::Shared => 1,
        HeadScope::PerKvGroup => params.heads_kv,
        HeadScope::PerHead => params.heads_q,
    };
    if params.heads_kv == 0 || !params.heads_q.is_multiple_of(params.heads_kv) {
        return Err(GenerateError::Heads {
            heads_q: params.heads_q,
            heads_kv: params.heads_kv,
        });
    }
    let variable = params.mask == Pattern::BlockSparseVariable;
    let n = if variable {
        s / params.sparse_block
    } else {
        s.div_ceil(params.sparse_block)
    };
    if variable && n.saturating_mul(params.min_block) > s {
        return Err(GenerateError::MinBlock {
            blocks: n,
            min_block: params.min_block,
            seqlen: s,
        });
    }
    let keep = ((params.density * n as f64).floor() as u64).clamp(1, n);
    drawn.insert("blocks".into(), json!(n));
    drawn.insert("kept_per_row".into(), json!(keep));
    let mut masks = Vec::with_capacity(count as usize);
    let mut picks: Vec<u64> = Vec::with_capacity(n as usize);
    for _ in 0..count {
        let (rows, cols) = if variable {
            (
                random_partition(s, n, params.min_block, rng),
                random_partition(s, n, params.min_block, rng),
            )
        } else {
            let bounds: Vec<u64> = (0..=n).map(|i| (i * params.sparse_block).min(s)).collect();
            (bounds.clone(), bounds)
        };
        let mut slices = Vec::new();
        for qb in 0..n as usize {
            picks.clear();
            picks.extend(0..n);
            for i in 0..keep as usize {
                let j = i + rng.randbelow(n - i as u64) as usize;
                picks.swap(i, j);
            }
            let chosen = &mut picks[..keep as usize];
            chosen.sort_unstable();
            // Adjacent key blocks become one slice.
            let mut run_start = chosen[0];
            for index in 0..chosen.len() {
                let current = chosen[index];
                let ends_run = index + 1 == chosen.len() || chosen[index + 1] != current + 1;
                if ends_run {
                    slices.push(Slice::new(
                        [rows[qb], rows[qb + 1]],
                        [cols[run_start as usize], cols[current as usize + 1]],
                        SliceKind::Full,
                    ));
                    if index + 1 < chosen.len() {
                        run_start = chosen[index + 1];
                    }
                }
            }
        }
        masks.push(Mask::square(s, slices)?);
    }
    let area: u64 = masks.iter().map(Mask::area).sum();
    drawn.insert(
        "density_actual".into(),
        json!(area as f64 / (count as f64 * s as f64 * s as f64)),
    );
    Ok((scope, masks))
}

/// Block boundaries of `n` blocks of at least `min` tokens summing to `total`: the extra tokens
/// are split at `n − 1` uniform cut points (drawn with replacement, sorted).
fn random_partition(total: u64, n: u64, min: u64, rng: &mut PyRandom) -> Vec<u64> {
    let extra = total - n * min;
    let mut cuts: Vec<u64> = (1..n)
        .map(|_| rng.randint(0, extra as i64) as u64)
        .collect();
    cuts.sort_unstable();
    let mut bounds = Vec::with_capacity(n as usize + 1);
    bounds.push(0);
    for (i, &cut) in cuts.iter().chain(std::iter::once(&extra)).enumerate() {
        bounds.push((i as u64 + 1) * min + cut);
    }
    bounds
}

#[cfg(test)]
mod tests;
