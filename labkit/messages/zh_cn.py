"""The Chinese catalogue of :mod:`labkit.messages`, in the glossary's terms
(locales/zh_CN/GLOSSARY.md): every kind of the English one, with the same fields."""

__all__ = ["CATALOGUE"]

CATALOGUE = {
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
    "option.precision.bf16-mixed-fp32-buffer": "bf16 混合精度，bf16 梯度累加到 fp32 缓冲区",
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
    "calc.model_params": "参数：共 {num_params:,} 个，每个 token 激活 {active_params:,} 个",
    "calc.paste_here": "在此粘贴 Hugging Face 的 config.json",
    "label.config_json": "粘贴的 config.json", "option.preset.config.json": "粘贴的 config.json",
    "plan.overflow": "计入{term:term}后累计 {bytes_so_far:GB}，超过上限 {limit_bytes:GB}",
    "plan.layout": "t={tp_size}{cp} p={pp_size} N_d={dp_size}：{why}",
    "plan.layout_cp": " cp={cp_size}", "plan.separator": "；", "plan.colon": "：",
    "plan.refused": "labkit 尚不能运行：{what}", "plan.refused_separator": "；",
    "refused.offload_stage": 'ZeRO-2 以外阶段的 ZeRO-Offload（labkit.zero.OffloadOptimizer 基于 ZeRO-2）',
    "refused.offload_composed": 'ZeRO-Offload 与张量、流水线或上下文并行的组合（labkit.zero.OffloadOptimizer 只在数据并行上运行）',
    "refused.offload_params": 'ZeRO-3 的参数卸载（offload_params）',
    "refused.reshard": 'ZeRO-3 在前向之后保留已收集参数直到反向（reshard_after_forward=False）',
    "refused.ep_composed": '混合专家与上下文并行的组合（模型含专家或 ep_size > 1，且 cp > 1）',
    "plan.no_layout": "没有一种 (t, cp, p, N_d, b) 能同时整除 GPU 数和全局批次",
    "serve.ep": "（专家并行）",
    "serve.no_block": "t={tp_size}{ep}：权重放下之后，连一个 KV 块都放不下",
    "serve.too_few_blocks": "t={tp_size}{ep}：只有 {num_blocks} 个块，不够一个请求使用",
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
    "error.mla_heads": ("MLA（kv_lora_rank > 0）没有 d_head 和 n_kv_head：它的头大小由 qk_* 和 v_head_dim "
                        "字段给出，每个头都读取同一份压缩缓存"),
    "error.seq_cp": ("seq_len={seq_len}：必须能被 cp_size={cp_size} 整除（使用序列并行时还要乘以 "
                     "tp_size={tp_size}）：每个 rank 持有相等份额的位置"),
    "error.interleave": ("v={v}：每个 rank 放多个模型块需要 pp_size > 1（当前为 {pp_size}）、v × pp_size 不超过 "
                         "n_layer={n_layer}，且 pp_size 整除 num_microbatches={num_microbatches}"),
    "error.interleave_schedule": "v={v}：每个 rank 放多个模型块需要交错调度（schedule='interleaved'）；当前为 {schedule!r}",
    "error.cp_chunks": "{name}={seq_len}：必须能被 {chunks} 整除（cp_size={cp_size}；请填充序列，或换一个 cp_size）",
    "error.sp_tp": "sequence_parallel=True：序列并行需要 tp_size > 1（它把序列切分到张量并行组上）",
    "error.sp_seq": "序列长度 {seq_len}：启用序列并行时必须能被 tp_size={tp_size} 整除（每个 rank 持有 seq_len / tp_size 个位置）",
    "error.seq_len_max": "seq_len={seq_len}：不能超过模型的 seq_len={max_len}（即其 max_position_embeddings）",
    "error.untrainable": "训练显存估算尚未建模：{missing:list}",
    "error.serving_experts": ("tp_size={tp_size}：必须整除 d_expert={d_expert}（每个专家按 t 切分），"
                              "或者把专家整个分到各 rank 上（expert_parallel）"),
    "error.expert_parallel": "expert_parallel=True：专家并行需要专家；这个模型是稠密模型（n_experts=0）",
    "error.weight_format": ("weight_format={value!r}（配置文件的 quantization_config）尚未建模；"
                            "请给出一种权重格式：{valid:list}"),
    "error.format_and_bytes": "{format_name}={format!r} 与 {bytes_name}={bytes!r}：只能给出其中一个",
    "error.no_peak": ("精度“{precision:opt.precision}”以 {half} 计算，而 {gpu} 没有 {half} 张量核心，"
                      "也就没有 {half} 峰值；{gpu} 上可用的精度：{valid:opts.precision}"),
    "error.other": "labkit 拒绝了这组输入：{detail}",
    "error.not_a_number": "{name:arg}：{text:q} 不是数字",
    "error.config_json": "config.json 无法解析：第 {line} 行第 {column} 列有语法错误",
    "error.config_empty": "config.json 是空的：请粘贴模型 config.json 的内容",
    "error.config_object": "config.json 必须是一个对象（{...}），即 Hugging Face 写出的格式",
    "error.model_type": "labkit 不读取 model_type={model_type:q} 的 config.json；支持的 model_type：{supported:vals}",
    "error.config_keys": ("config.json 的键 {keys:vals} 在 model_type={model_type:q} 下不被读取：改变显存或 "
                          "FLOPs 的键必须建模，不能忽略（已读取：{read:vals}）"),
    "error.config_missing": "config.json 缺少 {missing:vals}；model_type={model_type:q} 的 config.json 需要 {needed:vals}",
    "error.config_missing_experts": "config.json 缺少 {missing:vals}：混合专家模型需要给出专家数和每个 token 选择的专家数",
    "error.config_act": ("{key} = {value:q}：model_type={model_type:q} 的块按 {act:q} 读取（门控 MLP："
                         "“silu” 对应 SwiGLU，“gelu_pytorch_tanh” 对应 GeGLU）"),
    "error.config_value": "{key} = {value:q}：model_type={model_type:q} 下尚未建模",
    "error.config_text": ("model_type={model_type:q} 需要一个 model_type 为 {text_type:q} 的 text_config："
                          "读取的是其中的语言模型"),
    "error.config_quantization": "quantization_config = {value!r} 必须是一个含字符串 quant_method 的对象",
    "error.config_window_switch": "use_sliding_window=True（从 max_window_layers 层起加滑动窗口）尚未建模",
    "error.config_layer_list": "{key} 必须为全部 {n_layer} 层逐层给出 {full:q} 或 {windowed:q}",
    "error.config_no_window": "{key} 含有 {windowed:q} 层，但配置文件没有给出窗口大小",
    "error.config_layer_pattern": "{key} = {value!r}：只建模了“每 k 层一层全注意力、其余为窗口注意力”的排布",
    "error.config_disagree": "{keys:vals} 的取值不一致：{values!r}",
    "error.config_missing_width": "config.json 缺少 ['{key}']（专家的宽度）",
    "error.config_moe_freq": "moe_layer_freq = {value!r}：只建模了 1（first_k_dense_replace 之后每层都是稀疏层）",
    "error.config_head_dim": ("head_dim = {head_dim!r} 与 qk_rope_head_dim = {rope!r} 不同：MLA 的头维度从 qk_* "
                              "各键读取"),
    "error.config_missing_dense_width": "config.json 缺少 ['{key}']（Llama 4 稠密层的宽度）",
    "error.config_moe_layers": ("moe_layers = {value!r} 不是每隔 interleave_moe_layer_step = {step!r} 层一层："
                                "只建模了这种排布"),
    "error.config_window_size": "sliding_window_size = {size!r} 与 sliding_window = {window!r} 不同",
    "feature.experts": "混合专家", "feature.MLA": "MLA", "feature.head size": "独立的头大小",
    "feature.q/k/v biases": "q/k/v 偏置", "feature.output bias": "输出偏置",
    "feature.qk-norm": "q/k 归一化", "feature.feed-forward norms": "前馈层归一化",
    "feature.attention sinks": "注意力汇聚", "feature.GeGLU": "GeGLU",
    "feature.per-layer windows": "各层不同的窗口", "feature.chunked attention": "分块注意力",
    "feature.shared-expert gate": "共享专家门控", "feature.expert biases": "专家偏置",
    "feature.tensor-parallel experts": "张量并行切分的专家", "feature.fused MoE kernels": "融合的混合专家内核",
    "feature.gelu experts": "GELU 专家", "feature.geglu experts": "GeGLU 专家",
    "list.separator": "、", "quote": "“{}”",
    # the engines' notes (labkit.plan.export: an ExportNote, "{engine}：" before it) and the
    # published runs' notes (labkit.plan.published: PublishedRun.note_texts)
    "export.note": "{engine}：{text}",
    "option.attention.flash": "融合（SDPA）", "option.attention.eager": "非融合（eager）",
    "export.accelerate.machines": ("共 {machines} 台机器，每台 {gpus_per_node} 张 GPU：每台机器各自设置 machine_rank，"
                                   "main_process_ip 和 main_process_port 填第一台机器的地址和端口"),
    "export.accelerate.loop": ("微批次大小 {micro_batch}（每个序列 {seq_len} 个 token）即数据加载器（DataLoader）的 "
                               "batch_size，梯度累积步数由 Accelerator(gradient_accumulation_steps={num_microbatches}) "
                               "给出；用 accelerator.clip_grad_norm_(params, {max_norm}) 裁剪梯度；优化器"
                               "（{optimizer:opt.optimizer}）由你自己创建，经 accelerator.prepare 包装；DDP 和 FSDP "
                               "会让梯度归约与反向传播重叠进行"),
    "export.deepspeed.bf16_optimizer": ("ZeRO 阶段 1 下以 fp32 做梯度累积的 bf16 训练，就是它的 BF16 优化器，"
                                        "这个优化器还要保存一份 bf16 梯度：每个参数比方案计入的多 2 字节"
                                        "（精度选“{precision:opt.precision}”时会计入这部分）"),
    "export.deepspeed.fp32_partition": ("ZeRO-1/2 在 bf16 下以 fp32 保存划分到本 rank 的梯度和主权重"
                                        "（每个参数 4 + 4 字节，方案按 2 + 4 字节计）"),
    "export.deepspeed.pipeline": ("请把模型构建为 {module}：流水线阶段由这个模块的参数决定（配置中的“pipeline”"
                                  "块只设置它的重计算）"),
    "export.deepspeed.experts": "ep_size={ep_size} 需要在模型中写成 deepspeed.moe.layer.MoE(..., ep_size={ep_size})",
    "export.deepspeed.full": ("完全重计算（recompute='full'）：用 deepspeed.checkpointing.checkpoint 包装每个块"
                              "（activation_checkpointing 配置的正是这个调用）"),
    "export.deepspeed.selective": ("选择性重计算（recompute='selective'）只重计算注意力的核心部分，要在模型代码中实现："
                                   "DeepSpeed 的配置没有对应的开关"),
    "export.deepspeed.eager": "非融合注意力（attention='eager'）要在模型代码中实现：DeepSpeed 没有注意力相关的设置",
    "export.deepspeed.yours": ("学习率及其调度由你自己设置（optimizer.params、scheduler），{seq_len} 个 token 的"
                               "序列由你的数据加载器提供"),
    "export.fsdp2.stages": ("每个阶段的模块（它分到的 model.layers）需要你自己切分；流水线并行下，fully_shard 的 "
                            "reshard_after_forward 保持给定的值"),
    "export.fsdp2.loop": ("作用于 model.parameters() 的优化器（{optimizer:opt.optimizer}）、微批次，以及模型的"
                          "{attention:opt.attention}注意力，都由训练循环负责；fully_shard 会让梯度归约与反向传播"
                          "重叠进行"),
    "export.fsdp2.fp32_states": ("fully_shard 以 fp32 保存分片后的参数和梯度（每个参数 4 + 4 + 8 字节，"
                                 "即方案中的 2 + 2 + 4 + 8 字节换了一种分配）"),
    "export.fsdp2.embedding": ("不用 fully_shard 时，torch 按词表切分的嵌入层（RowwiseParallel）会让每个 rank "
                               "保留完整的梯度：比方案多出 V h 个梯度元素的 (t - 1)/t（t = {tp_size}；"
                               "用 torch 2.13 测得，见 tests/test_export.py）"),
    "export.megatron.offload": ("--optimizer-cpu-offload 在分布式优化器的基础上把优化器状态和 fp32 主权重卸载到 "
                                "CPU，梯度仍留在 GPU 上（方案按 ZeRO-Offload 计，梯度也一并卸载）"),
    "export.megatron.model_flags": "这个模型结构含有{beyond:list}，描述模型本身的命令行参数没有写出：请自行补上",
    "export.torchtitan.reshard": ("流水线并行下，它默认让 FSDP 的参数从前向一直保留到反向；{setting} "
                                  "会像方案那样在前向之后释放它们"),
    "export.torchtitan.stages": ("它切分层时把嵌入层和输出层各算作一层（首、末阶段默认各少放 1 层），除非像这里"
                                 "一样设为 0：这样切出的才是方案的流水线阶段"),
    "export.torchtitan.fp32_states": ("FSDP 以 fp32 保存分片后的参数和梯度（每个参数 4 + 4 + 8 字节，即方案中的 "
                                      "2 + 2 + 4 + 8 = 16 字节换了一种分配），计算时再收集 bf16 副本"),
    "export.torchtitan.selective": ("它的选择性模式按算子进行（每隔一个矩阵乘法保存一次输出），而不是方案中只重"
                                    "计算注意力的做法：两者保存的激活值不同"),
    "export.torchtitan.optimizer": ("优化器（optimizer={optimizer!r}）要在 --config 所指函数的 param_groups 中给出"
                                    "（torchtitan 自带的配置使用 AdamW）"),
    "export.torchtitan.overlap": "FSDP 和 DDP 总是让梯度归约与反向传播重叠进行",
    "export.vllm.stored": ("检查点以 {fmt} 格式存储（见其 config.json 的 quantization_config），vLLM 会自行读取："
                           "无需 --quantization"),
    "export.vllm.fp8": ("对 16 位检查点使用 --quantization fp8 时，每个矩阵只有一个缩放因子；方案按每个 "
                        "128 x 128 块一个缩放因子计（DeepSeek-V3 的做法），多算了几 MB"),
    "export.vllm.int4": "--quantization {method} 读取的是已经以该格式存储的检查点：请给出这个检查点的名称",
    "export.vllm.memory": ("bfloat16 代表任意 2 字节的数据类型（float16 也一样）；vLLM 启动时先试跑一次前向以测量显存占用，"
                           "再把 --gpu-memory-utilization 余下的显存分给 KV 缓存，与方案的估算方式相同"),
    "export.vllm.windows": ("方案按每层的窗口大小确定该层的缓存，与 vLLM 的混合 KV 缓存管理器"
                            "（hybrid KV cache manager）一致；没有它，每层都要缓存完整的上下文，"
                            "能同时容纳的请求更少"),
    "published.bloom.network": ("训练所用的超级计算机（Jean Zay）每个节点有 4 条 100 Gb/s 链路（Omni-Path），"
                                "供节点上的 8 张 GPU 共用，按每张 GPU 6.25 GB/s 计"),
    "published.bloom.attention": "Megatron 的融合 softmax 会保存注意力分数（attention='eager'）；未使用序列并行",
    "published.llama3.interleave": "交错度 v 未公开：假设为 2，即最小的交错度",
    "published.llama3.fused": "按融合内核计（kernels='fused'，labkit.memory.fused），而不是 labkit 自己的计数",
    "published.llama3.stages": "首、末阶段各少一层：规划器的模型则把层数较少的阶段放在最后",
    "published.llama3.network": "未建模定制通信库（NCCLX）及其调优；400 Gb/s 的网络按每张 GPU 50 GB/s 计",
    "published.llama3.all_gather": "上下文并行通过对 K 和 V 做 all-gather 实现（规划器的模型按可重叠的 ring 计）",
    "published.llama3.assumed_128k": "128K 时是否重计算未说明：假设不重计算；v 未公开：假设为 2，与 8K 相同",
    "published.narayanan.micro_batch": "每一行的微批次大小均未公开：假设 b = {micro_batch}",
    "grade.case.public": "公开测试 {n}{rule}：{shown}{why}",
    "grade.case.hidden": "隐藏测试 {n}{rule}：{why}",
    "grade.rule": " [{rule}]",
    "grade.differs": "输出与预期不同",
    "grade.expected_got": "{call}：预期 {expected}，实际得到 {got}",
    "grade.expected_got_bare": "预期 {expected}，实际得到 {got}",
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
    "setup.device": "设备：{device}（{name}），随机种子 {seed}",
    "setup.no_cjk_font": ("没有安装中文字体，图中的中文会显示为方框（在 Colab 或 Debian/Ubuntu 上运行 "
                          "{command}，然后再次运行这个单元格）"),
    "table.train.summary": "{fit} 个配置放得下（共 {considered} 个，每张 GPU {limit:.1GB}）；最佳的 {shown} 个：",
    "table.train.t": "t", "table.train.p": "p", "table.train.v": "v", "table.train.dp": "dp",
    "table.train.ep": "ep", "table.train.cp": "cp", "table.train.zero": "ZeRO",
    "table.train.recompute": "重计算", "table.train.sp": "序列并行", "table.train.b": "b", "table.train.m": "m",
    "table.train.states": "状态", "table.train.activ": "激活值", "table.train.other": "其他",
    "table.train.total": "合计 GB", "table.train.step": "单步 s", "table.train.mfu": "MFU",
    "table.yes": "是", "table.no": "否", "table.on": "开", "table.off": "关",
    "table.serve.summary": "同时服务的 {context_len} token 请求：",
    "table.serve.t": "t", "table.serve.ep": "ep", "table.serve.replicas": "副本数",
    "table.serve.weights": "权重 GB", "table.serve.blocks": "KV 块数", "table.serve.tokens": "token/GPU",
    "table.serve.per_replica": "每个副本", "table.serve.requests": "请求数", "table.serve.bound": "瓶颈",
    "breakdown.title.training": "训练时每张 GPU 的显存（GB = 10^9 字节）",
    "breakdown.title.serving": "{gpu} 上服务时每张 GPU 的显存（GB = 10^9 字节）",
    "breakdown.params": "参数", "breakdown.grads": "梯度", "breakdown.optimizer": "优化器状态",
    "breakdown.activations": "激活值", "breakdown.transient": "临时峰值",
    "breakdown.non_torch": "非 PyTorch 开销", "breakdown.weights": "权重",
    "breakdown.activation_peak": "前向峰值", "breakdown.non_pytorch": "非 PyTorch 开销", "breakdown.kv_cache": "KV 缓存", "breakdown.total": "合计",
    "breakdown.note.stage": "（流水线第 {stage} 个阶段）",
    "breakdown.note.offloaded": "（流水线第 {stage} 个阶段；{offloaded:.3GB} 卸载到 CPU）",
    "breakdown.note.blocks": "{num_blocks} 个 {block_size} token 的块 = {max_tokens} 个 token",
    "meter.category": "类别", "meter.at_peak": "峰值时", "meter.max": "最大值", "meter.total": "合计",
    "meter.parameters": "参数", "meter.buffers": "缓冲区", "meter.gradients": "梯度",
    "meter.optimizer": "优化器状态", "meter.activations": "激活值", "meter.temporaries": "临时缓冲区",
    "meter.peak_in": "（峰值在{phase:phase}中，算子 {op}）",
    "phase.forward": "前向传播", "phase.backward": "反向传播", "phase.optimizer": "优化器更新",
    "checkpoint.sqrt": "√n 分段检查点",
    "raise.shard_missing": "分片 {name}（rank {rank}，共 {world_size} 个 rank）不在 {path} 中",
    "raise.shard_size": ("分片 {shard} 有 {size} 字节，清单记录的是 {expected}：它被截断、已损坏，"
                         "或者是另一个检查点（另一个模型或另一次训练）的分片"),
    "raise.shard_digest": ("分片 {shard} 不是这个检查点保存的那一个（SHA-256 不同）：它已损坏，"
                           "或者是另一个检查点（另一个模型或另一次训练）的分片"),
    "raise.shard_unreadable": "无法读取分片 {shard}：{error}",
    "raise.shard_foreign": "分片 {shard} 属于另一个 rank 或另一个模型",
    "raise.budget_below_one": ("budget_bytes={budget_bytes:,} 低于单个样本的峰值 {one:,} 字节: "
                               "放不下任何微批次；仅模型状态就需要更大的预算或分片"),
    "raise.double_free": "重复释放：block_id={block_id} 已经是空闲的",
}
