//! Reference attention, shared by every kernel plugin and by `attnbench plugins check`: the
//! problem's layout, inputs drawn from a seed (so a host and a plugin can generate the same
//! tensors), the naive f64 kernel, tensor files, and the error metric.
//!
//! The tensors of one attention problem and how they are laid out.
//!
//! Q, dQ: `[heads_q][seqlen][head_dim]`; K, dK: `[heads_kv][seqlen][head_dim]`; V, dV:
//! `[heads_kv][seqlen][value_dim]`; O, dO: `[heads_q][seqlen][value_dim]`; LSE: `[heads_q][seqlen]`.
//! The value dim is the head dim unless `head_dim_v` says otherwise (MLA: 192 and 128). Query head `h` reads KV head `h / (heads_q / heads_kv)` (GQA).
//! Convention everywhere: a row with no allowed key has output 0 and LSE −∞ (never NaN), and
//! contributes nothing to the gradients.

mod check;
mod naive;
mod stream;

use std::path::Path;

use crate::mask::MaskSet;
use crate::PluginError;

pub use check::{check, pick_rows, reference_rows, sample_rows, CheckMode};
pub use naive::{backward, backward_with_threads, forward, forward_with_threads, score_bytes};
pub use stream::{RandomInputs, UniformStream};

/// An attention problem's layout: query and key/value heads, tokens (queries = keys) and the
/// head dimension. Kernels, the reference and measurement records share it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Shape {
    pub heads_q: usize,
    pub heads_kv: usize,
    pub seqlen: usize,
    /// Query and key head dim.
    pub head_dim: usize,
    /// Value (and output) head dim where it differs from `head_dim`; `None`: equal.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub head_dim_v: Option<usize>,
}

impl Shape {
    /// A shape whose values have the head dim of queries and keys.
    pub const fn new(heads_q: usize, heads_kv: usize, seqlen: usize, head_dim: usize) -> Shape {
        Shape {
            heads_q,
            heads_kv,
            seqlen,
            head_dim,
            head_dim_v: None,
        }
    }

    pub fn group(&self) -> usize {
        self.heads_q / self.heads_kv
    }

    pub fn kv_head(&self, head: usize) -> usize {
        head / self.group()
    }

    pub fn scale(&self) -> f32 {
        1.0 / (self.head_dim as f32).sqrt()
    }

    /// Value and output head dim.
    pub fn value_dim(&self) -> usize {
        self.head_dim_v.unwrap_or(self.head_dim)
    }

    /// `head_dim_v` as a shape keeps it: `None` when it equals `head_dim`.
    pub fn with_value_dim(mut self, value_dim: Option<usize>) -> Shape {
        self.head_dim_v = value_dim.filter(|&v| v != self.head_dim);
        self
    }

    /// Values of Q (and dQ).
    pub fn q_len(&self) -> usize {
        self.heads_q * self.seqlen * self.head_dim
    }

    /// Values of K (and dK).
    pub fn kv_len(&self) -> usize {
        self.heads_kv * self.seqlen * self.head_dim
    }

    /// Values of V (and dV).
    pub fn v_len(&self) -> usize {
        self.heads_kv * self.seqlen * self.value_dim()
    }

    /// Values of O (and dO).
    pub fn out_len(&self) -> usize {
        self.heads_q * self.seqlen * self.value_dim()
    }

    /// Where Q, K, V and dO start in the one stream of seeded values.
    fn tensor_starts(&self) -> [usize; 4] {
        let (q, k, v) = (self.q_len(), self.kv_len(), self.v_len());
        [0, q, q + k, q + k + v]
    }
}

