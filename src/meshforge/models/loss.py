"""The language-model loss of a model's output: token cross-entropy, plus the auxiliary loss an MoE returns.

Labels equal to `IGNORE_INDEX` carry no loss (prompt tokens, padding, document ends). The loss comes back as a
sum over label tokens and their count, so the caller can normalise by the count of the whole global batch
(across micro batches and ranks), which stays exact when micro batches hold different numbers of label tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100  # the Hugging Face / torch convention for "no loss on this position"


@dataclass
class LossParts:
    ce_sum: torch.Tensor  # fp32 sum of the token cross-entropy over label tokens
    n_tokens: torch.Tensor  # how many label tokens (labels != IGNORE_INDEX)
    aux: torch.Tensor | None  # an MoE's auxiliary (load-balancing) loss, already scaled by its coefficient

    @property
    def mean(self) -> torch.Tensor:
        """The cross-entropy mean over this micro batch's label tokens."""
        return self.ce_sum / self.n_tokens


def lm_loss(output, labels: torch.Tensor) -> LossParts:
    """Cross-entropy of `output` (logits, or (logits, aux_loss) from an MoE) against `labels`.

    Under a vocabulary-parallel output head the logits are a vocabulary-sharded DTensor and the caller runs this
    inside the parallelisation's loss context; the replicated result comes back as a plain tensor.
    """
    aux = None
    if isinstance(output, tuple):
        output, aux = output
    ce = F.cross_entropy(output.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")
    if hasattr(ce, "full_tensor"):  # a replicated DTensor (vocabulary-parallel loss) -> plain tensor
        ce = ce.full_tensor()
    return LossParts(ce, (labels != IGNORE_INDEX).sum(), aux)
