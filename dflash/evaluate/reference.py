"""The target-only greedy outputs of an online eval, kept in a JSON file so that evaluating many
checkpoints on the same prompts decodes the target alone once (`dflash eval --reference FILE`).

The file is reused only when its key matches: the target's identity (config hash and weights
fingerprint), the prompts' token ids (for --bench, in a file of its own beside it, the questions),
`max_new_tokens`, the dtype and the device kind (greedy outputs
in fp32 on CUDA and on the CPU may part at near-ties). Anything else rewrites it. JSON only: the file
may come from another machine.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from dflash.durable import atomic_write_bytes
from dflash.evaluate.speculative import Generation

VERSION = 1


def bench_path(path) -> Path:
    """The file beside --reference FILE that keeps the --bench prompt sets' target-only outputs."""
    p = Path(path)
    return p.with_name(f"{p.stem}.bench{p.suffix}")


class ReferenceFile:
    """`prompts`: the token ids of each prompt, one generation each; or, for the --bench sets (whose later
    turns are asked after the target's own earlier answers), each question's set, id and turns with
    `one_per_prompt` False: the generations are then the sets' decoded turns, in the order decoded."""

    def __init__(self, path, identity: dict, prompts: list, max_new_tokens: int, dtype: str,
                 device_kind: str, one_per_prompt: bool = True):
        self.path = Path(path)
        ids = hashlib.sha256(json.dumps(prompts).encode()).hexdigest()
        self.key = {"version": VERSION, "config_hash": identity.get("config_hash"),
                    "weights_fingerprint": identity.get("weights_fingerprint"), "prompts_sha256": ids,
                    "num_prompts": len(prompts) if one_per_prompt else None, "max_new_tokens": max_new_tokens,
                    "dtype": dtype, "device": device_kind}

    def load(self) -> list[Generation] | None:
        """The stored generations, or None when the file is absent, unreadable or made from other inputs."""
        try:
            d = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return None
        if not isinstance(d, dict) or d.get("key") != self.key:
            return None
        gens = d.get("generations")
        if not isinstance(gens, list) or (self.key["num_prompts"] is not None and len(gens) != self.key["num_prompts"]):
            return None
        return [Generation(tokens=[int(t) for t in g["tokens"]],
                           seconds=None if g["seconds"] is None else float(g["seconds"])) for g in gens]

    def save(self, gens: list[Generation]) -> None:
        """Atomically (a reader never sees half a file; concurrent writers of the same key agree)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        body = {"key": self.key, "generations": [{"tokens": g.tokens, "seconds": g.seconds} for g in gens]}
        atomic_write_bytes(self.path, json.dumps(body).encode(), durable=False)
