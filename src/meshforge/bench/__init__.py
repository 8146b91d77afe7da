"""`meshforge bench`: throughput, memory and communication of configurations, measured in fresh processes.

- `cli.py`     the command (arguments, composing configurations, exit codes)
- `runner.py`  launches one fresh process group per configuration and collects its result
- `worker.py`  runs inside the launched processes: the trainer's building blocks, timed after warm-up
- `measure.py` exact accounting: bytes passed to collectives, bytes of params/grads/optimizer state per rank
- `baseline.py` a hand-written PyTorch loop on the same model and batch, interleaved with meshforge's step
- `report.py`  the terminal table, bench.json, bench.md and bench.png
"""
