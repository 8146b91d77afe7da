"""The plain-PyTorch ceiling for one GPU: the same Llama module, whole-model `torch.compile`, bf16 autocast,
fused AdamW, plain cross-entropy on logits: what a careful hand-written loop reaches with no framework at all.

    python benchmarks/llama_ceiling.py --preset llama3_2_1b --seq-len 4096 --micro-batch 4 --out ceiling.json

Prints one JSON row (tokens/s, TFLOP/s, MFU, peak GiB) and writes it to --out; `gpu_throughput.sh` puts it
in the table beside meshforge's rows. On CPU (the tiny end-to-end check) it runs eager unless --compile.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

from meshforge.bench.measure import step_stats, sync, throughput_fields
from meshforge.config.schema import ModelConfig
from meshforge.models import build_model, init_weights
from meshforge.training.metrics import device_peak_tflops, max_memory_gib


def measure(preset: str, seq_len: int, micro_batch: int, steps: int, warmup: int, compile_model: bool,
            device: torch.device) -> dict:
    model = build_model(ModelConfig(preset=preset))
    init_weights(model, seed=0)
    model.to(device).train()
    vocab = model.args.vocab_size
    step_model = torch.compile(model) if compile_model else model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, vocab, (micro_batch, seq_len + 1), generator=g).to(device)
    inputs, labels = x[:, :-1], x[:, 1:]
    bf16 = device.type == "cuda"

    def step():
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            logits = step_model(inputs)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    for _ in range(warmup):
        step()
    sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        sync(device)
        times.append(time.perf_counter() - t0)
    stats = step_stats(times)
    row = {"name": "plain PyTorch ceiling", "preset": preset, "seq_len": seq_len, "micro_batch": micro_batch,
           "compile": compile_model, "precision": "bf16" if bf16 else "fp32", "step_s_median": stats["step_s_median"],
           "peak_gib": max_memory_gib(device)}
    row.update(throughput_fields(stats["step_s_median"], micro_batch * seq_len, 1, model.flops_per_token(seq_len),
                                 device_peak_tflops(device)))
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="llama3_2_1b")
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--compile", choices=["auto", "true", "false"], default="auto", help="auto: on CUDA only")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    compile_model = device.type == "cuda" if a.compile == "auto" else a.compile == "true"
    row = measure(a.preset, a.seq_len, a.micro_batch, a.steps, a.warmup, compile_model, device)
    print(json.dumps(row))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(row, f)


if __name__ == "__main__":
    main()
