#!/bin/bash
# bwd4 device call 3 (acceptance run, build v3 = wheel and gpu_bwd of 5eed43e): fla's Triton kernels
# compile for the four (H, fixed/varlen) keys from call 1's autotune results (phase A, parallel) while
# the GPU tests and the sanitizers run; keys tuned under contention are tuned again alone (phase B);
# then, one process per step, alone on the GPU: flashkda vs fla fwd+bwd and bwd on the six anchors
# (same inputs), per-kernel profiles, the gradient checks of both against float64 and the fla-backend
# hookup, the training example (teacher layer). Run from the repository root:
#   BUDGET=560 bash .carry-fk5/run3.sh
set -u
C=$PWD/.carry-fk5; P=$C/py; B=$C/v3
START=$(date +%s); BUDGET=${BUDGET:-560}
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
export PYTHONPATH=$W:$FLA
python3 -c "import torch, triton, fla, flashkda; print('torch', torch.__version__, 'triton', triton.__version__, 'fla', fla.__version__)" >> $L/env.txt 2>&1
cat $L/env.txt >> $S
rm -rf /tmp/tc; (cd /tmp && tar xzf $C/tc_json.tgz); find /tmp/tc -name "*.autotune.json" | sort > /tmp/preloaded.txt
echo "preloaded autotune results: $(wc -l < /tmp/preloaded.txt)" >> $S
for hc in "96 fixed" "96 varlen6" "64 fixed" "64 varlen6"; do
  set -- $hc; timeout 200 python3 $P/warm_fla.py --heads $1 --case $2 > $L/warmA_$1_$2.log 2>&1 &
done
FLASHKDA_GPU_LOG=$L/gpu_bwd.jsonl timeout 90 $B/gpu_bwd --test-threads=1 > $L/tests.log 2>&1
echo "tests rc=$? ($(left) s left)" >> $S; grep -E "panicked|rel error|not written|test result" $L/tests.log | head -6 >> $S
timeout 60 compute-sanitizer --tool memcheck $B/gpu_bwd --test-threads=1 bwd_smoke > $L/memcheck.log 2>&1
echo "memcheck rc=$?" >> $S; grep -E "ERROR SUMMARY|test result" $L/memcheck.log >> $S
timeout 60 compute-sanitizer --tool racecheck $B/gpu_bwd --test-threads=1 bwd_smoke > $L/racecheck.log 2>&1
echo "racecheck rc=$?" >> $S; grep -E "RACECHECK SUMMARY|test result" $L/racecheck.log >> $S
wait; echo "phase A done ($(left) s left)" >> $S; grep -h first $L/warmA_*.log >> $S
find /tmp/tc -name "*.autotune.json" | sort > /tmp/after_a.txt
comm -13 /tmp/preloaded.txt /tmp/after_a.txt > /tmp/retune.txt; echo "retuning $(wc -l < /tmp/retune.txt) keys alone" >> $S
if [ -s /tmp/retune.txt ]; then
  xargs -r rm -f < /tmp/retune.txt
  for hc in "96 fixed" "96 varlen6" "64 fixed" "64 varlen6"; do
    set -- $hc; timeout 100 python3 $P/warm_fla.py --heads $1 --case $2 > $L/warmB_$1_$2.log 2>&1
    echo "phase B $1 $2 rc=$? ($(left) s left)" >> $S; grep first $L/warmB_$1_$2.log >> $S
  done
fi
timeout 150 python3 $P/bench_bwd.py --time --contenders flashkda,fla --iters 10 --repeats 3 --out $L/time.json --heads 96,64 --cases fixed,varlen6,1024x8 > $L/time.log 2>&1
echo "time rc=$? ($(left) s left)" >> $S; grep -E "H=" $L/time.log | cut -c 15-140 >> $S
for hc in "96 fixed" "64 fixed"; do
  set -- $hc; timeout 30 python3 $P/prof_bwd.py --heads $1 --case $2 > $L/prof_$1_$2.log 2>&1; grep -v Warn $L/prof_$1_$2.log | head -8 >> $S
done
timeout $(( $(left) > 260 ? 150 : $(left) / 2 )) python3 $P/bench_bwd.py --out $L/check.json --check --check-heads 96,64 > $L/check.log 2>&1
echo "check rc=$? ($(left) s left)" >> $S; grep -E '"case"|registered' $L/check.log | cut -c 15-900 >> $S
timeout $(( $(left) - 10 )) python3 $P/bench_bwd.py --out $L/train.json --train 300 > $L/train.log 2>&1
echo "train rc=$? ($(left) s left)" >> $S; grep -E "train" $L/train.log >> $S
python3 -c "import json; t=json.load(open('$L/train.json'))['train']; print('train max rel diff', t.get('max_rel_diff'), 'final', t.get('final'))" >> $S 2>&1
