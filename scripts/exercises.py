"""Build and grade the course's autograded exercises with otter-grader, locally and without docker.

    python scripts/exercises.py build [CHAPTER ...]
        otter assign each exercises/source/<name>.ipynb into exercises/dist/<name>/ (autograder zip
        and solutions; gitignored) and copy the student notebook to exercises/student/<name>.ipynb
        (committed), and its Chinese edition to exercises/student/zh/<name>.ipynb (the same
        notebook, its instructions from locales/zh_CN/LC_MESSAGES/exercises/notebooks.po). CHAPTER
        is a notebook name such as 01_memory_wall, or its number (1 or 01).

    python scripts/exercises.py grade SUBMISSION.ipynb [--cell-timeout 10] [--question-timeout 10]
                                                       [--kernel-timeout SECONDS] [--language LANG]
        grade a filled-in notebook with `otter run` against its chapter's autograder (built first
        if missing or older than its source); print each question's score and the total, for every
        failed test case which one failed and the error it raised, and for every answer cell that
        raised or was interrupted, what it raised: in the notebook's language (its metadata, so
        the zh/ notebooks get Chinese; --language en|zh_CN overrides it; the words are
        labkit/messages' "grade." kinds). An answer cell that runs longer than
        --cell-timeout seconds is interrupted, and a question whose tests use more than
        --question-timeout seconds of processor time in all (a function that loops when the
        tests call it) is cut off: each costs only its own question. A run past --timeout seconds
        in all (default 60 plus twice --question-timeout per question) is stopped, kernel and
        all, and scores zero. The
        chapter comes from the notebook's metadata; --chapter overrides it.

    A busy machine is slow, not broken: a Jupyter kernel gets --kernel-timeout seconds to start
    (or EXERCISES_KERNEL_TIMEOUT; default 60, scaled up by the load average per core), and one that
    does not start in time is tried once more with twice as long before the run fails with a
    message that says so. The default --timeout is scaled the same way.
"""

import argparse
import ast
import hashlib
import importlib.util
import re
import json
import math
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCE_DIR = ROOT / "exercises" / "source"
DIST_DIR = ROOT / "exercises" / "dist"
STUDENT_DIR = ROOT / "exercises" / "student"
# Every process of one grading run (otter, its kernel) carries this variable, so a timeout can find
# and stop all of them, including the kernel, which jupyter starts in a session of its own.
TOKEN_ENV = "EXERCISES_GRADE_TOKEN"
ANSWER_TAG = "otter_answer_cell"  # otter assign tags each cell a student writes in
KERNEL_TIMEOUT_ENV = "EXERCISES_KERNEL_TIMEOUT"  # seconds a Jupyter kernel gets to start
KERNEL_NOT_STARTED = re.compile(r"Kernel didn't respond in [\d.]+ seconds|Kernel died before replying")
LANGUAGE_ENV = "EXERCISES_GRADE_LANGUAGE"  # the grading kernel's language for its time-limit message
# The command that runs this file's own steps (otter assign, otter run) in a subprocess: this
# interpreter, unless the variable names another one that runs a script (the suite's forking
# launcher, tests/warm_kernels.py, which saves each step importing otter again)
PYTHON_ENV = "EXERCISES_PYTHON"
# An assertion message in the tests' form: "call(args): expected X, got Y", or "expected X, got Y"
EXPECTED_GOT = re.compile(r"^(?:(?P<call>.+?): )?expected (?P<expected>.*), got (?P<got>.*)$", re.S)


def _messages():
    """labkit/messages, loaded by path (this script runs without labkit installed, or with
    another checkout's): the grader's words in each language, one table per language."""
    module = sys.modules.get("labkit_messages")
    if module is None:
        folder = ROOT / "labkit" / "messages"
        spec = importlib.util.spec_from_file_location("labkit_messages", folder / "__init__.py",
                                                      submodule_search_locations=[str(folder)])
        module = sys.modules["labkit_messages"] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return module


def say(kind, lang="en", **fields):
    """The grader's message ``kind`` (labkit.messages' "grade." kinds) in ``lang``."""
    return _messages().render("grade." + kind, lang, **fields)


