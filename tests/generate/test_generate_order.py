"""`dflash generate` in-process takes the rows shortest prompt (in tokens) first: each window then holds
one length class, so the static cache keeps one width (one cache, one set of CUDA graphs) from batch to
batch."""

from __future__ import annotations

from pathlib import Path

from dflash.config import GenerateConfig
from dflash.generate.drive import by_prompt_length, drive
from dflash.generate.journal import Journal, load_records
from dflash.generate.local import LocalEngine
from dflash.generate.rows import plan_row

EMBEDDED = Path(__file__).resolve().parents[2] / "data" / "target_model"


def test_rows_go_by_prompt_length_so_that_a_width_keeps_its_static_cache(tmp_path):
    short = ["Hi.", "Yes?", "Name a colour.", "Two plus two?"]
    long = [" ".join([w] * 90) for w in ("alpha", "beta", "gamma", "delta")]
    rows = [{"messages": [{"role": "user", "content": t}]} for pair in zip(short, long) for t in pair]
    plans = [plan_row(r, i, "rows", "last") for i, r in enumerate(rows)]  # file order: short, long, short, ...
    cfg = GenerateConfig(target=str(EMBEDDED), gpus="cpu", max_new_tokens=6, batch_size=1, static_cache="on")
    eng = LocalEngine(cfg, "cpu")
    new_cache = eng._static_cache

    def run(ordered, name):
        lengths = []

        def spy(rows_, length):
            lengths.append(length)
            return new_cache(rows_, length)

        eng._static_cache = spy
        (tmp_path / name).mkdir()
        journal = Journal(tmp_path / name, 0)
        drive(eng, cfg, rows, plans, journal, lambda n, t: None, ordered=ordered)
        journal.close()
        return lengths, {r: rec["out"] for r, rec in load_records(tmp_path / name).items()}

    file_widths, file_out = run(False, "file")
    sorted_widths, sorted_out = run(True, "sorted")
    order = [p.row for p in by_prompt_length(plans, eng.prompt_length)]
    assert set(order[:4]) == {0, 2, 4, 6} and set(order[4:]) == {1, 3, 5, 7}  # the short prompts first
    # windows of 4 rows in file order: each sorts its own, so the width falls back at every window
    assert file_widths != sorted(file_widths) and len(set(file_widths)) == 2
    assert sorted_widths == sorted(sorted_widths) and len(set(sorted_widths)) == 2  # one change of width
    assert sorted_out == file_out and len(sorted_out) == len(rows)  # greedy: the order changes no reply


def test_dflash_generate_journals_the_short_prompts_first(tmp_path):
    import json

    from dflash.generate.journal import work_dir
    from dflash.generate.run import run_generate

    texts = ["Hi.", " ".join(["alpha"] * 90), "Yes?", " ".join(["beta"] * 90), "Name a colour."]
    data = tmp_path / "in.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": t}]}) + "\n" for t in texts))
    out = tmp_path / "out.jsonl"
    run_generate(GenerateConfig(target=str(EMBEDDED), gpus="cpu", data=str(data), out=str(out), turns="last",
                                max_new_tokens=4, batch_size=1))
    journal = next(work_dir(out).glob("shard-*.journal")).read_text().splitlines()
    assert {json.loads(line)["row"] for line in journal[:3]} == {0, 2, 4}  # in file order: 0 and 2, then a long one
    assert [json.loads(line)["messages"][0]["content"] for line in out.read_text().splitlines()] == texts
