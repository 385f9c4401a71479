"""What the book's calculators and the exercise grader say, in each edition's language.

One table of strings per language (``CATALOGUES["en"]``, ``CATALOGUES["zh_CN"]``), keyed by a
*kind* such as ``"plan.overflow"``; :func:`render` fills a kind's template with structured
fields (numbers, names, terms), so no English sentence is parsed or pasted into a Chinese one:

    >>> render("plan.overflow", "zh_CN", term="activations", bytes_so_far=91.2e9, limit_bytes=77.3e9)
    '激活值：累计 91.2 GB，超过上限 77.3 GB'

A field is written ``{name}``, or ``{name:spec}`` where ``spec`` is Python's format spec or one of
this module's: ``.1GB`` (bytes as GB, 1 decimal), ``term`` (the field is a kind's suffix, e.g.
``term.activations``, rendered in the same language), ``list`` (items joined by the language's
list separator; a shape feature by its ``feature.`` text), ``opt.precision`` and
``opts.precision`` (an option's text, or a list of them), ``q`` (quoted the language's way),
``arg`` (an argument's name, after its form label), ``val`` and ``vals`` (the value or values of
the argument the field ``name`` names, as its options read). The Chinese strings use the glossary's terms
(locales/zh_CN/GLOSSARY.md; tests/test_i18n.py checks them). Standard library only: the
calculators run it in the page (Brython). The command line stays English and does not use it.

:func:`error_message` renders an exception labkit raised: an :class:`labkit.validate.ArgumentError`
carries ``kind`` and ``fields`` (``ArgumentError(..., kind="context_len", context_len=8192,
seq_len=4096)``); any other error is rendered as ``"error.other"`` around its own text.
"""

from __future__ import annotations

import re

__all__ = ["CATALOGUES", "LANGUAGES", "language", "known", "render", "pieces", "error_message",
           "training_reason", "serving_reason"]

LANGUAGES = ("en", "zh_CN")

