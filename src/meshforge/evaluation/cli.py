"""`meshforge eval MODEL [data.*=... training.seq_len=N] [--tasks T --include DIR]`: perplexity of a model on
held-out data and its scores on local lm-eval tasks, on one process (exit 2 on bad input, one line each).

MODEL is a run directory, its checkpoints directory, one checkpoint, or a Hugging Face folder. `data.*`
overrides say what to read, exactly as in a training config (any source, format, mix; the model's tokenizer
unless data.tokenizer is given); only `data.*`, `training.seq_len`, `training.micro_batch_size` (the batch) and
`training.device` are read, any other key is refused."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from meshforge.errors import MeshforgeError

READ = ("training.seq_len", "training.micro_batch_size", "training.device")


def add_arguments(parser) -> None:
    parser.add_argument("model", help="a run dir, checkpoints dir, checkpoint, or Hugging Face folder")
    parser.add_argument("overrides", nargs="*", default=[], help="data.*=... (what to evaluate perplexity on), "
                        "training.seq_len=N, training.micro_batch_size=N, training.device=cpu|cuda")
    parser.add_argument("--tasks", default=None, help="comma-separated lm-eval task names (needs meshforge[eval])")
    parser.add_argument("--include", action="append", default=[], help="a folder of lm-eval task YAML files")
    parser.add_argument("--limit", type=int, default=None, help="at most this many documents per task")
    parser.add_argument("--tokenizer", default=None, help="replaces the model's tokenizer")
    parser.add_argument("--output", default=None, help="also write the results as JSON to this file")


def run(args) -> int:
    try:
        return _run(args)
    except MeshforgeError as err:
        for p in err.problems:
            print(f"error: {p}", file=sys.stderr)
        return err.exit_code


def _run(args) -> int:
    from pydantic import ValidationError

    from meshforge.config.loader import apply_overrides
    from meshforge.config.schema import Config
    from meshforge.config.validation import format_validation_error
    from meshforge.errors import ConfigError

    keys = [o.split("=", 1)[0].strip() for o in args.overrides]
    bad = [k for k in keys if not (k.startswith("data.") or k in READ)]
    if bad:
        raise ConfigError(f"meshforge eval reads data.*, {', '.join(READ)}: {bad[0]} is not read (remove it)")
    if not args.tasks and not any(k.startswith("data.") for k in keys):
        raise ConfigError("meshforge eval: nothing to evaluate: give data.* (perplexity on those files, e.g. "
                          "data.source=dataset data.paths=[held_out.jsonl]) and/or --tasks")
    # the data and training sections alone, by the schema: the training rules (another model's preset) do not apply
    try:
        cfg = Config.model_validate(apply_overrides({}, args.overrides))
    except ValidationError as err:
        raise ConfigError(format_validation_error(err, Config)) from None
    data, t = cfg.data, cfg.training
    if args.output:  # checked before any work: never over an input, a checkpoint or a file of another kind
        import meshforge.outputs as outputs

        problem = outputs.check_file(args.output, "--output", _is_results, "a meshforge eval result",
                                     sources=[args.model])
        if problem:
            raise ConfigError(problem)
    import torch

    from meshforge.evaluation.model import load_eval_model

    device = "cuda" if t.device != "cpu" and torch.cuda.is_available() else "cpu"
    if t.device == "cuda" and device != "cuda":
        raise ConfigError("training.device=cuda but this machine has no CUDA device")
    em = load_eval_model(args.model, args.tokenizer, device)
    results = {}
    if t.seq_len > em.args.max_seq_len:
        raise ConfigError(f"training.seq_len={t.seq_len} exceeds the model's max_seq_len={em.args.max_seq_len}")
    tasks = [x.strip() for x in (args.tasks or "").split(",") if x.strip()]
    if tasks:  # found and built from their files before any model runs
        from meshforge.evaluation.harness import check_tasks

        check_tasks(tasks, args.include, args.limit)
    if any(k.startswith("data.") for k in keys):
        from meshforge.evaluation.perplexity import perplexity

        results["perplexity"] = perplexity(em, data, t.seq_len, t.micro_batch_size)
        for name, r in results["perplexity"].items():
            print(f"perplexity {name}: loss={r['loss']:.4f} ppl={r['ppl']:.4f} tokens={r['tokens']} "
                  f"samples={r['samples']}", flush=True)
    if tasks:
        from meshforge.evaluation.harness import make_lm, run_tasks

        results["tasks"] = run_tasks(make_lm(em), tasks, args.include, args.limit)
        for task, metrics in results["tasks"].items():
            print(f"task {task}: " + " ".join(f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}"
                                              for k, v in metrics.items()), flush=True)
    if args.output:
        import meshforge.outputs as outputs

        out = Path(args.output)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = outputs.temp_beside(out)
        tmp.write_text(json.dumps({"meshforge_eval": args.model, **results}, indent=1))
        outputs.publish_file(tmp, out)
    return 0


def _is_results(path: Path) -> bool:
    """An earlier `meshforge eval --output` file (the only file it overwrites)."""
    try:
        return "meshforge_eval" in json.loads(path.read_text())
    except (OSError, ValueError, TypeError):
        return False