/// Inputs of one problem.
#[derive(Debug, Clone)]
pub struct Inputs {
    pub q: Vec<f32>,
    pub k: Vec<f32>,
    pub v: Vec<f32>,
    /// The gradient flowing into O, for the backward pass.
    pub d_out: Vec<f32>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Forward {
    pub out: Vec<f32>,
    pub lse: Vec<f32>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Grads {
    pub dq: Vec<f32>,
    pub dk: Vec<f32>,
    pub dv: Vec<f32>,
}

/// How a kernel computes what is checked against the f64 reference; [`Arithmetic::tolerance`]
/// is the one table of the relative errors (the largest |actual − reference| over the largest
/// |reference|) every check allows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arithmetic {
    /// f64 throughout (the CP methods): only the outputs' rounding to f32 remains.
    F64,
    /// f32 products and accumulation on inputs of any type (the CPU kernels).
    F32,
    /// f32 accumulation with matrix products that may run in TF32, a library's choice (PyTorch's
    /// backends) or a third-party kernel's: 10 mantissa bits, about 1e-3 of the largest value.
    Tf32,
    /// f32 accumulation with P and dS rounded to the inputs' type before their products, as GPU
    /// kernels on 16-bit inputs do (on f32 inputs, the same as `F32`).
    RoundedTo(Element),
}

impl Arithmetic {
    pub const fn tolerance(self) -> f64 {
        match self {
            Arithmetic::F64 => 1e-5,
            Arithmetic::F32 | Arithmetic::RoundedTo(Element::F32) => 1e-4,
            Arithmetic::Tf32 => 2e-3,
            Arithmetic::RoundedTo(Element::F16) => 5e-3,
            Arithmetic::RoundedTo(Element::Bf16) => 2e-2,
        }
    }
}

crate::named_enum! {
    /// How a kernel stores its inputs. Inputs drawn for an element type are exactly representable
    /// in it, so a kernel and the f64 reference see the same numbers. A stage's `dtype` parameter
    /// and a measurement's `dtype` spell it `f32`, `bf16` or `fp16`.
    pub enum Element { F32 = "f32", Bf16 = "bf16", F16 = "fp16" }
}

impl Element {
    /// The relative error a GPU kernel storing this type is allowed against the f64 reference:
    /// [`Arithmetic::RoundedTo`] this type.
    pub fn tolerance(self) -> f64 {
        Arithmetic::RoundedTo(self).tolerance()
    }

    pub fn bytes(self) -> usize {
        match self {
            Element::F32 => 4,
            Element::Bf16 | Element::F16 => 2,
        }
    }

    /// The nearest representable value (ties to even).
    pub fn round(self, value: f32) -> f32 {
        match self {
            Element::F32 => value,
            Element::Bf16 => round_bf16(value),
            Element::F16 => half::f16::from_f32(value).to_f32(),
        }
    }

    /// Little-endian bytes of `values` in this type (values are rounded first).
    pub fn encode(self, values: &[f32]) -> Vec<u8> {
        match self {
            Element::F32 => values.iter().flat_map(|v| v.to_le_bytes()).collect(),
            Element::Bf16 => values
                .iter()
                .flat_map(|v| ((round_bf16(*v).to_bits() >> 16) as u16).to_le_bytes())
                .collect(),
            Element::F16 => values
                .iter()
                .flat_map(|v| half::f16::from_f32(*v).to_bits().to_le_bytes())
                .collect(),
        }
    }

    /// Values back from little-endian bytes of this type (what a kernel wrote).
    pub fn decode(self, bytes: &[u8]) -> Vec<f32> {
        match self {
            Element::F32 => bytes
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect(),
            Element::Bf16 => bytes
                .chunks_exact(2)
                .map(|b| f32::from_bits(u32::from(u16::from_le_bytes([b[0], b[1]])) << 16))
                .collect(),
            Element::F16 => bytes
                .chunks_exact(2)
                .map(|b| half::f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32())
                .collect(),
        }
    }
}

impl Inputs {
    /// Uniform values in [−1, 1) from `seed` (splitmix64), optionally rounded to bf16.
    pub fn random(shape: &Shape, seed: u64, bf16: bool) -> Inputs {
        let element = if bf16 { Element::Bf16 } else { Element::F32 };
        Inputs::random_as(shape, seed, element)
    }

    /// Uniform values in [−1, 1) from `seed` (splitmix64, one stream through q, k, v and dO),
    /// rounded to `element`. splitmix64's i-th value depends on i alone, so the machine's cores
    /// fill the tensors together (a billion values at 48K tokens) with the same values as one.
    pub fn random_as(shape: &Shape, seed: u64, element: Element) -> Inputs {
        let stream = UniformStream::new(seed, element);
        let [q, k, v, d_out] = shape.tensor_starts();
        Inputs {
            q: stream.fill(q as u64, shape.q_len()),
            k: stream.fill(k as u64, shape.kv_len()),
            v: stream.fill(v as u64, shape.v_len()),
            d_out: stream.fill(d_out as u64, shape.out_len()),
        }
    }
}

/// One of the four input tensors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Tensor {
    Q,
    K,
    V,
    DOut,
}

/// Rounds to the nearest bf16 value (ties to even), kept in an f32.
pub fn round_bf16(value: f32) -> f32 {
    let bits = value.to_bits();
    let rounded = bits.wrapping_add(0x7fff + ((bits >> 16) & 1)) & 0xffff_0000;
    f32::from_bits(rounded)
}

