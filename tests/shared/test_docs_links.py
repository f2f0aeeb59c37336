"""The documentation's links lead somewhere, and nothing the repository ships speaks of how the work on it
was organised.

Checked files: README.md, docs/*.md (but docs/OPTIONS.md, generated from the help strings in dflash/config/,
which tests/shared/test_options.py keeps current) and benchmarks/*.md.  Checked in them: every relative
markdown link (`[text](path)`, `![alt](path)`) and every repository path they name in running text under
bench/, docs/ or benchmarks/.  In the .py files of dflash/ and tests/ (docstrings, comments, help strings),
every `docs/*.md`, `benchmarks/*` and `bench/*.py` path they name."""

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
# A path right after a commit (`acb99b0:docs/...`, `git ls-tree acb99b0 docs/...`) names git history, not the tree.
PATH = re.compile(r"(?<![\w./-])(?<![0-9a-f]{7}:)(?<![0-9a-f]{7} )((?:bench|docs|benchmarks)/[\w./-]*[\w/])")
# In source, only paths with a file's ending (or any under benchmarks/): "docs/" alone or "docs/{name}.md" is
# not a citation.
SOURCE_PATH = re.compile(r"(?<![\w./-])(?<![0-9a-f]{7}:)(?<![0-9a-f]{7} )"
                         r"(docs/[\w./-]*\.md|benchmarks/[\w./-]*[\w/]|bench/[\w./-]*\.py)(?![\w/{<*-])")
# Made-up paths of the checks' own tests, split so that this file's scan does not find them.
NO_SUCH_SCRIPT = "bench/" + "no_such.py"
NO_SUCH_REPORT = "benchmarks/" + "no-such-report.md"
NO_SUCH_GUIDE = "docs/" + "NO_SUCH.md"
DIARY = r"session ?[0-9]|\bs[0-9]{2}\b|\blease"


def doc_files() -> list[Path]:
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "benchmarks").glob("*.md"))]
    return [f for f in files if f.name != "OPTIONS.md" or f.parent.name != "docs"]


def broken_references(doc: Path) -> list[str]:
    text = doc.read_text()
    broken = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue  # a URL or an anchor in the same file
        if not (doc.parent / target.split("#")[0]).exists():
            broken.append(f"link {target}")
    for path in PATH.findall(text):
        path = path.rstrip(".")
        if "*" in path or "<" in path:
            continue
        if not (ROOT / path).exists() and not any(p.exists() for p in ROOT.glob(path.rstrip("/") + "*")):
            broken.append(f"path {path}")
    return broken


def source_files() -> list[Path]:
    return sorted(p for d in ("dflash", "tests") for p in (ROOT / d).rglob("*.py"))


def missing_source_paths(text: str) -> list[str]:
    return [p for p in dict.fromkeys(m.rstrip(".") for m in SOURCE_PATH.findall(text)) if not (ROOT / p).exists()]


def test_every_link_and_named_path_in_the_docs_exists():
    problems = {str(d.relative_to(ROOT)): b for d in doc_files() if (b := broken_references(d))}
    assert problems == {}


def test_the_checks_find_a_broken_link_and_a_missing_bench_script(tmp_path):
    doc = tmp_path / "guide.md"
    doc.write_text(f"See [the store](store.md), [web](https://x.org), [here](#top), and `{NO_SUCH_SCRIPT}` or "
                   "bench/run.py, then ![plot](plot.png); `git show acb99b0:docs/gone.md` is history.\n")
    (tmp_path / "plot.png").write_bytes(b"")
    assert broken_references(doc) == ["link store.md", f"path {NO_SUCH_SCRIPT}"]


def test_every_docs_benchmarks_and_bench_path_named_in_the_code_exists():
    problems = {str(f.relative_to(ROOT)): m for f in source_files() if (m := missing_source_paths(f.read_text()))}
    assert problems == {}


def test_the_code_check_finds_a_missing_report_script_and_guide():
    text = (f'"""Rates: {NO_SUCH_REPORT}; ({NO_SUCH_SCRIPT}, {NO_SUCH_GUIDE}).  Kept: bench/run.py,\n'
            'benchmarks/README.md, docs/OPTIONS.md, docs/{name}.md, and `git show acb99b0:docs/gone.md`."""\n')
    assert missing_source_paths(text) == [NO_SUCH_REPORT, NO_SUCH_SCRIPT, NO_SUCH_GUIDE]


def test_no_tracked_text_file_speaks_of_how_the_work_was_organised():
    found = subprocess.run(["git", "grep", "-IinE", DIARY, "--", ".", ":!*.json"], cwd=ROOT,
                           capture_output=True, text=True)
    assert found.returncode in (0, 1), found.stderr  # 1: nothing found
    assert found.stdout == "", "reword these (cite a result by its report):\n" + found.stdout[:4000]
