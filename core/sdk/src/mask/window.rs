//! Sliding windows as slices.

use super::{Slice, SliceKind, Span};

/// The slices of a sliding window over `q × k`: query row `i` (bottom-right aligned, so in a
/// square region the diagonal is `k = q`) sees keys `j` with `pos − j ≤ left` and
/// `j − pos ≤ right`, where `pos = i + (Lk − Lq)`; −1 means unbounded. At most three slices:
/// rows whose window is clipped on neither, one or both sides of the key range have different
/// shapes (`full`, `causal`, `inv_causal`, `bi_causal`).
pub fn window_slices(q: Span, k: Span, left: i64, right: i64) -> Vec<Slice> {
    let (lq, lk) = ((q[1] - q[0]) as i64, (k[1] - k[0]) as i64);
    if lq == 0 || lk == 0 {
        return Vec::new();
    }
    let d = lk - lq;
    // A window as wide as the key range is no window.
    let left = if left < 0 || left >= lk - 1 { lk } else { left };
    let right = if right < 0 || right >= lk - 1 {
        lk
    } else {
        right
    };
    // Row i allows [lo(i), hi(i)) with lo(i) = max(0, i + d − left), hi(i) = min(lk, i + d + right + 1).
    // lo starts rising at row `rise`; hi is clipped from row `flat` on.
    let rise = (left - d).clamp(0, lq);
    let flat = (lk - d - right).clamp(0, lq);
    let mut cuts = vec![0, rise, flat, lq];
    cuts.sort_unstable();
    cuts.dedup();
    let lo = |i: i64| (i + d - left).max(0);
    let hi = |i: i64| (i + d + right + 1).min(lk);
    let mut slices = Vec::new();
    for band in cuts.windows(2) {
        let (a, b) = (band[0], band[1]);
        if a >= b {
            continue;
        }
        let lo_rises = a >= rise;
        let hi_rises = a < flat;
        let (k0, k1, kind) = match (lo_rises, hi_rises) {
            (false, false) => (0, lk, SliceKind::Full),
            (false, true) => (0, hi(b - 1), SliceKind::Causal),
            (true, false) => (lo(a), lk, SliceKind::InvCausal),
            (true, true) => (lo(a), hi(b - 1), SliceKind::BiCausal),
        };
        if k1 <= k0 {
            continue;
        }
        slices.push(Slice::new(
            [q[0] + a as u64, q[0] + b as u64],
            [k[0] + k0 as u64, k[0] + k1 as u64],
            kind,
        ));
    }
    slices
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;
    use crate::mask::Mask;

    fn within(q: i64, k: i64, left: i64, right: i64) -> bool {
        (left < 0 || q - k <= left) && (right < 0 || k - q <= right)
    }

    proptest! {
        #[test]
        fn window_slices_equal_the_predicate_on_square_regions(s in 1u64..40, offset in 0u64..5, left in -1i64..45, right in -1i64..45) {
            let span = [offset, offset + s];
            let mask = Mask::square(offset + s, window_slices(span, span, left, right)).unwrap();
            prop_assert!(mask.slices_disjoint());
            for q in 0..offset + s {
                for k in 0..offset + s {
                    let inside = q >= offset && k >= offset;
                    let expected = inside && within(q as i64, k as i64, left, right);
                    prop_assert_eq!(mask.allows(q, k), expected, "cell ({}, {})", q, k);
                }
            }
        }
    }

    #[test]
    fn the_checked_examples_on_sixteen_tokens() {
        let s = [0, 16];
        let kinds = |left, right| -> Vec<(Span, Span, SliceKind)> {
            window_slices(s, s, left, right)
                .into_iter()
                .map(|x| (x.q, x.k, x.kind))
                .collect()
        };
        assert_eq!(
            kinds(3, 0),
            vec![
                ([0, 3], [0, 3], SliceKind::Causal),
                ([3, 16], [0, 16], SliceKind::BiCausal)
            ]
        );
        assert_eq!(
            kinds(14, 14),
            vec![
                ([0, 2], [0, 16], SliceKind::Causal),
                ([2, 14], [0, 16], SliceKind::Full),
                ([14, 16], [0, 16], SliceKind::InvCausal)
            ]
        );
        assert_eq!(
            kinds(3, 3),
            vec![
                ([0, 3], [0, 6], SliceKind::Causal),
                ([3, 13], [0, 16], SliceKind::BiCausal),
                ([13, 16], [10, 16], SliceKind::InvCausal)
            ]
        );
        assert_eq!(kinds(15, 0), vec![([0, 16], [0, 16], SliceKind::Causal)]);
        assert_eq!(kinds(15, 15), vec![([0, 16], [0, 16], SliceKind::Full)]);
    }
}
