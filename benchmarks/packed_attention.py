"""Packed-sequence attention speed: milliseconds per forward+backward of the attention op alone, (B, H, S, D) with
grouped-query heads, `--docs` documents per row at random boundaries, for
- `causal`: unpacked causal SDPA (`is_causal`, the flash kernel on CUDA): the ceiling;
- `dense mask`: SDPA with the dense (B, 1, S, S) document mask (what CPU runs; off flash on CUDA);
- `block mask`: FlexAttention with the document block mask, compiled (what CUDA runs; CUDA only, FlexAttention
  has no CPU backward), the block mask's build timed apart (once per micro batch, shared by every layer).
Peak memory on CUDA. Numbers, no assertions.

    python benchmarks/packed_attention.py [--seq-len 4096] [--batch 4] [--heads 32] [--kv-heads 8] [--docs 8]
    python benchmarks/packed_attention.py --seq-len 256 --batch 2 --heads 4 --kv-heads 2   # CPU, seconds
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F


def _time(fn, device: torch.device, steps: int, warmup: int) -> tuple[float, float]:
    """(median ms, peak GiB above the start; 0 on CPU)."""
    for _ in range(warmup):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t) * 1e3)
    peak = (torch.cuda.max_memory_allocated() - base) / 2**30 if device.type == "cuda" else 0.0
    return sorted(times)[len(times) // 2], peak


def main() -> None:
    from meshforge.models.attention import dense_document_mask, document_block_mask, masked_attention

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--docs", type=int, default=8, help="documents per row")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = p.parse_args()
    device = torch.device(a.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    g = torch.Generator().manual_seed(0)
    b, s = a.batch, a.seq_len
    cuts = torch.stack([torch.randperm(s - 1, generator=g)[: a.docs - 1].sort().values + 1 for _ in range(b)])
    docs = torch.zeros(b, s, dtype=torch.long)
    docs.scatter_(1, cuts, 1)
    docs = docs.cumsum(1).to(device)
    q, k, v = (torch.randn(b, n, s, a.head_dim, generator=g).to(device, dtype).requires_grad_(True)
               for n in (a.heads, a.kv_heads, a.kv_heads))

    def step(attend):
        def run():
            attend().float().sum().backward()
            q.grad = k.grad = v.grad = None
        return run

    rows = [("causal", step(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)))]
    dense = dense_document_mask(docs)
    rows.append(("dense mask", step(lambda: masked_attention(q, k, v, dense))))
    if device.type == "cuda":
        block = document_block_mask(docs)
        rows.append(("block mask", step(lambda: masked_attention(q, k, v, block))))
        rows.append(("  (block mask build)", lambda: document_block_mask(docs)))
    print(f"packed attention fwd+bwd: batch {b}, seq {s}, {a.heads} q / {a.kv_heads} kv heads, head dim "
          f"{a.head_dim}, {a.docs} documents a row, {str(dtype).removeprefix('torch.')}, {device.type}")
    base = None
    for name, fn in rows:
        ms, gib = _time(fn, device, a.steps, a.warmup)
        base = base or ms
        peak = f"  peak {gib:6.2f} GiB" if device.type == "cuda" else ""
        print(f"  {name:<22} {ms:9.2f} ms  x{ms / base:5.2f} of causal{peak}", flush=True)


if __name__ == "__main__":
    main()
