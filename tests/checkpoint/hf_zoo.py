"""Every transformers causal-LM architecture installed, as a tiny random model, for `tests/checkpoint/test_hf_zoo.py`
and the parity subset in `tests/parallel/test_hf_model_parity.py`.

`tiny_config(model_type)` builds the architecture's config class (the one `MODEL_FOR_CAUSAL_LM_MAPPING_NAMES` pairs
with it) with small sizes: 2 layers, width 64, 4 heads of 16, vocabulary 256, 4 experts of which 2 per token,
no dropout (a random draw per rank cannot match one process), `is_decoder` where the class has it (BERT-like
encoders decode causally only so). Sizes are set by field name where the class has
that field (`SIZES`); the few architectures whose own checks need more say so in `OVERRIDES`.

`train_against_transformers(folder, steps)` trains `model.hf_model=<folder>` with meshforge's trainer (one
process) and the same model with a plain transformers loop (same initial weights, same batches, AdamW with the
same groups and hyperparameters, the same gradient clipping, cross-entropy plus the router's auxiliary loss as
transformers' causal-LM classes add it) and returns the largest differences.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
import torch.nn.functional as F

VOCAB = 256
SIZES = {
    # widths
    "hidden_size": 64, "d_model": 64, "n_embd": 64, "embed_dim": 64, "hidden_dim": 64, "emb_dim": 64,
    "intermediate_size": 96, "ffn_dim": 96, "n_inner": 96, "d_ff": 96, "dff": 96, "decoder_ffn_dim": 96,
    "encoder_ffn_dim": 96, "ffn_hidden_size": 96, "dense_intermediate_size": 96,
    # depth
    "num_hidden_layers": 2, "n_layer": 2, "num_layers": 2, "n_layers": 2, "decoder_layers": 2, "encoder_layers": 2,
    "num_decoder_layers": 2, "num_encoder_layers": 2,
    # attention
    "num_attention_heads": 4, "n_head": 4, "n_heads": 4, "num_heads": 4, "decoder_attention_heads": 4,
    "encoder_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "swa_num_attention_heads": 4,
    "swa_num_key_value_heads": 2, "swa_head_dim": 16, "rotary_dim": 8, "d_rel": 4, "rel_extent": 16,
    "max_position_embeddings": 64, "n_positions": 64, "n_ctx": 64, "max_seq_len": 64,
    "kv_lora_rank": 16, "q_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16,
    "index_head_dim": 16, "index_n_heads": 4, "index_topk": 8,
    # experts
    "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "moe_num_experts": 4,
    "num_experts_per_tok": 2, "moe_topk": 2, "moe_k": 2, "top_k_experts": 2,
    "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32, "shared_intermediate_size": 32,
    "moe_shared_expert_intermediate_size": 32, "expert_ffn_hidden_size": 32, "router_hidden_size": 16,
    "n_shared_experts": 1, "num_shared_experts": 1, "moe_num_shared_experts": 1, "zero_expert_num": 2,
    "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1, "num_dense_layers": 1,
    # state-space / linear attention
    "state_size": 8, "ssm_state_size": 8, "mamba_d_state": 8, "mamba_n_heads": 4, "mamba_num_heads": 4,
    "mamba_head_dim": 16, "mamba_d_head": 32, "n_groups": 1, "mamba_n_groups": 1, "mamba_ngroups": 1,
    "chunk_size": 16, "mamba_chunk_size": 16, "mamba_d_ssm": 128, "n_mamba_heads": 2,
    "linear_key_head_dim": 16, "linear_value_head_dim": 16, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
    "linear_head_dim": 16, "linear_num_heads": 4,
    # extra vocabularies and embeddings
    "vocab_size_per_layer_input": VOCAB, "hidden_size_per_layer_input": 8, "pronunciation_vocab_size": 16,
    "shape_vocab_size": 16, "pronunciation_embed_dim": 16, "shape_embed_dim": 16, "laurel_rank": 8,
    "adapter_rank": 8, "gated_norm_rank": 8, "num_kv_shared_layers": 0, "num_mtp_layers": 0,
    "unpadded_vocab_size": VOCAB, "mm_embed_dim": 64, "mm_posemb_size": 16, "output_proj_dims": 64,
    "ext_pw_out_channel": 64, "depthwise_separable_out_channel": 64, "nemo_conv_channels": 64,
    "local_attention_window_len": 16,
}
TOKEN_IDS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}


# dropout and similar draws: zero (the run must be a function of the seed and the batch)
ZEROED = ("dropout", "pdrop", "drop_path", "router_jitter_noise", "layerdrop")


def _fields(cls) -> dict:
    return {f.name: f for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else {}


def _shrink(cls, overrides: dict | None = None):
    fields = _fields(cls)
    kw = {k: v for k, v in SIZES.items() if k in fields}
    if "vocab_size" in fields:
        kw["vocab_size"] = VOCAB
    for k, v in TOKEN_IDS.items():
        f = fields.get(k)
        if f is not None and isinstance(f.default, int) and f.default >= VOCAB:
            kw[k] = v
    for k, f in fields.items():
        if any(z in k for z in ZEROED) and isinstance(f.default, float) and f.default:
            kw[k] = 0.0
    if "is_decoder" in fields:  # an encoder class (BERT, RoBERTa, ...) as a causal LM: as transformers says to
        kw["is_decoder"] = True
    kw.update(overrides or {})
    return cls(**kw)


ROPE = {"rope_type": "default", "rope_theta": 10000.0}
MLA = {"head_dim": 8}
MLA_KV = {"head_dim": 8, "num_key_value_heads": 4}
OVERRIDES = {
    "cohere": {"use_qk_norm": True},  # per-head q/k LayerNorms (heads, head_dim): split with their heads under TP
"dots3_note_text": {"num_key_value_heads": 4},
    "gpt_neo": {"attention_types": [[["global", "local"], 1]]},
    "mamba2": {"num_heads": 8},
    "zaya": {"num_experts_per_tok": 1},
    "lfm2_moe": {"layer_types": ["conv", "full_attention"]},
    "cohere_compass_text": {"rope_parameters": {"full_attention": ROPE, "sliding_attention": ROPE}},
    "reformer": {"is_decoder": True, "axial_pos_shape": [4, 4], "axial_pos_embds_dim": [32, 32]},
    "axk2": MLA_KV, "deepseek_v32": MLA_KV, "glm_moe_dsa": MLA_KV, "longcat_flash": MLA,
    "dbrx": {"attn_config": {"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
             "ffn_config": {"ffn_hidden_size": 96, "moe_num_experts": 4, "moe_top_k": 2}},
    "zamba": {"num_hidden_layers": 3, "layers_block_type": ["hybrid", "mamba", "hybrid"]},
    "zamba2": {"layers_block_type": ["mamba", "hybrid"]},
    "dots3_note.text_config": {"num_key_value_heads": 4, "per_layer_config": {}},
    "blt": {"encoder_hash_byte_group_vocab": 64},
    "gemma4_assistant.text_config": {"hidden_size_per_layer_input": 0},
}

def tiny_config(model_type: str):
    """The architecture's config class with tiny sizes (sub-configs, e.g. `text_config`, shrunk too)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    cls = CONFIG_MAPPING[model_type]
    try:
        default = cls()
    except Exception:  # some composite configs do not validate with their own defaults
        default = None
    subs = {}
    for name, sub_cls in (getattr(cls, "sub_configs", None) or {}).items():
        sub = getattr(default, name, None)
        sub_cls = type(sub) if sub is not None and not isinstance(sub, dict) else sub_cls
        if dataclasses.is_dataclass(sub_cls):
            subs[name] = _shrink(sub_cls, OVERRIDES.get(f"{model_type}.{name}"))
    return _shrink(cls, {**subs, **OVERRIDES.get(model_type, {})})