def notebook_language(nb, language=None):
    """The language the grader speaks for a notebook: ``language`` if given, else the notebook's
    metadata "language" (the zh/ notebooks carry "zh_CN"), else English."""
    language = language or nb.get("metadata", {}).get("language") or "en"
    try:
        return _messages().language(language)
    except ValueError:
        raise ExerciseError(f"language={language!r} has no grader messages; valid: "
                            f"{list(_messages().LANGUAGES)}") from None


class ExerciseError(Exception):
    """A bad argument: an unknown chapter, a missing or unreadable file (exit status 2)."""


class GradingError(ExerciseError):
    """otter assign or otter run failed for a reason other than a timeout (exit status 1)."""


def load_factor():
    """How much slower than idle this machine runs now: the load average per core, 1 to 4."""
    try:
        load = os.getloadavg()[0] / (os.cpu_count() or 1)
    except (AttributeError, OSError):  # Windows has no load average
        return 1.0
    return min(max(load, 1.0), 4.0)


def kernel_timeout(seconds=None):
    """Whole seconds a kernel gets to start: `seconds`, else $EXERCISES_KERNEL_TIMEOUT, else 60
    scaled by load_factor(); rounded up."""
    if seconds is None and os.environ.get(KERNEL_TIMEOUT_ENV):
        try:
            seconds = float(os.environ[KERNEL_TIMEOUT_ENV])
        except ValueError:
            raise ExerciseError(f"{KERNEL_TIMEOUT_ENV}={os.environ[KERNEL_TIMEOUT_ENV]!r} "
                                "must be a number of seconds")
    if seconds is None:
        seconds = 60.0 * load_factor()
    if seconds <= 0:
        raise ExerciseError(f"kernel timeout={seconds:g} must be a positive number of seconds")
    return max(1, math.ceil(seconds))  # nbclient counts whole seconds


def _kernel_did_not_start(what, log, seconds):
    """The message for a kernel that did not start in time, twice: a busy machine, and the knob."""
    return (f"{what}: the Jupyter kernel did not start within {seconds:g} s, twice (the second "
            f"time with {2 * seconds:g} s). The machine is probably busy (load average "
            f"{_load_text()}); that is not a bug in the notebook. Try again, or give the kernel "
            f"longer: --kernel-timeout SECONDS or {KERNEL_TIMEOUT_ENV}=SECONDS.\n"
            f"Last lines of the log:\n" + "\n".join(log.strip().splitlines()[-3:]))


def _load_text():
    try:
        return f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores"
    except (AttributeError, OSError):
        return "unknown"


def available_chapters(source_dir=SOURCE_DIR):
    """Map each source notebook's name (its file stem) to its path."""
    return {p.stem: p for p in sorted(Path(source_dir).glob("*.ipynb"))}


def resolve_chapter(chapter, source_dir=SOURCE_DIR):
    """Return the notebook name for `chapter`: a full name (01_memory_wall) or a number (1, 01)."""
    names = available_chapters(source_dir)
    if chapter in names:
        return chapter
    if chapter.isdigit():
        number = int(chapter)
        matches = [n for n in names if n.split("_")[0].isdigit() and int(n.split("_")[0]) == number]
        if len(matches) == 1:
            return matches[0]
    raise ExerciseError(
        f"chapter={chapter!r} is not one of {sorted(names)} (or their numbers) in {source_dir}"
    )


def _step_command(*args):
    """The command line of one of this file's internal steps (``_otter-assign``, ``_otter-run``)."""
    python = shlex.split(os.environ.get(PYTHON_ENV, "")) or [sys.executable]
    return [*python, str(Path(__file__).resolve()), *map(str, args)]


def _stable_cell_ids(nb):
    """Give generated cells ids that depend on their position and source, not on chance."""
    for i, cell in enumerate(nb["cells"]):
        if not str(cell.get("id", "")).startswith("cell-"):  # ids authored in the source are kept
            source = "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
            cell["id"] = "gen-" + hashlib.sha1(f"{i}:{source}".encode()).hexdigest()[:8]
    return nb


