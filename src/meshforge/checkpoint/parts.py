"""The parts of a run that a checkpoint holds. Each part saves and loads its own state (DCP's `Stateful`:
`state_dict()` / `load_state_dict()`).

The manager (`manager.py`) gets {name: part} and only orchestrates: it never learns what a part holds or which
strategy produced it. A part is one of two kinds, and its kind decides where it is stored:

- `ShardedPart`: tensors the ranks hold together, each rank its own shards. It is saved under `<name>.` in the
  run's one DCP checkpoint. On load, DCP fills the tensors of `state_dict()` in place, resharded to this run's
  layout, and hands them to `load_state_dict`. `state_dict_to_save()` is what a save writes (`torch_dist`
  gathers full tensors there). `content` is the part's entry in the manifest's `contents`. `manifest_entries()`
  adds what the part records to the manifest, and `check_manifest()` refuses a checkpoint the part cannot load,
  before anything is loaded.
- Any other `Stateful` (the scheduler, the data loader, the RNG, or a part the manager has never heard of) is this
  rank's own small state. It is saved under its name in `trainer_state_rank<R>.pt` as plain tensors and
  containers, so it loads with `weights_only=True`. After a change of world size, a rank with no file of its own
  reads rank 0's.

The parts of a training run (`training_parts`; the on-disk keys are those of format version 1):

    name        part                                        stored as
    model       ModelWeights, or AdapterWeights (LoRA:      DCP `model.<parameter>` (contents "model" / "adapter")
                trainable parameters only); MasterWeights
                around it under bf16_params (fp32 masters)
    optim       OptimizerState                              DCP `optim.state.<parameter>.<key>`, `optim.param_groups`
    scheduler   the LR scheduler itself (torch's)           trainer_state_rank<R>.pt ["scheduler"]
    loader      the data loader itself                      trainer_state_rank<R>.pt ["loader"]
    rng         RNGState                                    trainer_state_rank<R>.pt ["rng"]

The manager treats the part named `model` as the model's weights. It checks them against the checkpoint (tensor
names, shapes, model arguments) before loading. A checkpoint that holds only them (`meshforge checkpoint import`)
loads as weights only: step 0, no optimizer or trainer state.
"""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import torch
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor

from meshforge.checkpoint.collectives import log
from meshforge.checkpoint.hf import hf_config_of, tokenizer_of
from meshforge.checkpoint.peft import (
    adapter_manifest,
    check_adapter_checkpoint,
    refuse_adapter_checkpoint,
    trainable_names,
)
from meshforge.checkpoint.verify import check_model_inputs, model_inputs
from meshforge.config.rules import resolved_ckpt_format
from meshforge.distributed.master_weights import MasterWeightAdamW


class ShardedPart(Stateful):
    """A part whose tensors the ranks hold together (saved with DCP under its name); see the module docstring."""

    content: str | None = None  # its entry in the manifest's `contents` (None: its name)

    def state_dict(self) -> dict:
        """What a load fills in place: this rank's tensors, sharded as this run holds them."""
        raise NotImplementedError

    def load_state_dict(self, state_dict: dict) -> None:
        raise NotImplementedError

    def state_dict_to_save(self) -> dict:
        """What a save writes (by default what a load fills)."""
        return self.state_dict()

    def manifest_entries(self) -> dict:
        """What this part adds to the manifest of a checkpoint it is saved in."""
        return {}

    def check_manifest(self, path: Path, manifest: dict) -> None:
        """Before anything is loaded: refuse (CheckpointError, one line) a checkpoint this part cannot load."""


# --------------------------------------------------------------------------------- model
class ModelWeights(ShardedPart):
    """The model's parameters under the whole model's names. They go through the strategy's state-dict methods
    (`Strategy.model_state_dict`: DCP's helpers by default, megatron_fsdp's own), which return this rank's shards
    as DTensors, or, with `gather_on_save` (the torch_dist format) and a sharded state, plain full tensors
    gathered to rank 0 for a save. The part also records what an export of the weights needs: the config.json of
    a `model.hf_model` run and the run's tokenizer. When the run names no tokenizer, it keeps the tokenizer of the
    checkpoint it resumed."""

    content = "model"

    def __init__(self, pm, gather_on_save: bool, hf_config: dict | None = None, tokenizer: str | None = None,
                 inputs: dict | None = None, allow_changed_inputs: bool = False):
        self.pm, self.gather_on_save = pm, gather_on_save
        self.hf_config, self.tokenizer = hf_config, tokenizer
        self.inputs, self.allow_changed_inputs = inputs or {}, allow_changed_inputs  # `verify.model_inputs`
        self._resumed_tokenizer: str | None = None
        self._full: bool | None = None

    def _collect(self, full: bool = False) -> dict:
        state: dict = {}
        for part in self.pm.state_parts():
            state.update(self.pm.strategy.model_state_dict(part, full=full))
        return state

    def saves_full(self) -> bool:
        """True when a save writes plain full tensors (torch_dist with a sharded state); the optimizer's follow."""
        if self._full is None:  # a strategy's state is sharded or not for the whole run
            self._full = self.gather_on_save and any(isinstance(v, DTensor) for v in self._collect().values())
        return self._full

    def state_dict(self) -> dict:
        return self._collect()

    def state_dict_to_save(self) -> dict:
        return self._collect(full=self.saves_full())

    def load_state_dict(self, state_dict: dict) -> None:
        for part in self.pm.state_parts():
            self.pm.strategy.load_model_state_dict(part, state_dict)

    def manifest_entries(self) -> dict:
        return {"tokenizer": self.tokenizer or self._resumed_tokenizer,  # for the export's tokenizer files
                "hf_config": self.hf_config,  # model.hf_model: its config.json, for the export
                "model_inputs": self.inputs}  # what the model started from, by content

    def check_manifest(self, path: Path, manifest: dict) -> None:
        self._check_kind(path, manifest)
        note = check_model_inputs(path, manifest.get("model_inputs"), self.inputs, self.allow_changed_inputs)
        if note is not None:
            log(note, warn=True)
        self._resumed_tokenizer = manifest.get("tokenizer")  # e.g. an imported folder's, carried on to the export

    def _check_kind(self, path: Path, manifest: dict) -> None:
        refuse_adapter_checkpoint(path, manifest)


