"""Example recipes as Python functions, in the style of the spec's `llama3_8b_pretrain_config()`.

Each returns a validated `Config` that can be edited attribute by attribute
(`cfg.distributed.strategy = "megatron_fsdp"`; assignments are type-checked at
once, cross-field rules at `cfg.validate()` and again at `meshforge.train(cfg)`).
"""

from __future__ import annotations

from meshforge.config.loader import resolve
from meshforge.config.schema import Config


def _build(raw: dict) -> Config:
    return resolve(raw)


def tiny_cpu_config() -> Config:
    """The README's default run: the tiny model on the Python standard library's sources, on CPU."""
    return _build({
        "run": {"name": "tiny_cpu", "output_dir": "runs/tiny_cpu", "seed": 1234},
        "model": {"preset": "tiny"},
        "data": {"source": "text", "max_files": 60},
        "optimizer": {"lr": 3e-3, "weight_decay": 0.1},
        "scheduler": {"name": "cosine", "warmup_steps": 20},
        "training": {"max_steps": 300, "global_batch_size": 16, "micro_batch_size": 16, "seq_len": 128,
                     "device": "cpu"},
        "logging": {"log_every": 25},
    })


def _llama_pretrain(preset: str, name: str) -> dict:
    return {
        "run": {"name": name, "output_dir": f"runs/{name}"},
        "model": {"preset": preset, "init_device": "auto"},
        "data": {"source": "synthetic"},
        "distributed": {"strategy": "fsdp2", "activation_checkpointing": "selective"},
        "optimizer": {"lr": 3e-4, "weight_decay": 0.1, "betas": [0.9, 0.95]},
        "scheduler": {"name": "cosine", "warmup_steps": 2000, "min_lr_ratio": 0.1},
        "training": {"max_steps": 100000, "global_batch_size": 512, "micro_batch_size": 1, "seq_len": 8192,
                     "precision": "bf16", "grad_clip": 1.0},
        "checkpoint": {"interval": 1000, "keep_last": 3},
        "logging": {"log_every": 10},
    }


def llama3_2_1b_pretrain_config() -> Config:
    raw = _llama_pretrain("llama3_2_1b", "llama3_2_1b")
    raw["training"].update(seq_len=4096, micro_batch_size=4)
    raw["distributed"]["activation_checkpointing"] = False
    return _build(raw)


def llama3_8b_pretrain_config() -> Config:
    return _build(_llama_pretrain("llama3_8b", "llama3_8b"))


def llama3_70b_pretrain_config() -> Config:
    raw = _llama_pretrain("llama3_70b", "llama3_70b")
    raw["distributed"].update(tp_size=8, pp_size=4, sequence_parallel=True,
                              pipeline={"pp_schedule": "interleaved_1f1b", "pp_microbatch_size": 1,
                                        "virtual_stages_per_rank": 2})
    raw["training"]["micro_batch_size"] = 4
    return _build(raw)
