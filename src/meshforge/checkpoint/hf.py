"""Hugging Face safetensors: export a meshforge checkpoint, import HF weights into a meshforge model.

What maps where is the model's business: its state-dict adapter (the model contract) gives, tensor by
tensor, the HF names, the permutations and config.json. This module only streams.

Export is planned from the DCP metadata alone and loads one output shard's tensors at a time
(`consolidated_shard_mb`; a single tensor larger than that gets a shard of its own), so the whole model is
never in memory at once; above one shard it writes `model-0000i-of-0000n.safetensors` and
`model.safetensors.index.json`, else `model.safetensors`; plus `config.json` and `generation_config.json`.
Import reads config.json exactly (the model's family refuses any key it cannot honour) and the tensors one
by one with `safetensors.safe_open` (no pickle); a tensor the model does not have is refused.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import meshforge.outputs as outputs
from meshforge.checkpoint.manifest import MANIFEST, file_entry, manifest_model_args, new_manifest, read_manifest
from meshforge.checkpoint.paths import follow_umask, publish_checkpoint, write_atomic, write_export
from meshforge.checkpoint.safe_dcp import dcp_load, dcp_tensor_shapes
from meshforge.distributed.master_weights import write_param
from meshforge.errors import CheckpointError
from meshforge.models import (
    HF_PREFIX,
    ModelArgs,
    args_from_hf_config,
    build_model,
    contract_of,
    hf_config_dict,
    persistent_buffers,
)
from meshforge.progress import track
from meshforge.models.lora import is_adapter_param

# the files of a Hugging Face tokenizer folder an export carries
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "chat_template.jinja", "chat_template.json", "tokenizer.model", "vocab.json", "merges.txt")


def _adapter(model, where: Path):
    try:
        return contract_of(model).state_dict_adapter()
    except (ValueError, CheckpointError) as err:
        raise CheckpointError(f"{where}: {err}") from None


def open_safetensors(path: Path, what: str = ""):
    """`safe_open`, a damaged or crafted file (header length, non-JSON or nested header, offsets out of range,
    reversed or overlapping, unknown dtypes, shapes that do not fit their bytes) refused with one line naming it:
    safetensors validates all of that when it opens the file, before any tensor is read."""
    try:
        return safe_open(str(path), framework="pt")
    except (SafetensorError, OSError) as err:
        raise CheckpointError(f"{what}{path}: not a readable safetensors file ({str(err)[:200]})") from None


# --------------------------------------------------------------------------------- export
@torch.no_grad()
def copy_param(p: torch.Tensor, t: torch.Tensor) -> None:
    """A full tensor into a parameter: a DTensor takes its own shard (no collective: every rank holds `t`), a
    plain one through `write_param` (bf16_params: into the fp32 master, unrounded)."""
    if isinstance(p, DTensor):
        local = distribute_tensor(t.to(p.dtype), p.device_mesh, p.placements, src_data_rank=None)
        p.to_local().copy_(local.to_local())
    else:
        write_param(p, t)


def export_checkpoint(ckpt_dir: str | Path, out_dir: str | Path, shard_mb: int = 2048) -> dict:
    """Write a meshforge DCP checkpoint's model as HF safetensors + config.json; returns a summary."""
    ckpt_dir, out_dir = Path(ckpt_dir), Path(out_dir)
    manifest = read_manifest(ckpt_dir)
    args = manifest_model_args(ckpt_dir, manifest)
    if args.hf_model:
        return export_hf_model(ckpt_dir, out_dir, manifest, shard_mb)
    model = build_model(args, device="meta")  # names and adapter, no memory
    adapter = _adapter(model, ckpt_dir)
    shapes = dcp_tensor_shapes(ckpt_dir)
    names = [n for n, _ in _state(model) if adapter.hf_names(n)]  # tied: once
    missing = [k for k in names if f"model.{k}" not in shapes]
    if missing:
        raise CheckpointError(f"{ckpt_dir}: parameter {missing[0]} is missing from the checkpoint")
    limit = shard_mb * 2**20
    experts = _stacked_experts(model) if hasattr(adapter, "to_hf_experts") else set()
    # each output shard: {parameter: None (whole) or [first, stop) (those experts of a stacked expert weight)}
    shards: list[dict[str, list[int] | None]] = [{}]
    size = total = 0
    for ours in names:  # plan shards from the metadata alone; stacked experts one expert at a time
        shape, dtype = shapes[f"model.{ours}"]
        units = [(e, e + 1) for e in range(shape[0])] if ours in experts else [None]
        nbytes = torch.Size(shape).numel() * dtype.itemsize // len(units)
        for unit in units:
            total += nbytes
            if shards[-1] and size + nbytes > limit:
                shards.append({})
                size = 0
            if unit is None:
                shards[-1][ours] = None
            else:
                shards[-1].setdefault(ours, [unit[0], unit[0]])[1] = unit[1]
            size += nbytes
    n = len(shards)
    weight_map: dict[str, str] = {}

    def write(tmp: Path) -> dict | None:
        for i, group in enumerate(track(shards, "export: safetensors files")):
            fname = "model.safetensors" if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            whole, part, offsets = {}, {}, {}
            for k, r in group.items():
                shape, dtype = shapes[f"model.{k}"]
                if r is None:
                    whole[f"model.{k}"] = torch.empty(shape, dtype=dtype)
                else:  # only experts r[0]..r[1]-1 of the stacked weight
                    part[f"model.{k}"] = torch.empty((r[1] - r[0], *shape[1:]), dtype=dtype)
                    offsets[f"model.{k}"] = (r[0],) + (0,) * (len(shape) - 1)
            for state, box in ((whole, None), (part, offsets)):
                if state:
                    dcp_load(state, ckpt_dir, no_dist=True, offsets=box)
            out = {}
            for k, r in group.items():
                if r is None:
                    out.update(adapter.to_hf(k, whole.pop(f"model.{k}")))
                else:
                    out.update(adapter.to_hf_experts(k, r[0], part.pop(f"model.{k}")))
            weight_map.update(dict.fromkeys(out, fname))
            save_file(out, str(tmp / fname), metadata={"format": "pt"})
            follow_umask(tmp / fname)
            del out
        tokenizer = write_hf_config(tmp, adapter.hf_config(shapes[f"model.{names[0]}"][1]), manifest)
        if n > 1:
            (tmp / "model.safetensors.index.json").write_text(json.dumps(
                {"metadata": {"total_size": total, "meshforge_step": manifest["step"]}, "weight_map": weight_map},
                indent=2))
        return tokenizer

    tokenizer = write_export(out_dir, write)
    return {"files": n, "tensors": len(weight_map), "bytes": total, "dir": str(out_dir),
            "tokenizer": tokenizer is not None}


