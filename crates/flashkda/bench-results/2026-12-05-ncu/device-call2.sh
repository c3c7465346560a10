#!/bin/bash
# 2026-12-05 (issue 32), device call 2: the state-pass options that could lift the bound call 1 measured at
# the unsplit shapes (H=96 fixed T=8192, H=96 B=1 T=64K): overlap=True (the state pass beside the prep on a
# side stream, waiting on per-record flags) and value_split 1 / 4, CUDA-event medians beside the default,
# output compared with the default's. Same carry and wheel as device-call.sh.
#   bash crates/flashkda/bench-results/2026-12-05-ncu/device-call2.sh
set -u
C=$PWD/crates/flashkda/.carry; H=$PWD/crates/flashkda/bench-results/2026-12-05-ncu
L=$OUT/logs2; mkdir -p $L; S=$OUT/summary2.log
finish() { cp $S $L/ 2>/dev/null; tar czf $OUT/logs2.tgz -C $OUT logs2 && rm -rf $L; cat $S; }
trap finish EXIT
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
{ date -u +"start %F %T UTC"; cat $C/COMMIT
  nvidia-smi --query-gpu=name,driver_version,clocks.current.sm,clocks.max.sm --format=csv; } > $L/env.txt 2>&1
cat $L/env.txt >> $S
rm -rf /tmp/fk; mkdir -p /tmp/fk; (cd /tmp/fk && python3 -m zipfile -e $C/new/flashkda-*.whl .)
export PYTHONPATH=/tmp/fk
timeout 240 python3 $H/shapes.py --variants $L/variants.json > $L/variants.log 2>&1
echo "variants rc=$?" >> $S; grep -vE "^\s*$|UserWarning|_warn_once" $L/variants.log | cut -c 1-400 >> $S
date -u +"end %F %T UTC" >> $S
