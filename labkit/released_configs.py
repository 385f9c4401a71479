"""Released checkpoints' config.json files, transcribed: the keys ``labkit.shapes`` reads.

``labkit.shapes.PRESETS`` reads each with ``ModelShape.from_hf_config``, so a preset says what
its config.json says. Each entry names the repository whose config.json it copies and where the
copy was read (public mirrors of the Hugging Face files); ``tests/test_released_shapes.py``
checks every count against the published one. Only keys seen in the copy read are written; the
others change neither memory nor FLOPs (token ids, epsilons, rotary constants) or take the
family's default (``labkit.hf_config``: e.g. DeepSeek-V3's topk_method, gpt-oss's attention_bias).
"""

from __future__ import annotations

__all__ = ["RELEASED"]

_GPT_OSS_LAYERS = ["sliding_attention", "full_attention"]

# name -> (repository of the config.json, where it was read, the config's keys)
RELEASED: dict = {
    # Read from debaditc/kvfit src/kvfit/data/models.json (trimmed copies of the released files).
    "llama-3.1-8b": ("meta-llama/Llama-3.1-8B", "debaditc/kvfit", {
        "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
        "vocab_size": 128256, "max_position_embeddings": 131072, "tie_word_embeddings": False,
        "rope_theta": 500000.0}),  # θ: grattafiori2024llama3, Table 3 (the copy read leaves it out)
    "mistral-nemo-12b": ("mistralai/Mistral-Nemo-Instruct-2407", "debaditc/kvfit", {
        "model_type": "mistral", "hidden_size": 5120, "intermediate_size": 14336,
        "num_hidden_layers": 40, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
        "vocab_size": 131072, "max_position_embeddings": 131072, "tie_word_embeddings": False}),
    "phi-3-mini-4k": ("microsoft/Phi-3-mini-4k-instruct", "debaditc/kvfit", {
        "model_type": "phi3", "hidden_size": 3072, "intermediate_size": 8192,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
        "vocab_size": 32064, "max_position_embeddings": 4096, "sliding_window": 2047,
        "tie_word_embeddings": False}),
    "qwen2.5-7b": ("Qwen/Qwen2.5-7B-Instruct", "debaditc/kvfit; zaid-cdlg/inference-atlas", {
        "model_type": "qwen2", "hidden_size": 3584, "intermediate_size": 18944,
        "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
        "vocab_size": 152064, "max_position_embeddings": 32768, "sliding_window": 131072,
        "use_sliding_window": False, "tie_word_embeddings": False}),
    "qwen3-32b": ("Qwen/Qwen3-32B", "debaditc/kvfit", {
        "model_type": "qwen3", "hidden_size": 5120, "intermediate_size": 25600,
        "num_hidden_layers": 64, "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 128,
        "vocab_size": 151936, "max_position_embeddings": 40960, "use_sliding_window": False,
        "tie_word_embeddings": False}),
    "gemma-2-9b": ("google/gemma-2-9b-it", "debaditc/kvfit", {  # ties its embeddings (the default)
        "model_type": "gemma2", "hidden_size": 3584, "intermediate_size": 14336, "num_hidden_layers": 42,
        "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 256, "vocab_size": 256000,
        "max_position_embeddings": 8192, "sliding_window": 4096, "sliding_window_size": 4096}),
    # Mixtral 8x7B: zaid-cdlg/inference-atlas test/fixtures/hf/mixtral-8x7b.config.json, and the
    # vocabulary from the released config quoted in keras-team/keras-hub's Mixtral README.
    "mixtral-8x7b": ("mistralai/Mixtral-8x7B-v0.1", "zaid-cdlg/inference-atlas; keras-team/keras-hub", {
        "model_type": "mixtral", "hidden_act": "silu", "hidden_size": 4096, "intermediate_size": 14336,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "num_local_experts": 8, "num_experts_per_tok": 2, "vocab_size": 32000,
        "max_position_embeddings": 32768, "rope_theta": 1000000.0, "sliding_window": None,
        "router_aux_loss_coef": 0.02}),
    # Mixtral 8x22B: Cerebras' model-zoo config "based on mistral-community/Mixtral-8x22B-v0.1" gives
    # the vocabulary and 65536 positions; the sizes are the release's, which only the exact count
    # of 140,620,634,112 (tests/test_released_shapes.py) confirms here.
    "mixtral-8x22b": ("mistral-community/Mixtral-8x22B-v0.1", "Cerebras modelzoo (mixtral 8x22B)", {
        "model_type": "mixtral", "hidden_size": 6144, "intermediate_size": 16384,
        "num_hidden_layers": 56, "num_attention_heads": 48, "num_key_value_heads": 8,
        "num_local_experts": 8, "num_experts_per_tok": 2, "vocab_size": 32000,
        "max_position_embeddings": 65536}),
    "qwen1.5-moe-a2.7b": ("Qwen/Qwen1.5-MoE-A2.7B-Chat", "public test fixture of its config.json", {
        "model_type": "qwen2_moe", "hidden_size": 2048, "intermediate_size": 5632,
        "num_hidden_layers": 24, "num_attention_heads": 16, "num_key_value_heads": 16,
        "num_experts": 60, "num_experts_per_tok": 4, "moe_intermediate_size": 1408,
        "shared_expert_intermediate_size": 5632, "decoder_sparse_step": 1, "norm_topk_prob": False,
        "vocab_size": 151936, "max_position_embeddings": 32768, "rope_theta": 1000000.0,
        "sliding_window": 32768, "use_sliding_window": False, "max_window_layers": 21,
        "tie_word_embeddings": False}),
    "qwen3-30b-a3b": ("Qwen/Qwen3-30B-A3B", "debaditc/kvfit; zaid-cdlg/inference-atlas", {
        "model_type": "qwen3_moe", "hidden_size": 2048, "intermediate_size": 6144,
        "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
        "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
        "mlp_only_layers": [], "vocab_size": 151936, "max_position_embeddings": 40960,
        "use_sliding_window": False, "tie_word_embeddings": False}),
    "qwen3-235b-a22b": ("Qwen/Qwen3-235B-A22B", "debaditc/kvfit", {
        "model_type": "qwen3_moe", "hidden_size": 4096, "intermediate_size": 12288,
        "num_hidden_layers": 94, "num_attention_heads": 64, "num_key_value_heads": 4, "head_dim": 128,
        "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 1536,
        "mlp_only_layers": [], "vocab_size": 151936, "max_position_embeddings": 40960,
        "use_sliding_window": False, "tie_word_embeddings": False}),
    # DeepSeek-V2-Lite: its config.json as printed in a public model report (transformers 5.7
    # adds "head_dim" = qk_rope_head_dim and renames rope_scaling to rope_parameters).
    "deepseek-v2-lite": ("deepseek-ai/DeepSeek-V2-Lite", "public dump of DeepseekV2Config", {
        "model_type": "deepseek_v2", "hidden_act": "silu", "hidden_size": 2048, "intermediate_size": 10944,
        "num_hidden_layers": 27, "num_attention_heads": 16, "num_key_value_heads": 16,
        "q_lora_rank": None, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
        "v_head_dim": 128, "n_routed_experts": 64, "n_shared_experts": 2, "num_experts_per_tok": 6,
        "moe_intermediate_size": 1408, "first_k_dense_replace": 1, "moe_layer_freq": 1,
        "topk_method": "greedy", "scoring_func": "softmax", "norm_topk_prob": False,
        "routed_scaling_factor": 1.0, "vocab_size": 102400, "max_position_embeddings": 163840,
        "attention_bias": False, "tie_word_embeddings": False}),
    "deepseek-v3": ("deepseek-ai/DeepSeek-V3", "debaditc/kvfit; zaid-cdlg/inference-atlas", {
        "model_type": "deepseek_v3", "hidden_size": 7168, "intermediate_size": 18432,
        "num_hidden_layers": 61, "num_attention_heads": 128, "num_key_value_heads": 128,
        "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
        "v_head_dim": 128, "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 8,
        "moe_intermediate_size": 2048, "first_k_dense_replace": 3, "moe_layer_freq": 1,
        "num_nextn_predict_layers": 1, "vocab_size": 129280,
        "max_position_embeddings": 163840, "tie_word_embeddings": False,
        "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                "weight_block_size": [128, 128]}}),
    "gpt-oss-20b": ("openai/gpt-oss-20b", "debaditc/kvfit; zaid-cdlg/inference-atlas", {
        "model_type": "gpt_oss", "hidden_size": 2880, "intermediate_size": 2880,
        "num_hidden_layers": 24, "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64,
        "num_local_experts": 32, "num_experts_per_tok": 4, "experts_per_token": 4,
        "layer_types": _GPT_OSS_LAYERS * 12, "sliding_window": 128,
        "vocab_size": 201088, "max_position_embeddings": 131072, "tie_word_embeddings": False,
        "quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": [
            "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}}),
    "gpt-oss-120b": ("openai/gpt-oss-120b", "debaditc/kvfit", {
        "model_type": "gpt_oss", "hidden_size": 2880, "intermediate_size": 2880,
        "num_hidden_layers": 36, "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64,
        "num_local_experts": 128, "num_experts_per_tok": 4, "experts_per_token": 4,
        "layer_types": _GPT_OSS_LAYERS * 18, "sliding_window": 128,
        "vocab_size": 201088, "max_position_embeddings": 131072, "tie_word_embeddings": False,
        "quantization_config": {"quant_method": "mxfp4"}}),
    # Llama 4 Scout: a multimodal config; its language model under text_config (debaditc/kvfit's
    # copy, and the released config printed in full in a public model report).
    "llama-4-scout": ("meta-llama/Llama-4-Scout-17B-16E-Instruct", "debaditc/kvfit; public dump", {
        "model_type": "llama4", "architectures": ["Llama4ForConditionalGeneration"],
        "tie_word_embeddings": False, "text_config": {
            "model_type": "llama4_text", "hidden_act": "silu", "hidden_size": 5120,
            "intermediate_size": 8192, "intermediate_size_mlp": 16384, "num_hidden_layers": 48,
            "num_attention_heads": 40, "num_key_value_heads": 8, "head_dim": 128,
            "num_local_experts": 16, "num_experts_per_tok": 1, "interleave_moe_layer_step": 1,
            "attention_chunk_size": 8192, "no_rope_layers": [1, 1, 1, 0] * 12, "use_qk_norm": True,
            "attention_bias": False, "vocab_size": 202048, "max_position_embeddings": 10485760,
            "rope_theta": 500000.0, "tie_word_embeddings": False},
        "vision_config": {"model_type": "llama4_vision_model", "hidden_size": 1408,
                          "intermediate_size": 5632, "num_hidden_layers": 34, "image_size": 336,
                          "patch_size": 14, "num_channels": 3, "pixel_shuffle_ratio": 0.5,
                          "projector_input_dim": 4096, "projector_output_dim": 4096,
                          "vision_output_dim": 4096}}),
}
