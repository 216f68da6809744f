#!/usr/bin/env bash
# Every GPU acceptance scenario on one machine, in the least wall time: the three tiny-model runs side by
# side (each vLLM capped to a share of the GPU so all three start), then the 0.5B-architecture run and
# its bare-verl twin alone (their figures are the ones compared). Results: $1/*.json, logs beside them.
# Usage: bash bench/gpu_all.sh OUTDIR [WORKDIR]
set -uo pipefail
out=${1:?usage: bench/gpu_all.sh OUTDIR [WORKDIR]}
work=${2:-/tmp/verl-gpu-acceptance}
here=$(cd "$(dirname "$0")" && pwd)
py=${PYTHON:-python3}
mkdir -p "$out" "$work"
tiny() {  # scenario name
  "$py" "$here/gpu_acceptance.py" --scenario "$1" --workdir "$work/$1" --out "$out/$1.json" \
    --gpu-memory-utilization 0.15 > "$out/$1.out" 2>&1
  echo "$(date -u +%T) $1 rc=$?" >> "$out/progress"
}
echo "$(date -u +%T) start" >> "$out/progress"
# The 0.5B-architecture weights are written while the tiny runs go (a minute of CPU).
"$py" -c "import sys; sys.path.insert(0, '$here'); import gpu_acceptance as g, pathlib; \
g.write_real_size_model(pathlib.Path('$work/real-size/models/qwen2.5-0.5b-arch-random'))" > "$out/model.out" 2>&1 &
tiny acceptance & tiny resume-worker & tiny resume-raylet &
wait
"$py" "$here/gpu_acceptance.py" --scenario real-size --steps "${REAL_SIZE_STEPS:-3}" --workdir "$work/real-size" \
  --out "$out/real-size.json" > "$out/real-size.out" 2>&1
echo "$(date -u +%T) real-size rc=$?" >> "$out/progress"
