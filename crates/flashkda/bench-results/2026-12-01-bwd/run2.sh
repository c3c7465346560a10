#!/bin/bash
# flashkda-bwd run 2: shared-partials kernel; GPU tests (both sub-chunk sizes), timing variants, fla fwd+bwd
# on the anchors in the same run, wheel gradient checks with fla and the hookup
set -u
C=$(cd "$(dirname "$0")" && pwd)
START=$(date +%s); BUDGET=${BUDGET:-570}
left() { echo $((BUDGET - ($(date +%s) - START))); }
L=$OUT/logs; mkdir -p $L
S=$OUT/summary.log
finish() { tar czf $OUT/logs.tgz -C $OUT logs; cat $S; }
trap finish EXIT
nvidia-smi --query-gpu=name,driver_version,clocks.current.sm,clocks.max.sm --format=csv > $L/env.txt 2>&1
FLA=/tmp/flasite; rm -rf $FLA; mkdir -p $FLA; (cd $FLA && python3 -m zipfile -e $C/fla_core-0.6.0-py3-none-any.whl .)
W=/tmp/fkwheel; rm -rf $W; mkdir -p $W; (cd $W && python3 -m zipfile -e $C/flashkda-*.whl .)
export PYTHONPATH=$W:$FLA
python3 -c "import torch, triton, fla; print('torch', torch.__version__, 'triton', triton.__version__, 'fla', fla.__version__)" >> $L/env.txt 2>&1
cat $L/env.txt >> $S
export K3_REQUIRE_GPU=1 FLASHKDA_GPU_LOG=$L/accuracy.jsonl PYTHONUNBUFFERED=1
chmod +x $C/gpu_bwd $C/gpu
timeout 90 $C/gpu_bwd --test-threads=1 > $L/gpu_bwd.log 2>&1
echo "bwd tests (sub 16, checkpoints auto) rc=$? ($(left) s left)" >> $S
grep -E "test result|panicked" $L/gpu_bwd.log >> $S
FLASHKDA_BWD_SUB=8 timeout 90 $C/gpu_bwd --test-threads=1 > $L/gpu_bwd_s8.log 2>&1
echo "bwd tests (FLASHKDA_BWD_SUB=8) rc=$? ($(left) s left)" >> $S
grep -E "test result|panicked" $L/gpu_bwd_s8.log >> $S
FLASHKDA_TEST_KERNELS=default timeout 30 $C/gpu --test-threads=1 smoke_small_cases > $L/gpu_fwd_smoke.log 2>&1
echo "fwd smoke rc=$? ($(left) s left)" >> $S
for V in "16 auto" "8 auto" "16 64"; do
  set -- $V
  if [ "$2" = auto ]; then unset FLASHKDA_BWD_CK; else export FLASHKDA_BWD_CK=$2; fi
  FLASHKDA_BWD_SUB=$1 timeout 60 python3 $C/bench_bwd.py --out $L/time_flashkda_s$1_c$2.json --time --contenders flashkda --heads 96,64 --iters 10 --repeats 3 > $L/time_flashkda_s$1_c$2.log 2>&1
  echo "time flashkda sub=$1 ck=$2 rc=$? ($(left) s left)" >> $S
  grep -E "H=" $L/time_flashkda_s$1_c$2.log | cut -c 1-200 >> $S
done
unset FLASHKDA_BWD_CK
timeout $(( $(left) - 150 )) python3 $C/bench_bwd.py --out $L/time_both.json --time --contenders flashkda,fla --heads 96,64 --iters 10 --repeats 3 > $L/time_both.log 2>&1
echo "time flashkda vs fla rc=$? ($(left) s left)" >> $S
grep -E "H=" $L/time_both.log | cut -c 1-220 >> $S
timeout $(( $(left) - 10 )) python3 $C/bench_bwd.py --out $L/check.json --check > $L/check.log 2>&1
echo "check rc=$? ($(left) s left)" >> $S
tail -c 2500 $L/check.log >> $S
