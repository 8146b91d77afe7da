"""Hugging Face Mistral (`MistralForCausalLM`): Llama's layers without biases, and `sliding_window`.

`sliding_window` is kept (and exported back); attention within a window is full causal attention for
sequences no longer than the window, so a rule refuses `training.seq_len` above it (config/rules.py).
"""

from meshforge.models.hf_dense import DenseFamily

MISTRAL = DenseFamily("mistral", "MistralForCausalLM", fixed={"qkv_bias": False, "attention_bias": False,
                                                             "qk_norm": False},
                      sliding="mistral", default_max_positions=131072)
