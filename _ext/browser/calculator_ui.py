"""The book's calculators, in the page: Python run by Brython (see _ext/calculators.py).

Each ``<div class="labkit-calc" data-kind="...">`` that the ``{calculator}`` directive wrote gets
a form; every change re-reads the form, calls ``labkit.estimate`` (the package the tests check)
and writes the result: a bar of the per-GPU bytes and the numbers. Nothing here computes memory:
it reads inputs, calls labkit, and formats what labkit returned.

The form's ``preset`` picks a published shape, or ``config.json``: a Hugging Face config.json
pasted beside it, parsed here by Brython's json and read by ``ModelShape.from_hf_config`` (the
same Python; a refused config is shown as labkit's refusal, never replaced by a preset). The
shape fields below start at the model's values and override them (``dataclasses.replace``), so a
reader can type any shape. The output starts with the model's total and active parameters. Every
number shown carries its exact value in ``data-value``; the output carries the inputs it was
computed from in ``data-inputs`` (JSON), so a test can check the page against the estimator.

Every word shown (labels, option texts, column heads, units, progress, verdicts, the planner's
reasons and labkit's refusals) comes from ``labkit.messages``' table of the page's language
(``<html lang>``): the reasons are rendered from the planner's data (``TrainingPlans.overflows``),
a refusal from the exception's ``kind`` and ``fields`` (``labkit.validate.ArgumentError``).
"""

import json
from dataclasses import replace

from browser import document, html, timer, window

from labkit.estimate import OPTIMIZERS, PRECISIONS, check_context_len, serving_memory, training_memory
from labkit.hardware import GPUS
from labkit.memory.analytic import RECOMPUTE
from labkit.messages import error_message, known, language, pieces, render, training_reason
from labkit.hf_config import read_config_json
from labkit.shapes import PRESETS, ModelShape

SHAPE_FIELDS = ("n_layer", "d_model", "n_head", "n_kv_head", "d_ff", "vocab_size")
OPTIONAL = ("n_kv_head", "d_ff")  # empty: the preset family's default (multi-head, 4 h)
PASTED = "config.json"  # the preset choice that reads the pasted config.json (field "config_json")

# name: (kind, default, choices); the label a reader sees is labkit.messages' "label.<name>",
# and a choice's text its "option.<name>.<choice>" where the catalogue has one
KNOBS = {
    "gpu": ("choice", "a100-80gb", tuple(GPUS)),
    "seq_len": ("int", 4096, None),
    "micro_batch": ("int", 1, None),
    "dp_size": ("int", 8, None),
    "tp_size": ("int", 1, None),
    "pp_size": ("int", 1, None),
    "zero_stage": ("choice", "0", ("0", "1", "2", "3")),
    "recompute": ("choice", "none", RECOMPUTE),
    "sequence_parallel": ("choice", "off", ("off", "on")),
    "precision": ("choice", "bf16-mixed", tuple(PRECISIONS)),
    "optimizer": ("choice", "adamw", tuple(OPTIMIZERS)),
    "weight_bytes": ("choice", "2", ("1", "2", "4")),
    "kv_bytes": ("choice", "2", ("1", "2", "4")),
    "context_len": ("int", 4096, None),
    "gpu_memory_utilization": ("float", 0.9, None),
    "num_gpus": ("int", 8, None),
    "gpus_per_node": ("int", 8, None),
    "global_batch": ("int", 64, None),
    "micro_batches": ("ints", "1", None),
    "interleave": ("ints", "1", None),
}

