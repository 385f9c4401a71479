"""The book's calculators, in headless Chromium: the numbers a page shows are labkit's.

Each ``{calculator}`` (_ext/calculators.py) runs labkit's own modules in the page through
Brython. For each calculator this sets at least five input sets in the form (one that does not
fit, one typed shape), reads every number the page shows, and checks it equals what
``labkit.estimate``, called here in the test's own interpreter, returns for the same inputs; the
model's total and active parameters are among the numbers. Released config.json files (Mixtral-8x7B,
DeepSeek-V3, serialised from ``labkit.released_configs``) and one labkit refuses are pasted into the
form on the pages of both editions. It
also opens a calculator page from ``file://`` with every request outside the book's folder
blocked, and checks that a page whose Python runtime is missing says so.

It reuses the book the suite builds once (``built_book``) and the session's Chromium (tests/conftest.py).
"""

from __future__ import annotations

import json
import math
import re
import time
from dataclasses import replace
from types import SimpleNamespace
from urllib.parse import urlsplit

import pytest
from browser_support import LOCAL_HOSTS, ROOT, Deadline, patiently

from labkit.estimate import check_context_len, serving_memory, training_memory
from labkit.hardware import GPUS
from labkit.hf_config import read_config_json
from labkit.messages import error_message, render, training_reason
from labkit.plan import plan_training
from labkit.released_configs import RELEASED
from labkit.shapes import PRESETS, ModelShape



def _calculator_pages() -> dict:
    """{kind: the chapter whose source has that calculator}, read from chapters/*.md."""
    found = {}
    for path in sorted((ROOT / "chapters").glob("[0-9]*.md")):
        for kind in re.findall(r"^```+\{calculator\} (\w+)", path.read_text("utf-8"), re.M):
            found.setdefault(kind, f"chapters/{path.stem}")
    return found


PAGES = _calculator_pages()
SHAPE = ("n_layer", "d_model", "n_head", "n_kv_head", "d_ff", "vocab_size")
TRAIN_PARTS = ("params", "grads", "optimizer", "activations", "transient", "non_torch", "total")
SERVE_PARTS = ("weights", "activation_peak", "non_torch", "kv_cache", "total")
LOAD_S = 120  # Brython compiles labkit in the page: slow on a loaded 2-core machine

