"""The exercise pipeline: otter assign builds, otter run grades, and nothing hidden leaks.

Builds each chapter once per test process into a temporary folder (scripts/exercises.py build,
without otter's own grading of the solutions: the first test here grades them), then grades the
solutions, an untouched student notebook, a submission with broken answers (a syntax error, a
function that loops when the tests call it, a cell that raises), and an endless loop with
scripts/exercises.py grade; scores plausible wrong answers against the hidden tests with otter's
own test classes (scripts/exercise_checks.py, one process a worker) and checks that each loses
exactly the points of the rules it breaks; checks statically that every answer cell stands alone
and every hidden assertion says what it expected. Each chapter is an xdist group of its own, so
under `-n 3 --dist loadgroup` the workers share the chapters and none is built twice.

The gradings that test what a grading computes run in kernels forked from a process that has
imported ipykernel, torch and labkit (tests/warm_kernels.py, the ``warm_kernels``
fixture): a kernel starts in a fraction of a second instead of spending 2.7 CPU-seconds on
imports. Their otter processes (and the builds' otter assign) are forked from one that has
imported otter and nbconvert (1.1 of their 1.5 CPU-seconds). The endless loop and the kernel too
slow to start test how a grading is started and stopped, so they keep real processes.
"""

from __future__ import annotations

import ast
import builtins
import importlib.util
import json
import os
import re
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "exercises.py"
CHECKS = ROOT / "scripts" / "exercise_checks.py"
COMMITTED_STUDENT_DIR = ROOT / "exercises" / "student"

# A test cell's config block: """ # BEGIN TEST CONFIG ... """ # END TEST CONFIG
CONFIG_RE = r'\s*"""\s*#\s*BEGIN TEST CONFIG(.*?)"""\s*#\s*END TEST CONFIG\n'

_spec = importlib.util.spec_from_file_location("exercises_script", SCRIPT)
ex = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ex)

CHAPTERS = list(ex.available_chapters())


def _group(chapter: str) -> str:
    return f"exercises-{chapter}"


# Each chapter's tests run on one worker, which builds that chapter once.
BY_CHAPTER = [pytest.param(c, marks=pytest.mark.xdist_group(_group(c)), id=c) for c in CHAPTERS]
_BUILT: dict = {}


@pytest.fixture(scope="session")
def exercises_tmp(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("exercises")


def _build(root: Path, chapter: str) -> dict:
    """One chapter built into root/dist and root/student, once per process:
    {"dist", "student", "zip"}."""
    if chapter not in _BUILT:
        dist, student = root / "dist", root / "student"
        zip_path = ex.build(chapter, dist_dir=dist, student_dir=student, run_tests=False)
        _BUILT[chapter] = {"dist": dist, "student": student, "zip": zip_path}
    return _BUILT[chapter]


@pytest.fixture
def built(exercises_tmp, chapter, warm_grader_server) -> dict:
    """The test's chapter, built (once per process; otter assign forked from the grader server)."""
    with pytest.MonkeyPatch.context() as mp:
        if warm_grader_server is not None:
            mp.setenv("EXERCISES_PYTHON", warm_grader_server)
        return _build(exercises_tmp, chapter)


def _source(cell) -> str:
    return "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]


def _all_strings(obj) -> list[str]:
    """Every string inside a JSON document (so escaped quotes in the file do not hide a match)."""
    if isinstance(obj, str):
        return [obj]
    if isinstance(obj, dict):
        return [s for k, v in obj.items() for s in [k, *_all_strings(v)]]
    if isinstance(obj, list):
        return [s for v in obj for s in _all_strings(v)]
    return []


def _readable_text(path: Path) -> str:
    raw = path.read_text(encoding="utf-8", errors="replace")
    if path.suffix in (".ipynb", ".json"):
        raw += "\n" + "\n".join(_all_strings(json.loads(raw)))
    return raw


def _hidden_test_needles(source_nb: Path) -> list[list[str]]:
    """For each hidden test cell of a source notebook, its code lines found in no other cell.

    Lines are taken both as written and as otter rewrites them (ast.unparse), since otter stores
    tests in that normal form.
    """
    cells = json.loads(source_nb.read_text())["cells"]
    hidden, others, in_tests = [], [], False
    for cell in cells:
        text = _source(cell)
        if cell["cell_type"] == "raw" and re.match(r"#\s*(BEGIN|END)\s+TESTS", text.strip()):
            in_tests = text.strip().split()[1] == "BEGIN"
            continue
        config = re.match(CONFIG_RE, text, re.S)
        if in_tests and config and re.search(r"hidden:\s*true", config.group(1)):
            body = text[config.end():]
            hidden.append(body.splitlines() + ast.unparse(ast.parse(body)).splitlines())
        else:
            others.append(text)
    elsewhere = "\n".join(others)
    needles = []
    for lines in hidden:
        distinct = {ln.strip() for ln in lines if len(ln.strip()) >= 12}
        needles.append(sorted(ln for ln in distinct if ln not in elsewhere))
    return needles


def _processes_of_run(run_id: str) -> list[int]:
    """pids of live processes of one grading run (they carry its token in their environment)."""
    pids = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            if f"{ex.TOKEN_ENV}={run_id}".encode() in (entry / "environ").read_bytes().split(b"\0"):
                pids.append(int(entry.name))
        except OSError:
            continue
    return pids


@pytest.mark.parametrize("chapter", BY_CHAPTER)
@pytest.mark.usefixtures("warm_kernels")
def test_solution_scores_full_marks(built, chapter, tmp_path):
    solution = built["dist"] / chapter / "autograder" / f"{chapter}.ipynb"
    submission = tmp_path / "my.ipynb"  # a student's own file name, not the chapter's
    submission.write_bytes(solution.read_bytes())
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "grade", str(submission), "--timeout", "300",
         "--dist-dir", str(built["dist"])],
        capture_output=True, text=True, timeout=400,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    points = ex.question_points(built["zip"])
    assert len(points) >= 3 and all(p > 0 for p in points.values()), points
    for q, p in points.items():
        assert re.search(rf"^\s*{q}\s+{p:.2f} / {p:g}$", proc.stdout, re.M), proc.stdout
    total = sum(points.values())
    assert re.search(rf"^\s*total\s+{total:.2f} / {total:g}$", proc.stdout, re.M), proc.stdout


@pytest.mark.parametrize("chapter", BY_CHAPTER)
@pytest.mark.usefixtures("warm_kernels")
def test_untouched_student_notebook_scores_zero(built, chapter):
    result = ex.grade(built["student"] / f"{chapter}.ipynb", timeout=300, dist_dir=built["dist"])
    assert not result["timed_out"]
    assert result["max_total"] > 0 and set(result["scores"]) == set(result["max_scores"])
    assert result["scores"] == {q: 0.0 for q in result["max_scores"]}
    # one line per question, not a failure per test case
    assert result["failures"] == {q: ["not answered yet (its answer cell is as handed out)"]
                                  for q in result["max_scores"]}, result["failures"]


@pytest.mark.parametrize("chapter", BY_CHAPTER)
def test_hidden_tests_never_reach_students(built, chapter):
    needles = _hidden_test_needles(ex.SOURCE_DIR / f"{chapter}.ipynb")
    assert needles and all(needles), f"every hidden test needs a distinctive line: {needles}"
    # The scan finds them where they belong: in the autograder.
    with zipfile.ZipFile(built["zip"]) as z:
        autograder = "\n".join(z.read(n).decode() for n in z.namelist() if n.startswith("tests/"))
    for lines in needles:
        assert any(ln in autograder for ln in lines), f"hidden test not in the autograder: {lines}"
    # ... and nowhere a student looks: the built student folder and the committed notebook.
    student_files = [p for p in (built["dist"] / chapter / "student").rglob("*") if p.is_file()]
    student_files += [built["student"] / f"{chapter}.ipynb",
                      COMMITTED_STUDENT_DIR / f"{chapter}.ipynb"]
    for path in student_files:
        text = _readable_text(path)
        leaked = [ln for lines in needles for ln in lines if ln in text]
        assert not leaked, f"{path} contains hidden test code: {leaked[:3]}"


def _bound_and_free(code: str) -> tuple[set, set]:
    """Names a cell binds (assignments, imports, defs, arguments) and names it uses unbound."""
    bound, used = set(), set()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Name):
            (bound if isinstance(node.ctx, (ast.Store, ast.Del)) else used).add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            bound |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, ast.ExceptHandler) and node.name:
            bound.add(node.name)
    return bound, used - bound


