//! The cost model: per-GPU throughput of each method at 8 … 1024 GPUs, from a kernel's measured
//! throughput, the links' bandwidths and latencies, and the methods' traffic (the formulas the
//! threads backend is held to).
//!
//! Compute is the kernel at its measured rate on the slowest rank's share of the FLOPs: the mean
//! share times the sharding's imbalance on the mask (1 for zigzag on causal masks, more for
//! documents; `sharding::model_imbalance`). A ring step overlaps its block's transfer with the previous
//! block's compute, so a step costs the larger of the two; LoongTrain's inter-window transfer
//! hides behind a whole window. All-to-alls and all-gathers are not overlapped. A transfer runs at
//! NVLink speed when every member of its group is on one node, else at InfiniBand speed (the
//! slowest hop of a ring sets its pace); in an all-to-all the on-node and off-node parts run at
//! once.

use attnbench_sdk::measure::Prediction;

use crate::layout::{Layout, Placement};
use crate::methods::{kv_repeat, Method, Setup};
use crate::volume::Sizes;

#[derive(Debug, Clone)]
pub struct Machine {
    pub gpus_per_node: usize,
    /// Bytes per second per GPU.
    pub nvlink: f64,
    pub infiniband: f64,
    /// Seconds per message.
    pub nvlink_latency: f64,
    pub infiniband_latency: f64,
}

#[derive(Debug, Clone)]
pub struct Workload {
    pub sizes: Sizes,
    /// Allowed fraction of the S×S score matrix (1 for full, about ½ for causal).
    pub causal: bool,
    pub backward: bool,
    /// The most loaded ring rank's work over the mean's, under the sharding (1: even).
    pub imbalance: f64,
    /// The kernel's measured throughput, FLOP/s.
    pub kernel_flops: f64,
}

/// Group sizes LongCA-bench uses: USP and LoongTrain put min(world, 8) ranks in Ulysses groups
/// and split the ring into the largest divisor m of R with m² ≤ R windows.
pub fn paper_setup(method: Method, world: usize, placement: Placement, seqlen: usize) -> Setup {
    let ulysses = match method {
        Method::Ulysses => world,
        Method::RingP2p | Method::RingAllGather => 1,
        Method::Usp | Method::LoongTrain => world.min(8),
    };
    let ring = world / ulysses;
    let windows = if method == Method::LoongTrain {
        (1..=ring)
            .filter(|m| ring.is_multiple_of(*m) && m * m <= ring)
            .max()
            .unwrap_or(1)
    } else {
        1
    };
    Setup {
        method,
        layout: Layout::groups(seqlen, ulysses, ring, placement),
        windows,
    }
}

impl Machine {
    fn node(&self, world_rank: usize) -> usize {
        world_rank / self.gpus_per_node
    }

    /// (bandwidth, latency) of a group's transfers: NVLink when it sits on one node.
    fn link(&self, members: &[usize]) -> (f64, f64) {
        let first = self.node(members[0]);
        if members.iter().all(|&m| self.node(m) == first) {
            (self.nvlink, self.nvlink_latency)
        } else {
            (self.infiniband, self.infiniband_latency)
        }
    }

    /// Seconds for an all-to-all in which each member sends `bytes` in total, spread evenly.
    fn all_to_all(&self, members: &[usize], me: usize, bytes: f64) -> f64 {
        let n = members.len();
        if n < 2 {
            return 0.0;
        }
        let local = members
            .iter()
            .filter(|&&m| m != me && self.node(m) == self.node(me))
            .count();
        let share = bytes / (n - 1) as f64;
        let on_node = local as f64 * share / self.nvlink;
        let off_node = (n - 1 - local) as f64 * share / self.infiniband;
        let latency = if local + 1 < n {
            self.infiniband_latency
        } else {
            self.nvlink_latency
        };
        on_node.max(off_node) + latency
    }
}

fn flops(workload: &Workload, seqlen: f64) -> f64 {
    let s = workload.sizes;
    let area = if workload.causal {
        seqlen * (seqlen + 1.0) / 2.0
    } else {
        seqlen * seqlen
    };
    let forward = 4.0 * area * s.heads_q as f64 * s.head_dim as f64;
    if workload.backward {
        2.5 * forward
    } else {
        forward
    }
}

