"""The package layout holds: a folder per stage, each folder importing only folders of a
lower rank (imports inside functions count), no import cycle between modules, and
``solvers`` imports neither torch nor ``remat_pass`` (ARCHITECTURE.md)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# The folders in data-flow order (ARCHITECTURE.md): a module may import modules of its own
# folder and of the folders listed before it, never one listed after. ``solvers`` comes
# first (remat_pass builds on it, never the reverse); ``base`` is the handful of modules
# directly in remat_pass/ that every stage may use (errors, units); ``api`` the public
# entry points that may import any stage.
RANKS = [
    "solvers", "base", "graph", "models", "recompute", "measure", "memory", "liveness",
    "plan", "evaluate", "report", "parallel", "compile", "cli", "api",
]
BASE = {"remat_pass.errors", "remat_pass.formatting"}
API = {"remat_pass", "remat_pass.__main__", "remat_pass.pytest_plugin"}
# at most a handful of modules directly in remat_pass/ (issue 18)
TOP_LEVEL = {"__init__.py", "__main__.py", "errors.py", "formatting.py", "pytest_plugin.py"}


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def module_files() -> list[Path]:
    return sorted((ROOT / "remat_pass").rglob("*.py")) + sorted((ROOT / "solvers").rglob("*.py"))


def folder_of(module: str) -> str:
    """The folder (stage) a module belongs to: ``remat_pass.graph.trace`` -> ``graph``."""
    if module.split(".")[0] == "solvers":
        return "solvers"
    if module in BASE:
        return "base"
    if module in API:
        return "api"
    return module.split(".")[1]


def _imports(path: Path, known: set[str]) -> set[str]:
    """Project modules imported anywhere in ``path`` (module level and inside functions)."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = parts[: len(parts) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            if node.module:  # `from . import schedule` imports the submodule, not the package
                out.add(module)
            out.update(f"{module}.{a.name}" for a in node.names)
    return {m for m in out if m in known and m != name}


def import_graph() -> dict[str, set[str]]:
    files = module_files()
    known = {_module_name(p) for p in files}
    return {_module_name(p): _imports(p, known) for p in files}


def test_every_module_is_in_a_ranked_folder():
    unknown = sorted(m for m in import_graph() if folder_of(m) not in RANKS)
    assert not unknown, "put these modules in a folder of RANKS (and ARCHITECTURE.md): " + ", ".join(unknown)


def test_only_a_handful_of_modules_sit_directly_in_remat_pass():
    top = {p.name for p in (ROOT / "remat_pass").glob("*.py")}
    assert top == TOP_LEVEL, f"modules directly in remat_pass/: {sorted(top)}; move them into their stage's folder"


def _backward_imports(graph: dict[str, set[str]]) -> list[str]:
    rank = {f: i for i, f in enumerate(RANKS)}
    bad = []
    for m, deps in graph.items():
        for d in sorted(deps):
            fm, fd = folder_of(m), folder_of(d)
            # a folder's __init__ may re-export its own modules; nothing may import a later folder
            if rank[fd] > rank[fm]:
                bad.append(f"{m} ({fm}) imports {d} ({fd})")
    return bad


def test_no_folder_imports_a_later_one():
    bad = _backward_imports(import_graph())
    assert not bad, "\n".join(bad)


def _cycle(graph: dict[str, set[str]]) -> str | None:
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(m: str) -> str | None:
        state[m] = 1
        path.append(m)
        for d in sorted(graph.get(m, ())):
            if state.get(d) == 1:
                return " -> ".join(path[path.index(d):] + [d])
            if d not in state:
                found = visit(d)
                if found:
                    return found
        path.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state:
            found = visit(m)
            if found:
                return found
    return None


def test_no_import_cycle():
    cycle = _cycle(import_graph())
    assert cycle is None, "import cycle: " + cycle


def test_the_checks_catch_a_cycle_and_a_backward_import():
    """Negative control: a solver importing remat_pass is a backward import and a cycle; a
    graph module importing the planner is a backward import between folders."""
    graph = import_graph()
    planted = dict(graph)
    planted["solvers.chain"] = graph["solvers.chain"] | {"remat_pass.errors"}
    planted["remat_pass.errors"] = graph["remat_pass.errors"] | {"solvers.chain"}
    assert any("solvers.chain" in line for line in _backward_imports(planted))
    assert _cycle(planted) is not None
    planted = dict(graph)
    planted["remat_pass.graph.trace"] = graph["remat_pass.graph.trace"] | {"remat_pass.plan.planner"}
    assert _backward_imports(planted) == ["remat_pass.graph.trace (graph) imports remat_pass.plan.planner (plan)"]
    assert not _backward_imports(graph) and _cycle(graph) is None


def test_solvers_import_without_torch():
    """``import solvers`` and every one of its submodules in a fresh interpreter where torch and
    remat_pass cannot be imported."""
    code = (
        "import importlib.abc, sys\n"
        "class Block(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path, target=None):\n"
        "        if name.split('.')[0] in ('torch', 'remat_pass'):\n"
        "            raise ImportError('blocked: ' + name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "import importlib, pkgutil, solvers\n"
        "for m in pkgutil.iter_modules(solvers.__path__):\n"
        "    importlib.import_module('solvers.' + m.name)\n"
        "assert not [m for m in sys.modules if m.split('.')[0] in ('torch', 'remat_pass')]\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_architecture_md_names_every_folder_and_module():
    """One line per folder (its job, what it may import), then one per module."""
    text = (ROOT / "ARCHITECTURE.md").read_text(encoding="utf-8")
    folders = sorted({p.parent for p in module_files()})
    missing = [str(f.relative_to(ROOT)) + "/" for f in folders if f"| `{f.relative_to(ROOT)}/` |" not in text]
    missing += [str(p.relative_to(ROOT)) for p in module_files()
                if p.name != "__init__.py" and f"| `{p.relative_to(ROOT)}` |" not in text]
    assert not missing, "add a line to ARCHITECTURE.md for: " + ", ".join(missing)


def test_no_module_or_function_is_long():
    """About 500 lines a module and 80 a function (docstring included), issue 8."""
    long = []
    for p in module_files():
        text = p.read_text(encoding="utf-8")
        if text.count("\n") > 500:
            long.append(f"{p.relative_to(ROOT)}: {text.count(chr(10))} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 80:
                long.append(f"{p.relative_to(ROOT)}:{node.lineno} {node.name}: {node.end_lineno - node.lineno + 1} lines")
    assert not long, "\n".join(long)
