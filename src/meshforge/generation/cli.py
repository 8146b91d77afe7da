"""`meshforge generate SOURCE`: text from a run's checkpoint or a Hugging Face folder (load.py), one process.

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
    p.add_argument("overrides", nargs="*", help="model.key=value edits of the run's config.yaml")
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


def generate(args) -> int:
    import torch

    from meshforge.data.tokenizer import check_vocab
    from meshforge.generation.decode import Sampling, generate_ids
    from meshforge.generation.load import load
    from meshforge.generation.prompts import check_prompts, encode_prompts, read_prompts

    sampling = Sampling(args.temperature, args.top_k, args.top_p, args.seed)
    problems = sampling.problems() + ([f"--max-new-tokens={args.max_new_tokens} must be positive"]
                                      if args.max_new_tokens < 1 else [])
    if problems:
        raise MeshforgeError(problems)
    prompts = read_prompts(args.prompt, args.prompts_file)
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device)
    loaded = load(args.source, args.overrides, args.tokenizer, device,
                  torch.bfloat16 if args.dtype == "bf16" else torch.float32)
    tok = loaded.tokenizer
    if tok is None:
        raise MeshforgeError(f"{loaded.where} names no tokenizer: pass --tokenizer (a tokenizer.json or folder)")
    check_vocab(tok, loaded.args.vocab_size)
    ids = encode_prompts(prompts, tok, args.chat)
    check_prompts(ids, loaded.context)
    t0 = time.perf_counter()
    new = generate_ids(loaded.model, ids, args.max_new_tokens, sampling, loaded.stop_ids(), loaded.context,
                       use_cache=not args.no_cache, pad_id=tok.pad_id)
    seconds = time.perf_counter() - t0
    for prompt, p_ids, n_ids in zip(prompts, ids, new):
        text = tok.decode([t for t in n_ids if t not in loaded.stop_ids()])
        if args.json:
            print(json.dumps({"prompt": prompt, "completion": text, "prompt_ids": p_ids, "ids": n_ids}))
        else:
            print(f"--- {prompt if isinstance(prompt, str) else prompt[-1]['content']}\n{text}")
    n = sum(len(x) for x in new)
    print(f"generated {n} tokens for {len(new)} prompt(s) in {seconds:.2f} s ({n / max(seconds, 1e-9):.1f} tokens/s, "
          f"{'no KV cache' if args.no_cache else 'KV cache'}) from {loaded.where}", file=sys.stderr)
    return 0


def run(args) -> int:
    try:
        return generate(args)
    except MeshforgeError as err:
        for line in err.problems:
            print(f"error: {line}", file=sys.stderr)
        return err.exit_code
