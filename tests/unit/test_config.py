"""Config schema: every section, overrides, messages, Bridge spellings, the validate command."""

import pytest
import yaml

import meshforge
from meshforge.cli import main
from meshforge.config import ConfigError, load_config
from meshforge.config.loader import apply_overrides


def problems(overrides, world_size=None):
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides, world_size=world_size)
    return e.value.problems


def test_defaults_and_sections_in_run_order():
    cfg = load_config()
    assert list(type(cfg).model_fields)[:9] == ["run", "model", "data", "distributed", "optimizer", "scheduler",
                                                 "training", "checkpoint", "logging"]
    assert cfg.distributed.strategy == "fsdp2" and cfg.distributed.dp_size is None


@pytest.mark.parametrize("override, fragment", [
    ("run.seed=abc", "run.seed"),
    ("model.dim=-3", "model.dim"),
    ("model.preset=gpt5", "not a known preset"),
    ("data.source=parquet", "data.source"),
    ("distributed.strategy=zero", "distributed.strategy"),
    ("distributed.tp_size=0", "distributed.tp_size"),
    ("optimizer.lr=0", "optimizer.lr"),
    ("scheduler.name=step", "scheduler.name"),
    ("training.precision=fp8", "training.precision"),
    ("checkpoint.ckpt_format=zip", "checkpoint.ckpt_format"),
    ("logging.log_every=0", "logging.log_every"),
    ("distributed.pipeline.pp_schedule=chaos", "unknown pp_schedule"),
])
def test_invalid_value_in_every_section_names_the_key(override, fragment):
    msgs = problems([override])
    assert any(fragment in m for m in msgs), msgs


def test_unknown_key_suggests_the_closest():
    msgs = problems(["training.max_step=5"])
    assert msgs == ["training.max_step: unknown key (did you mean 'training.max_steps'?)"]
    assert "did you mean 'distributed.tp_size'" in problems(["distributed.tp_sise=2"])[0]
    assert "unknown key" in problems(["trainin.max_steps=2"])[0]


def test_all_problems_reported_at_once():
    assert len(problems(["training.max_steps=0", "optimizer.lr=-1", "run.sed=1"])) == 3


def test_overrides_are_typed_and_accept_none():
    cfg = load_config(None, ["training.max_steps=7", "distributed.dp_size=none", "optimizer.betas=[0.8, 0.9]",
                             "checkpoint.resume=null", "distributed.activation_checkpointing=selective"])
    assert cfg.training.max_steps == 7 and cfg.distributed.dp_size is None
    assert cfg.optimizer.betas == (0.8, 0.9) and cfg.checkpoint.resume is None
    assert cfg.distributed.ac_mode == "selective"
    with pytest.raises(ConfigError, match="not of the form"):
        apply_overrides({}, ["training.max_steps"])


def test_strategy_specific_option_under_other_strategy_is_rejected():
    msg = problems(["distributed.strategy=ddp", "distributed.data_parallel_sharding_strategy=optim"])[0]
    assert "data_parallel_sharding_strategy belongs to strategy megatron_fsdp" in msg and "'ddp'" in msg
    assert "bucket_cap_mb belongs to strategy ddp" in problems(["distributed.bucket_cap_mb=25"])[0]
    assert "mp_policy belongs to strategy fsdp2" in problems(
        ["distributed.strategy=megatron_fsdp", "distributed.mp_policy.param_dtype=bf16"])[0]


def test_strategy_aliases_and_zero_dp_strategy():
    for alias in ("megatron-fsdp", "mfsdp"):
        assert load_config(None, [f"distributed.strategy={alias}"]).distributed.strategy == "megatron_fsdp"
    cfg = load_config(None, ["distributed.strategy=megatron_fsdp", "distributed.zero_dp_strategy=1"])
    assert cfg.distributed.sharding_strategy == "optim"
    assert any("zero_dp_strategy" in p for p in problems(["distributed.strategy=megatron_fsdp",
                                                          "distributed.zero_dp_strategy=7"]))


def test_bridge_spelling_maps_onto_distributed():
    cfg = load_config(None, ["dist.use_megatron_fsdp=true", "ddp.use_megatron_fsdp=true",
                             "ddp.data_parallel_sharding_strategy=optim_grads_params",
                             "ddp.average_in_collective=false"])
    d = cfg.distributed
    assert d.strategy == "megatron_fsdp" and d.sharding_strategy == "optim_grads_params"
    assert d.average_in_collective is False
    assert "mutually exclusive" in problems(["dist.use_megatron_fsdp=true", "dist.use_torch_fsdp2=true"])[0]
    assert "use_tp_pp_dp_mapping is not supported with Megatron FSDP" in problems(
        ["dist.use_megatron_fsdp=true", "dist.use_tp_pp_dp_mapping=true"])[0]


