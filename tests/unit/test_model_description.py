"""A model is described once: its fields (models/args.py) make both ModelArgs and the schema's `model` section,
the families are registered once (models/hf_families.py) and everything reads that registration."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import typing
from pathlib import Path

import pytest

from meshforge.config.schema import ModelConfig
from meshforge.models import PRESETS, ModelArgs
from meshforge.models.args import model_fields
from meshforge.models.hf_families import FAMILIES

ROOT = Path(__file__).resolve().parents[2]


def test_schema_model_section_is_the_model_fields_as_optional_overrides():
    fields = model_fields()
    assert [a.name for a in fields] == [f.name for f in dataclasses.fields(ModelArgs)]
    assert list(ModelConfig.model_fields) == ["preset", *(a.name for a in fields if a.name != "hf_model"),
                                              "init_device", "init_from", "hf_model"]
    for a in fields:
        assert getattr(ModelArgs(), a.name) == a.default and a.doc
        if a.name == "hf_model":
            continue
        key = ModelConfig.model_fields[a.name]
        assert key.default is None and key.description == a.doc
        bounds = {type(m).__name__: getattr(m, type(m).__name__.lower()) for m in key.metadata}
        assert bounds == {k: v for k, v in (("Gt", a.gt), ("Ge", a.ge)) if v is not None}, a.name
        if a.choices:
            literal = next(t for t in typing.get_args(key.annotation) if t is not type(None))
            assert typing.get_args(literal) == a.choices
    assert ModelConfig.model_fields["family"].annotation == typing.Literal[tuple(FAMILIES)] | None


def test_docs_list_every_registered_family():
    rows = re.findall(r"^\| `(\w+)` +\| `(\w+)` +\|[^|]*\|([^|]*)\|$", (ROOT / "docs/hf.md").read_text(), re.M)
    assert [(name, arch) for name, arch, _ in rows] == [(f.name, f.architecture) for f in FAMILIES.values()]
    for name, _, presets in rows:
        assert all(PRESETS[p].family == name for p in re.findall(r"`(\w+)`", presets)), name


# A family added the way a new one is: its own module (declaration, model, description) and its name on the
# registration line, in a copy of the package. It brings a field of its own; the schema, ModelArgs, preset
# validation, build_model and the planner all follow.
TOY_MODULE = """
from meshforge.models.family import Arg
from meshforge.models.hf_dense import DenseFamily

TOY = DenseFamily("toy", "ToyForCausalLM", fields=(Arg("toy_window", int, 8, "a toy key", gt=0),),
                  model="meshforge.models.hf_toy:toy_class", description="meshforge.models.hf_toy:toy_description")
described = []


def toy_class(args):
    from meshforge.models.llama import Llama

    return type("Toy", (Llama,), {})


def toy_description(args):
    from meshforge.models.shapes import describe

    described.append(args.toy_window)
    return describe(args)
"""
USE_IT = """
import json, sys
from meshforge.config import ConfigError, load_config
from meshforge.models import build_model, hf_toy, plan_modules, resolve_model_args

out = {}
cfg = load_config("examples/tiny_cpu.yaml", ["model.family=toy", "model.toy_window=3"])
out["args"] = [resolve_model_args(cfg.model).family, resolve_model_args(cfg.model).toy_window]
plan_modules(cfg.model)
out["described"] = hf_toy.described
out["torch"] = "torch" in sys.modules
out["built"] = type(build_model(cfg.model, device="meta")).__name__
for bad in (["model.toy_window=0"], ["model.family=toys"], ["model.toy_window=3"]):
    try:
        load_config("examples/tiny_cpu.yaml", bad)
    except ConfigError as err:
        out[bad[0]] = str(err)
print(json.dumps(out))
"""


@pytest.mark.slow  # copies the package and imports it in a fresh interpreter: seconds
def test_a_family_in_its_own_module_and_one_registration_reaches_everything(tmp_path):
    src = tmp_path / "meshforge"
    shutil.copytree(ROOT / "src" / "meshforge", src, ignore=shutil.ignore_patterns("__pycache__"))
    (src / "models" / "hf_toy.py").write_text(TOY_MODULE)
    registry = src / "models" / "hf_families.py"
    text = registry.read_text()
    # the registration may span lines: the last family's name is followed by the closing parenthesis
    line = re.search(r"^FAMILIES: dict\[str, Family\] = register\(([^)]*)\)$", text, re.M)
    assert line is not None
    registry.write_text(text.replace(line[0], line[0][:-1] + ", TOY)")
                        .replace("from meshforge.models.hf_qwen3_moe import QWEN3_MOE\n",
                                 "from meshforge.models.hf_qwen3_moe import QWEN3_MOE\n"
                                 "from meshforge.models.hf_toy import TOY\n"))
    proc = subprocess.run([sys.executable, "-c", USE_IT], capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["args"] == ["toy", 3] and out["described"] == [3] and not out["torch"]
    assert out["built"] == "Toy"
    assert "model.toy_window: Input should be greater than 0" in out["model.toy_window=0"]
    assert f"'{list(FAMILIES)[-1]}' or 'toy'" in out["model.family=toys"]
    # its field under another family would be silently ignored: refused, naming the family that reads it
    assert "model.toy_window is read only by model.family=toy, not by llama" in out["model.toy_window=3"]