# What the reader types, field by field (values as typed); the rest stay at the page's defaults.
# Each list has a run that does not fit, a shape typed by hand, and one input labkit refuses.
INPUTS = {
    "training": [
        {"preset": "llama-2-7b", "gpu": "a100-80gb", "seq_len": "4096", "micro_batch": "1"},
        {"preset": "gpt2-small", "gpu": "a100-40gb", "seq_len": "1024", "micro_batch": "8",
         "recompute": "full"},
        {"preset": "llama-3.2-1b", "gpu": "h100-sxm", "seq_len": "2048", "micro_batch": "2",
         "recompute": "selective", "precision": "fp32", "optimizer": "sgd"},
        {"preset": "gpt2-medium", "n_layer": "12", "d_model": "512", "n_head": "8",
         "vocab_size": "32000", "gpu": "rtx-4090", "seq_len": "512", "micro_batch": "4",
         "recompute": "none", "precision": "bf16-mixed", "optimizer": "adamw"},
        {"preset": "mistral-7b", "gpu": "h200", "seq_len": "8192", "micro_batch": "1",
         "recompute": "full", "precision": "bf16", "optimizer": "adam"},
        {"preset": "gpt2-small", "n_head": "7"},
    ],
    "zero": [
        {"preset": "llama-2-7b", "gpu": "a100-80gb", "dp_size": "8", "seq_len": "4096",
         "micro_batch": "1"},
        {"preset": "llama-2-70b", "gpu": "h100-sxm", "dp_size": "8", "seq_len": "4096"},
        {"preset": "gpt2-xl", "gpu": "a100-40gb", "dp_size": "64", "seq_len": "1024",
         "micro_batch": "4", "optimizer": "adam"},
        {"preset": "llama-3-8b", "n_layer": "16", "n_kv_head": "4", "d_ff": "8192",
         "gpu": "l4", "dp_size": "16", "seq_len": "2048", "micro_batch": "1"},
        {"preset": "opt-13b", "gpu": "a100-80gb", "dp_size": "1", "seq_len": "2048",
         "precision": "bf16-mixed-fp32-grads", "optimizer": "adamw"},
        {"preset": "tiny", "dp_size": "0"},
    ],
    "activations": [
        {"preset": "llama-2-13b", "gpu": "a100-80gb", "tp_size": "8", "sequence_parallel": "off",
         "seq_len": "2048", "micro_batch": "1", "recompute": "none"},
        {"preset": "llama-2-13b", "tp_size": "8", "sequence_parallel": "on",
         "recompute": "selective"},
        {"preset": "gpt3-175b", "gpu": "a100-80gb", "tp_size": "8", "sequence_parallel": "on",
         "seq_len": "2048", "micro_batch": "1", "recompute": "full"},
        {"preset": "llama-3-70b", "gpu": "h100-sxm", "tp_size": "4", "sequence_parallel": "off",
         "seq_len": "8192", "micro_batch": "2", "recompute": "none"},
        {"preset": "gpt2-large", "n_layer": "24", "d_model": "2048", "n_head": "16",
         "gpu": "a10", "tp_size": "2", "sequence_parallel": "on", "seq_len": "1024",
         "micro_batch": "4", "recompute": "selective"},
        {"preset": "llama-2-13b", "tp_size": "3"},
    ],
    "kv": [
        {"preset": "llama-3-8b", "gpu": "a100-80gb", "tp_size": "1", "context_len": "4096"},
        {"preset": "llama-2-70b", "gpu": "a100-80gb", "tp_size": "1", "context_len": "4096"},
        {"preset": "llama-2-70b", "gpu": "h100-sxm", "tp_size": "4", "context_len": "4096",
         "kv_bytes": "1", "weight_bytes": "1"},
        {"preset": "mistral-7b", "gpu": "l4", "tp_size": "1", "context_len": "32768",
         "kv_bytes": "2", "weight_bytes": "2", "gpu_memory_utilization": "0.95"},
        {"preset": "llama-3-8b", "n_layer": "24", "n_kv_head": "2", "gpu": "rtx-4090",
         "tp_size": "2", "context_len": "2048", "gpu_memory_utilization": "0.5"},
        {"preset": "llama-3-8b", "gpu": "a100-80gb", "tp_size": "3"},
        {"preset": "llama-2-7b", "gpu": "a100-80gb", "tp_size": "1", "context_len": "8192"},
    ],
    "parallel": [
        {"preset": "llama-2-70b", "gpu": "a100-80gb", "dp_size": "8", "tp_size": "8",
         "pp_size": "4", "zero_stage": "1", "recompute": "selective", "sequence_parallel": "on",
         "seq_len": "4096", "micro_batch": "1"},
        {"preset": "llama-2-70b", "dp_size": "64", "tp_size": "1", "pp_size": "1",
         "zero_stage": "0", "recompute": "none", "sequence_parallel": "off"},
        {"preset": "gpt3-175b", "gpu": "a100-80gb", "dp_size": "8", "tp_size": "8",
         "pp_size": "16", "zero_stage": "1", "recompute": "full", "sequence_parallel": "on",
         "seq_len": "2048", "micro_batch": "1"},
        {"preset": "llama-3-8b", "n_layer": "8", "gpu": "l4", "dp_size": "2", "tp_size": "2",
         "pp_size": "2", "zero_stage": "3", "recompute": "selective",
         "sequence_parallel": "off", "seq_len": "2048", "micro_batch": "2"},
        {"preset": "llama-3-70b", "gpu": "h100-sxm", "dp_size": "16", "tp_size": "8",
         "pp_size": "4", "zero_stage": "2", "recompute": "selective", "sequence_parallel": "on",
         "seq_len": "8192", "micro_batch": "1"},
        {"preset": "llama-2-70b", "tp_size": "3"},
    ],
    "plans": [
        {"preset": "llama-2-7b", "gpu": "a100-80gb", "num_gpus": "8", "gpus_per_node": "8",
         "seq_len": "4096", "global_batch": "64", "micro_batches": "1", "interleave": "1"},
        {"preset": "llama-2-7b", "gpu": "a100-80gb", "num_gpus": "1", "global_batch": "8"},
        {"preset": "gpt2-xl", "gpu": "a100-40gb", "num_gpus": "4", "seq_len": "1024",
         "global_batch": "32", "micro_batches": "1, 2"},
        {"preset": "llama-3-8b", "n_layer": "16", "gpu": "h100-sxm", "num_gpus": "16",
         "seq_len": "2048", "global_batch": "64", "micro_batches": "1", "interleave": "1, 2"},
        {"preset": "llama-2-13b", "gpu": "l4", "num_gpus": "8", "seq_len": "2048",
         "global_batch": "16", "micro_batches": "1", "interleave": "1"},
        {"preset": "tiny", "global_batch": "0"},
    ],
}
PASTE = "config.json"  # the preset choice that reads the pasted config.json


