#!/usr/bin/env bash
# The conversion on one GPU, in one command: per-channel calibration, the budget walk, the self heal's recipe, and
# every site converted with a full-rank heal (every weight trained, the original as teacher, on its own samples and
# the text), each timed stage by stage (load, samples, calibration or walk, heal, measurement) from its
# fidelity.json, with the heal's tokens. Not measured here: no GPU. Run it on a GPU machine from the repository
# (after `make setup`):
#
#   bash scripts/gpu_convert.sh                              # SmolLM2-135M on cuda
#   MODEL=path/to/hf-folder bash scripts/gpu_convert.sh      # your model (a folder or a .gguf)
#   HEAL_MINUTES=30 bash scripts/gpu_convert.sh              # a longer recipe heal (default 10)
#   FULL_MINUTES=60 bash scripts/gpu_convert.sh              # a longer full-rank heal (default 10)
#
# The published removals of every norm of GPT-2 fine-tuned all weights on 150-500M tokens; the full-rank heal here
# runs for FULL_MINUTES and prints how many tokens that bought, to set against them. DEVICE (default cuda), OUT
# (default runs/gpu_convert), FULL_SAMPLES (the original's samples it distils on, default 16384), FULL_BUDGET (its
# heal budget's flags) and EXTRA (more convert flags) change the rest; the test suite runs it on the CPU with DEVICE=cpu on a tiny model.
set -euo pipefail
cd "$(dirname "$0")/.."
NORMLAB=${NORMLAB:-.venv/bin/normlab}
MODEL=${MODEL:-smollm2}
DEVICE=${DEVICE:-cuda}
OUT=${OUT:-runs/gpu_convert}
HEAL_MINUTES=${HEAL_MINUTES:-10}
HEAL=${HEAL:-"--heal-minutes $HEAL_MINUTES"}
FULL_MINUTES=${FULL_MINUTES:-10}
FULL_BUDGET=${FULL_BUDGET:-"--heal-minutes $FULL_MINUTES"}
FULL=${FULL:-"$FULL_BUDGET --set data.samples=${FULL_SAMPLES:-16384}"}
EXTRA=${EXTRA:-}

run() {  # NAME FLAGS...: one conversion into $OUT/NAME
  local name=$1
  shift
  # shellcheck disable=SC2086  # EXTRA and HEAL hold several flags
  "$NORMLAB" convert --model "$MODEL" --to dyisru --per channel --device "$DEVICE" --out "$OUT/$name" --overwrite \
    --no-progress $EXTRA "$@"
}

run per-channel
run budget-walk --budget-nats 0.4
# shellcheck disable=SC2086
run self-recipe --heal-text self --set heal.schedule=cooldown heal.teacher_top_k=1024 $HEAL
# shellcheck disable=SC2086
run every-site-full --massive-tokens route --heal-text self+text --heal-train all \
  --set heal.schedule=cooldown heal.teacher_top_k=1024 heal.precision=auto $FULL

"${PYTHON:-.venv/bin/python}" - "$OUT" "$DEVICE" <<'PY'
import json, sys
from pathlib import Path

out, device = Path(sys.argv[1]), sys.argv[2]
print(f"\nconvert stages on {device}, seconds (each run's fidelity.json):")
for name in ("per-channel", "budget-walk", "self-recipe", "every-site-full"):
    fid = json.loads((out / name / "fidelity.json").read_text())
    stages = ", ".join(f"{k} {v:.1f}" for k, v in fid["stages"].items())
    rise = fid["ce_converted"] - fid["ce_original"]
    top1 = fid.get("usage", {}).get("texts", {}).get("held-out", {}).get("same_top1")
    same = f", same top-1 {100 * top1:.1f}%" if isinstance(top1, (int, float)) else ""
    tokens = f", heal {fid['heal']['tokens']:,} tokens" if "heal" in fid else ""
    print(f"{name:15} {len(fid.get('sites', {}))} sites, held-out CE {rise:+.3f}{same}{tokens}; {stages}")
PY
