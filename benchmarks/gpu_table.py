"""One table from `gpu_throughput.sh`'s parts: the plain-PyTorch ceiling row and meshforge's bench.json rows,
with tokens/s, TFLOP/s, MFU, peak GiB and each row's tokens/s as a ratio to the ceiling measured in the same call.

    python benchmarks/gpu_table.py CEILING_JSON LABEL=BENCH_JSON [LABEL=BENCH_JSON ...] [--markdown OUT_MD]
"""

from __future__ import annotations

import argparse
import json


def rows(ceiling: dict, benches: list[tuple[str, dict]]) -> list[list[str]]:
    def fmt(name, tps, tflops, mfu, peak_gib, ratio):
        return [name, f"{tps:,.0f}", "-" if tflops is None else f"{tflops:.1f}",
                "-" if mfu is None else f"{mfu:.3f}", "-" if peak_gib is None else f"{peak_gib:.1f}",
                "-" if ratio is None else f"{ratio:.2f}"]

    top = ceiling["tokens_per_s_per_device"]
    out = [fmt(ceiling["name"], top, ceiling["tflops_per_device"], ceiling["mfu"], ceiling["peak_gib"], 1.0)]
    for label, r in [(label, r) for label, bench in benches for r in bench["rows"]]:
        name = f"meshforge {label} {r['name']}"
        if "error" in r:
            out.append([name, "failed: " + r["error"].splitlines()[0][:70], "-", "-", "-", "-"])
            continue
        peak = r.get("cuda_max_allocated_max")
        out.append(fmt(name, r["tokens_per_s_per_device"], r["tflops_per_device"], r["mfu"],
                       None if peak is None else peak / 2**30, r["tokens_per_s_per_device"] / top))
    return out


HEAD = ["configuration", "tokens/s", "TFLOP/s", "MFU", "peak GiB", "x ceiling"]


def markdown(table: list[list[str]]) -> str:
    lines = ["| " + " | ".join(HEAD) + " |", "|" + "---|" * len(HEAD)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in table]) + "\n"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("ceiling")
    p.add_argument("bench", nargs="+")
    p.add_argument("--markdown", default=None)
    a = p.parse_args()
    with open(a.ceiling) as f:
        ceiling = json.load(f)
    benches = []
    for arg in a.bench:
        label, _, path = arg.rpartition("=")
        try:
            with open(path) as f:
                benches.append((label, json.load(f)))
        except OSError as err:  # that bench call failed before writing: one failed row, the others still shown
            benches.append((label, {"rows": [{"name": "(all)", "error": f"no results: {err}"}]}))
    table = rows(ceiling, benches)
    widths = [max(len(r[i]) for r in [HEAD] + table) for i in range(len(HEAD))]
    for r in [HEAD] + table:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)))
    if a.markdown:
        with open(a.markdown, "w") as f:
            f.write(markdown(table))


if __name__ == "__main__":
    main()