def build(chapter, *, source_dir=SOURCE_DIR, dist_dir=DIST_DIR, student_dir=STUDENT_DIR,
          run_tests=True, kernel_seconds=None):
    """Run otter assign for one chapter; return the path of its autograder zip.

    Writes dist_dir/<name>/{autograder,student}/ and, unless student_dir is None, copies the
    student notebook (stable cell ids) to student_dir/<name>.ipynb. run_tests=False skips otter's
    grading of the solutions (a kernel), for callers that grade them themselves.
    """
    name = resolve_chapter(chapter, source_dir)
    source = available_chapters(source_dir)[name]
    out = Path(dist_dir).resolve() / name
    seconds = kernel_timeout(kernel_seconds)
    for attempt in (1, 2):  # a kernel that did not start in time gets one more try, twice as long
        shutil.rmtree(out, ignore_errors=True)
        out.parent.mkdir(parents=True, exist_ok=True)
        proc = subprocess.run(
            _step_command("_otter-assign", seconds * attempt, source.resolve(), out,
                          *([] if run_tests else ["--no-run-tests"])),
            capture_output=True, text=True,
        )
        log = proc.stdout + proc.stderr
        if proc.returncode == 0 or not KERNEL_NOT_STARTED.search(log):
            break
    if proc.returncode != 0:
        if KERNEL_NOT_STARTED.search(log):
            raise GradingError(_kernel_did_not_start(f"otter assign for {source}", log, seconds))
        if "autograder tests failed" in log:
            failed = log[log.index("Some autograder tests failed"):][-3000:]
            raise GradingError(f"otter assign failed for {source}: the solutions do not pass:\n{failed}")
        raise GradingError(f"otter assign failed for {source}:\n{log[-3000:]}")
    if student_dir is not None:
        nb = json.loads((out / "student" / f"{name}.ipynb").read_text())
        Path(student_dir).mkdir(parents=True, exist_ok=True)
        text = json.dumps(_stable_cell_ids(nb), indent=1, ensure_ascii=False) + "\n"
        (Path(student_dir) / f"{name}.ipynb").write_text(text)
        write_chinese(Path(student_dir) / f"{name}.ipynb")
    return find_autograder(name, dist_dir)


def write_chinese(student_notebook):
    """Write the Chinese student notebook beside ``student_notebook``, in its zh/ folder: the
    same notebook with its Markdown paragraphs taken from the catalogue
    locales/zh_CN/LC_MESSAGES/exercises/notebooks.po (scripts/i18n.py). Untranslated paragraphs
    stay English and are listed. Returns the path written."""
    i18n = sys.modules.get("i18n_script")
    if i18n is None:  # scripts/i18n.py, loaded once by path (scripts/ is not a package)
        spec = importlib.util.spec_from_file_location("i18n_script",
                                                      Path(__file__).with_name("i18n.py"))
        i18n = sys.modules["i18n_script"] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(i18n)
    student_notebook = Path(student_notebook)
    translations = i18n.translations_of(i18n.LOCALE_DIR / f"{i18n.NOTEBOOKS_DOMAIN}.po")
    nb, missing = i18n.translate_notebook(json.loads(student_notebook.read_text()), translations)
    _speak(nb, "zh_CN")
    target = student_notebook.parent / "zh" / student_notebook.name
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n")
    if missing:
        print(f"{target}: {len(missing)} paragraphs not yet translated (scripts/i18n.py status)")
    return target


# The setup cell's choice of the lines the notebook prints (its SAY table), by language.
NOTEBOOK_LANGUAGE = re.compile(r'^LANGUAGE = "[\w-]+"$', re.M)


def _speak(nb, language):
    """Make the notebook print in ``language``: its setup cell's ``LANGUAGE = "en"`` line says
    ``language`` (one such line, else an ExerciseError: the source lost it)."""
    found = 0
    for cell in nb["cells"]:
        if cell["cell_type"] != "code" or not NOTEBOOK_LANGUAGE.search(_cell_source(cell)):
            continue
        found += 1
        text = NOTEBOOK_LANGUAGE.sub(f"LANGUAGE = {language!r}".replace("'", '"'), _cell_source(cell))
        cell["source"] = text if isinstance(cell["source"], str) else text.splitlines(keepends=True)
    if found != 1:
        raise ExerciseError(f"language={language!r}: the notebook must have one setup line "
                            f'LANGUAGE = "...", found {found}')
    return nb


def find_autograder(name, dist_dir=DIST_DIR):
    """The newest autograder zip built for `name`, or None."""
    zips = sorted((Path(dist_dir) / name / "autograder").glob(f"{name}-autograder_*.zip"))
    return zips[-1] if zips else None


