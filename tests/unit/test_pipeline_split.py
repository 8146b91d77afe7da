"""The pipeline split without processes: stages, layers per stage, stage -> rank maps, microbatch rules,
the stage modules' parameter names, and the one-line errors (exit 2) for splits that cannot work."""

from __future__ import annotations

import pytest
import torch

from meshforge.cli import main
from meshforge.config import load_config
from meshforge.config.schema import PipelineConfig
from meshforge.distributed.pipeline import TORCH_SCHEDULE_CLASS, prune_to_stage, schedule_class
from meshforge.models import build_model, init_weights
from meshforge.planning.pipeline_plan import PipelinePlanError, plan_pipeline


def pcfg(**kw) -> PipelineConfig:
    return PipelineConfig(**kw)


def test_even_and_uneven_splits():
    p = plan_pipeline(8, 4, pcfg(), local_batch=8)
    assert p.stage_layers == ((0, 1), (2, 3), (4, 5), (6, 7)) and p.n_microbatches == 8
    assert [p.stage_rank(s) for s in range(4)] == [0, 1, 2, 3] and p.last_stage_rank == 3
    p = plan_pipeline(7, 2, pcfg(), local_batch=4)  # extra block to the earlier stage
    assert p.stage_layers == ((0, 1, 2, 3), (4, 5, 6))


def test_interleaved_defaults_to_two_stages_per_rank_loop_style():
    p = plan_pipeline(8, 2, pcfg(pp_schedule="interleaved1f1b"), local_batch=8)
    assert p.stages_per_rank == 2 and p.num_stages == 4
    assert p.rank_stages(0) == [0, 2] and p.rank_stages(1) == [1, 3] and p.last_stage_rank == 1


def test_v_schedule_places_stages_in_a_v():
    p = plan_pipeline(8, 4, pcfg(pp_schedule="v_schedule"), local_batch=8)
    assert [p.stage_rank(s) for s in range(8)] == [0, 1, 2, 3, 3, 2, 1, 0]
    assert p.rank_stages(0) == [0, 7] and p.last_stage_rank == 0


def test_layers_per_stage_sets_the_number_of_stages():
    p = plan_pipeline(12, 2, pcfg(pp_schedule="looped_bfs", layers_per_stage=2), local_batch=4)
    assert p.stages_per_rank == 3 and all(len(s) == 2 for s in p.stage_layers)
    p = plan_pipeline(8, 2, pcfg(pp_schedule="interleaved_1f1b", virtual_stages_per_rank=4), local_batch=8)
    assert p.num_stages == 8 and p.stage_layers[-1] == (7,)


def test_uneven_ends_llama3_405b_layout():
    """first/last_stage_layers=0: an embedding-only first stage and a head-only last stage; with layers_per_stage=1
    Llama 3 405B's 126 blocks + 2 ends make 128 stages, 8 per rank at pp 16."""
    p = plan_pipeline(126, 16, pcfg(pp_schedule="interleaved_1f1b", layers_per_stage=1, first_stage_layers=0,
                                    last_stage_layers=0), local_batch=16)
    assert p.num_stages == 128 and p.stages_per_rank == 8
    assert p.stage_layers[0] == () and p.stage_layers[-1] == () and p.stage_layers[1] == (0,)
    assert all(len(s) == 1 for s in p.stage_layers[1:-1]) and p.stage_layers[-2] == (125,)
    p = plan_pipeline(4, 2, pcfg(first_stage_layers=0), local_batch=4)  # one end explicit, the rest shared
    assert p.stage_layers == ((), (0, 1, 2, 3))
    p = plan_pipeline(5, 2, pcfg(pp_schedule="interleaved_1f1b", first_stage_layers=0, last_stage_layers=1),
                      local_batch=4)
    assert p.stage_layers == ((), (0, 1), (2, 3), (4,))
    p = plan_pipeline(4, 2, pcfg(first_stage_layers=1, last_stage_layers=3), local_batch=4)
    assert p.stage_layers == ((0,), (1, 2, 3))


def test_dualpipev_is_a_v_with_twice_pp_microbatches():
    p = plan_pipeline(8, 2, pcfg(pp_schedule="dual-pipe-v"), local_batch=4)
    assert p.schedule == "dualpipev" and p.rank_stages(0) == [0, 3] and p.last_stage_rank == 0


