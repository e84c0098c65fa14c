#!/usr/bin/env bash
# The GPU check: one prepared run for a machine with CUDA (a few minutes), figures as JSON.
#
#   scripts/gpu-check.sh [OUT_DIR]        OUT_DIR default: $OUT if set, else ./gpu-check-out
#
# With CUDA it runs, each step's log and exit status recorded in OUT_DIR/summary.json:
#   1. device.json          torch, CUDA, the GPUs
#   2. parity               tests/model_runtime/test_cuda.py -k forward_match: fp32 and bf16 forwards on CUDA vs CPU
#                           (random Qwen2/Llama weights and SmolLM2)
#   3. tp-nccl              test_nccl_tp2_equals_tp1: TP=2 over NCCL vs TP=1 (needs 2 GPUs; with one it says so
#                           and skips)
#   4. serve-fractional     test_serve_drafter_and_verifier_share_a_gpu: the Serve application on CUDA, Drafter and
#                           Verifier at 0.5 GPU each, greedy speculative == plain (inside scripts/in-netns.sh)
#   5. step-times.json      bf16 CUDA step times of the bundled models (scripts/gpu_step_times.py): decode (1 token)
#                           and verify (2..17 tokens), batch 1 and 8, at 128 and 1024 tokens of context, TP=1, and
#                           a profile of decode steps (host time per op, kernel launches, syncs)
# Where the models cannot be prepared (no GGUF files: the lent GPU machines here), GPU_CHECK_MODEL_DIRS names
# folders holding their config.json (random weights of those shapes), and the steps that need prepared weights or
# Ray (parity on SmolLM2's weights, serve-fractional) are skipped with the reason in summary.json.
#   6. captured-parity      tests/model_runtime/graph/test_capture.py -k cuda_graphs: one CUDA graph per bucket
#                           (cuda-graph, compile+cuda-graph, reduce-overhead; fp32, bf16) replays the eager step
#   7. captured.json        the captured step (model_runtime/graph/, scripts/gpu_captured_steps.py) on the same
#                           models: capture time and memory of every bucket, step times at batch 1 and 8 with 1..17
#                           rows (the eager forward beside them), launches and syncs per step, greedy speculative
#                           vs plain, and transformers' static-cache compiled generate (the peer); its parts stop
#                           at CAPTURED_BUDGET_S (default 240 s) so one run of this script fits in 8 minutes
#   8. bench-runtime.json, bench-spec.json
#                           `specserve bench runtime` and `bench spec --quick` with `--device cuda` where those
#                           commands take it; until they do they measure the CPU only and are skipped here
# Without CUDA it prints what it would run (the preflight), writes OUT_DIR/summary.json saying so, and exits 0.
# Exit status: 0 when every step that ran passed, 1 otherwise.
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-.venv/bin/python}"
SPECSERVE="${SPECSERVE:-.venv/bin/specserve}"
OUT_DIR="${1:-${OUT:-gpu-check-out}}"
mkdir -p "$OUT_DIR"
OUT_DIR="$(cd "$OUT_DIR" && pwd)"
STEPS_FILE="$OUT_DIR/steps.tsv"
: > "$STEPS_FILE"

log() { printf 'gpu-check: %s\n' "$*" >&2; }

# step NAME COMMAND...: run it, its output to OUT_DIR/NAME.log, its status and duration to steps.tsv
step() {
  local name="$1"; shift
  log "step $name: $*"
  local started status
  started=$(date +%s%N)
  "$@" > "$OUT_DIR/$name.log" 2>&1
  status=$?
  printf '%s\t%s\t%s\t%s\n' "$name" "$status" "$(( ($(date +%s%N) - started) / 1000000 ))" "$*" >> "$STEPS_FILE"
  log "step $name: exit $status ($(tail -n 1 "$OUT_DIR/$name.log"))"
}

skip() {
  printf '%s\tskipped\t0\t%s\n' "$1" "$2" >> "$STEPS_FILE"
  log "step $1: skipped ($2)"
}

