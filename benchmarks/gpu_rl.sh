#!/usr/bin/env bash
# Reverse-text RL on GPUs: `rl` with one GPU shared by inference and trainer, and with two GPUs
# split one and one, from MODEL (default: the example's shipped SFT checkpoint). Logs, metrics and
# reward curves go to $OUT.
# On a machine without uv: PYTHONPATH=src and the pure-Python dependencies importable.
set -uo pipefail
OUT=${OUT:-gpu-out}
STEPS=${STEPS:-30}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
MODEL=${MODEL:-examples/reverse_text/sft-checkpoint}
work=$(mktemp -d)
run_rl() {  # name, gpu args...
  local name=$1; shift
  timeout "${RL_TIMEOUT:-240}" python -m tandem.launch.cli @ examples/reverse_text/rl.toml --model.name "$MODEL" \
    --run-dir "$work/$name" --max-steps "$STEPS" "$@" > "$OUT/$name.log" 2>&1
  echo "$name exit $?"; grep -E "rl:|error" "$OUT/$name.log" | tail -5
  cp "$work/$name/metrics.jsonl" "$OUT/$name.metrics.jsonl"
  python -m tandem.monitor.plot "$work/$name" --out "$OUT/$name.png" > /dev/null
}
run_rl rl_1gpu --deployment.inference-gpus '["0"]' --deployment.trainer-gpus '["0"]'
run_rl rl_2gpu --deployment.inference-gpus '["0"]' --deployment.trainer-gpus '["1"]'
rm -rf "$work"
