"""Progress of long jobs outside the training loop (data prepare, checkpoint export/import): a rich bar on a
terminal, plain lines otherwise (logs, CI, pipes), on stderr so a command's stdout stays its result.

Plain mode prints a line each time another tenth of the work is done and one at the end, so a log shows
progress without one line per item. A leaf module: anything may use it.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Iterator
from typing import TextIO, TypeVar

T = TypeVar("T")


def track(items: Iterable[T], description: str, total: int | None = None, stream: TextIO | None = None,
          enabled: bool = True) -> Iterator[T]:
    """Yield `items`, showing how many of `total` (default `len(items)`) are done."""
    if not enabled:
        yield from items
        return
    stream = stream or sys.stderr
    total = total if total is not None else len(items)  # type: ignore[arg-type]
    if stream.isatty():
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        with Progress(TextColumn(f"[bold]{description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      console=Console(file=stream, force_terminal=True)) as bar:
            task = bar.add_task(description, total=total)
            for item in items:
                yield item
                bar.advance(task)
        return
    t0, shown = time.perf_counter(), 0
    for done, item in enumerate(items, 1):
        yield item
        tenth = done * 10 // max(total, 1)
        if tenth > shown or done == total:
            shown = tenth
            print(f"{description}: {done}/{total} ({100 * done // max(total, 1)}%, "
                  f"{time.perf_counter() - t0:.1f} s)", file=stream, flush=True)
