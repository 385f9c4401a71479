"""labkit.messages: what the calculators and the grader say, rendered per language from data.

English renders as labkit's own messages read (the planner's reason(), the refusals' text); the
Chinese catalogue has every kind, with the same fields, in the glossary's terms and without an
English word outside its kept list; each refusal a calculator can meet carries its kind.
"""

from __future__ import annotations

import pickle
import re

import pytest
from test_i18n import english_words, i18n, kept_latin

from labkit.estimate import check_context_len, serving_memory, training_memory
from labkit.hardware import get_gpu
from labkit.hf_config import read_config_json
from labkit.messages import CATALOGUES, error_message, language, pieces, render, serving_reason, training_reason
from labkit.plan import plan_serving, plan_training
from labkit.released_configs import RELEASED
from labkit.shapes import PRESETS, ModelShape
from labkit.validate import ArgumentError, check_bool, check_choice, check_float, check_int

EN, ZH = CATALOGUES["en"], CATALOGUES["zh_CN"]
FIELD = re.compile(r"\{(\w*)(?:![rs])?(?::[^{}]*)?\}")
CJK = re.compile(r"[\u4e00-\u9fff]")


def test_every_kind_in_chinese_with_the_same_fields():
    assert set(ZH) == set(EN), f"zh lacks {sorted(set(EN) - set(ZH))}, has extra {sorted(set(ZH) - set(EN))}"
    for kind, text in EN.items():
        assert set(FIELD.findall(ZH[kind])) == set(FIELD.findall(text)), kind


def test_chinese_catalogue_keeps_the_glossary():
    """No forbidden variant and no English word outside the kept list in a Chinese string (its
    fields and the command-line flags it quotes left out)."""
    kept = kept_latin()
    for kind, text in ZH.items():
        prose = re.sub(r"--[\w-]+(?: SECONDS)?|SyntaxError", " ", FIELD.sub(" N ", text))
        assert not i18n.forbidden_in(prose), (kind, text, i18n.forbidden_in(prose))
        assert not english_words(prose, kept), (kind, text, english_words(prose, kept))


def test_planted_english_and_forbidden_terms_are_found():
    """The two checks above fail on a planted word: they can fail."""
    assert english_words("放不下：does not fit", kept_latin()) == ["does", "not", "fit"]
    assert i18n.forbidden_in("每个 GPU 的内存")


def test_render_fills_fields_per_language():
    fields = dict(term="activations", bytes_so_far=91.2e9, limit_bytes=77.3e9)
    assert render("plan.overflow", "en", **fields) == "activations: 91.2 GB of 77.3 GB"
    assert render("plan.overflow", "zh_CN", **fields) == "计入激活值后累计 91.2 GB，超过上限 77.3 GB"
    assert render("plan.overflow", "zh-CN", **fields) == render("plan.overflow", "zh", **fields)
    assert [name for _, name in pieces("calc.sized", "zh_CN", considered=3, fitting=0)] == \
        [None, "considered", None, "fitting", None]


@pytest.mark.parametrize("call, name", [
    (lambda: render("no.such.kind", "en"), "kind"),
    (lambda: render("plan.overflow", "fr"), "lang"),
    (lambda: render("plan.overflow", None, term="x", bytes_so_far=1, limit_bytes=1), "lang"),
    (lambda: render("plan.overflow", "en", term="activations"), "bytes_so_far"),
])
def test_bad_input_names_the_argument(call, name):
    with pytest.raises(ValueError, match=name):
        call()


def test_language_codes():
    assert [language(x) for x in ("en", "en-US", "zh", "zh_CN", "zh-CN", "zh-Hans")] == \
        ["en", "en", "zh_CN", "zh_CN", "zh_CN", "zh_CN"]


def test_training_reason_is_the_planners_in_english():
    found = plan_training("llama-2-13b", gpu="l4", num_gpus=8, seq_len=2048, global_batch=16,
                          micro_batches=(1,), interleave=(1,))
    assert not found.plans and found.overflows
    assert training_reason(found.overflows, "en") == found.reason()
    zh = training_reason(found.overflows, "zh_CN")
    assert zh.count("；") == len(found.overflows) - 1 and "超过上限" in zh
    assert not english_words(zh, kept_latin()), zh
    assert training_reason([], "en") == found._replace(overflows=[], refused={}).reason()
    # nothing sized: what labkit does not run, by labkit.parallel.compose's keys, in either language
    refused = {"reshard": 3, "offload_params": 1}
    assert training_reason([], "en", refused) == found._replace(overflows=[], refused=refused).reason()
    zh = training_reason([], "zh_CN", refused)
    assert "参数卸载" in zh and not english_words(zh, kept_latin()), zh


