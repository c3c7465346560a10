#!/bin/bash
# chunked backward, device call 7 (final): GPU tests, flashkda vs fla fwd+bwd and bwd on the anchors
# (same run, same inputs), gradient checks of both against float64 (same run). Two builds travel:
# new/ (43a51d1) and the previous one (8ee36f2, tests passed in call 6); new/ is used if its tests pass.
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
export K3_REQUIRE_GPU=1 PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tc TRITON_CACHE_AUTOTUNING=1
B=$C/new
FLASHKDA_GPU_LOG=$L/gpu_bwd_new.jsonl timeout 45 $B/gpu_bwd --test-threads=1 > $L/tests_new.log 2>&1; rc=$?
echo "tests (new build) rc=$rc ($(left) s left)" >> $S
grep -E "panicked|rel error|not written|test result" $L/tests_new.log | head -6 >> $S
if [ $rc -ne 0 ]; then
  B=$C
  FLASHKDA_GPU_LOG=$L/gpu_bwd_old.jsonl timeout 45 $B/gpu_bwd --test-threads=1 > $L/tests_old.log 2>&1
  echo "tests (previous build) rc=$? ($(left) s left)" >> $S
  grep -E "panicked|rel error|not written|test result" $L/tests_old.log | head -6 >> $S
fi
echo "build used: $B" >> $S
W=/tmp/fkwheel; rm -rf $W; mkdir -p $W; (cd $W && python3 -m zipfile -e $B/flashkda-*.whl .)
export PYTHONPATH=$W:$FLA
python3 -c "import torch, triton, fla; print('torch', torch.__version__, 'triton', triton.__version__, 'fla', fla.__version__)" >> $L/env.txt 2>&1
cat $L/env.txt >> $S
T="python3 $C/bench_bwd.py --time --contenders flashkda,fla --iters 10 --repeats 3"
timeout $(( $(left) - 150 )) $T --out $L/time_h96_fixed.json --heads 96 --cases fixed > $L/time_h96_fixed.log 2>&1
echo "time H=96 fixed rc=$? ($(left) s left)" >> $S; grep -E "H=" $L/time_h96_fixed.log | cut -c 1-220 >> $S
timeout $(( $(left) > 200 ? 90 : $(left) / 2 )) python3 $C/bench_bwd.py --out $L/check_h96.json --check --check-heads 96 > $L/check_h96.log 2>&1
echo "check H=96 rc=$? ($(left) s left)" >> $S; grep -E '"case"|registered' $L/check_h96.log | cut -c 1-700 >> $S
timeout $(( $(left) - 5 )) $T --out $L/time_rest.json --heads 96,64 --cases fixed,varlen6,1024x8 > $L/time_rest.log 2>&1
echo "time all anchors rc=$? ($(left) s left)" >> $S; grep -E "H=" $L/time_rest.log | cut -c 1-220 >> $S