def _tests_in(autograder_zip):
    """Every `test = {...}` dict of the test files inside an autograder zip (OK format)."""
    tests = []
    with zipfile.ZipFile(autograder_zip) as z:
        for member in sorted(z.namelist()):
            if member.startswith("tests/") and member.endswith(".py"):
                ns = {}
                exec(z.read(member).decode(), ns)  # our own generated file: `test = {...}`
                tests.append(ns["test"])
    return tests


def case_rule(case):
    """The rule a test case checks: the string its code binds to `hidden_rule`, or None."""
    found = re.search(r"^>>> hidden_rule = (.+)$", case.get("code", ""), re.M)
    return ast.literal_eval(found.group(1)) if found else None


def question_cases(autograder_zip):
    """{question: [{'hidden', 'points', 'rule'} per test case, in order]} of an autograder zip."""
    questions = {}
    for test in _tests_in(autograder_zip):
        cases = test["suites"][0]["cases"]
        even = (test["points"] if test["points"] is not None else len(cases)) / len(cases)
        questions[test["name"]] = [
            {"hidden": bool(c.get("hidden")), "rule": case_rule(c),
             "points": c["points"] if c.get("points") is not None else even} for c in cases
        ]
    return questions


def question_points(autograder_zip):
    """{question: points} read from the test files inside an autograder zip (OK format)."""
    return {q: round(sum(c["points"] for c in cases), 6)
            for q, cases in question_cases(autograder_zip).items()}


def _why(error, lang):
    """A failed case's error line in ``lang``: an assertion in the hidden tests' form (call:
    expected X, got Y) is rendered from its parts; the call and the values are shown as they are."""
    if not error:
        return say("differs", lang)
    name, _, message = error.partition(": ")
    found = EXPECTED_GOT.match(message)
    if found and found["call"]:
        return f"{name}: " + say("expected_got", lang, **found.groupdict())
    if found:
        return f"{name}: " + say("expected_got_bare", lang, expected=found["expected"], got=found["got"])
    return error


def _failures(output, cases, lang="en"):
    """'public|hidden test N [rule]: <first line of the failed example> -> <error>' per failed case,
    in ``lang`` (the rule and the number are the same in every language).

    ``output`` is otter's report for one question; ``cases`` its question_cases() entries. The
    code of a hidden case is not shown: its rule and the error it raised (expected and got) are.
    """
    blocks = re.split(r"^\s*\S+ - (\d+) result:\s*$", output or "", flags=re.M)
    failed = []
    for number, body in zip(blocks[1::2], blocks[2::2]):
        if "Test case failed" not in body:
            continue
        n = int(number)
        case = cases[n - 1] if n - 1 < len(cases) else {"hidden": False, "rule": None}
        failed.append(case_failure(n, case, body, lang))
    return failed


def case_failure(n, case, report, lang="en"):
    """One failed case, test ``n`` of its question (``case``: its question_cases() entry), from
    its doctest ``report`` (from "Failed example:" on), in ``lang``."""
    kind = "hidden" if case["hidden"] else "public"
    first = (report.split("Failed example:", 1) + [""])[1]  # the first failed line, to its error
    first = first.split("Failed example:", 1)[0]
    example = first.strip().splitlines()[0].strip() if first.strip() else ""
    errors = re.findall(r"^\s*((?:[\w.]+(?:Error|Exception|Interrupt|Exit))\b.*)$", first, re.M)
    why = _why(errors[-1].strip() if errors else "", lang)
    rule = say("rule", lang, rule=case["rule"]) if case["rule"] else ""
    if kind == "public":
        shown = f"{example[:70]} -> " if example else ""
        return say("case.public", lang, n=n, rule=rule, shown=shown, why=why)
    return say("case.hidden", lang, n=n, rule=rule, why=why)


def _processes_to_stop(root_pid, token):
    """pids of root_pid's descendants and of every process carrying the run's token (/proc)."""
    parents, pids = {}, set()
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            parents[int(entry.name)] = int(fields[1])  # field 4 of stat: the parent pid
            if f"{TOKEN_ENV}={token}".encode() in (entry / "environ").read_bytes().split(b"\0"):
                pids.add(int(entry.name))
        except (OSError, IndexError, ValueError):
            continue  # the process ended, or is not ours to read
    frontier = {root_pid}
    while frontier:
        children = {pid for pid, ppid in parents.items() if ppid in frontier} - pids
        pids |= children
        frontier = children
    return pids | {root_pid}


