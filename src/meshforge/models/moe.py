"""A mixture-of-experts decoder: the Llama blocks with the SwiGLU MLP replaced by routed experts.

Per block, `feed_forward` is an `MoE`:
  router  -> top-k experts per token (softmax or sigmoid scores, optional renormalisation of the
             k weights), dropless: every token copy is computed, no capacity factor.
  experts -> `GroupedExperts`, the routed SwiGLU experts as three stacked 3-D parameters
             `experts.w1` / `experts.w3` (n_experts, dim, hidden) and `experts.w2` (n_experts, hidden, dim),
             computed by `torch._grouped_mm` where it runs (any device; 16-byte aligned rows), else by a loop
             over experts. Both give the same numbers (tests/unit/test_moe_model.py).
  shared  -> optional `shared_experts`, a plain SwiGLU of hidden moe_ffn_dim * n_shared_experts.
  aux     -> the Switch-Transformer load-balancing loss coeff * E * sum_e f_e * P_e (f_e: fraction of
             token copies sent to e, not differentiable; P_e: mean router probability of e, differentiable),
             summed over layers and returned by `MoETransformer.forward` as `(logits, aux_loss)` in training,
             so `models.loss.lm_loss` adds it to the loss and its gradient reaches the router. With packed
             sequences only tokens in a document count (document id >= 0; padding is -1): padding is routed and
             computed like any token but never reaches f_e, P_e or `last_counts`, and attention keeps every
             document's tokens (so their routing) independent of the other documents of the row.

Why the aux loss is collected as it is: the block keeps `TransformerBlock`'s forward (`h -> h`), so the MoE
leaves its aux loss on itself (`MoE.aux_loss`) and the model's forward collects it right after each block.
Under activation checkpointing the block's forward runs again inside backward; that recompute computes the
same ops (the checkpoint needs the same saved tensors) but does not store its aux loss, so nothing is
counted twice, and the gradient flows through the aux tensor of the original forward.

Token dispatch is pluggable: `MoE.dispatcher` is None here (all experts local). Expert parallelism
(`distributed/expert_parallel.py`) sets it to an all-to-all dispatcher and shards the stacked expert
parameters on dim 0; the model itself never imports torch.distributed.

Per-expert LoRA (`peft:` with an `experts.*` role): `GroupedExperts.add_lora` adds an `ExpertLoRA` (models/lora.py)
per role under `experts.adapters`, stacked by expert on dim 0 like the weights (so expert parallelism shards
them with the experts); the roles are the transformers 5 expert parameters: `experts.gate_up_proj` (one adapter
on the fused gate/up weight (E, 2 x hidden, dim), as PEFT adapts it: w1 and w3 share A) and `experts.down_proj`.
Forward adds the per-expert deltas to the weights before the grouped matmuls.

`Router.replay_routing` (set by expert parallelism for `moe.ignore_router_for_ac`): the routing decision
(top-k indices) of each forward is kept and reused by the activation-checkpointing recompute, so the
recompute routes every token exactly as the original forward did, whatever the numerics.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from meshforge.models import shapes
from meshforge.models.args import ModelArgs
from meshforge.models.hf_families import dense_adapter
from meshforge.models.kv_cache import KVCache
from meshforge.models.llama import Llama, block_forward, cache_mask, rope_cos_sin, swiglu
from meshforge.models.lora import ExpertLoRA
from meshforge.models.materialize import buildable, build_children
from meshforge.models.protocol import AdapterLayout, InitSpec, StateDictAdapter


def in_backward() -> bool:
    """True while the autograd engine runs (an activation-checkpointing recompute happens there)."""
    return torch._C._current_graph_task_id() != -1


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; multiplies the gradient by `scale` (expert parallelism's 1/ep, see expert_parallel)."""

    @staticmethod
    def forward(ctx, x, scale):
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g * ctx.scale, None


