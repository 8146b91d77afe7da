"""Packed SFT sequences: attention never crosses a document, positions restart, and the loss equals the unpacked
one on the same examples (1e-6 relative)."""

import dataclasses
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from meshforge.config import ConfigError, load_config
from meshforge.data.examples import ExampleSource
from meshforge.data.tokenizer import ByteTokenizer
from meshforge.distributed.runtime import packed_positions
from meshforge.models import build_model, init_weights

DATA = Path(__file__).resolve().parents[2] / "examples" / "data" / "prompt_completion_tiny.jsonl"


def _built(preset: str, seed: int):
    m = build_model(load_config(None, [f"model.preset={preset}"], world_size=1).model)
    init_weights(m, seed)
    return m


@pytest.fixture(scope="module")
def model():
    return _built("tiny", 3).eval()


def test_positions_restart_per_document():
    docs = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2], [0, 1, 1, 1, 1, 1, 2, 2]])
    assert packed_positions(docs).tolist() == [[0, 1, 2, 0, 1, 0, 1, 2], [0, 0, 1, 2, 3, 4, 0, 1]]


def test_no_attention_across_documents(model):
    g = torch.Generator().manual_seed(0)
    a, b = torch.randint(0, 256, (1, 7), generator=g), torch.randint(0, 256, (1, 9), generator=g)
    docs = torch.tensor([[0] * 7 + [1] * 9])
    pos = packed_positions(docs)
    with torch.no_grad():
        packed = model(torch.cat([a, b], 1), pos, docs)
        changed = model(torch.cat([torch.randint(0, 256, (1, 7), generator=g), b], 1), pos, docs)
        alone = model(b)
    assert torch.equal(packed[:, 7:], changed[:, 7:])  # a change in document A never reaches document B
    assert not torch.equal(packed[:, :7], changed[:, :7])
    assert (packed[:, 7:] - alone).abs().max() < 1e-5  # B as if alone: positions restart, A is invisible


def test_packed_loss_equals_unpacked(model):
    tok = ByteTokenizer()
    plain = ExampleSource([DATA], "prompt_completion", tok, 128, "answer", "truncate")
    packed = ExampleSource([DATA], "prompt_completion", tok, 128, "answer", "truncate", packing=True)
    assert packed.num_samples < plain.num_samples / 2

    def ce(src):
        total, count = 0.0, 0
        for i in range(src.num_samples):
            x, y, *docs = (torch.from_numpy(a) for a in src.batch([i]))
            with torch.no_grad():
                out = model(x, packed_positions(docs[0]), docs[0]) if docs else model(x)
            total += F.cross_entropy(out.flatten(0, 1).double(), y.flatten(), reduction="sum").item()
            count += int((y != -100).sum())
        return total / count, count

    (lp, n_plain), (lk, n_packed) = ce(plain), ce(packed)
    assert n_plain == n_packed  # the same label tokens: no label crosses a document boundary
    assert abs(lp - lk) <= 1e-6 * lp, (lp, lk)


def test_packing_runs_under_pp_and_moe_and_refuses_pp_with_cp():
    base = ["data.source=dataset", f"data.paths=[{DATA}]", "data.format=prompt_completion", "data.packing=true",
            "training.seq_len=32"]
    for extra in (["distributed.pp_size=2"], ["model.preset=tiny_moe"], ["distributed.cp_size=2"]):
        assert load_config(None, base + extra, world_size=2).data.packing  # each carries the document ids
    with pytest.raises(ConfigError, match="set cp_size 1 \\(packing under pp\\) or pp_size 1"):
        load_config(None, base + ["distributed.pp_size=2", "distributed.cp_size=2"], world_size=4)
    with pytest.raises(ConfigError, match="data.packing is not read"):
        load_config(None, ["data.packing=true"], world_size=1)


