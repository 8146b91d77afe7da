"""Multi-node plumbing without processes: SLURM variables -> torch's (a simulated 2-node allocation), the
torchrun arguments of `meshforge train --nnodes ...` read back by torch's own launcher parser, one-line
flag errors, and `meshforge validate --gpus-per-node` naming the axes whose groups cross nodes."""

from __future__ import annotations

import os

import pytest

from meshforge.cli import main
from meshforge.distributed.env import PORT_SPAN, STEPS_PER_JOB, expand_nodelist, in_srun_task, slurm_env, \
    slurm_master_port
from meshforge.launch import Nodes, torchrun_args

# what srun exports to task 5 of `sbatch --nodes=2 --ntasks-per-node=4` on nodes gpu-07 and gpu-08
SLURM_2x4 = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "SLURM_NODEID": "1",
             "SLURM_NNODES": "2", "SLURM_JOB_NODELIST": "gpu-[07-08]", "SLURM_STEP_NODELIST": "gpu-[07-08]",
             "SLURM_TASKS_PER_NODE": "4(x2)", "SLURM_STEP_TASKS_PER_NODE": "4(x2)", "SLURM_JOB_ID": "123456",
             "SLURM_STEP_ID": "0"}


def test_slurm_two_nodes():
    env = slurm_env(SLURM_2x4)
    assert env == {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "1",
                   "GROUP_WORLD_SIZE": "2", "MASTER_ADDR": "gpu-07", "MASTER_PORT": "26850"}
    # every task of the job derives the same address and port
    task0 = slurm_env({**SLURM_2x4, "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0"})
    assert (task0["RANK"], task0["GROUP_RANK"]) == ("0", "0")
    assert (task0["MASTER_ADDR"], task0["MASTER_PORT"]) == (env["MASTER_ADDR"], env["MASTER_PORT"])


def test_slurm_uneven_nodes_step_list_and_user_values():
    env = slurm_env({"SLURM_PROCID": "9", "SLURM_STEP_ID": "3", "SLURM_NTASKS": "10", "SLURM_LOCALID": "1", "SLURM_NODEID": "2",
                     "SLURM_NNODES": "3", "SLURM_JOB_NODELIST": "login1,n[001-004]", "SLURM_STEP_NODELIST":
                     "n[002-003],n007", "SLURM_STEP_TASKS_PER_NODE": "4(x2),2", "MASTER_PORT": "12345"})
    assert env["LOCAL_WORLD_SIZE"] == "2" and env["GROUP_RANK"] == "2"
    assert env["MASTER_ADDR"] == "n002"  # the step's first node, not the job's
    assert "MASTER_PORT" not in env  # a value the user exported wins
    assert slurm_env({"RANK": "0", **SLURM_2x4}) == {}  # torchrun inside srun: torch's variables are set
    assert slurm_env({"SLURM_JOB_ID": "7"}) == {}  # in an allocation but not an srun task


# what an sbatch script of that job sees (`sbatch --nodes=2 --ntasks-per-node=4 job.sh`): SLURM_PROCID=0 and the
# job's task count, but it is no srun task (no step id, or the batch step's 0xfffffffe)
SBATCH_2x4 = {k: v for k, v in {**SLURM_2x4, "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0"}.items()
              if not k.startswith("SLURM_STEP_")}


@pytest.mark.parametrize("step", [None, "4294967294", "4294967291", "batch"])
def test_an_sbatch_script_is_not_an_srun_task(step):
    env = SBATCH_2x4 if step is None else {**SBATCH_2x4, "SLURM_STEP_ID": step}
    assert not in_srun_task(env) and slurm_env(env) == {}
    assert in_srun_task({**SBATCH_2x4, "SLURM_STEPID": "0"})  # older SLURM spells it SLURM_STEPID


def test_nproc_per_node_in_an_sbatch_script_launches_as_asked(monkeypatch, tmp_path):
    """`meshforge train --nproc-per-node 2` in an sbatch script starts 2 processes; it was taken for task 0 of an
    8-task srun step (RANK 0 of 8), which then waited for 7 ranks that never came."""
    from meshforge import launch

    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    for k, v in SBATCH_2x4.items():
        monkeypatch.setenv(k, v)
    calls = []
    monkeypatch.setattr(launch, "run_cli", lambda nproc, argv, nodes=None, **kw: calls.append((nproc, nodes)) or 0)
    assert main(["train", "examples/tiny_cpu.yaml", f"run.output_dir={tmp_path}", "--nproc-per-node", "2"]) == 0
    assert calls == [(2, None)] and "RANK" not in os.environ