def _answers_and_setup(source_nb: Path) -> tuple[list, list]:
    """(question, code) of every solution cell of a source notebook, and the code cells that
    stand outside any question (the setup every answer may use)."""
    answers, setup, question, in_solution = [], [], None, False
    for cell in json.loads(source_nb.read_text())["cells"]:
        text = _source(cell).strip()
        if cell["cell_type"] == "raw":
            begin = re.match(r"#\s*BEGIN QUESTION\s*\nname:\s*(\S+)", text)
            if begin or re.match(r"#\s*END QUESTION", text):
                question = begin.group(1) if begin else None
            elif re.match(r"#\s*(BEGIN|END) SOLUTION", text):
                in_solution = text.split()[1] == "BEGIN"
        elif cell["cell_type"] == "code":
            if in_solution:
                answers.append((question, text))
            elif question is None:
                setup.append(text)
    return answers, setup


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_every_answer_cell_stands_alone(chapter):
    """No answer uses a name that only another answer defines (an import in q1 used by q3, say):
    a broken answer then costs its own question only, for every question at once."""
    answers, setup = _answers_and_setup(ex.SOURCE_DIR / f"{chapter}.ipynb")
    assert answers, f"{chapter}: no solution cells found"
    available = set(dir(builtins)).union(*(_bound_and_free(code)[0] for code in setup))
    for question, code in answers:
        missing = _bound_and_free(code)[1] - available
        assert not missing, f"{chapter} {question}: the answer uses {sorted(missing)}, defined " \
                            "in no setup cell; import or define it in the answer's own cell"


def _filled_in(built, chapter, edition: str = "") -> dict:
    """The student notebook (``edition`` "zh": the Chinese one) with every answer cell holding the
    solution, as a student writes it."""
    nb = json.loads((built["student"] / edition / f"{chapter}.ipynb").read_text())
    solved = json.loads((built["dist"] / chapter / "autograder" / f"{chapter}.ipynb").read_text())
    answers = [c for c in nb["cells"] if "otter_answer_cell" in c["metadata"].get("tags", [])]
    solutions = [c for c in solved["cells"]
                 if "otter_assign_solution_cell" in c["metadata"].get("tags", [])]
    assert len(answers) == len(solutions) >= 2, (len(answers), len(solutions))
    for answer, solution in zip(answers, solutions):
        answer["source"] = _source(solution)
    return nb


LOOP_IN_TESTS_CHAPTER = "06_pipeline"  # where a function loops only when the tests call it


@pytest.mark.parametrize("chapter", BY_CHAPTER)
@pytest.mark.usefixtures("warm_kernels")
def test_one_broken_answer_costs_only_its_question(built, chapter, tmp_path):
    """A syntax error in q1's cell costs q1 alone and is reported as the syntax error it is. In the
    first chapter q2's cell also loops at its top (interrupted by the cell limit); in chapter 6
    q2's function loops only when the tests call it (its tests are cut off by the question's
    limit, which names q2) and q3's cell raises after defining its answer (full marks, and a
    notice that the cell raised)."""
    nb = _filled_in(built, chapter)
    answers = [c for c in nb["cells"] if "otter_answer_cell" in c["metadata"].get("tags", [])]
    answers[0]["source"] += "\nthis line is not Python (\n"  # a syntax error in q1's cell
    broken, notices = {"q1"}, {"q1": "SyntaxError"}
    if chapter == CHAPTERS[0]:  # and, in one chapter, an endless loop at the top of q2's cell
        answers[1]["source"] = "while True:\n    pass\n" + answers[1]["source"]
        broken.add("q2")
        notices["q2"] = "interrupted after 5 s"
    if chapter == LOOP_IN_TESTS_CHAPTER:
        loop = "\n\ndef min_microbatches(p, target):\n    while True:\n        pass\n"
        answers[1]["source"] += loop
        answers[2]["source"] += "\nraise RuntimeError('a stray line after the answer')\n"
        broken.add("q2")
        notices["q3"] = "RuntimeError: a stray line"
    submission = tmp_path / "broken.ipynb"
    submission.write_text(json.dumps(nb))
    result = ex.grade(submission, timeout=240, cell_timeout=5, question_timeout=5,
                      dist_dir=built["dist"])
    assert not result["timed_out"]
    assert sorted(result["max_scores"])[:2] == ["q1", "q2"], result["max_scores"]
    for q, points in result["max_scores"].items():
        if q in broken:
            assert result["scores"][q] == 0, (q, result)
            assert result["failures"][q], f"{q}: no failed case reported"
            assert all(re.match(r"(public|hidden) test \d+( \[.*\])?: .*\w+Error", why)
                       for why in result["failures"][q]), result["failures"][q]
        else:
            assert result["scores"][q] == points and not result["failures"][q], (q, result)
        said = result["notices"][q]
        assert (notices[q] in " ".join(said)) if q in notices else not said, (q, said)
    if chapter == LOOP_IN_TESTS_CHAPTER:
        assert all("TimeoutError: q2 ran past its time limit of 5 s" in why
                   for why in result["failures"]["q2"]), result["failures"]["q2"]


@pytest.mark.xdist_group(_group(CHAPTERS[0]))
@pytest.mark.parametrize("chapter", [CHAPTERS[0]])
def test_endless_loop_is_cut_off_and_scores_zero(built, chapter, tmp_path):
    """An endless loop in the grading cell (no limit per cell here: 60 s > the run's limit) is
    stopped at the run's limit, kernel and all. The loop first writes a file, so the test knows
    the kernel reached it; on a machine too busy to start the kernel within the limit it tries
    again with a limit three times as long, twice at most (a slow start proves nothing about the
    loop)."""
    nb = json.loads((built["student"] / f"{chapter}.ipynb").read_text())
    answer = next(c for c in nb["cells"] if "otter_answer_cell" in c["metadata"].get("tags", []))
    marker = tmp_path / "the loop started"
    answer["source"] = f"open({str(marker)!r}, 'w').close()\nwhile True:\n    pass\n"
    submission = tmp_path / "loop.ipynb"
    submission.write_text(json.dumps(nb))
    for limit in (8, 24, 72):
        start = time.monotonic()
        result = ex.grade(submission, timeout=limit, cell_timeout=60, dist_dir=built["dist"])
        elapsed = time.monotonic() - start
        if marker.exists():
            break
    assert marker.exists(), f"the kernel never reached the loop within {limit} s"
    assert result["timed_out"]
    assert result["scores"] == {q: 0.0 for q in result["max_scores"]} and result["max_total"] > 0
    assert elapsed < limit + 15, f"grading took {elapsed:.0f} s with a {limit} s timeout"
    # No grace period: the kernel runs in a session of its own and would linger ~1 s if only
    # otter's process group were killed.
    assert not _processes_of_run(result["run_id"]), "otter or its kernel outlived the timeout"


@pytest.mark.parametrize("chapter", BY_CHAPTER)
def test_committed_student_notebooks_are_up_to_date(built, chapter):
    assert (COMMITTED_STUDENT_DIR / f"{chapter}.ipynb").is_file(), \
        f"exercises/student/{chapter}.ipynb is missing: python scripts/exercises.py build {chapter}"
    fresh = json.loads((built["student"] / f"{chapter}.ipynb").read_text())
    old = json.loads((COMMITTED_STUDENT_DIR / f"{chapter}.ipynb").read_text())
    regenerate = f"regenerate it: python scripts/exercises.py build {chapter}"
    cells = [[(c["cell_type"], _source(c)) for c in nb["cells"]] for nb in (old, fresh)]
    assert cells[0] == cells[1], f"{chapter}: cells differ; {regenerate}"
    assert old["metadata"].get("otter") == fresh["metadata"].get("otter"), \
        f"{chapter}: public tests differ; {regenerate}"


def test_every_source_has_a_committed_student_notebook():
    committed = sorted(p.stem for p in COMMITTED_STUDENT_DIR.glob("*.ipynb"))
    assert committed == sorted(CHAPTERS), "exercises/student/ and exercises/source/ differ"


@pytest.mark.parametrize("args, named", [
    (["build", "99_no_such_chapter"], "99_no_such_chapter"),
    (["grade", "no_such_submission.ipynb"], "no_such_submission.ipynb"),
    (["grade", str(SCRIPT)], "exercises.py"),  # exists, but is not a notebook
])
def test_bad_arguments_name_the_argument(args, named):
    proc = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert named in proc.stderr and proc.stderr.startswith("error:"), proc.stderr


def _hidden_test_bodies(source_nb: Path) -> list[str]:
    """The code of every hidden test cell of a source notebook (its config block removed)."""
    bodies = []
    for cell in json.loads(source_nb.read_text())["cells"]:
        config = re.match(CONFIG_RE, _source(cell), re.S)
        if cell["cell_type"] == "code" and config and re.search(r"hidden:\s*true", config.group(1)):
            bodies.append(_source(cell)[config.end():])
    return bodies


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_every_hidden_assertion_says_what_it_expected(chapter):
    """A hidden test shows a student only its error line, so every assert carries a message."""
    bodies = _hidden_test_bodies(ex.SOURCE_DIR / f"{chapter}.ipynb")
    assert bodies, f"{chapter}: no hidden tests found"
    for body in bodies:
        for node in ast.walk(ast.parse(body)):
            if isinstance(node, ast.Assert):
                assert node.msg is not None, \
                    f"{chapter}: hidden `assert {ast.unparse(node.test)[:60]}` has no message"
                assert "expected" in ast.unparse(node.msg), \
                    f"{chapter}: hidden assert message says no 'expected': {ast.unparse(node.msg)}"


