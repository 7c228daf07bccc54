#!/usr/bin/env bash
# Issue 18 on one node of eight H200s (nvidia-h200-x8), one part per 10-minute device call (times
# are estimates: nothing here has run on that machine yet):
#   PART=async0 bash benchmarks/gpu_node.sh     # SFT a Qwen3-1.7B-shaped model (tiny tokenizer, 151,936
#       embedding rows) on reverse text like sft_warmup.toml: texts of 4-6 letters only, so RL has the
#       longer ones to learn (8 GPUs, ~2-3 min; skipped when $WORK/sft/final exists); then RL from it at
#       max_async_level 0 on 4 inference GPUs (one native server each) + 4 trainer GPUs (4 FSDP ranks),
#       ~4-5 min
#   PART=async2 bash benchmarks/gpu_node.sh     # the same at level 2, then async_speedup.py --report over
#       both levels: wall time to the same held-out reward, and the speed-up. The trainer's compile (its
#       first steps) falls inside both levels' timed windows; the table's s / step is the steady state.
#       A fresh machine makes the SFT model again (same seed) and has no level-0 run: then report from
#       both calls' files, `async_speedup.py --out DIR --report` with their $OUT/async/async_0 and
#       async_2 copied into DIR
#   PART=moe-train bash benchmarks/gpu_node.sh  # trainer_mfu.py --nproc 8: Qwen3-30B-A3B with all 48
#       layers, ep = 8 + FSDP: tokens/s per GPU and MFU of the active parameters (~2-3 min; if it fails,
#       e.g. out of memory, again with full activation checkpointing), then its 8-layer cut on 8 GPUs,
#       against one GPU's figure. Compiled transformers cannot run it: its variants train on one GPU,
#       and 48 layers' bf16 weights, gradients and AdamW state are 244 GB
#   PART=moe-rl bash benchmarks/gpu_node.sh     # that model (random init, tiny tokenizer, bf16: 61 GB,
#       built once into $WORK, ~2 min) served by 4 native-engine servers and trained on 4 GPUs with
#       ep = 4 for MOE_STEPS RL steps, then rl_timing.py (~5-7 min, the final 61 GB export included)
#   SCALE=smoke  every part at a tiny scale on CPU, a check of the flow and not a measurement: the
#       4-layer model of sft_warmup.toml, RL with one server and 2 gloo trainer ranks, trainer_mfu.py's
#       smoke MoE on 2 gloo ranks with ep = 2, a tiny Qwen3-MoE trained with ep = 2
#   STEPS  RL steps per async level (default 100; smoke 10), evaluated every EVAL_EVERY (10; 5) steps
#   SFT_ARGS, RL_ARGS  overrides added to the SFT and to both async levels (the defaults, SFT lr 3e-4
#       and RL lr 3e-5 at the 1.7B shape, are guesses); MOE_STEPS (default 6), MOE_LAYERS (48)
#   WORK   models and run directories (default runs/node: git-ignored, so a warm machine keeps them)
# Output and logs go to $OUT. On a machine without uv: PYTHONPATH=src and the pure-Python
# dependencies importable; PYTHON names the interpreter (default python3).
set -uo pipefail
OUT=${OUT:-gpu-out}
PY=${PYTHON:-python3}
SCALE=${SCALE:-node}
BUDGET=${BUDGET:-560}  # seconds per part; each step gets at most what is left
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
source "$(dirname "$0")/gpu_part.sh"
case "$SCALE" in
node)
  WORK=${WORK:-runs/node}
  STEPS=${STEPS:-100}
  EVAL_EVERY=${EVAL_EVERY:-10}
  MOE_LAYERS=${MOE_LAYERS:-48}
  sft=("$PY" -m torch.distributed.run --standalone --nproc-per-node 8 -m tandem.trainer.sft.cli)
  sft_shape=(--model.device cuda --optim.lr 3e-4 --tiny.hidden-size 2048 --tiny.num-layers 28
             --tiny.num-heads 16 --tiny.num-kv-heads 8 --tiny.head-dim 128 --tiny.intermediate-size 6144
             --tiny.vocab-size 151936)
  rl_lr=(--trainer.optim.lr 3e-5)
  devices=(--deployment.inference-gpus '["0","1","2","3"]' --deployment.trainer-gpus '["4","5","6","7"]')
  mfu=(--nproc 8)
  moe_shape=moe48
  moe_variant=tandem_master_logits_bf16moments_ep8
  rl_ep=4
  moe_model="$WORK/qwen3-30b-a3b-${MOE_LAYERS}l"
  make_moe=("$PY" -c 'import sys, torch; from pathlib import Path; sys.path.insert(0, "benchmarks")
from bench_models import build_random
build_random("qwen3-30b-a3b", Path(sys.argv[1]), torch.device("cuda"), int(sys.argv[2]))' "$moe_model.tmp" "$MOE_LAYERS")
  ;;
smoke)
  WORK=${WORK:-runs/node-smoke}
  STEPS=${STEPS:-10}
  EVAL_EVERY=${EVAL_EVERY:-5}
  sft=("$PY" -m tandem.trainer.sft.cli)
  sft_shape=(--max-steps 40)
  rl_lr=()
  devices=(--deployment.trainer-nproc 2)
  mfu=(--device cpu --nproc 2)
  moe_shape=smoke
  moe_variant=tandem_master_logits_bf16moments_ep2
  rl_ep=2
  moe_model="$WORK/tiny-moe"
  # 4,096 embedding rows for a 331-token tokenizer: a random model samples ids it cannot decode
  make_moe=("$PY" -m tandem.models.tiny --out "$moe_model.tmp" --num-experts 8 --experts-per-token 2
            --vocab-size 4096 --tie-word-embeddings false)
  ;;