"$PYTHON" - "$OUT_DIR/device.json" <<'EOF'
import json, sys
import torch
info = {"torch": torch.__version__, "cuda_available": torch.cuda.is_available(), "cuda": torch.version.cuda,
        "devices": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        if torch.cuda.is_available() else []}
open(sys.argv[1], "w").write(json.dumps(info, indent=2) + "\n")
print(json.dumps(info))
EOF
CAPTURED_BUDGET_S="${CAPTURED_BUDGET_S:-240}"
CAPTURED_TEST=("$PYTHON" -m pytest -q -p no:cacheprovider -rs tests/model_runtime/graph/test_capture.py)
CUDA=$("$PYTHON" -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)')
PYTEST=("$PYTHON" -m pytest -q -p no:cacheprovider -rs tests/model_runtime/test_cuda.py)

bench_has_device() { "$SPECSERVE" bench "$1" --help 2>/dev/null | grep -q -- '--device'; }

if [ "$CUDA" = "0" ]; then
  log "no CUDA device: preflight only. On a machine with CUDA this script runs:"
  log "  parity:           ${PYTEST[*]} -k forward_match --junitxml $OUT_DIR/parity.xml"
  log "  tp-nccl:          ${PYTEST[*]} -k nccl --junitxml $OUT_DIR/tp-nccl.xml   (2+ GPUs; else skipped)"
  log "  serve-fractional: scripts/in-netns.sh ${PYTEST[*]} -k serve --junitxml $OUT_DIR/serve.xml"
  log "  step-times:       scripts/gpu_step_times.py on the prepared models -> $OUT_DIR/step-times.json"
  log "  captured-parity:  ${CAPTURED_TEST[*]} -k cuda_graphs --junitxml $OUT_DIR/captured-parity.xml"
  log "  captured:         scripts/gpu_captured_steps.py on the prepared models --budget-s $CAPTURED_BUDGET_S" \
      "-> $OUT_DIR/captured.json (capture, step times, profile, greedy, transformers' static-cache generate)"
  for bench in runtime spec; do
    if bench_has_device "$bench"; then
      log "  bench-$bench:     $SPECSERVE bench $bench --device cuda ... --json-out $OUT_DIR/bench-$bench.json"
    else
      log "  bench-$bench:     skipped: \`specserve bench $bench\` has no --device flag (CPU only)"
    fi
  done
  # The same tests here skip cleanly (what the suite does on a CPU machine).
  step preflight-skips "${PYTEST[@]}"
  step preflight-captured "${CAPTURED_TEST[@]}"
  "$PYTHON" - "$OUT_DIR" <<'EOF'
import json, sys
out = sys.argv[1]
steps = [dict(zip(("step", "exit", "ms", "command"), line.rstrip("\n").split("\t"))) for line in open(f"{out}/steps.tsv")]
summary = {"cuda": False, "ran": "preflight only (no CUDA device)", "steps": steps}
open(f"{out}/summary.json", "w").write(json.dumps(summary, indent=2) + "\n")
EOF
  status=$(awk -F'\t' '$2 != "0" && $2 != "skipped" {bad=1} END {print bad ? 1 : 0}' "$STEPS_FILE")
  log "preflight done (exit $status); summary: $OUT_DIR/summary.json"
  exit "$status"
fi