# Plausible wrong answers, each of which scored full marks before a hidden case was added for it:
# (chapter, question, the mistake, code run after the solution cells that redefines one function).
WRONG_ANSWERS = [
    ("02_zero", "q2", "only a stage above 3 rejected",
     ('a stage past either end (4, -1) raises ValueError naming stage', 'a bool or a float stage (True, 2.0) raises ValueError naming stage'), '''
def zero_bytes_per_rank(n_params, world_size, stage):
    if stage > 3:
        raise ValueError(f"stage={stage!r} must be 0, 1, 2 or 3")
    shard = -(-n_params // world_size)
    params = 2 * (shard if stage >= 3 else n_params)
    grads = 2 * (shard if stage >= 2 else n_params)
    optimizer = 12 * (shard if stage >= 1 else n_params)
    return {"params": params, "grads": grads, "optimizer": optimizer, "total": params + grads + optimizer}
'''),
    ("02_zero", "q2", "a bool accepted as a stage",
     ('a bool or a float stage (True, 2.0) raises ValueError naming stage',), '''
def zero_bytes_per_rank(n_params, world_size, stage):
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage={stage!r} must be 0, 1, 2 or 3")
    shard = -(-n_params // world_size)
    params = 2 * (shard if stage >= 3 else n_params)
    grads = 2 * (shard if stage >= 2 else n_params)
    optimizer = 12 * (shard if stage >= 1 else n_params)
    return {"params": params, "grads": grads, "optimizer": optimizer, "total": params + grads + optimizer}
'''),
    ("02_zero", "q4", "only a negative stage rejected",
     ('a stage past either end (-1, 4) raises ValueError naming stage', 'a bool or a float stage (True, 3.0) raises ValueError naming stage'), '''
def comm_elements_per_step(group_numels, world_size, stage):
    if stage < 0:
        raise ValueError(f"stage={stage!r} must be 0, 1, 2 or 3")
    if stage == 0:
        return 2 * sum(group_numels)
    padded = sum(-(-n // world_size) * world_size for n in group_numels)
    return (3 if stage == 3 else 2) * padded
'''),
    ("03_checkpointing", "q3", "a bool or a float accepted as k",
     ("'every_k' with a bool or a float k (True, 2.0) raises ValueError naming k",), '''
_policy_activation_bytes = policy_activation_bytes
def policy_activation_bytes(s, b, h, a, n_layer, policy, k=None, t=1, sequence_parallel=False):
    if policy == "every_k" and (k is None or k < 1):
        raise ValueError(f"k={k!r} must be >= 1 for policy='every_k'")
    if policy == "every_k":  # k=True or k=2.0 go through: n_layer // k counts the full layers
        whole = _policy_activation_bytes(s, b, h, a, 1, "none", t=t, sequence_parallel=sequence_parallel)
        n_full = n_layer // k
        return n_full * 2 * s * b * h + (n_layer - n_full) * whole
    return _policy_activation_bytes(s, b, h, a, n_layer, policy, t=t, sequence_parallel=sequence_parallel)
'''),
    ("04_accumulation", "q1", "token id 0 taken for padding",
     ('token id 0 is a real token: only -100 is padding',), '''
def microbatch_loss_scales(targets):
    n_window = sum(int((y > 0).sum()) for y in targets)
    if n_window == 0:
        raise ValueError("targets: the window has no real tokens")
    return [1.0 / n_window for _ in targets]
'''),
    ("04_accumulation", "q1", "scales as float32 tensors, not floats: 1/N rounded to float32",
     ('the scales are Python floats', 'the accumulated gradient equals one full-batch gradient, for uneven micro-batches',
      'a micro-batch without real tokens is fine: scale 1/N, like the others',
      'token id 0 is a real token: only -100 is padding'), '''
def microbatch_loss_scales(targets):
    n_window = sum((y != -100).sum() for y in targets)
    if n_window == 0:
        raise ValueError("targets: the window has no real tokens")
    return [1.0 / n_window for _ in targets]
'''),
    ("04_accumulation", "q3", "a bool or a float accepted as a count",
     ('a bool or a float count raises ValueError naming it',), '''
def allreduce_calls(num_steps, num_microbatches, num_buckets, use_no_sync):
    for name, value, low in [("num_steps", num_steps, 0), ("num_microbatches", num_microbatches, 1),
                             ("num_buckets", num_buckets, 1)]:
        if value < low:
            raise ValueError(f"{name}={value!r} must be >= {low}")
    return num_steps * (1 if use_no_sync else num_microbatches) * num_buckets
'''),
    ("05_tensor_parallel", "q2", "partials checked only in sum: y split evenly over the ranks",
     ("partials[r] is rank r's heads times its columns of w_proj, without the bias",), '''
_attention_tp = attention_tp
def attention_tp(x, w_qkv, b_qkv, w_proj, b_proj, n_head, t):
    y, _ = _attention_tp(x, w_qkv, b_qkv, w_proj, b_proj, n_head, t)
    return y, [(y - b_proj) / t for _ in range(t)]
'''),
    ("05_tensor_parallel", "q2", "partials in the wrong rank order",
     ("partials[r] is rank r's heads times its columns of w_proj, without the bias",), '''
_attention_tp = attention_tp
def attention_tp(x, w_qkv, b_qkv, w_proj, b_proj, n_head, t):
    y, partials = _attention_tp(x, w_qkv, b_qkv, w_proj, b_proj, n_head, t)
    return y, partials[::-1]
'''),
    ("05_tensor_parallel", "q3", "max_t ignored: t searched over 1, 2, 4, 8",
     ('max_t widens or narrows the search; a t that does not divide a is skipped',), '''
def smallest_t(s, b, h, a, n_layer, budget, sequence_parallel, max_t=8):
    for t in (1, 2, 4, 8):
        if a % t == 0 and n_layer * layer_activation_bytes(s, b, h, a, t, sequence_parallel) <= budget:
            return t
    raise ValueError(f"budget={budget} bytes is too small for any t: recompute instead")
'''),
    ("05_tensor_parallel", "q3", "a budget that must be strictly larger",
     ('a budget equal to the bytes fits (<=)',), '''
def smallest_t(s, b, h, a, n_layer, budget, sequence_parallel, max_t=8):
    t = 1
    while t <= max_t:
        if a % t == 0 and n_layer * layer_activation_bytes(s, b, h, a, t, sequence_parallel) < budget:
            return t
        t *= 2
    raise ValueError(f"budget={budget} bytes is too small for any t <= max_t={max_t}")
'''),
    ("06_pipeline", "q1", "no check of pp_size < 1 or of rank",
     ('pp_size below 1 or above n_layer raises ValueError naming pp_size', 'a rank outside [0, pp_size) raises ValueError naming rank'), '''
def stage_layers(n_layer, pp_size, rank):
    if pp_size > n_layer:
        raise ValueError(f"pp_size={pp_size} exceeds n_layer={n_layer}")
    base, extra = divmod(n_layer, pp_size)
    start = rank * base + min(rank, extra)
    return start, start + base + (rank < extra)
'''),
    ("06_pipeline", "q2", "the micro-batch count in floating point (13 at p = 4, target 0.2)",
     ('min_microbatches: the smallest m, also where the target sits exactly on a bubble',), '''
import math
def min_microbatches(p, target):
    return max(1, math.ceil((p - 1) * (1 - target) / target))
'''),
    ("06_pipeline", "q2", "a float count",
     ('min_microbatches returns an int',), '''
def min_microbatches(p, target):
    m = 1.0
    while bubble(p, m, "gpipe") > target:
        m += 1
    return m
'''),
    ("07_flash_attention", "q2", "every tile kept: the row rebuilt, then one logsumexp",
     ('only m and l stay between tiles',), '''
def row_lse(tiles):
    tiles = [t for t in tiles if t.numel()]
    return torch.logsumexp(torch.cat(tiles), 0).item() if tiles else float("-inf")
'''),
    ("07_flash_attention", "q2", "the running maximum started at 0: very negative rows underflow",
     ('rows of very negative scores, where e^x underflows to 0 for every entry',), '''
def row_lse(tiles):
    m, l = 0.0, 0.0
    for tile in tiles:
        if tile.numel() == 0:
            continue
        m_new = max(m, tile.max().item())
        l = math.exp(m - m_new) * l + (tile - m_new).exp().sum().item()
        m = m_new
    return m + math.log(l) if l > 0 else float("-inf")
'''),
    ("07_flash_attention", "q2", "a 0-d tensor returned, not a float",
     ('L is a Python float',), '''
def row_lse(tiles):
    m, l = float("-inf"), torch.tensor(0.0, dtype=torch.float64)
    for tile in tiles:
        if tile.numel() == 0:
            continue
        m_new = max(m, tile.max().item())
        if m_new == float("-inf"):
            continue
        l = l * math.exp(m - m_new) + (tile - m_new).exp().sum()
        m = m_new
    return m + torch.log(l) if l > 0 else float("-inf")
'''),
    ("07_flash_attention", "q3", "the tile inequality taken strictly",
     ('the tile size B: M on the equality 4Bd + B^2 = M allows that B',), '''
def hbm_forward(N, d, M, kind):
    if kind == "standard":
        return 4 * N * N + 4 * N * d
    if kind != "flash" or M < 4 * d + 1:
        raise ValueError(f"kind={kind!r}, M={M}")
    B = 1
    while (B + 1) ** 2 + 4 * d * (B + 1) < M:
        B += 1
    return N * d + -(-N // B) * 2 * N * d + N * d + N
'''),
    ("08_paged_attention", "q1", "only zero rejected, and neither head_dim nor batch_size checked",
     ('a zero or negative n_layer, n_kv_heads, head_dim or dtype_bytes raises ValueError naming it', 'a negative context_len or batch_size raises ValueError naming it'), '''
def kv_cache_bytes(n_layer, n_kv_heads, head_dim, dtype_bytes, context_len, batch_size=1):
    for name, value in [("n_layer", n_layer), ("n_kv_heads", n_kv_heads), ("dtype_bytes", dtype_bytes)]:
        if value == 0 or (name == "n_kv_heads" and value < 0):
            raise ValueError(f"{name}={value!r} must be positive")
    if context_len < 0:
        raise ValueError(f"context_len={context_len!r} must be non-negative")
    return 2 * n_layer * n_kv_heads * head_dim * dtype_bytes * context_len * batch_size
'''),
    ("08_paged_attention", "q2", "a float block_size accepted",
     ('a float or a bool block_size (16.0, True) raises ValueError naming block_size',), '''
def blocks_for_batch(lengths, block_size):
    if block_size <= 0:
        raise ValueError(f"block_size={block_size!r} must be a positive int")
    blocks = sum(-(-n // block_size) for n in lengths)
    return blocks, blocks * block_size - sum(lengths)
'''),
    ("08_paged_attention", "q3", "generated == 0 with a partial prompt block ((20, 0, 2, 16) gives 3)",
     ('nothing generated: nobody writes, so a partial prompt block is not copied',), '''
def sampling_blocks(prompt_len, generated, n, block_size):
    total = -(-(prompt_len + generated) // block_size)
    shared = prompt_len // block_size
    return shared + n * (total - shared), n * total
'''),
    ("10_context_parallel", "q1", "chunks i and cp - 1 - i: mirrored within cp chunks, not 2 cp",
     ('rank i holds chunks i and 2cp - 1 - i, early chunk first',), '''
def zigzag_positions(seq_len, cp_size, rank):
    if seq_len % (2 * cp_size):
        raise ValueError(f"seq_len={seq_len} must be divisible by 2 * cp_size")
    if not 0 <= rank < cp_size:
        raise ValueError(f"rank={rank} must be in [0, cp_size)")
    c = seq_len // (2 * cp_size)
    return list(range(2 * rank * c, (2 * rank + 1) * c)) + list(range((2 * (cp_size - 1 - rank) + 1) * c,
                                                                      (2 * (cp_size - 1 - rank) + 2) * c))
'''),
    ("10_context_parallel", "q1", "only cp checked to divide seq_len",
     ('a seq_len that 2 cp does not divide raises ValueError naming seq_len (even when cp divides it)',), '''
def zigzag_positions(seq_len, cp_size, rank):
    if seq_len % cp_size:
        raise ValueError(f"seq_len={seq_len} must be divisible by cp_size")
    if not 0 <= rank < cp_size:
        raise ValueError(f"rank={rank} must be in [0, cp_size)")
    c = seq_len // (2 * cp_size)
    late = 2 * cp_size - 1 - rank
    return list(range(rank * c, (rank + 1) * c)) + list(range(late * c, (late + 1) * c))
'''),
    ("10_context_parallel", "q2", "the shard sent cp times, to itself too",
     ("cp - 1 messages of the rank's K and V shards",), '''
def ring_bytes_sent(batch_size, seq_len, n_kv_head, head_dim, cp_size, dtype_bytes):
    if seq_len % cp_size:
        raise ValueError(f"seq_len={seq_len} must be divisible by cp_size={cp_size}")
    return 2 * batch_size * seq_len * n_kv_head * head_dim * dtype_bytes
'''),
    ("10_context_parallel", "q2", "K alone, without V",
     ("cp - 1 messages of the rank's K and V shards",), '''
def ring_bytes_sent(batch_size, seq_len, n_kv_head, head_dim, cp_size, dtype_bytes):
    if seq_len % cp_size:
        raise ValueError(f"seq_len={seq_len} must be divisible by cp_size={cp_size}")
    return (cp_size - 1) * batch_size * (seq_len // cp_size) * n_kv_head * head_dim * dtype_bytes
'''),
    ("10_context_parallel", "q2", "a float from (cp - 1) / cp",
     ('the bytes are an int',), '''
def ring_bytes_sent(batch_size, seq_len, n_kv_head, head_dim, cp_size, dtype_bytes):
    if seq_len % cp_size:
        raise ValueError(f"seq_len={seq_len} must be divisible by cp_size={cp_size}")
    return 2 * (cp_size - 1) / cp_size * batch_size * seq_len * n_kv_head * head_dim * dtype_bytes
'''),
    ("10_context_parallel", "q3", "the long-chunk limit: (2j + 1) c^2 / 2 per chunk, own key not counted",
     ('the contiguous layout, counted query by query', 'the zigzag layout, counted query by query'), '''
def causal_pairs_of_rank(seq_len, cp_size, rank, layout):
    if layout not in ("contiguous", "zigzag"):
        raise ValueError(f"layout={layout!r} must be 'contiguous' or 'zigzag'")
    n = cp_size if layout == "contiguous" else 2 * cp_size
    chunks = [rank] if layout == "contiguous" else [rank, 2 * cp_size - 1 - rank]
    c = seq_len // n
    return sum((2 * j + 1) * c * c // 2 for j in chunks)
'''),
    ("11_moe", "q1", "top-k probabilities not renormalised (they add to less than one)",
     ('the weights are the chosen probabilities renormalised to add to one',), '''
def top_k_route(logits, k):
    import math
    if not 1 <= k <= len(logits):
        raise ValueError(f"k={k} must be in [1, E]")
    z = sum(math.exp(x) for x in logits)
    probs = [math.exp(x) / z for x in logits]
    chosen = sorted(range(len(logits)), key=lambda e: (-probs[e], e))[:k]
    return [(e, probs[e]) for e in chosen]
'''),
    ("11_moe", "q1", "only k > E refused: k = 0 and negative k slip through",
     ('a k outside [1, n_experts] raises ValueError naming k',), '''
def top_k_route(logits, k):
    import math
    if k > len(logits):
        raise ValueError(f"k={k} must not exceed E")
    z = sum(math.exp(x) for x in logits)
    probs = [math.exp(x) / z for x in logits]
    chosen = sorted(range(len(logits)), key=lambda e: (-probs[e], e))[:k]
    kept = sum(probs[e] for e in chosen)
    return [(e, probs[e] / kept) for e in chosen]
'''),
    ("11_moe", "q2", "capacity rounded down (floor): a balanced batch at cf = 1 drops a row an expert",
     ('C = ceil(cf N k / E), rounded up',), '''
def expert_capacity(tokens, n_experts, experts_per_token, capacity_factor):
    if not capacity_factor > 0:
        raise ValueError(f"capacity_factor={capacity_factor} must be above 0")
    return int(capacity_factor * tokens * experts_per_token / n_experts)
'''),
    ("11_moe", "q2", "cf N k / E not rounded at all (a float)",
     ('C = ceil(cf N k / E), rounded up', 'the capacity is an int'), '''
def expert_capacity(tokens, n_experts, experts_per_token, capacity_factor):
    if not capacity_factor > 0:
        raise ValueError(f"capacity_factor={capacity_factor} must be above 0")
    return capacity_factor * tokens * experts_per_token / n_experts
'''),
    ("11_moe", "q3", "reduced over the ep group (ranks holding different experts), not the replicas",
     ('each rank sums over the ranks holding the same experts (rank % ep_size equal)',
      'the sum is divided by dp_size, the number of data-parallel ranks'), '''
def reduce_expert_grads(grads, ep_size):
    dp = len(grads)
    if ep_size < 1 or dp % ep_size:
        raise ValueError(f"ep_size={ep_size} must divide {dp}")
    return [sum(grads[s] for s in range(dp) if s // ep_size == r // ep_size) / dp for r in range(dp)]
'''),
    ("11_moe", "q3", "averaged over the replicas (divided by dp / ep, not dp): ep times too large",
     ('the sum is divided by dp_size, the number of data-parallel ranks',), '''
def reduce_expert_grads(grads, ep_size):
    dp = len(grads)
    if ep_size < 1 or dp % ep_size:
        raise ValueError(f"ep_size={ep_size} must divide {dp}")
    return [sum(grads[s] for s in range(dp) if s % ep_size == r % ep_size) / (dp // ep_size) for r in range(dp)]
'''),
    ("11_moe", "q3", "averaged over every data-parallel rank, as a dense gradient is",
     ('each rank sums over the ranks holding the same experts (rank % ep_size equal)',
      'the sum is divided by dp_size, the number of data-parallel ranks'), '''
def reduce_expert_grads(grads, ep_size):
    dp = len(grads)
    if ep_size < 1 or dp % ep_size:
        raise ValueError(f"ep_size={ep_size} must divide {dp}")
    return [sum(grads) / dp] * dp
'''),
    ("11_moe", "q4", "active and total confused (returned in the other order)",
     ('total counts every expert of every MoE layer, the routers and the other parameters',
      'active counts k experts a MoE layer, with the routers and the other parameters in full'), '''
def moe_param_counts(other_params, n_moe_layers, d_model, d_expert, n_experts, experts_per_token):
    if not 1 <= experts_per_token <= n_experts:
        raise ValueError(f"experts_per_token={experts_per_token} must be in [1, n_experts]")
    router, expert = d_model * n_experts, 3 * d_model * d_expert
    total = other_params + n_moe_layers * (router + n_experts * expert)
    active = other_params + n_moe_layers * (router + experts_per_token * expert)
    return active, total
'''),
    ("11_moe", "q4", "active as k / E of the total: the shared parameters scaled down too",
     ('active counts k experts a MoE layer, with the routers and the other parameters in full',), '''
def moe_param_counts(other_params, n_moe_layers, d_model, d_expert, n_experts, experts_per_token):
    if not 1 <= experts_per_token <= n_experts:
        raise ValueError(f"experts_per_token={experts_per_token} must be in [1, n_experts]")
    total = other_params + n_moe_layers * (d_model * n_experts + n_experts * 3 * d_model * d_expert)
    return total, total * experts_per_token // n_experts
'''),
    ("09_planning", "q1", "the fp32 master weights forgotten (8 bytes of optimizer state, not 12)",
     ('the smallest N_d whose bytes per GPU fit, or None', 'a trillion parameters on 80 GB GPUs, without trying every N_d'), '''
def min_dp_size(n_params, gpu_bytes, zero_stage, activation_bytes=0):
    if isinstance(zero_stage, bool) or zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage={zero_stage!r} must be 0, 1, 2 or 3")
    fixed, sharded = {0: (12, 0), 1: (4, 8), 2: (2, 10), 3: (0, 12)}[zero_stage]
    room = gpu_bytes - activation_bytes - fixed * n_params
    if sharded == 0:
        return 1 if room >= 0 else None
    most = room // sharded
    if most < 1:
        return None
    return -(-n_params // most)
'''),
    ("09_planning", "q1", "the shard taken as n_params / N_d, without the padding",
     ('the smallest N_d whose bytes per GPU fit, or None',), '''
def min_dp_size(n_params, gpu_bytes, zero_stage, activation_bytes=0):
    if isinstance(zero_stage, bool) or zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage={zero_stage!r} must be 0, 1, 2 or 3")
    fixed, sharded = {0: (16, 0), 1: (4, 12), 2: (2, 14), 3: (0, 16)}[zero_stage]
    room = gpu_bytes - activation_bytes - fixed * n_params
    if sharded == 0:
        return 1 if room >= 0 else None
    if room <= 0:
        return None
    return -(-sharded * n_params // room)
'''),
    ("09_planning", "q2", "the fp32 master weights forgotten",
     ('the fitting stage that sends the fewest elements, the lowest among equals', 'None exactly when no stage fits'), '''
def cheapest_zero_stage(n_params, dp_size, gpu_bytes, activation_bytes):
    shard = -(-n_params // dp_size)
    for stage in (0, 1, 2, 3):
        weights = 2 * (shard if stage >= 3 else n_params)
        grads = 2 * (shard if stage >= 2 else n_params)
        optimizer = 8 * (shard if stage >= 1 else n_params)
        if weights + grads + optimizer + activation_bytes <= gpu_bytes:
            return stage, (3 if stage == 3 else 2) * n_params
    return None
'''),
    ("09_planning", "q2", "the stage with the least memory, whatever it sends",
     ('the fitting stage that sends the fewest elements, the lowest among equals',), '''
def cheapest_zero_stage(n_params, dp_size, gpu_bytes, activation_bytes):
    shard = -(-n_params // dp_size)
    if 16 * shard + activation_bytes <= gpu_bytes:
        return 3, 3 * n_params
    return None
'''),
    ("09_planning", "q3", "K and V's factor 2 forgotten",
     ('the KV blocks of requests whose length is a whole number of blocks', 'a request takes whole blocks: ceil(context_len / block_size) of them'), '''
def max_concurrency(n_layer, d_model, n_head, n_kv_heads, n_params, gpu_bytes, context_len, *,
                    block_size=16, weight_bytes=2, kv_bytes=2, utilization=0.9, overhead_bytes=0):
    head_dim = d_model // n_head
    block = block_size * n_layer * n_kv_heads * head_dim * kv_bytes
    free = int(utilization * gpu_bytes) - weight_bytes * n_params - overhead_bytes
    return (max(free, 0) // block) // -(-context_len // block_size)
'''),
    ("09_planning", "q3", "grouped-query attention forgotten (n_head key-value heads)",
     ('the KV blocks of requests whose length is a whole number of blocks', 'a request takes whole blocks: ceil(context_len / block_size) of them'), '''
def max_concurrency(n_layer, d_model, n_head, n_kv_heads, n_params, gpu_bytes, context_len, *,
                    block_size=16, weight_bytes=2, kv_bytes=2, utilization=0.9, overhead_bytes=0):
    head_dim = d_model // n_head
    block = block_size * 2 * n_layer * n_head * head_dim * kv_bytes
    free = int(utilization * gpu_bytes) - weight_bytes * n_params - overhead_bytes
    return (max(free, 0) // block) // -(-context_len // block_size)
'''),
    ("09_planning", "q3", "the tokens' bytes pooled, without whole blocks per request",
     ('a request takes whole blocks: ceil(context_len / block_size) of them',), '''
def max_concurrency(n_layer, d_model, n_head, n_kv_heads, n_params, gpu_bytes, context_len, *,
                    block_size=16, weight_bytes=2, kv_bytes=2, utilization=0.9, overhead_bytes=0):
    token = 2 * n_layer * n_kv_heads * (d_model // n_head) * kv_bytes
    free = int(utilization * gpu_bytes) - weight_bytes * n_params - overhead_bytes
    return max(free, 0) // (token * context_len)
'''),
    # The holes of issue 34: each answer below scored full marks on its question before the rule
    # it breaks had a hidden test of its own.
    ("02_zero", "q1", "only the stop clipped to numel: a rank past the end starts beyond the buffer",
     ("a rank that owns only padding gets (numel, numel), even when its start lies past numel",), """
def shard_range(numel, world_size, rank):
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} must be in [0, {world_size})")
    S = padded_numel(numel, world_size) // world_size
    return rank * S, min((rank + 1) * S, numel)
"""),
    ("02_zero", "q3", "a reduce-scatter, then an all-gather of the whole mean gradient and a slice",
     ("it communicates one reduce-scatter of the N_d S gradient and nothing else",), """
def zero2_sgd_step(param_shard, local_grad, lr):
    world_size, S = dist.get_world_size(), param_shard.numel()
    grad_shard = torch.empty_like(param_shard)
    reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    reduce_scatter(grad_shard, local_grad / world_size)
    mean_grad = torch.empty_like(local_grad)
    dist.all_gather_into_tensor(mean_grad, grad_shard)
    rank = dist.get_rank()
    return param_shard - lr * mean_grad[rank * S:(rank + 1) * S]
"""),
    ("02_zero", "q3", "an all-reduce of the whole gradient, then a slice",
     ("it communicates one reduce-scatter of the N_d S gradient and nothing else",), """
def zero2_sgd_step(param_shard, local_grad, lr):
    world_size, S, rank = dist.get_world_size(), param_shard.numel(), dist.get_rank()
    mean_grad = local_grad / world_size
    dist.all_reduce(mean_grad)
    return param_shard - lr * mean_grad[rank * S:(rank + 1) * S]
"""),
    ("07_flash_attention", "q3", "the M >= 4d + 1 check made before looking at kind",
     ("standard attention ignores M: a small M is no error there",), """
def hbm_forward(N, d, M, kind):
    if M < 4 * d + 1:
        raise ValueError(f"M={M} cannot hold one row of each tile (needs >= {4 * d + 1})")
    if kind == "standard":
        return 4 * N * N + 4 * N * d
    if kind != "flash":
        raise ValueError(f"kind={kind!r} must be 'standard' or 'flash'")
    B = 1
    while (B + 1) ** 2 + 4 * d * (B + 1) <= M:
        B += 1
    return N * d + -(-N // B) * 2 * N * d + N * d + N
"""),
    # The same reading applied to every question: a check applied to the wrong case, a boundary
    # past the end, a tie taken the other way.
    ("03_checkpointing", "q3", "k checked whatever the policy",
     ("k is checked for 'every_k' only: the other policies ignore it",), """
_policy_activation_bytes = policy_activation_bytes
def policy_activation_bytes(s, b, h, a, n_layer, policy, k=None, t=1, sequence_parallel=False):
    if k is not None and (not isinstance(k, int) or isinstance(k, bool) or k < 1):
        raise ValueError(f"k={k!r} must be an int >= 1")
    return _policy_activation_bytes(s, b, h, a, n_layer, policy, k=k, t=t, sequence_parallel=sequence_parallel)
"""),
    ("03_checkpointing", "q1", "a tie goes to the largest k",
     ("a tie goes to the smallest k",), """
def best_segment_length(n, m_in, m_layer):
    best = 1
    for k in range(1, n + 1):
        if segment_memory(n, k, m_in, m_layer) <= segment_memory(n, best, m_in, m_layer):
            best = k
    return best
"""),
    ("01_memory_wall", "q4", "the tie taken as exceeding: 5as >= 34h",
     ("strictly exceeds: where 34h/(5a) is whole, that s ties and the next one exceeds",), """
def attention_dominates_seq_len(h, a):
    return -(-34 * h // (5 * a))
"""),
    ("05_tensor_parallel", "q1", "t checked against h, not against the heads",
     ("t must divide the number of heads, even when it divides h: ValueError naming t",), """
def qkv_shard(weight, n_head, rank, t):
    q, k, v = weight.chunk(3, dim=0)
    if q.size(0) % t:
        raise ValueError(f"t={t} must divide h={q.size(0)}")
    rows = q.size(0) // t
    return torch.cat([m[rank * rows:(rank + 1) * rows] for m in (q, k, v)])
"""),
    ("07_flash_attention", "q1", "two empty parts rescaled by exp(-inf - -inf): NaN",
     ("two empty parts give (-inf, 0, 0), without NaN",), """
def merge_partials(a, b):
    (m_a, l_a, o_a), (m_b, l_b, o_b) = a, b
    m = max(m_a, m_b)
    wa, wb = math.exp(m_a - m), math.exp(m_b - m)  # both parts empty: exp(nan)
    return m, wa * l_a + wb * l_b, wa * o_a + wb * o_b
"""),
    ("08_paged_attention", "q1", "an empty context refused",
     ("an empty context or an empty batch holds 0 bytes, with no error",), """
_kv_cache_bytes = kv_cache_bytes
def kv_cache_bytes(n_layer, n_kv_heads, head_dim, dtype_bytes, context_len, batch_size=1):
    if context_len == 0:
        raise ValueError(f"context_len={context_len!r} must be positive")
    return _kv_cache_bytes(n_layer, n_kv_heads, head_dim, dtype_bytes, context_len, batch_size)
"""),
    ("08_paged_attention", "q2", "a sequence of 0 tokens given a block",
     ("a sequence of 0 tokens holds no block",), """
_blocks_for_batch = blocks_for_batch
def blocks_for_batch(lengths, block_size):
    return _blocks_for_batch([max(n, 1) for n in lengths], block_size)[0], \
        _blocks_for_batch([max(n, 1) for n in lengths], block_size)[0] * block_size - sum(lengths)
"""),
    ("09_planning", "q2", "stage 3 returned when nothing fits",
     ("None exactly when no stage fits",), """
_cheapest_zero_stage = cheapest_zero_stage
def cheapest_zero_stage(n_params, dp_size, gpu_bytes, activation_bytes):
    found = _cheapest_zero_stage(n_params, dp_size, gpu_bytes, activation_bytes)
    return found if found is not None else (3, 3 * n_params)
"""),
]


