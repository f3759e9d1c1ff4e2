#!/usr/bin/env bash
# The GPU check of the scale-out work, sized for 10 minutes of one H100 or H200 (not yet run on one: no device
# machine has been lent to the sessions that built it). Three stages, each bounded by `timeout`:
#   1. the kernel and swap tests on CUDA (tests/kernels, tests/test_swap*.py): the Triton paths, meta, DTensor;
#   2. forward and backward bandwidth of normlab's Triton DyT, DyISRU, Derf and RMSNorm against torch.compile of the
#      reference, torch's own rms_norm and Liger-Kernel's LigerDyT and LigerRMSNorm (where `liger_kernel` imports),
#      as GB/s and as a fraction of the GPU's copy bandwidth measured in the same run (scripts/bench_kernels.py);
#   3. torchtitan's Llama 3 debug model, a few steps with DyT (normlab's model converter) and with RMSNorm, where
#      torchtitan imports (it needs torch 2.14); otherwise the stage says why and the rest stands.
#
#   bash scripts/gpu_check.sh                   # on the GPU machine, from the repository; no install needed
#   TINY=1 bash scripts/gpu_check.sh            # the same stages at a tiny size on the CPU (tests/test_gpu_check.py;
#                                               # stage 3 with PY=.venv-titan/bin/python, through the tests' CPU shim)
#
# PY (default python3; .venv/bin/python where it exists) and OUT (default runs/gpu_check) change where it runs and
# writes; the bandwidth rows go to $OUT/kernels_gpu.csv, every stage's log to $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
if [ -z "${PY:-}" ]; then if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi; fi
OUT=${OUT:-runs/gpu_check}
TINY=${TINY:-0}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
status=0

echo "== 1. kernel and swap tests"
if [ "$TINY" = 1 ]; then tests=(tests/test_swap_edges.py -k "dtensor and (dyt or rms_norm)"); else
  tests=(tests/kernels tests/test_swap.py tests/test_swap_edges.py -m "not slow"); fi
timeout 240 "$PY" -m pytest -q -p no:cacheprovider "${tests[@]}" 2>&1 | tee "$OUT/tests.log" | tail -3 || status=1

echo "== 2. bandwidth"
if [ "$TINY" = 1 ]; then
  bench=(--gpu-table --cpu --rows 8 --channels 32 --dtypes fp32 --reps 2); export TRITON_INTERPRET=1
else bench=(--rows 8192 --channels 4096 8192 --dtypes bf16 fp32 --reps 50); fi
timeout 240 "$PY" scripts/bench_kernels.py --ops dyt dyisru derf rms_norm "${bench[@]}" --csv "$OUT/kernels_gpu.csv" \
  > "$OUT/bandwidth.log" 2>&1 || status=1
grep -E "full|appended" "$OUT/bandwidth.log"
unset TRITON_INTERPRET

echo "== 3. torchtitan, DyT and RMSNorm"
if ! why=$("$PY" -c "import torchtitan" 2>&1); then
  echo "skipped: torchtitan does not import here (${why##*$'\n'}); it needs torch 2.14 (make titan builds it)"
else
  launch=(-m torchtitan.train) steps=20
  if [ "$TINY" = 1 ]; then launch=(titan_cpu.py) steps=3; fi  # the tests' CPU shim
  for config in llama3_debug_cpu llama3_debug_cpu_dyt; do  # the tests' configs: 2 blocks, seq 64, float32
    (cd tests/torchtitan && timeout 120 "$PY" -m torch.distributed.run --standalone --nproc-per-node 1 \
      "${launch[@]}" --module cpu_configs --config "$config" --training.steps "$steps" \
      --dump_folder "$OUT/titan-$config") > "$OUT/titan-$config.log" 2>&1 || status=1
    echo "$config: $(sed 's/\x1b\[[0-9;]*m//g' "$OUT/titan-$config.log" | grep -oE 'step: +[0-9]+ +loss: +[0-9.]+.*tps: [0-9,]+' \
      | sed -n '1p;$p' | tr -s ' ' | paste -sd '|')"  # the first and last step: loss, grad norm, memory, tokens/s
  done
fi
exit $status