@pytest.mark.parametrize("env, follows", [(SBATCH_2x4, False), ({**SBATCH_2x4, "SLURM_NTASKS": "1", "SLURM_STEP_ID": "0"}, True)])
def test_every_srun_task_follows_its_step_daemon(monkeypatch, tmp_path, env, follows):
    """A one-task srun step's process (here meshforge's launcher for its node) stops with srun's step daemon, as a
    rank of a many-task step does (tests/functional/test_lifeline.py kills one); an sbatch script follows nobody."""
    from meshforge import launch

    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", *SLURM_2x4):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    calls = []
    monkeypatch.setattr(launch, "stop_with_launcher", lambda: calls.append("follows"))
    monkeypatch.setattr(launch, "run_cli", lambda nproc, argv, nodes=None, **kw: calls.append(nproc) or 0)
    assert main(["train", "examples/tiny_cpu.yaml", f"run.output_dir={tmp_path}", "--nproc-per-node", "2"]) == 0
    assert calls == (["follows", 2] if follows else [2])


def test_master_port_differs_across_steps_and_jobs():
    """Concurrent steps of one job and jobs sharing a first node derive different ports: steps 0..63 of 312 jobs
    in a row (19,968 pairs), and one step number of every job id in a span of 20,011, never collide."""
    def port(job: int, step: int) -> int:
        return slurm_master_port({"SLURM_JOB_ID": str(job), "SLURM_STEP_ID": str(step)})

    window = PORT_SPAN // STEPS_PER_JOB
    ports = {port(987_000 + j, s) for j in range(window) for s in range(STEPS_PER_JOB)}
    assert len(ports) == window * STEPS_PER_JOB and min(ports) >= 10000 and max(ports) < 32768
    for step in (0, 5):
        assert len({port(5_000_000 + j, step) for j in range(PORT_SPAN)}) == PORT_SPAN
    assert port(7, 1) != port(7, 0) and port(8, 0) != port(7, 0)
    assert slurm_master_port({"SLURM_JOB_ID": "7", "SLURM_STEP_RESV_PORTS": "12000-12003"}) == 12000  # srun's own
    env = slurm_env({**SLURM_2x4, "SLURM_STEP_ID": "1"})  # the same job's next step (the 1st env: step 0)
    assert env["MASTER_PORT"] != slurm_env(SLURM_2x4)["MASTER_PORT"]


