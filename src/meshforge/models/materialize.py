"""nn.Modules built from their torch-free descriptions (models/shapes.py), so a model's structure is written once.

A model class's `__init__` calls `build_children(self, shapes.<its function>(...))`: the module gets the children
and parameters the description lists, in the description's order (the parameter order optimizer state,
checkpoints and the planner see), and weights the description shares (a tied output head) become one Parameter.
A child is built from its description's `kind` and `init` (the constructor arguments): torch's own modules here,
meshforge's by the class registered under its name with `@buildable` (a family with its own blocks registers
them in its own module). tests/unit/test_model_shapes.py checks the result equals the description.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from meshforge.models.shapes import ModuleShape

# kind -> constructor(*init, **factory); `factory` (device, dtype) reaches the classes that take it (an adapter
# created next to an existing weight)
_CLASSES: dict[str, Callable[..., nn.Module]] = {
    "Linear": lambda n_in, n_out, bias, **factory: nn.Linear(n_in, n_out, bias=bias, **factory),
    "Embedding": lambda n, dim, padding_idx, **factory: nn.Embedding(n, dim, padding_idx=padding_idx, **factory),
    "Dropout": lambda p, **factory: nn.Dropout(p),
    "Identity": lambda **factory: nn.Identity(),
}


def buildable(cls: type[nn.Module]) -> type[nn.Module]:
    """Register a module class as the builder of descriptions of kind `cls.__name__` (called with their `init`)."""
    _CLASSES[cls.__name__] = cls
    return cls


def build(spec: ModuleShape, **factory) -> nn.Module:
    """The module `spec` describes."""
    if spec.kind == "ModuleDict":
        return nn.ModuleDict({k: build(c, **factory) for k, c in spec.children.items()})
    if spec.kind not in _CLASSES:
        raise KeyError(f"no module class is registered for kind {spec.kind!r} (models/materialize.py `buildable`)")
    return _CLASSES[spec.kind](*spec.init, **factory)


def build_children(module: nn.Module, spec: ModuleShape, **factory) -> None:
    """Give `module` the parameters (uninitialised) and children `spec` lists, tying the weights it shares."""
    for name, p in spec.params.items():
        module.register_parameter(name, nn.Parameter(torch.empty(p.shape, **factory)))
    for name, child in spec.children.items():
        setattr(module, name, None if child is None else build(child, **factory))  # None: a plain attribute
    first: dict[int, str] = {}
    for name, p in spec.named_parameters(remove_duplicate=False):
        if id(p) not in first:
            first[id(p)] = name
            continue
        owner, _, attr = name.rpartition(".")
        setattr(module.get_submodule(owner), attr, module.get_parameter(first[id(p)]))
