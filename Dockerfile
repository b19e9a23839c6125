# syntax=docker/dockerfile:1
#
# Reproducible attnbench images.
#
#   docker build -t attnbench .                      # CPU image (the default target)
#   docker run --rm -v "$PWD/artifacts:/work/artifacts" attnbench
#       runs the CPU quickstart; results and the cache land in ./artifacts
#
#   docker build --target gpu -t attnbench:gpu .
#   docker run --rm --gpus all -v "$PWD/artifacts:/work/artifacts" attnbench:gpu attnbench doctor
#       GPU use: the NVIDIA container toolkit (`--gpus all`) mounts the host driver's libcuda into
#       the container; the CUDA 13 runtime libraries (NVRTC, cuBLAS) come from the base image.
#       The host driver must support CUDA 13 (driver 580 or newer).
#
# Python kernels (`python/benchmark`): both images have python3 with numpy (the CPU backend); for
# SDPA, FlexAttention and the FlashAttention family, derive an image that pip-installs torch (and
# those packages) and set ATTNBENCH_PYTHON to its interpreter.
#
# The builder stage runs scripts/stage-install.sh, the same script CI runs outside containers.
#
# Where no registry is reachable (CI), scripts/container-build.sh builds these same stages with
# podman from a Debian base made by mmdebstrap: the build arguments below name the images, and the
# machine's own Rust toolchain and target folder are mounted into the build at their own paths.

ARG BUILDER=rust:1-bookworm
ARG BASE=debian:bookworm-slim
ARG GPU_BASE=nvidia/cuda:13.0.0-runtime-ubuntu24.04

FROM ${BUILDER} AS builder
# Where the toolchain's binaries are (the rust image's, or a mounted one) and where the source
# goes; a mounted target folder is only reused when the source sits at the path it was built at.
ARG TOOLCHAIN_BIN=/usr/local/cargo/bin
ARG SRC=/src
ENV PATH=${TOOLCHAIN_BIN}:$PATH
# The dependency layer: a C toolchain for the crates that build C (the rust image has one).
# `--error-on=any`: without it apt-get update succeeds offline and the install fails obscurely.
RUN command -v cc >/dev/null || { { apt-get update --error-on=any || { echo "attnbench image: apt-get could not reach the package mirror; build on a machine that reaches it (or pass --build-arg http_proxy=...)" >&2; exit 1; }; } \
      && apt-get install -y --no-install-recommends gcc libc6-dev ca-certificates \
      && rm -rf /var/lib/apt/lists/*; }
WORKDIR ${SRC}
COPY . .
RUN scripts/stage-install.sh /opt/attnbench

FROM ${BASE} AS cpu
RUN { apt-get update --error-on=any || { echo "attnbench image: apt-get could not reach the package mirror; build on a machine that reaches it (or pass --build-arg http_proxy=...)" >&2; exit 1; }; } \
    && apt-get install -y --no-install-recommends ca-certificates python3 python3-numpy \
    && rm -rf /var/lib/apt/lists/*
COPY --from=builder /opt/attnbench /opt/attnbench
ENV PATH=/opt/attnbench/bin:$PATH \
    ATTNBENCH_PLUGIN_PATH=/opt/attnbench/plugins \
    ATTNBENCH_CACHE=/work/artifacts
WORKDIR /work
CMD ["attnbench", "run", "/opt/attnbench/pipelines/quickstart.yaml"]

FROM ${GPU_BASE} AS gpu
RUN { apt-get update --error-on=any || { echo "attnbench image: apt-get could not reach the package mirror; build on a machine that reaches it (or pass --build-arg http_proxy=...)" >&2; exit 1; }; } \
    && apt-get install -y --no-install-recommends ca-certificates python3 python3-numpy \
    && rm -rf /var/lib/apt/lists/*
COPY --from=builder /opt/attnbench /opt/attnbench
ENV PATH=/opt/attnbench/bin:$PATH \
    ATTNBENCH_PLUGIN_PATH=/opt/attnbench/plugins \
    ATTNBENCH_CACHE=/work/artifacts
WORKDIR /work
CMD ["attnbench", "doctor"]

FROM cpu
