#!/usr/bin/env bash
# Issue 10's GPU measurements on one H200 (or two). Each part fits in one 10-minute device call:
#   PART=sync  bash benchmarks/gpu_weights.sh   # the gpu-marked transfer tests (if pytest is there),
#                                               # then benchmarks/weight_sync.py (0.6B and 1.7B shapes)
#   PART=rl    bash benchmarks/gpu_weights.sh   # reverse-text RL at the Qwen3-0.6B shape, one GPU shared,
#                                               # weights by filesystem (before) and auto = colocated (after),
#                                               # then benchmarks/rl_timing.py over both runs
#   STEPS      RL steps per run (default 30);  RL_TIMEOUT  seconds per run (default 240)
# Output and logs go to $OUT. On a machine without uv: PYTHONPATH=src and the pure-Python
# dependencies importable.
set -uo pipefail
OUT=${OUT:-gpu-out}
PY=${PYTHON:-python3}
STEPS=${STEPS:-30}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

case "${PART:-sync}" in
sync)
  if "$PY" -c "import pytest" 2>/dev/null; then
    timeout 300 "$PY" -m pytest -q -m gpu tests/gpu/test_weight_transfer_gpu.py 2>&1 | tail -5 | tee "$OUT/gpu_tests.txt"
  else
    echo "(pytest not importable: skipped tests/gpu/test_weight_transfer_gpu.py)"
  fi
  timeout 400 "$PY" benchmarks/weight_sync.py 2>&1 | tee "$OUT/weight_sync.txt"
  ;;
rl)
  work=$(mktemp -d)
  "$PY" -m tandem.models.tiny --out "$work/q06" --hidden-size 1024 --num-layers 28 --num-heads 16 \
    --num-kv-heads 8 --head-dim 128 --intermediate-size 3072 --vocab-size 151936 \
    --max-position-embeddings 4096 > /dev/null
  for transport in filesystem auto; do
    timeout "${RL_TIMEOUT:-240}" "$PY" -m tandem.launch.cli @ examples/reverse_text/rl.toml \
      --model.name "$work/q06" --run-dir "$work/rl_$transport" --max-steps "$STEPS" \
      --trainer.ckpt.interval 0 --orchestrator.eval.interval 0 --orchestrator.sampling.max-tokens 128 \
      --deployment.inference-gpus '["0"]' --deployment.trainer-gpus '["0"]' \
      --weights.transport "$transport" > "$OUT/rl_$transport.log" 2>&1
    echo "rl_$transport exit $?"; grep -E "^\[rl\]|weights by|rror" "$OUT/rl_$transport.log" | tail -4
    cp "$work/rl_$transport/metrics.jsonl" "$OUT/rl_$transport.metrics.jsonl"
  done
  "$PY" benchmarks/rl_timing.py "$work/rl_filesystem" "$work/rl_auto" | tee "$OUT/rl_timing.md"
  rm -rf "$work"
  ;;
*)
  echo "PART must be sync or rl" >&2
  exit 2
  ;;
esac