def _paste(config: dict, **knobs) -> dict:
    """Inputs that paste ``config`` (serialised as a config.json file is) into the form."""
    return {"preset": PASTE, "config_json": json.dumps(config, indent=2), **knobs}


# Pasted into the training and serving calculators, on the pages of both editions: two released
# mixtures of experts (DeepSeek-V3 with MLA) and a config labkit refuses (an unknown model_type).
PASTED = {
    "training": [_paste(RELEASED["mixtral-8x7b"][2], seq_len="4096", micro_batch="1"),
                 _paste(RELEASED["deepseek-v3"][2], seq_len="4096"),
                 _paste({**RELEASED["mixtral-8x7b"][2], "model_type": "mixtral_next"})],
    "kv": [_paste(RELEASED["mixtral-8x7b"][2], gpu="h200", tp_size="1", context_len="4096"),
           _paste(RELEASED["deepseek-v3"][2], gpu="h200", tp_size="8", context_len="4096"),
           _paste({**RELEASED["deepseek-v3"][2], "model_type": "deepseek_v4"}, tp_size="1")],
}
KNOB_KIND = {"seq_len": int, "micro_batch": int, "dp_size": int, "tp_size": int,
             "pp_size": int, "context_len": int, "gpu_memory_utilization": float, "kv_bytes": int,
             "weight_bytes": int, "zero_stage": int, "num_gpus": int, "gpus_per_node": int,
             "global_batch": int}
PLAN_COLUMNS = ("tp_size", "pp_size", "v", "dp_size", "cp_size", "zero_stage", "recompute",
                "sequence_parallel", "micro_batch", "num_microbatches", "step_time_s", "mfu",
                "total")
TOP = 5


def _form(page, calc):
    """The values the form holds now, by field name."""
    return calc.evaluate("""el => Object.fromEntries(Array.from(
        el.querySelectorAll('.labkit-calc-input')).map(f => [f.name, f.value]))""")


# Puts values into the form as typing leaves it: the preset first, then the pasted config.json,
# each with its own event (each refills the shape fields from the model it names), then every
# other field, with one input event after the last. Each field's handler recomputes from the whole
# form, so that event computes what typing field by field computes last, without the page
# recomputing once per field on the way (most of these tests' time, measured).
SET_FORM = """(el, values) => {
  let last = null;
  for (const [name, value] of Object.entries(values)) {
    const box = el.querySelector(`[name="${name}"]`);
    if (!box) throw new Error(`the form has no field ${name}`);
    box.value = value;
    if (box.value !== value) throw new Error(`${name} does not take ${JSON.stringify(value)}`);
    if (name === "preset") box.dispatchEvent(new Event("change", {bubbles: true}));
    else if (name === "config_json") box.dispatchEvent(new Event("input", {bubbles: true}));
    else last = box;
  }
  if (last) last.dispatchEvent(new Event("input", {bubbles: true}));
}"""


def _set(page, calc, values: dict) -> dict:
    """Type ``values`` into the form (SET_FORM) and return all of the form's fields as the page
    holds them."""
    model = [n for n in ("preset", "config_json") if n in values]
    assert list(values)[:len(model)] == model, f"the model first, then the knobs: {values}"
    calc.evaluate(SET_FORM, values)
    return _form(page, calc)


def _expected_inputs(form: dict, kind: str) -> dict:
    """The form's fields as Python values, as the page's Python reads them."""
    got = {"preset": form["preset"]}
    if form["preset"] == PASTE:
        got["config_json"] = form["config_json"]
    for name in SHAPE:
        got[name] = int(form[name]) if form[name].strip() else None
    for name, text in form.items():
        if name in got or name == "config_json":
            continue
        if name == "sequence_parallel":
            got[name] = text == "on"
        elif name in ("micro_batches", "interleave"):
            got[name] = [int(t) for t in text.split(",") if t.strip()]
        else:
            got[name] = KNOB_KIND.get(name, str)(text)
    return got


