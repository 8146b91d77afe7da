"""Training-state bytes per rank: full fine-tuning vs LoRA (fp32 AdamW), from the model's shapes.

The accounting is `meshforge.bench.peft_memory.state_bytes` (equal, byte for byte, to the bench's measured
storage count at one rank: see tests/unit/test_lora.py); activations are not included. fsdp2 rows: every
parameter's dim-0 chunk; megatron_fsdp rows (optim_grads_params, rank 0): its per-unit flat buffers, where the
frozen base has its own buffer with no gradient and no fp32 main copy (equal to its `memory_report`, same test).

Usage: python benchmarks/lora_memory.py [--preset llama3_2_1b] [--rank 16] [--dp-shards 1 8]
                                        [--strategies fsdp2 megatron_fsdp]
"""

from __future__ import annotations

import argparse

from meshforge.bench.peft_memory import state_bytes
from meshforge.config import load_config

TARGETS = {"attention": "[q_proj,k_proj,v_proj,o_proj]", "all-linear": "['*_proj']"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="llama3_2_1b")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--dp-shards", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--strategies", nargs="+", default=["fsdp2", "megatron_fsdp"],
                    choices=["fsdp2", "megatron_fsdp"])
    a = ap.parse_args()
    rows = [("full fine-tuning", None)]
    for name, targets in TARGETS.items():
        cfg = load_config(None, [f"model.preset={a.preset}", f"peft.rank={a.rank}", f"peft.target_modules={targets}"])
        rows.append((f"LoRA r{a.rank} {name}", cfg.peft))
    model_cfg = load_config(None, [f"model.preset={a.preset}"]).model
    print(f"preset {a.preset}: training-state bytes per rank (fp32 params, grads, AdamW state)")
    print(f"{'strategy':<15}{'run':<26}{'N':>3}{'trainable':>15}{'params B':>16}{'grads B':>16}{'optimizer B':>16}"
          f"{'total B':>16}")
    for strategy in a.strategies:
        for n in a.dp_shards:
            for label, peft in rows:
                s = state_bytes(model_cfg, peft, n, strategy=strategy)
                print(f"{strategy:<15}{label:<26}{n:>3}{s['trainable_params']:>15,}{s['params']:>16,}"
                      f"{s['grads']:>16,}{s['optimizer']:>16,}{s['total']:>16,}")


if __name__ == "__main__":
    main()
