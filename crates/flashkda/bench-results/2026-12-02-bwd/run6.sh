#!/bin/bash
# chunked backward, device call 6: GPU tests (three runs, fresh seeds) and flashkda timing
set -u
C=$(cd "$(dirname "$0")" && pwd)
L=$OUT/logs; mkdir -p $L
S=$OUT/summary.log
finish() { tar czf $OUT/logs.tgz -C $OUT logs; cat $S; }
trap finish EXIT
W=/tmp/fkwheel; rm -rf $W; mkdir -p $W; (cd $W && python3 -m zipfile -e $C/flashkda-*.whl .)
export PYTHONPATH=$W PYTHONUNBUFFERED=1 K3_REQUIRE_GPU=1 FLASHKDA_GPU_LOG=$L/gpu_bwd.jsonl
for r in 1 2 3; do
  timeout 60 $C/gpu_bwd --test-threads=1 > $L/tests$r.log 2>&1; echo "tests run $r rc=$?" >> $S
  grep -E "panicked|rel error|not written|test result" $L/tests$r.log | head -6 >> $S
done
timeout 60 python3 $C/bench_bwd.py --out $L/time.json --time --contenders flashkda --heads 96,64 --cases fixed,varlen6,1024x8 --iters 10 --repeats 2 > $L/time.log 2>&1
echo "time rc=$?" >> $S; grep -E "H=" $L/time.log | cut -c 1-200 >> $S
timeout 60 python3 $C/prof_bwd.py --heads 96 --case fixed > $L/prof.log 2>&1; grep -v Warn $L/prof.log | head -12 >> $S
python3 - $L/gpu_bwd.jsonl >> $S 2>&1 <<'PY'
import json,sys
w={}
for l in open(sys.argv[1]):
    r=json.loads(l)
    for k,v in r.items():
        if isinstance(v,float) and k not in("seed",): w[k]=max(w.get(k,0),v)
print("worst per gradient:", {k: f"{v:.2e}" for k,v in w.items()})
PY