def _error_line(failure: str) -> str:
    """The last `SomeError: message` line of a failed test case's report."""
    errors = re.findall(r"^\s*((?:[\w.]+(?:Error|Exception))\b.*)$", failure, re.M)
    return errors[-1].strip() if errors else ""


_SCORED: dict = {}


@pytest.fixture(scope="session")
def scorer(exercises_tmp):
    """One ``exercise_checks.py --serve`` process for this worker's chapters: it imports otter and
    torch once (about 4 CPU-seconds), not once a chapter; forked from the worker's torch server
    (tests/warm_kernels.py), which imported torch already; ended when the session ends."""
    import warm_kernels

    log = exercises_tmp / "scorer.log"
    python = warm_kernels.python_command("torch", dict(os.environ))
    with open(log, "w") as out:
        proc = subprocess.Popen([*python, str(CHECKS), "--serve"], stdin=subprocess.PIPE,
                                stdout=out, stderr=subprocess.STDOUT, text=True, cwd=exercises_tmp)
    try:
        yield proc, log
    finally:
        proc.stdin.close()  # end of input: it returns
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture
def variant_scores(built, chapter, exercises_tmp, scorer) -> dict:
    """The chapter's solution and its wrong answers scored by the worker's scorer (once a chapter)."""
    if chapter not in _SCORED:
        proc, log = scorer
        work = exercises_tmp / f"variants-{chapter}"
        work.mkdir()
        out = work / "scores.json"
        job = [str(built["zip"]), str(built["dist"] / chapter / "autograder" / f"{chapter}.ipynb"),
               [(q, code) for c, q, _, _, code in WRONG_ANSWERS if c == chapter], str(out), str(work)]
        proc.stdin.write(json.dumps(job) + "\n")
        proc.stdin.flush()
        limit = 600 * ex.load_factor()
        deadline = time.monotonic() + limit
        while not out.exists():
            assert proc.poll() is None, f"the scorer ended (exit status {proc.returncode}):\n" \
                                        f"{log.read_text(errors='replace')[-4000:]}"
            if time.monotonic() > deadline:
                pytest.fail(f"scoring {chapter}'s wrong answers took over {limit:g} s (600 s times the "
                            f"load per core, {ex.load_factor():.1f}): a busy machine, or a variant "
                            f"that loops?\n{log.read_text(errors='replace')[-4000:]}")
            time.sleep(0.05)
        result = json.loads(out.read_text())
        assert "error" not in result, f"scoring {chapter}'s wrong answers failed:\n{result.get('error')}"
        _SCORED[chapter] = result
    return _SCORED[chapter]


