"""The fused (chunked) loss: same loss and gradients as the plain logits path, a fraction of its memory.

The plain path (`training.fused_loss=false`) is the reference: fp32, loss and every gradient within 1e-6
(relative to the gradient's scale). Peak memory is counted exactly, from the storages the loss's forward and
backward allocate (a dispatch mode that tracks every live tensor storage), at vocabulary 128,256.
"""

import weakref

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from meshforge.config.rules import check, warnings
from meshforge.planning.precision import fused_loss_note, fused_loss_on
from meshforge.config.schema import Config, ModelConfig
from meshforge.models import build_model, contract_of, init_weights
from meshforge.models.loss import IGNORE_INDEX, HeadInput, chunked_cross_entropy, lm_loss


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _loss_and_grads(model, x, y, fused: bool, chunk_tokens=None):
    model.zero_grad(set_to_none=True)
    model.set_fused_loss(fused)
    out = model(x)
    assert isinstance(out[0] if isinstance(out, tuple) and not isinstance(out, HeadInput) else out,
                      HeadInput) == fused
    parts = lm_loss(out, y, chunk_tokens=chunk_tokens)
    loss = parts.mean if parts.aux is None else parts.mean + parts.aux
    loss.backward()
    return parts, _grads(model)


@pytest.mark.parametrize("preset,tie", [("tiny", False), ("tiny", True), ("tiny_moe", False)])
def test_fused_loss_equals_plain_loss_and_grads(preset, tie):
    model = build_model(ModelConfig(preset=preset, tie_embeddings=tie))
    init_weights(model, seed=5)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, model.args.vocab_size, (3, 19), generator=g)
    y = torch.randint(0, model.args.vocab_size, (3, 19), generator=g)
    y[0, :7] = IGNORE_INDEX  # ignored tokens carry no loss, in both paths
    y[2, -1] = IGNORE_INDEX
    plain, g_plain = _loss_and_grads(model, x, y, fused=False)
    fused, g_fused = _loss_and_grads(model, x, y, fused=True, chunk_tokens=8)  # 57 tokens -> 8 chunks
    assert int(fused.n_tokens) == int(plain.n_tokens) == 3 * 19 - 8
    assert abs(fused.ce_sum.item() - plain.ce_sum.item()) <= 1e-6 * plain.ce_sum.item()
    assert (fused.aux is None) == (plain.aux is None)
    assert set(g_fused) == set(g_plain)
    for name, ref in g_plain.items():
        err = (g_fused[name] - ref).abs().max().item()
        assert err <= 1e-6 * max(ref.abs().max().item(), 1e-3), f"{name}: {err:.3e}"


def test_chunked_cross_entropy_matches_torch_in_bf16_matmul_and_all_ignored():
    g = torch.Generator().manual_seed(1)
    h = torch.randn(40, 16, generator=g, requires_grad=True)
    w = torch.randn(300, 16, generator=g, requires_grad=True)
    y = torch.randint(0, 300, (40,), generator=g)
    # bf16 matmul, fp32 softmax: the plain path under autocast does the same
    ref = F.cross_entropy((h.bfloat16() @ w.bfloat16().t()).float(), y, reduction="sum")
    got = chunked_cross_entropy(h, w, y, torch.bfloat16, chunk_tokens=7)
    assert abs(got.item() - ref.item()) <= 1e-5 * ref.item()
    # a micro batch whose labels are all ignored: zero loss and zero gradients, not NaN
    none = chunked_cross_entropy(h, w, torch.full((40,), IGNORE_INDEX), chunk_tokens=7)
    none.backward()
    assert none.item() == 0.0 and h.grad.abs().sum() == 0 and w.grad.abs().sum() == 0


