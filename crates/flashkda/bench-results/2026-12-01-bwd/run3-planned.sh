#!/bin/bash
# flashkda-bwd run 3: flashkda vs fla fwd+bwd at H=96 (same run), gradient checks with fla at H=96, training example
set -u
C=$(cd "$(dirname "$0")" && pwd)
START=$(date +%s); BUDGET=${BUDGET:-560}
left() { echo $((BUDGET - ($(date +%s) - START))); }
L=$OUT/logs; mkdir -p $L
S=$OUT/summary.log
finish() { tar czf $OUT/logs.tgz -C $OUT logs; cat $S; }
trap finish EXIT
nvidia-smi --query-gpu=name,driver_version,clocks.current.sm,clocks.max.sm --format=csv > $L/env.txt 2>&1
FLA=/tmp/flasite; rm -rf $FLA; mkdir -p $FLA; (cd $FLA && python3 -m zipfile -e $C/fla_core-0.6.0-py3-none-any.whl .)
W=/tmp/fkwheel; rm -rf $W; mkdir -p $W; (cd $W && python3 -m zipfile -e $C/flashkda-*.whl .)
export PYTHONPATH=$W:$FLA PYTHONUNBUFFERED=1
python3 -c "import torch, triton, fla; print('torch', torch.__version__, 'triton', triton.__version__, 'fla', fla.__version__)" >> $L/env.txt 2>&1
cat $L/env.txt >> $S
timeout 330 python3 $C/bench_bwd.py --out $L/time_h96.json --time --contenders flashkda,fla --heads 96 --cases fixed,1024x8,varlen6 --iters 10 --repeats 3 > $L/time_h96.log 2>&1
echo "time H=96 flashkda vs fla rc=$? ($(left) s left)" >> $S
grep -E "H=" $L/time_h96.log | cut -c 1-240 >> $S
timeout $(( $(left) > 230 ? 120 : $(left) / 2 )) python3 $C/bench_bwd.py --out $L/check_h96.json --check --check-heads 96 > $L/check_h96.log 2>&1
echo "check H=96 rc=$? ($(left) s left)" >> $S
tail -c 3000 $L/check_h96.log >> $S
timeout $(( $(left) - 10 )) python3 $C/bench_bwd.py --out $L/train.json --train 150 > $L/train.log 2>&1
echo "train rc=$? ($(left) s left)" >> $S
tail -5 $L/train.log >> $S