def _model(got: dict) -> ModelShape:
    if got["preset"] == PASTE:
        return ModelShape.from_hf_config(read_config_json(got["config_json"]))
    return PRESETS[got["preset"]]


def _estimate(kind: str, got: dict, lang: str = "en") -> dict:
    """What labkit returns for these inputs: {data-name: value}, with "error" (the message) if
    refused; the model's parameters once its shape is read; the messages (a refusal, why nothing
    fits) as labkit.messages renders them in ``lang``."""
    model = {}
    try:
        shape = replace(_model(got), **{n: got[n] for n in SHAPE})
        model = {"num_params": shape.num_params(), "active_params": shape.active_params()}
        return {**model, **_memory(kind, shape, got, lang)}
    except (ValueError, TypeError) as e:
        return {**model, "error": error_message(e, lang)}


def _memory(kind: str, shape: ModelShape, got: dict, lang: str) -> dict:
    capacity = GPUS[got["gpu"]].memory_bytes
    if kind == "plans":
        return _plans(shape, got, lang)
    if kind == "kv":
        check_context_len(shape, got["context_len"])
        est = serving_memory(shape, gpu=got["gpu"], tp_size=got["tp_size"],
                             weight_bytes=got["weight_bytes"], kv_bytes=got["kv_bytes"],
                             gpu_memory_utilization=got["gpu_memory_utilization"])
        d = est.to_dict()
        d["total"] = est.weights + est.activation_peak + est.non_torch + est.kv_cache
        out = {k: d[k] for k in SERVE_PARTS}
        conc = est.max_concurrency(got["context_len"])
        out.update(num_blocks=est.num_blocks, max_tokens=est.max_tokens,
                   max_concurrency=conc, serves=int(conc > 0),
                   fits=int(d["total"] <= capacity))
        return out
    dims = SimpleNamespace(dp_size=got.get("dp_size", 1), tp_size=got.get("tp_size", 1),
                           pp_size=got.get("pp_size", 1), cp_size=1)
    kw = {k: got[k] for k in ("zero_stage", "recompute", "sequence_parallel", "precision",
                              "optimizer")
          if k in got}
    runs = {f"z{s}-": {"zero_stage": s} for s in range(4)} if kind == "zero" else {"": {}}
    out = {}
    for prefix, over in runs.items():
        d = training_memory(shape, seq_len=got["seq_len"], micro_batch=got["micro_batch"],
                            dims=dims, **kw, **over).to_dict()
        out.update({prefix + k: d[k] for k in TRAIN_PARTS})
        out[prefix + "fits"] = int(d["total"] <= capacity)
    return out


def _plans(shape, got: dict, lang: str = "en") -> dict:
    found = plan_training(shape, gpu=got["gpu"], num_gpus=got["num_gpus"],
                          gpus_per_node=got["gpus_per_node"], seq_len=got["seq_len"],
                          global_batch=got["global_batch"],
                          micro_batches=tuple(got["micro_batches"]),
                          interleave=tuple(got["interleave"]))
    out = {"considered": found.considered, "fitting": len(found.plans)}
    if not found.plans:
        out["reason"] = training_reason(found.overflows, lang)
        return out
    best = found.plans[0]
    out.update({k: getattr(best.memory, k) for k in TRAIN_PARTS})
    out["fits"] = int(best.memory.total <= best.limit_bytes)
    for i, plan in enumerate(found.plans[:TOP]):
        row = {**plan.to_dict(), "total": plan.memory.total}
        out.update({f"p{i}-{k}": row[k] for k in PLAN_COLUMNS})
    return out


def _plan_text(name: str, value, lang: str = "en") -> str | None:
    """What the plans table shows for a value (None: not a table cell)."""
    if name == "step_time_s":
        return render("unit.seconds", lang, value=value)
    if name == "mfu":
        return render("unit.percent", lang, value=100 * value)
    if name == "total":
        return _gb(value)
    if name == "sequence_parallel":
        return render("value.on" if value else "value.off", lang)
    if name == "recompute":
        return render(f"option.recompute.{value}", lang)
    return str(value)


