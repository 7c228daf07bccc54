#!/usr/bin/env bash
# The two-GPU measurements (nvidia-h200-x2), one part per 10-minute device call:
#   PART=sync  bash benchmarks/gpu_multi.sh   # weight sync, 0.6B and 1.7B shapes: broadcast GPU 0 -> GPU 1
#                                             # against filesystem and colocated (benchmarks/weight_sync.py)
#   PART=rl-shared  bash benchmarks/gpu_multi.sh   # reverse-text RL at the Qwen3-0.6B shape on one GPU shared
#   PART=rl-split   bash benchmarks/gpu_multi.sh   # ... on one inference + one trainer GPU; each part runs
#                                             # max_async_level 0, 1 and 2, then benchmarks/rl_timing.py over them
#   PART=fsdp  bash benchmarks/gpu_multi.sh   # FSDP2 on 2 GPUs against 1 (0.6B, 1.7B; the MoE shape with
#                                             # ep = 2): benchmarks/trainer_mfu.py --nproc 2 and --nproc 1
#   PART=cp    bash benchmarks/gpu_multi.sh   # cp = 2, ulysses and ring, at 32k and 64k against cp = 1 on one
#                                             # GPU: benchmarks/long_context.py (rerun until it says "all done")
#   PART=prefill bash benchmarks/gpu_multi.sh  # two colocated servers against one decode + one prefill server
#                                             # (Qwen3-0.6B shape, 2,048-token prompts): benchmarks/prefill_servers.py
#   STEPS      RL steps per run (default 20);  RL_TIMEOUT  seconds per RL run (default 170)
#   VARIANT    trainer_mfu's tandem flags (default: the fastest measured on one GPU)
# Output and logs go to $OUT. On a machine without uv: PYTHONPATH=src and the pure-Python
# dependencies importable.
set -uo pipefail
OUT=${OUT:-gpu-out}
PY=${PYTHON:-python3}
STEPS=${STEPS:-20}
VARIANT=${VARIANT:-tandem_master_logits_bf16moments}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

case "${PART:-sync}" in
sync)
  timeout 540 "$PY" benchmarks/weight_sync.py 2>&1 | tee "$OUT/weight_sync.txt"
  ;;
rl-shared | rl-split)
  work=$(mktemp -d)
  "$PY" -m tandem.models.tiny --out "$work/q06" --hidden-size 1024 --num-layers 28 --num-heads 16 \
    --num-kv-heads 8 --head-dim 128 --intermediate-size 3072 --vocab-size 151936 \
    --max-position-embeddings 4096 > /dev/null
  runs=()
  gpus=${PART#rl-}
  trainer_gpu=0
  [ "$gpus" = split ] && trainer_gpu=1
  for level in 0 1 2; do
    name="rl_${gpus}_async$level"
    timeout "${RL_TIMEOUT:-170}" "$PY" -m tandem.launch.cli @ examples/reverse_text/rl.toml \
      --model.name "$work/q06" --run-dir "$work/$name" --max-steps "$STEPS" \
      --trainer.ckpt.interval 0 --orchestrator.eval.interval 0 --orchestrator.sampling.max-tokens 128 \
      --orchestrator.max-async-level "$level" \
      --deployment.inference-gpus '["0"]' --deployment.trainer-gpus "[\"$trainer_gpu\"]" > "$OUT/$name.log" 2>&1
    echo "$name exit $?"; grep -E "^\[rl\]|weights by|rror" "$OUT/$name.log" | tail -3
    cp "$work/$name/metrics.jsonl" "$OUT/$name.metrics.jsonl" 2>/dev/null
    runs+=("$work/$name")
  done
  "$PY" benchmarks/rl_timing.py "${runs[@]}" | tee "$OUT/rl_timing.md"
  rm -rf "$work"
  ;;
prefill)
  timeout 570 "$PY" benchmarks/prefill_servers.py --gpus 0,1 --shape qwen3-0.6b --prompt-len 2048 \
    --output-len 256 --rate 8 --duration 20 --min-tokens 256 --layouts colocated split-shared split-p2p \
    split-http --out "$OUT/prefill_servers.json" 2>&1 \
    | tail -8 | tee "$OUT/prefill_servers.txt"
  ;;
fsdp)
  two="0.6b:$VARIANT,1.7b:$VARIANT,moe:${VARIANT}_ep2"
  one="0.6b:$VARIANT,1.7b:$VARIANT,moe:$VARIANT"
  timeout 330 "$PY" benchmarks/trainer_mfu.py --nproc 2 --steps 5 --warmup 3 --variants "$two" \
    --out "$OUT/trainer_2gpu.jsonl" 2>&1 | tail -8 | tee "$OUT/trainer_2gpu.txt"
  timeout 240 "$PY" benchmarks/trainer_mfu.py --steps 5 --warmup 3 --variants "$one" \
    --out "$OUT/trainer_1gpu.jsonl" 2>&1 | tail -8 | tee "$OUT/trainer_1gpu.txt"
  ;;
cp)
  timeout 570 "$PY" benchmarks/long_context.py --shapes 0.6b --settings none,cp2,cp2-ring --trainers sft \
    --max-len 65536 --budget-s 540 --out "$OUT/long_context_cp.jsonl" 2>&1 | tail -12 | tee "$OUT/long_context_cp.txt"
  ;;
*)
  echo "PART must be sync, rl-shared, rl-split, fsdp or cp" >&2
  exit 2
  ;;
esac
