//! The artifact `masks/generate` writes (`mask.json`) and kernels read: one mask for every head,
//! or one per KV group or per query head (dynamic block-sparse patterns).

use std::path::Path;

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use super::{Flops, Mask};
use crate::PluginError;

/// Why a kernel's head counts do not fit a mask set.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HeadsError {
    #[error("heads_q ({heads_q}) must be a positive multiple of heads_kv ({heads_kv}), and head_dim positive")]
    Counts { heads_q: u64, heads_kv: u64 },
    #[error("{seqlen} tokens with {heads_q} query heads of dimension {head_dim} make more FLOPs than the 2^64 − 1 they are counted in; use fewer tokens or heads")]
    Flops {
        seqlen: u64,
        heads_q: u64,
        head_dim: u64,
    },
    #[error("the mask set has {masks} masks ({scope:?}) but {heads_q} heads_q / {heads_kv} heads_kv need {expected}; give masks/generate the same heads")]
    Masks {
        masks: usize,
        scope: HeadScope,
        heads_q: u64,
        heads_kv: u64,
        expected: u64,
    },
}

impl From<HeadsError> for PluginError {
    fn from(err: HeadsError) -> PluginError {
        PluginError::Params(err.to_string())
    }
}

crate::named_enum! {
    /// Which heads each mask of a set applies to.
    pub enum HeadScope {
        /// One mask for every head.
        Shared = "shared",
        /// One mask per KV head, used by the query heads of its group.
        PerKvGroup = "per_kv_group",
        /// One mask per query head.
        PerHead = "per_head",
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MaskSet {
    /// The catalogue name, e.g. `causal_document`.
    pub pattern: String,
    pub seqlen: u64,
    /// Every parameter, given and drawn (documents' prefix, global tokens, …).
    pub params: Map<String, Value>,
    /// Document lengths, for patterns built from documents.
    pub documents: Vec<u64>,
    pub scope: HeadScope,
    pub masks: Vec<Mask>,
}

impl MaskSet {
    pub const FILE: &'static str = "mask.json";

    pub fn load(dir: &Path) -> Result<MaskSet, PluginError> {
        let path = dir.join(Self::FILE);
        let text = std::fs::read(&path).map_err(|err| PluginError::io(&path, err))?;
        let set: MaskSet = serde_json::from_slice(&text).map_err(|err| {
            PluginError::failed(format!("{}: not a mask set: {err}", path.display()))
        })?;
        // Read masks bypass `Mask::new`; their areas must fit all the same.
        for mask in &set.masks {
            Mask::check_size(mask.seqlen_q, mask.seqlen_k)
                .map_err(|err| PluginError::failed(format!("{}: {err}", path.display())))?;
        }
        Ok(set)
    }

    pub fn save(&self, dir: &Path) -> Result<(), PluginError> {
        crate::write_json(dir, Self::FILE, self)
    }

    /// Checks a kernel's head counts against each other and against this set's scope.
    pub fn check_heads(
        &self,
        heads_q: u64,
        heads_kv: u64,
        head_dim: u64,
    ) -> Result<(), HeadsError> {
        if heads_q == 0 || heads_kv == 0 || head_dim == 0 || !heads_q.is_multiple_of(heads_kv) {
            return Err(HeadsError::Counts { heads_q, heads_kv });
        }
        let expected = match self.scope {
            HeadScope::Shared => 1,
            HeadScope::PerKvGroup => heads_kv,
            HeadScope::PerHead => heads_q,
        };
        if self.checked_flops(heads_q, heads_kv, head_dim).is_none() {
            return Err(HeadsError::Flops {
                seqlen: self.seqlen,
                heads_q,
                head_dim,
            });
        }
        if self.masks.len() as u64 != expected {
            return Err(HeadsError::Masks {
                masks: self.masks.len(),
                scope: self.scope,
                heads_q,
                heads_kv,
                expected,
            });
        }
        Ok(())
    }

    /// Which mask of the set query head `head` uses, given the model's head counts.
    pub fn mask_index(&self, head: u64, heads_q: u64, heads_kv: u64) -> usize {
        let index = match self.scope {
            HeadScope::Shared => 0,
            HeadScope::PerKvGroup => (head / (heads_q / heads_kv.max(1)).max(1)) as usize,
            HeadScope::PerHead => head as usize,
        };
        index.min(self.masks.len().saturating_sub(1))
    }

    pub fn mask_for_head(&self, head: u64, heads_q: u64, heads_kv: u64) -> &Mask {
        &self.masks[self.mask_index(head, heads_q, heads_kv)]
    }

    /// Allowed cells summed over all query heads: the area FLOPs are counted from.
    /// Saturates at `u64::MAX` rather than wrapping; [`MaskSet::check_heads`] refuses that.
    pub fn area_over_heads(&self, heads_q: u64, heads_kv: u64) -> u64 {
        self.checked_area_over_heads(heads_q, heads_kv)
            .unwrap_or(u64::MAX)
    }

    /// `None` when the sum over the heads does not fit in 64 bits.
    pub fn checked_area_over_heads(&self, heads_q: u64, heads_kv: u64) -> Option<u64> {
        if self.masks.is_empty() {
            return Some(0);
        }
        let areas: Vec<u64> = self.masks.iter().map(Mask::area).collect();
        let total: u128 = match self.scope {
            // Every head's mask is the same one: no need to walk 2⁶⁴ heads.
            HeadScope::Shared => u128::from(areas[0]) * u128::from(heads_q),
            _ => (0..heads_q)
                .map(|head| u128::from(areas[self.mask_index(head, heads_q, heads_kv)]))
                .sum(),
        };
        u64::try_from(total).ok()
    }

    pub fn flops(&self, heads_q: u64, heads_kv: u64, head_dim: u64, value_dim: u64) -> Flops {
        Flops::of(
            self.area_over_heads(heads_q, heads_kv),
            1,
            head_dim,
            value_dim,
        )
    }

    /// `None` when a FLOPs count does not fit in 64 bits.
    pub fn checked_flops(&self, heads_q: u64, heads_kv: u64, head_dim: u64) -> Option<Flops> {
        Flops::checked_of(
            self.checked_area_over_heads(heads_q, heads_kv)?,
            1,
            head_dim,
            head_dim,
        )
    }
}
