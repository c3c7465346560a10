#!/bin/bash
# chunked backward, device call 4: GPU tests, flashkda timing and profile, ncu of the backward kernels
set -u
C=$(cd "$(dirname "$0")" && pwd)
START=$(date +%s); BUDGET=${BUDGET:-300}
left() { echo $((BUDGET - ($(date +%s) - START))); }
L=$OUT/logs; mkdir -p $L
S=$OUT/summary.log
finish() { tar czf $OUT/logs.tgz -C $OUT logs; cat $S; }
trap finish EXIT
W=/tmp/fkwheel; rm -rf $W; mkdir -p $W; (cd $W && python3 -m zipfile -e $C/flashkda-*.whl .)
export PYTHONPATH=$W PYTHONUNBUFFERED=1 K3_REQUIRE_GPU=1 FLASHKDA_GPU_LOG=$L/gpu_bwd.jsonl
timeout 90 python3 $C/prof_bwd.py --heads 96 --case fixed > $L/prof.log 2>&1; echo "prof rc=$?" >> $S
grep -v Warn $L/prof.log | head -12 >> $S
timeout 60 python3 $C/bench_bwd.py --out $L/time.json --time --contenders flashkda --heads 96,64 --cases fixed,varlen6,1024x8 --iters 10 --repeats 2 > $L/time.log 2>&1
echo "time rc=$? ($(left) s left)" >> $S; grep -E "H=" $L/time.log | cut -c 1-200 >> $S
timeout 120 $C/gpu_bwd --test-threads=1 > $L/tests.log 2>&1; echo "tests rc=$? ($(left) s left)" >> $S
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
timeout $(( $(left) - 10 )) ncu --kernel-name regex:"kdab_(chunk|states_w2|dstates_w2)" --launch-count 3 --section SpeedOfLight --section WarpStateStats --section Occupancy --section MemoryWorkloadAnalysis python3 $C/prof_bwd.py --heads 96 --case fixed --iters 1 > $L/ncu.log 2>&1
echo "ncu rc=$? ($(left) s left)" >> $S
grep -E "kdab_|Duration|Memory Throughput|DRAM Throughput|Compute \(SM\) Throughput|Achieved Occupancy|Stall|Warp Cycles Per Issued|Registers|L2 Hit|L1/TEX Hit" $L/ncu.log | head -80 >> $S
