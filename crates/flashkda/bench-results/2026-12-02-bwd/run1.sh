#!/bin/bash
# chunked backward, device call 1: GPU tests, flashkda timing and per-kernel profile (no fla)
set -u
C=$(cd "$(dirname "$0")" && pwd)
START=$(date +%s); BUDGET=${BUDGET:-400}
left() { echo $((BUDGET - ($(date +%s) - START))); }
L=$OUT/logs; mkdir -p $L
S=$OUT/summary.log
finish() { tar czf $OUT/logs.tgz -C $OUT logs; cat $S; }
trap finish EXIT
nvidia-smi --query-gpu=name,driver_version,clocks.current.sm,clocks.max.sm --format=csv > $L/env.txt 2>&1
W=/tmp/fkwheel; rm -rf $W; mkdir -p $W; (cd $W && python3 -m zipfile -e $C/flashkda-*.whl .)
export PYTHONPATH=$W PYTHONUNBUFFERED=1 K3_REQUIRE_GPU=1 FLASHKDA_GPU_LOG=$L/gpu_bwd.jsonl
cat $L/env.txt >> $S
timeout 60 $C/gpu_bwd --test-threads=1 bwd_smoke > $L/smoke.log 2>&1; echo "smoke rc=$?" >> $S
grep -E "test |panicked|error" $L/smoke.log | head -20 >> $S
timeout 90 python3 $C/prof_bwd.py --heads 96 --case fixed > $L/prof.log 2>&1; echo "prof rc=$?" >> $S
head -20 $L/prof.log >> $S
timeout 90 python3 $C/bench_bwd.py --out $L/time.json --time --contenders flashkda --heads 96,64 --cases fixed,varlen6,1024x8 --iters 10 --repeats 2 > $L/time.log 2>&1
echo "time rc=$? ($(left) s left)" >> $S; grep -E "H=" $L/time.log | cut -c 1-200 >> $S
timeout $(( $(left) - 20 )) $C/gpu_bwd --test-threads=1 > $L/tests.log 2>&1; echo "tests rc=$? ($(left) s left)" >> $S
grep -E "test |panicked|rel error|not written|result" $L/tests.log | head -30 >> $S
python3 - $L/gpu_bwd.jsonl >> $S 2>&1 <<'PY'
import json,sys
w={}
for l in open(sys.argv[1]):
    r=json.loads(l)
    for k,v in r.items():
        if isinstance(v,float) and k not in("seed",): w[k]=max(w.get(k,0),v)
print("worst per gradient:", {k: f"{v:.2e}" for k,v in w.items()})
PY
