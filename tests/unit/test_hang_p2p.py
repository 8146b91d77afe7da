"""The hang record (distributed/hang.py) is torch's flight recorder, not wrappers: torch.distributed's functions
stay torch's own (the pipeline schedules build `P2POp(dist.isend, ...)`, and P2POp accepts only torch's two
functions: a wrapped isend failed every pipeline-parallel run on gloo), and the collectives torch issues from C++
(DDP's parameter broadcast and gradient buckets, DTensor's functional collectives) are counted with the Python
ones, per process group."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def test_the_record_counts_cpp_collectives_and_leaves_torch_functions_alone(tmp_path):
    code = textwrap.dedent(f"""
        import torch, torch.distributed as dist
        from torch.distributed import distributed_c10d as c10d
        from torch.distributed._functional_collectives import all_reduce as functional_all_reduce
        from meshforge.distributed import hang

        class NoMesh:
            def group(self, axis):
                raise KeyError(axis)

        ops = [n for n in dir(c10d) if n in dir(dist) and callable(getattr(c10d, n))]
        before = {{n: getattr(dist, n) for n in ops}}
        hang.enable_flight_recorder()
        dist.init_process_group("gloo", init_method="file://{tmp_path / 'store'}", rank=0, world_size=1)
        hang.install(NoMesh(), 0, lambda: 1, 1.0)
        try:
            assert all(getattr(dist, n) is f for n, f in before.items())  # nothing of torch's is replaced
            for op in (dist.isend, dist.irecv):
                dist.P2POp(op, torch.zeros(1), 0)
            dist.all_reduce(torch.ones(2))  # Python
            ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 2))  # C++: broadcast, buckets
            ddp(torch.ones(1, 2)).sum().backward()
            functional_all_reduce(torch.ones(2), "sum", dist.group.WORLD).wait()  # C++: DTensor's path
            world = dist.group.WORLD.group_name
            got = [op for _seq, op, _retired in hang.recorded(hang._fr_dump())[world]]
            state = hang._REC.state()
        finally:
            hang.uninstall()
            dist.destroy_process_group()
        print(got, state["counts"][world])
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    got = out.stdout.strip().splitlines()[-1]
    print(got)
    ops, count = eval(got.rsplit("] ", 1)[0] + "]"), int(got.rsplit("] ", 1)[1])  # noqa: S307 - our own output
    assert ops[0] == "all_reduce" and "broadcast" in ops and ops.count("all_reduce") >= 3, ops
    assert count == len(ops), (count, ops)
