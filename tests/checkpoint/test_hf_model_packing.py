"""Packed sequences on a `model.hf_model` (issue 30 item 4), against the real transformers:

- meshforge feeds a packed row with positions that restart at each document; transformers 5 builds the document
  mask from them (`masking_utils.find_packed_sequence_indices`). The packed row's summed loss equals the sum of
  each document's loss run alone through transformers within 1e-6 relative (measured: equal), and each
  parameter's gradient within 1e-5 of its norm (measured 3.7e-6: rounding of another summation order), fp32.
- Whether a model keeps documents apart that way is measured per model (`HFCausalLM.packing_problem`); one that
  does not (Bloom's ALiBi, Mamba's recurrent state) is refused in one line at validation.
Parity at N=2 with packing: tests/parallel/test_hf_model_parity.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

from meshforge.config.loader import apply_overrides, resolve  # noqa: E402
from meshforge.distributed.runtime import packed_positions  # noqa: E402
from meshforge.errors import ConfigError  # noqa: E402
from meshforge.models import build_model, init_weights, load_folder_weights, resolve_model_args  # noqa: E402
from meshforge.testing.parity import config  # noqa: E402
from tests.checkpoint.hf_zoo import write_tiny  # noqa: E402
from tests.checkpoint.test_hf_model import random_qwen2  # noqa: E402

RTOL = 1e-6
DOCS = [[7, 5, 4], [2, 9, 5]]  # document lengths per row of 16 tokens


def _packed_batch(vocab: int):
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, vocab, (len(DOCS), 16), generator=g)
    doc_ids = torch.tensor([[i for i, n in enumerate(row) for _ in range(n)] for row in DOCS])
    y = torch.roll(x, -1, dims=1)
    y[torch.cat([doc_ids[:, 1:] != doc_ids[:, :-1], torch.ones(len(DOCS), 1, dtype=torch.bool)], dim=1)] = -100
    return x, y, doc_ids


def test_packed_loss_and_gradients_equal_each_document_alone(tmp_path):
    random_qwen2(tmp_path / "base")
    ours = build_model(resolve_model_args(config([f"model.hf_model={tmp_path / 'base'}"], world_size=1).model))
    init_weights(ours, 0)
    assert load_folder_weights(ours)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32)
    x, y, doc_ids = _packed_batch(300)
    packed = F.cross_entropy(ours(x, packed_positions(doc_ids), doc_ids).flatten(0, 1), y.flatten(),
                             ignore_index=-100, reduction="sum")
    packed.backward()
    alone = torch.zeros(())
    for r, row in enumerate(DOCS):
        start = 0
        for n in row:
            xs, ys = x[r:r + 1, start:start + n], y[r:r + 1, start:start + n]
            alone = alone + F.cross_entropy(theirs(input_ids=xs, use_cache=False).logits.flatten(0, 1),
                                            ys.flatten(), ignore_index=-100, reduction="sum")
            start += n
    alone.backward()
    rel = abs(packed.item() - alone.item()) / alone.item()
    grads = {n.removeprefix("hf."): p.grad for n, p in ours.named_parameters()}
    grad_rel = max(((grads[n] - p.grad).norm() / p.grad.norm()).item() for n, p in theirs.named_parameters()
                   if p.grad is not None and p.grad.norm() > 0)
    print(f"packed hf_model loss {packed.item():.6f} vs documents alone {alone.item():.6f}: relative {rel:.1e}, "
          f"gradients {grad_rel:.1e}")
    assert rel <= RTOL and grad_rel <= 10 * RTOL
    # without the restarting positions the documents would see each other: the check above has teeth
    leaky = F.cross_entropy(ours(x).flatten(0, 1), y.flatten(), ignore_index=-100, reduction="sum")
    assert abs(leaky.item() - alone.item()) / alone.item() > 1e-3


@pytest.mark.parametrize("model_type", ["bloom", "mamba"])
def test_a_model_that_mixes_packed_documents_is_refused(tmp_path, model_type):
    folder = write_tiny(model_type, tmp_path / model_type)
    (tmp_path / "a.jsonl").write_text('{"prompt": "a", "completion": "b"}\n')
    raw = apply_overrides({}, [f"model.hf_model={folder}", "data.source=dataset", f"data.paths=[{tmp_path}/a.jsonl]",
                               "data.format=prompt_completion", "data.packing=true"])
    with pytest.raises(ConfigError) as err:
        resolve(raw, world_size=1)
    mine = [p for p in err.value.problems if p.startswith("data.packing=true with model.hf_model")]
    assert len(mine) == 1 and "does not keep packed documents apart" in mine[0] and "\n" not in mine[0], \
        err.value.problems


def test_packing_asked_by_one_source_of_a_mix_is_measured_too(tmp_path):
    """data.mix: a source that packs is packing (its documents share rows), whatever the top-level data.packing."""
    folder = write_tiny("bloom", tmp_path / "bloom")
    (tmp_path / "a.jsonl").write_text('{"prompt": "a", "completion": "b"}\n')
    source = {"source": "dataset", "paths": [str(tmp_path / "a.jsonl")], "format": "prompt_completion", "weight": 1}
    raw = apply_overrides({"data": {"mix": [{**source, "name": "packed", "packing": True},
                                            {**source, "name": "plain"}]}}, [f"model.hf_model={folder}"])
    with pytest.raises(ConfigError) as err:
        resolve(raw, world_size=1)
    assert any(p.startswith("data.packing=true with model.hf_model") and "does not keep packed documents apart"
               in p for p in err.value.problems), err.value.problems
