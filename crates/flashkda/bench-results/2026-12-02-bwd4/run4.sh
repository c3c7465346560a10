#!/bin/bash
# bwd4 device calls 4 and 5 (acceptance run, build v4 = 971da74, falls back to v3
# = 5eed43e if v4's tests fail): GPU tests (5 schedules) and sanitizers (without the prep overlap, which a
# serializing tool would starve) while fla's kernels compile from call 3's autotune results; flashkda-only
# timing of the default (prep overlap) and of conc4 (none), the faster is timed against fla; then the
# per-kernel profiles, gradient checks and the training example. BUDGET=400 bash .carry-fk5/run4.sh
set -u
C=$PWD/.carry-fk5; P=$C/py; B=$C/v4
START=$(date +%s); BUDGET=${BUDGET:-400}
left() { echo $((BUDGET - ($(date +%s) - START))); }
L=$OUT/logs; mkdir -p $L; S=$OUT/summary.log
finish() {
  tar czf $OUT/logs.tgz -C $OUT logs
  (cd /tmp && find tc -name "*.autotune.json" | tar czf $OUT/tc_json.tgz -T -)
  cat $S
}
trap finish EXIT
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 K3_REQUIRE_GPU=1 TRITON_CACHE_DIR=/tmp/tc
nvidia-smi --query-gpu=name,driver_version,clocks.current.sm,clocks.max.sm --format=csv > $L/env.txt 2>&1
FLA=/tmp/flasite; rm -rf $FLA; mkdir -p $FLA; (cd $FLA && python3 -m zipfile -e $C/fla_core-0.6.0-py3-none-any.whl .)
W=/tmp/fkwheel; rm -rf $W; mkdir -p $W; (cd $W && python3 -m zipfile -e $B/flashkda-*.whl .)
rm -rf /tmp/tc; (cd /tmp && tar xzf $C/tc_json.tgz); echo "preloaded autotune results: $(find /tmp/tc -name '*.autotune.json' | wc -l)" >> $S
for hc in "96 fixed" "96 varlen6" "64 fixed" "64 varlen6"; do
  set -- $hc; PYTHONPATH=$W:$FLA timeout 200 python3 $P/warm_fla.py --heads $1 --case $2 > $L/warmA_$1_$2.log 2>&1 &
done
FLASHKDA_GPU_LOG=$L/gpu_bwd.jsonl timeout 100 $B/gpu_bwd --test-threads=1 > $L/tests.log 2>&1; rc=$?
echo "tests v4 rc=$rc ($(left) s left)" >> $S; grep -E "panicked|rel error|not written|test result" $L/tests.log | head -6 >> $S
if [ $rc -ne 0 ]; then B=$C/v3; fi
echo "build used: $B" >> $S
FLASHKDA_TEST_NO_OVERLAP=1 timeout 60 compute-sanitizer --tool memcheck $B/gpu_bwd --test-threads=1 bwd_smoke > $L/memcheck.log 2>&1
echo "memcheck rc=$?" >> $S; grep -E "ERROR SUMMARY|test result" $L/memcheck.log >> $S
FLASHKDA_TEST_NO_OVERLAP=1 timeout 60 compute-sanitizer --tool racecheck $B/gpu_bwd --test-threads=1 bwd_smoke > $L/racecheck.log 2>&1
echo "racecheck rc=$?" >> $S; grep -E "RACECHECK SUMMARY|test result" $L/racecheck.log >> $S
wait; echo "phase A done ($(left) s left)" >> $S; grep -h first $L/warmA_*.log >> $S
if [ $B = $C/v3 ]; then rm -rf $W; mkdir -p $W; (cd $W && python3 -m zipfile -e $B/flashkda-*.whl .); fi
export PYTHONPATH=$W:$FLA
python3 -c "import torch, triton, fla, flashkda; print('torch', torch.__version__, 'triton', triton.__version__, 'fla', fla.__version__)" >> $L/env.txt 2>&1
cat $L/env.txt >> $S
for ps in auto conc4; do
  FLASHKDA_BWD_PASSES=$ps timeout 40 python3 $P/bench_bwd.py --time --contenders flashkda --iters 10 --repeats 3 --out $L/time_fk_$ps.json > $L/time_fk_$ps.log 2>&1
  echo "flashkda passes=$ps rc=$? ($(left) s left)" >> $S; grep -E "H=" $L/time_fk_$ps.log | cut -c 15-100 >> $S
done
PS=$(python3 -c "
import json
a=json.load(open('$L/time_fk_auto.json'))['timing']; b=json.load(open('$L/time_fk_conc4.json'))['timing']
s=sum(x['flashkda_fwd_bwd']['median_ms'] for x in a); t=sum(x['flashkda_fwd_bwd']['median_ms'] for x in b)
print('auto' if s <= t else 'conc4')" 2>>$S)
echo "acceptance timing with FLASHKDA_BWD_PASSES=${PS:-auto}" >> $S
FLASHKDA_BWD_PASSES=${PS:-auto} timeout 150 python3 $P/bench_bwd.py --time --contenders flashkda,fla --iters 10 --repeats 3 --out $L/time.json --heads 96,64 --cases fixed,varlen6,1024x8 > $L/time.log 2>&1
echo "time rc=$? ($(left) s left)" >> $S; grep -E "H=" $L/time.log | cut -c 15-140 >> $S
for hc in "96 fixed" "64 fixed"; do
  set -- $hc; FLASHKDA_BWD_PASSES=${PS:-auto} timeout 30 python3 $P/prof_bwd.py --heads $1 --case $2 > $L/prof_$1_$2.log 2>&1; grep -v Warn $L/prof_$1_$2.log | head -8 >> $S
done
FLASHKDA_BWD_PASSES=${PS:-auto} timeout $(( $(left) > 200 ? 120 : $(left) / 2 )) python3 $P/bench_bwd.py --out $L/check.json --check --check-heads 96,64 > $L/check.log 2>&1
echo "check rc=$? ($(left) s left)" >> $S; grep -E '"case"|registered' $L/check.log | cut -c 15-900 >> $S
FLASHKDA_BWD_PASSES=${PS:-auto} timeout $(( $(left) - 10 )) python3 $P/bench_bwd.py --out $L/train.json --train 300 > $L/train.log 2>&1
echo "train rc=$? ($(left) s left)" >> $S; grep -E "train" $L/train.log >> $S
python3 -c "import json; t=json.load(open('$L/train.json'))['train']; print('train max rel diff', t.get('max_rel_diff'), 'final', t.get('final'))" >> $S 2>&1