_EN = {
    # The calculators' form: field labels
    "label.preset": "preset", "label.n_layer": "layers", "label.d_model": "d_model",
    "label.n_head": "heads", "label.n_kv_head": "KV heads", "label.d_ff": "d_ff",
    "label.vocab_size": "vocab", "label.gpu": "GPU", "label.seq_len": "sequence length",
    "label.micro_batch": "micro-batch", "label.dp_size": "data-parallel GPUs N_d",
    "label.tp_size": "tensor-parallel t", "label.pp_size": "pipeline stages p",
    "label.zero_stage": "ZeRO stage", "label.recompute": "recomputation",
    "label.sequence_parallel": "sequence parallelism", "label.precision": "precision",
    "label.optimizer": "optimizer", "label.weight_bytes": "bytes per weight",
    "label.kv_bytes": "bytes per KV element", "label.context_len": "context length",
    "label.gpu_memory_utilization": "memory utilisation", "label.num_gpus": "GPUs",
    "label.gpus_per_node": "GPUs per node", "label.global_batch": "global batch",
    "label.micro_batches": "micro-batches b tried", "label.interleave": "interleave v tried",
    # option values (the value sent is the code's; this is what the reader sees)
    "option.recompute.none": "none", "option.recompute.selective": "selective",
    "option.recompute.full": "full", "option.sequence_parallel.off": "off",
    "option.sequence_parallel.on": "on",
    "option.precision.bf16-mixed": "bf16 mixed", "option.precision.fp16-mixed": "fp16 mixed",
    "option.precision.bf16-mixed-fp32-grads": "bf16 mixed, fp32 gradients",
    "option.precision.bf16": "bf16", "option.precision.fp32": "fp32",
    "option.optimizer.adamw": "AdamW", "option.optimizer.adam": "Adam",
    "option.optimizer.sgd_momentum": "SGD with momentum", "option.optimizer.sgd": "SGD",
    # the memory terms (bars, tables, the planner's overflows)
    "term.params": "parameters", "term.grads": "gradients", "term.optimizer": "optimizer states",
    "term.activations": "activations", "term.transient": "transient peaks",
    "term.weights": "weights", "term.activation_peak": "forward peak",
    "term.non_torch": "non-PyTorch", "term.kv_cache": "KV cache", "term.total": "total per GPU",
    # the plans table's column heads
    "column.tp_size": "t", "column.pp_size": "p", "column.v": "v", "column.dp_size": "N_d",
    "column.cp_size": "cp", "column.zero_stage": "ZeRO", "column.recompute": "recompute",
    "column.sequence_parallel": "SP", "column.micro_batch": "b", "column.num_microbatches": "m",
    "column.step_time_s": "step", "column.mfu": "MFU", "column.total": "memory",
    # units and values
    "unit.gb": "{value:.2f} GB", "unit.seconds": "{value:.2f} s", "unit.percent": "{value:.1f}%",
    "value.on": "on", "value.off": "off", "zero_stage": "ZeRO-{stage}",
    # what the calculators say
    "calc.gpu_memory": "GPU memory", "calc.fits_in": "fits in {capacity:.2GB}",
    "calc.does_not_fit": "does not fit: {total:.2GB} of {capacity:.2GB}",
    "calc.kv_blocks": "KV blocks", "calc.tokens_cached": "tokens cached",
    "calc.requests_of": "requests of {n} tokens", "calc.serves": "fits",
    "calc.serves_none": "does not fit: no request of this length fits",
    "calc.sized": "{considered} configurations sized, {fitting} fit.",
    "calc.nothing_fits": "Nothing fits: {reason}",
    "calc.best_memory": "The fastest plan's memory per GPU (limit {limit:.2GB}):",
    "calc.progress": "computing: {done} of {total} layouts sized",
    "calc.could_not_start": "The calculator could not start: {error}",
    # the planner's reasons (labkit.plan: TrainingPlans.overflows, ServingPlans.refused)
    "plan.overflow": "{term}: {bytes_so_far:.1GB} of {limit_bytes:.1GB}",
    "plan.layout": "t={tp_size}{cp} p={pp_size} N_d={dp_size}: {why}",
    "plan.layout_cp": " cp={cp_size}", "plan.separator": "; ", "plan.colon": ": ",
    "plan.no_layout": "no (t, cp, p, N_d, b) splits the GPUs and the global batch",
    "serve.no_block": "t={tp_size}: the weights leave no room for a KV block",
    "serve.too_few_blocks": "t={tp_size}: {num_blocks} blocks, fewer than one request needs",
    # refusals (ArgumentError.kind; fields as raised)
    "error.int": "{name}={value!r} must be an int >= {minimum}",
    "error.int_range": "{name}={value!r} must be an int in [{minimum}, {maximum}]",
    "error.choice": "{name}={value!r} is unknown; valid choices: {choices!r}",
    "error.bool": "{name}={value!r} must be True or False",
    "error.float": "{name}={value!r} must be a finite number in {interval}",
    "error.gpu": "gpu={gpu!r} is not in the table; valid: {valid!r}",
    "error.context_len": "context_len={context_len} must be at most the model's seq_len={seq_len}",
    "error.pp_size": "pp_size={pp_size} must be at most n_layer={n_layer} (a stage holds a layer or more)",
    "error.tp_divides": ("tp_size={tp_size} must divide {name}={value} (each rank holds whole heads "
                         "and an equal share of d_ff); valid tp_size: {valid!r}"),
    "error.serving_tp": ("tp_size={tp_size} must divide n_head={n_head}, and divide or be a multiple "
                         "of n_kv_head={n_kv_head}"),
    "error.head_divides": "n_head={n_head} must divide d_model={d_model} (or give d_head)",
    "error.kv_divides": "n_kv_head={n_kv_head} must divide n_head={n_head}",
    "error.seq_cp": ("seq_len={seq_len} must be divisible by cp_size={cp_size} (x tp_size={tp_size} "
                     "with sequence parallelism): each rank holds an equal share of the positions"),
    "error.untrainable": "training estimates do not model {missing:list} yet",
    "error.windows": ("{unmodelled:list}: the serving estimate caps every layer's cache at one "
                      "window; windows that differ by layer are not modelled yet"),
    "error.no_peak": ("precision={precision!r} computes in {half}, which {gpu} has no peak for "
                      "(no {half} tensor cores); valid on {gpu}: {valid:list}"),
    "error.other": "{detail}",
    "error.not_a_number": "{name}: {text:q} is not a number",
    "feature.experts": "experts", "feature.MLA": "MLA", "feature.head size": "head size",
    "feature.q/k/v biases": "q/k/v biases", "feature.output bias": "output bias",
    "feature.qk-norm": "qk-norm", "feature.feed-forward norms": "feed-forward norms",
    "feature.attention sinks": "attention sinks", "feature.GeGLU": "GeGLU",
    "feature.per-layer windows": "per-layer windows", "feature.chunked attention": "chunked attention",
    "list.separator": ", ", "quote": "'{}'",
    # the exercise grader (scripts/exercises.py grade)
    "grade.case.public": "public test {n}{rule}: {shown}{why}",
    "grade.case.hidden": "hidden test {n}{rule}: {why}",
    "grade.rule": " [{rule}]",
    "grade.differs": "the output differs from the expected one",
    "grade.expected_got": "{call}: expected {expected}, got {got}",
    "grade.raised": "{error}",
    "grade.time_limit": ("{question} ran past its time limit of {seconds:g} s of processor time "
                         "(does a function it calls loop forever?)"),
    "grade.not_answered": "not answered yet (its answer cell is as handed out)",
    "grade.see_syntax_error": "{why} (its answer cell has a syntax error: see the note)",
    "grade.cell_interrupted": ("its answer cell was interrupted after {seconds:g} s (--cell-timeout) "
                               "and did not finish; the tests ran without the rest of it"),
    "grade.cell_syntax_error": "its answer cell has a syntax error, so none of it ran: SyntaxError: {detail}",
    "grade.cell_raised": ("its answer cell raised {error}: {detail}; the tests ran on what it had "
                          "defined before that"),
    "grade.header": "Grading {submission} against {chapter} (timeout {timeout:g} s)",
    "grade.timed_out": ("TIMED OUT after {timeout:g} s: the notebook did not finish (an infinite "
                        "loop, or a machine too busy to finish in time: --timeout SECONDS allows "
                        "longer); every question scores 0."),
    "grade.note": "note: {notice}", "grade.total": "total",
}

