"""The fast step at N=2, inside the suite's shared N=2 launch:

- regional compile composes with fsdp2 + full activation checkpointing, with tensor + sequence parallelism
  (the embedding's all-gathered output enters the first compiled block: tensor_parallel.EmbeddingParallel),
  and with megatron_fsdp's hooks: each run compiles its blocks (`training.compile_backend=aot_eager`:
  dynamo and AOT autograd trace forward and backward exactly as for inductor, without inductor's code
  generation, which costs minutes per process on this machine) and reproduces the single-process EAGER run;
  a counter proves the graphs were captured. Tolerances as the dp parity tests (relative loss 1e-5, weights
  5e-5 absolute).
- training.precision=bf16_params under fsdp2 (fp32 shards, gathered in bf16, gradients reduced in fp32)
  tracks the single-process bf16_params run (bf16 parameters, fp32 masters in the optimizer), and its blocks
  really computed in bf16 (the logits' dtype). Not bit-equal: each rank's bf16 gradient of half the batch is
  rounded before the fp32 reduction, where one process rounds the whole batch's (tolerances below).
  Its micro-batch gradients accumulate in fp32: with gradient sync deferred to the last micro-batch, fsdp2
  upcasts the unsharded bf16 gradient to its reduce dtype (fp32) after the first one and adds the rest into it
  (torch's FSDPParam.unsharded_accumulated_grad); the result equals, bit for bit, the fp32 sum of each
  micro-batch's own reduced gradient (checked by hand with defer_fsdp_grad_sync=false too: also equal).
- training.precision=bf16_params under ddp (bf16 replicas, fp32 masters in every rank's optimizer, the fp32 main
  gradients averaged by the strategy, here with accumulation) and megatron_fsdp (fp32 main buffers, bf16 compute
  buffers) reproduce the one-process bf16_params run bitwise (without clipping, whose coefficient a sharded norm
  moves by ~1e-7: measured losses and weights equal; megatron_fsdp's weights are its fp32 masters, compared
  rounded to the bf16 parameters they make).
"""

import traceback
from pathlib import Path

import pytest
import torch
from test_float8_parity import FP8 as _FP8_PARITY, STEPS as _FP8_PARITY_STEPS

from meshforge.models.loss import lm_loss
from meshforge.testing.group import Job
from meshforge.testing.parity import compare, config, results_of
from meshforge.training.trainer import train

pytestmark = pytest.mark.dist

STEPS = 3
# bf16_params, fsdp2 vs one process: step 1 agrees to 4e-5 (grad norm); from there the bf16 weights differ by
# rounding and Adam at lr 1e-2 turns a gradient that is mostly rounding noise into a full lr step either way
# (measured over 4 steps: loss 1.7e-4, grad norm 1.3e-2, weights 3.9e-2 = about lr * steps; 3 are run)
LOSS_RTOL_BF16, WEIGHT_ATOL_BF16, GRAD_NORM_RTOL_BF16 = 1e-3, 8e-2, 3e-2
# fp8 + cp2 vs one process, 5 steps at lr 1e-2 on random tokens. The first step runs identical weights, so it
# differs by the activation scales only (measured: loss 7.5e-6, grad norm 2.6e-3); after it, lr 1e-2 turns those
# differences into full Adam steps (measured: loss 3.2e-3, grad norm 3.9e-2, weights 5.9e-2 ~ lr * steps, so no
# weight bound is asserted: it would not discriminate)
FIRST_LOSS_RTOL_FP8_CP, FIRST_GRAD_NORM_RTOL_FP8_CP, LOSS_RTOL_FP8_CP, GRAD_NORM_RTOL_FP8_CP = 1e-4, 5e-3, 1e-2, 6e-2
SMALL = ["training.global_batch_size=4", "training.seq_len=16"]
COMPILE = SMALL + ["training.compile=true", "training.compile_backend=aot_eager"]
BF16 = SMALL + ["training.precision=bf16_params"]
COMPILED = {
    "compile_fsdp2_ac": COMPILE + ["distributed.strategy=fsdp2", "distributed.activation_checkpointing=full"],
    "compile_tp_sp": COMPILE + ["distributed.tp_size=2", "distributed.sequence_parallel=true"],
    "compile_megatron_fsdp": COMPILE + ["distributed.strategy=megatron_fsdp"],
}
# FP8 (torchao, every block linear) with context parallelism: each cp rank scales its half of the sequence's
# activations by their own amax, one process by the whole sequence's, so the runs differ by fp8 rounding
# (the overrides and steps of test_float8_parity.py: the suite computes that single-process reference once)
FP8, FP8_STEPS = list(_FP8_PARITY), _FP8_PARITY_STEPS
# bf16_params where the masters are replicated (ddp) or in megatron_fsdp's main buffers: bitwise without clipping
BF16_EXACT = BF16 + ["training.grad_clip=null"]
# (the reference with the same micro batches: bf16 gradients are rounded per micro batch)
BF16_BITWISE = {"bf16_params_ddp_accum": BF16_EXACT + ["training.micro_batch_size=1", "distributed.strategy=ddp"],
                "bf16_params_megatron_fsdp": BF16_EXACT + ["distributed.strategy=megatron_fsdp"]}
