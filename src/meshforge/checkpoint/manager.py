"""Save and resume a run: a commit that never lies, a resume that checks before it loads.

The manager gets the run's parts as {name: Stateful} (`parts.py`: model, optimizer, scheduler, data loader, RNG;
LoRA adapters and fp32 masters are forms of the model part). It only orchestrates commit, resume and verification,
and never learns what a part holds or which strategy produced it. A checkpoint `step_<N>/` (the directory layout
is in `paths.py`) holds:

    .metadata, __R_I.distcp     DCP (torch.distributed.checkpoint): every `ShardedPart` under its name
                                ("model.<param>", "optim.state.<param>.exp_avg", ...), each rank its own shards
    trainer_state_rank<R>.pt    per rank: {"step": N, and each other part's state under its name}; plain
                                tensors/containers only, loaded with `weights_only=True`
    manifest.json               written last (`manifest.py`): the run, the parts' `contents`, every file's sha256

Commit protocol: every rank writes into `step_<N>.partial/`; a barrier; the ranks hash the files (split among
them), then rank 0 writes `manifest.json`, renames the directory to `step_<N>/` and atomically replaces `LATEST`
(`paths.publish_checkpoint`). A crash at any point leaves `LATEST` on the previous complete checkpoint. The next
manager to start removes leftover `*.partial` directories, with a log line. `keep_last` deletes the oldest
complete checkpoints, never the one `LATEST` names.

Formats (`config.rules.resolved_ckpt_format`): `fsdp_dtensor` saves the strategy's sharded (DTensor) state,
every rank writing its own shards. `torch_dist` saves the plain full (unsharded) state, which is what ddp holds;
a sharded strategy gathers it first (`ShardedPart.state_dict_to_save`). Both are DCP, so either loads at another
world size and under another strategy: a load always asks for the parts' current (sharded) state and DCP
reshards.

`checkpoint.async_save`: DCP `async_save` (THREAD mode, on a separate gloo process group). The state is staged to
CPU before it returns; the write and the commit run in the background while training continues. A second save,
`close()` and every resume wait for the first. A preemption save (`save()`, called by the trainer after
SIGTERM/SIGUSR1) is always synchronous and reports its time against `grace_period_s`.

Resume (`checkpoint.resume`): `auto` takes `LATEST` when there is one. If that checkpoint is corrupt (a missing
or truncated file, a checksum mismatch), it falls back to the previous complete one and says so. A path (a
checkpoint dir, a checkpoints dir with LATEST, or a run dir) is used as given, with no fallback; `none` starts
fresh. Before anything is loaded, every file is checked against the manifest, each part checks the manifest
(`check_manifest`), and the model part's tensor names and shapes and the model arguments are checked against the
model (`verify.py`). A failure is a one-line `CheckpointError` (exit 2 from the CLI) naming the file or the
parameter. A checkpoint that holds only the model (`checkpoint import`), or a partial load
(`checkpoint.allow_partial_load`), loads weights only and starts at step 0.

Storage faults: a save that meets a full disk (ENOSPC, EDQUOT, or a short write torch reports as an
`inline_container` error), a read-only or unwritable folder (EROFS, EACCES), a folder that disappeared (ENOENT, or
the checkpoint this run committed there gone: the folder is then not made again, since unmounted storage would
let it fill the disk beneath) or an I/O error ends the run with one line on every rank, the first failing rank's:
`no space left on device while saving step 6 to PATH; the last committed checkpoint is step 4 (what to do)`. The
ranks agree on each part of a save (`_agree`), so one rank's failure is never the others' hang; the `.partial`
folder is removed where it can be, and LATEST still names the previous checkpoint. Under `--max-restarts` the
same line twice in a row ends the job (`launch.py`).

`before_commit` (None by default) is called after this rank's files are written and before the commit; the
fault-injection tests kill a rank there, and `before_write` raises a storage error in this rank's write of its
trainer state (`training/faults.py`). `save_consolidated` exports a committed step as
Hugging Face safetensors into `<dir>/hf/step_<N>` (`hf.export_checkpoint`, streamed by rank 0).
"""

