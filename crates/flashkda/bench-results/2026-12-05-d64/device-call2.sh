#!/bin/bash
# 2026-12-05 device call 2 (issue 32): the head-dim-64 script (bench-results/2026-12-05-d64/run1.sh, BUDGET=200)
# then the warp-pair backward script (bench-results/2026-12-05-bwd8/run1.sh, BUDGET=340), both unchanged, from one
# carry (binaries of commit 29bb2c3): crates/flashkda/.carry/ with new/{gpu,gpu_d64,gpu_bwd,flashkda-*.whl},
# py/*.py, fla_core-0.6.0-py3-none-any.whl, tc_json.tgz. The d64 script reads .carry/d64/: a link to .carry here.
# bash crates/flashkda/.carry/call2.sh
set -u
C=$PWD/crates/flashkda/.carry; R=$PWD/crates/flashkda/bench-results
ln -sfn . $C/d64; (cd $C && tar xzf bins.tgz)
O=$OUT
nvidia-smi > $O/nvidia-smi.txt 2>&1; cat $C/COMMIT >> $O/nvidia-smi.txt
mkdir -p $O/d64 $O/bwd8
OUT=$O/d64 BUDGET=200 timeout -k 5 215 bash $R/2026-12-05-d64/run1.sh
echo "d64 script rc=$?"
[ -f $O/d64/logs.tgz ] || tar czf $O/d64/logs.tgz -C $O/d64 logs; rm -rf $O/d64/logs
OUT=$O/bwd8 BUDGET=340 timeout -k 5 355 bash $R/2026-12-05-bwd8/run1.sh
echo "bwd8 script rc=$?"
[ -f $O/bwd8/logs.tgz ] || tar czf $O/bwd8/logs.tgz -C $O/bwd8 logs; rm -rf $O/bwd8/logs
true
