"""The bench's outputs: a rich table in the terminal, bench.json, bench.md and bench.png.

One row per configuration plus, with `--baseline`, one for the bare PyTorch loop.
Columns (all per device / per rank, so rows at different world sizes compare):
step time median and spread (p10..p90 as % of the median), the median and mean time a step waited for its
batch (the mean is what throughput pays: a streaming source's occasional long record hides from the median;
data.num_workers > 0 builds batches ahead, so with spare cores it falls to a queue read), tokens/s per device,
TFLOP/s per device, MFU (null where no device peak is known, e.g. CPU), the bytes
of params+grads+optimizer state the largest rank holds, peak CUDA memory
(allocated / reserved; CUDA only), bytes passed to collectives per step, and, for
world-size-1 rows on the baseline's settings, the step time relative to the bare loop.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

COLUMNS = ["config", "N", "strategy", "step ms", "spread", "data wait ms med/mean", "tok/s/dev", "TFLOP/s/dev", "MFU",
           "state/rank", "peak alloc/res", "comm/step", "x bare"]


def fmt_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


def _num(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def _same_settings(row: dict, base: dict) -> bool:
    s = base.get("settings", {})
    return row.get("nproc") == 1 and all(row.get(k) == s.get(k) for k in
                                         ("seq_len", "global_batch_size", "micro_batch_size", "precision", "n_params"))


def table_rows(result: dict) -> list[list[str]]:
    base = result.get("baseline") or None
    bare = base.get("bare") if base and "error" not in base else None
    rows = []
    for r in result["rows"]:
        if "error" in r:
            rows.append([r["name"], str(r["nproc"]), "-", "failed: " + r["error"][:60]] + ["-"] * (len(COLUMNS) - 4))
            continue
        cuda = "-"
        if r.get("cuda_max_allocated_max"):
            cuda = f"{r['cuda_max_allocated_max'] / 2**30:.1f} / {r['cuda_max_reserved_max'] / 2**30:.1f} GiB"
        xb = f"{r['step_s_median'] / bare['step_s_median']:.3f}" if bare and _same_settings(r, base) else "-"
        rows.append([r["name"], str(r["world_size"]), r["strategy"], f"{r['step_s_median'] * 1e3:.2f}",
                     f"{r['spread_pct']:.0f}%",
                     f"{r['data_wait_s_median'] * 1e3:.2f} / {r['data_wait_s_mean'] * 1e3:.2f}",
                     f"{r['tokens_per_s_per_device']:,.0f}",
                     _num(r["tflops_per_device"], ".3g"), _num(r["mfu"] and 100 * r["mfu"], ".1f") +
                     ("%" if r["mfu"] else ""), fmt_bytes(r["state_bytes_max"]), cuda,
                     fmt_bytes(r["comm_bytes_per_step"]), xb])
    if bare:
        rows.append(["bare PyTorch loop", "1", "-", f"{bare['step_s_median'] * 1e3:.2f}", f"{bare['spread_pct']:.0f}%",
                     "-", f"{bare['tokens_per_s_per_device']:,.0f}", _num(bare["tflops_per_device"], ".3g"),
                     _num(bare["mfu"] and 100 * bare["mfu"], ".1f") + ("%" if bare["mfu"] else ""), "-", "-",
                     "0 B", "1.000"])
    return rows


def overhead_line(base: dict | None) -> str | None:
    if not base:
        return None
    if "error" in base:
        return f"baseline failed: {base['error']}"
    return (f"meshforge / bare PyTorch step time at world size 1: {base['ratio']:.3f} "
            f"(median of {base['pairs']} interleaved pairs, "
            f"quartiles {base['ratio_p25']:.3f}..{base['ratio_p75']:.3f}; "
            f"ratio of medians {base['ratio_of_medians']:.3f}; without the trainer's data loading "
            f"{base['ratio_without_data']:.3f})")


def markdown(result: dict) -> str:
    rows = table_rows(result)
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "|".join("---" for _ in COLUMNS) + "|"]
    lines += ["| " + " | ".join(c.replace("|", "/") for c in row) + " |" for row in rows]
    meta = result.get("meta", {})
    notes = [(f"{meta.get('steps')} timed steps after {meta.get('warmup')} warm-up steps per configuration, "
              f"each configuration in fresh processes; device {meta.get('device', '?')}.")]
    line = overhead_line(result.get("baseline"))
    if line:
        notes.append(line + ".")
    return "\n".join(lines) + "\n\n" + "\n".join(notes) + "\n"


def print_table(result: dict, console=None) -> None:
    from rich.console import Console
    from rich.table import Table

    if console is None:
        console = Console()
        if not console.is_terminal:  # piped or captured: do not squeeze the table into 80 columns
            console = Console(width=200)
    meta = result.get("meta", {})
    table = Table(title=f"meshforge bench ({meta.get('steps')} steps after {meta.get('warmup')} warm-up, "
                        f"{meta.get('device', '?')})")
    for c in COLUMNS:
        table.add_column(c, justify="left" if c in ("config", "strategy") else "right")
    for row in table_rows(result):
        table.add_row(*row)
    console.print(table)
    line = overhead_line(result.get("baseline"))
    if line:
        console.print(line, markup=False, highlight=False)


def plot(result: dict, path: Path) -> str | None:
    """bench.png: tokens/s per device and state bytes per rank per configuration; a note if matplotlib is absent."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "bench.png skipped: matplotlib is not installed (pip install 'meshforge[plot]')"
    ok = [r for r in result["rows"] if "error" not in r]
    if not ok:
        return "bench.png skipped: no configuration succeeded"
    names = [f"{r['name']}" for r in ok]
    tps = [r["tokens_per_s_per_device"] for r in ok]
    cuda = any(r.get("cuda_max_allocated_max") for r in ok)
    mem = [(r["cuda_max_allocated_max"] if cuda else r["state_bytes_max"]) / 2**20 for r in ok]
    fig, axes = plt.subplots(1, 2, figsize=(max(8, 1.6 * len(ok) + 4), 4.5))
    axes[0].bar(names, tps, color="tab:blue")
    axes[0].set_title("tokens/s per device")
    axes[1].bar(names, mem, color="tab:orange")
    axes[1].set_title("peak allocated MiB per rank" if cuda else "params+grads+optimizer MiB per rank")
    for ax in axes:
        ax.tick_params(axis="x", labelrotation=30)
        for lab in ax.get_xticklabels():
            lab.set_horizontalalignment("right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def write_outputs(result: dict, out_dir: str | Path) -> dict[str, Path | str]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    result.setdefault("meta", {})["written"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    paths: dict[str, Path | str] = {"json": out / "bench.json", "md": out / "bench.md"}
    paths["json"].write_text(json.dumps(result, indent=1))
    paths["md"].write_text(markdown(result))
    note = plot(result, out / "bench.png")
    paths["png"] = note if note else out / "bench.png"
    return paths
