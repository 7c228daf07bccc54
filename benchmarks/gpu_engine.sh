#!/usr/bin/env bash
# Issue 11 on one GPU (H200), unattended, in two calls of under 9 minutes (PARTS=engine,http and
# PARTS=fp8,moe,gpu_tests,prefix): the engine core against its graph-replay bound and the prefix
# cache on/off (engine_throughput.py, with transformers `generate` in the same run and the GPU's
# idle time over one whole run), HTTP whole
# responses and streaming with the prefix cache on/off and with engine.prompt_attention auto and
# varlen (inference_throughput.py), FP8 (rowwise and triton) vs bf16 at a Qwen3-8B shape at 16, 64
# and 256 concurrent requests (fp8_decode.py), Qwen3-MoE decode at a Qwen3-30B-A3B shape cut to 12
# layers (moe_decode.py), the CUDA tests, then what the prefix cache saves where prompts share
# prefixes (prefix_cache.py: n = 8, Wordle). Logs and JSON
# go to $OUT (default ./gpu-out); the last thing printed is one table of the targets. On the
# device, whose calls return at most 8 files: R=$OUT; OUT=/tmp/engine BUNDLE=$R/engine.tgz bash ...
# Without uv: PYTHONPATH=src plus the carried wheels (fastapi, uvicorn, httptools, uvloop, ...).
set -uo pipefail
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
BUDGET=${BUDGET:-530}  # seconds for everything; each part gets at most what is left
start=$(date +%s)

PARTS=${PARTS:-engine,http,fp8,moe,gpu_tests,prefix}  # which parts run (two device calls: split them)
# (also `mixed`, not by default: the engine part on prompts of 64–192 tokens, where prompt kernels differ;
# and `pieces,pieces_http`: engine.prompt_graphs against the plain forward, in the core and over HTTP)
source "$(dirname "$0")/gpu_part.sh"
want() { [[ ",$PARTS," == *",$1,"* ]]; }

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$OUT/device.txt" 2>&1
python3 -c "import torch, triton, transformers; print(torch.__version__, torch.version.cuda, triton.__version__, transformers.__version__)" >> "$OUT/device.txt" 2>&1
want engine && part engine 240 python3 benchmarks/engine_throughput.py --num-requests 256 --prompt-len 128 --output-len 256 \
  --profile --timeline --out "$OUT/engine.json"
want mixed && part mixed 200 python3 benchmarks/engine_throughput.py --num-requests 256 --prompt-len 128 \
  --output-len 256 --skip-hf --mixed-lengths --out "$OUT/engine_mixed.json"
want http && part http 300 python3 benchmarks/inference_throughput.py --num-requests 256 --prompt-len 128 --output-len 256 \
  --skip-transformers --compare-prefix-cache --compare-prompt-attention auto,varlen --out "$OUT/http.json"
want fp8 && part fp8 270 python3 benchmarks/fp8_decode.py --concurrency 16 64 256 --kernel rowwise triton \
  --out "$OUT/fp8.json"
want moe && part moe 110 python3 benchmarks/moe_decode.py --num-layers 12 --out "$OUT/moe.json"
want pieces && part pieces 300 python3 benchmarks/prompt_graphs.py --out "$OUT/prompt_graphs.json"
want pieces_http && part pieces_http 240 python3 benchmarks/inference_throughput.py --num-requests 256 --prompt-len 128 \
  --output-len 256 --skip-transformers --compare-prompt-graphs --out "$OUT/http_pieces.json"
want gpu_tests && part gpu_tests 180 python3 -m pytest -q -m gpu -p no:cacheprovider tests/gpu/test_engine_cuda.py \
  tests/gpu/test_prefill_servers_gpu.py
want prefix && part prefix 120 python3 benchmarks/prefix_cache.py --out "$OUT/prefix.json"
tail -n 3 "$OUT/gpu_tests.log" 2>/dev/null
python3 benchmarks/engine_report.py "$OUT"
