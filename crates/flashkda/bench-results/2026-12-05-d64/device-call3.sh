#!/bin/bash
# 2026-12-05 device call 3 (issue 32): the code of branch fk-gpu after calls 1-2 (COMMIT in the carry): head dim
# 64 with the gate lifted (no opt-in anywhere: gpu_d64, check_wheel.py), the backward after the warp-pair passes'
# deletion (every gradient test of the 10 remaining schedules, memcheck of the Auto ones, flashkda-only timing),
# forward regression (smoke, graph), and the head-dim-64 forward against fla's chunk_kda (bench_d64.py, fla warmed
# in parallel first). Carry: crates/flashkda/.carry/ with bins.tgz (new/gpu, gpu_graph, gpu_d64, gpu_bwd),
# new/flashkda-*.whl, py/*.py, fla_core-0.6.0-py3-none-any.whl, tc_json.tgz.
# BUDGET=330 bash crates/flashkda/.carry/call3.sh
set -u
C=$PWD/crates/flashkda/.carry; P=$C/py; (cd $C && tar xzf bins.tgz)
START=$(date +%s); BUDGET=${BUDGET:-330}
left() { echo $((BUDGET - ($(date +%s) - START))); }
L=$OUT/logs; mkdir -p $L; S=$OUT/summary.log
finish() { cp $S $L/ 2>/dev/null; tar czf $OUT/logs.tgz -C $OUT logs && rm -rf $L; cat $S; }
trap finish EXIT
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 K3_REQUIRE_GPU=1 TRITON_CACHE_DIR=/tmp/tc
unset FLASHKDA_EXPERIMENTAL_HEAD_DIM_64
nvidia-smi --query-gpu=name,driver_version,clocks.current.sm,clocks.max.sm --format=csv > $L/env.txt 2>&1
cat $C/COMMIT >> $L/env.txt
FLA=/tmp/flasite; rm -rf $FLA; mkdir -p $FLA; (cd $FLA && python3 -m zipfile -e $C/fla_core-0.6.0-py3-none-any.whl .)
rm -rf /tmp/fk_new; mkdir -p /tmp/fk_new; (cd /tmp/fk_new && python3 -m zipfile -e $C/new/flashkda-*.whl .)
rm -rf /tmp/tc; (cd /tmp && tar xzf $C/tc_json.tgz)
export PYTHONPATH=/tmp/fk_new:$FLA
python3 -c "import torch, triton, fla, flashkda; print('torch', torch.__version__, 'triton', triton.__version__, 'fla', fla.__version__, 'head_dim_enabled(64)', flashkda.head_dim_enabled(64))" >> $L/env.txt 2>&1
cat $L/env.txt >> $S
# fla at head dim 64: compile + autotune each anchor key in parallel while the tests run
for hc in 96:fixed 96:varlen6 64:fixed 64:varlen6; do
  timeout 170 python3 $P/bench_d64.py --warm $hc > $L/warm_d64_${hc/:/_}.log 2>&1 &
done
# head dim 64, gate lifted: the whole suite and the wheel check, no opt-in set anywhere
FLASHKDA_GPU_LOG=$L/gpu_d64.jsonl timeout 100 $C/new/gpu_d64 --test-threads=1 > $L/d64_tests.log 2>&1
echo "d64 tests rc=$? ($(left) s left)" >> $S; grep -E "panicked|test result" $L/d64_tests.log | head -4 >> $S
python3 - $L/gpu_d64.jsonl >> $S 2>&1 <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
if rows:
    w = max(rows, key=lambda r: r["rel_out_f64"])
    d = [r for r in rows if r["variant"] == "d64-default"]
    print("d64 cases", len(rows), "worst out vs f64", w["rel_out_f64"], w["case"], w["variant"],
          "| default worst out", max(r["rel_out_f64"] for r in d) if d else None)
PY
timeout 90 python3 $P/check_wheel.py > $L/check_wheel.log 2>&1
echo "check_wheel rc=$? ($(left) s left)" >> $S; python3 -c "
import json,sys; r=json.loads(open('$L/check_wheel.log').read().strip().splitlines()[-1])
print({k: r.get(k) for k in ('ok','head_dim_enabled_64','rel_out','split_rel_out','d64_default_rel_out','d64_split_rel_out','d64_training','registered','fla_dispatch_equals_direct','opt_out_disables','fla_error')})" >> $S 2>&1
# backward after the pair deletion: every remaining schedule, memcheck of the Auto ones
FLASHKDA_GPU_LOG=$L/gpu_bwd.jsonl timeout 150 $C/new/gpu_bwd --test-threads=1 > $L/bwd_tests.log 2>&1
echo "bwd tests rc=$? ($(left) s left)" >> $S; grep -E "panicked|test result" $L/bwd_tests.log | head -4 >> $S
FLASHKDA_TEST_PASSES=conc4d2,conc4d3 timeout 60 compute-sanitizer --tool memcheck $C/new/gpu_bwd --test-threads=1 bwd_smoke > $L/bwd_memcheck.log 2>&1
echo "bwd memcheck (conc4d2,conc4d3) rc=$?" >> $S; grep -E "ERROR SUMMARY|test result" $L/bwd_memcheck.log >> $S
# forward regression: smoke + gva + graph
FLASHKDA_GPU_LOG=$L/gpu.jsonl timeout 60 $C/new/gpu --test-threads=1 smoke gva > $L/gpu.log 2>&1
echo "gpu smoke/gva rc=$? ($(left) s left)" >> $S; grep -E "panicked|test result" $L/gpu.log | head -3 >> $S
timeout 60 $C/new/gpu_graph --test-threads=1 > $L/graph.log 2>&1
echo "gpu_graph rc=$? ($(left) s left)" >> $S; grep -E "panicked|test result" $L/graph.log | head -3 >> $S
wait; grep -h "first call" $L/warm_d64_*.log >> $S; echo "fla warm done ($(left) s left)" >> $S
# flashkda fwd+bwd (Auto) timing: unchanged by the deletion?
timeout 40 python3 $P/bench_bwd.py --time --contenders flashkda --iters 10 --repeats 3 --out $L/time_bwd_auto.json > $L/time_bwd_auto.log 2>&1
echo "flashkda fwd+bwd auto rc=$? ($(left) s left)" >> $S; grep -E "H=" $L/time_bwd_auto.log | cut -c 15-100 >> $S
# head dim 64 forward: flashkda vs fla on the six anchors
timeout $(( $(left) > 100 ? 90 : $(left) - 5 )) python3 $P/bench_d64.py --out $L/time_d64.json > $L/time_d64.log 2>&1
echo "d64 time rc=$? ($(left) s left)" >> $S; grep -E "D=64|Error" $L/time_d64.log | cut -c 1-260 >> $S