*)
  echo "SCALE must be node or smoke" >&2
  exit 2
  ;;
esac

keep() {  # run directory under $WORK: its metrics and process logs into $OUT, at the same path
  mkdir -p "$OUT/$1"
  cp "$WORK/$1/metrics.jsonl" "$OUT/$1/" 2>/dev/null
  cp -r "$WORK/$1/logs" "$OUT/$1/" 2>/dev/null
}

make_sft() {  # part 1's starting point, unless this machine has it already
  if [ -f "$WORK/sft/final/config.json" ]; then
    echo "sft: $WORK/sft/final exists, reused"
    return
  fi
  rm -rf "$WORK/sft"
  # shellcheck disable=SC2086
  part sft 300 "${sft[@]}" @ examples/reverse_text/sft_warmup.toml --model.name "$WORK/init" \
    --run-dir "$WORK/sft" --ckpt.final false "${sft_shape[@]}" ${SFT_ARGS:-}
  keep sft
  grep -E "^sft: (step|done)|rror" "$OUT/sft.log" | tail -3
}

case "${PART:-async0}" in
async0 | async2)
  start=$(date +%s)
  level=${PART#async}
  make_sft
  [ -f "$WORK/sft/final/config.json" ] || { echo "async$level: no SFT model in $WORK/sft/final" >&2; exit 1; }
  rm -rf "$WORK/async/async_$level"
  # shellcheck disable=SC2086
  part "async_$level" "$BUDGET" "$PY" benchmarks/async_speedup.py --out "$WORK/async" --levels "$level" -- \
    "$PY" -m tandem.launch.cli @ examples/reverse_text/rl.toml --model.name "$WORK/sft/final" \
    --max-steps "$STEPS" --orchestrator.eval.interval "$EVAL_EVERY" --trainer.ckpt.interval 0 \
    "${rl_lr[@]}" "${devices[@]}" ${RL_ARGS:-}
  keep "async/async_$level"
  grep -E "^\[rl\]|rror" "$OUT/async_$level.log" | tail -3
  sed -n '/^held-out reward target/,$p' "$OUT/async_$level.log"
  if [ "$level" = 2 ]; then
    if [ -f "$WORK/async/async_0/metrics.jsonl" ]; then
      "$PY" benchmarks/async_speedup.py --out "$WORK/async" --levels 0,2 --report | tee "$OUT/async_speedup.txt"
    else
      echo "async2: no level-0 run on this machine; report from both calls' \$OUT/async (see the header)"
    fi
  fi
  ;;
moe-train)
  start=$(date +%s)
  rm -f "$OUT/moe_train.jsonl"
  train() {  # name, limit (s), variant
    part "$1" "$2" "$PY" benchmarks/trainer_mfu.py "${mfu[@]}" --steps 5 --warmup 3 --variants "$3" \
      --out "$OUT/moe_train.jsonl"
  }
  train moe_train 330 "$moe_shape:$moe_variant"
  if grep -q '"error"' "$OUT/moe_train.jsonl" 2>/dev/null; then
    train moe_train_ac 330 "$moe_shape:${moe_variant}_ac"
  fi
  # the 8-layer cut on 8 GPUs, against one GPU's 71,845 tok/s (docs/benchmarks.md, run 13)
  [ "$SCALE" = node ] && train moe8_train 150 "moe:$moe_variant"
  for log in "$OUT"/moe*_train*.log; do sed -n '/^variant/,$p' "$log"; done
  ;;
moe-rl)
  start=$(date +%s)
  if [ ! -d "$moe_model" ]; then  # built aside and moved into place once whole
    rm -rf "$moe_model.tmp"
    timeout 240 "${make_moe[@]}" > "$OUT/moe_model.log" 2>&1 && mv "$moe_model.tmp" "$moe_model"
    echo "moe_model: built in $(( $(date +%s) - start )) s"
  fi
  [ -d "$moe_model" ] || { echo "moe-rl: the model was not built (see $OUT/moe_model.log)" >&2; exit 1; }
  rm -rf "$WORK/moe_rl"
  part moe_rl "$BUDGET" "$PY" -m tandem.launch.cli @ examples/reverse_text/rl.toml --model.name "$moe_model" \
    --run-dir "$WORK/moe_rl" --max-steps "${MOE_STEPS:-6}" --orchestrator.eval.interval 0 \
    --trainer.ckpt.interval 0 --orchestrator.sampling.max-tokens 64 --trainer.parallel.ep "$rl_ep" \
    --trainer.optim.master-weights optimizer --trainer.optim.moments-dtype bfloat16 "${devices[@]}"
  keep moe_rl
  grep -E "^\[rl\]|weights by|rror" "$OUT/moe_rl.log" | tail -4
  "$PY" benchmarks/rl_timing.py --skip 1 "$WORK/moe_rl" | tee "$OUT/moe_rl_timing.md"
  ;;
*)
  echo "PART must be async0, async2, moe-train or moe-rl" >&2
  exit 2
  ;;
esac
