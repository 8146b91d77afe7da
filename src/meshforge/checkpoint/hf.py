"""Hugging Face Llama safetensors: export a meshforge checkpoint, import HF weights into a meshforge model.

Names follow `Llama.hf_name_map()`. meshforge's RoPE rotates interleaved pairs (Meta's layout) while HF
Llama rotates halves (`rotate_half`), so the rows of wq/wk are permuted within each head on export and
back on import, exactly as HF's `convert_llama_weights_to_hf.py` does:
`permute(w, n_heads) = w.view(n_heads, hd/2, 2, dim).transpose(1, 2).reshape(n_heads*hd, dim)`.

Export streams: planned from the DCP metadata alone, it loads one output shard's tensors at a time
(`consolidated_shard_mb`, a single tensor larger than that gets a shard of its own), so the whole model
is never in memory at once; above one shard it writes `model-0000i-of-0000n.safetensors` and
`model.safetensors.index.json`, else `model.safetensors`; plus `config.json` (LlamaForCausalLM).
Import reads tensor by tensor with `safetensors.safe_open` (no pickle).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from meshforge.checkpoint.errors import CheckpointError

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


# ------------------------------------------------------------------------ names, layout
def _name_maps(n_layers: int, tie: bool) -> dict[str, str]:
    from meshforge.models.llama import Llama

    out = {}
    for ours, theirs in Llama.hf_name_map().items():
        if "{}" in ours:
            for i in range(n_layers):
                out[ours.format(i)] = theirs.format(i)
        else:
            out[ours] = theirs
    if tie:
        out.pop("output.weight")
    return out


def permute_to_hf(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Interleaved-pair rows (Meta) -> rotate_half rows (HF), per head."""
    rows, cols = w.shape
    return w.view(n_heads, rows // n_heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def permute_from_hf(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Inverse of `permute_to_hf`."""
    rows, cols = w.shape
    return w.view(n_heads, 2, rows // n_heads // 2, cols).transpose(1, 2).reshape(rows, cols)


def _heads_for(name: str, args: dict) -> int | None:
    if name.endswith("attention.wq.weight"):
        return args["n_heads"]
    if name.endswith("attention.wk.weight"):
        return args["n_kv_heads"]
    return None


def hf_config(args: dict, dtype: torch.dtype = torch.float32) -> dict:
    hd = args.get("head_dim") or args["dim"] // args["n_heads"]
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": args["vocab_size"],
            "hidden_size": args["dim"], "intermediate_size": args["ffn_dim"], "num_hidden_layers": args["n_layers"],
            "num_attention_heads": args["n_heads"], "num_key_value_heads": args["n_kv_heads"], "head_dim": hd,
            "max_position_embeddings": args["max_seq_len"], "rope_theta": args["rope_theta"],
            "rms_norm_eps": args["norm_eps"], "tie_word_embeddings": bool(args["tie_embeddings"]),
            "hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "initializer_range": args["init_std"],
            "torch_dtype": _DTYPE_NAMES.get(dtype, "float32")}


def model_overrides_from_hf_config(c: dict) -> dict:
    """HF config.json -> meshforge `model.*` values (on top of any preset)."""
    if c.get("model_type", "llama") != "llama":
        raise CheckpointError(f"config.json: model_type={c.get('model_type')!r} is not supported (llama only)")
    out = {"vocab_size": c["vocab_size"], "dim": c["hidden_size"], "ffn_dim": c["intermediate_size"],
           "n_layers": c["num_hidden_layers"], "n_heads": c["num_attention_heads"],
           "n_kv_heads": c.get("num_key_value_heads", c["num_attention_heads"]),
           "max_seq_len": c.get("max_position_embeddings", 2048), "rope_theta": float(c.get("rope_theta", 10000.0)),
           "norm_eps": float(c.get("rms_norm_eps", 1e-5)), "tie_embeddings": bool(c.get("tie_word_embeddings"))}
    hd = c.get("head_dim")
    if hd and hd != c["hidden_size"] // c["num_attention_heads"]:
        out["head_dim"] = hd
    return out


# --------------------------------------------------------------------------------- export
def export_checkpoint(ckpt_dir: str | Path, out_dir: str | Path, shard_mb: int = 2048) -> dict:
    """Write a meshforge DCP checkpoint's model as HF safetensors + config.json; returns a summary."""
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file

    from meshforge.checkpoint.manager import MANIFEST, dcp_tensor_shapes

    ckpt_dir, out_dir = Path(ckpt_dir), Path(out_dir)
    manifest = json.loads((ckpt_dir / MANIFEST).read_text())
    args = manifest["model_args"]
    if args.get("n_experts"):
        raise CheckpointError(f"{ckpt_dir}: export of mixture-of-experts models is not supported (dense Llama only)")
    shapes = dcp_tensor_shapes(ckpt_dir)
    names = _name_maps(args["n_layers"], args["tie_embeddings"])
    missing = [k for k in names if f"model.{k}" not in shapes]
    if missing:
        raise CheckpointError(f"{ckpt_dir}: parameter {missing[0]} is missing from the checkpoint")
    # plan shards in HF name order, from the metadata alone
    limit = shard_mb * 2**20
    shards: list[list[str]] = [[]]
    size = 0
    total = 0
    for ours in names:
        shape, dtype = shapes[f"model.{ours}"]
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        total += nbytes
        if shards[-1] and size + nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append(ours)
        size += nbytes
    tmp = out_dir.with_name(out_dir.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    n = len(shards)
    weight_map = {}
    for i, group in enumerate(shards):
        fname = "model.safetensors" if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        state = {f"model.{k}": torch.empty(shapes[f"model.{k}"][0], dtype=shapes[f"model.{k}"][1]) for k in group}
        dcp.load(state, checkpoint_id=str(ckpt_dir), no_dist=True)
        out = {}
        for k in group:
            t = state.pop(f"model.{k}")
            heads = _heads_for(k, args)
            out[names[k]] = (permute_to_hf(t, heads) if heads else t).contiguous()
            weight_map[names[k]] = fname
        save_file(out, str(tmp / fname), metadata={"format": "pt"})
        del out
    dtype = shapes[f"model.{next(iter(names))}"][1]
    (tmp / "config.json").write_text(json.dumps(hf_config(args, dtype), indent=2))
    if n > 1:
        (tmp / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": total, "meshforge_step": manifest["step"]}, "weight_map": weight_map},
            indent=2))
    if out_dir.exists():
        shutil.rmtree(out_dir)
    tmp.rename(out_dir)
    return {"files": n, "tensors": len(names), "bytes": total, "dir": str(out_dir)}


# --------------------------------------------------------------------------------- import
def _hf_tensor_files(hf_dir: Path) -> dict[str, Path]:
    """HF tensor name -> the safetensors file holding it."""
    index = hf_dir / "model.safetensors.index.json"
    if index.is_file():
        wm = json.loads(index.read_text())["weight_map"]
        return {k: hf_dir / v for k, v in wm.items()}
    single = hf_dir / "model.safetensors"
    files = [single] if single.is_file() else sorted(hf_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{hf_dir}: no model.safetensors or model.safetensors.index.json")
    from safetensors import safe_open

    out = {}
    for f in files:
        with safe_open(str(f), framework="pt") as sf:
            out.update({k: f for k in sf.keys()})  # noqa: SIM118
    return out


@torch.no_grad()
def load_hf_into(model, hf_dir: str | Path) -> None:
    """Copy HF Llama safetensors into a meshforge Llama (plain or with DTensor parameters), tensor by tensor."""
    from safetensors import safe_open
    from torch.distributed.tensor import DTensor, distribute_tensor

    hf_dir = Path(hf_dir)
    if not hf_dir.is_dir():
        raise CheckpointError(f"model.init_from: {hf_dir} is not a directory")
    a = model.args
    args = {"n_heads": a.n_heads, "n_kv_heads": a.n_kv_heads}
    files = _hf_tensor_files(hf_dir)
    names = _name_maps(a.n_layers, a.tie_embeddings)
    params = dict(model.named_parameters(remove_duplicate=False))
    uncovered = [n for n in params if n not in names and not (a.tie_embeddings and n == "output.weight")]
    if uncovered:
        raise CheckpointError(f"{hf_dir}: parameter {uncovered[0]} has no Hugging Face Llama name "
                              "(import supports dense Llama models only)")
    handles: dict[Path, object] = {}
    for ours, theirs in names.items():
        if ours not in params:
            continue  # a pipeline stage holds only some of the model
        if theirs not in files:
            raise CheckpointError(f"{hf_dir}: tensor {theirs} (for {ours}) is missing")
        f = files[theirs]
        if f not in handles:
            handles[f] = safe_open(str(f), framework="pt")
        t = handles[f].get_tensor(theirs)
        p = params[ours]
        if tuple(t.shape) != tuple(p.shape):
            raise CheckpointError(f"{files[theirs]}: {theirs} has shape {tuple(t.shape)} but parameter {ours} "
                                  f"of this model has shape {tuple(p.shape)}")
        heads = _heads_for(ours, args)
        if heads:
            t = permute_from_hf(t, heads)
        if isinstance(p, DTensor):
            local = distribute_tensor(t.to(p.dtype), p.device_mesh, p.placements, src_data_rank=None)
            p.to_local().copy_(local.to_local())
        else:
            p.copy_(t.to(device=p.device, dtype=p.dtype))


def save_weights_only(model, out_dir: str | Path, source: str = "") -> Path:
    """A weights-only meshforge checkpoint `<out>/step_0` (+ LATEST) of a plain model, with its manifest."""
    import dataclasses
    import datetime

    import torch.distributed.checkpoint as dcp

    from meshforge.checkpoint.manager import FORMAT_VERSION, MANIFEST, _write_atomic, file_entry

    out_dir = Path(out_dir)
    final, partial = out_dir / "step_0", out_dir / "step_0.partial"
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(partial), no_dist=True)
    files = {p.name: file_entry(p) for p in sorted(partial.iterdir()) if p.is_file()}
    manifest = {"format_version": FORMAT_VERSION, "step": 0, "contents": ["model"], "ckpt_format": "torch_dist",
                "strategy": "import", "world_size": 1, "layout": {}, "config_digest": "",
                "model_args": dataclasses.asdict(model.args), "imported_from": source,
                "torch_version": torch.__version__,
                "created_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"), "files": files}
    _write_atomic(partial / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True))
    if final.exists():
        shutil.rmtree(final)
    partial.rename(final)
    _write_atomic(out_dir / "LATEST", "step_0\n")
    return final


def import_hf(hf_dir: str | Path, out_dir: str | Path) -> dict:
    """HF dir -> a weights-only meshforge checkpoint `<out>/step_0` (+ LATEST) and the model.* values it needs."""
    from meshforge.models.llama import Llama
    from meshforge.models.presets import ModelArgs

    hf_dir = Path(hf_dir)
    cfg_file = hf_dir / "config.json"
    if not cfg_file.is_file():
        raise CheckpointError(f"{cfg_file}: missing")
    overrides = model_overrides_from_hf_config(json.loads(cfg_file.read_text()))
    model = Llama(ModelArgs(**overrides).validate())
    load_hf_into(model, hf_dir)
    final = save_weights_only(model, out_dir, str(hf_dir))
    return {"dir": str(final), "model_overrides": overrides}
