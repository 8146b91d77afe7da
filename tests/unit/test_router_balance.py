"""Auxiliary-loss-free load balancing (`model.router_bias_update_rate`, models/moe.py `Router`), in one process:
the update is the DeepSeek-V3 formula (checked against a hand computation), the bias steers selection only, a
skewed router's load converges toward uniform under it (measured), the bias stays fp32 and starts at zero from a
meta-device build, and a resume continues it exactly. Its parity at N=2 with EP is in
tests/parallel/test_deepseek_parity.py.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from meshforge.distributed.expert_parallel import update_router_biases
from meshforge.models import PRESETS, build_model
from meshforge.testing.parity import config, single_info
from meshforge.training.trainer import train


def _moe(preset: str, rate: float, seed: int = 0):
    """(a one-layer model whose only block is an MoE layer, that layer), weights random, in training mode."""
    args = dataclasses.replace(PRESETS[preset], router_bias_update_rate=rate, n_layers=1, first_k_dense=0)
    torch.manual_seed(seed)
    model = build_model(args).train()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.5)
    return model, model.moe_layers()[0]


class _World1:  # what update_router_biases asks of the mesh at world size 1
    world_size = 1


def test_bias_update_is_the_reference_formula_by_hand():
    model, layer = _moe("tiny_moe", rate=0.1)
    router = layer.router
    # b_i += rate * sign(mean_j load_j - load_i): loads (7, 1, 4, 4), mean 4
    router.update_bias(torch.tensor([7, 1, 4, 4]))
    assert router.expert_bias.tolist() == pytest.approx([-0.1, 0.1, 0.0, 0.0])
    router.update_bias(torch.tensor([2, 2, 9, 3]))  # mean 4: +, +, -, +
    assert router.expert_bias.tolist() == pytest.approx([0.0, 0.2, -0.1, 0.1])

    # through the layer: the load it counts is the top-k of scores + bias, summed over the step's micro batches
    g = torch.Generator().manual_seed(3)
    xs = [torch.randn(2, 8, 64, generator=g) for _ in range(3)]
    bias = router.expert_bias.clone()
    want = torch.zeros(4, dtype=torch.long)
    for x in xs:
        scores = (x.reshape(-1, 64) @ router.gate.weight.detach().T).softmax(-1)
        chosen = (scores + bias).topk(2, dim=-1).indices
        for e in range(4):
            want[e] += int((chosen == e).sum())
        layer(x).sum().backward()
    assert torch.equal(layer.balance_load(), want)
    mean = sum(want.tolist()) / 4
    expect = [b + 0.1 * (1 if n < mean else -1 if n > mean else 0) for b, n in zip(bias.tolist(), want.tolist())]
    update_router_biases([model], _World1())
    assert router.expert_bias.tolist() == pytest.approx(expect, abs=1e-6)
    assert layer.balance_load().sum() == 0  # the next step counts from zero

    # selection only: the weights are the unbiased scores' (renormalised), whatever the bias
    x = xs[0].reshape(-1, 64)
    scores, idx, weights = router(x)
    plain = scores.gather(-1, idx)
    assert torch.allclose(weights, plain / plain.sum(-1, keepdim=True))
    # an evaluation forward (no grad) is not counted
    with torch.no_grad():
        layer(xs[0])
    assert layer.balance_load().sum() == 0


@pytest.mark.parametrize("preset", ["tiny_moe", "tiny_deepseek"])
def test_skewed_router_load_converges_toward_uniform(preset):
    """A router whose gate prefers two experts for every token (the same 128 tokens each step, no gradient step:
    the router alone, its `update_bias` fed the step's load): with the update on (0.01 a step) the load per expert
    approaches the mean (without it the routing, hence the load, stays that of the first step)."""
    _, layer = _moe(preset, rate=0.01, seed=1)
    router = layer.router
    g = torch.Generator().manual_seed(2)
    u = torch.randn(64, generator=g)
    u /= u.norm()
    with torch.no_grad():
        router.gate.weight.mul_(0.1)[:2] += u  # experts 0 and 1 favoured by the tokens' common direction
    x = torch.randn(128, 64, generator=g) + 1.5 * u
    imbalance = []
    for _ in range(200):
        with torch.no_grad():
            load = torch.bincount(router(x)[1].flatten(), minlength=layer.n_experts).float()
        imbalance.append((load.max() / load.mean()).item())
        router.update_bias(load)
    late = sum(imbalance[-50:]) / 50
    print(f"\n{preset}: max/mean expert load {imbalance[0]:.2f} at the start, {late:.3f} over the last 50 of 200 "
          f"steps (bias update 0.01 a step); trajectory {[round(v, 2) for v in imbalance[:60:6]]}")
    assert imbalance[0] > 1.7  # two experts take nearly every token to begin with
    assert late < 1.25 and max(imbalance[-50:]) < 1.4


def test_bias_stays_fp32_starts_at_zero_and_is_saved():
    args = dataclasses.replace(PRESETS["tiny_moe"], router_bias_update_rate=1e-3)
    model = build_model(args, device="meta")
    model.to_empty(device="cpu")
    biases = [m.router.expert_bias for m in model.moe_layers()]
    assert all(torch.equal(b, torch.zeros(4)) for b in biases)  # a meta build materialises to its initial value
    model.moe_layers()[0].router.expert_bias += 0.0123
    model.to(torch.bfloat16)
    bias = model.moe_layers()[0].router.expert_bias
    assert bias.dtype == torch.float32 and torch.equal(bias, torch.full((4,), 0.0123))
    assert "layers.0.feed_forward.router.expert_bias" in model.state_dict()
    plain = build_model(PRESETS["tiny_moe"], device="meta")  # off: no bias, the model's state is as before
    assert not any(k.endswith("expert_bias") for k in plain.state_dict())


@pytest.mark.parametrize("strategy", ["fsdp2", "megatron_fsdp"])  # megatron_fsdp: the bias beside its flat buffers
def test_resume_continues_the_bias_exactly(tmp_path, strategy):
    over = ["model.preset=tiny_deepseek", "model.router_bias_update_rate=1e-2", f"distributed.strategy={strategy}"]
    full = train(config(over + [f"run.output_dir={tmp_path / 'a'}", "checkpoint.interval=2"], 4, 1), single_info())
    step2 = tmp_path / "a" / "checkpoints" / "step_2"
    resumed = train(config(over + [f"run.output_dir={tmp_path / 'b'}", f"checkpoint.resume={step2}"], 4, 1),
                    single_info())
    assert resumed.start_step == 2 and resumed.losses == full.losses[2:]  # bitwise
    a, b = full.parallel_model.full_state_dict(), resumed.parallel_model.full_state_dict()
    bias = [k for k in a if k.endswith("expert_bias")]
    assert bias and a[bias[0]].abs().sum() > 0
    assert all(torch.equal(a[k], b[k]) for k in a)
