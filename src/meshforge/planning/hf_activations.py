"""What a model.hf_model's forward keeps for backward, measured: the Llama-block formula of `activations.py` does
not describe an arbitrary transformers architecture (it was 15% under the scale trace's peak for transformers'
own Llama: its norms keep their fp32 input and output, its rotary tables are saved by every layer).

`saved_bytes` runs the model once on fake tensors (no values, no memory: torch's `FakeTensorMode`) at one micro
batch's shape, as one tp rank holds it (the plan's column-wise and row-wise slices of tp rank 0, as
`tp_trace.py` swaps them in), under saved-tensor hooks, and sums the storages autograd keeps (parameters
excluded), per block (the model's blocks, `models.blocks_of`: each storage to the block that first saves it) and
after the last block (the final norm and the head's input). The loss's own tensors stay the formula's (they are
meshforge's loss, not the model's). Each storage is counted once, as the memory holds it. The same forward says
which blocks keep their last row-wise projection's output (a post-norm after it): checkpointing recomputes that
reduction too (`comm.py`).
"""

from __future__ import annotations

import functools

from meshforge.planning.precision import bf16_compute


def measured_activations(formula: dict[str, int], args, cfg, layout, micro_batch: int) -> dict[str, int]:
    """`activations.activation_bytes`' answer with a model.hf_model's own tensors: without checkpointing every
    block's measured bytes; with it the blocks' inputs (the formula's) and one block's recomputation, the largest
    measured; after the blocks the measured final norm and head input beside the loss's tensors (the formula's
    fp32 log-softmax of this rank's vocabulary, int64 labels)."""
    measured = saved_bytes(cfg, layout.tp, micro_batch)
    if isinstance(measured, str):  # not measurable (`unmeasured_note` says why): the formula's
        return formula
    per_block, after, _ = measured
    tokens = micro_batch * cfg.training.seq_len // layout.cp
    out = dict(formula)
    if cfg.distributed.ac_mode is None:
        out["blocks"] = sum(per_block)
    else:
        out["recompute"] = max(per_block, default=0)
    if out["head"]:
        out["head"] = after + tokens * ((args.vocab_size // layout.tp) * 4 + 8) + 4
    out["total"] = out["blocks"] + out["embedding"] + out["head"]
    return out


def unmeasured_note(cfg) -> str | None:
    """The plan's note when a model.hf_model's activations could not be measured (None when they were)."""
    d, t = cfg.distributed, cfg.training
    try:
        measured = saved_bytes(cfg, d.tp_size, t.micro_batch_size)
    except (ValueError, OSError):  # a model that cannot be read: validation says why
        return None
    if not isinstance(measured, str):
        return None
    return (f"model.hf_model: activations are counted as for a Llama block of the same widths, not measured "
            f"({measured}); parameters, gradients and optimizer state are exact")


def saved_bytes(cfg, tp: int, micro_batch: int) -> tuple[tuple[int, ...], int, int] | str:
    """((bytes each block keeps, in block order), bytes kept after the last block, blocks that keep their last
    row-wise projection's output) for one micro batch on one rank of a model.hf_model config (fp32, or under CPU
    autocast where the run computes in bf16); or why that cannot be measured on fake tensors (a transformers MoE
    routes by values)."""
    d, t = cfg.distributed, cfg.training
    return _saved(cfg.model.model_dump_json(), tuple(d.block_classes), tuple(sorted((d.tp_plan or {}).items())),
                  tp, micro_batch, t.seq_len, bf16_compute(cfg))


@functools.lru_cache(maxsize=64)
def _saved(model_json: str, block_classes: tuple, tp_plan: tuple, tp: int, micro_batch: int, seq_len: int,
           bf16: bool) -> tuple[tuple[int, ...], int, int] | str:
    import contextlib

    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from meshforge.config.schema import ModelConfig
    from meshforge.models import blocks_of, build_model, contract_of
    from meshforge.planning.tp_plan import resolve_plan
    from meshforge.planning.tp_trace import _swapped

    model = build_model(ModelConfig.model_validate_json(model_json), device="meta")
    if contract_of(model).moe_layers():
        return "its routed experts route by values, which fake tensors do not have"
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    with fake:
        model.to_empty(device="cpu")
    styles = resolve_plan(model, False, dict(tp_plan) or None)[0] if tp > 1 else {}
    blocks = blocks_of(model, list(block_classes) or None)
    where: list = ["before"]  # the block running, else "before" the first one or "after" the last one
    kept: dict[int, tuple] = {}  # storage -> (where, bytes)
    alive: list = []  # the storages counted, kept so their ids are not reused

    def pack(x):
        storage = x.untyped_storage()
        key = storage._cdata
        if key not in params and key not in kept:
            kept[key] = (where[-1], storage.nbytes())
            alive.append(storage)
        return x

    last_row: dict[int, int] = {}  # block -> the storage of its last row-wise projection's output

    def row_output(_module, _args, out) -> None:
        if isinstance(where[-1], int) and isinstance(out, torch.Tensor):
            last_row[where[-1]] = out.untyped_storage()._cdata

    handles = [mod.register_forward_hook(row_output) for name, mod in model.named_modules()
               if styles.get(name, "").startswith("rowwise")]
    for i, block in enumerate(blocks):
        handles.append(block.register_forward_pre_hook(lambda m, a, i=i: where.append(i)))
        handles.append(block.register_forward_hook(lambda m, a, o: _left(where)))
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
    try:
        with _swapped(dict(model.named_modules()), styles, tp) if styles else contextlib.nullcontext():
            params = {p.untyped_storage()._cdata for p in model.parameters()}
            with fake, torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x), autocast:
                model.train()
                model(torch.zeros(micro_batch, seq_len, dtype=torch.long))
    except Exception as err:  # noqa: BLE001 - an op fake tensors cannot run (a value-dependent shape): said, not fatal
        return f"its forward does not run on fake tensors: {type(err).__name__}"
    finally:
        for h in handles:
            h.remove()
    per_block = [0] * len(blocks)
    after = 0
    for block, n in kept.values():
        if block == "after":
            after += n
        elif block != "before":  # (before: the embedding's token ids, the formula's)
            per_block[block] += n
    # a block that keeps its last row-wise output for backward (a post-norm after it: Gemma 3) recomputes that
    # reduction under checkpointing too
    kept_last = sum(1 for block, key in last_row.items() if kept.get(key, (None,))[0] == block)
    return tuple(per_block), after, kept_last


def recomputed_last_reductions(cfg, tp: int, micro_batch: int) -> int:
    """Blocks whose checkpointed recomputation runs their last row-wise reduction again (it keeps that output for
    backward), 0 where not measured."""
    measured = saved_bytes(cfg, tp, micro_batch)
    return 0 if isinstance(measured, str) else measured[2]


def _left(where: list) -> None:
    """A block's forward ended: what runs next is in the block around it, else after the blocks."""
    where.pop()
    if len(where) == 1:
        where[0] = "after"
