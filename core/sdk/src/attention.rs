//! The in-process attention backend: how a kernel plugin lends its kernel to context-parallel
//! plugins, which run it on every (query chunk, key chunk) block of their algorithms without a
//! worker round trip.
//!
//! A kernel plugin lists the kernels it offers in its manifest ([`crate::PluginManifest::attention`])
//! and implements [`crate::Plugin::attention`]; a caller opens the plugin's library with
//! [`Backend::open`] and hands it [`AttentionCall`]s. The mask of a block travels as
//! [`RowIntervals`]: every row's allowed keys in the block's own coordinates, which is exact for
//! any mask restricted to any rows and keys (a chunk of a zigzag layout, keys gathered from
//! several ranks) where slices would have to be cut.

use std::ffi::c_void;
use std::path::{Path, PathBuf};

use attnbench_abi::abi_stable::library::lib_header_from_path;
use attnbench_abi::abi_stable::std_types::{RResult, RSlice, RStr};
use attnbench_abi::PluginModRef;
pub use attnbench_abi::{AttentionCall, DType, Memory};

use crate::mask::{BlockMask, Mask};
use crate::PluginManifest;

/// Why an in-process attention call was refused or failed. Across the ABI it travels as its
/// message; a [`Backend`] gives it back as [`AttentionError::Backend`], named by the backend.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AttentionError {
    /// The plugin offers no in-process kernel of that name.
    #[error("no in-process attention kernel `{kernel}`; {offered}")]
    UnknownKernel { kernel: String, offered: String },
    /// The call breaks [`AttentionCall`]'s contract (its rows, heads or pointers): what is wrong.
    #[error("{0}")]
    Malformed(String),
    /// The kernel cannot take this call (its dtypes, memory, lengths or head layout): why.
    #[error("{0}")]
    Unsupported(String),
    /// The kernel took the call and failed running it (a device error…).
    #[error("{0}")]
    Failed(String),
    /// The library at `path` cannot serve as a backend.
    #[error("{}: {why}", path.display())]
    Open { path: PathBuf, why: String },
    /// What the backend `plugin/kernel` answered.
    #[error("{backend}: {message}")]
    Backend { backend: String, message: String },
}

/// A mask restricted to a block: row `r` of the block may see the local keys
/// `[intervals[2i], intervals[2i+1])` for `i` in `row_start[r]..row_start[r+1]` (sorted, disjoint).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RowIntervals {
    pub row_start: Vec<u32>,
    pub intervals: Vec<u32>,
}

impl RowIntervals {
    /// `mask` restricted to the rows at global positions `q_positions` and the keys at global
    /// positions `k_positions` (each list in the block's order, any order), in local coordinates.
    pub fn restrict(mask: &Mask, q_positions: &[u32], k_positions: &[u32]) -> RowIntervals {
        // Runs of consecutive key positions: (first position, length, local offset).
        let mut runs: Vec<(u64, u64, u64)> = Vec::new();
        for (local, &p) in k_positions.iter().enumerate() {
            match runs.last_mut() {
                Some((first, length, _)) if *first + *length == p as u64 => *length += 1,
                _ => runs.push((p as u64, 1, local as u64)),
            }
        }
        // Rows in increasing position against slices by first row, so that each row meets only
        // the slices that hold it (a block-sparse mask has hundreds of thousands).
        let mut slices: Vec<&crate::mask::Slice> = mask.slices.iter().collect();
        slices.sort_by_key(|s| s.q[0]);
        let mut order: Vec<usize> = (0..q_positions.len()).collect();
        order.sort_by_key(|&i| q_positions[i]);
        let mut rows: Vec<Vec<u32>> = vec![Vec::new(); q_positions.len()];
        let (mut next, mut active) = (0, Vec::new());
        let mut global = Vec::new();
        let mut local = Vec::new();
        for &row in &order {
            let q = q_positions[row] as u64;
            while next < slices.len() && slices[next].q[0] <= q {
                active.push(slices[next]);
                next += 1;
            }
            active.retain(|s| q < s.q[1]);
            global.clear();
            global.extend(active.iter().filter_map(|s| s.keys_of_row(q)));
            local.clear();
            for &(a, b) in &global {
                for &(first, length, offset) in &runs {
                    let (lo, hi) = (a.max(first), b.min(first + length));
                    if lo < hi {
                        local.push((offset + lo - first, offset + hi - first));
                    }
                }
            }
            local.sort_unstable();
            let intervals = &mut rows[row];
            let mut merged: Option<(u64, u64)> = None;
            for &(a, b) in &local {
                merged = match merged {
                    Some((start, end)) if a <= end => Some((start, end.max(b))),
                    Some((start, end)) => {
                        intervals.extend([start as u32, end as u32]);
                        Some((a, b))
                    }
                    None => Some((a, b)),
                };
            }
            if let Some((start, end)) = merged {
                intervals.extend([start as u32, end as u32]);
            }
        }
        RowIntervals::from_lists(rows)
    }

