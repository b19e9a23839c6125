//! Every flash kernel's one parameter, `FlashParams` of `kernels/flash/params.cuh`: filled by
//! name per launch, passed by value. Its layout is pinned twice — `static_assert`s in the header,
//! which NVRTC checks, and a test here that reads them and compares them with this struct — so
//! that the two sides cannot drift apart unnoticed.

use std::sync::Arc;

use cudarc::driver::{CudaStream, DeviceRepr};

use super::device::{DeviceTables, Dims, GradTensors, TensorMap, Tensors};
use crate::gpu::Buffer;

/// See `params.cuh` for what each field means. Device addresses are `u64`, 0 where a kernel
/// does not read them; maps are zeros where the kernel has none.
#[repr(C, align(64))]
#[derive(Clone, Copy)]
pub(super) struct FlashParams {
    pub(super) q: u64,
    pub(super) k: u64,
    pub(super) v: u64,
    pub(super) out: u64,
    pub(super) lse: u64,
    pub(super) tile_start: u64,
    pub(super) tiles: u64,
    pub(super) order: u64,
    pub(super) interval_start: u64,
    pub(super) intervals: u64,
    pub(super) mask_of_head: u64,
    pub(super) seqlen: i32,
    pub(super) group: i32,
    pub(super) scale_log2: f32,
    pub(super) scale: f32,
    pub(super) d_out: u64,
    pub(super) delta: u64,
    pub(super) dq: u64,
    pub(super) dk: u64,
    pub(super) dv: u64,
    pub(super) rows: i32,
    pub(super) heads: i32,
    pub(super) q_map: TensorMap,
    pub(super) k_map: TensorMap,
    pub(super) v_map: TensorMap,
    pub(super) do_map: TensorMap,
}

// SAFETY: plain data with the layout of the device's `FlashParams` (tested below), passed by
// value as the kernels' one parameter.
unsafe impl DeviceRepr for FlashParams {}

/// A launch's work lists: the tiles each grid tile visits, and the order to start them.
pub(super) struct WorkLists<'a> {
    pub(super) start: &'a Buffer<u32>,
    pub(super) tiles: &'a Buffer<u32>,
    pub(super) order: Option<&'a Buffer<u32>>,
}

/// The intervals a launch's partial tiles test: the rows' keys, or the keys' rows.
pub(super) struct Intervals<'a> {
    pub(super) start: &'a Buffer<u32>,
    pub(super) intervals: &'a Buffer<u32>,
}

impl FlashParams {
    /// A launch of `dims` on `x` (and `g` for the backward), work lists and maps unset.
    pub(super) fn new(
        stream: &Arc<CudaStream>,
        dims: Dims,
        x: &Tensors,
        g: Option<&GradTensors>,
        t: &DeviceTables,
    ) -> Self {
        let g = g.map_or([0; 5], |g| [g.d_out, g.delta, g.dq, g.dk, g.dv]);
        FlashParams {
            q: x.q,
            k: x.k,
            v: x.v,
            out: x.out,
            lse: x.lse,
            tile_start: 0,
            tiles: 0,
            order: 0,
            interval_start: 0,
            intervals: 0,
            mask_of_head: t.mask_of_head.address(stream),
            seqlen: dims.len as i32,
            group: (dims.heads_q / dims.heads_kv) as i32,
            scale_log2: dims.scale * std::f32::consts::LOG2_E,
            scale: dims.scale,
            d_out: g[0],
            delta: g[1],
            dq: g[2],
            dk: g[3],
            dv: g[4],
            rows: (dims.heads_q * dims.len) as i32,
            heads: dims.heads_q as i32,
            q_map: TensorMap::ZERO,
            k_map: TensorMap::ZERO,
            v_map: TensorMap::ZERO,
            do_map: TensorMap::ZERO,
        }
    }