def test_wrong_answers_name_rules_that_exist():
    """Every rule a recorded wrong answer names is the rule of a hidden test of its question, and
    every question has hidden tests with a rule and points of their own."""
    for chapter in CHAPTERS:
        rules = _source_rules(ex.SOURCE_DIR / f"{chapter}.ipynb")
        for c, q, why, broken, _ in WRONG_ANSWERS:
            if c == chapter:
                missing = set(broken) - set(rules.get(q, []))
                assert broken and not missing, f"{chapter} {q} ({why}): no hidden test has the rule {missing}"


def _source_rules(source_nb: Path) -> dict:
    """{question: [the rule of each hidden test cell]} of a source notebook."""
    rules, question = {}, None
    for cell in json.loads(source_nb.read_text())["cells"]:
        text = _source(cell)
        begin = re.match(r"#\s*BEGIN QUESTION\s*\nname:\s*(\S+)", text.strip())
        if cell["cell_type"] == "raw" and begin:
            question = begin.group(1)
        config = re.match(CONFIG_RE, text, re.S)
        if cell["cell_type"] == "code" and config and re.search(r"hidden:\s*true", config.group(1)):
            rule = re.match(r"hidden_rule = (.+)\n", text[config.end():])
            assert rule, f"{source_nb.name} {question}: a hidden test without `hidden_rule = ...` first"
            assert re.search(r"points:\s*\d", config.group(1)), \
                f"{source_nb.name} {question}: the hidden test {rule.group(1)} has no points of its own"
            rules.setdefault(question, []).append(ast.literal_eval(rule.group(1)))
    return rules


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_each_rule_has_one_hidden_test(chapter):
    """One hidden test per rule, and each question states some."""
    rules = _source_rules(ex.SOURCE_DIR / f"{chapter}.ipynb")
    assert rules, f"{chapter}: no hidden tests"
    for q, names in rules.items():
        assert len(names) == len(set(names)), f"{chapter} {q}: a rule tested twice: {names}"


