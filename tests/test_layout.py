"""The package layout holds: no import cycle, no stage importing a later stage (imports
inside functions count), and ``solvers`` imports neither torch nor ``remat_pass``."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# The stages in data-flow order (ARCHITECTURE.md): a module may import only modules
# listed before it. ``solvers`` comes first: remat_pass builds on it, never the reverse.
STAGES = [
    "solvers.errors", "solvers.poly", "solvers.chain", "solvers.chain_search", "solvers.closed_forms", "solvers.resolve", "solvers.oplevel",
    "solvers.theoretical_memory",
    "solvers",
    "remat_pass.errors", "remat_pass.formatting", "remat_pass.costs", "remat_pass.cuda_target",
    "remat_pass.static_memory", "remat_pass.op_signature",
    "remat_pass.scratch_table", "remat_pass.memory_model", "remat_pass.flat_step",
    "remat_pass.shape_symbols", "remat_pass.untraceable", "remat_pass.trace", "remat_pass.fake_trace",
    "remat_pass.module_paths", "remat_pass.regions", "remat_pass.schedule", "remat_pass.partition", "remat_pass.policies", "remat_pass.rewrite",
    "remat_pass.intervals", "remat_pass.liveness", "remat_pass.step_composition", "remat_pass.step_flow", "remat_pass.measure", "remat_pass.calibration", "remat_pass.schedule_result", "remat_pass.sweep", "remat_pass.symbolic_sizes", "remat_pass.symbolic",
    "remat_pass.layer_roles", "remat_pass.layer_template", "remat_pass.layer_reuse", "remat_pass.planner", "remat_pass.step_planning", "remat_pass.op_planner", "remat_pass.step_op_planning",
    "remat_pass.report", "remat_pass.plan_report",
    "remat_pass.step_report", "remat_pass.inspection",
    "remat_pass.plot",
    "remat_pass.gate", "remat_pass.compiled_graphs", "remat_pass.graph_transforms", "remat_pass.inductor_memory",
    "remat_pass.inductor_hooks", "remat_pass.step_recorder", "remat_pass.backend_options",
    "remat_pass.graph_schedule", "remat_pass.backend_graph", "remat_pass.backend_steps",
    "remat_pass.backend",
    "remat_pass.pipeline", "remat_pass.parallel", "remat_pass.fsdp", "remat_pass.parallel_plan", "remat_pass.launch",
    "remat_pass.models", "remat_pass.hf_families", "remat_pass.configs", "remat_pass.workload",
    "remat_pass.distributed", "remat_pass.fsdp_measure", "remat_pass.cli_parallel", "remat_pass.cli_workload", "remat_pass.cli_sweep", "remat_pass.cli_report", "remat_pass.cli_plan", "remat_pass.cli", "remat_pass.pytest_plugin", "remat_pass",
]


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def _imports(path: Path) -> set[str]:
    """Project modules imported anywhere in ``path`` (module level and inside functions)."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            if node.module:  # `from . import schedule` imports the submodule, not the package
                out.add(module)
            out.update(f"{module}.{a.name}" for a in node.names)
    known = set(STAGES)
    return {m for m in out if m in known and m != name}


def import_graph() -> dict[str, set[str]]:
    files = sorted((ROOT / "remat_pass").glob("*.py")) + sorted((ROOT / "solvers").glob("*.py"))
    return {_module_name(p): _imports(p) for p in files}


def test_every_module_has_a_stage():
    assert sorted(import_graph()) == sorted(STAGES), "add new modules to STAGES (and ARCHITECTURE.md)"


def test_no_stage_imports_a_later_one():
    rank = {m: i for i, m in enumerate(STAGES)}
    bad = [f"{m} imports {d}" for m, deps in import_graph().items() for d in sorted(deps) if rank[d] > rank[m]]
    assert not bad, "\n".join(bad)


def test_no_import_cycle():
    graph = import_graph()
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        path.append(m)
        for d in sorted(graph.get(m, ())):
            if state.get(d) == 1:
                raise AssertionError("import cycle: " + " -> ".join(path[path.index(d):] + [d]))
            if d not in state:
                visit(d)
        path.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)


def test_the_checks_catch_a_cycle_and_a_backward_import(tmp_path, monkeypatch):
    """Negative control: a solver importing remat_pass is a backward import and a cycle."""
    graph = import_graph()
    graph["solvers.chain"] = graph["solvers.chain"] | {"remat_pass.errors"}
    graph["remat_pass.errors"] = graph["remat_pass.errors"] | {"solvers.chain"}
    monkeypatch.setattr(sys.modules[__name__], "import_graph", lambda: graph)
    for check in (test_no_stage_imports_a_later_one, test_no_import_cycle):
        try:
            check()
        except AssertionError:
            continue
        raise AssertionError(f"{check.__name__} did not catch the planted import")


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


def test_every_module_has_a_line_in_architecture_md():
    text = (ROOT / "ARCHITECTURE.md").read_text(encoding="utf-8")
    missing = [p for p in sorted((ROOT / "remat_pass").glob("*.py")) + sorted((ROOT / "solvers").glob("*.py"))
               if f"| `{p.name}` |" not in text]
    assert not missing, "add a line to ARCHITECTURE.md's module tables for: " + ", ".join(map(str, missing))


def test_no_module_or_function_is_long():
    """About 500 lines a module and 80 a function (docstring included), issue 8."""
    long = []
    for p in sorted((ROOT / "remat_pass").glob("*.py")) + sorted((ROOT / "solvers").glob("*.py")):
        text = p.read_text(encoding="utf-8")
        if text.count("\n") > 500:
            long.append(f"{p.name}: {text.count(chr(10))} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 80:
                long.append(f"{p.name}:{node.lineno} {node.name}: {node.end_lineno - node.lineno + 1} lines")
    assert not long, "\n".join(long)
