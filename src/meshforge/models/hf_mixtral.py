"""Hugging Face Mixtral (`MixtralForCausalLM`): Mistral's attention, a softmax top-k router that always
renormalises the k weights, and experts `block_sparse_moe.experts.{e}.w1/w3/w2` of size `intermediate_size`.
`router_jitter_noise` (training-time noise) is accepted only as 0.
"""

from meshforge.models.hf_moe import MoEFamily

MIXTRAL = MoEFamily("mixtral", "MixtralForCausalLM", fixed={"qkv_bias": False, "attention_bias": False,
                                                           "qk_norm": False},
                    sliding="mistral", default_max_positions=131072, block="block_sparse_moe",
                    expert_names=("w1", "w3", "w2"), moe_ffn_key=None,
                    route_norm_key=None, must_be={"router_jitter_noise": 0.0})
