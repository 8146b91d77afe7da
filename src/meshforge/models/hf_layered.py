"""config.json pieces the families with per-layer attention rules share (Gemma 3, GPT-OSS): `layer_types` and
`sliding_window` as a window and a period (models/layer_types.py), and one rotary table's parameters as transformers
writes them (`rope_parameters`, or the older `rope_theta` + `rope_scaling`; DeepSeek-V3 reads its one table here
too, YaRN through models/yarn.py). Every key is read or refused with one line naming it, as in models/hf_dense.py.
Torch-free.
"""

from __future__ import annotations

from collections.abc import Callable

from meshforge.models.family import Arg
from meshforge.models.layer_types import FULL, SLIDING, layer_kinds
from meshforge.models.yarn import read_yarn, write_yarn

# the field both layered families read (each declares this one object)
SLIDING_PATTERN = Arg("sliding_window_pattern", int | None, None, "Gemma 3, GPT-OSS: every N-th layer (N, 2N, ...) "
                      "attends to the whole context, the others within model.sliding_window (None: all of them)",
                      gt=0)

def read_layer_pattern(c: dict, n_layers: int, default_window: int | None, default_pattern: int,
                       refuse: Callable[[str], None]) -> dict:
    """`layer_types` (or, without it, transformers' default from `sliding_window_pattern`) and `sliding_window`
    -> {sliding_window, sliding_window_pattern}; refuses kinds other than sliding/full attention, a list that is
    not one period repeated (every N-th layer global), and local layers without a window."""
    window = c.pop("sliding_window", default_window)
    hint = c.pop("sliding_window_pattern", None)
    c.pop("_sliding_window_pattern", None)  # transformers' private copy of the same; layer_types decides
    types = c.pop("layer_types", None)
    if types is None:
        types = layer_kinds(n_layers, 0, hint or default_pattern)  # 0: a window, whatever its value
    if len(types) != n_layers or set(types) - {SLIDING, FULL}:
        refuse(f"layer_types={types} must list {n_layers} entries of {SLIDING!r} or {FULL!r}")
    if SLIDING not in types:
        return {"sliding_window": None, "sliding_window_pattern": None}
    if window is None:
        refuse("layer_types has sliding_attention layers but sliding_window is null: set the window")
    pattern = types.index(FULL) + 1 if FULL in types else None
    if layer_kinds(n_layers, window, pattern) != list(types):
        refuse(f"layer_types={types} is not one period repeated (every N-th layer full_attention): meshforge "
               "builds periodic layouts only")
    if hint is not None and pattern is not None and hint != pattern:
        refuse(f"sliding_window_pattern={hint} disagrees with layer_types (every {pattern}-th layer is global)")
    return {"sliding_window": window, "sliding_window_pattern": pattern}


def write_layer_pattern(a) -> dict:
    return {"sliding_window": a.sliding_window,
            "layer_types": layer_kinds(a.n_layers, a.sliding_window, a.sliding_window_pattern)}


def read_rope_table(params: dict, kinds: tuple[str, ...], refuse: Callable[[str], None], max_positions: int,
                    what: str = "rope_parameters", yarn_fields: tuple[Arg, ...] = ()) -> dict:
    """One rotary table (a flat `rope_parameters` dict) -> `model.rope_*` values; `kinds`: the rope types the
    family computes; `yarn_fields`: the YaRN fields it honours (models/yarn.py; the other yarn keys are refused)."""
    p = dict(params)
    kind = p.pop("rope_type", None) or p.pop("type", None) or "default"
    p.pop("type", None)
    if kind not in kinds:
        refuse(f"{what}: rope_type={kind!r} is not supported ({', '.join(kinds)})")
    if "rope_theta" not in p:
        refuse(f"{what}: rope_theta is missing")
    out = {"rope_theta": float(p.pop("rope_theta")), "rope_type": kind}
    if kind == "linear":
        if "factor" not in p:
            refuse(f"{what}: rope_type {kind} needs 'factor'")
        out["rope_factor"] = float(p.pop("factor"))
    if kind == "yarn":
        out.update(read_yarn(p, max_positions, lambda msg: refuse(f"{what}: {msg}"), yarn_fields))
    if p:
        refuse(f"{what}: rope parameter {sorted(p)[0]!r} is not supported for rope_type {kind}")
    return out


def write_rope_table(a) -> dict:
    """`model.rope_*` values -> one flat `rope_parameters` dict."""
    out = {"rope_theta": a.rope_theta, "rope_type": a.rope_type}
    if a.rope_type == "linear":
        out["factor"] = a.rope_factor
    if a.rope_type == "yarn":
        out.update(write_yarn(a))
    return out
