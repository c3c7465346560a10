#!/bin/bash
# flashkda-tc run 2: split default (prep fix, w8, opt-in overlap) vs the bf16 kernels, same run
set -u
C=$(cd "$(dirname "$0")" && pwd)
START=$(date +%s); BUDGET=${BUDGET:-480}
left() { echo $((BUDGET - ($(date +%s) - START))); }
S=$OUT/summary.log
nvidia-smi --query-gpu=name,driver_version,clocks.current.sm,clocks.max.sm,clocks.current.memory,power.draw,temperature.gpu --format=csv > $OUT/env.txt 2>&1
cat $OUT/env.txt >> $S
export K3_REQUIRE_GPU=1 FLASHKDA_GPU_LOG=$OUT/accuracy.jsonl PYTHONUNBUFFERED=1
chmod +x $C/gpu
: > $OUT/gpu_tests.log
OVL=--overlap; ALL=""
for v in split-overlap split-1 default; do
  FLASHKDA_TEST_KERNELS=$v timeout 45 $C/gpu --test-threads=1 smoke_small_cases >> $OUT/gpu_tests.log 2>&1
  rc=$?; echo "smoke $v rc=$rc ($(left) s left)" >> $S
  if [ $v = split-overlap ] && [ $rc != 0 ]; then OVL=""; ALL=sequential,pipelined,workspace-4,workspace-2,workspace-8,workspace-cp3,split-2,split-4,split-8,split-1,split-cp3,split-auto,default; fi
done
FLASHKDA_TEST_KERNELS=$ALL timeout 270 $C/gpu --test-threads=1 >> $OUT/gpu_tests.log 2>&1
echo "full tests (all variants) rc=$? ($(left) s left)" >> $S
grep -E "^test |test result|panicked" $OUT/gpu_tests.log | grep -v "smoke_small_cases \.\.\. ok" >> $S
W=/tmp/fkwheel; rm -rf $W; mkdir -p $W; (cd $W && python3 -m zipfile -e $C/flashkda-*.whl .)
export PYTHONPATH=$W
timeout 60 python3 $C/check_wheel.py > $OUT/check_wheel.log 2>&1
echo "check_wheel rc=$? ($(left) s left)" >> $S
tail -c 900 $OUT/check_wheel.log >> $S; echo >> $S
timeout 200 python3 $C/bench_compare.py --out $OUT/bench.json --no-flash-kda --operands bf16 $OVL --value-splits split:1,split:4 > $OUT/bench.log 2>&1
echo "bench rc=$? ($(left) s left)" >> $S
if [ $(left) -gt 50 ]; then
  FLASHKDA_TEST_KERNELS=split-1,default timeout 60 compute-sanitizer --tool memcheck $C/gpu --test-threads=1 smoke_small_cases > $OUT/sanitizer.log 2>&1
  echo "memcheck rc=$? ($(left) s left)" >> $S
  grep -E "ERROR SUMMARY|test result" $OUT/sanitizer.log >> $S
fi
if [ $(left) -gt 30 ]; then
  FLASHKDA_TEST_KERNELS=split-1,default timeout 60 compute-sanitizer --tool racecheck $C/gpu --test-threads=1 smoke_small_cases >> $OUT/sanitizer.log 2>&1
  echo "racecheck rc=$? ($(left) s left)" >> $S
  grep -E "RACECHECK SUMMARY|test result" $OUT/sanitizer.log | tail -2 >> $S
fi
grep -E "flashkda|kernels|FAIL" $OUT/bench.log | grep -v "segment_chunks=" | cut -c1-300 >> $S
cat $S
