#!/bin/bash
# bwd3 device call 2 (flashkda only): GPU tests of the new build, compute-sanitizer on the smoke
# test, flashkda timing of the new and the baseline wheel on the six anchors, profile and ncu of
# the new backward kernels. Run from the repository root.
set -u
C=$PWD/.carry-fkbwd3
P=$PWD/crates/flashkda/python
START=$(date +%s); BUDGET=${BUDGET:-330}
left() { echo $((BUDGET - ($(date +%s) - START))); }
L=$OUT/logs; mkdir -p $L
S=$OUT/summary.log
finish() { tar czf $OUT/logs.tgz -C $OUT logs; cat $S; }
trap finish EXIT
export PYTHONUNBUFFERED=1 K3_REQUIRE_GPU=1
FLASHKDA_GPU_LOG=$L/gpu_bwd.jsonl timeout 60 $C/new/gpu_bwd --test-threads=1 > $L/tests.log 2>&1
echo "tests rc=$? ($(left) s left)" >> $S
grep -E "panicked|rel error|not written|test result" $L/tests.log | head -8 >> $S
for w in new base; do
  W=/tmp/fk_$w; rm -rf $W; mkdir -p $W; (cd $W && python3 -m zipfile -e $C/$w/flashkda-*.whl .)
  PYTHONPATH=$W timeout 60 python3 $P/bench_bwd.py --out $L/time_$w.json --time --contenders flashkda --heads 96,64 --cases fixed,varlen6,1024x8 --iters 10 --repeats 2 > $L/time_$w.log 2>&1
  echo "time $w rc=$? ($(left) s left)" >> $S; grep -E "H=" $L/time_$w.log | cut -c 1-200 >> $S
done
export PYTHONPATH=/tmp/fk_new
timeout 60 python3 $P/prof_bwd.py --heads 96 --case fixed > $L/prof.log 2>&1; grep -v Warn $L/prof.log | head -9 >> $S
timeout 60 python3 $P/prof_bwd.py --heads 64 --case fixed > $L/prof64.log 2>&1; grep -v Warn $L/prof64.log | head -9 >> $S
timeout 90 ncu --kernel-name regex:"kdab_(chunk|states_w2|dstates_w2)" --launch-count 3 --set full -o /tmp/bwd python3 $P/prof_bwd.py --heads 96 --case fixed --iters 1 > $L/ncu_run.log 2>&1
echo "ncu rc=$? ($(left) s left)" >> $S
ncu -i /tmp/bwd.ncu-rep --page details > $L/ncu_details.txt 2>&1
ncu -i /tmp/bwd.ncu-rep --page source --csv --print-source sass > $L/ncu_source_sass.csv 2>&1
grep -E "^  kdab_|Duration|DRAM Throughput|L1/TEX Cache Throughput|Achieved Occupancy|Registers Per" $L/ncu_details.txt | head -40 >> $S
timeout $(( $(left) - 15 )) compute-sanitizer --tool memcheck $C/new/gpu_bwd --test-threads=1 bwd_smoke > $L/memcheck.log 2>&1
echo "memcheck rc=$? ($(left) s left)" >> $S; grep -E "ERROR SUMMARY|test result" $L/memcheck.log >> $S
timeout $(( $(left) - 10 )) compute-sanitizer --tool racecheck $C/new/gpu_bwd --test-threads=1 bwd_smoke > $L/racecheck.log 2>&1
echo "racecheck rc=$? ($(left) s left)" >> $S; grep -E "RACECHECK SUMMARY|ERROR SUMMARY|test result" $L/racecheck.log >> $S