N2 = {**{k: (v, STEPS) for k, v in COMPILED.items()},
      "bf16_params_fsdp2": (BF16 + ["distributed.strategy=fsdp2"], STEPS),
      **{k: (v, STEPS) for k, v in BF16_BITWISE.items()},
      "fp8_cp2": (FP8 + ["distributed.cp_size=2"], FP8_STEPS)}


def fast_step_job(spec: dict, info) -> dict:
    """Each config in this group: losses, grad norms, weights (rank 0), the graphs dynamo captured for it."""
    out = {}
    for name, (overrides, steps) in spec.items():
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        try:
            res = train(config(overrides, steps, info.world_size), info)
            out[name] = {"losses": res.losses, "grad_norms": res.grad_norms}
            out[name]["graphs"] = int(torch._dynamo.utils.counters["stats"]["unique_graphs"])
            if name == "bf16_params_fsdp2":  # the logits, in the dtype the blocks computed in
                out[name]["accumulation"] = _accumulation(res.parallel_model)
                model = res.parallel_model.model.eval()
                with torch.no_grad():
                    out[name]["logits_dtype"] = str(model(torch.zeros(1, 8, dtype=torch.long)).dtype)
            w = res.parallel_model.full_state_dict()
            if info.rank == 0:
                out[name]["weights"] = w
        except Exception as err:  # noqa: BLE001 - reported to the test
            out[name] = {"error": f"{type(err).__name__}: {err}\n{traceback.format_exc()}"}
    return out


GROUP_JOBS = [Job("fast step n2", f"{Path(__file__).resolve()}:fast_step_job", N2, 2)]


def _accumulation(pm) -> tuple[bool, float]:
    """16 micro-batches (a large gradient, then 15 small ones) accumulated by fsdp2 against the fp32 sum of each
    one's own gradient: (bit-equal, how far a bf16 sum would be from it)."""
    model, gen = pm.model, torch.Generator().manual_seed(5)
    xs = [torch.randint(0, 256, (2, 16), generator=gen) for _ in range(16)]

    def grads(micro: list) -> dict:
        model.zero_grad(set_to_none=True)
        for i, x in enumerate(micro):
            with pm.strategy.micro_step(model, is_last=i == len(micro) - 1):
                (lm_loss(model(x), x).ce_sum * (1.0 if x is xs[0] else 1e-2)).backward()
        return {n: p.grad.full_tensor() for n, p in model.named_parameters()}

    acc, each = grads(xs), [grads([x]) for x in xs]
    ref = {n: sum((g[n] for g in each[1:]), each[0][n].clone()) for n in acc}  # fp32, in order
    bf16 = {n: sum((g[n].bfloat16() for g in each[1:]), each[0][n].bfloat16()) for n in acc}
    model.zero_grad(set_to_none=True)
    return (all(acc[n].dtype == torch.float32 and torch.equal(acc[n], ref[n]) for n in acc),
            max((bf16[n].float() - ref[n]).abs().max().item() for n in acc))


@pytest.mark.parametrize("name", list(COMPILED))
def test_regional_compile_composes_n2(reference, group, name):
    got = group("fast step n2")[name]
    assert got["graphs"] >= 1, f"{name}: nothing was compiled"
    compare(reference(SMALL, STEPS), results_of({name: got})[name], name, 1e-5, 5e-5)


def test_bf16_params_under_fsdp2_tracks_one_process(reference, group):
    got = group("fast step n2")["bf16_params_fsdp2"]
    assert got.get("logits_dtype") == "torch.bfloat16", got.get("error") or got["logits_dtype"]  # gathered in bf16
    compare(reference(BF16, STEPS), results_of({"x": got})["x"], "bf16_params_fsdp2", LOSS_RTOL_BF16,
            WEIGHT_ATOL_BF16, GRAD_NORM_RTOL_BF16)
    equal, bf16_off = got["accumulation"]
    assert equal and bf16_off > 1e-3, got["accumulation"]  # fp32 accumulation, where bf16 would be off (3.5e-2)


def test_fp8_with_context_parallelism_tracks_one_process(reference, group):
    ref, got = reference(FP8, FP8_STEPS), results_of({"x": group("fast step n2")["fp8_cp2"]})["x"]
    compare(ref, got, "fp8_cp2", LOSS_RTOL_FP8_CP, None, GRAD_NORM_RTOL_FP8_CP)
    assert abs(got.losses[0] - ref.losses[0]) <= FIRST_LOSS_RTOL_FP8_CP * ref.losses[0], (ref.losses, got.losses)
    assert abs(got.grad_norms[0] - ref.grad_norms[0]) <= FIRST_GRAD_NORM_RTOL_FP8_CP * ref.grad_norms[0]


@pytest.mark.parametrize("name", list(BF16_BITWISE))
def test_bf16_params_under_ddp_and_megatron_fsdp_is_bitwise(reference, group, name):
    overrides = [o for o in BF16_BITWISE[name] if not o.startswith("distributed.")]
    ref, got = reference(overrides, STEPS), results_of({name: group("fast step n2")[name]})[name]
    bf16 = {k: v.bfloat16() for k, v in got.weights.items()}  # (megatron_fsdp's: the fp32 masters)
    got = type(got)(got.losses, got.grad_norms, bf16, got.error)
    ref = type(ref)(ref.losses, ref.grad_norms, {k: v.bfloat16() for k, v in ref.weights.items()})
    compare(ref, got, name, loss_rtol=1e-6, weight_atol=0.0, grad_norm_rtol=1e-6)  # (loss: the sum order, 1 ulp)
