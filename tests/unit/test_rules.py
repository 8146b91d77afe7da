"""Every parallelism rule: one invalid config each through `meshforge validate` (exit 2 + message),
warnings for no-op blocks, the layout, and a property test over random sizes and options."""

import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from meshforge.cli import main
from meshforge.config import ConfigError, load_config
from meshforge.config.rules import check, layout_of, resolved_ckpt_format
from meshforge.distributed.env import choose_cuda_device_max_connections
from meshforge.planning.layout import Layout, MeshAxis

CASES = [
    # rule 1: inference of dp_size
    (["distributed.tp_size=3"], 8, "tp_size*pp_size*cp_size = 3*1*1 = 3 does not divide the world size 8"),
    (["distributed.dp_size=2", "distributed.tp_size=2"], 8, "dp_size=2 disagrees with world_size/(tp_size*pp_size*cp_size) = 8/2 = 4"),
    # rule 2: HSDP
    (["distributed.dp_replicate_size=3"], 8, "dp_replicate_size=3 must divide dp_size=8"),
    (["distributed.dp_replicate_size=4"], 4, "must divide dp_size=4 and be smaller than it"),
    (["distributed.strategy=ddp", "distributed.dp_replicate_size=2"], 4, "distributed.dp_replicate_size=2 is not supported by strategy ddp"),
    # rule 3: EP
    (["model.preset=tiny_moe", "distributed.ep_size=3"], 4, "ep_size=3 must divide dp_size*cp_size = 4*1 = 4"),
    (["distributed.ep_size=2"], 4, "needs a mixture-of-experts model"),
    # rule 4: megatron_fsdp limits (each strategy declares what it composes with)
    (["distributed.strategy=megatron_fsdp", "distributed.pp_size=2"], 4, "pp_size=2 is not supported by strategy megatron_fsdp"),
    (["distributed.strategy=megatron_fsdp", "distributed.ep_size=2", "model.preset=tiny_moe"], 4, "ep_size=2 is not supported by strategy megatron_fsdp"),
    (["distributed.strategy=megatron_fsdp", "distributed.sequence_parallel=true", "distributed.tp_size=2"], 4, "sequence_parallel=true is not supported by strategy megatron_fsdp"),
    (["distributed.strategy=megatron_fsdp", "distributed.dp_replicate_size=2"], 4, "distributed.dp_replicate_size=2 is not supported by strategy megatron_fsdp"),
    # rule 5: ddp limits (the same rule)
    (["distributed.strategy=ddp", "distributed.tp_size=2"], 4, "distributed.tp_size=2 is not supported by strategy ddp"),
    (["distributed.strategy=ddp", "distributed.cp_size=2"], 4, "distributed.cp_size=2 is not supported by strategy ddp (torch DistributedDataParallel: full replicas, gradients all-reduced): use strategy fsdp2 or megatron_fsdp"),
    # rule 6
    (["distributed.sequence_parallel=true"], 2, "sequence_parallel=true requires tp_size > 1"),
    # rule 8
    (["distributed.offload_policy=true", "distributed.activation_checkpointing=full"], 2, "offload_policy=true is not supported with activation_checkpointing=full"),
    # (offload with pp runs: tests/parallel/test_pipeline_parity.py; with nothing to shard it would do nothing)
    (["distributed.offload_policy=true", "distributed.pp_size=2", "model.n_layers=4"], 2, "offload_policy=true offloads fsdp2's shards, but dp_size*cp_size=1 shards nothing"),
    # rule 9
    (["distributed.strategy=megatron_fsdp", "checkpoint.ckpt_format=torch_dist"], 2, "set checkpoint.ckpt_format=fsdp_dtensor"),
    # rule 10 (Bridge spellings)
    (["dist.use_megatron_fsdp=true", "dist.use_torch_fsdp2=true"], 2, "mutually exclusive"),
    (["dist.use_megatron_fsdp=true", "dist.use_tp_pp_dp_mapping=true"], 2, "use_tp_pp_dp_mapping is not supported with Megatron FSDP"),
    # rule 12: sizes and batch arithmetic
    (["training.global_batch_size=6", "training.micro_batch_size=2"], 2, "global_batch_size=6 must be divisible by micro_batch_size*dp_size = 2*2 = 4"),
    (["distributed.cp_size=2", "training.seq_len=34"], 2, "seq_len=34 must be divisible by 2*cp_size = 4"),
    (["distributed.tp_size=2", "distributed.sequence_parallel=true", "training.seq_len=33"], 2, "seq_len=33 must be divisible by tp_size=2"),
    (["distributed.tp_size=0"], 2, "distributed.tp_size: Input should be greater than 0"),
    (["distributed.tp_size=8", "model.n_heads=4"], 8, "n_heads=4 is not divisible by distributed.tp_size=8"),
]


@pytest.mark.parametrize("overrides, world, message", CASES, ids=[c[2][:40] for c in CASES])
def test_each_rule_rejects_with_exit_2_and_names_the_fix(overrides, world, message, capsys):
    rc = main(["validate", "examples/tiny_cpu.yaml", *overrides, "--world-size", str(world)])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert message in err, err
    assert "Traceback" not in err


