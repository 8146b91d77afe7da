"""Data-parallel parity: every ddp / fsdp2 / HSDP configuration reproduces the single-process run.

fp32, same seed and global batch (8 sequences of 32 tokens), 10 steps. Tolerances:
relative loss difference <= 1e-5 per step; final weights within 5e-5 absolute
(reduction order differs from the single process, Adam amplifies roundoff a little).
The configurations run inside the suite's shared launches (one per world size, `conftest.group`).
"""

import pytest

from meshforge.testing.group import Job
from meshforge.testing.parity import compare, results_of

pytestmark = pytest.mark.dist

LOSS_RTOL, WEIGHT_ATOL = 1e-5, 5e-5

N2 = {
    "ddp": ["distributed.strategy=ddp"],
    "ddp_bucket": ["distributed.strategy=ddp", "distributed.bucket_cap_mb=1", "distributed.static_graph=true"],
    "fsdp2": ["distributed.strategy=fsdp2"],
    "fsdp2_accum4": ["distributed.strategy=fsdp2", "training.micro_batch_size=1"],
    "fsdp2_no_defer": ["distributed.strategy=fsdp2", "training.micro_batch_size=1",
                       "distributed.defer_fsdp_grad_sync=false"],
    "fsdp2_ac_full": ["distributed.activation_checkpointing=full"],
    "fsdp2_ac_selective": ["distributed.activation_checkpointing=selective"],
    "ddp_ac_full": ["distributed.strategy=ddp", "distributed.activation_checkpointing=full"],
    "fsdp2_offload": ["distributed.offload_policy=true"],
    "fsdp2_no_reshard": ["distributed.reshard_after_forward=false"],
    "fsdp2_meta_init": ["model.init_device=meta"],
}
N4 = {
    "fsdp2_n4": ["distributed.strategy=fsdp2"],
    "hsdp_2x2": ["distributed.dp_replicate_size=2"],
    "ddp_n4": ["distributed.strategy=ddp"],
}


GROUP_JOBS = [Job("dp parity n2", "meshforge.testing.parity:configs_job", {"configs": N2}, 2),
              Job("dp parity n4", "meshforge.testing.parity:configs_job", {"configs": N4}, 4)]


@pytest.mark.parametrize("name", list(N2))
def test_parity_n2(reference, group, name):
    compare(reference(), results_of(group("dp parity n2"))[name], name, LOSS_RTOL, WEIGHT_ATOL)


@pytest.mark.parametrize("name", list(N4))
def test_parity_n4(reference, group, name):
    compare(reference(), results_of(group("dp parity n4"))[name], name, LOSS_RTOL, WEIGHT_ATOL)


def test_single_process_world_size_one_is_unwrapped():
    from meshforge.config import load_config
    from meshforge.distributed.mesh import MeshContext
    from meshforge.distributed.parallelize import parallelize_model
    from meshforge.models import build_model

    cfg = load_config(None, [])
    model = build_model(cfg.model)
    out = parallelize_model(model, MeshContext.build(cfg.distributed, 1), cfg.distributed)
    wrapped = out.model
    assert wrapped is model and not out.strategy.active
    assert not any(type(p).__name__ == "DTensor" for p in wrapped.parameters())
