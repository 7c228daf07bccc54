#!/usr/bin/env bash
# Reverse-text RL on GPUs: SFT a larger tiny Qwen3 briefly, then run `rl` with one GPU shared by
# inference and trainer, and with two GPUs split one and one. Logs and metrics go to $OUT.
# On a machine without uv: PYTHONPATH=src and the pure-Python dependencies importable.
set -uo pipefail
OUT=${OUT:-gpu-out}
STEPS=${STEPS:-30}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
work=$(mktemp -d)
python -m tandem.models.tiny --out "$work/base" --hidden-size 512 --num-layers 8 --num-heads 8 \
  --num-kv-heads 4 --intermediate-size 1536 > /dev/null
python -m tandem.trainer.sft.cli @ examples/reverse_text/sft_warmup.toml --run-dir "$work/sft" \
  --model.name "$work/base" --model.device cuda 2>&1 | grep -E "sft: done|error" | tee "$OUT/sft.log"
python -m tandem.evaluate --model.name "$work/sft/final" --num-tasks 200 2>&1 | tail -1 | tee "$OUT/sft.eval"

run_rl() {  # name, gpu args...
  local name=$1; shift
  timeout 240 python -m tandem.launch.cli @ examples/reverse_text/rl.toml --model.name "$work/sft/final" \
    --run-dir "$work/$name" --max-steps "$STEPS" "$@" > "$OUT/$name.log" 2>&1
  echo "$name exit $?"; grep -E "rl:|error" "$OUT/$name.log" | tail -5
  cp "$work/$name/metrics.jsonl" "$OUT/$name.metrics.jsonl"
  python -m tandem.monitor.plot "$work/$name" --out "$OUT/$name.png" > /dev/null
}
run_rl rl_1gpu --deployment.inference-gpus '["0"]' --deployment.trainer-gpus '["0"]'
run_rl rl_2gpu --deployment.inference-gpus '["0"]' --deployment.trainer-gpus '["1"]'
rm -rf "$work"
