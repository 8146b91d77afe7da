"""Which modules are a model's blocks: declared, named by class, or the largest ModuleList/ModuleDict."""

from __future__ import annotations

from torch import nn


def find_blocks(model: nn.Module, block_classes: list[str] | None = None) -> list[nn.Module]:
    if block_classes:
        found = [m for m in model.modules() if type(m).__name__ in set(block_classes)]
        if not found:
            names = sorted({type(m).__name__ for m in model.modules()})
            raise ValueError(f"distributed.block_classes={block_classes} matches no module; the model has "
                             f"{', '.join(names[:20])}")
        return found
    if hasattr(model, "blocks") and callable(model.blocks):
        return list(model.blocks())
    containers = [m for m in model.modules() if isinstance(m, (nn.ModuleList, nn.ModuleDict)) and len(m) > 0]
    if not containers:
        return []
    largest = max(containers, key=lambda c: sum(p.numel() for p in c.parameters()))
    return list(largest.values()) if isinstance(largest, nn.ModuleDict) else list(largest)
