#!/bin/bash
# flashkda-tc run: split-operand kernels vs the previous default, same run (no public FlashKDA build)
set -u
C=$(cd "$(dirname "$0")" && pwd)
START=$(date +%s); BUDGET=${BUDGET:-420}
left() { echo $((BUDGET - ($(date +%s) - START))); }
S=$OUT/summary.log
nvidia-smi --query-gpu=name,driver_version,clocks.current.sm,clocks.max.sm,clocks.current.memory,power.draw,temperature.gpu --format=csv > $OUT/env.txt 2>&1
cat $OUT/env.txt >> $S
export K3_REQUIRE_GPU=1 FLASHKDA_GPU_LOG=$OUT/accuracy.jsonl PYTHONUNBUFFERED=1
chmod +x $C/gpu
: > $OUT/gpu_tests.log
for v in split-2 split-4 split-8 split-cp3 split-auto; do
  FLASHKDA_TEST_KERNELS=$v timeout 60 $C/gpu --test-threads=1 smoke_small_cases >> $OUT/gpu_tests.log 2>&1
  echo "smoke $v rc=$? ($(left) s left)" >> $S
done
FLASHKDA_TEST_KERNELS=${FULL_KERNELS:-workspace-2,workspace-cp3,default,split-2,split-4,split-8,split-cp3,split-auto} \
  timeout 240 $C/gpu --test-threads=1 >> $OUT/gpu_tests.log 2>&1
echo "full tests rc=$? ($(left) s left)" >> $S
grep -E "^test |test result" $OUT/gpu_tests.log >> $S
W=/tmp/fkwheel; rm -rf $W; mkdir -p $W; (cd $W && python3 -m zipfile -e $C/flashkda-*.whl .)
export PYTHONPATH=$W
timeout 60 python3 $C/check_wheel.py > $OUT/check_wheel.log 2>&1
echo "check_wheel rc=$? ($(left) s left)" >> $S
tail -c 1500 $OUT/check_wheel.log >> $S; echo >> $S
timeout ${BENCH_S:-200} python3 $C/bench_compare.py --out $OUT/bench.json --no-flash-kda --operands split ${BENCH_ARGS:-} > $OUT/bench.log 2>&1
echo "bench rc=$? ($(left) s left)" >> $S
if [ $(left) -gt 60 ]; then
  FLASHKDA_TEST_KERNELS=split-2,split-cp3 timeout 60 compute-sanitizer --tool memcheck $C/gpu --test-threads=1 smoke_small_cases > $OUT/sanitizer.log 2>&1
  echo "memcheck rc=$? ($(left) s left)" >> $S
  grep -E "ERROR SUMMARY|test result" $OUT/sanitizer.log >> $S
fi
if [ $(left) -gt 40 ]; then
  FLASHKDA_TEST_KERNELS=split-2,split-cp3 timeout 60 compute-sanitizer --tool racecheck $C/gpu --test-threads=1 smoke_small_cases >> $OUT/sanitizer.log 2>&1
  echo "racecheck rc=$? ($(left) s left)" >> $S
  grep -E "RACECHECK SUMMARY|test result" $OUT/sanitizer.log | tail -2 >> $S
fi
grep -E "flashkda|kernels" $OUT/bench.log | grep -v "segment_chunks=" | cut -c1-400 >> $S
cat $S
