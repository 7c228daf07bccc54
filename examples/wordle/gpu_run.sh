#!/usr/bin/env bash
# Wordle end to end on GPUs: synthetic solver games -> SFT of a 25M tiny Qwen3 -> RL with the `rl`
# launcher; the held-out win rate (greedy, all 176 eval secrets) before and after RL comes from
# the orchestrator's evaluations (eval/env/win in rl/metrics.jsonl). Logs and metrics go to $OUT.
# Knobs (environment): SFT_STEPS, RL_STEPS, GAMES, DEVICE (cuda|cpu), and for a quick CPU check
# of this script, TINY="--hidden-size 64 --num-layers 2 ..." plus EXTRA_RL args.
# On a machine without uv: PYTHONPATH=src and the pure-Python dependencies importable.
set -uo pipefail
OUT=${OUT:-gpu-out}
W=${WORK:-$(mktemp -d)}
SFT_STEPS=${SFT_STEPS:-400}
RL_STEPS=${RL_STEPS:-30}
GAMES=${GAMES:-20000}
DEVICE=${DEVICE:-cuda}
TINY=${TINY:---hidden-size 512 --num-layers 8 --num-heads 8 --num-kv-heads 4 --head-dim 64 --intermediate-size 1536}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
t0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - t0 ))s] $*"; }

python examples/wordle/synthetic_games.py --out "$W/games.jsonl" --games "$GAMES" | tee "$OUT/games.log"
python -m tandem.models.tiny --out "$W/model" $TINY | tee -a "$OUT/games.log"
stamp "games and model ready"

timeout "${SFT_TIMEOUT:-200}" python -m tandem.trainer.sft.cli @ examples/wordle/sft.toml \
  --model.name "$W/model" --model.device "$DEVICE" --data.path "$W/games.jsonl" --run-dir "$W/sft" \
  --max-steps "$SFT_STEPS" ${EXTRA_SFT:-} > "$OUT/sft.log" 2>&1
stamp "sft exit $?"; grep -E "sft: done|rror" "$OUT/sft.log" | tail -3
cp "$W/sft/metrics.jsonl" "$OUT/sft.metrics.jsonl" 2>/dev/null

gpus=()
[ "$DEVICE" = cuda ] && gpus=(--deployment.inference-gpus '["0"]' --deployment.trainer-gpus '["1"]')
timeout "${RL_TIMEOUT:-200}" python -m tandem.launch.cli @ examples/wordle/rl.toml --model.name "$W/sft/final" \
  --run-dir "$W/rl" --max-steps "$RL_STEPS" "${gpus[@]}" ${EXTRA_RL:-} > "$OUT/rl.log" 2>&1
stamp "rl exit $?"; grep -E "eval at step|rl:|rror" "$OUT/rl.log" | tail -8
cp "$W/rl/metrics.jsonl" "$OUT/rl.metrics.jsonl" 2>/dev/null
python - "$W/rl/metrics.jsonl" <<'PY' | tee "$OUT/summary.txt"
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
for r in rows:
    if "eval/env/win" in r:
        print(f"step {r['step']}: held-out win rate {r['eval/env/win']:.3f}, reward {r['eval/reward_mean']:.3f}, "
              f"partial {r['eval/env/partial_credit']:.3f}, invalid/game {r['eval/env/invalid_guesses']:.2f}, "
              f"turns {r['eval/env/turns']:.2f}")
train = [r for r in rows if "env/win" in r]
if train:
    print("train win rate by step:", " ".join(f"{r['env/win']:.2f}" for r in train))
PY
