#!/usr/bin/env bash
# SFT on GPUs: the reverse-text example on 1 GPU and with FSDP2 on 2 GPUs, plus a Qwen3-0.6B-shaped
# model for a throughput figure. Writes logs and metrics under $OUT (or ./gpu-out).
# On a machine without uv: PYTHONPATH=src and the pure-Python dependencies importable.
set -euo pipefail
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
work=$(mktemp -d)
python -m tandem.models.tiny --out "$work/tiny" > /dev/null

run_sft() {  # name, nproc, extra args...
  local name=$1 nproc=$2; shift 2
  local launcher=(python -m tandem.trainer.sft.cli)
  [ "$nproc" -gt 1 ] && launcher=(python -m torch.distributed.run --standalone --nproc-per-node "$nproc" -m tandem.trainer.sft.cli)
  "${launcher[@]}" @ examples/reverse_text/sft.toml --run-dir "$work/$name" --model.device cuda "$@" \
    2>&1 | tee "$OUT/$name.log" | grep -E "sft: done|error|Error" || true
  cp "$work/$name/metrics.jsonl" "$OUT/$name.metrics.jsonl" 2>/dev/null || true
}

run_sft sft_1gpu 1 --model.name "$work/tiny"
python -m tandem.evaluate --model.name "$work/sft_1gpu/final" --num-tasks 200 2>&1 | tail -1 | tee "$OUT/sft_1gpu.eval"
run_sft sft_2gpu 2 --model.name "$work/tiny"
python -m tandem.evaluate --model.name "$work/sft_2gpu/final" --num-tasks 200 2>&1 | tail -1 | tee "$OUT/sft_2gpu.eval"

# Throughput on a Qwen3-0.6B shape (random init, vocab 151,936 rows), 4 packed rows of 4096 tokens a step.
python -m tandem.models.tiny --out "$work/q06" --hidden-size 1024 --num-layers 28 --num-heads 16 \
  --num-kv-heads 8 --head-dim 128 --intermediate-size 3072 --vocab-size 151936 --max-position-embeddings 8192 > /dev/null
big=(--model.name "$work/q06" --seq-len 4096 --max-steps 12 --data.batch-size 960 --data.micro-batch-size 4
     --data.num-examples 20000 --ckpt.final false --optim.warmup-steps 2 --log.interval 4)
run_sft q06_1gpu 1 "${big[@]}"
run_sft q06_2gpu 2 "${big[@]}"
rm -rf "$work"
