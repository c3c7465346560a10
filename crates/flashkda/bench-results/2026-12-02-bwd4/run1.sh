#!/bin/bash
# bwd4 device call 1: fla's Triton kernels compile for the four (H, fixed/varlen) keys from bwd3's saved
# autotune results (phase A, parallel) while the GPU tests (every state-pass schedule) and the sanitizers
# run; keys first tuned under that contention are tuned again alone (phase B); then, alone on the GPU:
# flashkda fwd+bwd / bwd per state-pass schedule on the six anchors, per-kernel profiles, and fla on the
# six anchors (its first H=64 figures), after ncu with source counters on one kdab_chunk launch. Run from the repository root: BUDGET=540 bash .carry-fk5/run1.sh
set -u
C=$PWD/.carry-fk5; P=$C/py; B=$C/v1
START=$(date +%s); BUDGET=${BUDGET:-540}
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
  set -- $hc; timeout 240 python3 $P/warm_fla.py --heads $1 --case $2 > $L/warmA_$1_$2.log 2>&1 &
done
FLASHKDA_GPU_LOG=$L/gpu_bwd.jsonl timeout 150 $B/gpu_bwd --test-threads=1 > $L/tests.log 2>&1
echo "tests rc=$? ($(left) s left)" >> $S; grep -E "panicked|rel error|not written|test result" $L/tests.log | head -6 >> $S
timeout 90 compute-sanitizer --tool memcheck $B/gpu_bwd --test-threads=1 bwd_smoke > $L/memcheck.log 2>&1
echo "memcheck rc=$?" >> $S; grep -E "ERROR SUMMARY|test result" $L/memcheck.log >> $S
timeout 90 compute-sanitizer --tool racecheck $B/gpu_bwd --test-threads=1 bwd_smoke > $L/racecheck.log 2>&1
echo "racecheck rc=$?" >> $S; grep -E "RACECHECK SUMMARY|test result" $L/racecheck.log >> $S
wait; echo "phase A done ($(left) s left)" >> $S; grep -h first $L/warmA_*.log >> $S
find /tmp/tc -name "*.autotune.json" | sort > /tmp/after_a.txt
comm -13 /tmp/preloaded.txt /tmp/after_a.txt > /tmp/retune.txt; echo "retuning $(wc -l < /tmp/retune.txt) keys alone" >> $S
xargs -r rm -f < /tmp/retune.txt
for hc in "96 fixed" "96 varlen6" "64 fixed" "64 varlen6"; do
  set -- $hc; timeout 100 python3 $P/warm_fla.py --heads $1 --case $2 > $L/warmB_$1_$2.log 2>&1
  echo "phase B $1 $2 rc=$? ($(left) s left)" >> $S; grep first $L/warmB_$1_$2.log >> $S
done
for ps in auto seq2 conc4 conc2 seq4; do
  FLASHKDA_BWD_PASSES=$ps timeout 60 python3 $P/bench_bwd.py --time --contenders flashkda --iters 10 --repeats 3 --out $L/time_$ps.json > $L/time_$ps.log 2>&1
  echo "flashkda passes=$ps rc=$? ($(left) s left)" >> $S; grep -E "H=" $L/time_$ps.log | cut -c 15-120 >> $S
done
for hc in "96 fixed" "64 fixed" "96 1024x8"; do
  set -- $hc; timeout 40 python3 $P/prof_bwd.py --heads $1 --case $2 > $L/prof_$1_$2.log 2>&1; grep -v Warn $L/prof_$1_$2.log | head -9 >> $S
done
timeout 150 ncu --clock-control none -k regex:kdab_chunk -c 1 --set full --import-source yes -f -o /tmp/chunk python3 $P/prof_bwd.py --heads 96 --case fixed --iters 1 > $L/ncu_run.log 2>&1
echo "ncu rc=$? ($(left) s left)" >> $S
ncu -i /tmp/chunk.ncu-rep --page details > $L/ncu_chunk_details.txt 2>&1
ncu -i /tmp/chunk.ncu-rep --page source --csv --print-source cuda > $L/ncu_chunk_source.csv 2>&1
timeout $(( $(left) - 15 )) python3 $P/bench_bwd.py --time --contenders flashkda,fla --iters 10 --repeats 3 --out $L/time_both.json --heads 64,96 > $L/time_both.log 2>&1
echo "flashkda vs fla rc=$? ($(left) s left)" >> $S; grep -E "H=" $L/time_both.log | cut -c 15-140 >> $S
