"""FP8 (torchao float8, every block linear) at N=2 reproduces the same FP8 run in one process: fsdp2 with
float8 all-gather (tensorwise: the weight is cast to float8 on its shard, with the scale of the whole weight's
all-reduced amax, then gathered) and megatron_fsdp (flat buffers of the high-precision weights).

Each rank's micro batch holds the same sequences as one of the single process's micro batches, so the
activation scales are the same too; tolerances as the dp parity tests: relative loss 1e-5 per step, final
weights 5e-5 absolute (measured: 8.5e-8 and 3e-6). Runs in the suite's shared N=2 launch; 5 short steps (fp8 is slow on CPU).
"""

import pytest

from meshforge.testing.group import Job
from meshforge.testing.parity import compare, results_of

pytestmark = pytest.mark.dist

LOSS_RTOL, WEIGHT_ATOL, STEPS = 1e-5, 5e-5, 5
# (the plain loss everywhere: megatron_fsdp's default mode cannot fuse it, and float8's rounding would turn the
# fused-vs-plain float differences into large ones)
FP8 = ["training.fp8.enabled=true", "training.fp8.filter=all", "training.global_batch_size=4",
       "training.seq_len=16", "training.fused_loss=false"]
N2 = {
    "fp8_fsdp2_float8_all_gather": FP8 + ["distributed.strategy=fsdp2"],
    "fp8_megatron_fsdp": FP8 + ["distributed.strategy=megatron_fsdp"],
}

GROUP_JOBS = [Job("fp8 parity n2", "meshforge.testing.parity:configs_job", {"configs": N2, "steps": STEPS}, 2)]


@pytest.mark.parametrize("name", list(N2))
def test_fp8_parity_n2(reference, group, name):
    compare(reference(FP8, STEPS), results_of(group("fp8 parity n2"))[name], name, LOSS_RTOL, WEIGHT_ATOL)
