use super::*;
use attnbench_sdk::attention::HostBlock;

/// A call of `q_len` rows against `k_len` keys whose rows see `rows`, on device memory with
/// f32 outputs (pointers null: these tests look at the shape only).
fn call_with<'a>(q_len: u64, k_len: u64, rows: &'a RowIntervals) -> AttentionCall<'a> {
    HostBlock {
        head_dim: 128,
        q_len: q_len as usize,
        k_len: k_len as usize,
        scale: 128f64.sqrt().recip(),
        kv_head_of: &HEADS,
        heads_kv: 2,
        rows,
    }
    .call(Memory::Cuda, (DType::Bf16, DType::F32), false)
}

/// Row starts and intervals of rows that see the first `ends[r]` keys (none when 0).
fn prefixes(ends: &[u32]) -> RowIntervals {
    let (mut row_start, mut intervals) = (vec![0], Vec::new());
    for &end in ends {
        if end > 0 {
            intervals.extend([0, end]);
        }
        row_start.push((intervals.len() / 2) as u32);
    }
    RowIntervals {
        row_start,
        intervals,
    }
}

const HEADS: [u32; 4] = [0, 0, 1, 1];

#[test]
fn a_whole_cache_is_a_block_with_nothing_after() {
    // 4 new tokens of a 10-key cache: row r sees 7 + r keys.
    let rows = prefixes(&[7, 8, 9, 10]);
    let call = call_with(4, 10, &rows);
    assert_eq!(keys_after(&call), Ok(0));
}

#[test]
fn an_early_shard_is_seen_whole_and_a_late_short_one_in_part() {
    let rows = prefixes(&[6, 6, 6, 6]);
    let whole = call_with(4, 6, &rows);
    let after = keys_after(&whole).unwrap();
    assert!(after >= 3, "{after}");
    // The last shard of two keys: rows 0 and 1 see none of it, rows 2 and 3 one and two keys.
    let rows = prefixes(&[0, 0, 1, 2]);
    let last = call_with(4, 2, &rows);
    assert_eq!(keys_after(&last), Ok(0));
    // A middle shard that the last new tokens' keys lie beyond by one: rows see 3, 4, 4, 4.
    let rows = prefixes(&[3, 4, 4, 4]);
    let middle = call_with(4, 4, &rows);
    assert_eq!(keys_after(&middle), Ok(2));
}

#[test]
fn other_masks_are_refused_with_the_reason() {
    // A row that sees a window, not a prefix.
    let rows = RowIntervals {
        row_start: vec![0, 1, 2],
        intervals: vec![1, 4, 0, 4],
    };
    let call = call_with(2, 4, &rows);
    let err = keys_after(&call).unwrap_err().to_string();
    assert!(err.contains("one sequence's new tokens"), "{err}");
    // Prefixes that do not grow by one key a row.
    let rows = prefixes(&[2, 4]);
    let call = call_with(2, 6, &rows);
    assert!(keys_after(&call).is_err());
}

#[test]
fn a_backward_or_a_host_call_is_not_the_decode_backends() {
    let rows = prefixes(&[4]);
    let mut call = call_with(1, 4, &rows);
    call.backward = true;
    assert!(element_of(&call).is_err());
    call.backward = false;
    call.memory = Memory::Host;
    assert!(element_of(&call).is_err());
    call.memory = Memory::Cuda;
    assert_eq!(element_of(&call), Ok(Element::Bf16));
}