def test_serving_reason_is_the_planners_in_english():
    found = plan_serving("llama-2-70b", gpu="l4", num_gpus=4, context_len=4096)
    assert found.refused
    assert serving_reason(found.refused, "en") == found.reason()
    assert CJK.search(serving_reason(found.refused, "zh_CN"))


MIXTRAL = RELEASED["mixtral-8x7b"][2]
LLAMA4, QWEN2, GPT_OSS = (RELEASED[n][2] for n in ("llama-4-scout", "qwen2.5-7b", "gpt-oss-20b"))
DEEPSEEK, GEMMA2 = RELEASED["deepseek-v3"][2], RELEASED["gemma-2-9b"][2]
# Each refusal a calculator can meet, with the kind it carries.
REFUSALS = [
    (lambda: check_int("seq_len", 0, 1), "int"),
    (lambda: check_int("pp_size", 5, 1, 4), "int_range"),
    (lambda: check_choice("recompute", "some", ("none", "full")), "choice"),
    (lambda: check_bool("sequence_parallel", "no"), "bool"),
    (lambda: check_float("gpu_memory_utilization", 1.5, above=0.0, maximum=1.0), "float"),
    (lambda: get_gpu("v100"), "gpu"),
    (lambda: check_context_len("llama-2-7b", 8192), "context_len"),
    (lambda: ModelShape(n_layer=2, d_model=10, n_head=3, vocab_size=10, seq_len=8), "head_divides"),
    (lambda: ModelShape(n_layer=2, d_model=12, n_head=4, n_kv_head=3, vocab_size=10, seq_len=8),
     "kv_divides"),
    (lambda: PRESETS["llama-2-13b"].check_tp_size(3), "tp_divides"),
    (lambda: serving_memory("llama-3-8b", gpu="a100", tp_size=3), "serving_tp"),
    (lambda: training_memory("qwen1.5-moe-a2.7b", seq_len=128, micro_batch=1), "untrainable"),  # its shared-expert gate
    (lambda: serving_memory(PRESETS["mixtral-8x7b"].replace(d_ff=101), gpu="a100", tp_size=2), "serving_experts"),
    (lambda: serving_memory("llama-3-8b", gpu="a100", tp_size=2, expert_parallel=True), "expert_parallel"),
    (lambda: serving_memory(PRESETS["llama-3-8b"].replace(weight_format="nf4"), gpu="a100"), "weight_format"),
    (lambda: serving_memory("llama-3-8b", gpu="a100", weight_format="fp8", weight_bytes=1), "format_and_bytes"),
    (lambda: plan_training("gpt2-small", gpu="t4", num_gpus=1, seq_len=1024, global_batch=8), "no_peak"),
    # a config.json pasted into a calculator (labkit.hf_config)
    (lambda: read_config_json('{"model_type": "llama",}'), "config_json"),
    (lambda: read_config_json("[1, 2]"), "config_object"),
    (lambda: read_config_json(" \n"), "config_empty"),
    (lambda: ModelShape.from_hf_config({**MIXTRAL, "model_type": "bert"}), "model_type"),
    (lambda: ModelShape.from_hf_config({**MIXTRAL, "moe_capacity": 2}), "config_keys"),
    (lambda: ModelShape.from_hf_config({"model_type": "llama", "hidden_size": 64}), "config_missing"),
    (lambda: ModelShape.from_hf_config({k: v for k, v in MIXTRAL.items() if k != "num_local_experts"}),
     "config_missing_experts"),
    (lambda: ModelShape.from_hf_config({**MIXTRAL, "hidden_act": "gelu"}), "config_act"),
    (lambda: ModelShape.from_hf_config({**MIXTRAL, "mlp_bias": True}), "config_value"),
    (lambda: ModelShape.from_hf_config({**LLAMA4, "text_config": {"model_type": "llama"}}), "config_text"),
    (lambda: ModelShape.from_hf_config({**MIXTRAL, "quantization_config": "fp8"}), "config_quantization"),
    (lambda: ModelShape.from_hf_config({**QWEN2, "use_sliding_window": True}), "config_window_switch"),
    (lambda: ModelShape.from_hf_config({**GPT_OSS, "layer_types": ["full_attention"]}), "config_layer_list"),
    (lambda: ModelShape.from_hf_config({**GPT_OSS, "sliding_window": None}), "config_no_window"),
    (lambda: ModelShape.from_hf_config({**GPT_OSS, "layer_types": ["full_attention"] * 2 + ["sliding_attention"] * (
        GPT_OSS["num_hidden_layers"] - 2)}), "config_layer_pattern"),
    (lambda: ModelShape.from_hf_config({**GPT_OSS, "num_experts_per_tok": GPT_OSS["experts_per_token"] + 1}),
     "config_disagree"),
    (lambda: ModelShape.from_hf_config({k: v for k, v in DEEPSEEK.items() if k != "moe_intermediate_size"}),
     "config_missing_width"),
    (lambda: ModelShape.from_hf_config({**DEEPSEEK, "moe_layer_freq": 2}), "config_moe_freq"),
    (lambda: ModelShape.from_hf_config({**DEEPSEEK, "head_dim": 128}), "config_head_dim"),
    (lambda: ModelShape.from_hf_config({**LLAMA4, "text_config": {
        k: v for k, v in LLAMA4["text_config"].items() if k != "intermediate_size_mlp"}}), "config_missing_dense_width"),
    (lambda: ModelShape.from_hf_config({**LLAMA4, "text_config": {**LLAMA4["text_config"], "moe_layers": [0]}}),
     "config_moe_layers"),
    (lambda: ModelShape.from_hf_config({**GEMMA2, "sliding_window_size": 1}), "config_window_size"),
]