    /// Rows given as lists of flattened `[start, end)` pairs, one list per row.
    fn from_lists(rows: Vec<Vec<u32>>) -> RowIntervals {
        let mut result = RowIntervals {
            row_start: Vec::with_capacity(rows.len() + 1),
            intervals: Vec::with_capacity(rows.iter().map(Vec::len).sum()),
        };
        result.row_start.push(0);
        for intervals in rows {
            result.intervals.extend(intervals);
            result.row_start.push((result.intervals.len() / 2) as u32);
        }
        result
    }

    /// The same mask seen by columns: for each of the `k_len` keys, the rows that may see it, as
    /// intervals (the row intervals of the transposed mask). A kernel that walks a key tile's
    /// queries tests its fixed keys against these, where the rows' own intervals would cost a
    /// lookup per query.
    pub fn transpose(&self, k_len: usize) -> RowIntervals {
        let rows = self.row_start.len() - 1;
        // Per key, the row where its current run of allowed rows began.
        let mut open = vec![u32::MAX; k_len];
        let mut columns: Vec<Vec<u32>> = vec![Vec::new(); k_len];
        let mut previous: Vec<(usize, usize)> = Vec::new();
        let raw = |r: usize| {
            &self.intervals[2 * self.row_start[r] as usize..2 * self.row_start[r + 1] as usize]
        };
        // Between one row and the next only the keys where they differ open or close a run, so
        // the sweep costs the changes, not rows × keys (and a row like the one before, as in
        // the bands of a block mask, costs one comparison).
        for r in 0..=rows {
            if r > 0 && r < rows && raw(r) == raw(r - 1) {
                continue;
            }
            let current: Vec<(usize, usize)> = if r < rows {
                merged(self.row(r))
            } else {
                Vec::new()
            };
            for (a, b) in differing(&previous, &current) {
                for key in a..b.min(k_len) {
                    if open[key] == u32::MAX {
                        open[key] = r as u32;
                    } else {
                        columns[key].extend([open[key], r as u32]);
                        open[key] = u32::MAX;
                    }
                }
            }
            previous = current;
        }
        RowIntervals::from_lists(columns)
    }