    /// These parameters with `lists` and `intervals` as the launch's.
    pub(super) fn walking(
        mut self,
        stream: &Arc<CudaStream>,
        lists: &WorkLists<'_>,
        intervals: &Intervals<'_>,
    ) -> Self {
        self.tile_start = lists.start.address(stream);
        self.tiles = lists.tiles.address(stream);
        self.order = lists.order.map_or(0, |order| order.address(stream));
        self.interval_start = intervals.start.address(stream);
        self.intervals = intervals.intervals.address(stream);
        self
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;
    use std::mem::{align_of, offset_of, size_of};

    use super::FlashParams;
    use crate::nvrtc::{compile_ptx, CudaSource};

    const HEADER: &str = include_str!("../../kernels/flash/params.cuh");

    /// Every field and its offset in the Rust struct.
    fn fields() -> Vec<(&'static str, usize)> {
        vec![
            ("q", offset_of!(FlashParams, q)),
            ("k", offset_of!(FlashParams, k)),
            ("v", offset_of!(FlashParams, v)),
            ("out", offset_of!(FlashParams, out)),
            ("lse", offset_of!(FlashParams, lse)),
            ("tile_start", offset_of!(FlashParams, tile_start)),
            ("tiles", offset_of!(FlashParams, tiles)),
            ("order", offset_of!(FlashParams, order)),
            ("interval_start", offset_of!(FlashParams, interval_start)),
            ("intervals", offset_of!(FlashParams, intervals)),
            ("mask_of_head", offset_of!(FlashParams, mask_of_head)),
            ("seqlen", offset_of!(FlashParams, seqlen)),
            ("group", offset_of!(FlashParams, group)),
            ("scale_log2", offset_of!(FlashParams, scale_log2)),
            ("scale", offset_of!(FlashParams, scale)),
            ("d_out", offset_of!(FlashParams, d_out)),
            ("delta", offset_of!(FlashParams, delta)),
            ("dq", offset_of!(FlashParams, dq)),
            ("dk", offset_of!(FlashParams, dk)),
            ("dv", offset_of!(FlashParams, dv)),
            ("rows", offset_of!(FlashParams, rows)),
            ("heads", offset_of!(FlashParams, heads)),
            ("q_map", offset_of!(FlashParams, q_map)),
            ("k_map", offset_of!(FlashParams, k_map)),
            ("v_map", offset_of!(FlashParams, v_map)),
            ("do_map", offset_of!(FlashParams, do_map)),
        ]
    }

    /// The number the header's `static_assert(WHAT(FlashParams) == N, ...)` states.
    fn asserted(what: &str) -> usize {
        let prefix = format!("static_assert({what}(FlashParams) == ");
        let line = HEADER
            .lines()
            .find_map(|line| line.strip_prefix(prefix.as_str()))
            .unwrap_or_else(|| panic!("params.cuh asserts {what}(FlashParams)"));
        line.split(',').next().unwrap().trim().parse().unwrap()
    }

    #[test]
    fn the_rust_params_have_the_size_and_alignment_the_header_asserts() {
        assert_eq!(size_of::<FlashParams>(), asserted("sizeof"));
        assert_eq!(align_of::<FlashParams>(), asserted("alignof"));
    }

    /// A kernel that stores every field's offset, then the size and alignment, compiled by NVRTC
    /// with the header; the offsets come back as the PTX's constants.
    #[test]
    #[ignore = "needs libnvrtc on the library path (a CUDA toolkit or the nvidia-cuda-nvrtc wheel)"]
    fn nvrtc_lays_the_params_out_as_the_rust_struct() {
        let fields = fields();
        let mut probe = String::from(
            "#include \"flash/primitives.cuh\"\n#include \"flash/params.cuh\"\n\
             extern \"C\" __global__ void layout(volatile unsigned long long* out) {\n\
             const FlashParams p{};\n",
        );
        for (i, (name, _)) in fields.iter().enumerate() {
            probe += &format!(
                "out[{i}] = (unsigned long long)((const char*)&p.{name} - (const char*)&p);\n"
            );
        }
        let n = fields.len();
        probe += &format!(
            "out[{n}] = sizeof(FlashParams);\nout[{}] = alignof(FlashParams);\n}}\n",
            n + 1
        );
        let headers: Vec<_> = crate::flash::SOURCE
            .headers
            .iter()
            .filter(|(name, _)| ["flash/primitives.cuh", "flash/params.cuh"].contains(name))
            .copied()
            .collect();
        let source = CudaSource {
            name: "params_probe.cu",
            text: Box::leak(probe.into_boxed_str()),
            headers: Box::leak(headers.into_boxed_slice()),
        };
        let ptx = compile_ptx(&source, "sm_90a").unwrap();
        // `mov.u64 %rdN, VALUE;` then `st.volatile.global.u64 [%rdM+OFFSET], %rdN;`.
        let mut constants = HashMap::new();
        let mut stored = HashMap::new();
        for line in ptx.lines().map(str::trim) {
            let words: Vec<&str> = line
                .split(|c: char| c.is_whitespace() || c == ',' || c == ';')
                .filter(|w| !w.is_empty())
                .collect();
            match words.as_slice() {
                ["mov.u64", register, value] => {
                    if let Ok(value) = value.parse::<usize>() {
                        constants.insert(register.to_string(), value);
                    }
                }
                ["st.volatile.global.u64", address, register] => {
                    let at = address
                        .trim_matches(|c| c == '[' || c == ']')
                        .split_once('+')
                        .map_or(0, |(_, offset)| offset.parse::<usize>().unwrap());
                    stored.insert(at / 8, constants[*register]);
                }
                _ => {}
            }
        }
        for (i, (name, offset)) in fields.iter().enumerate() {
            assert_eq!(
                stored.get(&i),
                Some(offset),
                "offset of {name}: device, then Rust"
            );
        }
        assert_eq!(stored.get(&n), Some(&size_of::<FlashParams>()), "size");
        assert_eq!(
            stored.get(&(n + 1)),
            Some(&align_of::<FlashParams>()),
            "alignment"
        );
    }
}