KINDS = {
    "training": ("gpu", "seq_len", "micro_batch", "recompute", "precision", "optimizer"),
    "zero": ("gpu", "dp_size", "seq_len", "micro_batch", "precision", "optimizer"),
    "activations": ("gpu", "tp_size", "sequence_parallel", "seq_len", "micro_batch", "recompute"),
    "parallel": ("gpu", "dp_size", "tp_size", "pp_size", "zero_stage", "recompute",
                 "sequence_parallel", "seq_len", "micro_batch"),
    "kv": ("gpu", "tp_size", "context_len", "kv_bytes", "weight_bytes", "gpu_memory_utilization"),
    "plans": ("gpu", "num_gpus", "gpus_per_node", "seq_len", "global_batch", "micro_batches",
              "interleave"),
}
TOP = 5  # plans shown
STEP_MS = 40  # the planner's sweep runs this long between the browser's turns (it stays responsive)
PLAN_COLUMNS = ("tp_size", "pp_size", "v", "dp_size", "cp_size", "zero_stage", "recompute",
                "sequence_parallel", "micro_batch", "num_microbatches", "step_time_s", "mfu", "total")

TRAIN_PARTS = ("params", "grads", "optimizer", "activations", "transient", "non_torch")
SERVE_PARTS = ("weights", "activation_peak", "non_torch", "kv_cache")


def _page_language():
    """The catalogue of the page's language (<html lang>, from Sphinx's ``language``); English
    for a language labkit.messages has no catalogue for."""
    try:
        return language(document.documentElement.lang or "en")
    except ValueError:
        return "en"


LANG = _page_language()


def _t(kind, **fields):
    """``kind`` from labkit.messages' table of the page's language."""
    return render(kind, LANG, **fields)


def _option(name, choice):
    kind = f"option.{name}.{choice}"
    return _t(kind) if known(kind) else str(choice)


class Dims:
    """The parallel degrees ``training_memory`` reads (duck-typed like ``ParallelDims``)."""

    def __init__(self, dp_size=1, tp_size=1, pp_size=1, cp_size=1):
        self.dp_size, self.tp_size, self.pp_size, self.cp_size = dp_size, tp_size, pp_size, cp_size


def gb(n):
    return _t("unit.gb", value=n / 1e9)


def _field(calc, name, value, choices=None):
    """A labelled box of the form: its label and its choices' texts in the page's language, its
    values the code's."""
    if name == "config_json":  # the pasted config.json: a text area beside the preset
        box = html.TEXTAREA(name=name, rows=6, cols=48, placeholder=_t("calc.paste_here"),
                            spellcheck="false", **{"class": "labkit-calc-input labkit-calc-config"})
    elif choices is None:
        box = html.INPUT(type="text", value="" if value is None else str(value), size=7,
                         name=name, **{"class": "labkit-calc-input"})
    else:
        box = html.SELECT(name=name, **{"class": "labkit-calc-input"})
        for c in choices:
            box <= html.OPTION(_option(name, c), value=str(c), selected=(str(c) == str(value)))
    calc.fields[name] = box
    return html.LABEL(html.SPAN(_t("label." + name)) + box)


class FormError(ValueError):
    """A field that is not a number: ``kind`` and ``fields`` as labkit's ArgumentError has them."""

    def __init__(self, name, text):
        super().__init__(f"{name}: {text!r} is not a number")
        self.kind, self.fields = "not_a_number", {"name": name, "text": text}


