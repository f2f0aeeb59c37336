"""Make the embedded default target: a tokenizer and a small Qwen3 LM trained on generated conversations.

The target must have real structure (a drafter trained on a random-init target learns nothing worth
measuring), yet be small enough that precompute -> train -> eval runs on a CPU in minutes. So: a
byte-level BPE tokenizer fitted to data/train.jsonl, a Qwen-style ChatML chat template, and a 4-layer
Qwen3ForCausalLM (hidden 256, 3.7M parameters, tied embeddings) trained with AdamW, seeded, on
data/train.jsonl plus `--extra` fresh conversations from the same generator (none sharing a prompt
with the held-out split).

    python stages/make_dataset.py --out data
    python stages/make_target.py --data data --out data/target_model

The defaults are what made the committed weights: 5000 steps of ~4096 tokens (~11M tokens, ~2.5 epochs
of 82k conversations), which took 3.6 minutes on one H200 (`--device auto` picks CUDA when present).
The same command runs on a CPU, at roughly 2-3k tokens/s on two free cores, i.e. about an hour; fewer
`--steps` or `--extra` give a weaker target (1200 steps over train.jsonl alone memorise it and reach a
held-out loss of ~0.6 instead of ~0.01). The result is committed, so nothing downstream retrains it.

Writes OUT/{config.json, model.safetensors, generation_config.json, tokenizer files, TRAINING.json}.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import random
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>"] + [f"<|reserved_{i}|>" for i in range(4)]

# Qwen-style ChatML. The {% generation %} markers let transformers return an assistant-token mask
# (apply_chat_template(..., return_assistant_tokens_mask=True)); they render to nothing.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['role'] == 'assistant' %}"
    "{% generation %}{{- message['content'] + '<|im_end|>' }}{% endgeneration %}{{- '\\n' }}"
    "{%- else %}"
    "{{- message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Qwen2's pre-tokenizer split, except that every digit is its own piece (as in Qwen): arithmetic is
# then learnable digit by digit instead of through thousands of number tokens.
SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def read_conversations(path: Path) -> list[list[dict]]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line)["messages"] for line in f if line.strip()]


def extra_conversations(n: int, seed: int, heldout: list[list[dict]]) -> list[list[dict]]:
    """More conversations from the same generator, none sharing a user prompt with the held-out split.

    The committed train split is small (it is what a drafter's precompute reads); a 4-layer LM trained
    for many epochs on it memorises it instead of learning to copy from the prompt. Fresh samples from
    the generator teach the algorithm, as a real target's pretraining dwarfs a drafter's data.
    """
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from make_dataset import conversation

    held_prompts = {m["content"] for c in heldout for m in c if m["role"] == "user"}
    rng = random.Random(f"target-{seed}")
    out = []
    while len(out) < n:
        c = conversation(rng)
        if not any(m["content"] in held_prompts for m in c if m["role"] == "user"):
            out.append(c)
    return out


def build_tokenizer(convs: list[list[dict]], vocab_size: int):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    texts = [m["role"] + "\n" + m["content"] for c in convs for m in c]
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        additional_special_tokens=["<|im_start|>", "<|mask|>"] + [f"<|reserved_{i}|>" for i in range(4)],
        chat_template=CHAT_TEMPLATE,
        model_max_length=2048,
        clean_up_tokenization_spaces=False,
    )


def encode(tokenizer, conv: list[dict]) -> tuple[list[int], list[int]]:
    """Token ids of the rendered conversation and a mask of assistant tokens (content + <|im_end|>)."""
    out = tokenizer.apply_chat_template(conv, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    return list(out["input_ids"]), list(out["assistant_masks"])


def make_model(vocab_size: int, args):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.hidden // args.heads,
        max_position_embeddings=2048,
        rope_theta=10000.0,
        tie_word_embeddings=args.tie,
        bos_token_id=None,
        eos_token_id=None,  # set below from the tokenizer
        pad_token_id=None,
    )
    return Qwen3ForCausalLM(cfg)


def batches(samples, tokens_per_batch: int, rng: random.Random):
    """Length-bucketed batches of about tokens_per_batch (padded) tokens, in a shuffled order."""
    order = sorted(range(len(samples)), key=lambda i: (len(samples[i][0]), rng.random()))
    out, cur, cur_max = [], [], 0
    for i in order:
        n = len(samples[i][0])
        if cur and max(cur_max, n) * (len(cur) + 1) > tokens_per_batch:
            out.append(cur)
            cur, cur_max = [], 0
        cur.append(i)
        cur_max = max(cur_max, n)
    if cur:
        out.append(cur)
    rng.shuffle(out)
    return out


def collate(samples, idx, pad_id: int):
    T = max(len(samples[i][0]) for i in idx)
    ids = torch.full((len(idx), T), pad_id, dtype=torch.long)
    labels = torch.full((len(idx), T), -100, dtype=torch.long)
    attn = torch.zeros((len(idx), T), dtype=torch.long)
    for r, i in enumerate(idx):
        x, m = samples[i]
        ids[r, : len(x)] = torch.tensor(x)
        attn[r, : len(x)] = 1
        # Label t is token t+1, supervised when that token belongs to an assistant turn.
        y = torch.tensor(x[1:] + [pad_id])
        keep = torch.tensor(m[1:] + [0], dtype=torch.bool)
        labels[r, : len(x)] = torch.where(keep, y, torch.full_like(y, -100))
    return ids, attn, labels


def loss_of(model, ids, attn, labels) -> tuple[torch.Tensor, int]:
    logits = model(input_ids=ids, attention_mask=attn).logits
    n = int((labels != -100).sum())
    loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100, reduction="sum")
    return loss, n


@torch.no_grad()
def evaluate(model, samples, pad_id: int, tokens_per_batch: int) -> float:
    """Mean cross-entropy per supervised (assistant) token."""
    model.eval()
    total, count = 0.0, 0
    for idx in batches(samples, tokens_per_batch, random.Random(0)):
        loss, n = loss_of(model, *collate(samples, idx, pad_id))
        total, count = total + float(loss), count + n
    model.train()
    return total / max(count, 1)


@torch.no_grad()
def greedy_samples(model, tokenizer, convs, n: int, max_new_tokens: int = 160) -> list[dict]:
    model.eval()
    out = []
    for conv in convs[:n]:
        prompt = conv[: next(i for i, m in enumerate(conv) if m["role"] == "assistant")]
        ids = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, return_tensors="pt", return_dict=True)
        gen = model.generate(**ids, max_new_tokens=max_new_tokens, do_sample=False)
        text = tokenizer.decode(gen[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)
        ref = conv[len(prompt)]["content"]
        out.append({"prompt": prompt[-1]["content"], "generated": text, "reference": ref, "exact": text == ref})
    model.train()
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description="Train the embedded default target (tokenizer + small Qwen3 LM).")
    p.add_argument("--data", default="data", help="directory holding train.jsonl and heldout.jsonl")
    p.add_argument("--out", default="data/target_model")
    p.add_argument("--vocab-size", type=int, default=2048)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--intermediate", type=int, default=768)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--tie", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--extra", type=int, default=80000, help="generated conversations added to train.jsonl")
    p.add_argument("--steps", type=int, default=5000)
    p.add_argument("--tokens-per-batch", type=int, default=4096)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--device", default="auto", help="auto (cuda when present, else cpu) | cpu | cuda")
    args = p.parse_args(argv)

    torch.set_num_threads(args.threads)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    data, out = Path(args.data), Path(args.out)
    train_convs = read_conversations(data / "train.jsonl")
    held_convs = read_conversations(data / "heldout.jsonl")

    t0 = time.time()
    tokenizer = build_tokenizer(train_convs, args.vocab_size)
    train = [encode(tokenizer, c) for c in train_convs + extra_conversations(args.extra, args.seed, held_convs)]
    held = [encode(tokenizer, c) for c in held_convs]
    n_tok = sum(len(x) for x, _ in train)
    n_sup = sum(sum(m) for _, m in train)
    print(f"tokenizer: {len(tokenizer)} tokens; {len(train)} training conversations, {n_tok} tokens "
          f"({n_sup} assistant), longest {max(len(x) for x, _ in train)}")

    model = make_model(len(tokenizer), args)
    model.config.eos_token_id = tokenizer.eos_token_id
    model.config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.to(args.device)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params / 1e6:.2f}M parameters")

    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.95))

    def lr_at(step: int) -> float:
        if step < args.warmup:
            return args.lr * (step + 1) / args.warmup
        t = (step - args.warmup) / max(1, args.steps - args.warmup)
        return args.lr * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * t)))

    model.train()
    schedule: list[list[int]] = []
    losses: list[float] = []
    bar = tqdm(range(args.steps), desc="train target", unit="step", file=sys.stdout, mininterval=5)
    for step in bar:
        if not schedule:
            schedule = batches(train, args.tokens_per_batch, rng)
        ids, attn, labels = (t.to(args.device) for t in collate(train, schedule.pop(), tokenizer.pad_token_id))
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        loss, n = loss_of(model, ids, attn, labels)
        loss = loss / max(n, 1)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        if step % 10 == 0:
            bar.set_postfix(loss=f"{sum(losses[-20:]) / len(losses[-20:]):.4f}")
    train_time = time.time() - t0

    model.to("cpu")
    train_loss = evaluate(model, train[:300], tokenizer.pad_token_id, args.tokens_per_batch)
    held_loss = evaluate(model, held, tokenizer.pad_token_id, args.tokens_per_batch)
    samples = greedy_samples(model, tokenizer, held_convs, n=20)
    exact = sum(s["exact"] for s in samples) / len(samples)
    print(f"done in {train_time:.0f}s: train loss {train_loss:.4f}, held-out loss {held_loss:.4f} "
          f"(nats per assistant token), greedy exact match {exact:.2f} on {len(samples)} held-out prompts")
    for s in samples[:4]:
        print(f"--- {s['prompt']}\n{s['generated']}")

    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    record = {
        "command": "python " + " ".join([Path(sys.argv[0]).as_posix()] + (argv if argv is not None else sys.argv[1:])),
        "args": vars(args),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
        "parameters": n_params,
        "train_tokens": n_tok,
        "train_time_s": round(train_time, 1),
        "final_train_loss": round(train_loss, 4),
        "heldout_loss": round(held_loss, 4),
        "loss_unit": "mean cross-entropy (nats) per assistant token, next-token prediction",
        "greedy_exact_match_heldout": exact,
        "loss_curve": [round(sum(losses[i:i + 50]) / len(losses[i:i + 50]), 4) for i in range(0, len(losses), 50)],
        "greedy_samples": samples[:6],
    }
    (out / "TRAINING.json").write_text(json.dumps(record, indent=2) + "\n")
    print(f"saved to {out}")


if __name__ == "__main__":
    main()
