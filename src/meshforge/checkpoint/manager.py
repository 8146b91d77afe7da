"""Save and resume a run: model, optimizer, scheduler, data position and RNG states.

Layout: `<dir>/step_<N>/` holds DCP shards of model + optimizer (every rank writes
its own) and `trainer_state.pt` per rank; a save goes to `step_<N>.partial/` and is
renamed when complete, then `LATEST` is replaced atomically, so a crash leaves
LATEST on the previous complete checkpoint.
"""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from meshforge.checkpoint.errors import CheckpointError


def checkpoint_dir(cfg) -> Path:
    return Path(cfg.checkpoint.dir or os.path.join(cfg.run.output_dir, "checkpoints"))


def has_checkpoint(cfg) -> bool:
    return (checkpoint_dir(cfg) / "LATEST").is_file()


def _barrier(mesh_ctx) -> None:
    if mesh_ctx.world_size > 1:
        dist.barrier()


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class CheckpointManager:
    def __init__(self, cfg, mesh_ctx, info):
        self.cfg, self.mesh_ctx, self.info = cfg, mesh_ctx, info
        self.root = checkpoint_dir(cfg)

    # ------------------------------------------------------------------ state
    def _app_state(self, pm, optimizer) -> dict:
        opts = StateDictOptions(full_state_dict=False)
        models = pm.unwrapped_parts() if len(pm.parts) > 1 else pm.parts
        msd, osd = {}, {}
        for part in models:
            msd.update(get_model_state_dict(part, options=opts))
        osd = get_optimizer_state_dict(models[0] if len(models) == 1 else models, optimizer, options=opts)
        return {"model": msd, "optim": osd}

    def save(self, step: int, pm, optimizer, scheduler, loader) -> Path:
        final = self.root / f"step_{step}"
        partial = self.root / f"step_{step}.partial"
        if self.info.is_main:
            shutil.rmtree(partial, ignore_errors=True)
            partial.mkdir(parents=True, exist_ok=True)
        _barrier(self.mesh_ctx)
        dcp.save(self._app_state(pm, optimizer), checkpoint_id=str(partial))
        torch.save({"step": step, "scheduler": scheduler.state_dict(), "loader": loader.state_dict(),
                    "rng": rng_state()}, partial / f"trainer_state_rank{self.info.rank}.pt")
        _barrier(self.mesh_ctx)
        if self.info.is_main:
            shutil.rmtree(final, ignore_errors=True)
            partial.rename(final)
            tmp = self.root / "LATEST.tmp"
            tmp.write_text(final.name)
            os.replace(tmp, self.root / "LATEST")
        _barrier(self.mesh_ctx)
        return final

    def maybe_save(self, step: int, pm, optimizer, scheduler, loader, final: bool = False) -> None:
        c = self.cfg.checkpoint
        if (c.interval and step % c.interval == 0) or (final and c.save_final):
            self.save(step, pm, optimizer, scheduler, loader)

    def resume(self, pm, optimizer, scheduler, loader) -> int:
        r = self.cfg.checkpoint.resume
        if r is None:
            return 0
        if r == "auto":
            if not has_checkpoint(self.cfg):
                return 0
            path = self.root / (self.root / "LATEST").read_text().strip()
        else:
            path = Path(r)
        if not path.is_dir():
            raise CheckpointError(f"checkpoint.resume: {str(path)!r} is not a checkpoint directory")
        state = self._app_state(pm, optimizer)
        dcp.load(state, checkpoint_id=str(path))
        models = pm.unwrapped_parts() if len(pm.parts) > 1 else pm.parts
        for part in models:
            set_model_state_dict(part, state["model"], options=StateDictOptions(strict=False))
        set_optimizer_state_dict(models[0] if len(models) == 1 else models, optimizer, state["optim"])
        ts_path = path / f"trainer_state_rank{self.info.rank}.pt"
        if not ts_path.exists():
            ts_path = path / "trainer_state_rank0.pt"
        ts = torch.load(ts_path, weights_only=False)
        scheduler.load_state_dict(ts["scheduler"])
        loader.load_state_dict(ts["loader"])
        set_rng_state(ts["rng"])
        return int(ts["step"])

    def close(self) -> None:
        pass
