use super::*;

fn params(mask: &str, seqlen: u64) -> Params {
    Params {
        heads_q: 4,
        heads_kv: 2,
        ..Params::new(
            Pattern::from_name(mask).expect("a catalogue pattern"),
            seqlen,
        )
    }
}

#[test]
fn documents_match_longca_bench_bit_for_bit() {
    let Some(pile) = shared_longca_histogram("pile") else {
        return;
    };
    let set = generate(&params("causal_document", 1024), &pile, 42).unwrap();
    assert_eq!(set.documents, vec![353, 559, 102, 10]);
    assert_eq!(set.masks[0].area(), 224_309);
    let set = generate(&params("causal_document", 8192), &pile, 42).unwrap();
    assert_eq!(set.documents.len(), 17);
    assert_eq!(
        set.documents[..12],
        [353, 559, 102, 421, 322, 13, 129, 314, 113, 768, 618, 469]
    );
    assert_eq!(set.masks[0].area(), 7_558_462);
    assert_eq!(
        generate(&params("full", 8192), &pile, 42).unwrap().masks[0].area(),
        67_108_864
    );
    assert_eq!(
        generate(&params("causal", 8192), &pile, 42).unwrap().masks[0].area(),
        33_558_528
    );
}

#[test]
fn every_histogram_of_longca_bench_parses_and_samples() {
    for name in ["pile", "prolong64k", "prolong512k"] {
        let Some(histogram) = shared_longca_histogram(name) else {
            return;
        };
        let documents = histogram.sample_documents(65536, &mut PyRandom::new(42));
        assert_eq!(documents.iter().sum::<u64>(), 65536);
    }
}

/// Document index and start of every token.
fn documents_of(set: &MaskSet) -> (Vec<usize>, Vec<u64>) {
    let mut doc = Vec::new();
    let mut starts = Vec::new();
    let mut start = 0;
    for (index, &length) in set.documents.iter().enumerate() {
        starts.push(start);
        doc.extend(std::iter::repeat_n(index, length as usize));
        start += length;
    }
    (doc, starts)
}

/// Each pattern is what docs/masks-and-data.md says it is, cell by cell.
#[test]
fn every_static_pattern_matches_its_definition() {
    let histogram = Histogram {
        buckets: vec![Bucket {
            lo: 1,
            hi: 40,
            weight: 1.0,
        }],
    };
    for seed in 0..4 {
        for mask in Pattern::NAMES
            .iter()
            .filter(|p| !p.starts_with("block_sparse"))
        {
            let mut p = params(mask, 192);
            p.window = 7;
            p.block_size = 16;
            p.long_min = 20;
            p.long_max = 60;
            let set = generate(&p, &histogram, seed).unwrap_or_else(|err| panic!("{mask}: {err}"));
            let (doc, starts) = documents_of(&set);
            let last = set.documents.len().saturating_sub(1);
            let prefix = set
                .params
                .get("prefix")
                .and_then(Value::as_u64)
                .unwrap_or(0);
            let g = set
                .params
                .get("global_tokens")
                .and_then(Value::as_u64)
                .unwrap_or(0);
            let w = set
                .params
                .get("global_window")
                .and_then(Value::as_i64)
                .unwrap_or(0) as u64;
            let m = &set.masks[0];
            for q in 0..192u64 {
                for k in 0..192u64 {
                    let same = !doc.is_empty() && doc[q as usize] == doc[k as usize];
                    let expected = match *mask {
                        "full" => true,
                        "causal" => k <= q,
                        "full_document" | "full_document_long" => same,
                        "causal_document" | "causal_document_long" => same && k <= q,
                        "sliding_window" => q.abs_diff(k) <= 7,
                        "sliding_window_causal" => k <= q && q - k <= 7,
                        "share_question" => {
                            (doc[k as usize] == 0 && doc[q as usize] != 0) || (same && k <= q)
                        }
                        "causal_blockwise" => {
                            (doc[q as usize] == last && doc[k as usize] != last) || (same && k <= q)
                        }
                        "prefix_lm_causal" => k < prefix || k <= q,
                        "prefix_lm_document" => {
                            same && (k - starts[doc[k as usize]] < prefix || k <= q)
                        }
                        "global_sliding_window" => k < g || q < g || q.abs_diff(k) <= w,
                        "block_causal_document" => same && k < (q / 16 + 1) * 16,
                        other => unreachable!("{other}"),
                    };
                    assert_eq!(
                        m.allows(q, k),
                        expected,
                        "{mask} (seed {seed}) at ({q}, {k})"
                    );
                }
            }
            assert_eq!(m.area(), m.dense().unwrap().count(), "{mask}");
        }
    }
}

