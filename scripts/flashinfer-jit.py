#!/usr/bin/env python3
"""Compile, in parallel, the FlashInfer kernels that attnbench's `flashinfer` adapter calls.

    scripts/flashinfer-jit.py [--dtype bf16|fp16] [--head-dim 128] [--jobs N] [--variants bsr,block sparse,...]

FlashInfer compiles each kernel variant with nvcc the first time a process calls it (about two
minutes a variant on an H200 host) and keeps it in its JIT cache (`$FLASHINFER_WORKSPACE_BASE`,
default `~/.cache/flashinfer`). A pipeline meets them one after another, inside measurements that
hold the machine alone; this makes the same calls on tiny inputs, one process per variant, so the
compilations overlap and a pipeline started afterwards finds them all cached. The variants are
the adapter's paths: single prefill (with and without a sliding window), documents as a ragged
batch (with and without), the BSR and the variable block-sparse wrappers, and the decode adapter's
paged batch decode and causal paged prefill. Compile time is never
part of a measurement either way (the adapter's first call is untimed); this only shortens the run.
"""
import argparse
import concurrent.futures
import multiprocessing
import sys
import time

SEQ, DOCS, WINDOW = 256, (96, 160), 64


def variant(name, dtype_name, head_dim, heads_q, heads_kv):
    import torch
    import flashinfer
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype_name]
    q, k, v = (torch.randn(SEQ, h, head_dim, device="cuda", dtype=dtype) for h in (heads_q, heads_kv, heads_kv))
    scale = head_dim ** -0.5
    start = time.perf_counter()
    if name.startswith("single"):
        window = {"window_left": WINDOW} if name.endswith("window") else {}
        flashinfer.single_prefill_with_kv_cache(q, k, v, causal=True, kv_layout="NHD", sm_scale=scale,
                                                return_lse=True, **window)
    elif name.startswith("ragged"):
        bounds = torch.tensor([0, DOCS[0], SEQ], dtype=torch.int32, device="cuda")
        wrapper = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(
            torch.empty(128 << 20, dtype=torch.uint8, device="cuda"), "NHD")
        wrapper.plan(bounds, bounds, heads_q, heads_kv, head_dim, causal=True,
                     window_left=WINDOW if name.endswith("window") else -1, sm_scale=scale, q_data_type=dtype)
        wrapper.run(q, k, v, return_lse=True)
    elif name.startswith("paged"):
        # The decode adapter's wrappers: two sequences in 16-token pages; one new token each
        # (batch decode) or four (causal paged prefill).
        page, pages = 16, SEQ // 16
        cache = tuple(torch.randn(pages, page, heads_kv, head_dim, device="cuda", dtype=dtype) for _ in range(2))
        int32 = lambda values: torch.tensor(values, dtype=torch.int32, device="cuda")  # noqa: E731
        layout = (int32([0, pages // 2, pages]), int32(list(range(pages))), int32([page, page]))
        workspace = torch.empty(128 << 20, dtype=torch.uint8, device="cuda")
        if name == "paged decode":
            # Tensor cores for GQA groups of 4 or more, as the adapter asks for them.
            wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD",
                                                                    use_tensor_cores=heads_q // heads_kv >= 4)
            wrapper.plan(*layout, heads_q, heads_kv, head_dim, page, pos_encoding_mode="NONE",
                         q_data_type=dtype, kv_data_type=dtype, sm_scale=scale)
            wrapper.run(q[:2], cache, return_lse=True)
        else:
            wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
            wrapper.plan(int32([0, 4, 8]), *layout, heads_q, heads_kv, head_dim, page, causal=True,
                         sm_scale=scale, q_data_type=dtype, kv_data_type=dtype)
            wrapper.run(q[:8], cache, return_lse=True)
    elif name == "bsr":
        blocks = 4
        kept = torch.ones(blocks, blocks, dtype=torch.bool, device="cuda").tril()
        indptr = torch.cat([kept.new_zeros(1, dtype=torch.int32), kept.sum(-1).cumsum(0).to(torch.int32)])
        wrapper = flashinfer.BlockSparseAttentionWrapper(torch.empty(128 << 20, dtype=torch.uint8, device="cuda"))
        wrapper.plan(indptr, kept.nonzero()[:, 1].to(torch.int32).contiguous(), SEQ, SEQ, SEQ // blocks, SEQ // blocks,
                     heads_q, heads_kv, head_dim, sm_scale=scale, q_data_type=dtype, o_data_type=dtype)
        wrapper.run(q, k, v, return_lse=True)
    else:
        blocks = 4
        kept = torch.ones(heads_kv, blocks, blocks, dtype=torch.bool, device="cuda").tril()
        sizes = torch.full((heads_kv, blocks), SEQ // blocks, dtype=torch.int32, device="cuda")
        wrapper = flashinfer.VariableBlockSparseAttentionWrapper(
            torch.empty(128 << 20, dtype=torch.uint8, device="cuda"))
        wrapper.plan(kept, sizes, sizes, heads_q, heads_kv, head_dim, causal=False, sm_scale=scale, q_data_type=dtype)
        heads_first = (x.transpose(0, 1).contiguous() for x in (q, k, v))  # this wrapper takes [H, S, D]
        wrapper.run(*heads_first, return_lse=True)
    torch.cuda.synchronize()
    return name, time.perf_counter() - start


VARIANTS = ("single", "single window", "ragged", "ragged window", "bsr", "block sparse", "paged decode",
            "paged prefill")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--heads", default="64:8",
                        help="query:KV heads (the kernels do not depend on them; the decode path does on their ratio)")
    parser.add_argument("--jobs", type=int, default=len(VARIANTS))
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help="comma-separated, of " + ", ".join(VARIANTS) + " (default: all)")
    args = parser.parse_args()
    chosen = args.variants.split(",")
    unknown = set(chosen) - set(VARIANTS)
    if unknown:
        parser.error(f"--variants: {', '.join(sorted(unknown))} is not one of {', '.join(VARIANTS)}")
    heads_q, heads_kv = (int(x) for x in args.heads.split(":"))
    context = multiprocessing.get_context("spawn")  # each process initialises CUDA itself
    failed = 0
    with concurrent.futures.ProcessPoolExecutor(args.jobs, mp_context=context) as pool:
        futures = {pool.submit(variant, name, args.dtype, args.head_dim, heads_q, heads_kv): name for name in chosen}
        for future in concurrent.futures.as_completed(futures):
            try:
                name, seconds = future.result()
                print(f"{name}: ready ({seconds:.0f} s)", flush=True)
            except Exception as error:  # one variant failing leaves the others compiled
                failed += 1
                print(f"{futures[future]}: failed: {type(error).__name__}: {error}", flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
