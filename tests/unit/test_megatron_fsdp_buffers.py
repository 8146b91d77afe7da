"""Single-process tests of megatron_fsdp's flat buffers: layout, views, storage freeing, optimizer exactness."""

from __future__ import annotations

import copy
import random

import pytest
import torch

from meshforge.distributed.megatron_fsdp.buffers import flat_layout, local_piece, row_chunk

MODES = ("no_shard", "optim", "optim_grads", "optim_grads_params")


def test_flat_layout_pads_to_world_and_pieces_partition_each_param():
    rng = random.Random(0)
    for _ in range(200):
        numels = [rng.randint(1, 50) for _ in range(rng.randint(1, 6))]
        world = rng.randint(1, 8)
        offsets, padded, shard = flat_layout(numels, world)
        assert padded == shard * world and padded - world < sum(numels) <= padded
        assert offsets == [sum(numels[:i]) for i in range(len(numels))]
        for off, n in zip(offsets, numels):
            pieces = [local_piece(off, n, r * shard, (r + 1) * shard) for r in range(world)]
            covered = [i for a, b in pieces for i in range(a, b)]
            assert covered == list(range(off, off + n))  # every element on exactly one rank, in order


def test_row_chunk_is_torch_chunk_semantics():
    for dim0 in range(13):
        for world in range(1, 6):
            chunks = torch.arange(dim0).chunk(world) if dim0 else []
            for r in range(world):
                a, b = row_chunk(dim0, world, r)
                expect = chunks[r].tolist() if r < len(chunks) else []
                assert list(range(a, b)) == expect, (dim0, world, r)


def _setup(mode: str, extra=()):
    from meshforge.config import load_config
    from meshforge.distributed.mesh import MeshContext
    from meshforge.distributed.parallelize import parallelize_model
    from meshforge.models import build_model, init_weights

    cfg = load_config(None, ["model.preset=tiny", "distributed.strategy=megatron_fsdp",
                             f"distributed.data_parallel_sharding_strategy={mode}", *extra], world_size=1)
    model = build_model(cfg.model)
    init_weights(model, 3)
    ref = copy.deepcopy(model)
    out = parallelize_model(model, MeshContext.build(cfg.distributed, 1), cfg.distributed)
    return cfg, out.model, out.strategy, ref


@pytest.mark.parametrize("mode", MODES)
def test_params_are_views_into_the_unit_buffer(mode):
    _, model, strategy, ref = _setup(mode)
    names = dict(model.named_parameters())
    assert set(names) == set(dict(ref.named_parameters()))
    assert len(strategy.units) == 3  # two blocks + the rest
    for u in strategy.units:
        assert u.padded % u.world == 0
        for s in u.slots:
            assert s.param is names[s.fqn]
            assert s.param.untyped_storage() is u.compute.untyped_storage() or \
                s.param.untyped_storage().data_ptr() == u.compute.untyped_storage().data_ptr()
    if mode == "optim_grads_params":  # freed at rest, gathered for forward, freed after a no-grad forward
        assert all(u.compute.untyped_storage().nbytes() == 0 for u in strategy.units)
        x = torch.randint(0, 256, (2, 16))
        with torch.no_grad():
            assert torch.equal(model(x), ref(x))
        assert all(u.compute.untyped_storage().nbytes() == 0 for u in strategy.units)
    else:
        for n, p in ref.named_parameters():
            assert torch.equal(names[n], p)


