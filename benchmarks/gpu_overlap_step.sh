#!/usr/bin/env bash
# `[optim] overlap_step` on one GPU, in about 4 minutes: its GPU test (the overlapped step trains
# as the step in line), the 1.7B shape with and without it (trainer_mfu.py, overlap first and
# last), and the reverse-text SFT trainer with it on CUDA, checkpointing and then resuming.
# Logs go to $OUT. Without uv: PYTHONPATH=src plus the carried wheels.
set -uo pipefail
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
BUDGET=${BUDGET:-300}
FAST=1.7b:tandem_master_logits_bf16moments
start=$(date +%s)
source "$(dirname "$0")/gpu_part.sh"

part gpu_test 90 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_models_cuda.py -k overlapped
tail -n 3 "$OUT/gpu_test.log"
part mfu 200 python3 benchmarks/trainer_mfu.py --steps 8 --warmup 3 --out "$OUT/trainer_mfu.jsonl" \
  --variants "${FAST}_overlap-cudnn,$FAST-cudnn,${FAST}_overlap-cudnn"
tail -n 5 "$OUT/mfu.log"
work=$(mktemp -d)
python3 -m tandem.models.tiny --out "$work/tiny" > /dev/null
sft=(python3 -m tandem.trainer.sft.cli @ examples/reverse_text/sft.toml --model.name "$work/tiny" --model.device cuda
  --optim.master-weights optimizer --optim.overlap-step true --eval.final false --run-dir "$work/run")
part sft 40 "${sft[@]}" --max-steps 40 --ckpt.interval 20
part sft_resume 30 "${sft[@]}" --max-steps 50 --ckpt.interval 20 --resume true
grep -hE "sft: (done|resumed)|Error" "$OUT/sft.log" "$OUT/sft_resume.log"
rm -rf "$work"