def export_hf_model(ckpt_dir: Path, out_dir: Path, manifest: dict, shard_mb: int) -> dict:
    """A `model.hf_model` run: the transformers model rebuilt from the config.json the run recorded, its weights
    read from DCP, written by transformers' own `save_pretrained` (its names, tied weights once, config.json and
    generation_config.json). The whole model is in this process's memory once (offline, one process)."""
    try:
        import transformers
    except ImportError:
        raise CheckpointError("exporting a model.hf_model checkpoint needs transformers: pip install "
                              "'meshforge[hf]'") from None
    transformers.utils.logging.disable_progress_bar()
    config = manifest.get("hf_config")
    if not config:
        raise CheckpointError(f"{ckpt_dir}: the manifest records model.hf_model but not its config.json")
    config = transformers.AutoConfig.for_model(**config)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    shapes = dcp_tensor_shapes(ckpt_dir)
    own = model.state_dict()
    missing = [k for k in own if f"model.{HF_PREFIX}{k}" not in shapes]
    extra = sorted(k for k in shapes if k.startswith("model.") and k[len("model." + HF_PREFIX):] not in own)
    if missing or extra:
        what = f"{missing[0]} is missing from it" if missing else f"it holds {extra[0]}, not a tensor of the model"
        raise CheckpointError(f"{ckpt_dir}: not this {type(model).__name__}'s checkpoint ({what})")
    state = {f"model.{HF_PREFIX}{k}": torch.empty(shapes[f"model.{HF_PREFIX}{k}"][0],
                                                  dtype=shapes[f"model.{HF_PREFIX}{k}"][1]) for k in own}
    dcp_load(state, ckpt_dir, no_dist=True)
    model.load_state_dict({k: state[f"model.{HF_PREFIX}{k}"] for k in own}, strict=True)

    def write(tmp: Path) -> dict | None:
        tokenizer = copy_tokenizer(manifest.get("tokenizer"), tmp)
        for key, value in (tokenizer or {}).items():  # bos/eos from the run's tokenizer where the model has none
            for cfg in (model.config, model.generation_config):
                if getattr(cfg, key, None) is None and value is not None:
                    setattr(cfg, key, value)
        model.save_pretrained(str(tmp), max_shard_size=f"{shard_mb}MB")
        for f in tmp.iterdir():
            follow_umask(f)
        return tokenizer

    tokenizer = write_export(out_dir, write)
    files = sorted(out_dir.glob("*.safetensors"))
    written = {}
    for f in files:
        with open_safetensors(f) as sf:
            written.update({k: sf.get_slice(k).get_shape() for k in sf.keys()})  # noqa: SIM118
    return {"files": len(files), "tensors": len(written), "dir": str(out_dir), "tokenizer": tokenizer is not None,
            "bytes": sum(torch.Size(v).numel() * 4 for v in written.values())}