@pytest.mark.parametrize("call, kind", REFUSALS, ids=[k for _, k in REFUSALS])
def test_each_refusal_carries_its_kind_and_renders_in_chinese(call, kind):
    with pytest.raises(ValueError) as info:
        call()
    error = info.value
    assert isinstance(error, ArgumentError) and error.kind == kind, (type(error), getattr(error, "kind", None))
    english = error_message(error, "en")
    if kind not in ("untrainable",):  # the catalogue's English is the message raised
        assert english == str(error)
    zh = error_message(error, "zh_CN")
    assert CJK.search(zh) and zh != english, zh
    assert not english_words(zh, kept_latin()), zh
    assert pickle.loads(pickle.dumps(error)).args == error.args


def test_an_error_without_a_kind_is_still_shown():
    assert error_message(ValueError("plain"), "en") == "plain"
    assert error_message(ValueError("plain"), "zh_CN") == "labkit 拒绝了这组输入：plain"


def _calculator_calls(shape, gpu):
    """What the calculators call for a shape on a GPU (the planner's checks only: stepwise)."""
    yield lambda: training_memory(shape, seq_len=min(shape.seq_len, 2048), micro_batch=1)
    yield lambda: (check_context_len(shape, min(shape.seq_len, 4096)),
                   serving_memory(shape, gpu=gpu, tp_size=1))
    yield lambda: plan_training(shape, gpu=gpu, num_gpus=8, seq_len=min(shape.seq_len, 2048),
                                global_batch=64, stepwise=True)


def test_every_refusal_a_calculator_meets_has_a_kind():
    """Every preset on every GPU in each calculator's call, and each shape field typed wrong: what
    labkit refuses carries a kind the catalogues render (no English "error.other" in Chinese)."""
    from dataclasses import replace

    from labkit.hardware import GPUS

    refused, typed = set(), {"n_layer": 0, "d_model": 7, "n_head": 5, "n_kv_head": 3, "d_ff": -1,
                             "vocab_size": 0}
    shapes = [PRESETS[name] for name in PRESETS]
    for name in ("llama-2-7b", "deepseek-v3", "gpt2-small"):
        for field, value in typed.items():
            try:
                shapes.append(replace(PRESETS[name], **{field: value}))
            except ValueError as e:
                assert getattr(e, "kind", None) and "error." + e.kind in EN, (name, field, e)
                refused.add(e.kind)
    for shape in shapes:
        for gpu in GPUS:
            for call in _calculator_calls(shape, gpu):
                try:
                    call()
                except ValueError as e:
                    assert getattr(e, "kind", None) and "error." + e.kind in EN, (shape, gpu, e)
                    assert not english_words(error_message(e, "zh_CN"), kept_latin()), e
                    refused.add(e.kind)
    assert {"untrainable", "no_peak", "head_divides", "kv_divides", "mla_heads", "int"} <= refused, refused


def test_every_refusal_of_the_composition_table_is_worded_in_both_languages():
    from labkit.parallel.compose import NOT_COMPOSED
    for key, _, text in NOT_COMPOSED:
        assert render(f"refused.{key}", "en") == text
        zh = render(f"refused.{key}", "zh_CN")
        assert zh != text and not english_words(zh, kept_latin()), (key, zh)


