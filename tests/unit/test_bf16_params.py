"""training.precision=bf16_params: bf16 parameters and no autocast, fp32 master weights in the optimizer
(distributed/master_weights.py): fp32 main grads summed over the micro-batches, masters made from, and loaded
in, full precision. One process, tiny model.

Tolerance against the fp32 run: 2e-2 relative loss per step over 10 steps at lr 1e-2 on random tokens (bf16
rounds every matmul input: measured 2e-3)."""

import pytest
import torch

from meshforge.bench.measure import state_bytes
from meshforge.checkpoint.hf import export_checkpoint, save_weights_only
from meshforge.checkpoint.peft import export_adapter
from meshforge.config import load_config
from meshforge.distributed.grad_norm import clip_grad_norm_
from meshforge.distributed.master_weights import MasterWeightAdamW
from meshforge.errors import ConfigError
from meshforge.models import build_model, init_weights
from meshforge.testing.parity import config, single_info
from meshforge.training.trainer import Trainer, train

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
    # a step's gradients, over 4 micro-batches: bf16 grads freed, summed in fp32 main grads
    gen = torch.Generator().manual_seed(3)
    batch = [(torch.randint(0, 256, (2, 32), generator=gen), torch.randint(0, 256, (2, 32), generator=gen))
             for _ in range(4)]
    pm.forward_backward(batch)
    assert all(p.grad is None and p.main_grad.dtype == torch.float32 for p in params)
    norm = pm.clip_grad_norm_(None)
    want = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.main_grad) for p in params]))
    assert norm.dtype == torch.float32 and torch.allclose(norm, want, rtol=1e-6)
    # the bench's state bytes: bf16 params (2), fp32 main grads (4), fp32 masters and moments (4 + 8), a step
    # per tensor (the formula the planner uses)
    n, n_tensors = sum(p.numel() for p in params), len(params)
    got = state_bytes([pm.model], opt)
    assert (got["params"], got["grads"]) == (2 * n, 4 * n)
    assert got["optimizer"] == 12 * n + 4 * n_tensors, (got, n, n_tensors)
    opt.zero_grad()
    assert all(p.main_grad is None for p in params)


def test_micro_batch_gradients_accumulate_in_fp32_and_the_step_uses_them():
    """Many micro-batches with small gradients after a large one: a bf16 p.grad rounds every addition, the fp32
    main grad is the fp32 sum; the grad norm, the clipping and the update all read that sum."""
    torch.manual_seed(0)
    w0 = torch.randn(4, 8).to(torch.bfloat16)
    p = torch.nn.Parameter(w0.clone())
    opt = MasterWeightAdamW([p], lr=1e-2, weight_decay=0.0, foreach=False)
    bf16_acc = torch.nn.Parameter(w0.clone())  # what a bf16 p.grad does with the same micro-batches
    ref = None
    xs = [torch.randn(2, 8).to(torch.bfloat16) * (1.0 if i == 0 else 1e-2) for i in range(64)]
    for x in xs:
        (x @ p.t()).square().sum().backward()
        (x @ bf16_acc.t()).square().sum().backward()
        alone = torch.nn.Parameter(w0.clone())  # this micro-batch's own bf16 gradient
        (x @ alone.t()).square().sum().backward()
        ref = alone.grad.float() if ref is None else ref + alone.grad.float()  # fp32 sum, in order
    assert p.grad is None and p.main_grad.dtype == torch.float32
    assert torch.equal(p.main_grad, ref)  # the fp32 reference sum, exactly
    exact = sum(2 * (x.double() @ w0.double().t()).t() @ x.double() for x in xs)  # d/dw sum((x w^T)^2)
    assert torch.allclose(p.main_grad.double(), exact, rtol=1e-2, atol=0)  # bf16 terms: 7e-3; bf16 sum: 3e-2
    bf16_err = (bf16_acc.grad.float() - ref).abs().max().item()
    assert bf16_err > 1e3 * ref.abs().max().item() * 2**-24, bf16_err  # bf16 accumulation lost much more
    norm = clip_grad_norm_([p], max_norm=1e-3)
    assert torch.equal(norm, torch.linalg.vector_norm(ref))
    coef = torch.clamp(1e-3 / (norm + 1e-6), max=1.0)
    assert torch.equal(p.main_grad, ref * coef)
    twin = torch.nn.Parameter(w0.float())  # fp32 AdamW stepped with the clipped fp32 sum
    twin.grad = ref * coef
    torch.optim.AdamW([twin], lr=1e-2, weight_decay=0.0, foreach=False).step()
    opt.step()
    assert torch.equal(opt.masters[p], twin.detach()) and torch.equal(p, twin.detach().to(torch.bfloat16))


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
    (["distributed.strategy=fsdp2", "distributed.tp_size=2"], 2, "needs data or context parallel size > 1"),
    (["distributed.strategy=fsdp2", "distributed.tp_size=2", "distributed.pp_size=2"], 4,
     "needs data or context parallel size > 1"),
    (["distributed.strategy=megatron_fsdp", "distributed.grad_reduce_in_fp32=false"], 2, "grad_reduce_in_fp32"),
    (["distributed.strategy=fsdp2", "distributed.mp_policy.param_dtype=fp32"], 2, "contradicts"),
    (["distributed.strategy=ddp", "distributed.static_graph=true"], 2, "static_graph=true is not read"),
])
def test_rules_say_where_it_runs(overrides, world_size, words):
    with pytest.raises(ConfigError) as err:
        load_config(None, ["model.preset=tiny", "data.source=synthetic"] + BF16 + overrides, world_size=world_size)
    assert words in str(err.value) and len(str(err.value).splitlines()) == 1


