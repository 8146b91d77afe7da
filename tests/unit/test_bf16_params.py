"""training.precision=bf16_params: bf16 parameters and no autocast, fp32 master weights in the optimizer
(distributed/master_weights.py). One process, tiny model.

Tolerance against the fp32 run: 2e-2 relative loss per step over 10 steps at lr 1e-2 on random tokens (bf16
rounds every matmul input: measured 2e-3)."""

import pytest
import torch

from meshforge.bench.measure import state_bytes
from meshforge.config import load_config
from meshforge.distributed.master_weights import MasterWeightAdamW
from meshforge.errors import ConfigError
from meshforge.testing.parity import config, single_info
from meshforge.training.trainer import train

BF16 = ["training.precision=bf16_params"]
LOSS_RTOL, STEPS = 2e-2, 10


@pytest.mark.parametrize("fused", [True, False])
def test_an_update_bf16_would_round_away_still_moves_the_master(fused):
    p = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    opt = MasterWeightAdamW([p], lr=1e-4, weight_decay=0.0, fused=fused)
    plain_p = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    plain = torch.optim.AdamW([plain_p], lr=1e-4, weight_decay=0.0)
    for _ in range(10):
        p.grad, plain_p.grad = torch.ones_like(p), torch.ones_like(p)
        opt.step()
        plain.step()
        opt.zero_grad()  # the fp32 main grad, like p.grad after a backward, adds up until zero_grad
    master = opt.masters[p]
    assert master.dtype == torch.float32 and all(t.dtype == torch.float32 for t in opt.state[p].values())
    assert torch.all(plain_p == 1.0)  # ten updates of 1e-4 each round away in bf16 (half an ulp at 1.0 is 2^-8)
    assert torch.allclose(master, torch.full((4,), 1.0 - 1e-3), atol=1e-6)  # the master took all ten
    assert torch.equal(p, master.to(torch.bfloat16))
    for _ in range(40):  # enough to cross half an ulp: the bf16 parameter follows its master's rounding
        p.grad = torch.ones_like(p)
        opt.step()
        opt.zero_grad()
    assert p[0].item() < 1.0 and torch.equal(p, opt.masters[p].to(torch.bfloat16))


def test_bf16_params_train_and_track_the_fp32_run(reference):
    ref = reference([], STEPS)  # the suite's shared fp32 reference
    res = train(config(BF16, STEPS, 1), single_info())
    pm, opt = res.parallel_model, res.optimizer
    assert isinstance(opt, MasterWeightAdamW)
    params = list(pm.model.parameters())
    assert all(p.dtype == torch.bfloat16 for p in params)
    assert pm.autocast().__class__.__name__ == "nullcontext"  # no autocast around the forward
    for p in params:
        assert opt.masters[p].dtype == torch.float32 and torch.equal(p, opt.masters[p].to(torch.bfloat16))
    rel = max(abs(a - b) / abs(a) for a, b in zip(ref.losses, res.losses))
    print(f"bf16_params vs fp32: max rel loss diff {rel:.2e} over {STEPS} steps")
    assert len(res.losses) == STEPS and rel < LOSS_RTOL and res.losses != ref.losses
    # the bench's state bytes: bf16 params and grads (2 + 2), fp32 masters and moments (4 + 8), a step per tensor
    n, n_tensors = sum(p.numel() for p in params), len(params)
    for p in params:
        p.grad = torch.zeros_like(p)
    got = state_bytes([pm.model], opt)
    assert (got["params"], got["grads"]) == (2 * n, 2 * n)
    assert got["optimizer"] == 12 * n + 4 * n_tensors, (got, n, n_tensors)


def _state(res) -> dict:
    opt = res.optimizer
    return {k: v.clone() for k, v in opt.master_state_dict(dict(res.parallel_model.model.state_dict())).items()}


def test_resume_is_bitwise_exact_and_the_checkpoint_holds_the_fp32_masters(tmp_path):
    full = train(config(BF16 + [f"run.output_dir={tmp_path / 'a'}", "checkpoint.interval=2"], 4, 1), single_info())
    step2 = tmp_path / "a" / "checkpoints" / "step_2"
    resumed = train(config(BF16 + [f"run.output_dir={tmp_path / 'b'}", f"checkpoint.resume={step2}"], 4, 1),
                    single_info())
    assert resumed.start_step == 2 and resumed.losses == full.losses[2:]  # bitwise
    a, b = _state(full), _state(resumed)
    assert all(torch.equal(a[k], b[k]) for k in a) and any(v.dtype == torch.float32 for v in a.values())
    opt_a, opt_b = full.optimizer, resumed.optimizer
    for pa, pb in zip(full.parallel_model.model.parameters(), resumed.parallel_model.model.parameters()):
        assert torch.equal(pa, pb) and pb.dtype == torch.bfloat16
        assert all(torch.equal(opt_a.state[pa][k], opt_b.state[pb][k]) for k in opt_a.state[pa])
        assert opt_b.state[pb]["exp_avg"].dtype == torch.float32
    # the saved model tensors are the fp32 masters: an fp32 run resumes them unrounded
    fp32 = train(config([f"run.output_dir={tmp_path / 'c'}", f"checkpoint.resume={step2}"], 2, 1), single_info())
    mid = train(config(BF16 + [f"run.output_dir={tmp_path / 'd'}", "checkpoint.interval=2"], 2, 1), single_info())
    want = _state(mid)
    got = fp32.parallel_model.model.state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.parametrize("overrides, world_size, words", [
    (["distributed.strategy=ddp"], 2, "no fsdp2 sharding"),
    (["distributed.strategy=fsdp2", "distributed.tp_size=2"], 2, "no fsdp2 sharding"),
    (["distributed.strategy=megatron_fsdp"], 1, "megatron_fsdp keeps its own"),
    (["distributed.pp_size=2"], 2, "pp_size=2"),
    (["distributed.strategy=fsdp2", "distributed.mp_policy.param_dtype=fp32"], 2, "contradicts"),
])
def test_rules_say_where_it_runs(overrides, world_size, words):
    with pytest.raises(ConfigError) as err:
        load_config(None, ["model.preset=tiny", "data.source=synthetic"] + BF16 + overrides, world_size=world_size)
    assert words in str(err.value) and len(str(err.value).splitlines()) == 1


def test_fsdp2_sharded_and_world_size_one_are_accepted():
    for overrides, ws in ([], 1), (["distributed.strategy=ddp"], 1), (["distributed.strategy=fsdp2"], 2):
        load_config(None, ["model.preset=tiny", "data.source=synthetic"] + BF16 + overrides, world_size=ws)


def test_fp8_composes_with_bf16_params():
    """torchao's Float8Linear over bf16 weights: converted, trains, tracks bf16_params without FP8 (3 steps:
    measured 8e-4 relative)."""
    pytest.importorskip("torchao.float8")
    small = BF16 + ["training.global_batch_size=4", "training.seq_len=16"]
    plain = train(config(small, 3, 1), single_info())
    fp8 = train(config(small + ["training.fp8.enabled=true", "training.fp8.filter=all"], 3, 1), single_info())
    converted = [m for m in fp8.parallel_model.model.modules() if type(m).__name__ == "Float8Linear"]
    assert converted and all(m.weight.dtype == torch.bfloat16 for m in converted)
    assert max(abs(a - b) / a for a, b in zip(plain.losses, fp8.losses)) < 5e-3
