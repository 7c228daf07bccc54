#!/usr/bin/env bash
# The trainer model layer on one H200 (issue 19), unattended, in under 10 minutes: the trainer's
# CUDA tests, the output head's kernels (head_kernels.py: Triton against compiled), then
# trainer_mfu.py with kernel profiles for the 0.6B, 1.7B and MoE shapes against compiled
# transformers.
# Logs, trainer_mfu.jsonl and the profiles go to $OUT (at most 8 files).
# Without uv: PYTHONPATH=src plus the carried wheels.
set -uo pipefail
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
BUDGET=${BUDGET:-560}
# the fastest settings measured (docs/benchmarks.md, runs 13-14) against compiled transformers
FAST=tandem_master_logits_bf16moments
VARIANTS=${VARIANTS:-0.6b:$FAST,moe:$FAST,moe:hf_compiled,0.6b:hf_compiled,1.7b:$FAST}
start=$(date +%s)
source "$(dirname "$0")/gpu_part.sh"

part gpu_tests 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/gpu/test_models_cuda.py tests/gpu/test_cuda.py
tail -n 15 "$OUT/gpu_tests.log"
part head 60 python3 benchmarks/head_kernels.py
grep -E "^\||diff" "$OUT/head.log"
part mfu 600 python3 benchmarks/trainer_mfu.py --profile --steps 5 --warmup 3 --variants "$VARIANTS" --out "$OUT/trainer_mfu.jsonl"
tail -n 8 "$OUT/mfu.log"
