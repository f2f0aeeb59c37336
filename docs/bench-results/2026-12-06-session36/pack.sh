#!/usr/bin/env bash
# Session 36: the newest checkpoint of RUN (default DRG) back through $OUT, for a lossless eval in a later
# lease when this one has no time left for it: its drafter (model.safetensors, fp32: the online eval runs
# the drafter in fp32), config.json and train_config.json, as a tar cut into pieces of 15 MiB. The example's
# DFlash2 drafter is 37.4M parameters (its two candidate codebooks are 25.2M of them), ~150 MB: ten pieces,
# and a call returns at most 64 MiB, so PART=0, 1, 2 bring back pieces 4 x PART to 4 x PART + 3, one call
# each. The optimizer state (train_state.pt) stays behind: it is twice the weights and an eval does not read it.
set -u
E=/root/ex; RUN=${RUN:-DRG}; PART=${PART:-0}; W=/root/pack
if [ ! -f $W/ckpt.sha256 ]; then
  ck=$(ls -d $E/runs/$RUN/checkpoints/step-* 2>/dev/null | sort | tail -1)
  [ -n "$ck" ] || { echo "no checkpoint of $RUN under $E/runs"; exit 3; }
  ls -la $ck
  rm -rf $W && mkdir -p $W
  tar -C $(dirname $ck) -cf - --exclude=train_state.pt $(basename $ck) | split -b 15m -d - $W/ckpt.tar.
  (cd $W && sha256sum ckpt.tar.* > ckpt.sha256)
fi
cat $W/ckpt.sha256
for i in 0 1 2 3; do
  f=$W/ckpt.tar.$(printf %02d $(( 4 * PART + i )))
  [ -f $f ] && cp $f $OUT/
done
cp $W/ckpt.sha256 $OUT/
ls -la $OUT
