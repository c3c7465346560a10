#!/bin/bash
# fk8 device call 2: issue 11's capture report reproduced with the wheel of main (a99ba7b, before the
# fix) and of fk8, each cold (first flashkda call inside the capture) and warm (one eager call first).
# Run from the repository root: bash .carry-fk8/run2.sh
set -u
C=$PWD/.carry-fk8; S=$OUT/summary.log
export PYTHONUNBUFFERED=1
for b in head fk8; do
  W=/tmp/fk_$b; rm -rf $W; mkdir -p $W; (cd $W && python3 -m zipfile -e $C/$b/flashkda-*.whl .)
  for m in cold warm; do
    echo "== wheel $b ($(cat $C/$b/COMMIT)), $m" >> $S
    PYTHONPATH=$W timeout 60 python3 $C/repro_capture.py $m >> $S 2>&1
  done
done
cat $S
