"""Every technique chapter's "In practice" section, in both editions, checked by the engines.

Each chapter from 2 to 8, 10 and 11 has a section "In practice" before "What the lab measured", and
its Chinese twin a translated heading. Every code block of those sections is checked by what it
configures: a ds_config (```json) by DeepSpeed 0.19.8's ``DeepSpeedConfig`` over 8 data-parallel
ranks; a Megatron-LM command line by megatron-core 0.16.1's config fields (flag names: Megatron-LM's
own parser is not installable here); torchtitan's overrides by its ``ConfigManager`` and
``ParallelDims`` on 8 GPUs; a Python fragment by parsing it and running its imports (torch's here,
DeepSpeed's in .venv-engines); a ``vllm serve`` line by the engine-argument names of vLLM 0.8.5's
documentation, which the chapters cite (vLLM itself is not installed).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from test_export import ENGINES_WORKER, _ask

ROOT = Path(__file__).resolve().parents[1]
CHAPTERS = ["02_zero", "03_checkpointing", "04_accumulation", "05_tensor_parallel", "06_pipeline",
            "07_flash_attention", "08_paged_attention", "10_context_parallel", "11_moe"]
HEADING, NEXT = "## In practice", "## What the lab measured"
MEGATRON, TITAN, VLLM = "torchrun ... pretrain_gpt.py \\", "torchrun ... -m torchtitan.train \\", "vllm serve "
# `vllm serve` options of the engine-arguments page of vLLM 0.8.5 (references.bib: vllmengineargs)
VLLM_OPTIONS = {
    "--tensor-parallel-size", "--pipeline-parallel-size", "--max-model-len", "--gpu-memory-utilization",
    "--block-size", "--max-num-seqs", "--max-num-batched-tokens", "--kv-cache-dtype", "--enable-prefix-caching",
    "--swap-space", "--enforce-eager", "--dtype", "--num-gpu-blocks-override", "--quantization", "--seed",
    "--max-seq-len-to-capture",
}


def _section(chapter: str) -> str:
    text = (ROOT / "chapters" / f"{chapter}.md").read_text(encoding="utf-8")
    assert HEADING in text and NEXT in text, f"{chapter}: no {HEADING!r} section"
    start = text.index(HEADING)
    assert start < text.index(NEXT), f"{chapter}: {HEADING!r} must come before {NEXT!r}"
    return text[start:text.index("\n## ", start + len(HEADING))]


def _blocks() -> dict:
    """Every code block of the sections, by what checks it: {kind: [(chapter, text)]}."""
    kinds = {"deepspeed": [], "megatron": [], "torchtitan": [], "python": [], "vllm": []}
    for chapter in CHAPTERS:
        for lang, body in re.findall(r"```(\w*)\n(.*?)\n```", _section(chapter), re.S):
            first = body.splitlines()[0]
            kind = {"json": "deepspeed", "python": "python"}.get(lang) or (
                "megatron" if first == MEGATRON else "torchtitan" if first == TITAN else
                "vllm" if first.startswith(VLLM) else None)
            assert lang in ("json", "python", "text") and kind, f"{chapter}: a ```{lang} block of unknown kind: {first!r}"
            kinds[kind].append((chapter, body))
    return kinds


def _args(body: str) -> list:
    """The flags and values of a command line written one flag a line, without its first line."""
    return " ".join(line.rstrip("\\").strip() for line in body.splitlines()[1:]).split()


@pytest.fixture(scope="module")
def blocks():
    return _blocks()


def test_every_technique_chapter_has_the_section_in_both_editions():
    for chapter in CHAPTERS:
        assert _section(chapter).count("```") >= 2, f"{chapter}: no configuration in {HEADING!r}"
        po = (ROOT / "locales" / "zh_CN" / "LC_MESSAGES" / "chapters" / f"{chapter}.po").read_text(encoding="utf-8")
        assert 'msgid "In practice"\nmsgstr "实践中"' in po, chapter


def test_every_code_line_fits_the_books_80_columns(blocks):
    long = [(c, line) for kind in blocks.values() for c, body in kind for line in body.splitlines()
            if len(line) > 80]
    assert long == []


def test_each_engine_is_shown_somewhere(blocks):
    assert all(blocks[kind] for kind in blocks), {k: len(v) for k, v in blocks.items()}


@ENGINES_WORKER
def test_deepspeed_accepts_every_ds_config(blocks):
    import json

    cases = [json.loads(body) for _, body in blocks["deepspeed"]]
    got = _ask("deepspeed", [{"config": c, "world": {"dp_size": 8}} for c in cases])
    for (chapter, _), back, config in zip(blocks["deepspeed"], got, cases):
        assert "error" not in back, (chapter, back)
        assert back["zero_stage"] == config.get("zero_optimization", {}).get("stage", 0), chapter


@ENGINES_WORKER
def test_megatron_core_knows_every_flag(blocks):
    got = _ask("megatron_flags", [{"config": _args(b), "world": {}} for _, b in blocks["megatron"]])
    assert [(c, back["unknown"]) for (c, _), back in zip(blocks["megatron"], got) if back["unknown"]] == []


@ENGINES_WORKER
def test_torchtitan_parses_every_override_list(blocks):
    got = _ask("torchtitan", [{"config": _args(b), "world": {"world_size": 8}} for _, b in blocks["torchtitan"]])
    assert [(c, back) for (c, _), back in zip(blocks["torchtitan"], got) if "error" in back] == []


@ENGINES_WORKER
def test_every_python_fragment_parses_and_its_imports_run(blocks):
    cases = []
    for chapter, body in blocks["python"]:
        ast.parse(body)  # a SyntaxError names the fragment's line
        cases.append({"config": body, "world": {}})
    got = _ask("imports", cases)  # in .venv-engines, which sees torch 2.13 and has DeepSpeed
    assert [(c, back) for (c, _), back in zip(blocks["python"], got) if "error" in back] == []


def test_every_vllm_option_is_one_of_its_engine_arguments(blocks):
    for chapter, body in blocks["vllm"]:
        flags = [a for a in body.replace("\\", " ").split() if a.startswith("--")]
        assert set(flags) <= VLLM_OPTIONS, (chapter, set(flags) - VLLM_OPTIONS)


@pytest.mark.parametrize("text, found", [
    (f"{HEADING}\n\n```bash\nls\n```\n\n{NEXT}\n", "a ```bash block of unknown kind"),
    (f"{HEADING}\n\n```text\ntorchrun train.py\n```\n\n{NEXT}\n", "a ```text block of unknown kind"),
    (f"{NEXT}\n\n{HEADING}\n\n", "must come before"),
    ("## Something else\n", "no '## In practice' section"),
])
def test_the_block_reader_refuses_what_it_cannot_check(text, found, monkeypatch):
    monkeypatch.setattr(Path, "read_text", lambda self, encoding=None: text)
    with pytest.raises(AssertionError, match=re.escape(found)):
        _blocks()
