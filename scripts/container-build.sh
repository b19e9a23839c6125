#!/usr/bin/env bash
# Builds the Dockerfile's images with podman on a machine that reaches a Debian mirror but no
# image registry (as CI does): a bookworm base made by mmdebstrap and imported once, the machine's
# own Rust toolchain and the repository's target folder mounted into the build at their own
# paths, so that the release build already made here is the one the image gets (built once).
#
#   scripts/container-build.sh [cpu] [gpu]      # default: both; images localhost/attnbench:TARGET
#
# The GPU target is built on the same Debian base here, since no nvidia/cuda image can be pulled;
# with a registry, `docker build --target gpu .` starts from nvidia/cuda as the Dockerfile says.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
for tool in podman mmdebstrap; do
  command -v "$tool" >/dev/null || {
    echo "container-build: $tool is not installed; apt-get install podman mmdebstrap runc" >&2
    exit 2
  }
done
work=$root/target/container
mkdir -p "$work"
# crun refuses a hybrid cgroup layout, and podman's default ulimits can exceed the hard limits.
cat > "$work/containers.conf" <<'CONF'
[containers]
default_ulimits = ["nofile=20000:20000", "nproc=32768:32768"]
[engine]
runtime = "runc"
CONF
export CONTAINERS_CONF=$work/containers.conf
base=localhost/attnbench-base:bookworm
mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
if ! podman image exists "$base"; then
  mmdebstrap --quiet --variant=minbase bookworm "$work/base.tar" "$mirror" || {
    echo "container-build: mmdebstrap could not build a base from the Debian mirror $mirror; set DEBIAN_MIRROR to one this machine reaches" >&2
    exit 1
  }
  podman import "$work/base.tar" "$base" >/dev/null
  rm -f "$work/base.tar"
fi
cargo_home=${CARGO_HOME:-$HOME/.cargo}
rustup_home=${RUSTUP_HOME:-$HOME/.rustup}
for target in ${*:-cpu gpu}; do
  podman build --target "$target" --tag "localhost/attnbench:$target" \
    --build-arg BUILDER="$base" --build-arg BASE="$base" --build-arg GPU_BASE="$base" \
    --build-arg SRC="$root" --build-arg TOOLCHAIN_BIN="$cargo_home/bin" \
    --volume "$cargo_home:$cargo_home" --volume "$rustup_home:$rustup_home" \
    --volume "$root/target:$root/target" .
done
