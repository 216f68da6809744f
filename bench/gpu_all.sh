#!/usr/bin/env bash
# Every GPU acceptance scenario on one machine, in the least wall time: the tiny-model runs side by
# side (each vLLM capped to a share of the GPU so all start), then the raylet case alone (its retry's
# vLLM profiles the GPU's memory while it starts, and beside other runs' allocations it can find no
# room for its KV cache), then the 0.5B-architecture run and its bare-verl twin alone (their figures
# are the ones compared). `logprob-kernels` (a minute) times verl's log-prob paths on the GPU while
# the 0.5B weights are written. Results: $1/*.json, logs beside them, $1/progress line by line.
# Usage: bash bench/gpu_all.sh OUTDIR [WORKDIR]
# ONLY="resume-raylet real-size" runs those scenarios alone;
# logprob-kernels runs only when ONLY names it. ppo and resume-ppo (PPO with a critic) join the tiny
# runs side by side. SHARED_CACHES=1: each scenario keeps its runs' warm caches in $WORKDIR/caches/<it>
# (its later run starts as a repeated run on one cluster does); REAL_SIZE_RUNS=N runs the 0.5B scenario N times (the
# second on warm caches); NO_BARE=1 skips its bare-verl twin.
set -uo pipefail
out=${1:?usage: bench/gpu_all.sh OUTDIR [WORKDIR]}
work=${2:-/tmp/verl-gpu-acceptance}
here=$(cd "$(dirname "$0")" && pwd)
py=${PYTHON:-python3}
mkdir -p "$out" "$work"
# Each scenario's own warm caches (its first run starts cold whatever ran before it).
caches() { [ "${SHARED_CACHES:-0}" = 1 ] && echo "--shared-caches=$work/caches/$1"; }
# The disk left after each scenario, in its progress line: checkpoints of a 0.5B actor and critic take ~12 GB a
# step, and a twin whose first save finds the disk full fails.
disk() { df -h --output=avail "$work" | tail -1 | tr -d ' '; }
wanted() { [ -z "${ONLY:-}" ] && [ "$1" != logprob-kernels ] || [[ " ${ONLY:-} " == *" $1 "* ]]; }
tiny() {  # scenario name, vLLM's share of the GPU
  wanted "$1" || return 0
  # TINY_OVERRIDES="k=v k2=v2": verl overrides for the tiny-model scenarios (an A/B against a launch without).
  local o over=(); for o in ${TINY_OVERRIDES:-}; do over+=(--verl-override "$o"); done
  # TINY_TWIN=1: the ppo and resume scenarios' bare-verl twins, each after its DAG run (a resume twin is killed
  # after the same checkpoint and started again by hand). ONLY=ppo or ONLY=resume-ppo: the pair alone on the GPU.
  case $1 in ppo | resume-*) [ "${TINY_TWIN:-0}" = 1 ] && over+=(--twin) ;; esac
  "$py" "$here/gpu_acceptance.py" --scenario "$1" --workdir "$work/$1" --out "$out/$1.json" \
    --gpu-memory-utilization "$2" $(caches "$1") "${over[@]}" > "$out/$1.out" 2>&1
  local rc=$?  # before $(date …), whose own status $? would report
  echo "$(date -u +%T) $1 rc=$rc, disk free $(disk)" >> "$out/progress"
}
echo "$(date -u +%T) start" >> "$out/progress"
trap 'echo "$(date -u +%T) end" >> "$out/progress"' EXIT
# Where a package's site is, found without importing it: verl's and torch's (one site, or two).
site_of() { "$py" -c "import importlib.util as u, os; print(os.path.dirname(os.path.dirname(u.find_spec('$1').origin)))" 2>/dev/null; }
site=$(site_of verl)
# The GPU stack's shared libraries (torch, CUDA, cuDNN, NCCL and the other wheels beside torch; vLLM, flash-attn
# and the rest of verl's site) read once into the page cache before a DAG run and its bare twin (the 0.5B
# pair, or the tiny pairs of TINY_TWIN=1). On a fresh machine the first run would read gigabytes of them from
# disk and the twin after it would not, which puts tens of seconds between their starts (docs/benchmarks.md).
# The read's time is in progress. PAGE_CACHE=0 skips it.
if [ "${PAGE_CACHE:-1}" = 1 ] && { wanted real-size || [ "${TINY_TWIN:-0}" = 1 ]; }; then
  t0=$(date +%s)
  bytes=$(for d in $(site_of torch) $site; do find "$d" -name '*.so*' -type f -print0; done 2>/dev/null \
    | xargs -0 -r cat | wc -c)
  echo "$(date -u +%T) read $(( bytes / 1000000 )) MB of shared libraries in $(( $(date +%s) - t0 )) s" >> "$out/progress"