class AdapterWeights(ModelWeights):
    """LoRA (`peft:` set): only the parameters this run trains (the adapters, and any norms or embeddings the
    freeze policy trains). The frozen base comes from `model.init_from` or the seed and is not saved. The manifest
    records the base and the adapter settings (`peft.py`), and a resume onto another base is refused."""

    content = "adapter"

    def __init__(self, pm, gather_on_save: bool, cfg, **export):
        super().__init__(pm, gather_on_save, **export)
        self.cfg = cfg

    def _trainable(self, state: dict) -> dict:
        keep = trainable_names(self.pm)
        return {k: v for k, v in state.items() if k in keep}

    def state_dict(self) -> dict:
        return self._trainable(super().state_dict())

    def state_dict_to_save(self) -> dict:
        return self._trainable(super().state_dict_to_save())

    def manifest_entries(self) -> dict:
        return {**super().manifest_entries(), **adapter_manifest(self.cfg)}

    def _check_kind(self, path: Path, manifest: dict) -> None:
        check_adapter_checkpoint(path, manifest, self.cfg)


class MasterWeights(ShardedPart):
    """training.precision=bf16_params at world size 1: the fp32 master weights (`MasterWeightAdamW.masters`)
    stand in for the bf16 parameters under the same names. A checkpoint therefore holds fp32 weights and a resume
    is exact. A load fills the masters in place, and the weights part's load then rounds them into the
    parameters."""

    def __init__(self, weights: ModelWeights, optimizer: MasterWeightAdamW):
        self.weights, self.optimizer = weights, optimizer
        self.content = weights.content

    def state_dict(self) -> dict:
        return self.optimizer.master_state_dict(self.weights.state_dict())

    def state_dict_to_save(self) -> dict:
        return self.optimizer.master_state_dict(self.weights.state_dict_to_save())

    def load_state_dict(self, state_dict: dict) -> None:
        self.weights.load_state_dict(state_dict)

    def manifest_entries(self) -> dict:
        return self.weights.manifest_entries()

    def check_manifest(self, path: Path, manifest: dict) -> None:
        self.weights.check_manifest(path, manifest)


# ----------------------------------------------------------------------------- optimizer
class OptimizerState(ShardedPart):
    """The optimizer's state (moments, step, param groups) keyed by parameter name, through the strategy's
    optimizer state-dict methods. It holds full tensors when the weights part saves full ones."""

    content = "optim"

    def __init__(self, pm, optimizer: torch.optim.Optimizer, weights: ModelWeights):
        self.pm, self.optimizer, self.weights = pm, optimizer, weights

    def state_dict(self) -> dict:
        return self.pm.optimizer_state_dict(self.optimizer)

    def state_dict_to_save(self) -> dict:
        return self.pm.optimizer_state_dict(self.optimizer, full=self.weights.saves_full())

    def load_state_dict(self, state_dict: dict) -> None:
        self.pm.load_optimizer_state_dict(self.optimizer, state_dict)


# ----------------------------------------------------------------------------------- RNG
class RNGState(Stateful):
    """This process's random generators (torch, CUDA, numpy, Python) as tensors and plain containers, so the
    per-rank file loads with weights_only=True."""

    def state_dict(self) -> dict:
        kind, keys, pos, has_gauss, cached = np.random.get_state()
        version, internal, gauss = random.getstate()
        state = {"torch": torch.get_rng_state(),
                 "numpy": {"kind": kind, "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)), "pos": int(pos),
                           "has_gauss": int(has_gauss), "cached": float(cached)},
                 "python": {"version": version, "internal": list(internal), "gauss": gauss}}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            state["cuda"] = torch.cuda.get_rng_state_all()
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        torch.set_rng_state(state_dict["torch"])
        n = state_dict["numpy"]
        np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached"]))
        p = state_dict["python"]
        random.setstate((p["version"], tuple(p["internal"]), p["gauss"]))
        if "cuda" in state_dict and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state_dict["cuda"])


# ------------------------------------------------------------------------------- factory
def training_parts(cfg, pm, optimizer: torch.optim.Optimizer, scheduler, loader) -> dict[str, Stateful]:
    """The parts of a training run, in the order they are saved and loaded (see the module docstring)."""
    gather = resolved_ckpt_format(cfg) == "torch_dist"
    export = {"hf_config": hf_config_of(cfg), "tokenizer": tokenizer_of(cfg), "inputs": model_inputs(cfg),
              "allow_changed_inputs": cfg.checkpoint.allow_changed_inputs}
    weights = AdapterWeights(pm, gather, cfg, **export) if cfg.peft is not None else ModelWeights(pm, gather, **export)
    model = MasterWeights(weights, optimizer) if isinstance(optimizer, MasterWeightAdamW) else weights
    return {"model": model, "optim": OptimizerState(pm, optimizer, weights), "scheduler": scheduler,
            "loader": loader, "rng": RNGState()}
