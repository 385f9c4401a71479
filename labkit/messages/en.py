"""The English catalogue of :mod:`labkit.messages`: every kind, its template."""

__all__ = ["CATALOGUE"]

CATALOGUE = {
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
    "option.precision.bf16-mixed-fp32-buffer": "bf16 mixed, bf16 gradients added to an fp32 buffer",
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
    "calc.model_params": "parameters: {num_params:,} in all, {active_params:,} active per token",
    "calc.paste_here": "Paste a Hugging Face config.json here",
    "label.config_json": "pasted config.json", "option.preset.config.json": "a pasted config.json",
    # the planner's reasons (labkit.plan: TrainingPlans.overflows, ServingPlans.refused)
    "plan.overflow": "{term}: {bytes_so_far:GB} of {limit_bytes:GB}",
    "plan.layout": "t={tp_size}{cp} p={pp_size} N_d={dp_size}: {why}",
    "plan.layout_cp": " cp={cp_size}", "plan.separator": "; ", "plan.colon": ": ",
    "plan.refused": "labkit does not run {what} yet", "plan.refused_separator": "; nor ",
    "refused.offload_stage": "ZeRO-Offload at a stage other than 2 (labkit.zero.OffloadOptimizer is ZeRO-2's)",
    "refused.offload_composed": 'ZeRO-Offload with tensor, pipeline or context parallelism (labkit.zero.OffloadOptimizer runs over data parallelism alone)',
    "refused.offload_params": "ZeRO-3's parameter offload (offload_params)",
    "refused.reshard": 'ZeRO-3 keeping its gathered parameters from forward to backward (reshard_after_forward=False)',
    "refused.ep_composed": 'a mixture of experts with context parallelism (experts, or ep_size > 1, with cp > 1)',
    "plan.no_layout": "no (t, cp, p, N_d, b) splits the GPUs and the global batch",
    "serve.ep": " ep",
    "serve.no_block": "t={tp_size}{ep}: the weights leave no room for a KV block",
    "serve.too_few_blocks": "t={tp_size}{ep}: {num_blocks} blocks, fewer than one request needs",
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
    "error.mla_heads": ("MLA (kv_lora_rank > 0) has no d_head or n_kv_head: its head sizes are the qk_* "
                        "and v_head_dim fields, and every head reads the one compressed cache"),
    "error.seq_cp": ("seq_len={seq_len} must be divisible by cp_size={cp_size} (x tp_size={tp_size} "
                     "with sequence parallelism): each rank holds an equal share of the positions"),
    "error.interleave": ("v={v} chunks a rank need pp_size > 1 (got {pp_size}), v x pp_size at most "
                         "n_layer={n_layer} and pp_size dividing num_microbatches={num_microbatches}"),
    "error.interleave_schedule": "v={v} chunks a rank need schedule='interleaved' (and v > 1); got {schedule!r}",
    "error.cp_chunks": ("{name}={seq_len} must be divisible by {chunks} for cp_size={cp_size} (pad the "
                        "sequence, or pick another cp_size)"),
    "error.sp_tp": "sequence_parallel=True needs tp_size > 1 (it splits the sequence over the tensor group)",
    "error.sp_seq": ("sequence length {seq_len} must be divisible by tp_size={tp_size} under sequence "
                     "parallelism: each rank holds seq_len / tp_size positions"),
    "error.seq_len_max": "seq_len={seq_len} must be at most the model's seq_len={max_len} (its max_position_embeddings)",
    "error.untrainable": "training estimates do not model {missing:list} yet",
    "error.serving_experts": ("tp_size={tp_size} must divide d_expert={d_expert} (each expert sliced by t), "
                              "or shard the experts whole (expert_parallel)"),
    "error.expert_parallel": "expert_parallel=True needs experts; this model is dense (n_experts=0)",
    "error.weight_format": ("weight_format={value!r} (the config's quantization_config) is not modelled; "
                            "give a weight format: {valid:list}"),
    "error.format_and_bytes": "{format_name}={format!r} and {bytes_name}={bytes!r}: give one",
    "error.no_peak": ("precision={precision!r} computes in {half}, which {gpu} has no peak for "
                      "(no {half} tensor cores); valid on {gpu}: {valid:list}"),
    "error.other": "{detail}",
    "error.not_a_number": "{name}: {text:q} is not a number",
    # a pasted config.json refused (labkit.hf_config: read_config_json, shape_fields)
    "error.config_json": "config.json is not valid JSON: line {line}, column {column}",
    "error.config_empty": "config.json is empty: paste the text of the model's config.json",
    "error.config_object": "config.json must be a JSON object ({...}), as Hugging Face writes it",
    "error.model_type": "model_type={model_type!r} is not read by labkit; supported: {supported!r}",
    "error.config_keys": ("config.json keys {keys!r} are not read for model_type={model_type!r}; a key that "
                          "changes memory or FLOPs must be modelled, not ignored (read: {read!r})"),
    "error.config_missing": "config.json is missing {missing!r}; a {model_type} config needs {needed!r}",
    "error.config_missing_experts": ("config.json is missing {missing!r}: a mixture of experts needs its "
                                     "expert count and experts per token"),
    "error.config_act": ("{key}={value!r}: a {model_type} block is read with {act!r} (gated MLP: SwiGLU "
                         "for 'silu', GeGLU for 'gelu_pytorch_tanh')"),
    "error.config_value": "{key}={value!r} is not modelled for model_type={model_type!r}",
    "error.config_text": ("model_type={model_type!r} needs a text_config of model_type {text_type!r}: its "
                          "language model is what is read"),
    "error.config_quantization": "quantization_config={value!r} must be a dict with a 'quant_method' string",
    "error.config_window_switch": ("use_sliding_window=True (a window on the layers from max_window_layers on) "
                                   "is not modelled"),
    "error.config_layer_list": "{key} must list {full!r} or {windowed!r} for each of {n_layer} layers",
    "error.config_no_window": "{key} has {windowed!r} layers but the config gives no window size",
    "error.config_layer_pattern": "{key}={value!r}: only every k-th layer full, the others windowed, is modelled",
    "error.config_disagree": "{keys!r} disagree: {values!r}",
    "error.config_missing_width": "config.json is missing ['{key}'] (the experts' width)",
    "error.config_moe_freq": ("moe_layer_freq={value!r}: only 1 (every layer after first_k_dense_replace sparse) "
                              "is modelled"),
    "error.config_head_dim": ("head_dim={head_dim!r} differs from qk_rope_head_dim={rope!r}: MLA's head sizes "
                              "are read from the qk_* keys"),
    "error.config_missing_dense_width": "config.json is missing ['{key}'] (Llama 4's dense layers' width)",
    "error.config_moe_layers": ("moe_layers={value!r} is not every interleave_moe_layer_step={step!r}-th layer: "
                                "only that pattern is modelled"),
    "error.config_window_size": "sliding_window_size={size!r} differs from sliding_window={window!r}",
    "feature.experts": "experts", "feature.MLA": "MLA", "feature.head size": "head size",
    "feature.q/k/v biases": "q/k/v biases", "feature.output bias": "output bias",
    "feature.qk-norm": "qk-norm", "feature.feed-forward norms": "feed-forward norms",
    "feature.attention sinks": "attention sinks", "feature.GeGLU": "GeGLU",
    "feature.per-layer windows": "per-layer windows", "feature.chunked attention": "chunked attention",
    "feature.shared-expert gate": "shared-expert gate", "feature.expert biases": "expert biases",
    "feature.tensor-parallel experts": "tensor-parallel experts", "feature.fused MoE kernels": "fused MoE kernels",
    "feature.gelu experts": "gelu experts", "feature.geglu experts": "geglu experts",
    "list.separator": ", ", "quote": "'{}'",
    # the engines' notes (labkit.plan.export: an ExportNote, "{engine}: " before it) and the
    # published runs' notes (labkit.plan.published: PublishedRun.note_texts)
    "export.note": "{engine}: {text}",
    "option.attention.flash": "fused (SDPA)", "option.attention.eager": "eager",
    "export.accelerate.machines": ("{machines} machines of {gpus_per_node}: each sets its machine_rank, and "
                                   "main_process_ip and main_process_port name the first"),
    "export.accelerate.loop": ("micro-batch {micro_batch} of {seq_len} tokens is the DataLoader's batch_size and "
                               "Accelerator(gradient_accumulation_steps={num_microbatches}); clip with "
                               "accelerator.clip_grad_norm_(params, {max_norm}); the optimizer ({optimizer}) is "
                               "yours, through accelerator.prepare, and DDP and FSDP overlap the gradient "
                               "reduction with the backward"),
    "export.deepspeed.bf16_optimizer": ("bf16 with fp32 gradient accumulation at ZeRO stage 1 is its BF16 "
                                        "optimizer, which also holds the bf16 gradients: 2 bytes a parameter more "
                                        "than the plan counts (precision={precision!r} counts them)"),
    "export.deepspeed.fp32_partition": ("ZeRO-1/2 under bf16 keeps its gradient partition and master copy in fp32 "
                                        "(4 + 4 bytes a parameter where the plan counts 2 + 4)"),
    "export.deepspeed.pipeline": ("build the model as {module}: the stages are the module's arguments (the "
                                  "config's pipeline block sets its recomputation only)"),
    "export.deepspeed.experts": "ep_size={ep_size} is deepspeed.moe.layer.MoE(..., ep_size={ep_size}) in the model",
    "export.deepspeed.full": ("recompute='full': wrap each block in deepspeed.checkpointing.checkpoint "
                              "(activation_checkpointing configures that call)"),
    "export.deepspeed.selective": ("recompute='selective' (attention's core recomputed) is the model's code: "
                                   "DeepSpeed's config has no switch for it"),
    "export.deepspeed.eager": "attention='eager' is the model's code: DeepSpeed has no attention setting",
    "export.deepspeed.yours": ("the learning rate and its schedule are yours (optimizer.params, scheduler), and "
                               "the {seq_len}-token sequences your data loader's"),
    "export.fsdp2.stages": ("each stage's module (its share of model.layers) is yours to cut; fully_shard under a "
                            "pipeline keeps reshard_after_forward as given"),
    "export.fsdp2.loop": ("the optimizer ({optimizer}) over model.parameters(), the micro-batches and the model's "
                          "{attention:opt.attention} attention are the training loop's; fully_shard overlaps the "
                          "gradient reduction with the backward"),
    "export.fsdp2.fp32_states": ("fully_shard keeps the sharded parameters and gradients in fp32 (4 + 4 + 8 bytes "
                                 "a parameter, the plan's 2 + 2 + 4 + 8 arranged differently)"),
    "export.fsdp2.embedding": ("without fully_shard, torch's vocabulary-split embedding (RowwiseParallel) leaves "
                               "each rank its whole gradient: (t - 1)/t of V h gradient elements above the plan "
                               "(t = {tp_size}; measured with torch 2.13, tests/test_export.py)"),
    "export.megatron.offload": ("--optimizer-cpu-offload moves the optimizer states and fp32 master weights to "
                                "the CPU, over the distributed optimizer, and keeps the gradients on the GPU (the "
                                "plan, ZeRO-Offload, moves its gradients too)"),
    "export.megatron.model_flags": "the model's own flags are not written for this shape ({beyond:list}): add them",
    "export.torchtitan.reshard": ("its default under a pipeline keeps FSDP's parameters from forward to "
                                  "backward; {setting} frees them as the plan does"),
    "export.torchtitan.stages": ("it splits the layers counting the embedding and the output as a layer each "
                                 "(first/last stage less layers 1) unless told 0, as here: the plan's stages"),
    "export.torchtitan.fp32_states": ("FSDP keeps the sharded parameters and gradients in fp32 (4 + 4 + 8 bytes "
                                      "a parameter, the plan's 2 + 2 + 4 + 8 = 16 arranged differently) and "
                                      "gathers bf16 copies"),
    "export.torchtitan.selective": ("its selective mode is per-op (it saves every other matmul's output), not "
                                    "the plan's attention-only recomputation: its activations differ"),
    "export.torchtitan.optimizer": ("optimizer={optimizer!r} is the --config function's param_groups "
                                    "(torchtitan's own configs take AdamW)"),
    "export.torchtitan.overlap": "FSDP and DDP always overlap the gradient reduction with the backward",
    "export.vllm.stored": ("the checkpoint is stored in {fmt} (its config.json's quantization_config), which "
                           "vLLM reads by itself: no --quantization"),
    "export.vllm.fp8": ("--quantization fp8 of a 16-bit checkpoint keeps one scale a matrix; the plan counted "
                        "one a 128 x 128 block (DeepSeek-V3's), a few MB more"),
    "export.vllm.int4": "--quantization {method} reads a checkpoint already stored so: give its name",
    "export.vllm.memory": ("bfloat16 stands for any 2-byte dtype (float16 too); vLLM profiles a forward at "
                           "start-up and gives the KV cache what remains of --gpu-memory-utilization, as the "
                           "plan's estimate does"),
    "export.vllm.windows": ("the plan sizes each layer's cache by its window, as vLLM's hybrid KV cache manager "
                            "does; without it every layer holds the whole context and fewer requests fit"),
    "published.bloom.network": "Jean Zay's 4 Omni-Path 100 Gb/s links per 8-GPU node, taken as 6.25 GB/s a GPU",
    "published.bloom.attention": ("Megatron's fused softmax keeps the scores (attention='eager'); no sequence "
                                  "parallelism"),
    "published.llama3.interleave": "the interleaving degree v is not published: 2 assumed, the least interleaving",
    "published.llama3.fused": "fused kernels (kernels='fused', labkit.memory.fused), not labkit's own count",
    "published.llama3.stages": ("one layer fewer on the first and last stage: the model's split puts the short "
                                "stages last"),
    "published.llama3.network": "NCCLX and its tuning; the 400 Gb/s network taken as 50 GB/s a GPU",
    "published.llama3.all_gather": ("context parallelism by an all-gather of K and V (the model's is the "
                                    "overlapped ring)"),
    "published.llama3.assumed_128k": ("recomputation at 128K is not stated: none assumed; v not published: 2 "
                                      "assumed, as at 8K"),
    "published.narayanan.micro_batch": "the micro-batch size of each row is not published: b = {micro_batch} assumed",
    # the exercise grader (scripts/exercises.py grade)
    "grade.case.public": "public test {n}{rule}: {shown}{why}",
    "grade.case.hidden": "hidden test {n}{rule}: {why}",
    "grade.rule": " [{rule}]",
    "grade.differs": "the output differs from the expected one",
    "grade.expected_got": "{call}: expected {expected}, got {got}",
    "grade.expected_got_bare": "expected {expected}, got {got}",
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
    # what labkit prints (labkit.setup's banner, the meter's table, the planner's tables, the
    # estimates' breakdowns), in the language labkit.messages.use set
    "setup.device": "device: {device} ({name}), seed {seed}",
    "setup.no_cjk_font": ("no CJK font is installed: Chinese in the figures shows as boxes (on Colab or "
                          "Debian/Ubuntu: {command}, then run this cell again)"),
    "table.train.summary": "{fit} of {considered} configurations fit in {limit:.1GB} a GPU; the best {shown}:",
    "table.train.t": "t", "table.train.p": "p", "table.train.v": "v", "table.train.dp": "dp",
    "table.train.ep": "ep", "table.train.cp": "cp", "table.train.zero": "zero",
    "table.train.recompute": "recompute", "table.train.sp": "sp", "table.train.b": "b", "table.train.m": "m",
    "table.train.states": "states", "table.train.activ": "activ", "table.train.other": "other",
    "table.train.total": "total GB", "table.train.step": "step s", "table.train.mfu": "MFU",
    "table.yes": "yes", "table.no": "no", "table.on": "on", "table.off": "off",
    "table.serve.summary": "requests of {context_len} tokens served at once:",
    "table.serve.t": "t", "table.serve.ep": "ep", "table.serve.replicas": "replicas",
    "table.serve.weights": "weights GB", "table.serve.blocks": "KV blocks", "table.serve.tokens": "tokens/GPU",
    "table.serve.per_replica": "per replica", "table.serve.requests": "requests", "table.serve.bound": "bound",
    "breakdown.title.training": "Training memory per GPU (GB = 10^9 bytes)",
    "breakdown.title.serving": "Serving memory per GPU on {gpu} (GB = 10^9 bytes)",
    "breakdown.params": "params", "breakdown.grads": "grads", "breakdown.optimizer": "optimizer",
    "breakdown.activations": "activations", "breakdown.transient": "transient",
    "breakdown.non_torch": "non_torch", "breakdown.weights": "weights",
    "breakdown.activation_peak": "forward peak", "breakdown.non_pytorch": "non-PyTorch", "breakdown.kv_cache": "KV cache", "breakdown.total": "total",
    "breakdown.note.stage": "(pipeline stage {stage})",
    "breakdown.note.offloaded": "(pipeline stage {stage}; {offloaded:.3GB} offloaded to the CPU)",
    "breakdown.note.blocks": "{num_blocks} blocks of {block_size} tokens = {max_tokens} tokens",
    "meter.category": "category", "meter.at_peak": "at peak", "meter.max": "max", "meter.total": "total",
    "meter.parameters": "parameters", "meter.buffers": "buffers", "meter.gradients": "gradients",
    "meter.optimizer": "optimizer", "meter.activations": "activations", "meter.temporaries": "temporaries",
    "meter.peak_in": "(peak in {phase}, op {op})",
    "phase.forward": "forward", "phase.backward": "backward", "phase.optimizer": "optimizer",
    "checkpoint.sqrt": "sqrt(n) segments",
    # exceptions whose text a lab prints
    "raise.shard_missing": "shard {name} (rank {rank} of {world_size}) is missing from {path}",
    "raise.shard_size": ("shard {shard} has {size} bytes, the manifest says {expected}: it is truncated, damaged, "
                         "or a shard of another checkpoint (another model or run)"),
    "raise.shard_digest": ("shard {shard} is not the one this checkpoint saved (its SHA-256 differs): it is "
                           "damaged, or a shard of another checkpoint (another model or run)"),
    "raise.shard_unreadable": "shard {shard} cannot be read: {error}",
    "raise.shard_foreign": "shard {shard} belongs to another rank or model",
    "raise.budget_below_one": ("budget_bytes={budget_bytes:,} is below the peak of one sample, {one:,} bytes: "
                               "no micro-batch fits; the model states alone need a larger budget or sharding"),
    "raise.double_free": "double free: block_id={block_id} is already free",
}
