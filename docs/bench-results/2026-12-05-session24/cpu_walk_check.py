"""CPU check on the real target (session 24): a fixed-token drafter's walk over the target's own fp32 replies
against the lossless online eval of the same prompts, step for step.

The drafter's layers write nothing and its final norm maps the mask token's embedding onto a vector whose
lm_head argmax is the replies' commonest token that such a vector can single out, so its proposals do not
depend on the context features: walk and online eval must then agree exactly, and any difference is in the
walk's anchors, stops or the reply it follows.  Made in /tmp/dry (the example's target and data built):

    head -6 examples/smollm2/data/heldout.jsonl > rows.jsonl
    dflash generate --target $M --data rows.jsonl --out gen.jsonl --turns last --max-new-tokens 48 \
        --dtype fp32 --batch-size 1 --gpus cpu
    dflash precompute --target $M --data gen.jsonl --out store --hidden-dtype bf16 --gpus cpu
    python cpu_walk_check.py        # writes fixed.json (results/cpu_walk_check.json)
"""
import json
from collections import Counter

import torch

from dflash.evaluate.run import load_prompts, online_eval
from dflash.store import open_store
from dflash.target_model.capture import load_target, load_tokenizer
from dflash.train.walk import reply_span, walk_tau

M = "/work/main/examples/smollm2/model"
store = open_store("/tmp/dry/store")
counts = Counter()
for sid in store.sample_ids():
    d = store.read(sid, fields=("input_ids", "loss_mask")); f, l = reply_span(d["loss_mask"].numpy())
    counts.update(d["input_ids"][f:f + 32].tolist())
tok = load_tokenizer(M)
from dflash.drafter import DFlashDrafter, DrafterConfig
from dflash.target_model.files import load_embed_and_head, target_config

embed, head = load_embed_and_head(M); embed, head = embed.float(), head.float()
mask_id = next(i for i in range(len(embed) - 1, 0, -1) if bool((embed[i] != 0).all()))  # no zero to divide by
cfg = DrafterConfig.from_target(target_config(M), num_layers=1, block_size=16,
                                target_layer_ids=list(store.target_layer_ids), mask_token_id=mask_id)
torch.manual_seed(0)
drafter = DFlashDrafter(cfg).float().eval()
pinv = torch.linalg.pinv(head)  # [H, V]
found = None
for c, n in counts.most_common(40):  # the commonest reply token that some hidden vector makes lm_head's argmax
    for v in (head[c], head[c] - head.mean(0), pinv[:, c]):
        if int((head @ v).argmax()) == c:
            found = (c, n, v); break
    if found: break
c, n, v = found
with torch.no_grad():
    for layer in drafter.layers:
        layer.self_attn.o_proj.weight.zero_(); layer.mlp.down_proj.weight.zero_()
    x = embed[cfg.mask_token_id]
    unit = x / x.pow(2).mean().add(cfg.rms_norm_eps).sqrt()
    drafter.norm.weight.copy_(v / unit)
assert int((head @ drafter.norm(x)).argmax()) == c
print("fixed token", c, repr(tok.decode([c])), n)
walk = walk_tau(drafter, embed, head, store, max_new_tokens=32, progress=False)
model = load_target(M, torch.float32, torch.device("cpu"))
prompts = load_prompts("/tmp/dry/gen.jsonl", tok)
online = online_eval(model, drafter, prompts, max_new_tokens=32, eos_ids={tok.eos_token_id}, progress=False)
out = {"token": c, "walk": {k: walk[k] for k in ("tau", "num_blocks", "num_samples", "tau_hist")},
       "online": {k: online[k] for k in ("tau", "num_blocks", "tau_hist", "lossless")}}
print(json.dumps(out))
json.dump(out, open("/tmp/dry/fixed.json", "w"), indent=1)
