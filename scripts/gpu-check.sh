#!/usr/bin/env bash
# A GPU machine's check-up, from a staged bundle (`.device/run.sh`) or an installed attnbench:
# doctor, the harness against a cuBLAS GEMM, the naive kernel against the CPU reference, the
# in-process flash backend against the host's f64 blocks, the naive kernel's pipeline, and the
# repeatability of one cell. Results go under $OUT (default:
# ./gpu-check). NAIVE_ARGS are passed to the naive pipeline's run (e.g. to narrow its matrix with
# --set); STEPS picks steps (default: all of doctor gemm check backend naive repeat); CHECK_KERNELS the
# native kernels the correctness step runs (default: naive, flash), CHECK_SEQLENS its lengths
# (default: 512, 1k).
set -uo pipefail
steps=" ${STEPS:-doctor gemm check backend naive repeat} "
want() { [[ $steps == *" $1 "* ]]; }
attnbench=${ATTNBENCH:-.device/run.sh}
out=${OUT:-gpu-check}
mkdir -p "$out"
export ATTNBENCH_CACHE=${ATTNBENCH_CACHE:-$out/cache}
root=$(cd "$(dirname "$0")/.." && pwd)

if want doctor; then
  echo "== doctor"
  $attnbench doctor | tee "$out/doctor.txt"
fi

if want gemm; then
  echo "== cuBLAS bf16 GEMM 8192³ through the harness"
  cat > "$out/gemm.yaml" <<'YAML'
name: gemm
stages:
  gemm: {uses: cuda/gemm, matrix: {dtype: [bf16]}}
YAML
  $attnbench run "$out/gemm.yaml" -v 2>&1 | tail -3
fi

if want check; then
  echo "== native kernels (${CHECK_KERNELS:-naive, flash}) against the f64 reference (every mask, ${CHECK_SEQLENS:-512, 1k} tokens, fwd and bwd)"
  cat > "$out/check.yaml" <<YAML
name: gpu-correctness
seed: 7
defaults: {heads_q: 8, heads_kv: 2, head_dim: 128}
stages:
  masks:
    uses: masks/generate
    matrix:
      mask: [full, causal, causal_document, full_document, sliding_window, sliding_window_causal, share_question, causal_blockwise, prefix_lm_causal, prefix_lm_document, global_sliding_window, block_causal_document]
      seqlen: [${CHECK_SEQLENS:-512, 1k}]
    with: {window: 128, block_size: 128}
  bench:
    uses: cuda/benchmark
    needs: [masks]
    matrix: {kernel: [${CHECK_KERNELS:-naive, flash}], dtype: [bf16, fp16, f32], direction: [fwd, bwd]}
    with: {check_max_seqlen: 1k, warmup_reps: 1, min_reps: 3, max_time_s: 0.2}
  fused:
    uses: cuda/benchmark
    needs: [masks]
    matrix: {dtype: [bf16, fp16]}
    with: {kernel: flash, backward: fused, direction: bwd, check_max_seqlen: 1k, warmup_reps: 1, min_reps: 3, max_time_s: 0.2}
  # On Hopper the flash kernel runs wgmma by default; its mma.sync kernels are checked here too.
  mma:
    uses: cuda/benchmark
    needs: [masks]
    matrix: {dtype: [bf16, fp16]}
    with: {kernel: flash, instructions: mma, direction: bwd, check_max_seqlen: 1k, warmup_reps: 1, min_reps: 3, max_time_s: 0.2}
  # Blocks of 64 tokens split the 128-row tiles (the flash kernel's narrow-tile paths), blocks
  # of 128 do not.
  sparse_masks:
    uses: masks/generate
    matrix: {seqlen: [${CHECK_SEQLENS:-512, 1k}], sparse_block: [64, 128]}
    with: {mask: block_sparse_uniform, density: 0.5}
  sparse:
    uses: cuda/benchmark
    needs: [sparse_masks]
    matrix: {instructions: [auto, mma], dtype: [bf16, fp16]}
    with: {kernel: flash, direction: bwd, check_max_seqlen: 1k, warmup_reps: 1, min_reps: 3, max_time_s: 0.2}
  report:
    uses: report/table
    needs: {bench: all, fused: all, mma: all, sparse: all}
