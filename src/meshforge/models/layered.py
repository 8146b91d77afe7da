"""The decoder of families whose layers differ in their attention rule (Gemma 3, GPT-OSS): `LayeredDecoder`.

It is Llama's forward with what those families add: each block brings its own rotary table (`block.rope`, from
models/layer_types.py; the tables of one forward are computed once per distinct table), a sliding window in its
attention slot, an embedding scale and a final logit soft-cap where the family has them, the auxiliary loss of
MoE blocks collected as `MoETransformer` does, and generation's KV cache (`cache=`, as Llama). Packed sequences
(document ids) mask every layer and keep padding out of MoE blocks' router statistics; the window is applied on
top of the document (or cache) mask by each layer's attention (models/attention.py).
"""

from __future__ import annotations

import torch

from meshforge.models import rope
from meshforge.models.kv_cache import KVCache
from meshforge.models.llama import Llama, block_forward, cache_mask
from meshforge.models.materialize import build_children
from meshforge.models.moe import MoE


class LayeredDecoder(Llama):
    """Llama whose blocks carry their own rotary table (`block.rope`) and attention rule; subclasses give the
    description (`description`) and may scale the embedding (`embed_scale`) or soft-cap the logits
    (`logit_softcap`). In training, an MoE decoder returns (logits, aux loss) like `MoETransformer`."""

    applies_windows = True  # each local layer's attention applies its sliding window (Llama's forward does not)
    embed_scale: float | None = None
    logit_softcap: float | None = None

    def __init__(self, args):
        torch.nn.Module.__init__(self)
        self.args = args
        build_children(self, self.description(args))

    @staticmethod
    def description(args):
        raise NotImplementedError

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None,
                document_ids: torch.Tensor | None = None, cache: KVCache | None = None):
        if positions is None:
            positions = torch.arange(tokens.shape[1], device=tokens.device)
        h = tokens
        if self.tok_embeddings is not None:
            h = self.tok_embeddings(tokens)
            if self.embed_scale is not None:  # rounded to fp32, then to the embedding's dtype, as transformers does
                h = h * torch.tensor(self.embed_scale, dtype=torch.float32, device=h.device).to(h.dtype)
        mask = cache_mask(cache, tokens, document_ids)
        in_document = None if document_ids is None else document_ids >= 0  # padding: out of router statistics
        tables: dict = {}
        aux = None
        for i, block in enumerate(self.layers.values()):
            if block.rope not in tables:
                tables[block.rope] = rope.tables(positions, self.args.hd, block.rope)
            cos, sin = tables[block.rope]
            h = block_forward(block, h, cos, sin, mask, cache, i,
                              in_document if isinstance(block.feed_forward, MoE) else None)
            ff_aux = getattr(block.feed_forward, "aux_loss", None)
            if ff_aux is not None:
                aux = ff_aux if aux is None else aux + ff_aux
                block.feed_forward.aux_loss = None
        if self.norm is not None:
            h = self.norm(h)
        out = self.head(h)
        if self.logit_softcap is not None and self.output is not None:
            out = torch.tanh(out / self.logit_softcap) * self.logit_softcap
        if self.training and aux is not None and self.args.aux_loss_coeff > 0:
            return out, aux
        return out

    def set_fused_loss(self, enabled: bool) -> bool:
        """The fused loss projects the head's input chunk by chunk: it has no soft-cap, so a capped model keeps
        returning logits."""
        if self.logit_softcap is not None:
            self.fused_loss = False
            return not enabled
        return super().set_fused_loss(enabled)