@pytest.mark.parametrize("chapter", BY_CHAPTER)
def test_plausible_wrong_answers_lose_points(built, variant_scores, chapter):
    """Each wrong answer loses exactly the points of the rules it breaks, on its own question,
    with failures that show what was expected and what came back; the solution, graded the
    same way, keeps full marks."""
    wrong = [(q, why, broken) for c, q, why, broken, _ in WRONG_ANSWERS if c == chapter]
    scores = variant_scores
    cases = ex.question_cases(built["zip"])
    assert set(scores["solution"]) == set(cases)
    for q, (score, possible) in scores["solution"].items():
        assert score == possible > 0, (f"{chapter} {q}: the solution scored {score} / {possible}:\n"
                                       + "\n".join(scores["solution_failures"][q]))
    assert len(scores["variants"]) == len(wrong)
    for (q, why, broken), (score, possible, failures, which) in zip(wrong, scores["variants"]):
        failed_rules = {cases[q][i]["rule"] for i in which if cases[q][i]["hidden"]}
        assert failed_rules == set(broken), \
            f"{chapter} {q} ({why}): expected to fail exactly {sorted(broken)}, failed {sorted(failed_rules)}"
        lost = sum(c["points"] for c in cases[q] if c["rule"] in broken)
        assert lost > 0 and score == pytest.approx(possible - lost), \
            f"{chapter} {q} ({why}): expected {possible - lost} / {possible} (lost the points of " \
            f"{sorted(broken)}), got {score} / {possible}"
        shown = [_error_line(f) for f in failures]
        assert any("expected" in e and "got" in e for e in shown), \
            f"{chapter} {q} ({why}): no failure shows expected and got: {shown}"
        # a call is shown as a reader writes it: no stray `{}` for keyword arguments it has not
        stray = [e for e in shown if re.search(r"\)\s*\{\}", e)]
        assert not stray, f"{chapter} {q} ({why}): a stray {{}} in {stray}"


