//! Bytes each rank sends, by LongCA-bench's traffic formulas, for a problem of `tokens` tokens per rank:
//! `Q = T·h_q·d·b`, `KV = 2·T·h_kv·d·b`, an all-to-all of x bytes over N ranks sends
//! `(N−1)/N·x`. When a Ulysses group has more ranks than KV heads, the KV heads are repeated up to
//! its size first (LongCA-bench does so for Ulysses and refuses USP), and KV counts the repeated
//! heads. The threads backend counts what the methods really send; tests hold the two equal.

use crate::methods::{kv_repeat, Method, Setup};

#[derive(Debug, Clone, Copy)]
pub struct Sizes {
    /// Tokens per rank.
    pub tokens: u64,
    pub heads_q: u64,
    pub heads_kv: u64,
    pub head_dim: u64,
    /// Bytes per element.
    pub element: u64,
}

/// (forward, backward) bytes sent by every rank.
pub fn bytes(setup: &Setup, sizes: &Sizes) -> (u64, u64) {
    let (u, r) = (setup.layout.ulysses as u64, setup.layout.ring as u64);
    let q = sizes.tokens * sizes.heads_q * sizes.head_dim * sizes.element;
    let repeat =
        kv_repeat(sizes.heads_q as usize, sizes.heads_kv as usize, u as usize).unwrap_or(1) as u64;
    let kv = 2 * sizes.tokens * sizes.heads_kv * repeat * sizes.head_dim * sizes.element;
    let all_to_all = |n: u64, x: u64| (n - 1) * x / n;
    match setup.method {
        Method::Ulysses => {
            let bytes = all_to_all(u, 2 * q + kv);
            (bytes, bytes)
        }
        Method::RingP2p | Method::RingAllGather => ((r - 1) * kv, 2 * (r - 1) * kv),
        Method::Usp => {
            let heads = all_to_all(u, 2 * q + kv);
            (heads + (r - 1) * kv, heads + 2 * (r - 1) * kv)
        }
        Method::LoongTrain => {
            let heads = all_to_all(u, 2 * q + kv);
            let m = setup.windows as u64;
            let w = r / m;
            let dkv_blocks = if w > 1 { m * w } else { 0 } + if m > 1 { m } else { 0 };
            (heads + (r - 1) * kv, heads + (r - 1) * kv + dkv_blocks * kv)
        }
    }
}