_ZH = {
    "label.preset": "预设模型", "label.n_layer": "层数", "label.d_model": "隐藏维度 d_model",
    "label.n_head": "头数", "label.n_kv_head": "KV 头数", "label.d_ff": "MLP 宽度 d_ff",
    "label.vocab_size": "词表大小", "label.gpu": "GPU", "label.seq_len": "序列长度",
    "label.micro_batch": "微批次大小", "label.dp_size": "数据并行 GPU 数 N_d",
    "label.tp_size": "张量并行度 t", "label.pp_size": "流水线阶段数 p", "label.zero_stage": "ZeRO 阶段",
    "label.recompute": "重计算", "label.sequence_parallel": "序列并行", "label.precision": "精度",
    "label.optimizer": "优化器", "label.weight_bytes": "每个权重的字节数",
    "label.kv_bytes": "每个 KV 元素的字节数", "label.context_len": "上下文长度",
    "label.gpu_memory_utilization": "显存利用率", "label.num_gpus": "GPU 数",
    "label.gpus_per_node": "每节点 GPU 数", "label.global_batch": "全局批次大小",
    "label.micro_batches": "尝试的微批次大小 b", "label.interleave": "尝试的交错度 v",
    "option.recompute.none": "不重计算", "option.recompute.selective": "选择性重计算",
    "option.recompute.full": "完全重计算", "option.sequence_parallel.off": "关",
    "option.sequence_parallel.on": "开",
    "option.precision.bf16-mixed": "bf16 混合精度", "option.precision.fp16-mixed": "fp16 混合精度",
    "option.precision.bf16-mixed-fp32-grads": "bf16 混合精度，fp32 梯度",
    "option.precision.bf16": "纯 bf16", "option.precision.fp32": "fp32",
    "option.optimizer.adamw": "AdamW", "option.optimizer.adam": "Adam",
    "option.optimizer.sgd_momentum": "带动量的 SGD", "option.optimizer.sgd": "SGD",
    "term.params": "参数", "term.grads": "梯度", "term.optimizer": "优化器状态",
    "term.activations": "激活值", "term.transient": "临时峰值", "term.weights": "权重",
    "term.activation_peak": "前向峰值", "term.non_torch": "非 PyTorch 开销", "term.kv_cache": "KV 缓存",
    "term.total": "每张 GPU 合计",
    "column.tp_size": "t", "column.pp_size": "p", "column.v": "v", "column.dp_size": "N_d",
    "column.cp_size": "cp", "column.zero_stage": "ZeRO", "column.recompute": "重计算",
    "column.sequence_parallel": "序列并行", "column.micro_batch": "b", "column.num_microbatches": "m",
    "column.step_time_s": "单步耗时", "column.mfu": "MFU", "column.total": "显存",
    "unit.gb": "{value:.2f} GB", "unit.seconds": "{value:.2f} 秒", "unit.percent": "{value:.1f}%",
    "value.on": "开", "value.off": "关", "zero_stage": "ZeRO-{stage}",
    "calc.gpu_memory": "GPU 显存", "calc.fits_in": "放得下（上限 {capacity:.2GB}）",
    "calc.does_not_fit": "放不下：需要 {total:.2GB}，上限 {capacity:.2GB}",
    "calc.kv_blocks": "KV 块数", "calc.tokens_cached": "可缓存的 token 数",
    "calc.requests_of": "可同时容纳的 {n} token 请求数", "calc.serves": "放得下",
    "calc.serves_none": "放不下：连一个这种长度的请求都放不下",
    "calc.sized": "已估算 {considered} 种配置，其中 {fitting} 种放得下。",
    "calc.nothing_fits": "没有配置放得下：{reason}",
    "calc.best_memory": "最快方案每张 GPU 的显存（上限 {limit:.2GB}）：",
    "calc.progress": "计算中：已估算 {done}/{total} 种布局",
    "calc.could_not_start": "计算器未能启动：{error}",
    "plan.overflow": "{term:term}：累计 {bytes_so_far:.1GB}，超过上限 {limit_bytes:.1GB}",
    "plan.layout": "t={tp_size}{cp} p={pp_size} N_d={dp_size}：{why}",
    "plan.layout_cp": " cp={cp_size}", "plan.separator": "；", "plan.colon": "：",
    "plan.no_layout": "没有一种 (t, cp, p, N_d, b) 能同时整除 GPU 数和全局批次",
    "serve.no_block": "t={tp_size}：权重放下之后，连一个 KV 块都放不下",
    "serve.too_few_blocks": "t={tp_size}：只有 {num_blocks} 个块，不够一个请求使用",
    "error.int": "{name:arg} = {value:val}：必须是不小于 {minimum} 的整数",
    "error.int_range": "{name:arg} = {value:val}：必须是 {minimum} 到 {maximum} 之间的整数",
    "error.choice": "{name:arg} 的取值 {value:val} 未知；可选：{choices:vals}",
    "error.bool": "{name:arg} = {value:val}：必须是布尔值（True/False）",
    "error.float": "{name:arg} = {value:val}：必须是区间 {interval} 内的有限数",
    "error.gpu": "gpu={gpu!r}：不在 GPU 表中；可选：{valid:list}",
    "error.context_len": "context_len={context_len}：不能超过模型的 seq_len={seq_len}",
    "error.pp_size": "pp_size={pp_size}：不能超过 n_layer={n_layer}（每个阶段至少放一层）",
    "error.tp_divides": ("tp_size={tp_size}：必须整除 {name}={value}（每个 rank 持有完整的头，"
                         "以及相等份额的 d_ff）；可用的 tp_size：{valid:list}"),
    "error.serving_tp": ("tp_size={tp_size}：必须整除 n_head={n_head}，并且整除 n_kv_head={n_kv_head} "
                         "或是它的倍数"),
    "error.head_divides": "n_head={n_head}：必须整除 d_model={d_model}（或给出 d_head）",
    "error.kv_divides": "n_kv_head={n_kv_head}：必须整除 n_head={n_head}",
    "error.seq_cp": ("seq_len={seq_len}：必须能被 cp_size={cp_size} 整除（使用序列并行时还要乘以 "
                     "tp_size={tp_size}）：每个 rank 持有相等份额的位置"),
    "error.untrainable": "训练显存估算尚未建模：{missing:list}",
    "error.windows": "{unmodelled:list}：服务估算把每层的缓存都限制在同一个窗口内，尚未建模各层窗口不同的情况",
    "error.no_peak": ("精度“{precision:opt.precision}”以 {half} 计算，而 {gpu} 没有 {half} 张量核心，"
                      "也就没有 {half} 峰值；{gpu} 上可用的精度：{valid:opts.precision}"),
    "error.other": "labkit 拒绝了这组输入：{detail}",
    "error.not_a_number": "{name:arg}：{text:q} 不是数字",
    "feature.experts": "混合专家", "feature.MLA": "MLA", "feature.head size": "独立的头大小",
    "feature.q/k/v biases": "q/k/v 偏置", "feature.output bias": "输出偏置",
    "feature.qk-norm": "q/k 归一化", "feature.feed-forward norms": "前馈层归一化",
    "feature.attention sinks": "注意力汇聚", "feature.GeGLU": "GeGLU",
    "feature.per-layer windows": "各层不同的窗口", "feature.chunked attention": "分块注意力",
    "list.separator": "、", "quote": "“{}”",
    "grade.case.public": "公开测试 {n}{rule}：{shown}{why}",
    "grade.case.hidden": "隐藏测试 {n}{rule}：{why}",
    "grade.rule": " [{rule}]",
    "grade.differs": "输出与预期不同",
    "grade.expected_got": "{call}：预期 {expected}，实际得到 {got}",
    "grade.raised": "抛出了 {error}",
    "grade.time_limit": "{question} 超出了 {seconds:g} 秒处理器时间的限制（它调用的某个函数是否陷入了死循环？）",
    "grade.not_answered": "尚未作答（答案单元格与发放时相同）",
    "grade.see_syntax_error": "{why}（答案单元格有语法错误：见上面的说明）",
    "grade.cell_interrupted": "答案单元格运行超过 {seconds:g} 秒（--cell-timeout）被中断，没有运行完；测试在缺少其余部分的情况下运行",
    "grade.cell_syntax_error": "答案单元格有语法错误，整个单元格都没有运行：SyntaxError: {detail}",
    "grade.cell_raised": "答案单元格抛出了 {error}：{detail}；测试只能使用它在出错之前定义的内容",
    "grade.header": "评分：{submission}，对照 {chapter}（时限 {timeout:g} 秒）",
    "grade.timed_out": ("超时：{timeout:g} 秒后 notebook 仍未运行完（死循环，或者机器太忙、来不及运行完："
                        "--timeout SECONDS 可以放宽时限）；所有问题都记 0 分。"),
    "grade.note": "说明：{notice}", "grade.total": "总分",
}

