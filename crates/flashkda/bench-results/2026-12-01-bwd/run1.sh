#!/bin/bash
# flashkda-bwd run 1: backward GPU tests (Rust), forward smoke, wheel gradient checks + fla hookup, timing
set -u
C=$(cd "$(dirname "$0")" && pwd)
START=$(date +%s); BUDGET=${BUDGET:-560}
left() { echo $((BUDGET - ($(date +%s) - START))); }
S=$OUT/summary.log
nvidia-smi --query-gpu=name,driver_version,clocks.current.sm,clocks.max.sm --format=csv > $OUT/env.txt 2>&1
python3 -c "import torch, importlib.metadata as m; print(torch.__version__, m.version('triton'), m.version('fla-core'))" >> $OUT/env.txt 2>&1
cat $OUT/env.txt >> $S
export K3_REQUIRE_GPU=1 FLASHKDA_GPU_LOG=$OUT/accuracy.jsonl PYTHONUNBUFFERED=1
chmod +x $C/gpu_bwd $C/gpu
timeout 60 $C/gpu_bwd --test-threads=1 bwd_smoke > $OUT/gpu_bwd.log 2>&1
echo "bwd smoke rc=$? ($(left) s left)" >> $S
timeout 200 $C/gpu_bwd --test-threads=1 >> $OUT/gpu_bwd.log 2>&1
echo "bwd tests (checkpoints auto = 16 tokens) rc=$? ($(left) s left)" >> $S
FLASHKDA_BWD_CK=64 timeout 100 $C/gpu_bwd --test-threads=1 bwd_smoke bwd_edge > $OUT/gpu_bwd_ck64.log 2>&1
echo "bwd tests (FLASHKDA_BWD_CK=64: smoke, edge) rc=$? ($(left) s left)" >> $S
grep -E "^test |test result|panicked" $OUT/gpu_bwd_ck64.log >> $S
grep -E "^test |test result|panicked" $OUT/gpu_bwd.log >> $S
FLASHKDA_TEST_KERNELS=default timeout 30 $C/gpu --test-threads=1 smoke_small_cases > $OUT/gpu_fwd_smoke.log 2>&1
echo "fwd smoke rc=$? ($(left) s left)" >> $S
W=/tmp/fkwheel; rm -rf $W; mkdir -p $W; (cd $W && python3 -m zipfile -e $C/flashkda-*.whl .)
export PYTHONPATH=$W
timeout 60 python3 $C/bench_bwd.py --out $OUT/time_flashkda.json --time --contenders flashkda --iters 10 --repeats 2 > $OUT/time_flashkda.log 2>&1
echo "time flashkda rc=$? ($(left) s left)" >> $S
grep -E "H=" $OUT/time_flashkda.log >> $S
FLASHKDA_BWD_CK=64 timeout 40 python3 $C/bench_bwd.py --out $OUT/time_flashkda_ck64.json --time --contenders flashkda --heads 96 --iters 10 --repeats 2 > $OUT/time_flashkda_ck64.log 2>&1
echo "time flashkda ck64 rc=$? ($(left) s left)" >> $S
grep -E "H=" $OUT/time_flashkda_ck64.log >> $S
timeout $(( $(left) > 200 ? 200 : $(left) - 60 )) python3 $C/bench_bwd.py --out $OUT/check.json --check > $OUT/check.log 2>&1
echo "check rc=$? ($(left) s left)" >> $S
tail -c 3000 $OUT/check.log >> $S
T=$(( $(left) - 15 ))
if [ $T -gt 30 ]; then
  timeout $T python3 $C/bench_bwd.py --out $OUT/time_fla.json --time --contenders fla --heads 96 --cases fixed,1024x8 --iters 10 --repeats 2 > $OUT/time_fla.log 2>&1
  echo "time fla rc=$? ($(left) s left)" >> $S
  grep -E "H=" $OUT/time_fla.log >> $S
fi
cat $S