log "$CUDA CUDA device(s): running the GPU check into $OUT_DIR"
# the prepared models' cache entries (prepare_model: the same check as `make setup`); a machine that cannot fetch
# the GGUF files (the lent GPU machines here) names config-only folders in GPU_CHECK_MODEL_DIRS instead (their
# shapes with random weights: scripts/gpu_step_times.py) and runs the tests that need no prepared model
if mapfile -t MODEL_DIRS < <("$PYTHON" -c 'from model_runtime.prepare import prepare_model
from model_runtime.registry import KNOWN_MODELS
for name in KNOWN_MODELS: print(prepare_model(name, progress=False))' 2> "$OUT_DIR/prepare.log") \
    && [ "${#MODEL_DIRS[@]}" -gt 0 ]; then
  PREPARED=1
else
  PREPARED=0
  read -r -a MODEL_DIRS <<< "${GPU_CHECK_MODEL_DIRS:-}"
  log "no prepared models here ($(tail -n 1 "$OUT_DIR/prepare.log")); config folders: ${MODEL_DIRS[*]:-none}"
fi
if [ "$PREPARED" = 1 ]; then
  step parity "${PYTEST[@]}" -k forward_match --junitxml "$OUT_DIR/parity.xml"
else
  step parity "${PYTEST[@]}" -k "forward_match and not smollm2" --junitxml "$OUT_DIR/parity.xml"
fi
if [ "$CUDA" -ge 2 ]; then
  step tp-nccl "${PYTEST[@]}" -k nccl --junitxml "$OUT_DIR/tp-nccl.xml"
else
  skip tp-nccl "one GPU: TP=2 over NCCL needs two"
fi
if ! "$PYTHON" -c 'import ray.serve' 2> /dev/null; then
  skip serve-fractional "Ray Serve is not installed here"
elif [ "$PREPARED" = 0 ]; then
  skip serve-fractional "no prepared smollm2-135m here"
else
  step serve-fractional scripts/in-netns.sh "${PYTEST[@]}" -k serve --junitxml "$OUT_DIR/serve.xml"
fi

if [ "${#MODEL_DIRS[@]}" -gt 0 ]; then  # step times and a profile of decode steps, by one script
  step step-times "$PYTHON" scripts/gpu_step_times.py "${MODEL_DIRS[@]}" --profile --out "$OUT_DIR/step-times.json"
else
  skip step-times "no prepared models and no GPU_CHECK_MODEL_DIRS"
fi

step captured-parity "${CAPTURED_TEST[@]}" -k cuda_graphs --junitxml "$OUT_DIR/captured-parity.xml"
if [ "${#MODEL_DIRS[@]}" -gt 0 ]; then  # the captured step; its parts stop at the budget, the timeout is a backstop
  step captured timeout "$((CAPTURED_BUDGET_S + 150))" "$PYTHON" scripts/gpu_captured_steps.py "${MODEL_DIRS[@]}" \
    --budget-s "$CAPTURED_BUDGET_S" --out "$OUT_DIR/captured.json"
else
  skip captured "no prepared models and no GPU_CHECK_MODEL_DIRS"
fi

for bench in runtime spec; do
  if bench_has_device "$bench"; then
    extra=(); [ "$bench" = spec ] && extra=(--quick)
    step "bench-$bench" scripts/in-netns.sh "$SPECSERVE" bench "$bench" --device cuda "${extra[@]}" \
      --json-out "$OUT_DIR/bench-$bench.json"
  else
    skip "bench-$bench" "specserve bench $bench has no --device flag (CPU only)"
  fi
done

"$PYTHON" - "$OUT_DIR" <<'EOF'
import json, os, sys
out = sys.argv[1]
steps = [dict(zip(("step", "exit", "ms", "command"), line.rstrip("\n").split("\t"))) for line in open(f"{out}/steps.tsv")]
summary = {"cuda": True, "device": json.load(open(f"{out}/device.json")), "steps": steps}
for name in ("step-times", "captured", "bench-runtime", "bench-spec"):
    if os.path.exists(f"{out}/{name}.json"):
        summary[name] = json.load(open(f"{out}/{name}.json"))
open(f"{out}/summary.json", "w").write(json.dumps(summary, indent=2) + "\n")
EOF
status=$(awk -F'\t' '$2 != "0" && $2 != "skipped" {bad=1} END {print bad ? 1 : 0}' "$STEPS_FILE")
log "done (exit $status); summary: $OUT_DIR/summary.json"
exit "$status"
