"""The fused loss under every data-parallel strategy (and CP, AC, accumulation) reproduces the single-process
run of the PLAIN loss (`training.fused_loss=false`): the head's weight is used outside the head's own forward,
so this proves each strategy still gathers it, reduces its gradient and updates it.

fp32, 5 steps (the head's reduced gradient shows from step 2 on), tolerances as the dp parity tests (relative loss 1e-5, final weights 5e-5 absolute). The
configurations run inside the suite's shared N=2 launch.
"""

import pytest

from meshforge.testing.group import Job
from meshforge.testing.parity import compare, results_of

pytestmark = pytest.mark.dist

LOSS_RTOL, WEIGHT_ATOL, STEPS = 1e-5, 5e-5, 5
FUSED = ["training.fused_loss=true"]

N2 = {
    "fused_ddp": FUSED + ["distributed.strategy=ddp"],
    "fused_fsdp2_accum": FUSED + ["distributed.strategy=fsdp2", "training.micro_batch_size=1"],
    "fused_fsdp2_tied": FUSED + ["distributed.strategy=fsdp2", "model.tie_embeddings=true"],
    # (optim_grads_params frees the root unit after forward: the rules refuse fused_loss=true there)
    "fused_megatron_fsdp": FUSED + ["distributed.strategy=megatron_fsdp",
                                    "distributed.data_parallel_sharding_strategy=optim_grads"],
    "fused_fsdp2_cp2_ac": FUSED + ["distributed.cp_size=2", "distributed.activation_checkpointing=full"],
}

GROUP_JOBS = [Job("fused loss parity n2", "meshforge.testing.parity:configs_job", {"configs": N2, "steps": STEPS}, 2)]


@pytest.mark.parametrize("name", list(N2))
def test_fused_loss_parity_n2(reference, group, name):
    plain = ["training.fused_loss=false"] + (["model.tie_embeddings=true"] if "tied" in name else [])
    compare(reference(plain, STEPS), results_of(group("fused loss parity n2"))[name], name, LOSS_RTOL, WEIGHT_ATOL)
