"""Which scaled-dot-product-attention kernel the model's own attention runs, at a real shape.

`F.scaled_dot_product_attention` picks its backend per call: flash or cuDNN when the call is eligible (no dense
mask, causal, bf16/fp16, head dim <= 256, last dim contiguous; `enable_gqa` is honoured by flash only), else
memory-efficient attention or the math fallback, which materialises the S x S scores and costs several times
more. Nothing tells the user which one ran, so this runs one forward and backward of a one-block model of the
configured shape (its own attention, RoPE and layouts: the exact call training makes, not a copy of it) under
the profiler and names the backend from the aten operators that ran. `strict` reruns it with only flash and
cuDNN (flash only on CPU) allowed: an ineligible call raises there instead of falling back.

    python -m meshforge.bench.sdpa --preset llama3_2_1b --seq-len 4096 --batch 4 [--device cuda]
"""

from __future__ import annotations

import argparse
import dataclasses

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from meshforge.models import build_model, init_weights, resolve_model_args

# aten operator name fragment -> backend (forward and backward operators both name it)
_BACKENDS = {"flash_attention": "flash", "cudnn_attention": "cudnn", "efficient_attention": "efficient",
             "attention_math": "math"}


def _backend_of(op_names: set[str]) -> str:
    found = sorted({b for name in op_names for frag, b in _BACKENDS.items() if frag in name})
    return "+".join(found) if found else "none"


def sdpa_calls(model_cfg, seq_len: int, batch: int, dtype: torch.dtype = torch.bfloat16,
               packed: bool = False) -> list[dict]:
    """The arguments the model's own attention hands `F.scaled_dot_product_attention` at this shape (one block,
    built and run on the meta device: no memory, no compute). `packed`: with document ids (a packed batch)."""
    args = dataclasses.replace(resolve_model_args(model_cfg), n_layers=1)
    model = build_model(args, device="meta").to(dtype)
    calls: list[dict] = []

    class Record(TorchFunctionMode):
        def __torch_function__(self, func, types, a=(), kw=None):
            kw = kw or {}
            if func is F.scaled_dot_product_attention:
                q, k, v = a[:3]
                calls.append({"q": q, "k": k, "v": v, "attn_mask": kw.get("attn_mask", a[3] if len(a) > 3 else None),
                              "dropout_p": kw.get("dropout_p", 0.0), "is_causal": kw.get("is_causal", False),
                              "enable_gqa": kw.get("enable_gqa", False)})
            return func(*a, **kw)

    tokens = torch.zeros(batch, seq_len, dtype=torch.long, device="meta")
    with Record(), torch.no_grad():
        if packed:
            docs = torch.zeros(batch, seq_len, dtype=torch.long, device="meta")
            model(tokens, torch.zeros_like(docs), docs)
        else:
            model(tokens)
    return calls


def flash_ineligible(call: dict) -> list[str]:
    """Why flash attention cannot take this call (empty: it can), by the conditions torch's flash backend checks:
    no dense mask, no dropout (training here has none), bf16/fp16, head dim <= 256 and a multiple of 8, the
    last dimension contiguous; `is_causal` for the causal mask without materialising it."""
    q, k, v = call["q"], call["k"], call["v"]
    out = []
    if call["attn_mask"] is not None:
        out.append("a dense attention mask (packed documents)")
    if not call["is_causal"]:
        out.append("is_causal=False")
    if call["dropout_p"]:
        out.append(f"dropout {call['dropout_p']}")
    if q.dtype not in (torch.bfloat16, torch.float16):
        out.append(f"dtype {q.dtype}")
    if q.shape[-1] > 256 or q.shape[-1] % 8:
        out.append(f"head dim {q.shape[-1]}")
    if any(t.stride(-1) != 1 for t in (q, k, v)):
        out.append("last dimension not contiguous")
    if k.shape[1] != q.shape[1] and not call["enable_gqa"]:
        out.append("fewer kv heads without enable_gqa")
    return out


def sdpa_report(model_cfg, seq_len: int, batch: int, device: torch.device, dtype: torch.dtype = torch.bfloat16,
                vocab_size: int | None = None) -> dict:
    """{"backend", "ops", "strict"} of one training forward+backward of one block of `model_cfg`'s shape, its
    parameters in `dtype` (as training.precision=bf16_params runs them). `vocab_size` shrinks the embedding and
    head only (they do not touch attention)."""
    args = resolve_model_args(model_cfg)
    args = dataclasses.replace(args, n_layers=1, **({"vocab_size": vocab_size} if vocab_size else {}))
    model = build_model(args)
    init_weights(model, 0)
    model.to(device=device, dtype=dtype)
    tokens = torch.randint(0, args.vocab_size, (batch, seq_len), device=device)

    def step() -> None:
        model(tokens).float().logsumexp(-1).mean().backward()
        model.zero_grad(set_to_none=True)

    step()  # warm up (kernel selection caches, cuDNN plans)
    activities = [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=activities) as prof:
        step()
    ops = {e.name for e in prof.events() if "attention" in e.name and e.name.startswith("aten::")}
    from torch.nn.attention import SDPBackend, sdpa_kernel

    allowed = [SDPBackend.FLASH_ATTENTION] + ([SDPBackend.CUDNN_ATTENTION] if device.type == "cuda" else [])
    try:
        with sdpa_kernel(allowed):
            step()
        strict = "ok"
    except RuntimeError as err:  # no allowed kernel takes this call
        strict = "refused: " + (str(err).strip().splitlines() or ["?"])[0][:160]
    return {"backend": _backend_of(ops), "ops": sorted(ops), "strict": strict,
            "shape": {"batch": batch, "seq_len": seq_len, "n_heads": args.n_heads, "n_kv_heads": args.n_kv_heads,
                      "head_dim": args.hd, "dtype": str(dtype).removeprefix("torch.")}}


def line(report: dict) -> str:
    s = report["shape"]
    return (f"SDPA kernel: {report['backend']} (batch {s['batch']}, seq {s['seq_len']}, {s['n_heads']} q / "
            f"{s['n_kv_heads']} kv heads, head dim {s['head_dim']}, {s['dtype']}); flash/cuDNN only: "
            f"{report['strict']}; ops: {', '.join(report['ops'])}")


def main() -> None:
    from meshforge.config.schema import ModelConfig

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="llama3_2_1b")
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--vocab-size", type=int, default=None)
    p.add_argument("--out", default=None, help="also append the line to this file")
    a = p.parse_args()
    report = sdpa_report(ModelConfig(preset=a.preset), a.seq_len, a.batch, torch.device(a.device),
                         vocab_size=a.vocab_size)
    text = line(report)
    print(text, flush=True)
    if a.out:
        with open(a.out, "a") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