def test_packing_refused_for_an_moe_family_whose_model_does_not_pack(monkeypatch):
    """`Family.packs_documents` decides: the default MoE model (tiny_moe's, family llama) packs, GPT-OSS's does; a
    family declaring that its MoE model does not is refused, in one line naming the families that do."""
    from meshforge.models import FAMILIES

    base = ["data.source=dataset", f"data.paths=[{DATA}]", "data.format=prompt_completion", "data.packing=true",
            "training.seq_len=32"]
    for preset in ("tiny_moe", "tiny_gpt_oss"):
        assert load_config(None, base + [f"model.preset={preset}"], world_size=1).data.packing
    monkeypatch.setitem(FAMILIES, "llama", dataclasses.replace(FAMILIES["llama"], packs_documents=False))
    with pytest.raises(ConfigError, match=r"mixture-of-experts model \(model.family=llama\) is not supported yet "
                                          r"\(mixtral and .*gpt_oss are\)"):
        load_config(None, base + ["model.preset=tiny_moe"], world_size=1)
    assert load_config(None, base, world_size=1).data.packing  # the family's dense model still packs


def test_padding_is_in_no_document():
    packed = ExampleSource([DATA], "prompt_completion", ByteTokenizer(), 128, "answer", "truncate", packing=True)
    x, y, docs = packed.batch(list(range(packed.num_samples)))
    padded = docs == -1
    assert padded.any() and (y[padded] == -100).all()  # padding: id -1, no label
    assert ((docs[:, 1:] >= docs[:, :-1]) | (docs[:, 1:] == -1)).all()  # documents 0, 1, ... then padding


@pytest.fixture(scope="module")
def moe():
    return _built("tiny_moe", 5).train()


def test_moe_router_statistics_count_documents_only(moe):
    """Packed rows (documents 0, 1, 2 and padding -1): the aux loss is the load-balancing loss of the tokens in a
    document alone (recomputed here from the routers' scores), `last_counts` counts only their routed copies, and
    the padding's content changes neither."""
    from meshforge.models import contract_of

    g = torch.Generator().manual_seed(3)
    docs = torch.tensor([[0] * 9 + [1] * 12 + [-1] * 11, [0] * 20 + [2] * 7 + [-1] * 5])
    x = torch.randint(0, 256, docs.shape, generator=g)
    layers = contract_of(moe).moe_layers()
    scores: list[torch.Tensor] = []
    hooks = [layer.router.register_forward_hook(lambda mod, inp, out: scores.append(out[0].detach()))
             for layer in layers]
    try:
        with torch.no_grad():
            _, aux = moe(x, packed_positions(docs), docs)
            counts = [layer.last_counts.clone() for layer in layers]
            x2 = x.clone()
            x2[docs == -1] = torch.randint(0, 256, (int((docs == -1).sum()),), generator=g)
            _, aux2 = moe(x2, packed_positions(docs), docs)
            counts2 = [layer.last_counts.clone() for layer in layers]
    finally:
        for h in hooks:
            h.remove()
    keep = (docs >= 0).reshape(-1)
    want = torch.zeros(())
    for layer, sc, c in zip(layers, scores[:len(layers)], counts):
        kept = sc[keep]
        n = torch.bincount(kept.topk(layer.top_k, -1).indices.reshape(-1), minlength=layer.n_experts).float()
        assert torch.equal(c, n.long())  # only the documents' token copies
        want = want + layer.aux_coeff * layer.n_experts * (n / n.sum() * kept.mean(0)).sum()  # scores: softmax
    assert abs(aux.item() - want.item()) <= 1e-6 * want.item(), (aux.item(), want.item())
    assert aux.item() == aux2.item() and all(torch.equal(a, b) for a, b in zip(counts, counts2))


# ------------------------------------------------------------------ the block-mask (FlexAttention) path
def _packed_batch(g):
    """Two rows of several documents each (lengths not multiples of any block size)."""
    docs = torch.tensor([[0] * 5 + [1] * 11 + [2] * 3 + [3] * 13, [0] * 17 + [1] * 1 + [2] * 14])
    return torch.randint(0, 256, docs.shape, generator=g), docs


@pytest.fixture(scope="module")
def gqa_model():
    cfg = load_config(None, ["model.preset=tiny"], world_size=1)
    m = build_model(cfg.model)
    assert m.args.n_kv_heads < m.args.n_heads  # grouped-query heads: the case that leaves flash under a dense mask
    init_weights(m, 4)
    return m.eval()


