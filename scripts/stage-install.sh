#!/usr/bin/env bash
# Builds the workspace in release and installs it under PREFIX as the runtime image lays it out:
#   PREFIX/bin/attnbench, PREFIX/plugins/*.so, PREFIX/pipelines/, PREFIX/datasets/
# The Dockerfile's builder stage runs exactly this; CI runs it too, since no Docker engine runs there.
set -euo pipefail
prefix=${1:?usage: scripts/stage-install.sh PREFIX}
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
cargo build --release --workspace --locked
target=${CARGO_TARGET_DIR:-$root/target}/release
rm -rf "$prefix"
mkdir -p "$prefix/bin" "$prefix/plugins"
install -m 0755 "$target/attnbench" "$prefix/bin/attnbench"
# One rank of a multi-process context-parallel run; the cp plugin looks for it beside attnbench.
install -m 0755 "$target/attnbench-cp-rank" "$prefix/bin/attnbench-cp-rank"
for library in "$target"/lib*.so; do
  # The test plugin misbehaves on purpose; it is not part of an installation.
  case "$(basename "$library")" in libattnbench_testkit.so) continue ;; esac
  install -m 0644 "$library" "$prefix/plugins/"
done
for dir in pipelines datasets; do
  if [ -d "$dir" ]; then cp -r "$dir" "$prefix/$dir"; fi
done
echo "installed attnbench into $prefix"
