"""End to end training on CPU: real store, real gloo processes, real kills and resumes."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dflash.config import TrainConfig
from dflash.errors import ConfigError, StoreError
from dflash.train.launch import launch_train
from helpers import differing_files
from processes import invoke

pytestmark = pytest.mark.slow

DFLASH = [sys.executable, "-m", "dflash.cli"]

# Imported by every Python process of the run (launcher, training processes, the forkservers that
# fork the DataLoader workers): create_block_mask raises, and each patched process leaves its pid.
SITECUSTOMIZE = """
import os
import torch.nn.attention.flex_attention as fa

def create_block_mask(*args, **kwargs):
    raise RuntimeError("create_block_mask called in a training process")

fa.create_block_mask = create_block_mask
with open(os.environ["PATCHED_PIDS"], "a") as f:
    f.write(f"{os.getpid()}\\n")
"""


@pytest.fixture(scope="module")
def counting(counting_store):
    return counting_store


def _cfg(target, store, out, **kw):
    base = dict(store=str(store), target=str(target), out=str(out), gpus="cpu:1", block_size=8, num_layers=1,
                steps=6, lr=3e-3, warmup_steps=2, token_budget=256, num_anchors=8, num_workers=1,
                compile="off", seed=0, save_every=0)
    base.update(kw)
    return TrainConfig(**base)


def _args(cfg: TrainConfig, where: Path) -> list[str]:
    """`dflash train --config params.yaml` holding exactly `cfg` (so in-process and CLI runs agree)."""
    import yaml

    from dflash.config import to_dict

    where.mkdir(parents=True, exist_ok=True)
    params = where / "params.yaml"
    params.write_text(yaml.safe_dump({"train": to_dict(cfg)}))
    return ["train", "--config", str(params)]


def _env(extra_path: Path | None = None) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    paths = [str(Path(__file__).resolve().parents[2])] + ([str(extra_path)] if extra_path else [])
    env["PYTHONPATH"] = os.pathsep.join(paths + [env.get("PYTHONPATH", "")])
    return env


def _metrics(run) -> list[dict]:
    return [json.loads(x) for x in (Path(run) / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def two_process_run(counting, tmp_path_factory):
    """`dflash train --gpus cpu:2` with create_block_mask patched to raise in every process."""
    target, store = counting
    tmp = tmp_path_factory.mktemp("ddp")
    site = tmp / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    cfg = _cfg(target, store, tmp / "run", gpus="cpu:2", steps=4, save_every=2)
    env = dict(_env(site), PATCHED_PIDS=str(tmp / "patched_pids"))
    p = subprocess.run(DFLASH + _args(cfg, tmp / "cwd"), env=env, cwd=tmp / "cwd", capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    return cfg, len(set((tmp / "patched_pids").read_text().split()))


def test_two_processes_without_create_block_mask(two_process_run):
    cfg, patched = two_process_run
    assert patched >= 5  # launcher, 2 training processes, their 2 worker forkservers
    run = Path(cfg.out)
    recs = _metrics(run)
    assert [r["step"] for r in recs] == [1, 2, 3, 4]
    for key in ("loss", "ce", "kd", "acc", "tau", "lr", "grad_norm", "ctx_tokens_per_s", "block_tokens_per_s",
                "data_wait_frac", "gc_frac", "peak_mem_gb", "recompiles"):
        assert key in recs[0], key
    assert len(recs[0]["acc"]) == cfg.block_size - 1 and 1 <= recs[-1]["tau"] <= cfg.block_size
    for r in recs[1:]:  # the host's step by phase: parts of the step's host interval
        fracs = [r[f"host_{k}_frac"] for k in ("fwd", "loss", "bwd", "opt", "sync")]
        assert all(f >= 0 for f in fracs) and sum(fracs) <= 1.0 + 1e-6, fracs
        assert r["host_fwd_frac"] > 0 and r["host_loss_frac"] > 0 and r["host_bwd_frac"] > 0
    final = json.loads((run / "metrics.json").read_text())
    assert final["steps"] == 4 and final["tokens_per_s"] > 0 and "loss" in final and "tau" in final
    curves = (run / "curves.csv").read_text().splitlines()  # what dvc plots reads
    assert curves[0] == "step,loss,tau,lr" and [int(c.split(",")[0]) for c in curves[1:]] == [1, 2, 3, 4]
    assert float(curves[1].split(",")[1]) == pytest.approx(recs[0]["loss"], rel=1e-5)
    conf = json.loads((run / "config.json").read_text())
    assert conf["world_size"] == 2 and conf["drafter"]["dflash_config"]["block_size"] == 8
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = EventAccumulator(str(run / "tb"))
    tb.Reload()
    tags = set(tb.Tags()["scalars"])  # every numeric field of a record, one point a step, as metrics.jsonl has it
    assert {"train/loss", "train/tau", "train/lr", "train/grad_norm", "acc/pos01"} <= tags
    assert [(e.step, e.value) for e in tb.Scalars("train/loss")] == [(r["step"], pytest.approx(r["loss"])) for r in recs]
    assert [e.value for e in tb.Scalars("acc/pos01")] == [pytest.approx(r["acc"][0]) for r in recs]
    ckpts = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert ckpts == ["step-00000002", "step-00000004"]
    # the drafter only, with Qwen3 names: no target embedding or lm_head
    keys = set(load_file(str(run / "checkpoints/step-00000004/model.safetensors")))
    assert "fc.weight" in keys and "layers.0.self_attn.q_proj.weight" in keys
    assert not any("embed" in k or "lm_head" in k for k in keys)


def test_two_processes_equal_one_with_accumulation(two_process_run, counting, tmp_path):
    """W=2 x A=1 and W=1 x A=2 consume the same micro-batches: same losses, same weights (the one-process
    run without batch slots, so that the two ways of handing over context features are compared too)."""
    cfg2, _ = two_process_run
    target, store = counting
    cfg1 = _cfg(target, store, tmp_path / "one", steps=4, grad_accum=2, batch_slots=False)
    launch_train(cfg1)
    a, b = _metrics(cfg2.out), _metrics(cfg1.out)
    for x, y in zip(a, b):
        assert x["samples"] == y["samples"]
        assert x["loss"] == pytest.approx(y["loss"], rel=1e-5)
        assert x["tau"] == pytest.approx(y["tau"], rel=1e-6)
    w2 = load_file(str(Path(cfg2.out) / "checkpoints/step-00000004/model.safetensors"))
    w1 = load_file(str(Path(cfg1.out) / "checkpoints/step-00000004/model.safetensors"))
    for k in w1:
        assert torch.allclose(w1[k], w2[k], atol=1e-5, rtol=1e-4), k


def test_resume_two_process_run_on_one_process(two_process_run, counting, tmp_path):
    """Without accumulation here, a fresh run would plan its epochs for steps of 1 micro-batch; the resumed
    run keeps the checkpoint's plan (balanced for steps of 2), in which its data position lies."""
    import shutil

    cfg2, _ = two_process_run
    run = tmp_path / "run"
    shutil.copytree(cfg2.out, run)
    target, store = counting
    cfg = _cfg(target, store, run, steps=6, resume=True)
    launch_train(cfg)
    recs = _metrics(run)
    assert [r["step"] for r in recs] == [1, 2, 3, 4, 5, 6]
    state = torch.load(run / "checkpoints/step-00000006/train_state.pt", weights_only=True)
    assert state["world_size"] == 1 and state["step"] == 6
    # the position moved on by exactly the samples of steps 5 and 6
    before = torch.load(Path(cfg2.out) / "checkpoints/step-00000004/train_state.pt", weights_only=True)
    moved = state["data"]["samples_consumed"] - before["data"]["samples_consumed"]
    assert before["data"]["balance_group"] == 2 and state["data"]["balance_group"] == 2
    assert state["data"]["epoch"] != before["data"]["epoch"] or moved == recs[4]["samples"] + recs[5]["samples"]