/// Which mask of the set each query head uses, with its row intervals precomputed.
pub struct HeadMasks<'a> {
    pub set: &'a MaskSet,
    pub index_of_head: Vec<usize>,
}

impl<'a> HeadMasks<'a> {
    pub fn new(set: &'a MaskSet, shape: &Shape) -> Self {
        let index_of_head = (0..shape.heads_q)
            .map(|h| set.mask_index(h as u64, shape.heads_q as u64, shape.heads_kv as u64))
            .collect();
        HeadMasks { set, index_of_head }
    }

    /// Allowed key intervals of every row of mask `index`, as one CSR table (what kernels upload).
    pub fn row_intervals(&self, index: usize) -> crate::attention::RowIntervals {
        let mut table = crate::attention::RowIntervals {
            row_start: vec![0],
            intervals: Vec::new(),
        };
        for row in self.rows(index) {
            table
                .intervals
                .extend(row.into_iter().flat_map(|(a, b)| [a, b]));
            table.row_start.push((table.intervals.len() / 2) as u32);
        }
        table
    }

    /// Allowed key intervals of every row of mask `index`.
    pub fn rows(&self, index: usize) -> Vec<Vec<(u32, u32)>> {
        let mut rows = Vec::with_capacity(self.set.seqlen as usize);
        self.set.masks[index].for_each_row(|_, intervals| {
            rows.push(
                intervals
                    .iter()
                    .map(|&(a, b)| (a as u32, b as u32))
                    .collect(),
            );
        });
        rows
    }
}

/// Largest |a − b| over the largest |b|: an error that does not depend on the values' scale.
/// −∞ (the LSE of a row with no key) must match exactly; NaN never passes.
pub fn relative_error(actual: &[f32], reference: &[f32]) -> f64 {
    if actual.len() != reference.len() {
        return f64::INFINITY;
    }
    let mut worst = 0f64;
    let mut largest = 0f64;
    for (a, b) in actual.iter().zip(reference) {
        if a.is_nan() || b.is_nan() {
            return f64::INFINITY;
        }
        if a.is_infinite() || b.is_infinite() {
            if a != b {
                return f64::INFINITY;
            }
            continue;
        }
        worst = worst.max((*a as f64 - *b as f64).abs());
        largest = largest.max((*b as f64).abs());
    }
    if largest == 0.0 {
        worst
    } else {
        worst / largest
    }
}

/// Writes `values` as little-endian f32 to `dir/name`.
pub fn write_tensor(dir: &Path, name: &str, values: &[f32]) -> Result<(), PluginError> {
    let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
    crate::write_atomically(dir, name, &bytes)
}

/// Writes a kernel's outputs as a stage with `outputs: true` leaves them for checking: out.f32,
/// lse.f32 (unless the kernel gives no LSE) and, when the backward ran, dq.f32, dk.f32 and dv.f32.
pub fn write_outputs(
    dir: &Path,
    forward: &Forward,
    grads: Option<&Grads>,
) -> Result<(), PluginError> {
    let tensors = [
        Some(&forward.out),
        (!forward.lse.is_empty()).then_some(&forward.lse),
        grads.map(|g| &g.dq),
        grads.map(|g| &g.dk),
        grads.map(|g| &g.dv),
    ];
    for (name, values) in OUTPUT_TENSORS.iter().zip(tensors) {
        if let Some(values) = values {
            write_tensor(dir, name, values)?;
        }
    }
    Ok(())
}

/// Reads a tensor written by [`write_tensor`].
pub fn read_tensor(path: &Path) -> Result<Vec<f32>, PluginError> {
    let bytes = std::fs::read(path).map_err(|err| PluginError::io(path, err))?;
    if bytes.len() % 4 != 0 {
        return Err(PluginError::failed(format!(
            "{}: not a whole number of f32 values",
            path.display()
        )));
    }
    Ok(bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect())
}

/// File names of the tensors a kernel stage writes when asked for its outputs (`outputs: true`).
pub const OUTPUT_TENSORS: [&str; 5] = ["out.f32", "lse.f32", "dq.f32", "dk.f32", "dv.f32"];

#[cfg(test)]
mod tests {
    use super::*;