def _state(model) -> list[tuple[str, torch.Tensor]]:
    """What a checkpoint holds of a model, by name: its parameters (tied ones under each name), then the buffers it
    keeps (an MoE router's selection bias)."""
    return list(model.named_parameters(remove_duplicate=False)) + persistent_buffers(model)


def _stacked_experts(model) -> set[str]:
    """Names of the stacked routed-expert weights (dim 0 = expert) of the model's MoE layers."""
    ids = {id(p) for layer in contract_of(model).moe_layers() for p in layer.experts.parameters(recurse=False)}
    return {n for n, p in model.named_parameters() if id(p) in ids}


def write_hf_config(folder: Path, hf_config: dict, manifest: dict) -> dict | None:
    """config.json, generation_config.json and the run's tokenizer (`copy_tokenizer`) into an export folder, so
    every export (plain or merged) is the same complete Hugging Face folder; returns the tokenizer's token ids."""
    tokenizer = copy_tokenizer(manifest.get("tokenizer"), folder)
    for key, value in (tokenizer or {}).items():  # bos/eos from the run's tokenizer where the model has none
        if hf_config.get(key) is None and value is not None:
            hf_config[key] = value
    (folder / "config.json").write_text(json.dumps(hf_config, indent=2))
    (folder / "generation_config.json").write_text(json.dumps(generation_config(hf_config), indent=2))
    return tokenizer


def generation_config(hf_config: dict) -> dict:
    """generation_config.json as transformers derives it from config.json (token ids; greedy by default)."""
    out = {"_from_model_config": True}
    out.update({k: hf_config[k] for k in ("bos_token_id", "eos_token_id") if hf_config.get(k) is not None})
    return out


def hf_config_of(cfg) -> dict | None:
    """config.json of a `model.hf_model` run, as the manifest records it (its export rebuilds the model from it)."""
    return hf_config_dict(cfg.model.hf_model) if cfg.model.hf_model else None


def tokenizer_of(cfg) -> str | None:
    """The run's tokenizer as the manifest records it: data.tokenizer (absolute path); "bytes" for data.source=text
    without one (one token per byte); else the tokenizer of the Hugging Face folder the model started from
    (model.hf_model or model.init_from), when it has one; else None."""
    if cfg.data.tokenizer:
        return str(Path(cfg.data.tokenizer).expanduser().resolve())
    if any(s.source == "text" for s in cfg.data.sources()):
        return "bytes"
    for folder in (cfg.model.hf_model, cfg.model.init_from):
        if folder and (Path(folder) / "tokenizer.json").is_file():
            return str(Path(folder).expanduser().resolve())
    return None


