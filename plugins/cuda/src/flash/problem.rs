//! A benchmark's problem on the device: inputs uploaded once, the passes run on demand, the
//! outputs read back.

use attnbench_sdk::reference::{Element, Grads, HeadMasks, Inputs, Shape};
use attnbench_sdk::PluginError;

use super::device::{DeviceTables, Dims, GradTensors, Tensors};
use super::functions::{Functions, HopperFunctions};
use super::launch::{launch_backward, launch_forward, Backward, Instructions, Schedule};
use super::tables::{tables, MaskTiles};
use super::{HeadDims, Kernels};
use crate::gpu::{Buffer, Gpu};

/// What only the backward pass needs.
pub(super) struct Gradients {
    pub(super) d_out: Buffer<u8>,
    pub(super) delta: Buffer<f32>,
    pub(super) dq: Buffer<f32>,
    pub(super) dk: Buffer<f32>,
    pub(super) dv: Buffer<f32>,
}

pub struct Problem {
    dims: Dims,
    q: Buffer<u8>,
    k: Buffer<u8>,
    v: Buffer<u8>,
    pub out: Buffer<f32>,
    pub lse: Buffer<f32>,
    tables: DeviceTables,
    functions: Functions,
    grad: Option<Gradients>,
    pub backward: Backward,
    pub instructions: Instructions,
    pub schedule: Schedule,
}

impl Problem {
    #[allow(clippy::too_many_arguments)]
    pub fn upload(
        gpu: &Gpu,
        kernels: &Kernels,
        shape: Shape,
        element: Element,
        masks: &HeadMasks,
        inputs: &Inputs,
        backward: bool,
    ) -> Result<Problem, PluginError> {
        let head = HeadDims {
            qk: shape.head_dim,
            v: shape.value_dim(),
        };
        let mask_of_head: Vec<i32> = masks.index_of_head.iter().map(|&i| i as i32).collect();
        let tables = DeviceTables::upload(gpu, &tables(&MaskTiles::of_set(masks)), &mask_of_head)?;
        let grad = if backward {
            Some(Gradients {
                d_out: gpu.upload("dO", &element.encode(&inputs.d_out))?,
                delta: gpu.alloc("D", shape.heads_q * shape.seqlen)?,
                dq: gpu.alloc("dQ", shape.q_len())?,
                dk: gpu.alloc("dK", shape.kv_len())?,
                dv: gpu.alloc("dV", shape.v_len())?,
            })
        } else {
            None
        };
        Ok(Problem {
            dims: Dims {
                heads_q: shape.heads_q,
                heads_kv: shape.heads_kv,
                len: shape.seqlen,
                head,
                scale: shape.scale(),
            },
            q: gpu.upload("Q", &element.encode(&inputs.q))?,
            k: gpu.upload("K", &element.encode(&inputs.k))?,
            v: gpu.upload("V", &element.encode(&inputs.v))?,
            out: gpu.alloc("O", shape.out_len())?,
            lse: gpu.alloc("LSE", shape.heads_q * shape.seqlen)?,
            tables,
            functions: kernels.functions(element, head)?,
            grad,
            backward: Backward::Split,
            instructions: Instructions::Auto,
            schedule: Schedule::Grid,
        })
    }

    /// The instructions (`wgmma` or `mma`) the forward runs on here, and the backward's where
    /// the problem has one; an error where the choice cannot run.
    pub fn instructions_used(&self) -> Result<(&'static str, Option<&'static str>), PluginError> {
        let name =
            |hopper: Option<&HopperFunctions>| if hopper.is_some() { "wgmma" } else { "mma" };
        let (instructions, f) = (self.instructions, &self.functions);
        let backward = match self.grad {
            Some(_) => Some(name(instructions.backward(
                f,
                self.backward,
                self.tables.forward_rows,
            )?)),
            None => None,
        };
        let forward = instructions.forward(f)?;
        self.schedule.check(forward)?;
        Ok((name(forward), backward))
    }

    pub(super) fn tensors(&self, gpu: &Gpu) -> Tensors {
        let stream = &gpu.stream;
        Tensors {
            q: self.q.address(stream),
            k: self.k.address(stream),
            v: self.v.address(stream),
            out: self.out.address(stream),
            lse: self.lse.address(stream),
        }
    }

    pub fn forward(&self, gpu: &Gpu) -> Result<(), PluginError> {
        // SAFETY: the buffers were allocated for these dimensions and the tables built for this
        // mask set and length.
        unsafe {
            launch_forward(
                &gpu.stream,
                &self.functions,
                self.dims,
                &self.tensors(gpu),
                &self.tables,
                self.instructions,
                self.schedule,
            )
        }
    }

    /// dQ, dK and dV from the forward pass's O and LSE (the forward must have run).
    pub fn backward(&self, gpu: &Gpu) -> Result<(), PluginError> {
        let Some(grad) = &self.grad else {
            return Err(PluginError::failed(
                "the problem was uploaded without backward buffers",
            ));
        };
        let stream = &gpu.stream;
        let g = GradTensors {
            d_out: grad.d_out.address(stream),
            delta: grad.delta.address(stream),
            dq: grad.dq.address(stream),
            dk: grad.dk.address(stream),
            dv: grad.dv.address(stream),
        };
        // SAFETY: as in `forward`; the gradient buffers were allocated for these dimensions.
        unsafe {
            launch_backward(
                stream,
                &self.functions,
                self.dims,
                &self.tensors(gpu),
                &g,
                &self.tables,
                self.backward,
                self.instructions,
            )
        }
    }

    pub fn grads(&self, gpu: &Gpu) -> Result<Option<Grads>, PluginError> {
        let Some(grad) = &self.grad else {
            return Ok(None);
        };
        Ok(Some(Grads {
            dq: gpu.download(&grad.dq)?,
            dk: gpu.download(&grad.dk)?,
            dv: gpu.download(&grad.dv)?,
        }))
    }
}
