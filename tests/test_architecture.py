"""labkit's shape, checked: no import cycles, techniques that do not import each other, small
modules and functions, explicit exports, one way to check an argument, an ``import labkit`` that
loads no torch, and nothing that only the tests use (labkit/README.md draws the map).

The import graph is read from the source with ``ast``, function-level imports included, so an
import hidden inside a function to dodge a cycle still counts.
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LABKIT = ROOT / "labkit"
# One package (or module) per technique; they may import the core, never each other.
TECHNIQUES = ("zero", "data_parallel", "checkpoint", "accumulate", "tensor_parallel", "pipeline",
              "flash_attention", "paged_attention", "context_parallel", "expert_parallel")
# Packages of the core: the model builds its blocks from them, as it builds attention from
# labkit.attention. labkit.moe is the mixture-of-experts block (router, experts, capacity); the
# technique that shards it over ranks, labkit.expert_parallel, is in TECHNIQUES.
CORE_PACKAGES = ("memory", "moe")
# The only modules whose job is to compose techniques: what a lab's ranks run (runs), and the
# layer that shards one model by several techniques at once (parallel).
COMPOSING = ("runs", "parallel", "estimate", "plan")  # estimate and plan compose formulas, never mechanisms
MAX_LINES = 300


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(LABKIT.rglob("*.py"))}


def _imports(source: str, module: str, is_package: bool, known) -> set[str]:
    """The labkit modules ``source`` imports, anywhere in it (functions included)."""
    package = module if is_package else module.rpartition(".")[0]

    def absolute(level: int, name: str | None) -> str:
        if not level:
            return name or ""
        base = package.split(".")
        return ".".join(base[:len(base) - level + 1] + ([name] if name else []))

    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            stem = absolute(node.level, node.module)
            # "from pkg import sub" imports the submodule when there is one
            names = [f"{stem}.{a.name}" if f"{stem}.{a.name}" in known else stem for a in node.names]
        elif _is_lazy_table(node):  # lazy_exports(__name__, {".meter": (...)}): imports on first use
            relative = [k.value for k in node.args[1].keys if isinstance(k, ast.Constant)]
            names = [absolute(len(r) - len(r.lstrip(".")), r.lstrip(".")) for r in relative]
        else:
            continue
        for name in names:
            while name and name not in known:  # "import labkit.zero.stage1 as s": the deepest module
                name = name.rpartition(".")[0]
            if name.startswith("labkit"):
                found.add(name)
    found.discard(module)
    return found


def _is_lazy_table(node) -> bool:
    """A call ``lazy_exports(__name__, {module: names, ...})`` (labkit._lazy), the table literal."""
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "lazy_exports"
            and len(node.args) >= 2 and isinstance(node.args[1], ast.Dict))


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
    assert "labkit.collectives" in graph["labkit.data_parallel.ddp"]
    assert "labkit.zero" in graph["labkit.runs.zero"]
    assert {"labkit.device"} <= graph["labkit"]
    assert {"labkit.memory.meter", "labkit.memory.plot"} <= graph["labkit.memory"]  # lazy_exports' table


def test_the_core_packages_are_not_techniques_and_model_builds_the_moe_block():
    graph = _graph()
    assert all(_row(f"labkit.{name}") == "core" for name in CORE_PACKAGES)
    assert "labkit.moe.layer" in graph["labkit.model"] and _row("labkit.expert_parallel.apply") == "expert_parallel"


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
    """labkit modules the labs, scripts and the book's extensions (the calculators' page code)
    import, and everything those import in turn."""
    mods = _modules()
    sources = [p.read_text() for p in sorted((ROOT / "scripts").glob("*.py"))]
    sources += [p.read_text() for p in sorted((ROOT / "_ext").rglob("*.py"))]
    for nb in sorted((ROOT / "labs").glob("*.ipynb")):
        cells = json.loads(nb.read_text())["cells"]
        code = ["".join(c["source"]) for c in cells if c["cell_type"] == "code"]
        sources += ["\n".join(line for line in c.splitlines() if not re.match(r"\s*(%|!)[A-Za-z]", line))
                    for c in code]  # IPython's %pip and !shell lines are not Python
    todo = {m for m in mods if m.endswith(".__main__")}  # run by `python -m`, an entry point like a script
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
    ("__getattr__, __dir__ = lazy_exports(__name__, {'..zero.stage1': ('ShardedOptimizer',)})",
     "labkit.zero.stage1"),  # an import on first use, through a package's table
])
def test_the_reader_sees_the_imports_that_would_break_the_rules(bad_source, expected):
    # the checks above can fail: a technique's import of another, even inside a function, is seen
    found = _imports(bad_source, "labkit.tensor_parallel.layers", False, _modules())
    assert expected in found and _row(expected) != _row("labkit.tensor_parallel.layers")


# --- the shape of the code inside the modules --------------------------------------------------

MAX_FUNCTION_LINES = 60
ARGUMENT_CHECKS = "labkit/validate.py"  # the one module that checks argument types by hand


def _sources() -> dict[str, str]:
    return {str(p.relative_to(ROOT)): p.read_text() for p in sorted(LABKIT.rglob("*.py"))}


def _long_functions(source: str, path: str, limit: int = MAX_FUNCTION_LINES) -> list[str]:
    """'path:qualname (N lines)' of every function or method longer than ``limit`` lines."""
    found = []

    def visit(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                if not isinstance(child, ast.ClassDef):
                    n = child.end_lineno - child.lineno + 1  # from `def` to its last line
                    if n > limit:
                        found.append(f"{path}:{name} ({n} lines)")
                visit(child, name + ".")
            else:
                visit(child, prefix)

    visit(ast.parse(source), "")
    return found


def _export_problems(source: str, path: str) -> list[str]:
    """A package __init__ without a literal ``__all__``; a star import in any module."""
    tree = ast.parse(source)
    problems = [f"{path}:{node.lineno} star import from {'.' * node.level}{node.module or ''}"
                for node in ast.walk(tree)
                if isinstance(node, ast.ImportFrom) and any(a.name == "*" for a in node.names)]
    if path.endswith("__init__.py"):
        has_all = any(isinstance(node, (ast.Assign, ast.AnnAssign))
                      and any(isinstance(t, ast.Name) and t.id == "__all__"
                              for t in (node.targets if isinstance(node, ast.Assign) else [node.target]))
                      and isinstance(node.value, (ast.List, ast.Tuple))
                      for node in tree.body)
        if not has_all:
            problems.append(f"{path}: no explicit __all__ (a list of the package's public names)")
    return problems


def _mentions_int_type(node) -> bool:
    """``isinstance(x, int)``, ``isinstance(x, (int, ...))``, ``type(x) is int``."""
    for call in ast.walk(node):
        if isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id == "isinstance" \
                and len(call.args) == 2:
            kinds = call.args[1].elts if isinstance(call.args[1], ast.Tuple) else [call.args[1]]
            if any(isinstance(k, ast.Name) and k.id == "int" for k in kinds):
                return True
        if isinstance(call, ast.Compare) and isinstance(call.left, ast.Call) \
                and isinstance(call.left.func, ast.Name) and call.left.func.id == "type" \
                and any(isinstance(c, ast.Name) and c.id == "int" for c in call.comparators):
            return True
    return False


_FIRES_WHEN_SMALL = {ast.Lt: True, ast.LtE: True, ast.Gt: False, ast.GtE: False}  # for `arg op bound`


def _lower_bound_checks(test, arguments: set[str], negated: bool = False):
    """Arguments that ``test`` refuses for being below an int literal: ``n < 1``, ``not 0 < n``.

    ``not`` flips which side a comparison refuses; ``v > 1 and ...`` (a condition on a large
    value, not a range check) is not one.
    """
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        yield from _lower_bound_checks(test.operand, arguments, not negated)
    elif isinstance(test, ast.BoolOp):
        for value in test.values:
            yield from _lower_bound_checks(value, arguments, negated)
    elif isinstance(test, ast.Compare):
        sides = [test.left, *test.comparators]
        for left, op, right in zip(sides, test.ops, sides[1:]):
            if type(op) not in _FIRES_WHEN_SMALL:
                continue
            for arg, bound, small in ((left, right, _FIRES_WHEN_SMALL[type(op)]),
                                      (right, left, not _FIRES_WHEN_SMALL[type(op)])):
                name = arg.id if isinstance(arg, ast.Name) else (
                    arg.attr if isinstance(arg, ast.Attribute) and isinstance(arg.value, ast.Name)
                    and arg.value.id == "self" else None)
                literal = isinstance(bound, ast.Constant) and type(bound.value) is int
                if name in arguments and literal and small != negated:
                    yield name


def _int_arguments(func) -> set[str]:
    """Parameters that may hold an int: all but those annotated float/str/bool (and self, cls)."""
    args = [*func.args.posonlyargs, *func.args.args, *func.args.kwonlyargs]
    skip = ("float", "str", "bool")
    names = {a.arg for a in args if not (a.annotation is not None and any(
        s in ast.unparse(a.annotation) for s in skip) and "int" not in ast.unparse(a.annotation))}
    return names - {"self", "cls"}


def _hand_written_int_checks(source: str, path: str) -> list[str]:
    """'path:function:line' of every ``if <integer check>: raise`` outside labkit.validate."""
    tree, found = ast.parse(source), set()
    fields = {t.target.id for cls in ast.walk(tree) if isinstance(cls, ast.ClassDef) for t in cls.body
              if isinstance(t, ast.AnnAssign) and isinstance(t.target, ast.Name)}
    for func in ast.walk(tree):
        if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        arguments = _int_arguments(func) | (fields if func.name == "__post_init__" else set())
        for node in ast.walk(func):
            if not (isinstance(node, ast.If) and any(isinstance(s, ast.Raise) for s in node.body)):
                continue
            if _mentions_int_type(node.test):
                found.add(f"{path}:{func.name}:{node.lineno} (isinstance(..., int) by hand)")
            elif (name := next(_lower_bound_checks(node.test, arguments), None)) is not None:
                found.add(f"{path}:{func.name}:{node.lineno} ({name} compared with an int by hand)")
    return sorted(found)


def test_no_function_is_longer_than_60_lines():
    long = [f for path, src in _sources().items() for f in _long_functions(src, path)]
    assert not long, (f"split these functions (at most {MAX_FUNCTION_LINES} lines each, def to last "
                      "line):\n" + "\n".join(long))


def test_every_package_lists_its_exports_and_nothing_is_star_imported():
    problems = [p for path, src in _sources().items() for p in _export_problems(src, path)]
    assert not problems, "\n".join(problems)


def test_integer_arguments_are_checked_only_through_labkit_validate():
    hand = [f for path, src in _sources().items() if path != ARGUMENT_CHECKS
            for f in _hand_written_int_checks(src, path)]
    assert not hand, ("check integer arguments with labkit.validate (check_int, check_choice; "
                      "check_float / check_positive for numbers), which refuses True as an int:\n"
                      + "\n".join(hand))


# The checks above can fail: each finds what it is written to find, and passes what it should.
PLANTED_LONG = "def f():\n" + "    x = 1\n" * 60  # 61 lines from def to the last line


def test_the_length_check_sees_a_planted_61_line_method_and_passes_60():
    assert _long_functions(f"class A:\n    {PLANTED_LONG.replace(chr(10), chr(10) + '    ')}", "p.py") \
        == ["p.py:A.f (61 lines)"]
    assert _long_functions("def f():\n" + "    x = 1\n" * 59, "p.py") == []


@pytest.mark.parametrize("source, path, expected", [
    ("from .meter import *\n__all__ = ['a']", "labkit/m/__init__.py", ["star import from .meter"]),
    ("from .meter import a", "labkit/m/__init__.py", ["no explicit __all__"]),
    ("from .meter import a\n__all__ = ['a']", "labkit/m/__init__.py", []),
    ("from torch import *", "labkit/m/x.py", ["star import from torch"]),
])
def test_the_export_check_sees_a_planted_star_import_or_missing_all(source, path, expected):
    problems = _export_problems(source, path)
    assert len(problems) == len(expected) and all(e in p for e, p in zip(expected, problems))


@pytest.mark.parametrize("source, found", [
    ("def f(n):\n    if not isinstance(n, int) or n < 1:\n        raise ValueError(n)", True),
    ("def f(n: int):\n    if n <= 0:\n        raise ValueError(n)", True),
    ("def f(n, m):\n    if not 0 < n < m:\n        raise ValueError(n)", True),
    ("def f(xs):\n    for x in xs:\n        if type(x) is int:\n            raise TypeError(x)", True),
    ("class C:\n    n: int = 1\n    def __post_init__(self):\n        if self.n < 1:\n            raise ValueError", True),
    ("def f(n):\n    check_int('n', n, 1)", False),
    ("def f(x: float):\n    if x <= 0:\n        raise ValueError(x)", False),
    ("def f(n):\n    if n < 1:\n        return 0", False),  # no raise: not an argument check
    ("def f(a, b):\n    if a % b != 0:\n        raise ValueError(a)", False),  # divisibility, not type
    ("def f(v, p):\n    if v > 1 and p == 1:\n        raise ValueError(v)", False),  # a condition, not a range
    ("def f(v):\n    if not v >= 1:\n        raise ValueError(v)", True),
])
def test_the_integer_check_detector_on_planted_examples(source, found):
    assert bool(_hand_written_int_checks(source, "p.py")) is found


def test_import_labkit_and_labkit_hardware_leave_torch_out():
    # a fresh interpreter, so that no test's earlier import of torch hides an eager import
    code = ("import sys, labkit, labkit.hardware, labkit.validate, labkit.version\n"
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", f"importing labkit imported torch modules: {out.stdout.strip()}"


def test_labkit_exports_still_load_on_first_use():
    import labkit

    assert callable(labkit.setup) and callable(labkit.seed_everything) and callable(labkit.pick_device)
    assert labkit.memory.MemoryMeter.__module__ == "labkit.memory.meter"  # a submodule, on first use
    with pytest.raises(AttributeError, match="no attribute 'not_a_module'"):
        labkit.not_a_module  # noqa: B018


def _lazy_packages() -> list[str]:
    return sorted(_module_name(p) for p in LABKIT.rglob("__init__.py")
                  if any(_is_lazy_table(node) for node in ast.walk(ast.parse(p.read_text()))))


def test_every_lazy_package_export_loads():
    # a name in __all__ that no table lists (or a table's typo) fails here, not in a reader's lab
    import importlib

    packages = _lazy_packages()
    assert {"labkit.memory", "labkit.zero", "labkit.parallel", "labkit.context_parallel", "labkit.moe",
            "labkit.expert_parallel"} <= set(packages)
    missing = [f"{name}.{export}" for name in packages for export in importlib.import_module(name).__all__
               if not hasattr(importlib.import_module(name), export)]
    assert not missing, f"listed in __all__ but not found: {missing}"
    import labkit.pipeline

    assert callable(labkit.pipeline.simulate)  # the function, though a submodule has its name


def test_the_end_of_backward_gradient_sum_is_written_once():
    # sequence parallelism and context parallelism share the core's sum, and neither rewrites it
    from labkit.collectives import GradSumAfterBackward
    from labkit.context_parallel import ContextParallelGradSum
    from labkit.tensor_parallel import SequenceParallelGradSync

    for technique in (SequenceParallelGradSync, ContextParallelGradSum):
        assert issubclass(technique, GradSumAfterBackward)
        assert not {"__init__", "_on_grad", "_finish"} & set(vars(technique)), technique


def test_import_labkit_estimate_leaves_torch_out():
    # the estimator runs where torch is not installed (a browser page): a fresh interpreter
    code = ("import sys, labkit.estimate, labkit.moe, labkit.expert_parallel.analytic\n"
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", f"importing labkit.estimate imported torch modules: {out.stdout.strip()}"
