#!/usr/bin/env bash
# `specserve check exact` at scale on the Qwen pair (docs/check-exact.md, "Results"): the four default prompts,
# positions 1-3, N samples per prompt (default 4000), draft qwen2.5-coder-0.5b, in process, one configuration after
# another. Each writes bench_results/check-exact/qwen-<dtype>-<sampling>.json and a .log with its time and CPU.
#   scripts/check-exact-qwen.sh [CONFIG ...]   CONFIG: <dtype>:<sampling>, dtype auto|float32,
#                                              sampling t1k10 | t07p09 | t0; default: every one, auto first
# Env: N (samples per prompt), THREADS (torch threads, default every core), BATCH (requests in flight, default 128).
set -euo pipefail
cd "$(dirname "$0")/.."
N="${N:-4000}"
THREADS="${THREADS:-$(nproc)}"
BATCH="${BATCH:-128}"
out=bench_results/check-exact
mkdir -p "$out"
configs=("$@")
[ ${#configs[@]} -gt 0 ] || configs=(auto:t1k10 auto:t07p09 auto:t0 float32:t0 float32:t1k10 float32:t07p09)
cpu="$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ *//')"
for config in "${configs[@]}"; do
  dtype="${config%%:*}"
  sampling="${config#*:}"
  case "$sampling" in
    t1k10) flags=(--temperature 1 --top-k 10); n="$N" ;;
    t07p09) flags=(--temperature 0.7 --top-p 0.9); n="$N" ;;
    t0) flags=(--temperature 0); n=$(( N < 256 ? N : 256 )) ;;  # greedy: every sample must be the argmax
    *) echo "check-exact-qwen: unknown sampling '$sampling' (t1k10, t07p09, t0)" >&2; exit 2 ;;
  esac
  name="$out/qwen-$dtype-$sampling"
  cmd=(.venv/bin/specserve check exact --model qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b "${flags[@]}"
       --dtype "$dtype" --n "$n" --positions 1,2,3 --threads "$THREADS" --batch "$BATCH" --per-call "$BATCH"
       --json-out "$name.json")
  {
    echo "# $(date -u +%FT%TZ) CPU: $cpu ($(nproc) cores); kernels: SPECSERVE_CPU_KERNEL=${SPECSERVE_CPU_KERNEL:-auto}"
    echo "# ${cmd[*]}"
  } > "$name.log"
  echo "check-exact-qwen: $dtype $sampling, n=$n per prompt -> $name.log" >&2
  start=$(date +%s)
  rc=0
  scripts/in-netns.sh "${cmd[@]}" >> "$name.log" 2>&1 || rc=$?
  echo "# exit $rc after $(( $(date +%s) - start )) s" >> "$name.log"
  echo "check-exact-qwen: $dtype $sampling: exit $rc after $(( $(date +%s) - start )) s" >&2
done
