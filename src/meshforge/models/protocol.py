"""The model contract: what every model offers the rest of meshforge, so nothing outside `models/` names a
model's modules.

A model *declares* what can be parallelised and how its weights map to Hugging Face; the packages above
apply those declarations (`distributed/` shards, `checkpoint/` converts, `training/` counts FLOPs). Module
names in a declaration are dotted paths of `named_modules()` (patterns: `*` matches one path component).

- `blocks()`: the repeated units in forward order. FSDP wraps each, activation checkpointing recomputes
  each, regional compilation compiles each.
- `tp_plan(sequence_parallel)`: module-name pattern -> tensor-parallel style (`colwise`, `rowwise`, `rowwise_full`,
  `sequence_parallel`, `sequence_gather`, `sequence_gather_scatter`, `vocab_embedding`, `vocab_output`), applied by
  `distributed/tensor_parallel.py` and checked without processes by `planning/tp_plan.py`.
- `pipeline_layout()`: the blocks as split points, plus the modules only the first stage holds (input
  embedding) and only the last stage holds (final norm, output head). A stage is the model with the other
  stages' blocks deleted and those first/last modules set to None; forward then runs the blocks present,
  takes hidden states when there is no embedding and returns hidden states when there is no head.
- `attention_slots()`: names of the attention-op modules: `forward(q, k, v)` on (batch, heads, seq,
  head_dim), causal. Context parallelism replaces each with a drop-in of the same signature.
- `moe_layers()`: the mixture-of-experts layers (empty for a dense model); expert parallelism shards their
  `experts` and sets their `dispatcher`; `balance_load()` (None: no auxiliary-loss-free balancing) gives the
  loads the step boundary sums to update their router's selection bias.
- `init_spec(name)`: how parameter `name` starts (`InitSpec`); with the seed it fixes the initial value,
  so any sharding or pipeline split initialises exactly like one process (`models.param_init_tensor`).
- `flops_per_token(seq_len)`: training FLOPs per token, for TFLOP/s and MFU.
- `state_dict_adapter()`: Hugging Face names, tensor permutations and config.json, both directions.
- `adapter_layout()`: what parameter-efficient fine-tuning (`models/lora.py`) may adapt: the linear layers by
  role (role -> module-name pattern; roles are the Hugging Face module names, `q_proj`, ..., as PEFT's
  `target_modules` spells them) and the embedding and norm modules its freeze policy covers; None when the
  model declares none (LoRA is then refused).
- `set_fused_loss(enabled)`: with it on, forward in training mode returns `models.loss.HeadInput` (final hidden
  states and the output head's weight) instead of logits, so the loss projects chunk by chunk and never holds
  the full logits (eval mode returns logits); returns whether the model can (False: it keeps returning logits).

A built-in model's forward also takes `cache=` (models/kv_cache.py), for generation: the keys and values of the
tokens before these, and which positions are padding (tensor parallelism keeps working: each rank caches its heads).

A model meshforge did not define (bring your own `nn.Module`) gets `ForeignModel`: blocks by class name
(`distributed.block_classes`) or the largest ModuleList/ModuleDict, and nothing else (tensor parallelism
then needs `distributed.tp_plan`; pipeline and context parallelism and HF interop are refused). A transformers
causal LM (`model.hf_model`) is wrapped by `models/hf_auto.py`'s `HFCausalLM`, which declares the contract from
the transformers class itself: blocks from `_no_split_modules`, the TP plan from `_tp_plan`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple, Protocol, runtime_checkable

if TYPE_CHECKING:  # importable without torch, so config can read model presets without loading it
    import torch
    from torch import nn


class InitSpec(NamedTuple):
    """("normal", std), ("ones", 0.0), ("zeros", 0.0), or ("computed", compute=fn): `fn(seed)` returns the full
    initial value (a model whose initialisation is its own code, e.g. transformers' `_init_weights`)."""

    kind: str
    std: float = 0.0
    compute: Callable[[int], torch.Tensor] | None = None


@dataclass(frozen=True)
class PipelineLayout:
    split_points: tuple[str, ...]  # block module names, in forward order
    first_stage: tuple[str, ...]  # modules only the first stage holds (e.g. the input embedding)
    last_stage: tuple[str, ...]  # modules only the last stage holds (e.g. final norm and output head)


class StateDictAdapter(Protocol):
    """A model's Hugging Face mapping, tensor by tensor (so export and import stream)."""

    def hf_names(self, name: str) -> list[str]:
        """The HF tensors that make up meshforge tensor `name` ([] when it is not saved, e.g. a tied head);
        KeyError for a name the model does not have."""

    def to_hf(self, name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        """meshforge tensor -> its HF tensors (names as `hf_names(name)`)."""

    def from_hf(self, name: str, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        """The HF tensors of `hf_names(name)` -> the meshforge tensor."""

    def hf_config(self, dtype: torch.dtype) -> dict:
        """config.json for this model's arguments."""


@dataclass(frozen=True)
class AdapterLayout:
    linears: dict[str, str]  # role -> module-name pattern of the nn.Linear layers LoRA may adapt
    embeddings: tuple[str, ...]  # module-name patterns: input embedding and output head
    norms: tuple[str, ...]  # module-name patterns: the normalisation layers
    # role -> module-name pattern of grouped-expert modules (stacked per-expert weights) that take per-expert
    # adapters: such a module has `add_lora(role, rank, alpha)`, `lora(role)`, `lora_roles` and `merge_lora()`;
    # roles are the Hugging Face (transformers 5) expert parameter names, e.g. `experts.gate_up_proj`, in the
    # order the HF experts module registers them (PEFT nests its `target_parameters` wrappers in that order)
    experts: dict[str, str] = field(default_factory=dict)


@runtime_checkable
class ModelContract(Protocol):
    def blocks(self) -> list[nn.Module]: ...

    def tp_plan(self, sequence_parallel: bool = False) -> dict[str, str] | None: ...

    def pipeline_layout(self) -> PipelineLayout | None: ...

    def attention_slots(self) -> list[str]: ...

    def moe_layers(self) -> list[nn.Module]: ...

    def init_spec(self, name: str) -> InitSpec: ...

    def flops_per_token(self, seq_len: int) -> float: ...

    def state_dict_adapter(self) -> StateDictAdapter: ...

    def adapter_layout(self) -> AdapterLayout | None: ...

    def set_fused_loss(self, enabled: bool) -> bool: ...


class Undeclared:
    """The contract's optional declarations, all absent: no tensor-parallel plan, no pipeline split, no attention
    slots (no context parallelism), no MoE layers, no LoRA layout, and forward returns logits (no fused loss).
    A model that declares some of them overrides those."""

    def tp_plan(self, sequence_parallel: bool = False) -> dict[str, str] | None:
        return None

    def pipeline_layout(self) -> None:
        return None

    def attention_slots(self) -> list[str]:
        return []

    def moe_layers(self) -> list[nn.Module]:
        return []

    def adapter_layout(self) -> None:
        return None

    def set_fused_loss(self, enabled: bool) -> bool:
        return not enabled  # its forward returns logits: it cannot hand the loss its head's input


class ForeignModel(Undeclared):
    """The contract of an `nn.Module` meshforge did not define: blocks found, nothing else declared."""

    def __init__(self, model: nn.Module):
        self.model = model

    def blocks(self) -> list[nn.Module]:
        from torch import nn  # a model exists, so torch is loaded

        containers = [m for m in self.model.modules() if isinstance(m, (nn.ModuleList, nn.ModuleDict)) and len(m)]
        if not containers:
            return []
        largest = max(containers, key=lambda c: sum(p.numel() for p in c.parameters()))
        return list(largest.values()) if isinstance(largest, nn.ModuleDict) else list(largest)

    def init_spec(self, name: str) -> InitSpec:
        raise ValueError(f"{type(self.model).__name__} declares no initialisation: initialise it yourself")

    def flops_per_token(self, seq_len: int) -> float:
        return 0.0  # unknown: throughput is reported in tokens/s only

    def state_dict_adapter(self) -> StateDictAdapter:
        raise ValueError(f"{type(self.model).__name__} has no Hugging Face state-dict adapter")


def contract_of(model: nn.Module) -> ModelContract:
    """The model itself when it implements the contract, else its `ForeignModel` view."""
    return model if isinstance(model, ModelContract) else ForeignModel(model)


def blocks_of(model: nn.Module, block_classes: list[str] | None = None) -> list[nn.Module]:
    """The model's blocks: those of the classes named (`distributed.block_classes`), else declared or found."""
    if block_classes:
        found = [m for m in model.modules() if type(m).__name__ in set(block_classes)]
        if not found:
            names = sorted({type(m).__name__ for m in model.modules()})
            raise ValueError(f"distributed.block_classes={block_classes} matches no module; the model has "
                             f"{', '.join(names[:20])}")
        return found
    return list(contract_of(model).blocks())


def set_submodule(root: nn.Module, name: str, module: nn.Module | None) -> None:
    """Replace (or with None, empty) the submodule at dotted path `name`."""
    parent, _, child = name.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, child, module)


def submodule_or_none(root: nn.Module, name: str) -> nn.Module | None:
    """The submodule at dotted path `name`, or None where it is absent (e.g. set to None on a pipeline stage)."""
    try:
        return root.get_submodule(name)
    except AttributeError:
        return None