from __future__ import annotations

import concurrent.futures
import errno
import json
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.tensor import DTensor
from torch.distributed.checkpoint.stateful import Stateful

from meshforge.checkpoint.collectives import all_gather_object, barrier, dist_on, log
from meshforge.checkpoint.hf import export_checkpoint
from meshforge.checkpoint.manifest import (
    MANIFEST,
    config_digest,
    file_entry,
    model_args_dict,
    new_manifest,
    verify_files,
)
from meshforge.checkpoint.parts import ShardedPart
from meshforge.checkpoint.paths import (
    checkpoint_dir,
    complete_checkpoints,
    publish_checkpoint,
    read_latest,
    remove_leftovers,
    remove_old,
    resolve_checkpoint_path,
    write_atomic,
)
from meshforge.checkpoint.safe_dcp import dcp_load
from meshforge.checkpoint.verify import check_same_model
from meshforge.config.rules import resolved_ckpt_format
from meshforge.errors import CheckpointError

T = TypeVar("T")
MODEL = "model"  # the part the manager checks against the checkpoint, and the one a weights-only load loads


def unlike(saved, mine, name: str, require: bool) -> str | None:
    """Why a part's saved state cannot be this run's (`mine`: what the part holds now): not a dict where it holds a
    dict, or a key of another kind (numbers, text, lists, tensors, dicts); with `require` (a part whose load takes
    any dict silently: torch's LR schedulers), a public key of its own missing. None when alike. One level deep:
    below, and for missing keys of the other parts, the part's own `load_state_dict` checks (its KeyError is
    reported as a missing key)."""
    if not isinstance(mine, dict):
        return None
    if not isinstance(saved, dict):
        return f"key {name} must be a dict, not a {type(saved).__name__}"
    kinds = ((bool, int, float), (str,), (list, tuple), (torch.Tensor,), (dict,))
    for key, value in mine.items():
        if key not in saved:
            if require and not str(key).startswith("_"):  # private keys differ between torch versions
                return f"key {name}.{key} is missing"
            continue
        kind = next((k for k in kinds if isinstance(value, k)), None)
        if kind is not None and saved[key] is not None and not isinstance(saved[key], kind):
            return f"key {name}.{key} must be a {type(value).__name__}, not {saved[key]!r:.60}"
    return None


def _nbytes(obj) -> int:
    """Bytes of the tensors in a (nested) state dict, as this rank holds them."""
    if isinstance(obj, DTensor):
        return _nbytes(obj.to_local())
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_nbytes(v) for v in obj.values())
    if isinstance(obj, list | tuple):
        return sum(_nbytes(v) for v in obj)
    return 0


# the storage faults a save reports as one line (what happened, then what to do), by errno
_STORAGE = {errno.ENOSPC: "free some space or set checkpoint.dir elsewhere, then resume",
            errno.EDQUOT: "free some space or set checkpoint.dir elsewhere, then resume",
            errno.EROFS: "make it writable or set checkpoint.dir elsewhere, then resume",
            errno.EACCES: "make it writable or set checkpoint.dir elsewhere, then resume",
            errno.EPERM: "make it writable or set checkpoint.dir elsewhere, then resume",
            errno.ENOENT: "it was deleted or its storage came unmounted: restore it or set checkpoint.dir "
                          "elsewhere, then resume",
            errno.EIO: "check the storage, then resume", errno.ESTALE: "check the storage, then resume"}
_STORAGE_TEXT = {"No space left on device": errno.ENOSPC, "Disk quota exceeded": errno.EDQUOT,
                 "Read-only file system": errno.EROFS}


def storage_errno(err: BaseException) -> int | None:
    """The storage fault (an errno of `_STORAGE`) anywhere in an error, its causes, or the per-rank failures DCP
    collects; None when it is not one."""
    seen, todo = set(), [err]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in _STORAGE:
            return e.errno
        code = next((c for text, c in _STORAGE_TEXT.items() if text in str(e)), None)
        if code is not None:
            return code
        todo += [e.__cause__, e.__context__, *[f[0] if isinstance(f, tuple) else f
                                               for f in (getattr(e, "failures", None) or {}).values()]]
    return None


