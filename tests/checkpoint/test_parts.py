"""The checkpoint parts on their own (checkpoint/parts.py), one process: each part round-trips its state, the
manager saves and restores parts it has never heard of, and the files on disk keep format version 1's keys."""

from __future__ import annotations

import json

import pytest
import torch
from torch.distributed.checkpoint.stateful import Stateful

from meshforge.checkpoint.manager import CheckpointManager
from meshforge.checkpoint.parts import AdapterWeights, MasterWeights, ModelWeights, ShardedPart
from meshforge.checkpoint.safe_dcp import load_dcp_metadata
from meshforge.errors import CheckpointError
from meshforge.testing.parity import config, single_info
from meshforge.training.trainer import Trainer


@pytest.fixture
def build(tmp_path):
    built = []

    def make(*overrides: str) -> Trainer:
        tr = Trainer.build(config([f"run.output_dir={tmp_path / 'run'}", *overrides], steps=6, world_size=1),
                           single_info())
        built.append(tr)
        return tr

    yield make
    for tr in built:
        tr.loader.close()


def _copy(x):
    """A deep copy of a state dict (tensors cloned: the parts return live parameters and optimizer state)."""
    if isinstance(x, torch.Tensor):
        return x.detach().clone()
    if isinstance(x, dict):
        return {k: _copy(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_copy(v) for v in x)
    return x


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b


def test_each_part_round_trips_its_state(build):
    """Every part's state, taken after step 2 and loaded back after step 4, is again what it was, and step 3
    then runs bitwise as it first did."""
    tr = build()
    parts = tr.checkpoint_parts()
    assert list(parts) == ["model", "optim", "scheduler", "loader", "rng"]
    assert all(isinstance(p, Stateful) for p in parts.values())
    assert type(parts["model"]) is ModelWeights and parts["model"].content == "model"
    tr.train_step(), tr.train_step()
    saved = {name: _copy(p.state_dict()) for name, p in parts.items()}
    torch.rand(3)  # moves the RNG
    step3 = tr.train_step()[0].item()
    tr.train_step()
    for name, p in parts.items():
        assert not _equal(p.state_dict(), saved[name]), f"{name}: the steps changed nothing, the test means nothing"
        p.load_state_dict(_copy(saved[name]))
        assert _equal(p.state_dict(), saved[name]), name
    assert tr.train_step()[0].item() == step3


def test_adapter_and_master_weights(build):
    """LoRA: only the trainable tensors, content "adapter", the peft settings in the manifest. bf16_params: the
    fp32 masters under the parameters' names; a load fills them and rounds them into the bf16 parameters."""
    lora = build("peft.rank=4", "peft.alpha=8")
    weights = lora.checkpoint_parts()["model"]
    trainable = {n for n, p in lora.pm.model.named_parameters() if p.requires_grad}
    assert type(weights) is AdapterWeights and weights.content == "adapter"
    assert set(weights.state_dict()) == trainable and all(".lora_" in n for n in trainable)
    assert weights.manifest_entries()["peft"]["rank"] == 4

    bf16 = build("training.precision=bf16_params")
    masters = bf16.checkpoint_parts()["model"]
    assert type(masters) is MasterWeights and masters.content == "model"
    state = masters.state_dict()
    params = dict(bf16.pm.model.named_parameters())
    assert {params[k].dtype for k in state} == {torch.bfloat16} and {v.dtype for v in state.values()} == {torch.float32}
    wanted = {k: v + 1e-3 for k, v in state.items()}  # not representable in bf16: a load must not round the masters
    for k, v in state.items():
        v.copy_(wanted[k])  # what DCP does: fill the tensors of state_dict() in place
    masters.load_state_dict(state)
    assert _equal(masters.state_dict(), wanted)
    assert all(torch.equal(params[k], wanted[k].to(torch.bfloat16)) for k in wanted)


class Counter(Stateful):
    """A per-rank part the manager has never heard of."""

    def __init__(self):
        self.n = 0

    def state_dict(self) -> dict:
        return {"n": self.n}

    def load_state_dict(self, state_dict: dict) -> None:
        self.n = state_dict["n"]


class Average(ShardedPart):
    """A sharded part the manager has never heard of (an average of the weights, say), saved with DCP."""

    def __init__(self):
        self.avg = torch.zeros(5)

    def state_dict(self) -> dict:
        return {"avg": self.avg}

    def load_state_dict(self, state_dict: dict) -> None:
        self.avg.copy_(state_dict["avg"])


def test_the_manager_saves_and_restores_parts_it_does_not_know(build, tmp_path):
    tr = build("checkpoint.resume=auto")
    counter, average = Counter(), Average()
    parts = {**tr.checkpoint_parts(), "counter": counter, "average": average}
    tr.train_step()
    counter.n, average.avg[:] = 7, torch.arange(5.0)
    ck = CheckpointManager(tr.cfg, tr.mesh_ctx, tr.info, parts).save(1)
    manifest = json.loads((ck / "manifest.json").read_text())
    assert manifest["contents"] == ["model", "optim", "average", "trainer_state"]
    assert torch.load(ck / "trainer_state_rank0.pt", weights_only=True)["counter"] == {"n": 7}
    assert "average.avg" in load_dcp_metadata(ck).state_dict_metadata
    counter.n, average.avg[:] = 0, 0.0
    assert CheckpointManager(tr.cfg, tr.mesh_ctx, tr.info, parts).resume() == 1
    assert counter.n == 7 and torch.equal(average.avg, torch.arange(5.0))
    # a run with a sharded part its checkpoint lacks is refused in one line, not started from the weights alone
    more = {**parts, "other": Average()}
    with pytest.raises(CheckpointError, match=r"step_1: holds no other \(manifest.json lists model, optim, average"):
        CheckpointManager(tr.cfg, tr.mesh_ctx, tr.info, more)._load(ck)


# The keys of format version 1, as main wrote them before the parts existed: checkpoints written then still resume.
MANIFEST_KEYS = {"ckpt_format", "config_digest", "contents", "created_utc", "files", "format_version", "hf_config",
                 "layout", "model_args", "model_inputs", "step", "strategy", "tokenizer", "torch_version", "world_size"}


@pytest.mark.parametrize("extra,contents,more_keys", [
    ([], "model", set()),
    (["training.precision=bf16_params"], "model", set()),
    (["peft.rank=4", "peft.alpha=8"], "adapter", {"peft", "peft_base"}),
], ids=["fp32", "bf16_params", "lora"])
def test_on_disk_keys_are_format_version_1(build, extra, contents, more_keys):
    tr = build(*extra)
    tr.train_step()
    ck = tr.checkpoints().save(1)
    manifest = json.loads((ck / "manifest.json").read_text())
    assert set(manifest) == MANIFEST_KEYS | more_keys and manifest["format_version"] == 1
    assert manifest["contents"] == [contents, "optim", "trainer_state"]
    assert set(manifest["files"]) == {".metadata", "__0_0.distcp", "trainer_state_rank0.pt"}
    md = load_dcp_metadata(ck).state_dict_metadata
    trainable = {n for n, p in tr.pm.model.named_parameters() if p.requires_grad}
    assert {k for k in md if k.startswith("model.")} == {f"model.{n}" for n in trainable}
    optim = {k for k in md if k.startswith("optim.")}
    assert {k for k in md if not k.startswith(("model.", "optim."))} == set()
    assert {k for k in optim if k.startswith("optim.state.")} == \
        {f"optim.state.{n}.{s}" for n in trainable for s in ("step", "exp_avg", "exp_avg_sq")}
    groups = {k for k in optim if k.startswith("optim.param_groups.")}
    assert groups == optim - {k for k in optim if k.startswith("optim.state.")} and "optim.param_groups.0.lr" in groups
    assert {md[f"model.{n}"].properties.dtype for n in trainable} == {torch.float32}  # bf16_params: the masters
    own = torch.load(ck / "trainer_state_rank0.pt", weights_only=True)
    assert set(own) == {"step", "scheduler", "loader", "rng"} and own["step"] == 1
    assert set(own["rng"]) == {"torch", "numpy", "python"}
