"""Tiny random-init checkpoints of every target family dflash supports, built with save_pretrained.

    d = make_family_target(tmp_path, "qwen3_5_vl")   # a Qwen3.5 vision-language wrapper, 4 layers

Families (FAMILIES): llama, qwen2, qwen3, qwen3_moe, gpt_oss (sliding + full attention, MoE), qwen3_next
(linear + full attention, MoE), qwen3_5_vl and qwen3_5_moe_vl (Qwen3_5[Moe]ForConditionalGeneration:
a tiny vision tower, the language model's weights under `model.language_model.*`, linear + full
attention).  Hybrids mix `linear_attention` and `full_attention` layers.  Each is a few hundred KB and
runs a forward on one CPU core in milliseconds.  Nothing is downloaded.
"""

from __future__ import annotations

from pathlib import Path

from helpers import make_tokenizer

FAMILIES = ("llama", "qwen2", "qwen3", "qwen3_moe", "gpt_oss", "qwen3_next", "qwen3_5_vl", "qwen3_5_moe_vl")
HYBRID = ("qwen3_next", "qwen3_5_vl", "qwen3_5_moe_vl")  # linear-attention (recurrent + conv state) layers


def family_config(family: str, tok, hidden_size: int = 64, num_layers: int = 4, tie_word_embeddings: bool = False,
                  sliding_window: int = 8, spare_ids: int = 8):
    """(config, model class) of a tiny random-init `family` model for tokenizer `tok`."""
    import transformers as tf

    vocab = len(tok) + spare_ids
    heads = 4
    special = dict(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    common = dict(
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=2,
        head_dim=hidden_size // heads,
        intermediate_size=2 * hidden_size,
        vocab_size=vocab,
        max_position_embeddings=4096,
        tie_word_embeddings=tie_word_embeddings,
        **special,
    )
    moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
    # linear, linear, linear, full, ...: the 3:1 pattern of Qwen3-Next / Qwen3.5 (at least one of each)
    mixed = ["full_attention" if i % 4 == 3 or i == num_layers - 1 else "linear_attention" for i in range(num_layers)]
    linear = dict(layer_types=mixed, linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16,
                  linear_num_key_heads=2, linear_num_value_heads=4)
    if family == "llama":
        return tf.LlamaConfig(**common), tf.LlamaForCausalLM
    if family == "qwen2":  # Qwen2.5 (examples/qwen2.5-coder-0.5b): biased q/k/v, its sliding window off
        return tf.Qwen2Config(**common, use_sliding_window=False), tf.Qwen2ForCausalLM
    if family == "qwen3":
        return tf.Qwen3Config(**common), tf.Qwen3ForCausalLM
    if family == "qwen3_moe":
        return tf.Qwen3MoeConfig(**common, **moe), tf.Qwen3MoeForCausalLM
    if family == "gpt_oss":
        common.pop("intermediate_size")
        types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)]
        cfg = tf.GptOssConfig(**common, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2,
                              sliding_window=sliding_window, layer_types=types)
        return cfg, tf.GptOssForCausalLM
    if family == "qwen3_next":
        cfg = tf.Qwen3NextConfig(**common, **moe, **linear, shared_expert_intermediate_size=32)
        return cfg, tf.Qwen3NextForCausalLM
    if family in ("qwen3_5_vl", "qwen3_5_moe_vl"):
        tie = common.pop("tie_word_embeddings")
        vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=4,
                      spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=hidden_size,
                      num_position_embeddings=16)
        if family == "qwen3_5_vl":
            text = tf.Qwen3_5TextConfig(**common, **linear, tie_word_embeddings=tie)
            cfg = tf.Qwen3_5Config(text_config=text.to_dict(), vision_config=vision, tie_word_embeddings=tie,
                                   image_token_id=vocab - 1, video_token_id=vocab - 2,
                                   vision_start_token_id=vocab - 3, vision_end_token_id=vocab - 4)
            return cfg, tf.Qwen3_5ForConditionalGeneration
        common.pop("intermediate_size")
        text = tf.Qwen3_5MoeTextConfig(**common, **moe, **linear, shared_expert_intermediate_size=32,
                                       tie_word_embeddings=tie)
        cfg = tf.Qwen3_5MoeConfig(text_config=text.to_dict(), vision_config=vision, tie_word_embeddings=tie,
                                  image_token_id=vocab - 1, video_token_id=vocab - 2,
                                  vision_start_token_id=vocab - 3, vision_end_token_id=vocab - 4)
        return cfg, tf.Qwen3_5MoeForConditionalGeneration
    raise ValueError(f"unknown family {family!r}; one of {', '.join(FAMILIES)}")


def make_family_target(tmp_path, family: str, hidden_size: int = 64, num_layers: int = 4, seed: int = 0,
                       tie_word_embeddings: bool = False, name: str | None = None, **kw) -> Path:
    """Save a random-init tiny `family` checkpoint plus a Qwen3-style chat tokenizer; return its directory.

    The vocabulary is the tokenizer's plus 8 unused ids (the VL wrappers' image/video ids take the last
    four, a drafter's mask token can take len(tokenizer))."""
    import torch

    out = Path(tmp_path) / (name or f"target-{family}{'-tied' if tie_word_embeddings else ''}")
    tok = make_tokenizer("llama" if family == "llama" else "qwen3")
    config, cls = family_config(family, tok, hidden_size, num_layers, tie_word_embeddings, **kw)
    torch.manual_seed(seed)
    model = cls(config).eval()
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out
