#!/bin/bash
# bwd5 device call (build of fk6: the gpu_bwd test binary and the abi3 wheel, kernels unchanged from
# main 1e9be14): GPU tests (dbeta against its floored denominator, plain error logged), the small cases
# over 200 fresh seeds, while fla's kernels compile from bwd4's saved autotune results; then flashkda vs
# fla fwd+bwd and bwd on the six anchors (same process, same inputs). Carried in crates/flashkda/.carry/:
# gpu_bwd, flashkda-*.whl, fla_core-0.6.0-py3-none-any.whl, py/ (crates/flashkda/python/*.py), tc_json.tgz.
#   BUDGET=270 bash crates/flashkda/.carry/run5.sh
set -u
C=$PWD/crates/flashkda/.carry; P=$C/py
START=$(date +%s); BUDGET=${BUDGET:-270}
left() { echo $((BUDGET - ($(date +%s) - START))); }
L=$OUT/logs; mkdir -p $L; S=$OUT/summary.log
finish() { tar czf $OUT/logs.tgz -C $OUT logs; cat $S; }
trap finish EXIT
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 K3_REQUIRE_GPU=1 TRITON_CACHE_DIR=/tmp/tc
nvidia-smi --query-gpu=name,driver_version,clocks.current.sm,clocks.max.sm --format=csv > $L/env.txt 2>&1
FLA=/tmp/flasite; rm -rf $FLA; mkdir -p $FLA; (cd $FLA && python3 -m zipfile -e $C/fla_core-0.6.0-py3-none-any.whl .)
W=/tmp/fkwheel; rm -rf $W; mkdir -p $W; (cd $W && python3 -m zipfile -e $C/flashkda-*.whl .)
export PYTHONPATH=$W:$FLA
rm -rf /tmp/tc; (cd /tmp && tar xzf $C/tc_json.tgz); echo "preloaded autotune results: $(find /tmp/tc -name '*.autotune.json' | wc -l)" >> $S
for hc in "96 fixed" "96 varlen6" "64 fixed" "64 varlen6"; do
  set -- $hc; timeout 150 python3 $P/warm_fla.py --heads $1 --case $2 > $L/warmA_$1_$2.log 2>&1 &
done
FLASHKDA_GPU_LOG=$L/gpu_bwd.jsonl timeout 100 $C/gpu_bwd --test-threads=1 > $L/tests.log 2>&1
echo "tests rc=$? ($(left) s left)" >> $S; grep -E "panicked|rel error|not written|test result" $L/tests.log | head -6 >> $S
FLASHKDA_GPU_LOG=$L/small_seeds.jsonl FLASHKDA_TEST_REPEAT=200 timeout 60 $C/gpu_bwd --test-threads=1 --ignored bwd_small_cases_over_many_seeds > $L/small_seeds.log 2>&1
echo "small cases x200 rc=$? ($(left) s left)" >> $S; grep -E "panicked|rel error|test result" $L/small_seeds.log | head -4 >> $S
python3 - $L/small_seeds.jsonl >> $S 2>&1 <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
for c in sorted({r["bwd_case"] for r in rows}):
    rs = [r for r in rows if r["bwd_case"] == c]
    p = [r["dbeta_plain"] for r in rs]; f = [r["dbeta"] for r in rs]
    print(f"{c}: {len(rs)} runs ({len({r['seed'] for r in rs})} seeds), dbeta plain max {max(p):.2e} (>1e-2: {sum(x > 1e-2 for x in p)}), floored max {max(f):.2e} (>1e-2: {sum(x > 1e-2 for x in f)}), worst field max {max(r['worst'] for r in rs):.2e}")
PY
wait; echo "phase A done ($(left) s left)" >> $S; grep -h first $L/warmA_*.log >> $S
python3 -c "import torch, triton, fla, flashkda; print('torch', torch.__version__, 'triton', triton.__version__, 'fla', fla.__version__)" >> $L/env.txt 2>&1
cat $L/env.txt >> $S
timeout $(( $(left) - 5 )) python3 $P/bench_bwd.py --time --contenders flashkda,fla --iters 10 --repeats 3 --out $L/time.json --heads 96,64 --cases fixed,varlen6,1024x8 > $L/time.log 2>&1
echo "time rc=$? ($(left) s left)" >> $S; grep -E "H=" $L/time.log | cut -c 15-140 >> $S