class Calculator:
    def __init__(self, root):
        self.root = root
        self.kind = root.attrs["data-kind"]
        self.fields = {}
        preset = root.attrs.get("data-preset", "llama-2-7b")
        form = html.DIV(Class="labkit-calc-form")
        form <= _field(self, "preset", preset, tuple(PRESETS) + (PASTED,))
        self.paste = _field(self, "config_json", None)
        self.paste.attrs["class"] = "labkit-calc-paste"
        form <= self.paste
        for name in SHAPE_FIELDS:
            form <= _field(self, name, None)
        for name in KINDS[self.kind]:
            kind, default, choices = KNOBS[name]
            default = root.attrs.get("data-" + name.replace("_", "-"), default)
            form <= _field(self, name, default, choices)
        self.out = html.DIV(Class="labkit-calc-output")
        self.progress = html.P(Class="labkit-calc-progress")  # how far a sweep is (the planner's)
        self.run = 0  # the sweep under way; an older one stops at its next step
        root.clear()
        root <= form
        root <= self.progress
        root <= self.out
        self.fill_shape()
        self.fields["preset"].bind("change", lambda ev: (self.fill_shape(), self.update()))
        self.fields["config_json"].bind("input", lambda ev: (self.fill_shape(), self.update()))
        for name, box in self.fields.items():
            if name not in ("preset", "config_json"):
                box.bind("input", lambda ev: self.update())
                box.bind("change", lambda ev: self.update())
        self.pending = None
        self.update()

    def update(self):
        """Recompute now, or for the planner (a sweep: seconds in the page) once typing stops."""
        if self.kind != "plans":
            self.compute()
            return
        if self.pending is not None:
            timer.clear_timeout(self.pending)
        self.run += 1  # a sweep of the old inputs stops
        self.out.attrs["data-state"] = "computing"
        self.out.style.opacity = "0.5"
        self.pending = timer.set_timeout(self.compute, 400)

    def fill_shape(self):
        """The shape fields from the preset or the pasted config.json (one that is refused leaves
        them as they were: compute() shows the refusal)."""
        pasted = self.fields["preset"].value == PASTED
        self.paste.style.display = "flex" if pasted else "none"
        try:
            shape = model_shape(self.inputs_model())
        except (ValueError, TypeError):
            return
        for name in SHAPE_FIELDS:
            value = getattr(shape, name)
            self.fields[name].value = "" if value is None else str(value)

    def inputs_model(self):
        """The model chosen: {"preset": name}, with "config_json" (the pasted text) for PASTED."""
        got = {"preset": self.fields["preset"].value}
        if got["preset"] == PASTED:
            got["config_json"] = self.fields["config_json"].value
        return got

    def inputs(self):
        """The form as Python values (a ValueError names a field that is not a number)."""
        got = self.inputs_model()
        for name in SHAPE_FIELDS:
            text = self.fields[name].value.strip()
            got[name] = None if (text == "" and name in OPTIONAL) else _number(name, text, int)
        for name in KINDS[self.kind]:
            kind = KNOBS[name][0]
            text = self.fields[name].value.strip()
            if kind == "int":
                got[name] = _number(name, text, int)
            elif kind == "float":
                got[name] = _number(name, text, float)
            elif kind == "ints":
                got[name] = [_number(name, t.strip(), int) for t in text.split(",") if t.strip()]
            elif name in ("zero_stage", "weight_bytes", "kv_bytes"):
                got[name] = int(text)
            elif name == "sequence_parallel":
                got[name] = text == "on"
            else:
                got[name] = text
        return got

    def compute(self):
        self.pending = None
        got = shape = None
        try:
            got = self.inputs()
            shape = replace(model_shape(got), **{n: got[n] for n in SHAPE_FIELDS})
            if self.kind == "plans":
                self.start_plans(shape, got)
                return
            body = self.serving(shape, got) if self.kind == "kv" else self.training(shape, got)
            self.show(body, got, "ok", shape)
        except (ValueError, TypeError) as e:
            self.show(_error(e), got, "error", shape)

    def show(self, body, got, state, shape=None):
        """The output: the model's parameters (once its shape is read), then ``body``."""
        self.progress.text = ""
        self.out.style.opacity = "1"
        self.out.clear()
        if shape is not None:
            self.out <= html.P(_spans("calc.model_params", num_params=shape.num_params(),
                                      active_params=shape.active_params()), Class="labkit-calc-model")
        self.out <= body
        self.out.attrs["data-inputs"] = json.dumps(got, sort_keys=True) if got else ""
        self.out.attrs["data-state"] = state
        self.root.attrs["data-ready"] = "1"

    def training(self, shape, got):
        capacity = GPUS[got["gpu"]].memory_bytes
        if self.kind == "zero":
            body = html.DIV()
            for stage in range(4):
                d = self._train(shape, got, zero_stage=stage).to_dict()
                body <= html.DIV(html.B(_t("zero_stage", stage=stage))
                                 + _bar(d, TRAIN_PARTS, capacity)
                                 + _numbers(d, TRAIN_PARTS, capacity, f"z{stage}-"))
            return body
        est = self._train(shape, got)
        d = est.to_dict()
        return html.DIV(_bar(d, TRAIN_PARTS, capacity) + _numbers(d, TRAIN_PARTS, capacity, ""))

    def _train(self, shape, got, **over):
        dims = Dims(got.get("dp_size", 1), got.get("tp_size", 1), got.get("pp_size", 1))
        kw = {k: got[k] for k in ("zero_stage", "recompute", "sequence_parallel", "precision",
                                  "optimizer") if k in got}
        kw.update(over)
        return training_memory(shape, seq_len=got["seq_len"], micro_batch=got["micro_batch"],
                               dims=dims, **kw)

    def serving(self, shape, got):
        check_context_len(shape, got["context_len"])  # as plan_serving and the command line refuse it
        est = serving_memory(shape, gpu=got["gpu"], tp_size=got["tp_size"],
                             weight_bytes=got["weight_bytes"], kv_bytes=got["kv_bytes"],
                             gpu_memory_utilization=got["gpu_memory_utilization"])
        d = est.to_dict()
        capacity = GPUS[got["gpu"]].memory_bytes
        d["total"] = est.weights + est.activation_peak + est.non_torch + est.kv_cache
        conc = est.max_concurrency(got["context_len"])
        counts = html.UL(Class="labkit-calc-counts")
        for name, label, value in (("num_blocks", _t("calc.kv_blocks"), est.num_blocks),
                                   ("max_tokens", _t("calc.tokens_cached"), est.max_tokens),
                                   ("max_concurrency", _t("calc.requests_of", n=got["context_len"]),
                                    conc)):
            counts <= html.LI(label + _t("plan.colon") + _value(name, value, str(value)))
        verdict = _t("calc.serves") if conc > 0 else _t("calc.serves_none")
        return html.DIV(_bar(d, SERVE_PARTS, capacity) + _numbers(d, SERVE_PARTS, capacity, "")
                        + counts + html.P(_value("serves", int(conc > 0), verdict),
                                          Class="labkit-calc-verdict"))

    def start_plans(self, shape, got):
        """Check the inputs (a ValueError names one), then run the sweep in steps."""
        from labkit.plan import plan_training

        steps = plan_training(shape, gpu=got["gpu"], num_gpus=got["num_gpus"],
                              gpus_per_node=got["gpus_per_node"], seq_len=got["seq_len"],
                              global_batch=got["global_batch"],
                              micro_batches=tuple(got["micro_batches"]),
                              interleave=tuple(got["interleave"]), stepwise=True)
        self.run += 1
        self.step_plans(steps, got, self.run, shape)

    def step_plans(self, steps, got, run, shape):
        """Size configurations for STEP_MS, say how far the sweep is, then give the browser its
        turn; show the plans at the end. A newer run (the inputs changed) ends this one."""
        if run != self.run:
            return
        try:
            end = window.performance.now() + STEP_MS
            for done, total, found in steps:
                if found is not None:
                    self.show(self.plans(found), got, "ok", shape)
                    return
                if window.performance.now() > end:
                    break
            self.progress.text = _t("calc.progress", done=done, total=total)
            timer.set_timeout(lambda: self.step_plans(steps, got, run, shape), 0)
        except (ValueError, TypeError) as e:
            self.show(_error(e), got, "error", shape)

    def plans(self, found):
        """The sweep's result: how many sized and fit, the fastest plan's memory, the best TOP."""
        body = html.DIV()
        body <= html.P(_spans("calc.sized", considered=found.considered, fitting=len(found.plans)))
        if not found.plans:  # the reasons, from the overflows' data, in the page's language
            reason = training_reason(found.overflows, LANG)
            body <= html.P(_spans("calc.nothing_fits", reason=reason), Class="labkit-calc-verdict")
            return body
        best = found.plans[0]
        d = best.memory.to_dict()
        body <= html.P(_t("calc.best_memory", limit=best.limit_bytes))
        body <= _bar(d, TRAIN_PARTS, best.limit_bytes) + _numbers(d, TRAIN_PARTS, best.limit_bytes, "")
        table = html.TABLE(Class="labkit-calc-table labkit-calc-plans")
        table <= html.TR([html.TH(_t("column." + name)) for name in PLAN_COLUMNS])
        for i, plan in enumerate(found.plans[:TOP]):
            row = plan.to_dict()
            row["total"] = plan.memory.total
            table <= html.TR([html.TD(_value(f"p{i}-{k}", row[k], _plan_text(k, row[k])))
                              for k in PLAN_COLUMNS])
        body <= table
        return body