def _shown(calc, want: dict, timeout: float = 30.0, progress: set | None = None) -> dict:
    """Wait until the output was computed from ``want`` (its data-inputs), then read it; into
    ``progress``, what the page said of a sweep under way while it waited."""
    out = calc.locator(".labkit-calc-output")
    deadline = Deadline(timeout)
    while True:
        if progress is not None:  # a page frozen by the sweep answers only once it is done
            progress.add(calc.locator(".labkit-calc-progress").inner_text())
        raw = out.get_attribute("data-inputs")
        state = out.get_attribute("data-state")
        if state in ("ok", "error") and raw and json.loads(raw) == want:
            break
        if deadline.passed():
            pytest.fail(f"the calculator did not show {want} {deadline.said()}: "
                        f"data-inputs={raw!r}, state={state}")
        time.sleep(0.1)
    values = out.evaluate("""el => Object.fromEntries(Array.from(
        el.querySelectorAll('.labkit-calc-value')).map(v => [v.dataset.name,
                                                             [v.dataset.value, v.textContent]]))""")
    if state == "error":
        values["error"] = out.locator(".labkit-calc-error").inner_text()
    return values


def _open(page, on, url: str, problems: list, requests: list) -> None:
    """Load ``url`` in ``page`` (the worker's tab, conftest.book_tab, or a test's own), its
    requests and problems recorded through ``on`` (the visit's, or ``page.on``)."""
    on("request", lambda r: requests.append(r.url))
    on("pageerror", lambda err: problems.append(f"page error: {err}"))
    on("console", lambda m: _console(m, problems))
    patiently(f"{url} did not load", lambda ms: page.goto(url, wait_until="load", timeout=ms), 60)


def _console(msg, problems: list) -> None:
    # The browser asks the server root for /favicon.ico by itself; the book has none.
    if msg.type == "error" and not msg.location.get("url", "").endswith("/favicon.ico"):
        problems.append(f"console: {msg.text} ({msg.location.get('url', '')})")


def _ready(page) -> None:
    # asked every 100 ms, not at every animation frame (Playwright's default), which would keep the
    # page painting frames while Brython compiles
    patiently("the page's calculators did not get ready (Brython compiles labkit in the page)",
              lambda ms: page.wait_for_function(
                  "() => Array.from(document.querySelectorAll('.labkit-calc'))"
                  ".every(el => el.dataset.ready === '1')", polling=100, timeout=ms), LOAD_S)


def _gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB"


def _check_shown(kind: str, shown: dict, expected: dict, inputs: dict, lang: str = "en") -> None:
    assert set(shown) == set(expected), f"{kind} {inputs}: shown {sorted(shown)}, labkit {sorted(expected)}"
    for name, want in expected.items():
        if name == "error":
            assert shown[name] == want, f"{kind} {inputs}: the page's error differs from labkit's"
            continue
        value, text = shown[name]
        part = name.split("-")[-1]
        if name == "reason":
            assert text == want, f"{kind} {inputs}: the page says {text!r}, labkit {want!r}"
        elif kind == "plans" and name.startswith("p") and "-" in name:
            if isinstance(want, float):  # the page's floats are JavaScript's doubles
                assert math.isclose(float(value), want, rel_tol=1e-12), (kind, inputs, name, value)
            else:
                assert value == str(want), f"{kind} {inputs}: {name} shown {value}, labkit {want}"
            assert text == _plan_text(part, want, lang), f"{kind} {inputs}: {name} reads {text!r}"
        else:
            assert int(value) == want, f"{kind} {inputs}: {name} shown {value}, labkit {want}"
        if name == "reason" or (kind == "plans" and name.startswith("p") and "-" in name):
            continue
        if part in TRAIN_PARTS + SERVE_PARTS:
            assert text == _gb(want), f"{kind} {inputs}: {name} reads {text!r}"
        elif part in ("num_blocks", "max_tokens", "max_concurrency"):
            assert text == str(want), f"{kind} {inputs}: {name} reads {text!r}"
        elif part in ("num_params", "active_params"):
            assert text == f"{want:,}", f"{kind} {inputs}: {name} reads {text!r}"


