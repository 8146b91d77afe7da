"""Hugging Face mixture-of-experts decoders <-> meshforge `MoETransformer`: router and expert tensor layout.

HF checkpoints store each expert as its own three matrices (`...experts.{e}.{gate,up,down}.weight`, in
nn.Linear's (out, in) layout; transformers 5 fuses them when loading and splits them again when saving);
meshforge stacks the experts of a layer into `experts.w1` / `w3` (E, dim, hidden) and `w2` (E, hidden, dim).
So one meshforge tensor is E HF tensors: `hf_names` lists them in expert order, `to_hf` splits and transposes,
`from_hf` transposes and stacks. Attention, norms and embeddings are the dense families' (`hf_dense`).
Torch-free at import, like `hf_dense`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

from meshforge.errors import CheckpointError
from meshforge.models.hf_dense import DenseFamily, DenseStateDictAdapter

if TYPE_CHECKING:
    import torch

    from meshforge.models.args import ModelArgs

_EXPERT = re.compile(r"^layers\.(\d+)\.feed_forward\.(router\.gate\.weight|experts\.(w1|w3|w2))$")


@dataclass(frozen=True)
class MoEFamily(DenseFamily):
    has_experts: ClassVar[bool] = True
    block: str = "mlp"  # the HF module holding `gate` (router) and `experts` in each layer
    expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")  # HF names of w1, w3, w2
    moe_ffn_key: str | None = "moe_intermediate_size"  # None: experts use `intermediate_size` (Mixtral)
    route_norm_key: str | None = "norm_topk_prob"  # None: always renormalised (Mixtral)
    must_be: dict = field(default_factory=dict)  # config keys accepted only with this value

    def check_args(self, a: ModelArgs) -> None:
        if not a.is_moe:
            raise CheckpointError(f"model.family={self.name} needs a mixture-of-experts model (model.n_experts)")
        if a.n_shared_experts:
            raise CheckpointError(f"model.n_shared_experts={a.n_shared_experts}: Hugging Face {self.name} "
                                  "has no shared experts")
        if a.score_func != "softmax":
            raise CheckpointError(f"model.score_func={a.score_func}: Hugging Face {self.name} routes by softmax")
        if self.route_norm_key is None and not a.route_norm:
            raise CheckpointError(f"model.route_norm=false: Hugging Face {self.name} always renormalises")
        if a.router_bias_update_rate > 0:
            raise CheckpointError(f"model.router_bias_update_rate={a.router_bias_update_rate}: Hugging Face "
                                  f"{self.name}'s router has no selection bias, so the exported model would route "
                                  "otherwise (export from a run with it 0)")
        super().check_args(a)

    def read_config(self, config: dict) -> dict:
        c = dict(config)
        where = f"config.json ({self.name})"
        for key, value in self.must_be.items():
            got = c.pop(key, value)
            if got != value:
                raise CheckpointError(f"{where}: {key}={got!r} is not supported (only {value!r})")
        # the number of experts: `num_local_experts` (transformers 5 writes it), or its alias `num_experts`
        counts = {c.pop(k) for k in ("num_local_experts", "num_experts") if k in c}
        if len(counts) != 1:
            raise CheckpointError(f"{where}: needs one number of experts (num_local_experts or num_experts), got "
                                  f"{sorted(counts)}")
        moe = {"n_experts": counts.pop(), "top_k": c.pop("num_experts_per_tok", 2),
               "aux_loss_coeff": float(c.pop("router_aux_loss_coef", 0.001)), "score_func": "softmax",
               "n_shared_experts": 0}
        c.pop("output_router_logits", None)  # what HF's forward returns; meshforge always adds its aux loss
        moe["route_norm"] = bool(c.pop(self.route_norm_key, False)) if self.route_norm_key else True
        if self.moe_ffn_key and self.moe_ffn_key not in c:
            raise CheckpointError(f"{where}: required key {self.moe_ffn_key!r} is missing")
        moe_ffn = c.pop(self.moe_ffn_key) if self.moe_ffn_key else None
        out = super().read_config(c)
        return {**out, **moe, "moe_ffn_dim": moe_ffn or out["ffn_dim"]}

    def write_config(self, a: ModelArgs, dtype: torch.dtype) -> dict:
        c = super().write_config(a, dtype)
        c.update({"num_local_experts": a.n_experts, "num_experts_per_tok": a.top_k,
                  "router_aux_loss_coef": a.aux_loss_coeff, "output_router_logits": False, **self.must_be})
        if self.moe_ffn_key:
            c[self.moe_ffn_key] = a.moe_ffn_dim
        else:
            c["intermediate_size"] = a.moe_ffn_dim
        if self.route_norm_key:
            c[self.route_norm_key] = bool(a.route_norm)
        return c

    def adapter(self, args: ModelArgs) -> MoEStateDictAdapter:
        return MoEStateDictAdapter(args, self)


class MoEStateDictAdapter(DenseStateDictAdapter):
    """Dense names for attention and norms; router and stacked experts <-> HF per-expert tensors."""

    family: MoEFamily

    def hf_names(self, name: str) -> list[str]:
        m = _EXPERT.match(name)
        if not m:
            return super().hf_names(name)
        prefix = f"model.layers.{m[1]}.{self.family.block}"
        if m[3] is None:
            return [f"{prefix}.gate.weight"]
        hf = self.family.expert_names[("w1", "w3", "w2").index(m[3])]
        return [f"{prefix}.experts.{e}.{hf}.weight" for e in range(self.args.n_experts)]

    def to_hf(self, name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        m = _EXPERT.match(name)
        if not m or m[3] is None:
            return super().to_hf(name, tensor)
        return self.to_hf_experts(name, 0, tensor)

    def to_hf_experts(self, name: str, first: int, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        """Experts first..first+len(tensor)-1 of stacked weight `name` -> their HF tensors (export streams them
        expert by expert instead of holding a layer's stacked weight)."""
        names = self.hf_names(name)[first:first + len(tensor)]
        return {theirs: t.t().contiguous() for theirs, t in zip(names, tensor, strict=True)}

    def from_hf(self, name: str, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        m = _EXPERT.match(name)
        if not m or m[3] is None:
            return super().from_hf(name, tensors)
        import torch

        return torch.stack([tensors[theirs].t() for theirs in self.hf_names(name)])

    def from_hf_box(self, name: str, read, box: list[tuple[int, int]]) -> torch.Tensor:
        """Only experts box[0] (expert parallelism and FSDP shard the stacked dim), each read as its slice."""
        m = _EXPERT.match(name)
        if not m or m[3] is None:
            return super().from_hf_box(name, read, box)
        import torch

        names = self.hf_names(name)[box[0][0]:box[0][1]]
        (a, b), (c, d) = box[1], box[2]
        if not names:
            return torch.empty(0, b - a, d - c)
        return torch.stack([read(theirs, [(c, d), (a, b)]).t() for theirs in names])
