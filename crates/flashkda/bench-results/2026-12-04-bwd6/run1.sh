#!/bin/bash
# fk7 device call 1: build new (swizzled kdab_chunk tiles) vs old (main 971da74-equivalent kernels):
# GPU tests + sanitizers of new while fla compiles from saved autotune results; flashkda-only A/B
# old/new/new/old; new vs fla on the six anchors; profiles; ncu of kdab_chunk (SASS + CUDA source
# counters) and of the passes; gradient checks; training example. BUDGET=420 bash .carry-fk7/run1.sh
set -u
C=$PWD/.carry-fk7; P=$C/py
START=$(date +%s); BUDGET=${BUDGET:-420}
left() { echo $((BUDGET - ($(date +%s) - START))); }
L=$OUT/logs; mkdir -p $L; S=$OUT/summary.log
finish() { tar czf $OUT/logs.tgz -C $OUT logs; cat $S; }
trap finish EXIT
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 K3_REQUIRE_GPU=1 TRITON_CACHE_DIR=/tmp/tc
nvidia-smi --query-gpu=name,driver_version,clocks.current.sm,clocks.max.sm --format=csv > $L/env.txt 2>&1
FLA=/tmp/flasite; rm -rf $FLA; mkdir -p $FLA; (cd $FLA && python3 -m zipfile -e $C/fla_core-0.6.0-py3-none-any.whl .)
for b in new old; do rm -rf /tmp/fk_$b; mkdir -p /tmp/fk_$b; (cd /tmp/fk_$b && python3 -m zipfile -e $C/$b/flashkda-*.whl .); done
mkdir -p /work/wt-fk7/crates/flashkda && cp -r $C/kernels /work/wt-fk7/crates/flashkda/
rm -rf /tmp/tc; (cd /tmp && tar xzf $C/tc_json.tgz); echo "preloaded autotune results: $(find /tmp/tc -name '*.autotune.json' | wc -l)" >> $S
for hc in "96 fixed" "96 varlen6" "64 fixed" "64 varlen6"; do
  set -- $hc; PYTHONPATH=/tmp/fk_new:$FLA timeout 200 python3 $P/warm_fla.py --heads $1 --case $2 > $L/warmA_$1_$2.log 2>&1 &
done
FLASHKDA_GPU_LOG=$L/gpu_bwd.jsonl timeout 120 $C/new/gpu_bwd --test-threads=1 > $L/tests.log 2>&1
echo "tests new rc=$? ($(left) s left)" >> $S; grep -E "panicked|rel error|not written|test result" $L/tests.log | head -6 >> $S
FLASHKDA_TEST_NO_OVERLAP=1 timeout 60 compute-sanitizer --tool memcheck $C/new/gpu_bwd --test-threads=1 bwd_smoke > $L/memcheck.log 2>&1
echo "memcheck rc=$?" >> $S; grep -E "ERROR SUMMARY|test result" $L/memcheck.log >> $S
FLASHKDA_TEST_NO_OVERLAP=1 timeout 60 compute-sanitizer --tool racecheck $C/new/gpu_bwd --test-threads=1 bwd_smoke > $L/racecheck.log 2>&1
echo "racecheck rc=$?" >> $S; grep -E "RACECHECK SUMMARY|test result" $L/racecheck.log >> $S
wait; echo "phase A done ($(left) s left)" >> $S; grep -h first $L/warmA_*.log >> $S
PYTHONPATH=/tmp/fk_new:$FLA python3 -c "import torch, triton, fla, flashkda; print('torch', torch.__version__, 'triton', triton.__version__, 'fla', fla.__version__)" >> $L/env.txt 2>&1
cat $L/env.txt >> $S
i=0; for b in old new new old; do i=$((i+1))
  PYTHONPATH=/tmp/fk_$b:$FLA timeout 40 python3 $P/bench_bwd.py --time --contenders flashkda --iters 10 --repeats 3 --out $L/time_fk_${i}_$b.json > $L/time_fk_${i}_$b.log 2>&1
  echo "flashkda $b rc=$? ($(left) s left)" >> $S; grep -E "H=" $L/time_fk_${i}_$b.log | cut -c 15-100 >> $S
done
export PYTHONPATH=/tmp/fk_new:$FLA
timeout 150 python3 $P/bench_bwd.py --time --contenders flashkda,fla --iters 10 --repeats 3 --out $L/time.json --heads 96,64 --cases fixed,varlen6,1024x8 > $L/time.log 2>&1
echo "time rc=$? ($(left) s left)" >> $S; grep -E "H=" $L/time.log | cut -c 15-140 >> $S
for hc in "96 fixed" "64 fixed"; do
  set -- $hc; timeout 30 python3 $P/prof_bwd.py --heads $1 --case $2 > $L/prof_$1_$2.log 2>&1; grep -v Warn $L/prof_$1_$2.log | head -8 >> $S
done
timeout 90 ncu --clock-control none -k regex:kdab_chunk -c 1 --section SourceCounters --section MemoryWorkloadAnalysis_Tables --section SpeedOfLight --section WarpStateStats --import-source yes -f -o /tmp/chunk python3 $P/prof_bwd.py --heads 96 --case fixed --iters 1 > $L/ncu_run.log 2>&1
echo "ncu chunk rc=$? ($(left) s left)" >> $S
ncu -i /tmp/chunk.ncu-rep --page details > $L/ncu_chunk_details.txt 2>&1
ncu -i /tmp/chunk.ncu-rep --page source --csv --print-source sass > $L/ncu_chunk_sass.csv 2>&1
ncu -i /tmp/chunk.ncu-rep --page source --csv --print-source cuda > $L/ncu_chunk_cuda.csv 2>&1
ls -la $L/ncu_chunk_*.csv >> $S; grep -E "Duration|Excessive|bank" $L/ncu_chunk_details.txt | head -8 >> $S
timeout 60 ncu --clock-control none -k regex:"kdab_d?states_w4" -c 2 --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy python3 $P/prof_bwd.py --heads 96 --case fixed --iters 1 > $L/ncu_passes.txt 2>&1
echo "ncu passes rc=$? ($(left) s left)" >> $S; grep -E "kdab_|Duration|DRAM Throughput|Memory Throughput" $L/ncu_passes.txt | head -12 >> $S
timeout $(( $(left) > 200 ? 120 : $(left) / 2 )) python3 $P/bench_bwd.py --out $L/check.json --check --check-heads 96,64 > $L/check.log 2>&1
echo "check rc=$? ($(left) s left)" >> $S; grep -E '"case"|registered' $L/check.log | cut -c 15-900 >> $S
timeout $(( $(left) - 15 )) python3 $P/bench_bwd.py --out $L/train.json --train 300 > $L/train.log 2>&1
echo "train rc=$? ($(left) s left)" >> $S; grep -E "train" $L/train.log >> $S
python3 -c "import json; t=json.load(open('$L/train.json'))['train']; print('train max rel diff', t.get('max_rel_diff'), 'final', t.get('final'))" >> $S 2>&1
