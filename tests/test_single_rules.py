"""Each validity rule and formula of labkit lives in one function that every caller uses.

Two checks, read from the source with ``ast``: no two functions of labkit have the same body (up
to the names of their own arguments and local variables, and their docstrings), and no rule
function's name is defined a second time anywhere in labkit. Both are shown to catch a planted
second copy of a real rule: the body of ``interleave_allowed`` under another name, with its
arguments renamed, in another module; and a second ``check_zero``.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from collections import defaultdict
from pathlib import Path

import pytest

from labkit.pipeline import analytic as pipeline_analytic

ROOT = Path(__file__).resolve().parents[1]
LABKIT = ROOT / "labkit"
# The rules RunConfig.check and the planner go through, each in its one home.
RULES = {
    "check_pipeline": "labkit/pipeline/analytic.py", "default_schedule": "labkit/pipeline/analytic.py",
    "interleave_allowed": "labkit/pipeline/analytic.py", "check_zero": "labkit/zero/analytic.py",
    "check_sequence_parallel": "labkit/tensor_parallel/rules.py", "check_ep_size": "labkit/expert_parallel/analytic.py",
    "check_cp_seq_len": "labkit/context_parallel/analytic.py", "layer_split": "labkit/shape_rules.py",
    "layer_range": "labkit/shape_rules.py", "check_attention": "labkit/parallel/config.py",
    "runnable_reason": "labkit/parallel/compose.py", "check_context_len": "labkit/estimate/serving.py",
}
# Names defined twice on purpose. tensor_parallel.check_tp_size checks a built module's
# dimensions, the vocabulary included (labkit's tensor parallelism does not pad it);
# ModelShape.check_tp_size is the shape rule the planner uses (engines pad the vocabulary).
TWO_HOMES = {"check_tp_size": {"labkit/shapes.py:ModelShape.check_tp_size",
                               "labkit/tensor_parallel/apply.py:check_tp_size"}}
MIN_NODES = 30  # smaller bodies (a property, a one-line delegation) repeat without being rules


def _sources() -> dict[str, str]:
    return {str(p.relative_to(ROOT)): p.read_text() for p in sorted(LABKIT.rglob("*.py"))}


def _functions(sources: dict[str, str]) -> list[tuple[str, ast.FunctionDef]]:
    """('path:qualname', node) of every function and method."""
    found = []
    for path, source in sources.items():
        def visit(node, prefix):
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    found.append((f"{path}:{prefix}{child.name}", child))
                    visit(child, f"{prefix}{child.name}.")
                elif isinstance(child, ast.ClassDef):
                    visit(child, f"{prefix}{child.name}.")
                else:
                    visit(child, prefix)
        visit(ast.parse(source), "")
    return found


def _body_key(func) -> tuple[str, int]:
    """The body without its docstring, the function's own names (arguments, assigned names)
    numbered in order of appearance; and its size in nodes."""
    body = func.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
            and isinstance(body[0].value.value, str):
        body = body[1:]
    tree = ast.parse(ast.unparse(ast.Module(body=body, type_ignores=[])) or "pass")
    own = {a.arg for a in ast.walk(func.args) if isinstance(a, ast.arg)}
    own |= {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    numbers: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and node.id in own:
            node.id = numbers.setdefault(node.id, f"_{len(numbers)}")
    return ast.dump(tree, annotate_fields=False), sum(1 for _ in ast.walk(tree))


def _copies(sources: dict[str, str], min_nodes: int = MIN_NODES) -> list[list[str]]:
    """Groups of functions whose bodies are the same (see _body_key), of at least min_nodes nodes."""
    groups = defaultdict(list)
    for name, func in _functions(sources):
        key, size = _body_key(func)
        if size >= min_nodes:
            groups[key].append(name)
    return sorted(sorted(g) for g in groups.values() if len(g) > 1)


def _rules_defined_again(sources: dict[str, str]) -> list[str]:
    """Every definition of a rule's name outside its home, and names defined in more places than allowed."""
    by_name = defaultdict(set)
    for name, func in _functions(sources):
        by_name[func.name].add(name)
    found = [place for rule, home in RULES.items() for place in sorted(by_name[rule])
             if not place.startswith(f"{home}:")]
    found += [f"{rule}: {sorted(by_name[rule])}" for rule, home in RULES.items()
              if not any(p.startswith(f"{home}:") for p in by_name[rule])]
    found += [f"{name}: {sorted(places)}" for name, places in by_name.items()
              if name.startswith("check_") and len(places) > 1 and name not in RULES
              and places != TWO_HOMES.get(name)]
    return found


def test_no_function_body_is_written_twice():
    assert _copies(_sources()) == []


def test_each_rule_is_defined_once_in_its_home():
    assert _rules_defined_again(_sources()) == []


def _planted_copy() -> str:
    """interleave_allowed's body under another name, its arguments renamed, as a module."""
    source = textwrap.dedent(inspect.getsource(pipeline_analytic.interleave_allowed))
    func = ast.parse(source).body[0]
    renames = {a.arg: f"my_{a.arg}" for a in func.args.args}
    for node in ast.walk(func):
        if isinstance(node, ast.arg):
            node.arg = renames.get(node.arg, node.arg)
        elif isinstance(node, ast.Name):
            node.id = renames.get(node.id, node.id)
    func.name, func.body = "can_interleave", func.body[1:]  # and without its docstring
    return ast.unparse(func)


def test_the_copy_check_catches_a_planted_copy_of_a_rule():
    sources = _sources()
    assert _body_key(ast.parse(inspect.getsource(pipeline_analytic.interleave_allowed)).body[0])[1] >= MIN_NODES
    planted = {**sources, "labkit/plan/planted.py": _planted_copy()}
    assert _copies(planted) == [["labkit/pipeline/analytic.py:interleave_allowed",
                                 "labkit/plan/planted.py:can_interleave"]]


@pytest.mark.parametrize("planted, found", [
    ("def check_zero(zero_stage, replicas):\n    return zero_stage", ["labkit/plan/planted.py:check_zero"]),
    ("class P:\n    def check_pipeline(self):\n        return 1", ["labkit/plan/planted.py:P.check_pipeline"]),
    ("def check_batch(n):\n    return n", []),  # a new check with one home
])
def test_the_rule_check_catches_a_planted_second_definition(planted, found):
    assert _rules_defined_again({**_sources(), "labkit/plan/planted.py": planted}) == found


def test_a_new_check_defined_in_two_modules_is_caught():
    planted = "def check_batch(n):\n    return n"
    sources = {**_sources(), "labkit/plan/planted.py": planted, "labkit/runs/planted.py": planted}
    assert _rules_defined_again(sources) == [
        "check_batch: ['labkit/plan/planted.py:check_batch', 'labkit/runs/planted.py:check_batch']"]