def test_loss_falls_and_tau_rises(counting, tmp_path):
    target, store = counting
    cfg = _cfg(target, store, tmp_path / "run", steps=40, lr=1e-2, warmup_steps=2, token_budget=512, num_anchors=16,
               eval_every=20, eval_store=str(store))
    final = launch_train(cfg)
    recs = _metrics(cfg.out)
    first = recs[:5]
    last = recs[-5:]
    mean = lambda rs, k: sum(r[k] for r in rs) / len(rs)  # noqa: E731
    assert mean(last, "loss") < mean(first, "loss") - 0.5
    assert mean(last, "tau") > mean(first, "tau") + 0.05
    assert final["steps"] == 40 and final["tau"] == recs[-1]["tau"]
    # offline tau on the held-out store at steps 20 and 40 (here the training store itself)
    assert "eval_tau" not in recs[0] and recs[39]["eval_tau"] > recs[19]["eval_tau"] >= 1.0


def test_profile_of_chosen_steps(counting, tmp_path):
    """--profile-start 5 --profile-steps 3 in a 6-step run profiles only step 6 (the run ends inside the
    window, which still writes the outputs): an operator table and a Chrome trace holding exactly one
    optimizer step."""
    target, store = counting
    cfg = _cfg(target, store, tmp_path / "run", profile_steps=3, profile_start=5)
    launch_train(cfg)
    table = (tmp_path / "run" / "profile" / "rank0.txt").read_text()
    assert "aten::mm" in table and "Self CPU" in table
    trace = json.loads((tmp_path / "run" / "profile" / "rank0.trace.json").read_text())
    names = [e.get("name", "") for e in trace["traceEvents"]]
    assert sum(n.startswith("Optimizer.step#AdamW.step") for n in names) == 1
    assert len(_metrics(cfg.out)) == 6  # profiling does not change the run


