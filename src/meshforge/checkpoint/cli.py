"""`meshforge checkpoint inspect|export|import`: look into, export and import checkpoints (exit 2 on a bad one).

- `inspect DIR`: the manifest (step, strategy, format, world layout, digests), the files' integrity, and
  the model tensors with shapes and sizes. DIR is a checkpoint, a checkpoints dir or a run dir (LATEST).
- `export RUN_DIR/step_N --to DIR [--shard-mb M]`: Hugging Face safetensors + config.json (verified first);
  of a LoRA checkpoint, `--adapter` writes the PEFT format and `--merge` the base with adapters merged. DIR is
  new, empty or an earlier export (replaced whole); anything else is refused (`outputs.check_folder`).
- `import HF_DIR --to DIR`: a weights-only meshforge checkpoint `DIR/step_0` (+ LATEST) from HF Llama
  safetensors (Llama, Qwen2, Qwen3, Mistral; config.json read exactly, unknown keys refused); prints the
  `model.*` values to train it with `checkpoint.resume=DIR` (or `model.init_from=HF_DIR`). DIR is new, empty or
  an earlier import (replaced whole); never a run's checkpoints folder (its LATEST stays where it is).
"""

from __future__ import annotations

import json
import sys

from meshforge.errors import CheckpointError


def add_arguments(parser) -> None:
    sub = parser.add_subparsers(dest="checkpoint_command", required=True)
    i = sub.add_parser("inspect", help="print a checkpoint's manifest, integrity and tensors")
    i.add_argument("dir")
    i.add_argument("--json", action="store_true", help="print the manifest as JSON")
    i.add_argument("--no-verify", action="store_true", help="skip the size and sha256 check of every file")
    e = sub.add_parser("export", help="export a checkpoint as Hugging Face safetensors + config.json")
    e.add_argument("dir", help="a checkpoint (RUN_DIR/checkpoints/step_N) or a run/checkpoints dir (LATEST)")
    e.add_argument("--to", required=True)
    e.add_argument("--shard-mb", type=int, default=2048, help="largest safetensors file (MiB) before sharding")
    lora = e.add_mutually_exclusive_group()
    lora.add_argument("--adapter", action="store_true",
                      help="a LoRA checkpoint -> Hugging Face PEFT (adapter_config.json + adapter_model.safetensors)")
    lora.add_argument("--merge", action="store_true",
                      help="a LoRA checkpoint -> its base with the adapters merged, as Hugging Face safetensors")
    m = sub.add_parser("import", help="Hugging Face safetensors -> a weights-only meshforge checkpoint")
    m.add_argument("dir")
    m.add_argument("--to", required=True)


def _inspect(args) -> int:
    from meshforge.checkpoint.manifest import read_manifest, verify_files
    from meshforge.checkpoint.paths import resolve_checkpoint_path
    from meshforge.checkpoint.safe_dcp import dcp_tensor_shapes

    path = resolve_checkpoint_path(args.dir)
    manifest = verify_files(path) if not args.no_verify else read_manifest(path)
    if args.json:
        print(json.dumps(manifest, indent=1, sort_keys=True))
        return 0
    files = manifest["files"]
    total = sum(f["bytes"] for f in files.values())
    print(f"checkpoint {path}")
    print(f"  step            {manifest['step']}")
    print(f"  contents        {', '.join(manifest.get('contents', []))}")
    print(f"  strategy        {manifest.get('strategy')}   format {manifest.get('ckpt_format')}")
    print(f"  world           {manifest.get('world_size')}   layout {manifest.get('layout')}")
    print(f"  config digest   {manifest.get('config_digest', '')[:16]}   torch {manifest.get('torch_version')}")
    print(f"  created (UTC)   {manifest.get('created_utc')}")
    a = manifest.get("model_args", {})
    if a:
        print("  model           " + " ".join(f"{k}={a[k]}" for k in ("vocab_size", "dim", "n_layers", "n_heads",
                                                                       "n_kv_heads", "ffn_dim") if k in a))
    verified = "" if args.no_verify else ", sizes and sha256 OK"
    print(f"  files           {len(files)} ({total / 2**20:.2f} MiB){verified}")
    shapes = dcp_tensor_shapes(path)
    model = {k[len("model."):]: v for k, v in shapes.items() if k.startswith("model.")}
    n_params = sum(_numel(s) for s, _ in model.values())
    print(f"  model tensors   {len(model)} ({n_params:,} parameters); optimizer tensors "
          f"{sum(1 for k in shapes if k.startswith('optim.'))}")
    width = max((len(k) for k in model), default=0)
    for k, (shape, dtype) in model.items():
        print(f"    {k:<{width}}  {tuple(shape)!s:<16} {str(dtype).replace('torch.', ''):<9} "
              f"{_numel(shape) * dtype.itemsize / 2**10:10.1f} KiB")
    return 0


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _export(args) -> int:
    from meshforge.checkpoint.hf import export_checkpoint
    from meshforge.checkpoint.manifest import verify_files
    from meshforge.checkpoint.paths import resolve_checkpoint_path

    path = resolve_checkpoint_path(args.dir)
    _check_destination(args.to, [args.dir, path])
    manifest = verify_files(path)
    if args.adapter or args.merge or "adapter" in manifest.get("contents", []):
        return _export_lora(args, path, manifest)
    s = export_checkpoint(path, args.to, args.shard_mb)
    print(f"exported {path} -> {s['dir']}: {s['tensors']} tensors, {s['bytes'] / 2**20:.2f} MiB in {s['files']} "
          "safetensors file(s) + config.json, generation_config.json" +
          (", tokenizer.json" if s["tokenizer"] else ""))
    return 0


def _check_destination(dest: str, sources: list) -> None:
    """`--to` is new, empty or an earlier export, and holds none of the command's inputs: else one line."""
    import meshforge.outputs as outputs

    problem = outputs.check_folder(dest, outputs.EXPORT, "--to", sources=sources)
    if problem is not None:
        raise CheckpointError(problem)


def _export_lora(args, path, manifest: dict) -> int:
    from meshforge.checkpoint.peft import export_adapter, export_merged

    if not (args.adapter or args.merge):
        raise CheckpointError(f"{path} is a LoRA adapter checkpoint: export it with --adapter (PEFT format) or "
                              "--merge (merged Hugging Face weights)")
    base = (manifest.get("peft_base") or {}).get("init_from")
    if base:  # the base a merge reads is an input too
        _check_destination(args.to, [base])
    s = export_adapter(path, args.to) if args.adapter else export_merged(path, args.to)
    what = "PEFT adapter" if args.adapter else "merged Hugging Face safetensors + config.json"
    print(f"exported {path} -> {s['dir']}: {s['tensors']} tensors, {s['bytes'] / 2**20:.2f} MiB ({what})")
    return 0


def _import(args) -> int:
    from meshforge.checkpoint.hf import import_hf

    s = import_hf(args.dir, args.to)
    print(f"imported {args.dir} -> {s['dir']} (weights only)")
    print("train it with: checkpoint.resume=" + args.to + " " +
          " ".join(f"model.{k}={json.dumps(v, separators=(',', ':')) if isinstance(v, list) else v}"
                   for k, v in s["model_overrides"].items()))
    return 0


def run(args) -> int:
    fn = {"inspect": _inspect, "export": _export, "import": _import}[args.checkpoint_command]
    try:
        return fn(args)
    except CheckpointError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except (FileNotFoundError, NotADirectoryError, json.JSONDecodeError, KeyError) as err:
        print(f"error: {args.dir}: not a usable checkpoint ({type(err).__name__}: {err})", file=sys.stderr)
        return 2