def _answers_map(notebook: Path) -> dict:
    """The setup cell's ANSWERS: {question: [the names its check looks at]}."""
    for cell in json.loads(notebook.read_text())["cells"]:
        found = re.search(r"^ANSWERS = (\{.*\})$", _source(cell), re.M)
        if cell["cell_type"] == "code" and found:
            return ast.literal_eval(found.group(1))
    raise AssertionError(f"{notebook.name}: no ANSWERS in a setup cell")


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_answers_name_what_each_question_defines(chapter):
    """`grader.check` says "not answered yet" by looking at ANSWERS: it must list exactly the
    functions and classes each question's answer cells define."""
    answers, _ = _answers_and_setup(ex.SOURCE_DIR / f"{chapter}.ipynb")
    defined = {}
    for question, code in answers:
        defined.setdefault(question, []).extend(
            n.name for n in ast.parse(code).body if isinstance(n, (ast.FunctionDef, ast.ClassDef)))
    assert _answers_map(ex.SOURCE_DIR / f"{chapter}.ipynb") == defined


# Chapter 1's answers are functions; chapter 3's second is a class whose methods are the answer.
@pytest.mark.parametrize("chapter", [BY_CHAPTER[0], BY_CHAPTER[2]])
@pytest.mark.usefixtures("warm_kernels")
def test_unanswered_question_says_so(built, chapter, tmp_path, monkeypatch, capsys):
    """In the student notebook, `grader.check` on a question whose functions still have `...` for
    a body prints that it is not answered yet (no doctest trace); once answered, it runs the
    public tests, which pass for the solution."""
    nb = json.loads((built["student"] / f"{chapter}.ipynb").read_text())
    solved = json.loads((built["dist"] / chapter / "autograder" / f"{chapter}.ipynb").read_text())
    (tmp_path / f"{chapter}.ipynb").write_text(json.dumps(nb))
    monkeypatch.chdir(tmp_path)
    env = {"__name__": "__main__"}
    for cell in nb["cells"]:
        if cell["cell_type"] == "code" and ".check(" not in _source(cell):
            exec(compile(_source(cell), f"<{chapter}>", "exec"), env)  # the setup, then the stubs
    capsys.readouterr()
    questions = list(_answers_map(built["student"] / f"{chapter}.ipynb"))
    for q in questions:
        assert env["grader"].check(q) is None
        said = capsys.readouterr().out
        assert said.startswith(f"{q}: not answered yet (replace the ... in ") and "Trace" not in said, said
    solutions = [_source(c) for c in solved["cells"]
                 if "otter_assign_solution_cell" in c["metadata"].get("tags", [])]
    exec(compile(solutions[0], "<solution>", "exec"), env)  # q1 answered; the others still not
    result = env["grader"].check(questions[0])
    said = capsys.readouterr().out
    assert result is not None and result.passed_all, (said, result)
    assert "not answered" not in said
    assert env["grader"].check(questions[1]) is None
    assert "not answered yet" in capsys.readouterr().out


@pytest.mark.parametrize("chapter", [BY_CHAPTER[5]])
def test_a_kernel_too_slow_to_start_is_retried_and_named(built, chapter, tmp_path):
    """A kernel that does not start in time is tried again with twice as long; then the grader
    fails with a short message that names a busy machine and the knob, not a traceback. The
    kernel here is a stand-in that never answers (a kernelspec "python3" that sleeps)."""
    spec = tmp_path / "jupyter" / "kernels" / "python3"
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-c", "import time; time.sleep(60)", "{connection_file}"],
        "display_name": "a kernel that never answers", "language": "python"}))
    submission = tmp_path / "my.ipynb"
    submission.write_bytes((built["student"] / f"{chapter}.ipynb").read_bytes())
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "grade", str(submission), "--kernel-timeout", "1",
         "--dist-dir", str(built["dist"])], capture_output=True, text=True, timeout=300,
        env={**os.environ, "JUPYTER_PATH": str(tmp_path / "jupyter")})
    assert proc.returncode == 1, proc.stdout + proc.stderr
    said = proc.stderr
    assert "did not start within 1 s, twice (the second time with 2 s)" in said, said
    assert "busy" in said and "--kernel-timeout" in said and ex.KERNEL_TIMEOUT_ENV in said, said
    assert len(said.splitlines()) <= 8, said
    assert time.monotonic() - start < 240, "the retry waited for the kernel that never answers"


def test_kernel_timeout_scales_with_load_and_takes_the_knob(monkeypatch):
    monkeypatch.delenv(ex.KERNEL_TIMEOUT_ENV, raising=False)
    monkeypatch.setattr(ex.os, "getloadavg", lambda: (6.0, 0.0, 0.0))
    monkeypatch.setattr(ex.os, "cpu_count", lambda: 2)
    assert ex.load_factor() == 3.0 and ex.kernel_timeout() == 180
    monkeypatch.setattr(ex.os, "getloadavg", lambda: (0.5, 0.0, 0.0))
    assert ex.kernel_timeout() == 60  # an idle machine keeps the default
    monkeypatch.setenv(ex.KERNEL_TIMEOUT_ENV, "250")
    assert ex.kernel_timeout() == 250 and ex.kernel_timeout(0.2) == 1  # whole seconds
    monkeypatch.setenv(ex.KERNEL_TIMEOUT_ENV, "soon")
    with pytest.raises(ex.ExerciseError, match=ex.KERNEL_TIMEOUT_ENV):
        ex.kernel_timeout()


# The grader's feedback in the notebook's language: the Chinese notebooks (exercises/student/zh,
# metadata "language": "zh_CN") get the same cases, numbers and rules, in Chinese.
_EN_CASE = re.compile(r"^(public|hidden) test (\d+)(?: \[(.*?)\])?: ")
_ZH_CASE = re.compile(r"^(公开|隐藏)测试 (\d+)(?: \[(.*?)\])?：")
_CJK = re.compile(r"[\u4e00-\u9fff]")


@pytest.mark.parametrize("chapter", BY_CHAPTER)
def test_wrong_answers_feedback_in_chinese(built, variant_scores, chapter):
    """Each recorded wrong answer's failed cases, as the grader says them to an English and to a
    Chinese notebook: the same kind, number and rule; the Chinese one in Chinese, with what was
    expected and what came back ("预期 ...，实际得到 ...") wherever the English one has them."""
    cases = ex.question_cases(built["zip"])
    wrong = [q for c, q, _, _, _ in WRONG_ANSWERS if c == chapter]
    assert wrong and len(variant_scores["variants"]) == len(wrong)
    expected_got = 0
    for q, (_, _, failures, which) in zip(wrong, variant_scores["variants"]):
        assert failures and len(failures) == len(which), (chapter, q)
        for i, report in zip(which, failures):
            en = ex.case_failure(i + 1, cases[q][i], report, "en")
            zh = ex.case_failure(i + 1, cases[q][i], report, "zh_CN")
            en_head, zh_head = _EN_CASE.match(en), _ZH_CASE.match(zh)
            assert en_head and zh_head, (en, zh)
            assert ({"public": "公开", "hidden": "隐藏"}[en_head[1]], en_head[2], en_head[3]) == \
                zh_head.groups(), (en, zh)
            assert en_head[3] == cases[q][i]["rule"] and int(en_head[2]) == i + 1, (en, cases[q][i])
            assert "test " not in zh and "the output differs" not in zh, zh
            said = zh[zh_head.end():].split(" -> ", 1)[-1]  # what it raised (a public case's code aside)
            if re.search(r"(^|: )expected .*, got ", en[en_head.end():].split(" -> ", 1)[-1]):
                expected_got += 1
                assert "预期 " in said and "，实际得到 " in said and "expected " not in said, (en, zh)
    assert expected_got, f"{chapter}: no failure shows expected and got"


