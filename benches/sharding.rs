//! Speed of the balanced sharding (target from the CP-balancing issue): dealing 1M tokens of
//! documents over 1024 ring ranks, chunks of 64 tokens, well under a second — the mask's row work
//! and the solver apart — and the balance it reaches beside zigzag's and contiguous pieces'.
//! The documents come from LongCA-bench's Pile histogram where the shared data folder has it
//! (the synthetic distribution otherwise).
//!
//! Run with `cargo bench --bench sharding`.

use attnbench_cp::{imbalance, rank_shares, row_work, Layout, Placement, Sharding};
use attnbench_mask_catalogue::{generate, shared_longca_histogram, Params, Pattern};
use attnbench_sdk::histogram::Histogram;
use attnbench_tests::best;

fn main() {
    let (histogram, source) = match shared_longca_histogram("pile") {
        Some(pile) => (pile, "Pile"),
        None => (Histogram::synthetic(), "synthetic"),
    };
    let seqlen = 1usize << 20;
    let (ranks, heads_q, heads_kv) = (1024, 64, 8);
    let set = generate(
        &Params::new(Pattern::CausalDocument, seqlen as u64),
        &histogram,
        42,
    )
    .expect("causal_document generates");
    println!(
        "causal_document 1M, {source} histogram: {} documents; {ranks} ranks, 64:8 heads",
        set.documents.len()
    );
    println!("{:<44} {:>10}  target", "measurement", "ms");
    let (time, work) = best(3, || row_work(&set, heads_q, heads_kv));
    println!(
        "{:<44} {:>10.2}",
        "row work (area per query token)",
        time.as_secs_f64() * 1e3
    );
    let layout = |sharding| {
        Layout::new(seqlen, 1, ranks, Placement::RingInner, sharding, || {
            work.clone()
        })
        .expect("1M tokens deal over 1024 ranks")
    };
    let (time, balanced) = best(3, || layout(Sharding::Balanced { chunk: 64 }));
    println!(
        "{:<44} {:>10.2}  < 1000 ms with the row work",
        "balanced(64): the solver",
        time.as_secs_f64() * 1e3
    );
    for (name, layout) in [
        ("balanced(64)", balanced),
        ("zigzag", layout(Sharding::Zigzag)),
        ("contiguous", layout(Sharding::Contiguous)),
        ("striped(64)", layout(Sharding::Striped { width: 64 })),
    ] {
        let shares = rank_shares(&layout, &set, heads_q as usize, heads_kv as usize);
        let areas: Vec<u64> = shares.iter().map(|s| s.0).collect();
        let pieces: u64 = shares.iter().map(|s| s.1).sum();
        println!(
            "{:<44} {:>10.3}  (max/mean area; {:.1} pieces a rank on average)",
            format!("{name}: imbalance"),
            imbalance(&areas),
            pieces as f64 / ranks as f64
        );
    }
}
