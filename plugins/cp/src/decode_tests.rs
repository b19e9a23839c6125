use super::*;

fn problem() -> DecodeProblem {
    // A sequence shorter than the largest world leaves some ranks an empty shard.
    DecodeProblem::new(vec![61, 5, 130], 3, (4, 2, 8), None).unwrap()
}

#[test]
fn tree_and_ring_decoding_are_exact_at_any_world_size() {
    let p = problem();
    let inputs = DecodeInputs::random(&p, 9, Element::Bf16);
    let whole = reference(&p, &inputs);
    for method in [DecodeMethod::Tree, DecodeMethod::Ring] {
        for world in [1, 2, 3, 5, 8] {
            let outcome = run(&p, &inputs, method, world);
            let error = whole.max_difference(&outcome.partial);
            assert!(error < 1e-12, "{method} at {world} ranks: {error}");
        }
    }
}

#[test]
fn every_rank_but_the_root_sends_one_partial() {
    let p = problem();
    let inputs = DecodeInputs::random(&p, 2, Element::Bf16);
    let partial = p.heads_q * p.rows() * (p.head_dim + 1);
    for method in [DecodeMethod::Tree, DecodeMethod::Ring] {
        let outcome = run(&p, &inputs, method, 6);
        let mut expected = vec![partial; 6];
        expected[0] = 0;
        assert_eq!(outcome.sent, expected, "{method}");
    }
}

#[test]
fn a_tree_is_logarithmic_deep_and_a_ring_linear() {
    let cases = [(1, 0, 0), (2, 1, 1), (5, 3, 4), (8, 3, 7), (1024, 10, 1023)];
    for (world, tree, ring) in cases {
        assert_eq!(depth(DecodeMethod::Tree, world), tree, "{world}");
        assert_eq!(depth(DecodeMethod::Ring, world), ring, "{world}");
    }
}

#[test]
fn the_cost_model_favours_the_tree_as_gpus_grow() {
    // One sequence of 1M tokens, one new token: 64 query heads over 8 KV heads, bf16.
    let p = DecodeProblem::new(vec![1 << 20], 1, (64, 8, 128), None).unwrap();
    let machine = Machine {
        gpus_per_node: 8,
        nvlink: 150e9,
        infiniband: 25e9,
        nvlink_latency: 10e-6,
        infiniband_latency: 20e-6,
    };
    let seconds = |method, world| decode_seconds(&p, method, world, &machine, 4e12, 2);
    assert_eq!(
        seconds(DecodeMethod::Tree, 1),
        seconds(DecodeMethod::Ring, 1)
    );
    // 2 · 2^20 keys · 8 heads · 128 · 2 bytes at 4 TB/s on one GPU: about 1 ms.
    assert!((seconds(DecodeMethod::Tree, 1) - 1.05e-3).abs() < 0.05e-3);
    for world in [16, 64, 1024] {
        assert!(seconds(DecodeMethod::Tree, world) < seconds(DecodeMethod::Ring, world));
    }
    // Past a few nodes the sends dominate both; the ring's thousand of them by far.
    assert!(seconds(DecodeMethod::Ring, 1024) > seconds(DecodeMethod::Ring, 64));
    assert!(seconds(DecodeMethod::Ring, 1024) > 20.0 * seconds(DecodeMethod::Tree, 1024));
}

#[test]
fn every_send_meets_one_receive_and_the_root_only_receives() {
    for method in [DecodeMethod::Tree, DecodeMethod::Ring] {
        for size in [1, 2, 3, 5, 8, 13] {
            let all: Vec<Vec<Hop>> = (0..size).map(|r| hops(method, r, size)).collect();
            assert!(
                all[0].iter().all(|h| matches!(h, Hop::Receive(_))),
                "{method} {size}"
            );
            for (rank, mine) in all.iter().enumerate().skip(1) {
                // Every other rank ends with exactly one send, which its target receives.
                let sends: Vec<usize> = mine
                    .iter()
                    .filter_map(|h| {
                        if let Hop::Send(to) = h {
                            Some(*to)
                        } else {
                            None
                        }
                    })
                    .collect();
                assert_eq!(sends.len(), 1, "{method} {size} rank {rank}");
                assert_eq!(mine.last(), Some(&Hop::Send(sends[0])));
                assert!(
                    all[sends[0]].contains(&Hop::Receive(rank)),
                    "{method} {size} rank {rank}"
                );
            }
            // The root's chain of receives is the critical path's length.
            let longest = (0..size).map(|r| all[r].len()).max().unwrap_or(0);
            assert!(longest <= depth(method, size).max(1), "{method} {size}");
        }
    }
}