def test_grader_notices_and_time_limit_in_chinese(tmp_path, capsys):
    """The notices about answer cells (interrupted, a syntax error, raised), the question time
    limit's message and the printed summary, in each language; an unknown language is refused,
    named."""
    cells = [{"cell_type": "code", "metadata": {"tags": [ex.ANSWER_TAG]}, "source": "x",
              "outputs": [{"output_type": "error", "ename": ename, "evalue": "boom"}]}
             for ename in ("KeyboardInterrupt", "SyntaxError", "RuntimeError")]
    cells.append({"cell_type": "code", "metadata": {}, "source": 'grader.check("q1")', "outputs": []})
    executed = tmp_path / "executed.ipynb"
    executed.write_text(json.dumps({"cells": cells}))
    en = ex._answer_cell_notices(executed, 5, "en")["q1"]
    zh = ex._answer_cell_notices(executed, 5, "zh_CN")["q1"]
    assert len(en) == len(zh) == 3
    assert "interrupted after 5 s" in en[0] and "SyntaxError: boom" in en[1] and "raised RuntimeError" in en[2]
    assert "5 秒" in zh[0] and "SyntaxError: boom" in zh[1] and "RuntimeError" in zh[2]
    assert all(_CJK.search(n) for n in zh) and not any(_CJK.search(n) for n in en)
    failures = {"q1": ["hidden test 1: NameError: name 'f' is not defined"]}
    ex._explain(failures, {}, tmp_path / "none.ipynb", {"q1": zh}, "zh_CN")
    assert failures["q1"][0].endswith("（答案单元格有语法错误：见上面的说明）"), failures
    checks = importlib.util.spec_from_file_location("exercise_checks_zh", CHECKS)
    module = importlib.util.module_from_spec(checks)
    checks.loader.exec_module(module)
    assert module.limit_message("q2", 5, "en") == module.LIMIT_MESSAGE.format(q="q2", s=5)
    assert module.limit_message("q2", 5, "zh_CN").startswith("q2 超出了 5 秒处理器时间的限制")
    result = {"chapter": "01_memory_wall", "timeout": 60.0, "timed_out": True, "language": "zh_CN",
              "max_scores": {"q1": 2.0}, "scores": {"q1": 0.0}, "notices": {"q1": zh[:1]},
              "failures": {"q1": [ex.say("not_answered", "zh_CN")]}, "total": 0.0, "max_total": 2.0}
    ex._print_results("作业.ipynb", result)
    printed = capsys.readouterr().out
    for said in ("评分：作业.ipynb，对照 01_memory_wall（时限 60 秒）", "超时：60 秒后", "说明：答案单元格",
                 "尚未作答", "总分"):
        assert said in printed, printed
    assert not re.search(r"Grading|TIMED OUT|note:|total|not answered", printed), printed
    assert ex.notebook_language({"metadata": {"language": "zh_CN"}}) == "zh_CN"
    assert ex.notebook_language({"metadata": {}}) == "en"
    with pytest.raises(ex.ExerciseError, match="language='fr'"):
        ex.notebook_language({}, "fr")


@pytest.mark.parametrize("chapter", [BY_CHAPTER[0]])
@pytest.mark.usefixtures("warm_kernels")
def test_chinese_notebook_says_not_answered_in_chinese(built, chapter, tmp_path, monkeypatch, capsys):
    """The Chinese student notebook prints its own lines in Chinese (LANGUAGE = "zh_CN"), and
    grading it untouched says 'not answered yet' in Chinese, one line a question."""
    zh_nb = built["student"] / "zh" / f"{chapter}.ipynb"
    nb = json.loads(zh_nb.read_text())
    assert nb["metadata"].get("language") == "zh_CN"
    (tmp_path / f"{chapter}.ipynb").write_text(json.dumps(nb))
    monkeypatch.chdir(tmp_path)
    env = {"__name__": "__main__"}
    for cell in nb["cells"]:
        if cell["cell_type"] == "code" and ".check(" not in _source(cell):
            exec(compile(_source(cell), f"<{chapter} zh>", "exec"), env)
    assert env["LANGUAGE"] == "zh_CN"
    capsys.readouterr()
    q = list(_answers_map(zh_nb))[0]
    assert env["grader"].check(q) is None
    said = capsys.readouterr().out
    assert said.startswith(f"{q}：尚未作答（请把 ") and "not answered" not in said, said
    result = ex.grade(zh_nb, timeout=300, dist_dir=built["dist"])
    assert result["language"] == "zh_CN" and not result["timed_out"]
    assert result["failures"] == {q: [ex.say("not_answered", "zh_CN")] for q in result["max_scores"]}
    assert _CJK.search(ex.say("not_answered", "zh_CN"))


def test_chinese_colab_links_open_the_chinese_notebooks():
    """The exercises page's Colab link of each chapter opens that chapter's student notebook:
    the English one in the English edition, the Chinese one (exercises/student/zh) in the
    Chinese edition (its catalogue's translation of the link)."""
    i18n = sys.modules.get("i18n_script")
    if i18n is None:  # scripts/i18n.py, as scripts/exercises.py loads it
        spec = importlib.util.spec_from_file_location("i18n_script", ROOT / "scripts" / "i18n.py")
        i18n = sys.modules["i18n_script"] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(i18n)
    page = (ROOT / "exercises" / "index.md").read_text(encoding="utf-8")
    english = dict(re.findall(r"^\[(colab-\d+)\]: (\S+)$", page, re.M))
    zh = i18n.translations_of(i18n.LOCALE_DIR / "exercises" / "index.po")
    names = sorted(p.name for p in COMMITTED_STUDENT_DIR.glob("*.ipynb"))
    assert len(english) == len(names) == len(CHAPTERS), (english, names)
    for name in names:
        key = f"colab-{name[:2]}"
        assert english[key].endswith(f"/exercises/student/{name}"), english[key]
        link = zh.get(f"[Open in Colab][{key}]", "")
        target = re.search(r"\]\((https://colab\.research\.google\.com/\S+?)\)", link)
        assert target and target[1].endswith(f"/exercises/student/zh/{name}"), (key, link)
        assert target[1].replace("/student/zh/", "/student/") == english[key]
        assert (COMMITTED_STUDENT_DIR / "zh" / name).is_file()


@pytest.mark.xdist_group(_group(LOOP_IN_TESTS_CHAPTER))
@pytest.mark.parametrize("chapter", [LOOP_IN_TESTS_CHAPTER])
@pytest.mark.usefixtures("warm_kernels")
def test_chinese_notebook_graded_in_chinese(built, chapter, tmp_path):
    """Grading the Chinese notebook end to end: a syntax error's note and its NameErrors, and the
    question time limit the grading kernel enforces, are said in Chinese, with the same cases,
    numbers and rules as the English grader reports."""
    nb = _filled_in(built, chapter, "zh")
    answers = [c for c in nb["cells"] if "otter_answer_cell" in c["metadata"].get("tags", [])]
    answers[0]["source"] += "\nthis line is not Python (\n"
    answers[1]["source"] += "\n\ndef min_microbatches(p, target):\n    while True:\n        pass\n"
    submission = tmp_path / "zh.ipynb"
    submission.write_text(json.dumps(nb))
    result = ex.grade(submission, timeout=240, cell_timeout=5, question_timeout=5, dist_dir=built["dist"])
    assert result["language"] == "zh_CN" and not result["timed_out"], result
    cases = ex.question_cases(built["zip"])
    for q in ("q1", "q2"):
        assert result["scores"][q] == 0 and result["failures"][q], (q, result)
        for why in result["failures"][q]:
            head = _ZH_CASE.match(why)
            assert head, why
            case = cases[q][int(head[2]) - 1]
            assert (head[1] == "隐藏") == case["hidden"] and head[3] == case["rule"], (why, case)
    assert all("（答案单元格有语法错误：见上面的说明）" in why for why in result["failures"]["q1"])
    assert result["notices"]["q1"][0].startswith("答案单元格有语法错误"), result["notices"]
    assert all("TimeoutError: q2 超出了 5 秒处理器时间的限制" in why for why in result["failures"]["q2"])
