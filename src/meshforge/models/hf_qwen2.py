"""Hugging Face Qwen2 / Qwen2.5 (`Qwen2ForCausalLM`): Llama's layers with biases on q, k and v (never o).

Sliding-window attention layers (`use_sliding_window: true`) are refused; with it false, `sliding_window`
and `max_window_layers` have no effect and are accepted.
"""

from meshforge.models.hf_dense import DenseFamily

QWEN2 = DenseFamily("qwen2", "Qwen2ForCausalLM", fixed={"qkv_bias": True, "attention_bias": False, "qk_norm": False},
                    sliding="qwen", default_max_positions=32768)
