set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /root/site .whl/*.whl || exit 1
rm -rf /root/old && mkdir -p /root/old && tar -C .carry/old -cf - . | tar -C /root/old -xf -
export PATH=/root/site/bin:$PATH PYTHONUNBUFFERED=1 BENCH_ROWS_ONLY=1 BENCH_ROWS= BENCH_PART_LIMIT_S=230
unset PYTHONDONTWRITEBYTECODE
for which in now old; do
  if [ $which = old ]; then dir=/root/old; else dir=$PWD; fi
  d=$OUT/${which}_r16; mkdir -p $d
  ( cd $dir && OUT=$d PYTHONPATH=/root/site:$dir BENCH_VARIANTS="R=16,loss=triton" timeout 260 python3 bench/train_step.py --layers 3 --steps 10 > $d/log.txt 2>&1 )
  echo "$(date +%T) $which rows 16: exit $?"; tail -c 300 $d/log.txt
done
