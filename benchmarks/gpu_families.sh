#!/usr/bin/env bash
# Issue 14 on one GPU (H200), unattended: the GLM and MiniMax families at their published layer
# shapes (benchmarks/bench_models.py FAMILY_SHAPES), layer counts cut to fit. Two parts, each
# under 10 minutes (run them as two commands, or PART=all for both):
#   PART=trainer  trainer MFU, tandem against transformers (trainer_mfu.py --variants families),
#                 then the CUDA tests of the families (GLM-5 sparse path = dense mask, trains,
#                 memory linear; the engines with CUDA graphs against transformers)
#   PART=engine   engine decode tok/s at 64 and 256 concurrent requests (moe_decode.py --shape
#                 for GLM-4.5-Air, MiniMax-M2, GLM-5; each model deleted after its run: disk)
# Logs and JSON go to $OUT (default ./gpu-out); the tables are printed last.
# Without uv: PYTHONPATH=src plus the carried wheels (MACHINE-NOTES); transformers must know
# glm4_moe, minimax_m2 and glm_moe_dsa (5.17 on the H200 does, per MACHINE-NOTES).
set -uo pipefail
OUT=${OUT:-gpu-out}
PART=${PART:-all}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
BUDGET=${BUDGET:-560}  # seconds per part; each step gets at most what is left
source "$(dirname "$0")/gpu_part.sh"
python3 -c "import torch, transformers; print(torch.__version__, torch.version.cuda, transformers.__version__, torch.cuda.get_device_name())" > "$OUT/device.txt" 2>&1
if [ "$PART" = trainer ] || [ "$PART" = all ]; then
  start=$(date +%s)
  part families_trainer 470 python3 benchmarks/trainer_mfu.py --variants families --steps 4 --warmup 2 \
    --out "$OUT/families_trainer.jsonl"
  part family_gpu_tests 120 python3 -m pytest -q -m gpu -p no:cacheprovider -k "glm5 or glm_and_minimax or glm_keeps_its_router" \
    tests/gpu/test_models_cuda.py tests/gpu/test_engine_cuda.py
  tail -n 3 "$OUT/family_gpu_tests.log" 2>/dev/null
  sed -n '/^variant/,$p' "$OUT/families_trainer.log"
fi
if [ "$PART" = engine ] || [ "$PART" = all ]; then
  start=$(date +%s)
  for shape in glm-4.5-air minimax-m2 glm-5; do
    part "decode_$shape" 180 python3 benchmarks/moe_decode.py --shape "$shape" --delete \
      --work-dir "$OUT/models" --out "$OUT/decode_$shape.json"
  done
  cat "$OUT/device.txt"
  echo "| shape | layers | weights GiB | CUDA graphs | concurrency | output tok/s | decode-step tok/s |"
  for shape in glm-4.5-air minimax-m2 glm-5; do grep -E "^\| $shape" "$OUT/decode_$shape.log"; done
fi
