#!/bin/bash
# flashkda chunk-64 forward (kda_fwd_c64.cu, KernelSchedule::Chunk64 / chunk=64), first device call.
# NOT YET RUN. Carry (prepared on the build machine, see README.md): crates/flashkda/.carry/c64/ with
#   new/gpu, new/gpu_graph, new/gpu_c64   release test binaries (cargo test --release -p flashkda --no-run)
#   new/flashkda-*.whl       the abi3 wheel of the same commit (maturin build --release --strip --features python)
#   py/                      crates/flashkda/python/*.py
# BUDGET=560 bash crates/flashkda/bench-results/2026-12-05-c64/run1.sh
# Order: the variant's smoke cases alone first (a device fault poisons the process's context), sanitizers
# on them, the full GPU suite of the variant, the graph case, then timing of the default vs chunk=64 on the
# six anchors in one process, then (time permitting) ncu of kda_state64 / kda_prep64.
set -u
C=$PWD/crates/flashkda/.carry/c64; P=$C/py
START=$(date +%s); BUDGET=${BUDGET:-560}
left() { echo $((BUDGET - ($(date +%s) - START))); }
L=$OUT/logs; mkdir -p $L; S=$OUT/summary.log
finish() { tar czf $OUT/logs.tgz -C $OUT logs; cat $S; }
trap finish EXIT
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 K3_REQUIRE_GPU=1
nvidia-smi --query-gpu=name,driver_version,clocks.current.sm,clocks.max.sm --format=csv > $L/env.txt 2>&1
cat $L/env.txt >> $S
rm -rf /tmp/fk_new; mkdir -p /tmp/fk_new; (cd /tmp/fk_new && python3 -m zipfile -e $C/new/flashkda-*.whl .)
export PYTHONPATH=/tmp/fk_new

# 0. the wgmma building blocks alone (tile layout, descriptors, fragment mapping): a failure here is a
#    layout error, not a math one
FLASHKDA_GPU_LOG=$L/selftest.jsonl timeout 60 $C/new/gpu_c64 --test-threads=1 --nocapture > $L/selftest.log 2>&1
echo "wgmma selftest rc=$? ($(left) s left)" >> $S; grep -E "wgmma selftest|panicked|test result" $L/selftest.log | head -4 >> $S
timeout 60 compute-sanitizer --tool memcheck $C/new/gpu_c64 --test-threads=1 > $L/selftest_memcheck.log 2>&1
echo "selftest memcheck rc=$?" >> $S; grep -E "ERROR SUMMARY" $L/selftest_memcheck.log >> $S
# 1. smoke cases of the variant alone (also the default, as a control on the same inputs)
FLASHKDA_TEST_KERNELS=chunk64,default FLASHKDA_GPU_LOG=$L/smoke.jsonl timeout 120 $C/new/gpu --test-threads=1 \
  smoke_small_cases > $L/smoke.log 2>&1
echo "smoke rc=$? ($(left) s left)" >> $S; grep -E "panicked|rel error|not written|vs emulation|test result" $L/smoke.log | head -6 >> $S
# 2. sanitizers on the smoke cases (chunk64 only)
for t in memcheck racecheck synccheck; do
  FLASHKDA_TEST_KERNELS=chunk64 timeout 150 compute-sanitizer --tool $t $C/new/gpu --test-threads=1 smoke_small_cases \
    > $L/$t.log 2>&1
  echo "$t rc=$? ($(left) s left)" >> $S; grep -E "ERROR SUMMARY|RACECHECK SUMMARY|test result" $L/$t.log | head -3 >> $S
done
# 3. the whole GPU suite for the variant (edge cases, anchors vs float64, GVA, determinism, CP refusals)
FLASHKDA_TEST_KERNELS=chunk64 FLASHKDA_GPU_LOG=$L/gpu.jsonl timeout $(( $(left) > 330 ? 200 : $(left) / 3 )) \
  $C/new/gpu --test-threads=1 > $L/tests.log 2>&1
echo "tests rc=$? ($(left) s left)" >> $S; grep -E "panicked|rel error|not written|test result" $L/tests.log | head -8 >> $S
python3 - $L/gpu.jsonl >> $S 2>&1 <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
worst = max((r["rel_out_f64"], r["case"]) for r in rows) if rows else None
anchors = [(r["case"], r["H"], r["rel_out_f64"], r["rel_state_f64"]) for r in rows if r["case"].startswith("anchor")]
print("chunk64 cases", len(rows), "worst out vs f64", worst)
for a in anchors: print("  anchor", *a)
PY
# 4. CUDA graph capture and replay (bitwise vs eager)
FLASHKDA_GPU_LOG=$L/graph.jsonl timeout 90 $C/new/gpu_graph --test-threads=1 chunk64_graph > $L/graph.log 2>&1
echo "graph rc=$? ($(left) s left)" >> $S; grep -E "panicked|test result" $L/graph.log | head -3 >> $S
# 5. timing: default vs chunk=64 on the six anchors, one process (CUDA events, medians; kernel profiles)
timeout $(( $(left) > 200 ? 150 : $(left) / 2 )) python3 $P/bench_compare.py --sets anchors --heads 96,64 --chunk64 \
  --no-flash-kda --out $L/time.json > $L/time.log 2>&1
echo "time rc=$? ($(left) s left)" >> $S; grep -E "chunk=64|flashkda [0-9]" $L/time.log | cut -c 1-220 >> $S
# 6. ncu of the two kernels at H=96 fixed
if [ $(left) -gt 70 ]; then
  timeout $(( $(left) - 10 )) ncu --clock-control none -k regex:"kda_(state|prep)64" -c 2 --section SpeedOfLight \
    --section WarpStateStats --section Occupancy --section LaunchStats python3 $P/bench_compare.py --sets anchors \
    --heads 96 --chunk64 --no-flash-kda --warmup 0 --iters 1 --repeats 1 --out $L/ncu_time.json > $L/ncu.txt 2>&1
  echo "ncu rc=$? ($(left) s left)" >> $S
  grep -E "kda_(state|prep)64|Duration|Registers Per|Warp Cycles Per Issued|Compute \(SM\) Throughput" $L/ncu.txt | head -14 >> $S
fi
