"""The architecture as tests: the import layers, no import cycles, the model contract's reach, a strategy's
reach (its name spelled only in its spec and runtime modules), and process-free validation.

Layers (a package may import only packages of its own layer or below; every import counts, function-local
ones too, except under `if TYPE_CHECKING:`):

    errors, launch, outputs, progress   leaves: the error classes, the process launcher, where outputs may go,
                                        progress bars
    models, data                        plain models behind one contract; token sources and the loader
    config, planning, recipes           process-free: schema, strategy specs, rules, layout, plans
    distributed                         meshes, strategies, parallelisms, the parallel model runtime
    checkpoint                          stateful parts, commit protocol, resume, HF weight I/O
    generation                          decoding (KV cache, sampling), `meshforge generate`
    training                            the Trainer and its parts
    testing, bench, scale, verify, evaluation, cli  tools on top
"""

from __future__ import annotations

import ast
import functools
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src" / "meshforge"
LAYERS = [
    {"errors", "launch", "outputs", "progress"},
    {"models", "data"},
    {"config", "planning", "recipes"},
    {"distributed"},
    {"checkpoint"},
    {"generation"},
    {"training"},
    {"testing", "bench", "scale", "verify", "plot", "evaluation", "cli", "__init__", "__main__"},
]
LAYER_OF = {pkg: i for i, layer in enumerate(LAYERS) for pkg in layer}
# what a model is made of: names no code outside models/ may spell (the model contract says it instead)
MODEL_INTERNALS = {"tok_embeddings", "feed_forward", "attention_norm", "ffn_norm", "wq", "wk", "wv", "wo", "w1",
                   "w2", "w3", "shared_experts", "CoreAttention", "Llama", "MoETransformer", "TransformerBlock",
                   "GroupedExperts", "hf_name_map", "pp_split_points"}
# what other packages may import from models/: the package, its contract, the model's fields (args: the schema
# derives its model section from them), the presets, the loss, LoRA and the packed-sequence attention kernels
# (context parallelism masks with the same ones), and the built-in models' torch-free description the planner
# reads (shapes), and the KV cache a built-in model's forward takes in generation (kv_cache)
MODELS_PUBLIC = {"protocol", "args", "presets", "loss", "lora", "attention", "shapes", "kv_cache"}
# a built-in strategy is spelled only in its own modules: its spec (options, rules, planner terms) and its runtime.
# Everything else asks the spec (`StrategySpec`) or the runtime protocol (`distributed/strategy.py`).
STRATEGY_OWNERS = {
    "ddp": {"meshforge.config.strategies.ddp", "meshforge.distributed.ddp"},
    "fsdp2": {"meshforge.config.strategies.fsdp2", "meshforge.distributed.fsdp2"},
    "megatron_fsdp": {"meshforge.config.strategies.megatron_fsdp", "meshforge.distributed.megatron_fsdp",
                      "meshforge.distributed.megatron_fsdp.buffers", "meshforge.distributed.megatron_fsdp.comm",
                      "meshforge.distributed.megatron_fsdp.strategy"},
}
# where a built-in's name may still be written outside its modules, and why
STRATEGY_NAMES_ALLOWED = {
    ("meshforge.config.schema", "fsdp2"): "the default of distributed.strategy",
    ("meshforge.recipes", "fsdp2"): "a recipe's choice of strategy",
    ("meshforge.config.schema", "ddp"): "Megatron-Bridge's `ddp:` section (not the strategy)",
    ("meshforge.config.validation", "ddp"): "Megatron-Bridge's `ddp:` section (not the strategy)",
    ("meshforge.config.strategies.megatron_fsdp", "ddp"): "its Megatron-Bridge flag `ddp.use_megatron_fsdp`",
    ("meshforge.config.strategies", "ddp"): "the Bridge sections (`dist.`, `ddp.`) a spec's Bridge keys may name",
    ("meshforge.bench.cli", "megatron-fsdp"): "`--use-megatron-fsdp`, the spec documents' harness flag (its "
                                              "settings are the spec's `harness_overrides`)",
}
# modules that must import without torch.distributed (beyond what `import torch` itself loads)
PROCESS_FREE = {"errors", "models", "data", "config", "planning", "recipes"}


