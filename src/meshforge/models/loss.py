"""The language-model loss of a model's output: token cross-entropy, plus the auxiliary loss an MoE returns."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def lm_loss(output, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(cross-entropy mean over tokens, auxiliary loss or None); models may return (logits, aux_loss).

    Under a vocabulary-parallel output head the logits are a vocabulary-sharded DTensor and the caller runs this
    inside the parallelisation's loss context; the replicated result comes back as a plain tensor.
    """
    aux = None
    if isinstance(output, tuple):
        output, aux = output
    ce = F.cross_entropy(output.flatten(0, 1).float(), labels.flatten())
    if hasattr(ce, "full_tensor"):  # a replicated DTensor (vocabulary-parallel loss) -> plain tensor
        ce = ce.full_tensor()
    return ce, aux