def test_kill_and_resume_is_exact(counting, tmp_path):
    target, store = counting
    cwd = tmp_path / "cwd"
    ref = _cfg(target, store, tmp_path / "ref", steps=16, save_every=4)
    launch_train(ref)
    expected = [(r["step"], r["loss"], r["tau"]) for r in _metrics(ref.out)]

    cfg = _cfg(target, store, tmp_path / "killed", steps=16, save_every=4)
    proc = subprocess.Popen(DFLASH + _args(cfg, cwd), env=_env(), cwd=cwd, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, start_new_session=True)
    metrics = Path(cfg.out) / "metrics.jsonl"
    deadline = time.time() + 240
    killed_at = None
    while time.time() < deadline and proc.poll() is None:
        if (Path(cfg.out) / "checkpoints/step-00000004").is_dir() and metrics.is_file():
            lines = metrics.read_text().splitlines()
            if len(lines) >= 6:
                killed_at = len(lines)
                os.killpg(proc.pid, signal.SIGKILL)  # the run and its DataLoader workers, mid-step
                break
        time.sleep(0.01)
    proc.wait(timeout=60)
    assert killed_at is not None, "the run finished before it could be killed: " + proc.stderr.read().decode()[-2000:]
    assert killed_at < 16

    resume = _cfg(target, store, cfg.out, steps=16, save_every=4, resume=True)
    rc, _, err = invoke(_args(resume, cwd), command=None, cwd=cwd)  # the resuming run in process
    assert rc == 0, err[-3000:]
    got = [(r["step"], r["loss"], r["tau"]) for r in _metrics(cfg.out)]
    assert [g[0] for g in got] == list(range(1, 17))
    for (s, l1, t1), (_, l2, t2) in zip(expected, got):
        assert l1 == pytest.approx(l2, rel=1e-6, abs=1e-7), f"step {s}"
        assert t1 == pytest.approx(t2, rel=1e-9), f"step {s}"


