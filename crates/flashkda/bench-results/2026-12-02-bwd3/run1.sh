#!/bin/bash
# bwd3 device call 1: fla's Triton autotuning for the four (H, fixed/varlen) keys of the anchors
# (compile in parallel, then autotune again one at a time over the compiled kernels so the timings
# that pick configs run alone), the Triton cache saved to $OUT; the baseline (main @ 483ea2c)
# flashkda vs fla on the six anchors, the training example, a profile and ncu. Run from the
# repository root.
set -u
C=$PWD/.carry-fkbwd3  # run from the repository root: the carried builds and Triton cache
START=$(date +%s); BUDGET=${BUDGET:-560}
left() { echo $((BUDGET - ($(date +%s) - START))); }
L=$OUT/logs; mkdir -p $L
S=$OUT/summary.log
finish() {
  tar czf $OUT/logs.tgz -C $OUT logs
  du -sh /tmp/tc >> $S 2>&1
  (cd /tmp && tar cf - tc | gzip -1 | split -b 15M - $OUT/tc.tgz.) 2>> $S
  ls -la $OUT >> $S; cat $S
}
trap finish EXIT
nvidia-smi --query-gpu=name,driver_version,clocks.current.sm,clocks.max.sm --format=csv > $L/env.txt 2>&1
FLA=/tmp/flasite; rm -rf $FLA; mkdir -p $FLA; (cd $FLA && python3 -m zipfile -e $C/fla_core-0.6.0-py3-none-any.whl .)
W=/tmp/fkwheel; rm -rf $W; mkdir -p $W; (cd $W && python3 -m zipfile -e $C/base/flashkda-*.whl .)
export PYTHONPATH=$W:$FLA PYTHONUNBUFFERED=1 K3_REQUIRE_GPU=1 TRITON_CACHE_DIR=/tmp/tc
mkdir -p /tmp/tc; [ -n "$(ls $C/tc.tgz.* 2>/dev/null)" ] && (cd /tmp && cat $C/tc.tgz.* | tar xzf -)
python3 -c "import torch, triton, fla; print('torch', torch.__version__, 'triton', triton.__version__, 'fla', fla.__version__)" >> $L/env.txt 2>&1
cat $L/env.txt >> $S
P=$PWD/crates/flashkda/python
for hc in "96 fixed" "96 varlen6" "64 fixed" "64 varlen6"; do
  set -- $hc; timeout 300 python3 $P/warm_fla.py --heads $1 --case $2 > $L/warmA_$1_$2.log 2>&1 &
done
wait; echo "phase A (parallel compile) done ($(left) s left)" >> $S; cat $L/warmA_*.log | grep first >> $S
find /tmp/tc -name "*.autotune.json" | wc -l >> $S
find /tmp/tc -name "*.autotune.json" -delete
for hc in "96 fixed" "96 varlen6" "64 fixed" "64 varlen6"; do
  set -- $hc; timeout 200 python3 $P/warm_fla.py --heads $1 --case $2 > $L/warmB_$1_$2.log 2>&1
  echo "phase B $1 $2 rc=$? ($(left) s left)" >> $S; grep first $L/warmB_$1_$2.log >> $S
done
T="python3 $P/bench_bwd.py --time --contenders flashkda,fla --iters 10 --repeats 3"
timeout $(( $(left) - 150 )) $T --out $L/time_base.json --heads 96,64 --cases fixed,varlen6,1024x8 > $L/time_base.log 2>&1
echo "time base rc=$? ($(left) s left)" >> $S; grep -E "H=" $L/time_base.log | cut -c 1-200 >> $S
timeout 60 python3 $P/prof_bwd.py --heads 96 --case fixed > $L/prof.log 2>&1; grep -v Warn $L/prof.log | head -10 >> $S
timeout 120 ncu --kernel-name regex:"kdab_(chunk|states_w2|dstates_w2)" --launch-count 3 --set full -o /tmp/bwd python3 $P/prof_bwd.py --heads 96 --case fixed --iters 1 > $L/ncu_run.log 2>&1
echo "ncu rc=$? ($(left) s left)" >> $S
ncu -i /tmp/bwd.ncu-rep --page details > $L/ncu_details.txt 2>&1
ncu -i /tmp/bwd.ncu-rep --page source --csv --print-source sass > $L/ncu_source_sass.csv 2>&1
grep -E "kdab_|Duration|Throughput|Achieved Occupancy|Registers|Bank" $L/ncu_details.txt | head -60 >> $S
timeout $(( $(left) - 40 )) python3 $P/bench_bwd.py --out $L/train.json --train 300 > $L/train.log 2>&1
echo "train rc=$? ($(left) s left)" >> $S; grep -E "train" $L/train.log >> $S
