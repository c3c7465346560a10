#!/bin/bash
# flashkda-tc run 4: reordered split state pass (commit after 6cc9e82), validated and timed against bf16
set -u
C=$(cd "$(dirname "$0")" && pwd)
START=$(date +%s); BUDGET=${BUDGET:-230}
left() { echo $((BUDGET - ($(date +%s) - START))); }
S=$OUT/summary.log
nvidia-smi --query-gpu=name,driver_version,clocks.current.sm,clocks.max.sm,clocks.current.memory,power.draw,temperature.gpu --format=csv > $OUT/env.txt 2>&1
cat $OUT/env.txt >> $S
export K3_REQUIRE_GPU=1 FLASHKDA_GPU_LOG=$OUT/accuracy.jsonl PYTHONUNBUFFERED=1
chmod +x $C/gpu
FLASHKDA_TEST_KERNELS=split-2 timeout 30 $C/gpu --test-threads=1 smoke_small_cases > $OUT/gpu_tests.log 2>&1
echo "smoke split-2 rc=$? ($(left) s left)" >> $S
FLASHKDA_TEST_KERNELS=split-2,split-1,split-cp3,split-overlap,default timeout 120 $C/gpu --test-threads=1 >> $OUT/gpu_tests.log 2>&1
echo "tests (split-2, split-1, split-cp3, split-overlap, default) rc=$? ($(left) s left)" >> $S
grep -E "^test |test result|panicked" $OUT/gpu_tests.log >> $S
W=/tmp/fkwheel; rm -rf $W; mkdir -p $W; (cd $W && python3 -m zipfile -e $C/flashkda-*.whl .)
export PYTHONPATH=$W
timeout 40 python3 $C/check_wheel.py > $OUT/check_wheel.log 2>&1
echo "check_wheel rc=$? ($(left) s left)" >> $S
timeout 90 python3 $C/bench_compare.py --out $OUT/bench.json --no-flash-kda --operands bf16,split > $OUT/bench.log 2>&1
echo "bench rc=$? ($(left) s left)" >> $S
grep -E "flashkda|FAIL|accuracy" $OUT/bench.log | grep -v "segment_chunks=\|kernels" | cut -c1-240 >> $S
cat $S
