"""labkit's shape, checked: no import cycles, techniques that do not import each other, small
modules, and nothing that only the tests use (labkit/README.md draws the map).

The import graph is read from the source with ``ast``, function-level imports included, so an
import hidden inside a function to dodge a cycle still counts.
"""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LABKIT = ROOT / "labkit"
# One package (or module) per technique; they may import the core, never each other.
TECHNIQUES = ("zero", "checkpoint", "accumulate", "tensor_parallel", "pipeline", "flash_attention",
              "paged_attention")
# The only modules whose job is to compose techniques: what a lab's ranks run, 3D parallelism.
COMPOSING = ("runs",)
MAX_LINES = 300


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(LABKIT.rglob("*.py"))}


def _imports(source: str, module: str, is_package: bool, known) -> set[str]:
    """The labkit modules ``source`` imports, anywhere in it (functions included)."""
    package = module if is_package else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                stem = ".".join(base + ([node.module] if node.module else []))
            else:
                stem = node.module or ""
            # "from pkg import sub" imports the submodule when there is one
            names = [f"{stem}.{a.name}" if f"{stem}.{a.name}" in known else stem for a in node.names]
        else:
            continue
        for name in names:
            while name and name not in known:  # "import labkit.zero.stage1 as s": the deepest module
                name = name.rpartition(".")[0]
            if name.startswith("labkit"):
                found.add(name)
    found.discard(module)
    return found


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    return {m: _imports(p.read_text(), m, p.name == "__init__.py", mods) for m, p in mods.items()}


def _row(module: str) -> str:
    """'core', 'runs' or the technique a labkit module belongs to."""
    first = module.split(".")[1] if "." in module else ""
    if first in TECHNIQUES:
        return first
    return first if first in COMPOSING else "core"


def test_the_graph_is_read_from_the_source():
    graph = _graph()
    # known edges of each kind: relative, absolute, from a package, inside a function
    assert "labkit.zero.flat" in graph["labkit.zero.stage1"]
    assert "labkit.collectives" in graph["labkit.zero.ddp"]
    assert "labkit.zero" in graph["labkit.runs.zero"]
    assert {"labkit.device"} <= graph["labkit"]


def test_no_import_cycles():
    graph = _graph()
    state, stack, cycles = {}, [], []

    def visit(m):
        state[m] = "open"
        stack.append(m)
        for n in sorted(graph.get(m, ())):
            if state.get(n) == "open":
                cycles.append(stack[stack.index(n):] + [n])
            elif n not in state:
                visit(n)
        stack.pop()
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m)
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_techniques_import_only_the_core_and_the_core_imports_no_technique():
    bad = []
    for module, imported in _graph().items():
        row = _row(module)
        for target in imported:
            target_row = _row(target)
            if row in COMPOSING or target_row == "core" or target_row == row:
                continue
            bad.append(f"{module} ({row}) imports {target} ({target_row})")
    assert not bad, ("only labkit.runs composes techniques; the core imports none, and a technique "
                     "imports no other technique nor labkit.runs:\n" + "\n".join(sorted(bad)))


def test_no_module_is_longer_than_300_lines():
    long = {str(p.relative_to(ROOT)): n for p in LABKIT.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"split these modules (at most {MAX_LINES} lines each): {long}"


def _used_outside_tests() -> set[str]:
    """labkit modules the labs and scripts import, and everything those import in turn."""
    mods = _modules()
    sources = [p.read_text() for p in sorted((ROOT / "scripts").glob("*.py"))]
    for nb in sorted((ROOT / "labs").glob("*.ipynb")):
        cells = json.loads(nb.read_text())["cells"]
        code = ["".join(c["source"]) for c in cells if c["cell_type"] == "code"]
        sources += ["\n".join(line for line in c.splitlines() if not re.match(r"\s*(%|!)[A-Za-z]", line))
                    for c in code]  # IPython's %pip and !shell lines are not Python
    todo = set()
    for src in sources:
        todo |= _imports(src, "__main__", False, mods)
    graph, seen = _graph(), set()
    while todo:
        m = todo.pop()
        if m in seen:
            continue
        seen.add(m)
        parent = m.rpartition(".")[0]
        todo |= graph.get(m, set()) | ({parent} if parent else set())  # a submodule runs its package first
    return seen


def test_nothing_in_labkit_is_used_only_by_the_tests():
    unused = sorted(set(_modules()) - _used_outside_tests())
    assert not unused, ("no lab, script or other labkit module imports these; code only tests use "
                        f"belongs in tests/: {unused}")


@pytest.mark.parametrize("bad_source, expected", [
    ("from ..zero import ShardedOptimizer", "labkit.zero"),
    ("def f():\n    from labkit.checkpoint.plan import Plan", "labkit.checkpoint.plan"),
])
def test_the_reader_sees_the_imports_that_would_break_the_rules(bad_source, expected):
    # the checks above can fail: a technique's import of another, even inside a function, is seen
    found = _imports(bad_source, "labkit.tensor_parallel.layers", False, _modules())
    assert expected in found and _row(expected) != _row("labkit.tensor_parallel.layers")