def _modules() -> dict[str, Path]:
    out = {}
    for path in SRC.rglob("*.py"):
        rel = path.relative_to(SRC.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _package(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1:
        return "__init__"
    return parts[1]


@functools.cache
def _tree(path: Path) -> ast.Module:
    """A module's syntax tree, parsed once for all the tests here (they only read it)."""
    return ast.parse(path.read_text())


def _imports(path: Path) -> list[str]:
    """Every meshforge module `path` imports (function-local imports included, TYPE_CHECKING blocks not)."""
    tree = _tree(path)
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    found = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.append(node.module)
            found += [f"{node.module}.{a.name}" for a in node.names]
    return [m for m in found if m.split(".")[0] == "meshforge" and m in MODULES]


GRAPH = {m: sorted(set(_imports(p)) - {m}) for m, p in MODULES.items()}


def test_every_package_is_in_a_layer():
    assert {_package(m) for m in MODULES} <= set(LAYER_OF), {_package(m) for m in MODULES} - set(LAYER_OF)


def test_imports_flow_down_the_layers():
    bad = [f"{m} imports {dep}" for m, deps in GRAPH.items() for dep in deps
           if LAYER_OF[_package(dep)] > LAYER_OF[_package(m)]]
    assert not bad, "\n".join(bad)


def test_no_import_cycles():
    seen, stack, cycles = set(), [], []

    def visit(m):
        if m in stack:
            cycles.append(stack[stack.index(m):] + [m])
            return
        if m in seen:
            return
        seen.add(m)
        stack.append(m)
        for dep in GRAPH[m]:
            # importing a package's submodule runs the package first: not an edge back into it
            if not m.startswith(dep + "."):
                visit(dep)
        stack.pop()

    for m in GRAPH:
        visit(m)
    assert not cycles, "\n".join(" -> ".join(c) for c in cycles)


def test_process_free_packages_never_name_torch_distributed():
    bad = []
    for m, path in MODULES.items():
        if _package(m) not in PROCESS_FREE:
            continue
        for node in ast.walk(_tree(path)):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            bad += [f"{m}: {n}" for n in names if n.startswith("torch.distributed")]
    assert not bad, bad


def test_nothing_outside_models_names_a_model_internal():
    bad = []
    for m, path in MODULES.items():
        if _package(m) == "models":
            continue
        tree = _tree(path)
        docstrings = {id(n.body[0].value) for n in ast.walk(tree)
                      if isinstance(n, (ast.Module, ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef))
                      and n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("meshforge.models.") \
                    and node.module.rpartition(".")[2] not in MODELS_PUBLIC:
                bad.append(f"{m}: imports {node.module}")
            word = node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else \
                node.value if isinstance(node, ast.Constant) and id(node) not in docstrings else None
            if isinstance(word, str) and word in MODEL_INTERNALS:
                bad.append(f"{m}:{node.lineno}: {word}")
    assert not bad, "\n".join(bad)


def _docstrings(tree: ast.AST) -> set[int]:
    return {id(n.body[0].value) for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef))
            and n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}


def _strategy_words() -> dict[str, str]:
    """{word: the built-in strategy it names}: its name and aliases, the classes its modules define (those no other
    module defines too), and its option keys and properties (those no other config section has too)."""
    from meshforge.config import schema
    from meshforge.config.strategies import strategy_specs

    def classes(modules) -> set[str]:
        return {n.name for m in modules for n in _tree(MODULES[m]).body if isinstance(n, ast.ClassDef)}

    owned = set().union(*STRATEGY_OWNERS.values())
    elsewhere = classes(set(MODULES) - owned)
    shared = {f for cls in vars(schema).values() if isinstance(cls, type) and issubclass(cls, schema.BaseModel)
              and not issubclass(cls, schema.StrategyOptions) for f in cls.model_fields}
    out = {}
    for name, owners in STRATEGY_OWNERS.items():
        spec = strategy_specs()[name]
        props = {k for k, v in vars(spec.options).items() if isinstance(v, property)}
        for word in {spec.name, *spec.aliases, *(classes(owners) - elsewhere), *((spec.option_keys | props) - shared)}:
            out[word] = name
    return out


def test_nothing_outside_a_strategy_names_it():
    """Rules, the planner, parallelize, the bench and the checkpointer ask the spec or the runtime protocol: a
    built-in's name, classes, option keys and modules appear only in its own spec and runtime modules (docstrings
    and comments may describe it)."""
    from meshforge.config.strategies import strategy_specs

    assert set(STRATEGY_OWNERS) == {n for n, s in strategy_specs().items() if not isinstance(s.runtime, type)}
    for name, owners in STRATEGY_OWNERS.items():  # the owners named are the modules the spec points at
        spec = strategy_specs()[name]
        assert {spec.runtime.partition(":")[0], spec.options.__module__} <= owners
    words = _strategy_words()
    # longest first: `megatron-fsdp` is megatron_fsdp's alias, not fsdp2's `fsdp`
    pattern = re.compile(r"(?<!\w)(" + "|".join(map(re.escape, sorted(words, key=len, reverse=True))) + r")(?!\w)")
    bad, allowed_seen = [], set()
    for m, path in MODULES.items():
        tree = _tree(path)
        docs = _docstrings(tree)
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                mods = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                    [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
                if m != "meshforge.config.strategies":  # the registry imports the built-in specs
                    bad += [f"{m}:{node.lineno}: imports {x}" for x in mods
                            for owners in STRATEGY_OWNERS.values() if x in owners and m not in owners]
                continue
            text = node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) \
                else node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) \
                and id(node) not in docs else None
            for word in set(pattern.findall(text)) if text else ():
                if m in STRATEGY_OWNERS[words[word]]:
                    continue
                if (m, word) in STRATEGY_NAMES_ALLOWED:
                    allowed_seen.add((m, word))
                else:
                    bad.append(f"{m}:{node.lineno}: {word!r} names strategy {words[word]}")
    assert not bad, "\n".join(bad)
    assert allowed_seen == set(STRATEGY_NAMES_ALLOWED), set(STRATEGY_NAMES_ALLOWED) - allowed_seen  # none stale