    /// The allowed local keys of row `r`, as `[start, end)` pairs.
    pub fn row(&self, r: usize) -> impl Iterator<Item = (usize, usize)> + '_ {
        let (first, last) = (self.row_start[r] as usize, self.row_start[r + 1] as usize);
        self.intervals[2 * first..2 * last]
            .chunks_exact(2)
            .map(|pair| (pair[0] as usize, pair[1] as usize))
    }

    /// A call's rows, checked: one start per row and one more, increasing from 0, and each
    /// interval non-empty and within the block's keys.
    pub fn of_call(call: &AttentionCall<'_>) -> Result<RowIntervals, AttentionError> {
        let rows = RowIntervals {
            row_start: call.row_start.as_slice().to_vec(),
            intervals: call.intervals.as_slice().to_vec(),
        };
        let q_len = call.q_len as usize;
        if rows.row_start.len() != q_len + 1
            || rows.row_start.first() != Some(&0)
            || rows.row_start.windows(2).any(|w| w[0] > w[1])
            || *rows.row_start.last().unwrap_or(&0) as usize * 2 != rows.intervals.len()
            || rows
                .intervals
                .chunks_exact(2)
                .any(|p| p[0] >= p[1] || p[1] as u64 > call.k_len)
        {
            return Err(AttentionError::Malformed(format!(
                "malformed mask: {} row starts and {} interval bounds for {} rows of {} keys",
                rows.row_start.len(),
                rows.intervals.len(),
                q_len,
                call.k_len
            )));
        }
        Ok(rows)
    }

    /// The block mask of these rows over `k_len` keys at `block_q × block_k` tiles: what
    /// [`Mask::block_mask`] gives for the mask they were restricted from. A tile is full when
    /// every row of it allows every key of it, partial when some row allows some key.
    pub fn block_mask(&self, k_len: u64, block_q: u64, block_k: u64) -> BlockMask {
        assert!(block_q > 0 && block_k > 0, "tile sizes must be positive");
        let q_len = (self.row_start.len() - 1) as u64;
        let k_tiles = k_len.div_ceil(block_k) as usize;
        let mut result = BlockMask {
            block_q,
            block_k,
            seqlen_q: q_len,
            seqlen_k: k_len,
            row_start: Vec::new(),
            key_tiles: Vec::new(),
            full: Vec::new(),
        };
        // Per key tile of one band of rows: rows covering it whole, rows touching it.
        let (mut covering, mut touching) = (vec![0i64; k_tiles + 1], vec![0i64; k_tiles + 1]);
        for t in 0..q_len.div_ceil(block_q) {
            result.row_start.push(result.key_tiles.len());
            let (r0, r1) = (t * block_q, ((t + 1) * block_q).min(q_len));
            covering.iter_mut().for_each(|c| *c = 0);
            touching.iter_mut().for_each(|c| *c = 0);
            for r in r0..r1 {
                for (a, b) in merged(self.row(r as usize)) {
                    let (a, b) = (a as u64, b as u64);
                    touching[(a / block_k) as usize] += 1;
                    touching[((b - 1) / block_k) as usize + 1] -= 1;
                    let first = a.div_ceil(block_k);
                    let end = if b >= k_len {
                        k_tiles as u64
                    } else {
                        b / block_k
                    };
                    if first < end {
                        covering[first as usize] += 1;
                        covering[end as usize] -= 1;
                    }
                }
            }
            let (mut covered, mut touched) = (0, 0);
            for kt in 0..k_tiles {
                covered += covering[kt];
                touched += touching[kt];
                if touched > 0 {
                    result.key_tiles.push(kt as u32);
                    result.full.push(covered == (r1 - r0) as i64);
                }
            }
        }
        result.row_start.push(result.key_tiles.len());
        result
    }
}

/// The ranges where exactly one of two sorted, disjoint interval lists holds, in one merge pass.
fn differing(x: &[(usize, usize)], y: &[(usize, usize)]) -> Vec<(usize, usize)> {
    let mut points: Vec<usize> = x.iter().chain(y).flat_map(|&(a, b)| [a, b]).collect();
    points.sort_unstable();
    points.dedup();
    // The first interval of each list that ends after the current point.
    let (mut ix, mut iy) = (0, 0);
    let mut out: Vec<(usize, usize)> = Vec::new();
    for pair in points.windows(2) {
        let p = pair[0];
        while ix < x.len() && x[ix].1 <= p {
            ix += 1;
        }
        while iy < y.len() && y[iy].1 <= p {
            iy += 1;
        }
        let in_x = ix < x.len() && x[ix].0 <= p;
        let in_y = iy < y.len() && y[iy].0 <= p;
        if in_x != in_y {
            match out.last_mut() {
                Some(last) if last.1 == p => last.1 = pair[1],
                _ => out.push((p, pair[1])),
            }
        }
    }
    out
}

