use super::*;
use attnbench_sdk::decode::DecodeInputs;

fn problem() -> DecodeProblem {
    DecodeProblem::new(vec![61, 5, 130], 3, (4, 2, 8), None).unwrap()
}

#[test]
fn a_ranks_draws_are_its_share_of_the_whole_batch() {
    let p = problem();
    let whole = DecodeInputs::random(&p, 5, Element::Bf16);
    let draws = UniformStream::new(5, Element::Bf16);
    let d = p.head_dim as usize;
    let (q_values, kv_values) = (whole.q.len() as u64, whole.k.len() as u64);
    for world in [1, 3, 8] {
        let mut keys_seen = 0;
        for rank in 0..world {
            let q = draw(&draws, &p, (rank, world), None);
            let k = draw(&draws, &p, (rank, world), Some(q_values));
            let v = draw(&draws, &p, (rank, world), Some(q_values + kv_values));
            let (mut at_q, mut at_kv) = (0, 0);
            for b in 0..p.batch() {
                for h in 0..p.heads_q as usize {
                    for i in 0..p.queries as usize {
                        let row = h * p.rows() as usize + b * p.queries as usize + i;
                        assert_eq!(q[at_q..at_q + d], whole.q[row * d..(row + 1) * d]);
                        at_q += d;
                    }
                }
                let keys = shard_of(&p, b, (rank, world));
                keys_seen += keys.end - keys.start;
                for h in 0..p.heads_kv as usize {
                    for j in keys.clone() {
                        let key = h * p.keys() as usize + (p.key_offset(b) + j) as usize;
                        assert_eq!(k[at_kv..at_kv + d], whole.k[key * d..(key + 1) * d]);
                        assert_eq!(v[at_kv..at_kv + d], whole.v[key * d..(key + 1) * d]);
                        at_kv += d;
                    }
                }
            }
            assert_eq!((at_q, at_kv), (q.len(), k.len()));
        }
        assert_eq!(keys_seen, p.keys(), "world {world}");
    }
}

#[test]
fn the_roots_output_returns_to_the_references_order() {
    let p = problem();
    let (hq, q, d, rows) = (4, 3, 8, p.rows() as usize);
    // Sequence-major values that name their own (b, h, i, c).
    let mut out = Vec::new();
    let mut lse = Vec::new();
    for b in 0..3 {
        for h in 0..hq {
            for i in 0..q {
                lse.push((b * 100 + h * 10 + i) as f32);
                out.extend((0..d).map(|c| (b * 1000 + h * 100 + i * 10 + c) as f32));
            }
        }
    }
    let (o, l) = heads_major(&p, &out, &lse);
    for h in 0..hq {
        for b in 0..3 {
            for i in 0..q {
                let row = h * rows + b * q + i;
                assert_eq!(l[row], (b * 100 + h * 10 + i) as f32);
                assert_eq!(o[row * d + 7], (b * 1000 + h * 100 + i * 10 + 7) as f32);
            }
        }
    }
}
