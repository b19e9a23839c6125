//! The problem's layout comes from the SDK's reference module; this adds the vector helpers the
//! kernels' inner loops use and their work queue.

use std::sync::Mutex;

pub use attnbench_sdk::reference::{Forward, Grads, HeadMasks, Inputs, Shape};

/// Runs `work` on every job, spread over `threads` threads that take jobs from one queue.
pub fn parallel<J: Send>(jobs: Vec<J>, threads: usize, work: impl Fn(J) + Sync) {
    let queue = Mutex::new(jobs);
    std::thread::scope(|scope| {
        for _ in 0..threads.max(1) {
            scope.spawn(|| loop {
                let job = queue.lock().ok().and_then(|mut q| q.pop());
                match job {
                    Some(job) => work(job),
                    None => break,
                }
            });
        }
    });
}

/// `Σ a·b` with eight independent accumulators, so the compiler can vectorise it.
#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut lanes = [0f32; 8];
    let (a_chunks, b_chunks) = (a.chunks_exact(8), b.chunks_exact(8));
    let (a_rest, b_rest) = (a_chunks.remainder(), b_chunks.remainder());
    for (x, y) in a_chunks.zip(b_chunks) {
        for lane in 0..8 {
            lanes[lane] += x[lane] * y[lane];
        }
    }
    let mut total: f32 = lanes.iter().sum();
    for (x, y) in a_rest.iter().zip(b_rest) {
        total += x * y;
    }
    total
}

/// `y += alpha · x`.
#[inline]
pub fn axpy(alpha: f32, x: &[f32], y: &mut [f32]) {
    for (target, value) in y.iter_mut().zip(x) {
        *target += alpha * value;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dot_handles_remainders() {
        let a: Vec<f32> = (0..13).map(|i| i as f32).collect();
        assert_eq!(dot(&a, &a), (0..13).map(|i| (i * i) as f32).sum::<f32>());
    }
}