def _stop(proc, token):
    """SIGKILL the run: otter's process group, the kernel's session, and every token carrier."""
    if os.name != "posix":  # no process groups: kill otter; ipykernel exits when its parent dies
        proc.kill()
        proc.wait()
        return
    pids = _processes_to_stop(proc.pid, token)
    groups = set()
    for pid in pids:
        try:
            groups.add(os.getpgid(pid))
        except OSError:
            pass
    groups.discard(os.getpgrp())  # never our own group
    kills = [(os.killpg, g) for g in groups] + [(os.kill, p) for p in pids - {os.getpid()}]
    for kill, target in kills:
        try:
            kill(target, signal.SIGKILL)
        except OSError:
            pass  # already gone
    proc.wait()
    deadline = time.monotonic() + 5  # return only once they are gone (or zombies awaiting init)
    while time.monotonic() < deadline and any(_alive(pid) for pid in pids - {proc.pid}):
        time.sleep(0.05)


def _alive(pid):
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _submission_name(nb_path):
    """The assignment name otter assign wrote into a notebook's metadata, or None."""
    try:
        nb = json.loads(Path(nb_path).read_text())
    except (OSError, ValueError) as e:
        raise ExerciseError(f"submission={str(nb_path)!r} is not a readable notebook: {e}")
    return nb.get("metadata", {}).get("otter", {}).get("assignment_name"), nb


def _resolve_submission(submission, chapter, source_dir):
    """(chapter name, notebook dict) of a submission: --chapter, else its metadata or file name."""
    submission = Path(submission)
    if not submission.is_file() or submission.suffix != ".ipynb":
        raise ExerciseError(f"submission={str(submission)!r} is not an existing .ipynb file")
    meta_name, nb = _submission_name(submission)
    name = resolve_chapter(chapter, source_dir) if chapter else meta_name
    if name is None:
        name = next((n for n in available_chapters(source_dir) if n in submission.stem), None)
    if name is None:
        raise ExerciseError(
            f"submission={str(submission)!r} names no chapter in its metadata; pass --chapter"
        )
    name = resolve_chapter(name, source_dir)
    if meta_name not in (None, name):
        raise ExerciseError(f"submission={str(submission)!r} is for {meta_name!r}, not {name!r}")
    return name, nb


def _answer_cell_notices(executed_path, cell_timeout, lang="en"):
    """{question: [notice]} for every answer cell of the executed notebook that raised an error
    or was interrupted, in ``lang``; the question is the one whose check follows the cell."""
    try:
        cells = json.loads(Path(executed_path).read_text())["cells"]
    except (OSError, ValueError, KeyError):
        return {}  # the run was stopped before otter wrote it
    notices, pending = {}, []
    for cell in cells:
        if cell["cell_type"] != "code":
            continue
        if ANSWER_TAG in cell.get("metadata", {}).get("tags", []):
            for out in cell.get("outputs", []):
                if out.get("output_type") != "error":
                    continue
                if out.get("ename") == "KeyboardInterrupt":
                    pending.append(say("cell_interrupted", lang, seconds=cell_timeout))
                elif out.get("ename") == "SyntaxError":
                    pending.append(say("cell_syntax_error", lang, detail=out.get("evalue", "")))
                else:
                    pending.append(say("cell_raised", lang, error=out.get("ename"),
                                       detail=out.get("evalue", "")))
        question = re.search(r"\.check\(\s*[\"'](\w+)[\"']\s*\)", _cell_source(cell))
        if question and pending:
            notices.setdefault(question.group(1), []).extend(pending)
            pending = []
    return notices


def _answers_by_question(nb):
    """{question: [source of each answer cell before its check cell]} of a notebook."""
    found, pending = {}, []
    for cell in nb.get("cells", []):
        if cell["cell_type"] != "code":
            continue
        if ANSWER_TAG in cell.get("metadata", {}).get("tags", []):
            pending.append(_cell_source(cell).strip())
        question = re.search(r"\.check\(\s*[\"'](\w+)[\"']\s*\)", _cell_source(cell))
        if question and pending:
            found[question.group(1)], pending = pending, []
    return found


def unanswered_questions(nb, handed_out):
    """The questions of `nb` whose answer cells are all still as in the notebook `handed_out`."""
    given = _answers_by_question(handed_out)
    return {q for q, cells in _answers_by_question(nb).items() if given.get(q) == cells}


def _cell_source(cell):
    return "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]


