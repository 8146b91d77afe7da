"""Context-parallel attention equals full causal attention (forward and gradients), on 2 and 4 gloo processes.

One job of the suite's shared 4-process launch checks cp=4 (all ranks) and cp=2 (two groups of 2 ranks) on
random q, k, v,
with grouped-query attention (8 query heads, 2 kv heads) and with plain multi-head attention, and with a layer's
own rule: a sliding window crossing the chunk borders, a softmax scale, and attention sinks (their gradient too,
summed over the cp ranks), against `models.attention.attend` on the whole sequence. Every rank
computes the single-process reference itself and compares its load-balanced shards of the output and of
dq, dk, dv. Uneven chunks are not allowed (the config rule and the batch transform reject them): tested too.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from meshforge.distributed.context_parallel import CPBatchTransform, load_balanced_indices
from meshforge.testing.group import Job

TOL = 1e-10  # float64 inputs: only rounding differences


def _check(group, cp_size, cp_rank, heads, kv_heads, seq, seed, window=None, sinks=False, scale=None) -> dict:
    import torch.distributed as dist

    from meshforge.distributed.context_parallel import ContextParallelAttention
    from meshforge.models.attention import attend

    g = torch.Generator().manual_seed(seed)
    b, d = 2, 16
    q = torch.randn(b, heads, seq, d, generator=g, dtype=torch.float64)
    k = torch.randn(b, kv_heads, seq, d, generator=g, dtype=torch.float64)
    v = torch.randn(b, kv_heads, seq, d, generator=g, dtype=torch.float64)
    dout = torch.randn(b, heads, seq, d, generator=g, dtype=torch.float64)
    s = torch.randn(heads, generator=g, dtype=torch.float64) if sinks else None
    ref_in = [t.clone().requires_grad_(True) for t in (q, k, v)] + ([s.clone().requires_grad_(True)] if sinks else [])
    ref = attend(*ref_in[:3], window=window, scale=scale, sinks=ref_in[3] if sinks else None)
    ref.backward(dout)

    idx = load_balanced_indices(seq, cp_size, cp_rank)
    loc = [t.index_select(2, idx).clone().requires_grad_(True) for t in (q, k, v)]
    s_loc = s.clone().requires_grad_(True) if sinks else None
    out = ContextParallelAttention(group, cp_size, cp_rank, window=window, scale=scale)(*loc, sinks=s_loc)
    out.backward(dout.index_select(2, idx))
    errs = {"out": (out - ref.index_select(2, idx)).abs().max().item()}
    for name, a, r in zip(("dq", "dk", "dv"), loc, ref_in):
        errs[name] = (a.grad - r.grad.index_select(2, idx)).abs().max().item()
    if sinks:  # each rank's queries give their share of the sinks' gradient
        total = s_loc.grad.clone()
        dist.all_reduce(total, group=group)
        errs["dsinks"] = (total - ref_in[3].grad).abs().max().item()
    return errs


RULES = {"": {}, " window 10 sinks": {"window": 10, "sinks": True},
         " window 7 scale": {"window": 7, "scale": 0.2}}


def cp_job(spec, info) -> list[dict]:
    """Every rank's errors (gathered to rank 0)."""
    import torch.distributed as dist

    rank, world = info.rank, info.world_size
    results = {}
    cases = [(8, 2, 32), (4, 4, 64)]  # (heads, kv heads, sequence length)
    # cp=4 over every rank
    for rule, kw in RULES.items():
        for i, (h, kvh, s) in enumerate(cases):
            results[f"cp4 h{h} kv{kvh} s{s}{rule}"] = _check(dist.group.WORLD, world, rank, h, kvh, s, 10 + i, **kw)
    # cp=2 in two groups {0,1} and {2,3} (every rank must create every group)
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    for rule, kw in RULES.items():
        for i, (h, kvh, s) in enumerate(cases):
            results[f"cp2 h{h} kv{kvh} s{s}{rule}"] = _check(groups[rank // 2], 2, rank % 2, h, kvh, s, 20 + i,
                                                              **kw)
    everyone: list = [None] * world
    dist.all_gather_object(everyone, results)
    return everyone


GROUP_JOBS = [Job("cp attention n4", f"{Path(__file__).resolve()}:cp_job", None, 4)]


@pytest.mark.dist
def test_cp_attention_matches_full_causal_attention(group):
    worst = {}
    for per_rank in group("cp attention n4"):
        for case, errs in per_rank.items():
            for name, e in errs.items():
                worst[(case, name)] = max(worst.get((case, name), 0.0), e)
    for (case, name), e in sorted(worst.items()):
        print(f"{case} {name}: max abs diff {e:.2e}")
    assert len(worst) == 4 * 4 * len(RULES) + 4 * 1  # (out, dq, dk, dv) per case; dsinks per sinks case
    assert max(worst.values()) <= TOL, worst


@pytest.mark.parametrize("device,dtype,tol", [
    ("cpu", torch.float64, 1e-10),
    pytest.param("cuda", torch.float32, 2e-4, marks=pytest.mark.gpu),  # memory-efficient kernel, lower-right mask
    pytest.param("cuda", torch.bfloat16, 3e-2, marks=pytest.mark.gpu),  # flash kernel
])
def test_local_chunk_attention_single_process(device, dtype, tol):
    """The per-rank kernel path (no collectives): this rank's two query chunks against the gathered K/V."""
    import torch.nn.functional as F

    from meshforge.distributed.context_parallel import _CPGroup

    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    g = torch.Generator().manual_seed(5)
    b, h, kvh, s, d = 2, 8, 2, 64, 64
    q, k, v = (torch.randn(b, n, s, d, generator=g).to(device, dtype) for n in (h, kvh, kvh))
    rd = torch.float64 if dtype == torch.float64 else torch.float32
    ref = F.scaled_dot_product_attention(q.to(rd), k.to(rd), v.to(rd), is_causal=True, enable_gqa=True)
    for cp in (2, 4):
        for r in range(cp):
            idx = load_balanced_indices(s, cp, r, device=device)
            out = _CPGroup(None, cp, r).local_attention(q.index_select(2, idx), k, v)
            err = (out.to(rd) - ref.index_select(2, idx)).abs().max().item()
            assert err <= tol, (cp, r, err)


def test_load_balanced_chunks():
    # 2*cp chunks; rank r holds chunks r and 2cp-1-r; together the ranks hold every position once
    s, cp = 16, 4
    held = [load_balanced_indices(s, cp, r).tolist() for r in range(cp)]
    assert held[0] == [0, 1, 14, 15] and held[3] == [6, 7, 8, 9]
    assert sorted(i for h in held for i in h) == list(range(s))
    x = torch.arange(2 * s).view(2, s)
    xl, yl, pos = CPBatchTransform(cp, 1)(x, x + 100)
    assert pos.tolist() == [2, 3, 12, 13]
    assert xl.tolist() == [[2, 3, 12, 13], [18, 19, 28, 29]] and (yl == xl + 100).all()


def test_uneven_sequence_rejected():
    with pytest.raises(ValueError, match="divisible by 2\\*cp_size = 4"):
        load_balanced_indices(30, 2, 0)
    from meshforge.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="seq_len=30 must be divisible by 2\\*cp_size = 4"):
        load_config(None, ["training.seq_len=30", "distributed.cp_size=2", "training.global_batch_size=8",
                           "training.micro_batch_size=2"], world_size=2)