def test_published_runs_notes_are_english_and_said_in_chinese():
    """A published run's ``notes`` are the English text they always were; ``note_texts`` says each
    in a language (None: the one labkit prints in), from its kind, also after pickling; plain text
    stays as given; the runs say every published kind."""
    from dataclasses import replace

    from labkit.messages import using
    from labkit.plan.published import NARAYANAN_TABLE1, PUBLISHED, narayanan_run

    cases = [*PUBLISHED.values(), narayanan_run(NARAYANAN_TABLE1[0])]
    assert cases[-1].notes == ("the micro-batch size of each row is not published: b = 1 assumed",)
    for case in cases:
        assert case.note_texts("en") == case.notes and all(type(t) is str for t in case.note_texts("en"))
        zh = case.note_texts("zh_CN")
        assert len(zh) == len(case.notes) and all(CJK.search(t) for t in zh), zh
        assert not [english_words(t, kept_latin()) for t in zh if english_words(t, kept_latin())], zh
        with using("zh_CN"):
            assert case.note_texts() == zh
        assert pickle.loads(pickle.dumps(case)).note_texts("zh_CN") == zh
    assert replace(cases[0], notes=("as given",)).note_texts("zh_CN") == ("as given",)
    assert {n.kind for case in cases for n in case.notes} == {k for k in EN if k.startswith("published.")}


# ----------------------------------------------------------------------------- what labkit prints
def test_labkit_prints_in_the_language_set_and_the_command_line_stays_english(capsys, monkeypatch):
    """labkit.setup(lang=...) sets the language of labkit's printed text for the process (its
    banner, the planner's tables and reasons, the breakdowns, the meter's table); ``using`` sets
    it for a block and restores it; the command line speaks English whatever is set."""
    import matplotlib

    import labkit
    from labkit import messages
    from labkit.plan.cli import main as plan_cli

    # setup(lang="zh_CN") gives matplotlib a CJK font: the worker's other tests keep theirs
    monkeypatch.setitem(matplotlib.rcParams, "font.family", list(matplotlib.rcParams["font.family"]))
    from labkit.plan.table import serving_table, training_table

    found = plan_training(PRESETS["llama-3-8b"], gpu="a100-80gb", num_gpus=8, seq_len=4096, global_batch=64)
    nothing = plan_training(PRESETS["llama-2-7b"], gpu="a100-80gb", num_gpus=1, seq_len=4096, global_batch=16)
    served = plan_serving(PRESETS["llama-3-8b"], gpu="l4", num_gpus=2, context_len=2048)
    printed = lambda: [training_table(found, 3), serving_table(served, 2), nothing.reason(),
                       str(found.plans[0].memory), str(served.plans[0].estimate)]
    english = printed()
    assert messages.current() == "en" and not any(CJK.search(t) for t in english)
    previous = messages.current()
    try:
        labkit.setup(seed=0, lang="zh")
        assert messages.current() == "zh_CN" and CJK.search(capsys.readouterr().out)
        chinese = printed()
        assert all(CJK.search(t) for t in chinese), chinese
        for text in chinese:  # in Chinese throughout: no English word outside the kept list
            assert not english_words(re.sub(r"\b(?:none|selective|full|kv_cache|weights)\b", "", text),
                                     kept_latin()), text
        assert plan_cli(["train", "--model", "llama-3-8b", "--gpu", "a100-80gb", "--num-gpus", "8",
                         "--seq-len", "4096", "--global-batch", "64", "--top", "3"]) == 0
        cli = capsys.readouterr().out
        assert english[0] in cli and not CJK.search(cli)  # the English table
        assert messages.current() == "zh_CN"
        with messages.using("en"):
            assert printed() == english
        assert messages.current() == "zh_CN"
    finally:
        messages.use(previous)
    assert printed() == english
    with pytest.raises(ValueError, match="lang='fr'"):
        messages.use("fr")
    with pytest.raises(ValueError, match="lang=True"):
        labkit.setup(lang=True)


def test_a_chinese_table_lines_up_in_display_columns():
    """A CJK character takes two columns: the right-aligned tables end every row at one column."""
    from labkit import messages
    from labkit.plan.table import training_table

    assert messages.width("显存 GB") == 7 and messages.pad("显存", 6, ">") == "  显存"
    found = plan_training(PRESETS["llama-3-8b"], gpu="a100-80gb", num_gpus=8, seq_len=4096, global_batch=64)
    with messages.using("zh_CN"):
        rows = training_table(found, 5).splitlines()[1:]
    assert len({messages.width(r) for r in rows}) == 1, rows  # the header as wide as the rows

    def ends(row):  # the display column where each cell ends
        return [messages.width(row[:k + 1]) for k in range(len(row))
                if row[k] != " " and (k + 1 == len(row) or row[k + 1] == " ")]

    assert len({tuple(ends(r)) for r in rows[1:]}) == 1, rows  # a plan's cells hold no space
