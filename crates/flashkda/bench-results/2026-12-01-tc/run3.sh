#!/bin/bash
# flashkda-tc run 3: the final default (Auto operands by measurement) against bf16 and split, same run
set -u
C=$(cd "$(dirname "$0")" && pwd)
START=$(date +%s); BUDGET=${BUDGET:-360}
left() { echo $((BUDGET - ($(date +%s) - START))); }
S=$OUT/summary.log
nvidia-smi --query-gpu=name,driver_version,clocks.current.sm,clocks.max.sm,clocks.current.memory,power.draw,temperature.gpu --format=csv > $OUT/env.txt 2>&1
cat $OUT/env.txt >> $S
export K3_REQUIRE_GPU=1 FLASHKDA_GPU_LOG=$OUT/accuracy.jsonl PYTHONUNBUFFERED=1
chmod +x $C/gpu
FLASHKDA_TEST_KERNELS=default,split-2 timeout 150 $C/gpu --test-threads=1 > $OUT/gpu_tests.log 2>&1
echo "tests (default, split-2) rc=$? ($(left) s left)" >> $S
grep -E "^test |test result|panicked" $OUT/gpu_tests.log >> $S
W=/tmp/fkwheel; rm -rf $W; mkdir -p $W; (cd $W && python3 -m zipfile -e $C/flashkda-*.whl .)
export PYTHONPATH=$W
timeout 60 python3 $C/check_wheel.py > $OUT/check_wheel.log 2>&1
echo "check_wheel rc=$? ($(left) s left)" >> $S
tail -c 900 $OUT/check_wheel.log >> $S; echo >> $S
timeout 150 python3 $C/bench_compare.py --out $OUT/bench.json --no-flash-kda --operands bf16,split > $OUT/bench.log 2>&1
echo "bench rc=$? ($(left) s left)" >> $S
grep -E "flashkda|FAIL|accuracy" $OUT/bench.log | grep -v "segment_chunks=\|kernels" | cut -c1-300 >> $S
cat $S
if [ $(left) -gt 60 ]; then
  timeout 60 ncu --clock-control none --launch-skip 2 --launch-count 2 --section WarpStateStats --section SchedulerStats --section SpeedOfLight --section Occupancy python3 $C/ncu_probe.py 96 8192 split > $OUT/ncu.txt 2>&1
  echo "ncu H=96 rc=$? ($(left) s left)" >> $S
fi
if [ $(left) -gt 40 ]; then
  timeout 40 ncu --clock-control none --kernel-name kda_state_w4 --launch-skip 1 --launch-count 1 --section WarpStateStats --section SchedulerStats --section SpeedOfLight python3 $C/ncu_probe.py 4 16384 split >> $OUT/ncu.txt 2>&1
  echo "ncu H=4 rc=$? ($(left) s left)" >> $S
fi
grep -E "Stall|Warp Cycles|Issued Warp|Eligible|Duration|Memory Throughput|Compute \(SM\)|==PROF==|kda_" $OUT/ncu.txt 2>/dev/null | head -60
