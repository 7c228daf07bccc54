#!/usr/bin/env bash
# Reverse-text RL on GPUs with a larger tiny model: SFT it like sft_warmup.toml (4-6 letters only,
# so RL has the longer texts to learn), then `rl` twice: one GPU shared by inference and trainer,
# and two GPUs split one and one. Prints where each run's time goes (benchmarks/rl_timing.py);
# logs, metrics and reward curves go to $OUT.
#   SHAPE    tiny-model overrides (default: hidden 512, 8 layers, 25M parameters)
#   MODEL    start RL from this checkpoint instead (skips the SFT)
#   STEPS    RL steps per run (default 200);  RL_TIMEOUT  seconds per run (default 300)
#   RL_ARGS  extra overrides for both RL runs;  SWEEP  if set, also an lr sweep (both GPUs) first
#   SFT_TIMEOUT, SWEEP_TIMEOUT  seconds (default 300 each)
# On a machine without uv: PYTHONPATH=src and the pure-Python dependencies importable.
set -uo pipefail
OUT=${OUT:-gpu-out}
STEPS=${STEPS:-200}
PY=${PYTHON:-python3}
SHAPE=${SHAPE:-"--tiny.hidden-size 512 --tiny.num-layers 8 --tiny.num-heads 8 --tiny.num-kv-heads 4 --tiny.intermediate-size 1536"}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
work=$(mktemp -d)

if [ -z "${MODEL:-}" ]; then
  # shellcheck disable=SC2086
  timeout "${SFT_TIMEOUT:-300}" "$PY" -m tandem.trainer.sft.cli @ examples/reverse_text/sft_warmup.toml $SHAPE --model.device cuda \
    --model.name "$work/init" --run-dir "$work/sft" ${SFT_ARGS:-} > "$OUT/sft.log" 2>&1
  echo "sft exit $?"; grep -E "sft:|eval|rror" "$OUT/sft.log" | tail -4
  cp "$work/sft/metrics.jsonl" "$OUT/sft.metrics.jsonl"
  MODEL="$work/sft/final"
fi

if [ -n "${SWEEP:-}" ]; then
  rl="$PY -m tandem.launch.cli @ examples/reverse_text/rl.toml --model.name $MODEL --inference.port {port}"
  rl+=" --max-steps 80 --orchestrator.eval.interval 20 --trainer.ckpt.interval 0 --inference.engine.kv-cache-memory-gb 2"
  timeout "${SWEEP_TIMEOUT:-300}" "$PY" benchmarks/sweep.py --out "$work/sweep" --parallel 8 --metric eval/reward_mean \
    --metric2 eval/env/exact_match --command "$rl" \
    --variant lr3e-5="--trainer.optim.lr 3e-5" --variant lr1e-4="--trainer.optim.lr 1e-4" \
    --variant lr3e-4="--trainer.optim.lr 3e-4" --variant lr1e-3="--trainer.optim.lr 1e-3" > "$OUT/sweep.txt" 2>&1
  cat "$OUT/sweep.txt"
fi

run_rl() {  # name, gpu args...
  local name=$1; shift
  # shellcheck disable=SC2086
  timeout "${RL_TIMEOUT:-300}" "$PY" -m tandem.launch.cli @ examples/reverse_text/rl.toml --model.name "$MODEL" \
    --run-dir "$work/$name" --max-steps "$STEPS" --trainer.ckpt.interval 0 "$@" ${RL_ARGS:-} > "$OUT/$name.log" 2>&1
  echo "$name exit $?"; grep -E "^\[rl\]|rror" "$OUT/$name.log" | tail -5
  cp "$work/$name/metrics.jsonl" "$OUT/$name.metrics.jsonl"
  "$PY" -m tandem.monitor.plot "$work/$name" --out "$OUT/$name.png" > /dev/null 2>&1 || echo "(no plot: matplotlib missing?)"
}
run_rl rl_1gpu --deployment.inference-gpus '["0"]' --deployment.trainer-gpus '["0"]'
run_rl rl_2gpu --deployment.inference-gpus '["0"]' --deployment.trainer-gpus '["1"]'
"$PY" benchmarks/rl_timing.py "$work/rl_1gpu" "$work/rl_2gpu" | tee "$OUT/timing.md"
rm -rf "$work"
