"""The documentation's links lead somewhere, and nothing the repository ships speaks of how the work on it
was organised.

Checked files: README.md, docs/*.md (but docs/OPTIONS.md, generated from the help strings in dflash/config/,
which tests/shared/test_options.py keeps current) and benchmarks/*.md.  Checked in them: every relative
markdown link (`[text](path)`, `![alt](path)`) and every repository path they name in running text under
bench/, docs/ or benchmarks/."""

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
# A path right after a commit (`acb99b0:docs/...`, `git ls-tree acb99b0 docs/...`) names git history, not the tree.
PATH = re.compile(r"(?<![\w./-])(?<![0-9a-f]{7}:)(?<![0-9a-f]{7} )((?:bench|docs|benchmarks)/[\w./-]*[\w/])")
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


def test_every_link_and_named_path_in_the_docs_exists():
    problems = {str(d.relative_to(ROOT)): b for d in doc_files() if (b := broken_references(d))}
    assert problems == {}


def test_the_checks_find_a_broken_link_and_a_missing_bench_script(tmp_path):
    doc = tmp_path / "guide.md"
    doc.write_text("See [the store](store.md), [web](https://x.org), [here](#top), and `bench/no_such.py` or "
                   "bench/run.py, then ![plot](plot.png); `git show acb99b0:docs/gone.md` is history.\n")
    (tmp_path / "plot.png").write_bytes(b"")
    assert broken_references(doc) == ["link store.md", "path bench/no_such.py"]


def test_no_tracked_text_file_speaks_of_how_the_work_was_organised():
    found = subprocess.run(["git", "grep", "-IinE", DIARY, "--", ".", ":!*.json"], cwd=ROOT,
                           capture_output=True, text=True)
    assert found.returncode in (0, 1), found.stderr  # 1: nothing found
    assert found.stdout == "", "reword these (cite a result by its report):\n" + found.stdout[:4000]
