#!/bin/bash
# chunked backward, device call 7 (final): GPU tests, flashkda vs fla fwd+bwd and bwd on the anchors
# (same run, same inputs), gradient checks of both against float64 (same run)
set -u
C=$(cd "$(dirname "$0")" && pwd)
START=$(date +%s); BUDGET=${BUDGET:-470}
left() { echo $((BUDGET - ($(date +%s) - START))); }
L=$OUT/logs; mkdir -p $L
S=$OUT/summary.log
finish() { tar czf $OUT/logs.tgz -C $OUT logs; cat $S; }
trap finish EXIT
nvidia-smi --query-gpu=name,driver_version,clocks.current.sm,clocks.max.sm --format=csv > $L/env.txt 2>&1
FLA=/tmp/flasite; rm -rf $FLA; mkdir -p $FLA; (cd $FLA && python3 -m zipfile -e $C/fla_core-0.6.0-py3-none-any.whl .)
W=/tmp/fkwheel; rm -rf $W; mkdir -p $W; (cd $W && python3 -m zipfile -e $C/flashkda-*.whl .)
export PYTHONPATH=$W:$FLA PYTHONUNBUFFERED=1 K3_REQUIRE_GPU=1 FLASHKDA_GPU_LOG=$L/gpu_bwd.jsonl
export TRITON_CACHE_DIR=/tmp/tc TRITON_CACHE_AUTOTUNING=1
python3 -c "import torch, triton, fla; print('torch', torch.__version__, 'triton', triton.__version__, 'fla', fla.__version__)" >> $L/env.txt 2>&1
cat $L/env.txt >> $S
timeout 45 $C/gpu_bwd --test-threads=1 > $L/tests.log 2>&1; echo "tests rc=$? ($(left) s left)" >> $S
grep -E "panicked|rel error|not written|test result" $L/tests.log | head -6 >> $S
timeout $(( $(left) - 75 )) python3 $C/bench_bwd.py --out $L/time.json --time --contenders flashkda,fla --heads 96,64 --cases fixed,varlen6,1024x8 --iters 10 --repeats 3 > $L/time.log 2>&1
echo "time rc=$? ($(left) s left)" >> $S; grep -E "H=" $L/time.log | cut -c 1-220 >> $S
timeout $(( $(left) - 5 )) python3 $C/bench_bwd.py --out $L/check.json --check --check-heads 96,64 > $L/check.log 2>&1
echo "check rc=$? ($(left) s left)" >> $S; grep -E "case|registered" $L/check.log | cut -c 1-900 >> $S