CATALOGUES = {"en": _EN, "zh_CN": _ZH}

_FIELD = re.compile(r"\{(\w*)(![rs])?(?::([^{}]*))?\}")


def language(lang) -> str:
    """The catalogue for ``lang``: "en", "zh_CN"; "zh", "zh-CN", "zh-Hans" and "en-US" are read
    as their catalogue; anything else is a ValueError naming ``lang``."""
    if not isinstance(lang, str):
        raise ValueError(f"lang={lang!r} must be a language code, one of {list(LANGUAGES)}")
    code = lang.replace("-", "_")
    if code in CATALOGUES:
        return code
    base = code.split("_")[0].lower()
    for name in LANGUAGES:
        if name.split("_")[0] == base:
            return name
    raise ValueError(f"lang={lang!r} has no catalogue; valid: {list(LANGUAGES)} (or zh, zh-CN)")


def known(kind: str) -> bool:
    """Whether the catalogues have ``kind``."""
    return kind in _EN


def _template(kind, lang) -> str:
    if not isinstance(kind, str) or kind not in _EN:
        raise ValueError(f"kind={kind!r} is not in the catalogue (labkit.messages)")
    return CATALOGUES[language(lang)].get(kind, _EN[kind])


def _option_text(name, value, lang) -> str:
    """A value as the reader chose it: its option's text where the catalogue has one, else the
    value quoted (a number as it is)."""
    kind = f"option.{name}.{value}"
    if kind in _EN:
        return render(kind, lang)
    return str(value) if isinstance(value, (int, float)) else _template("quote", lang).format(value)


