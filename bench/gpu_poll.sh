#!/usr/bin/env bash
# One poll of a gpu_all.sh launch on the device machine, which brings the results back every time:
# waits until the launch is over (OUTDIR/done) or SECONDS have passed, prints its progress, then packs
# OUTDIR and WORKDIR (without checkpoints, models, caches and data) into $OUT/results.tgz, in parts
# under the device tool's file limit. Why every poll and not only the last: the machine goes back
# about 30 s after a call ends, and a launch whose results waited for one more call lost them all on
# 2026-12-05 when that call came late. Each poll's files replace the one before's.
# Usage (the device tool's command): bash bench/gpu_poll.sh OUTDIR WORKDIR SECONDS
set -uo pipefail
out=$(realpath -m "${1:?usage: bench/gpu_poll.sh OUTDIR WORKDIR SECONDS}") work=$(realpath -m "${2:?WORKDIR}") seconds=${3:?SECONDS}
dest=${OUT:?the device tool sets OUT}
deadline=$(( $(date +%s) + seconds ))
while [ ! -f "$out/done" ] && [ "$(date +%s)" -lt "$deadline" ]; do sleep 5; done
# A launch's progress, or each launch's when OUTDIR holds several (one folder each, as the plan starts them).
cat "$out/progress" 2>/dev/null
for p in "$out"/*/progress; do [ -f "$p" ] && { echo "${p%/progress}:"; cat "$p"; }; done
[ -f "$out/done" ] && echo "launch over: $(cat "$out/done")"
rm -f "$dest"/results.tgz*
tar -C / --exclude=caches --exclude=models --exclude='global_step_*' --exclude='*.safetensors' \
  --exclude='*.parquet' --exclude='*.pt' --exclude='*.bin' --exclude='*.arrow' \
  -czf "$dest/results.tgz" "${out#/}" "${work#/}" 2>/dev/null
# The device tool brings back files of at most 16 MB: a larger archive comes back in parts (cat them).
if [ "$(stat -c %s "$dest/results.tgz")" -gt 15000000 ]; then
  split -b 15000000 -d "$dest/results.tgz" "$dest/results.tgz.part-" && rm "$dest/results.tgz"
fi
ls -l "$dest"
