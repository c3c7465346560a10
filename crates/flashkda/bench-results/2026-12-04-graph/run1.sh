#!/bin/bash
# fk8 device call 1 (issue 11: graph-safe default, self-contained bundle): CUDA-graph tests of the
# Rust API (gpu_graph) and of the wheel and fla backend (check_graph.py), compute-sanitizer memcheck
# on gpu_graph, forward smoke/determinism/GVA tests, the wheel check, then the bundled
# flashkda-bench run from a folder outside the checkout with the fla baseline for one key.
# Run from the repository root: BUDGET=300 bash .carry-fk8/run1.sh
set -u
C=$PWD/.carry-fk8
START=$(date +%s); BUDGET=${BUDGET:-300}
left() { echo $((BUDGET - ($(date +%s) - START))); }
L=$OUT/logs; mkdir -p $L; S=$OUT/summary.log
finish() { tar czf $OUT/logs.tgz -C $OUT logs; cat $S; }
trap finish EXIT
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 K3_REQUIRE_GPU=1 TRITON_CACHE_DIR=/tmp/tc
nvidia-smi --query-gpu=name,driver_version,clocks.current.sm,clocks.max.sm --format=csv > $L/env.txt 2>&1
FLA=/tmp/flasite; rm -rf $FLA; mkdir -p $FLA; (cd $FLA && python3 -m zipfile -e $C/fla_core-0.6.0-py3-none-any.whl .)
W=/tmp/fkwheel; rm -rf $W; mkdir -p $W; (cd $W && python3 -m zipfile -e $C/flashkda-*.whl .)
export PYTHONPATH=$W:$FLA
python3 -c "import torch, triton, fla, flashkda; print('torch', torch.__version__, 'triton', triton.__version__, 'fla', fla.__version__, 'flashkda', flashkda.__version__)" >> $L/env.txt 2>&1
cat $C/COMMIT >> $L/env.txt; cat $L/env.txt >> $S
rm -rf /tmp/tc; (cd /tmp && tar xzf $PWD/crates/flashkda/bench-results/2026-12-02-bwd4/fla_autotune_results.tgz) 2>>$S
FLASHKDA_GPU_LOG=$L/gpu_graph.jsonl timeout 90 $C/gpu_graph --test-threads=1 > $L/gpu_graph.log 2>&1
echo "gpu_graph rc=$? ($(left) s left)" >> $S; grep -E "panicked|differs|test result|^test " $L/gpu_graph.log | head -8 >> $S
timeout 60 python3 $C/check_graph.py --out $L/check_graph.json > $L/check_graph.log 2>&1
echo "check_graph rc=$? ($(left) s left)" >> $S; cut -c 1-330 $L/check_graph.log | grep -v "^ " | head -14 >> $S
timeout 90 compute-sanitizer --tool memcheck $C/gpu_graph --test-threads=1 > $L/memcheck_graph.log 2>&1
echo "memcheck gpu_graph rc=$? ($(left) s left)" >> $S; grep -E "ERROR SUMMARY|test result" $L/memcheck_graph.log >> $S
FLASHKDA_GPU_LOG=$L/gpu.jsonl timeout 60 $C/gpu --test-threads=1 smoke deterministic gva > $L/gpu.log 2>&1
echo "gpu smoke/deterministic/gva rc=$? ($(left) s left)" >> $S; grep -E "panicked|test result" $L/gpu.log | head -4 >> $S
timeout 40 python3 $C/check_wheel.py > $L/check_wheel.log 2>&1
echo "check_wheel rc=$? ($(left) s left)" >> $S; tail -3 $L/check_wheel.log | cut -c 1-300 >> $S
mkdir -p /tmp/elsewhere/report; cd /tmp/elsewhere
T=$(( $(left) - 10 )); [ $T -gt 150 ] && T=150
timeout $T $C/flashkda-bench --tier sm90 --out /tmp/elsewhere/report/report.json --heads 64 --kernels workspace-2 \
  --fla-heads 64 --fla-cases 1024x8 --warmup 3 --iters 10 --repeats 1 > $L/bench.log 2>&1
echo "bench (from /tmp/elsewhere) rc=$? ($(left) s left)" >> $S; grep -E "fla|BEST|error|Error" $L/bench.log | cut -c 1-250 | head -12 >> $S
cp /tmp/elsewhere/report/report.json $L/bench_report.json 2>/dev/null
true