def _format(value, conversion, spec, lang, fields) -> str:
    spec = spec or ""
    if spec == "arg":  # an argument's name: its field's label where the form has one, then the name
        label = "label." + str(value)
        return f"{render(label, lang)}（{value}）" if label in _EN and render(label, lang) != value else str(value)
    if spec in ("val", "vals"):  # the value(s) of the argument named by the field "name"
        texts = [_option_text(fields.get("name"), v, lang) for v in (value if spec == "vals" else [value])]
        return _template("list.separator", lang).join(texts)
    if spec == "term":
        return render("term." + value, lang) if "term." + value in _EN else str(value)
    if spec == "list":
        return _template("list.separator", lang).join(
            render("feature." + v, lang) if isinstance(v, str) and "feature." + v in _EN else str(v)
            for v in value)
    if spec.startswith("opt.") or spec.startswith("opts."):  # an option's text, or a list of them
        prefix = "option." + spec.split(".", 1)[1] + "."
        texts = [render(prefix + v, lang) if prefix + v in _EN else str(v)
                 for v in (value if spec.startswith("opts.") else [value])]
        return _template("list.separator", lang).join(texts)
    if spec == "q":
        return _template("quote", lang).format(value)
    if conversion == "!r":
        value = repr(value)
    elif conversion == "!s":
        value = str(value)
    if spec and spec.endswith("GB"):
        return format(value / 1e9, spec[:-2] + "f") + " GB"
    return format(value, spec or "")