    /// A shard drawn on its own holds the values the whole tensors hold at its heads and
    /// positions, for every tensor (GQA: fewer KV heads).
    #[test]
    fn a_shard_drawn_alone_equals_the_cut_from_the_whole_inputs() {
        let shape = Shape {
            heads_q: 6,
            heads_kv: 2,
            seqlen: 37,
            head_dim: 8,
            head_dim_v: None,
        };
        let whole = Inputs::random_as(&shape, 11, Element::Bf16);
        let draws = RandomInputs::new(&shape, 11, Element::Bf16);
        let positions = [36u32, 0, 5, 6, 20];
        let cut = |data: &[f32], heads: &[usize]| -> Vec<f32> {
            let d = shape.head_dim;
            heads
                .iter()
                .flat_map(|&h| {
                    positions.iter().flat_map(move |&p| {
                        let start = (h * shape.seqlen + p as usize) * d;
                        data[start..start + d].to_vec()
                    })
                })
                .collect()
        };
        let (q_heads, kv_heads) = ([5usize, 1, 2], [1usize]);
        for (tensor, data, heads) in [
            (Tensor::Q, &whole.q, &q_heads[..]),
            (Tensor::K, &whole.k, &kv_heads[..]),
            (Tensor::V, &whole.v, &kv_heads[..]),
            (Tensor::DOut, &whole.d_out, &q_heads[..]),
        ] {
            let shard = draws.shard(tensor, heads, &positions);
            assert_eq!(shard, cut(data, heads), "{tensor:?}");
            assert!(shard.iter().all(|v| round_bf16(*v) == *v));
        }
    }

    #[test]
    fn the_reference_gives_the_same_bits_on_any_number_of_threads() {
        use crate::mask::{HeadScope, Mask, Slice, SliceKind};
        let shape = Shape {
            heads_q: 6,
            heads_kv: 3,
            seqlen: 40,
            head_dim: 8,
            head_dim_v: None,
        };
        let slices = vec![
            Slice::new([0, 25], [0, 25], SliceKind::Causal),
            Slice::new([25, 40], [10, 40], SliceKind::Full),
        ];
        let set = MaskSet {
            pattern: "test".into(),
            seqlen: 40,
            params: Default::default(),
            documents: vec![],
            scope: HeadScope::Shared,
            masks: vec![Mask::new(40, 40, slices).unwrap()],
        };
        let masks = HeadMasks::new(&set, &shape);
        let inputs = Inputs::random(&shape, 5, false);
        let one = forward_with_threads(&shape, &masks, &inputs, 1);
        let many = forward_with_threads(&shape, &masks, &inputs, 4);
        assert_eq!(one, many);
        assert_eq!(
            backward_with_threads(&shape, &masks, &inputs, &one, 1),
            backward_with_threads(&shape, &masks, &inputs, &one, 3)
        );
    }

    #[test]
    fn inputs_filled_in_parallel_are_one_splitmix_stream() {
        // Large enough that each tensor is split between threads.
        let shape = Shape {
            heads_q: 4,
            heads_kv: 2,
            seqlen: 4096,
            head_dim: 32,
            head_dim_v: None,
        };
        let mut state = 11u64 ^ 0x9E37_79B9_7F4A_7C15;
        let mut next = move || {
            state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = state;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^= z >> 31;
            round_bf16((z >> 40) as f32 / (1u64 << 23) as f32 - 1.0)
        };
        let inputs = Inputs::random_as(&shape, 11, Element::Bf16);
        for (name, tensor) in [
            ("q", &inputs.q),
            ("k", &inputs.k),
            ("v", &inputs.v),
            ("dO", &inputs.d_out),
        ] {
            let expected: Vec<f32> = (0..tensor.len()).map(|_| next()).collect();
            assert!(
                *tensor == expected,
                "{name} differs from the sequential stream"
            );
        }
    }

    #[test]
    fn decode_reads_back_what_encode_wrote() {
        let values = [0.0f32, -1.5, 0.1, 3.0e-3, 65504.0];
        for element in [Element::F32, Element::Bf16, Element::F16] {
            let rounded: Vec<f32> = values.iter().map(|&v| element.round(v)).collect();
            assert_eq!(
                element.decode(&element.encode(&values)),
                rounded,
                "{element}"
            );
        }
    }

    #[test]
    fn bf16_rounding_keeps_eight_bits_of_mantissa() {
        assert_eq!(round_bf16(1.0), 1.0);
        assert_eq!(round_bf16(1.0 + 1.0 / 256.0), 1.0);
        assert_eq!(round_bf16(1.0 + 3.0 / 256.0), 1.0 + 4.0 / 256.0);
        assert_eq!(round_bf16(-2.5), -2.5);
    }
}
