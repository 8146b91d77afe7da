"""FP8 (torchao float8, every block linear) at N=2 reproduces the same FP8 run in one process: fsdp2 with
float8 all-gather (tensorwise: the weight is cast to float8 on its shard, with the scale of the whole weight's
all-reduced amax, then gathered), megatron_fsdp (flat buffers of the high-precision weights), tensor parallelism
with torchao's float8 styles (tensorwise: each module's input and output gradient cast on the DTensor, with the
whole tensor's scale; with and without sequence parallelism) and pipeline stages (each stage's linears converted).

Each rank's micro batch holds the same sequences as one of the single process's micro batches, so the
activation scales are the same too; tolerances as the dp parity tests: relative loss 1e-5 per step, final
weights 5e-5 absolute (measured: 8.5e-8 and 3e-6). Runs in the suite's shared N=2 launch; 5 short steps (fp8 is
slow on CPU).

Without gradient clipping (a sharded or pipelined norm moves the clipping coefficient by ~1e-7, and a float8
cast turns such differences into whole float8 steps): PP2 is bitwise (measured: losses and weights equal), PP2 x
fsdp2 2 (float8 all-gather per stage, N=4) as the dp tests. TP2
splits the row-wise projections' sums over the ranks: the first two steps agree to 1e-7 (measured: loss 8.6e-8
and 9.0e-8, grad norm 1.4e-7 and 9.5e-7), after which float8 rounding of those 1e-7 differences flips float8
values (up to 1/16 of an element each) and the runs drift apart as different float8 runs (measured over 5 steps:
loss 1.2e-3, grad norm 1.0e-1): the early steps are the exact test, the later ones only that it tracks.
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
NOCLIP = FP8 + ["training.grad_clip=null"]
TP = {"fp8_tp2": NOCLIP + ["distributed.tp_size=2"],
      "fp8_tp2_sp": NOCLIP + ["distributed.tp_size=2", "distributed.sequence_parallel=true"]}
PP = {"fp8_pp2": NOCLIP + ["distributed.pp_size=2", "distributed.pipeline.pp_microbatch_size=2"]}
# N=4: each pipeline stage sharded by fsdp2 with the float8 all-gather (as the dp tests: measured loss 0, grad norm
# 1.4e-7 over 5 steps; gpipe: each rank's 2 sequences are one microbatch, as one of the single process's micro
# batches, for the same activation scales; 1f1b would need 2 microbatches per rank); fsdp2 x TP2 (fsdp2 gathers the
# high-precision shards there: torchao would scale a float8 gather by each tp shard's own amax, measured 1.1e-4 off
# one process at the first step), which tracks as TP2 alone does
PP_FSDP2 = {"fp8_pp2_fsdp2": PP["fp8_pp2"] + ["distributed.pipeline.pp_schedule=gpipe"]}
N4 = {**PP_FSDP2, "fp8_fsdp2_tp2": TP["fp8_tp2"]}
EARLY_LOSS_RTOL, EARLY_GRAD_NORM_RTOL, LATE_LOSS_RTOL, LATE_GRAD_NORM_RTOL = 1e-6, 1e-5, 1e-2, 0.2

GROUP_JOBS = [Job("fp8 parity n2", "meshforge.testing.parity:configs_job",
                  {"configs": {**N2, **TP, **PP}, "steps": STEPS}, 2),
              Job("fp8 parity n4", "meshforge.testing.parity:configs_job", {"configs": N4, "steps": STEPS}, 4)]


@pytest.mark.parametrize("name", list(N2))
def test_fp8_parity_n2(reference, group, name):
    compare(reference(FP8, STEPS), results_of(group("fp8 parity n2"))[name], name, LOSS_RTOL, WEIGHT_ATOL)


def test_fp8_pipeline_stages_are_bitwise_and_shard_with_float8_all_gather(reference, group):
    got = results_of(group("fp8 parity n2"))["fp8_pp2"]
    compare(reference(NOCLIP, STEPS), got, "fp8_pp2", loss_rtol=0.0, weight_atol=0.0, grad_norm_rtol=1e-6)
    sharded = results_of(group("fp8 parity n4"))["fp8_pp2_fsdp2"]
    compare(reference(NOCLIP, STEPS), sharded, "fp8_pp2_fsdp2", LOSS_RTOL, WEIGHT_ATOL)


@pytest.mark.parametrize("job, name", [("fp8 parity n2", n) for n in TP] + [("fp8 parity n4", "fp8_fsdp2_tp2")])
def test_fp8_with_tp_or_sharded_stages_matches_the_first_steps(reference, group, job, name):
    ref, got = reference(NOCLIP, STEPS), results_of(group(job))[name]
    compare(ref, got, name, LATE_LOSS_RTOL, None, LATE_GRAD_NORM_RTOL)
    for step in (0, 1):
        assert abs(got.losses[step] - ref.losses[step]) <= EARLY_LOSS_RTOL * ref.losses[step], (name, step)
        assert abs(got.grad_norms[step] - ref.grad_norms[step]) <= EARLY_GRAD_NORM_RTOL * ref.grad_norms[step]
