#!/usr/bin/env bash
# Builds the attnbench wheel (packaging/pip): the release binary through maturin, and beside it
# the plugins, pipelines, datasets and the CP rank binary, laid out as scripts/stage-install.sh
# lays out an installation. Prints the wheel's path.
#
#   scripts/build-wheel.sh [MATURIN]     (default: maturin on the PATH)
set -euo pipefail
maturin=${1:-maturin}
command -v "$maturin" >/dev/null 2>&1 || {
  echo "build-wheel.sh: \`$maturin\` not found; install it with \`pip install maturin\` or pass its path" >&2
  exit 2
}
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
staged=$(mktemp -d)
trap 'rm -rf "$staged"' EXIT
scripts/stage-install.sh "$staged/prefix" >/dev/null
data=target/wheel-data
rm -rf "$data"
mkdir -p "$data/data" "$data/scripts"
for dir in plugins pipelines datasets; do cp -r "$staged/prefix/$dir" "$data/data/$dir"; done
install -m 0755 "$staged/prefix/bin/attnbench-cp-rank" "$data/scripts/attnbench-cp-rank"
# --auditwheel skip: the binary opens CUDA and the plugins at run time, which auditwheel would
# otherwise try to bundle or refuse.
(cd packaging/pip && "$maturin" build --release --locked --auditwheel skip --out "$root/target/wheels") >&2
ls -t target/wheels/attnbench-*.whl | head -1