def copy_tokenizer(tokenizer: str | None, out_dir: Path) -> dict | None:
    """Write the run's tokenizer into an export folder so `AutoTokenizer.from_pretrained` loads it: the byte-level
    one, a tokenizer folder's files (tokenizer.json, tokenizer_config.json, special tokens, chat template), or a
    lone tokenizer.json with a tokenizer_config.json naming its eos token. Returns its {bos_token_id,
    eos_token_id} as transformers reads them (None: the run had no tokenizer)."""
    if tokenizer is None:
        return None
    if tokenizer == "bytes":
        write_byte_tokenizer(out_dir)
        return {}
    src = Path(tokenizer)
    if src.is_dir():
        for name in TOKENIZER_FILES:
            if (src / name).is_file():
                shutil.copyfile(src / name, out_dir / name)
    elif src.is_file():
        from meshforge.data.tokenizer import load_tokenizer

        lone = load_tokenizer(str(src))
        eos = lone._tok.id_to_token(lone.eos_id)
        shutil.copyfile(src, out_dir / "tokenizer.json")
        (out_dir / "tokenizer_config.json").write_text(json.dumps(
            {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos}, indent=2))
    else:
        raise CheckpointError(f"the run's tokenizer {tokenizer} is gone: restore it to export its files")
    try:
        import transformers
    except ImportError:
        raise CheckpointError("exporting the run's tokenizer needs transformers: pip install 'meshforge[hf]'") from None
    tok = transformers.AutoTokenizer.from_pretrained(str(out_dir), local_files_only=True)
    return {"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id}


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map, the alphabet of a byte-level `tokenizers` model."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = bs[:]
    extra = 0
    for b in range(256):
        if b not in bs:  # unprintable bytes map to characters above 255, in byte order
            bs.append(b)
            cs.append(256 + extra)
            extra += 1
    return dict(zip(bs, map(chr, cs), strict=True))


def write_byte_tokenizer(out_dir: Path) -> None:
    """tokenizer.json (+ tokenizer_config.json) equivalent to meshforge's byte-level tokenization: token id ==
    byte value, no merges, no specials, so `AutoTokenizer` encodes text to exactly the ids the run trained on."""
    try:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    except ImportError:
        raise CheckpointError("writing the byte-level tokenizer needs the tokenizers package: "
                              "pip install 'meshforge[hf]'") from None
    chars = _bytes_to_unicode()
    tok = Tokenizer(models.BPE(vocab={chars[b]: b for b in range(256)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast",
                                                                "model_max_length": 1 << 30}, indent=2))


# --------------------------------------------------------------------------------- import
def _hf_tensor_files(hf_dir: Path) -> dict[str, Path]:
    """HF tensor name -> the safetensors file holding it."""
    index = hf_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            wm = json.loads(index.read_text())["weight_map"]
        except (ValueError, RecursionError, KeyError, TypeError) as err:
            raise CheckpointError(f"{index}: not a safetensors index with a weight_map ({type(err).__name__})") \
                from None
        if not isinstance(wm, dict) or not all(isinstance(k, str) and isinstance(v, str) and Path(v).name == v
                                               and v not in ("", ".", "..") for k, v in wm.items()):
            raise CheckpointError(f"{index}: weight_map must map tensor names to file names in its folder")
        return {k: hf_dir / v for k, v in wm.items()}
    single = hf_dir / "model.safetensors"
    files = [single] if single.is_file() else sorted(hf_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{hf_dir}: no model.safetensors or model.safetensors.index.json")
    out = {}
    for f in files:
        with open_safetensors(f) as sf:
            out.update({k: f for k in sf.keys()})  # noqa: SIM118
    return out


# model.* values that do not change the weights or the logits: a run may differ from config.json in them
_FREE_ARGS = {"init_std", "max_seq_len", "bos_token_id", "eos_token_id", "head_dim",
              "aux_loss_coeff", "router_bias_update_rate"}  # (training choices: the balancing of the experts)


def hf_model_args(hf_dir: Path, what: str = "model.init_from") -> ModelArgs:
    """The meshforge model a Hugging Face directory's config.json describes (every key honoured or refused)."""
    cfg_file = hf_dir / "config.json"
    if not cfg_file.is_file():
        raise CheckpointError(f"{what}: {cfg_file} is missing (the model's shape is read from it)")
    try:
        values = args_from_hf_config(json.loads(cfg_file.read_text()))
        return ModelArgs(**values).validate()
    except json.JSONDecodeError as err:
        raise CheckpointError(f"{cfg_file}: not JSON ({err})") from None
    except ValueError as err:
        raise CheckpointError(f"{cfg_file}: {err}") from None


def check_model_matches(args: ModelArgs, hf_args: ModelArgs, hf_dir: Path) -> None:
    """Refuse a run whose model.* values build a different model than config.json (one line, every difference)."""
    diffs = [f"{f.name}={getattr(hf_args, f.name)!r} (run: {getattr(args, f.name)!r})"
             for f in dataclasses.fields(ModelArgs)
             if f.name not in _FREE_ARGS and getattr(args, f.name) != getattr(hf_args, f.name)]
    if args.hd != hf_args.hd:
        diffs.append(f"head_dim={hf_args.hd} (run: {args.hd})")
    if diffs:
        raise CheckpointError(f"model.init_from: {hf_dir}/config.json describes another model: {'; '.join(diffs)}; "
                              "set model.* to match (`meshforge checkpoint import` prints them)")


@torch.no_grad()
def load_hf_into(model, hf_dir: str | Path, progress: bool = False) -> list[str]:
    """Copy HF safetensors into a meshforge model (plain or with DTensor parameters), tensor by tensor.

    config.json must describe this model, and every tensor of the checkpoint must be one of the model's: a
    tensor nothing reads is refused, not dropped. A pipeline stage holds only some of the model: it reads
    only the tensors of its own parameters; a sharded parameter reads only its rank's slice
    (`safetensors` `get_slice`, through the adapter's `from_hf_box`), so no rank holds a full copy.
    Returns the HF tensors read whole (those of unsharded parameters).
    """
    hf_dir = Path(hf_dir)
    if not hf_dir.is_dir():
        raise CheckpointError(f"model.init_from: {hf_dir} is not a directory")
    adapter = _adapter(model, hf_dir)
    args = getattr(model, "args", None)
    if args is not None:
        check_model_matches(args, hf_model_args(hf_dir), hf_dir)
    files = _hf_tensor_files(hf_dir)
    if args is not None:
        whole = build_model(args, device="meta")
        expected = {t for n, _ in _state(whole) for t in adapter.hf_names(n)}
        unused = sorted(set(files) - expected)
        if unused:
            raise CheckpointError(f"{files[unused[0]]}: tensor {unused[0]} is not a parameter of this "
                                  f"{args.family} model ({len(unused)} unused tensor(s)); refusing to drop it")
    handles: dict[Path, object] = {}
    read_whole: list[str] = []

    def opened(name: str):
        f = files[name]
        if f not in handles:
            handles[f] = open_safetensors(f)
        return handles[f]

    def read(name: str, box: list[tuple[int, int]]) -> torch.Tensor:  # only the rows/columns in `box`
        return opened(name).get_slice(name)[tuple(slice(a, b) for a, b in box)]

    def whole(name: str) -> torch.Tensor:
        read_whole.append(name)
        return opened(name).get_tensor(name)

    params = _state(model)
    for ours, p in track(params, "import: tensors", enabled=progress):
        if is_adapter_param(ours):
            continue  # LoRA adapters are not base weights (`peft.init_from` loads them)
        try:
            theirs = adapter.hf_names(ours)
        except KeyError as err:
            raise CheckpointError(f"{hf_dir}: {err.args[0]}") from None
        if not theirs:
            continue  # tied: loaded through the parameter it shares
        for name in theirs:
            if name not in files:
                raise CheckpointError(f"{hf_dir}: tensor {name} (for {ours}) is missing")
        # the full shape, from the files' headers alone: the adapter's transform run on meta tensors
        metas = {n: torch.empty(opened(n).get_slice(n).get_shape(), device="meta") for n in theirs}
        full_shape = tuple(adapter.from_hf(ours, metas).shape)
        if full_shape != tuple(p.shape):
            verb = "has" if len(theirs) == 1 else "give"
            raise CheckpointError(f"{files[theirs[0]]}: {', '.join(theirs)} {verb} shape {full_shape} but "
                                  f"parameter {ours} of this model has shape {tuple(p.shape)}")
        box = _local_box(p)
        if box is not None and hasattr(adapter, "from_hf_box"):  # this rank reads only its own slice
            local = adapter.from_hf_box(ours, read, box)
            p.to_local().copy_(local.to(p.dtype))
            continue
        if not isinstance(p, DTensor) and p.untyped_storage().nbytes() < p.numel() * p.element_size():
            raise CheckpointError(f"model.init_from: parameter {ours} has no storage of its own here (the strategy "
                                  "keeps it in a flat buffer): import with `meshforge checkpoint "
                                  "import` and start from it with checkpoint.resume instead")
        copy_param(p, adapter.from_hf(ours, {n: whole(n) for n in theirs}))
    return read_whole


class PlainInitFrom:
    """`model.init_from` for a strategy that re-stores parameters in flat buffers (its spec says `flat_buffers`):
    loaded into the plain model before parallelisation (`build_parallel_model(load_plain=...)`), where every rank
    reads the tensors whole; `done` says whether that path ran (not on meta-device or pipeline builds)."""

    def __init__(self, hf_dir: str):
        self.hf_dir, self.done = hf_dir, False

    def __call__(self, model) -> None:
        load_hf_into(model, self.hf_dir)
        self.done = True

    @classmethod
    def of(cls, cfg) -> PlainInitFrom | None:
        flat = cfg.model.init_from and cfg.distributed.spec.flat_buffers
        return cls(cfg.model.init_from) if flat else None


def _local_box(p) -> list[tuple[int, int]] | None:
    """[(start, stop)] per dim of the part of DTensor `p` this rank holds, when that part is one contiguous
    box (placements only `Shard`/`Replicate`); None otherwise (a plain tensor, or strided/partial placements:
    then the full tensor is read and distributed)."""
    if not isinstance(p, DTensor) or any(type(pl) not in (Shard, Replicate) for pl in p.placements):
        return None
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    if tuple(shape) != tuple(p.to_local().shape):
        return None
    return [(o, o + n) for o, n in zip(offset, shape, strict=True)]


def save_weights_only(model, out_dir: str | Path, source: str = "") -> Path:
    """A weights-only meshforge checkpoint `<out>/step_0` (+ LATEST) of a plain model, with its manifest."""
    out_dir = Path(out_dir)
    final, partial = out_dir / "step_0", out_dir / "step_0.partial"
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(partial), no_dist=True)
    files = {p.name: file_entry(p) for p in sorted(partial.iterdir()) if p.is_file()}
    tokenizer = str(Path(source).resolve()) if source and (Path(source) / "tokenizer.json").is_file() else None
    manifest = new_manifest(step=0, contents=["model"], ckpt_format="torch_dist", strategy="import", world_size=1,
                            layout={}, config_digest="", model_args=dataclasses.asdict(model.args),
                            imported_from=source, tokenizer=tokenizer,  # an imported folder's goes on to its export
                            files=files)
    write_atomic(partial / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True))
    publish_checkpoint(partial, final)
    return final