@pytest.mark.parametrize("n_layers,pp,kw,local,needle", [
    (4, 2, {"first_stage_layers": 3, "last_stage_layers": 2}, 4,
     "first_stage_layers=3 + distributed.pipeline.last_stage_layers=2 = 5 blocks, more than model.n_layers=4"),
    (4, 2, {"first_stage_layers": 1, "last_stage_layers": 1}, 4, "no other stage is left for the other 2"),
    (4, 2, {"pp_schedule": "interleaved_1f1b", "virtual_stages_per_rank": 3, "first_stage_layers": 0}, 8,
     "the 5 stages between the ends need at least one block each, but model.n_layers=4"),
    (6, 2, {"pp_schedule": "interleaved_1f1b", "layers_per_stage": 2, "first_stage_layers": 1}, 8,
     "model.n_layers=6 minus the 1 blocks of first/last_stage_layers (5) is not divisible"),
    (4, 2, {"pp_schedule": "interleaved_1f1b", "layers_per_stage": 2, "first_stage_layers": 0}, 8,
     "gives 4/2 + 1 explicit end stage(s) = 3 stages, not a multiple of distributed.pp_size=2"),
    (8, 2, {"pp_schedule": "dualpipev"}, 3, "pp_schedule=dualpipev needs at least 2 x pp_size=4 microbatches"),
])
def test_bad_uneven_splits_name_the_keys(n_layers, pp, kw, local, needle):
    with pytest.raises(PipelinePlanError) as err:
        plan_pipeline(n_layers, pp, pcfg(**kw), local_batch=local)
    assert needle in str(err.value), str(err.value)


@pytest.mark.parametrize("n_layers,pp,kw,local,needle", [
    (7, 2, {"layers_per_stage": 2}, 8, "model.n_layers=7 is not divisible by distributed.pipeline.layers_per_stage=2"),
    (6, 4, {"layers_per_stage": 2}, 8, "layers_per_stage=2 gives 6/2 = 3 stages, not a multiple of distributed.pp_size=4"),
    (8, 2, {"pp_schedule": "interleaved_1f1b", "layers_per_stage": 2, "virtual_stages_per_rank": 3}, 8,
     "gives 2 stages per rank (8 blocks / 2 / pp_size 2) but distributed.pipeline.virtual_stages_per_rank=3"),
    (8, 2, {"virtual_stages_per_rank": 2}, 8, "pp_schedule=1f1b runs one stage per rank, but the split asks for 2"),
    (8, 2, {"pp_schedule": "v_schedule", "virtual_stages_per_rank": 3}, 8, "needs exactly 2 stages per rank"),
    (2, 2, {"pp_schedule": "interleaved_1f1b"}, 8, "model.n_layers=2 is fewer than the 4 pipeline stages"),
    (4, 4, {"pp_microbatch_size": 3}, 8,
     "global_batch_size/dp_size = 8 must be divisible by distributed.pipeline.pp_microbatch_size=3"),
    (4, 4, {"pp_microbatch_size": 4}, 8, "pp_schedule=1f1b needs at least pp_size=4 microbatches per step"),
    (8, 2, {"pp_schedule": "zero_bubble"}, 5, "to be a multiple of its rounds max(1, 5//pp_size 2) = 2"),
])
def test_bad_splits_name_the_numbers(n_layers, pp, kw, local, needle):
    with pytest.raises(PipelinePlanError) as err:
        plan_pipeline(n_layers, pp, pcfg(**kw), local_batch=local)
    assert needle in str(err.value), str(err.value)


