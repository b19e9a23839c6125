//! The mask IR's encodings that the bridge's adapters hand to libraries, computed here from the
//! IR itself so that the worker never interprets the slices: every mask's rows as runs of key
//! intervals (dense masks, interval lookups, the rows with no key), the masks' block grid for
//! the adapters that take block tables, and for a mask every head shares, varlen documents with
//! one window (FlashAttention's varlen entry points, flex's closed forms, full and causal) and
//! FlashMask's column bounds.

use attnbench_sdk::mask::{BlockGrid, Mask, MaskSet, NotExpressible};
use serde::Serialize;
use serde_json::{json, Value};

/// The file a benchmark node keeps the encodings it sent in.
pub(crate) const FILE: &str = "encodings.json";

/// Which of the costlier encodings the node's adapter reads.
#[derive(Clone, Copy, Default)]
pub(crate) struct Wanted {
    /// FlashMask's column bounds, which list every key column.
    pub flashmask: bool,
    /// The block grid, a table of blocks per mask.
    pub grid: bool,
}

/// The set's encodings. `rows` has every mask's [`attnbench_sdk::mask::RowRuns`]; `varlen` and
/// `flashmask` are `null` unless every head has the same mask (the adapters that need one mask
/// refuse such sets before they look); each of `varlen`, `flashmask` and `grid` is
/// `{"encoding": …}`, `{"refused": why}`, or `null` where `wanted` leaves it out.
pub(crate) fn of_set(set: &MaskSet, wanted: Wanted) -> Value {
    let shared = set
        .masks
        .split_first()
        .filter(|(first, rest)| rest.iter().all(|mask| mask == *first))
        .map(|(first, _)| first);
    let masks: Vec<&Mask> = set.masks.iter().collect();
    json!({
        "rows": set.masks.iter().map(Mask::row_runs).collect::<Vec<_>>(),
        "grid": if wanted.grid { outcome(BlockGrid::of(&masks)) } else { Value::Null },
        "varlen": shared.map_or(Value::Null, |mask| outcome(mask.varlen())),
        "flashmask": match shared {
            Some(mask) if wanted.flashmask => outcome(mask.flashmask()),
            _ => Value::Null,
        },
    })
}

fn outcome<T: Serialize>(encoding: Result<T, NotExpressible>) -> Value {
    match encoding {
        Ok(encoding) => json!({"encoding": encoding}),
        Err(refusal) => json!({"refused": refusal.reason}),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use attnbench_sdk::mask::{HeadScope, Mask, Slice, SliceKind};

    fn set(scope: HeadScope, masks: Vec<Mask>) -> MaskSet {
        MaskSet {
            pattern: "test".into(),
            seqlen: 64,
            params: Default::default(),
            documents: vec![],
            scope,
            masks,
        }
    }

    fn causal() -> Mask {
        Mask::square(64, vec![Slice::new([0, 64], [0, 64], SliceKind::Causal)]).unwrap()
    }

    #[test]
    fn every_mask_gets_its_rows_and_only_a_shared_mask_its_documents() {
        let shared = of_set(&set(HeadScope::Shared, vec![causal()]), Wanted::default());
        assert_eq!(
            shared["varlen"]["encoding"],
            json!({"cu_seqlens": [0, 64], "max_seqlen": 64, "left": -1, "right": 0})
        );
        assert_eq!(shared["flashmask"], Value::Null);
        assert_eq!(shared["grid"], Value::Null);
        assert_eq!(shared["rows"][0]["intervals"], json!([[0, 0, 1, 1]]));
        let everything = Wanted {
            flashmask: true,
            grid: true,
        };
        let columns = of_set(&set(HeadScope::Shared, vec![causal()]), everything);
        assert_eq!(columns["flashmask"]["encoding"]["causal"], true);
        assert!(columns["grid"]["refused"].is_string(), "{columns}");

        let two_docs = Mask::square(
            64,
            vec![
                Slice::new([0, 32], [0, 32], SliceKind::Full),
                Slice::new([32, 64], [0, 64], SliceKind::Full),
            ],
        )
        .unwrap();
        let refused = of_set(&set(HeadScope::Shared, vec![two_docs.clone()]), everything);
        assert!(refused["varlen"]["refused"].is_string(), "{refused}");
        assert_eq!(refused["grid"]["encoding"]["rows"], json!([0, 32, 64]));
        let same = of_set(
            &set(HeadScope::PerKvGroup, vec![causal(), causal()]),
            Wanted::default(),
        );
        assert!(same["varlen"]["encoding"].is_object(), "{same}");
        let differ = of_set(
            &set(HeadScope::PerKvGroup, vec![causal(), two_docs]),
            everything,
        );
        assert_eq!(
            (&differ["varlen"], &differ["flashmask"]),
            (&Value::Null, &Value::Null)
        );
        assert_eq!(differ["rows"].as_array().map(Vec::len), Some(2));
    }
}
