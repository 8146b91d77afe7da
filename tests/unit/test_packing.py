"""Packed SFT sequences: attention never crosses a document, positions restart, and the loss equals the unpacked
one on the same examples (1e-6 relative)."""

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


@pytest.fixture(scope="module")
def model():
    cfg = load_config(None, ["model.preset=tiny"], world_size=1)
    m = build_model(cfg.model)
    init_weights(m, 3)
    return m.eval()


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


def test_packing_refused_where_the_mask_is_not_carried():
    base = ["data.source=dataset", f"data.paths=[{DATA}]", "data.format=prompt_completion", "data.packing=true",
            "training.seq_len=32"]
    for extra, match in ((["distributed.pp_size=2"], "pp_size 1"), (["model.preset=tiny_moe"], "mixture-of-experts")):
        with pytest.raises(ConfigError, match=match):
            load_config(None, base + extra, world_size=2)
    assert load_config(None, base + ["distributed.cp_size=2"], world_size=2).data.packing  # cp carries the mask
    with pytest.raises(ConfigError, match="data.packing is not read"):
        load_config(None, ["data.packing=true"], world_size=1)