@pytest.mark.parametrize("mode", MODES)
def test_optimizer_pieces_equal_plain_adamw(mode):
    """Weight decay on >= 2-D params only, clipping by the global norm: equal to plain AdamW on the full model."""
    from meshforge.distributed.parallelize import Parallelized
    from meshforge.distributed.runtime import ParallelModel
    from meshforge.distributed.strategy import Strategy

    _, model, strategy, ref = _setup(mode)
    opt = torch.optim.AdamW(strategy.optimizer_param_groups(model, 0.1), lr=1e-2, foreach=False)
    ref_opt = torch.optim.AdamW(Strategy.optimizer_param_groups(None, ref, 0.1), lr=1e-2, foreach=False)
    decay_shapes = sorted(p.numel() for p in opt.param_groups[0]["params"])
    assert decay_shapes == sorted(p.numel() for p in ref_opt.param_groups[0]["params"])
    pm = ParallelModel([Parallelized(model, strategy)], strategy.mesh_ctx, torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        x = torch.randint(0, 256, (4, 16), generator=g)
        mbs = [(x[:2], torch.roll(x[:2], -1, 1)), (x[2:], torch.roll(x[2:], -1, 1))]
        loss = pm.forward_backward(mbs)
        norm = pm.clip_grad_norm_(0.5)
        opt.step()
        pm.after_optimizer_step()
        pm.zero_grad(opt)
        ref_loss = sum(torch.nn.functional.cross_entropy(ref(a).flatten(0, 1), b.flatten()) / 2 for a, b in mbs)
        ref_loss.backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        ref_opt.step()
        ref_opt.zero_grad()
        assert abs(loss.item() - ref_loss.item()) <= 1e-6 * ref_loss.item()
        assert abs(norm.item() - ref_norm.item()) <= 1e-5 * ref_norm.item()
    w = pm.full_state_dict()
    for n, p in ref.named_parameters():
        assert (w[n] - p.detach()).abs().max().item() < 1e-6, n


def test_materialize_equals_full_init_and_state_dict_round_trip():
    from meshforge.config import load_config
    from meshforge.distributed.mesh import MeshContext
    from meshforge.distributed.parallelize import parallelize_model
    from meshforge.models import build_model, init_weights

    cfg = load_config(None, ["model.preset=tiny", "distributed.strategy=megatron_fsdp"], world_size=1)
    meta = build_model(cfg.model, device="meta")
    out = parallelize_model(meta, MeshContext.build(cfg.distributed, 1), cfg.distributed)
    model, strategy = out.model, out.strategy
    strategy.materialize(model, 5)
    full = build_model(cfg.model)
    init_weights(full, 5)
    got = strategy.full_state_dict(model)
    assert all(torch.equal(got[n], p) for n, p in full.named_parameters())
    sd = strategy.model_state_dict(model)
    strategy.materialize(model, 6)
    assert not torch.equal(strategy.full_state_dict(model)["output.weight"], got["output.weight"])
    strategy.load_model_state_dict(model, sd)
    assert all(torch.equal(strategy.full_state_dict(model)[n], got[n]) for n in got)


def test_memory_report_counts_buffers():
    _, _, strategy, ref = _setup("optim_grads_params")
    n = sum(p.numel() for p in ref.parameters())
    rep = strategy.memory_report()
    assert rep["total_param_numel"] == n
    assert rep["params_at_rest"] == 4 * sum(u.padded for u in strategy.units)  # main shard only (world 1)
    assert rep["params_gathered_now"] == 0
    assert rep["grads"] == 4 * sum(u.shard for u in strategy.units)  # the grad shard; full buffers freed at rest


def test_bridge_and_zero_dp_spellings():
    from meshforge.config import load_config

    cfg = load_config(None, ["dist.use_megatron_fsdp=true", "ddp.data_parallel_sharding_strategy=optim_grads"],
                      world_size=2)
    assert cfg.distributed.strategy == "megatron_fsdp" and cfg.distributed.sharding_strategy == "optim_grads"
    cfg = load_config(None, ["distributed.strategy=megatron_fsdp", "distributed.zero_dp_strategy=1"], world_size=2)
    assert cfg.distributed.sharding_strategy == "optim"
    assert load_config(None, ["distributed.strategy=megatron_fsdp"], world_size=2).distributed.sharding_strategy \
        == "optim_grads_params"


@pytest.mark.gpu
def test_world_size_one_bf16_on_gpu_trains_close_to_fp32():
    """On a GPU: bf16 compute parameters, fp32 main parameters and reduction; 10 steps stay near the fp32 run."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from meshforge.distributed.env import DistInfo
    from meshforge.testing.parity import config, run_single
    from meshforge.training.trainer import train

    ref = run_single(weights=False)
    cfg = config(["distributed.strategy=megatron_fsdp", "training.device=cuda", "training.precision=bf16"], 10)
    res = train(cfg, DistInfo(0, 1, 0, torch.device("cuda", 0), None))
    strategy = res.parallel_model.strategy
    assert strategy.compute_dtype == torch.bfloat16 and strategy.units[0].main.dtype == torch.float32
    assert all(abs(a - b) <= 2e-2 * abs(a) for a, b in zip(ref.losses, res.losses)), (ref.losses, res.losses)