def grouped_mm_supported(x: torch.Tensor, *weights: torch.Tensor) -> bool:
    """Whether `torch._grouped_mm` runs these operands: CPU fp32/bf16, CUDA bf16 on sm90+, 16-byte aligned rows."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    if x.device.type == "cuda":
        if x.dtype != torch.bfloat16 or torch.cuda.get_device_capability(x.device) < (9, 0):
            return False
    elif x.device.type != "cpu" or x.dtype not in (torch.float32, torch.bfloat16):
        return False
    es = x.element_size()
    return all((w.shape[-1] * es) % 16 == 0 and (w.shape[-2] * es) % 16 == 0 for w in weights)


@buildable
class Router(nn.Module):
    """Scores every expert for every token and picks the top k.

    Auxiliary-loss-free balancing (`bias_update_rate` > 0; DeepSeek-V3, Wang et al. 2024): experts are selected on
    scores + `expert_bias` (a persistent buffer, so checkpoints keep it and a resume continues exactly), while the
    weights stay the unbiased scores'; after each optimizer step the bias of every expert moves by the rate towards
    the mean load, b_i += rate * sign(mean_j load_j - load_i), from the load of the whole global batch (the
    distributed package sums it over the ranks, `expert_parallel.update_router_biases`). The bias stays fp32 when
    the model is cast (its updates are below bf16's resolution near 1; transformers keeps it fp32 too). The gate
    itself may have a bias (`bias`, a parameter: GPT-OSS)."""

    def __init__(self, dim: int, n_experts: int, top_k: int, score_func: str, route_norm: bool,
                 bias_update_rate: float = 0.0, bias: bool = False):
        super().__init__()
        if score_func not in ("softmax", "sigmoid"):
            raise ValueError(f"model.score_func={score_func!r} must be softmax or sigmoid")
        build_children(self, shapes.router(dim, n_experts, top_k, score_func, route_norm, bias_update_rate, bias))
        self.n_experts, self.top_k, self.score_func, self.route_norm = n_experts, top_k, score_func, route_norm
        self.bias_update_rate = bias_update_rate
        if bias_update_rate > 0:
            self.register_buffer("expert_bias", torch.zeros(n_experts, dtype=torch.float32))
        self.replay_routing = False
        self._routing_fifo: list[torch.Tensor] = []

    @property
    def has_bias(self) -> bool:
        return "expert_bias" in self._buffers

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x: (T, dim) -> scores (T, E) fp32, top-k expert ids (T, k), top-k weights (T, k) fp32."""
        logits = self.gate(x).float()
        scores = logits.softmax(-1) if self.score_func == "softmax" else logits.sigmoid()
        choice = scores.detach() + self.expert_bias if self.has_bias else scores.detach()
        idx = self._choose(choice)
        weights = scores.gather(-1, idx)
        if self.route_norm:
            weights = weights / weights.sum(-1, keepdim=True).clamp_min(1e-20)
        return scores, idx, weights

    def forget_routing(self) -> None:
        """Drop stored decisions no recompute will replay (a forward whose backward never ran)."""
        self._routing_fifo.clear()

    def _select(self, choice: torch.Tensor) -> torch.Tensor:
        """The top-k expert ids of the (detached) selection scores."""
        return choice.topk(self.top_k, dim=-1).indices

    def _choose(self, choice: torch.Tensor) -> torch.Tensor:
        if not (self.replay_routing and torch.is_grad_enabled()):
            return self._select(choice)
        if in_backward():  # activation-checkpointing recompute: route exactly as the original forward did
            if not self._routing_fifo:
                raise RuntimeError("MoE router: recompute without a stored routing decision")
            return self._routing_fifo.pop(0)
        idx = self._select(choice)
        self._routing_fifo.append(idx)
        return idx

    @torch.no_grad()
    def update_bias(self, load: torch.Tensor) -> None:
        """One balancing step from the global load (E,) of token copies per expert (see the class docstring)."""
        load = load.to(self.expert_bias.dtype)
        self.expert_bias += self.bias_update_rate * torch.sign(load.mean() - load)

    def _apply(self, fn, recurse=True):
        """Moves and casts as any module, but `expert_bias` keeps its fp32 values (see the class docstring), and a
        meta-device model materialised (`to_empty`) gets its initial value, zero."""
        bias = self._buffers.get("expert_bias")
        out = super()._apply(fn, recurse)
        moved = self._buffers.get("expert_bias")
        if bias is not None and bias.is_meta and not moved.is_meta:
            self._buffers["expert_bias"] = torch.zeros(moved.shape, dtype=torch.float32, device=moved.device)
        elif bias is not None and moved.dtype != torch.float32:
            self._buffers["expert_bias"] = bias.to(device=moved.device)
        return out


@buildable
class GroupedExperts(nn.Module):
    """n_experts SwiGLU experts as stacked parameters; `forward(x, counts)` on rows sorted by expert."""

    use_grouped_mm = True  # False forces the loop (tests compare both)

    def __init__(self, n_experts: int, dim: int, hidden: int):
        super().__init__()
        # w1, w3 (E, dim, hidden), w2 (E, hidden, dim); `adapters`: per-expert LoRA by role (empty: none), every
        # tensor stacked on dim 0
        build_children(self, shapes.grouped_experts(n_experts, dim, hidden))
        # expert parallelism scales these parameters' gradients (see distributed/expert_parallel.py)
        self.grad_scale = 1.0

    @property
    def lora_roles(self) -> list[str]:
        return [f"experts.{k}" for k in self.adapters]

    def lora(self, role: str) -> ExpertLoRA:
        return self.adapters[role.rpartition(".")[2]]

    def add_lora(self, role: str, rank: int, alpha: float) -> None:
        """Per-expert adapters on `experts.gate_up_proj` (w1 and w3, fused as HF stores them) or `experts.down_proj`."""
        n, dim, hidden = self.w1.shape
        in_f, out_f = shapes.expert_lora_dims(role, dim, hidden)
        self.adapters[role.rpartition(".")[2]] = ExpertLoRA(n, in_f, out_f, rank, alpha, like=self.w1)

    def _adapted(self, w1, w3, w2):
        """The (local) expert weights plus their adapters' deltas, in this module's (E, in, out) layout."""
        if "gate_up_proj" in self.adapters:
            d = self.adapters["gate_up_proj"].delta(self._local).transpose(1, 2)  # (E, dim, 2 x hidden): gate, up
            h = w1.shape[-1]
            w1, w3 = w1 + d[..., :h], w3 + d[..., h:]
        if "down_proj" in self.adapters:
            w2 = w2 + self.adapters["down_proj"].delta(self._local).transpose(1, 2)
        return w1.contiguous(), w3.contiguous(), w2.contiguous()

    @torch.no_grad()
    def merge_lora(self) -> None:
        """Fold the adapters into the (plain, whole) expert weights and drop them."""
        w1, w3, w2 = self._adapted(self.w1, self.w3, self.w2)
        self.w1.copy_(w1)
        self.w3.copy_(w3)
        self.w2.copy_(w2)
        self.adapters = nn.ModuleDict()

    def _local(self, w: torch.Tensor) -> torch.Tensor:
        if hasattr(w, "to_local"):  # a DTensor sharded on the expert dim: this rank's experts
            w = w.to_local()
        return _ScaleGrad.apply(w, self.grad_scale) if self.grad_scale != 1.0 else w

    def forward(self, x: torch.Tensor, counts: torch.Tensor, counts_list: list[int] | None = None) -> torch.Tensor:
        """x: (N, dim) rows grouped by expert in order; counts: (local experts,) rows per expert (`counts_list`:
        the same, when the host already knows them: balanced routing)."""
        w1, w3, w2 = self._local(self.w1), self._local(self.w3), self._local(self.w2)
        if len(self.adapters):
            w1, w3, w2 = self._adapted(w1, w3, w2)
        x = x.to(w1.dtype)
        if self.use_grouped_mm and grouped_mm_supported(x, w1, w2):
            offs = torch.cumsum(counts, 0).to(torch.int32)
            x = x.contiguous()
            h = swiglu(torch._grouped_mm(x, w1, offs=offs), torch._grouped_mm(x, w3, offs=offs))
            out = torch._grouped_mm(h, w2, offs=offs)
            if out.requires_grad:  # _grouped_mm's backward rejects expanded (stride 0) gradients, e.g. of .sum()
                out.register_hook(lambda g: g.contiguous())
            return out
        # every expert runs, also on zero rows: its weights then get a zero gradient, never None
        outs = []
        for e, xe in enumerate(torch.split(x, counts.tolist() if counts_list is None else counts_list)):
            outs.append(swiglu(xe @ w1[e], xe @ w3[e]) @ w2[e])
        return torch.cat(outs) if outs else x.new_zeros(0, w2.shape[-1])


def balanced_counts(copies: int, n_experts: int) -> list[int]:
    """Token copies per expert when copy i goes to expert i % n_experts."""
    base, extra = divmod(copies, n_experts)
    return [base + (e < extra) for e in range(n_experts)]


@buildable
class MoE(nn.Module):
    """Router + routed experts (+ shared experts); returns (T..., dim) and leaves `self.aux_loss`."""

    def __init__(self, args: ModelArgs, spec=None):
        super().__init__()
        self.n_experts, self.top_k, self.aux_coeff = args.n_experts, args.top_k, args.aux_loss_coeff
        # router, experts, shared_experts (None without them); `spec`: a family's own description of them
        build_children(self, spec or shapes.moe(args))
        self.dispatcher = None  # None: all experts on this rank; expert parallelism sets an all-to-all one
        self.aux_loss: torch.Tensor | None = None
        # context parallelism: sums (E + E + 1,) over the ranks sharing this micro batch (see load_balance_loss)
        self.stats_reducer = None
        self.aux_grad_scale = 1.0
        self.last_counts: torch.Tensor | None = None  # token copies per expert of the last forward (stats)
        # route token copy i to expert i % n_experts whatever the scores: every expert gets the same load, known
        # without reading a value (the scale trace runs on fake tensors, which have none)
        self.balanced_routing = False
        # auxiliary-loss-free balancing: token copies per expert since the last bias update (a plain attribute, not
        # a buffer: DDP would overwrite buffers with rank 0's at every forward)
        self.expert_load: torch.Tensor | None = None

    def router_counts(self, idx: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
        """Token copies per expert that the router statistics count: all of them, or (packed sequences) those of
        tokens in a document (`keep`, (T,) bool; padding is in none), without a host sync."""
        if keep is None:
            return torch.bincount(idx.reshape(-1), minlength=self.n_experts)
        weights = keep.unsqueeze(-1).expand_as(idx).reshape(-1).float()
        # whole numbers: the int64 of the unweighted count (the balancing loads of the ranks are summed as one)
        return torch.bincount(idx.reshape(-1), weights=weights, minlength=self.n_experts).long()

    def load_balance_loss(self, scores: torch.Tensor, counts: torch.Tensor,
                          keep: torch.Tensor | None = None) -> torch.Tensor:
        """coeff * E * sum_e f_e * P_e over the micro batch's tokens (`keep`: only those in a document, with the
        matching `router_counts`).

        With `stats_reducer` set (context parallelism: the micro batch's tokens are split over the cp ranks),
        the per-expert sums are added over those ranks first, so the value is the single-process one; the
        gradient still flows through this rank's tokens only, and is multiplied by `aux_grad_scale` (= cp)
        because the data-parallel reduction averages it over the cp ranks that each hold one share of it.
        """
        probs = scores if self.router.score_func == "softmax" else scores / scores.sum(-1, keepdim=True)
        if keep is None:
            n_tok = torch.tensor([float(probs.shape[0])], device=probs.device)
        else:
            probs = probs * keep.unsqueeze(-1).to(probs.dtype)
            n_tok = keep.sum().reshape(1).to(probs.dtype)
        prob_sum = probs.sum(0)
        counts = counts.to(probs.dtype)
        if self.stats_reducer is not None:
            total = self.stats_reducer(torch.cat([prob_sum.detach(), counts, n_tok]))
            e = self.n_experts
            prob_sum = prob_sum + (total[:e] - prob_sum.detach())  # global value, local gradient
            counts, n_tok = total[e:2 * e], total[2 * e:]
        frac = counts / counts.sum().clamp_min(1)
        aux = self.aux_coeff * self.n_experts * (frac * prob_sum / n_tok.clamp_min(1)).sum()
        return _ScaleGrad.apply(aux, self.aux_grad_scale) if self.aux_grad_scale != 1.0 else aux

    def forward(self, x: torch.Tensor, in_document: torch.Tensor | None = None) -> torch.Tensor:
        """x: (..., dim); `in_document` (packed sequences): x's leading shape, True for tokens in a document. Every
        token is routed and computed; only those in a document count in the router statistics and the aux loss."""
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        scores, idx, weights = self.router(x)
        counts_list = None
        if self.balanced_routing:
            copies = idx.numel()
            idx = torch.arange(copies, device=x.device).remainder(self.n_experts).view(idx.shape)
            counts_list = balanced_counts(copies, self.n_experts)
            counts = torch.tensor(counts_list, device=x.device)
        flat = idx.reshape(-1)
        if counts_list is None:
            counts = torch.bincount(flat, minlength=self.n_experts)
        keep = None if in_document is None else in_document.reshape(-1)
        stat_counts = counts if keep is None else self.router_counts(idx, keep)
        aux = self.load_balance_loss(scores, stat_counts, keep)
        order = torch.argsort(flat, stable=True)  # token copies grouped by expert, token order inside
        token = order // self.top_k
        xs = x[token]
        ys = (self.experts(xs, counts, counts_list) if self.dispatcher is None
              else self.dispatcher(xs, counts, self.experts, counts_list))
        ys = ys * weights.reshape(-1)[order].unsqueeze(-1).to(ys.dtype)
        out = torch.zeros(x.shape[0], ys.shape[-1], dtype=ys.dtype, device=ys.device).index_add(0, token, ys)
        out = out.to(x.dtype)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        if not in_backward():  # a checkpoint recompute computes the same, but must not count it again
            self.aux_loss = aux
            self.last_counts = stat_counts.detach()
            if self.router.has_bias and self.training and torch.is_grad_enabled():
                self.expert_load = self.last_counts if self.expert_load is None else self.expert_load + stat_counts
        return out.view(shape)

    def forget_forward(self) -> None:
        """Drop what a forward whose backward never runs left behind (a pipeline's metadata inference): its stored
        routing decisions and the load it added to the balancing count."""
        self.router.forget_routing()
        self.expert_load = None

    def balance_load(self) -> torch.Tensor | None:
        """Token copies per expert (E,) routed by this rank's training forwards since the last `update_balance`,
        or None when the router's bias is not updated (auxiliary-loss-free balancing off)."""
        if not (self.router.has_bias and self.router.bias_update_rate > 0):
            return None
        if self.expert_load is None:
            return torch.zeros(self.n_experts, dtype=torch.long, device=self.router.expert_bias.device)
        return self.expert_load

    def update_balance(self, global_load: torch.Tensor) -> None:
        """Move the router's bias from the load of the global batch (`balance_load` summed over the ranks that
        saw different tokens) and start counting the next step's."""
        self.router.update_bias(global_load)
        self.expert_load = None


def take_aux_loss(feed_forward: nn.Module, aux: torch.Tensor | None) -> torch.Tensor | None:
    """`aux` plus the load-balancing loss an MoE block's feed-forward left on itself (then cleared; see the module
    docstring: collected right after each block); a dense feed-forward adds nothing."""
    own = getattr(feed_forward, "aux_loss", None)
    if own is None:
        return aux
    feed_forward.aux_loss = None
    return own if aux is None else aux + own


def with_aux_loss(model: Llama, out, aux: torch.Tensor | None):
    """A mixture-of-experts model's forward result: (logits, aux_loss) in training with an auxiliary loss, else the
    logits alone."""
    if model.training and aux is not None and model.args.aux_loss_coeff > 0:
        return out, aux
    return out


class MoETransformer(Llama):
    """Llama with an `MoE` feed-forward in every block (models/shapes.py `block`); forward returns
    (logits, aux_loss) in training."""

    def moe_layers(self) -> list[MoE]:
        """The MoE modules, in layer order (expert parallelism applies to these)."""
        return [m for m in self.modules() if isinstance(m, MoE)]

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None,
                document_ids: torch.Tensor | None = None, cache: KVCache | None = None):
        """As `Llama.forward`; packed sequences (`document_ids`, padding -1: in no document) also keep padding out
        of the router statistics and the aux loss."""
        if positions is None:
            positions = torch.arange(tokens.shape[1], device=tokens.device)
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        cos, sin = rope_cos_sin(positions, self.args)
        mask = cache_mask(cache, tokens, document_ids)
        in_document = None if document_ids is None else document_ids >= 0
        aux = None
        for i, block in enumerate(self.layers.values()):
            h = block_forward(block, h, cos, sin, mask, cache, i, in_document)
            aux = take_aux_loss(block.feed_forward, aux)
        if self.norm is not None:
            h = self.norm(h)
        return with_aux_loss(self, self.head(h), aux)

    # ------------------------------------------------------------ declared plans
    def tp_plan(self, sequence_parallel: bool = False) -> dict[str, str]:
        """Attention and shared experts split as in Llama; router and routed experts stay whole (EP splits those)."""
        return shapes.tp_plan(self.args, sequence_parallel)  # declared in models/shapes.py, which the planner reads

    def init_spec(self, name: str) -> InitSpec:
        if name.endswith("experts.w2"):  # stacked routed experts' down projection: a residual projection
            return InitSpec("normal", self.args.init_std / math.sqrt(2 * self.args.n_layers))
        return super().init_spec(name)

    def active_ffn_params_per_layer(self) -> int:
        """Routed experts a token visits (top_k) + shared experts (hidden moe_ffn_dim * n_shared) + router."""
        return shapes.active_ffn_params_per_layer(self.args)

    def adapter_layout(self) -> AdapterLayout:
        """Attention projections as Llama's; the routed experts as grouped roles (per-expert adapters); shared
        experts (if any) as linears; the router is not adapted (declared in models/shapes.py)."""
        return shapes.adapter_layout(self.args)

    def state_dict_adapter(self) -> StateDictAdapter:
        """Per `model.family` (mixtral, qwen3_moe): stacked experts <-> HF per-expert tensors (models/hf_moe.py)."""
        return dense_adapter(self.args)


def decoder_class(args: ModelArgs) -> type[Llama]:
    """What the built-in families build (models/family.py `Family.model`): Llama, or with experts MoETransformer."""
    return MoETransformer if args.is_moe else Llama