@pytest.mark.filterwarnings("ignore::UserWarning")  # eager FlexAttention warns that it is unfused
def test_block_mask_path_equals_dense_and_keeps_documents_apart(gqa_model, monkeypatch):
    """The CUDA fast path (FlexAttention block mask, chosen by the ids' device) run on CPU (forward only, eager):
    equal to the dense-mask SDPA path, and a change in one document never reaches another."""
    import meshforge.models.llama as llama
    from meshforge.models import attention

    g = torch.Generator().manual_seed(1)
    x, docs = _packed_batch(g)
    pos = packed_positions(docs)
    with torch.no_grad():
        dense = gqa_model(x, pos, docs)
        monkeypatch.setattr(llama, "document_mask", lambda ids: attention.document_block_mask(ids, compiled=False))
        monkeypatch.setattr(attention.F, "scaled_dot_product_attention", None)  # the block mask path: no SDPA
        flex = gqa_model(x, pos, docs)
        x2 = x.clone()
        x2[0, 5:16] = torch.randint(0, 256, (11,), generator=g)  # row 0, document 1 changes
        changed = gqa_model(x2, pos, docs)
    assert (flex - dense).abs().max() <= 1e-5
    others = torch.ones_like(docs, dtype=torch.bool)
    others[0, 5:16] = False
    assert torch.equal(flex[others], changed[others])  # every other document of both rows is untouched
    assert not torch.equal(flex[0, 5:16], changed[0, 5:16])


def test_mask_kind_follows_the_device():
    from meshforge.models.attention import document_mask, is_block_mask

    docs = torch.tensor([[0, 0, 1, 1]])
    assert not is_block_mask(document_mask(docs))  # CPU: dense (FlexAttention has no CPU backward)
    assert document_mask(docs).shape == (1, 1, 4, 4)
    assert not is_block_mask(document_mask(docs.to("meta")))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-4), (torch.bfloat16, 3e-2)])
def test_block_mask_matches_dense_on_cuda(gqa_model, dtype, tol):
    """On CUDA the model's packed forward and backward (compiled FlexAttention) equal the dense-mask SDPA path."""
    import copy

    from meshforge.models import attention

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    g = torch.Generator().manual_seed(2)
    x, docs = (t.cuda() for t in _packed_batch(g))
    pos = packed_positions(docs)
    m = copy.deepcopy(gqa_model).cuda().to(dtype).train()
    assert attention.is_block_mask(attention.document_mask(docs))

    def run(mask_fn):
        import meshforge.models.llama as llama

        old = llama.document_mask
        llama.document_mask = mask_fn
        try:
            m.zero_grad(set_to_none=True)
            out = m(x, pos, docs)
            out.float().logsumexp(-1).mean().backward()
        finally:
            llama.document_mask = old
        return out.float(), [p.grad.float() for p in m.parameters()]

    fast, fast_g = run(attention.document_mask)
    dense, dense_g = run(attention.dense_document_mask)
    assert (fast - dense).abs().max() <= tol * dense.abs().max()
    for a, b in zip(fast_g, dense_g):
        assert (a - b).abs().max() <= tol * max(b.abs().max(), 1e-3)


@pytest.mark.parametrize("preset", ["tiny_gpt_oss", "tiny_deepseek"])
def test_router_statistics_count_documents_only_in_every_packing_moe_family(preset):
    """The families whose model packs (`Family.packs_documents`) keep padding out of their MoE layers' statistics
    too: the padding's content changes neither the aux loss nor the counted copies, which are the documents'."""
    from meshforge.models import contract_of

    model = _built(preset, 5).train()
    docs = torch.tensor([[0] * 9 + [1] * 12 + [-1] * 11, [0] * 20 + [2] * 7 + [-1] * 5])
    g = torch.Generator().manual_seed(3)
    x = torch.randint(0, 256, docs.shape, generator=g)
    x2 = x.clone()
    x2[docs == -1] = torch.randint(0, 256, (int((docs == -1).sum()),), generator=g)
    layers = contract_of(model).moe_layers()
    runs = []
    with torch.no_grad():
        for tokens in (x, x2):
            out = model(tokens, packed_positions(docs), docs)
            runs.append((out[1] if isinstance(out, tuple) else None, [layer.last_counts.clone() for layer in layers]))
    (aux, counts), (aux2, counts2) = runs
    assert layers and all(int(c.sum()) == int((docs >= 0).sum()) * layer.top_k for layer, c in zip(layers, counts))
    assert all(torch.equal(a, b) for a, b in zip(counts, counts2))
    assert (aux is None and aux2 is None) or aux.item() == aux2.item()