/// Intervals with the touching ones joined: [0, 5) and [5, 9) cover a tile as [0, 9) does.
fn merged(intervals: impl Iterator<Item = (usize, usize)>) -> Vec<(usize, usize)> {
    let mut out: Vec<(usize, usize)> = Vec::new();
    for (a, b) in intervals {
        match out.last_mut() {
            Some(last) if last.1 == a => last.1 = b,
            _ => out.push((a, b)),
        }
    }
    out
}

/// One block on the host, in f64: the shape of an [`AttentionCall`] and its mask.
#[derive(Debug, Clone, Copy)]
pub struct HostBlock<'a> {
    pub head_dim: usize,
    pub q_len: usize,
    pub k_len: usize,
    pub scale: f64,
    /// Local KV head of each local query head (its length is the number of query heads).
    pub kv_head_of: &'a [u32],
    pub heads_kv: usize,
    pub rows: &'a RowIntervals,
}

impl HostBlock<'_> {
    fn heads_q(&self) -> usize {
        self.kv_head_of.len()
    }

    /// The allowed keys of row `t` of query head `h` with their scaled scores.
    fn scores(&self, q: &[f64], k: &[f64], h: usize, t: usize) -> Vec<(usize, f64)> {
        let d = self.head_dim;
        let query = &q[(h * self.q_len + t) * d..][..d];
        let kv = self.kv_head_of[h] as usize;
        self.rows
            .row(t)
            .flat_map(|(a, b)| a..b)
            .map(|j| {
                let key = &k[(kv * self.k_len + j) * d..][..d];
                let dot: f64 = query.iter().zip(key).map(|(x, y)| x * y).sum();
                (j, dot * self.scale)
            })
            .collect()
    }

    /// O and LSE of the block's rows over its keys (O = 0, LSE = −∞ where a row sees none).
    pub fn forward(&self, q: &[f64], k: &[f64], v: &[f64], out: &mut [f64], lse: &mut [f64]) {
        let d = self.head_dim;
        out.fill(0.0);
        lse.fill(f64::NEG_INFINITY);
        for h in 0..self.heads_q() {
            let kv = self.kv_head_of[h] as usize;
            for t in 0..self.q_len {
                let scores = self.scores(q, k, h, t);
                if scores.is_empty() {
                    continue;
                }
                let top = scores.iter().map(|s| s.1).fold(f64::NEG_INFINITY, f64::max);
                let total: f64 = scores.iter().map(|s| (s.1 - top).exp()).sum();
                let row = h * self.q_len + t;
                lse[row] = top + total.ln();
                let o = &mut out[row * d..][..d];
                for &(j, score) in &scores {
                    let p = (score - lse[row]).exp();
                    for (o, x) in o.iter_mut().zip(&v[(kv * self.k_len + j) * d..][..d]) {
                        *o += p * x;
                    }
                }
            }
        }
    }

    /// The block's share of the gradients given the rows' final O and LSE (over all their keys)
    /// and dO: P = exp(S − LSE), dS = P∘(dO·Vᵀ − rowsum(dO∘O))·scale; dQ for the rows, dK and dV
    /// for the block's keys (overwritten).
    #[allow(clippy::too_many_arguments)]
    pub fn backward(
        &self,
        (q, k, v): (&[f64], &[f64], &[f64]),
        out: &[f64],
        lse: &[f64],
        d_out: &[f64],
        dq: &mut [f64],
        dk: &mut [f64],
        dv: &mut [f64],
    ) {
        let d = self.head_dim;
        dq.fill(0.0);
        dk.fill(0.0);
        dv.fill(0.0);
        for h in 0..self.heads_q() {
            let kv = self.kv_head_of[h] as usize;
            for t in 0..self.q_len {
                let row = h * self.q_len + t;
                if lse[row] == f64::NEG_INFINITY {
                    continue;
                }
                let d_o = &d_out[row * d..][..d];
                let delta: f64 = d_o
                    .iter()
                    .zip(&out[row * d..][..d])
                    .map(|(a, b)| a * b)
                    .sum();
                let query = &q[row * d..][..d];
                for (j, score) in self.scores(q, k, h, t) {
                    let p = (score - lse[row]).exp();
                    let key_row = (kv * self.k_len + j) * d;
                    let dp: f64 = d_o.iter().zip(&v[key_row..][..d]).map(|(a, b)| a * b).sum();
                    let ds = p * (dp - delta) * self.scale;
                    for i in 0..d {
                        dq[row * d + i] += ds * k[key_row + i];
                        dk[key_row + i] += ds * query[i];
                        dv[key_row + i] += p * d_o[i];
                    }
                }
            }
        }
    }
}

