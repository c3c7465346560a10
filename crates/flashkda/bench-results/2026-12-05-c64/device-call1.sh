#!/bin/bash
# 2026-12-05 device call 1 (issue 32): the chunk-64 forward's run1.sh (bench-results/2026-12-05-c64/run1.sh,
# unchanged steps 0-4 and 6), with the public FlashKDA built on the device in the background (ignored /tmp
# folder, from the carried MoonshotAI/FlashKDA @ 1ce47ea archive and nvidia-cutlass 4.2.0.0 headers) and timed in
# step 5 (no --no-flash-kda), then (5b) the cuDNN frontend 1.32.0 KDA forward beside flashkda and FlashKDA
# (bench_cudnn.py) and (5c) the default vs FlashKDA on the B=1 T=64K shapes. Binaries of commit 29bb2c3.
# Carry: crates/flashkda/.carry/ with new/{gpu,gpu_graph,gpu_c64,flashkda-*.whl}, py/*.py, ext/{flashkda_src.tgz,
# nvidia_cutlass-4.2.0.0-py3-none-any.whl, nvidia_cudnn_frontend-1.32.0-*.whl}.
# BUDGET=560 bash crates/flashkda/.carry/call1.sh
set -u
C=$PWD/crates/flashkda/.carry; P=$C/py; X=$C/ext; (cd $C && tar xzf bins.tgz)
START=$(date +%s); BUDGET=${BUDGET:-560}
left() { echo $((BUDGET - ($(date +%s) - START))); }
L=$OUT/logs; mkdir -p $L; S=$OUT/summary.log
finish() { cp $S $L/ 2>/dev/null; tar czf $OUT/logs.tgz -C $OUT logs && rm -rf $L; cat $S; }
trap finish EXIT
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 K3_REQUIRE_GPU=1
nvidia-smi --query-gpu=name,driver_version,clocks.current.sm,clocks.max.sm,memory.total --format=csv > $L/env.txt 2>&1
cat $C/COMMIT >> $L/env.txt; cat $L/env.txt >> $S
rm -rf /tmp/fk_new; mkdir -p /tmp/fk_new; (cd /tmp/fk_new && python3 -m zipfile -e $C/new/flashkda-*.whl .)
# public FlashKDA, built in the background while the tests run (CPU only)
FK=/tmp/fkx; rm -rf $FK; mkdir -p $FK
( cd $FK && tar xzf $X/flashkda_src.tgz && python3 -m zipfile -e $X/nvidia_cutlass-4.2.0.0-py3-none-any.whl cl \
  && mkdir -p FlashKDA/cutlass && ln -s $FK/cl/cutlass_library/source/include FlashKDA/cutlass/include \
  && cd FlashKDA && sed -i 's/^subprocess.run(\["git", "submodule".*$/pass/' setup.py \
  && FLASH_KDA_CUDA_ARCHS=90a NVCC_THREADS=4 MAX_JOBS=4 FLASH_KDA_VERSION_SUFFIX=+1ce47ea nice python3 setup.py build_ext --inplace ) > $L/flash_kda_build.log 2>&1 &
FKPID=$!
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/cudnnfe $X/nvidia_cudnn_frontend-*.whl > $L/cudnnfe_install.log 2>&1
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
# 5. timing: default vs chunk=64 vs the public FlashKDA on the six anchors, one process
wait $FKPID; echo "FlashKDA build rc=$? ($(left) s left)" >> $S; tail -2 $L/flash_kda_build.log | cut -c 1-200 >> $S
FKDA=--no-flash-kda
if PYTHONPATH=/tmp/fk_new:$FK/FlashKDA python3 -c "import flash_kda" >> $L/flash_kda_build.log 2>&1; then
  export PYTHONPATH=/tmp/fk_new:$FK/FlashKDA; FKDA=""
fi
timeout $(( $(left) > 200 ? 150 : $(left) / 2 )) python3 $P/bench_compare.py --sets anchors --heads 96,64 --chunk64 \
  $FKDA --out $L/time.json > $L/time.log 2>&1
echo "time rc=$? ($(left) s left)" >> $S; grep -E "chunk=64|flashkda [0-9]|FlashKDA|flash_kda|Error" $L/time.log | cut -c 1-220 >> $S
python3 - $L/time.json >> $S 2>&1 <<'PY'
import json, sys
for r in json.load(open(sys.argv[1]))["rows"]:
    fk = r["flashkda"]["median_ms"]; c = r.get("flashkda_chunk64", {}).get("median_ms"); p = r.get("flash_kda_best_ms")
    print(f"  {r['shape']:>14}: default {fk:.4f}  chunk64 {c}  FlashKDA {p}  default/FlashKDA {p / fk if p else None}")
PY
# 5b. the cuDNN frontend KDA forward (sm90 engines) beside flashkda and FlashKDA
if [ $(left) -gt 150 ]; then
  PYTHONPATH=$PYTHONPATH:/tmp/cudnnfe timeout 100 python3 $P/bench_cudnn.py --out $L/cudnn.json > $L/cudnn.log 2>&1
  echo "cudnn rc=$? ($(left) s left)" >> $S; grep -E "cuDNN|env|Error|error" $L/cudnn.log | cut -c 1-300 | head -24 >> $S
fi
# 5c. long single sequences (B=1, T=64K): the default vs FlashKDA, float64 accuracy at H=4
if [ $(left) -gt 110 ]; then
  timeout 70 python3 $P/bench_compare.py --sets long --long-t 65536 $FKDA --out $L/time_long.json > $L/time_long.log 2>&1
  echo "time long rc=$? ($(left) s left)" >> $S; grep -E "flashkda [0-9]|FlashKDA|flash_kda|rel|Error" $L/time_long.log | cut -c 1-220 >> $S
fi
# 6. ncu of the two kernels at H=96 fixed
if [ $(left) -gt 70 ]; then
  timeout $(( $(left) - 10 )) ncu --clock-control none -k regex:"kda_(state|prep)64" -c 2 --section SpeedOfLight \
    --section WarpStateStats --section Occupancy --section LaunchStats --section MemoryWorkloadAnalysis \
    python3 $P/bench_compare.py --sets anchors \
    --heads 96 --chunk64 --no-flash-kda --warmup 0 --iters 1 --repeats 1 --out $L/ncu_time.json > $L/ncu.txt 2>&1
  echo "ncu rc=$? ($(left) s left)" >> $S
  grep -E "kda_(state|prep)64|Duration|Registers Per|Warp Cycles Per Issued|Compute \(SM\) Throughput|DRAM Throughput|Achieved Occupancy" $L/ncu.txt | head -20 >> $S
fi
