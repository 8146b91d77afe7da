"""Peak resident memory per rank while `model.init_from` loads a Hugging Face checkpoint (fsdp2, CPU/gloo).

Writes a random bf16 checkpoint of a preset's shape (default llama3_2_1b: 1.24B parameters, 2.5 GB) in
~1 GB safetensors shards with an index, then at each world size builds the fsdp2 model on the meta device,
materialises it, and samples the process RSS every 2 ms while `load_hf_into` runs. Each rank reads only
its slices (safetensors `get_slice`), so the load's extra memory per rank should be about the rank's
share of the model, not a full copy.

    python benchmarks/hf_load_rss.py [--preset llama3_2_1b] [--worlds 1 2] [--dir /tmp/hf_rss]
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from pathlib import Path


def write_checkpoint(preset: str, out: Path) -> int:
    import torch
    from safetensors.torch import save_file

    from meshforge.models import PRESETS, build_model

    model = build_model(PRESETS[preset], device="meta")
    adapter = model.state_dict_adapter()
    out.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    shard, size, n, weight_map, total = {}, 0, 0, {}, 0

    def flush():
        nonlocal shard, size, n
        if shard:
            n += 1
            name = f"model-{n:05d}.safetensors"
            save_file(shard, str(out / name), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(shard, name))
            shard, size = {}, 0

    for name, p in model.named_parameters(remove_duplicate=False):
        for theirs in adapter.hf_names(name):
            t = torch.empty(p.shape, dtype=torch.bfloat16).normal_(0, 0.02, generator=g)
            shard[theirs] = t
            size += t.numel() * 2
            total += t.numel() * 2
            if size > 2**30:
                flush()
    flush()
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                   "weight_map": weight_map}))
    (out / "config.json").write_text(json.dumps(adapter.hf_config(torch.bfloat16)))
    return total


def rss_job(spec: dict, info) -> dict:
    import psutil

    from meshforge.checkpoint.hf import load_hf_into
    from meshforge.config import load_config
    from meshforge.distributed.build import build_parallel_model
    from meshforge.distributed.mesh import MeshContext

    cfg = load_config(None, [f"model.preset={spec['preset']}", "model.init_device=meta", "training.device=cpu",
                             "distributed.strategy=fsdp2", "training.precision=fp32", "data.source=synthetic"],
                      world_size=info.world_size)
    pm = build_parallel_model(cfg, MeshContext.build(cfg.distributed, info.world_size, info.rank, "cpu"),
                              info.device)
    proc = psutil.Process()
    before = proc.memory_info().rss
    peak, done = [before], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], proc.memory_info().rss)
            time.sleep(0.002)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    t0 = time.perf_counter()
    whole = [n for part in pm.unwrapped_parts() for n in load_hf_into(part, spec["dir"])]
    seconds = time.perf_counter() - t0
    done.set()
    thread.join()
    import torch.distributed as dist

    row = [info.rank, before / 2**30, peak[0] / 2**30, (peak[0] - before) / 2**30, seconds, len(whole)]
    rows = [None] * info.world_size
    dist.all_gather_object(rows, row) if info.world_size > 1 else rows.__setitem__(0, row)
    return {"rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="llama3_2_1b")
    ap.add_argument("--worlds", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--dir", default="/tmp/meshforge_hf_rss")
    a = ap.parse_args()
    from meshforge.testing.group import Job, launch_jobs

    d = Path(a.dir) / a.preset
    if not (d / "config.json").is_file():
        t0 = time.perf_counter()
        total = write_checkpoint(a.preset, d)
        print(f"wrote {d}: {total / 2**30:.2f} GiB bf16 in {time.perf_counter() - t0:.0f} s")
    for world in a.worlds:
        job = Job("rss", f"{Path(__file__).resolve()}:rss_job", {"preset": a.preset, "dir": str(d)}, world)
        out = launch_jobs([job], world, timeout=1800)["rss"]
        if "error" in out:
            raise SystemExit(out["error"])
        for rank, before, peak, extra, secs, whole in out["value"]["rows"]:
            print(f"world {world} rank {rank}: RSS before load {before:.2f} GiB, peak during load {peak:.2f} GiB "
                  f"(+{extra:.2f} GiB), {secs:.1f} s, {whole} tensors read whole")


if __name__ == "__main__":
    main()
