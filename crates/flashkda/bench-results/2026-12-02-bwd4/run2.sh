#!/bin/bash
# bwd4 device call 2: GPU tests of builds v2 (bulk-copied chunk states) and v3 (+ bulk-copied records),
# sanitizers on v3, flashkda-only timing of v1 (conc4) / v2 / v3 on the six anchors, per-kernel
# profiles of v3, ncu source counters of v3's kdab_chunk. BUDGET=260 bash .carry-fk5/run2.sh
set -u
C=$PWD/.carry-fk5; P=$C/py
START=$(date +%s); BUDGET=${BUDGET:-260}
left() { echo $((BUDGET - ($(date +%s) - START))); }
L=$OUT/logs; mkdir -p $L; S=$OUT/summary.log
finish() { tar czf $OUT/logs.tgz -C $OUT logs; cat $S; }
trap finish EXIT
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 K3_REQUIRE_GPU=1
for v in v1 v2 v3; do W=/tmp/fk_$v; rm -rf $W; mkdir -p $W; (cd $W && python3 -m zipfile -e $C/$v/flashkda-*.whl .); done
for v in v3 v2; do
  FLASHKDA_GPU_LOG=$L/gpu_bwd_$v.jsonl timeout 60 $C/$v/gpu_bwd --test-threads=1 > $L/tests_$v.log 2>&1
  echo "tests $v rc=$? ($(left) s left)" >> $S; grep -E "panicked|rel error|not written|test result" $L/tests_$v.log | head -4 >> $S
done
timeout 60 compute-sanitizer --tool memcheck $C/v3/gpu_bwd --test-threads=1 bwd_smoke > $L/memcheck.log 2>&1
echo "memcheck v3 rc=$?" >> $S; grep -E "ERROR SUMMARY|test result" $L/memcheck.log >> $S
timeout 60 compute-sanitizer --tool racecheck $C/v3/gpu_bwd --test-threads=1 bwd_smoke > $L/racecheck.log 2>&1
echo "racecheck v3 rc=$?" >> $S; grep -E "RACECHECK SUMMARY|test result" $L/racecheck.log >> $S
for v in v3 v2 v1; do
  ps=auto; [ $v = v1 ] && ps=conc4
  PYTHONPATH=/tmp/fk_$v FLASHKDA_BWD_PASSES=$ps timeout 40 python3 $P/bench_bwd.py --time --contenders flashkda --iters 10 --repeats 3 --out $L/time_$v.json > $L/time_$v.log 2>&1
  echo "flashkda $v rc=$? ($(left) s left)" >> $S; grep -E "H=" $L/time_$v.log | cut -c 15-100 >> $S
done
for hc in "96 fixed" "64 fixed"; do
  set -- $hc; PYTHONPATH=/tmp/fk_v3 timeout 30 python3 $P/prof_bwd.py --heads $1 --case $2 > $L/prof_$1_$2.log 2>&1; grep -v Warn $L/prof_$1_$2.log | head -8 >> $S
done
mkdir -p /work/wt-fk/crates/flashkda; cp -r $C/kernels /work/wt-fk/crates/flashkda/
PYTHONPATH=/tmp/fk_v3 timeout 90 ncu --clock-control none -k regex:kdab_chunk -c 1 --section SourceCounters --section WarpStateStats --import-source yes -f -o /tmp/chunk python3 $P/prof_bwd.py --heads 96 --case fixed --iters 1 > $L/ncu_run.log 2>&1
echo "ncu rc=$? ($(left) s left)" >> $S
ncu -i /tmp/chunk.ncu-rep --page source --csv --print-source cuda > $L/ncu_chunk_source.csv 2>&1
ncu -i /tmp/chunk.ncu-rep --page details > $L/ncu_chunk_details.txt 2>&1
head -c 300 $L/ncu_chunk_source.csv >> $S