def test_every_built_in_strategy_and_pipeline_stages_are_accepted():
    """Where the masters live: the optimizer's (world size 1, pipeline stages without dp, every ddp replica),
    fsdp2's fp32 shards, megatron_fsdp's main buffers (also with TP)."""
    for overrides, ws in ([], 1), (["distributed.strategy=ddp"], 1), (["distributed.strategy=fsdp2"], 1), \
            (["distributed.strategy=fsdp2"], 2), (["distributed.strategy=ddp"], 2), \
            (["distributed.strategy=megatron_fsdp"], 1), (["distributed.strategy=megatron_fsdp"], 2), \
            (["distributed.strategy=megatron_fsdp", "distributed.tp_size=2"], 4), \
            (["distributed.pp_size=2"], 2), (["distributed.pp_size=2", "distributed.tp_size=2"], 8):
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


@pytest.mark.parametrize("source", ["init_from", "resume"])
def test_fp32_weights_loaded_at_start_reach_the_masters_unrounded(tmp_path, source):
    """`model.init_from` (fp32 HF safetensors) and `checkpoint.resume` of an fp32 checkpoint: the masters are the
    fp32 values bit for bit (not their bf16 rounding), the bf16 parameters their rounding."""
    model = build_model(config(BF16, 2, 1).model)
    init_weights(model, seed=123)
    want = {k: v.clone() for k, v in model.state_dict().items()}
    assert any(not torch.equal(v, v.to(torch.bfloat16).float()) for v in want.values())  # bf16 would round them
    ck = save_weights_only(model, tmp_path / "ck")
    if source == "init_from":
        export_checkpoint(ck, tmp_path / "hf", shard_mb=1)
    start = f"model.init_from={tmp_path / 'hf'}" if source == "init_from" else f"checkpoint.resume={ck}"
    tr = Trainer.build(config(BF16 + [start, f"run.output_dir={tmp_path / 'run'}"], 2, 1), single_info())
    try:
        if source == "resume":
            tr.checkpoints().resume()
        got = tr.optimizer.master_state_dict(dict(tr.pm.model.state_dict()))
        for k, v in want.items():
            assert got[k].dtype == torch.float32 and torch.equal(got[k], v), k
        assert all(torch.equal(p, m.to(torch.bfloat16)) for p, m in tr.optimizer.masters.items())
    finally:
        tr.loader.close()


def test_lora_keeps_a_bf16_frozen_base_and_fp32_masters_for_the_adapters(tmp_path):
    """bf16_params + LoRA at world size 1: the frozen base is only cast (2 bytes a weight, no master, no main
    grad, never updated), each adapter gets an fp32 master and main grad; the run tracks the fp32 LoRA run
    (3 steps: measured 3e-4 relative). `peft.init_from` (a PEFT folder of fp32 adapters) loads into the masters
    unrounded."""
    lora = ["peft.method=lora", "peft.rank=4", "training.global_batch_size=4", "training.seq_len=16"]
    ref = train(config(lora + [f"run.output_dir={tmp_path / 'ref'}", "checkpoint.save_final=true"], 3, 1),
                single_info())
    res = train(config(BF16 + lora, 3, 1), single_info())
    model, opt = res.parallel_model.model, res.optimizer
    frozen = [p for p in model.parameters() if not p.requires_grad]
    adapters = [p for p in model.parameters() if p.requires_grad]
    assert frozen and adapters and all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert all(getattr(p, "main_param", None) is None and not hasattr(p, "main_grad") for p in frozen)
    assert set(opt.masters) == set(adapters) and all(opt.masters[p].dtype == torch.float32 for p in adapters)
    assert all(torch.equal(p, opt.masters[p].to(torch.bfloat16)) for p in adapters)
    ref_base = [p for p in ref.parallel_model.model.parameters() if not p.requires_grad]
    assert all(torch.equal(p, q.to(torch.bfloat16)) for p, q in zip(frozen, ref_base))  # the base never moved
    rel = max(abs(a - b) / abs(a) for a, b in zip(ref.losses, res.losses))
    print(f"bf16_params LoRA vs fp32 LoRA: max rel loss diff {rel:.2e}")
    assert rel < LOSS_RTOL
    export_adapter(tmp_path / "ref" / "checkpoints" / "step_3", tmp_path / "adapter")
    tr = Trainer.build(config(BF16 + lora + [f"peft.init_from={tmp_path / 'adapter'}"], 1, 1), single_info())
    tr.loader.close()
    want = {n: p for n, p in ref.parallel_model.model.named_parameters() if p.requires_grad}
    got = {n: tr.optimizer.masters[p] for n, p in tr.pm.model.named_parameters() if p.requires_grad}
    assert got.keys() == want.keys() and all(torch.equal(got[n], want[n]) for n in want)
    assert any(not torch.equal(v, v.to(torch.bfloat16).float()) for v in want.values())


def test_injected_nan_gradients_reach_the_fp32_main_grads(monkeypatch, tmp_path):
    """The fault injection (`nan_at_step`) poisons the gradients the step would use: under bf16_params the fp32
    main grads (p.grad is already freed), so the logged grad norm is NaN and the skipped step changes nothing."""
    monkeypatch.setenv("MESHFORGE_FAULT", "nan_at_step:2")
    small = BF16 + ["training.global_batch_size=4", "training.seq_len=16", "training.nonfinite=skip",
                    f"run.output_dir={tmp_path}"]
    res = train(config(small, 2, 1), single_info())
    assert res.skipped_steps == 1 and res.grad_norms[1] != res.grad_norms[1] and res.grad_norms[0] == res.grad_norms[0]
    assert all(torch.isfinite(m).all() for m in res.optimizer.masters.values())