/// Refuses a call missing a tensor it needs: Q, K, V, O and LSE always, dO, dQ, dK and dV in a
/// backward call.
pub fn require_tensors(call: &AttentionCall<'_>) -> Result<(), AttentionError> {
    let always = [
        call.q,
        call.k,
        call.v,
        call.out as *const c_void,
        call.lse as *const c_void,
    ];
    let backward = [
        call.d_out,
        call.dq as *const c_void,
        call.dk as *const c_void,
        call.dv as *const c_void,
    ];
    if always.iter().any(|p| p.is_null()) || (call.backward && backward.iter().any(|p| p.is_null()))
    {
        return Err(AttentionError::Malformed(
            "a tensor pointer the call needs is null".into(),
        ));
    }
    Ok(())
}

/// Runs `call` on the host in f64 ([`HostBlock`]): the reference any backend can offer for
/// host memory. Refuses, with the reason, what is not a host f64 call.
pub fn run_on_host(call: &AttentionCall<'_>) -> Result<(), AttentionError> {
    if call.memory != Memory::Host || call.input != DType::F64 || call.output != DType::F64 {
        return Err(AttentionError::Unsupported(format!(
            "this backend runs host memory in f64, not {:?} memory with {:?} inputs and {:?} outputs",
            call.memory, call.input, call.output
        )));
    }
    let rows = RowIntervals::of_call(call)?;
    let (hq, hkv, d) = (
        call.heads_q as usize,
        call.heads_kv as usize,
        call.head_dim as usize,
    );
    let (ql, kl) = (call.q_len as usize, call.k_len as usize);
    if call.kv_head_of.len() != hq || call.kv_head_of.iter().any(|&h| h as usize >= hkv) {
        return Err(AttentionError::Malformed(format!(
            "kv_head_of must name one of {hkv} KV heads for each of {hq} query heads"
        )));
    }
    let block = HostBlock {
        head_dim: d,
        q_len: ql,
        k_len: kl,
        scale: call.scale,
        kv_head_of: call.kv_head_of.as_slice(),
        heads_kv: hkv,
        rows: &rows,
    };
    require_tensors(call)?;
    // SAFETY: the caller of the ABI promises host buffers of these extents (AttentionCall's
    // contract); the outputs do not alias the inputs.
    unsafe {
        let input = |p: *const c_void, n: usize| std::slice::from_raw_parts(p as *const f64, n);
        let output = |p: *mut c_void, n: usize| std::slice::from_raw_parts_mut(p as *mut f64, n);
        let (q, k, v) = (
            input(call.q, hq * ql * d),
            input(call.k, hkv * kl * d),
            input(call.v, hkv * kl * d),
        );
        if call.backward {
            block.backward(
                (q, k, v),
                input(call.out, hq * ql * d),
                input(call.lse, hq * ql),
                input(call.d_out, hq * ql * d),
                output(call.dq, hq * ql * d),
                output(call.dk, hkv * kl * d),
                output(call.dv, hkv * kl * d),
            );
        } else {
            block.forward(
                q,
                k,
                v,
                output(call.out, hq * ql * d),
                output(call.lse, hq * ql),
            );
        }
    }
    Ok(())
}

/// A kernel plugin's in-process attention backend, opened from its library (which stays loaded
/// for the life of the process).
pub struct Backend {
    entry: extern "C" fn(
        RStr<'_>,
        &AttentionCall<'_>,
    ) -> RResult<(), attnbench_abi::abi_stable::std_types::RString>,
    kernel: String,
    /// `plugin/kernel`, for messages.
    pub name: String,
}

