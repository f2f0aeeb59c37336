"""bench/run.py, the benchmarks' runner: one JSON-lines record per run in one schema; bench/real_study.py's
minutes, read from a run's metrics the way a study reads them; and bench/chain.py, an example's stages timed."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import real_study  # noqa: E402


def test_runner_records_the_command_the_commit_the_versions_and_the_results(tmp_path):
    trace = tmp_path / "trace.json"
    events = [{"ph": "X", "cat": "kernel", "name": "gemm", "ts": 0, "dur": 100, "pid": 0, "tid": 7},
              {"ph": "X", "cat": "kernel", "name": "late", "ts": 1100, "dur": 100, "pid": 0, "tid": 7}]
    trace.write_text(json.dumps({"traceEvents": events}))
    results = tmp_path / "r.jsonl"
    cmd = [sys.executable, str(ROOT / "bench" / "run.py"), "--results", str(results), "trace_gaps", "--", str(trace)]
    for _ in range(2):  # appends, never rewrites
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-2000:]
    records = [json.loads(line) for line in results.read_text().splitlines()]
    assert len(records) == 2
    r = records[0]
    assert set(r) >= {"bench", "command", "cwd", "date", "commit", "device", "versions", "returncode", "wall_s", "results"}
    assert r["bench"] == "trace_gaps" and r["returncode"] == 0
    assert r["command"][:2] == ["python", "bench/trace_gaps.py"] and r["command"][-1] == str(trace)
    assert r["versions"]["python"] == ".".join(map(str, sys.version_info[:3]))
    assert r["commit"] != "unknown" and r["date"].endswith("+00:00")
    device = r["results"]["stdout"][0]["devices"]["0"]  # trace_gaps' own summary of the trace above
    assert device["busy_ms"] == pytest.approx(0.2) and device["gaps_over_min"] == 1


def test_runner_refuses_an_unknown_or_library_name(tmp_path):
    for name in ("no_such_bench", "common"):
        done = subprocess.run([sys.executable, str(ROOT / "bench" / "run.py"), "--results", str(tmp_path / "r"), name],
                              cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert done.returncode != 0 and "no benchmark named" in done.stderr
        assert not (tmp_path / "r").exists()


def test_study_minutes_sum_step_times_and_share_wall_time_among_arms(tmp_path):
    rows = [{"step": 1, "ctx_tokens": 600, "ctx_tokens_per_s": 10.0},  # 60 s
            {"step": 2, "ctx_tokens": 300, "ctx_tokens_per_s": 10.0, "eval_walk_tau": 2.5, "eval_tau": 3.0},
            {"step": 3, "ctx_tokens": 1200, "ctx_tokens_per_s": 10.0, "eval_walk_tau": 2.75}]
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert real_study.curve(metrics) == [
        {"step": 2, "eval_walk_tau": 2.5, "eval_tau": 3.0, "minutes_alone": 1.5},
        {"step": 3, "eval_walk_tau": 2.75, "eval_tau": None, "minutes_alone": 3.5}]
    assert real_study.fair_share([(60.0, 2), (60.0, 1)]) == pytest.approx(1.5)
    assert real_study.parse_arm("DRK=--kd-weight 1 --seed 2") == ("DRK", ["--kd-weight", "1", "--seed", "2"])
    assert real_study.parse_arm("base=") == ("base", [])
    with pytest.raises(Exception, match="NAME=FLAGS"):
        real_study.parse_arm("--kd-weight 1")


def test_chain_runs_an_examples_stages_in_order_times_each_and_stops_at_a_failed_one(tmp_path):
    # a stage that ends as `dflash generate` does: a progress bar, then its summary line
    (tmp_path / "say.py").write_text("print('gen: 50%\\rgenerate: a.jsonl: 3 of 3 rows, 9 response tokens; in 1.0s "
                                     "(9 tokens/s)')\nprint('noise')\n")
    (tmp_path / "dvc.yaml").write_text(
        "stages:\n"
        "  first:\n    cmd: echo one >> order.txt && python say.py\n"
        "  skipped:\n    cmd: echo skipped >> order.txt\n"
        "  second:\n    cmd: python -c \"open('order.txt', 'a').write('two\\\\n')\"\n"
        "  broken:\n    cmd: exit 3\n"
        "  never:\n    cmd: echo never >> order.txt\n")
    out = tmp_path / "out"
    out.mkdir()
    cmd = [sys.executable, str(ROOT / "bench" / "chain.py"), "--skip", "skipped", "--logs", "logs"]
    done = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=60, env={**os.environ, "OUT": str(out)})
    assert done.returncode == 3 and "stage broken failed" in done.stderr
    assert (tmp_path / "order.txt").read_text().split() == ["one", "two"]
    stages = json.loads((out / "chain.json").read_text())["stages"]
    assert [s["stage"] for s in stages] == ["first", "second", "broken"]
    assert [s["returncode"] for s in stages] == [0, 0, 3] and all(s["seconds"] >= 0 for s in stages)
    assert stages[0]["summary"] == ["generate: a.jsonl: 3 of 3 rows, 9 response tokens; in 1.0s (9 tokens/s)"]
    assert stages[1]["summary"] == []
    printed = [json.loads(line)["stage"] for line in done.stdout.splitlines()]
    assert printed == ["first", "second", "broken"] and (tmp_path / "logs" / "second.log").is_file()
    until = subprocess.run([*cmd, "--until", "first"], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert until.returncode == 0 and [json.loads(line)["stage"] for line in until.stdout.splitlines()] == ["first"]


def test_overlap_times_two_commands_alone_then_together_clearing_their_outputs_before_each_run(tmp_path):
    # a stand-in for `dflash`: refuses an --out that exists (as generate and precompute refuse a finished
    # one), sleeps, writes its --out; exit 5 when asked to fail
    fake = tmp_path / "fake.py"
    fake.write_text(
        "import sys, time, pathlib\n"
        "a = sys.argv[1:]; out = pathlib.Path(a[a.index('--out') + 1])\n"
        "if out.exists(): sys.exit(4)\n"
        "time.sleep(float(a[a.index('--sleep') + 1])); out.write_text(a[0])\n"
        "sys.exit(5 if '--fail' in a else 0)\n")
    out = tmp_path / "out"
    out.mkdir()
    base = [sys.executable, str(ROOT / "bench" / "overlap.py"), "--dflash", f"{sys.executable} {fake}", "--logs", "logs"]
    cmd = base + ["--generate", f"--out {tmp_path / 'g.jsonl'} --sleep 1", "--precompute", f"--out {tmp_path / 'st'} --sleep 1"]
    done = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=60, env={**os.environ, "OUT": str(out)})
    assert done.returncode == 0, done.stderr
    rec = json.loads((out / "overlap.json").read_text())
    assert rec["generate_warmup"]["returncode"] == 0 and rec["precompute_warmup"]["returncode"] == 0
    assert rec["generate_alone"]["seconds"] >= 1 and rec["precompute_alone"]["seconds"] >= 1
    together = rec["together"]
    assert together["generate"]["returncode"] == together["precompute"]["returncode"] == 0
    assert 1 <= together["both"]["seconds"] < rec["generate_alone"]["seconds"] + rec["precompute_alone"]["seconds"]
    assert rec["together_over_sequence"] == pytest.approx(
        together["both"]["seconds"] / (rec["generate_alone"]["seconds"] + rec["precompute_alone"]["seconds"]), abs=1e-3)
    assert (tmp_path / "st").read_text() == "precompute" and (tmp_path / "logs" / "generate_together.log").is_file()
    failing = base + ["--no-warmup", "--generate", f"--out {tmp_path / 'g2'} --sleep 0 --fail",
                      "--precompute", f"--out {tmp_path / 'st2'} --sleep 0"]
    done = subprocess.run(failing, cwd=tmp_path, capture_output=True, text=True, timeout=60, env={**os.environ, "OUT": str(out)})
    rec = json.loads((out / "overlap.json").read_text())
    assert done.returncode == 1 and rec["generate_alone"]["returncode"] == 5 and "generate_warmup" not in rec
    assert rec["precompute_alone"]["returncode"] == 0


def test_timed_subsets_compares_the_spread_and_the_strata_pick_against_the_sets_tau(tmp_path, monkeypatch, capsys):
    import timed_subsets

    # 8 prompts in file order; tau ranked: prompt 1 (1.0) ... prompt 0 (8.0); 2 steps each but prompt 2's 6
    taus = [8.0, 1.0, 7.0, 2.0, 6.0, 3.0, 5.0, 4.0]
    steps = [2, 2, 6, 2, 2, 2, 2, 2]
    per_prompt = [{"tau": t, "steps": s} for t, s in zip(taus, steps)]
    set_tau = sum(t * s for t, s in zip(taus, steps)) / sum(steps)
    path = tmp_path / "eval.json"
    path.write_text(json.dumps({"online": {"tau": set_tau, "per_prompt": per_prompt},
                                "bench": {"humaneval": {"tau": set_tau, "per_prompt": per_prompt[::-1]}}}))
    monkeypatch.setenv("OUT", str(tmp_path))
    assert timed_subsets.main([str(path), "--counts", "2"]) == 0
    rows = json.loads((tmp_path / "timed_subsets.json").read_text())
    held = next(r for r in rows if r["set"] == "held-out")
    assert held["spread_tau"] == pytest.approx((8 * 2 + 4 * 2) / 4)  # the first and last prompt of the file
    assert held["strata_tau"] == pytest.approx((7 * 6 + 3 * 2) / 8)  # prompts 2 and 5: ranks 3 and 7 of 8
    assert held["strata_off"] == pytest.approx(held["strata_tau"] - set_tau)
    assert [r["set"] for r in rows] == ["held-out", "humaneval"] and "K=2: largest distance" in capsys.readouterr().out
