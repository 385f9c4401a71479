"""Grading helpers that run outside scripts/exercises.py's own process.

- `install_question_time_limit(seconds)` runs inside the grading kernel (scripts/exercises.py
  adds a cell that calls it): each question's tests get `seconds` of processor time in all, so a
  function that loops when the tests call it fails its own question, named, and the notebook goes
  on. Processor time, not wall-clock time: a loaded machine slows an honest answer down without
  making it use more of it, and a test that waits on forked ranks uses almost none.
- `score_variants(autograder_zip, solution_nb, variants)` grades answer variants (a solution with
  one function rewritten) with otter's own test classes in one process, without a kernel per
  variant: tests/test_exercises.py uses it to show that each plausible wrong answer loses points,
  through `python exercise_checks.py --serve` (`serve`), one process a test worker.
"""

import importlib.util
import json
import signal
import sys
import time
from pathlib import Path

__all__ = ["install_question_time_limit", "score_variants"]

LIMIT_MESSAGE = ("{q} ran past its time limit of {s:g} s of processor time "
                 "(does a function it calls loop forever?)")


def limit_message(question, seconds, lang="en"):
    """LIMIT_MESSAGE in ``lang`` (labkit/messages' "grade.time_limit" for a language other than
    English)."""
    if lang != "en":
        try:
            module = sys.modules.get("labkit_messages")
            if module is None:  # this checkout's labkit/messages, by path, as scripts/exercises.py
                folder = Path(__file__).resolve().parents[1] / "labkit" / "messages"
                spec = importlib.util.spec_from_file_location(
                    "labkit_messages", folder / "__init__.py", submodule_search_locations=[str(folder)])
                module = sys.modules["labkit_messages"] = importlib.util.module_from_spec(spec)
                spec.loader.exec_module(module)
            return module.render("grade.time_limit", lang, question=question, seconds=seconds)
        except (ImportError, OSError, ValueError):  # never fail a time limit over its wording
            pass
    return LIMIT_MESSAGE.format(q=question, s=seconds)


def _timeout_result(question, seconds, lang="en"):
    """What otter records for a test case cut off, in the shape of a failed doctest."""
    why = limit_message(question, seconds, lang)
    return False, ("Failed example:\n    (the test case, cut off)\nException raised:\n"
                   f"    TimeoutError: {why}\n")


def install_question_time_limit(seconds, lang="en"):
    """Give each question's tests `seconds` of processor time in all (ITIMER_PROF, where it exists).

    Wraps otter's run_doctest: the first case of a question starts its clock; a case still running
    when the time is spent is interrupted with TimeoutError (a failed case), and every later case
    of that question then fails at once; the message is in ``lang``. Returns whether the limit is
    in place.
    """
    if not hasattr(signal, "setitimer"):  # Windows: the whole-run --timeout still applies
        return False
    timer, alarm = signal.ITIMER_PROF, signal.SIGPROF
    from otter.test_files import ok_test

    run_doctest = ok_test.run_doctest
    left, current = {}, [None]  # processor seconds left to each question; the one running
    struck = set()  # questions whose limit has struck: their later cases fail at once

    def on_alarm(signum, frame):
        struck.add(current[0])
        signal.setitimer(timer, 0.05)  # keep interrupting until the case gives up
        raise TimeoutError(limit_message(current[0], seconds, lang))

    def limited(name, doctest_string, global_environment):
        question, _, case = name.rpartition(" ")
        if case == "0" or question not in left:  # a new check of this question
            left[question] = seconds
            struck.discard(question)
        if left[question] <= 0 or question in struck:
            return _timeout_result(question, seconds, lang)
        current[0] = question
        previous = signal.signal(alarm, on_alarm)
        start = time.process_time()
        signal.setitimer(timer, left[question])
        try:
            return run_doctest(name, doctest_string, global_environment)
        except TimeoutError:  # the alarm struck outside the test's own code
            left[question] = 0
            return _timeout_result(question, seconds, lang)
        finally:
            signal.setitimer(timer, 0)
            signal.signal(alarm, previous)
            left[question] -= time.process_time() - start

    ok_test.run_doctest = limited
    return True


def _code_cells(nb):
    for cell in nb["cells"]:
        if cell["cell_type"] == "code":
            src = cell["source"]
            yield cell, "".join(src) if isinstance(src, list) else src


def score_variants(autograder_zip, solution_nb, variants):
    """Score the solution and each variant against the autograder's tests, in this process.

    solution_nb: the autograder's notebook (solutions filled in). variants: [(question, code)]:
    `code` runs after every solution cell (it redefines the function it gets wrong). Returns
    {"solution": {q: (score, possible)}, "solution_failures": {q: [failure texts]},
     "variants": [(score, possible, [failure texts], [index of each failed case])]}.
    """
    import zipfile

    from otter.test_files import OKTestFile

    tests = {}
    with zipfile.ZipFile(autograder_zip) as z:
        for member in sorted(z.namelist()):
            if member.startswith("tests/") and member.endswith(".py"):
                ns = {}
                exec(z.read(member).decode(), ns)  # our own generated file: `test = {...}`
                tests[ns["test"]["name"]] = ns["test"]
    nb = json.loads(open(solution_nb).read())
    setup, solutions = [], []
    for cell, src in _code_cells(nb):
        tags = cell["metadata"].get("tags", [])
        if "otter_assign_solution_cell" in tags:
            solutions.append(src)
        elif ".check(" not in src:  # the grader's check cells run the tests: not here
            setup.append(src)
    base = {"__name__": "__main__"}
    for src in setup:
        exec(compile(src, "<setup>", "exec"), base)

    def run(question, extra):
        env = dict(base)
        for src in solutions:
            exec(compile(src, "<solution>", "exec"), env)
        if extra:
            exec(compile(extra, "<variant>", "exec"), env)
        test = OKTestFile.from_spec(tests[question])
        test.run(env)
        failed = [r.message for r in test.test_case_results if not r.passed]
        which = [i for i, r in enumerate(test.test_case_results) if not r.passed]
        return test.score, test.possible, failed, which

    solution = {q: run(q, None) for q in tests}
    return {"solution": {q: r[:2] for q, r in solution.items()},
            "solution_failures": {q: r[2] for q, r in solution.items()},
            "variants": [run(q, code) for q, code in variants]}


def serve(lines):
    """Score one job a line, as they come, in this process (otter and torch are imported once):
    [autograder_zip, solution_nb, variants, out_json, folder]. Runs in ``folder``; writes the
    scores (or {"error": the traceback}) to out_json through a temporary file and a rename, so a
    reader that sees the file sees all of it, and nothing the notebooks print can garble it."""
    import os
    import traceback

    for line in lines:
        autograder_zip, solution_nb, variants, out, folder = json.loads(line)
        os.chdir(folder)
        try:
            result = score_variants(autograder_zip, solution_nb, variants)
        except Exception:  # this job's error, reported in its file; the next job still runs
            result = {"error": traceback.format_exc()}
        with open(out + ".tmp", "w") as f:
            json.dump(result, f)
        os.replace(out + ".tmp", out)


if __name__ == "__main__":  # python exercise_checks.py --serve (jobs on stdin, a line each)
    if sys.argv[1:] != ["--serve"]:
        sys.exit(f"usage: {sys.argv[0]} --serve  (one JSON job a line on stdin; see serve())")
    serve(sys.stdin)