def test_the_same_run_twice_writes_the_same_bytes(counting, tmp_path, monkeypatch):
    """A CPU run is a function of its inputs: the same command in two directories (two clones of a DVC
    project) writes byte-identical checkpoints, safetensors headers included, and curves.csv, and leaves
    deterministic kernels as it found them; metrics.json differs only in tokens/s, which is why dvc.yaml
    hashes neither it nor the TensorBoard events."""
    target, store = counting
    for clone in ("a", "b"):
        (tmp_path / clone).mkdir()
        monkeypatch.chdir(tmp_path / clone)
        launch_train(_cfg(target, store, "run", steps=4, save_every=2))
        assert not torch.are_deterministic_algorithms_enabled()
    a, b = tmp_path / "a" / "run", tmp_path / "b" / "run"
    assert len(list(a.glob("checkpoints/*/model.safetensors"))) == 2
    assert differing_files(a / "checkpoints", b / "checkpoints") == []
    assert (a / "curves.csv").read_bytes() == (b / "curves.csv").read_bytes()
    ma, mb = (json.loads((r / "metrics.json").read_text()) for r in (a, b))
    assert ma.pop("tokens_per_s") > 0 and mb.pop("tokens_per_s") > 0 and ma == mb and ma["steps"] == 4


def test_mismatched_store_is_refused(counting, tmp_path):
    from helpers import make_tiny_target

    _, store = counting
    other = make_tiny_target(tmp_path, hidden_size=32, name="other")
    with pytest.raises(StoreError, match="hidden size"):
        launch_train(_cfg(other, store, tmp_path / "run"))
    target, _ = counting
    with pytest.raises(StoreError, match="target_layer_ids"):
        launch_train(_cfg(target, store, tmp_path / "run", target_layers=[0, 3]))
    # the store's target was taught to count after it was made: the untaught checkpoint has its config
    # and tokenizer but other weights, so its hidden states are not the store's
    untaught = make_tiny_target(tmp_path, name="untaught")
    with pytest.raises(StoreError, match="weights fingerprint"):
        launch_train(_cfg(untaught, store, tmp_path / "run"))
    assert not (tmp_path / "run").exists()  # nothing written


def test_user_errors(counting, tmp_path):
    target, store = counting
    run = tmp_path / "run"
    run.mkdir()
    (run / "something").write_text("x")
    with pytest.raises(ConfigError, match="--resume"):
        launch_train(_cfg(target, store, run))
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="cpu:N"):
            launch_train(_cfg(target, store, tmp_path / "gpu", gpus="0,1"))


def test_mask_token_choice(counting):
    from transformers import AutoTokenizer

    from dflash.store import open_store
    from dflash.train.preflight import resolve_mask_token

    target, store = counting
    s = open_store(store)
    n = len(AutoTokenizer.from_pretrained(target))
    assert resolve_mask_token(None, str(target), n + 8, s) == (n, "first unused embedding row")
    assert resolve_mask_token(5, str(target), n + 8, s) == (5, "configured")
    with pytest.raises(ConfigError, match="outside"):
        resolve_mask_token(n + 8, str(target), n + 8, s)
    # no padding row, no mask or reserved token: a special token neither the Qwen3-style template (it writes
    # <|im_start|>, <|im_end|>, <think>) nor the store uses, never an in-use word (tests/train/test_mask_token.py)
    tok = AutoTokenizer.from_pretrained(target)
    assert resolve_mask_token(None, str(target), n, s) == (
        tok.convert_tokens_to_ids("<|begin_of_text|>"),
        "added special token unused by the chat template '<|begin_of_text|>', absent from the store")


def test_mask_token_reserved_and_unused(counting, tmp_path):
    """A tokenizer with <|mask|> and reserved tokens but no spare row: the first one the store never uses."""
    from transformers import AutoTokenizer

    from dflash.store import open_store
    from dflash.train.preflight import resolve_mask_token

    target, store = counting
    tok = AutoTokenizer.from_pretrained(target)
    tok.add_special_tokens({"additional_special_tokens": ["<|reserved_0|>", "<|mask|>"]})
    tdir = tmp_path / "tok"
    tok.save_pretrained(tdir)
    n = len(tok)
    s = open_store(store)
    used = {int(x) for sid in s.sample_ids() for x in s.read(sid, fields=["input_ids"])["input_ids"]}
    mask_id, reserved_id = tok.convert_tokens_to_ids("<|mask|>"), tok.convert_tokens_to_ids("<|reserved_0|>")
    assert mask_id not in used and reserved_id not in used
    assert resolve_mask_token(None, str(tdir), n, s)[0] == mask_id  # the dedicated mask token first
    # a "reserved" token that does occur in the store is never chosen
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert im_end in used
    tok2 = AutoTokenizer.from_pretrained(target)
    tok2.add_special_tokens({"additional_special_tokens": ["<|reserved_9|>"]})
    tdir2 = tmp_path / "tok2"
    tok2.save_pretrained(tdir2)
    assert resolve_mask_token(None, str(tdir2), len(tok2), s)[0] == tok2.convert_tokens_to_ids("<|reserved_9|>")