fi
# The 0.5B-architecture weights are written while the tiny runs go (a minute of CPU), when a 0.5B run follows.
wanted real-size && "$py" -c "import sys; sys.path.insert(0, '$here'); import gpu_acceptance as g, pathlib; \
g.write_real_size_model(pathlib.Path('$work/real-size/models/qwen2.5-0.5b-arch-random'))" > "$out/model.out" 2>&1 &
if wanted logprob-kernels; then
  "$py" "$here/logprob_kernels.py" --out "$out/logprob-kernels.json" > "$out/logprob-kernels.out" 2>&1
  rc=$?
  echo "$(date -u +%T) logprob-kernels rc=$rc" >> "$out/progress"
fi
tiny acceptance 0.2 & tiny resume-worker 0.2 & tiny ppo 0.2 & tiny resume-ppo 0.2 &
wait
tiny resume-raylet 0.4
wanted real-size || exit 0
# REAL_SIZE_OVERRIDES="k=v k2=v2": verl overrides for the 0.5B run and its twin (a setting tried against a run without it).
extra=(); for o in ${REAL_SIZE_OVERRIDES:-}; do extra+=(--verl-override "$o"); done
[ "${NO_BARE:-0}" = 1 ] && extra+=(--no-bare)
# REAL_SIZE_PROFILE=qwen2.5-0.5b-ppo: the same architecture with PPO (a critic of the same size).
[ -n "${REAL_SIZE_PROFILE:-}" ] && extra+=(--real-size-profile "$REAL_SIZE_PROFILE")
for _ in $(seq "${REAL_SIZE_RUNS:-1}"); do extra+=(--scenario real-size); done
# How busy the GPU was in each phase of the 0.5B runs' steps (DAG and bare), from every utilisation sample
# the driver keeps, not the report's one instant every 10 s, and the CPU each phase used, by process
# (bench/gpu_busy.py). GPU_BUSY=0 skips it.
busy=
if [ "${GPU_BUSY:-1}" = 1 ]; then
  "$py" "$here/gpu_busy.py" record --metrics "$work/real-size/*/home/runs/*/metrics-a*.jsonl" \
    --metrics "$work/real-size/bare/metrics.jsonl" --out "$out/gpu-busy.jsonl" > "$out/gpu-busy.out" 2>&1 &
  busy=$!
fi
"$py" "$here/gpu_acceptance.py" --steps "${REAL_SIZE_STEPS:-3}" --workdir "$work/real-size" \
  --out "$out/real-size.json" $(caches real-size) "${extra[@]}" > "$out/real-size.out" 2>&1
rc=$?
echo "$(date -u +%T) real-size rc=$rc, disk free $(disk)" >> "$out/progress"
if [ -n "$busy" ]; then
  kill "$busy" 2>/dev/null; wait "$busy"
  "$py" "$here/gpu_busy.py" analyse --samples "$out/gpu-busy.jsonl" --out "$out/gpu-busy.json" >> "$out/gpu-busy.out" 2>&1
  rc=$?
  echo "$(date -u +%T) gpu-busy rc=$rc" >> "$out/progress"
fi
# ROLLOUT_CEILING=1: vLLM's own benchmark of the last 0.5B run's step (its model, batch and engine settings) on
# the GPU the run just left, against the run's generation per token (bench/rollout_ceiling.py; ~2 min).
if [ "${ROLLOUT_CEILING:-0}" = 1 ]; then
  run_dir=$(ls -td "$work"/real-size/*/home/runs/*/ 2>/dev/null | head -1)
  "$py" "$here/rollout_ceiling.py" --run-dir "${run_dir:-$work/real-size/none}" --out "$out/rollout-ceiling.json" \
    > "$out/rollout-ceiling.out" 2>&1
  rc=$?
  echo "$(date -u +%T) rollout-ceiling rc=$rc" >> "$out/progress"
fi
