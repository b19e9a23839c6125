#!/usr/bin/env bash
# A GPU machine's check-up with the attnbench given as the first argument (default: the one on PATH):
# doctor, the harness against a cuBLAS GEMM, the naive kernel against the CPU reference, the
# in-process flash backend against the host's f64 blocks, the flash kernel's other head dims
# (96, 192, 256, MLA's 192/128), the decode kernel's variants, the naive
# kernel's pipeline, and the repeatability of one cell. Results go under $OUT (default:
# ./gpu-check). NAIVE_ARGS are passed to the naive pipeline's run (e.g. to narrow its matrix with
# --set); STEPS picks steps (default: all of doctor gemm check backend headdims decode naive repeat); CHECK_KERNELS the
# native kernels the correctness step runs (default: naive, flash), CHECK_SEQLENS its lengths
# (default: 512, 1k).
set -uo pipefail
steps=" ${STEPS:-doctor gemm check backend headdims decode naive repeat} "
want() { [[ $steps == *" $1 "* ]]; }
attnbench=${1:-attnbench}
command -v "$attnbench" >/dev/null || { echo "gpu-check: no attnbench at \`$attnbench\`: install it (scripts/stage-install.sh) or give its path as the first argument" >&2; exit 2; }
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
  $attnbench run "$root/pipelines/checks/gemm.yaml" -v 2>&1 | tail -3
fi

if want check; then
  echo "== native kernels (${CHECK_KERNELS:-naive, flash}) against the f64 reference (every mask, ${CHECK_SEQLENS:-512, 1k} tokens, fwd and bwd)"
  $attnbench run "$root/pipelines/checks/correctness.yaml" -q \
    --set "stages.masks.matrix.seqlen=[${CHECK_SEQLENS:-512, 1k}]" --set "stages.sparse_masks.matrix.seqlen=[${CHECK_SEQLENS:-512, 1k}]" \
    --set "stages.bench.matrix.kernel=[${CHECK_KERNELS:-naive, flash}]" 2>&1 | tail -4
fi

if want backend; then
  echo "== the in-process flash backend (cuda/flash) against the host's f64 blocks"
  $attnbench run "$root/pipelines/checks/backend.yaml" -q 2>&1 | tail -4
fi

if want headdims; then
  echo "== the flash kernel at head dims 96, 192, 256 and MLA's 192/128 against the f64 reference"
  $attnbench run "$root/pipelines/checks/head-dims.yaml" -q 2>&1 | tail -4
fi

if want decode; then
  echo "== the decode kernel (d 64/128, bf16/fp16, MHA and GQA, packed and paged) against the f64 reference"
  $attnbench run "$root/pipelines/checks/decode.yaml" -q 2>&1 | tail -4
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
    for name in ('gemm.json', 'decode.json'):
        path = os.path.join(art, name)
        if os.path.exists(path): return json.load(open(path))
    return None
rows = []
for run in sorted(glob.glob(os.path.join(cache, 'runs', '*', 'run.json'))):
    record = json.load(open(run))
    for node in record['nodes']:
        r = result(node)
        if not r or node['id'].startswith('report'): continue
        t = r.get('tflops') or {}
        t = t if isinstance(t, dict) else {'p50': t}  # a decode step records one figure
        c = r.get('correctness') or {}
        errs = {k: v for k, v in (c.get('errors') or {}).items() if isinstance(v, (int, float))}
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
