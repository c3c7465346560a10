#!/bin/bash
# 2026-12-05 (issue 32): Nsight Compute of the default (`Auto`) forward at the goal shapes, with CUDA-event
# timing of the same shapes in the same call. Wheel of the commit in .carry/COMMIT (built on the dev box:
# maturin build --release --strip -m crates/flashkda/Cargo.toml --features python -o crates/flashkda/.carry/new).
# Carry: crates/flashkda/.carry (new/flashkda-*.whl, COMMIT). Run from the repository root:
#   BUDGET=540 bash crates/flashkda/bench-results/2026-12-05-ncu/device-call.sh
# ncu: --clock-control none (clocks as found), --set full, only the kernels of the second (profiled) call.
set -u
C=$PWD/crates/flashkda/.carry; H=$PWD/crates/flashkda/bench-results/2026-12-05-ncu
START=$(date +%s); BUDGET=${BUDGET:-540}
left() { echo $((BUDGET - ($(date +%s) - START))); }
L=$OUT/logs; mkdir -p $L; S=$OUT/summary.log
finish() {
  cp $S $L/ 2>/dev/null
  mkdir -p $OUT/reps; mv $L/*.ncu-rep $OUT/reps/ 2>/dev/null
  tar czf $OUT/logs.tgz -C $OUT logs && rm -rf $L
  tar czf $OUT/reps.tgz -C $OUT reps && rm -rf $OUT/reps
  cat $S
}
trap finish EXIT
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
{ date -u +"start %F %T UTC"; cat $C/COMMIT
  nvidia-smi --query-gpu=name,driver_version,clocks.current.sm,clocks.max.sm,clocks.current.memory,memory.total,power.limit --format=csv
  ncu --version | tail -1; python3 -c "import torch; print('torch', torch.__version__)"; } > $L/env.txt 2>&1
cat $L/env.txt >> $S
rm -rf /tmp/fk; mkdir -p /tmp/fk; (cd /tmp/fk && python3 -m zipfile -e $C/new/flashkda-*.whl .)
export PYTHONPATH=/tmp/fk
# 1. CUDA-event timing + torch-profiler kernel split + forced segment variants + copy bandwidth
timeout 200 python3 $H/shapes.py --time $L/time.json > $L/time.log 2>&1
echo "time rc=$? ($(left) s left)" >> $S; grep -vE "^\s*$" $L/time.log | cut -c 1-400 >> $S
# 2. ncu --set full of the profiled call per shape (kernels per call: 2 unsplit, 4 segmented)
for spec in H96_fixed_T8192:2 H32_T64K:4 H96_T64K:2; do
  s=${spec%%:*}; k=${spec##*:}
  if [ $(left) -lt 60 ]; then echo "ncu $s skipped ($(left) s left)" >> $S; continue; fi
  timeout $(( $(left) - 30 < 200 ? $(left) - 30 : 200 )) ncu --clock-control none --set full -k regex:^kda_ \
    --launch-skip $k --launch-count $k -f -o $L/ncu_$s python3 $H/shapes.py --ncu $s > $L/ncu_$s.log 2>&1
  echo "ncu $s rc=$? ($(left) s left)" >> $S; grep -E "plan|done|==ERROR|==WARNING" $L/ncu_$s.log | cut -c 1-300 >> $S
  if [ -f $L/ncu_$s.ncu-rep ]; then
    ncu -i $L/ncu_$s.ncu-rep --page raw --csv > $L/ncu_${s}_raw.csv 2> $L/ncu_${s}_raw.err
    ncu -i $L/ncu_$s.ncu-rep --page details > $L/ncu_${s}_details.txt 2>&1
    python3 $H/summarize.py $L/ncu_${s}_raw.csv > $L/ncu_${s}_summary.txt 2>&1
    cat $L/ncu_${s}_summary.txt >> $S
  fi
done
nvidia-smi --query-gpu=clocks.current.sm,clocks.max.sm,temperature.gpu --format=csv >> $S 2>&1
date -u +"end %F %T UTC" >> $S