def test_head_input_records_the_autocast_dtype():
    model = build_model(ModelConfig(preset="tiny"))
    model.set_fused_loss(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(torch.randint(0, 256, (1, 8)))
    assert isinstance(out, HeadInput) and out.dtype == torch.bfloat16 and out.weight is model.output.weight


class _PeakBytes(TorchDispatchMode):
    """Exact peak of the bytes held by tensor storages allocated while active (freed ones are subtracted)."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self.seen: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                st = t.untyped_storage()
                key = st.data_ptr()
                if key and key not in self.seen:
                    self.seen.add(key)
                    self.live += st.nbytes()
                    self.peak = max(self.peak, self.live)
                    weakref.finalize(st, self._free, key, st.nbytes())
        return out

    def _free(self, key, nbytes):
        self.seen.discard(key)
        self.live -= nbytes


def _loss_peak_bytes(fused: bool, vocab=128_256, dim=16, tokens=96) -> int:
    g = torch.Generator().manual_seed(2)
    hidden = torch.randn(1, tokens, dim, generator=g, requires_grad=True)
    head = torch.nn.Linear(dim, vocab, bias=False)
    labels = torch.randint(0, vocab, (1, tokens), generator=g)
    with _PeakBytes() as meter:
        out = HeadInput(hidden, head.weight) if fused else head(hidden)
        lm_loss(out, labels, chunk_tokens=16).mean.backward()
        del out
    return meter.peak


def test_fused_loss_peak_bytes_drop_at_least_4x_at_vocab_128k():
    plain, fused = _loss_peak_bytes(False), _loss_peak_bytes(True)
    print(f"loss-path peak bytes at vocab 128256, 96 tokens: plain {plain / 2**20:.1f} MiB, "
          f"fused {fused / 2**20:.1f} MiB ({plain / fused:.1f}x)")
    assert plain >= 96 * 128_256 * 4  # the meter sees at least the fp32 logits of the plain path
    assert plain >= 4 * fused


def test_fused_loss_config_rules():
    # every layout runs it: TP (vocabulary-parallel), PP (last stage), resharding fsdp2, megatron_fsdp in any mode
    for dist in ({"tp_size": 2}, {"tp_size": 2, "sequence_parallel": True}, {"pp_size": 2},
                 {"strategy": "fsdp2", "reshard_after_forward": True}, {"strategy": "megatron_fsdp"}):
        forced = Config.model_validate({"training": {"fused_loss": True}, "distributed": dist})
        assert not any("fused_loss" in p for p in check(forced, 2)), dist
        auto = Config.model_validate({"distributed": dist})
        assert fused_loss_on(auto) and fused_loss_note(auto) is None, dist
    # a model whose forward returns logits: auto takes the plain loss and says so; true is refused in one line
    auto = Config.model_validate({"model": {"hf_model": "some/folder"}})
    assert not fused_loss_on(auto)
    assert fused_loss_note(auto).startswith("training.fused_loss=auto takes the plain loss (model.hf_model")
    assert fused_loss_note(auto) in warnings(auto, 1)
    forced = Config.model_validate({"model": {"hf_model": "some/folder"}, "training": {"fused_loss": True}})
    assert [p for p in check(forced, 1) if "fused_loss" in p] == [
        "training.fused_loss=true cannot run here (model.hf_model: the transformers model's forward returns "
        "logits): set training.fused_loss=auto"]
    off = Config.model_validate({"model": {"hf_model": "some/folder"}, "training": {"fused_loss": False}})
    assert fused_loss_note(off) is None  # asked for: nothing to say


def test_foreign_model_cannot_fuse():
    assert contract_of(torch.nn.Sequential(torch.nn.Linear(2, 2))).set_fused_loss(True) is False


def test_auto_taking_the_plain_loss_is_in_the_plan_notes():
    from meshforge.planning.hardware import DEFAULT_EFFICIENCY
    from meshforge.planning.plan import _notes

    auto = Config.model_validate({"model": {"hf_model": "some/folder"}})
    assert fused_loss_note(auto) in _notes(auto, DEFAULT_EFFICIENCY["h100"])
    assert not any("fused_loss" in n for n in _notes(Config.model_validate({"distributed": {"tp_size": 2}}),
                                                     DEFAULT_EFFICIENCY["h100"]))
