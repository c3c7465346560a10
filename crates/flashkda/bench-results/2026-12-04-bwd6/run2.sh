#!/bin/bash
# fk7 device call 2: wheels main (971da74-equivalent kernels), v1 (82f3eb7: dO/dv/U tiles and 16x16 partials
# swizzled), v2 (every cp.async tile swizzled, X diag(b) swizzled, the gate pass on all 8 warps) and v2's
# gpu_bwd: tests + sanitizers of v2 while fla compiles from saved autotune results; flashkda-only A/B
# main/v1/v2/v2/v1/main; v2 vs fla on the six anchors; profiles; ncu of v2's kdab_chunk; gradient checks;
# training example. BUDGET=430 bash .carry-fk7/run2.sh
set -u
C=$PWD/.carry-fk7; P=$C/py
START=$(date +%s); BUDGET=${BUDGET:-430}
left() { echo $((BUDGET - ($(date +%s) - START))); }
L=$OUT/logs; mkdir -p $L; S=$OUT/summary.log
finish() { tar czf $OUT/logs.tgz -C $OUT logs; cat $S; }
trap finish EXIT
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 K3_REQUIRE_GPU=1 TRITON_CACHE_DIR=/tmp/tc
nvidia-smi --query-gpu=name,driver_version,clocks.current.sm,clocks.max.sm --format=csv > $L/env.txt 2>&1
FLA=/tmp/flasite; rm -rf $FLA; mkdir -p $FLA; (cd $FLA && python3 -m zipfile -e $C/fla_core-0.6.0-py3-none-any.whl .)
for b in main v1 v2; do rm -rf /tmp/fk_$b; mkdir -p /tmp/fk_$b; (cd /tmp/fk_$b && python3 -m zipfile -e $C/$b/flashkda-*.whl .); done
rm -rf /tmp/tc; (cd /tmp && tar xzf $C/tc_json.tgz); echo "preloaded autotune results: $(find /tmp/tc -name '*.autotune.json' | wc -l)" >> $S
for hc in "96 fixed" "96 varlen6" "64 fixed" "64 varlen6"; do
  set -- $hc; PYTHONPATH=/tmp/fk_v2:$FLA timeout 200 python3 $P/warm_fla.py --heads $1 --case $2 > $L/warmA_$1_$2.log 2>&1 &
done
FLASHKDA_GPU_LOG=$L/gpu_bwd.jsonl timeout 120 $C/v2/gpu_bwd --test-threads=1 > $L/tests.log 2>&1
echo "tests v2 rc=$? ($(left) s left)" >> $S; grep -E "panicked|rel error|not written|test result" $L/tests.log | head -6 >> $S
FLASHKDA_TEST_NO_OVERLAP=1 timeout 60 compute-sanitizer --tool memcheck $C/v2/gpu_bwd --test-threads=1 bwd_smoke > $L/memcheck.log 2>&1
echo "memcheck rc=$?" >> $S; grep -E "ERROR SUMMARY|test result" $L/memcheck.log >> $S
FLASHKDA_TEST_NO_OVERLAP=1 timeout 60 compute-sanitizer --tool racecheck $C/v2/gpu_bwd --test-threads=1 bwd_smoke > $L/racecheck.log 2>&1
echo "racecheck rc=$?" >> $S; grep -E "RACECHECK SUMMARY|test result" $L/racecheck.log >> $S
wait; echo "phase A done ($(left) s left)" >> $S; grep -h first $L/warmA_*.log >> $S
PYTHONPATH=/tmp/fk_v2:$FLA python3 -c "import torch, triton, fla, flashkda; print('torch', torch.__version__, 'triton', triton.__version__, 'fla', fla.__version__)" >> $L/env.txt 2>&1
cat $L/env.txt >> $S
i=0; for b in main v1 v2 v2 v1 main; do i=$((i+1))
  PYTHONPATH=/tmp/fk_$b:$FLA timeout 40 python3 $P/bench_bwd.py --time --contenders flashkda --iters 10 --repeats 3 --out $L/time_fk_${i}_$b.json > $L/time_fk_${i}_$b.log 2>&1
  echo "flashkda $b rc=$? ($(left) s left)" >> $S; grep -E "H=" $L/time_fk_${i}_$b.log | cut -c 15-100 >> $S
done
export PYTHONPATH=/tmp/fk_v2:$FLA
timeout 150 python3 $P/bench_bwd.py --time --contenders flashkda,fla --iters 10 --repeats 3 --out $L/time.json --heads 96,64 --cases fixed,varlen6,1024x8 > $L/time.log 2>&1
echo "time rc=$? ($(left) s left)" >> $S; grep -E "H=" $L/time.log | cut -c 15-140 >> $S
for hc in "96 fixed" "64 fixed"; do
  set -- $hc; timeout 30 python3 $P/prof_bwd.py --heads $1 --case $2 > $L/prof_$1_$2.log 2>&1; grep -v Warn $L/prof_$1_$2.log | head -8 >> $S
done
timeout 90 ncu --clock-control none -k regex:kdab_chunk -c 1 --section SourceCounters --section MemoryWorkloadAnalysis_Tables --section SpeedOfLight --section WarpStateStats -f -o /tmp/chunk python3 $P/prof_bwd.py --heads 96 --case fixed --iters 1 > $L/ncu_run.log 2>&1
echo "ncu chunk rc=$? ($(left) s left)" >> $S
ncu -i /tmp/chunk.ncu-rep --page details > $L/ncu_chunk_details.txt 2>&1
ncu -i /tmp/chunk.ncu-rep --page source --csv --print-source sass > $L/ncu_chunk_sass.csv 2>&1
grep -E "Duration|bank" $L/ncu_chunk_details.txt | head -6 >> $S
timeout $(( $(left) > 200 ? 120 : $(left) / 2 )) python3 $P/bench_bwd.py --out $L/check.json --check --check-heads 96,64 > $L/check.log 2>&1
echo "check rc=$? ($(left) s left)" >> $S; grep -E '"case"|registered' $L/check.log | cut -c 15-900 >> $S
timeout $(( $(left) - 15 )) python3 $P/bench_bwd.py --out $L/train.json --train 300 > $L/train.log 2>&1
echo "train rc=$? ($(left) s left)" >> $S; grep -E "train" $L/train.log >> $S
python3 -c "import json; t=json.load(open('$L/train.json'))['train']; print('train max rel diff', t.get('max_rel_diff'), 'final', t.get('final'))" >> $S 2>&1