def rank_file(path: Path, rank: int) -> Path:
    """The per-rank parts' file of `rank` in checkpoint `path`."""
    return path / f"trainer_state_rank{rank}.pt"


class CheckpointManager:
    def __init__(self, cfg, mesh_ctx, info, parts: dict[str, Stateful]):
        self.cfg, self.mesh_ctx, self.info = cfg, mesh_ctx, info
        self.sharded = {n: p for n, p in parts.items() if isinstance(p, ShardedPart)}  # into DCP
        self.per_rank = {n: p for n, p in parts.items() if not isinstance(p, ShardedPart)}  # trainer_state files
        self.resumed_from: Path | None = None  # the checkpoint `resume` loaded
        self.root = checkpoint_dir(cfg)
        self.fmt = resolved_ckpt_format(cfg)
        self.rank, self.world = info.rank, info.world_size
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._pending: concurrent.futures.Future | None = None
        self._pg = None
        self.last_saved: Path | None = None
        self.before_commit: Callable[[int], None] | None = None  # (step) -> None; fault-injection tests
        self.before_write: Callable[[int, Path], None] | None = None  # (step, this rank's file); the same
        self.committed: Path | None = None  # the last checkpoint this run committed or resumed from, in root
        self._clean_partials()

    # ------------------------------------------------------------------ housekeeping
    def _clean_partials(self) -> None:
        if self.rank == 0:
            for p in remove_leftovers(self.root):
                log(f"removed leftover {p.relative_to(self.root)} (an interrupted save; LATEST was never moved to it)")
        barrier()

    def _group(self):
        """A separate gloo group for background saves, so they never interleave with training collectives."""
        if self.world > 1 and self._pg is None:
            self._pg = dist.new_group(backend="gloo")
        return self._pg

    def _retention(self) -> None:
        k = self.cfg.checkpoint.keep_last
        if k:
            for p in remove_old(self.root, k):
                log(f"keep_last={k}: deleted {p.name}")

    def _contents(self) -> list[str]:
        """The manifest's `contents`: the sharded parts (by their `content`), then "trainer_state"."""
        return [p.content or n for n, p in self.sharded.items()] + (["trainer_state"] if self.per_rank else [])

    def _manifest(self, step: int, files: dict) -> dict:
        entries: dict = {}
        for part in self.sharded.values():
            entries.update(part.manifest_entries())
        return new_manifest(step=step, **entries, contents=self._contents(), ckpt_format=self.fmt,
                            strategy=self.cfg.distributed.strategy, world_size=self.world,
                            layout=self.mesh_ctx.layout.named_shape(), config_digest=config_digest(self.cfg),
                            model_args=model_args_dict(self.cfg), files=files)

    # -------------------------------------------------------------------------- save
    def _due(self, step: int, final: bool) -> tuple[bool, bool]:
        """(save a checkpoint, export consolidated HF weights) at this step."""
        c = self.cfg.checkpoint
        due = bool(c.interval and step % c.interval == 0)
        consolidated = (c.save_consolidated == "every" and (due or final)) or (c.save_consolidated == "final" and final)
        return due or (final and c.save_final) or consolidated, consolidated

    def will_save(self, step: int, final: bool = False) -> bool:
        return self._due(step, final)[0]

    def maybe_save(self, step: int, final: bool = False) -> None:
        save, consolidated = self._due(step, final)
        if save:
            self._save(step, allow_async=True)
        if consolidated:
            self.export_consolidated(step)

    def save(self, step: int) -> Path:
        """A synchronous save (what the trainer calls on SIGTERM/SIGUSR1), timed against grace_period_s."""
        t0 = time.perf_counter()
        path = self._save(step, allow_async=False)
        dt, grace = time.perf_counter() - t0, self.cfg.checkpoint.grace_period_s
        log(f"synchronous save of step {step} took {dt:.2f} s (checkpoint.grace_period_s={grace:g})",
            warn=dt > grace)
        return path

    def _save(self, step: int, allow_async: bool) -> Path:
        self.wait()
        final = self.root / f"step_{step}"
        if self.last_saved == final:
            return final  # already saved at this step (interval and final, or a stop right after a save)
        partial = self.root / f"step_{step}.partial"
        t0 = time.perf_counter()
        self._agree(self._prepare(step, partial) if self.rank == 0 else None, partial)
        state = {name: part.state_dict_to_save() for name, part in self.sharded.items()}
        own = {"step": step, **{name: part.state_dict() for name, part in self.per_rank.items()}}
        need = _nbytes(state) + _nbytes(own)

        def write_own() -> None:
            if self.before_write is not None:
                self.before_write(step, rank_file(partial, self.rank))
            torch.save(own, rank_file(partial, self.rank))

        if allow_async and self.cfg.checkpoint.async_save:
            group = self._group()
            fut, failed = self._written(step, partial, need, lambda: dcp.async_save(
                state, checkpoint_id=str(partial), process_group=group, no_dist=not dist_on()))
            del state  # staged to CPU already: training may change the parameters now
            failed = failed or self._written(step, partial, need, write_own)[1]
            if self._executor is None:
                self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="meshforge-ckpt")
            self._pending = self._executor.submit(self._finish_async, fut, step, partial, final, group, t0, need,
                                                  failed)
        else:
            _, failed = self._written(step, partial, need, lambda: dcp.save(state, checkpoint_id=str(partial),
                                                                           no_dist=not dist_on()))
            failed = failed or self._written(step, partial, need, write_own)[1]
            self._commit(step, partial, final, None, t0, failed=failed)
        self.last_saved = final
        return final

    def _finish_async(self, fut, step, partial, final, group, t0, need, failed) -> None:
        if fut is not None:
            failed = self._written(step, partial, need, fut.result)[1] or failed
        self._commit(step, partial, final, group, t0, background=True, failed=failed)

    def _prepare(self, step: int, partial: Path) -> str | None:
        """Rank 0, before a save: the checkpoint it committed last still there, an empty `.partial` folder made; or
        a storage fault's line. A checkpoint folder that lost what this run committed there is not made again: it
        was deleted, or its storage came unmounted and a new folder would fill the disk beneath."""
        if self.committed is not None and not (self.committed / MANIFEST).is_file():
            gone = "the checkpoint folder" if not self.root.exists() else f"{self.committed.name} (committed there)"
            return (f"{gone} disappeared before saving step {step} to {self.root}; the last committed checkpoint "
                    f"was {self.committed.name.replace('_', ' ')}; not making it again ({_STORAGE[errno.ENOENT]})")
        try:
            shutil.rmtree(partial, ignore_errors=True)
            partial.mkdir(parents=self.committed is None, exist_ok=True)
        except OSError as err:
            return self._storage_line(err.errno or errno.EIO, step, err)
        return None

    def _written(self, step: int, partial: Path, need: int, write: Callable[[], T]) -> tuple[T | None, str | None]:
        """(`write()`'s result, None), or (None, the one line of the storage fault it met): ENOSPC and its kin
        anywhere in the error, or less room left on the checkpoint folder's filesystem than this rank's share of
        the save, written or not (torch's writers report a short write as an `inline_container` error). Other
        errors are raised. The ranks agree on the outcome before the commit (`_agree`)."""
        try:
            return write(), None
        except (Exception, CheckpointException) as err:  # noqa: BLE001 - re-raised unless the storage failed
            code = storage_errno(err)
            if code is None:
                try:
                    free = shutil.disk_usage(self.root).free
                    written = sum(p.stat().st_size for p in partial.iterdir() if p.is_file())
                except OSError:  # unknown: not called a full disk
                    free, written = need, 0
                if free + written >= need:
                    raise
                code = errno.ENOSPC
            return None, self._storage_line(code, step, err)

    def _storage_line(self, code: int, step: int, err: BaseException) -> str:
        """`<what happened> while saving step N to PATH; the last committed checkpoint is step M (<what to do>)`."""
        what = "the checkpoint folder disappeared" if code == errno.ENOENT else os.strerror(code).lower()
        if code not in _STORAGE:  # (an errno a save should never meet: its own words too)
            what = f"{what} ({type(err).__name__}: {(str(err).strip().splitlines() or [''])[0][:160]})"
        try:
            latest = read_latest(self.root)
        except OSError:
            latest = None
        last = latest or self.committed
        last = last.name.replace("_", " ") if last else "none (nothing was committed yet)"
        return f"{what} while saving step {step} to {self.root}; the last committed checkpoint is {last} " \
               f"({_STORAGE.get(code, _STORAGE[errno.EIO])})"

    def _agree(self, failed: str | None, partial: Path, group=None) -> None:
        """Every rank learns whether any rank's part of a save failed on its storage; then each raises the first
        failing rank's line (a `CheckpointError`: one line, exit 2), the `.partial` folder removed where it can
        be (it never became a checkpoint: LATEST still names the previous one)."""
        lines = [f for f in all_gather_object(failed, group) if f]
        if not lines:
            return
        if self.rank == 0:
            shutil.rmtree(partial, ignore_errors=True)
        raise CheckpointError(lines[0])

    def _commit(self, step: int, partial: Path, final: Path, group, t0: float, background: bool = False,
                failed: str | None = None) -> None:
        if self.before_commit is not None:
            self.before_commit(step)
        self._agree(failed, partial, group)  # also: every rank's files are on disk
        names = sorted(p.name for p in partial.iterdir() if p.is_file() and p.name != MANIFEST)
        mine = {n: file_entry(partial / n) for n in names[self.rank::self.world]}
        files: dict = {}
        for part in all_gather_object(mine, group):
            files.update(part)
        failed = None
        if self.rank == 0:
            try:
                write_atomic(partial / MANIFEST, json.dumps(self._manifest(step, files), indent=1, sort_keys=True))
                publish_checkpoint(partial, final)
            except OSError as err:
                failed = self._storage_line(err.errno or errno.EIO, step, err)
            else:
                self._retention()
                total = sum(f["bytes"] for f in files.values())
                log(f"saved {final.name} ({len(files)} files, {total / 2**20:.2f} MiB, {self.fmt}) in "
                    f"{time.perf_counter() - t0:.2f} s{' (async)' if background else ''}")
        self._agree(failed, partial, group)
        self.committed = final

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
    def resume(self) -> int:
        """Load the checkpoint `checkpoint.resume` names into the parts; the step to continue from (0: none)."""
        r = self.cfg.checkpoint.resume
        if r is None:
            return 0
        self.wait()
        if r != "auto":
            return self._load(resolve_checkpoint_path(r))
        latest = read_latest(self.root)
        candidates = complete_checkpoints(self.root)
        if latest is not None:
            candidates = [latest] + [c for c in candidates if c != latest]
        if not candidates:
            return 0
        first_err = None
        for i, path in enumerate(candidates):
            try:
                return self._load(path)
            except CheckpointError as err:
                first_err = first_err or err
                nxt = candidates[i + 1].name if i + 1 < len(candidates) else None
                log(f"{err}; " + (f"falling back to the previous complete checkpoint {nxt}" if nxt
                                  else "no older complete checkpoint to fall back to"), warn=True)
        raise CheckpointError(f"{first_err} (checkpoint.resume=auto: no usable checkpoint in {self.root})")

    def _load(self, path: Path) -> int:
        t0 = time.perf_counter()
        manifest = verify_files(path)
        for part in self.sharded.values():
            part.check_manifest(path, manifest)
        names = self._saved_parts(path, manifest)
        weights_only = names == [MODEL]
        state = {name: self.sharded[name].state_dict() for name in names}
        partial = check_same_model(path, manifest, state[MODEL], model_args_dict(self.cfg),
                                   self.cfg.checkpoint.allow_partial_load)
        if partial is not None:
            state = {MODEL: {k: v for k, v in state[MODEL].items() if k in partial}}
        dcp_load(state, path, no_dist=not dist_on())
        for name, part_state in state.items():
            self.sharded[name].load_state_dict(part_state)
        self.resumed_from = path  # the run directory asks: a step-0 start from here is a fresh run
        if path.parent.resolve() == self.root.resolve():
            self.committed = path
        if partial is not None:
            log(f"loaded {len(partial)} model tensors from {path} (checkpoint.allow_partial_load; the others keep "
                "their initialisation; no optimizer state): starting at step 0")
            return 0
        if weights_only:
            log(f"loaded model weights from {path} (no optimizer state): starting at step 0")
            return 0
        step = self._load_per_rank(path)
        if manifest.get("config_digest") != config_digest(self.cfg):
            log(f"{path.name} was saved with a different config (digest {manifest.get('config_digest', '?')[:12]}"
                f" vs {config_digest(self.cfg)[:12]}); the model is the same, continuing")
        world = manifest.get("world_size")
        reshard = f", resharded from world {world} ({manifest.get('strategy')}) to {self.world} " \
                  f"({self.cfg.distributed.strategy})" if world != self.world or \
            manifest.get("strategy") != self.cfg.distributed.strategy else ""
        log(f"resumed from {path} at step {step}{reshard} in {time.perf_counter() - t0:.2f} s")
        return step

    def _saved_parts(self, path: Path, manifest: dict) -> list[str]:
        """The sharded parts to load: every one, or only the model from a checkpoint holding only the model (a
        weights-only checkpoint: `checkpoint import`). The model itself is checked by `check_same_model`."""
        saved = manifest.get("contents")
        if saved is None:
            return list(self.sharded)
        missing = [n for n, p in self.sharded.items() if n != MODEL and (p.content or n) not in saved]
        if not missing:
            return list(self.sharded)
        if len(missing) == len(self.sharded) - 1:  # (asking DCP for an optimizer state would initialise it)
            return [MODEL]
        raise CheckpointError(f"{path}: holds no {missing[0]} ({MANIFEST} lists {', '.join(saved)})")

    def _load_per_rank(self, path: Path) -> int:
        """This rank's file (rank 0's after a change of world size) into the per-rank parts; the saved step."""
        ts_path = rank_file(path, self.rank)
        if not ts_path.exists():
            ts_path = rank_file(path, 0)
        try:
            own = torch.load(ts_path, weights_only=True)  # no pickle code execution, ever
        except Exception as err:  # noqa: BLE001 - one line naming the file
            first = (str(err).strip().splitlines() or [type(err).__name__])[0]
            raise CheckpointError(f"{ts_path}: refused by torch.load(weights_only=True): {first}") from None
        if not isinstance(own, dict):
            raise CheckpointError(f"{ts_path}: not a trainer state (a {type(own).__name__}, not a dict)")
        if type(own.get("step")) is not int:
            raise CheckpointError(f"{ts_path}: key step " + ("is missing" if "step" not in own else
                                                              f"must be an integer, not {own['step']!r:.60}"))
        for name, part in self.per_rank.items():
            if name not in own:
                raise CheckpointError(f"{ts_path}: key {name} is missing (holds no {name} state)")
            silent = isinstance(part, torch.optim.lr_scheduler.LRScheduler)
            if (problem := unlike(own[name], part.state_dict(), name, require=silent)) is not None:
                raise CheckpointError(f"{ts_path}: {problem}")
            try:
                part.load_state_dict(own[name])
            except (ValueError, KeyError, TypeError, AttributeError, IndexError, RuntimeError) as err:
                what = f"key {err.args[0]!r} is missing" if isinstance(err, KeyError) else \
                    (str(err).strip().splitlines() or [type(err).__name__])[0][:300]
                raise CheckpointError(f"{ts_path}: {name}: {what}") from None
        return own["step"]

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