def model_shape(got):
    """The model of the form's choice: a preset, or the pasted config.json read by labkit."""
    if got["preset"] == PASTED:
        return ModelShape.from_hf_config(read_config_json(got["config_json"]))
    return PRESETS[got["preset"]]


def _plan_text(name, value):
    """How the plans table writes one value."""
    if name == "step_time_s":
        return _t("unit.seconds", value=value)
    if name == "mfu":
        return _t("unit.percent", value=100 * value)
    if name == "total":
        return gb(value)
    if name == "sequence_parallel":
        return _t("value.on") if value else _t("value.off")
    if name == "recompute":
        return _option(name, value)
    return str(value)


def _number(name, text, kind):
    try:
        return kind(text)
    except ValueError:
        raise FormError(name, text) from None


def _error(e):
    """A refusal, in the page's language: from the exception's kind and fields where it has them
    (labkit.validate.ArgumentError, FormError)."""
    return html.P(error_message(e, LANG), Class="labkit-calc-error")


def _spans(kind, **fields):
    """``kind`` in the page's language, each field's text in a value element (data-name: the
    field, data-value: its exact value; the reason's: 0)."""
    out = html.SPAN()
    for text, name in pieces(kind, LANG, **fields):
        if name is None:
            out <= text
        else:
            out <= _value(name, 0 if name == "reason" else fields[name], text)
    return out