#[test]
fn long_documents_mix_drawn_and_long_ones() {
    let histogram = Histogram {
        buckets: vec![Bucket {
            lo: 10,
            hi: 20,
            weight: 1.0,
        }],
    };
    let mut p = params("causal_document_long", 100_000);
    p.long_min = 8192;
    let set = generate(&p, &histogram, 1).unwrap();
    assert_eq!(set.documents.iter().sum::<u64>(), 100_000);
    let long: u64 = set.documents.iter().filter(|&&d| d >= 8192).sum();
    assert!(
        long >= 50_000,
        "about 60% of the tokens are in long documents: {long}"
    );
}

#[test]
fn block_sparse_keeps_the_stated_fraction_per_row() {
    let mut p = params("block_sparse_uniform", 1024);
    p.density = 0.3;
    let set = generate(&p, &Histogram::synthetic(), 9).unwrap();
    assert_eq!(set.scope, HeadScope::PerKvGroup);
    assert_eq!(set.masks.len(), 2);
    // 8 blocks of 128, keep floor(0.3 * 8) = 2 per query block.
    for mask in &set.masks {
        assert_eq!(mask.area(), 8 * 2 * 128 * 128);
        let blocks = mask.block_mask(128, 128);
        for t in 0..8 {
            assert_eq!(blocks.row(t).filter(|(_, full)| *full).count(), 2);
        }
    }
    assert_ne!(set.masks[0], set.masks[1], "independent per KV group");
    assert_eq!(set.params["kept_per_row"], 2);

    let mut p = params("block_sparse_variable", 4096);
    p.sparse_block = 512;
    p.density = 0.5;
    let set = generate(&p, &Histogram::synthetic(), 3).unwrap();
    let actual = set.params["density_actual"].as_f64().unwrap();
    assert!(actual > 0.2 && actual < 0.8, "{actual}");
}

#[test]
fn impossible_requests_are_refused_with_the_reason() {
    let synthetic = Histogram::synthetic();
    let err = generate(&params("block_causal_document", 1000), &synthetic, 0).unwrap_err();
    assert_eq!(
        err,
        GenerateError::BlockSize {
            seqlen: 1000,
            block: 1024
        }
    );
    assert!(err.to_string().contains("multiple of block_size"), "{err}");
    let err = generate(&params("global_sliding_window", 4), &synthetic, 0).unwrap_err();
    assert_eq!(err, GenerateError::GlobalDraw { seqlen: 4 });
    assert!(err.to_string().contains("seqlen ≥ 6"), "{err}");
    let err = generate(&params("causal", 0), &synthetic, 0).unwrap_err();
    assert_eq!(err, GenerateError::EmptySequence);
    let mut p = params("block_sparse_uniform", 1024);
    p.density = 0.0;
    assert_eq!(
        generate(&p, &synthetic, 0).unwrap_err(),
        GenerateError::Density(0.0)
    );
    let mut p = params("prefix_lm_causal", 100);
    p.prefix = 200;
    let err = generate(&p, &synthetic, 0).unwrap_err();
    assert!(
        err.to_string().contains("longer than the sequence"),
        "{err}"
    );
}
