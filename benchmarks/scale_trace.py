"""The scale trace at the full shapes of every example: what it costs, and the plan beside it.

For each example config at the world size its header names (and the Llama 3 405B layout of docs/strategies.md,
as overrides), rank 0 and the last rank are traced (`meshforge.scale`: one real training step on fake tensors,
each rank in its own process) and compared with `meshforge plan`: state bytes, peak memory, collective bytes
per mesh axis. Printed: the trace's CPU and wall seconds and peak RSS beside its estimate, and the plan's error.

Usage: python benchmarks/scale_trace.py [--only NAME,...] [--json runs/scale_trace.json] [--from-json FILE]
       [--write-docs docs/scale.md]
(--from-json re-plans saved traces without tracing again: the plan changes in milliseconds, a trace in minutes.)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LLAMA_405B = ["model.dim=16384", "model.n_layers=128", "model.n_heads=128", "model.n_kv_heads=8", "model.ffn_dim=53248",
              "distributed.pp_size=16", "distributed.pipeline.virtual_stages_per_rank=8",
              "distributed.activation_checkpointing=false", "training.global_batch_size=2048",
              "training.compile=false"]
# name: (config, overrides, world size): the world sizes the examples' headers name (docs/strategies.md for 8B)
CASES = {
    "llama3_8b": ("examples/llama3_8b.yaml", ["training.global_batch_size=16", "training.micro_batch_size=2"], 8),
    "llama3_8b_tp": ("examples/llama3_8b_tp.yaml", [], 64),
    "llama3_70b_tp_pp": ("examples/llama3_70b_tp_pp.yaml", [], 64),
    "llama3_405b_tp8_pp16": ("examples/llama3_70b_tp_pp.yaml", LLAMA_405B, 8192),
    "qwen3_moe_ep8": ("examples/qwen3_moe_ep8.yaml", [], 8),
    "long_context_cp": ("examples/long_context_cp.yaml", [], 16),
    "llama3_2_1b": ("examples/llama3_2_1b.yaml", [], 8),
}


def trace_case(name: str) -> list[dict]:
    from meshforge.config import load_config
    from meshforge.scale.estimate import estimate
    from meshforge.scale.worker import trace_jobs

    path, overrides, world = CASES[name]
    cfg = load_config(str(ROOT / path), overrides, world_size=world)
    out = []
    for rank in sorted({0, world - 1}):
        est = estimate(cfg, world, rank)
        t0 = time.perf_counter()
        res = trace_jobs(world, rank, [{"name": name, "path": str(ROOT / path), "overrides": overrides}])[0]
        res.update(wall_s=time.perf_counter() - t0, estimate_cpu_s=est.cpu_s, estimate_rss_bytes=est.rss_bytes,
                   case=name)
        out.append(res)
        print(f"{name} rank {rank}: " + (res["error"] if "error" in res else
              f"cpu {res['cpu_s']:.0f} s (estimate {est.cpu_s:.0f}), wall {res['wall_s']:.0f} s, "
              f"RSS {res['rss_bytes'] / 1e9:.2f} GB, peak {res['peak']['total'] / 1e9:.2f} GB"), flush=True)
    return out


def table(results: list[dict]) -> list[str]:
    """Markdown rows: the trace beside the plan, per traced rank."""
    from meshforge.config import load_config
    from meshforge.scale.compare import compare
    from meshforge.scale.trace import RankTrace, layout_of

    rows = ["| example | world | rank | trace CPU s (wall) | RSS GB | state plan = trace | peak trace GB | peak plan GB "
            "| error | collectives plan = trace |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for res in results:
        name = res["case"]
        path, overrides, world = CASES[name]
        if "error" in res:
            rows.append(f"| {name} | {world} | {res.get('rank', '?')} | cannot be traced yet: {res['error']} "
                        "| | | | | | |")
            continue
        cfg = load_config(str(ROOT / path), overrides, world_size=world)
        trace = RankTrace.from_dict(res, layout_of(cfg, world))
        c = compare(cfg, trace)
        rows.append(f"| {name} | {world} | {trace.rank} | {trace.cpu_s:.0f} ({res['wall_s']:.0f}) | "
                    f"{trace.rss_bytes / 1e9:.2f} | {'yes' if c.state_exact else 'no'} | "
                    f"{c.peak_trace / 1e9:.2f} | {c.peak_plan / 1e9:.2f} | {100 * c.peak_error:+.1f}% | "
                    f"{'yes' if c.comm_exact else 'no: ' + '; '.join(c.problems())} |")
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default=None, help="comma-separated case names (default: all)")
    ap.add_argument("--json", default=None, help="write the traces here")
    ap.add_argument("--from-json", default=None, help="re-plan traces saved by --json instead of tracing")
    ap.add_argument("--write-docs", default=None, help="replace the table between the markers in this file")
    args = ap.parse_args()
    names = args.only.split(",") if args.only else list(CASES)
    unknown = [n for n in names if n not in CASES]
    if unknown:
        print(f"error: unknown case {', '.join(unknown)}; cases: {', '.join(CASES)}", file=sys.stderr)
        return 2
    if args.from_json:
        results = [r for r in json.loads(Path(args.from_json).read_text()) if r["case"] in names]
    else:
        results = [r for n in names for r in trace_case(n)]
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(results, indent=1))
    rows = table(results)
    print("\n".join(rows))
    if args.write_docs:
        doc = Path(args.write_docs)
        text = doc.read_text()
        start, end = "<!-- scale-trace-table -->", "<!-- /scale-trace-table -->"
        head, _, rest = text.partition(start)
        _, _, tail = rest.partition(end)
        doc.write_text(f"{head}{start}\n" + "\n".join(rows) + f"\n{end}{tail}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
