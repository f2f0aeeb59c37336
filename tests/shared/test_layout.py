"""The house rules (docs/DESIGN.md §1): one package per stage, the store the only link between the two
stages, no import cycles, no stage importing a later one, and DVC stage deps that cover every module the
stage's command can import.  The import graph is read statically from every `import` in the package,
including those inside functions (heavy imports are deferred there), so a lazy import counts too."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "dflash"

SHARED = {"dflash", "dflash.config", "dflash.errors", "dflash.fields", "dflash.chat", "dflash.hostgc",
          "dflash.cpu_threads", "dflash.locks", "dflash.spawned", "dflash.paths", "dflash.jsonl", "dflash.durable"}
# what each layer may import besides itself; the data flow is generate -> precompute -> store -> train -> evaluate
ALLOWED = {
    "shared": {"shared"},
    "store": {"errors", "spawned", "durable"},
    "generate": {"shared"},
    "precompute": {"shared", "store"},
    "train": {"shared", "store"},
    "evaluate": {"shared", "store", "train"},
    "cli": {"shared", "store", "generate", "precompute", "train", "evaluate", "errors"},
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def layer(mod: str) -> str:
    if mod == "dflash.cli":
        return "cli"
    if mod in SHARED or mod.startswith(("dflash.config.", "dflash.target_model", "dflash.drafter")):
        return "shared"
    return mod.split(".")[1]


def _type_checking_only(node: ast.AST, parents: dict) -> bool:
    while node in parents:
        node = parents[node]
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            return True
    return False


def imports_of(path: Path, modules: set[str], within: str | None = None, type_only: bool = False) -> set[str]:
    """dflash modules imported by the file (all of them, or only inside the top-level function `within`
    plus the module-level ones; a click command named `within` counts as that function); `from dflash.x import y` counts y when y is itself a module.
    `type_only`: those under `if TYPE_CHECKING:` count too (they run no code, but tie the two modules)."""
    tree = ast.parse(path.read_text())
    parents = {c: p for p in ast.walk(tree) for c in ast.iter_child_nodes(p)}
    roots = [tree]
    if within is not None:
        fn = [n for n in tree.body if isinstance(n, ast.FunctionDef) and
              (n.name == within or any(f"'{within}'" in ast.unparse(d) for d in n.decorator_list))]
        assert fn, f"{path} has no function {within}"
        roots = [ast.Module(body=[n for n in tree.body if not isinstance(n, (ast.FunctionDef, ast.ClassDef))],
                            type_ignores=[]), fn[0]]
    found = set()
    for root in roots:
        for node in ast.walk(root):
            if not type_only and _type_checking_only(node, parents):
                continue
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            found |= {n for n in names if n in modules}
    return found


def graph(type_only: bool = False) -> dict[str, set[str]]:
    files = {module_name(p): p for p in PKG.rglob("*.py")}
    return {m: imports_of(p, set(files), type_only=type_only) - {m} for m, p in files.items()}


def test_layers_import_only_earlier_stages_and_shared():
    bad = []
    for mod, deps in graph().items():
        own = layer(mod)
        for dep in deps:
            other = layer(dep)
            if other == own or other in ALLOWED[own] or (dep in ("dflash.errors", "dflash.spawned", "dflash.durable") and dep[7:] in ALLOWED[own]):
                continue
            bad.append(f"{mod} ({own}) imports {dep} ({other})")
    assert not bad, "layering broken:\n" + "\n".join(sorted(bad))


def test_store_is_the_only_link_between_the_stages():
    g = graph()
    for a, b in [("precompute", "train"), ("train", "precompute"), ("store", "train"), ("store", "precompute")]:
        crossing = [f"{m} -> {d}" for m, ds in g.items() if layer(m) == a for d in ds if layer(d) == b]
        assert not crossing, crossing


def test_no_import_cycles():
    # every import counts: module level, inside functions, and type-only ones (a trainer and a tracker that
    # name each other's types are one concern split in two, whatever runs first)
    g = graph(type_only=True)
    index, low, stack, on, cycles, counter = {}, {}, [], set(), [], [0]

    def visit(v):  # Tarjan's strongly connected components
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in g[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            # a package importing its own submodules (re-exports) is not a cycle of concerns
            if len(comp) > 1 and not all(c.startswith(min(comp, key=len)) for c in comp):
                cycles.append(sorted(comp))

    for v in g:
        if v not in index:
            visit(v)
    assert not cycles, f"import cycles: {cycles}"


def test_only_the_drafter_package_names_a_drafter_family():
    # A family lives in dflash/drafter/<name>/ behind DrafterFamily: the stages ask the registry, so adding
    # one touches its package and one registry line (the config's help text may name them to the user).
    from dflash.drafter.registry import FAMILIES

    names = re.compile(r"\b(" + "|".join(n for n in FAMILIES if n != "dflash") + r")\b", re.IGNORECASE)
    naming = [str(p.relative_to(ROOT)) for p in PKG.rglob("*.py")
              if p.parent.name != "config" and PKG / "drafter" not in p.parents and names.search(p.read_text())]
    assert not naming, f"modules outside dflash/drafter/ that name a drafter family: {naming}"


def test_only_the_cli_knows_the_command_line():
    users = [str(p.relative_to(ROOT)) for p in PKG.rglob("*.py")
             if p.name != "cli.py" and any(isinstance(n, (ast.Import, ast.ImportFrom)) and
                                           "click" in ast.unparse(n) for n in ast.walk(ast.parse(p.read_text())))]
    assert not users, users


def closure(command: str) -> set[str]:
    """Every dflash module `dflash <command>` can import: cli's module-level imports and those of the
    command's function, then everything those import."""
    files = {module_name(p): p for p in PKG.rglob("*.py")}
    todo = {"dflash.cli"} | imports_of(PKG / "cli.py", set(files), within=command)
    seen: set[str] = set()
    while todo:
        m = todo.pop()
        if m in seen:
            continue
        seen.add(m)
        # importing dflash.a.b runs dflash/__init__ and dflash/a/__init__ first
        parts = m.split(".")
        todo |= {".".join(parts[:i]) for i in range(1, len(parts))}
        if m != "dflash.cli":
            todo |= imports_of(files[m], set(files))
    return seen


DVC = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]


@pytest.mark.parametrize("stage", sorted(DVC))
def test_dvc_stage_deps_cover_every_module_its_command_imports(stage):
    spec = DVC[stage]
    words = spec["cmd"].split()
    assert words[0] == "dflash", spec["cmd"]
    deps = [Path(d) for d in spec["deps"]]
    for d in deps:
        if d.parts[0] == "dflash":
            assert (ROOT / d).exists(), f"dvc.yaml stage {stage}: dep {d} does not exist"
    missing = []
    for mod in sorted(closure(words[1])):
        path = (PKG / Path(*mod.split(".")[1:])).with_suffix(".py") if mod != "dflash" else PKG / "__init__.py"
        if not path.exists():
            path = PKG / Path(*mod.split(".")[1:]) / "__init__.py"
        rel = path.relative_to(ROOT)
        if not any(rel == d or d in rel.parents for d in deps):
            missing.append(str(rel))
    assert not missing, f"dvc.yaml stage {stage} runs code it does not depend on: {missing}"


def test_the_closure_sees_lazy_imports():
    # the check above is only as good as the graph: `dflash train` reaches the drafter only through a lazy import
    assert "dflash.drafter.dflash" in closure("train") and "dflash.train.trainer" in closure("train")
    assert "dflash.train.trainer" not in closure("precompute")