@pytest.mark.parametrize("overrides, world, needle", [
    (["distributed.pp_size=2", "distributed.pipeline.pp_schedule=interleaved_1f1b"], 2,
     "model.n_layers=2 is fewer than the 4 pipeline stages"),
    (["distributed.pp_size=2", "model.n_layers=4", "distributed.pipeline.layers_per_stage=3"], 2,
     "model.n_layers=4 is not divisible by distributed.pipeline.layers_per_stage=3"),
    (["distributed.pp_size=4", "model.n_layers=4", "distributed.pipeline.pp_microbatch_size=4",
      "training.global_batch_size=8", "training.micro_batch_size=2"], 4, "needs at least pp_size=4 microbatches"),
    (["distributed.pp_size=2", "model.n_layers=4", "distributed.pipeline.first_stage_layers=3",
      "distributed.pipeline.last_stage_layers=2"], 2, "= 5 blocks, more than model.n_layers=4: lower them"),
    (["distributed.strategy=ddp", "distributed.pp_size=2", "model.n_layers=4"], 2, "distributed.pp_size=2 is not supported by strategy ddp"),
    (["distributed.pp_size=2", "distributed.cp_size=2", "model.n_layers=4", "data.source=dataset", "data.max_files=null",
      "data.paths=[examples/data/prompt_completion_tiny.jsonl]", "data.format=prompt_completion", "data.packing=true"],
     4, "data.packing=true with distributed.pp_size=2 and cp_size=2 is not supported yet"),
])
def test_rules_reject_before_launch_with_exit_2(overrides, world, needle, capsys):
    rc = main(["validate", "examples/tiny_cpu.yaml", *overrides, "--world-size", str(world)])
    err = capsys.readouterr().err
    assert rc == 2 and needle in err and "Traceback" not in err, err


def test_valid_pp_configs_pass_validation():
    for extra in (["distributed.pipeline.pp_schedule=v_schedule"], ["distributed.pipeline.pp_schedule=dfs"],
                  ["model.tie_embeddings=true"], ["model.preset=tiny_moe"],  # tied ends and MoE stages run
                  ["distributed.pipeline.pp_schedule=interleaved_1f1b", "distributed.pipeline.first_stage_layers=0",
                   "distributed.pipeline.last_stage_layers=0"],
                  ["distributed.pipeline.pp_schedule=interleaved1f1b", "distributed.pipeline.layers_per_stage=1"]):
        load_config(None, ["distributed.pp_size=2", "model.n_layers=4", *extra], world_size=2)
    assert main(["validate", "examples/llama3_70b_tp_pp.yaml", "--world-size", "64"]) == 0


def test_every_schedule_exists_in_installed_torch():
    import torch.distributed.pipelining.schedules as S

    for name, cls_name in TORCH_SCHEDULE_CLASS.items():
        assert schedule_class(name) is getattr(S, cls_name)


def test_missing_schedule_class_is_a_config_error_naming_torch(monkeypatch):
    import torch.distributed.pipelining.schedules as S

    from meshforge.config import ConfigError

    monkeypatch.delattr(S, "ScheduleZBVZeroBubble")
    with pytest.raises(ConfigError, match=rf"torch {torch.__version__.split('+')[0]}.*does not have"):
        schedule_class("v_schedule")


def test_stage_modules_keep_whole_model_names_and_init():
    cfg = load_config(None, ["model.n_layers=4"])
    full = build_model(cfg.model)
    init_weights(full, 7)
    full_sd = full.state_dict()
    plan = plan_pipeline(4, 2, pcfg(), local_batch=8)
    names = set()
    for s in range(plan.num_stages):
        m = build_model(cfg.model)
        prune_to_stage(m, plan.stage_layers[s], s == 0, s == plan.num_stages - 1)
        init_weights(m, 7)
        sd = m.state_dict()
        assert all(torch.equal(v, full_sd[k]) for k, v in sd.items())
        assert not names & set(sd)
        names |= set(sd)
    assert names == set(full_sd)
    # running the stages in sequence is the whole model
    tokens = torch.randint(0, 256, (2, 16))
    stages = []
    for s in range(plan.num_stages):
        m = build_model(cfg.model)
        prune_to_stage(m, plan.stage_layers[s], s == 0, s == plan.num_stages - 1)
        m.load_state_dict({k: full_sd[k] for k in m.state_dict()})
        stages.append(m)
    h = tokens
    for m in stages:
        h = m(h)
    torch.testing.assert_close(h, full(tokens), rtol=0, atol=0)


def test_defer_fsdp_grad_sync_false_warns_under_pp(capsys):
    assert main(["validate", "examples/tiny_cpu.yaml", "distributed.pp_size=2", "model.n_layers=4",
                 "distributed.defer_fsdp_grad_sync=false", "--world-size", "2"]) == 0
    assert "defer_fsdp_grad_sync=false has no effect with pp_size>1" in capsys.readouterr().err
