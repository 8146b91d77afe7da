"""The mixture-of-experts model on one process: routing, dropless experts, grouped matmul vs loop, the aux
loss's gradient path, zero gradients for idle experts, activation checkpointing, presets and FLOPs."""

import pytest
import torch
import torch.nn.functional as F

from meshforge.config import load_config
from meshforge.models import build_model, init_weights, resolve_model_args
from meshforge.models.moe import GroupedExperts, MoE, MoETransformer


def tiny(*overrides, seed=3):
    cfg = load_config(None, ["model.preset=tiny_moe", *overrides])
    model = build_model(cfg.model)
    init_weights(model, seed)
    return model


def tokens(b=2, s=16, seed=0):
    return torch.randint(0, 256, (b, s), generator=torch.Generator().manual_seed(seed))


def naive_moe(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """Token by token: sum over its top-k experts of weight * SwiGLU expert(x), plus the shared experts."""
    flat = x.reshape(-1, x.shape[-1])
    _, idx, w = moe.router(flat)
    e = moe.experts
    out = torch.zeros_like(flat)
    for t in range(flat.shape[0]):
        for j in range(idx.shape[1]):
            k = idx[t, j]
            out[t] += w[t, j] * ((F.silu(flat[t] @ e.w1[k]) * (flat[t] @ e.w3[k])) @ e.w2[k])
    if moe.shared_experts is not None:
        out = out + moe.shared_experts(flat)
    return out.view_as(x)


def test_structure_and_parameter_names():
    m = tiny()
    assert isinstance(m, MoETransformer)
    shapes = {n: tuple(p.shape) for n, p in m.named_parameters()}
    assert shapes["layers.0.feed_forward.experts.w1"] == (4, 64, 64)
    assert shapes["layers.0.feed_forward.experts.w2"] == (4, 64, 64)
    assert shapes["layers.1.feed_forward.router.gate.weight"] == (4, 64)
    assert "layers.0.feed_forward.shared_experts.w1.weight" in shapes
    assert not any(".feed_forward.w1" in n for n in shapes)
    # experts' down projection is a residual projection (scaled init), like the dense w2
    assert m.init_spec("layers.0.feed_forward.experts.w2")[1] < m.init_spec("layers.0.feed_forward.experts.w1")[1]


@pytest.mark.parametrize("score_func,route_norm", [("softmax", True), ("softmax", False), ("sigmoid", True),
                                                   ("sigmoid", False)])
def test_dropless_layer_matches_token_by_token_reference(score_func, route_norm):
    m = tiny(f"model.score_func={score_func}", f"model.route_norm={str(route_norm).lower()}")
    moe = m.layers["0"].feed_forward
    x = torch.randn(2, 12, 64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got, want = moe(x), naive_moe(moe, x)
        _, idx, w = moe.router(x.reshape(-1, 64))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert idx.shape == (24, 2) and (idx[:, 0] != idx[:, 1]).all()
    if route_norm:
        torch.testing.assert_close(w.sum(-1), torch.ones(24))
    elif score_func == "softmax":
        assert (w.sum(-1) < 1).all()


def test_grouped_mm_and_loop_give_the_same_results(monkeypatch):
    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("this torch has no _grouped_mm; the loop is the only path")
    x = tokens()
    m = tiny()
    results = []
    for grouped in (True, False):
        monkeypatch.setattr(GroupedExperts, "use_grouped_mm", grouped)
        m.zero_grad()
        out, aux = m(x)
        (out.pow(2).mean() + aux).backward()
        results.append((out.detach(), {n: p.grad.clone() for n, p in m.named_parameters()}))
    (o1, g1), (o2, g2) = results
    torch.testing.assert_close(o1, o2, rtol=1e-6, atol=1e-6)
    for n in g1:
        torch.testing.assert_close(g1[n], g2[n], rtol=1e-5, atol=1e-7, msg=n)


def test_grouped_mm_matches_loop_with_empty_experts_and_bf16():
    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("no _grouped_mm")
    for dtype, tol in ((torch.float32, 1e-6), (torch.bfloat16, 2e-2)):
        e = GroupedExperts(4, 16, 32).to(dtype)
        for p in e.parameters():
            torch.nn.init.normal_(p, std=0.1)
        counts = torch.tensor([3, 0, 5, 0])
        x = torch.randn(8, 16, dtype=dtype)
        outs = []
        for grouped in (True, False):
            e.use_grouped_mm = grouped
            e.zero_grad()
            y = e(x, counts)
            y.sum().backward()  # an expanded (stride 0) gradient: grouped_mm's backward needs it contiguous
            outs.append((y.detach().float(), e.w1.grad.float().clone()))
            assert e.w1.grad[1].abs().sum() == 0 and e.w2.grad[3].abs().sum() == 0  # idle experts: zero grads
        torch.testing.assert_close(outs[0][0], outs[1][0], rtol=tol, atol=tol)
        torch.testing.assert_close(outs[0][1], outs[1][1], rtol=tol, atol=tol)


def test_aux_loss_alone_reaches_every_router_and_is_in_the_training_loss():
    m = tiny()
    _, aux = m(tokens())
    assert aux.requires_grad and aux.item() > 0
    aux.backward()
    for i in m.layers:
        g = m.layers[i].feed_forward.router.gate.weight.grad
        assert g is not None and g.abs().sum() > 0, f"layer {i}: router got no gradient from the aux loss"
    # lm_loss adds it: the router gradient of ce + aux differs from ce alone by exactly the aux gradient
    from meshforge.models.loss import lm_loss

    y = tokens(seed=1)
    grads = []
    for with_aux in (True, False):
        m.zero_grad()
        o = m(tokens())
        lp = lm_loss(o if with_aux else o[0], y)
        ce, a = lp.mean, lp.aux
        (ce if a is None else ce + a).backward()
        grads.append(m.layers["0"].feed_forward.router.gate.weight.grad.clone())
    assert (grads[0] - grads[1]).abs().max() > 1e-7
    m.eval()
    assert isinstance(m(tokens()), torch.Tensor)  # evaluation: logits only


def test_aux_loss_coefficient_zero_returns_logits_only():
    m = tiny("model.aux_loss_coeff=0")
    assert isinstance(m(tokens()), torch.Tensor)


def test_an_expert_that_receives_no_token_gets_a_zero_gradient():
    m = tiny()
    for i in m.layers:  # expert 3 can never win a top-k slot
        m.layers[i].feed_forward.router.gate.register_forward_hook(
            lambda mod, inp, out: out.index_fill(-1, torch.tensor([3]), -1e4))
    out, aux = m(tokens())
    assert all(m.layers[i].feed_forward.last_counts[3] == 0 for i in m.layers)
    (out.pow(2).mean() + aux).backward()
    for i in m.layers:
        e = m.layers[i].feed_forward.experts
        for w in (e.w1, e.w2, e.w3):
            assert w.grad is not None and w.grad[3].abs().sum() == 0 and w.grad[:3].abs().sum() > 0


def test_activation_checkpointing_counts_the_aux_loss_once_and_replays_routing():
    from meshforge.distributed.activation_checkpointing import apply_activation_checkpointing

    x, y = tokens(), tokens(seed=1)
    ref = tiny()
    out, aux = ref(x)
    (F.cross_entropy(out.flatten(0, 1), y.flatten()) + aux).backward()
    for mode, replay in (("full", False), ("full", True), ("selective", True)):
        m = tiny()
        apply_activation_checkpointing(m.blocks(), mode)
        for moe in m.moe_layers():
            moe.router.replay_routing = replay
        for _ in range(2):  # the second step would see a stale or doubled aux loss if any leaked
            m.zero_grad()
            o, a = m(x)
            assert torch.equal(a.detach(), aux.detach())
            (F.cross_entropy(o.flatten(0, 1), y.flatten()) + a).backward()
            for n, p in m.named_parameters():
                torch.testing.assert_close(p.grad, dict(ref.named_parameters())[n].grad, rtol=1e-5, atol=1e-7,
                                           msg=f"{mode} replay={replay}: {n}")
            assert all(not moe.router._routing_fifo for moe in m.moe_layers())


def test_replayed_routing_is_identical_in_the_recompute_even_if_scores_change():
    """ignore_router_for_ac: the recompute reuses the forward's decision, whatever the router computes then."""
    from meshforge.distributed.activation_checkpointing import apply_activation_checkpointing
    from meshforge.models.moe import in_backward

    for replay in (True, False):
        m = tiny()
        apply_activation_checkpointing(m.blocks(), "full")
        seen = {"fwd": [], "recompute": []}
        for moe in m.moe_layers():
            moe.router.replay_routing = replay
            # in the recompute, flip the scores so a fresh top-k would pick the other experts
            moe.router.gate.register_forward_hook(lambda mod, inp, out: -out if in_backward() else out)
            orig = moe.router.forward

            def spy(x, _orig=orig, seen=seen):
                s, idx, w = _orig(x)
                seen["recompute" if in_backward() else "fwd"].append(idx.clone())
                return s, idx, w

            moe.router.forward = spy
        out, aux = m(tokens())
        (out.pow(2).mean() + aux).backward()
        same = all(torch.equal(a, b) for a, b in zip(seen["fwd"], reversed(seen["recompute"])))
        assert len(seen["recompute"]) == 2
        assert same is replay


def test_presets_parameter_counts_and_active_flops():
    # published sizes: Mixtral 8x7B 46.7B total / 12.9B active; Qwen3-30B-A3B 30.5B total / 3.3B active
    for preset, total, active in (("mixtral_8x7b", 46.7e9, 12.9e9), ("qwen3_30b_a3b", 30.5e9, 3.3e9)):
        cfg = load_config(None, [f"model.preset={preset}"])
        m = build_model(cfg.model, device="meta")
        a = m.args
        n_total = sum(p.numel() for p in m.parameters())
        assert abs(n_total - total) / total < 0.01, (preset, n_total)
        attn_proj = a.dim * a.hd * (2 * a.n_heads + 2 * a.n_kv_heads)
        n_active = a.n_layers * (attn_proj + m.active_ffn_params_per_layer()) + 2 * a.dim * a.vocab_size
        assert abs(n_active - active) / active < 0.02, (preset, n_active)
        seq = 4096
        attn = a.n_layers * 2 * a.n_heads * a.hd * seq
        assert m.flops_per_token(seq) == 6 * (n_active - a.dim * a.vocab_size) + 3 * attn
        assert m.flops_per_token(seq) < 6 * n_total / 2  # far from counting every expert


def test_active_ffn_params_match_the_layer():
    m = tiny()
    moe = m.layers["0"].feed_forward
    a = m.args
    per_expert = sum(p[0].numel() for p in (moe.experts.w1, moe.experts.w2, moe.experts.w3))
    shared = sum(p.numel() for p in moe.shared_experts.parameters())
    assert m.active_ffn_params_per_layer() == a.top_k * per_expert + shared + moe.router.gate.weight.numel()


def test_rules_reject_bad_expert_parallel_configs():
    from meshforge.config.rules import check

    def problems(*ov, world=4):
        from meshforge.config.schema import Config

        raw: dict = {}
        for o in ov:
            key, value = o.split("=")
            section, name = key.split(".")
            raw.setdefault(section, {})[name] = int(value) if value.isdigit() else value
        return check(Config.model_validate(raw), world)

    assert any("must divide model.n_experts=4" in p for p in problems("model.preset=tiny_moe",
                                                                      "distributed.ep_size=8", world=8))
    assert any("dense" in p for p in problems("model.preset=tiny", "distributed.ep_size=2"))
    assert any("must divide dp_size*cp_size" in p for p in problems("model.preset=tiny_moe",
                                                                    "distributed.ep_size=4", world=2))
    assert any("megatron_fsdp" in p for p in problems("model.preset=tiny_moe", "distributed.strategy=megatron_fsdp",
                                                      "distributed.ep_size=2"))
    assert any("ddp" in p for p in problems("model.preset=tiny_moe", "distributed.strategy=ddp",
                                            "distributed.ep_size=2"))
    # sequence parallelism and pipeline stages with MoE run (parity: tests/parallel/test_expert_parallel.py,
    # test_pipeline_parity.py)
    assert problems("model.preset=tiny_moe", "distributed.tp_size=2", "distributed.sequence_parallel=true") == []
    assert problems("model.preset=tiny_moe", "distributed.pp_size=2", "distributed.ep_size=2", world=4) == []
    assert problems("model.preset=tiny_moe", "distributed.ep_size=2") == []
    assert resolve_model_args(load_config(None, ["model.preset=tiny_moe"]).model).is_moe


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_grouped_mm_matches_loop_on_cuda_bf16():
    e = GroupedExperts(8, 128, 256).to("cuda", torch.bfloat16)
    for p in e.parameters():
        torch.nn.init.normal_(p, std=0.05)
    counts = torch.tensor([5, 0, 17, 3, 0, 0, 9, 30], device="cuda")
    x = torch.randn(int(counts.sum()), 128, device="cuda", dtype=torch.bfloat16)
    outs = []
    for grouped in (True, False):
        e.use_grouped_mm = grouped
        e.zero_grad()
        y = e(x, counts)
        y.float().pow(2).sum().backward()
        outs.append((y.float(), e.w2.grad.float().clone()))
    torch.testing.assert_close(outs[0][0], outs[1][0], rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(outs[0][1], outs[1][1], rtol=3e-2, atol=3e-2)


def test_aux_loss_over_split_tokens_equals_the_whole_batch_with_a_stats_reducer():
    """Context parallelism's view: each rank holds half the micro batch's tokens; with the per-expert sums
    added over the halves, each half's aux value is the whole batch's, and the halves' gradients add up to
    the whole batch's gradient (the dp_cp averaging is then undone by aux_grad_scale = cp)."""
    moe = tiny().layers["0"].feed_forward
    x = torch.randn(24, 64, generator=torch.Generator().manual_seed(5))
    halves = (x[:12], x[12:])

    def stats(h):
        with torch.no_grad():
            scores, idx, _ = moe.router(h)
        counts = torch.bincount(idx.reshape(-1), minlength=moe.n_experts).float()
        return torch.cat([scores.sum(0), counts, torch.tensor([float(h.shape[0])])])

    moe(x)
    full = moe.aux_loss
    g_full = torch.autograd.grad(full, moe.router.gate.weight)[0]
    g_sum = torch.zeros_like(g_full)
    for i, h in enumerate(halves):
        other = stats(halves[1 - i])
        moe.stats_reducer = lambda t, other=other: t + other
        moe(h)
        torch.testing.assert_close(moe.aux_loss, full, rtol=1e-6, atol=1e-8)
        g_sum += torch.autograd.grad(moe.aux_loss, moe.router.gate.weight)[0]
    torch.testing.assert_close(g_sum, g_full, rtol=1e-5, atol=1e-9)
