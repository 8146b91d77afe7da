"""`meshforge generate SOURCE`: text from a run's checkpoint or a Hugging Face folder (load.py), on one process, or
with `--nproc-per-node N` tensor-parallel over N (parallel.py).

Prompts come from `--prompt` (repeatable) and `--prompts-file` (one prompt a line; a .jsonl file: objects with
`prompt` or chat `messages`). The tokenizer's chat template wraps each prompt as a user turn when it has one
(`--chat` demands it, one line if there is none; `--no-chat` feeds the text as is). All prompts run as one batch
(left-padded). Bad input is one line, exit 2.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from meshforge.errors import MeshforgeError


def add_arguments(p) -> None:
    p.add_argument("source", help="a run directory (its latest checkpoint), a checkpoint step_N, or a Hugging Face "
                   "model folder (e.g. an export)")
    p.add_argument("overrides", nargs="*", default=[], help="model.key=value edits of the run's config.yaml")
    p.add_argument("--prompt", "-p", action="append", default=[], help="a prompt (repeat for a batch)")
    p.add_argument("--prompts-file", default=None, help="one prompt a line; .jsonl: {prompt} or {messages} objects")
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                   help="apply the tokenizer's chat template (default: when it has one)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-cache", action="store_true", help="recompute the whole sequence each token (no KV cache)")
    p.add_argument("--tokenizer", default=None, help="a tokenizer.json or folder (default: the run's or folder's)")
    p.add_argument("--device", default="auto", help="auto (cuda when available), cpu, cuda, cuda:N")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--json", action="store_true", help="one JSON object a prompt: prompt, completion, token ids")
    p.add_argument("--nproc-per-node", type=int, default=None, help="N local processes, the model tensor-parallel "
                   "over them (it needs a TP plan)")


_VALUE_FLAGS = ("prompts_file", "max_new_tokens", "temperature", "top_k", "top_p", "seed", "tokenizer", "device",
                "dtype")


def rank_argv(args) -> list[str]:
    """The command line each launched rank runs: these arguments without --nproc-per-node."""
    argv = ["generate", args.source, *args.overrides, *[a for p in args.prompt for a in ("--prompt", p)]]
    for key in _VALUE_FLAGS:
        if getattr(args, key) is not None:
            argv += ["--" + key.replace("_", "-"), str(getattr(args, key))]
    if args.chat is not None:
        argv.append("--chat" if args.chat else "--no-chat")
    return argv + [f for f, on in (("--no-cache", args.no_cache), ("--json", args.json)) if on]


def checked(args) -> tuple:
    """(Sampling, prompts) of the flags, or one line per problem (before any process is launched)."""
    from meshforge.generation.decode import Sampling
    from meshforge.generation.prompts import read_prompts

    sampling = Sampling(args.temperature, args.top_k, args.top_p, args.seed)
    problems = sampling.problems() + [f"--{k}={v} must be at least 1" for k, v in (
        ("max-new-tokens", args.max_new_tokens), ("nproc-per-node", args.nproc_per_node)) if v is not None and v < 1]
    if problems:
        raise MeshforgeError(problems)
    return sampling, read_prompts(args.prompt, args.prompts_file)


def complete(args, info=None) -> tuple[list[dict], str]:
    """Each prompt's completion ({prompt, completion, prompt_ids, ids}) and a line on the speed; with `info` (a
    launched rank), tensor-parallel over all ranks."""
    import torch

    from meshforge.data.tokenizer import check_vocab
    from meshforge.generation.decode import generate_ids
    from meshforge.generation.load import load
    from meshforge.generation.prompts import check_prompts, encode_prompts

    sampling, prompts = checked(args)
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device)
    if info is not None:
        device = info.device
    loaded = load(args.source, args.overrides, args.tokenizer, device,
                  torch.bfloat16 if args.dtype == "bf16" else torch.float32)
    tok = loaded.tokenizer
    if tok is None:
        raise MeshforgeError(f"{loaded.where} names no tokenizer: pass --tokenizer (a tokenizer.json or folder)")
    check_vocab(tok, loaded.args.vocab_size)
    ids = encode_prompts(prompts, tok, args.chat)
    check_prompts(ids, loaded.context)
    if info is not None:
        from meshforge.generation.parallel import shard_tp

        shard_tp(loaded.model, info)
    t0 = time.perf_counter()
    new = generate_ids(loaded.model, ids, args.max_new_tokens, sampling, loaded.stop_ids(), loaded.context,
                       use_cache=not args.no_cache, pad_id=tok.pad_id)
    seconds = time.perf_counter() - t0
    records = [{"prompt": prompt, "completion": tok.decode([t for t in n_ids if t not in loaded.stop_ids()]),
                "prompt_ids": p_ids, "ids": n_ids} for prompt, p_ids, n_ids in zip(prompts, ids, new)]
    n = sum(len(x) for x in new)
    tp = f", tensor-parallel over {info.world_size}" if info is not None else ""
    return records, (f"generated {n} tokens for {len(new)} prompt(s) in {seconds:.2f} s ({n / max(seconds, 1e-9):.1f} "
                     f"tokens/s, {'no KV cache' if args.no_cache else 'KV cache'}{tp}) from {loaded.where}")


def generate(args) -> int:
    import os

    if "RANK" in os.environ and int(os.environ.get("WORLD_SIZE", 1)) > 1:  # a launched rank
        from meshforge.generation.parallel import launched_rank

        with launched_rank(args.device) as info:
            records, summary = complete(args, info)
        if info.rank != 0:
            return 0
    else:
        records, summary = complete(args)
    for r in records:
        prompt = r["prompt"] if isinstance(r["prompt"], str) else r["prompt"][-1]["content"]
        print(json.dumps(r) if args.json else f"--- {prompt}\n{r['completion']}")
    print(summary, file=sys.stderr)
    return 0


def run(args) -> int:
    import os

    try:
        checked(args)
        if args.nproc_per_node and args.nproc_per_node > 1 and "RANK" not in os.environ:  # launch the ranks
            from meshforge.launch import run_cli

            return run_cli(args.nproc_per_node, rank_argv(args))
        return generate(args)
    except MeshforgeError as err:
        for line in err.problems:
            print(f"error: {line}", file=sys.stderr)
        return err.exit_code