def test_every_calculator_is_tested(built_book):
    found = {}
    for path in built_book.html.rglob("*.html"):
        for kind in re.findall(r'class="labkit-calc" data-kind="(\w+)"', path.read_text("utf-8")):
            found.setdefault(kind, []).append(path.relative_to(built_book.html).as_posix())
    # each calculator on its chapter's page, in both editions
    assert {k: sorted([f"{p}.html", f"zh/{p}.html"]) for k, p in PAGES.items()}.items() \
        <= {k: sorted(v) for k, v in found.items()}.items(), found
    assert set(found) <= set(INPUTS), f"calculators without a browser test: {found}"


@pytest.mark.parametrize("kind", sorted(PAGES))
def test_calculator_shows_labkits_numbers(book_tab, site, kind):
    problems, requests = [], []
    with book_tab.visit() as (page, on):
        _open(page, on, f"{site}/{PAGES[kind]}.html", problems, requests)
        _ready(page)
        calc = page.locator(f'.labkit-calc[data-kind="{kind}"]').first
        fits, progress = set(), set()
        for inputs in INPUTS[kind] + PASTED.get(kind, []):
            got = _expected_inputs(_set(page, calc, inputs), kind)
            expected = _estimate(kind, got)
            _check_shown(kind, _shown(calc, got, progress=progress), expected, inputs)
            fits.update(v for k, v in expected.items()
                        if k.endswith(("fits", "serves")) and not k.startswith("p"))
            fits.update([0] if "reason" in expected else [])
            fits.add("error" if "error" in expected else "ok")
        assert fits >= {0, 1, "error", "ok"}, f"{kind}: the inputs must include runs that fit, " \
                                               "do not fit, and are refused"
        if kind == "plans":  # the sweep (seconds in the page) says how far it is as it runs
            assert any(re.fullmatch(r"computing: \d+ of \d+ layouts sized", t) for t in progress), progress
    outside = [u for u in requests if urlsplit(u).hostname not in LOCAL_HOSTS]
    assert not outside, f"{kind}: requests outside the book: {outside}"
    assert not problems, "\n".join(problems)


def test_calculator_works_from_file_without_network(browser, built_book):  # noqa: F811
    """From file://, with every http(s) request blocked: Python loads and shows labkit's numbers."""
    problems, requests = [], []
    url = (built_book.html / f"{PAGES['kv']}.html").as_uri()

    def route(r):
        if r.request.url.startswith("file://"):
            r.continue_()
        else:
            r.abort("blockedbyclient")

    context = browser.new_context(viewport={"width": 1280, "height": 900})
    context.route("**/*", route)  # its own context: a route turns the HTTP cache off
    try:
        page = context.new_page()
        _open(page, page.on, url, problems, requests)
        _ready(page)
        calc = page.locator('.labkit-calc[data-kind="kv"]').first
        inputs = INPUTS["kv"][0]
        got = _expected_inputs(_set(page, calc, inputs), "kv")
        _check_shown("kv", _shown(calc, got), _estimate("kv", got), inputs)
    finally:
        context.close()
    outside = [u for u in requests if not u.startswith(("file://", "data:"))]
    assert not outside, f"requests outside the book's folder: {outside}"
    assert not problems, "\n".join(problems)


def test_page_says_when_the_calculator_cannot_load(browser, site):  # noqa: F811
    """Without its Python runtime, the page says in words that the calculator could not load."""
    context = browser.new_context()
    context.route("**/brython*.js", lambda r: r.abort("blockedbyclient"))
    page = context.new_page()
    try:
        url = f"{site}/{PAGES['training']}.html"
        patiently(f"{url} did not load", lambda ms: page.goto(url, wait_until="load", timeout=ms), 60)
        status = page.locator(".labkit-calc-status").first.inner_text()
    finally:
        context.close()
    assert "could not load" in status, status


def _calculators_ext():
    import importlib.util

    spec = importlib.util.spec_from_file_location("calculators", ROOT / "_ext" / "calculators.py")
    ext = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ext)
    return ext


