"""LoRA checkpoints and the Hugging Face PEFT format: adapter-only saves, their resume checks, export, import.

A LoRA run (`peft:` set) saves only its trainable parameters (the adapters, plus any embeddings/norms the
freeze policy trains) and their optimizer state, with the same commit protocol as a full checkpoint
(`manager.py`; the checkpoint part is `parts.AdapterWeights`). The frozen base is not saved: the manifest
records where it came from (`peft_base`: the `model.init_from` folder, else the seed it was initialised from)
with the base's `model_args` and the `peft` settings, and a resume onto another base, shape or adapter setting
is refused with one line.

PEFT format (`export_adapter`): `adapter_config.json` + `adapter_model.safetensors`, tensors named
`base_model.model.<HF module>.lora_{A,B}.weight`, the HF module taken from the model contract's state-dict
adapter (`hf_names` of the base weight). B is mapped with the base weight's own `to_hf` (a row permutation
such as Llama's q/k RoPE layout acts on the output side, i.e. on B); A is unchanged. That is exact only for
maps acting on rows, so every export checks `to_hf(B A) == to_hf(B) A` and refuses a model whose map is not.
Trained norms/embeddings (`peft.freeze` without them) are PEFT's `modules_to_save`: written under their HF
names, as PEFT saves them. `export_merged` rebuilds the base, folds the adapters in and writes full HF
safetensors + config.json.
Per-expert adapters (grouped MoE experts) are PEFT `target_parameters` on the transformers 5 experts module
(`...mlp.experts.gate_up_proj` (E, 2 x hidden, dim), `...down_proj`): PEFT's 3-D `ParamWrapper` stores A as
(E * rank, in) (expert-major rows) and B as (out, rank * E) (expert-minor columns), and nests one wrapper per
targeted parameter in the module's parameter order, the inner one's keys under `base_layer.`.
`load_peft_adapter` (`peft.init_from`) reads a PEFT folder back, every key and setting checked.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from meshforge.checkpoint.hf import _adapter, copy_param, load_hf_into, open_safetensors, write_hf_config
from meshforge.checkpoint.manifest import MANIFEST, manifest_model_args, model_args_dict, read_manifest
from meshforge.checkpoint.paths import follow_umask, write_export
from meshforge.checkpoint.safe_dcp import dcp_load, dcp_tensor_shapes
from meshforge.checkpoint.verify import changed_inputs, folder_inputs
from meshforge.errors import CheckpointError
from meshforge.models import build_model, init_weights
from meshforge.models.lora import (
    adapter_modules,
    apply_lora,
    expert_adapters,
    is_adapter_param,
    layout_of,
    merge_lora,
)

ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
_PEFT_KEYS = ("method", "rank", "alpha", "target_modules", "freeze")  # must match to resume (dropout may change)


# ------------------------------------------------------------------ adapter-only checkpoints
def trainable_names(pm) -> set[str]:
    """Names of the parameters this run trains (what an adapter checkpoint holds)."""
    return {n for part in pm.unwrapped_parts() for n, p in part.named_parameters() if p.requires_grad}


def _base_of(cfg) -> dict:
    init_from = cfg.model.init_from
    return {"init_from": str(Path(init_from).resolve()) if init_from else None,
            "seed": None if init_from else cfg.run.seed}


def adapter_manifest(cfg) -> dict:
    """The manifest entries of an adapter checkpoint: the peft settings and the base they adapt."""
    return {"peft": cfg.peft.model_dump(mode="json", include=set(_PEFT_KEYS) | {"dropout"}),
            "peft_base": _base_of(cfg)}


def refuse_adapter_checkpoint(path: Path, manifest: dict) -> None:
    """A run without `peft` cannot resume an adapter checkpoint (its frozen base is not in it): one line."""
    if "adapter" in manifest.get("contents", []):
        raise CheckpointError(f"{path}: a LoRA adapter checkpoint (peft {manifest.get('peft')}): set the same peft "
                              "section to resume it, or export it with `meshforge checkpoint export --merge`")


def check_adapter_checkpoint(path: Path, manifest: dict, cfg) -> None:
    """A LoRA run resumes adapter checkpoints of its own base and adapter settings only: else one line."""
    if "adapter" not in manifest.get("contents", []):
        raise CheckpointError(f"{path}: a full checkpoint, but peft is set and a LoRA run resumes adapter "
                              "checkpoints only: export it (`meshforge checkpoint export`) and set model.init_from")
    mine = model_args_dict(cfg)
    for k, v in manifest.get("model_args", {}).items():
        if mine.get(k) != v:
            raise CheckpointError(f"{path}: adapters trained on a base with model.{k}={v}, but this model has "
                                  f"{k}={mine.get(k)}: an adapter loads only onto the base it was trained on")
    saved = manifest.get("peft", {})
    for k in _PEFT_KEYS:
        if saved.get(k) != getattr(cfg.peft, k):
            raise CheckpointError(f"{path}: saved with peft.{k}={saved.get(k)}, this run has peft.{k}="
                                  f"{getattr(cfg.peft, k)}: set it back to resume these adapters")
    base, now = manifest.get("peft_base", {}), _base_of(cfg)
    for k in ("init_from", "seed"):
        if base.get(k) != now[k]:
            key = "model.init_from" if k == "init_from" else "run.seed (which initialised the base)"
            raise CheckpointError(f"{path}: adapters trained on the base of {key}={base.get(k)}, this run's is "
                                  f"{now[k]}: an adapter loads only onto the base it was trained on")


# ------------------------------------------------------------------ the PEFT format
def _hf_module(adapter, name: str) -> str:
    """The HF module a meshforge linear maps to (from its weight's HF name); one-to-one maps only."""
    theirs = adapter.hf_names(f"{name}.weight")
    if len(theirs) != 1 or not theirs[0].endswith(".weight"):
        raise CheckpointError(f"{name}.weight maps to Hugging Face tensors {theirs}: the PEFT format needs one "
                              "HF linear per adapted layer (use --merge)")
    return theirs[0][: -len(".weight")]


def _b_to_hf(adapter, name: str, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """B in HF's layout, after checking that the model's map acts on rows only (to_hf(B A) == to_hf(B) A)."""
    (b_hf,) = adapter.to_hf(f"{name}.weight", b).values()
    (delta_hf,) = adapter.to_hf(f"{name}.weight", b @ a).values()
    if not torch.allclose(b_hf @ a, delta_hf, rtol=1e-5, atol=1e-7):
        raise CheckpointError(f"{name}: the Hugging Face map of its weight is not a row mapping, so its LoRA "
                              "factors cannot be exported separately (use --merge)")
    return b_hf


def _hf_experts_module(adapter, model: nn.Module, module: str, role: str) -> str:
    """The HF experts module a grouped-experts module maps to (`model.layers.0.mlp.experts`), from the HF names of
    its own weights (`...experts.{e}.gate_proj.weight` per expert, or one stacked `...experts.gate_up_proj` as
    GPT-OSS stores them)."""
    own = next(n for n, _ in model.get_submodule(module).named_parameters(recurse=False))
    theirs = adapter.hf_names(f"{module}.{own}")
    hf = {n.rsplit(".", 3)[0] for n in theirs} if len(theirs) > 1 else {theirs[0].rsplit(".", 1)[0]}
    if len(hf) != 1 or not next(iter(hf)).endswith("." + role.split(".")[0]):
        raise CheckpointError(f"{module}: its Hugging Face tensors {theirs[:2]} are not one experts module, so its "
                              "per-expert adapters have no PEFT form (use --merge)")
    return hf.pop()


def _expert_keys(layout, pcfg, hf_module: str, role: str) -> str:
    """PEFT's key prefix of one targeted expert parameter: the earlier-registered ones nest under `base_layer.`."""
    targeted = [r for r in layout.experts if r in _expert_roles(layout, pcfg)]
    return f"base_model.model.{hf_module}." + "base_layer." * (len(targeted) - 1 - targeted.index(role))


def _expert_roles(layout, pcfg) -> list[str]:
    from meshforge.models.lora import resolve_roles

    return [r for r in resolve_roles(layout, list(pcfg.target_modules)) if r in layout.experts]


def _peft_model(manifest: dict, where: Path, device: str = "meta"):
    if "adapter" not in manifest.get("contents", []):
        raise CheckpointError(f"{where}: not a LoRA adapter checkpoint (no peft section in its run): export it "
                              "without --adapter/--merge")
    from meshforge.config.schema import PeftConfig

    try:
        pcfg = PeftConfig(**manifest["peft"])
    except (KeyError, TypeError, ValueError) as err:
        raise CheckpointError(f"{where / MANIFEST}: key peft is missing or not a peft section "
                              f"({str(err).splitlines()[0][:200]})") from None
    model = build_model(manifest_model_args(where, manifest), device=device)
    return model, pcfg


def _load_tensors(ckpt_dir: Path, targets: dict[str, torch.Tensor]) -> None:
    """DCP-load `model.<name>` into the given tensors (in place)."""
    shapes = dcp_tensor_shapes(ckpt_dir)
    for k, t in targets.items():
        if f"model.{k}" not in shapes or tuple(shapes[f"model.{k}"][0]) != tuple(t.shape):
            raise CheckpointError(f"{ckpt_dir}: tensor {k} {tuple(t.shape)} is not in the checkpoint as expected")
    dcp_load({f"model.{k}": t for k, t in targets.items()}, ckpt_dir, no_dist=True)


def _write_dir(out_dir: Path, files: dict[str, dict | str], hf_config: dict | None = None,
               manifest: dict | None = None) -> None:
    """Write {name: tensors dict (safetensors) | text} into `out_dir` whole (`write_export`); with `hf_config`,
    also config.json, generation_config.json and the checkpoint's tokenizer, as a plain export has them."""

    def write(tmp: Path) -> None:
        for name, content in files.items():
            if isinstance(content, str):
                (tmp / name).write_text(content)
            else:
                save_file(content, str(tmp / name), metadata={"format": "pt"})
                follow_umask(tmp / name)
        if hf_config is not None:
            write_hf_config(tmp, hf_config, manifest or {})

    write_export(out_dir, write)


def export_adapter(ckpt_dir: str | Path, out_dir: str | Path) -> dict:
    """An adapter checkpoint -> PEFT `adapter_config.json` + `adapter_model.safetensors`."""
    ckpt_dir, out_dir = Path(ckpt_dir), Path(out_dir)
    manifest = read_manifest(ckpt_dir)
    model, pcfg = _peft_model(manifest, ckpt_dir)
    adapter = _adapter(model, ckpt_dir)
    apply_lora(model, pcfg)
    if "embeddings" not in pcfg.freeze and model.args.tie_embeddings:
        raise CheckpointError(f"{ckpt_dir}: trained tied embeddings would be untied by PEFT's modules_to_save copy "
                              "of embed_tokens: use --merge")
    modules = adapter_modules(model)
    whole = [n for n, p in model.named_parameters() if p.requires_grad and not is_adapter_param(n)]
    targets = {n: torch.empty(p.shape, dtype=p.dtype) for n, p in model.named_parameters() if p.requires_grad}
    _load_tensors(ckpt_dir, targets)
    tensors, roles, saved = {}, set(), set()
    for name in modules:
        hf = _hf_module(adapter, name)
        a, b = targets[f"{name}.lora_A.weight"], targets[f"{name}.lora_B.weight"]
        tensors[f"base_model.model.{hf}.lora_A.weight"] = a.contiguous()
        tensors[f"base_model.model.{hf}.lora_B.weight"] = _b_to_hf(adapter, name, a, b).contiguous()
        roles.add(hf.rpartition(".")[2])
    names = {id(p): n for n, p in model.named_parameters()}
    layout, params = layout_of(model), set()
    for module, role, lo in expert_adapters(model):
        key = _expert_keys(layout, pcfg, _hf_experts_module(adapter, model, module, role), role)
        a, b = targets[names[id(lo.lora_A.weight)]], targets[names[id(lo.lora_B.weight)]]  # (E, r, in), (E, out, r)
        tensors[f"{key}lora_A.weight"] = a.reshape(-1, a.shape[-1]).contiguous()
        tensors[f"{key}lora_B.weight"] = b.permute(1, 2, 0).reshape(b.shape[1], -1).contiguous()
        params.add(role)
    for name in whole:  # trained norms/embeddings: PEFT's modules_to_save, stored under their HF names
        for hf_name, t in adapter.to_hf(name, targets[name]).items():
            tensors[f"base_model.model.{hf_name}"] = t
            saved.add(hf_name.rpartition(".")[0].rpartition(".")[2])
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": pcfg.rank, "lora_alpha": pcfg.alpha,
              "lora_dropout": pcfg.dropout, "target_modules": sorted(roles),
              "target_parameters": sorted(params) or None, "bias": "none", "fan_in_fan_out": False,
              "use_rslora": False, "use_dora": False, "init_lora_weights": True,
              "inference_mode": True, "modules_to_save": sorted(saved) or None, "base_model_name_or_path": None}
    _write_dir(out_dir, {ADAPTER_CONFIG: json.dumps(config, indent=2), ADAPTER_WEIGHTS: tensors})
    return {"dir": str(out_dir), "tensors": len(tensors), "modules": len(modules),
            "bytes": sum(t.numel() * t.element_size() for t in tensors.values())}


def export_merged(ckpt_dir: str | Path, out_dir: str | Path) -> dict:
    """An adapter checkpoint + its base (rebuilt from `peft_base`) -> merged HF safetensors + config.json."""
    ckpt_dir, out_dir = Path(ckpt_dir), Path(out_dir)
    manifest = read_manifest(ckpt_dir)
    model, pcfg = _peft_model(manifest, ckpt_dir, device="cpu")
    adapter = _adapter(model, ckpt_dir)
    base = manifest.get("peft_base", {})
    if base.get("init_from"):  # the very base the adapters were trained on, by content
        what = changed_inputs(manifest.get("model_inputs"),
                              {"model.init_from": folder_inputs("model.init_from", base["init_from"])})
        if what is not None:
            raise CheckpointError(f"{ckpt_dir}: {what}: the adapters were trained on another base; merging them "
                                  "into this one would give wrong weights: restore the base")
        load_hf_into(model, base["init_from"])
    elif type(base.get("seed")) is int:
        init_weights(model, base["seed"])
    else:
        raise CheckpointError(f"{ckpt_dir / MANIFEST}: key peft_base must name the base's init_from or seed")
    apply_lora(model, pcfg)
    trained = {n: p.data for n, p in model.named_parameters() if p.requires_grad}
    _load_tensors(ckpt_dir, trained)
    merge_lora(model)
    tensors = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if adapter.hf_names(name):
            tensors.update(adapter.to_hf(name, p.detach()))
    dtype = next(model.parameters()).dtype
    _write_dir(out_dir, {"model.safetensors": tensors}, adapter.hf_config(dtype), manifest)
    return {"dir": str(out_dir), "tensors": len(tensors),
            "bytes": sum(t.numel() * t.element_size() for t in tensors.values())}


# ------------------------------------------------------------------ import (peft.init_from)
def _expect(cfg: dict, key: str, want, where: Path) -> None:
    """A PEFT setting this run must agree with (absent = PEFT's default, which is `want`)."""
    if cfg.get(key, want) != want and not (want in ({}, None) and not cfg.get(key)):
        fix = {"r": "set peft.rank to match", "lora_alpha": "set peft.alpha to match"}.get(key, "not supported")
        raise CheckpointError(f"{where / ADAPTER_CONFIG}: {key}={cfg.get(key)!r} but this run needs {want!r} ({fix})")


def _copy_into(p: torch.Tensor, t: torch.Tensor, key: str, name: str, where: Path) -> None:
    if tuple(t.shape) != tuple(p.shape):
        raise CheckpointError(f"{where / ADAPTER_WEIGHTS}: {key} has shape {tuple(t.shape)} but {name} has "
                              f"{tuple(p.shape)}")
    copy_param(p, t)


@torch.no_grad()
def load_peft_adapter(model: nn.Module, pcfg) -> None:
    """Copy a PEFT adapter folder into an adapted model (plain or DTensor parameters), every key checked; its
    `modules_to_save` must be the modules this run's freeze policy trains."""
    where = Path(pcfg.init_from)
    if not (where / ADAPTER_CONFIG).is_file() or not (where / ADAPTER_WEIGHTS).is_file():
        raise CheckpointError(f"peft.init_from: {where} has no {ADAPTER_CONFIG} + {ADAPTER_WEIGHTS}")
    cfg = json.loads((where / ADAPTER_CONFIG).read_text())
    _expect(cfg, "peft_type", "LORA", where)
    for key, want in (("r", pcfg.rank), ("lora_alpha", pcfg.alpha), ("use_dora", False), ("use_rslora", False),
                      ("bias", "none"), ("fan_in_fan_out", False), ("layers_to_transform", None),
                      ("rank_pattern", {}), ("alpha_pattern", {})):
        _expect(cfg, key, want, where)
    adapter = _adapter(model, where)
    modules = adapter_modules(model)
    hf = {name: _hf_module(adapter, name) for name in modules}
    roles = sorted({h.rpartition(".")[2] for h in hf.values()})
    theirs = cfg.get("target_modules")
    if sorted([theirs] if isinstance(theirs, str) else theirs or []) != roles:
        raise CheckpointError(f"{where / ADAPTER_CONFIG}: target_modules={theirs} but this run adapts {roles}: set "
                              "peft.target_modules to match")
    # per-expert adapters <-> PEFT target_parameters (`experts.down_proj`, `mlp.experts.down_proj`, `down_proj`)
    layout, experts = layout_of(model), expert_adapters(model)
    mine = sorted({role for _, role, _ in experts})
    params = cfg.get("target_parameters") or []
    named = sorted({r for r in layout.experts for t in params
                    if t == r or t.endswith("." + r) or r.endswith("." + t)})
    if named != mine or len(named) != len(params):
        raise CheckpointError(f"{where / ADAPTER_CONFIG}: target_parameters={params or None} but this run adapts the "
                              f"expert parameters {mine or 'none'}: set peft.target_modules to match")
    # whole trained parameters (norms/embeddings the freeze policy trains) <-> PEFT's modules_to_save
    whole = {n: p for n, p in model.named_parameters() if p.requires_grad and not is_adapter_param(n)}
    whole_hf = {n: adapter.hf_names(n) for n in whole}
    saved = sorted({h.rpartition(".")[0].rpartition(".")[2] for names in whole_hf.values() for h in names})
    if sorted(cfg.get("modules_to_save") or []) != saved:
        raise CheckpointError(f"{where / ADAPTER_CONFIG}: modules_to_save={cfg.get('modules_to_save')} but this run "
                              f"trains {saved or 'none'} besides the adapters: set peft.freeze to match")
    with open_safetensors(where / ADAPTER_WEIGHTS, "peft.init_from: ") as sf:
        left = set(sf.keys())

        def take(key: str, name: str) -> torch.Tensor:
            if key not in left:
                raise CheckpointError(f"{where / ADAPTER_WEIGHTS}: tensor {key} (for {name}) is missing")
            left.discard(key)
            return sf.get_tensor(key)

        for name, m in modules.items():
            for part in ("lora_A", "lora_B"):
                key = f"base_model.model.{hf[name]}.{part}.weight"
                t = take(key, name)
                if part == "lora_B":
                    t = adapter.from_hf(f"{name}.weight", {f"{hf[name]}.weight": t})
                _copy_into(getattr(m, part).weight, t, key, f"{name}.{part}.weight", where)
        for module, role, lo in experts:  # A (E * r, in) expert-major rows, B (out, r * E) expert-minor columns
            key = _expert_keys(layout, pcfg, _hf_experts_module(adapter, model, module, role), role)
            n_exp, rank, _ = lo.lora_A.weight.shape
            a = take(f"{key}lora_A.weight", f"{module} {role}")
            b = take(f"{key}lora_B.weight", f"{module} {role}")
            if a.dim() != 2 or b.dim() != 2 or a.shape[0] != n_exp * rank or b.shape[1] != n_exp * rank:
                raise CheckpointError(f"{where / ADAPTER_WEIGHTS}: {key}lora_A/B have shapes {tuple(a.shape)}, "
                                      f"{tuple(b.shape)}, not ({n_exp} x {rank}, in) and (out, {rank} x {n_exp})")
            _copy_into(lo.lora_A.weight, a.reshape(n_exp, rank, -1), f"{key}lora_A.weight", f"{module} {role}", where)
            _copy_into(lo.lora_B.weight, b.reshape(b.shape[0], rank, n_exp).permute(2, 0, 1),
                       f"{key}lora_B.weight", f"{module} {role}", where)
        for name, p in whole.items():
            if whole_hf[name]:  # a tied head loads through the embedding it shares
                t = adapter.from_hf(name, {h: take(f"base_model.model.{h}", name) for h in whole_hf[name]})
                _copy_into(p, t, f"base_model.model.{whole_hf[name][0]}", name, where)
    if left:
        raise CheckpointError(f"{where / ADAPTER_WEIGHTS}: tensor {sorted(left)[0]} matches no adapter of this model "
                              f"({len(left)} unused)")
