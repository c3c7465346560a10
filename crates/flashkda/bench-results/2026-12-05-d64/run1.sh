#!/bin/bash
# flashkda head dim 64 (K = V = 64, workspace schedule; gated by FLASHKDA_EXPERIMENTAL_HEAD_DIM_64 until this
# passes), first device call. NOT YET RUN. Carry (see README.md): crates/flashkda/.carry/d64/ with
#   new/gpu_d64, new/gpu          release test binaries of one commit
#   new/flashkda-*.whl            the abi3 wheel of the same commit
#   py/                           crates/flashkda/python/*.py
# BUDGET=240 bash crates/flashkda/bench-results/2026-12-05-d64/run1.sh
# Order: smoke cases alone (a fault poisons the context), sanitizers on them, the whole D=64 suite (every built
# variant: bf16 and split operands, value splits One/Two/Four, context parallelism; NaN-poisoned outputs against
# float64), the D=128 smoke cases as a control, then the wheel check (its D=64 case against a float64 torch
# recurrence, the training refusal). The tests opt in themselves.
set -u
C=$PWD/crates/flashkda/.carry/d64; P=$C/py
START=$(date +%s); BUDGET=${BUDGET:-240}
left() { echo $((BUDGET - ($(date +%s) - START))); }
L=$OUT/logs; mkdir -p $L; S=$OUT/summary.log
finish() { tar czf $OUT/logs.tgz -C $OUT logs; cat $S; }
trap finish EXIT
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 K3_REQUIRE_GPU=1
nvidia-smi --query-gpu=name,driver_version,clocks.current.sm,clocks.max.sm --format=csv > $L/env.txt 2>&1
cat $L/env.txt >> $S
FLASHKDA_GPU_LOG=$L/smoke.jsonl timeout 60 $C/new/gpu_d64 --test-threads=1 d64_smoke_small_cases > $L/smoke.log 2>&1
echo "d64 smoke rc=$? ($(left) s left)" >> $S; grep -E "panicked|rel error|not written|test result" $L/smoke.log | head -4 >> $S
for t in memcheck racecheck; do
  timeout 60 compute-sanitizer --tool $t $C/new/gpu_d64 --test-threads=1 d64_smoke_small_cases > $L/$t.log 2>&1
  echo "$t rc=$?" >> $S; grep -E "ERROR SUMMARY|RACECHECK SUMMARY|test result" $L/$t.log | head -2 >> $S
done
FLASHKDA_GPU_LOG=$L/gpu_d64.jsonl timeout $(( $(left) > 150 ? 100 : $(left) / 2 )) $C/new/gpu_d64 --test-threads=1 > $L/tests.log 2>&1
echo "d64 tests rc=$? ($(left) s left)" >> $S; grep -E "panicked|rel error|not written|test result" $L/tests.log | head -6 >> $S
python3 - $L/gpu_d64.jsonl >> $S 2>&1 <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
if rows:
    w = max(rows, key=lambda r: r["rel_out_f64"])
    print("d64 cases", len(rows), "worst out vs f64", w["rel_out_f64"], w["case"], w["variant"],
          "worst state", max(r["rel_state_f64"] for r in rows))
PY
timeout 60 $C/new/gpu --test-threads=1 smoke_small_cases > $L/d128_smoke.log 2>&1
echo "d128 smoke (control) rc=$?" >> $S; grep -E "test result" $L/d128_smoke.log >> $S
rm -rf /tmp/fk_new; mkdir -p /tmp/fk_new; (cd /tmp/fk_new && python3 -m zipfile -e $C/new/flashkda-*.whl .)
PYTHONPATH=/tmp/fk_new timeout $(( $(left) - 5 )) python3 $P/check_wheel.py > $L/check_wheel.log 2>&1
echo "check_wheel rc=$? (exit 1 may only mean fla is not importable: read the log)" >> $S
grep -E "d64|rel_out|error|Error" $L/check_wheel.log | head -12 >> $S