def test_all_violations_reported_at_once(capsys):
    rc = main(["validate", "examples/tiny_cpu.yaml", "distributed.strategy=ddp", "distributed.tp_size=2",
               "distributed.sequence_parallel=false", "training.global_batch_size=7", "--world-size", "4"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 2


def test_noop_blocks_warn(capsys):
    assert main(["validate", "examples/tiny_cpu.yaml", "distributed.pipeline.pp_schedule=gpipe",
                 "distributed.moe.reshard_after_forward=true"]) == 0
    err = capsys.readouterr().err
    assert "distributed.pipeline is ignored because pp_size=1" in err
    assert "distributed.moe is ignored because ep_size=1" in err


def test_pp_without_pipeline_block_uses_defaults():
    cfg = load_config(None, ["distributed.pp_size=2", "model.n_layers=4"], world_size=2)
    assert cfg.distributed.pipeline is None and cfg.distributed.pipeline_or_default.pp_schedule == "1f1b"


def test_checkpoint_format_is_chosen_per_strategy():
    assert resolved_ckpt_format(load_config(None, ["distributed.strategy=megatron_fsdp"])) == "fsdp_dtensor"
    assert resolved_ckpt_format(load_config(None, ["distributed.strategy=ddp"])) == "torch_dist"
    assert resolved_ckpt_format(load_config(None, [])) == "fsdp_dtensor"


def test_cuda_device_max_connections(monkeypatch):
    # setenv first so that the undo removes the value choose_cuda_device_max_connections sets below (delenv of an
    # unset variable records nothing: the "1" leaked into later tests' subprocesses)
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "")
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS")
    tp_only = load_config(None, ["distributed.tp_size=2"], world_size=2).distributed
    assert choose_cuda_device_max_connections(tp_only, 2, cuda=False) is None
    assert "set for TP/CP without FSDP" in choose_cuda_device_max_connections(tp_only, 2, cuda=True)
    assert os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"
    fsdp = load_config(None, [], world_size=2).distributed
    assert "unset" not in choose_cuda_device_max_connections(fsdp, 2, cuda=True)  # user/launcher value is reported
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    import meshforge.config.rules as rules

    monkeypatch.setattr(rules, "_cuda_available", lambda: True)
    msgs = check(load_config(None, ["training.device=auto"]), 2)
    assert any("CUDA_DEVICE_MAX_CONNECTIONS=1 serialises" in m for m in msgs)


def test_layout_tp_contiguous_and_groups():
    L = Layout.from_sizes(16, tp=2, pp=2, cp=2)
    assert L.shape == (2, 1, 2, 2, 2) and L.dp == 2
    assert L.groups("tp")[0] == [0, 1] and all(g[1] - g[0] == 1 for g in L.groups("tp"))
    assert L.groups("pp")[0] == [0, 8]
    assert sorted(r for g in L.groups("dp_cp") for r in g) == list(range(16))
    for r in range(16):
        c = L.coords(r)
        assert L.rank_of(c) == r
    with pytest.raises(KeyError, match="unknown mesh axis 'xp'"):
        L.size("xp")
    assert MeshAxis.parse("dp_shard_cp") is MeshAxis.DP_SHARD_CP


def test_validate_prints_layout_table(capsys):
    assert main(["validate", "examples/tiny_cpu.yaml", "distributed.tp_size=2", "distributed.dp_replicate_size=2",
                 "training.micro_batch_size=2", "--world-size", "8"]) == 0
    out = capsys.readouterr().out
    assert "dp_replicate" in out and "[0,1] [2,3]" in out


sizes = st.sampled_from([1, 2, 3, 4, 8])


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(world=st.integers(1, 64), tp=sizes, pp=sizes, cp=sizes, ep=sizes, rep=st.sampled_from([None, 1, 2, 4]),
       dp=st.sampled_from([None, 1, 2, 4, 8]), strategy=st.sampled_from(["fsdp2", "ddp", "megatron_fsdp"]),
       sp=st.booleans(), moe=st.booleans(), gbs=st.integers(1, 64), mbs=st.integers(1, 8),
       seq=st.sampled_from([16, 32, 48, 100, 128]), ac=st.sampled_from([False, True, "selective"]),
       offload=st.sampled_from([None, True]))
def test_validator_never_crashes_and_accepted_layouts_multiply_out(world, tp, pp, cp, ep, rep, dp, strategy, sp, moe,
                                                                   gbs, mbs, seq, ac, offload):
    ov = [f"distributed.strategy={strategy}", f"distributed.tp_size={tp}", f"distributed.pp_size={pp}",
          f"distributed.cp_size={cp}", f"distributed.ep_size={ep}", f"distributed.sequence_parallel={sp}",
          f"training.global_batch_size={gbs}", f"training.micro_batch_size={mbs}", f"training.seq_len={seq}",
          f"distributed.activation_checkpointing={ac}", f"model.preset={'tiny_moe' if moe else 'tiny'}",
          "model.n_layers=8", "model.n_heads=8", "model.n_kv_heads=8"]
    if dp is not None:
        ov.append(f"distributed.dp_size={dp}")
    if rep is not None:
        ov.append(f"distributed.dp_replicate_size={rep}")
    if offload is not None:
        ov.append(f"distributed.offload_policy={offload}")
    try:
        cfg = load_config(None, ov, world_size=world)
    except ConfigError as err:
        assert err.problems and all(isinstance(p, str) and p for p in err.problems)
        return
    L = layout_of(cfg, world)
    assert L.pp * L.dp_replicate * L.dp_shard * L.cp * L.tp == world
    assert L.dp * L.tp * L.pp * L.cp == world
    assert (L.dp * L.cp) % L.ep == 0
