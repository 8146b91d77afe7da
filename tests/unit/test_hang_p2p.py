"""The hang recorders (distributed/hang.py) replace torch.distributed's Python collectives with wrappers: torch's
own point-to-point ops must stay valid, since the pipeline schedules build `P2POp(dist.isend, ...)` at call time
and P2POp accepts only torch's two functions (a wrapped isend failed every pipeline-parallel run on gloo)."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def test_recorders_leave_the_pipelines_p2p_ops_valid(tmp_path):
    code = textwrap.dedent(f"""
        import torch, torch.distributed as dist
        from meshforge.distributed import hang

        class NoMesh:
            def group(self, axis):
                raise KeyError(axis)

        dist.init_process_group("gloo", init_method="file://{tmp_path / 'store'}", rank=0, world_size=1)
        hang.install(NoMesh(), 0, lambda: 1, 1.0)
        try:
            assert dist.all_reduce is not hang._ORIGINAL["all_reduce"]  # the recorders are installed
            for op in (dist.isend, dist.irecv):
                dist.P2POp(op, torch.zeros(1), 0)
        finally:
            hang.uninstall()
            dist.destroy_process_group()
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