def import_hf(hf_dir: str | Path, out_dir: str | Path) -> dict:
    """HF dir -> a weights-only meshforge checkpoint `<out>/step_0` (+ LATEST) and the model.* values it needs."""
    hf_dir = Path(hf_dir)
    if not hf_dir.is_dir():
        raise CheckpointError(f"{hf_dir} is not a directory")
    check_import_destination(out_dir, hf_dir)
    args = hf_model_args(hf_dir, "checkpoint import")
    overrides = {f.name: getattr(args, f.name) for f in dataclasses.fields(ModelArgs)
                 if getattr(args, f.name) != getattr(ModelArgs(), f.name)}
    model = build_model(args)
    load_hf_into(model, hf_dir, progress=True)
    outputs.replace_folder(out_dir, outputs.CHECKPOINTS, lambda tmp: save_weights_only(model, tmp, str(hf_dir)))
    return {"dir": str(Path(out_dir) / "step_0"), "model_overrides": overrides}


def check_import_destination(out_dir: str | Path, hf_dir: Path) -> None:
    """An import goes into a new or empty folder, or replaces an earlier import (a checkpoints folder holding only
    an imported step_0): never a run's checkpoints, whose LATEST it would move. Else one line."""
    problem = outputs.check_folder(out_dir, outputs.CHECKPOINTS, "--to", sources=[hf_dir])
    if problem is None and outputs.kind_of(Path(out_dir)) == outputs.CHECKPOINTS:
        steps = [p for p in Path(out_dir).iterdir() if p.name.startswith("step_")]
        try:
            imported = [json.loads((p / MANIFEST).read_text()).get("strategy") for p in steps] == ["import"]
        except (OSError, ValueError, AttributeError):
            imported = False
        if not imported:
            problem = (f"--to={out_dir} is a run's checkpoints folder ({outputs.entries(Path(out_dir))}): an import "
                       "never moves a run's LATEST; give a new folder")
    if problem is not None:
        raise CheckpointError(problem)
