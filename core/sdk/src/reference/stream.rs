//! Inputs as a stream of uniform values addressed by index: any part of a tensor without the
//! rest, and every core filling one tensor with the values one core would.

use super::{Element, Shape, Tensor};

/// Uniform values in [−1, 1) rounded to an element type, addressed by index (splitmix64): the
/// i-th value depends on the seed and i alone, so any part of a tensor is made without the rest
/// and the machine's cores fill a tensor together with the same values as one core.
#[derive(Debug, Clone, Copy)]
pub struct UniformStream {
    start: u64,
    element: Element,
}

impl UniformStream {
    const GAMMA: u64 = 0x9E37_79B9_7F4A_7C15;

    /// The stream of `seed`, its values rounded to `element`.
    pub fn new(seed: u64, element: Element) -> UniformStream {
        UniformStream {
            start: seed ^ Self::GAMMA,
            element,
        }
    }

    /// The `index`-th value.
    pub fn value(&self, index: u64) -> f32 {
        let mut z = self
            .start
            .wrapping_add(index.wrapping_add(1).wrapping_mul(Self::GAMMA));
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        self.element
            .round((z >> 40) as f32 / (1u64 << 23) as f32 - 1.0)
    }

    /// Values `first .. first + n`, on every core.
    pub fn fill(&self, first: u64, n: usize) -> Vec<f32> {
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
        let mut out = vec![0.0f32; n];
        let per_thread = n.div_ceil(threads).max(1 << 16);
        std::thread::scope(|scope| {
            for (part, chunk) in out.chunks_mut(per_thread).enumerate() {
                let offset = first + (part * per_thread) as u64;
                scope.spawn(move || {
                    for (i, slot) in chunk.iter_mut().enumerate() {
                        *slot = self.value(offset + i as u64);
                    }
                });
            }
        });
        out
    }
}

/// The values [`Inputs::random_as`] draws, one at a time: a context-parallel rank makes its own
/// share of the inputs without the whole tensors (gigabytes per rank at long sequences).
#[derive(Debug, Clone, Copy)]
pub struct RandomInputs {
    shape: Shape,
    stream: UniformStream,
}

impl RandomInputs {
    pub fn new(shape: &Shape, seed: u64, element: Element) -> RandomInputs {
        RandomInputs {
            shape: *shape,
            stream: UniformStream::new(seed, element),
        }
    }

    /// `tensor`'s rows of `heads` (query heads for Q and dO, KV heads for K and V) at
    /// `positions`, head-major: `[heads][positions][head_dim]`, as cut from the whole tensor.
    pub fn shard(&self, tensor: Tensor, heads: &[usize], positions: &[u32]) -> Vec<f32> {
        let s = &self.shape;
        let [q, k, v, d_out] = s.tensor_starts();
        let (first, d) = match tensor {
            Tensor::Q => (q, s.head_dim),
            Tensor::K => (k, s.head_dim),
            Tensor::V => (v, s.value_dim()),
            Tensor::DOut => (d_out, s.value_dim()),
        };
        let first = first as u64;
        let mut out = vec![0.0f32; heads.len() * positions.len() * d];
        std::thread::scope(|scope| {
            for (&h, chunk) in heads.iter().zip(out.chunks_mut(positions.len() * d)) {
                scope.spawn(move || {
                    for (row, &p) in chunk.chunks_mut(d).zip(positions) {
                        let at = first + ((h * s.seqlen + p as usize) * d) as u64;
                        for (i, slot) in row.iter_mut().enumerate() {
                            *slot = self.stream.value(at + i as u64);
                        }
                    }
                });
            }
        });
        out
    }
}