def test_the_checkpoint_manager_only_orchestrates():
    """The manager gets {name: Stateful} (checkpoint/parts.py) and commits, resumes and verifies them: it imports no
    strategy, model, LoRA or master-weight code, so it cannot know which of them produced a part."""
    deps = GRAPH["meshforge.checkpoint.manager"]
    bad = [d for d in deps if d.startswith(("meshforge.distributed", "meshforge.models", "meshforge.checkpoint.peft"))]
    assert not bad and "meshforge.checkpoint.parts" in deps, bad


def _fresh_python(code: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          cwd=SRC.parents[1])
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


VALIDATE = """
import contextlib, io, json, sys
import torch
before = {m for m in sys.modules if m.startswith("torch.distributed")}
from meshforge.cli import main
out = {}
for case, (config, overrides, world) in %r.items():
    with contextlib.redirect_stdout(io.StringIO()):
        rc = main(["validate", config, *overrides, "--world-size", str(world)])
    extra = sorted(m for m in sys.modules if m.startswith("torch.distributed") and m not in before)
    out[case] = {"rc": rc, "extra": extra}
print(json.dumps(out))
"""
VALIDATED = {"tp8-pp2": ("examples/llama3_70b_tp_pp.yaml", ["distributed.tp_size=8", "distributed.pp_size=2"], 1024),
             "ep8-tp4": ("examples/qwen3_moe_ep8.yaml", ["distributed.tp_size=4"], 256)}


@pytest.fixture(scope="module")
def validated() -> dict:
    """Every case in one fresh interpreter (torch imported once); a case's `extra` counts all cases before it too."""
    return _fresh_python(VALIDATE % (VALIDATED,))


@pytest.mark.parametrize("case", list(VALIDATED))
def test_validate_loads_no_torch_distributed_module(case, validated):
    """Beyond what `import torch` loads itself: no DTensor, FSDP, pipelining or DCP to check a plan."""
    assert validated[case] == {"rc": 0, "extra": []}, validated[case]


def test_validating_a_config_without_tp_never_imports_torch():
    out = _fresh_python("""
import json, sys
from meshforge.config import load_config
load_config("examples/tiny_cpu.yaml", ["distributed.strategy=megatron_fsdp", "training.micro_batch_size=4"],
            world_size=4)
print(json.dumps({"torch": "torch" in sys.modules}))
""")
    assert out == {"torch": False}