def _run_otter(autograder, nb, submission_name, work, token, timeout, limits, lang="en"):
    """Run otter on a copy of nb in work/; return (process, timed_out)."""
    sub_copy = work / "submission" / submission_name
    sub_copy.parent.mkdir()
    sub_copy.write_text(json.dumps(nb))
    (work / "tmp").mkdir()
    env = dict(os.environ, **{TOKEN_ENV: token, "TMPDIR": str(work / "tmp"), LANGUAGE_ENV: lang})
    with open(work / "otter.log", "w") as log:  # a file, not a pipe: no wait on a straggler's EOF
        proc = subprocess.Popen(
            _step_command("_otter-run", *limits, work / "executed.ipynb",
                          "--no-logo", "-a", autograder, "-o", work, sub_copy),
            cwd=work, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True,  # its own process group, which _stop kills whole
        )
        try:
            proc.wait(timeout=timeout)
            return proc, False
        except subprocess.TimeoutExpired:
            _stop(proc, token)
            return proc, True


def _run_otter_patiently(autograder, nb, submission_name, root, token, timeout, limits, lang="en"):
    """_run_otter in root/try1; if its kernel did not start in time, once more in root/try2
    with twice the start-up limit. Returns (process, timed_out, work folder, otter's log)."""
    cell_timeout, question_timeout, startup = limits
    for attempt in (1, 2):
        work = root / f"try{attempt}"
        work.mkdir()
        proc, timed_out = _run_otter(autograder, nb, submission_name, work, token, timeout,
                                     (cell_timeout, question_timeout, startup * attempt), lang)
        log = (work / "otter.log").read_text(errors="replace")
        if timed_out or proc.returncode == 0 or not KERNEL_NOT_STARTED.search(log):
            break
        _stop(proc, token)  # a kernel that started too late may still be running
    return proc, timed_out, work, log


def _explain(failures, nb, handed_out, notices, lang="en"):
    """Say why a question failed where the cases alone mislead: an answer cell still as handed
    out is 'not answered yet' (one line, not every case), and a NameError after a syntax error
    points at the syntax error."""
    if Path(handed_out).is_file():
        for q in unanswered_questions(nb, json.loads(Path(handed_out).read_text())) & set(failures):
            failures[q] = [say("not_answered", lang)]
    for q, said in notices.items():  # a name the tests miss because the cell never ran
        if q in failures and any("SyntaxError:" in n for n in said):
            failures[q] = [say("see_syntax_error", lang, why=why)
                           if "NameError" in why else why for why in failures[q]]


def grade(submission, *, timeout=None, cell_timeout=10.0, question_timeout=10.0, chapter=None,
          source_dir=SOURCE_DIR, dist_dir=DIST_DIR, kernel_seconds=None, language=None):
    """Grade one notebook with otter run in a subprocess; return a results dict.

    {'chapter', 'scores': {q: score}, 'max_scores': {q: points}, 'failures': {q: [why, ...]},
     'notices': {q: [an answer cell that raised or was interrupted]}, 'total', 'max_total',
     'timed_out', 'timeout', 'seconds', 'run_id' (the value of TOKEN_ENV in the run's processes),
     'language'}. The failures and notices are in ``language``: by default the notebook's own
    (its metadata "language": "zh_CN" for the Chinese notebooks), else English.
    Limits: an answer cell past ``cell_timeout`` s is interrupted; a question's tests past
    ``question_timeout`` s of processor time fail; past ``timeout`` s in all (default 60 s plus
    twice ``question_timeout`` per question, times load_factor()) every question scores 0.
    """
    name, nb = _resolve_submission(submission, chapter, source_dir)
    lang = notebook_language(nb, language)
    autograder = find_autograder(name, dist_dir)
    source_mtime = available_chapters(source_dir)[name].stat().st_mtime
    if autograder is None or autograder.stat().st_mtime < source_mtime:  # missing or stale
        autograder = build(name, source_dir=source_dir, dist_dir=dist_dir, student_dir=None,
                           kernel_seconds=kernel_seconds)
    max_scores = question_points(autograder)
    cases = question_cases(autograder)
    if timeout is None:  # room for a loop in each question, and for a busy machine
        timeout = (60.0 + 2 * question_timeout * len(max_scores)) * load_factor()

    token = uuid.uuid4().hex
    root = Path(tempfile.mkdtemp(prefix="exercises-grade-"))
    scores = {q: 0.0 for q in max_scores}
    failures = {q: [] for q in max_scores}
    startup = kernel_timeout(kernel_seconds)
    try:
        nb.setdefault("metadata", {}).setdefault("otter", {})["assignment_name"] = name
        start = time.monotonic()
        proc, timed_out, work, log = _run_otter_patiently(
            autograder, nb, Path(submission).name, root, token, timeout,
            (cell_timeout, question_timeout, startup), lang)
        seconds = time.monotonic() - start
        notices = _answer_cell_notices(work / "executed.ipynb", cell_timeout, lang)
        if not timed_out:
            results_path = work / "results.json"
            if proc.returncode != 0 and KERNEL_NOT_STARTED.search(log):
                raise GradingError(_kernel_did_not_start(
                    f"otter run on submission={str(submission)!r}", log, startup))
            if proc.returncode != 0 or not results_path.is_file():
                raise GradingError(f"otter run failed on submission={str(submission)!r} "
                                   f"(exit {proc.returncode}):\n" + log[-3000:])
            for test in json.loads(results_path.read_text())["tests"]:
                if test["name"] in scores:
                    scores[test["name"]] = float(test["score"])
                    failures[test["name"]] = _failures(test.get("output"), cases[test["name"]], lang)
            _explain(failures, nb, Path(dist_dir) / name / "student" / f"{name}.ipynb", notices, lang)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return {
        "chapter": name, "scores": scores, "max_scores": max_scores, "failures": failures,
        "notices": {q: notices.get(q, []) for q in max_scores},
        "total": sum(scores.values()), "max_total": sum(max_scores.values()),
        "timed_out": timed_out, "timeout": timeout, "seconds": seconds, "run_id": token,
        "language": lang,
    }


