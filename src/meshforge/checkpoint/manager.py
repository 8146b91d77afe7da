"""Save and resume a run: model, optimizer, scheduler, step, data position and RNG states; a commit that never lies.

Layout of `checkpoint.dir` (default `<run.output_dir>/checkpoints`; paths and the manifest in `files.py`)::

    LATEST                      one line: the name of the newest complete checkpoint ("step_20")
    step_<N>/                   a complete checkpoint:
        .metadata, __R_I.distcp   DCP (torch.distributed.checkpoint): model + optimizer, each rank its shards
        trainer_state_rank<R>.pt  per rank: step, scheduler, loader position, RNG (torch, cuda, numpy, python);
                                  plain tensors/containers only, loaded with `weights_only=True`
        manifest.json             written last: step, config digest, world layout, every file's bytes + sha256
    hf/step_<N>/                `checkpoint.save_consolidated`: Hugging Face safetensors + config.json

Commit protocol: every rank writes into `step_<N>.partial/`; a barrier; the ranks hash the files
(split among them) and rank 0 writes `manifest.json`, renames the directory to `step_<N>/` and atomically
replaces `LATEST` (write `LATEST.tmp`, fsync, `os.replace`). A crash at any point leaves `LATEST` on the
previous complete checkpoint; leftover `*.partial` directories are removed, with a log line, when the next
manager starts. `keep_last` deletes the oldest complete checkpoints, never the one `LATEST` names.

Formats (`config.rules.resolved_ckpt_format`): `fsdp_dtensor` saves the strategy's sharded (DTensor) state,
every rank writing its own shards; `torch_dist` saves the plain full (unsharded) state (what ddp holds; a
sharded strategy gathers it first). Both are DCP, so either loads at another world size and under another
strategy: a load always asks for the current model's own (sharded) state and DCP reshards.

`checkpoint.async_save`: DCP `async_save` (THREAD mode, on a separate gloo process group); the state is
staged to CPU before it returns, the write and the commit run in the background while training continues;
a second save, `close()` and every resume wait for the first. A preemption save (`save()` called by the
trainer after SIGTERM/SIGUSR1) is always synchronous and reports its time against `grace_period_s`.

Resume (`checkpoint.resume`): `auto` takes `LATEST` when there is one; if that checkpoint is corrupt
(missing or truncated file, checksum mismatch) it falls back to the previous complete one and says so; a
path (checkpoint dir, checkpoints dir with LATEST, or run dir) is used as given, with no fallback; `none`
starts fresh. Before anything is loaded, every file is checked against the manifest and every parameter's
shape against the model; a failure is a one-line `CheckpointError` (exit 2 from the CLI) naming the file or
the parameter and both shapes.

What is saved is whatever the strategy's state-dict methods return (`distributed/strategy.py`: DCP by
default, megatron_fsdp's own); the manager never learns which strategy produced it. `before_commit`
(None by default) is called after this rank's files are written and before the commit: the fault-injection
tests kill a rank there (`training/faults.py`).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import datetime
import hashlib
import json
import os
import random
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor

from meshforge.checkpoint.files import (
    DCP_ERRORS,
    FORMAT_VERSION,
    MANIFEST,
    _fsync_dir,
    all_gather_object,
    barrier,
    check_model_keys,
    checkpoint_dir,
    complete_checkpoints,
    dcp_error_line,
    dcp_load,
    dist_on,
    file_entry,
    log,
    read_latest,
    resolve_checkpoint_path,
    verify_files,
    write_atomic,
)
from meshforge.checkpoint.hf import export_checkpoint, hf_config_of, tokenizer_of
from meshforge.checkpoint.peft import adapter_manifest, check_adapter_checkpoint, trainable_names
from meshforge.config.rules import resolved_ckpt_format
from meshforge.config.schema import BRIDGE_SECTIONS
from meshforge.distributed.master_weights import MasterWeightAdamW
from meshforge.errors import CheckpointError
from meshforge.models import resolve_model_args


def config_digest(cfg) -> str:
    d = cfg.model_dump(mode="json", exclude=BRIDGE_SECTIONS)
    d.get("checkpoint", {}).pop("resume", None)
    return hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()


def model_args_dict(cfg) -> dict:
    return dataclasses.asdict(resolve_model_args(cfg.model))


# --------------------------------------------------------------------------------- RNG
def rng_state() -> dict:
    """All RNG states as tensors and plain containers (loadable with weights_only=True)."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    version, internal, gauss = random.getstate()
    state = {"torch": torch.get_rng_state(),
             "numpy": {"kind": kind, "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)), "pos": int(pos),
                       "has_gauss": int(has_gauss), "cached": float(cached)},
             "python": {"version": version, "internal": list(internal), "gauss": gauss}}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached"]))
    p = state["python"]
    random.setstate((p["version"], tuple(p["internal"]), p["gauss"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _with_masters(model_state: dict, optimizer) -> dict:
    """training.precision=bf16_params at world size 1: the checkpoint holds the fp32 master weights in place of
    the bf16 parameters (loading them rounds them into the parameters), so a resume is exact."""
    return optimizer.master_state_dict(model_state) if isinstance(optimizer, MasterWeightAdamW) else model_state


# ---------------------------------------------------------------------------- manager
class CheckpointManager:
    def __init__(self, cfg, mesh_ctx, info):
        self.cfg, self.mesh_ctx, self.info = cfg, mesh_ctx, info
        self.root = checkpoint_dir(cfg)
        self.fmt = resolved_ckpt_format(cfg)
        self.rank, self.world = info.rank, info.world_size
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._pending: concurrent.futures.Future | None = None
        self._pg = None
        self.last_saved: Path | None = None
        self.resumed_from: Path | None = None
        self.resumed_tokenizer: str | None = None  # the resumed checkpoint's, kept when this run names none
        self.before_commit: Callable[[int], None] | None = None  # (step) -> None; fault-injection tests
        self._clean_partials()

    # ------------------------------------------------------------------ housekeeping
    def _clean_partials(self) -> None:
        if self.rank == 0 and self.root.is_dir():
            for p in sorted([*self.root.glob("*.partial"), *self.root.glob("hf/*.partial")]):
                shutil.rmtree(p, ignore_errors=True)
                log(f"removed leftover {p.relative_to(self.root)} (an interrupted save; LATEST was never moved to it)")
            (self.root / "LATEST.tmp").unlink(missing_ok=True)
        barrier()

    def _group(self):
        """A separate gloo group for background saves, so they never interleave with training collectives."""
        if self.world > 1 and self._pg is None:
            self._pg = dist.new_group(backend="gloo")
        return self._pg

    def _retention(self) -> None:
        k = self.cfg.checkpoint.keep_last
        if not k:
            return
        latest = read_latest(self.root)
        done = complete_checkpoints(self.root)
        keep = set(done[:k]) | ({latest} if latest else set())
        for p in done:
            if p not in keep:
                shutil.rmtree(p, ignore_errors=True)
                log(f"keep_last={k}: deleted {p.name}")

    # ------------------------------------------------------------------------- state
    def _app_state(self, pm, optimizer, for_save: bool) -> dict:
        s, parts = pm.strategy, pm.state_parts()
        msd: dict = {}
        for part in parts:
            msd.update(s.model_state_dict(part))
        # torch_dist saves plain full tensors: a sharded strategy gathers them (rank 0 holds them on CPU)
        full = for_save and self.fmt == "torch_dist" and any(isinstance(v, DTensor) for v in msd.values())
        if full:
            msd = {}
            for part in parts:
                msd.update(s.model_state_dict(part, full=True))
        if self.cfg.peft is not None:  # adapter-only: the frozen base comes from peft_base, not the checkpoint
            trainable = trainable_names(pm)
            msd = {k: v for k, v in msd.items() if k in trainable}
        return {"model": _with_masters(msd, optimizer), "optim": s.optimizer_state_dict(parts, optimizer, full=full)}

    def _load_app_state(self, pm, optimizer, state: dict) -> None:
        s, parts = pm.strategy, pm.state_parts()
        for part in parts:
            s.load_model_state_dict(part, state["model"])
        if "optim" in state:
            s.load_optimizer_state_dict(parts, optimizer, state["optim"])

    def _manifest_base(self, step: int) -> dict:
        layout = self.mesh_ctx.layout
        peft = adapter_manifest(self.cfg)
        return {"format_version": FORMAT_VERSION, "step": step, **peft,
                "contents": ["adapter" if peft else "model", "optim", "trainer_state"],
                "ckpt_format": self.fmt, "strategy": self.cfg.distributed.strategy, "world_size": self.world,
                "layout": layout.named_shape(),
                "config_digest": config_digest(self.cfg), "model_args": model_args_dict(self.cfg),
                "tokenizer": tokenizer_of(self.cfg) or self.resumed_tokenizer,  # for the export's tokenizer files
                "hf_config": hf_config_of(self.cfg),  # model.hf_model: its config.json, for the export
                "torch_version": torch.__version__,
                "created_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")}

    # -------------------------------------------------------------------------- save
    def _due(self, step: int, final: bool) -> tuple[bool, bool]:
        """(save a checkpoint, export consolidated HF weights) at this step."""
        c = self.cfg.checkpoint
        due = bool(c.interval and step % c.interval == 0)
        consolidated = (c.save_consolidated == "every" and (due or final)) or (c.save_consolidated == "final" and final)
        return due or (final and c.save_final) or consolidated, consolidated

    def will_save(self, step: int, final: bool = False) -> bool:
        return self._due(step, final)[0]

    def maybe_save(self, step: int, pm, optimizer, scheduler, loader, final: bool = False) -> None:
        save, consolidated = self._due(step, final)
        if save:
            self._save(step, pm, optimizer, scheduler, loader, allow_async=True)
        if consolidated:
            self.export_consolidated(step)

    def save(self, step: int, pm, optimizer, scheduler, loader) -> Path:
        """A synchronous save (what the trainer calls on SIGTERM/SIGUSR1), timed against grace_period_s."""
        t0 = time.perf_counter()
        path = self._save(step, pm, optimizer, scheduler, loader, allow_async=False)
        dt, grace = time.perf_counter() - t0, self.cfg.checkpoint.grace_period_s
        log(f"synchronous save of step {step} took {dt:.2f} s (checkpoint.grace_period_s={grace:g})",
             warn=dt > grace)
        return path

    def _save(self, step: int, pm, optimizer, scheduler, loader, allow_async: bool) -> Path:
        self.wait()
        final = self.root / f"step_{step}"
        if self.last_saved == final:
            return final  # already saved at this step (interval and final, or a stop right after a save)
        partial = self.root / f"step_{step}.partial"
        t0 = time.perf_counter()
        if self.rank == 0:
            shutil.rmtree(partial, ignore_errors=True)
            partial.mkdir(parents=True, exist_ok=True)
        barrier()
        state = self._app_state(pm, optimizer, for_save=True)
        trainer_state = {"step": step, "scheduler": scheduler.state_dict(), "loader": loader.state_dict(),
                         "rng": rng_state()}
        use_async = allow_async and self.cfg.checkpoint.async_save
        if use_async:
            group = self._group()
            fut = dcp.async_save(state, checkpoint_id=str(partial), process_group=group, no_dist=not dist_on())
            del state  # staged to CPU already: training may change the parameters now
            torch.save(trainer_state, partial / f"trainer_state_rank{self.rank}.pt")
            if self._executor is None:
                self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="meshforge-ckpt")
            self._pending = self._executor.submit(self._finish_async, fut, step, partial, final, group, t0)
        else:
            dcp.save(state, checkpoint_id=str(partial), no_dist=not dist_on())
            torch.save(trainer_state, partial / f"trainer_state_rank{self.rank}.pt")
            self._commit(step, partial, final, None, t0)
        self.last_saved = final
        return final

    def _finish_async(self, fut, step, partial, final, group, t0) -> None:
        fut.result()
        self._commit(step, partial, final, group, t0, background=True)

    def _commit(self, step: int, partial: Path, final: Path, group, t0: float, background: bool = False) -> None:
        if self.before_commit is not None:
            self.before_commit(step)
        barrier(group)  # every rank's files are on disk
        names = sorted(p.name for p in partial.iterdir() if p.is_file() and p.name != MANIFEST)
        mine = {n: file_entry(partial / n) for n in names[self.rank::self.world]}
        files: dict = {}
        for part in all_gather_object(mine, group):
            files.update(part)
        if self.rank == 0:
            manifest = {**self._manifest_base(step), "files": files}
            write_atomic(partial / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True))
            if final.exists():  # a save of the same step again (e.g. after a resume): replace it
                old = final.with_name(final.name + ".old.partial")
                final.rename(old)
                shutil.rmtree(old, ignore_errors=True)
            os.rename(partial, final)
            _fsync_dir(self.root)
            write_atomic(self.root / "LATEST", final.name + "\n")
            self._retention()
            total = sum(f["bytes"] for f in files.values())
            log(f"saved {final.name} ({len(files)} files, {total / 2**20:.2f} MiB, {self.fmt}) in "
                 f"{time.perf_counter() - t0:.2f} s{' (async)' if background else ''}")
        barrier(group)

    def wait(self) -> None:
        """Block until a background save has committed (re-raising its error)."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.result()

    def export_consolidated(self, step: int) -> Path:
        """Hugging Face safetensors of step `step`'s checkpoint into `<dir>/hf/step_<N>` (rank 0 streams it)."""
        self.wait()
        out = self.root / "hf" / f"step_{step}"
        if self.rank == 0:
            t0 = time.perf_counter()
            export_checkpoint(self.root / f"step_{step}", out, self.cfg.checkpoint.consolidated_shard_mb)
            log(f"exported {out} (Hugging Face safetensors) in {time.perf_counter() - t0:.2f} s")
        barrier()
        return out

    # ------------------------------------------------------------------------ resume
    def resume(self, pm, optimizer, scheduler, loader) -> int:
        r = self.cfg.checkpoint.resume
        if r is None:
            return 0
        self.wait()
        if r != "auto":
            return self._load(resolve_checkpoint_path(r), pm, optimizer, scheduler, loader)
        latest = read_latest(self.root)
        candidates = complete_checkpoints(self.root)
        if latest is not None:
            candidates = [latest] + [c for c in candidates if c != latest]
        if not candidates:
            return 0
        first_err = None
        for i, path in enumerate(candidates):
            try:
                return self._load(path, pm, optimizer, scheduler, loader)
            except CheckpointError as err:
                first_err = first_err or err
                nxt = candidates[i + 1].name if i + 1 < len(candidates) else None
                log(f"{err}; " + (f"falling back to the previous complete checkpoint {nxt}" if nxt
                                   else "no older complete checkpoint to fall back to"), warn=True)
        raise CheckpointError(f"{first_err} (checkpoint.resume=auto: no usable checkpoint in {self.root})")

    def _load(self, path: Path, pm, optimizer, scheduler, loader) -> int:
        t0 = time.perf_counter()
        manifest = verify_files(path)
        check_adapter_checkpoint(path, manifest, self.cfg)
        weights_only = "optim" not in manifest.get("contents", ["optim"])
        if weights_only:  # (asking DCP for an optimizer state dict would initialise it with a zero step)
            state = {"model": {}}
            for part in pm.state_parts():
                state["model"].update(pm.strategy.model_state_dict(part))
            state["model"] = _with_masters(state["model"], optimizer)
        else:
            state = self._app_state(pm, optimizer, for_save=False)
        partial = self._check_same_model(path, manifest, state)
        if partial is not None:
            weights_only = True
            state = {"model": {k: v for k, v in state["model"].items() if k in partial}}
        try:
            dcp_load(state, path, no_dist=not dist_on())
        except DCP_ERRORS as err:  # DCP wraps per-rank errors; report one line
            raise CheckpointError(f"{path}: DCP load failed: {dcp_error_line(err)}") from None
        self._load_app_state(pm, optimizer, state)
        self.resumed_from = path
        self.resumed_tokenizer = manifest.get("tokenizer")  # e.g. an imported folder's, carried on to the export
        if partial is not None:
            log(f"loaded {len(partial)} model tensors from {path} (checkpoint.allow_partial_load; the others keep "
                "their initialisation; no optimizer state): starting at step 0")
            return 0
        if weights_only:
            log(f"loaded model weights from {path} (no optimizer state): starting at step 0")
            return 0
        ts_path = path / f"trainer_state_rank{self.rank}.pt"
        if not ts_path.exists():
            ts_path = path / "trainer_state_rank0.pt"
        try:
            ts = torch.load(ts_path, weights_only=True)  # no pickle code execution, ever
        except Exception as err:  # noqa: BLE001 - one line naming the file
            first = (str(err).strip().splitlines() or [type(err).__name__])[0]
            raise CheckpointError(f"{ts_path}: refused by torch.load(weights_only=True): {first}") from None
        scheduler.load_state_dict(ts["scheduler"])
        try:
            loader.load_state_dict(ts["loader"])
        except ValueError as err:
            raise CheckpointError(f"{ts_path}: {err}") from None
        set_rng_state(ts["rng"])
        if manifest.get("config_digest") != config_digest(self.cfg):
            log(f"{path.name} was saved with a different config (digest {manifest.get('config_digest', '?')[:12]}"
                 f" vs {config_digest(self.cfg)[:12]}); the model is the same, continuing")
        world = manifest.get("world_size")
        reshard = f", resharded from world {world} ({manifest.get('strategy')}) to {self.world} " \
                  f"({self.cfg.distributed.strategy})" if world != self.world or \
            manifest.get("strategy") != self.cfg.distributed.strategy else ""
        log(f"resumed from {path} at step {ts['step']}{reshard} in {time.perf_counter() - t0:.2f} s")
        return int(ts["step"])

    def _check_same_model(self, path: Path, manifest: dict, state: dict) -> set[str] | None:
        """Refuse a checkpoint of another model: its exact set of tensor names and shapes, and its stored model
        arguments, must be this model's. With checkpoint.allow_partial_load and another model: the names to
        load (shapes must still match)."""
        allow = self.cfg.checkpoint.allow_partial_load
        mine = {fqn: tuple(t.shape) for fqn, t in state["model"].items()}  # full shapes (DTensors say them)
        # a pipeline rank holds only its stages: the model is every rank's parts
        mine = {k: v for ranks in all_gather_object(mine) for k, v in ranks.items()}
        keys = check_model_keys(path, mine, allow)
        keys = None if keys is None else keys & set(state["model"])  # what this rank loads
        saved, mine = manifest.get("model_args"), json.loads(json.dumps(model_args_dict(self.cfg)))  # as stored
        diff = [f"{k}={saved.get(k)!r} (this model {mine.get(k)!r})" for k in sorted(set(saved) | set(mine))
                if saved.get(k) != mine.get(k)] if isinstance(saved, dict) else []
        if diff and not allow:
            raise CheckpointError(f"{path}: saved from another model: {', '.join(diff[:6])}"
                                  f"{f' and {len(diff) - 6} more' if len(diff) > 6 else ''}; set model.* to "
                                  "match, or checkpoint.allow_partial_load=true to load the tensors both have")
        if keys is None and diff:  # same tensors, other model args (e.g. rope_theta): still another model
            keys = set(state["model"])
        return keys

    def close(self) -> None:
        try:
            self.wait()
        finally:
            if self._executor is not None:
                self._executor.shutdown(wait=True)
                self._executor = None
            if self._pg is not None and dist.is_initialized():
                dist.destroy_process_group(self._pg)
                self._pg = None