/// The predicted time of one rank of `setup`.
pub fn predict_setup(setup: &Setup, machine: &Machine, workload: &Workload) -> Prediction {
    let s = workload.sizes;
    let (method, world) = (setup.method, setup.layout.world());
    let seqlen = s.tokens as usize * world;
    let mask = if workload.causal { "causal" } else { "full" };
    let mut prediction = Prediction {
        method: method.to_string(),
        mask: mask.into(),
        direction: if workload.backward { "bwd" } else { "fwd" }.into(),
        world: world as u64,
        tokens_per_gpu: s.tokens,
        tflops_per_gpu: None,
        time_s: None,
        compute_s: None,
        exposed_communication_s: None,
        reason: None,
        sharding: None,
        imbalance: None,
    };
    if let Err(reason) = kv_repeat(
        s.heads_q as usize,
        s.heads_kv as usize,
        setup.layout.ulysses,
    ) {
        prediction.reason = Some(reason.to_string());
        return prediction;
    }
    let layout = &setup.layout;
    let total = flops(workload, seqlen as f64);
    // The slowest rank sets the pace: its share is the mean's times the sharding's imbalance.
    let compute = total / world as f64 / workload.kernel_flops * workload.imbalance;
    let repeat =
        kv_repeat(s.heads_q as usize, s.heads_kv as usize, layout.ulysses).unwrap_or(1) as f64;
    let q = s.tokens as f64 * s.heads_q as f64 * s.head_dim as f64 * s.element as f64;
    let kv =
        2.0 * s.tokens as f64 * s.heads_kv as f64 * repeat * s.head_dim as f64 * s.element as f64;
    // Rank 0's groups.
    let ulysses: Vec<usize> = (0..layout.ulysses)
        .map(|u| layout.world_rank(u, 0))
        .collect();
    let ring: Vec<usize> = (0..layout.ring).map(|r| layout.world_rank(0, r)).collect();
    // Q, K, V there and O back (dO there, dQ, dK, dV back): A(U, 2Q + KV), as volume::bytes.
    let u = layout.ulysses as f64;
    let head_exchange = machine.all_to_all(&ulysses, 0, (u - 1.0) / u * (2.0 * q + kv));
    let (bandwidth, latency) = machine.link(&ring);
    // What one ring hop carries: KV forward; KV and its dK/dV accumulator backward.
    let hop = |bandwidth: f64, latency: f64| {
        kv * if workload.backward { 2.0 } else { 1.0 } / bandwidth + latency
    };
    let r = layout.ring;
    let ring_time = match method {
        Method::Ulysses => compute,
        Method::RingP2p | Method::Usp => {
            let step = compute / r as f64;
            step + (r - 1) as f64 * step.max(hop(bandwidth, latency))
        }
        Method::RingAllGather => {
            let passes = if workload.backward { 3.0 } else { 1.0 };
            passes * (r - 1) as f64 * (kv / bandwidth + latency) + compute
        }
        Method::LoongTrain => {
            let m = setup.windows;
            let w = r / m;
            let step = compute / r as f64;
            let window: Vec<usize> = ring[..w].to_vec();
            let across: Vec<usize> = (0..m).map(|j| ring[j * w]).collect();
            let (intra_bw, intra_latency) = machine.link(&window);
            let (inter_bw, inter_latency) = machine.link(&across);
            let inner = step + (w - 1) as f64 * step.max(hop(intra_bw, intra_latency));
            let inter = hop(inter_bw, inter_latency);
            (m - 1) as f64 * inner.max(inter) + inner
        }
    };
    let time = head_exchange + ring_time;
    prediction.time_s = Some(time);
    prediction.compute_s = Some(compute);
    prediction.exposed_communication_s = Some(time - compute);
    prediction.tflops_per_gpu = Some(total / world as f64 / time / 1e12);
    prediction
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The predicted time of one rank (rank 0: every rank does the same in this model) with
    /// LongCA-bench's groups.
    fn predict(
        method: Method,
        world: usize,
        placement: Placement,
        machine: &Machine,
        workload: &Workload,
    ) -> Prediction {
        let seqlen = workload.sizes.tokens as usize * world;
        predict_setup(
            &paper_setup(method, world, placement, seqlen),
            machine,
            workload,
        )
    }

    fn h200_cluster() -> Machine {
        Machine {
            gpus_per_node: 8,
            nvlink: 370e9,
            infiniband: 48e9,
            nvlink_latency: 5e-6,
            infiniband_latency: 10e-6,
        }
    }

    fn paper_workload(causal: bool, backward: bool) -> Workload {
        Workload {
            sizes: Sizes {
                tokens: 8192,
                heads_q: 64,
                heads_kv: 8,
                head_dim: 128,
                element: 2,
            },
            causal,
            backward,
            imbalance: 1.0,
            kernel_flops: 400e12,
        }
    }

    #[test]
    fn throughput_never_exceeds_the_kernel_and_slower_links_never_help() {
        let cluster = h200_cluster();
        let one_big_node = Machine {
            gpus_per_node: 1024,
            ..h200_cluster()
        };
        for &method in Method::ALL {
            for (causal, backward) in [(false, false), (true, false), (true, true)] {
                let workload = paper_workload(causal, backward);
                for world in [8, 16, 64, 256] {
                    let across =
                        predict(method, world, Placement::UlyssesInner, &cluster, &workload);
                    let within = predict(
                        method,
                        world,
                        Placement::UlyssesInner,
                        &one_big_node,
                        &workload,
                    );
                    let (Some(across), Some(within)) =
                        (across.tflops_per_gpu, within.tflops_per_gpu)
                    else {
                        continue;
                    };
                    assert!(within <= 400.0 + 1e-9 && across > 0.0, "{method:?} {world}");
                    assert!(
                        across <= within + 1e-9,
                        "{method:?} at {world}: {across} over InfiniBand vs {within} on NVLink"
                    );
                }
            }
        }
    }

    #[test]
    fn ulysses_stops_where_heads_run_out_and_says_so() {
        let prediction = predict(
            Method::Ulysses,
            128,
            Placement::UlyssesInner,
            &h200_cluster(),
            &paper_workload(false, false),
        );
        assert!(prediction.tflops_per_gpu.is_none());
        assert!(prediction
            .reason
            .unwrap()
            .contains("64 query heads cannot be split over 128"));
    }

    #[test]
    fn a_ring_that_hides_its_transfers_runs_at_the_kernel_rate() {
        // Full mask, 8 GPUs on NVLink: a 32 MiB KV hop takes ~0.09 ms, a step's compute ~0.3 ms.
        let prediction = predict(
            Method::RingP2p,
            8,
            Placement::RingInner,
            &h200_cluster(),
            &paper_workload(false, false),
        );
        let tflops = prediction.tflops_per_gpu.unwrap();
        assert!((tflops - 400.0).abs() < 1.0, "{prediction:?}");
    }
}