@pytest.mark.filterwarnings("ignore::UserWarning")  # eager FlexAttention warns that it is unfused
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_packed_chunk_block_mask_equals_dense(device):
    """Packed sequences under CP on CUDA: one FlexAttention call with the block mask of this rank's query positions
    equals the dense per-chunk document mask (forward on CPU, eager; forward and backward on CUDA, compiled)."""
    from meshforge.distributed.context_parallel import _CPGroup
    from meshforge.models.attention import document_block_mask

    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    g = torch.Generator().manual_seed(6)
    b, h, kvh, s, d = 2, 4, 2, 48, 16
    docs = torch.tensor([[0] * 7 + [1] * 20 + [2] * 21, [0] * 30 + [1] * 3 + [2] * 15], device=device)
    q, k, v = (torch.randn(b, n, s, d, generator=g).to(device) for n in (h, kvh, kvh))
    cp = 4  # every rank's two chunks sit at different distances from the diagonal
    for r in range(cp):
        idx = load_balanced_indices(s, cp, r, device=device)
        group = _CPGroup(None, cp, r)
        ql = q.index_select(2, idx).requires_grad_(device == "cuda")
        dense = group.local_attention(ql, k, v, docs)
        fast = group.local_attention(ql, k, v, document_block_mask(docs, q_positions=idx))
        assert (fast - dense).abs().max() <= 2e-4, r
        if device == "cuda":
            (gd,), (gf,) = (torch.autograd.grad(o.sum(), ql) for o in (dense, fast))
            assert (gf - gd).abs().max() <= 2e-4, r