def _print_results(submission, r):
    lang = r.get("language", "en")
    print(say("header", lang, submission=submission, chapter=r["chapter"], timeout=r["timeout"]))
    if r["timed_out"]:
        print(say("timed_out", lang, timeout=r["timeout"]))
    for q, max_score in r["max_scores"].items():
        print(f"  {q:<8} {r['scores'][q]:6.2f} / {max_score:g}")
        for notice in r["notices"][q]:
            print("             " + say("note", lang, notice=notice))
        for why in r["failures"][q]:
            print(f"             {why}")
    print(f"  {say('total', lang):<8} {r['total']:6.2f} / {r['max_total']:g}")


# The grading kernel's first cell after otter's own: each question's tests get a time limit.
LIMIT_CELL = """\
import sys as _exercise_sys
if {root!r} not in _exercise_sys.path:  # the hidden tests may use labkit (a CommCounter, say)
    _exercise_sys.path.append({root!r})
import importlib.util as _exercise_util
_exercise_spec = _exercise_util.spec_from_file_location("exercise_checks", {path!r})
_exercise_checks = _exercise_util.module_from_spec(_exercise_spec)
_exercise_spec.loader.exec_module(_exercise_checks)
_exercise_checks.install_question_time_limit({seconds!r}, {lang!r})
del _exercise_util, _exercise_spec, _exercise_checks, _exercise_sys
"""


def _kernel_startup(seconds):
    """Give every kernel nbconvert starts in this process `seconds` to start."""
    from nbconvert.preprocessors import ExecutePreprocessor

    init = ExecutePreprocessor.__init__

    def patient_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.startup_timeout = int(seconds)

    ExecutePreprocessor.__init__ = patient_init


def _otter_assign(startup, otter_args):
    """`otter assign` whose solution check (a kernel) gets `startup` seconds to start."""
    from otter.cli import cli

    _kernel_startup(startup)
    cli(["assign", *otter_args], standalone_mode=False)
    return 0