def causal_lm_types() -> dict[str, str]:
    """model_type -> the causal-LM class transformers pairs with it, for every architecture installed."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return dict(sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items()))


def write_tiny(model_type: str, folder: Path) -> Path:
    """`folder/config.json` of the tiny architecture (a random start: no weights)."""
    folder.mkdir(parents=True, exist_ok=True)
    tiny_config(model_type).save_pretrained(folder)
    return folder


SHORT = ["training.seq_len=16", "training.global_batch_size=2", "training.micro_batch_size=2",
         "scheduler.name=constant", "scheduler.warmup_steps=0", "optimizer.lr=1e-3", "optimizer.impl=for_loop"]


class PlainLoop:
    """The reference: the transformers model trained by hand, as meshforge's trainer is configured (AdamW with decay
    on matrices only, the same hyperparameters, global-norm clipping, a constant learning rate), on the batches
    given: per micro batch sum(cross-entropy) / the global batch's label tokens, plus the auxiliary loss times the
    coefficient transformers' causal-LM class uses, divided by the micro batches."""

    def __init__(self, folder: Path, cfg, init: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32,
                 attn: str = "sdpa"):
        import transformers

        self.model = transformers.AutoModelForCausalLM.from_config(
            transformers.AutoConfig.from_pretrained(folder), attn_implementation=attn, dtype=dtype)
        self.model.load_state_dict({k: v.to(dtype) for k, v in init.items()})
        self.model.train()
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        o = cfg.optimizer
        self.opt = torch.optim.AdamW(
            [{"params": [p for p in self.params if p.dim() >= 2], "weight_decay": o.weight_decay},
             {"params": [p for p in self.params if p.dim() < 2], "weight_decay": 0.0}],
            lr=o.lr, betas=tuple(o.betas), eps=o.eps, foreach=False)
        self.clip = cfg.training.grad_clip
        self.coef = next((float(getattr(self.model, a)) for a in ("router_aux_loss_coef", "aux_loss_coef")
                          if hasattr(self.model, a)), 0.0)

    def step(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
        count = sum(int((y != -100).sum()) for _, y in micro_batches)
        total = 0.0
        for x, y in micro_batches:
            out = self.model(input_ids=x, use_cache=False)
            ce = F.cross_entropy(out.logits.flatten(0, 1).to(self.params[0].dtype), y.flatten(), ignore_index=-100,
                                 reduction="sum") / count
            aux = getattr(out, "aux_loss", None)
            (ce if aux is None else ce + self.coef * aux / len(micro_batches)).backward()
            total += ce.item()
        torch.nn.utils.clip_grad_norm_(self.params, self.clip)
        self.opt.step()
        self.opt.zero_grad()
        return total

    def state(self) -> dict[str, torch.Tensor]:
        return {k: v.detach() for k, v in self.model.state_dict().items()}


def meshforge_run(folder: Path, overrides: list[str], steps: int):
    """(config, trainer, its initial weights under transformers' names) of a one-process run, before any step."""
    from meshforge.testing.parity import config, single_info
    from meshforge.training.trainer import Trainer

    cfg = config([f"model.hf_model={folder}", *overrides], steps, world_size=1)
    trainer = Trainer.build(cfg, single_info())
    init = {k[len("hf."):]: v.detach().clone() for k, v in trainer.pm.unwrapped_parts()[0].state_dict().items()}
    return cfg, trainer, init


def train_against_transformers(folder: Path, steps: int = 3) -> dict:
    """{"loss_rel": max relative loss difference per step, "weight_abs": max abs final weight difference,
    "losses": meshforge's} of meshforge's trainer against `PlainLoop` on the same batches."""
    cfg, trainer, init = meshforge_run(folder, SHORT, steps)
    ours = trainer.pm.unwrapped_parts()[0]
    ref = PlainLoop(folder, cfg, init, attn=ours.hf.config._attn_implementation)
    ours_losses, ref_losses = [], []
    for _ in range(steps):
        batch = trainer.loader.next_batch()
        ours_losses.append(float(trainer.train_step(batch=batch)[0]))
        ref_losses.append(ref.step(batch))
    trained = {k[len("hf."):]: v for k, v in ours.state_dict().items()}
    weight = max((trained[k] - v).abs().max().item() for k, v in ref.state().items() if v.is_floating_point())
    rel = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(ours_losses, ref_losses))
    return {"loss_rel": rel, "weight_abs": weight, "losses": ours_losses, "ref_losses": ref_losses}