def test_python_api_edits_validate_on_assignment_and_at_validate():
    cfg = meshforge.recipes.llama3_8b_pretrain_config()
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="strategy"):
        cfg.distributed.strategy = "zero3"
    cfg.dist.use_megatron_fsdp = True
    cfg.ddp.use_megatron_fsdp = True
    cfg.ddp.data_parallel_sharding_strategy = "optim_grads_params"
    cfg.ddp.average_in_collective = False
    cfg.checkpoint.ckpt_format = "fsdp_dtensor"
    cfg.checkpoint.save = "/tmp/fsdp_ckpts"
    cfg.checkpoint.load = None
    cfg = cfg.validate()
    assert cfg.distributed.strategy == "megatron_fsdp" and cfg.checkpoint.dir == "/tmp/fsdp_ckpts"
    assert cfg.checkpoint.resume is None
    cfg.checkpoint.ckpt_format = "torch_dist"
    with pytest.raises(ConfigError, match="fsdp_dtensor"):
        cfg.validate()
    # a strategy's own keys by attribute, after choosing it; a key of the old strategy blocks a switch
    cfg = meshforge.recipes.tiny_cpu_config()
    cfg.distributed.strategy = "megatron_fsdp"
    cfg.distributed.data_parallel_sharding_strategy = "optim"
    assert cfg.validate().distributed.sharding_strategy == "optim"
    with pytest.raises(ValueError, match="data_parallel_sharding_strategy belongs to strategy megatron_fsdp, not "
                                         "to strategy 'ddp'"):
        cfg.distributed.strategy = "ddp"
    assert cfg.distributed.strategy == "megatron_fsdp"
    for fn in ("tiny_cpu_config", "llama3_2_1b_pretrain_config", "llama3_70b_pretrain_config"):
        assert getattr(meshforge.recipes, fn)().model.preset


def test_yaml_cannot_execute_code(tmp_path):
    p = tmp_path / "evil.yaml"
    p.write_text("run: !!python/object/apply:os.system ['echo pwned']\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(p)


def test_validate_command_exit_codes(tmp_path, capsys):
    p = tmp_path / "c.yaml"
    p.write_text(yaml.safe_dump({"training": {"max_steps": 3}}))
    assert main(["validate", str(p), "training.seq_len=64", "--world-size", "4"]) == 0
    out = capsys.readouterr().out
    assert "seq_len: 64" in out and "rank layout, world size 4" in out
    assert main(["validate", str(p), "training.max_stepz=3", "optimizer.lr=-1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all(e.startswith("error: ") for e in err) and "Traceback" not in "".join(err)
    assert main(["validate", str(tmp_path / "missing.yaml")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_all_examples_validate():
    import glob

    files = sorted(glob.glob("examples/*.yaml"))
    assert "examples/tiny_cpu.yaml" in files
    load_config("examples/tiny_cpu.yaml", world_size=1)
    for f in files:  # each example is valid for the world size it is written for (some power of two)
        errors = {}
        for world in (2**k for k in range(15)):  # up to 16,384 (Llama 3 405B's published size)
            try:
                load_config(f, world_size=world)
                break
            except ConfigError as err:
                errors[world] = err.problems
        else:
            raise AssertionError(f"{f} is valid at no world size: {errors}")


@pytest.mark.parametrize("overrides", [
    [], ["data.source=synthetic"], ["data.source=tokenized", "data.path=x.npy"], ["distributed.strategy=megatron_fsdp"],
    ["distributed.strategy=ddp", "peft.rank=4"], ["scheduler.name=wsd", "scheduler.decay_steps=10"],
    ["logging.loggers=[jsonl,tensorboard]", "profiling.enabled=true"], ["training.fp8.enabled=true"],
    ["model.preset=tiny_moe"], ["model.preset=qwen3_0_6b"]], ids=lambda o: " ".join(o) or "defaults")
def test_a_dumped_config_loads_back_identically(overrides, tmp_path):
    """The run's config.yaml (every key spelled out, defaults too) must load back to the same config."""
    from meshforge.config.loader import dump_yaml

    cfg = load_config(None, overrides, world_size=1)
    (tmp_path / "c.yaml").write_text(dump_yaml(cfg))
    assert load_config(str(tmp_path / "c.yaml"), [], world_size=1).model_dump() == cfg.model_dump()
