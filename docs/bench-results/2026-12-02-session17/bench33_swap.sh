#!/usr/bin/env bash
# Session 17, last call (carry .whl, .carry/old): the step bench again, the old tree first this time and twice
# each (old, now, old, now), 1 and 16 rows, so that the order of the first calls is not what differs.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /root/site .whl/*.whl || exit 1
rm -rf /root/old && mkdir -p /root/old && tar -C .carry/old -cf - . | tar -C /root/old -xf -
export PATH=/root/site/bin:$PATH PYTHONUNBUFFERED=1 BENCH_ROWS_ONLY=1 BENCH_ROWS= BENCH_PART_LIMIT_S=230
unset PYTHONDONTWRITEBYTECODE
for rows in 1 16; do for rep in a b; do for which in old now; do
  if [ $which = old ]; then dir=/root/old; else dir=$PWD; fi
  d=$OUT/${which}_r${rows}_$rep; mkdir -p $d
  ( cd $dir && OUT=$d PYTHONPATH=/root/site:$dir BENCH_VARIANTS="R=$rows,loss=triton" timeout 200 python3 bench/train_step.py --layers 3 --steps 10 > $d/log.txt 2>&1 )
  echo "$(date +%T) $which rows $rows $rep: exit $?"
done; done; done