def test_rendezvous_timeout_reaches_torch_and_is_validated(capsys):
    cfg, _, _ = _torchrun_config(torchrun_args(1, ["x.py"], Nodes(2, "h0:29400", None, "j", timeout_s=42)))
    assert cfg.rdzv_configs["join_timeout"] == "42"
    cfg, _, _ = _torchrun_config(torchrun_args(1, ["x.py"], Nodes(2, "h0:29400", 0, timeout_s=42)))
    assert cfg.rdzv_configs["timeout"] == "42"
    rc = main(["train", "examples/tiny_cpu.yaml", "distributed.rendezvous_timeout_s=0",
               "distributed.timeout_minutes=-1", "--nnodes", "2", "--rdzv-endpoint", "127.0.0.1:1",
               "--nproc-per-node", "1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 2, err
    assert any("rendezvous_timeout_s" in line for line in err) and any("timeout_minutes" in line for line in err)


def test_expand_nodelist():
    assert expand_nodelist("gpu-[07-09,12],login1") == ["gpu-07", "gpu-08", "gpu-09", "gpu-12", "login1"]
    assert expand_nodelist("r[1-2]n[08-09]") == ["r1n08", "r1n09", "r2n08", "r2n09"]
    assert expand_nodelist("node1") == ["node1"]


def _torchrun_config(args: list[str]):
    from torch.distributed.run import config_from_args, get_args_parser

    return config_from_args(get_args_parser().parse_args(args))


def test_torchrun_arguments_as_torch_reads_them():
    static = _torchrun_config(torchrun_args(4, ["-m", "meshforge", "train", "c.yaml"], Nodes(2, "h0:29400", 1)))
    cfg, _, argv = static
    assert (cfg.min_nodes, cfg.max_nodes, cfg.nproc_per_node) == (2, 2, 4)
    assert (cfg.rdzv_backend, cfg.rdzv_endpoint, cfg.rdzv_configs["rank"]) == ("static", "h0:29400", 1)
    assert cfg.max_restarts == 0 and argv[-3:] == ["meshforge", "train", "c.yaml"]
    cfg, _, _ = _torchrun_config(torchrun_args(8, ["x.py"], Nodes(3, "h0:29400", None, "job7")))
    assert (cfg.min_nodes, cfg.max_nodes, cfg.rdzv_backend, cfg.run_id) == (3, 3, "c10d", "job7")
    assert "rank" not in cfg.rdzv_configs  # c10d assigns node ranks
    cfg, _, _ = _torchrun_config(torchrun_args(2, ["x.py"]))
    assert (cfg.min_nodes, cfg.max_nodes, cfg.nproc_per_node) == (1, 1, 2)


@pytest.mark.parametrize("flags, msg", [
    (["--nnodes", "2", "--node-rank", "0", "--nproc-per-node", "2"], "needs --rdzv-endpoint HOST:PORT"),
    (["--nnodes", "2", "--rdzv-endpoint", "h:1"], "needs --nproc-per-node"),
    (["--node-rank", "1"], "--node-rank needs --nnodes"),
    (["--nnodes", "2", "--node-rank", "2", "--rdzv-endpoint", "h:1", "--nproc-per-node", "1"], "[0, 1]"),
    (["--nnodes", "2", "--rdzv-endpoint", "h", "--nproc-per-node", "1"], "is not HOST:PORT"),
    (["--nnodes", "2", "--node-rank", "0", "--rdzv-id", "j", "--rdzv-endpoint", "h:1", "--nproc-per-node", "1"],
     "--rdzv-id is for the c10d rendezvous"),
])
def test_node_flags_are_one_line(capsys, flags, msg):
    assert main(["train", "examples/tiny_cpu.yaml", *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and msg in err[0], err


def test_node_world_size_validates_the_config(capsys):
    # 2 nodes x 3 processes = 6: the config is checked at world size 6 before anything starts
    rc = main(["train", "examples/tiny_cpu.yaml", "training.global_batch_size=16", "training.micro_batch_size=1",
               "--nnodes", "2", "--node-rank", "0", "--rdzv-endpoint", "127.0.0.1:1", "--nproc-per-node", "3"])
    assert rc == 2 and "micro_batch_size*dp_size = 1*6" in capsys.readouterr().err


VALID = ["examples/tiny_cpu.yaml", "model.n_kv_heads=4", "training.micro_batch_size=1",
         "training.global_batch_size=24"]


@pytest.mark.parametrize("overrides, world, gpn, crossing", [
    (["distributed.tp_size=4"], 12, 6, ["TP groups span 2 nodes"]),  # tp 4 < 6 per node, yet [4..7] straddles
    (["distributed.tp_size=2"], 12, 6, []),
    (["distributed.cp_size=4", "training.seq_len=64"], 16, 2, ["CP groups span 2 nodes"]),
    (["distributed.tp_size=2", "distributed.cp_size=2", "training.seq_len=64"], 16, 2, ["CP groups span 2 nodes"]),
    (["distributed.tp_size=4"], 16, 8, []),
])
def test_validate_shows_axes_crossing_nodes(capsys, overrides, world, gpn, crossing):
    assert main(["validate", *VALID, *overrides, "--world-size", str(world), "--gpus-per-node", str(gpn)]) == 0
    out, err = capsys.readouterr()
    assert "nodes per group" in out and f"{world // gpn} nodes of {gpn}" in out
    notes = [line for line in err.splitlines() if "span" in line and "nodes" in line]
    assert len(notes) == len(crossing) and all(c in n for c, n in zip(crossing, notes)), err


def test_validate_gpus_per_node_must_divide_world(capsys):
    assert main(["validate", *VALID, "--world-size", "12", "--gpus-per-node", "5"]) == 2
    assert "must be positive and divide the world size 12" in capsys.readouterr().err


def test_srun_task_1_does_no_rank0_work(tmp_path, monkeypatch, capsys):
    """Started by srun directly, task 1 must know it is rank 1 before the CLI's rank-0 work (config.yaml,
    the closing line): RANK comes from SLURM before anything reads it."""
    from types import SimpleNamespace

    from meshforge import cli
    from meshforge.config import load_config
    from meshforge.training import trainer

    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
              "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.setenv(k, "")  # recorded, so the variables the CLI derives are removed after the test
        monkeypatch.delenv(k)
    for k, v in {**SLURM_2x4, "SLURM_PROCID": "1"}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(trainer, "train", lambda cfg: SimpleNamespace(losses=[1.0], start_step=0, final_step=1, signal=None))
    cfg = load_config(None, [f"run.output_dir={tmp_path}", "training.global_batch_size=16"], world_size=8)
    assert cli.run_training(cfg) == 0
    assert not (tmp_path / "config.yaml").exists() and "done:" not in capsys.readouterr().out
    assert os.environ["RANK"] == "1" and os.environ["MASTER_ADDR"] == "gpu-07"