def _otter_run(cell_timeout, question_timeout, startup, executed_path, otter_args):
    """`otter run` with time limits: an answer cell past cell_timeout is interrupted
    (KeyboardInterrupt, an error in that cell) and a question's tests past question_timeout
    fail; the run goes on; the kernel gets `startup` s to start. The executed notebook is
    written to executed_path."""
    import nbformat
    from nbconvert.preprocessors import ExecutePreprocessor
    from otter.cli import cli
    from otter.execute.preprocessor import GradingPreprocessor
    from otter.run.run_autograder.runners import python_runner

    _kernel_startup(startup)
    init = ExecutePreprocessor.__init__

    def limited_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.interrupt_on_timeout = True
        self.timeout_func = lambda cell: (
            cell_timeout if ANSWER_TAG in cell.get("metadata", {}).get("tags", []) else None)

    add_cells = GradingPreprocessor.add_init_and_export_cells

    def add_cells_and_limit(self, nb):
        add_cells(self, nb)  # otter's set-up cell first, its export cell last
        source = LIMIT_CELL.format(path=str(Path(__file__).with_name("exercise_checks.py")),
                                   seconds=question_timeout, root=str(ROOT),
                                   lang=os.environ.get(LANGUAGE_ENV, "en"))
        nb.cells.insert(1, nbformat.v4.new_code_cell(source))

    grade_notebook = python_runner.grade_notebook

    def grade_and_keep(*args, **kwargs):
        results = grade_notebook(*args, **kwargs)
        nbformat.write(results.notebook, executed_path)
        return results

    ExecutePreprocessor.__init__ = limited_init
    GradingPreprocessor.add_init_and_export_cells = add_cells_and_limit
    python_runner.grade_notebook = grade_and_keep
    cli(["run", *otter_args], standalone_mode=False)
    return 0


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_otter-run"]:  # internal: what grade() runs in its subprocess
        return _otter_run(float(argv[1]), float(argv[2]), int(argv[3]), argv[4], argv[5:])
    if argv[:1] == ["_otter-assign"]:  # internal: what build() runs in its subprocess
        return _otter_assign(int(argv[1]), argv[2:])
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p_build = sub.add_parser("build", help="otter assign source notebooks into dist/ and student/")
    p_build.add_argument("chapters", nargs="*", metavar="CHAPTER", help="default: all chapters")
    p_grade = sub.add_parser("grade", help="grade a submitted notebook locally with otter run")
    p_grade.add_argument("submission", metavar="SUBMISSION.ipynb")
    p_grade.add_argument("--timeout", type=float, default=None,
                         help="seconds for the whole run (default 60 + 20 per question, times "
                              "the load average per core when above 1)")
    p_grade.add_argument("--cell-timeout", type=float, default=10.0,
                         help="seconds for one answer cell (default 10)")
    p_grade.add_argument("--question-timeout", type=float, default=10.0,
                         help="processor seconds for one question's tests (default 10)")
    p_grade.add_argument("--chapter", help="chapter to grade against (default: from the notebook)")
    p_grade.add_argument("--language", help="the language of the feedback: en or zh_CN (default: "
                                            "the notebook's, from its metadata; else en)")
    for p in (p_build, p_grade):
        p.add_argument("--kernel-timeout", type=float, default=None,
                       help=f"seconds a Jupyter kernel gets to start (default: ${KERNEL_TIMEOUT_ENV}, "
                            "else 60 times the load average per core, at least 1); one that does not "
                            "start in time gets a second try, twice as long")
        p.add_argument("--source-dir", type=Path, default=SOURCE_DIR, help=argparse.SUPPRESS)
        p.add_argument("--dist-dir", type=Path, default=DIST_DIR, help=argparse.SUPPRESS)
    p_build.add_argument("--student-dir", type=Path, default=STUDENT_DIR, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    try:
        if args.command == "build":
            names = [resolve_chapter(c, args.source_dir) for c in args.chapters]
            for name in names or list(available_chapters(args.source_dir)):
                zip_path = build(name, source_dir=args.source_dir, dist_dir=args.dist_dir,
                                 student_dir=args.student_dir, kernel_seconds=args.kernel_timeout)
                print(f"built {name}: {zip_path}; student notebook in {args.student_dir}")
        else:
            for flag, value in (("--timeout", args.timeout), ("--cell-timeout", args.cell_timeout),
                                ("--question-timeout", args.question_timeout),
                                ("--kernel-timeout", args.kernel_timeout)):
                if value is not None and value <= 0:
                    raise ExerciseError(f"{flag}={value:g} must be a positive number of seconds")
            r = grade(args.submission, timeout=args.timeout, cell_timeout=args.cell_timeout,
                      question_timeout=args.question_timeout, chapter=args.chapter,
                      source_dir=args.source_dir, dist_dir=args.dist_dir,
                      kernel_seconds=args.kernel_timeout, language=args.language)
            _print_results(args.submission, r)
    except ExerciseError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1 if isinstance(e, GradingError) else 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