def test_the_bundle_holds_what_importing_the_estimator_and_planner_loads():
    """The modules the page gets are the labkit modules that importing labkit.estimate and
    labkit.plan loads here (read from their imports, without importing them), torch left out."""
    import subprocess
    import sys

    ext = _calculators_ext()
    bundled = set(ext.labkit_modules(ROOT, ext.entries_for(ROOT)))
    code = ("import sys; sys.modules['torch'] = None; import labkit.estimate, labkit.plan, "
            "labkit.memory.analytic, labkit.messages; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'labkit'))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                          check=True)
    assert bundled == set(eval(proc.stdout)), proc.stdout  # noqa: S307 (our own printed list)


def test_the_bundle_refuses_a_module_that_imports_torch_when_it_loads(tmp_path):
    from sphinx.errors import ExtensionError

    ext = _calculators_ext()
    pkg = tmp_path / "labkit"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from .fine import f\n")
    (pkg / "fine.py").write_text("import math\n\ndef f():\n    import torch\n")
    assert set(ext.labkit_modules(tmp_path, ("labkit.fine",))) == {"labkit", "labkit.fine"}
    (pkg / "bad.py").write_text("from . import fine\ntry:\n    import torch\nexcept ImportError:\n"
                                "    pass\n")
    with pytest.raises(ExtensionError, match="labkit.bad imports torch"):
        ext.labkit_modules(tmp_path, ("labkit.bad",))


# The calculators outside the book: a page per language with one calculator of each kind, built
# from the same runtime and bundle the book copies (_ext/calculators.py), opened from file://.
STANDALONE = """<!DOCTYPE html>
<html lang="{lang}"><head><meta charset="utf-8">
<script src="brython.js"></script><script src="brython_stdlib.js"></script>
<script src="labkit.brython.js"></script>
<script type="text/python">import calculator_ui
calculator_ui.main()</script></head>
<body>{divs}</body></html>
"""
# Beyond INPUTS, what a reader may type that labkit refuses, each rendered from its kind: a
# mixture of experts (untrainable), a word for a number, a model the table's GPU cannot plan
# (no bf16 peak), nothing fitting.
MORE_INPUTS = {
    "training": [{"preset": "mixtral-8x7b"}, {"preset": "gpt2-small", "seq_len": "abc"}],
    "zero": [{"preset": "gpt2-small", "n_head": "5"},
             {"preset": PASTE, "config_json": '{"model_type": "llama",\n "hidden_size": 4096,}'}],
    "activations": [{"preset": "llama-2-7b", "n_kv_head": "3"}, {"preset": PASTE, "config_json": ""}],
    "parallel": [{"preset": "gpt2-small", "pp_size": "13"}],
    "kv": [{"preset": "llama-2-70b", "gpu": "t4", "tp_size": "1", "context_len": "4096"}],
    "plans": [{"preset": "gpt2-small", "gpu": "t4", "num_gpus": "1", "global_batch": "8",
               "seq_len": "1024", "micro_batches": "1", "interleave": "1"},
              {"preset": "llama-2-70b", "gpu": "t4", "num_gpus": "1", "global_batch": "1"}],
}
NAMES = ("preset",)  # its options are the published models' names


@pytest.fixture(scope="module")
def standalone(tmp_path_factory):
    """{language: file:// address of the page}."""
    import shutil

    from sphinx.errors import ExtensionError

    ext = _calculators_ext()
    try:
        data = ext.brython_data()
    except ExtensionError as e:
        pytest.skip(str(e))
    folder = tmp_path_factory.mktemp("calculators")
    for name in ext.RUNTIME:
        shutil.copy2(data / name, folder / name)
    (folder / "labkit.brython.js").write_text(ext.bundle(ROOT), encoding="utf-8")
    divs = "".join(f'<div class="labkit-calc" data-kind="{kind}"></div>' for kind in INPUTS)
    pages = {}
    for lang, code in (("en", "en"), ("zh_CN", "zh-CN")):
        (folder / f"{lang}.html").write_text(STANDALONE.format(lang=code, divs=divs), encoding="utf-8")
        pages[lang] = (folder / f"{lang}.html").as_uri()
    return pages


def _refused(calc, timeout: float = 30.0) -> str:
    """The error the output shows for inputs the page could not read (data-inputs empty)."""
    out, deadline = calc.locator(".labkit-calc-output"), Deadline(timeout)
    while not (out.get_attribute("data-state") == "error" and not out.get_attribute("data-inputs")):
        if deadline.passed():
            pytest.fail(f"the calculator did not refuse the form {deadline.said()}: "
                        f"{out.inner_text()!r}")
        time.sleep(0.1)
    return out.locator(".labkit-calc-error").inner_text()


def _words_shown(calc) -> list:
    """Every text the calculator shows: labels, choices (not those of NAMES), progress, output,
    and the titles of the bar's parts."""
    return calc.evaluate("""(el, names) => {
        const out = [];
        el.querySelectorAll('label > span').forEach(s => out.push(s.textContent));
        el.querySelectorAll('select').forEach(s => {
            if (!names.includes(s.name)) s.querySelectorAll('option').forEach(o => out.push(o.textContent));
        });
        el.querySelectorAll('.labkit-calc-progress, .labkit-calc-output').forEach(o => out.push(o.innerText));
        el.querySelectorAll('[title]').forEach(t => out.push(t.title));
        return out; }""", list(NAMES))


@pytest.mark.parametrize("lang", ["zh_CN", "en"])
def test_calculators_speak_the_pages_language(book_tab, standalone, lang):
    """Each calculator on a page of each language: the numbers are labkit's, every message is
    rendered from data in the page's language (a refusal from the error's kind and fields, why
    nothing fits from the planner's overflows), and a Chinese page shows no English word outside
    the glossary's kept list (tests/test_i18n.py's scan); an English page no Chinese."""
    from test_i18n import english_words, kept_latin

    problems, requests = [], []
    kept, cjk = kept_latin(), re.compile(r"[\u4e00-\u9fff]")
    with book_tab.visit() as (page, on):
        _open(page, on, standalone[lang], problems, requests)
        _ready(page)
        seen = set()
        for kind in INPUTS:
            calc = page.locator(f'.labkit-calc[data-kind="{kind}"]').first
            progress = set()
            for inputs in INPUTS[kind] + MORE_INPUTS[kind]:
                form = _set(page, calc, inputs)
                typed = [n for n, v in inputs.items() if n in KNOB_KIND and not v.strip().isdigit()
                         and KNOB_KIND[n] is int]
                if typed:  # a word for a number: the page says which field, with nothing computed
                    expected = {"error": render("error.not_a_number", lang, name=typed[0],
                                                text=form[typed[0]])}
                    assert _refused(calc) == expected["error"], (kind, inputs)
                else:
                    got = _expected_inputs(form, kind)
                    expected = _estimate(kind, got, lang)
                    _check_shown(kind, _shown(calc, got, progress=progress), expected, inputs, lang)
                seen |= {"error" if "error" in expected else "reason" if "reason" in expected else "ok"}
                texts = [t for t in _words_shown(calc) + sorted(progress) if t.strip()]
                if lang == "zh_CN":
                    english = {t: w for t in texts if (w := english_words(t, kept))}
                    assert not english, f"{kind} {inputs}: English on the Chinese page: {english}"
                    if "error" in expected:
                        assert cjk.search(expected["error"]), expected["error"]
                else:
                    chinese = [t for t in texts if cjk.search(t)]
                    assert not chinese, f"{kind} {inputs}: Chinese on the English page: {chinese}"
        assert seen == {"ok", "error", "reason"}, seen
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("kind", ["training", "plans", "kv"])
def test_chinese_edition_calculator_speaks_chinese(book_tab, site, kind):
    """The calculator on its Chinese page (the built book's zh/ edition, <html lang> from Sphinx's
    ``language``) shows its labels and results in Chinese, with no English word outside the
    glossary's kept list; the pasted config.json files show labkit's numbers, or its refusal in
    Chinese."""
    from test_i18n import english_words, kept_latin

    problems, requests, texts, errors = [], [], [], []
    with book_tab.visit() as (page, on):
        _open(page, on, f"{site}/zh/{PAGES[kind]}.html", problems, requests)
        _ready(page)
        calc = page.locator(f'.labkit-calc[data-kind="{kind}"]').first
        for inputs in [INPUTS[kind][1]] + PASTED.get(kind, []):
            got = _expected_inputs(_set(page, calc, inputs), kind)
            expected = _estimate(kind, got, "zh_CN")
            _check_shown(kind, _shown(calc, got), expected, inputs, "zh_CN")
            errors += [expected["error"]] if "error" in expected else []
            texts += [t for t in _words_shown(calc) if t.strip()]
    assert any(re.search(r"[\u4e00-\u9fff]", t) for t in texts), texts
    english = {t: w for t in texts if (w := english_words(t, kept_latin()))}
    assert not english, f"zh {kind}: English in the calculator: {english}"
    if kind in PASTED:  # the unknown model_type, refused in Chinese
        assert any(e.startswith("labkit 不读取 model_type=") for e in errors), errors
    assert not problems, "\n".join(problems)
