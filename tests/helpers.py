"""Builders shared by the tests: tiny random-init targets with a chat-templated tokenizer, conversations.

Nothing here downloads anything.  A "target" is a real transformers checkpoint directory (config.json,
model.safetensors, tokenizer.json + chat template) small enough to run on one CPU core in milliseconds.

    target = make_tiny_target(tmp_path, arch="qwen3")      # or "llama"
    data = make_conversations_jsonl(tmp_path / "chats.jsonl", n=24)
    store = build_store(tmp_path / "store", target, data)  # runs dflash.precompute.run.run_precompute
"""

from __future__ import annotations

import json
import random
from pathlib import Path

SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<think>",
    "</think>",
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
]

# The structure of Qwen3's template (tools left out): system first, <think> blocks are stripped from
# assistant turns before the last user query and forced (possibly empty) on the turns after it.
QWEN3_TEMPLATE = (
    "{%- if messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- set ns = namespace(found=false, last_query_index=messages|length - 1) %}"
    "{%- for message in messages[::-1] %}"
    "{%- set index = (messages|length - 1) - loop.index0 %}"
    "{%- if not ns.found and message.role == 'user' %}"
    "{%- set ns.found = true %}{%- set ns.last_query_index = index %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- for message in messages %}"
    "{%- set content = message.content if message.content is string else '' %}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{%- set reasoning_content = '' %}"
    "{%- if '</think>' in content %}"
    "{%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}"
    "{%- endif %}"
    "{%- if loop.index0 > ns.last_query_index and (loop.last or reasoning_content) %}"
    "{{- '<|im_start|>assistant\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}"
    "{%- else %}"
    "{{- '<|im_start|>assistant\\n' + content }}"
    "{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)

# The structure of Llama 3's template: BOS, a default system header, trimmed contents, <|eot_id|>.
LLAMA3_TEMPLATE = (
    "{{- bos_token }}"
    "{%- if messages[0].role == 'system' %}"
    "{%- set system_message = messages[0].content | trim %}{%- set messages = messages[1:] %}"
    "{%- else %}{%- set system_message = '' %}{%- endif %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}"
    "{{- 'Cutting Knowledge Date: December 2023\\n\\n' + system_message + '<|eot_id|>' }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message.role + '<|end_header_id|>\\n\\n' + message.content | trim + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)

_WORDS = (
    "the a of to and in is it that for on with as was at by this be from or have an are not but what all "
    "were when we there can more if no out so said up its about into than them only other new some could "
    "time these two may then do first any my now such like our over man me even most made after also did "
    "many before must through back years where much your way well down should because each just those "
    "people how too little state good very make world still own see men work long get here between both "
    "life being under never day same another know while last might us great old year off come since against"
).split()

_CORPUS = [" ".join(_WORDS[i : i + 12]) for i in range(0, len(_WORDS), 5)] + ["0123456789 ,.?!:;'\"()[]{}"]


def make_tokenizer(arch: str = "qwen3"):
    """A byte-level BPE tokenizer (a few hundred merges) with the arch's special tokens and chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    if arch == "qwen3":
        kw = dict(eos_token="<|im_end|>", pad_token="<|endoftext|>", chat_template=QWEN3_TEMPLATE)
    elif arch == "llama":
        kw = dict(
            bos_token="<|begin_of_text|>",
            eos_token="<|eot_id|>",
            pad_token="<|end_of_text|>",
            chat_template=LLAMA3_TEMPLATE,
        )
    else:
        raise ValueError(f"unknown arch {arch!r}")
    return PreTrainedTokenizerFast(tokenizer_object=tok, **kw)


def make_tiny_target(
    tmp_path,
    arch: str = "qwen3",
    hidden_size: int = 64,
    num_layers: int = 4,
    seed: int = 0,
    tie_word_embeddings: bool = False,
    chat_template: bool = True,
    name: str | None = None,
    spare_ids: int = 8,
) -> Path:
    """Save a random-init Qwen3 or Llama causal LM plus its tokenizer in `tmp_path/name`; return the dir.

    The vocabulary is the tokenizer's plus `spare_ids` unused ids (a drafter's mask token can take one).
    """
    import torch
    import transformers

    out = Path(tmp_path) / (name or f"target-{arch}")
    tok = make_tokenizer(arch)
    vocab = len(tok) + spare_ids
    heads = max(2, hidden_size // 16)
    common = dict(
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2),
        head_dim=hidden_size // heads,
        intermediate_size=2 * hidden_size,
        vocab_size=vocab,
        max_position_embeddings=4096,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    if arch == "qwen3":
        config = transformers.Qwen3Config(**common)
        cls = transformers.Qwen3ForCausalLM
    elif arch == "llama":
        config = transformers.LlamaConfig(**common)
        cls = transformers.LlamaForCausalLM
    else:
        raise ValueError(f"unknown arch {arch!r}")
    torch.manual_seed(seed)
    model = cls(config).eval()
    model.save_pretrained(out)
    if not chat_template:
        tok.chat_template = None
    tok.save_pretrained(out)
    if not chat_template:
        for f in ("chat_template.jinja", "chat_template.json"):
            (out / f).unlink(missing_ok=True)
    return out


def make_conversations(n: int, seed: int = 0, fmt: str = "messages", min_words: int = 3, max_words: int = 30):
    """`n` rows of random-word conversations: some with a system prompt, some multi-turn.

    fmt: "messages" ({role, content}), "sharegpt" ({from, value} under `conversations`) or "prompt"
    (prompt/response columns).
    """
    rng = random.Random(seed)

    def text():
        return " ".join(rng.choice(_WORDS) for _ in range(rng.randint(min_words, max_words)))

    rows = []
    for i in range(n):
        msgs = []
        if fmt != "prompt" and i % 3 == 0:
            msgs.append({"role": "system", "content": "You are a helpful assistant. " + text()})
        for _ in range(1 if fmt == "prompt" else 1 + (i % 2)):
            msgs.append({"role": "user", "content": text()})
            msgs.append({"role": "assistant", "content": text()})
        if fmt == "messages":
            rows.append({"messages": msgs})
        elif fmt == "sharegpt":
            names = {"system": "system", "user": "human", "assistant": "gpt"}
            rows.append({"conversations": [{"from": names[m["role"]], "value": m["content"]} for m in msgs]})
        elif fmt == "prompt":
            rows.append({"prompt": msgs[0]["content"], "response": msgs[1]["content"]})
        else:
            raise ValueError(f"unknown fmt {fmt!r}")
    return rows


def make_conversations_jsonl(path, n: int, seed: int = 0, fmt: str = "messages", **kw) -> Path:
    """Write `make_conversations(n, ...)` as JSON lines to `path`; return the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for row in make_conversations(n, seed=seed, fmt=fmt, **kw):
            f.write(json.dumps(row) + "\n")
    return path


def build_store(out, target, data, **overrides) -> Path:
    """Run `dflash precompute` in-process on CPU (fp32 compute) and return the store path.

    Defaults: one shard, layers [1, 2], top-4, max_length 256; `overrides` are PrecomputeConfig fields.
    A store that is only another stage's input takes writer="thread": the same bytes as the default writer
    process (tests/precompute/test_precompute_pipeline.py), without starting that process (it imports torch
    and zarr).
    """
    from dflash.config import PrecomputeConfig
    from dflash.precompute.run import run_precompute

    kw = dict(target=str(target), data=str(data), out=str(out), shards=1, gpus="cpu", max_length=256, topk=4)
    kw["target_layers"] = [1, 2]  # fits the 4-layer default of make_tiny_target
    kw.update(overrides)
    run_precompute(PrecomputeConfig(**kw))
    return Path(out)

def random_run(target_dir, tmp_path):
    """A run directory holding one checkpoint of a random 1-layer drafter (block 4) for `target_dir`."""
    import torch

    from dflash.drafter import DFlashDrafter, DrafterConfig
    from dflash.target_model.files import target_config
    from dflash.train.checkpoint import save_checkpoint

    tc = target_config(target_dir)
    cfg = DrafterConfig.from_target(tc, num_layers=1, block_size=4, target_layer_ids=[1, 3],
                                    mask_token_id=tc.vocab_size - 1)
    torch.manual_seed(0)
    run = tmp_path / "run"
    save_checkpoint(run, 1, DFlashDrafter(cfg).state_dict(), cfg.to_hf_dict(), {"step": 1},
                    {"train": {"target": str(target_dir)}})
    return run



def differing_files(a, b) -> list[str]:
    """The files (paths relative to `a` and `b`) whose bytes differ between two directory trees, or that
    only one of them has: [] when the trees are byte for byte the same."""
    a, b = Path(a), Path(b)
    names = {str(p.relative_to(root)) for root in (a, b) for p in root.rglob("*") if p.is_file()}
    return sorted(n for n in names if not ((a / n).is_file() and (b / n).is_file()
                                            and (a / n).read_bytes() == (b / n).read_bytes()))