def pieces(kind: str, lang: str = "en", **fields) -> list:
    """``kind`` in ``lang`` as a list of (text, field name or None): the calculators wrap each
    field's text in an element that carries its exact value."""
    template, out, at = _template(kind, lang), [], 0
    for m in _FIELD.finditer(template):
        name, conversion, spec = m.group(1), m.group(2), m.group(3)
        if name not in fields:
            raise ValueError(f"{kind}: field {name!r} missing; given {sorted(fields)}")
        if m.start() > at:
            out.append((template[at:m.start()], None))
        out.append((_format(fields[name], conversion, spec, lang, fields), name))
        at = m.end()
    if at < len(template):
        out.append((template[at:], None))
    return out


def render(kind: str, lang: str = "en", **fields) -> str:
    """``kind``'s template in ``lang`` (a ValueError names an unknown kind or language, or a field
    the template needs and ``fields`` lacks)."""
    return "".join(text for text, _ in pieces(kind, lang, **fields))


def error_message(error: BaseException, lang: str = "en") -> str:
    """What to show for ``error``: its structured kind rendered in ``lang`` when it has one
    (``labkit.validate.ArgumentError``), else ``"error.other"`` around its text."""
    kind = getattr(error, "kind", None)
    if kind and "error." + kind in _EN:
        try:
            return render("error." + kind, lang, **getattr(error, "fields", {}))
        except (ValueError, KeyError, TypeError):
            pass  # fields that do not match the template: say it as raised
    return render("error.other", lang, detail=str(error))


def training_reason(overflows, lang: str = "en") -> str:
    """Why no training plan fits, from ``TrainingPlans.overflows`` (``labkit.plan.Overflow``:
    each layout's leanest configuration and the term that passed the limit), the closest first;
    in English, the text of ``TrainingPlans.reason()``."""
    if not overflows:
        return render("plan.no_layout", lang)
    lines = []
    for o in sorted(overflows, key=lambda o: o.leanest.memory.total):
        cp = render("plan.layout_cp", lang, cp_size=o.cp_size) if o.cp_size > 1 else ""
        why = render("plan.overflow", lang, term=o.term, bytes_so_far=o.bytes_so_far,
                     limit_bytes=o.limit_bytes)
        lines.append(render("plan.layout", lang, tp_size=o.tp_size, cp=cp, pp_size=o.pp_size,
                            dp_size=o.dp_size, why=why))
    return render("plan.separator", lang).join(lines)


def serving_reason(refused, lang: str = "en") -> str:
    """Why each refused tensor-parallel degree serves nothing, from ``ServingPlans.refused``; in
    English, the text of ``ServingPlans.reason()``."""
    return render("plan.separator", lang).join(
        render("serve.no_block", lang, tp_size=p.tp_size) if p.bound == "weights"
        else render("serve.too_few_blocks", lang, tp_size=p.tp_size, num_blocks=p.num_blocks)
        for p in refused)
