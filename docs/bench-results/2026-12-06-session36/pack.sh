#!/usr/bin/env bash
# Session 36: the newest checkpoint of RUN (default DRG) back through $OUT, for a lossless eval in a later
# lease when this one has no time left for it: its drafter (model.safetensors, fp32), config.json and
# train_config.json, in tar pieces of 15 MiB (a call returns files of up to 16 MiB). The optimizer state
# (train_state.pt) stays behind: it is twice the weights and an eval does not read it.
set -u
E=/root/ex; RUN=${RUN:-DRG}
ck=$(ls -d $E/runs/$RUN/checkpoints/step-* 2>/dev/null | sort | tail -1)
[ -n "$ck" ] || { echo "no checkpoint of $RUN under $E/runs"; exit 3; }
ls -la $ck
tar -C $(dirname $ck) -cf - --exclude=train_state.pt $(basename $ck) | split -b 15m -d - $OUT/ckpt.tar.
cd $OUT && sha256sum ckpt.tar.* | tee ckpt.sha256
