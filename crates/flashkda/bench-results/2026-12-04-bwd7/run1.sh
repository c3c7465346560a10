#!/bin/bash
# fk9 device call 1: one build (default passes = main's kernels; conc4d2/conc4d3/conc4p4 = new variants):
# GPU tests (every schedule incl. the variants) + sanitizers while fla compiles from saved autotune results;
# flashkda alone per variant (and the forward overlap); the best variant vs fla on the six anchors;
# profile; gradient checks; training example. BUDGET=300 bash .carry-fk9/run1.sh
set -u
C=$PWD/.carry-fk9; P=$C/py
START=$(date +%s); BUDGET=${BUDGET:-300}
left() { echo $((BUDGET - ($(date +%s) - START))); }
L=$OUT/logs; mkdir -p $L; S=$OUT/summary.log
finish() { tar czf $OUT/logs.tgz -C $OUT logs; cat $S; }
trap finish EXIT
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 K3_REQUIRE_GPU=1 TRITON_CACHE_DIR=/tmp/tc
nvidia-smi --query-gpu=name,driver_version,clocks.current.sm,clocks.max.sm --format=csv > $L/env.txt 2>&1
FLA=/tmp/flasite; rm -rf $FLA; mkdir -p $FLA; (cd $FLA && python3 -m zipfile -e $C/fla_core-0.6.0-py3-none-any.whl .)
rm -rf /tmp/fk_new; mkdir -p /tmp/fk_new; (cd /tmp/fk_new && python3 -m zipfile -e $C/new/flashkda-*.whl .)
rm -rf /tmp/tc; (cd /tmp && tar xzf $C/tc_json.tgz); echo "preloaded autotune results: $(find /tmp/tc -name '*.autotune.json' | wc -l)" >> $S
export PYTHONPATH=/tmp/fk_new:$FLA
for hc in "96 fixed" "96 varlen6" "64 fixed" "64 varlen6"; do
  set -- $hc; timeout 200 python3 $P/warm_fla.py --heads $1 --case $2 > $L/warmA_$1_$2.log 2>&1 &
done
FLASHKDA_GPU_LOG=$L/gpu_bwd.jsonl timeout 150 $C/new/gpu_bwd --test-threads=1 > $L/tests.log 2>&1
echo "tests rc=$? ($(left) s left)" >> $S; grep -E "panicked|rel error|not written|test result" $L/tests.log | head -6 >> $S
for t in memcheck racecheck; do
  FLASHKDA_TEST_NO_OVERLAP=1 timeout 60 compute-sanitizer --tool $t $C/new/gpu_bwd --test-threads=1 bwd_smoke > $L/$t.log 2>&1
  echo "$t rc=$?" >> $S; grep -E "ERROR SUMMARY|RACECHECK SUMMARY|test result" $L/$t.log >> $S
done
wait; echo "phase A done ($(left) s left)" >> $S; grep -h first $L/warmA_*.log >> $S
python3 -c "import torch, triton, fla, flashkda; print('torch', torch.__version__, 'triton', triton.__version__, 'fla', fla.__version__)" >> $L/env.txt 2>&1
cat $L/env.txt >> $S
i=0; for b in conc4 conc4d2 conc4d3 conc4p4 fwdov conc4; do i=$((i+1))
  if [ $b = fwdov ]; then E="FLASHKDA_FWD_OVERLAP=1"; else E="FLASHKDA_BWD_PASSES=$b"; fi
  env $E timeout 40 python3 $P/bench_bwd.py --time --contenders flashkda --iters 10 --repeats 3 --out $L/time_fk_${i}_$b.json > $L/time_fk_${i}_$b.log 2>&1
  echo "flashkda $b rc=$? ($(left) s left)" >> $S; grep -E "H=" $L/time_fk_${i}_$b.log | cut -c 15-100 >> $S
done
BEST=$(python3 - $L <<'PY'
import json, sys, glob
L = sys.argv[1]; tot = {}
for f in glob.glob(L + "/time_fk_*_conc4*.json"):
    b = f.rsplit("_", 1)[1][:-5]
    t = sum(r["flashkda_fwd_bwd"]["median_ms"] for r in json.load(open(f))["timing"])
    tot[b] = min(tot.get(b, 1e9), t)
print(min(tot, key=tot.get))
PY
)
echo "best passes: $BEST" >> $S
FLASHKDA_BWD_PASSES=$BEST timeout 150 python3 $P/bench_bwd.py --time --contenders flashkda,fla --iters 10 --repeats 3 --out $L/time.json --heads 96,64 --cases fixed,varlen6,1024x8 > $L/time.log 2>&1
echo "time ($BEST) rc=$? ($(left) s left)" >> $S; grep -E "H=" $L/time.log | cut -c 15-140 >> $S
for hc in "96 fixed" "64 fixed"; do
  set -- $hc; FLASHKDA_BWD_PASSES=$BEST timeout 30 python3 $P/prof_bwd.py --heads $1 --case $2 > $L/prof_$1_$2.log 2>&1; grep -v Warn $L/prof_$1_$2.log | head -8 >> $S
done
FLASHKDA_BWD_PASSES=$BEST timeout $(( $(left) > 150 ? 60 : $(left) / 2 )) python3 $P/bench_bwd.py --out $L/check.json --check --check-heads 96,64 > $L/check.log 2>&1
echo "check rc=$? ($(left) s left)" >> $S; grep -E '"case"|registered' $L/check.log | cut -c 15-400 >> $S
FLASHKDA_BWD_PASSES=$BEST timeout $(( $(left) - 10 )) python3 $P/bench_bwd.py --out $L/train.json --train 300 > $L/train.log 2>&1
echo "train rc=$? ($(left) s left)" >> $S; grep -E "train" $L/train.log >> $S