def test_checkpoints_are_atomic_and_pruned(tmp_path):
    from dflash.train import checkpoint as ckpt

    state = {"w": torch.arange(4.0)}
    for step in (1, 2, 3):
        ckpt.save_checkpoint(tmp_path, step, state, {"block_size": 8}, {"step": step, "rng": {"cpu": torch.get_rng_state()}},
                             {"train": {}}, keep=2)
    # a write interrupted by a crash leaves only a temporary directory, which is never a checkpoint
    (tmp_path / "checkpoints" / ".tmp-step-00000004-123").mkdir()
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == ["step-00000002", "step-00000003"]
    assert ckpt.resolve_checkpoint(tmp_path).name == "step-00000003"
    model, drafter_cfg, train_state, _ = ckpt.load_checkpoint(ckpt.latest_checkpoint(tmp_path))
    assert torch.equal(model["w"], state["w"]) and train_state["step"] == 3 and drafter_cfg == {"block_size": 8}
    ckpt.clean_partial(tmp_path)
    assert not list((tmp_path / "checkpoints").glob(".tmp-*"))


def test_step_rates_use_the_device_timeline_when_known():
    """On a GPU, tokens/s come from the device's step interval (CUDA events), data wait from the host's."""
    from dflash.train.metrics import step_record
    from dflash.train.step import StepStats
    from dflash.train.tracker import PendingStep

    cfg = TrainConfig(block_size=4)
    vec = [8.0, 0.0, 4.0, 6.0, 3.0, 1000.0, 200.0, 5.0, 1.0, 0.0, 0.0] + [0.0, 1.0, 1.0, 0.0] + [0.0, 2.0, 2.0, 1.0] + [0.5]
    stats = StepStats.from_vector(vec, 4)
    assert stats.samples == 5.0 and stats.damaged == 1.0 and stats.valid == [0.0, 2.0, 2.0, 1.0]
    assert stats.grad_norm == 0.5
    p = PendingStep(stats=None, event=None, step=7, epoch=0, epoch_samples=40, lr=1e-3, dt=0.5, data_wait=0.05,
                    gc=0.0, recompiles=0, host={"bwd": 0.2, "sync": 0.1})
    host = step_record(p, stats, None, cfg, torch.device("cpu"), 1)
    assert host["ctx_tokens_per_s"] == 2000.0 and host["data_wait_frac"] == pytest.approx(0.1)
    assert host["host_bwd_frac"] == pytest.approx(0.4) and host["host_sync_frac"] == pytest.approx(0.2)
    dev = step_record(p, stats, 0.25, cfg, torch.device("cpu"), 1)
    assert dev["ctx_tokens_per_s"] == 4000.0 and dev["block_tokens_per_s"] == 800.0
    assert dev["data_wait_frac"] == pytest.approx(0.1)  # host wait over host interval
    assert dev["loss"] == host["loss"] == 2.0 and dev["acc"] == [0.5, 0.5, 0.0]


def test_truncate_metrics(tmp_path):
    from dflash.train.preflight import truncate_metrics

    f = tmp_path / "metrics.jsonl"
    f.write_text("".join(json.dumps({"step": i, "loss": 1.0}) + "\n" for i in range(1, 6)) + '{"step": 6, "lo')
    kept = truncate_metrics(f, 3)
    assert [r["step"] for r in kept] == [1, 2, 3] and len(f.read_text().splitlines()) == 3


