"""`meshforge plot RUN_DIR [RUN_DIR ...] [-o out.png]`: the curves of runs from their metrics.jsonl, overlaid.

One panel per metric against step: loss (with `val_loss` dashed where a run logged it), lr, grad norm,
tokens/s and memory (GiB); one colour per run, the same in every panel, labelled by the run's name
(`run_meta.json` / `config.yaml`, else its directory). A run lacking a metric (or logging it as null, as MFU
is on CPU) draws no line in that panel. matplotlib is an extra, imported only here (`meshforge[plot]`).
The output (`meshforge.outputs`) is a new file or an earlier PNG, replaced in one step once the new one is whole;
a path that cannot be written is one line.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import meshforge.outputs as outputs
from meshforge.errors import MeshforgeError

PANELS = [("loss", "loss"), ("lr", "learning rate"), ("grad_norm", "grad norm"), ("tokens_per_s", "tokens/s"),
          ("max_mem_gib", "memory (GiB)")]


def add_arguments(parser) -> None:
    parser.add_argument("runs", nargs="+", help="run directories (each holds metrics.jsonl)")
    parser.add_argument("-o", "--output", default="plot.png", help="the PNG to write (default plot.png)")


def read_run(run_dir: str) -> tuple[str, list[dict]]:
    """(label, records) of one run directory; a missing or unreadable metrics.jsonl is a one-line error."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise MeshforgeError(f"{run_dir}: no metrics.jsonl (is it a run directory with logging.loggers "
                             "including jsonl?)")
    records = []
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError as err:
        raise MeshforgeError(f"{path} cannot be read ({err.strerror or type(err).__name__})") from None
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except (json.JSONDecodeError, RecursionError):
            raise MeshforgeError(f"{path}:{n} is not a JSON line") from None
        if isinstance(rec, dict) and isinstance(rec.get("step"), int):
            records.append(rec)
    if not records:
        raise MeshforgeError(f"{path} holds no logged steps")
    return _label(Path(run_dir)), records


def _label(run_dir: Path) -> str:
    meta = run_dir / "run_meta.json"
    try:
        return json.loads(meta.read_text())["config"]["run"]["name"]
    except (OSError, ValueError, KeyError, TypeError, RecursionError):
        return run_dir.resolve().name


def _series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    pts = [(r["step"], r[key]) for r in records if isinstance(r.get(key), (int, float))]
    return [p[0] for p in pts], [p[1] for p in pts]


def _is_png(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(8) == b"\x89PNG\r\n\x1a\n"
    except OSError:
        return False


def plot_runs(run_dirs: list[str], output: str) -> dict[str, int]:
    """Draw every run into `output`; returns {panel metric: number of curves drawn}."""
    out = Path(output)
    problem = outputs.check_file(out, "--output", _is_png, "a PNG", sources=[Path(d) / "metrics.jsonl"
                                                                              for d in run_dirs])
    if problem is None and out.suffix.lower() != ".png":
        problem = f"--output={output} must end in .png (meshforge plot writes PNG)"
    if problem is not None:
        raise MeshforgeError(problem)
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise MeshforgeError("meshforge plot needs matplotlib: pip install 'meshforge[plot]'") from None
    runs = [read_run(d) for d in run_dirs]
    labels = [name for name, _ in runs]
    if len(set(labels)) < len(labels):  # the same run name twice: tell them apart by directory
        labels = [f"{name} ({d})" for name, d in zip(labels, run_dirs)]
    fig = Figure(figsize=(15, 8), dpi=80)
    FigureCanvasAgg(fig)
    axes = fig.subplots(2, 3).flatten()
    counts = {}
    for ax, (key, title) in zip(axes, PANELS):
        for i, ((_, recs), label) in enumerate(zip(runs, labels)):
            colour = f"C{i % 10}"
            xs, ys = _series(recs, key)
            if xs:
                ax.plot(xs, ys, color=colour, label=label)
            if key == "loss":
                vx, vy = _series(recs, "val_loss")
                if vx:
                    ax.plot(vx, vy, color=colour, linestyle="--", marker="o", label=f"{label} val")
        counts[key] = len(ax.get_lines())
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    axes[-1].axis("off")
    fig.tight_layout()
    tmp = outputs.temp_beside(out, ".png")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(tmp, format="png")
        outputs.publish_file(tmp, out)
    except OSError as err:
        raise MeshforgeError(f"--output={output} cannot be written ({err.strerror or type(err).__name__}): "
                             "choose a writable path") from None
    finally:
        tmp.unlink(missing_ok=True)
    return counts


def run(args) -> int:
    try:
        counts = plot_runs(args.runs, args.output)
    except MeshforgeError as err:
        for line in err.problems:
            print(f"error: {line}", file=sys.stderr)
        return err.exit_code
    print(f"wrote {args.output}: {len(args.runs)} run(s), {sum(counts.values())} curves "
          f"({', '.join(f'{k} {v}' for k, v in counts.items())})")
    return 0
