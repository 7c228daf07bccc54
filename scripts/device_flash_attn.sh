#!/usr/bin/env bash
# Prepare FlashAttention 4 (`model.attention = "flash"`) for the GPU machine, which lacks it and
# takes at most 64 MiB a call: its CuTe DSL library alone is a 92 MB wheel (60 MB as xz). So it
# travels in two calls to one warm machine, each leaving its half in /tmp/fa4 there, and a third
# call installs it (the machine is given back after ~30 s idle: make the calls back to back).
#   bash scripts/device_flash_attn.sh             # here: .fa4/part1 and .fa4/part2 (git-ignored)
#   call 1, carry [".fa4/part1"]:  mkdir -p /tmp/fa4 && cp .fa4/part1/* /tmp/fa4/
#   call 2, carry [".fa4/part2"]:  cp .fa4/part2/* /tmp/fa4/
#   call 3, carry [".whl"]:        source scripts/device_flash_attn.sh install; <the run>
# `install` puts it into /tmp/site beside the carried wheels and sets PYTHONPATH (the DSL's own
# packages sit in a folder that a .pth file would add, which pip --target does not run).
# The GPU machine has cuda-bindings 13 and einops already; torch's CUDA 13 takes the DSL's cu13 build.
if [ "${1:-}" = install ]; then  # sourced on the GPU machine
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site /tmp/fa4/*.whl \
    && cat /tmp/fa4/cutlass_dsl_cu13.tar.xz.* | xz -d | tar -C /tmp/site -xf - \
    && export PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages:${PYTHONPATH:-src}
  return  # the tar after pip, whose --upgrade replaces whole folders
fi
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.fa4/' .git/info/exclude 2>/dev/null || echo '/.fa4/' >> .git/info/exclude
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
download() {
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --dest "$work" "$@"
}
download flash-attn-4==4.0.0b40 quack-kernels==0.6.5 apache-tvm-ffi==0.1.15.post2 torch-c-dlpack-ext==0.1.5 \
  nvidia-cutlass-dsl==4.8.1 nvidia-cutlass-dsl-libs-base==4.8.1 nvidia-cutlass-dsl-libs-core==4.8.1 \
  nvidia-cutlass-dsl-libs-cu13==4.8.1
mkdir -p "$work/cu13"
unzip -q "$work"/nvidia_cutlass_dsl_libs_cu13-*.whl -d "$work/cu13"
rm "$work"/nvidia_cutlass_dsl_libs_cu13-*.whl
echo "compressing the CuTe DSL's CUDA 13 libraries (~4 minutes on 2 cores)"
tar -C "$work/cu13" -cf - . | xz -9 -T0 > "$work/cutlass_dsl_cu13.tar.xz"
rm -rf .fa4 && mkdir -p .fa4/part1 .fa4/part2
split -b 31800000 -d "$work/cutlass_dsl_cu13.tar.xz" "$work/cutlass_dsl_cu13.tar.xz."
mv "$work"/cutlass_dsl_cu13.tar.xz.00 "$work"/*.whl .fa4/part1/
mv "$work"/cutlass_dsl_cu13.tar.xz.01 .fa4/part2/
du -sh .fa4/part1 .fa4/part2
