"""Decoding speed with the KV cache against a full recompute each token (`meshforge generate --no-cache`).

A built-in preset with seeded random weights, greedy, a batch of `--batch` prompts of `--prompt-len` tokens,
`--new` new tokens each, on `--device`; the best of `--repeat` runs per mode. Prints tokens/s for both and the ratio,
and checks both produce the same tokens.

    python benchmarks/generate_kv_cache.py [--preset tiny] [--batch 4] [--prompt-len 64] [--new 64] [--device cpu]
"""

from __future__ import annotations

import argparse
import time

import torch


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="tiny")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--device", default="cpu")
    a = p.parse_args()

    from meshforge.config.schema import ModelConfig
    from meshforge.generation.decode import Sampling, generate_ids
    from meshforge.models import build_model, init_weights, resolve_model_args

    args = resolve_model_args(ModelConfig(preset=a.preset))
    model = build_model(args)
    init_weights(model, 0)
    model.to(a.device).eval()
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, args.vocab_size, (a.batch, a.prompt_len), generator=g).tolist()
    out, speed = {}, {}
    for cache in (True, False):
        best = float("inf")
        for _ in range(a.repeat):
            t0 = time.perf_counter()
            out[cache] = generate_ids(model, prompts, a.new, Sampling(), set(), args.max_seq_len, use_cache=cache)
            if a.device.startswith("cuda"):
                torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t0)
        speed[cache] = sum(map(len, out[cache])) / best
        print(f"{'KV cache' if cache else 'no cache':>9}: {speed[cache]:9.1f} tokens/s ({best:.3f} s)")
    print(f"KV cache / no cache: {speed[True] / speed[False]:.2f}x; same tokens: {out[True] == out[False]}")


if __name__ == "__main__":
    main()
