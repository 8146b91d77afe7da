"""The hang record (distributed/hang.py) is torch's flight recorder, not wrappers, on two real gloo ranks (one
launch for every test here):
- torch.distributed's functions stay torch's own (the pipeline schedules build `P2POp(dist.isend, ...)`, and P2POp
  accepts only torch's two functions: a wrapped isend failed every pipeline-parallel run on gloo), and the
  collectives torch issues from C++ (DDP's parameter broadcast and gradient buckets, DTensor's functional
  collectives) are counted with the Python ones, per process group;
- the NCCL path without a GPU: meshforge turns NCCL's recorder on and points its dumps into the run folder unless
  the user chose, and the launcher's summary reads dumps in torch's own format, written by torch's own writer
  (`_dump_fr_trace`: the pickle NCCL writes on a timeout; gloo keeps the same flight recorder), here from ranks
  of which one never entered the last all_reduce of a subgroup."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import textwrap

import pytest

from meshforge.distributed import hang

pytestmark = pytest.mark.dist  # it starts two processes
NCCL_VARS = ("TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_NCCL_DUMP_ON_TIMEOUT", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE")

RANK = """
import os, sys, torch, torch.distributed as dist
from torch.distributed import distributed_c10d as c10d
from torch.distributed._functional_collectives import all_reduce as functional_all_reduce
from meshforge.distributed import hang

class NoMesh:
    def group(self, axis):
        raise KeyError(axis)

rank, folder = int(sys.argv[1]), sys.argv[2]
ops = [n for n in dir(c10d) if n in dir(dist) and callable(getattr(c10d, n))]
before = {n: getattr(dist, n) for n in ops}
hang.enable_flight_recorder()
dist.init_process_group("gloo", init_method=f"file://{folder}/store", rank=rank, world_size=2)
hang.install(NoMesh(), rank, lambda: 1, 1.0)
assert all(getattr(dist, n) is f for n, f in before.items())  # nothing of torch's is replaced
for op in (dist.isend, dist.irecv):
    dist.P2POp(op, torch.zeros(1), 1 - rank)
dist.all_reduce(torch.ones(2))  # Python
ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 2))  # C++: broadcast, buckets
ddp(torch.ones(1, 2)).sum().backward()
functional_all_reduce(torch.ones(2), "sum", dist.group.WORLD).wait()  # C++: DTensor's path
world = dist.group.WORLD.group_name
print([op for _seq, op, _retired in hang.recorded(hang._fr_dump())[world]], hang._REC.state()["counts"][world])
hang.uninstall()

sub = dist.new_group([0, 1], group_desc="mesh_tp")
t = torch.ones(2)
for _ in range(3):
    dist.all_gather_into_tensor(torch.empty(4), t, group=sub)
dist.barrier()
if rank == 0:  # rank 1 never enters it
    dist.all_reduce(t, group=sub, async_op=True)
with open(f"{folder}/nccl_trace_rank_{rank}", "wb") as f:
    f.write(torch._C._distributed_c10d._dump_fr_trace())
sys.stdout.flush()
os._exit(0)
"""


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> tuple:
    folder = tmp_path_factory.mktemp("ranks")
    procs = [subprocess.Popen([sys.executable, "-c", textwrap.dedent(RANK), str(r), str(folder)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    outs = [p.communicate(timeout=180) for p in procs]
    for p, (_out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-2000:]
    return folder, outs[0][0].strip().splitlines()[-1]


def test_the_record_counts_cpp_collectives_and_leaves_torch_functions_alone(ranks):
    got = ranks[1]
    print(got)
    ops, count = ast.literal_eval(got.rsplit("] ", 1)[0] + "]"), int(got.rsplit("] ", 1)[1])
    assert ops[0] == "all_reduce" and "broadcast" in ops and ops.count("all_reduce") >= 3, ops
    assert count == len(ops), (count, ops)


def test_meshforge_turns_the_nccl_recorder_on_unless_the_user_chose(monkeypatch, tmp_path):
    for var in NCCL_VARS:
        monkeypatch.delenv(var, raising=False)
    where = hang.enable_nccl_flight_recorder(str(tmp_path))
    assert where == str(tmp_path / "nccl_trace_rank_") == hang.nccl_dump_prefix(str(tmp_path))
    assert [os.environ[v] for v in NCCL_VARS] == ["2000", "1", where]
    for var, value in zip(NCCL_VARS, ("0", "0", "/elsewhere/trace_")):
        monkeypatch.setenv(var, value)
    assert hang.enable_nccl_flight_recorder(str(tmp_path)) is None  # the user turned it off
    assert [os.environ[v] for v in NCCL_VARS] == ["0", "0", "/elsewhere/trace_"]
    assert hang.nccl_dump_prefix(str(tmp_path)) == "/elsewhere/trace_"


def test_the_summary_reads_torchs_dumps(ranks, tmp_path):
    prefix = str(ranks[0] / "nccl_trace_rank_")
    lines = hang.dump_summary(prefix)
    print("\n".join(lines))
    assert len(lines) == 2, lines
    assert lines[0].startswith("hang: all_reduce #4 on mesh axis tp (process group ") and "'mesh_tp', ranks [0, 1]) " \
        "did not complete; entered: ranks [0]; never entered: ranks [1]" in lines[0], lines
    assert lines[1] == "hang: rank 1's last collective there was all_gather #3", lines
    assert hang.dump_summary(prefix, since=2e9) == []  # another run's dumps
    alone = tmp_path / "node0"  # rank 0's dump alone (rank 1's on another node's storage): no claim about rank 1
    alone.mkdir()
    (alone / "nccl_trace_rank_0").write_bytes((ranks[0] / "nccl_trace_rank_0").read_bytes())
    assert hang.dump_summary(str(alone / "nccl_trace_rank_")) == []
