//! The mask IR's encodings that the bridge's adapters hand to libraries, computed here from the
//! IR itself so that the worker does not derive them a second time: varlen documents with one
//! window (FlashAttention's varlen entry points, flex's closed forms, full and causal), and
//! FlashMask's column bounds.

use attnbench_sdk::mask::{MaskSet, NotExpressible};
use serde::Serialize;
use serde_json::{json, Value};

/// The file a benchmark node keeps the encodings it sent in.
pub(crate) const FILE: &str = "encodings.json";

/// The encodings of the set's one mask, when every head has the same (`null` otherwise: the
/// adapters that need one mask refuse such sets before they look). Each is `{"encoding": …}` or
/// `{"refused": why}`; FlashMask's, which lists every key column, only when `flashmask` asks.
pub(crate) fn of_shared_mask(set: &MaskSet, flashmask: bool) -> Value {
    let Some((first, rest)) = set.masks.split_first() else {
        return Value::Null;
    };
    if rest.iter().any(|mask| mask != first) {
        return Value::Null;
    }
    json!({
        "varlen": outcome(first.varlen()),
        "flashmask": if flashmask { outcome(first.flashmask()) } else { Value::Null },
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
    fn a_shared_mask_gets_its_encodings_and_differing_masks_none() {
        let shared = of_shared_mask(&set(HeadScope::Shared, vec![causal()]), false);
        assert_eq!(
            shared["varlen"]["encoding"],
            json!({"cu_seqlens": [0, 64], "max_seqlen": 64, "left": -1, "right": 0})
        );
        assert_eq!(shared["flashmask"], Value::Null);
        let columns = of_shared_mask(&set(HeadScope::Shared, vec![causal()]), true);
        assert_eq!(columns["flashmask"]["encoding"]["causal"], true);

        let two_docs = Mask::square(
            64,
            vec![
                Slice::new([0, 32], [0, 32], SliceKind::Full),
                Slice::new([32, 64], [0, 64], SliceKind::Full),
            ],
        )
        .unwrap();
        let refused = of_shared_mask(&set(HeadScope::Shared, vec![two_docs.clone()]), false);
        assert!(refused["varlen"]["refused"].is_string(), "{refused}");
        let same = of_shared_mask(&set(HeadScope::PerKvGroup, vec![causal(), causal()]), false);
        assert!(same["varlen"]["encoding"].is_object(), "{same}");
        let differ = of_shared_mask(&set(HeadScope::PerKvGroup, vec![causal(), two_docs]), false);
        assert_eq!(differ, Value::Null);
    }
}