impl Backend {
    /// Loads the plugin library at `path` and checks that it offers `kernel` in process.
    pub fn open(path: &Path, kernel: &str) -> Result<Backend, AttentionError> {
        let refuse = |why: String| AttentionError::Open {
            path: path.to_path_buf(),
            why,
        };
        let header = lib_header_from_path(path).map_err(|err| refuse(err.to_string()))?;
        let module = header
            .init_root_module::<PluginModRef>()
            .map_err(|err| refuse(err.to_string()))?;
        let manifest: PluginManifest = serde_json::from_str((module.manifest())().as_str())
            .map_err(|err| refuse(format!("unreadable manifest: {err}")))?;
        let name = format!("{}/{kernel}", manifest.name);
        let entry = module
            .attention()
            .filter(|_| manifest.attention.iter().any(|k| k == kernel));
        let Some(entry) = entry else {
            let offered = if manifest.attention.is_empty() {
                "none".to_string()
            } else {
                manifest.attention.join(", ")
            };
            return Err(AttentionError::UnknownKernel {
                kernel: kernel.to_string(),
                offered: format!("plugin `{}` offers: {offered}", manifest.name),
            });
        };
        Ok(Backend {
            entry,
            kernel: kernel.to_string(),
            name,
        })
    }

    /// Runs one call. The caller keeps the call's buffers alive and sized as its contract says.
    pub fn call(&self, call: &AttentionCall<'_>) -> Result<(), AttentionError> {
        match (self.entry)(RStr::from_str(&self.kernel), call) {
            RResult::ROk(()) => Ok(()),
            RResult::RErr(message) => Err(AttentionError::Backend {
                backend: self.name.clone(),
                message: message.into(),
            }),
        }
    }

    /// [`HostBlock::forward`] through this backend.
    pub fn forward_host(
        &self,
        block: &HostBlock<'_>,
        (q, k, v): (&[f64], &[f64], &[f64]),
        out: &mut [f64],
        lse: &mut [f64],
    ) -> Result<(), AttentionError> {
        let call = host_call(block, (q, k, v), out.as_mut_ptr(), lse.as_mut_ptr(), None);
        self.call(&call)
    }

    /// [`HostBlock::backward`] through this backend.
    #[allow(clippy::too_many_arguments)]
    pub fn backward_host(
        &self,
        block: &HostBlock<'_>,
        (q, k, v): (&[f64], &[f64], &[f64]),
        out: &[f64],
        lse: &[f64],
        d_out: &[f64],
        (dq, dk, dv): (&mut [f64], &mut [f64], &mut [f64]),
    ) -> Result<(), AttentionError> {
        let grads = (
            d_out.as_ptr(),
            dq.as_mut_ptr(),
            dk.as_mut_ptr(),
            dv.as_mut_ptr(),
        );
        let call = host_call(
            block,
            (q, k, v),
            out.as_ptr() as *mut f64,
            lse.as_ptr() as *mut f64,
            Some(grads),
        );
        self.call(&call)
    }
}

type GradPointers = (*const f64, *mut f64, *mut f64, *mut f64);

fn host_call<'a>(
    block: &'a HostBlock<'a>,
    (q, k, v): (&[f64], &[f64], &[f64]),
    out: *mut f64,
    lse: *mut f64,
    grads: Option<GradPointers>,
) -> AttentionCall<'a> {
    let mut call = block.call(Memory::Host, (DType::F64, DType::F64), grads.is_some());
    call.q = q.as_ptr() as *const c_void;
    call.k = k.as_ptr() as *const c_void;
    call.v = v.as_ptr() as *const c_void;
    call.out = out as *mut c_void;
    call.lse = lse as *mut c_void;
    if let Some((d_out, dq, dk, dv)) = grads {
        call.d_out = d_out as *const c_void;
        call.dq = dq as *mut c_void;
        call.dk = dk as *mut c_void;
        call.dv = dv as *mut c_void;
    }
    call
}