def _value(name, value, text):
    return html.SPAN(text, Class="labkit-calc-value", **{"data-name": name, "data-value": str(value)})


def _bar(d, parts, capacity):
    """One bar: each part's share of max(total, the GPU's memory); a mark at the GPU's memory."""
    scale = max(d["total"], capacity)
    bar = html.DIV(Class="labkit-calc-bar")
    for name in parts:
        if d[name] > 0:
            bar <= html.DIV(Class=f"labkit-calc-seg labkit-calc-{name}", title=_t("term." + name),
                            style={"width": f"{100 * d[name] / scale:.3f}%"})
    bar <= html.DIV(Class="labkit-calc-cap", title=_t("calc.gpu_memory"),
                    style={"left": f"{100 * capacity / scale:.3f}%"})
    return bar


def _numbers(d, parts, capacity, prefix):
    table = html.TABLE(Class="labkit-calc-table")
    for name in parts + ("total",):
        key = html.SPAN(Class=f"labkit-calc-key labkit-calc-{name}") if name != "total" else ""
        table <= html.TR(html.TD(key + _t("term." + name))
                         + html.TD(_value(prefix + name, d[name], gb(d[name]))))
    fits = d["total"] <= capacity
    text = (_t("calc.fits_in", capacity=capacity) if fits
            else _t("calc.does_not_fit", total=d["total"], capacity=capacity))
    table <= html.TR(html.TD(_t("calc.gpu_memory")) + html.TD(_value(prefix + "fits", int(fits), text)))
    return table


def main():
    for root in document.select(".labkit-calc"):
        try:
            Calculator(root)
        except Exception as e:  # show it in the page, where the reader looks
            root.clear()
            root <= html.P(_t("calc.could_not_start", error=error_message(e, LANG)),
                           Class="labkit-calc-error")
            root.attrs["data-ready"] = "error"