YAML
  $attnbench run "$out/check.yaml" -q 2>&1 | tail -4
fi

if want backend; then
  echo "== the in-process flash backend (cuda/flash) against the host's f64 blocks"
  cat > "$out/backend.yaml" <<'YAML'
name: backend-check
seed: 5
stages:
  masks:
    uses: masks/generate
    matrix:
      mask: [causal, causal_document, sliding_window, global_sliding_window, prefix_lm_document, block_sparse_uniform]
    with: {seqlen: 2k, window: 200, sparse_block: 64, heads_q: 8, heads_kv: 2}
  check:
    uses: cuda/backend-check
    needs: [masks]
    matrix: {dtype: [bf16, fp16], head_dim: [64, 128]}
    with: {block: 384}
YAML
  $attnbench run "$out/backend.yaml" -q 2>&1 | tail -4
fi

# The pipelines fetch LongCA-bench's Pile histogram; a GPU machine without network gives a copy
# of it in DISTRIBUTION, else these checks draw documents from the synthetic histogram.
documents=(--set "stages.lengths.with.source=${DISTRIBUTION:-synthetic}")

if want naive; then
  echo "== the naive kernel's pipeline"
  # shellcheck disable=SC2086
  $attnbench run "$root/pipelines/naive-gpu.yaml" -q "${documents[@]}" ${NAIVE_ARGS:-} 2>&1 | tail -4
fi

if want repeat; then
  echo "== repeatability: the same cell twice"
  cell='bench[mask=causal,seqlen=8k,kernel=naive,direction=fwd]'
  for i in 1 2; do
    $attnbench run "$root/pipelines/naive-gpu.yaml" -q "${documents[@]}" --force "$cell" --set 'stages.masks.matrix.seqlen=[8k]' --set 'stages.masks.matrix.mask=[causal]' >/dev/null 2>&1
    # The forced cell's cache entry is replaced by the next run: keep this run's measurement now.
    python3 -c "import json,sys; r=json.load(open(sys.argv[1])); n=[n for n in r['nodes'] if n['id']==sys.argv[2]][0]; print(json.dumps(json.load(open(n['artifact']+'/measurement.json'))))" \
      "$ATTNBENCH_CACHE/runs/$(cat "$ATTNBENCH_CACHE/runs/latest")/run.json" "$cell" > "$out/repeat-$i.json"
  done
fi

echo "== summary"
python3 - "$ATTNBENCH_CACHE" "$out" <<'PY'
import json, os, sys, glob
cache, out = sys.argv[1], sys.argv[2]
def result(node):
    art = node.get('artifact')
    if not art: return None
    path = os.path.join(art, 'measurement.json')
    if os.path.exists(path): return json.load(open(path))
    path = os.path.join(art, 'gemm.json')
    return json.load(open(path)) if os.path.exists(path) else None
rows = []
for run in sorted(glob.glob(os.path.join(cache, 'runs', '*', 'run.json'))):
    record = json.load(open(run))
    for node in record['nodes']:
        r = result(node)
        if not r or node['id'].startswith('report'): continue
        t = r.get('tflops') or {}
        c = r.get('correctness') or {}
        errs = c.get('errors') or {}
        rows.append((record['pipeline'], node['id'], r.get('status', 'ok'), t.get('p50'), (r.get('time_s') or {}).get('p50'), c.get('passed'), max(errs.values()) if errs else None, r.get('reason')))
seen = set()
with open(os.path.join(out, 'summary.tsv'), 'w') as f:
    for row in rows:
        key = row[:2]
        line = '\t'.join('' if x is None else (f'{x:.4g}' if isinstance(x, float) else str(x)) for x in row)
        f.write(line + '\n')
        if key in seen: continue
        seen.add(key)
        print(line)
values = [json.load(open(p))['time_s']['p50'] for p in (os.path.join(out, f'repeat-{i}.json') for i in (1, 2)) if os.path.exists(p)]
if len(values) == 2:
    print(f'repeatability: medians {values[0]*1e3:.3f} ms and {values[1]*1e3:.3f} ms differ by {abs(values[0]-values[1])/min(values)*100:.2f}%')
PY
