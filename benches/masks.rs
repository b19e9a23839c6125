//! Speed of the mask IR on long sequences (targets from the masks issue):
//! causal_document at 768K and 4M tokens — mask and FLOPs under 10 ms, its block mask at 128-token
//! tiles under 200 ms — and `mask show --png` of a 768K mask under 1 s (release binary). And what
//! a GPU benchmark of a block-sparse mask (32K tokens, 64-token blocks, density 0.5, one mask per
//! KV group, 4:1) does on the host before and after its kernels run: the row intervals and tile
//! lists of every mask, and the sampled check's reference rows — each under 1 s, since every
//! second of it is a second of GPU time.
//!
//! Run with `cargo build --release --workspace && cargo bench --bench masks`.

use attnbench_mask_catalogue::{generate, Params, Pattern};
use attnbench_sdk::histogram::Histogram;
use attnbench_sdk::mask::Flops;
use attnbench_tests::{best, stderr, Sandbox};

fn params(seqlen: u64) -> Params {
    Params::new(Pattern::CausalDocument, seqlen)
}

fn block_sparse_host_work() {
    use attnbench_sdk::reference::{
        reference_rows, sample_rows, Element, HeadMasks, Inputs, Shape,
    };
    let params = Params {
        sparse_block: 64,
        density: 0.5,
        heads_q: 4,
        heads_kv: 1,
        ..Params::new(Pattern::BlockSparseUniform, 32 << 10)
    };
    let set =
        generate(&params, &Histogram::synthetic(), 42).expect("block_sparse_uniform generates");
    let shape = Shape {
        heads_q: 4,
        heads_kv: 1,
        seqlen: 32 << 10,
        head_dim: 128,
        head_dim_v: None,
    };
    let slices: usize = set.masks.iter().map(|m| m.slices.len()).sum();
    let masks = HeadMasks::new(&set, &shape);
    let (time, intervals) = best(3, || {
        (0..set.masks.len())
            .map(|i| masks.row_intervals(i).intervals.len())
            .sum::<usize>()
    });
    println!(
        "{:<52} {:>10.2}  < 1000 ms ({slices} slices, {intervals} interval bounds)",
        "block_sparse_uniform 32K/64: row intervals",
        time.as_secs_f64() * 1e3
    );
    let (time, tiles) = best(3, || {
        set.masks
            .iter()
            .map(|m| m.block_mask(128, 64).counts().1 + m.block_mask(64, 64).counts().1)
            .sum::<usize>()
    });
    println!(
        "{:<52} {:>10.2}  < 1000 ms ({tiles} partial tiles)",
        "block_sparse_uniform 32K/64: tiles at 128×64 and 64×64",
        time.as_secs_f64() * 1e3
    );
    let half: Vec<u32> = (0..16u32 << 10).collect();
    let (time, bounds) = best(3, || {
        attnbench_sdk::attention::RowIntervals::restrict(&set.masks[0], &half, &half)
            .intervals
            .len()
    });
    println!(
        "{:<52} {:>10.2}  < 1000 ms ({bounds} interval bounds)",
        "block_sparse_uniform 32K/64: a 16K × 16K block's rows",
        time.as_secs_f64() * 1e3
    );
    let inputs = Inputs::random_as(&shape, 1, Element::Bf16);
    let rows = sample_rows(shape.seqlen, 16);
    let (time, _) = best(3, || reference_rows(&shape, &masks, &inputs, &rows, true));
    println!(
        "{:<52} {:>10.2}  < 1000 ms (16 rows of every head, with dQ)",
        "block_sparse_uniform 32K/64: sampled check's reference",
        time.as_secs_f64() * 1e3
    );
}

fn main() {
    let histogram = Histogram::synthetic();
    println!("{:<52} {:>10}  target", "measurement", "ms");
    for (label, seqlen) in [("768K", 768u64 << 10), ("4M", 4u64 << 20)] {
        let (time, (documents, flops)) = best(5, || {
            let set = generate(&params(seqlen), &histogram, 42).expect("causal_document generates");
            let flops = Flops::of(set.masks[0].area(), 64, 128, 128);
            (set.documents.len(), flops)
        });
        println!(
            "{:<52} {:>10.2}  < 10 ms ({documents} documents, fwd {:.3e} FLOPs)",
            format!("causal_document {label}: mask + FLOPs"),
            time.as_secs_f64() * 1e3,
            flops.fwd as f64
        );
        let set = generate(&params(seqlen), &histogram, 42).expect("causal_document generates");
        let (time, tiles) = best(3, || set.masks[0].block_mask(128, 128).counts());
        println!(
            "{:<52} {:>10.2}  < 200 ms ({} full, {} partial tiles)",
            format!("causal_document {label}: block mask, 128-token tiles"),
            time.as_secs_f64() * 1e3,
            tiles.0,
            tiles.1
        );
    }
    block_sparse_host_work();
    let sandbox = Sandbox::new();
    let picture = sandbox.path().join("mask.png");
    let (time, output) = best(3, || {
        sandbox.run(&[
            "mask",
            "show",
            "--mask",
            "causal_document",
            "--seqlen",
            "768k",
            "--png",
            picture.to_str().unwrap_or_default(),
        ])
    });
    assert!(
        output.status.success(),
        "mask show failed: {}",
        stderr(&output)
    );
    println!(
        "{:<52} {:>10.2}  < 1000 ms (the whole command)",
        "mask show --png, causal_document 768K",
        time.as_secs_f64() * 1e3
    );
}