impl<'a> HostBlock<'a> {
    /// A call of this block's shape and mask in `memory`, with (input, output) element types;
    /// its tensor pointers and stream are null, for the caller to set.
    pub fn call(
        &self,
        memory: Memory,
        (input, output): (DType, DType),
        backward: bool,
    ) -> AttentionCall<'a> {
        let null = std::ptr::null_mut::<c_void>();
        AttentionCall {
            memory,
            input,
            output,
            backward,
            heads_q: self.kv_head_of.len() as u32,
            heads_kv: self.heads_kv as u32,
            head_dim: self.head_dim as u32,
            q_len: self.q_len as u64,
            k_len: self.k_len as u64,
            scale: self.scale,
            kv_head_of: RSlice::from_slice(self.kv_head_of),
            row_start: RSlice::from_slice(&self.rows.row_start),
            intervals: RSlice::from_slice(&self.rows.intervals),
            q: null,
            k: null,
            v: null,
            out: null,
            lse: null,
            d_out: null,
            dq: null,
            dk: null,
            dv: null,
            stream: null,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mask::{Slice, SliceKind};

    #[test]
    fn restriction_maps_global_intervals_onto_local_keys() {
        // Causal over 8 tokens; rows {5, 1}, keys {4, 5, 6, 0, 1} (two runs, out of order).
        let mask = Mask::square(8, vec![Slice::new([0, 8], [0, 8], SliceKind::Causal)]).unwrap();
        let rows = RowIntervals::restrict(&mask, &[5, 1], &[4, 5, 6, 0, 1]);
        let row = |r| rows.row(r).collect::<Vec<_>>();
        // Row 5 sees keys 0..=5: local 0, 1 (positions 4, 5) and 3, 4 (positions 0, 1).
        assert_eq!(row(0), vec![(0, 2), (3, 5)]);
        // Row 1 sees keys 0 and 1: local 3 and 4.
        assert_eq!(row(1), vec![(3, 5)]);
        for (r, &q) in [5u32, 1].iter().enumerate() {
            for (j, &k) in [4u32, 5, 6, 0, 1].iter().enumerate() {
                let local = rows.row(r).any(|(a, b)| a <= j && j < b);
                assert_eq!(local, mask.allows(q as u64, k as u64), "row {q}, key {k}");
            }
        }
    }

    proptest::proptest! {
        /// A key's column intervals hold exactly the rows whose intervals hold the key, and each
        /// column's intervals are sorted, disjoint and not touching (one interval per run).
        #[test]
        fn transpose_holds_the_rows_that_see_each_key(
            rows in proptest::collection::vec(
                proptest::collection::vec((0usize..40, 1usize..12), 0..4), 1..40),
        ) {
            let k_len = 48;
            let mut mask = RowIntervals { row_start: vec![0], intervals: Vec::new() };
            for row in &rows {
                let mut spans: Vec<(usize, usize)> =
                    row.iter().map(|&(a, n)| (a, (a + n).min(k_len))).collect();
                spans.sort_unstable();
                let mut end = 0;
                for (a, b) in spans {
                    let a = a.max(end);
                    if a < b {
                        mask.intervals.extend([a as u32, b as u32]);
                        end = b;
                    }
                }
                mask.row_start.push((mask.intervals.len() / 2) as u32);
            }
            let columns = mask.transpose(k_len);
            proptest::prop_assert_eq!(columns.row_start.len(), k_len + 1);
            for key in 0..k_len {
                let runs: Vec<(usize, usize)> = columns.row(key).collect();
                proptest::prop_assert!(runs.windows(2).all(|w| w[0].1 < w[1].0), "key {}: {:?}", key, runs);
                for r in 0..rows.len() {
                    let by_row = mask.row(r).any(|(a, b)| a <= key && key < b);
                    let by_column = runs.iter().any(|&(a, b)| a <= r && r < b);
                    proptest::prop_assert_eq!(by_row, by_column, "row {}, key {}", r, key);
                }
            }
        }
    }
}
