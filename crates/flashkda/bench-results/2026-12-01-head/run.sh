#!/bin/bash
# flashkda at HEAD after the merge (bounded overlap wait): every GPU test variant, the wheel checks, a CUDA-graph replay.
set -u
C=$(cd "$(dirname "$0")" && pwd)
S=$OUT/summary.log
nvidia-smi --query-gpu=name,driver_version --format=csv > $OUT/env.txt 2>&1; cat $OUT/env.txt >> $S
export K3_REQUIRE_GPU=1 FLASHKDA_GPU_LOG=$OUT/accuracy.jsonl PYTHONUNBUFFERED=1
chmod +x $C/gpu
timeout 240 $C/gpu --test-threads=1 > $OUT/gpu_tests.log 2>&1
echo "gpu tests rc=$?" >> $S
grep -E "^test |test result|panicked|variant" $OUT/gpu_tests.log | tail -30 >> $S
W=/tmp/fkwheel; rm -rf $W; mkdir -p $W; (cd $W && python3 -m zipfile -e $C/flashkda-*.whl .)
export PYTHONPATH=$W
timeout 90 python3 $C/check_wheel.py > $OUT/check_wheel.log 2>&1
echo "check_wheel rc=$?" >> $S
tail -c 1500 $OUT/check_wheel.log >> $S
cat $S