@pytest.mark.slow
def test_fsdp2_matches_ddp(two_process_run, counting, tmp_path):
    """`--parallel fsdp` (FSDP2 fully_shard over gloo) trains the same as DDP, step for step."""
    target, store = counting
    ddp_cfg, _ = two_process_run
    cfg = _cfg(target, store, tmp_path / "run", gpus="cpu:2", steps=4, save_every=2, parallel="fsdp")
    launch_train(cfg)  # launched from this process: its two training processes are spawned as from the CLI
    fsdp = [r["loss"] for r in _metrics(cfg.out)]
    ddp = [r["loss"] for r in _metrics(ddp_cfg.out)]
    assert len(fsdp) == 4 and fsdp == pytest.approx(ddp, rel=1e-4)


@pytest.mark.parametrize("overlap", [True, False])
def test_compiled_ddp_matches_eager(two_process_run, counting, tmp_path, overlap):
    """With compile on, two processes compile the DDP wrapper (graph split at gradient buckets so the
    all-reduce overlaps the backward) or, without overlap, the drafter itself (all-reduce after the
    backward); either run must match the eager two-process run."""
    cfg2, _ = two_process_run
    target, store = counting
    cfg = _cfg(target, store, tmp_path / "compiled", gpus="cpu:2", steps=4, compile="on", ddp_overlap=overlap)
    launch_train(cfg)
    a, b = _metrics(cfg2.out), _metrics(cfg.out)
    assert len(b) == 4
    for x, y in zip(a, b):
        assert x["samples"] == y["samples"]
        assert x["loss"] == pytest.approx(y["loss"], rel=1e-4)
    assert [r["recompiles"] for r in b] == [0, 0, 0, 0]


def test_clipping_inside_fused_adamw_matches_clip_grad_norm():
    """step.clip hands the clipping factor to fused AdamW as grad_scale: the update must equal
    clip_grad_norm_ followed by a plain AdamW step, both when clipping bites and when it does not."""
    from dflash.train.step import clip as _clip

    for max_norm in (0.5, 1e6):
        torch.manual_seed(0)
        a = torch.nn.Linear(8, 4)
        b = torch.nn.Linear(8, 4)
        b.load_state_dict(a.state_dict())
        x = torch.randn(16, 8)
        for m in (a, b):
            (m(x) ** 2).sum().backward()
        cfg = _cfg("t", "s", "o", grad_clip=max_norm)
        opt_a = torch.optim.AdamW(a.parameters(), lr=0.1, fused=True)
        norm = _clip(a, opt_a, cfg, world=1)
        opt_a.step()
        ref_norm = torch.nn.utils.clip_grad_norm_(b.parameters(), max_norm)
        torch.optim.AdamW(b.parameters(), lr=0.1, foreach=False).step()
        assert torch.allclose(norm, ref_norm)
        for pa, pb in zip(a.parameters(), b.parameters()):
            # the fused kernel divides the gradients in place: they must be the clipped ones
            assert torch.allclose(pa.grad, pb.grad, rtol=1e-5, atol=1e-7), max_norm
            assert torch.allclose(pa, pb, atol=1e-6), max_norm
        if max_norm < 1:
            assert float(norm) > max_norm  # clipping did bite in this case


def test_banner_states_the_host_memory_of_batch_slots(counting, tmp_path, capsys):
    from dflash.store import open_store
    from dflash.train.loader import shape_set

    target, store = counting
    cfg = _cfg(target, store, tmp_path / "run", steps=1, num_workers=2, rows_per_batch=2)
    launch_train(cfg)
    s = open_store(store)
    one = cfg.rows_per_batch * shape_set(cfg.token_budget, cfg.num_shapes)[-1] * s.hidden_size * s.num_layers * 2
    err = capsys.readouterr().err
    n = 2 + 3 * 1 + 1  # workers + 3 steps of 1 micro-batch + 1
    assert f"{n * one / 1e9:.2f} GB of shared slots per process ({n} slots = 2 workers + 3 x 1 micro-batches per " \
           f"step + 1, x {one / 1e6:.1f} MB" in err, err[-2000:]
    # how often the data agrees with the target, and under --labels data a hint when under 90%
    from dflash.train.loader import target_agreement

    share, n = target_agreement(s)
    assert f"the data's supervised tokens equal the target's greedy token at {100 * share:.1f}% of {n:,} positions" in err
    assert ("--labels rollout trains on what the engine verifies" in err) == (share < 0.9)
