"""Storage faults mid-run (issue 29 item 6): a full disk, a read-only or a vanished checkpoint folder during a save
end the run with one line on every rank, the previous committed checkpoint intact; under `--max-restarts` the same
fault twice ends the job with that line. Real faults where this machine can make them (a small tmpfs, filled or
remounted read-only; the folder deleted between saves), an injected OSError at the checkpoint writer
(`storage_error`, training/faults.py) otherwise and always: the N=2 scenarios share one launch."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from meshforge.testing.group import Job
from meshforge.testing.parity import base_overrides

OUT = Path(os.environ["MESHFORGE_TEST_SHARED"]) / "storage_faults"
ROOT = Path(__file__).resolve().parents[2]
LINE = r"; the last committed checkpoint is step 2 \("

# name: (MESHFORGE_FAULT, async_save, what happens to the checkpoint folder after step 3 on rank 0)
SCENARIOS = {"enospc injected rank 1": ("storage_error:4:1:ENOSPC", False, None),
             "erofs injected rank 0 async": ("storage_error:4:0:EROFS", True, None),
             "folder deleted": (None, False, "delete"),
             "read-only tmpfs": (None, False, "read-only")}


def storage_job(spec, info) -> dict:
    import torch.distributed as dist

    from meshforge.checkpoint.collectives import all_gather_object
    from meshforge.checkpoint.manifest import verify_files
    from meshforge.errors import CheckpointError
    from meshforge.testing.disk import remount_read_only, small_tmpfs
    from meshforge.testing.parity import config
    from meshforge.training.trainer import Trainer

    results = {}
    for name, (fault, async_save, damage) in SCENARIOS.items():
        where = OUT / name.replace(" ", "_")
        disk = where / "disk"
        mount = small_tmpfs(disk, "16m") if damage == "read-only" and info.rank == 0 else contextlib.nullcontext()
        with mount as why_not:
            skip = all_gather_object(why_not)[0]
            if skip:
                results[name] = {"skip": skip}
                continue
            ck = disk / "ck"
            os.environ.pop("MESHFORGE_FAULT", None)
            if fault:
                os.environ["MESHFORGE_FAULT"] = fault
            try:
                cfg = config([f"run.output_dir={where / 'run'}", f"checkpoint.dir={ck}", "checkpoint.interval=2",
                              f"checkpoint.async_save={str(async_save).lower()}"], steps=4,
                             world_size=info.world_size)
                trainer = Trainer.build(cfg, info)
            finally:
                os.environ.pop("MESHFORGE_FAULT", None)

            def after_step(step: int, damage=damage, ck=ck, disk=disk) -> None:
                if step == 3 and info.rank == 0 and damage == "delete":
                    shutil.rmtree(ck)
                elif step == 3 and info.rank == 0 and damage == "read-only":
                    remount_read_only(disk)

            trainer.after_step.append(after_step)
            try:
                trainer.fit()
                error = None
            except CheckpointError as err:
                error = str(err)
            errors = all_gather_object(error)
            dist.barrier()
            intact = bool(verify_files(ck / "step_2")) if (ck / "step_2").is_dir() else None  # (a collective)
            if info.rank == 0:
                listing = sorted(p.name for p in ck.iterdir()) if ck.is_dir() else None
                latest = (ck / "LATEST").read_text() if ck.is_dir() else None
                results[name] = {"errors": errors, "listing": listing, "latest": latest, "intact": intact}
    return results


GROUP_JOBS = [Job("storage faults n2", f"{Path(__file__).resolve()}:storage_job", None, 2)]


@pytest.mark.dist
@pytest.mark.parametrize("name", SCENARIOS)
def test_a_storage_fault_mid_run_is_one_line_on_every_rank_and_the_last_checkpoint_stays(group, name):
    import re

    got = group("storage faults n2")[name]
    if "skip" in got:
        pytest.skip(got["skip"])
    print(f"{name}: {got['errors'][0]}")
    assert got["errors"][0] is not None and got["errors"] == [got["errors"][0]] * 2, got  # the same line everywhere
    line = got["errors"][0]
    assert "\n" not in line and "Traceback" not in line and "inline_container" not in line
    want = {"enospc injected rank 1": r"^no space left on device while saving step 4 to .*" + LINE,
            "erofs injected rank 0 async": r"^read-only file system while saving step 4 to .*" + LINE,
            "folder deleted": r"^the checkpoint folder disappeared before saving step 4 to .*; the last committed "
                              r"checkpoint was step 2; not making it again \(it was deleted or its storage came",
            "read-only tmpfs": r"^read-only file system while saving step 4 to .*" + LINE}[name]
    assert re.search(want, line), line
    if name == "folder deleted":
        assert got["listing"] is None, got  # not made again (unmounted storage: the disk beneath would fill)
    else:
        assert got["latest"] == "step_2\n" and got["intact"], got
        assert [n for n in got["listing"] if n.startswith("step_")] == ["step_2"], got


@pytest.mark.dist
def test_restarts_stop_after_the_same_storage_fault_twice(tmp_path):
    """`--max-restarts 3` on a disk with room for one checkpoint: the save of step 4 fails, the restart resumes at
    step 2 and fails the same way, and the job stops there with that line (a real full tmpfs where one can be
    mounted, else the injected ENOSPC in both attempts)."""
    from meshforge.testing.disk import small_tmpfs

    with small_tmpfs(tmp_path / "disk", "2500k") as why_not:
        ck = tmp_path / "disk" / "ck"
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
        env.pop("MESHFORGE_FAULT", None)
        if why_not:
            print(f"injected ENOSPC: {why_not}")
            env["MESHFORGE_FAULT"] = "storage_error:4:0:ENOSPC,storage_error@1:4:0:ENOSPC"
        cfg = tmp_path / "c.yaml"
        cfg.write_text("run: {name: storage}\n")
        proc = subprocess.run(
            [sys.executable, "-m", "meshforge", "train", str(cfg), "--max-restarts", "3", *base_overrides(6),
             f"run.output_dir={tmp_path / 'run'}", f"checkpoint.dir={ck}", "checkpoint.interval=2",
             "checkpoint.resume=auto"], capture_output=True, text=True, env=env, timeout=600)
        err = proc.stderr
        print(err[-2000:])
        assert proc.returncode == 2, err[-3000:]
        line = f"no space left on device while saving step 4 to {ck}; the last committed checkpoint is step 2 (free"
        assert f"meshforge: restart 1 of 3 after: rank 0: {line}" in err, err[-3000:]
        assert f"error: the same failure twice in a row, not restarting again: rank 0: {line}" in err, err[-3000:]
        assert "restart 2 of 3" not in err and "Traceback" not in err and "inline_container" not in err
        assert (ck / "LATEST").read_text() == "step_2\n"
